/* Pause and resume through gpumemd, with the memory held by several worker
 * processes, against the same backend operations done in one process
 * without a daemon (create, map, set access / unmap, release the same
 * chunks), measured in the same run. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdbool.h>

#include "bench.h"
#include "common/size.h"
#include "gpu/gpudev.h"
#include "gpu/gpuva.h"
#include "gpumem.h"

#define MAX_CHUNKS 65536
#define MAX_WORKERS 64

struct params {
  const char *bin, *backend, *plot;
  uint64_t total, chunk;
  unsigned workers, rounds;
  bool backup;
};

static void die(const char *what, const char *why) {
  fprintf(stderr, "bench_pause: %s: %s\n", what, why);
  exit(1);
}

/* The baseline: the same chunks created, mapped and released by one
 * process, with no daemon; with --backup, each range also copied to host
 * memory (pinned on GPUs) before it is released and back after it is
 * mapped, one plain copy each. */
struct baseline {
  gpudev *d;
  gpuva *g;
  uint64_t per, nper;
  uint64_t handles[MAX_CHUNKS];
  void *va[MAX_WORKERS];
  void *store; /* --backup: host memory for every range */
};

static void baseline_open(const struct params *p, struct baseline *b) {
  struct gpudev_options o = {.backend = p->backend, .host_devices = 1,
                             .host_device_size = p->total + p->chunk};
  char err[256];
  if (gpudev_open(&o, &b->d, err, sizeof err) < 0 ||
      gpuva_open(p->backend, &b->g, err, sizeof err) < 0)
    die("backend", err);
  b->per = p->total / p->workers;
  b->nper = b->per / p->chunk;
  for (unsigned w = 0; w < p->workers; w++)
    if (gpuva_reserve(b->g, 0, b->per, &b->va[w]) < 0) die("reserve", gpu_error());
  if (p->backup && gpudev_backup_alloc(b->d, 0, p->total, &b->store) < 0) die("store", gpu_error());
}

/* Create and map every chunk, access set once per range; milliseconds. */
static double baseline_resume(const struct params *p, struct baseline *b) {
  uint64_t t0 = bench_ns();
  for (unsigned w = 0; w < p->workers; w++) {
    for (uint64_t i = 0; i < b->nper; i++) {
      uint64_t *h = &b->handles[w * b->nper + i];
      if (gpudev_chunk_create(b->d, 0, p->chunk, h) < 0) die("create", gpu_error());
      if (gpuva_map(b->g, 0, (char *)b->va[w] + i * p->chunk, p->chunk, *h) < 0)
        die("map", gpu_error());
    }
    if (gpuva_set_access(b->g, 0, b->va[w], b->per) < 0) die("access", gpu_error());
    if (b->store && gpuva_copy_to(b->g, 0, b->va[w], (char *)b->store + w * b->per, b->per) < 0)
      die("copy", gpu_error());
  }
  return (double)(bench_ns() - t0) / 1e6;
}

/* Unmap and release every chunk; milliseconds. */
static double baseline_pause(const struct params *p, struct baseline *b) {
  uint64_t t0 = bench_ns();
  gpuva_sync(b->g, 0);
  for (unsigned w = 0; w < p->workers; w++) {
    if (b->store && gpuva_copy_from(b->g, 0, (char *)b->store + w * b->per, b->va[w], b->per) < 0)
      die("copy", gpu_error());
    for (uint64_t i = 0; i < b->nper; i++) {
      gpuva_unmap(b->g, 0, (char *)b->va[w] + i * p->chunk, p->chunk);
      gpudev_chunk_release(b->d, 0, b->handles[w * b->nper + i], p->chunk);
    }
  }
  return (double)(bench_ns() - t0) / 1e6;
}

static void baseline_close(const struct params *p, struct baseline *b) {
  for (unsigned w = 0; w < p->workers; w++) gpuva_free(b->g, 0, b->va[w], b->per);
  if (b->store) gpudev_backup_free(b->d, 0, b->store, p->total);
  gpuva_close(b->g);
  gpudev_close(b->d);
}

/* Start a worker holding bytes in chunk-sized pieces; wait for "ready". */
static pid_t worker(const struct params *p, const char *sock, uint64_t bytes) {
  int fds[2];
  if (pipe(fds) < 0) die("pipe", strerror(errno));
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    close(fds[0]);
    char path[512], size[32], count[32];
    snprintf(path, sizeof path, "%s/gpumem-worker", p->bin);
    snprintf(size, sizeof size, "%llu", (unsigned long long)p->chunk);
    snprintf(count, sizeof count, "%llu", (unsigned long long)(bytes / p->chunk));
    execl(path, path, "--socket", sock, "--tag", "bench", "--size", size, "--count", count,
          "--no-verify", p->backup ? "--backup" : (char *)NULL, (char *)NULL);
    _exit(127);
  }
  close(fds[1]);
  /* Read lines until "ready"; one line per buffer comes before it. */
  FILE *f = fdopen(fds[0], "r");
  char line[512];
  bool ready = false;
  while (!ready && fgets(line, sizeof line, f)) ready = strncmp(line, "ready", 5) == 0;
  fclose(f);
  if (!ready) die("worker", "ended before it was ready");
  return pid;
}

