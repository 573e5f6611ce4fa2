/* The pause engine and the registry in this process, over the host
 * backend: every move of the state machine, driven through a fake outbox
 * that keeps what the engine sends (packed and unpacked, as a socket
 * would carry it) and owners that are plain structs. Nothing is spawned;
 * timeouts are the engine's own timer, run by this test's loop. This is
 * where a feature that changes the pause path adds its cases. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/engine.h"
#include "daemon/registry.h"
#include "harness.h"

#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x
#define MiB (1ull << 20)
#define MAX_SENT 64

/* What the engine sent one owner. */
struct sent {
  struct owner *to;
  wire_env *env;
  size_t nfds;
  bool taken;
};

/* The fake outbox: what was sent, ended and stopped. */
static struct {
  struct sent sent[MAX_SENT];
  size_t nsent;
  int send_rc;       /* what send returns (0, or a failure to try) */
  int stop_rc;       /* what stop returns */
  struct owner *ended, *stopped;
  wire_code end_code;
} box;

static uv_loop_t loop;
static gpudev *g;
static registry *reg;
static stats *st;
static engine *eng;
static struct config cfg;
static struct list owners;
static struct owner ctl, w1, w2;
static pid_t gone; /* a pid no process has: an owner that maps nothing */

/* Keep a copy of a message, as the peer would read it; close its fds. */
static int fake_send(void *ctx, struct owner *o, const wire_env *env, const int *fds,
                     size_t nfds) {
  (void)ctx;
  for (size_t i = 0; i < nfds; i++) close(fds[i]);
  if (box.send_rc) return box.send_rc;
  ck_assert_uint_lt(box.nsent, MAX_SENT);
  size_t len;
  uint8_t *bytes = wire_pack(env, &len);
  ck_assert_ptr_nonnull(bytes);
  struct sent *s = &box.sent[box.nsent++];
  s->to = o;
  s->env = wire_unpack(bytes, len);
  s->nfds = nfds;
  free(bytes);
  ck_assert_ptr_nonnull(s->env);
  ck_assert_uint_eq(s->env->fd_count, nfds);
  return 0;
}

/* An Error, kept as fake_send keeps any message. */
static void fake_send_error(void *ctx, struct owner *o, uint64_t id, const struct fault *f) {
  Gpumem__Wire__Error err = GPUMEM__WIRE__ERROR__INIT;
  err.code = f->code;
  err.message = (char *)f->text;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = id;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ERROR;
  env.error = &err;
  fake_send(ctx, o, &env, NULL, 0);
}

/* Ending a session: noted; the test then closes the owner (owner_close). */
static void fake_end(void *ctx, struct owner *o, const struct fault *f) {
  (void)ctx;
  box.ended = o;
  box.end_code = f ? f->code : CODE(OK);
}

/* Stopping an owner: noted, and stop_rc returned. */
static int fake_stop(void *ctx, struct owner *o) {
  (void)ctx;
  box.stopped = o;
  return box.stop_rc;
}

static const struct outbox fake = {.send = fake_send, .send_error = fake_send_error,
                                   .end = fake_end, .stop = fake_stop};

/* A pid above the kernel's pid_max: never a process. */
static pid_t pid_nobody_has(void) {
  FILE *f = fopen("/proc/sys/kernel/pid_max", "r");
  long max = 4194304;
  if (f) {
    if (fscanf(f, "%ld", &max) != 1) max = 4194304;
    fclose(f);
  }
  return (pid_t)max + 1;
}

/* An owner of the given role, in the server's list. */
static void owner_init(struct owner *o, uint64_t id, Gpumem__Wire__Role role, const char *name) {
  memset(o, 0, sizeof *o);
  o->id = id;
  o->pid = gone;
  o->uid = getuid();
  o->role = role;
  o->minor = 5;
  snprintf(o->name, sizeof o->name, "%s", name);
  list_init(&o->buffers);
  list_append(&owners, &o->link);
}

/* What the server does when a session ends: its buffers go, the engine
 * forgets it. */
static void owner_close(struct owner *o) {
  o->closed = true;
  list_remove(&o->link);
  struct list *p, *t;
  list_for_each_safe(p, t, &o->buffers) registry_free(reg, list_entry(p, struct buffer, owner_link));
  engine_forget(eng, o);
}

