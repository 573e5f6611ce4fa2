/* Tenants: a tag belongs to the uid that created it unless a controller
 * shares it, each uid's buffers and bytes are capped, a worker sees only
 * its own uid's sessions, tags and buffers, and status and list come in
 * pages that a controller can walk to the end. The other uids need root
 * (the test connects under a borrowed effective uid, which is what
 * SO_PEERCRED reports); without it those tests say so and pass. */
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpumem.h"
#include "harness.h"

#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x
#define WORKER GPUMEM__WIRE__ROLE__ROLE_WORKER
#define CONTROLLER GPUMEM__WIRE__ROLE__ROLE_CONTROLLER
#define MiB (1ull << 20)
#define ALICE 1000
#define BOB 1001

static struct daemon d;

/* Start a daemon every uid may reach, with extra arguments. */
static void daemon_open_to_all(const char *const *extra) {
  const char *args[16] = {"--socket-mode", "0666"};
  size_t n = 2;
  for (; extra && *extra && n < 15; extra++) args[n++] = *extra;
  args[n] = NULL;
  daemon_start(&d, args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7],
               args[8], args[9], NULL);
  ck_assert_int_eq(chmod(d.dir, 0755), 0);
}

/* Whether this test can be other uids; says so when it cannot. */
static bool can_be_others(const char *test) {
  if (geteuid() == 0) return true;
  printf("%s: skipped: needs root to connect as other uids\n", test);
  return false;
}

/* Connect as uid (root's real uid is kept, to come back) and say hello. */
static void open_as(struct peer *p, uid_t uid, int role) {
  ck_assert_int_eq(seteuid(uid), 0);
  peer_connect(p, &d);
  ck_assert_int_eq(seteuid(0), 0);
  wire_env *r = peer_hello(p, role);
  wire_env_free(r);
}

/* Share a tag or take that back; the reply's code. */
static wire_code share(struct peer *c, const char *tag, bool shared) {
  Gpumem__Wire__ShareRequest q = GPUMEM__WIRE__SHARE_REQUEST__INIT;
  q.tag = (char *)tag;
  q.shared = shared;
  wire_env env = peer_env(0, GPUMEM__WIRE__ENVELOPE__BODY_SHARE);
  env.share = &q;
  return peer_call_code(c, &env, NULL, 0);
}

/* One status page at these cursors, at most limit of each list. */
static wire_env *status_page(struct peer *c, uint64_t tags, uint64_t sessions, uint32_t limit) {
  Gpumem__Wire__StatusRequest q = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  q.tag_cursor = tags;
  q.session_cursor = sessions;
  q.limit = limit;
  wire_env env = peer_env(0, GPUMEM__WIRE__ENVELOPE__BODY_STATUS);
  env.status = &q;
  return peer_ask(c, &env, GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY);
}

/* One list page after a buffer id. */
static wire_env *list_page(struct peer *c, uint64_t after, uint32_t limit) {
  Gpumem__Wire__ListRequest q = GPUMEM__WIRE__LIST_REQUEST__INIT;
  q.after = after;
  q.limit = limit;
  wire_env env = peer_env(0, GPUMEM__WIRE__ENVELOPE__BODY_LIST);
  env.list = &q;
  return peer_ask(c, &env, GPUMEM__WIRE__ENVELOPE__BODY_LIST_REPLY);
}

/* Whether a status lists a tag. */
static bool has_tag(const wire_env *st, const char *name) {
  const Gpumem__Wire__StatusReply *r = st->status_reply;
  for (size_t i = 0; i < r->n_tags; i++)
    if (strcmp(r->tags[i]->name, name) == 0) return true;
  return false;
}

static void own_pause(struct peer *w, const char *tag, uint32_t timeout_ms);

/* Another uid can neither add buffers to a tag, nor (paused) slip
 * ALLOW_PAUSED ones into it to make its resume fail, nor hold its pause
 * hostage with a worker that never acks: the owner's pause and resume go
 * through untouched. */
