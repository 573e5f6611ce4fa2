/* What the journal costs: alloc+free round trips, and pause and resume of
 * one tag's buffers, through a daemon that keeps its journal against one
 * started with --journal none, a fresh pair each round, their operations
 * interleaved one by one. Each figure is the median of the rounds'
 * medians; the target is a ratio under 1.05. */
#include <stdbool.h>
#include <sys/stat.h>

#include "bench.h"
#include "gpumem.h"

#define ALLOCS 2000   /* round trips per round */
#define BUFFERS 1000  /* buffers of the paused tag */
#define ROUNDS 15
#define OPS 4        /* pauses and resumes of each daemon per round */

/* One daemon and its worker. */
struct side {
  char sockdir[80], sock[100];
  pid_t pid;
  gpumem_client *c;
  gpumem_buffer *bufs[BUFFERS];
  uint64_t alloc[ROUNDS], pause[ROUNDS], resume[ROUNDS];
};

/* Fail the benchmark with the library's words. */
static void die(const char *what) {
  fprintf(stderr, "bench_journal: %s: %s\n", what, gpumem_last_error());
  exit(1);
}

/* Start a daemon (journal or none) and a worker holding BUFFERS buffers. */
static void start(struct side *s, const char *bin, const char *backend, const char *dir,
                  bool journal) {
  snprintf(s->sockdir, sizeof s->sockdir, "%s/gpumemd-bench-journal.XXXXXX", dir);
  bench_sockdir(s->sockdir, s->sock, sizeof s->sock);
  const char *extra[] = {"--backend",          backend, "--host-devices",     "1",
                         "--host-device-size", "4G",    "--host-granularity", "4K",
                         "--journal",          "none",  NULL};
  if (journal) extra[8] = NULL; /* the default journal, next to the socket */
  s->pid = bench_daemon(bin, s->sock, extra);
  if (gpumem_connect(s->sock, "bench", GPUMEM_ROLE_WORKER, 0, &s->c) < 0) die("connect");
  for (int i = 0; i < BUFFERS; i++)
    if (gpumem_alloc(s->c, "held", 0, 4096, 0, &s->bufs[i]) < 0) die("alloc");
}

/* One alloc+free on s: its time in ns. */
static uint64_t alloc_free(struct side *s) {
  gpumem_buffer *b;
  uint64_t t0 = bench_ns();
  if (gpumem_alloc(s->c, "bench", 0, 4096, 0, &b) < 0 || gpumem_free(s->c, b) < 0)
    die("alloc+free");
  return bench_ns() - t0;
}

/* A pause and a resume of s's held tag, their times in ns. */
static void pause_resume(struct side *s, uint64_t *pause, uint64_t *resume) {
  const char *tags[] = {"held"};
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.scope = GPUMEM_SCOPE_OWN;
  uint64_t t0 = bench_ns();
  if (gpumem_pause(s->c, tags, 1, NULL, 0, &o, NULL) < 0) die("pause");
  uint64_t t1 = bench_ns();
  if (gpumem_resume(s->c, tags, 1, NULL, 0, &o, NULL) < 0) die("resume");
  *pause = t1 - t0;
  *resume = bench_ns() - t1;
}

/* One round on a fresh pair: ALLOCS alloc+free on each, one after the
 * other's (the order turning each time), their medians; then OPS pauses
 * and resumes of each in turn, their medians. */
static void round_of(struct side *a, struct side *b, int r) {
  static uint64_t ta[ALLOCS], tb[ALLOCS];
  for (int i = 0; i < ALLOCS; i++) {
    if (i % 2) {
      ta[i] = alloc_free(a);
      tb[i] = alloc_free(b);
    } else {
      tb[i] = alloc_free(b);
      ta[i] = alloc_free(a);
    }
  }
  a->alloc[r] = (uint64_t)bench_percentile(ta, ALLOCS, 50);
  b->alloc[r] = (uint64_t)bench_percentile(tb, ALLOCS, 50);
  uint64_t pa[OPS], ra[OPS], pb[OPS], rb[OPS];
  for (int k = 0; k < OPS; k++) {
    pause_resume(k % 2 ? a : b, k % 2 ? &pa[k] : &pb[k], k % 2 ? &ra[k] : &rb[k]);
    pause_resume(k % 2 ? b : a, k % 2 ? &pb[k] : &pa[k], k % 2 ? &rb[k] : &ra[k]);
  }
  a->pause[r] = (uint64_t)bench_percentile(pa, OPS, 50);
  a->resume[r] = (uint64_t)bench_percentile(ra, OPS, 50);
  b->pause[r] = (uint64_t)bench_percentile(pb, OPS, 50);
  b->resume[r] = (uint64_t)bench_percentile(rb, OPS, 50);
}

/* Stop the worker and the daemon. */
static void stop(struct side *s) {
  gpumem_disconnect(s->c);
  bench_daemon_stop(s->pid);
  char cmd[120];
  snprintf(cmd, sizeof cmd, "rm -rf %s", s->sockdir);
  if (system(cmd) != 0) fprintf(stderr, "bench_journal: %s failed\n", cmd);
}

int main(int argc, char **argv) {
  const char *bin = "build/bin", *backend = "host";
  /* tmpfs, as /run is under systemd, where the journal lives */
  struct stat shm;
  const char *dir = stat("/dev/shm", &shm) == 0 && S_ISDIR(shm.st_mode) ? "/dev/shm" : "/tmp";
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc)
      backend = argv[++i];
    else if (strcmp(argv[i], "--dir") == 0 && i + 1 < argc)
      dir = argv[++i];
    else
      bin = argv[i];
  }
  static struct side with, without;
  /* Fresh daemons each round, started in turn first: the daemon started
   * first measured up to 10% slower than its twin with both keeping no
   * journal, so a pair kept for the whole run would bias the ratio. */
  for (int r = 0; r < ROUNDS; r++) {
    struct side *first = r % 2 ? &with : &without, *second = r % 2 ? &without : &with;
    start(first, bin, backend, dir, first == &with);
    start(second, bin, backend, dir, second == &with);
    round_of(first, second, r);
    struct stat st; /* the figures mean nothing unless one daemon really kept a journal */
    char path[120];
    snprintf(path, sizeof path, "%s.journal", with.sock);
    if (stat(path, &st) < 0 || st.st_size == 0) die("the journal daemon kept no journal");
    snprintf(path, sizeof path, "%s.journal", without.sock);
    if (stat(path, &st) == 0) die("the --journal none daemon kept a journal");
    stop(&with);
    stop(&without);
  }
  char name[96];
  snprintf(name, sizeof name, "alloc+free with journal (%s, vs none)", backend);
  bench_report(name, bench_percentile(with.alloc, ROUNDS, 50) / 1000, "us",
               bench_percentile(without.alloc, ROUNDS, 50) / 1000);
  snprintf(name, sizeof name, "pause of %d buffers with journal (%s, vs none)", BUFFERS,
           backend);
  bench_report(name, bench_percentile(with.pause, ROUNDS, 50) / 1e6, "ms",
               bench_percentile(without.pause, ROUNDS, 50) / 1e6);
  snprintf(name, sizeof name, "resume of %d buffers with journal (%s, vs none)", BUFFERS,
           backend);
  bench_report(name, bench_percentile(with.resume, ROUNDS, 50) / 1e6, "ms",
               bench_percentile(without.resume, ROUNDS, 50) / 1e6);
  return 0;
}