static void setup(void) {
  harness_fd_setup();
  memset(&box, 0, sizeof box);
  gone = pid_nobody_has();
  ck_assert_int_eq(uv_loop_init(&loop), 0);
  struct gpudev_options o = {.backend = "host", .host_devices = 2, .host_device_size = 256 * MiB};
  char err[128];
  ck_assert_int_eq(gpudev_open(&o, &g, err, sizeof err), 0);
  struct registry_options ro = {.chunk_size = 4 * MiB, .backup_limit = 64 * MiB,
                                .verify_backups = true};
  ck_assert_ptr_nonnull(reg = registry_create(g, &ro));
  ck_assert_ptr_nonnull(st = stats_create());
  cfg = (struct config){.ack_timeout_ms = 10000, .timeout_policy = TIMEOUT_REPORT};
  list_init(&owners);
  owner_init(&ctl, 1, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER, "rl");
  owner_init(&w1, 2, GPUMEM__WIRE__ROLE__ROLE_WORKER, "engine-0");
  owner_init(&w2, 3, GPUMEM__WIRE__ROLE__ROLE_WORKER, "engine-1");
  ck_assert_ptr_nonnull(eng = engine_create(&loop, reg, g, &cfg, &owners, &fake, st));
}

static void teardown(void) {
  engine_destroy(eng);
  uv_run(&loop, UV_RUN_NOWAIT); /* the engine's timer closes */
  for (size_t i = 0; i < box.nsent; i++) wire_env_free(box.sent[i].env);
  registry_destroy(reg);
  stats_destroy(st);
  gpudev_close(g);
  ck_assert_int_eq(uv_loop_close(&loop), 0);
  harness_fd_teardown();
}

/* A buffer of size bytes in tag on device dev, owned by o. */
static struct buffer *alloc(struct owner *o, const char *tag, unsigned dev, uint64_t size,
                            uint32_t flags) {
  struct buffer *b;
  struct fault f = {0};
  ck_assert_int_eq(registry_alloc(reg, o, tag, dev, size, flags, &b, &f), CODE(OK));
  return b;
}

/* The first message not yet taken that went to o with this body. */
static wire_env *take(struct owner *o, Gpumem__Wire__Envelope__BodyCase body) {
  for (size_t i = 0; i < box.nsent; i++) {
    struct sent *s = &box.sent[i];
    if (s->taken || s->to != o || s->env->body_case != body) continue;
    s->taken = true;
    return s->env;
  }
  return NULL;
}

/* Nothing more went to o. */
static bool quiet(const struct owner *o) {
  for (size_t i = 0; i < box.nsent; i++)
    if (!box.sent[i].taken && box.sent[i].to == o) return false;
  return true;
}

/* Ask for a pause (or resume) of one tag (NULL: every tag) on devmask. */
static void op(bool resume, const char *tag, uint64_t devmask, uint32_t timeout_ms,
               const struct scope_spec *scope) {
  char *tags[] = {(char *)tag};
  engine_submit(eng, &ctl, 77, resume, tags, tag ? 1 : 0, devmask, timeout_ms, 0, 0, false, scope);
}

/* The controller's answer: its code, with the reply in *out. */
static wire_code answer(wire_env **out) {
  wire_env *r = take(&ctl, GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY);
  if (!r) r = take(&ctl, GPUMEM__WIRE__ENVELOPE__BODY_ERROR);
  ck_assert_msg(r != NULL, "no answer to the controller");
  ck_assert_uint_eq(r->id, 77);
  if (out) *out = r;
  return r->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR ? r->error->code : CODE(OK);
}

/* Run the loop until the controller has an answer (the engine's timer). */
static wire_code answer_after_timeout(wire_env **out) {
  for (int i = 0; i < 1000; i++) {
    for (size_t k = 0; k < box.nsent; k++)
      if (!box.sent[k].taken && box.sent[k].to == &ctl) return answer(out);
    uv_run(&loop, UV_RUN_ONCE);
  }
  ck_abort_msg("the engine's timer never answered");
  return CODE(INTERNAL);
}

