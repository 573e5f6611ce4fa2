/* The CUDA backend's driver-facing operations, checked against the driver:
 * memory figures with the reserve apart (NVML v2), the per-process list,
 * re-export of an imported chunk and its adoption by a daemon with no
 * context. Built from the gpu/ sources alone (no libuv, protobuf-c), one
 * PASS or FAIL line per check; the exit status is the number of failures.
 *
 *   cc -std=c11 -D_GNU_SOURCE -DHAVE_CUDA -I. -I$CUDA_HOME/include \
 *     tests/gpu/backend_probe.c gpu/gpu.c gpu/host.c gpu/vmm.c gpu/cuda.c \
 *     common/idmap.c -ldl -lpthread -o backend_probe && ./backend_probe */
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu/gpu.h"
#include "tests/gpu/check.h"

#define MiB (1ull << 20)
#define GiB (1ull << 30)


static double mib(uint64_t b) { return (double)b / (double)MiB; }

/* Open the CUDA backend, or exit saying why. */
static gpu *open_cuda(bool client) {
  struct gpu_options o = {.backend = "cuda", .client = client};
  gpu *g = NULL;
  char err[256];
  if (gpu_open(&o, &g, err, sizeof err) < 0) {
    printf("FAIL open cuda: %s\n", err);
    exit(1);
  }
  return g;
}

/* Free bytes once they stop moving (releases land asynchronously). */
static uint64_t settled_free(gpu *g) {
  struct gpu_mem m, prev = {0};
  gpu_mem_detail(g, 0, &prev);
  for (int i = 0; i < 100; i++) {
    usleep(20000);
    gpu_mem_detail(g, 0, &m);
    if (m.free == prev.free) return m.free;
    prev = m;
  }
  return prev.free;
}

/* Pass an fd over a socket (a bare byte for -1). */
static void send_fd(int sock, int fd) {
  char byte = 'f', buf[CMSG_SPACE(sizeof(int))];
  struct iovec io = {&byte, 1};
  struct msghdr msg = {.msg_iov = &io, .msg_iovlen = 1};
  if (fd >= 0) {
    msg.msg_control = buf;
    msg.msg_controllen = sizeof buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  if (sendmsg(sock, &msg, 0) != 1) perror("sendmsg");
}

/* Receive an fd passed with send_fd; -1 if none came. */
static int recv_fd(int sock) {
  char byte, buf[CMSG_SPACE(sizeof(int))];
  struct iovec io = {&byte, 1};
  struct msghdr msg = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = buf,
                       .msg_controllen = sizeof buf};
  if (recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) != 1) return -1;
  struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
  int fd = -1;
  if (c && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
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
  gpu *w = open_cuda(true);
  uint64_t h, outside;
  void *va;
  uint8_t ipc[GPU_IPC_HANDLE_SIZE];
  int rc = gpu_import(w, 0, chunk_fd, size, &h);
  if (rc == 0) rc = gpu_va_reserve(w, 0, size, &va);
  if (rc == 0) rc = gpu_map(w, 0, va, size, h);
  if (rc == 0) rc = gpu_set_access(w, 0, va, size);
  if (rc == 0) rc = gpu_fill32(w, 0, va, size, 0x5a5a5a5au);
  gpu *own = open_cuda(false); /* its own memory, as an application's */
  if (rc == 0) rc = gpu_ipc_alloc(own, 0, 2 * GiB, &outside, ipc);
  int fd = -1;
  if (rc == 0) rc = gpu_export(w, 0, h, &fd);
  if (rc < 0) fprintf(stderr, "worker: %s\n", gpu_error());
  send_fd(sock, rc == 0 ? fd : -1);
  if (fd >= 0) close(fd);
  if (hear(sock) != 'q') return 1;
  gpu_unmap(w, 0, va, size);
  gpu_release(w, 0, h);
  gpu_va_free(w, 0, va, size);
  gpu_ipc_free(own, 0, outside, 2 * GiB);
  gpu_close(own);
  gpu_close(w);
  return rc < 0;
}

