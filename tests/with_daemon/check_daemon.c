/* Integration: a real gpumemd, real worker processes, real memory. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/wire.h"
#include "gpumem.h"
#include "harness.h"

#define MiB (1ull << 20)
#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x

static struct daemon d;

static gpumem_client *controller(void) {
  gpumem_client *c = NULL;
  int rc = gpumem_connect(d.socket, "test-controller", GPUMEM_ROLE_CONTROLLER,
                          GPUMEM_CONNECT_NO_THREAD, &c);
  ck_assert_msg(rc == 0, "connect: %s", gpumem_last_error());
  return c;
}

/* The figures of a pause's or resume's report that these tests check. */
struct op_sum {
  uint64_t buffers, bytes, backup_bytes, bytes_needed, bytes_free;
  size_t npids;
  uint32_t pids[64];
};

/* Pause or resume one tag with options, keeping the report's figures
 * (when r is not NULL). */
static int op_tag(gpumem_client *c, bool resume, const char *tag,
                  const struct gpumem_op_options *o, struct op_sum *r) {
  struct gpumem_op_report *rep = NULL;
  int rc = resume ? gpumem_resume(c, &tag, 1, NULL, 0, o, &rep)
                  : gpumem_pause(c, &tag, 1, NULL, 0, o, &rep);
  if (r) memset(r, 0, sizeof *r);
  if (r && rep) {
    r->buffers = rep->buffers;
    r->bytes = rep->bytes;
    r->backup_bytes = rep->backup_bytes;
    r->bytes_needed = rep->bytes_needed;
    r->bytes_free = rep->bytes_free;
    for (size_t i = 0; i < rep->npids && i < 64; i++) r->pids[r->npids++] = rep->pids[i];
  }
  gpumem_op_report_free(rep);
  return rc;
}

static int pause_tag(gpumem_client *c, const char *tag, struct op_sum *r) {
  return op_tag(c, false, tag, NULL, r);
}

/* Resumes wait for the workers' hooks, which verify their buffers: give
 * them time even under ThreadSanitizer (a 256 MiB check takes ~9 s there);
 * the tests of timeouts time out pauses. */
static int resume_tag(gpumem_client *c, const char *tag, struct op_sum *r) {
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.timeout_ms = 60000;
  return op_tag(c, true, tag, &o, r);
}

static const struct gpumem_tag_status *find_tag(const struct gpumem_status *s, const char *name) {
  for (size_t i = 0; i < s->ntags; i++)
    if (strcmp(s->tags[i]->name, name) == 0) return s->tags[i];
  return NULL;
}

/* Wait (2 s, times the harness's patience) until a tag has this many
 * buffers and bytes paused. */
static bool wait_paused(gpumem_client *c, const char *tag, uint64_t buffers, uint64_t bytes) {
  for (int i = 0; i < harness_patience_ms(2000) / 10; i++) {
    struct gpumem_status *s;
    ck_assert_int_eq(gpumem_status(c, &s), 0);
    const struct gpumem_tag_status *t = find_tag(s, tag);
    bool done = t && t->paused_buffers == buffers && t->paused_bytes == bytes;
    gpumem_status_free(s);
    if (done) return true;
    usleep(10000);
  }
  return false;
}

/* Wait (2 s, times the harness's patience) until a tag is in a state. */
static bool wait_state(gpumem_client *c, const char *tag, int state) {
  for (int i = 0; i < harness_patience_ms(2000) / 10; i++) {
    struct gpumem_status *s;
    ck_assert_int_eq(gpumem_status(c, &s), 0);
    const struct gpumem_tag_status *t = find_tag(s, tag);
    bool done = t && t->state == state;
    gpumem_status_free(s);
    if (done) return true;
    usleep(10000);
  }
  return false;
}

/* Wait (2 s, times the harness's patience) until the daemon serves this
 * many sessions. */
static bool wait_sessions(gpumem_client *c, size_t n) {
  for (int i = 0; i < harness_patience_ms(2000) / 10; i++) {
    struct gpumem_status *s;
    ck_assert_int_eq(gpumem_status(c, &s), 0);
    bool done = s->nsessions == n;
    gpumem_status_free(s);
    if (done) return true;
    usleep(10000);
  }
  return false;
}

/* What gpumem_list returns for c (the buffers it lists), the list freed. */
static int listed(gpumem_client *c) {
  struct gpumem_list *list;
  int n = gpumem_list(c, &list);
  if (n >= 0) gpumem_list_free(list);
  return n;
}

/* The pointer printed on the first line that starts with prefix and id. */
static void ptr_of(const struct worker *w, const char *what, unsigned long long id, char *out) {
  char key[64];
  snprintf(key, sizeof key, "%s buffer %llu ", what, id);
  const char *p = strstr(worker_output(w), key);
  ck_assert_msg(p != NULL, "no '%s' in: %s", key, worker_output(w));
  p = strstr(p, "ptr=");
  sscanf(p, "ptr=%31s", out);
}

