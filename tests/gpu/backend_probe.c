/* The CUDA backend's driver-facing operations, checked against the driver:
 * memory figures with the reserve apart (NVML v2), the per-process list,
 * re-export of an imported chunk and its adoption by a daemon with no
 * context; that no call changes the calling thread's current context; and
 * that backup memory pinned in the background, a piece at a time, holds
 * the process's other driver calls up by no more than a piece. Built from
 * the gpu/ sources alone (no libuv, protobuf-c): this file, every gpu/
 * source but HIP's (hip_*.c) and common/idmap.c, with -DHAVE_CUDA -I.
 * -I$CUDA_HOME/include -ldl -lpthread (tests/gpu/run.sh has the line).
 * One PASS or FAIL line per check; the exit status is the number of
 * failures. */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu/gpudev.h"
#include "gpu/gpuva.h"
#include "tests/gpu/check.h"
#include "tests/gpu/fdpass.h"

#define MiB (1ull << 20)
#define GiB (1ull << 30)


static double mib(uint64_t b) { return (double)b / (double)MiB; }

/* Open the CUDA backend's daemon side, or exit saying why. */
static gpudev *open_cuda(void) {
  struct gpudev_options o = {.backend = "cuda"};
  gpudev *g = NULL;
  char err[256];
  if (gpudev_open(&o, &g, err, sizeof err) < 0) {
    printf("FAIL open cuda: %s\n", err);
    exit(1);
  }
  return g;
}

/* Open the CUDA backend's client side, or exit saying why. */
static gpuva *open_cuda_client(void) {
  gpuva *g = NULL;
  char err[256];
  if (gpuva_open("cuda", &g, err, sizeof err) < 0) {
    printf("FAIL open cuda: %s\n", err);
    exit(1);
  }
  return g;
}

/* Free bytes once they stop moving (releases land asynchronously). */
static uint64_t settled_free(gpudev *g) {
  struct gpudev_mem m, prev = {0};
  gpudev_mem_detail(g, 0, &prev);
  for (int i = 0; i < 100; i++) {
    usleep(20000);
    gpudev_mem_detail(g, 0, &m);
    if (m.free == prev.free) return m.free;
    prev = m;
  }
  return prev.free;
}

/* One byte each way, to step the worker. */
static void say(int sock, char c) {
  if (write(sock, &c, 1) != 1) perror("write");
}

static char hear(int sock) {
  char c = 0;
  return read(sock, &c, 1) == 1 ? c : 0;
}

/* The worker: imports and maps the daemon's chunk, allocates 2 GiB of its
 * own outside the daemon, hands the chunk back re-exported, then on 'q'
 * lets everything go and exits. Exit status 0 if every call worked. */
static int worker(int sock, int chunk_fd, uint64_t size) {
  gpuva *w = open_cuda_client();
  uint64_t h, outside;
  void *va;
  uint8_t ipc[GPU_IPC_HANDLE_SIZE];
  int rc = gpuva_import(w, 0, chunk_fd, size, &h);
  if (rc == 0) rc = gpuva_reserve(w, 0, size, &va);
  if (rc == 0) rc = gpuva_map(w, 0, va, size, h);
  if (rc == 0) rc = gpuva_set_access(w, 0, va, size);
  if (rc == 0) rc = gpuva_fill32(w, 0, va, size, 0x5a5a5a5au);
  gpudev *own = open_cuda(); /* its own memory, as an application's */
  if (rc == 0) rc = gpudev_ipc_alloc(own, 0, 2 * GiB, &outside, ipc);
  int fd = -1;
  if (rc == 0) rc = gpuva_export(w, 0, h, &fd);
  if (rc < 0) fprintf(stderr, "worker: %s\n", gpu_error());
  send_fd(sock, rc == 0 ? fd : -1);
  if (fd >= 0) close(fd);
  if (hear(sock) != 'q') return 1;
  gpuva_unmap(w, 0, va, size);
  gpuva_release(w, 0, h);
  gpuva_free(w, 0, va, size);
  gpudev_ipc_free(own, 0, outside, 2 * GiB);
  gpudev_close(own);
  gpuva_close(w);
  return rc < 0;
}

