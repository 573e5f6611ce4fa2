/* Backup and restore bandwidth through gpumemd against a plain copy of
 * the same size in the same run: a pinned cuMemcpyDtoH/HtoD on GPUs, a
 * memcpy between faulted-in buffers on the host backend.
 *
 * Then the first pause of fresh BACKUP buffers (16 GiB on GPUs, 1 GiB on
 * the host backend; --first-size or GPUMEM_BENCH_FIRST_PAUSE_SIZE) against
 * the steady pauses after it: the daemon makes their host memory in the
 * background when they are allocated, so the first pause should cost what
 * the later ones do (steady/first >= 0.9).
 *
 * And the allocation of the same size of fresh BACKUP buffers against
 * plain ones, in one daemon: making their host memory in the background
 * must not hold the daemon's next allocations up (pinning it in one piece
 * per buffer made 16 x 1 GiB take 7.2 s on an H200 against tens of ms), so
 * BACKUP/plain should be near 1. */
#include <getopt.h>
#include <stdbool.h>

#include "bench.h"
#include "common/size.h"
#include "common/wire.h"
#include "gpu/gpudev.h"
#include "gpu/gpuva.h"
#include "gpumem.h"

static void die(const char *what, const char *why) {
  fprintf(stderr, "bench_backup: %s: %s\n", what, why);
  exit(1);
}

/* GB/s of one plain copy each way, through the backend's client calls:
 * one synchronous copy between device memory and pinned host memory. */
static void plain_copy(const char *backend, uint64_t size, unsigned rounds, double *d2h,
                       double *h2d) {
  struct gpudev_options o = {.backend = backend, .host_devices = 1, .host_device_size = size};
  gpudev *d;
  gpuva *g;
  char err[256];
  if (gpudev_open(&o, &d, err, sizeof err) < 0 || gpuva_open(backend, &g, err, sizeof err) < 0)
    die("backend", err);
  uint64_t h;
  void *va, *host;
  if (gpudev_chunk_create(d, 0, size, &h) < 0 || gpuva_reserve(g, 0, size, &va) < 0 ||
      gpuva_map(g, 0, va, size, h) < 0 || gpuva_set_access(g, 0, va, size) < 0 ||
      gpudev_backup_alloc(d, 0, size, &host) < 0)
    die("setup", gpu_error());
  gpuva_fill32(g, 0, va, size, 0x12345678u); /* fault the pages in */
  double a[16], b[16];
  for (unsigned r = 0; r < rounds; r++) {
    uint64_t t0 = bench_ns();
    if (gpuva_copy_from(g, 0, host, va, size) < 0) die("copy", gpu_error());
    uint64_t t1 = bench_ns();
    if (gpuva_copy_to(g, 0, va, host, size) < 0) die("copy", gpu_error());
    uint64_t t2 = bench_ns();
    a[r] = (double)size / (double)(t1 - t0);
    b[r] = (double)size / (double)(t2 - t1);
  }
  gpudev_backup_free(d, 0, host, size);
  gpuva_unmap(g, 0, va, size);
  gpuva_free(g, 0, va, size);
  gpudev_chunk_release(d, 0, h, size);
  gpuva_close(g);
  gpudev_close(d);
  *d2h = bench_median(a, rounds);
  *h2d = bench_median(b, rounds);
}

/* gpumemd with one host device of dev_bytes and a backup limit of
 * limit_bytes, its socket in the private directory sockdir (a mkdtemp
 * template), the socket's path in sock. */
static pid_t backup_daemon(const char *bin, const char *backend, uint64_t dev_bytes,
                           uint64_t limit_bytes, char *sockdir, char *sock, size_t socklen) {
  char devsize[32], limit[32];
  bench_sockdir(sockdir, sock, socklen);
  snprintf(devsize, sizeof devsize, "%llu", (unsigned long long)dev_bytes);
  snprintf(limit, sizeof limit, "%llu", (unsigned long long)limit_bytes);
  const char *extra[] = {"--backend", backend, "--host-devices", "1", "--host-device-size",
                         devsize, "--backup-limit", limit, NULL};
  return bench_daemon(bin, sock, extra);
}

/* Pause one tag through the client library; its report (which the caller
 * frees) in *rep, there whenever the call succeeded. */
static int op_pause(gpumem_client *c, const char *tag, struct gpumem_op_report **rep) {
  return gpumem_pause(c, &tag, 1, NULL, 0, NULL, rep);
}

