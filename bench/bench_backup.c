/* Backup and restore bandwidth through gpumemd against a plain copy of
 * the same size in the same run: a pinned cuMemcpyDtoH/HtoD on GPUs, a
 * memcpy between faulted-in buffers on the host backend. */
#include <getopt.h>
#include <stdbool.h>

#include "bench.h"
#include "common/size.h"
#include "gpu/gpu.h"
#include "gpumem.h"

static void die(const char *what, const char *why) {
  fprintf(stderr, "bench_backup: %s: %s\n", what, why);
  exit(1);
}

/* GB/s of one plain copy each way, through the backend's client calls:
 * one synchronous copy between device memory and pinned host memory. */
static void plain_copy(const char *backend, uint64_t size, unsigned rounds, double *d2h,
                       double *h2d) {
  struct gpu_options o = {.backend = backend, .host_devices = 1, .host_device_size = size};
  gpu *g;
  char err[256];
  if (gpu_open(&o, &g, err, sizeof err) < 0) die("backend", err);
  uint64_t h;
  void *va, *host;
  if (gpu_chunk_create(g, 0, size, &h) < 0 || gpu_va_reserve(g, 0, size, &va) < 0 ||
      gpu_map(g, 0, va, size, h) < 0 || gpu_set_access(g, 0, va, size) < 0 ||
      gpu_backup_alloc(g, 0, size, &host) < 0)
    die("setup", gpu_error());
  gpu_fill32(g, 0, va, size, 0x12345678u); /* fault the pages in */
  double a[16], b[16];
  for (unsigned r = 0; r < rounds; r++) {
    uint64_t t0 = bench_ns();
    if (gpu_copy_from(g, 0, host, va, size) < 0) die("copy", gpu_error());
    uint64_t t1 = bench_ns();
    if (gpu_copy_to(g, 0, va, host, size) < 0) die("copy", gpu_error());
    uint64_t t2 = bench_ns();
    a[r] = (double)size / (double)(t1 - t0);
    b[r] = (double)size / (double)(t2 - t1);
  }
  gpu_backup_free(g, 0, host, size);
  gpu_unmap(g, 0, va, size);
  gpu_va_free(g, 0, va, size);
  gpu_chunk_release(g, 0, h, size);
  gpu_close(g);
  *d2h = bench_median(a, rounds);
  *h2d = bench_median(b, rounds);
}

/* GB/s of the daemon's backups and restores of a BACKUP buffer. */
static void daemon_copy(const char *bin, const char *backend, uint64_t size, unsigned rounds,
                        double *d2h, double *h2d) {
  char sock[] = "/tmp/gpumemd-bench-backup.sock", devsize[32], limit[32];
  snprintf(devsize, sizeof devsize, "%llu", (unsigned long long)(size + (64ull << 20)));
  snprintf(limit, sizeof limit, "%llu", (unsigned long long)size);
  const char *extra[] = {"--backend", backend, "--host-devices", "1", "--host-device-size",
                         devsize, "--backup-limit", limit, NULL};
  pid_t d = bench_daemon(bin, sock, extra);
  gpumem_client *w, *c;
  gpumem_buffer *b;
  if (gpumem_connect(sock, "bench-worker", GPUMEM_ROLE_WORKER, 0, &w) < 0 ||
      gpumem_connect(sock, "bench", GPUMEM_ROLE_CONTROLLER, GPUMEM_CONNECT_NO_THREAD, &c) < 0 ||
      gpumem_alloc(w, "weights", 0, size, GPUMEM_BACKUP, &b) < 0 ||
      gpumem_buffer_fill32(w, b, 0, size, 0xabcdef01u) < 0)
    die("setup", gpumem_last_error());
  const char *tag = "weights";
  double a[16], r2[16];
  for (unsigned r = 0; r < rounds + 1; r++) {
    struct gpumem_op_report *p = NULL, *q = NULL;
    if (gpumem_pause(c, &tag, 1, NULL, 0, NULL, &p) < 0 ||
        gpumem_resume(c, &tag, 1, NULL, 0, NULL, &q) < 0)
      die("pause/resume", gpumem_last_error());
    if (r > 0) { /* the first pause makes the pinned memory */
      a[r - 1] = (double)p->backup_bytes / (double)p->backup_us / 1e3;
      r2[r - 1] = (double)q->backup_bytes / (double)q->backup_us / 1e3;
    }
    gpumem_op_report_free(p);
    gpumem_op_report_free(q);
  }
  gpumem_free(w, b);
  gpumem_disconnect(w);
  gpumem_disconnect(c);
  bench_daemon_stop(d);
  *d2h = bench_median(a, rounds);
  *h2d = bench_median(r2, rounds);
}

int main(int argc, char **argv) {
  const char *bin = "build/bin", *backend = "host";
  uint64_t size = 1ull << 30;
  unsigned rounds = 3;
  static const struct option opts[] = {{"backend", required_argument, 0, 'b'},
                                       {"size", required_argument, 0, 's'},
                                       {"rounds", required_argument, 0, 'r'},
                                       {0, 0, 0, 0}};
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    if (ch == 'b') backend = optarg;
    else if (ch == 's') {
      if (size_parse(optarg, &size)) die("--size", optarg);
    } else if (ch == 'r') rounds = (unsigned)atoi(optarg);
    else return 2;
  }
  if (optind < argc) bin = argv[optind];
  if (rounds < 1 || rounds > 15) die("--rounds", "1..15");
  double pd, ph, dd, dh;
  plain_copy(backend, size, rounds, &pd, &ph);
  daemon_copy(bin, backend, size, rounds, &dd, &dh);
  char name[128], sz[32];
  size_format(size, sz, sizeof sz);
  snprintf(name, sizeof name, "backup bandwidth %s (%s) vs plain copy", sz, backend);
  bench_report(name, dd, "GB/s", pd);
  snprintf(name, sizeof name, "restore bandwidth %s (%s) vs plain copy", sz, backend);
  bench_report(name, dh, "GB/s", ph);
  return 0;
}