/* Both ways in turns, so that each creates memory the other just freed
 * (the driver clears recycled memory when it is taken again): the first
 * two rounds warm up and are not counted. */
static void measure(const struct params *p, double out[4]) {
  static struct baseline b;
  baseline_open(p, &b);
  char sockdir[] = "/tmp/gpumemd-bench-pause.XXXXXX", sock[64], chunk[32], devsize[32];
  bench_sockdir(sockdir, sock, sizeof sock);
  snprintf(chunk, sizeof chunk, "%llu", (unsigned long long)p->chunk);
  snprintf(devsize, sizeof devsize, "%llu", (unsigned long long)(2 * p->total + p->chunk));
  const char *extra[] = {"--backend", p->backend, "--chunk-size", chunk, "--host-devices", "1",
                         "--host-device-size", devsize, "--log-level", "info", NULL};
  pid_t d = bench_daemon(p->bin, sock, extra);
  pid_t w[MAX_WORKERS];
  for (unsigned i = 0; i < p->workers; i++) w[i] = worker(p, sock, p->total / p->workers);
  gpumem_client *c;
  if (gpumem_connect(sock, "bench", GPUMEM_ROLE_CONTROLLER, GPUMEM_CONNECT_NO_THREAD, &c) < 0)
    die("connect", gpumem_last_error());
  const char *tag = "bench";
  double v[4][16];
  unsigned n = 0;
  for (unsigned r = 0; r < p->rounds + 2; r++) {
    struct gpumem_op_report *res;
    uint64_t t0 = bench_ns();
    if (gpumem_pause(c, &tag, 1, NULL, 0, NULL, &res) < 0) die("pause", gpumem_last_error());
    double dp = (double)(bench_ns() - t0) / 1e6;
    bool all = res->bytes == b.per * p->workers;
    gpumem_op_report_free(res);
    if (!all) die("pause", "not every byte paused");
    double br = baseline_resume(p, &b);
    double bp = baseline_pause(p, &b);
    t0 = bench_ns();
    if (gpumem_resume(c, &tag, 1, NULL, 0, NULL, NULL) < 0) die("resume", gpumem_last_error());
    double dr = (double)(bench_ns() - t0) / 1e6;
    if (r < 2) continue;
    v[0][n] = dp;
    v[1][n] = dr;
    v[2][n] = bp;
    v[3][n] = br;
    n++;
  }
  gpumem_disconnect(c);
  for (unsigned i = 0; i < p->workers; i++) {
    kill(w[i], SIGTERM);
    waitpid(w[i], NULL, 0);
  }
  bench_daemon_stop(d);
  rmdir(sockdir);
  baseline_close(p, &b);
  for (int k = 0; k < 4; k++) out[k] = bench_median(v[k], n);
}

int main(int argc, char **argv) {
  struct params p = {"build/bin", "host", NULL, 1ull << 30, 64ull << 20, 4, 3, false};
  static const struct option opts[] = {
      {"backend", required_argument, 0, 'b'}, {"total", required_argument, 0, 't'},
      {"chunk", required_argument, 0, 'c'},   {"workers", required_argument, 0, 'w'},
      {"rounds", required_argument, 0, 'r'},  {"backup", no_argument, 0, 'B'},
      {"plot", required_argument, 0, 'P'},    {0, 0, 0, 0},
  };
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (ch) {
    case 'b': p.backend = optarg; break;
    case 't': if (size_parse(optarg, &p.total)) die("--total", optarg); break;
    case 'c': if (size_parse(optarg, &p.chunk)) die("--chunk", optarg); break;
    case 'w': p.workers = (unsigned)atoi(optarg); break;
    case 'r': p.rounds = (unsigned)atoi(optarg); break;
    case 'B': p.backup = true; break;
    case 'P': p.plot = optarg; break;
    default: return 2;
    }
  }
  if (optind < argc) p.bin = argv[optind];
  if (!p.workers || p.workers > MAX_WORKERS || !p.rounds || p.rounds > 14 ||
      p.total % ((uint64_t)p.workers * p.chunk) || p.total / p.chunk > MAX_CHUNKS)
    die("parameters", "total must split into workers x chunks");
  double m[4];
  measure(&p, m);
  double dp = m[0], dr = m[1], bp = m[2], br = m[3];
  char name[128], sz[32];
  size_format(p.total, sz, sizeof sz);
  const char *kind = p.backup ? ", backup" : "";
  snprintf(name, sizeof name, "pause %s, %u workers (%s%s)", sz, p.workers, p.backend, kind);
  bench_report(name, dp, "ms", bp);
  snprintf(name, sizeof name, "resume %s, %u workers (%s%s)", sz, p.workers, p.backend, kind);
  bench_report(name, dr, "ms", br);
  if (p.plot) {
    /* GiB, then pause and resume through gpumemd and in one process */
    FILE *f = fopen(p.plot, "a");
    if (!f) die("--plot", p.plot);
    fprintf(f, "%.3f %.3f %.3f %.3f %.3f\n", (double)p.total / (1 << 30), dp, dr, bp, br);
    fclose(f);
  }
  return 0;
}