/* Ack event id as owner o: code, and the buffers it could not handle. */
static void ack_only(struct owner *o, uint64_t id, wire_code code, uint64_t *failed,
                     size_t nfailed) {
  Gpumem__Wire__EventAck a = GPUMEM__WIRE__EVENT_ACK__INIT;
  a.code = code;
  a.failed_ids = failed;
  a.n_failed_ids = nfailed;
  a.message = code ? "device busy" : "";
  engine_ack(eng, o, id, &a);
}

/* Ack as ack_only does; the loop then ends its turn, as the daemon's does
 * after reading acks (what an Unmap's ack released is settled there). */
static void ack(struct owner *o, uint64_t id, wire_code code, uint64_t *failed, size_t nfailed) {
  ack_only(o, id, code, failed, nfailed);
  uv_run(&loop, UV_RUN_NOWAIT);
}

/* The Unmap event o got, checked to carry exactly b. */
static uint64_t unmap_of(struct owner *o, const struct buffer *b) {
  wire_env *e = take(o, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
  ck_assert_msg(e != NULL, "no Unmap for %s", o->name);
  ck_assert_uint_eq(e->unmap->n_buffer_ids, 1);
  ck_assert_uint_eq(e->unmap->buffer_ids[0], b->id);
  return e->id;
}

/* The Remap event o got, checked to carry b with one fd per chunk. */
static uint64_t remap_of(struct owner *o, const struct buffer *b) {
  wire_env *e = take(o, GPUMEM__WIRE__ENVELOPE__BODY_REMAP);
  ck_assert_msg(e != NULL, "no Remap for %s", o->name);
  ck_assert_uint_eq(e->remap->n_entries, 1);
  ck_assert_uint_eq(e->remap->entries[0]->buffer_id, b->id);
  ck_assert_uint_eq(e->fd_count, b->nchunks);
  return e->id;
}

/* Pause tag kv with b's owner acking, and check it went through. */
static void pause_acked(struct buffer *b) {
  op(false, "kv", 0, 0, NULL);
  ack(b->owner, unmap_of(b->owner, b), CODE(OK), NULL, 0);
  ck_assert_int_eq(answer(NULL), CODE(OK));
  ck_assert_int_eq(b->state, BUF_PAUSED);
}

/* Pause: ACTIVE -> PAUSING (the owner told) -> PAUSED (its ack), the
 * memory released, the tag marked paused; resume: PAUSED -> RESUMING (the
 * memory made again, its fds sent) -> ACTIVE, the mark gone. */
START_TEST(pause_and_resume_move_every_buffer) {
  struct buffer *a = alloc(&w1, "kv", 0, 10 * MiB, 0), *b = alloc(&w2, "kv", 1, 4 * MiB, 0);
  op(false, "kv", 0, 0, NULL);
  ck_assert_int_eq(a->state, BUF_PAUSING);
  ck_assert_int_eq(b->state, BUF_PAUSING);
  ack(&w1, unmap_of(&w1, a), CODE(OK), NULL, 0);
  ck_assert(quiet(&ctl)); /* w2 has not answered */
  ack(&w2, unmap_of(&w2, b), CODE(OK), NULL, 0);
  wire_env *r;
  ck_assert_int_eq(answer(&r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 2);
  ck_assert_uint_eq(r->op_reply->bytes, a->size + b->size);
  ck_assert(!a->has_memory && !b->has_memory);
  ck_assert_uint_eq(registry_managed(reg, 0) + registry_managed(reg, 1), 0);
  ck_assert_uint_eq(registry_tag(reg, "kv")->paused_devices, 3);
  ck_assert_int_eq(registry_tag_state(registry_tag(reg, "kv")).state, BUF_PAUSED);

  op(true, "kv", 0, 0, NULL);
  ck_assert_int_eq(a->state, BUF_RESUMING);
  ck_assert(a->has_memory && b->has_memory);
  ack(&w1, remap_of(&w1, a), CODE(OK), NULL, 0);
  ck_assert_int_eq(a->state, BUF_RESUMING); /* ACTIVE only when every owner mapped */
  ack(&w2, remap_of(&w2, b), CODE(OK), NULL, 0);
  ck_assert_int_eq(answer(&r), CODE(OK));
  ck_assert_int_eq(a->state, BUF_ACTIVE);
  ck_assert_int_eq(b->state, BUF_ACTIVE);
  ck_assert_uint_eq(registry_tag(reg, "kv")->paused_devices, 0);
  ck_assert_uint_eq(registry_managed(reg, 0), a->size);
}
END_TEST

/* A BACKUP buffer's contents survive the pause: backed up on the ack,
 * restored before its Remap goes out. */
START_TEST(backup_buffers_keep_their_contents) {
  struct buffer *b = alloc(&w1, "kv", 0, 8 * MiB, BUF_FLAG_BACKUP);
  char *pattern = malloc(b->size), *back = malloc(b->size);
  for (size_t i = 0; i < b->size; i++) pattern[i] = (char)(i * 7 + 3);
  ck_assert_int_eq(gpudev_chunks_copy(g, 0, b->handles, b->chunk_sizes, b->nchunks, pattern, false), 0);
  pause_acked(b);
  ck_assert(b->backup_valid);
  op(true, "kv", 0, 0, NULL);
  ck_assert_int_eq(gpudev_chunks_copy(g, 0, b->handles, b->chunk_sizes, b->nchunks, back, true), 0);
  ck_assert(memcmp(back, pattern, b->size) == 0);
  ack(&w1, remap_of(&w1, b), CODE(OK), NULL, 0);
  wire_env *r;
  ck_assert_int_eq(answer(&r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->backup_bytes, b->size);
  ck_assert(!b->backup_valid); /* ACTIVE again: the backup is stale */
  free(pattern);
  free(back);
}
END_TEST

/* An owner that could not unmap: its buffer is ACTIVE again, the pause
 * fails NOT_RELEASED naming it, and the other owner's buffer is paused. */
START_TEST(a_failed_unmap_leaves_the_buffer_active) {
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0), *b = alloc(&w2, "kv", 0, 4 * MiB, 0);
  op(false, "kv", 0, 0, NULL);
  uint64_t failed[] = {a->id};
  ack(&w1, unmap_of(&w1, a), CODE(BACKEND_ERROR), failed, 1);
  ack(&w2, unmap_of(&w2, b), CODE(OK), NULL, 0);
  wire_env *r;
  ck_assert_int_eq(answer(&r), CODE(NOT_RELEASED));
  ck_assert_ptr_nonnull(strstr(r->error->message, "device busy"));
  ck_assert_uint_eq(r->error->buffers_held, 1);
  ck_assert_uint_eq(r->error->n_pids, 1);
  ck_assert_uint_eq(r->error->pids[0], (uint32_t)gone);
  ck_assert_int_eq(a->state, BUF_ACTIVE);
  ck_assert(a->has_memory);
  ck_assert_int_eq(b->state, BUF_PAUSED);
  ck_assert(registry_tag_state(registry_tag(reg, "kv")).mixed);
}
END_TEST

/* An owner that acks the unmap but still maps the memory (here: this
 * process, which holds every chunk) keeps it: NOT_RELEASED, counted held,
 * and the buffer is PAUSED with its memory, released by the next pause. */
START_TEST(an_owner_still_mapping_keeps_the_memory) {
  w1.pid = getpid();
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0);
  op(false, "kv", 0, 0, NULL);
  ack(&w1, unmap_of(&w1, a), CODE(OK), NULL, 0);
  wire_env *r;
  ck_assert_int_eq(answer(&r), CODE(NOT_RELEASED));
  ck_assert_ptr_nonnull(strstr(r->error->message, "still maps it"));
  ck_assert_uint_eq(r->error->bytes_held, a->size);
  ck_assert_int_eq(a->state, BUF_PAUSED);
  ck_assert(a->has_memory);
  w1.pid = gone; /* it let go: the next pause releases it, no event needed */
  op(false, "kv", 0, 0, NULL);
  ck_assert_int_eq(answer(NULL), CODE(OK));
  ck_assert(quiet(&w1));
  ck_assert(!a->has_memory);
}
END_TEST

/* Unmap acks read in one turn of the loop are settled at its end, with one
 * look at each owner's process: each buffer is judged by its own owner's
 * process (this one, which holds every chunk, keeps a; a gone process
 * holds nothing, so b is released). */
START_TEST(acks_of_one_turn_are_settled_together) {
  w1.pid = getpid();
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0);
  struct buffer *b = alloc(&w2, "kv", 0, 4 * MiB, 0);
  op(false, "kv", 0, 0, NULL);
  uint64_t ea = unmap_of(&w1, a), eb = unmap_of(&w2, b);
  ack_only(&w1, ea, CODE(OK), NULL, 0);
  ack_only(&w2, eb, CODE(OK), NULL, 0);
  ck_assert(quiet(&ctl)); /* the turn has not ended */
  ck_assert_int_eq(a->state, BUF_PAUSING);
  ck_assert_int_eq(b->state, BUF_PAUSING);
  uv_run(&loop, UV_RUN_NOWAIT);
  wire_env *r;
  ck_assert_int_eq(answer(&r), CODE(NOT_RELEASED));
  char want[64];
  snprintf(want, sizeof want, "buffer %llu but still maps it", (unsigned long long)a->id);
  ck_assert_ptr_nonnull(strstr(r->error->message, want));
  ck_assert_uint_eq(r->error->bytes_held, a->size);
  ck_assert_int_eq(a->state, BUF_PAUSED);
  ck_assert(a->has_memory);
  ck_assert_int_eq(b->state, BUF_PAUSED);
  ck_assert(!b->has_memory);
}
END_TEST