/* The daemon's memory figures: NVML v2 keeps the reserve out of used. */
static void check_mem_detail(gpudev *d) {
  struct gpudev_mem m;
  uint64_t free_v1, total_v1;
  int rc = gpudev_mem_detail(d, 0, &m);
  gpudev_mem_info(d, 0, &free_v1, &total_v1);
  check(rc == 0 && m.total == total_v1 && m.reserved > 0, "mem_detail",
        "total %.0f MiB, free %.0f, reserved %.0f: used %.0f MiB without the reserve, %.0f "
        "with it (v1); rc %d %s",
        mib(m.total), mib(m.free), mib(m.reserved), mib(m.total - m.free - m.reserved),
        mib(total_v1 - free_v1), rc, rc ? gpu_error() : "");
  check(!gpudev_holding(d, 0), "mem_detail without a context", "holding %d", gpudev_holding(d, 0));
}

/* The worker is listed with what it allocated itself and its context, not
 * the chunk it imported. */
static void check_processes(gpudev *d, int pid, uint64_t chunk) {
  struct gpudev_process list[64];
  size_t n = 0;
  int rc = gpudev_processes(d, 0, list, 64, &n);
  uint64_t used = 0;
  for (size_t i = 0; i < n && i < 64; i++) {
    printf("  process %d: %s%.0f MiB\n", list[i].pid,
           list[i].used == GPUDEV_USED_UNKNOWN ? "unknown " : "",
           list[i].used == GPUDEV_USED_UNKNOWN ? 0 : mib(list[i].used));
    if (list[i].pid == pid) used = list[i].used;
  }
  check(rc == 0 && used >= 2 * GiB && used < 2 * GiB + chunk, "processes",
        "worker %d holds %.0f MiB outside the daemon (2048 its own, and its context; the "
        "%.0f MiB chunk it maps is not counted); %zu processes; rc %d %s",
        pid, mib(used), mib(chunk), n, rc, rc ? gpu_error() : "");
  uint64_t none = 0;
  bool held;
  check(gpudev_chunks_held_by(d, pid, &none, 1, &held) == -ENOTSUP, "held_by", "not on VMM: %s",
        gpu_error());
}

/* What the daemon must refuse to adopt. */
static void check_adopt_refuses(gpudev *d) {
  int p[2];
  uint64_t h;
  if (pipe(p) < 0) return;
  close(p[1]);
  int rc = gpudev_chunk_adopt(d, 0, p[0], 2 * MiB, &h);
  check(rc == -EINVAL, "adopt a pipe", "rc %d: %s", rc, gpu_error());
  int m = memfd_create("gpumem-host-local:0", MFD_CLOEXEC);
  rc = gpudev_chunk_adopt(d, 0, m, 2 * MiB, &h);
  check(rc == -EINVAL, "adopt a memfd", "rc %d: %s", rc, gpu_error());
  rc = gpudev_chunk_adopt(d, gpudev_device_count(d), dup(2), 2 * MiB, &h);
  check(rc == -ENODEV, "adopt on no device", "rc %d: %s", rc, gpu_error());
}

/* The driver's context calls, from libcuda itself (the probe links no
 * CUDA library): cuCtxCreate_v2 is the old, flag-only signature every
 * driver still exports. */
struct cu_ctx_calls {
  int (*get)(void **ctx);
  int (*set)(void *ctx);
  int (*create)(void **ctx, unsigned flags, int dev);
  int (*destroy)(void *ctx);
};

/* Look up the context calls; false if libcuda lacks one. */
static bool cu_ctx_calls(struct cu_ctx_calls *c) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return false;
  *(void **)&c->get = dlsym(lib, "cuCtxGetCurrent");
  *(void **)&c->set = dlsym(lib, "cuCtxSetCurrent");
  *(void **)&c->create = dlsym(lib, "cuCtxCreate_v2");
  *(void **)&c->destroy = dlsym(lib, "cuCtxDestroy_v2");
  return c->get && c->set && c->create && c->destroy;
}