/* --- raw protocol, to reach the daemon's edge without the library --- */

/* Read one reply (its fds closed); NULL at end of stream. Nothing may
 * follow it yet. */
static wire_env *raw_read(struct peer *p) {
  wire_env *env = peer_get(p, NULL);
  ck_assert_uint_eq(frame_reader_pending(p->r), 0);
  return env;
}

/* The error code of the next reply (OK if not an Error), its text into
 * text (256 bytes) unless NULL. */
static wire_code raw_reply(struct peer *p, char *text) {
  wire_env *r = raw_read(p);
  wire_code code = peer_reply_code(r, text, 256);
  wire_env_free(r);
  return code;
}

/* The error code of the reply to env (OK if not an Error). */
static wire_code raw_call(struct peer *p, const wire_env *env, char *text) {
  peer_put(p, env, NULL, 0);
  return raw_reply(p, text);
}

/* Connect and send a Hello in a role at a major version (its reply not read). */
static void raw_hello(struct peer *p, int role, uint32_t major) {
  peer_connect(p, &d);
  peer_push_hello(p, role, "raw", major, 0);
  ck_assert_int_eq(peer_flush_within(p, 5000), 0);
}

/* The error code of the reply to an alloc. */
static wire_code raw_alloc(struct peer *p, const char *tag, unsigned dev, uint64_t size,
                           char *text) {
  peer_push_alloc(p, tag, dev, size, 0);
  ck_assert_int_eq(peer_flush_within(p, 5000), 0);
  return raw_reply(p, text);
}

/* Connect, say Hello in a role, and take the HelloReply. */
static void raw_session(struct peer *p, int role) {
  raw_hello(p, role, WIRE_VERSION_MAJOR);
  wire_env_free(raw_read(p));
}

/* True when the daemon closed the connection. */
static bool raw_closed(struct peer *p) {
  wire_env *r = raw_read(p);
  wire_env_free(r);
  return r == NULL;
}

/* The reply to p's last request is an Error of code, then the daemon
 * ends the session; p is closed. */
static void raw_ends_with(struct peer *p, wire_code code) {
  wire_env *r = raw_read(p);
  ck_assert_int_eq(r->error->code, code);
  wire_env_free(r);
  ck_assert(raw_closed(p));
  peer_close(p);
}

/* Stop the test's daemon and check that no fd leaked. */
static void teardown(void) { harness_daemon_teardown(&d); }

/* --- tests --- */

START_TEST(pause_releases_memory_and_resume_takes_it_again) {
  daemon_start(&d, "--host-device-size", "1G", NULL);
  struct worker w;
  worker_start(&w, &d, "--tag", "kv_cache", "--size", "128M", "--count", "2", NULL);
  pid_t pids[] = {d.pid, w.pid};
  ck_assert_uint_eq(memfd_bytes(pids, 2), 256 * MiB);
  gpumem_client *c = controller();
  struct op_sum r;
  ck_assert_int_eq(pause_tag(c, "kv_cache", &r), 0);
  ck_assert_uint_eq(r.buffers, 2);
  ck_assert_uint_eq(r.bytes, 256 * MiB);
  /* Released before the reply: neither process holds any of it. */
  ck_assert_uint_eq(memfd_bytes(pids, 2), 0);
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_uint_eq(s->devices[0]->managed, 0);
  ck_assert_uint_eq(s->devices[0]->free, 1024 * MiB);
  ck_assert_int_eq(find_tag(s, "kv_cache")->state, GPUMEM_PAUSED);
  ck_assert_uint_eq(find_tag(s, "kv_cache")->paused_bytes, 256 * MiB);
  gpumem_status_free(s);
  ck_assert_int_eq(resume_tag(c, "kv_cache", &r), 0);
  ck_assert_uint_eq(r.bytes, 256 * MiB);
  ck_assert(worker_wait_for(&w, "verified buffer", 2, 5000));
  ck_assert_uint_eq(memfd_bytes(pids, 2), 256 * MiB);
  char before[32], after[32];
  for (unsigned long long id = 1; id <= 2; id++) {
    ptr_of(&w, "allocated", id, before);
    ptr_of(&w, "resumed", id, after);
    ck_assert_str_eq(before, after);
  }
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
  ck_assert(wait_sessions(c, 1));
  ck_assert_uint_eq(memfd_bytes(pids, 1), 0);
  gpumem_disconnect(c);
}
END_TEST