/* Resume one tag, its report in *rep as op_pause gives it. */
static int op_resume(gpumem_client *c, const char *tag, struct gpumem_op_report **rep) {
  return gpumem_resume(c, &tag, 1, NULL, 0, NULL, rep);
}

/* GB/s of the daemon's backups and restores of a BACKUP buffer. */
static void daemon_copy(const char *bin, const char *backend, uint64_t size, unsigned rounds,
                        double *d2h, double *h2d) {
  char sockdir[] = "/tmp/gpumemd-bench-backup.XXXXXX", sock[64];
  pid_t d = backup_daemon(bin, backend, size + (64ull << 20), size, sockdir, sock, sizeof sock);
  gpumem_client *w, *c;
  gpumem_buffer *b;
  if (gpumem_connect(sock, "bench-worker", GPUMEM_ROLE_WORKER, 0, &w) < 0 ||
      gpumem_connect(sock, "bench", GPUMEM_ROLE_CONTROLLER, GPUMEM_CONNECT_NO_THREAD, &c) < 0 ||
      gpumem_alloc(w, "weights", 0, size, GPUMEM_BACKUP, &b) < 0 ||
      gpumem_buffer_fill32(w, b, 0, size, 0xabcdef01u) < 0)
    die("setup", gpumem_last_error());
  double a[16], r2[16];
  for (unsigned r = 0; r < rounds + 1; r++) {
    struct gpumem_op_report *p = NULL, *q = NULL;
    if (op_pause(c, "weights", &p) < 0 || op_resume(c, "weights", &q) < 0)
      die("pause/resume", gpumem_last_error());
    if (r > 0) { /* the first is a warm-up, as for the plain copy */
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
  rmdir(sockdir);
  *d2h = bench_median(a, rounds);
  *h2d = bench_median(r2, rounds);
}

/* Write all of a blocking socket. */
static void put_all(int fd, const void *p, size_t n) {
  for (size_t at = 0; at < n;) {
    ssize_t k = write(fd, (const char *)p + at, n - at);
    if (k <= 0) die("status", "write failed");
    at += (size_t)k;
  }
}

/* Read n bytes from a blocking socket. */
static void get_all(int fd, void *p, size_t n) {
  for (size_t at = 0; at < n;) {
    ssize_t k = read(fd, (char *)p + at, n - at);
    if (k <= 0) die("status", "the daemon closed the connection");
    at += (size_t)k;
  }
}

/* One request and its reply over a raw session: a frame is a
 * little-endian u32 length and an Envelope. */
static wire_env *ask(int fd, const wire_env *env) {
  size_t len;
  uint8_t *bytes = wire_pack(env, &len);
  uint8_t hdr[4] = {(uint8_t)len, (uint8_t)(len >> 8), (uint8_t)(len >> 16), (uint8_t)(len >> 24)};
  put_all(fd, hdr, 4);
  put_all(fd, bytes, len);
  free(bytes);
  get_all(fd, hdr, 4);
  len = (size_t)hdr[0] | (size_t)hdr[1] << 8 | (size_t)hdr[2] << 16 | (size_t)hdr[3] << 24;
  uint8_t *in = malloc(len ? len : 1);
  if (!in) die("status", "out of memory");
  get_all(fd, in, len);
  wire_env *r = wire_unpack(in, len);
  free(in);
  if (!r) die("status", "not a gpumemd message");
  return r;
}

/* Host memory the daemon has made for BACKUP buffers (StatusReply's
 * backup_ready, which the client library does not carry yet). */
static uint64_t backup_ready(const char *sock) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", sock);
  if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) die("status", sock);
  Gpumem__Wire__Hello h = GPUMEM__WIRE__HELLO__INIT;
  h.version_major = WIRE_VERSION_MAJOR;
  h.version_minor = WIRE_VERSION_MINOR;
  h.role = GPUMEM__WIRE__ROLE__ROLE_CONTROLLER;
  h.name = "bench-status";
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = 1;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_HELLO;
  env.hello = &h;
  wire_env_free(ask(fd, &env));
  Gpumem__Wire__StatusRequest sr = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  env.id = 2;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_STATUS;
  env.status = &sr;
  wire_env *r = ask(fd, &env);
  if (r->body_case != GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY) die("status", "no status reply");
  uint64_t ready = r->status_reply->backup_ready;
  wire_env_free(r);
  close(fd);
  return ready;
}