/* Every library call with want current: the name of the first call that
 * failed or left another context current, or NULL. */
static const char *calls_keep(gpudev *d, gpuva *c, const struct cu_ctx_calls *cu, void *want,
                              uint64_t chunk, uint64_t size) {
  static char why[512];
  void *now = NULL, *va = NULL, *host = NULL;
  uint64_t h = 0, dptr = 0, free_b, total;
  uint8_t ipc[GPU_IPC_HANDLE_SIZE];
  int fd = -1;
  char *buf = malloc(4096);
#define STEP(name, expr)                                                                   \
  do {                                                                                     \
    int rc_ = (expr);                                                                      \
    cu->get(&now);                                                                         \
    if (rc_ < 0 || now != want) {                                                          \
      snprintf(why, sizeof why, "%s: rc %d %s, current %p (want %p)", name, rc_,           \
               rc_ < 0 ? gpu_error() : "", now, want);                                      \
      free(buf);                                                                           \
      return why;                                                                          \
    }                                                                                      \
  } while (0)
  STEP("gpudev_chunk_export", gpudev_chunk_export(d, chunk, &fd));
  STEP("gpuva_reserve", gpuva_reserve(c, 0, size, &va));
  STEP("gpuva_import", gpuva_import(c, 0, fd, size, &h));
  STEP("gpuva_map", gpuva_map(c, 0, va, size, h));
  STEP("gpuva_set_access", gpuva_set_access(c, 0, va, size));
  STEP("gpuva_fill32", gpuva_fill32(c, 0, va, size, 0x5eed5eedu));
  STEP("gpuva_copy_from", gpuva_copy_from(c, 0, buf, va, 4096));
  STEP("gpuva_copy_to", gpuva_copy_to(c, 0, va, buf, 4096));
  STEP("gpuva_sync", gpuva_sync(c, 0));
  STEP("gpuva_unmap", gpuva_unmap(c, 0, va, size));
  STEP("gpuva_release", (gpuva_release(c, 0, h), 0));
  STEP("gpuva_free", (gpuva_free(c, 0, va, size), 0));
  STEP("gpudev_hold", gpudev_hold(d, 0));
  STEP("gpudev_backup_reserve", gpudev_backup_reserve(d, 0, size, &host));
  for (uint64_t off = 0; off < size; off += GPUDEV_BACKUP_PIECE)
    STEP("gpudev_backup_make", gpudev_backup_make(d, 0, host, size, off, false));
  STEP("gpudev_chunks_copy", gpudev_chunks_copy(d, 0, &chunk, &size, 1, host, true));
  STEP("gpudev_chunks_copy back", gpudev_chunks_copy(d, 0, &chunk, &size, 1, host, false));
  STEP("gpudev_backup_release", (gpudev_backup_release(d, 0, host, size, size), 0));
  STEP("gpudev_backup_alloc", gpudev_backup_alloc(d, 0, size, &host));
  STEP("gpudev_backup_free", (gpudev_backup_free(d, 0, host, size), 0));
  STEP("gpudev_ipc_alloc", gpudev_ipc_alloc(d, 0, 2 * MiB, &dptr, ipc));
  STEP("gpudev_ipc_free", (gpudev_ipc_free(d, 0, dptr, 2 * MiB), 0));
  STEP("gpudev_mem_info", gpudev_mem_info(d, 0, &free_b, &total));
  STEP("gpudev_unhold", (gpudev_unhold(d, 0), 0));
#undef STEP
  free(buf);
  return NULL;
}

/* No library call changes the calling thread's current context: with none
 * current, none stays current; with an application's own context current,
 * it stays current (a multi-GPU application's device is its own). */
