/* Pause and resume scopes: a worker pausing its own buffers (as each rank
 * does under torch_memory_saver), a controller pausing sessions by pid or
 * by name, and what a scope may not do. Real daemon, real sessions; memory
 * figures are the kernel's. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/wire.h"
#include "harness.h"
#include "scenario.h"

#define ACTIVE GPUMEM__WIRE__BUFFER_STATE__ACTIVE
#define PAUSED GPUMEM__WIRE__BUFFER_STATE__PAUSED

static struct daemon d;

static void teardown(void) { scene_stop(&d); }

/* What these processes hold of the backend's memory. */
static uint64_t held_by(pid_t pid) { return memfd_bytes(&pid, 1); }

/* Connect to d and say hello in a role under a name. */
static void open_named(struct peer *p, int role, const char *name) {
  peer_connect(p, &d);
  wire_env_free(peer_hello_as(p, role, name));
}

/* Connect worker w as engine-a-0, then a worker v named vname and a
 * controller c named cname. */
static void open_three(struct peer *w, struct peer *v, const char *vname, struct peer *c,
                       const char *cname) {
  open_named(w, WORKER, "engine-a-0");
  open_named(v, WORKER, vname);
  open_named(c, CONTROLLER, cname);
}

/* A scoped request and the answer a test expects: its code, and words
 * its message contains (has) or is (is); NULL: not looked at. */
struct answer {
  struct peer *p;
  bool resume;
  const char *tag; /* NULL: every tag */
  struct scene_scope sc;
  wire_code code;
  const char *has, *is;
};

/* Send each request in turn and check its answer. */
static void expect_answers(const struct answer *a, size_t n) {
  for (size_t i = 0; i < n; i++) {
    scene_send_scoped(a[i].p, a[i].resume, a[i].tag ? &a[i].tag : NULL, a[i].tag ? 1 : 0, &a[i].sc);
    wire_env *r = peer_get(a[i].p, NULL);
    char why[256];
    ck_assert_int_eq(peer_reply_code(r, why, sizeof why), a[i].code);
    wire_env_free(r);
    if (a[i].has) ck_assert_msg(strstr(why, a[i].has), "%s", why);
    if (a[i].is) ck_assert_str_eq(why, a[i].is);
  }
}

/* A worker pauses or resumes its own buffers: it is the owner the daemon
 * waits for, so it answers the events that come before the reply (unmaps
 * close the chunk fds, remaps take the new ones). The reply's code, with
 * the reply in *out. */
static wire_code own_op(struct peer *w, bool resume, const char *const *tags, size_t ntags,
                        struct pbuf *bufs, size_t n, wire_env **out) {
  struct scene_scope sc = {.own = true};
  scene_send_scoped(w, resume, tags, ntags, &sc);
  for (;;) {
    struct frame f;
    wire_env *e = peer_get(w, &f);
    ck_assert_ptr_nonnull(e);
    if (e->body_case != GPUMEM__WIRE__ENVELOPE__BODY_UNMAP &&
        e->body_case != GPUMEM__WIRE__ENVELOPE__BODY_REMAP) {
      frame_release(&f);
      *out = e;
      return peer_reply_code(e, NULL, 0);
    }
    scene_serve_event(w, e, &f, bufs, n);
  }
}

/* The state of buffer id as a controller's list shows it. */
static int state_of(struct peer *c, uint64_t id) {
  wire_env *l = peer_list(c);
  int st = -1;
  for (size_t i = 0; i < l->list_reply->n_buffers; i++)
    if (l->list_reply->buffers[i]->id == id) st = (int)l->list_reply->buffers[i]->state;
  wire_env_free(l);
  return st;
}

/* States of the buffers of pid as a controller's list shows them: how many
 * are in state st, out of *total. */
static size_t count_state(struct peer *c, pid_t pid, int st, size_t *total) {
  wire_env *l = peer_list(c);
  size_t n = 0;
  *total = 0;
  for (size_t i = 0; i < l->list_reply->n_buffers; i++) {
    const Gpumem__Wire__BufferInfo *b = l->list_reply->buffers[i];
    if (b->pid != (uint32_t)pid) continue;
    ++*total;
    n += (int)b->state == st;
  }
  wire_env_free(l);
  return n;
}

