/* The backends: the vendor ones from a machine without their GPUs (they
 * fail cleanly, and no binary depends on a vendor runtime), and the host
 * backend's view of device memory through the kernel's (real memfds, real
 * /proc, real child processes). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu/gpudev.h"
#include "gpu/gpuva.h"
#include "harness.h"

#define MiB (1ull << 20)

/* Run a command; its exit status, and its output in out. */
static int run(const char *cmd, char *out, size_t len) {
  FILE *p = popen(cmd, "r");
  ck_assert_ptr_nonnull(p);
  size_t n = fread(out, 1, len - 1, p);
  out[n] = '\0';
  int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* With no AMD GPU, --backend hip says so and exits within seconds. */
START_TEST(hip_backend_without_a_device_fails_cleanly) {
  char cmd[600], out[4096], dir[] = "/tmp/gpumemd-hip-test.XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  snprintf(cmd, sizeof cmd, "timeout 10 %s --backend hip --socket %s/sock 2>&1; rc=$?; "
           "rm -rf %s; exit $rc", harness_bin("gpumemd"), dir, dir);
  double t0 = now_ms();
  int rc = run(cmd, out, sizeof out);
  if (strstr(out, "unknown backend") && getenv("GPUMEM_NO_HIP_OK")) return; /* no HIP headers */
  ck_assert_int_eq(rc, 1);
  ck_assert_double_lt(now_ms() - t0, 10000);
  ck_assert_msg(strstr(out, "no HIP") != NULL, "output: %s", out);
}
END_TEST

/* Without the CUDA driver, --backend cuda says so, and auto falls back. */
START_TEST(cuda_backend_without_a_driver_fails_cleanly) {
  char cmd[700], out[4096], dir[] = "/tmp/gpumemd-cuda-test.XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  snprintf(cmd, sizeof cmd, "ls /dev/nvidia0 >/dev/null 2>&1 || timeout 10 %s --backend cuda "
           "--socket %s/sock 2>&1; rc=$?; rm -rf %s; exit $rc", harness_bin("gpumemd"), dir, dir);
  int rc = run(cmd, out, sizeof out);
  if (strstr(out, "unknown backend")) return; /* built without cuda.h */
  if (rc == 0 && !out[0]) return;             /* a GPU machine: nothing to see */
  ck_assert_int_eq(rc, 1);
  ck_assert_msg(strstr(out, "CUDA") != NULL, "output: %s", out);
}
END_TEST

/* A node of one vendor needs nothing of the other: no vendor runtime in
 * any binary's dependencies. */
START_TEST(no_binary_links_a_vendor_runtime) {
  const char *files[] = {"gpumemd", "gpumemctl", "gpumem-worker", "../lib/libgpumem.so"};
  for (size_t i = 0; i < 4; i++) {
    char cmd[600], out[8192];
    snprintf(cmd, sizeof cmd, "ldd %s", harness_bin(files[i]));
    ck_assert_int_eq(run(cmd, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "libc.so") != NULL, "ldd said: %s", out);
    ck_assert_msg(!strstr(out, "amdhip") && !strstr(out, "libcuda") && !strstr(out, "nvidia"),
                  "%s depends on a vendor runtime: %s", files[i], out);
  }
}
END_TEST

/* A host backend of two devices of 16 MiB each, daemon side. */
static gpudev *host_open(void) {
  struct gpudev_options o = {.backend = "host", .host_devices = 2, .host_device_size = 16 * MiB};
  gpudev *g = NULL;
  char err[256];
  ck_assert_msg(gpudev_open(&o, &g, err, sizeof err) == 0, "%s", err);
  return g;
}

/* The host backend, client side. */
static gpuva *host_client_open(void) {
  gpuva *g = NULL;
  char err[256];
  ck_assert_msg(gpuva_open("host", &g, err, sizeof err) == 0, "%s", err);
  return g;
}

/* A memfd as another process makes "device memory": named like the host
 * backend's chunks, size bytes, committed when asked. */
static int outside_memfd(unsigned dev, uint64_t size, bool commit) {
  char name[48];
  snprintf(name, sizeof name, "gpumem-host-local:%u", dev);
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
  if (commit) ck_assert_int_eq(fallocate(fd, 0, 0, (off_t)size), 0);
  return fd;
}

/* A child process driven one step at a time: it waits for a byte from the
 * parent before each step and answers one after it. */
struct child {
  pid_t pid;
  int to, from;
};

/* Send one byte to the other side. */
static void say(int fd, char c) { ck_assert_int_eq(write(fd, &c, 1), 1); }

