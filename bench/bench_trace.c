/* Many allocations, as PyTorch makes segments: a trace of allocations and
 * frees (sizes log-uniform, 512 KiB to 64 MiB by default; the live set
 * bounded) run (a) through gpumem_malloc and gpumem_free_ptr against the
 * daemon and (b) with the backend's own calls in one process, each
 * allocation its own chunk (create, reserve, map, set access; on free
 * unmap, release, free the range), the baseline, in the same run. */
#include <getopt.h>
#include <math.h>
#include <stdbool.h>

#include "bench.h"
#include "common/size.h"
#include "gpu/gpudev.h"
#include "gpu/gpuva.h"
#include "gpumem.h"

struct params {
  const char *bin, *backend;
  unsigned count, max_live, rounds;
  uint64_t min, max, max_bytes, seed;
};

/* One step of the trace: allocate size bytes into slot, or free slot. */
struct step {
  bool alloc;
  unsigned slot;
  uint64_t size;
};

/* What one way of running the trace measured. */
struct run {
  double total_ms;
  uint64_t *alloc_ns, *free_ns;
  size_t nalloc, nfree;
};

/* Say what failed and stop. */
static void die(const char *what, const char *why) {
  fprintf(stderr, "bench_trace: %s: %s\n", what, why);
  exit(1);
}

/* xorshift64*: the trace is the same for a seed on every machine. */
static uint64_t next_rand(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545f4914f6cdd1dull;
}

/* A uniform double in [0, 1). */
static double uniform(uint64_t *s) { return (double)(next_rand(s) >> 11) / 9007199254740992.0; }

/* Build the trace: count allocations, each freed later; an allocation
 * comes when the live set has room and a coin says so, else a free of a
 * random live one; everything left is freed at the end. */
static struct step *make_trace(const struct params *p, size_t *n) {
  struct step *t = calloc(2 * (size_t)p->count, sizeof *t);
  unsigned *live = calloc(p->max_live, sizeof *live);
  uint64_t *sizes = calloc(p->max_live, sizeof *sizes);
  if (!t || !live || !sizes) die("trace", "out of memory");
  uint64_t s = p->seed ? p->seed : 1, bytes = 0;
  unsigned nlive = 0, made = 0;
  double lo = log((double)p->min), hi = log((double)p->max);
  uint64_t want = size_round_up((uint64_t)exp(lo + uniform(&s) * (hi - lo)), 512);
  size_t k = 0;
  while (made < p->count || nlive) {
    bool room = nlive < p->max_live && bytes + want <= p->max_bytes;
    bool alloc = made < p->count && room && (nlive == 0 || (next_rand(&s) & 1));
    if (alloc) {
      /* Slots are live[0..nlive); a slot number is its index at the time. */
      t[k++] = (struct step){true, nlive, want};
      sizes[nlive] = want;
      live[nlive++] = made++;
      bytes += want;
      want = size_round_up((uint64_t)exp(lo + uniform(&s) * (hi - lo)), 512);
    } else {
      if (!nlive) die("trace", "--max-bytes is smaller than --max");
      unsigned i = (unsigned)(next_rand(&s) % nlive);
      t[k++] = (struct step){false, i, sizes[i]};
      bytes -= sizes[i];
      /* The last live one takes the freed slot, in the runners too. */
      nlive--;
      live[i] = live[nlive];
      sizes[i] = sizes[nlive];
    }
  }
  free(live);
  free(sizes);
  *n = k;
  return t;
}

/* Allocate and free through one interface, timing each call. */
struct way {
  void *state;
  int (*alloc)(void *state, unsigned slot, uint64_t size);
  void (*free)(void *state, unsigned slot, unsigned last);
};

/* Run the trace one way. */
static void run_trace(const struct step *t, size_t n, const struct way *w, struct run *r) {
  r->nalloc = r->nfree = 0;
  unsigned nlive = 0;
  uint64_t start = bench_ns();
  for (size_t i = 0; i < n; i++) {
    uint64_t t0 = bench_ns();
    if (t[i].alloc) {
      if (w->alloc(w->state, t[i].slot, t[i].size) < 0) die("alloc", gpumem_last_error());
      r->alloc_ns[r->nalloc++] = bench_ns() - t0;
      nlive++;
    } else {
      w->free(w->state, t[i].slot, --nlive);
      r->free_ns[r->nfree++] = bench_ns() - t0;
    }
  }
  r->total_ms = (double)(bench_ns() - start) / 1e6;
}

