/* What the daemon counts since it started, as a controller reads it
 * through libgpumem's status: pauses and resumes by result, the bytes
 * they released and gave back, their durations, errors answered to any
 * request, and the record of the operations running and recently done,
 * with the progress of one in flight seen from another connection. A real
 * daemon on the host backend; raw workers answer (or do not) exactly as
 * each test needs, real gpumem-worker processes where a stopped one is
 * the point. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

#include "common/wire.h"
#include "gpumem.h"
#include "harness.h"
#include "scenario.h"

static struct daemon d;

static void teardown(void) { scene_stop(&d); }

/* A controller of the library, connected to d. */
static gpumem_client *controller(void) {
  gpumem_client *c;
  ck_assert_int_eq(gpumem_connect(d.socket, "stats-test", GPUMEM_ROLE_CONTROLLER,
                                  GPUMEM_CONNECT_NO_THREAD | GPUMEM_CONNECT_NO_RECONNECT |
                                      GPUMEM_CONNECT_NODE_DEVICES,
                                  &c),
                   0);
  return c;
}

/* The status, through the library. */
static struct gpumem_status *status_of(gpumem_client *c) {
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_uint_eq(s->size, sizeof *s);
  return s;
}

/* The count of op ("" for errors) with name, 0 if there is none. */
static uint64_t counted(struct gpumem_counter **v, size_t n, const char *op, const char *name) {
  for (size_t i = 0; i < n; i++)
    if (strcmp(v[i]->op, op) == 0 && strcmp(v[i]->name, name) == 0) return v[i]->count;
  return 0;
}

/* Operations of one kind that ended with name. */
static uint64_t ops(const struct gpumem_status *s, const char *op, const char *name) {
  return counted(s->op_counts, s->nop_counts, op, name);
}

/* Errors answered with name. */
static uint64_t errors(const struct gpumem_status *s, const char *name) {
  return counted(s->error_counts, s->nerror_counts, "", name);
}

/* The histogram of one kind (the test fails without one). */
static const struct gpumem_histogram *histogram(const struct gpumem_status *s, const char *op) {
  for (size_t i = 0; i < s->nhistograms; i++)
    if (strcmp(s->histograms[i]->op, op) == 0) return s->histograms[i];
  ck_abort_msg("no %s histogram", op);
  return NULL;
}

/* A histogram is cumulative, ends in +Inf with every operation, and its
 * sum is that of the durations recorded (all of them still in the ring). */
static void check_histogram(const struct gpumem_status *s, const char *op, uint64_t total) {
  const struct gpumem_histogram *h = histogram(s, op);
  ck_assert_uint_eq(h->size, sizeof *h);
  ck_assert_uint_eq(h->nbuckets, 12);
  ck_assert_uint_eq(h->le_us[0], 1000);
  ck_assert_uint_eq(h->le_us[10], 60000000);
  ck_assert_uint_eq(h->le_us[11], UINT64_MAX);
  for (size_t b = 1; b < h->nbuckets; b++) {
    ck_assert_uint_gt(h->le_us[b], h->le_us[b - 1]);
    ck_assert_uint_ge(h->count[b], h->count[b - 1]);
  }
  ck_assert_uint_eq(h->total, total);
  ck_assert_uint_eq(h->count[11], total);
  uint64_t sum = 0, fast = 0;
  for (size_t i = 0; i < s->nrecent_ops; i++) {
    const struct gpumem_op_record *r = s->recent_ops[i];
    if (!r->done || strcmp(r->op, op) != 0) continue;
    sum += r->duration_us;
    fast += r->duration_us <= 1000;
  }
  ck_assert_uint_eq(h->sum_us, sum);
  ck_assert_uint_eq(h->count[0], fast);
}

/* A record's tags are these (none: every tag). */
static void check_tags(const struct gpumem_op_record *r, const char *const *tags, size_t n) {
  ck_assert_uint_eq(r->ntags, n);
  for (size_t i = 0; i < n; i++) ck_assert_str_eq(r->tags[i], tags[i]);
}