static void check_context_kept(gpudev *d) {
  struct cu_ctx_calls cu;
  if (!cu_ctx_calls(&cu)) {
    check(false, "context kept", "libcuda lacks cuCtxGetCurrent/SetCurrent/Create_v2/Destroy_v2");
    return;
  }
  gpuva *c = open_cuda_client();
  uint64_t size = GPUDEV_BACKUP_PIECE + 2 * MiB, chunk;
  void *own = NULL;
  int rc = gpudev_chunk_create(d, 0, size, &chunk);
  int made = cu.create(&own, 0, 0); /* current on this thread from here */
  if (rc < 0 || made != 0) {
    check(false, "context kept", "setup: rc %d %s, cuCtxCreate_v2 %d", rc, gpu_error(), made);
    return;
  }
  cu.set(NULL);
  const char *moved = calls_keep(d, c, &cu, NULL, chunk, size);
  check(!moved, "context kept: none current stays none", "%s", moved ? moved : "every call");
  cu.set(own);
  moved = calls_keep(d, c, &cu, own, chunk, size);
  check(!moved, "context kept: the application's own context stays current", "%s",
        moved ? moved : "every call");
  cu.set(NULL);
  cu.destroy(own);
  gpudev_chunk_release(d, 0, chunk, size);
  gpuva_close(c);
}

/* Milliseconds on the monotonic clock. */
static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Backup memory made on a thread of its own, as the daemon's pool does:
 * in pieces, or in one pinned allocation (as before pieces). */
struct background {
  gpudev *g;
  uint64_t size;
  bool pieces;
  void *host;
  int rc;
  double ms, piece_max;
  atomic_bool done;
};

/* The background thread: make the memory, timing it (and each piece). */
static void *make_backup(void *arg) {
  struct background *b = arg;
  double t0 = now_ms();
  if (!b->pieces) {
    b->rc = gpudev_backup_alloc(b->g, 0, b->size, &b->host);
  } else if ((b->rc = gpudev_backup_reserve(b->g, 0, b->size, &b->host)) == 0) {
    for (uint64_t off = 0; off < b->size && b->rc == 0; off += GPUDEV_BACKUP_PIECE) {
      double p0 = now_ms();
      b->rc = gpudev_backup_make(b->g, 0, b->host, b->size, off, true);
      if (now_ms() - p0 > b->piece_max) b->piece_max = now_ms() - p0;
    }
  }
  b->ms = now_ms() - t0;
  atomic_store(&b->done, true);
  return NULL;
}

/* What the daemon's loop does for each allocation of a BACKUP buffer:
 * create a 1 GiB chunk, export it and map an address range for its backup
 * (then, here, let them go); milliseconds, or -1. The mmap waits for the
 * process's mmap lock, which faulting memory in holds. */