/* (a): gpumem_malloc against the daemon. */
struct pooled {
  gpumem_client *c;
  void **ptr;
};

/* gpumem_malloc into a slot. */
static int pooled_alloc(void *state, unsigned slot, uint64_t size) {
  struct pooled *s = state;
  return gpumem_malloc(s->c, "trace", 0, size, 0, &s->ptr[slot]);
}

/* gpumem_free_ptr of a slot; the last live slot moves into it. */
static void pooled_free(void *state, unsigned slot, unsigned last) {
  struct pooled *s = state;
  if (gpumem_free_ptr(s->c, s->ptr[slot]) < 0) die("free", gpumem_last_error());
  s->ptr[slot] = s->ptr[last];
}

/* (b): one chunk per allocation, mapped at its own range. */
struct direct {
  gpudev *d;
  gpuva *g;
  uint64_t gran;
  void **va;
  uint64_t *handle, *size;
};

/* A chunk of its own, mapped at a range of its own. */
static int direct_alloc(void *state, unsigned slot, uint64_t size) {
  struct direct *s = state;
  uint64_t sz = size_round_up(size, s->gran);
  if (gpudev_chunk_create(s->d, 0, sz, &s->handle[slot]) < 0) die("create", gpu_error());
  if (gpuva_reserve(s->g, 0, sz, &s->va[slot]) < 0) die("reserve", gpu_error());
  if (gpuva_map(s->g, 0, s->va[slot], sz, s->handle[slot]) < 0) die("map", gpu_error());
  if (gpuva_set_access(s->g, 0, s->va[slot], sz) < 0) die("access", gpu_error());
  s->size[slot] = sz;
  return 0;
}

/* Unmap, release and free the range of a slot; the last live slot moves into it. */
static void direct_free(void *state, unsigned slot, unsigned last) {
  struct direct *s = state;
  if (gpuva_unmap(s->g, 0, s->va[slot], s->size[slot]) < 0) die("unmap", gpu_error());
  gpudev_chunk_release(s->d, 0, s->handle[slot], s->size[slot]);
  gpuva_free(s->g, 0, s->va[slot], s->size[slot]);
  s->va[slot] = s->va[last];
  s->handle[slot] = s->handle[last];
  s->size[slot] = s->size[last];
}

/* Microseconds of the median of n samples. */
static double p50_us(uint64_t *v, size_t n) { return bench_percentile(v, n, 50) / 1e3; }

