#include "stats.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/list.h"

/* Error codes counted one by one; a code past them counts as INTERNAL
 * (the daemon answers only its own codes, so none should). */
#define STATS_CODES 32
/* Duration buckets, in microseconds; the last is +Inf. */
#define STATS_BUCKETS 12
static const uint64_t bucket_le_us[STATS_BUCKETS] = {
    1000,     5000,     10000,    50000,    100000,   500000,
    1000000,  5000000,  10000000, 30000000, 60000000, UINT64_MAX,
};

struct stats_op {
  struct list link; /* stats' running operations */
  bool resume, done;
  char **tags;
  size_t ntags;
  uint32_t pid, uid;
  wire_code result;
  uint64_t bytes_done, bytes_total, copied;
  uint64_t started_ms; /* Unix time */
  uint64_t t0_ns;      /* monotonic, for the duration so far */
  uint64_t duration_us;
};

/* The durations of one kind of operation. */
struct histogram {
  uint64_t bucket[STATS_BUCKETS]; /* not cumulative here */
  uint64_t total, sum_us;
};

struct stats {
  uint64_t t0_ns;
  uint64_t released, restored;
  uint64_t ops[2][STATS_CODES]; /* [resume][code] */
  uint64_t errors[STATS_CODES];
  struct histogram hist[2];
  struct list running;
  struct stats_op *done[STATS_RECENT]; /* a ring: the newest at done[(next - 1) % N] */
  size_t ndone, next;
};

/* What stats_fill hands a reply, in one place to free. */
struct stats_view {
  Gpumem__Wire__OpCount *counts;
  Gpumem__Wire__OpCount **op_countp, **error_countp;
  Gpumem__Wire__OpHistogram hist[2];
  Gpumem__Wire__OpHistogram *histp[2];
  uint64_t cumulative[2][STATS_BUCKETS];
  uint64_t le[STATS_BUCKETS];
  Gpumem__Wire__OpRecord *recs;
  Gpumem__Wire__OpRecord **recp;
};

