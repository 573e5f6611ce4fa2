/* What a status costs as the node fills with processes: the host backend
 * models the driver's per-process figures from /proc, so every process on
 * the node is a place to look. Measured in one run: a status with 10 idle
 * processes of this benchmark's (the baseline), with 1,000, and with one
 * process holding 15,000 descriptors and 60,000 mappings; then with 7,000
 * tags held by 1,000 sessions against 10 tags of 10 sessions (as many
 * tags as one uid's chunks may take of a descriptor limit of 20,000). Ten
 * statuses a second for 4 s each, as gpumemctl top asks (median, mean and
 * largest).
 *   bench_status [--backend host|cuda|hip] BUILD/bin */
#include <errno.h>
#include <stdbool.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <fcntl.h>

#include "bench.h"
#include "gpumem.h"

#define RUNS 40
#define PACE_MS 100

static void die(const char *what, const char *why) {
  fprintf(stderr, "bench_status: %s: %s\n", what, why);
  exit(1);
}

/* Children that wait, each in read() on one pipe, until it closes. */
struct idle {
  int wr;
  pid_t *pids;
  unsigned n;
};

/* Fork n children that hold what setup makes (NULL: nothing) and wait on
 * one pipe; they are ready when this returns. */
static void idle_start(struct idle *w, unsigned n, void (*setup)(void)) {
  int p[2], ready[2];
  if (pipe(p) || pipe(ready)) die("pipe", strerror(errno));
  w->pids = calloc(n, sizeof *w->pids);
  w->n = n;
  for (unsigned i = 0; i < n; i++) {
    w->pids[i] = fork();
    if (w->pids[i] < 0) die("fork", strerror(errno));
    if (w->pids[i] == 0) {
      close(p[1]);
      close(ready[0]);
      if (setup) setup();
      if (write(ready[1], "r", 1) != 1) _exit(1);
      char c;
      while (read(p[0], &c, 1) > 0) {
      }
      _exit(0);
    }
  }
  close(p[0]);
  close(ready[1]);
  for (unsigned i = 0; i < n; i++) {
    char c;
    if (read(ready[0], &c, 1) != 1) die("child", "did not start");
  }
  close(ready[0]);
  w->wr = p[1];
}

/* End the children and reap them. */
static void idle_stop(struct idle *w) {
  close(w->wr);
  for (unsigned i = 0; i < w->n; i++) waitpid(w->pids[i], NULL, 0);
  free(w->pids);
}

/* A heavy process: 15,000 descriptors and 60,000 mappings. */
static void heavy(void) {
  struct rlimit rl = {16384, 16384};
  setrlimit(RLIMIT_NOFILE, &rl);
  for (int i = 0; i < 15000; i++)
    if (open("/dev/null", O_RDONLY) < 0) _exit(1);
  long page = sysconf(_SC_PAGESIZE);
  size_t pages = 60000; /* every other page protected: a mapping each */
  char *m = mmap(NULL, pages * (size_t)page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) _exit(1);
  for (size_t i = 0; i < pages; i += 2)
    if (mprotect(m + i * (size_t)page, (size_t)page, PROT_NONE)) _exit(1);
}

/* Milliseconds of RUNS statuses, one every PACE_MS as a live view asks
 * (top: ten a second), into ms; their mean back. */
static double statuses(gpumem_client *c, double *ms) {
  double sum = 0;
  for (int i = 0; i < RUNS; i++) {
    struct gpumem_status *s;
    uint64_t t0 = bench_ns();
    if (gpumem_status(c, &s) < 0) die("status", gpumem_last_error());
    ms[i] = (double)(bench_ns() - t0) / 1e6;
    sum += ms[i];
    gpumem_status_free(s);
    usleep(PACE_MS * 1000);
  }
  return sum / RUNS;
}

/* The largest of n figures. */
static double most(const double *v, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; i++) m = v[i] > m ? v[i] : m;
  return m;
}

/* n sessions of the worker role holding per buffers each, every buffer
 * in a tag of its own (t<session>.<i>). */