START_TEST(another_uid_cannot_join_a_tag) {
  if (!can_be_others("another_uid_cannot_join_a_tag")) return;
  daemon_open_to_all((const char *const[]){"--host-device-size", "64M", "--ack-timeout", "500ms",
                                           NULL});
  struct peer alice, bob, ctl;
  open_as(&alice, ALICE, WORKER);
  open_as(&bob, BOB, WORKER);
  open_as(&ctl, 0, CONTROLLER);
  struct pbuf a, x;
  peer_alloc(&alice, "kv", 0, 40 * MiB, 0, &a);
  char why[256];
  ck_assert_int_eq(peer_try_alloc(&bob, "kv", 0, 2 * MiB, 0, &x), CODE(PERMISSION_DENIED));
  peer_op_served(&ctl, false, "kv", &alice, &a, 1);
  /* Paused, the tag still refuses bob's buffers that would start paused
   * and then need room on resume. */
  ck_assert_int_eq(peer_try_alloc(&bob, "kv", 0, 40 * MiB, GPUMEM__WIRE__BUFFER_FLAG__FLAG_ALLOW_PAUSED,
                                  &x),
                   CODE(PERMISSION_DENIED));
  wire_env *st = peer_status(&ctl);
  const Gpumem__Wire__TagInfo *t = peer_tag(st, "kv");
  ck_assert_uint_eq(t->buffers, 1);
  ck_assert_uint_eq(t->owner_uid, ALICE);
  ck_assert(t->owned && !t->shared);
  wire_env_free(st);
  peer_op(&ctl, true, "kv", 0, 0);
  peer_serve(&alice, &a, 1, 1);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&ctl, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  wire_env_free(r);
  /* The refusal names the owner and the way out. */
  peer_push_alloc(&bob, "kv", 0, 2 * MiB, 0);
  r = peer_answer(&bob);
  ck_assert_int_eq(peer_reply_code(r, why, sizeof why), CODE(PERMISSION_DENIED));
  ck_assert_msg(strstr(why, "belongs to uid 1000") && strstr(why, "gpumemctl share kv"), "%s",
                why);
  wire_env_free(r);
  peer_unmap(&a);
  peer_close(&alice);
  peer_close(&bob);
  peer_close(&ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* A shared tag takes every uid's buffers, and a pause covers them all;
 * unshared, it is its owner's again and what joined stays. */
START_TEST(shared_tags_take_every_uid) {
  if (!can_be_others("shared_tags_take_every_uid")) return;
  daemon_open_to_all((const char *const[]){"--shared-tag", "common", NULL});
  struct peer alice, bob, ctl;
  open_as(&alice, ALICE, WORKER);
  open_as(&bob, BOB, WORKER);
  open_as(&ctl, 0, CONTROLLER);
  struct pbuf a, b, x;
  peer_alloc(&alice, "common", 0, 2 * MiB, 0, &a); /* shared from the start */
  peer_alloc(&bob, "common", 0, 2 * MiB, 0, &b);
  peer_alloc(&alice, "rollout", 0, 2 * MiB, 0, &x);
  peer_unmap(&x);
  ck_assert_int_eq(peer_try_alloc(&bob, "rollout", 0, 2 * MiB, 0, &x), CODE(PERMISSION_DENIED));
  ck_assert_int_eq(share(&alice, "rollout", true), CODE(PERMISSION_DENIED)); /* not a controller */
  ck_assert_int_eq(share(&ctl, "rollout", true), CODE(OK));
  peer_alloc(&bob, "rollout", 0, 2 * MiB, 0, &x);
  wire_env *st = peer_status(&ctl);
  ck_assert(peer_tag(st, "rollout")->shared && peer_tag(st, "common")->shared);
  ck_assert_uint_eq(peer_tag(st, "rollout")->buffers, 2);
  wire_env_free(st);
  /* Bob's view of a shared tag counts bob's buffers alone. */
  st = peer_status(&bob);
  ck_assert_uint_eq(peer_tag(st, "rollout")->buffers, 1);
  wire_env_free(st);
  peer_op(&ctl, false, "common", 0, 0);
  peer_serve(&alice, &a, 1, 1);
  peer_serve(&bob, &b, 1, 1);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&ctl, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 2);
  wire_env_free(r);
  ck_assert_int_eq(share(&ctl, "rollout", false), CODE(OK));
  struct pbuf y;
  ck_assert_int_eq(peer_try_alloc(&bob, "rollout", 0, 2 * MiB, 0, &y), CODE(PERMISSION_DENIED));
  st = peer_status(&ctl);
  const Gpumem__Wire__TagInfo *t = peer_tag(st, "rollout");
  ck_assert(!t->shared && t->owned && t->owner_uid == ALICE && t->buffers == 2);
  wire_env_free(st);
  ck_assert_int_eq(share(&ctl, "nothing", false), CODE(NOT_FOUND));
  /* Bob pauses his own buffer of the shared tag: alice's view of it is her
   * own buffer's state (ACTIVE), the controller's is mixed. */
  peer_op(&ctl, true, "common", 0, 0);
  peer_serve(&alice, &a, 1, 1);
  peer_serve(&bob, &b, 1, 1);
  ck_assert_int_eq(peer_op_code(&ctl), CODE(OK));
  own_pause(&bob, "common", 0);
  peer_serve(&bob, &b, 1, 1);
  wire_env *r2 = peer_get(&bob, NULL);
  ck_assert_int_eq(peer_reply_code(r2, NULL, 0), CODE(OK));
  wire_env_free(r2);
  st = peer_status(&alice);
  t = peer_tag(st, "common");
  ck_assert(t->state == GPUMEM__WIRE__BUFFER_STATE__ACTIVE && !t->mixed && t->buffers == 1);
  wire_env_free(st);
  st = peer_status(&ctl);
  ck_assert(peer_tag(st, "common")->mixed);
  wire_env_free(st);
  peer_unmap(&a);
  peer_unmap(&x);
  peer_close(&alice);
  peer_close(&bob);
  peer_close(&ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* A worker's status and list hold its own uid's sessions, tags, buffers,
 * tenant line and operations, nothing of another uid's; a controller's
 * hold everyone's. */
START_TEST(workers_see_only_their_own) {
  if (!can_be_others("workers_see_only_their_own")) return;
  daemon_open_to_all(NULL);
  struct peer alice, alice2, bob, ctl;
  open_as(&alice, ALICE, WORKER);
  open_as(&alice2, ALICE, WORKER);
  open_as(&bob, BOB, WORKER);
  open_as(&ctl, 0, CONTROLLER);
  struct pbuf a, a2, b;
  peer_alloc(&alice, "alice-kv", 0, 2 * MiB, 0, &a);
  peer_alloc(&alice2, "alice-kv", 1, 4 * MiB, 0, &a2);
  peer_alloc(&bob, "bob-secret", 0, 2 * MiB, 0, &b);
  peer_op_served(&ctl, false, "bob-secret", &bob, &b, 1);
  wire_env *st = peer_status(&alice);
  const Gpumem__Wire__StatusReply *s = st->status_reply;
  ck_assert_uint_eq(s->n_sessions, 2);
  for (size_t i = 0; i < s->n_sessions; i++) ck_assert_uint_eq(s->sessions[i]->uid, ALICE);
  ck_assert(has_tag(st, "alice-kv") && !has_tag(st, "bob-secret"));
  ck_assert_uint_eq(s->n_tenants, 1);
  ck_assert_uint_eq(s->tenants[0]->uid, ALICE);
  ck_assert_uint_eq(s->tenants[0]->buffers, 2);
  ck_assert_uint_eq(s->tenants[0]->bytes, 6 * MiB);
  ck_assert_uint_eq(s->tenants[0]->n_device_bytes, 2);
  ck_assert_uint_eq(s->tenants[0]->device_bytes[1], 4 * MiB);
  ck_assert_uint_eq(s->n_recent_ops, 0); /* the controller's pause of bob's tag */
  wire_env_free(st);
  st = list_page(&alice, 0, 0); /* both of alice's sessions' buffers, not bob's */
  ck_assert_uint_eq(st->list_reply->n_buffers, 2);
  ck_assert_uint_eq(st->list_reply->buffers[0]->id, a.id);
  ck_assert_uint_eq(st->list_reply->buffers[1]->id, a2.id);
  wire_env_free(st);
  st = list_page(&alice, 0, 1); /* in pages of one: a, then a2, then none */
  ck_assert(st->list_reply->n_buffers == 1 && st->list_reply->buffers[0]->id == a.id);
  ck_assert_uint_eq(st->list_reply->next, a.id);
  wire_env_free(st);
  st = list_page(&alice, a.id, 1);
  ck_assert(st->list_reply->n_buffers == 1 && st->list_reply->buffers[0]->id == a2.id);
  ck_assert_uint_eq(st->list_reply->next, 0);
  wire_env_free(st);
  st = peer_status(&ctl);
  s = st->status_reply;
  ck_assert_uint_eq(s->n_sessions, 4);
  ck_assert(has_tag(st, "alice-kv") && has_tag(st, "bob-secret"));
  ck_assert_uint_eq(s->n_tenants, 2);
  ck_assert_uint_eq(s->n_recent_ops, 1);
  wire_env_free(st);
  peer_unmap(&a);
  peer_unmap(&a2);
  peer_close(&alice);
  peer_close(&alice2);
  peer_close(&bob);
  peer_close(&ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* Per-uid quotas hold across a uid's sessions, count paused buffers, leave
 * other uids alone, and come back as buffers are freed. */
START_TEST(quotas_hold_across_sessions) {
  if (!can_be_others("quotas_hold_across_sessions")) return;
  daemon_open_to_all((const char *const[]){"--max-device-bytes-per-uid", "8M",
                                           "--max-backup-bytes-per-uid", "4M", NULL});
  struct peer a1, a2, bob, ctl;
  open_as(&a1, ALICE, WORKER);
  open_as(&a2, ALICE, WORKER);
  open_as(&bob, BOB, WORKER);
  open_as(&ctl, 0, CONTROLLER);
  struct pbuf x, y, z;
  peer_alloc(&a1, "kv", 0, 6 * MiB, 0, &x);
  peer_op_served(&ctl, false, "kv", &a1, &x, 1);
  /* Paused, its bytes still count: a resume must find room in the quota. */
  peer_push_alloc(&a2, "other", 0, 4 * MiB, 0);
  wire_env *r = peer_answer(&a2);
  char why[256];
  ck_assert_int_eq(peer_reply_code(r, why, sizeof why), CODE(LIMIT_EXCEEDED));
  ck_assert_msg(strstr(why, "uid 1000 holds 6.00 MiB on device 0") &&
                    strstr(why, "--max-device-bytes-per-uid 8.00 MiB"),
                "%s", why);
  wire_env_free(r);
  peer_alloc(&a2, "other", 1, 4 * MiB, GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP, &y);
  peer_push_alloc(&a2, "other", 1, 2 * MiB, GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP);
  r = peer_answer(&a2);
  ck_assert_int_eq(peer_reply_code(r, why, sizeof why), CODE(LIMIT_EXCEEDED));
  ck_assert_msg(strstr(why, "--max-backup-bytes-per-uid"), "%s", why);
  wire_env_free(r);
  peer_alloc(&bob, "bobs", 0, 8 * MiB, 0, &z); /* alice's use is not bob's */
  peer_unmap(&z);
  wire_env *st = peer_status(&ctl);
  const Gpumem__Wire__StatusReply *s = st->status_reply;
  ck_assert_uint_eq(s->max_device_bytes_per_uid, 8 * MiB);
  ck_assert_uint_eq(s->max_backup_bytes_per_uid, 4 * MiB);
  ck_assert_uint_eq(s->n_tenants, 2);
  ck_assert_uint_eq(s->tenants[0]->uid, ALICE);
  ck_assert_uint_eq(s->tenants[0]->bytes, 10 * MiB);
  ck_assert_uint_eq(s->tenants[0]->backup_bytes, 4 * MiB);
  ck_assert_uint_eq(s->tenants[1]->uid, BOB);
  ck_assert_uint_eq(s->tenants[1]->bytes, 8 * MiB);
  wire_env_free(st);
  /* Alice's first session ends: its paused buffer goes, and the room with
   * it. */
  peer_close(&a1);
  bool gone = false;
  for (int i = 0; i < 300 && !gone; i++) {
    st = peer_status(&ctl);
    gone = st->status_reply->n_tenants == 2 && st->status_reply->tenants[0]->bytes == 4 * MiB;
    wire_env_free(st);
    if (!gone) usleep(10000);
  }
  ck_assert_msg(gone, "alice's first session's buffer still counted");
  peer_alloc(&a2, "other", 0, 8 * MiB, 0, &x);
  peer_unmap(&x);
  peer_unmap(&y);
  peer_close(&a2);
  peer_close(&bob);
  peer_close(&ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* Send a worker's pause of its own buffers in one tag, with a timeout. */
static void own_pause(struct peer *w, const char *tag, uint32_t timeout_ms) {
  Gpumem__Wire__PauseRequest q = GPUMEM__WIRE__PAUSE_REQUEST__INIT;
  char *tags[1] = {(char *)tag};
  q.tags = tags;
  q.n_tags = 1;
  q.own = true;
  q.timeout_ms = timeout_ms;
  wire_env env = peer_env(w->next_id++, GPUMEM__WIRE__ENVELOPE__BODY_PAUSE);
  env.pause = &q;
  peer_put(w, &env, NULL, 0);
}

/* Workers' own pauses that never get their acks cannot hold the node:
 * each waits --ack-timeout at most, whatever timeout it asks for, and a
 * controller's pause goes ahead of the workers' waiting ones. */
START_TEST(workers_cannot_hold_the_queue) {
  if (!can_be_others("workers_cannot_hold_the_queue")) return;
  daemon_open_to_all((const char *const[]){"--ack-timeout", "1s", NULL});
  struct peer alice, bob1, bob2, ctl;
  open_as(&alice, ALICE, WORKER);
  open_as(&bob1, BOB, WORKER);
  open_as(&bob2, BOB, WORKER);
  open_as(&ctl, 0, CONTROLLER);
  struct pbuf a, b1, b2;
  peer_alloc(&alice, "alice-kv", 0, 2 * MiB, 0, &a);
  peer_alloc(&bob1, "bob-one", 0, 2 * MiB, 0, &b1);
  peer_alloc(&bob2, "bob-two", 0, 2 * MiB, 0, &b2);
  own_pause(&bob1, "bob-one", 600000); /* asks for ten minutes, never acks */
  wire_env *ev = peer_event(&bob1, NULL);
  ck_assert_int_eq(ev->body_case, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
  wire_env_free(ev);
  own_pause(&bob2, "bob-two", 600000); /* waits behind bob1's */
  wire_env_free(peer_status(&bob2));   /* the daemon has queued it */
  peer_op(&ctl, false, "alice-kv", 0, 0);
  wire_env *r = peer_get_within(&bob1, NULL, 10000);
  char why[512];
  ck_assert_int_eq(peer_reply_code(r, why, sizeof why), CODE(CLIENT_TIMEOUT));
  ck_assert_msg(strstr(why, "no ack within 1000 ms"), "%s", why);
  wire_env_free(r);
  peer_serve(&alice, &a, 1, 1);
  ck_assert_int_eq(peer_op_code(&ctl), CODE(OK));
  ev = peer_event(&bob2, NULL);
  ck_assert_int_eq(ev->body_case, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
  peer_unmap(&b2);
  peer_ack(&bob2, ev->id, NULL, 0, NULL);
  wire_env_free(ev);
  r = peer_get(&bob2, NULL);
  ck_assert_int_eq(peer_reply_code(r, NULL, 0), CODE(OK));
  wire_env_free(r);
  /* In the daemon's record, newest first: bob2's, the controller's, bob1's. */
  wire_env *st = peer_status(&ctl);
  const Gpumem__Wire__StatusReply *s = st->status_reply;
  ck_assert_uint_eq(s->n_recent_ops, 3);
  ck_assert_str_eq(s->recent_ops[0]->tags[0], "bob-two");
  ck_assert_str_eq(s->recent_ops[1]->tags[0], "alice-kv");
  ck_assert_str_eq(s->recent_ops[2]->tags[0], "bob-one");
  wire_env_free(st);
  peer_unmap(&a);
  peer_unmap(&b1);
  peer_close(&alice);
  peer_close(&bob1);
  peer_close(&bob2);
  peer_close(&ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* A tag emptied while paused is forgotten once resumed, so another uid
 * may use its name; "default" is every uid's and stays so. */
START_TEST(names_come_free_and_default_is_shared) {
  if (!can_be_others("names_come_free_and_default_is_shared")) return;
  daemon_open_to_all(NULL);
  struct peer alice, bob, ctl;
  open_as(&alice, ALICE, WORKER);
  open_as(&bob, BOB, WORKER);
  open_as(&ctl, 0, CONTROLLER);
  struct pbuf a, b;
  peer_alloc(&alice, "kv", 0, 2 * MiB, 0, &a);
  peer_op_served(&ctl, false, "kv", &alice, &a, 1);
  peer_push_free(&alice, a.id);
  wire_env *r = peer_answer(&alice);
  ck_assert_int_eq(peer_reply_code(r, NULL, 0), CODE(OK));
  wire_env_free(r);
  ck_assert_int_eq(peer_try_alloc(&bob, "kv", 0, 2 * MiB, 0, &b), CODE(PERMISSION_DENIED));
  peer_op(&ctl, true, "kv", 0, 0);
  ck_assert_int_eq(peer_op_code(&ctl), CODE(OK));
  peer_alloc(&bob, "kv", 0, 2 * MiB, 0, &b);
  peer_unmap(&b);
  peer_alloc(&alice, "default", 0, 2 * MiB, 0, &a);
  peer_alloc(&bob, "default", 0, 2 * MiB, 0, &b);
  peer_unmap(&a);
  peer_unmap(&b);
  ck_assert_int_eq(share(&ctl, "default", false), CODE(INVALID_ARGUMENT));
  wire_env *st = peer_status(&ctl);
  ck_assert(peer_tag(st, "default")->shared && peer_tag(st, "default")->buffers == 2);
  ck_assert_uint_eq(peer_tag(st, "kv")->owner_uid, BOB);
  wire_env_free(st);
  peer_close(&alice);
  peer_close(&bob);
  peer_close(&ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* Allocate one-chunk buffers as a worker until the daemon refuses;
 * returns how many it took, the refusal's words in why. */
static int alloc_until_refused(struct peer *w, const char *tag, char *why, size_t len) {
  for (int n = 0; n < 100000; n++) {
    peer_push_alloc(w, tag, 0, 4096, 0);
    wire_env *r = peer_answer(w); /* its chunk fd is closed: the daemon keeps its own */
    wire_code code = peer_reply_code(r, why, len);
    wire_env_free(r);
    if (code) {
      ck_assert_int_eq(code, CODE(LIMIT_EXCEEDED));
      return n;
    }
  }
  ck_abort_msg("never refused");
  return -1;
}

/* On the host backend each chunk is one of the daemon's descriptors: one
 * uid's chunks take half of three quarters of its limit at most, all
 * chunks three quarters, and the rest stays for connections (a controller
 * still gets in and is answered). */
START_TEST(chunks_leave_descriptors_for_connections) {
  if (!can_be_others("chunks_leave_descriptors_for_connections")) return;
  struct rlimit rl = {400, 400};
  ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &rl), 0); /* the daemon's, and this test's */
  daemon_open_to_all((const char *const[]){"--host-granularity", "4K", NULL});
  struct peer alice, bob, carol, ctl;
  open_as(&alice, ALICE, WORKER);
  open_as(&bob, BOB, WORKER);
  open_as(&carol, 1002, WORKER);
  char why[512];
  ck_assert_int_eq(alloc_until_refused(&alice, "a", why, sizeof why), 150);
  ck_assert_msg(strstr(why, "uid 1000 holds 150 chunks") && strstr(why, "descriptor"), "%s", why);
  ck_assert_int_eq(alloc_until_refused(&bob, "b", why, sizeof why), 150);
  ck_assert_int_eq(alloc_until_refused(&carol, "c", why, sizeof why), 0);
  ck_assert_msg(strstr(why, "holds 300 chunks") && strstr(why, "three quarters"), "%s", why);
  open_as(&ctl, 0, CONTROLLER);
  wire_env *st = peer_status(&ctl);
  ck_assert_uint_eq(st->status_reply->fd_limit, 400);
  ck_assert_uint_lt(st->status_reply->fds_open, 400 - 50);
  wire_env_free(st);
  peer_close(&alice); /* its chunks go, and the room with them */
  bool gone = false;
  for (int i = 0; i < 300 && !gone; i++) {
    st = peer_status(&ctl);
    gone = st->status_reply->n_tenants == 1; /* bob (carol got none) */
    wire_env_free(st);
    if (!gone) usleep(10000);
  }
  ck_assert_msg(gone, "alice's chunks still counted");
  ck_assert_int_eq(alloc_until_refused(&carol, "c", why, sizeof why), 150);
  peer_close(&bob);
  peer_close(&carol);
  peer_close(&ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* After a restart without a journal (--journal none) but with a
 * re-registration grace, a new tag cannot be taken by another uid before
 * its owner's worker re-registers it (check_reclaim has the journal's
 * way, which needs no wait): the other
 * uid's allocation waits for the grace (its status is answered meanwhile),
 * the owner's re-registration goes through, and the late allocation is
 * refused as any other would be. */
START_TEST(a_restart_keeps_tags_for_their_owners) {
  if (!can_be_others("a_restart_keeps_tags_for_their_owners")) return;
  daemon_open_to_all(NULL);
  struct peer alice, bob;
  open_as(&alice, ALICE, WORKER);
  struct pbuf a;
  peer_alloc(&alice, "kv", 0, 2 * MiB, 0, &a);
  peer_close(&alice);
  /* The next daemon on the same socket (the host backend's memory is the
   * socket's), with a grace. */
  int status;
  kill(d.pid, SIGTERM);
  ck_assert_int_eq(waitpid(d.pid, &status, 0), d.pid);
  ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  d.pid = daemon_spawn(d.socket, d.log,
                       (const char *const[]){"--socket-mode", "0666", "--adopt-grace", "4s",
                                             "--journal", "none", NULL});
  double end = now_ms() + 5000;
  int fd;
  while ((fd = raw_connect(&d)) < 0 && now_ms() < end) {
    struct pollfd none;
    poll(&none, 0, 10);
  }
  ck_assert_int_ge(fd, 0);
  close(fd);
  open_as(&bob, BOB, WORKER);
  uint64_t waiting = peer_push_alloc(&bob, "kv", 0, 2 * MiB, 0);
  ck_assert_int_eq(peer_flush_within(&bob, 5000), 0);
  wire_env *st = peer_status(&bob); /* answered first: the allocation waits */
  /* The status says that the grace runs, how long more, and who waits. */
  ck_assert_uint_gt(st->status_reply->grace_left_ms, 0);
  ck_assert_uint_le(st->status_reply->grace_left_ms, 4000);
  ck_assert_uint_eq(st->status_reply->grace_waiting, 1);
  ck_assert_uint_eq(st->status_reply->n_tags, 0);
  wire_env_free(st);
  /* A controller's pause of the tag not yet re-registered says why. */
  struct peer ctl;
  open_as(&ctl, 0, CONTROLLER);
  peer_op(&ctl, false, "kv", 0, 0);
  char why[256];
  wire_env *pr = peer_answer(&ctl);
  ck_assert_int_eq(peer_reply_code(pr, why, sizeof why), CODE(NOT_FOUND));
  ck_assert_msg(strstr(why, "no tag 'kv' yet: the re-registration grace runs") &&
                    strstr(why, "(1 waiting)"),
                "%s", why);
  wire_env_free(pr);
  peer_close(&ctl);
  open_as(&alice, ALICE, WORKER);
  Gpumem__Wire__AdoptBuffer ab = GPUMEM__WIRE__ADOPT_BUFFER__INIT;
  uint64_t chunk = 2 * MiB;
  ab.tag = "kv";
  ab.size = chunk;
  ab.chunk_sizes = &chunk;
  ab.n_chunk_sizes = 1;
  Gpumem__Wire__AdoptBuffer *abp = &ab;
  Gpumem__Wire__AdoptRequest ar = GPUMEM__WIRE__ADOPT_REQUEST__INIT;
  ar.buffers = &abp;
  ar.n_buffers = 1;
  wire_env ae = peer_env(alice.next_id++, GPUMEM__WIRE__ENVELOPE__BODY_ADOPT);
  ae.fd_count = 1;
  ae.adopt = &ar;
  int give = dup(a.fds[0]);
  peer_put(&alice, &ae, &give, 1);
  wire_env *r = peer_get(&alice, NULL);
  ck_assert_msg(peer_reply_code(r, why, sizeof why) == CODE(OK), "%s", why);
  wire_env_free(r);
  r = peer_get_within(&bob, NULL, 15000); /* once the grace is over */
  ck_assert_int_eq(r->id, waiting);
  ck_assert_int_eq(peer_reply_code(r, why, sizeof why), CODE(PERMISSION_DENIED));
  ck_assert_msg(strstr(why, "belongs to uid 1000"), "%s", why);
  wire_env_free(r);
  peer_unmap(&a);
  peer_close(&alice);
  peer_close(&bob);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* The grace's wait list is bounded per uid: one uid whose allocations
 * in new tags fill its share is refused, saying so, and another uid's
 * allocation still waits (the list was one for every uid: 4096 of one
 * uid's refused everybody's). */
START_TEST(one_uid_cannot_fill_the_grace_wait_list) {
  if (!can_be_others("one_uid_cannot_fill_the_grace_wait_list")) return;
  daemon_open_to_all((const char *const[]){"--adopt-grace", "60s", NULL});
  struct peer alice, bob;
  open_as(&bob, BOB, WORKER);
  const int asks = 4100;
  for (int i = 0; i < asks; i++) {
    char tag[16];
    snprintf(tag, sizeof tag, "b%d", i);
    peer_push_alloc(&bob, tag, 0, 2 * MiB, 0);
  }
  ck_assert_int_eq(peer_flush_within(&bob, 10000), 0);
  int refused = 0;
  char why[256];
  for (int i = 0; i < asks - 256; i++) { /* the rest wait: no answer */
    wire_env *r = peer_get(&bob, NULL);
    ck_assert_int_eq(peer_reply_code(r, why, sizeof why), CODE(LIMIT_EXCEEDED));
    ck_assert_msg(strstr(why, "of this uid wait for the re-registration grace"), "%s", why);
    refused++;
    wire_env_free(r);
  }
  open_as(&alice, ALICE, WORKER);
  peer_push_alloc(&alice, "a0", 0, 2 * MiB, 0);
  ck_assert_int_eq(peer_flush_within(&alice, 5000), 0);
  wire_env *st = peer_status(&alice); /* answered first: the allocation waits */
  ck_assert_uint_eq(st->status_reply->grace_waiting, 256 + 1);
  wire_env_free(st);
  ck_assert_int_eq(refused, asks - 256);
  peer_close(&bob); /* its waiting allocations go with it, once the daemon sees it gone */
  uint64_t left = 0;
  for (double end = now_ms() + 5000; now_ms() < end;) {
    st = peer_status(&alice);
    left = st->status_reply->grace_waiting;
    wire_env_free(st);
    if (left == 1) break;
    struct pollfd none;
    poll(&none, 0, 10);
  }
  ck_assert_uint_eq(left, 1);
  peer_close(&alice);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* A worker's own pause with --max-residual says how much a device holds
 * outside gpumemd, but not which process holds it (another uid's, which
 * its status would not show). */
START_TEST(a_worker_is_not_told_whose_residual_it_is) {
  if (!can_be_others("a_worker_is_not_told_whose_residual_it_is")) return;
  daemon_open_to_all(NULL);
  struct peer alice, mallory;
  open_as(&alice, ALICE, WORKER);
  open_as(&mallory, BOB, WORKER);
  struct pbuf a, m;
  peer_alloc(&alice, "kv", 0, 8 * MiB, 0, &a);
  peer_push_free(&alice, a.id);
  wire_env *r = peer_answer(&alice); /* freed, but its chunk stays held here: outside gpumemd */
  ck_assert_int_eq(peer_reply_code(r, NULL, 0), CODE(OK));
  wire_env_free(r);
  peer_alloc(&mallory, "m", 0, 2 * MiB, 0, &m);
  Gpumem__Wire__PauseRequest q = GPUMEM__WIRE__PAUSE_REQUEST__INIT;
  q.own = true;
  q.max_residual = 1;
  wire_env pe = peer_env(mallory.next_id++, GPUMEM__WIRE__ENVELOPE__BODY_PAUSE);
  pe.pause = &q;
  peer_put(&mallory, &pe, NULL, 0);
  peer_serve(&mallory, &m, 1, 1);
  r = peer_get(&mallory, NULL);
  char why[512];
  ck_assert_int_eq(peer_reply_code(r, why, sizeof why), CODE(RESIDUAL_EXCEEDED));
  ck_assert_msg(strstr(why, "outside gpumemd") && !strstr(why, "pid"), "%s", why);
  ck_assert_uint_eq(r->error->n_pids, 0);
  wire_env_free(r);
  peer_unmap(&a);
  peer_close(&alice);
  peer_close(&mallory);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* Status pages: walking the cursors with a small limit gives every tag
 * and session once; list pages give every buffer once, in id order. */
START_TEST(status_and_list_come_in_pages) {
  daemon_start(&d, NULL);
  struct peer w[5], ctl;
  for (int i = 0; i < 5; i++) peer_open(&w[i], &d, WORKER);
  peer_open(&ctl, &d, CONTROLLER);
  struct pbuf b[11];
  char tag[16];
  for (int i = 0; i < 11; i++) {
    snprintf(tag, sizeof tag, "t%d", i);
    peer_alloc(&w[i % 5], tag, 0, 2 * MiB, 0, &b[i]);
    peer_unmap(&b[i]);
  }
  int seen_tags[11] = {0}, pages = 0;
  size_t sessions = 0;
  uint64_t tc = 0, sc = 0;
  do {
    wire_env *st = status_page(&ctl, tc, sc, 3);
    const Gpumem__Wire__StatusReply *s = st->status_reply;
    ck_assert_uint_le(s->n_tags, 3);
    ck_assert_uint_le(s->n_sessions, 3);
    ck_assert_uint_eq(s->total_tags, 11); /* every page says the whole walk's (1.10) */
    ck_assert_uint_eq(s->total_sessions, 6);
    for (size_t i = 0; i < s->n_tags; i++) seen_tags[atoi(s->tags[i]->name + 1)]++;
    sessions += s->n_sessions;
    tc = s->next_tag ? s->next_tag : UINT64_MAX;
    sc = s->next_session ? s->next_session : UINT64_MAX;
    pages++;
    wire_env_free(st);
  } while (tc != UINT64_MAX || sc != UINT64_MAX);
  for (int i = 0; i < 11; i++) ck_assert_int_eq(seen_tags[i], 1);
  ck_assert_uint_eq(sessions, 6);
  ck_assert_int_eq(pages, 4);
  uint64_t after = 0, last = 0;
  size_t n = 0;
  do {
    wire_env *l = list_page(&ctl, after, 4);
    ck_assert_uint_le(l->list_reply->n_buffers, 4);
    ck_assert_uint_eq(l->list_reply->total, 11);
    for (size_t i = 0; i < l->list_reply->n_buffers; i++, n++) {
      ck_assert_uint_gt(l->list_reply->buffers[i]->id, last);
      last = l->list_reply->buffers[i]->id;
    }
    after = l->list_reply->next;
    wire_env_free(l);
  } while (after);
  ck_assert_uint_eq(n, 11);
  /* A 1.3 client knows no pages: it gets everything in one reply. */
  struct peer old;
  peer_connect(&old, &d);
  peer_push_hello(&old, CONTROLLER, "old", WIRE_VERSION_MAJOR, 3);
  wire_env_free(peer_answer(&old));
  wire_env *st = status_page(&old, 0, 0, 3);
  ck_assert_uint_eq(st->status_reply->n_tags, 11);
  ck_assert_uint_eq(st->status_reply->n_sessions, 7);
  ck_assert_uint_eq(st->status_reply->next_tag, 0);
  wire_env_free(st);
  wire_env *l = list_page(&old, 0, 4);
  ck_assert_uint_eq(l->list_reply->n_buffers, 11);
  ck_assert_uint_eq(l->list_reply->next, 0);
  wire_env_free(l);
  peer_close(&old);
  for (int i = 0; i < 5; i++) peer_close(&w[i]);
  peer_close(&ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* Re-register n paused buffers, one tag each, in one request. */
static void adopt_paused(struct peer *w, size_t first, size_t n) {
  Gpumem__Wire__AdoptBuffer *bufs = calloc(n, sizeof *bufs);
  Gpumem__Wire__AdoptBuffer **ptrs = calloc(n, sizeof *ptrs);
  char(*tags)[16] = calloc(n, sizeof *tags);
  uint64_t chunk = 2 * MiB;
  ck_assert(bufs && ptrs && tags);
  for (size_t i = 0; i < n; i++) {
    gpumem__wire__adopt_buffer__init(&bufs[i]);
    snprintf(tags[i], sizeof tags[i], "p%zu", first + i);
    bufs[i].tag = tags[i];
    bufs[i].size = chunk;
    bufs[i].chunk_sizes = &chunk;
    bufs[i].n_chunk_sizes = 1;
    bufs[i].paused = true;
    ptrs[i] = &bufs[i];
  }
  Gpumem__Wire__AdoptRequest q = GPUMEM__WIRE__ADOPT_REQUEST__INIT;
  q.buffers = ptrs;
  q.n_buffers = n;
  wire_env env = peer_env(0, GPUMEM__WIRE__ENVELOPE__BODY_ADOPT);
  env.adopt = &q;
  char why[256];
  ck_assert_msg(peer_call_code(w, &env, why, sizeof why) == CODE(OK), "%s", why);
  free(bufs);
  free(ptrs);
  free(tags);
}

/* More buffers and tags than one page holds: the library gathers every
 * page, so a controller lists and sees everything. */
START_TEST(a_controller_always_sees_everything) {
  /* Paused re-registrations make tags cheaply: taken by a daemon without
   * a journal in its grace. */
  daemon_start(&d, "--journal", "none", "--adopt-grace", "600s", NULL);
  struct peer w;
  peer_open(&w, &d, WORKER);
  const size_t total = 20000, batch = 2000;
  for (size_t i = 0; i < total; i += batch) adopt_paused(&w, i, batch);
  gpumem_client *c;
  ck_assert_int_eq(gpumem_connect(d.socket, "pager", GPUMEM_ROLE_CONTROLLER, 0, &c), 0);
  struct gpumem_list *l;
  ck_assert_int_eq(gpumem_list(c, &l), (int)total);
  for (size_t i = 1; i < l->nbuffers; i++) ck_assert_uint_gt(l->buffers[i]->id, l->buffers[i - 1]->id);
  gpumem_list_free(l);
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_uint_eq(s->ntags, total);
  ck_assert_str_eq(s->tags[total - 1]->name, "p19999");
  ck_assert_uint_eq(s->nsessions, 2);
  ck_assert_uint_eq(s->ntenants, 1);
  ck_assert_uint_eq(s->tenants[0]->buffers, total);
  gpumem_status_free(s);
  gpumem_disconnect(c);
  peer_close(&w);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

int main(void) {
  return HARNESS_RUN("tenants", 60, harness_fd_setup, harness_fd_teardown,
                     another_uid_cannot_join_a_tag, shared_tags_take_every_uid,
                     workers_see_only_their_own, quotas_hold_across_sessions,
                     status_and_list_come_in_pages, a_controller_always_sees_everything,
                     workers_cannot_hold_the_queue, names_come_free_and_default_is_shared,
                     chunks_leave_descriptors_for_connections,
                     a_restart_keeps_tags_for_their_owners,
                     one_uid_cannot_fill_the_grace_wait_list,
                     a_worker_is_not_told_whose_residual_it_is);
}
