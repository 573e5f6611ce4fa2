/* Scale: pause and resume of 100,000 buffers held by 1,000 sessions of
 * 100 buffers each, against the same buffers held by one session, in the
 * same run: the cost should follow the buffers, not the sessions. */
#include <getopt.h>
#include <stdbool.h>
#include <sys/resource.h>

#include "bench.h"
#include "gpumem.h"

static void die(const char *what, const char *why) {
  fprintf(stderr, "bench_scale: %s: %s\n", what, why);
  exit(1);
}

/* Each session holds its buffers through its own connection. */
static void measure(const char *sock, const char *tag, unsigned sessions, unsigned per,
                    double *pause_ms, double *resume_ms) {
  gpumem_client **w = calloc(sessions, sizeof *w);
  for (unsigned s = 0; s < sessions; s++) {
    if (gpumem_connect(sock, tag, GPUMEM_ROLE_WORKER, 0, &w[s]) < 0)
      die("connect", gpumem_last_error());
    for (unsigned i = 0; i < per; i++) {
      gpumem_buffer *b;
      if (gpumem_alloc(w[s], tag, 0, 1, 0, &b) < 0) die("alloc", gpumem_last_error());
    }
  }
  gpumem_client *c;
  if (gpumem_connect(sock, "bench", GPUMEM_ROLE_CONTROLLER, GPUMEM_CONNECT_NO_THREAD, &c) < 0)
    die("connect", gpumem_last_error());
  double p[3], r[3];
  for (int k = 0; k < 3; k++) {
    struct gpumem_op_report *res;
    uint64_t t0 = bench_ns();
    if (gpumem_pause(c, &tag, 1, NULL, 0, NULL, &res) < 0) die("pause", gpumem_last_error());
    uint64_t t1 = bench_ns();
    bool all = res->buffers == (uint64_t)sessions * per;
    gpumem_op_report_free(res);
    if (!all) die("pause", "not every buffer paused");
    if (gpumem_resume(c, &tag, 1, NULL, 0, NULL, NULL) < 0) die("resume", gpumem_last_error());
    uint64_t t2 = bench_ns();
    p[k] = (double)(t1 - t0) / 1e6;
    r[k] = (double)(t2 - t1) / 1e6;
  }
  gpumem_disconnect(c);
  for (unsigned s = 0; s < sessions; s++) gpumem_disconnect(w[s]);
  free(w);
  *pause_ms = bench_median(p, 3);
  *resume_ms = bench_median(r, 3);
}

int main(int argc, char **argv) {
  const char *bin = "build/bin", *backend = "host";
  unsigned sessions = 1000, buffers = 100000;
  static const struct option opts[] = {{"backend", required_argument, 0, 'b'},
                                       {"sessions", required_argument, 0, 's'},
                                       {"buffers", required_argument, 0, 'n'},
                                       {0, 0, 0, 0}};
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    if (ch == 'b') backend = optarg;
    else if (ch == 's') sessions = (unsigned)atoi(optarg);
    else if (ch == 'n') buffers = (unsigned)atoi(optarg);
    else return 2;
  }
  if (optind < argc) bin = argv[optind];
  if (!sessions || buffers < sessions) die("parameters", "buffers must be at least sessions");
  /* Chunks cost descriptors: raise the limit where we may, or measure
   * fewer buffers. */
  struct rlimit rl;
  getrlimit(RLIMIT_NOFILE, &rl);
  FILE *f = fopen("/proc/sys/fs/nr_open", "r");
  unsigned long nr_open = 0;
  if (f && fscanf(f, "%lu", &nr_open) == 1 && nr_open > rl.rlim_max) {
    struct rlimit want = {nr_open, nr_open};
    if (setrlimit(RLIMIT_NOFILE, &want) == 0) rl = want;
  }
  if (f) fclose(f);
  if (rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  bool host = strcmp(backend, "host") == 0;
  /* Every chunk is a descriptor of this process too on the VMM backends
   * (kept for re-registration after a daemon restart); on the host backend
   * the daemon lets one uid's chunks take three eighths of its limit. */
  uint64_t room = rl.rlim_cur > 2ull * sessions + 1024 ? rl.rlim_cur - 2ull * sessions - 1024 : 0;
  if (host && room > rl.rlim_cur / 4 * 3 / 2) room = rl.rlim_cur / 4 * 3 / 2;
  if (room < buffers) {
    buffers = (unsigned)room / sessions * sessions;
    fprintf(stderr, "bench_scale: fd limit %llu: measuring %u buffers instead of 100000\n",
            (unsigned long long)rl.rlim_cur, buffers);
  }
  char sockdir[] = "/tmp/gpumemd-bench-scale.XXXXXX", sock[64], devsize[32], maxbuf[32];
  bench_sockdir(sockdir, sock, sizeof sock);
  snprintf(devsize, sizeof devsize, "%llu", (unsigned long long)buffers * 4096 + (64ull << 20));
  snprintf(maxbuf, sizeof maxbuf, "%u", buffers + 1);
  const char *extra[] = {"--backend", backend, "--host-devices", "1", "--host-device-size", devsize,
                         "--host-granularity", "4K", "--max-buffers-per-session", maxbuf,
                         "--ack-timeout", "120s", NULL};
  pid_t d = bench_daemon(bin, sock, extra);
  double p1, r1, pn, rn;
  measure(sock, "one", 1, buffers, &p1, &r1);
  measure(sock, "many", sessions, buffers / sessions, &pn, &rn);
  bench_daemon_stop(d);
  rmdir(sockdir);
  char name[128];
  snprintf(name, sizeof name, "pause %u sessions x %u buffers (vs 1 x %u, %s)", sessions,
           buffers / sessions, buffers, backend);
  bench_report(name, pn, "ms", p1);
  snprintf(name, sizeof name, "resume %u sessions x %u buffers (vs 1 x %u, %s)", sessions,
           buffers / sessions, buffers, backend);
  bench_report(name, rn, "ms", r1);
  return 0;
}