/* No ack in time: the pause fails CLIENT_TIMEOUT naming the owner, whose
 * buffer stays PAUSING and holds its memory; a pause meanwhile is refused;
 * the late ack settles it (PAUSED, released). */
START_TEST(a_late_unmap_ack_settles_the_buffer) {
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0);
  op(false, "kv", 0, 5, NULL);
  uint64_t ev = unmap_of(&w1, a);
  wire_env *r;
  ck_assert_int_eq(answer_after_timeout(&r), CODE(CLIENT_TIMEOUT));
  ck_assert_uint_eq(r->error->buffers_held, 1);
  ck_assert_uint_eq(r->error->pids[0], (uint32_t)gone);
  ck_assert_int_eq(a->state, BUF_PAUSING);
  ck_assert(a->has_memory);
  op(false, "kv", 0, 0, NULL);
  ck_assert_int_eq(answer(&r), CODE(CLIENT_TIMEOUT));
  ck_assert_ptr_nonnull(strstr(r->error->message, "earlier pause or resume"));
  ack(&w1, ev, CODE(OK), NULL, 0);
  ck_assert_int_eq(a->state, BUF_PAUSED);
  ck_assert(!a->has_memory);
  ck_assert(quiet(&ctl));
}
END_TEST

/* A resume whose owner does not ack in time: CLIENT_TIMEOUT, nothing
 * resumed; the late ack of the Remap rolls it back (an Unmap of what it
 * mapped, then PAUSED without memory). */