START_TEST(backup_buffers_keep_their_contents) {
  struct worker w;
  daemon_with_worker(&d, &w, "--tag", "weights", "--size", "24M", "--count", "3", "--backup", NULL);
  gpumem_client *c = controller();
  struct op_sum r;
  for (int round = 1; round <= 2; round++) {
    ck_assert_int_eq(pause_tag(c, "weights", &r), 0);
    ck_assert_uint_eq(r.backup_bytes, 72 * MiB);
    ck_assert_int_eq(resume_tag(c, "weights", &r), 0);
    ck_assert_uint_eq(r.backup_bytes, 72 * MiB);
    ck_assert(worker_wait_for(&w, "contents kept", 3 * round, 5000));
  }
  ck_assert_int_eq(worker_count(&w, "FAILED"), 0);
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

START_TEST(killed_worker_gives_its_memory_back) {
  daemon_start(&d, "--host-device-size", "1G", NULL);
  struct worker w;
  worker_start(&w, &d, "--tag", "kv_cache", "--size", "200M", NULL);
  pid_t pids[] = {d.pid, w.pid};
  ck_assert_uint_eq(memfd_bytes(pids, 2), 200 * MiB);
  ck_assert_int_eq(worker_stop(&w, SIGKILL), 128 + SIGKILL);
  gpumem_client *c = controller();
  ck_assert(wait_sessions(c, 1));
  ck_assert_msg(memfd_bytes(pids, 1) == 0, "memory of a killed worker stayed");
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_uint_eq(s->devices[0]->managed, 0);
  ck_assert_uint_eq(s->nsessions, 1); /* only us */
  gpumem_status_free(s);
  gpumem_disconnect(c);
}
END_TEST

START_TEST(unresponsive_worker_is_reported_and_finishes_late) {
  daemon_start(&d, "--ack-timeout", "300ms", NULL);
  struct worker a, b;
  worker_start(&a, &d, "--tag", "kv", "--size", "8M", NULL);
  worker_start(&b, &d, "--tag", "kv", "--size", "8M", NULL);
  worker_freeze(&b);
  gpumem_client *c = controller();
  struct op_sum r;
  double t0 = now_ms();
  ck_assert_int_eq(pause_tag(c, "kv", &r), GPUMEM_E_CLIENT_TIMEOUT);
  ck_assert_double_ge(now_ms() - t0, 290);
  ck_assert_uint_eq(r.npids, 1);
  ck_assert_uint_eq(r.pids[0], (uint32_t)b.pid);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "CLIENT_TIMEOUT"));
  kill(b.pid, SIGCONT);
  /* The late ack completes the pause of b's buffer. */
  ck_assert(wait_paused(c, "kv", 2, 16 * MiB));
  ck_assert_int_eq(resume_tag(c, "kv", &r), 0);
  ck_assert_uint_eq(r.buffers, 2);
  ck_assert(worker_wait_for(&a, "verified", 1, 3000));
  ck_assert(worker_wait_for(&b, "verified", 1, 3000));
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&a, SIGTERM), 0);
  ck_assert_int_eq(worker_stop(&b, SIGTERM), 0);
}
END_TEST

START_TEST(kill_policy_ends_unresponsive_workers) {
  daemon_start(&d, "--ack-timeout", "200ms", "--timeout-policy", "kill", NULL);
  struct worker b;
  worker_start(&b, &d, "--tag", "kv", "--size", "8M", NULL);
  worker_freeze(&b);
  gpumem_client *c = controller();
  struct op_sum r;
  ck_assert_int_eq(pause_tag(c, "kv", &r), GPUMEM_E_CLIENT_TIMEOUT);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "killed"));
  int status;
  ck_assert_int_eq(waitpid(b.pid, &status, 0), b.pid);
  ck_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  b.pid = 0;
  struct gpumem_status *s;
  for (int i = 0; i < 100; i++) {
    ck_assert_int_eq(gpumem_status(c, &s), 0);
    size_t n = s->nsessions;
    uint64_t managed = s->devices[0]->managed;
    gpumem_status_free(s);
    if (n == 1 && managed == 0) break;
    ck_assert_int_lt(i, 99);
    usleep(10000);
  }
  gpumem_disconnect(c);
}
END_TEST

/* A 256 MiB device: worker a's two 64 MiB buffers in "kv" paused (r the
 * pause's figures), then worker t's 192 MiB "trainer" in the room they
 * left, so that kv does not fit back; a controller, returned. */
static gpumem_client *kv_paused_trainer_in(struct worker *a, struct worker *t, struct op_sum *r) {
  daemon_start(&d, "--host-devices", "1", "--host-device-size", "256M", NULL);
  worker_start(a, &d, "--tag", "kv", "--size", "64M", "--count", "2", NULL);
  gpumem_client *c = controller();
  ck_assert_int_eq(pause_tag(c, "kv", r), 0);
  worker_start(t, &d, "--tag", "trainer", "--size", "192M", NULL);
  return c;
}