/* Build the trace, run it both ways, report. */
int main(int argc, char **argv) {
  struct params p = {"build/bin", "host", 10000, 64, 1, 512ull << 10, 64ull << 20, 4ull << 30,
                     42};
  static const struct option opts[] = {
      {"backend", required_argument, 0, 'b'},  {"count", required_argument, 0, 'n'},
      {"max-live", required_argument, 0, 'l'}, {"max-bytes", required_argument, 0, 'B'},
      {"min", required_argument, 0, 'm'},      {"max", required_argument, 0, 'M'},
      {"seed", required_argument, 0, 's'},     {"rounds", required_argument, 0, 'r'},
      {0, 0, 0, 0},
  };
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (ch) {
    case 'b': p.backend = optarg; break;
    case 'n': p.count = (unsigned)atoi(optarg); break;
    case 'l': p.max_live = (unsigned)atoi(optarg); break;
    case 'B': if (size_parse(optarg, &p.max_bytes)) die("--max-bytes", optarg); break;
    case 'm': if (size_parse(optarg, &p.min)) die("--min", optarg); break;
    case 'M': if (size_parse(optarg, &p.max)) die("--max", optarg); break;
    case 's': p.seed = strtoull(optarg, NULL, 0); break;
    case 'r': p.rounds = (unsigned)atoi(optarg); break;
    default: return 2;
    }
  }
  if (optind < argc) p.bin = argv[optind];
  if (!p.count || !p.max_live || !p.rounds || p.rounds > 15 || !p.min || p.min > p.max ||
      p.max > p.max_bytes)
    die("parameters", "need count, max-live, rounds (<= 15) > 0 and min <= max <= max-bytes");
  size_t n;
  struct step *t = make_trace(&p, &n);

  /* The daemon's device holds the live set and the pool's slack. */
  char sockdir[] = "/tmp/gpumemd-bench-trace.XXXXXX", sock[64], devsize[32];
  /* A private directory: gpumemd refuses one others can write (/tmp). */
  if (!mkdtemp(sockdir)) die("mkdtemp", sockdir);
  snprintf(sock, sizeof sock, "%s/sock", sockdir);
  snprintf(devsize, sizeof devsize, "%llu", (unsigned long long)(2 * p.max_bytes + (2ull << 30)));
  const char *extra[] = {"--backend", p.backend, "--host-devices", "1", "--host-device-size",
                         devsize, NULL};
  pid_t d = bench_daemon(p.bin, sock, extra);

  struct gpudev_options o = {.backend = p.backend, .host_devices = 1,
                             .host_device_size = 2 * p.max_bytes + (2ull << 30)};
  char err[256];
  struct direct dir = {0};
  if (gpudev_open(&o, &dir.d, err, sizeof err) < 0 ||
      gpuva_open(p.backend, &dir.g, err, sizeof err) < 0)
    die("backend", err);
  dir.gran = gpudev_granularity(dir.d);
  dir.va = calloc(p.max_live, sizeof *dir.va);
  dir.handle = calloc(p.max_live, sizeof *dir.handle);
  dir.size = calloc(p.max_live, sizeof *dir.size);
  struct pooled pool = {.ptr = calloc(p.max_live, sizeof *pool.ptr)};
  struct run a = {.alloc_ns = calloc(p.count, 8), .free_ns = calloc(p.count, 8)};
  struct run b = {.alloc_ns = calloc(p.count, 8), .free_ns = calloc(p.count, 8)};
  if (!dir.va || !dir.handle || !dir.size || !pool.ptr || !a.alloc_ns || !a.free_ns ||
      !b.alloc_ns || !b.free_ns)
    die("setup", "out of memory");
  struct way way_a = {&pool, pooled_alloc, pooled_free};
  struct way way_b = {&dir, direct_alloc, direct_free};

  /* Each round: the baseline, then a new client through the daemon (its
   * pools start empty, so their growth is counted every round). */
  double ta[16], tb[16], a_alloc = 0, a_free = 0, b_alloc = 0, b_free = 0;
  struct gpumem_pool_stats st = {.size = sizeof st};
  for (unsigned r = 0; r < p.rounds; r++) {
    run_trace(t, n, &way_b, &b);
    tb[r] = b.total_ms;
    if (gpumem_connect(sock, "bench-trace", GPUMEM_ROLE_WORKER, 0, &pool.c) < 0)
      die("connect", gpumem_last_error());
    run_trace(t, n, &way_a, &a);
    ta[r] = a.total_ms;
    gpumem_pool_stats(pool.c, &st);
    gpumem_disconnect(pool.c);
    if (r + 1 == p.rounds) {
      a_alloc = p50_us(a.alloc_ns, a.nalloc);
      a_free = p50_us(a.free_ns, a.nfree);
      b_alloc = p50_us(b.alloc_ns, b.nalloc);
      b_free = p50_us(b.free_ns, b.nfree);
    }
  }
  bench_daemon_stop(d);
  rmdir(sockdir);
  gpuva_close(dir.g);
  gpudev_close(dir.d);

  char name[128], lo[32], hi[32], cap[32];
  size_format(p.min, lo, sizeof lo);
  size_format(p.max, hi, sizeof hi);
  size_format(p.max_bytes, cap, sizeof cap);
  printf("trace: %u allocations %s..%s, at most %u live or %s; pool: %llu daemon allocations,"
         " %llu buffers (%.1f MiB) at the end\n",
         p.count, lo, hi, p.max_live, cap, (unsigned long long)st.daemon_allocs,
         (unsigned long long)st.pooled_buffers, (double)st.pooled_bytes / (1 << 20));
  snprintf(name, sizeof name, "trace %u allocs+frees total (%s)", p.count, p.backend);
  bench_report(name, bench_median(ta, p.rounds), "ms", bench_median(tb, p.rounds));
  snprintf(name, sizeof name, "trace malloc p50 (%s)", p.backend);
  bench_report(name, a_alloc, "us", b_alloc);
  snprintf(name, sizeof name, "trace free p50 (%s)", p.backend);
  bench_report(name, a_free, "us", b_free);
  snprintf(name, sizeof name, "trace daemon allocations (%s)", p.backend);
  bench_report(name, (double)st.daemon_allocs, "count", (double)p.count);
  free(t);
  free(dir.va);
  free(dir.handle);
  free(dir.size);
  free(pool.ptr);
  free(a.alloc_ns);
  free(a.free_ns);
  free(b.alloc_ns);
  free(b.free_ns);
  return 0;
}