START_TEST(a_late_remap_ack_is_rolled_back) {
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0);
  pause_acked(a);
  op(true, "kv", 0, 5, NULL);
  uint64_t ev = remap_of(&w1, a);
  wire_env *r;
  ck_assert_int_eq(answer_after_timeout(&r), CODE(CLIENT_TIMEOUT));
  ck_assert_ptr_nonnull(strstr(r->error->message, "nothing resumed"));
  ck_assert_int_eq(a->state, BUF_RESUMING);
  ack(&w1, ev, CODE(OK), NULL, 0);
  ack(&w1, unmap_of(&w1, a), CODE(OK), NULL, 0);
  ck_assert_int_eq(a->state, BUF_PAUSED);
  ck_assert(!a->has_memory);
  ck_assert_uint_eq(registry_managed(reg, 0), 0);
}
END_TEST

/* A resume one owner could not map is all or nothing: the owner that did
 * map unmaps again, and every buffer is PAUSED, its memory gone. */
START_TEST(a_failed_remap_rolls_back_every_owner) {
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0), *b = alloc(&w2, "kv", 0, 4 * MiB, 0);
  op(false, "kv", 0, 0, NULL);
  ack(&w1, unmap_of(&w1, a), CODE(OK), NULL, 0);
  ack(&w2, unmap_of(&w2, b), CODE(OK), NULL, 0);
  ck_assert_int_eq(answer(NULL), CODE(OK));
  op(true, "kv", 0, 0, NULL);
  ack(&w1, remap_of(&w1, a), CODE(OK), NULL, 0);
  ack(&w2, remap_of(&w2, b), CODE(BACKEND_ERROR), NULL, 0);
  ck_assert(quiet(&ctl)); /* the rollback of w1 runs first */
  ack(&w1, unmap_of(&w1, a), CODE(OK), NULL, 0);
  wire_env *r;
  ck_assert_int_eq(answer(&r), CODE(BACKEND_ERROR));
  ck_assert_ptr_nonnull(strstr(r->error->message, "nothing resumed"));
  ck_assert_int_eq(a->state, BUF_PAUSED);
  ck_assert_int_eq(b->state, BUF_PAUSED);
  ck_assert(!a->has_memory && !b->has_memory);
  ck_assert_uint_eq(registry_tag(reg, "kv")->paused_devices, 3); /* still paused (both devices) */
}
END_TEST