START_TEST(resume_beyond_capacity_changes_nothing) {
  struct worker a, t;
  struct op_sum r;
  gpumem_client *c = kv_paused_trainer_in(&a, &t, &r);
  ck_assert_int_eq(resume_tag(c, "kv", &r), GPUMEM_E_OUT_OF_MEMORY);
  ck_assert_uint_eq(r.bytes_needed, 128 * MiB);
  ck_assert_uint_eq(r.bytes_free, 64 * MiB);
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_int_eq(find_tag(s, "kv")->state, GPUMEM_PAUSED);
  ck_assert_uint_eq(find_tag(s, "kv")->paused_bytes, 128 * MiB);
  ck_assert_uint_eq(s->devices[0]->managed, 192 * MiB);
  gpumem_status_free(s);
  ck_assert_int_eq(worker_count(&a, "resumed"), 0);
  ck_assert_int_eq(worker_stop(&t, SIGTERM), 0);
  /* Its memory is free once the daemon has ended its session (under load
   * that came after the resume was asked, which then ran out of memory). */
  ck_assert(wait_sessions(c, 2));
  ck_assert_int_eq(resume_tag(c, "kv", &r), 0);
  ck_assert_uint_eq(r.buffers, 2);
  ck_assert(worker_wait_for(&a, "verified", 2, 3000));
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&a, SIGTERM), 0);
}
END_TEST

/* A resume with wait_ms on its thread: its code, words and wait. */
struct waiting_resume {
  unsigned wait_ms;
  bool all; /* every tag, not "kv" */
  int rc;
  uint64_t waited_us;
  char words[512];
};

static void *resume_thread(void *arg) {
  struct waiting_resume *w = arg;
  gpumem_client *c = controller();
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.timeout_ms = 60000;
  o.wait_ms = w->wait_ms;
  struct gpumem_op_report *rep = NULL;
  const char *tag = "kv";
  w->rc = gpumem_resume(c, w->all ? NULL : &tag, w->all ? 0 : 1, NULL, 0, &o, &rep);
  snprintf(w->words, sizeof w->words, "%s", w->rc ? gpumem_last_error() : "");
  w->waited_us = rep ? rep->waited_us : 0;
  gpumem_op_report_free(rep);
  gpumem_disconnect(c);
  return NULL;
}

/* Until the daemon's log has said text n times (20 s at most). */
static bool log_says(const char *text, int n) {
  for (int i = 0; i < 2000; i++) {
    if (daemon_log_count(&d, text) >= n) return true;
    usleep(10000);
  }
  return false;
}

/* A resume with wait_ms (protocol 1.10) where the device lacks the room
 * waits for it: it ends once the trainer's memory is given back (its tag
 * gone with it meanwhile), saying how long it waited; a wait that runs
 * out fails as a resume without one does, saying it waited; a requester
 * that goes away ends its wait, and the operations behind it run. */
START_TEST(a_resume_that_waits_for_room_takes_it_once_there) {
  struct worker a, t;
  struct op_sum r;
  gpumem_client *c = kv_paused_trainer_in(&a, &t, &r);
  /* Every tag's resume: the trainer's tag goes with the trainer while it
   * waits. */
  struct waiting_resume w = {.wait_ms = 30000, .all = true};
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, resume_thread, &w), 0);
  ck_assert_msg(log_says("waiting up to", 1), "the resume never waited");
  ck_assert_int_eq(worker_stop(&t, SIGTERM), 0); /* the trainer lets go */
  pthread_join(th, NULL);
  ck_assert_msg(w.rc == 0, "%s", w.words);
  ck_assert_uint_gt(w.waited_us, 0);
  ck_assert_uint_lt(w.waited_us, 30000000);
  ck_assert(worker_wait_for(&a, "resumed buffer", 2, 10000));
  /* A wait that runs out. */
  ck_assert_int_eq(pause_tag(c, "kv", &r), 0);
  worker_start(&t, &d, "--tag", "trainer", "--size", "192M", NULL);
  w = (struct waiting_resume){.wait_ms = 300};
  resume_thread(&w);
  ck_assert_int_eq(w.rc, GPUMEM_E_OUT_OF_MEMORY);
  ck_assert_msg(strstr(w.words, "resume needs 134217728 bytes") &&
                    strstr(w.words, "after waiting") && strstr(w.words, "for room"),
                "%s", w.words);
  ck_assert_uint_ge(w.waited_us, 300000);
  /* A requester that goes away: the wait ends, and the next one runs. */
  struct peer p;
  peer_open(&p, &d, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  Gpumem__Wire__ResumeRequest q = GPUMEM__WIRE__RESUME_REQUEST__INIT;
  char *kv = "kv";
  q.tags = &kv;
  q.n_tags = 1;
  q.wait_ms = 60000;
  wire_env env = wire_envelope(5, GPUMEM__WIRE__ENVELOPE__BODY_RESUME, &q);
  peer_put(&p, &env, NULL, 0);
  /* the two before, and this one */
  ck_assert_msg(log_says("waiting up to", 3), "the peer's resume never waited");
  peer_close(&p);
  ck_assert_msg(log_says("its requester went away", 1), "the wait did not end");
  ck_assert_int_eq(worker_stop(&t, SIGTERM), 0);
  ck_assert(wait_sessions(c, 2));
  ck_assert_int_eq(resume_tag(c, "kv", &r), 0);
  ck_assert(worker_wait_for(&a, "resumed buffer", 4, 10000));
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&a, SIGTERM), 0);
}
END_TEST

struct timed_pause {
  const char *tag;
  int rc;
  double done_ms;
};