/* Allocate n buffers of unit bytes in tag: total and longest milliseconds. */
static void timed_allocs(gpumem_client *w, const char *tag, uint64_t n, uint64_t unit,
                         uint32_t flags, gpumem_buffer **bufs, double *total, double *longest) {
  *longest = 0;
  uint64_t t0 = bench_ns();
  char each[512] = "";
  for (uint64_t i = 0; i < n; i++) {
    uint64_t a = bench_ns();
    if (gpumem_alloc(w, tag, 0, unit, flags, &bufs[i]) < 0) die("alloc", gpumem_last_error());
    double ms = (double)(bench_ns() - a) / 1e6;
    if (ms > *longest) *longest = ms;
    size_t at = strlen(each);
    snprintf(each + at, sizeof each - at, " %.1f", ms);
  }
  *total = (double)(bench_ns() - t0) / 1e6;
  printf("  %s allocations, ms:%s\n", tag, each);
}

/* Milliseconds to allocate size bytes of fresh BACKUP buffers (16 of
 * them) while the daemon makes their host memory behind them, and the
 * same of plain buffers first, in one daemon; longest single allocations
 * too. A small BACKUP buffer made ready first takes the context both the
 * daemon and the worker need, so that neither timing pays for it. */
static void alloc_compare(const char *bin, const char *backend, uint64_t size, double *plain,
                          double *backup, double *plain_max, double *backup_max) {
  char sockdir[] = "/tmp/gpumemd-bench-alloc.XXXXXX", sock[64];
  uint64_t warm = 2ull << 20, n = 16, unit = size / n / warm * warm;
  if (unit < warm) unit = warm;
  pid_t d = backup_daemon(bin, backend, 2 * n * unit + (64ull << 20), n * unit + warm, sockdir,
                          sock, sizeof sock);
  gpumem_client *w;
  gpumem_buffer *first, **bufs = calloc(2 * n, sizeof *bufs);
  if (!bufs) die("alloc", "out of memory");
  if (gpumem_connect(sock, "bench-worker", GPUMEM_ROLE_WORKER, 0, &w) < 0 ||
      gpumem_alloc(w, "warm", 0, warm, GPUMEM_BACKUP, &first) < 0)
    die("setup", gpumem_last_error());
  uint64_t t0 = bench_ns();
  while (backup_ready(sock) < warm && bench_ns() - t0 < 60ull * 1000000000ull) usleep(1000);
  timed_allocs(w, "plain", n, unit, 0, bufs, plain, plain_max);
  timed_allocs(w, "weights", n, unit, GPUMEM_BACKUP, bufs + n, backup, backup_max);
  /* Freed before their host memory is all made: the jobs are dropped. */
  for (uint64_t i = 0; i < 2 * n; i++) gpumem_free(w, bufs[i]);
  gpumem_free(w, first);
  free(bufs);
  gpumem_disconnect(w);
  bench_daemon_stop(d);
  rmdir(sockdir);
}

/* Milliseconds of one pause of the tag (and the resume after it, untimed). */
static double timed_pause(gpumem_client *c, const char *tag) {
  struct gpumem_op_report *p = NULL, *q = NULL;
  uint64_t t0 = bench_ns();
  if (op_pause(c, tag, &p) < 0) die("pause", gpumem_last_error());
  double ms = (double)(bench_ns() - t0) / 1e6;
  if (op_resume(c, tag, &q) < 0) die("resume", gpumem_last_error());
  gpumem_op_report_free(p);
  gpumem_op_report_free(q);
  return ms;
}

/* Milliseconds of the first pause of fresh BACKUP buffers and of the
 * steady ones after it; settle: only once their host memory is made. */