/* An owner whose session ends in the middle of a pause: the engine stops
 * waiting for it, its buffers go with it, and the pause ends with the
 * others' buffers paused. */
START_TEST(an_owner_gone_mid_pause_is_not_waited_for) {
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0), *b = alloc(&w2, "kv", 0, 4 * MiB, 0);
  op(false, "kv", 0, 0, NULL);
  ack(&w1, unmap_of(&w1, a), CODE(OK), NULL, 0);
  ck_assert(take(&w2, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP));
  ck_assert(quiet(&ctl));
  (void)b;
  owner_close(&w2);
  wire_env *r;
  ck_assert_int_eq(answer(&r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  ck_assert_int_eq(a->state, BUF_PAUSED);
  ck_assert_uint_eq(registry_managed(reg, 0), 0);
}
END_TEST

/* Two owners in one process (w1 and w2 share a pid): the first's ack is
 * settled with the second's, so that the process is read once for both
 * (its buffer PAUSING until then), and then both are PAUSED. */
START_TEST(one_process_acks_are_settled_together) {
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0), *b = alloc(&w2, "kv", 0, 4 * MiB, 0);
  ck_assert_int_eq(w1.pid, w2.pid);
  op(false, "kv", 0, 0, NULL);
  ack(&w1, unmap_of(&w1, a), CODE(OK), NULL, 0);
  ck_assert_int_eq(a->state, BUF_PAUSING);
  ck_assert(quiet(&ctl));
  ack(&w2, unmap_of(&w2, b), CODE(OK), NULL, 0);
  ck_assert_int_eq(a->state, BUF_PAUSED);
  ck_assert_int_eq(b->state, BUF_PAUSED);
  wire_env *r;
  ck_assert_int_eq(answer(&r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 2);
  ck_assert_uint_eq(registry_managed(reg, 0), 0);
}
END_TEST

/* The controller gone mid-pause: the pause finishes, and nobody is
 * answered. */
START_TEST(a_controller_gone_mid_pause_gets_no_answer) {
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0);
  op(false, "kv", 0, 0, NULL);
  uint64_t ev = unmap_of(&w1, a);
  owner_close(&ctl);
  ack(&w1, ev, CODE(OK), NULL, 0);
  ck_assert_int_eq(a->state, BUF_PAUSED);
  ck_assert(quiet(&ctl));
}
END_TEST

/* A pause of one device leaves the other's buffers, and the tag's mark,
 * alone there. */
START_TEST(a_device_subset_pauses_only_there) {
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0), *b = alloc(&w1, "kv", 1, 4 * MiB, 0);
  op(false, "kv", 1ull << 1, 0, NULL);
  ck_assert_int_eq(a->state, BUF_ACTIVE);
  ack(&w1, unmap_of(&w1, b), CODE(OK), NULL, 0);
  ck_assert_int_eq(answer(NULL), CODE(OK));
  ck_assert_int_eq(b->state, BUF_PAUSED);
  ck_assert_uint_eq(registry_tag(reg, "kv")->paused_devices, 2);
  struct fault f = {0};
  struct buffer *c;
  ck_assert_int_eq(registry_alloc(reg, &w1, "kv", 1, MiB, 0, &c, &f), CODE(TAG_PAUSED));
  ck_assert_int_eq(registry_alloc(reg, &w1, "kv", 0, MiB, 0, &c, &f), CODE(OK));
}
END_TEST