/* A worker pauses its own buffers: exactly its memory is released (its
 * backup kept), while another worker's buffers of the same tag stay
 * mapped and ACTIVE; resuming itself brings its contents back. */
START_TEST(worker_self_pause_releases_only_its_own_memory) {
  daemon_start(&d, NULL);
  struct worker other;
  worker_start(&other, &d, "--tag", "kv", "--size", "6M", "--backup", "--name", "engine-b-0",
               NULL);
  struct peer w, c;
  open_named(&w, WORKER, "engine-a-0");
  open_named(&c, CONTROLLER, "rl");
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 4 * MiB, BACKUP, &b);
  scene_fill(&b, 4 * MiB, 0xa11ce);
  pid_t me = getpid();
  ck_assert_uint_eq(held_by(me), 4 * MiB);
  ck_assert_uint_eq(held_by(other.pid), 6 * MiB);
  ck_assert_uint_eq(held_by(d.pid), 10 * MiB);
  const char *tag = "kv";
  wire_env *r;
  ck_assert_int_eq(own_op(&w, false, &tag, 1, &b, 1, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  ck_assert_uint_eq(r->op_reply->bytes, 4 * MiB);
  ck_assert_uint_eq(r->op_reply->backup_bytes, 4 * MiB);
  wire_env_free(r);
  /* Its 4 MiB are gone from every process; the other's 6 MiB stay. */
  ck_assert_uint_eq(held_by(me), 0);
  ck_assert_uint_eq(held_by(d.pid), 6 * MiB);
  ck_assert_uint_eq(held_by(other.pid), 6 * MiB);
  size_t total;
  ck_assert_uint_eq(count_state(&c, other.pid, ACTIVE, &total), 1);
  ck_assert_uint_eq(total, 1);
  ck_assert_int_eq(state_of(&c, b.id), PAUSED);
  wire_env *s = peer_status(&c);
  const Gpumem__Wire__TagInfo *t = peer_tag(s, "kv");
  ck_assert(t->mixed);
  ck_assert_uint_eq(t->paused_buffers, 1);
  ck_assert_uint_eq(t->paused_bytes, 4 * MiB);
  wire_env_free(s);
  /* Resuming itself: its memory and contents come back. */
  ck_assert_int_eq(own_op(&w, true, &tag, 1, &b, 1, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  ck_assert_uint_eq(r->op_reply->backup_bytes, 4 * MiB);
  wire_env_free(r);
  ck_assert_uint_eq(b.nfds, 1);
  ck_assert(scene_holds(&b, 4 * MiB, 0xa11ce));
  ck_assert_uint_eq(held_by(d.pid), 10 * MiB);
  ck_assert_int_eq(state_of(&c, b.id), ACTIVE);
  /* The other worker saw no event at all. */
  ck_assert_int_eq(worker_count(&other, "paused buffer"), 0);
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
  ck_assert_int_eq(worker_stop(&other, SIGTERM), 0);
}
END_TEST

/* own with no tags pauses every tag of the worker, and nothing else. */
START_TEST(own_without_tags_pauses_all_the_workers_tags) {
  daemon_start(&d, NULL);
  struct peer w, v, c;
  open_three(&w, &v, "engine-b-0", &c, "rl");
  struct pbuf mine[3], theirs;
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &mine[0]);
  peer_alloc(&w, "weights", 0, 4 * MiB, 0, &mine[1]);
  peer_alloc(&w, "graph", 1, 2 * MiB, 0, &mine[2]);
  peer_alloc(&v, "kv", 0, 8 * MiB, 0, &theirs);
  wire_env *r;
  ck_assert_int_eq(own_op(&w, false, NULL, 0, mine, 3, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 3);
  ck_assert_uint_eq(r->op_reply->bytes, 8 * MiB);
  ck_assert_uint_eq(r->op_reply->n_detail, 3);
  wire_env_free(r);
  for (int i = 0; i < 3; i++) ck_assert_int_eq(state_of(&c, mine[i].id), PAUSED);
  ck_assert_int_eq(state_of(&c, theirs.id), ACTIVE);
  ck_assert_uint_eq(held_by(d.pid), 8 * MiB);
  ck_assert(!peer_waiting(&v)); /* no event for the other worker */
  /* Again: nothing left to pause is not an error. */
  ck_assert_int_eq(own_op(&w, false, NULL, 0, mine, 3, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 0);
  wire_env_free(r);
  ck_assert_int_eq(own_op(&w, true, NULL, 0, mine, 3, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 3);
  wire_env_free(r);
  for (int i = 0; i < 3; i++) ck_assert_uint_eq(mine[i].nfds, 1);
  ck_assert_uint_eq(held_by(d.pid), 16 * MiB);
  for (int i = 0; i < 3; i++) peer_unmap(&mine[i]);
  peer_unmap(&theirs);
  peer_close(&w);
  peer_close(&v);
  peer_close(&c);
}
END_TEST

/* A controller pauses one of two sessions by pid; the other keeps its
 * memory; resuming by pid brings the contents back. */
START_TEST(controller_pause_by_pid_selects_one_session) {
  daemon_start(&d, NULL);
  struct worker a, b;
  worker_start(&a, &d, "--tag", "kv", "--size", "4M", "--backup", NULL);
  worker_start(&b, &d, "--tag", "kv", "--size", "6M", "--backup", NULL);
  struct peer c;
  open_named(&c, CONTROLLER, "rl");
  uint32_t pid = (uint32_t)a.pid;
  struct scene_scope sc = {.pids = &pid, .npids = 1};
  scene_send_scoped(&c, false, (const char *[]){"kv"}, 1, &sc);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  ck_assert_uint_eq(r->op_reply->bytes, 4 * MiB);
  wire_env_free(r);
  ck_assert_uint_eq(held_by(a.pid), 0);
  ck_assert_uint_eq(held_by(b.pid), 6 * MiB);
  ck_assert_uint_eq(held_by(d.pid), 6 * MiB);
  size_t total;
  ck_assert_uint_eq(count_state(&c, a.pid, PAUSED, &total), 1);
  ck_assert_uint_eq(count_state(&c, b.pid, ACTIVE, &total), 1);
  scene_send_scoped(&c, true, (const char *[]){"kv"}, 1, &sc);
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  wire_env_free(r);
  ck_assert(worker_wait_for(&a, "contents kept", 1, 5000));
  ck_assert_int_eq(worker_count(&b, "paused buffer"), 0);
  ck_assert_uint_eq(held_by(d.pid), 10 * MiB);
  peer_close(&c);
  ck_assert_int_eq(worker_stop(&a, SIGTERM), 0);
  ck_assert_int_eq(worker_stop(&b, SIGTERM), 0);
}
END_TEST

/* A name prefix selects engine-a-* and not engine-b-*; the tag is then
 * partly paused: others may still allocate in it, while a pause of every
 * session makes it fully paused and refuses them. */
START_TEST(controller_pause_by_prefix_selects_matching_names) {
  daemon_start(&d, NULL);
  struct worker a0, a1, b0;
  worker_start(&a0, &d, "--tag", "kv", "--size", "2M", "--name", "engine-a-0", NULL);
  worker_start(&a1, &d, "--tag", "kv", "--size", "4M", "--name", "engine-a-1", NULL);
  worker_start(&b0, &d, "--tag", "kv", "--size", "8M", "--name", "engine-b-0", NULL);
  struct peer c, late;
  open_named(&c, CONTROLLER, "rl");
  struct scene_scope sc = {.prefix = "engine-a-"};
  scene_send_scoped(&c, false, (const char *[]){"kv"}, 1, &sc);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 2);
  ck_assert_uint_eq(r->op_reply->bytes, 6 * MiB);
  wire_env_free(r);
  ck_assert_uint_eq(held_by(a0.pid) + held_by(a1.pid), 0);
  ck_assert_uint_eq(held_by(b0.pid), 8 * MiB);
  ck_assert_uint_eq(held_by(d.pid), 8 * MiB);
  wire_env *s = peer_status(&c);
  const Gpumem__Wire__TagInfo *t = peer_tag(s, "kv");
  ck_assert(t->mixed);
  ck_assert_int_eq(t->state, PAUSED);
  wire_env_free(s);
  /* Partly paused: a new buffer starts ACTIVE. */
  open_named(&late, WORKER, "engine-c-0");
  struct pbuf x;
  ck_assert_int_eq(peer_try_alloc(&late, "kv", 0, 2 * MiB, 0, &x), CODE(OK));
  ck_assert_int_eq(state_of(&c, x.id), ACTIVE);
  peer_unmap(&x);
  peer_close(&late); /* its buffer goes with its session */
  /* Fully paused: refused. */
  r = scene_op(&c, false, "kv", CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 1); /* engine-b-0's */
  wire_env_free(r);
  open_named(&late, WORKER, "engine-c-1");
  ck_assert_int_eq(peer_try_alloc(&late, "kv", 0, 2 * MiB, 0, &x), CODE(TAG_PAUSED));
  /* A scoped resume of engine-a-*: the tag is no longer fully paused. */
  scene_send_scoped(&c, true, (const char *[]){"kv"}, 1, &sc);
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 2);
  wire_env_free(r);
  size_t total;
  ck_assert_uint_eq(count_state(&c, b0.pid, PAUSED, &total), 1);
  ck_assert_int_eq(peer_try_alloc(&late, "kv", 0, 2 * MiB, 0, &x), CODE(OK));
  peer_unmap(&x);
  peer_close(&late);
  ck_assert_int_eq(scene_op_code(&c, true, "kv"), CODE(OK));
  peer_close(&c);
  ck_assert_int_eq(worker_stop(&a0, SIGTERM), 0);
  ck_assert_int_eq(worker_stop(&a1, SIGTERM), 0);
  ck_assert_int_eq(worker_stop(&b0, SIGTERM), 0);
}
END_TEST

/* Scopes are checked at the edge: own with pids or a prefix, pid 0, too
 * many pids, a prefix that is no name; the session carries on. */
START_TEST(malformed_scopes_are_invalid) {
  daemon_start(&d, NULL);
  struct peer w, c;
  open_named(&w, WORKER, "engine-a-0");
  open_named(&c, CONTROLLER, "rl");
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &b);
  uint32_t pids[WIRE_MAX_PIDS + 1], zero[2] = {(uint32_t)getpid(), 0};
  for (size_t i = 0; i <= WIRE_MAX_PIDS; i++) pids[i] = (uint32_t)getpid();
  char longname[WIRE_NAME_MAX + 2];
  memset(longname, 'e', sizeof longname - 1);
  longname[sizeof longname - 1] = '\0';
  const struct scene_scope own_pids = {.own = true, .pids = pids, .npids = 1};
  const struct answer invalid[] = {
      {&w, false, "kv", own_pids, CODE(INVALID_ARGUMENT), "own", NULL},
      {&c, true, "kv", own_pids, CODE(INVALID_ARGUMENT), NULL, NULL},
      {&w, false, "kv", {.own = true, .prefix = "engine-"}, CODE(INVALID_ARGUMENT), NULL, NULL},
      {&c, false, "kv", {.pids = pids, .npids = WIRE_MAX_PIDS + 1}, CODE(INVALID_ARGUMENT),
       "too many pids", NULL},
      {&c, false, "kv", {.pids = zero, .npids = 2}, CODE(INVALID_ARGUMENT), "pid 0", NULL},
  };
  expect_answers(invalid, sizeof invalid / sizeof invalid[0]);
  const char *bad[] = {"engine\n", "engine\x1b[2J", "\xc3\x28", "\xed\xa0\x80", "\x7f"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    const struct answer a = {&c, false, "kv", {.prefix = bad[i]}, CODE(INVALID_ARGUMENT),
                             "session_prefix", NULL};
    expect_answers(&a, 1);
  }
  const struct answer too_long = {&c, false, "kv", {.prefix = longname}, CODE(INVALID_ARGUMENT),
                                  NULL, NULL};
  expect_answers(&too_long, 1);
  /* Nothing changed, and both sessions still work. */
  ck_assert_int_eq(state_of(&c, b.id), ACTIVE);
  const struct answer utf8 = {&c, false, "kv", {.prefix = "engine-\xc3\xa9"}, CODE(NOT_FOUND),
                              NULL, NULL};
  expect_answers(&utf8, 1);
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A worker may pause and resume only its own buffers. */
START_TEST(workers_may_not_pause_other_sessions) {
  daemon_start(&d, NULL);
  struct peer w, v;
  open_named(&w, WORKER, "engine-a-0");
  open_named(&v, WORKER, "engine-b-0");
  struct pbuf b;
  peer_alloc(&v, "kv", 0, 2 * MiB, 0, &b);
  uint32_t pid = (uint32_t)getpid();
  const struct answer denied[] = {
      {&w, false, "kv", {.pids = &pid, .npids = 1}, CODE(PERMISSION_DENIED), "other sessions",
       NULL},
      {&w, true, "kv", {.prefix = "engine-b"}, CODE(PERMISSION_DENIED), NULL, NULL},
      {&w, false, "kv", {0}, CODE(PERMISSION_DENIED), NULL, NULL},
      {&w, false, NULL, {0}, CODE(PERMISSION_DENIED), NULL, NULL},
  };
  expect_answers(denied, sizeof denied / sizeof denied[0]);
  ck_assert(!peer_waiting(&v)); /* nothing reached the owner */
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&v);
}
END_TEST

/* A scope that selects no session, and an own scope naming a tag the
 * session has nothing in, are NOT_FOUND with words that say so. */
START_TEST(scopes_that_select_nothing_are_not_found) {
  daemon_start(&d, NULL);
  struct peer w, v, c;
  open_three(&w, &v, "engine-a-1", &c, "engine-b-ctl"); /* a controller is not selected */
  struct pbuf b[2];
  peer_alloc(&v, "kv", 0, 2 * MiB, 0, &b[0]);
  peer_alloc(&v, "weights", 0, 2 * MiB, 0, &b[1]);
  peer_unmap(&b[0]);
  peer_unmap(&b[1]);
  pid_t gone = fork();
  if (gone == 0) _exit(0);
  ck_assert_int_eq(waitpid(gone, NULL, 0), gone);
  uint32_t pid = (uint32_t)gone, mine = (uint32_t)getpid();
  char no_pid[64], no_pid_name[64];
  snprintf(no_pid, sizeof no_pid, "no worker session with pid %u", pid);
  snprintf(no_pid_name, sizeof no_pid_name, "no worker session with pid %u named 'engine-b*'",
           mine);
  const struct scene_scope by_name = {.prefix = "engine-b"}, own = {.own = true};
  const struct answer not_found[] = {
      {&c, false, "kv", {.pids = &pid, .npids = 1}, CODE(NOT_FOUND), NULL, no_pid},
      {&c, true, NULL, by_name, CODE(NOT_FOUND), NULL, "no worker session named 'engine-b*'"},
      {&c, false, "kv", {.pids = &mine, .npids = 1, .prefix = "engine-b"}, CODE(NOT_FOUND), NULL,
       no_pid_name},
      /* Unknown tags stay NOT_FOUND; so is a tag the session has nothing in. */
      {&c, false, "nope", by_name, CODE(NOT_FOUND), NULL, "no tag 'nope'"},
      {&w, false, "kv", own, CODE(NOT_FOUND), NULL, "this session has no buffers in tag 'kv'"},
      {&w, true, "weights", own, CODE(NOT_FOUND), NULL, NULL},
  };
  expect_answers(not_found, sizeof not_found / sizeof not_found[0]);
  /* Nothing moved. */
  wire_env *s = peer_status(&c);
  ck_assert_int_eq(peer_tag(s, "kv")->state, ACTIVE);
  ck_assert_uint_eq(peer_tag(s, "kv")->paused_buffers, 0);
  wire_env_free(s);
  ck_assert(!peer_waiting(&v));
  peer_close(&w);
  peer_close(&v);
  peer_close(&c);
}
END_TEST

/* A scoped pause, then a resume of everything: every paused buffer comes
 * back, the tag is ACTIVE again and not mixed. */
START_TEST(unscoped_resume_resumes_what_scoped_pauses_paused) {
  daemon_start(&d, NULL);
  struct peer a, b, c;
  open_three(&a, &b, "engine-b-0", &c, "rl");
  struct pbuf ab[2], bb[2];
  peer_alloc(&a, "kv", 0, 2 * MiB, 0, &ab[0]);
  peer_alloc(&a, "weights", 0, 4 * MiB, 0, &ab[1]);
  peer_alloc(&b, "kv", 0, 6 * MiB, 0, &bb[0]);
  peer_alloc(&b, "weights", 0, 8 * MiB, 0, &bb[1]);
  /* engine-a pauses itself, the controller pauses engine-b's kv. */
  wire_env *r;
  ck_assert_int_eq(own_op(&a, false, NULL, 0, ab, 2, &r), CODE(OK));
  wire_env_free(r);
  struct scene_scope sb = {.prefix = "engine-b"};
  scene_send_scoped(&c, false, (const char *[]){"kv"}, 1, &sb);
  peer_serve(&b, bb, 2, 1);
  ck_assert_int_eq(peer_op_code(&c), CODE(OK));
  ck_assert_uint_eq(held_by(d.pid), 8 * MiB);
  /* A resume of every tag and every session. */
  struct scene_scope all = {0};
  scene_send_scoped(&c, true, NULL, 0, &all);
  peer_serve(&a, ab, 2, 1);
  peer_serve(&b, bb, 2, 1);
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 3);
  ck_assert_uint_eq(r->op_reply->bytes, 12 * MiB);
  wire_env_free(r);
  ck_assert_uint_eq(held_by(d.pid), 20 * MiB);
  wire_env *s = peer_status(&c);
  for (size_t i = 0; i < s->status_reply->n_tags; i++) {
    ck_assert_int_eq(s->status_reply->tags[i]->state, ACTIVE);
    ck_assert(!s->status_reply->tags[i]->mixed);
  }
  wire_env_free(s);
  for (int i = 0; i < 2; i++) {
    ck_assert_uint_eq(ab[i].nfds, 1);
    ck_assert_uint_eq(bb[i].nfds, 1);
    peer_unmap(&ab[i]);
    peer_unmap(&bb[i]);
  }
  peer_close(&a);
  peer_close(&b);
  peer_close(&c);
}
END_TEST

/* A scoped resume whose selected owner is stopped: it times out naming
 * that owner, the owner that did map unmaps again, everything stays
 * PAUSED (buffers outside the scope untouched), and the late ack settles
 * the stopped owner's buffer; then everything resumes with its contents. */
START_TEST(scoped_resume_with_a_stopped_owner_rolls_back) {
  daemon_start(&d, NULL);
  struct worker a0, a1, b0;
  worker_start(&a0, &d, "--tag", "kv", "--size", "2M", "--backup", "--name", "engine-a-0", NULL);
  worker_start(&a1, &d, "--tag", "kv", "--size", "4M", "--backup", "--name", "engine-a-1", NULL);
  worker_start(&b0, &d, "--tag", "kv", "--size", "8M", "--backup", "--name", "engine-b-0", NULL);
  struct peer c;
  open_named(&c, CONTROLLER, "rl");
  ck_assert_int_eq(scene_op_code(&c, false, "kv"), CODE(OK));
  ck_assert_uint_eq(held_by(d.pid), 0);
  worker_freeze(&a0);
  struct scene_scope sa = {.prefix = "engine-a-", .timeout_ms = 500};
  scene_send_scoped(&c, true, (const char *[]){"kv"}, 1, &sa);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(CLIENT_TIMEOUT));
  ck_assert_uint_eq(r->error->n_pids, 1);
  ck_assert_uint_eq(r->error->pids[0], (uint32_t)a0.pid);
  ck_assert_ptr_nonnull(strstr(r->error->message, "nothing resumed"));
  wire_env_free(r);
  /* engine-a-1 mapped and unmapped again; engine-b-0 saw nothing. */
  ck_assert(worker_wait_for(&a1, "paused buffer", 2, 5000));
  ck_assert_int_eq(worker_count(&b0, "resumed buffer"), 0);
  size_t total;
  ck_assert_uint_eq(count_state(&c, a1.pid, PAUSED, &total), 1);
  ck_assert_uint_eq(count_state(&c, b0.pid, PAUSED, &total), 1);
  ck_assert(peer_wait_tag(&c, "kv", GPUMEM__WIRE__BUFFER_STATE__RESUMING, 1));
  ck_assert_uint_eq(held_by(a1.pid), 0);
  /* The late ack rolls the stopped owner's buffer back too. */
  kill(a0.pid, SIGCONT);
  ck_assert(peer_wait_tag(&c, "kv", GPUMEM__WIRE__BUFFER_STATE__PAUSED, 0));
  ck_assert(worker_wait_for(&a0, "paused buffer", 2, 5000));
  ck_assert_uint_eq(held_by(d.pid), 0);
  ck_assert_uint_eq(held_by(a0.pid) + held_by(a1.pid) + held_by(b0.pid), 0);
  /* Each engine-a worker checked its contents once when it mapped; now a
   * resume of every session brings all three back. */
  ck_assert_int_eq(scene_op_code(&c, true, "kv"), CODE(OK));
  ck_assert(worker_wait_for(&a0, "contents kept", 2, 5000));
  ck_assert(worker_wait_for(&a1, "contents kept", 2, 5000));
  ck_assert(worker_wait_for(&b0, "contents kept", 1, 5000));
  ck_assert_int_eq(worker_count(&a0, "FAILED") + worker_count(&a1, "FAILED"), 0);
  peer_close(&c);
  ck_assert_int_eq(worker_stop(&a0, SIGTERM), 0);
  ck_assert_int_eq(worker_stop(&a1, SIGTERM), 0);
  ck_assert_int_eq(worker_stop(&b0, SIGTERM), 0);
}
END_TEST

