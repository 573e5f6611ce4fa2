/* Control-plane latency: an alloc+free round trip through gpumemd against
 * a raw Unix-socket ping-pong between two processes, in the same run. */
#include "bench.h"
#include "gpumem.h"

#define N 20000

/* Two processes bounce a 64-byte message; returns samples in ns. */
static void pingpong(uint64_t *samples) {
  int sv[2];
  socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
  pid_t child = fork();
  char msg[64] = {0};
  if (child == 0) {
    close(sv[0]);
    while (read(sv[1], msg, sizeof msg) == (ssize_t)sizeof msg)
      if (write(sv[1], msg, sizeof msg) != (ssize_t)sizeof msg) break;
    _exit(0);
  }
  close(sv[1]);
  for (int i = 0; i < N; i++) {
    uint64_t t0 = bench_ns();
    if (write(sv[0], msg, sizeof msg) != (ssize_t)sizeof msg ||
        read(sv[0], msg, sizeof msg) != (ssize_t)sizeof msg)
      exit(1);
    samples[i] = bench_ns() - t0;
  }
  close(sv[0]);
  waitpid(child, NULL, 0);
}

int main(int argc, char **argv) {
  const char *bin = "build/bin", *backend = "host";
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc)
      backend = argv[++i];
    else
      bin = argv[i];
  }
  char sockdir[] = "/tmp/gpumemd-bench-rtt.XXXXXX", sock[64];
  bench_sockdir(sockdir, sock, sizeof sock);
  static uint64_t raw[N], full[N];
  pingpong(raw);
  /* Page granularity: this measures the control plane, not the kernel
   * zeroing 2 MiB of pages for every allocation. */
  const char *extra[] = {"--backend", backend, "--host-devices", "1", "--host-device-size", "1G",
                         "--host-granularity", "4K", NULL};
  pid_t d = bench_daemon(bin, sock, extra);
  gpumem_client *c;
  if (gpumem_connect(sock, "bench", GPUMEM_ROLE_WORKER, GPUMEM_CONNECT_NO_THREAD, &c) < 0) {
    fprintf(stderr, "bench: %s\n", gpumem_last_error());
    return 1;
  }
  for (int i = 0; i < N; i++) {
    gpumem_buffer *b;
    uint64_t t0 = bench_ns();
    if (gpumem_alloc(c, "bench", 0, 1, 0, &b) < 0 || gpumem_free(c, b) < 0) {
      fprintf(stderr, "bench: %s\n", gpumem_last_error());
      return 1;
    }
    full[i] = bench_ns() - t0;
  }
  gpumem_disconnect(c);
  bench_daemon_stop(d);
  rmdir(sockdir);
  double r50 = bench_percentile(raw, N, 50) / 1000, r99 = bench_percentile(raw, N, 99) / 1000;
  double f50 = bench_percentile(full, N, 50) / 1000, f99 = bench_percentile(full, N, 99) / 1000;
  char name[96];
  snprintf(name, sizeof name, "alloc+free round trip p50 (%s, vs ping-pong)", backend);
  bench_report(name, f50, "us", r50);
  snprintf(name, sizeof name, "alloc+free round trip p99 (%s, vs ping-pong)", backend);
  bench_report(name, f99, "us", r99);
  return 0;
}