/* A scope by pid and name covers only the sessions it selects, leaves the
 * paused mark alone, and one that selects nobody is NOT_FOUND. */
START_TEST(a_scope_covers_only_its_sessions) {
  w2.pid = gone - 1;
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0), *b = alloc(&w2, "kv", 0, 4 * MiB, 0);
  uint32_t pids[] = {(uint32_t)w2.pid};
  struct scope_spec by_pid = {.pids = pids, .npids = 1};
  op(false, "kv", 0, 0, &by_pid);
  ck_assert(quiet(&w1));
  ack(&w2, unmap_of(&w2, b), CODE(OK), NULL, 0);
  ck_assert_int_eq(answer(NULL), CODE(OK));
  ck_assert_int_eq(a->state, BUF_ACTIVE);
  ck_assert_uint_eq(registry_tag(reg, "kv")->paused_devices, 0);
  struct scope_spec by_name = {.prefix = "trainer-"};
  op(false, "kv", 0, 0, &by_name);
  wire_env *r;
  ck_assert_int_eq(answer(&r), CODE(NOT_FOUND));
  ck_assert_ptr_nonnull(strstr(r->error->message, "no worker session named 'trainer-*'"));
}
END_TEST

/* Under the kill policy an owner that misses its ack is stopped; one that
 * cannot be (not pinned) has its session ended with CLIENT_TIMEOUT. */
START_TEST(the_kill_policy_stops_or_ends_stragglers) {
  cfg.timeout_policy = TIMEOUT_KILL;
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0);
  op(false, "kv", 0, 5, NULL);
  ck_assert(take(&w1, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP));
  wire_env *r;
  ck_assert_int_eq(answer_after_timeout(&r), CODE(CLIENT_TIMEOUT));
  ck_assert_ptr_eq(box.stopped, &w1);
  ck_assert_ptr_nonnull(strstr(r->error->message, "(killed)"));
  ck_assert_ptr_null(box.ended);
  owner_close(&w1); /* it died: its buffers go with it */
  ck_assert_uint_eq(registry_managed(reg, 0), 0);
  (void)a;

  struct buffer *b = alloc(&w2, "lm", 0, 4 * MiB, 0); /* kv is marked paused */
  box.stop_rc = -EBADF;
  op(false, "lm", 0, 5, NULL);
  ck_assert(take(&w2, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP));
  ck_assert_int_eq(answer_after_timeout(&r), CODE(CLIENT_TIMEOUT));
  ck_assert_ptr_eq(box.ended, &w2);
  ck_assert_int_eq(box.end_code, CODE(CLIENT_TIMEOUT));
  ck_assert_ptr_nonnull(strstr(r->error->message, "not pinned"));
  ck_assert_uint_eq(r->error->buffers_held, 0); /* freed with the session, not held */
  (void)b;
}
END_TEST

/* A buffer re-registered paused (after a daemon restart) starts PAUSED
 * without memory, and a resume gives it memory and sends it. */
START_TEST(an_adopted_paused_buffer_resumes) {
  struct buffer *b;
  struct fault f = {0};
  uint64_t chunks[] = {4 * MiB, 4 * MiB};
  ck_assert_int_eq(registry_adopt(reg, &w1, "kv", 0, 8 * MiB, 0, NULL, true, chunks, 2, NULL, NULL, &b, &f),
                   CODE(OK));
  ck_assert_int_eq(b->state, BUF_PAUSED);
  ck_assert(!b->has_memory);
  op(true, "kv", 0, 0, NULL);
  ack(&w1, remap_of(&w1, b), CODE(OK), NULL, 0);
  ck_assert_int_eq(answer(NULL), CODE(OK));
  ck_assert_int_eq(b->state, BUF_ACTIVE);
  ck_assert(b->has_memory);
}
END_TEST