static void first_pause(const char *bin, const char *backend, uint64_t size, unsigned rounds,
                        bool settle, double *first, double *steady) {
  char sockdir[] = "/tmp/gpumemd-bench-first.XXXXXX", sock[64];
  pid_t d = backup_daemon(bin, backend, size + (64ull << 20), size, sockdir, sock, sizeof sock);
  gpumem_client *w, *c;
  if (gpumem_connect(sock, "bench-worker", GPUMEM_ROLE_WORKER, 0, &w) < 0 ||
      gpumem_connect(sock, "bench", GPUMEM_ROLE_CONTROLLER, GPUMEM_CONNECT_NO_THREAD, &c) < 0)
    die("connect", gpumem_last_error());
  uint64_t piece = 1ull << 30, n = (size + piece - 1) / piece;
  gpumem_buffer **bufs = calloc(n, sizeof *bufs);
  uint64_t t0 = bench_ns();
  for (uint64_t i = 0; i < n; i++) {
    uint64_t len = size - i * piece < piece ? size - i * piece : piece;
    if (gpumem_alloc(w, "weights", 0, len, GPUMEM_BACKUP, &bufs[i]) < 0)
      die("alloc", gpumem_last_error());
  }
  uint64_t t1 = bench_ns();
  char sz[32];
  size_format(size, sz, sizeof sz);
  /* An engine's first pause comes long after it loaded its weights, when
   * the daemon has made the host memory in the background; without
   * settle the pause comes at once and makes (or waits for) it itself, as
   * every first pause did before. */
  if (settle) {
    for (uint64_t i = 0; i < n; i++)
      if (gpumem_buffer_fill32(w, bufs[i], 0, gpumem_buffer_size(bufs[i]), 0xabcdef01u) < 0)
        die("fill", gpumem_last_error());
    uint64_t ready = 0;
    while ((ready = backup_ready(sock)) < size && bench_ns() - t0 < 600ull * 1000000000ull)
      usleep(1000);
    if (ready < size) fprintf(stderr, "bench_backup: host memory not made in 10 minutes\n");
    printf("fresh BACKUP buffers %s (%s): allocated in %.1f ms, their host memory made %.1f ms "
           "after the first alloc\n",
           sz, backend, (double)(t1 - t0) / 1e6, (double)(bench_ns() - t0) / 1e6);
  }
  *first = timed_pause(c, "weights");
  double v[16];
  for (unsigned r = 0; r < rounds; r++) v[r] = timed_pause(c, "weights");
  *steady = bench_median(v, rounds);
  for (uint64_t i = 0; i < n; i++) gpumem_free(w, bufs[i]);
  free(bufs);
  gpumem_disconnect(w);
  gpumem_disconnect(c);
  bench_daemon_stop(d);
  rmdir(sockdir);
}

int main(int argc, char **argv) {
  const char *bin = "build/bin", *backend = "host";
  uint64_t size = 1ull << 30, first_size = 0;
  unsigned rounds = 3;
  static const struct option opts[] = {{"backend", required_argument, 0, 'b'},
                                       {"size", required_argument, 0, 's'},
                                       {"first-size", required_argument, 0, 'f'},
                                       {"rounds", required_argument, 0, 'r'},
                                       {0, 0, 0, 0}};
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char *env_first = getenv("GPUMEM_BENCH_FIRST_PAUSE_SIZE");
  if (env_first && *env_first && size_parse(env_first, &first_size))
    die("GPUMEM_BENCH_FIRST_PAUSE_SIZE", env_first);
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    if (ch == 'b') backend = optarg;
    else if (ch == 's') {
      if (size_parse(optarg, &size)) die("--size", optarg);
    } else if (ch == 'f') {
      if (size_parse(optarg, &first_size) || first_size == 0) die("--first-size", optarg);
    } else if (ch == 'r') rounds = (unsigned)atoi(optarg);
    else return 2;
  }
  if (first_size == 0) first_size = strcmp(backend, "host") == 0 ? 1ull << 30 : 16ull << 30;
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
  double first, steady, early, early_steady, plain_ms, backup_ms, plain_max, backup_max;
  alloc_compare(bin, backend, first_size, &plain_ms, &backup_ms, &plain_max, &backup_max);
  size_format(first_size, sz, sizeof sz);
  printf("allocating %s in 16 buffers (%s), longest single allocation: plain %.1f ms, fresh "
         "BACKUP %.1f ms\n",
         sz, backend, plain_max, backup_max);
  snprintf(name, sizeof name, "alloc %s fresh BACKUP (%s) vs plain", sz, backend);
  bench_report(name, backup_ms, "ms", plain_ms);
  first_pause(bin, backend, first_size, rounds, false, &early, &early_steady);
  first_pause(bin, backend, first_size, rounds, true, &first, &steady);
  size_format(first_size, sz, sizeof sz);
  printf("first pause %s right after the allocation (host memory made on its path): %.1f ms, "
         "steady %.1f ms\n",
         sz, early, early_steady);
  snprintf(name, sizeof name, "steady pause %s BACKUP (%s) vs first", sz, backend);
  bench_report(name, steady, "ms", first);
  return 0;
}