/* Wait for one byte from the other side; 0 at end of file. */
static char hear(int fd) {
  char c = 0;
  return read(fd, &c, 1) == 1 ? c : 0;
}

/* Fork a child running step(arg, n) for each byte n it hears until end of
 * file, answering each step with 'y' (or 'n' if it failed). */
static void child_start(struct child *c, bool (*step)(void *arg, char n), void *arg) {
  int down[2], up[2];
  ck_assert_int_eq(pipe2(down, O_CLOEXEC), 0);
  ck_assert_int_eq(pipe2(up, O_CLOEXEC), 0);
  c->pid = fork();
  ck_assert_int_ge(c->pid, 0);
  if (c->pid == 0) {
    close(down[1]);
    close(up[0]);
    for (char n; (n = hear(down[0]));)
      if (write(up[1], step(arg, n) ? "y" : "n", 1) != 1) _exit(1);
    _exit(0);
  }
  close(down[0]);
  close(up[1]);
  c->to = down[1];
  c->from = up[0];
}

/* Have the child take step n; true if it did. */
static bool child_step(struct child *c, char n) {
  say(c->to, n);
  return hear(c->from) == 'y';
}

/* Let the child finish and reap it. */
static void child_end(struct child *c) {
  close(c->to);
  int status;
  ck_assert_int_eq(waitpid(c->pid, &status, 0), c->pid);
  close(c->from);
  ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* The bytes process pid holds on dev by gpudev_processes, 0 if not listed. */
static uint64_t held_outside(gpudev *g, unsigned dev, int pid) {
  size_t n = 0;
  ck_assert_int_eq(gpudev_processes(g, dev, NULL, 0, &n), 0);
  n += 64; /* room for processes that start meanwhile */
  struct gpudev_process *list = calloc(n, sizeof *list);
  size_t got = 0;
  ck_assert_int_eq(gpudev_processes(g, dev, list, n, &got), 0);
  uint64_t used = 0;
  for (size_t i = 0; i < got && i < n; i++)
    if (list[i].pid == pid) used = list[i].used;
  free(list);
  return used;
}

/* On the host backend free memory is capacity less what chunks commit,
 * and there is no driver reserve. */
START_TEST(host_mem_detail_is_capacity_less_committed) {
  gpudev *g = host_open();
  uint64_t h;
  ck_assert_int_eq(gpudev_chunk_create(g, 1, 4 * MiB, &h), 0);
  struct gpudev_mem m;
  ck_assert_int_eq(gpudev_mem_detail(g, 1, &m), 0);
  ck_assert_uint_eq(m.total, 16 * MiB);
  ck_assert_uint_eq(m.free, 12 * MiB);
  ck_assert_uint_eq(m.reserved, 0);
  ck_assert_int_eq(gpudev_mem_detail(g, 0, &m), 0);
  ck_assert_uint_eq(m.free, 16 * MiB);
  ck_assert_int_eq(gpudev_mem_detail(g, 2, &m), -ENODEV);
  gpudev_chunk_release(g, 1, h, 4 * MiB);
  gpudev_close(g);
}
END_TEST

/* The memfds of the child in the residual test. */
struct outside {
  int dev0, dev1, chunk;
  void *m0, *m1, *mc;
};

/* Step 'm': map outside memory of both devices and a chunk the daemon
 * made, then close every fd (the mappings hold the memory). */
static bool outside_step(void *arg, char n) {
  struct outside *o = arg;
  if (n != 'm') return false;
  o->m0 = mmap(NULL, 6 * MiB, PROT_READ | PROT_WRITE, MAP_SHARED, o->dev0, 0);
  o->m1 = mmap(NULL, 2 * MiB, PROT_READ, MAP_SHARED, o->dev1, 0);
  o->mc = mmap(NULL, 4 * MiB, PROT_READ | PROT_WRITE, MAP_SHARED, o->chunk, 0);
  close(o->dev0);
  close(o->dev1);
  close(o->chunk);
  return o->m0 != MAP_FAILED && o->m1 != MAP_FAILED && o->mc != MAP_FAILED;
}

/* A process that allocates device memory outside the daemon is listed
 * with those bytes, per device; what it maps of the daemon's chunks is not
 * counted; once it exits it is gone from the list. */
START_TEST(host_processes_names_who_holds_memory_outside_the_daemon) {
  gpudev *g = host_open();
  uint64_t h;
  ck_assert_int_eq(gpudev_chunk_create(g, 0, 4 * MiB, &h), 0);
  struct outside o = {.dev0 = outside_memfd(0, 6 * MiB, true),
                      .dev1 = outside_memfd(1, 2 * MiB, true)};
  ck_assert_int_eq(gpudev_chunk_export(g, h, &o.chunk), 0);
  struct child c;
  child_start(&c, outside_step, &o);
  close(o.dev0);
  close(o.dev1);
  close(o.chunk);
  ck_assert(child_step(&c, 'm'));
  ck_assert_uint_eq(held_outside(g, 0, c.pid), 6 * MiB);
  ck_assert_uint_eq(held_outside(g, 1, c.pid), 2 * MiB);
  ck_assert_uint_eq(held_outside(g, 0, getpid()), 0); /* never the daemon itself */
  child_end(&c);
  ck_assert_uint_eq(held_outside(g, 0, c.pid), 0);
  ck_assert_int_eq(gpudev_processes(g, 2, NULL, 0, &(size_t){0}), -ENODEV);
  gpudev_chunk_release(g, 0, h, 4 * MiB);
  gpudev_close(g);
}
END_TEST

/* The fds of the child in the holding test: the chunk's own (inherited
 * through fork, closed first) and an export of it. */
struct holder {
  int chunk, fd;
  void *m;
};

/* Step 'x': close the inherited chunk fd; 'm': map the export; 'c': close
 * the export; 'u': unmap. */
static bool holder_step(void *arg, char n) {
  struct holder *k = arg;
  if (n == 'x') return close(k->chunk) == 0;
  if (n == 'm') return (k->m = mmap(NULL, 4 * MiB, PROT_READ, MAP_SHARED, k->fd, 0)) != MAP_FAILED;
  if (n == 'c') return close(k->fd) == 0;
  if (n == 'u') return munmap(k->m, 4 * MiB) == 0;
  return false;
}

/* Whether one chunk is held by pid (the batch call for one). */
static int held_by(gpudev *g, uint64_t h, pid_t pid) {
  bool held = true;
  int rc = gpudev_chunks_held_by(g, (int)pid, &h, 1, &held);
  ck_assert_int_eq(rc, held ? 1 : 0);
  return rc;
}

/* A chunk is held by a process while it has an fd to it or a mapping of
 * it, until it lets go of both, and not by one that has exited. */
START_TEST(host_chunk_held_by_follows_fds_and_mappings) {
  gpudev *g = host_open();
  uint64_t h;
  ck_assert_int_eq(gpudev_chunk_create(g, 0, 4 * MiB, &h), 0);
  struct holder k = {.chunk = (int)h};
  ck_assert_int_eq(gpudev_chunk_export(g, h, &k.fd), 0);
  struct child c;
  child_start(&c, holder_step, &k);
  close(k.fd);
  ck_assert(child_step(&c, 'x'));
  ck_assert_int_eq(held_by(g, h, c.pid), 1); /* the export's fd */
  ck_assert(child_step(&c, 'm'));
  ck_assert_int_eq(held_by(g, h, c.pid), 1);
  ck_assert(child_step(&c, 'c'));
  ck_assert_int_eq(held_by(g, h, c.pid), 1); /* the mapping alone */
  ck_assert(child_step(&c, 'u'));
  ck_assert_int_eq(held_by(g, h, c.pid), 0);
  child_end(&c);
  ck_assert_int_eq(held_by(g, h, c.pid), 0);
  gpudev_chunk_release(g, 0, h, 4 * MiB);
  gpudev_close(g);
}
END_TEST

/* True if fd is no longer open. */
static bool closed(int fd) { return fcntl(fd, F_GETFD) < 0 && errno == EBADF; }

/* Adopt fd; the result, and check that the fd was consumed. */
static int adopt(gpudev *g, unsigned dev, int fd, uint64_t size, uint64_t *h) {
  int rc = gpudev_chunk_adopt(g, dev, fd, size, h);
  ck_assert_msg(rc == 0 || closed(fd), "a refused fd was left open");
  return rc;
}

/* Adoption takes only memory this backend could have made for the device:
 * a committed memfd of the right name and the claimed size, within the
 * device's capacity, not already held; the fd is consumed either way. */
START_TEST(host_chunk_adopt_takes_only_whole_chunks_of_the_device) {
  gpudev *g = host_open();
  uint64_t h, h2;
  int p[2];
  ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
  close(p[1]);
  ck_assert_int_eq(adopt(g, 0, p[0], 4 * MiB, &h), -EINVAL);
  ck_assert_msg(strstr(gpu_error(), "not a memfd"), "%s", gpu_error());
  ck_assert_int_eq(adopt(g, 0, outside_memfd(0, 4 * MiB, true), 2 * MiB, &h), -EINVAL);
  ck_assert_msg(strstr(gpu_error(), "4194304 bytes"), "%s", gpu_error());
  ck_assert_int_eq(adopt(g, 0, outside_memfd(1, 4 * MiB, true), 4 * MiB, &h), -EINVAL);
  ck_assert_int_eq(adopt(g, 0, outside_memfd(0, 4 * MiB, false), 4 * MiB, &h), -EINVAL);
  ck_assert_int_eq(adopt(g, 0, outside_memfd(0, 3 * MiB, true), 3 * MiB, &h), -EINVAL);
  ck_assert_int_eq(adopt(g, 1, outside_memfd(1, 32 * MiB, true), 32 * MiB, &h), -ENOMEM);
  ck_assert_int_eq(adopt(g, 2, outside_memfd(2, 4 * MiB, true), 4 * MiB, &h), -ENODEV);
  /* One its holder could shrink under the daemon's copies. */
  int unsealable = memfd_create("gpumem-host-local:0", MFD_CLOEXEC);
  ck_assert_int_eq(ftruncate(unsealable, 4 * MiB), 0);
  ck_assert_int_eq(fallocate(unsealable, 0, 0, 4 * MiB), 0);
  ck_assert_int_eq(adopt(g, 0, unsealable, 4 * MiB, &h), -EINVAL);
  ck_assert_msg(strstr(gpu_error(), "cannot be sealed"), "%s", gpu_error());

  ck_assert_int_eq(adopt(g, 0, outside_memfd(0, 4 * MiB, true), 4 * MiB, &h), 0);
  struct gpudev_mem m;
  ck_assert_int_eq(gpudev_mem_detail(g, 0, &m), 0);
  ck_assert_uint_eq(m.free, 12 * MiB);
  int again;
  ck_assert_int_eq(gpudev_chunk_export(g, h, &again), 0);
  ck_assert_int_eq(adopt(g, 0, again, 4 * MiB, &h2), -EEXIST);
  ck_assert_uint_eq(held_outside(g, 0, getpid()), 0);
  gpudev_chunk_release(g, 0, h, 4 * MiB);
  ck_assert_int_eq(gpudev_mem_detail(g, 0, &m), 0);
  ck_assert_uint_eq(m.free, 16 * MiB);
  gpudev_close(g);
}
END_TEST

/* A client keeps each imported chunk's fd while it is mapped and can hand
 * it over again: the new daemon adopts the very memory, contents and all;
 * release then closes the client's fd, and a failed map leaks nothing. */
START_TEST(host_export_hands_an_imported_chunk_to_a_new_daemon) {
  gpudev *old = host_open(), *fresh = host_open();
  gpuva *client = host_client_open();
  int fds = harness_fd_count();
  uint64_t h, imported, adopted;
  int fd;
  void *va;
  ck_assert_int_eq(gpudev_chunk_create(old, 0, 4 * MiB, &h), 0);
  ck_assert_int_eq(gpudev_chunk_export(old, h, &fd), 0);
  ck_assert_int_eq(gpuva_import(client, 0, fd, 4 * MiB, &imported), 0);
  ck_assert_int_eq(gpuva_reserve(client, 0, 4 * MiB, &va), 0);
  ck_assert_int_eq(gpuva_map(client, 0, va, 4 * MiB, imported), 0);
  ck_assert_int_eq(gpuva_set_access(client, 0, va, 4 * MiB), 0);
  memset(va, 0x5a, 4 * MiB);
  gpudev_chunk_release(old, 0, h, 4 * MiB); /* the old daemon is gone */
  ck_assert_int_eq(harness_fd_count(), fds + 1); /* the client's handle */

  ck_assert_int_eq(gpuva_export(client, 0, imported, &fd), 0);
  ck_assert_int_eq(gpudev_chunk_adopt(fresh, 0, fd, 4 * MiB, &adopted), 0);
  char byte;
  ck_assert_int_eq(pread((int)adopted, &byte, 1, 4 * MiB - 1), 1);
  ck_assert_int_eq(byte, 0x5a);
  ck_assert_int_eq(gpuva_unmap(client, 0, va, 4 * MiB), 0);
  gpuva_release(client, 0, imported);
  ck_assert_int_eq(harness_fd_count(), fds + 1); /* the new daemon's chunk */

  ck_assert_int_eq(gpudev_chunk_export(fresh, adopted, &fd), 0);
  ck_assert_int_eq(gpuva_import(client, 0, fd, 4 * MiB, &imported), 0);
  ck_assert_int_lt(gpuva_map(client, 0, (char *)va + 1, 4 * MiB, imported), 0);
  gpuva_release(client, 0, imported);
  gpuva_free(client, 0, va, 4 * MiB);
  gpudev_chunk_release(fresh, 0, adopted, 4 * MiB);
  ck_assert_int_eq(harness_fd_count(), fds);
  gpudev_close(old);
  gpuva_close(client);
  gpudev_close(fresh);
}
END_TEST

/* How many of the pages of [p, p + len) are resident. */
static size_t resident_pages(void *p, uint64_t len) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE), n = (len + page - 1) / page, in = 0;
  unsigned char *vec = malloc(n);
  ck_assert_int_eq(mincore(p, len, vec), 0);
  for (size_t i = 0; i < n; i++) in += vec[i] & 1;
  free(vec);
  return in;
}