static double one_alloc(gpudev *d) {
  uint64_t h;
  int fd = -1;
  double t0 = now_ms();
  if (gpudev_chunk_create(d, 0, GiB, &h) < 0) return -1;
  int rc = gpudev_chunk_export(d, h, &fd);
  void *range = mmap(NULL, GiB, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (fd >= 0) close(fd);
  gpudev_chunk_release(d, 0, h, GiB);
  if (range != MAP_FAILED) munmap(range, GiB);
  double ms = now_ms() - t0;
  return rc < 0 || range == MAP_FAILED ? -1 : ms;
}

/* Allocations every 10 ms (requests arriving, with room between them for
 * the background, which waits for 5 ms of quiet) while a backup of size
 * bytes is made in the background: the longest one, and how many ran. */
static double alloc_during(gpudev *d, struct background *b, int *n) {
  pthread_t t;
  double longest = 0;
  *n = 0;
  atomic_store(&b->done, false);
  if (pthread_create(&t, NULL, make_backup, b) != 0) return -1;
  while (!atomic_load(&b->done)) {
    double ms = one_alloc(d);
    if (ms < 0) longest = 1e9;
    if (ms > longest) longest = ms;
    ++*n;
    usleep(10000);
  }
  pthread_join(t, NULL);
  if (b->rc == 0 && b->pieces) gpudev_backup_release(d, 0, b->host, b->size, b->size);
  if (b->rc == 0 && !b->pieces) gpudev_backup_free(d, 0, b->host, b->size);
  return longest;
}

/* Backup memory made in the background in one pinned allocation held the
 * driver's lock throughout, and the loop's allocations waited for all of
 * it; made a piece at a time, an allocation waits for one piece at most. */
static void check_background_pieces(gpudev *d) {
  uint64_t size = 2 * GiB;
  double alone[16], base_max = 0;
  gpudev_hold(d, 0); /* the daemon holds the context while BACKUP buffers exist */
  for (int i = 0; i < 16; i++) {
    alone[i] = one_alloc(d);
    if (alone[i] > base_max) base_max = alone[i];
  }
  struct background whole = {.g = d, .size = size}, pieces = {.g = d, .size = size, .pieces = true};
  int n_whole, n_pieces;
  double during_whole = alloc_during(d, &whole, &n_whole);
  double during_pieces = alloc_during(d, &pieces, &n_pieces);
  gpudev_unhold(d, 0);
  printf("  allocation (create, export, release of 1 GiB, mmap of a range) alone: longest "
         "%.1f ms; while 2 GiB of backup memory is pinned in one piece (%.0f ms): longest %.1f ms of %d; in %llu MiB pieces "
         "(%.0f ms, longest piece %.1f ms): longest %.1f ms of %d\n",
         base_max, whole.ms, during_whole, n_whole,
         (unsigned long long)(GPUDEV_BACKUP_PIECE / MiB), pieces.ms, pieces.piece_max,
         during_pieces, n_pieces);
  check(whole.rc == 0 && pieces.rc == 0 && during_pieces <= pieces.piece_max + base_max + 2 &&
            during_pieces < 20,
        "background backup memory holds allocations up by a piece at most",
        "longest allocation %.1f ms (alone %.1f, a piece %.1f; in one piece %.1f); rc %d %d",
        during_pieces, base_max, pieces.piece_max, during_whole, whole.rc, pieces.rc);
}

/* The worker is forked before this process touches CUDA (a forked child
 * cannot use a driver its parent initialized), and gets the chunk over a
 * socket, as from a daemon. */
int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) return 1;
  uint64_t size = GiB, chunk;
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    int fd = recv_fd(sv[1]);
    _exit(fd < 0 ? 1 : worker(sv[1], fd, size));
  }
  close(sv[1]);
  gpudev *d = open_cuda();
  check_mem_detail(d);
  int fd;
  if (gpudev_chunk_create(d, 0, size, &chunk) < 0 || gpudev_chunk_export(d, chunk, &fd) < 0) {
    printf("FAIL setup: %s\n", gpu_error());
    return 1;
  }
  send_fd(sv[0], fd);
  close(fd);
  int back = recv_fd(sv[0]);
  check(back >= 0, "export an imported chunk", "fd %d", back);
  check_processes(d, pid, size);

  /* The old daemon lets go; a new one adopts what the worker handed back,
   * without a context. */
  gpudev_chunk_release(d, 0, chunk, size);
  gpudev *fresh = open_cuda();
  uint64_t adopted = 0;
  int rc = back < 0 ? -EBADF : gpudev_chunk_adopt(fresh, 0, back, size, &adopted);
  check(rc == 0 && !gpudev_holding(fresh, 0), "adopt without a context", "rc %d %s", rc,
        rc ? gpu_error() : "");
  check_adopt_refuses(fresh);

  say(sv[0], 'q');
  int status;
  waitpid(pid, &status, 0);
  check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "worker", "status %d", status);
  close(sv[0]);
  uint64_t before = settled_free(fresh);
  if (rc == 0) gpudev_chunk_release(fresh, 0, adopted, size);
  uint64_t after = settled_free(fresh);
  check(rc == 0 && after >= before + size - 2 * MiB && after <= before + size + 64 * MiB,
        "adopted memory freed by its release",
        "free %.0f MiB with only the adopted handle left, %.0f after its release", mib(before),
        mib(after));
  check_context_kept(fresh);
  check_background_pieces(fresh);
  gpudev_close(fresh);
  gpudev_close(d);
  printf("%d failures\n", failures);
  return failures;
}