static gpumem_client **tagged(const char *sock, unsigned n, unsigned per) {
  gpumem_client **w = calloc(n, sizeof *w);
  for (unsigned s = 0; s < n; s++) {
    if (gpumem_connect(sock, "bench-tags", GPUMEM_ROLE_WORKER, 0, &w[s]) < 0)
      die("connect", gpumem_last_error());
    for (unsigned i = 0; i < per; i++) {
      char tag[32];
      gpumem_buffer *b;
      snprintf(tag, sizeof tag, "t%u.%u", s, i);
      if (gpumem_alloc(w[s], tag, 0, 1, 0, &b) < 0) die("alloc", gpumem_last_error());
    }
  }
  return w;
}

/* Close n sessions. */
static void untagged(gpumem_client **w, unsigned n) {
  for (unsigned s = 0; s < n; s++) gpumem_disconnect(w[s]);
  free(w);
}

int main(int argc, char **argv) {
  const char *bin = "build/bin", *backend = "host";
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc) backend = argv[++i];
    else bin = argv[i];
  }
  char dir[] = "/tmp/gpumemd-bench-status.XXXXXX", sock[64];
  bench_sockdir(dir, sock, sizeof sock);
  struct rlimit rl;
  getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);
  const char *extra[] = {"--backend", backend, "--host-devices", "1", "--host-granularity", "4K",
                         "--host-device-size", "1G", NULL};
  if (strcmp(backend, "host") != 0) extra[2] = NULL; /* the simulated devices' flags: host only */
  pid_t d = bench_daemon(bin, sock, extra);
  gpumem_client *c;
  if (gpumem_connect(sock, "bench-status", GPUMEM_ROLE_CONTROLLER, GPUMEM_CONNECT_NO_THREAD, &c) <
      0)
    die("connect", gpumem_last_error());
  static double few[2 * RUNS], many[RUNS], big[RUNS];
  struct idle w10, w990, w1;
  idle_start(&w10, 10, NULL);
  double few_mean = statuses(c, few);
  idle_start(&w990, 990, NULL);
  double many_mean = statuses(c, many);
  idle_stop(&w990);
  idle_start(&w1, 1, heavy);
  double big_mean = statuses(c, big);
  idle_stop(&w1);
  few_mean = (few_mean + statuses(c, few + RUNS)) / 2; /* again, after: drift counts against it */
  idle_stop(&w10);
  static double tags10[RUNS], tags7k[RUNS];
  gpumem_client **w = tagged(sock, 10, 1);
  double tags10_mean = statuses(c, tags10);
  untagged(w, 10);
  w = tagged(sock, 1000, 7);
  double tags7k_mean = statuses(c, tags7k);
  untagged(w, 1000);
  gpumem_disconnect(c);
  bench_daemon_stop(d);
  rmdir(dir);
  double few_most = most(few, 2 * RUNS), base = bench_median(few, 2 * RUNS);
  char name[128];
  snprintf(name, sizeof name, "status median, 1000 processes (vs 10, %s)", backend);
  bench_report(name, bench_median(many, RUNS), "ms", base);
  snprintf(name, sizeof name, "status mean, 1000 processes (vs 10, %s)", backend);
  bench_report(name, many_mean, "ms", few_mean);
  snprintf(name, sizeof name, "status max, 1000 processes (vs 10, %s)", backend);
  bench_report(name, most(many, RUNS), "ms", few_most);
  snprintf(name, sizeof name, "status median, 15k fds 60k maps (vs 10, %s)", backend);
  bench_report(name, bench_median(big, RUNS), "ms", base);
  snprintf(name, sizeof name, "status mean, 15k fds 60k maps (vs 10, %s)", backend);
  bench_report(name, big_mean, "ms", few_mean);
  snprintf(name, sizeof name, "status max, 15k fds 60k maps (vs 10, %s)", backend);
  bench_report(name, most(big, RUNS), "ms", few_most);
  snprintf(name, sizeof name, "status median, 7000 tags 1000 sessions (vs 10, %s)", backend);
  bench_report(name, bench_median(tags7k, RUNS), "ms", bench_median(tags10, RUNS));
  snprintf(name, sizeof name, "status mean, 7000 tags 1000 sessions (vs 10, %s)", backend);
  bench_report(name, tags7k_mean, "ms", tags10_mean);
  snprintf(name, sizeof name, "status max, 7000 tags 1000 sessions (vs 10, %s)", backend);
  bench_report(name, most(tags7k, RUNS), "ms", most(tags10, RUNS));
  return 0;
}