/* Backup memory is reserved with nothing in it and made a piece at a
 * time, each piece only when asked; copies of chunks run through all of
 * it, in and out. */
START_TEST(host_backup_is_made_a_piece_at_a_time) {
  struct gpudev_options o = {.backend = "host", .host_devices = 1, .host_device_size = 256 * MiB};
  gpudev *g = NULL;
  char err[256];
  ck_assert_msg(gpudev_open(&o, &g, err, sizeof err) == 0, "%s", err);
  const uint64_t piece = GPUDEV_BACKUP_PIECE, size = 2 * piece + 2 * MiB;
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  void *host;
  ck_assert_int_eq(gpudev_backup_reserve(g, 0, size, &host), 0);
  char *p = host;
  ck_assert_uint_eq(resident_pages(p, size), 0);
  ck_assert_int_eq(gpudev_backup_make(g, 0, host, size, MiB, true), -EINVAL);
  ck_assert_int_eq(gpudev_backup_make(g, 0, host, size, size, true), -EINVAL);
  /* The middle piece alone: the others stay untouched. */
  ck_assert_int_eq(gpudev_backup_make(g, 0, host, size, piece, true), 0);
  ck_assert_uint_eq(resident_pages(p + piece, piece), piece / page);
  ck_assert_uint_eq(resident_pages(p, piece), 0);
  ck_assert_uint_eq(resident_pages(p + 2 * piece, 2 * MiB), 0);
  ck_assert_int_eq(gpudev_backup_make(g, 0, host, size, 0, true), 0);
  ck_assert_int_eq(gpudev_backup_make(g, 0, host, size, 2 * piece, true), 0);
  ck_assert_uint_eq(resident_pages(p, size), size / page);
  for (uint64_t i = 0; i < size; i += 4096) ck_assert_int_eq(p[i], 0);
  /* Two chunks across the piece boundaries, out and back in. */
  uint64_t sizes[2] = {piece + 2 * MiB, piece}, h[2];
  ck_assert_int_eq(gpudev_chunk_create(g, 0, sizes[0], &h[0]), 0);
  ck_assert_int_eq(gpudev_chunk_create(g, 0, sizes[1], &h[1]), 0);
  uint32_t word = 0x600df00du;
  for (uint64_t off = 0; off < sizes[0]; off += MiB)
    ck_assert_int_eq(pwrite((int)h[0], &word, 4, (off_t)off), 4);
  ck_assert_int_eq(gpudev_chunks_copy(g, 0, h, sizes, 2, host, true), 0);
  for (uint64_t off = 0; off < sizes[0]; off += MiB) ck_assert_uint_eq(*(uint32_t *)(p + off), word);
  memset(p + sizes[0], 0x7e, sizes[1]);
  ck_assert_int_eq(gpudev_chunks_copy(g, 0, h, sizes, 2, host, false), 0);
  char back[64];
  ck_assert_int_eq(pread((int)h[1], back, sizeof back, (off_t)(sizes[1] - sizeof back)),
                   (ssize_t)sizeof back);
  for (size_t i = 0; i < sizeof back; i++) ck_assert_int_eq(back[i], 0x7e);
  gpudev_chunk_release(g, 0, h[0], sizes[0]);
  gpudev_chunk_release(g, 0, h[1], sizes[1]);
  gpudev_backup_release(g, 0, host, size, size);
  gpudev_close(g);
}
END_TEST

int main(void) {
  return HARNESS_RUN("backends", 30, NULL, NULL,
                     hip_backend_without_a_device_fails_cleanly,
                     cuda_backend_without_a_driver_fails_cleanly,
                     no_binary_links_a_vendor_runtime,
                     host_mem_detail_is_capacity_less_committed,
                     host_processes_names_who_holds_memory_outside_the_daemon,
                     host_chunk_held_by_follows_fds_and_mappings,
                     host_chunk_adopt_takes_only_whole_chunks_of_the_device,
                     host_export_hands_an_imported_chunk_to_a_new_daemon,
                     host_backup_is_made_a_piece_at_a_time);
}