static void *pause_thread(void *arg) {
  struct timed_pause *p = arg;
  gpumem_client *c = controller();
  p->rc = pause_tag(c, p->tag, NULL);
  p->done_ms = now_ms();
  gpumem_disconnect(c);
  return NULL;
}

/* A second controller waits for the first operation to end. */
START_TEST(controller_operations_are_serialized) {
  daemon_start(&d, "--ack-timeout", "600ms", NULL);
  struct worker a, b;
  worker_start(&a, &d, "--tag", "slow", "--size", "4M", NULL);
  worker_start(&b, &d, "--tag", "fast", "--size", "4M", NULL);
  worker_freeze(&a);
  struct timed_pause first = {"slow", 0, 0}, second = {"fast", 0, 0};
  pthread_t t1, t2;
  double t0 = now_ms();
  pthread_create(&t1, NULL, pause_thread, &first);
  gpumem_client *c = controller();
  ck_assert(wait_state(c, "slow", GPUMEM_PAUSING)); /* the first is running */
  pthread_create(&t2, NULL, pause_thread, &second);
  pthread_join(t1, NULL);
  pthread_join(t2, NULL);
  gpumem_disconnect(c);
  ck_assert_int_eq(first.rc, GPUMEM_E_CLIENT_TIMEOUT);
  ck_assert_int_eq(second.rc, 0);
  /* The second waited for the first's timeout (the replies' order on two
   * threads is not the daemon's). */
  ck_assert_double_ge(second.done_ms - t0, 590);
  kill(a.pid, SIGCONT);
  ck_assert_int_eq(worker_stop(&a, SIGTERM), 0);
  ck_assert_int_eq(worker_stop(&b, SIGTERM), 0);
}
END_TEST