/* Acks the engine did not ask for are refused (NOT_FOUND to the sender)
 * and change nothing: another owner's event, an event twice, buffers the
 * event did not carry. */
START_TEST(wrong_acks_are_refused) {
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0);
  op(false, "kv", 0, 0, NULL);
  uint64_t ev = unmap_of(&w1, a);
  ack(&w2, ev, CODE(OK), NULL, 0);
  wire_env *e = take(&w2, GPUMEM__WIRE__ENVELOPE__BODY_ERROR);
  ck_assert(e && e->error->code == CODE(NOT_FOUND));
  ck_assert_int_eq(a->state, BUF_PAUSING);
  uint64_t stranger[] = {a->id + 100};
  ack(&w1, ev, CODE(BACKEND_ERROR), stranger, 1);
  e = take(&w1, GPUMEM__WIRE__ENVELOPE__BODY_ERROR);
  ck_assert(e && strstr(e->error->message, "did not carry"));
  ck_assert_int_eq(answer(NULL), CODE(OK)); /* a's own unmap went through */
  ack(&w1, ev, CODE(OK), NULL, 0);
  e = take(&w1, GPUMEM__WIRE__ENVELOPE__BODY_ERROR);
  ck_assert(e && e->error->code == CODE(NOT_FOUND));
}
END_TEST

/* The registry's table refuses the moves it does not have, changing
 * nothing; and a buffer in transition may not be freed. */
START_TEST(the_move_table_refuses_what_it_lacks) {
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0);
  ck_assert(registry_can_free(a));
  ck_assert(!registry_move(reg, a, BUF_EV_UNMAPPED));
  ck_assert(!registry_move(reg, a, BUF_EV_COMMIT));
  ck_assert_int_eq(a->state, BUF_ACTIVE);
  ck_assert(registry_move(reg, a, BUF_EV_PAUSE));
  ck_assert(!registry_can_free(a));
  ck_assert(!registry_move(reg, a, BUF_EV_PAUSE));
  ck_assert(registry_move(reg, a, BUF_EV_UNMAP_FAILED));
  ck_assert_int_eq(a->state, BUF_ACTIVE);
  struct tag_view v = registry_tag_state(registry_tag(reg, "kv"));
  ck_assert_int_eq(v.state, BUF_ACTIVE);
  ck_assert_uint_eq(v.transit_buffers, 0);
}
END_TEST

/* A send that fails (the session cannot queue) ends nothing inside the
 * engine: the owner is still waited for until its session closes. */
START_TEST(a_failed_send_waits_for_the_session_to_close) {
  struct buffer *a = alloc(&w1, "kv", 0, 4 * MiB, 0);
  box.send_rc = -EPIPE;
  op(false, "kv", 0, 0, NULL);
  ck_assert_int_eq(a->state, BUF_PAUSING);
  box.send_rc = 0;
  owner_close(&w1);
  ck_assert_int_eq(answer(NULL), CODE(OK));
}
END_TEST

int main(void) {
  /* libuv opens a pipe of its own with the first loop of a process and
   * keeps it: made here, before the tests fork, it is not a test's leak. */
  uv_loop_t first;
  if (uv_loop_init(&first) == 0) uv_loop_close(&first);
  return HARNESS_RUN("states", 20, setup, teardown,
                     pause_and_resume_move_every_buffer,
                     backup_buffers_keep_their_contents,
                     a_failed_unmap_leaves_the_buffer_active,
                     an_owner_still_mapping_keeps_the_memory,
                     acks_of_one_turn_are_settled_together,
                     a_late_unmap_ack_settles_the_buffer,
                     a_late_remap_ack_is_rolled_back,
                     a_failed_remap_rolls_back_every_owner,
                     an_owner_gone_mid_pause_is_not_waited_for,
                     one_process_acks_are_settled_together,
                     a_controller_gone_mid_pause_gets_no_answer,
                     a_device_subset_pauses_only_there,
                     a_scope_covers_only_its_sessions,
                     the_kill_policy_stops_or_ends_stragglers,
                     an_adopted_paused_buffer_resumes,
                     wrong_acks_are_refused,
                     the_move_table_refuses_what_it_lacks,
                     a_failed_send_waits_for_the_session_to_close);
}