/* A clock's reading in nanoseconds. */
static uint64_t clock_ns(clockid_t id) {
  struct timespec ts;
  clock_gettime(id, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Codes past the table count as INTERNAL. */
static size_t code_index(wire_code code) {
  return (unsigned)code < STATS_CODES ? (size_t)code : (size_t)GPUMEM__WIRE__ERROR_CODE__INTERNAL;
}

/* Start counting now. */
stats *stats_create(void) {
  stats *st = calloc(1, sizeof *st);
  if (!st) return NULL;
  st->t0_ns = clock_ns(CLOCK_MONOTONIC);
  list_init(&st->running);
  return st;
}

/* Free a record and its tags. */
static void op_free(struct stats_op *r) {
  for (size_t i = 0; i < r->ntags; i++) free(r->tags[i]);
  free(r->tags);
  free(r);
}

/* Free the figures and every record. */
void stats_destroy(stats *st) {
  if (!st) return;
  struct list *p, *t;
  list_for_each_safe(p, t, &st->running) op_free(list_entry(p, struct stats_op, link));
  for (size_t i = 0; i < STATS_RECENT; i++)
    if (st->done[i]) op_free(st->done[i]);
  free(st);
}

/* A record in flight for an operation that starts running. */
struct stats_op *stats_op_begin(stats *st, bool resume, char *const *tags, size_t ntags,
                                uint32_t pid, uint32_t uid) {
  struct stats_op *r = calloc(1, sizeof *r);
  if (!r || !(r->tags = calloc(ntags + 1, sizeof *r->tags))) {
    free(r);
    return NULL;
  }
  for (; r->ntags < ntags; r->ntags++)
    if (!(r->tags[r->ntags] = strdup(tags[r->ntags]))) {
      op_free(r);
      return NULL;
    }
  r->resume = resume;
  r->pid = pid;
  r->uid = uid;
  r->started_ms = clock_ns(CLOCK_REALTIME) / 1000000u;
  r->t0_ns = clock_ns(CLOCK_MONOTONIC);
  list_append(&st->running, &r->link);
  return r;
}

/* The operation covers more device memory. */
void stats_op_cover(struct stats_op *r, uint64_t bytes) {
  if (r) r->bytes_total += bytes;
}

/* More of the operation's memory released or remapped, more copied. */
void stats_op_progress(struct stats_op *r, uint64_t bytes, uint64_t copied) {
  if (!r) return;
  r->bytes_done += bytes;
  r->copied += copied;
}

/* Count an operation that ended and keep its record with the last ones. */
void stats_op_end(stats *st, struct stats_op *r, wire_code result, uint64_t bytes,
                  uint64_t copied, uint64_t duration_us) {
  if (!r) return;
  list_remove(&r->link);
  r->done = true;
  r->result = result;
  r->bytes_done = bytes;
  r->copied = copied;
  r->duration_us = duration_us;
  st->ops[r->resume][code_index(result)]++;
  struct histogram *h = &st->hist[r->resume];
  size_t b = 0;
  while (duration_us > bucket_le_us[b]) b++; /* the last bound takes every value */
  h->bucket[b]++;
  h->total++;
  h->sum_us += duration_us;
  if (st->done[st->next]) op_free(st->done[st->next]);
  st->done[st->next] = r;
  st->next = (st->next + 1) % STATS_RECENT;
  if (st->ndone < STATS_RECENT) st->ndone++;
}

/* Device bytes released by a pause or given back by a resume. */
void stats_bytes(stats *st, bool resume, uint64_t bytes) {
  if (resume)
    st->restored += bytes;
  else
    st->released += bytes;
}

/* An error was answered to a request. */
void stats_error(stats *st, wire_code code) {
  if (code != GPUMEM__WIRE__ERROR_CODE__OK) st->errors[code_index(code)]++;
}

/* One record as the wire has it; its tags point into r. */
static void record_info(Gpumem__Wire__OpRecord *o, const struct stats_op *r, uint64_t now_ns) {
  gpumem__wire__op_record__init(o);
  o->resume = r->resume;
  o->tags = r->tags;
  o->n_tags = r->ntags;
  o->pid = r->pid;
  o->done = r->done;
  o->result = r->done ? r->result : GPUMEM__WIRE__ERROR_CODE__OK;
  o->bytes_done = r->bytes_done;
  o->bytes_total = r->bytes_total;
  o->copied_bytes = r->copied;
  o->started_ms = r->started_ms;
  o->duration_us = r->done ? r->duration_us : (now_ns - r->t0_ns) / 1000u;
}

/* Counts by kind and code: OK always (so that the series exist from the
 * start), other codes once they happened; then errors by code. */
static void fill_counts(const stats *st, struct stats_view *v, Gpumem__Wire__StatusReply *r) {
  size_t n = 0;
  for (int k = 0; k < 2; k++)
    for (size_t c = 0; c < STATS_CODES; c++) {
      if (c != GPUMEM__WIRE__ERROR_CODE__OK && !st->ops[k][c]) continue;
      Gpumem__Wire__OpCount *o = &v->counts[n];
      gpumem__wire__op_count__init(o);
      o->resume = k;
      o->code = (wire_code)c;
      o->count = st->ops[k][c];
      v->op_countp[r->n_op_counts++] = o;
      n++;
    }
  for (size_t c = 0; c < STATS_CODES; c++) {
    if (!st->errors[c]) continue;
    Gpumem__Wire__OpCount *o = &v->counts[n++];
    gpumem__wire__op_count__init(o);
    o->code = (wire_code)c;
    o->count = st->errors[c];
    v->error_countp[r->n_error_counts++] = o;
  }
  r->op_counts = v->op_countp;
  r->error_counts = v->error_countp;
}

/* Both histograms, cumulative as Prometheus has them. */
static void fill_histograms(const stats *st, struct stats_view *v, Gpumem__Wire__StatusReply *r) {
  memcpy(v->le, bucket_le_us, sizeof v->le);
  for (int k = 0; k < 2; k++) {
    Gpumem__Wire__OpHistogram *h = &v->hist[k];
    gpumem__wire__op_histogram__init(h);
    h->resume = k;
    uint64_t sum = 0;
    for (size_t b = 0; b < STATS_BUCKETS; b++) {
      sum += st->hist[k].bucket[b];
      v->cumulative[k][b] = sum;
    }
    h->le_us = v->le;
    h->n_le_us = STATS_BUCKETS;
    h->count = v->cumulative[k];
    h->n_count = STATS_BUCKETS;
    h->total = st->hist[k].total;
    h->sum_us = st->hist[k].sum_us;
    v->histp[k] = h;
  }
  r->histograms = v->histp;
  r->n_histograms = 2;
}

/* The running operations, oldest first, then the done ones, newest first
 * (those uid asked for, unless all). */
static void fill_records(const stats *st, struct stats_view *v, Gpumem__Wire__StatusReply *r,
                         bool all, uint32_t uid) {
  uint64_t now = clock_ns(CLOCK_MONOTONIC);
  size_t n = 0;
  for (const struct list *p = st->running.next; p != &st->running; p = p->next) {
    const struct stats_op *op = list_entry(p, struct stats_op, link);
    if (!all && op->uid != uid) continue;
    record_info(&v->recs[n], op, now);
    v->recp[n] = &v->recs[n];
    n++;
  }
  for (size_t i = 0; i < st->ndone; i++) {
    size_t at = (st->next + STATS_RECENT - 1 - i) % STATS_RECENT;
    if (!all && st->done[at]->uid != uid) continue;
    record_info(&v->recs[n], st->done[at], now);
    v->recp[n] = &v->recs[n];
    n++;
  }
  r->recent_ops = v->recp;
  r->n_recent_ops = n;
}

/* Fill the figures into a status reply. */
struct stats_view *stats_fill(const stats *st, Gpumem__Wire__StatusReply *r, bool all,
                              uint32_t uid) {
  r->uptime_ms = (clock_ns(CLOCK_MONOTONIC) - st->t0_ns) / 1000000u;
  r->bytes_released = st->released;
  r->bytes_restored = st->restored;
  size_t nrec = st->ndone;
  for (const struct list *p = st->running.next; p != &st->running; p = p->next) nrec++;
  struct stats_view *v = calloc(1, sizeof *v);
  size_t ncounts = 3 * STATS_CODES;
  if (!v || !(v->counts = calloc(ncounts, sizeof *v->counts)) ||
      !(v->op_countp = calloc(ncounts, sizeof *v->op_countp)) ||
      !(v->error_countp = calloc(ncounts, sizeof *v->error_countp)) ||
      !(v->recs = calloc(nrec + 1, sizeof *v->recs)) ||
      !(v->recp = calloc(nrec + 1, sizeof *v->recp))) {
    stats_view_free(v);
    return NULL;
  }
  fill_counts(st, v, r);
  fill_histograms(st, v, r);
  fill_records(st, v, r, all, uid);
  return v;
}

/* Free what stats_fill made. */
void stats_view_free(struct stats_view *v) {
  if (!v) return;
  free(v->counts);
  free(v->op_countp);
  free(v->error_countp);
  free(v->recs);
  free(v->recp);
  free(v);
}