/* One client's garbage ends that client only. */
START_TEST(garbage_client_is_dropped_and_others_carry_on) {
  struct worker w;
  daemon_with_worker(&d, &w, "--tag", "kv", "--size", "4M", NULL);
  struct peer raw;
  peer_connect(&raw, &d);
  uint8_t junk[] = {5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff};
  ck_assert_int_eq(write(raw.fd, junk, sizeof junk), (ssize_t)sizeof junk);
  wire_env *r = raw_read(&raw);
  ck_assert_ptr_nonnull(r);
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_ERROR);
  ck_assert_int_eq(r->error->code, CODE(PROTOCOL_ERROR));
  wire_env_free(r);
  ck_assert(raw_closed(&raw));
  peer_close(&raw);
  gpumem_client *c = controller();
  ck_assert_int_eq(pause_tag(c, "kv", NULL), 0);
  ck_assert_int_eq(resume_tag(c, "kv", NULL), 0);
  ck_assert(worker_wait_for(&w, "verified", 1, 3000));
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* Bad requests get a clear code and text; the session and daemon go on. */
START_TEST(bad_requests_get_clear_errors) {
  daemon_start(&d, "--host-device-size", "256M", NULL);
  char text[256];
  struct peer raw;
  raw_session(&raw, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  ck_assert_int_eq(raw_alloc(&raw, "", 0, MiB, text), CODE(INVALID_ARGUMENT));
  ck_assert_ptr_nonnull(strstr(text, "invalid tag"));
  ck_assert_int_eq(raw_alloc(&raw, "kv cache", 0, MiB, NULL), CODE(INVALID_ARGUMENT));
  char longtag[80];
  memset(longtag, 'a', sizeof longtag - 1);
  longtag[79] = '\0';
  ck_assert_int_eq(raw_alloc(&raw, longtag, 0, MiB, NULL), CODE(INVALID_ARGUMENT));
  ck_assert_int_eq(raw_alloc(&raw, "kv", 0, 0, text), CODE(INVALID_ARGUMENT));
  ck_assert_int_eq(raw_alloc(&raw, "kv", 0, 257 * MiB, text), CODE(INVALID_ARGUMENT));
  ck_assert_ptr_nonnull(strstr(text, "larger than device"));
  ck_assert_int_eq(raw_alloc(&raw, "kv", 0, UINT64_MAX, NULL), CODE(INVALID_ARGUMENT));
  ck_assert_int_eq(raw_alloc(&raw, "kv", 7, MiB, text), CODE(INVALID_ARGUMENT));
  ck_assert_ptr_nonnull(strstr(text, "device 7 out of range"));
  /* Unknown and foreign buffer ids look the same. */
  struct worker w;
  worker_start(&w, &d, "--tag", "kv", "--size", "4M", NULL);
  Gpumem__Wire__FreeRequest fr = GPUMEM__WIRE__FREE_REQUEST__INIT;
  wire_env env = peer_env(3, GPUMEM__WIRE__ENVELOPE__BODY_FREE);
  env.free = &fr;
  fr.buffer_id = 999;
  ck_assert_int_eq(raw_call(&raw, &env, text), CODE(NOT_FOUND));
  fr.buffer_id = 1; /* the worker's */
  ck_assert_int_eq(raw_call(&raw, &env, text), CODE(NOT_FOUND));
  /* Workers do not pause. */
  char *tags[] = {"kv"};
  Gpumem__Wire__PauseRequest p = GPUMEM__WIRE__PAUSE_REQUEST__INIT;
  p.tags = tags;
  p.n_tags = 1;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_PAUSE;
  env.pause = &p;
  ck_assert_int_eq(raw_call(&raw, &env, text), CODE(PERMISSION_DENIED));
  p.n_tags = 0; /* every tag: still not a worker's to pause */
  ck_assert_int_eq(raw_call(&raw, &env, text), CODE(PERMISSION_DENIED));
  /* The session is still fine. */
  ck_assert_int_eq(raw_alloc(&raw, "kv", 0, MiB, NULL), CODE(OK));
  /* Controllers do not allocate; devices are checked. */
  struct peer raw_ctl;
  raw_session(&raw_ctl, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  ck_assert_int_eq(raw_alloc(&raw_ctl, "kv", 0, MiB, NULL), CODE(PERMISSION_DENIED));
  uint32_t dev = 9;
  p.n_tags = 1;
  p.devices = &dev;
  p.n_devices = 1;
  ck_assert_int_eq(raw_call(&raw_ctl, &env, text), CODE(INVALID_ARGUMENT));
  /* Hello twice ends the session. */
  Gpumem__Wire__Hello h = GPUMEM__WIRE__HELLO__INIT;
  h.version_major = WIRE_VERSION_MAJOR;
  h.role = GPUMEM__WIRE__ROLE__ROLE_WORKER;
  h.name = "";
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_HELLO;
  env.hello = &h;
  ck_assert_int_eq(raw_call(&raw_ctl, &env, NULL), CODE(PROTOCOL_ERROR));
  ck_assert(raw_closed(&raw_ctl));
  peer_close(&raw_ctl);
  /* So do a request before Hello, a wrong major version, fds on a
   * request, and an oversized frame. */
  struct peer x;
  peer_connect(&x, &d);
  ck_assert_int_eq(raw_alloc(&x, "kv", 0, MiB, text), CODE(PROTOCOL_ERROR));
  ck_assert_str_eq(text, "the first message must be Hello");
  ck_assert(raw_closed(&x));
  peer_close(&x);
  raw_hello(&x, GPUMEM__WIRE__ROLE__ROLE_WORKER, WIRE_VERSION_MAJOR + 1);
  raw_ends_with(&x, CODE(VERSION_MISMATCH));
  raw_session(&x, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  int spare = dup(1);
  Gpumem__Wire__StatusRequest sr = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_STATUS;
  env.status = &sr;
  env.fd_count = 1;
  peer_put(&x, &env, &spare, 1);
  raw_ends_with(&x, CODE(PROTOCOL_ERROR));
  raw_session(&x, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  uint8_t huge[4] = {0, 0, 0, 0x10}; /* 256 MiB */
  ck_assert_int_eq(write(x.fd, huge, 4), 4);
  raw_ends_with(&x, CODE(PROTOCOL_ERROR));
  /* Nothing leaked into the registry: the worker's buffer and ours. */
  gpumem_client *c = controller();
  ck_assert_int_eq(listed(c), 2);
  gpumem_disconnect(c);
  peer_close(&raw);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

START_TEST(one_daemon_per_socket_and_stale_sockets_replaced) {
  daemon_start(&d, NULL);
  char log[160];
  snprintf(log, sizeof log, "%s/second.log", d.dir);
  pid_t second = daemon_spawn(d.socket, log, NULL);
  int status;
  ck_assert_int_eq(waitpid(second, &status, 0), second);
  ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 1);
  FILE *f = fopen(log, "r");
  char line[256] = "";
  bool said = false;
  while (fgets(line, sizeof line, f)) said |= strstr(line, "another gpumemd is answering") != NULL;
  fclose(f);
  ck_assert(said);
  /* SIGTERM: exit 0 and the socket is gone. */
  kill(d.pid, SIGTERM);
  ck_assert_int_eq(waitpid(d.pid, &status, 0), d.pid);
  ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  d.pid = 0;
  struct stat st;
  ck_assert_int_ne(stat(d.socket, &st), 0);
  /* A socket file nobody listens on is replaced. */
  int s = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", d.socket);
  ck_assert_int_eq(bind(s, (struct sockaddr *)&addr, sizeof addr), 0);
  close(s);
  ck_assert_int_eq(stat(d.socket, &st), 0);
  pid_t third = daemon_spawn(d.socket, log, NULL);
  int fd = -1;
  for (int i = 0; i < 300 && fd < 0; i++) {
    fd = raw_connect(&d);
    if (fd < 0) usleep(10000);
  }
  ck_assert_int_ge(fd, 0);
  close(fd);
  d.pid = third;
  ck_assert_int_eq(stat(d.socket, &st), 0);
  ck_assert_uint_eq(st.st_mode & 0777, 0660);
}
END_TEST

/* Touching a paused buffer faults, as on a GPU. */
START_TEST(touching_a_paused_buffer_faults) {
  daemon_start(&d, NULL);
  int go[2], ready[2];
  ck_assert_int_eq(pipe(go), 0);
  ck_assert_int_eq(pipe(ready), 0);
  pid_t child = fork();
  if (child == 0) {
    signal(SIGSEGV, SIG_DFL); /* not the sanitizer's report: the fault itself */
    gpumem_client *w;
    gpumem_buffer *b;
    if (gpumem_connect(d.socket, "toucher", GPUMEM_ROLE_WORKER, 0, &w) < 0 ||
        gpumem_alloc(w, "kv", 0, 4 * MiB, 0, &b) < 0)
      _exit(3);
    volatile char *p = gpumem_buffer_ptr(b);
    p[0] = 'x';
    char c = 1;
    if (write(ready[1], &c, 1) != 1 || read(go[0], &c, 1) != 1) _exit(4);
    p[4096] = 'y'; /* paused now */
    _exit(0);
  }
  char c;
  ck_assert_int_eq(read(ready[0], &c, 1), 1);
  gpumem_client *ctl = controller();
  ck_assert_int_eq(pause_tag(ctl, "kv", NULL), 0);
  ck_assert_int_eq(write(go[1], &c, 1), 1);
  int status;
  waitpid(child, &status, 0);
  ck_assert_msg(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV, "status %d", status);
  gpumem_disconnect(ctl);
  close(go[0]);
  close(go[1]);
  close(ready[0]);
  close(ready[1]);
}
END_TEST

/* A paused tag refuses new buffers unless asked; asked, they start paused
 * and come alive at the resume, at the address they were given. */
START_TEST(allocations_in_a_paused_tag) {
  daemon_start(&d, NULL);
  gpumem_client *ctl = controller();
  struct op_sum r;
  ck_assert_int_eq(pause_tag(ctl, "kv", &r), GPUMEM_E_NOT_FOUND);
  gpumem_client *w;
  ck_assert_int_eq(gpumem_connect(d.socket, "late", GPUMEM_ROLE_WORKER, 0, &w), 0);
  gpumem_buffer *b, *first;
  ck_assert_int_eq(gpumem_alloc(w, "kv", 1, MiB, 0, &first), 0);
  ck_assert_int_eq(pause_tag(ctl, "kv", &r), 0);
  ck_assert_uint_eq(r.buffers, 1);
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, MiB, 0, &b), GPUMEM_E_TAG_PAUSED);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "paused"));
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, MiB, GPUMEM_ALLOW_PAUSED, &b), 0);
  ck_assert_int_eq(gpumem_buffer_mapped(b), 0);
  char *p = gpumem_buffer_ptr(b);
  ck_assert_int_eq(resume_tag(ctl, "kv", &r), 0);
  ck_assert_uint_eq(r.buffers, 2);
  ck_assert_int_eq(gpumem_buffer_mapped(b), 1);
  ck_assert_ptr_eq(gpumem_buffer_ptr(b), p);
  memset(p, 0xab, gpumem_buffer_size(b));
  ck_assert_int_eq((unsigned char)p[gpumem_buffer_size(b) - 1], 0xab);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  ck_assert_int_eq(gpumem_free(w, first), 0);
  gpumem_disconnect(w);
  gpumem_disconnect(ctl);
}
END_TEST