/* A worker that pauses itself and goes away without acking ends its own
 * operation (nobody is left to answer); the next one runs at once. */
START_TEST(worker_that_leaves_mid_self_pause_ends_cleanly) {
  daemon_start(&d, "--ack-timeout", "60s", NULL);
  struct peer w, v, c;
  open_three(&w, &v, "engine-b-0", &c, "rl");
  struct pbuf b, keep;
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &b);
  peer_alloc(&v, "kv", 0, 2 * MiB, 0, &keep);
  struct scene_scope own = {.own = true};
  scene_send_scoped(&w, false, (const char *[]){"kv"}, 1, &own);
  wire_env *e = peer_event(&w, NULL);
  wire_env_free(e);
  peer_unmap(&b);
  peer_close(&w); /* no ack */
  double t0 = now_ms();
  peer_op(&c, false, "kv", 0, 0); /* queued behind it, or after it */
  peer_serve(&v, &keep, 1, 1);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  ck_assert_uint_eq(r->op_reply->bytes, 2 * MiB);
  wire_env_free(r);
  ck_assert_double_lt(now_ms() - t0, 30000); /* not the ack timeout */
  ck_assert_uint_eq(held_by(d.pid), 0);
  peer_close(&v);
  peer_close(&c);
}
END_TEST

int main(void) {
  return HARNESS_RUN("scope", 60, NULL, teardown,
                     worker_self_pause_releases_only_its_own_memory,
                     own_without_tags_pauses_all_the_workers_tags,
                     controller_pause_by_pid_selects_one_session,
                     controller_pause_by_prefix_selects_matching_names,
                     malformed_scopes_are_invalid,
                     workers_may_not_pause_other_sessions,
                     scopes_that_select_nothing_are_not_found,
                     unscoped_resume_resumes_what_scoped_pauses_paused,
                     scoped_resume_with_a_stopped_owner_rolls_back,
                     worker_that_leaves_mid_self_pause_ends_cleanly);
}