/* Unix time in milliseconds. */
static uint64_t unix_ms(void) {
  struct timeval tv;
  gettimeofday(&tv, NULL);
  return (uint64_t)tv.tv_sec * 1000u + (uint64_t)tv.tv_usec / 1000u;
}

/* A pause or resume by a raw controller, its owner answering every event;
 * returns the daemon's elapsed_us. */
static uint64_t op_served(struct peer *c, struct peer *w, struct pbuf *b, size_t n, bool resume,
                          const char *tag) {
  wire_env *r = scene_served_reply(c, w, b, n, resume, tag);
  uint64_t us = r->op_reply->elapsed_us;
  wire_env_free(r);
  return us;
}

/* Two pauses and two resumes of a tag and a pause of a tag that does not
 * exist: counts by result, bytes released and given back (the tag's),
 * durations and the record (newest first, with the daemon's own elapsed
 * times) are exact; the failure is an error answered, too. */
START_TEST(counts_bytes_durations_and_records_are_exact) {
  daemon_start(&d, NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  struct pbuf b[2];
  scene_alloc_n(&w, "kv", 0, 4 * MiB, 0, b, 2);
  gpumem_client *lc = controller();
  struct gpumem_status *s = status_of(lc);
  /* Nothing yet: OK counts at 0 for both kinds, empty histograms. */
  ck_assert_uint_eq(s->nop_counts, 2);
  ck_assert_uint_eq(ops(s, "pause", "OK") + ops(s, "resume", "OK"), 0);
  ck_assert_uint_eq(s->nerror_counts, 0);
  ck_assert_uint_eq(s->nrecent_ops, 0);
  ck_assert_uint_eq(s->bytes_released + s->bytes_restored, 0);
  check_histogram(s, "pause", 0);
  check_histogram(s, "resume", 0);
  gpumem_status_free(s);
  uint64_t t0 = unix_ms();
  uint64_t us[4];
  us[0] = op_served(&c, &w, b, 2, false, "kv");
  us[1] = op_served(&c, &w, b, 2, true, "kv");
  us[2] = op_served(&c, &w, b, 2, false, "kv");
  us[3] = op_served(&c, &w, b, 2, true, NULL); /* every tag */
  ck_assert_int_eq(scene_op_code(&c, false, "kv_cahce"), CODE(NOT_FOUND));
  s = status_of(lc);
  ck_assert_uint_eq(ops(s, "pause", "OK"), 2);
  ck_assert_uint_eq(ops(s, "pause", "NOT_FOUND"), 1);
  ck_assert_uint_eq(ops(s, "resume", "OK"), 2);
  ck_assert_uint_eq(s->nop_counts, 3);
  ck_assert_uint_eq(errors(s, "NOT_FOUND"), 1);
  ck_assert_uint_eq(s->nerror_counts, 1);
  ck_assert_uint_eq(s->bytes_released, 16 * MiB);
  ck_assert_uint_eq(s->bytes_restored, 16 * MiB);
  ck_assert_uint_gt(s->uptime_ms, 0);
  check_histogram(s, "pause", 3);
  check_histogram(s, "resume", 2);
  ck_assert_uint_eq(s->nrecent_ops, 5);
  static const char *const kv[] = {"kv"}, *const typo[] = {"kv_cahce"};
  const struct gpumem_op_record *r = s->recent_ops[0];
  ck_assert_uint_eq(r->size, sizeof *r);
  ck_assert_str_eq(r->op, "pause");
  check_tags(r, typo, 1);
  ck_assert_int_eq(r->done, 1);
  ck_assert_int_eq(r->result, GPUMEM_E_NOT_FOUND);
  ck_assert_uint_eq(r->bytes_done + r->bytes_total + r->copied_bytes, 0);
  for (size_t i = 1; i < 5; i++) {
    r = s->recent_ops[i];
    bool resume = i % 2 == 1; /* newest first: resume, pause, resume, pause */
    ck_assert_str_eq(r->op, resume ? "resume" : "pause");
    check_tags(r, kv, i == 1 ? 0 : 1);
    ck_assert_uint_eq(r->pid, (uint32_t)getpid());
    ck_assert_int_eq(r->done, 1);
    ck_assert_int_eq(r->result, 0);
    ck_assert_uint_eq(r->bytes_done, 8 * MiB);
    ck_assert_uint_eq(r->bytes_total, 8 * MiB);
    ck_assert_uint_eq(r->copied_bytes, 0);
    ck_assert_uint_eq(r->duration_us, us[4 - i]);
    ck_assert_uint_ge(r->started_ms, t0);
    ck_assert_uint_le(r->started_ms, unix_ms());
    ck_assert_uint_le(r->started_ms, s->recent_ops[i - 1]->started_ms);
  }
  gpumem_status_free(s);
  gpumem_disconnect(lc);
  peer_unmap(&b[0]);
  peer_unmap(&b[1]);
  peer_close(&c);
  peer_close(&w);
}
END_TEST

/* Poll the status (up to 5 s) until the newest record has bytes_done at
 * least done; returns that status (the test fails if it never comes). */
static struct gpumem_status *await_progress(gpumem_client *lc, uint64_t done) {
  double end = now_ms() + 5000;
  for (;;) {
    struct gpumem_status *s = status_of(lc);
    if (s->nrecent_ops && s->recent_ops[0]->bytes_done >= done) return s;
    gpumem_status_free(s);
    ck_assert_msg(now_ms() < end, "no progress to %llu bytes", (unsigned long long)done);
    usleep(2000);
  }
}

/* A pause waiting on a stopped worker: another connection sees it running,
 * with the bytes the other worker's ack released done and the rest not;
 * once the stopped one answers the record is done with everything. */
START_TEST(a_pause_in_flight_shows_its_progress_to_another_connection) {
  daemon_start(&d, "--ack-timeout", "30s", NULL);
  struct worker fast, slow;
  worker_start(&fast, &d, "--tag", "kv", "--size", "4M", "--name", "fast", NULL);
  worker_start(&slow, &d, "--tag", "kv", "--size", "6M", "--name", "slow", NULL);
  worker_freeze(&slow);
  struct peer c;
  peer_open(&c, &d, CONTROLLER);
  uint64_t t0 = unix_ms();
  peer_op(&c, false, "kv", 0, 0);
  gpumem_client *lc = controller();
  struct gpumem_status *s = await_progress(lc, 4 * MiB);
  const struct gpumem_op_record *r = s->recent_ops[0];
  ck_assert_str_eq(r->op, "pause");
  ck_assert_int_eq(r->done, 0);
  ck_assert_int_eq(r->result, 0);
  ck_assert_uint_eq(r->bytes_done, 4 * MiB);
  ck_assert_uint_eq(r->bytes_total, 10 * MiB);
  ck_assert_uint_lt(r->bytes_done, r->bytes_total);
  ck_assert_uint_eq(r->pid, (uint32_t)getpid());
  ck_assert_uint_ge(r->started_ms, t0);
  ck_assert_uint_eq(ops(s, "pause", "OK"), 0);
  ck_assert_uint_eq(histogram(s, "pause")->total, 0);
  ck_assert_uint_eq(s->bytes_released, 4 * MiB);
  /* Still running: its duration grows. */
  uint64_t before = r->duration_us;
  gpumem_status_free(s);
  s = status_of(lc);
  ck_assert_int_eq(s->recent_ops[0]->done, 0);
  ck_assert_uint_ge(s->recent_ops[0]->duration_us, before);
  gpumem_status_free(s);
  ck_assert_int_eq(kill(slow.pid, SIGCONT), 0);
  wire_env *reply;
  ck_assert_int_eq(peer_op_wait(&c, &reply), CODE(OK));
  s = status_of(lc);
  ck_assert_uint_eq(s->nrecent_ops, 1);
  r = s->recent_ops[0];
  ck_assert_int_eq(r->done, 1);
  ck_assert_int_eq(r->result, 0);
  ck_assert_uint_eq(r->bytes_done, 10 * MiB);
  ck_assert_uint_eq(r->bytes_total, 10 * MiB);
  ck_assert_uint_eq(r->duration_us, reply->op_reply->elapsed_us);
  ck_assert_uint_ge(r->duration_us, before);
  ck_assert_uint_eq(ops(s, "pause", "OK"), 1);
  ck_assert_uint_eq(s->bytes_released, 10 * MiB);
  wire_env_free(reply);
  gpumem_status_free(s);
  gpumem_disconnect(lc);
  peer_close(&c);
  ck_assert_int_eq(worker_stop(&fast, SIGTERM), 0);
  ck_assert_int_eq(worker_stop(&slow, SIGTERM), 0);
}
END_TEST

/* A resume in flight: what one owner mapped again is done, the other's is
 * not until it answers. */
START_TEST(a_resume_in_flight_counts_what_owners_mapped) {
  daemon_start(&d, "--ack-timeout", "30s", NULL);
  struct peer w1, w2, c;
  peer_open(&w1, &d, WORKER);
  scene_open(&w2, &c, &d);
  struct pbuf b1, b2;
  peer_alloc(&w1, "kv", 0, 2 * MiB, 0, &b1);
  peer_alloc(&w2, "kv", 0, 8 * MiB, 0, &b2);
  peer_op(&c, false, "kv", 0, 0);
  peer_serve(&w1, &b1, 1, 1);
  peer_serve(&w2, &b2, 1, 1);
  ck_assert_int_eq(peer_op_code(&c), CODE(OK));
  peer_op(&c, true, "kv", 0, 0);
  peer_serve(&w1, &b1, 1, 1);
  struct frame f;
  wire_env *ev = peer_event(&w2, &f); /* w2 has its Remap and holds it */
  gpumem_client *lc = controller();
  struct gpumem_status *s = await_progress(lc, 2 * MiB);
  const struct gpumem_op_record *r = s->recent_ops[0];
  ck_assert_str_eq(r->op, "resume");
  ck_assert_int_eq(r->done, 0);
  ck_assert_uint_eq(r->bytes_done, 2 * MiB);
  ck_assert_uint_eq(r->bytes_total, 10 * MiB);
  ck_assert_uint_eq(s->bytes_restored, 0); /* given back only when every owner mapped */
  ck_assert_str_eq(s->recent_ops[1]->op, "pause");
  gpumem_status_free(s);
  peer_take_remap(ev, &f, &b2, 1);
  frame_release(&f);
  peer_ack(&w2, ev->id, NULL, 0, NULL);
  wire_env_free(ev);
  ck_assert_int_eq(peer_op_code(&c), CODE(OK));
  s = status_of(lc);
  r = s->recent_ops[0];
  ck_assert_int_eq(r->done, 1);
  ck_assert_uint_eq(r->bytes_done, 10 * MiB);
  ck_assert_uint_eq(s->bytes_restored, 10 * MiB);
  ck_assert_uint_eq(s->bytes_released, 10 * MiB);
  gpumem_status_free(s);
  gpumem_disconnect(lc);
  peer_unmap(&b1);
  peer_unmap(&b2);
  peer_close(&c);
  peer_close(&w1);
  peer_close(&w2);
}
END_TEST

/* Figures are what happened: a pause whose owner could unmap only one of
 * two buffers fails with NOT_RELEASED and counts that one buffer's bytes;
 * a resume whose owner cannot map gives nothing back; a pause that timed
 * out counts the bytes its owner's late ack released. */
START_TEST(failures_count_what_really_happened) {
  daemon_start(&d, "--ack-timeout", "300ms", NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  struct pbuf b[2];
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &b[0]);
  peer_alloc(&w, "kv", 0, 6 * MiB, 0, &b[1]);
  /* Half a pause. */
  peer_op(&c, false, "kv", 0, 0);
  wire_env *ev = peer_event(&w, NULL);
  peer_unmap(&b[0]);
  peer_ack(&w, ev->id, &b[1].id, 1, "busy");
  wire_env_free(ev);
  ck_assert_int_eq(peer_op_code(&c), CODE(NOT_RELEASED));
  gpumem_client *lc = controller();
  struct gpumem_status *s = status_of(lc);
  const struct gpumem_op_record *r = s->recent_ops[0];
  ck_assert_int_eq(r->result, GPUMEM_E_NOT_RELEASED);
  ck_assert_uint_eq(r->bytes_done, 2 * MiB);
  ck_assert_uint_eq(r->bytes_total, 8 * MiB);
  ck_assert_uint_eq(s->bytes_released, 2 * MiB);
  ck_assert_uint_eq(ops(s, "pause", "NOT_RELEASED"), 1);
  ck_assert_uint_eq(ops(s, "pause", "OK"), 0);
  ck_assert_uint_eq(errors(s, "NOT_RELEASED"), 1);
  gpumem_status_free(s);
  /* A resume the owner cannot map: nothing given back. */
  peer_op(&c, true, "kv", 0, 0);
  struct frame f;
  ev = peer_event(&w, &f);
  frame_release(&f);
  peer_ack(&w, ev->id, &b[0].id, 1, "no room");
  wire_env_free(ev);
  ck_assert_int_eq(peer_op_code(&c), CODE(BACKEND_ERROR));
  s = status_of(lc);
  r = s->recent_ops[0];
  ck_assert_str_eq(r->op, "resume");
  ck_assert_int_eq(r->result, GPUMEM_E_BACKEND);
  ck_assert_uint_eq(r->bytes_done, 0);
  ck_assert_uint_eq(r->bytes_total, 2 * MiB);
  ck_assert_uint_eq(s->bytes_restored, 0);
  ck_assert_uint_eq(ops(s, "resume", "BACKEND_ERROR"), 1);
  gpumem_status_free(s);
  /* A pause that times out, then the late ack. */
  peer_op(&c, false, "kv", 0, 0);
  ev = peer_event(&w, NULL);
  ck_assert_int_eq(peer_op_code(&c), CODE(CLIENT_TIMEOUT));
  s = status_of(lc);
  r = s->recent_ops[0];
  ck_assert_int_eq(r->result, GPUMEM_E_CLIENT_TIMEOUT);
  ck_assert_uint_eq(r->bytes_done, 0);
  ck_assert_uint_eq(r->bytes_total, 6 * MiB);
  ck_assert_uint_eq(s->bytes_released, 2 * MiB);
  gpumem_status_free(s);
  scene_unmap_ack(&w, ev, &b[1]);
  double end = now_ms() + 5000;
  for (;;) {
    s = status_of(lc);
    uint64_t released = s->bytes_released;
    r = s->recent_ops[0];
    ck_assert_uint_eq(r->bytes_done, 0); /* the record keeps what the pause answered */
    gpumem_status_free(s);
    if (released == 8 * MiB) break;
    ck_assert_msg(now_ms() < end, "the late ack's release is not counted");
    usleep(2000);
  }
  gpumem_disconnect(lc);
  peer_close(&c);
  peer_close(&w);
}
END_TEST

/* The record keeps the last 16 operations, newest first; the counts and
 * durations keep them all. */
START_TEST(the_record_keeps_the_last_16) {
  daemon_start(&d, NULL);
  struct peer c;
  peer_open(&c, &d, CONTROLLER);
  char tag[20][16];
  for (int i = 0; i < 20; i++) {
    snprintf(tag[i], sizeof tag[i], "t%d", i);
    ck_assert_int_eq(scene_op_code(&c, i % 2, tag[i]), CODE(NOT_FOUND));
  }
  gpumem_client *lc = controller();
  struct gpumem_status *s = status_of(lc);
  ck_assert_uint_eq(s->nrecent_ops, 16);
  for (int i = 0; i < 16; i++) {
    const char *want[] = {tag[19 - i]};
    check_tags(s->recent_ops[i], want, 1);
    ck_assert_str_eq(s->recent_ops[i]->op, (19 - i) % 2 ? "resume" : "pause");
  }
  ck_assert_uint_eq(ops(s, "pause", "NOT_FOUND"), 10);
  ck_assert_uint_eq(ops(s, "resume", "NOT_FOUND"), 10);
  ck_assert_uint_eq(histogram(s, "pause")->total, 10);
  ck_assert_uint_eq(histogram(s, "resume")->total, 10);
  ck_assert_uint_eq(errors(s, "NOT_FOUND"), 20);
  gpumem_status_free(s);
  gpumem_disconnect(lc);
  peer_close(&c);
}
END_TEST

/* Every request's error is counted by code, operations or not: a tag that
 * does not exist, a device out of range, an allocation by a controller, a
 * free of a buffer nobody has, a worker's pause of other sessions, a
 * session over the limit. */
START_TEST(errors_are_counted_by_code) {
  daemon_start(&d, "--max-sessions-per-uid", "3", NULL);
  struct peer c, w, over;
  peer_open(&c, &d, CONTROLLER);
  peer_open(&w, &d, WORKER);
  gpumem_client *lc = controller();
  peer_connect(&over, &d);
  ck_assert_int_eq(peer_stray_error(&over), CODE(LIMIT_EXCEEDED));
  peer_close(&over);
  ck_assert_int_eq(scene_op_code(&c, false, "nope"), CODE(NOT_FOUND));
  peer_op(&c, false, "nope", 1ull << 40, 0);
  ck_assert_int_eq(peer_op_code(&c), CODE(INVALID_ARGUMENT));
  struct pbuf b;
  ck_assert_int_eq(peer_try_alloc(&c, "kv", 0, MiB, 0, &b), CODE(PERMISSION_DENIED));
  ck_assert_int_eq(scene_op_code(&w, false, "kv"), CODE(PERMISSION_DENIED));
  ck_assert_int_eq(scene_free_code(&w, 12345), CODE(NOT_FOUND));
  struct gpumem_status *s = status_of(lc);
  ck_assert_uint_eq(errors(s, "NOT_FOUND"), 2);
  ck_assert_uint_eq(errors(s, "INVALID_ARGUMENT"), 1);
  ck_assert_uint_eq(errors(s, "PERMISSION_DENIED"), 2);
  ck_assert_uint_eq(errors(s, "LIMIT_EXCEEDED"), 1);
  ck_assert_uint_eq(s->nerror_counts, 4);
  for (size_t i = 0; i < s->nerror_counts; i++) ck_assert_str_eq(s->error_counts[i]->op, "");
  /* Only the one that reached the engine is an operation. */
  ck_assert_uint_eq(ops(s, "pause", "NOT_FOUND"), 1);
  ck_assert_uint_eq(s->nrecent_ops, 1);
  gpumem_status_free(s);
  gpumem_disconnect(lc);
  peer_close(&c);
  peer_close(&w);
}
END_TEST

int main(void) {
  return HARNESS_RUN("stats", 60, NULL, teardown, counts_bytes_durations_and_records_are_exact,
                     a_pause_in_flight_shows_its_progress_to_another_connection,
                     a_resume_in_flight_counts_what_owners_mapped,
                     failures_count_what_really_happened, the_record_keeps_the_last_16,
                     errors_are_counted_by_code);
}