START_TEST(pause_and_resume_are_idempotent) {
  struct worker w;
  daemon_with_worker(&d, &w, "--tag", "kv", "--size", "4M", "--count", "2", NULL);
  gpumem_client *c = controller();
  struct op_sum r;
  ck_assert_int_eq(pause_tag(c, "kv", &r), 0);
  ck_assert_uint_eq(r.buffers, 2);
  ck_assert_int_eq(pause_tag(c, "kv", &r), 0);
  ck_assert_uint_eq(r.buffers, 0);
  ck_assert_int_eq(resume_tag(c, "kv", &r), 0);
  ck_assert_uint_eq(r.buffers, 2);
  ck_assert_int_eq(resume_tag(c, "kv", &r), 0);
  ck_assert_uint_eq(r.buffers, 0);
  /* A typo is not success. */
  ck_assert_int_eq(resume_tag(c, "never_seen", &r), GPUMEM_E_NOT_FOUND);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "no tag 'never_seen'"));
  ck_assert_int_eq(pause_tag(c, "never_seen", &r), GPUMEM_E_NOT_FOUND);
  ck_assert(worker_wait_for(&w, "verified", 2, 3000));
  ck_assert_int_eq(worker_count(&w, "resumed"), 2);
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* The operation goes on when the controller that asked for it is gone. */
START_TEST(controller_disconnect_does_not_stop_a_pause) {
  struct worker w;
  daemon_with_worker(&d, &w, "--tag", "kv", "--size", "8M", NULL);
  struct peer raw;
  raw_hello(&raw, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER, WIRE_VERSION_MAJOR);
  char *tags[] = {"kv"};
  Gpumem__Wire__PauseRequest p = GPUMEM__WIRE__PAUSE_REQUEST__INIT;
  p.tags = tags;
  p.n_tags = 1;
  wire_env env = peer_env(2, GPUMEM__WIRE__ENVELOPE__BODY_PAUSE);
  env.pause = &p;
  peer_put(&raw, &env, NULL, 0);
  peer_close(&raw);
  ck_assert(worker_wait_for(&w, "paused buffer", 1, 3000));
  gpumem_client *c = controller();
  ck_assert(wait_paused(c, "kv", 1, 8 * MiB));
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* Without the background thread, events wait for gpumem_dispatch. */
START_TEST(applications_can_dispatch_events_themselves) {
  daemon_start(&d, NULL);
  gpumem_client *w;
  ck_assert_int_eq(gpumem_connect(d.socket, "loop", GPUMEM_ROLE_WORKER, GPUMEM_CONNECT_NO_THREAD, &w), 0);
  ck_assert_int_ge(gpumem_fd(w), 0);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc(w, "kv", 1, 3 * MiB, 0, &b), 0);
  ck_assert_uint_eq(gpumem_buffer_size(b), 4 * MiB);
  ck_assert_uint_eq(gpumem_buffer_device(b), 1);
  ck_assert_int_eq(gpumem_dispatch(w, 0), 0);
  pid_t child = fork();
  if (child == 0) {
    char *argv[] = {(char *)harness_bin("gpumemctl"), "--socket", d.socket, "pause", "kv", NULL};
    execv(argv[0], argv);
    _exit(127);
  }
  int handled = 0;
  for (int i = 0; i < 100 && gpumem_buffer_mapped(b); i++) handled += gpumem_dispatch(w, 100);
  ck_assert_int_eq(handled, 1);
  ck_assert_int_eq(gpumem_buffer_mapped(b), 0);
  int status;
  waitpid(child, &status, 0);
  ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  gpumem_disconnect(w);
}
END_TEST