/* The daemon's memory figures: NVML v2 keeps the reserve out of used. */
static void check_mem_detail(gpu *d) {
  struct gpu_mem m;
  uint64_t free_v1, total_v1;
  int rc = gpu_mem_detail(d, 0, &m);
  gpu_mem_info(d, 0, &free_v1, &total_v1);
  check(rc == 0 && m.total == total_v1 && m.reserved > 0, "mem_detail",
        "total %.0f MiB, free %.0f, reserved %.0f: used %.0f MiB without the reserve, %.0f "
        "with it (v1); rc %d %s",
        mib(m.total), mib(m.free), mib(m.reserved), mib(m.total - m.free - m.reserved),
        mib(total_v1 - free_v1), rc, rc ? gpu_error() : "");
  check(!gpu_holding(d, 0), "mem_detail without a context", "holding %d", gpu_holding(d, 0));
}

/* The worker is listed with what it allocated itself and its context, not
 * the chunk it imported. */
static void check_processes(gpu *d, int pid, uint64_t chunk) {
  struct gpu_process list[64];
  size_t n = 0;
  int rc = gpu_processes(d, 0, list, 64, &n);
  uint64_t used = 0;
  for (size_t i = 0; i < n && i < 64; i++) {
    printf("  process %d: %s%.0f MiB\n", list[i].pid,
           list[i].used == GPU_USED_UNKNOWN ? "unknown " : "",
           list[i].used == GPU_USED_UNKNOWN ? 0 : mib(list[i].used));
    if (list[i].pid == pid) used = list[i].used;
  }
  check(rc == 0 && used >= 2 * GiB && used < 2 * GiB + chunk, "processes",
        "worker %d holds %.0f MiB outside the daemon (2048 its own, and its context; the "
        "%.0f MiB chunk it maps is not counted); %zu processes; rc %d %s",
        pid, mib(used), mib(chunk), n, rc, rc ? gpu_error() : "");
  uint64_t none = 0;
  bool held;
  check(gpu_chunks_held_by(d, pid, &none, 1, &held) == -ENOTSUP, "held_by", "not on VMM: %s",
        gpu_error());
}

/* What the daemon must refuse to adopt. */
static void check_adopt_refuses(gpu *d) {
  int p[2];
  uint64_t h;
  if (pipe(p) < 0) return;
  close(p[1]);
  int rc = gpu_chunk_adopt(d, 0, p[0], 2 * MiB, &h);
  check(rc == -EINVAL, "adopt a pipe", "rc %d: %s", rc, gpu_error());
  int m = memfd_create("gpumem-host-local:0", MFD_CLOEXEC);
  rc = gpu_chunk_adopt(d, 0, m, 2 * MiB, &h);
  check(rc == -EINVAL, "adopt a memfd", "rc %d: %s", rc, gpu_error());
  rc = gpu_chunk_adopt(d, gpu_device_count(d), dup(2), 2 * MiB, &h);
  check(rc == -ENODEV, "adopt on no device", "rc %d: %s", rc, gpu_error());
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
  gpu *d = open_cuda(false);
  check_mem_detail(d);
  int fd;
  if (gpu_chunk_create(d, 0, size, &chunk) < 0 || gpu_chunk_export(d, chunk, &fd) < 0) {
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
  gpu_chunk_release(d, 0, chunk, size);
  gpu *fresh = open_cuda(false);
  uint64_t adopted = 0;
  int rc = back < 0 ? -EBADF : gpu_chunk_adopt(fresh, 0, back, size, &adopted);
  check(rc == 0 && !gpu_holding(fresh, 0), "adopt without a context", "rc %d %s", rc,
        rc ? gpu_error() : "");
  check_adopt_refuses(fresh);

  say(sv[0], 'q');
  int status;
  waitpid(pid, &status, 0);
  check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "worker", "status %d", status);
  close(sv[0]);
  uint64_t before = settled_free(fresh);
  if (rc == 0) gpu_chunk_release(fresh, 0, adopted, size);
  uint64_t after = settled_free(fresh);
  check(rc == 0 && after >= before + size - 2 * MiB && after <= before + size + 64 * MiB,
        "adopted memory freed by its release",
        "free %.0f MiB with only the adopted handle left, %.0f after its release", mib(before),
        mib(after));
  gpu_close(fresh);
  gpu_close(d);
  printf("%d failures\n", failures);
  return failures;
}