struct churn {
  gpumem_client *c;
  int failures;
};

/* Allocate, write, check and free, over and over. */
static void *churn(void *arg) {
  struct churn *t = arg;
  for (int i = 0; i < 200; i++) {
    gpumem_buffer *b;
    if (gpumem_alloc(t->c, "churn", 0, 64 * 1024, 0, &b) < 0) {
      t->failures++;
      continue;
    }
    unsigned char *p = gpumem_buffer_ptr(b);
    memset(p, i, 64 * 1024);
    t->failures += p[4095] != (unsigned char)i;
    t->failures += gpumem_free(t->c, b) < 0;
  }
  return NULL;
}

/* One client used from several threads at once, while its events (a
 * pause and resume of another of its tags) arrive in between. */
START_TEST(one_client_from_many_threads) {
  daemon_start(&d, "--host-granularity", "64K", NULL);
  gpumem_client *w;
  ck_assert_int_eq(gpumem_connect(d.socket, "threads", GPUMEM_ROLE_WORKER, 0, &w), 0);
  gpumem_buffer *kv;
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 4 * MiB, 0, &kv), 0);
  struct churn t[4] = {{w, 0}, {w, 0}, {w, 0}, {w, 0}};
  pthread_t tid[4];
  for (int i = 0; i < 4; i++) pthread_create(&tid[i], NULL, churn, &t[i]);
  gpumem_client *c = controller();
  for (int i = 0; i < 10; i++) {
    ck_assert_int_eq(pause_tag(c, "kv", NULL), 0);
    ck_assert_int_eq(gpumem_buffer_mapped(kv), 0);
    ck_assert_int_eq(resume_tag(c, "kv", NULL), 0);
    ck_assert_int_eq(gpumem_buffer_mapped(kv), 1);
  }
  for (int i = 0; i < 4; i++) {
    pthread_join(tid[i], NULL);
    ck_assert_int_eq(t[i].failures, 0);
  }
  ck_assert_int_eq(listed(w), 1);
  gpumem_disconnect(c);
  gpumem_disconnect(w);
}
END_TEST

int main(void) {
  return HARNESS_RUN("daemon", 60, NULL, teardown,
                     pause_releases_memory_and_resume_takes_it_again,
                     backup_buffers_keep_their_contents,
                     killed_worker_gives_its_memory_back,
                     unresponsive_worker_is_reported_and_finishes_late,
                     kill_policy_ends_unresponsive_workers,
                     resume_beyond_capacity_changes_nothing,
                     a_resume_that_waits_for_room_takes_it_once_there,
                     controller_operations_are_serialized,
                     garbage_client_is_dropped_and_others_carry_on,
                     bad_requests_get_clear_errors,
                     one_daemon_per_socket_and_stale_sockets_replaced,
                     touching_a_paused_buffer_faults,
                     allocations_in_a_paused_tag,
                     pause_and_resume_are_idempotent,
                     controller_disconnect_does_not_stop_a_pause,
                     applications_can_dispatch_events_themselves,
                     one_client_from_many_threads);
}
