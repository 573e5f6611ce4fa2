/* The pause engine against workers that misbehave on purpose: raw protocol
 * peers written here answer (or do not answer) each event exactly as a test
 * needs, so every interleaving is deterministic. Memory figures are the
 * kernel's, for the daemon's and this process's memfds only. */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/wire.h"
#include "harness.h"

#define MiB (1024ull * 1024ull)
#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x

static struct daemon d;

/* A raw peer: a socket with its own frame reader and writer. */
struct raw {
  int fd;
  frame_reader *r;
  frame_writer *w;
  uint64_t next_id;
};

/* A buffer a raw worker holds: its id and the chunk fds it "maps". */
struct rbuf {
  uint64_t id;
  int fds[8];
  size_t nfds;
};

/* Send a message with fds (consumed). */
static void raw_put(struct raw *p, const wire_env *env, const int *fds, size_t nfds) {
  size_t len;
  uint8_t *bytes = wire_pack(env, &len);
  ck_assert_int_eq(frame_writer_push(p->w, bytes, len, fds, nfds), 0);
  free(bytes);
  int rc;
  while ((rc = frame_writer_flush(p->w, p->fd)) == -EAGAIN) {
    struct pollfd pf = {p->fd, POLLOUT, 0};
    poll(&pf, 1, 5000);
  }
  ck_assert_int_eq(rc, 0);
}

/* The next message (waiting up to 5 s); its fds go to f (NULL: closed).
 * NULL at end of stream. */
static wire_env *raw_get(struct raw *p, struct frame *keep) {
  struct frame f;
  for (;;) {
    int rc = frame_reader_next(p->r, &f);
    ck_assert_int_ge(rc, 0);
    if (rc == 1) break;
    struct pollfd pf = {p->fd, POLLIN, 0};
    ck_assert_msg(poll(&pf, 1, 5000) == 1, "nothing from gpumemd in 5 s");
    ssize_t got = frame_reader_fill(p->r, p->fd);
    if (got == 0) return NULL;
    ck_assert(got > 0 || got == -EAGAIN);
  }
  wire_env *env = wire_unpack(f.data, f.len);
  ck_assert_ptr_nonnull(env);
  if (keep)
    *keep = f;
  else
    frame_release(&f);
  if (keep) {
    free(keep->data);
    keep->data = NULL;
  }
  return env;
}

/* True if a message is waiting (without blocking). */
static bool raw_waiting(struct raw *p) {
  struct pollfd pf = {p->fd, POLLIN, 0};
  return poll(&pf, 1, 0) == 1;
}

/* Connect and say hello in a role. */
static void raw_open(struct raw *p, int role) {
  p->fd = raw_connect(&d);
  ck_assert_int_ge(p->fd, 0);
  p->r = frame_reader_create(WIRE_MAX_REPLY);
  p->w = frame_writer_create();
  p->next_id = 1;
  Gpumem__Wire__Hello h = GPUMEM__WIRE__HELLO__INIT;
  h.version_major = WIRE_VERSION_MAJOR;
  h.version_minor = WIRE_VERSION_MINOR;
  h.role = role;
  h.name = role == GPUMEM__WIRE__ROLE__ROLE_WORKER ? "raw-worker" : "raw-ctl";
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = p->next_id++;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_HELLO;
  env.hello = &h;
  raw_put(p, &env, NULL, 0);
  wire_env *r = raw_get(p, NULL);
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_HELLO_REPLY);
  wire_env_free(r);
}

static void raw_close(struct raw *p) {
  close(p->fd);
  frame_reader_destroy(p->r);
  frame_writer_destroy(p->w);
}

/* Allocate a buffer and keep its chunk fds, as a mapping would. */
static void raw_alloc(struct raw *p, const char *tag, unsigned dev, uint64_t size, uint32_t flags,
                      struct rbuf *b) {
  Gpumem__Wire__AllocRequest a = GPUMEM__WIRE__ALLOC_REQUEST__INIT;
  a.tag = (char *)tag;
  a.device = dev;
  a.size = size;
  a.flags = flags;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = p->next_id++;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ALLOC;
  env.alloc = &a;
  raw_put(p, &env, NULL, 0);
  struct frame f;
  wire_env *r = raw_get(p, &f);
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY);
  b->id = r->alloc_reply->buffer_id;
  ck_assert_uint_le(f.nfds, 8);
  b->nfds = f.nfds;
  for (size_t i = 0; i < f.nfds; i++) {
    b->fds[i] = f.fds[i];
    f.fds[i] = -1;
  }
  frame_release(&f);
  wire_env_free(r);
}

/* "Unmap": close the fds a buffer holds. */
static void unmap(struct rbuf *b) {
  for (size_t i = 0; i < b->nfds; i++) close(b->fds[i]);
  b->nfds = 0;
}

/* Acknowledge an event, naming failed buffers (code OK if none). */
static void ack(struct raw *p, uint64_t event, const uint64_t *failed, size_t nfailed,
                const char *why) {
  Gpumem__Wire__EventAck a = GPUMEM__WIRE__EVENT_ACK__INIT;
  a.code = nfailed ? CODE(BACKEND_ERROR) : CODE(OK);
  a.message = (char *)(why ? why : "");
  a.failed_ids = (uint64_t *)failed;
  a.n_failed_ids = nfailed;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = event;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ACK;
  env.ack = &a;
  raw_put(p, &env, NULL, 0);
}

/* Send a pause or resume of one tag (devices: bit mask, 0 for all). */
static void op_send(struct raw *c, bool resume, const char *tag, uint64_t devmask,
                    uint64_t max_residual) {
  char *tags[] = {(char *)tag};
  uint32_t devs[8];
  size_t ndev = 0;
  for (unsigned i = 0; i < 8; i++)
    if (devmask & (1ull << i)) devs[ndev++] = i;
  Gpumem__Wire__PauseRequest pr = GPUMEM__WIRE__PAUSE_REQUEST__INIT;
  Gpumem__Wire__ResumeRequest rr = GPUMEM__WIRE__RESUME_REQUEST__INIT;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = c->next_id++;
  if (resume) {
    rr.tags = tags;
    rr.n_tags = 1;
    rr.devices = devs;
    rr.n_devices = ndev;
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_RESUME;
    env.resume = &rr;
  } else {
    pr.tags = tags;
    pr.n_tags = 1;
    pr.devices = devs;
    pr.n_devices = ndev;
    pr.max_residual = max_residual;
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_PAUSE;
    env.pause = &pr;
  }
  raw_put(c, &env, NULL, 0);
}

/* The controller's answer: OK (with the OpReply in *out) or an error code
 * (with the Error in *out). Free *out with wire_env_free. */
static wire_code op_wait(struct raw *c, wire_env **out) {
  wire_env *r = raw_get(c, NULL);
  ck_assert_ptr_nonnull(r);
  *out = r;
  if (r->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) return r->error->code;
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY);
  return CODE(OK);
}

/* The next event for a worker, with its fds kept in *f. */
static wire_env *event(struct raw *w, struct frame *f) {
  wire_env *e = raw_get(w, f);
  ck_assert_ptr_nonnull(e);
  ck_assert_msg(e->body_case == GPUMEM__WIRE__ENVELOPE__BODY_UNMAP ||
                    e->body_case == GPUMEM__WIRE__ENVELOPE__BODY_REMAP,
                "expected an event, got message %d", e->body_case);
  return e;
}

/* Take a Remap's fds into the buffers it names ("map" them). */
static void take_remap(const wire_env *e, struct frame *f, struct rbuf *bufs, size_t n) {
  size_t at = 0;
  for (size_t i = 0; i < e->remap->n_entries; i++) {
    const Gpumem__Wire__RemapEntry *en = e->remap->entries[i];
    for (size_t k = 0; k < n; k++) {
      if (bufs[k].id != en->buffer_id) continue;
      for (size_t c = 0; c < en->n_chunk_sizes; c++) {
        bufs[k].fds[bufs[k].nfds++] = f->fds[at + c];
        f->fds[at + c] = -1;
      }
    }
    at += en->n_chunk_sizes;
  }
}

/* A status as the daemon sends it (raw). */
static wire_env *status_of(struct raw *c) {
  Gpumem__Wire__StatusRequest sr = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = c->next_id++;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_STATUS;
  env.status = &sr;
  raw_put(c, &env, NULL, 0);
  wire_env *r = raw_get(c, NULL);
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY);
  return r;
}

static const Gpumem__Wire__TagInfo *tag_of(const wire_env *st, const char *name) {
  for (size_t i = 0; i < st->status_reply->n_tags; i++)
    if (strcmp(st->status_reply->tags[i]->name, name) == 0) return st->status_reply->tags[i];
  ck_abort_msg("no tag %s in status", name);
  return NULL;
}

/* Poll status (up to 2 s) until the tag is in state st with n in transit. */
static bool wait_tag(struct raw *c, const char *tag, int st, uint64_t transit) {
  for (int i = 0; i < 200; i++) {
    wire_env *s = status_of(c);
    const Gpumem__Wire__TagInfo *t = tag_of(s, tag);
    bool ok = (int)t->state == st && t->transit_buffers == transit;
    wire_env_free(s);
    if (ok) return true;
    usleep(10000);
  }
  return false;
}

/* What the daemon process holds of the backend's memory. */
static uint64_t daemon_bytes(void) { return memfd_bytes(&d.pid, 1); }

static void setup(void) { harness_fd_setup(); }

static void teardown(void) {
  if (d.pid) ck_assert_int_eq(daemon_stop(&d), 0);
  harness_fd_teardown();
}

/* A worker that cannot unmap one buffer: the pause fails, names it, and
 * the buffer stays ACTIVE and held; the other one is released. */
START_TEST(failed_unmap_fails_the_pause) {
  daemon_start(&d, NULL);
  struct raw w, c;
  raw_open(&w, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  raw_open(&c, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  struct rbuf b[2];
  raw_alloc(&w, "kv", 0, 4 * MiB, 0, &b[0]);
  raw_alloc(&w, "kv", 0, 4 * MiB, 0, &b[1]);
  op_send(&c, false, "kv", 0, 0);
  wire_env *e = event(&w, NULL);
  ck_assert_uint_eq(e->unmap->n_buffer_ids, 2);
  unmap(&b[0]);
  ack(&w, e->id, &b[1].id, 1, "device busy");
  wire_env_free(e);
  wire_env *r;
  ck_assert_int_eq(op_wait(&c, &r), CODE(NOT_RELEASED));
  ck_assert_uint_eq(r->error->buffers_held, 1);
  ck_assert_uint_eq(r->error->bytes_held, 4 * MiB);
  ck_assert_uint_eq(r->error->n_pids, 1);
  ck_assert_uint_eq(r->error->pids[0], (uint32_t)getpid());
  ck_assert_ptr_nonnull(strstr(r->error->message, "device busy"));
  wire_env_free(r);
  ck_assert_uint_eq(daemon_bytes(), 4 * MiB);
  wire_env *s = status_of(&c);
  const Gpumem__Wire__TagInfo *t = tag_of(s, "kv");
  ck_assert(t->mixed);
  ck_assert_uint_eq(t->paused_buffers, 1);
  wire_env_free(s);
  unmap(&b[1]);
  raw_close(&w);
  raw_close(&c);
}
END_TEST

/* One owner fails its remap: the other owner is told to unmap again, the
 * memory is released, and every buffer is PAUSED as before. */
START_TEST(failed_remap_rolls_the_resume_back) {
  daemon_start(&d, NULL);
  struct raw w1, w2, c;
  raw_open(&w1, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  raw_open(&w2, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  raw_open(&c, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  struct rbuf b1, b2;
  raw_alloc(&w1, "kv", 0, 4 * MiB, 0, &b1);
  raw_alloc(&w2, "kv", 0, 6 * MiB, 0, &b2);
  op_send(&c, false, "kv", 0, 0);
  wire_env *e1 = event(&w1, NULL), *e2 = event(&w2, NULL);
  unmap(&b1);
  unmap(&b2);
  ack(&w1, e1->id, NULL, 0, NULL);
  ack(&w2, e2->id, NULL, 0, NULL);
  wire_env_free(e1);
  wire_env_free(e2);
  wire_env *r;
  ck_assert_int_eq(op_wait(&c, &r), CODE(OK));
  wire_env_free(r);
  ck_assert_uint_eq(daemon_bytes(), 0);
  op_send(&c, true, "kv", 0, 0);
  struct frame f1, f2;
  e1 = event(&w1, &f1);
  e2 = event(&w2, &f2);
  take_remap(e1, &f1, &b1, 1);
  ack(&w1, e1->id, NULL, 0, NULL);
  ack(&w2, e2->id, &b2.id, 1, "import failed");
  frame_release(&f1);
  frame_release(&f2);
  wire_env_free(e1);
  wire_env_free(e2);
  ck_assert_msg(!raw_waiting(&c), "the resume answered before rolling back");
  wire_env *rb = event(&w1, NULL);
  ck_assert_int_eq(rb->body_case, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
  ck_assert_uint_eq(rb->unmap->buffer_ids[0], b1.id);
  unmap(&b1);
  ack(&w1, rb->id, NULL, 0, NULL);
  wire_env_free(rb);
  ck_assert_int_eq(op_wait(&c, &r), CODE(BACKEND_ERROR));
  ck_assert_ptr_nonnull(strstr(r->error->message, "nothing resumed"));
  ck_assert_ptr_nonnull(strstr(r->error->message, "import failed"));
  wire_env_free(r);
  ck_assert_uint_eq(daemon_bytes(), 0);
  wire_env *s = status_of(&c);
  const Gpumem__Wire__TagInfo *t = tag_of(s, "kv");
  ck_assert_int_eq(t->state, GPUMEM__WIRE__BUFFER_STATE__PAUSED);
  ck_assert_uint_eq(t->paused_buffers, 2);
  ck_assert(!t->mixed);
  wire_env_free(s);
  raw_close(&w1);
  raw_close(&w2);
  raw_close(&c);
}
END_TEST

/* A stopped worker misses its unmap: the pause says so with the bytes it
 * holds; so does every later pause or resume, until the late ack releases
 * the memory and the tag is PAUSED. */
START_TEST(missed_unmap_is_held_until_the_late_ack) {
  daemon_start(&d, "--ack-timeout", "200ms", NULL);
  struct raw w, c;
  raw_open(&w, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  raw_open(&c, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  struct rbuf b;
  raw_alloc(&w, "kv", 0, 8 * MiB, 0, &b);
  op_send(&c, false, "kv", 0, 0);
  wire_env *e = event(&w, NULL), *r;
  ck_assert_int_eq(op_wait(&c, &r), CODE(CLIENT_TIMEOUT));
  ck_assert_uint_eq(r->error->bytes_held, 8 * MiB);
  ck_assert_uint_eq(r->error->pids[0], (uint32_t)getpid());
  wire_env_free(r);
  op_send(&c, false, "kv", 0, 0);
  ck_assert_int_eq(op_wait(&c, &r), CODE(CLIENT_TIMEOUT));
  ck_assert_uint_eq(r->error->bytes_held, 8 * MiB);
  ck_assert_ptr_nonnull(strstr(r->error->message, "has not acknowledged"));
  wire_env_free(r);
  op_send(&c, true, "kv", 0, 0);
  ck_assert_int_eq(op_wait(&c, &r), CODE(CLIENT_TIMEOUT));
  ck_assert_ptr_nonnull(strstr(r->error->message, "nothing changed"));
  wire_env_free(r);
  ck_assert(wait_tag(&c, "kv", GPUMEM__WIRE__BUFFER_STATE__PAUSING, 1));
  ck_assert_uint_eq(daemon_bytes(), 8 * MiB);
  unmap(&b);
  ack(&w, e->id, NULL, 0, NULL);
  wire_env_free(e);
  ck_assert(wait_tag(&c, "kv", GPUMEM__WIRE__BUFFER_STATE__PAUSED, 0));
  ck_assert_uint_eq(daemon_bytes(), 0);
  op_send(&c, false, "kv", 0, 0);
  ck_assert_int_eq(op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 0);
  wire_env_free(r);
  raw_close(&w);
  raw_close(&c);
}
END_TEST

/* A resume that times out is undone: a pause meanwhile is refused, and the
 * late remap ack is answered with an unmap, after which the tag is PAUSED
 * and its memory released. */
START_TEST(missed_remap_is_rolled_back_at_the_late_ack) {
  daemon_start(&d, "--ack-timeout", "200ms", NULL);
  struct raw w, c;
  raw_open(&w, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  raw_open(&c, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  struct rbuf b;
  raw_alloc(&w, "kv", 0, 8 * MiB, 0, &b);
  op_send(&c, false, "kv", 0, 0);
  wire_env *e = event(&w, NULL), *r;
  unmap(&b);
  ack(&w, e->id, NULL, 0, NULL);
  wire_env_free(e);
  ck_assert_int_eq(op_wait(&c, &r), CODE(OK));
  wire_env_free(r);
  op_send(&c, true, "kv", 0, 0);
  struct frame f;
  e = event(&w, &f);
  ck_assert_int_eq(op_wait(&c, &r), CODE(CLIENT_TIMEOUT));
  ck_assert_ptr_nonnull(strstr(r->error->message, "nothing resumed"));
  wire_env_free(r);
  op_send(&c, false, "kv", 0, 0);
  ck_assert_int_eq(op_wait(&c, &r), CODE(CLIENT_TIMEOUT));
  ck_assert_uint_eq(r->error->bytes_held, 8 * MiB);
  wire_env_free(r);
  take_remap(e, &f, &b, 1);
  frame_release(&f);
  ack(&w, e->id, NULL, 0, NULL);
  wire_env_free(e);
  e = event(&w, NULL);
  ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
  unmap(&b);
  ack(&w, e->id, NULL, 0, NULL);
  wire_env_free(e);
  ck_assert(wait_tag(&c, "kv", GPUMEM__WIRE__BUFFER_STATE__PAUSED, 0));
  ck_assert_uint_eq(daemon_bytes(), 0);
  raw_close(&w);
  raw_close(&c);
}
END_TEST

/* Answer every event of one operation: unmaps close, remaps take fds. */
static void serve(struct raw *w, struct rbuf *bufs, size_t n, size_t events) {
  for (size_t k = 0; k < events; k++) {
    struct frame f;
    wire_env *e = event(w, &f);
    if (e->body_case == GPUMEM__WIRE__ENVELOPE__BODY_UNMAP) {
      for (size_t i = 0; i < e->unmap->n_buffer_ids; i++)
        for (size_t j = 0; j < n; j++)
          if (bufs[j].id == e->unmap->buffer_ids[i]) unmap(&bufs[j]);
    } else {
      take_remap(e, &f, bufs, n);
    }
    frame_release(&f);
    ack(w, e->id, NULL, 0, NULL);
    wire_env_free(e);
  }
}

/* Paused everywhere, resumed on one device: the tag says mixed, and a
 * resume of the other device makes it ACTIVE (it used to stay PAUSED). */
START_TEST(device_subsets_keep_the_tag_state_true) {
  daemon_start(&d, NULL);
  struct raw w, c;
  raw_open(&w, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  raw_open(&c, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  struct rbuf b[2];
  raw_alloc(&w, "kv", 0, 2 * MiB, 0, &b[0]);
  raw_alloc(&w, "kv", 1, 2 * MiB, 0, &b[1]);
  wire_env *r;
  op_send(&c, false, "kv", 0, 0);
  serve(&w, b, 2, 1);
  ck_assert_int_eq(op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->n_checks, 2);
  wire_env_free(r);
  op_send(&c, true, "kv", 1u << 1, 0);
  serve(&w, b, 2, 1);
  ck_assert_int_eq(op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  wire_env_free(r);
  wire_env *s = status_of(&c);
  ck_assert(tag_of(s, "kv")->mixed);
  ck_assert_int_eq(tag_of(s, "kv")->state, GPUMEM__WIRE__BUFFER_STATE__PAUSED);
  wire_env_free(s);
  op_send(&c, true, "kv", 1u << 0, 0);
  serve(&w, b, 2, 1);
  ck_assert_int_eq(op_wait(&c, &r), CODE(OK));
  wire_env_free(r);
  s = status_of(&c);
  ck_assert(!tag_of(s, "kv")->mixed);
  ck_assert_int_eq(tag_of(s, "kv")->state, GPUMEM__WIRE__BUFFER_STATE__ACTIVE);
  wire_env_free(s);
  unmap(&b[0]);
  unmap(&b[1]);
  raw_close(&w);
  raw_close(&c);
}
END_TEST

/* The error a session gets outside a request (id 0). */
static wire_code stray_error(struct raw *p) {
  wire_env *e = raw_get(p, NULL);
  ck_assert_ptr_nonnull(e);
  ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_ERROR);
  ck_assert_uint_eq(e->id, 0);
  wire_code code = e->error->code;
  wire_env_free(e);
  return code;
}

/* Acks for events never sent, acked twice, or sent to another session get
 * an error and change nothing; the right ack still counts. */
START_TEST(wrong_acks_are_refused) {
  daemon_start(&d, NULL);
  struct raw w1, w2, c;
  raw_open(&w1, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  raw_open(&w2, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  raw_open(&c, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  struct rbuf b;
  raw_alloc(&w1, "kv", 0, 2 * MiB, 0, &b);
  ack(&w1, 999, NULL, 0, NULL);
  ck_assert_int_eq(stray_error(&w1), CODE(NOT_FOUND));
  op_send(&c, false, "kv", 0, 0);
  wire_env *e = event(&w1, NULL), *r;
  ack(&w2, e->id, NULL, 0, NULL);
  ck_assert_int_eq(stray_error(&w2), CODE(NOT_FOUND));
  ck_assert(!raw_waiting(&c));
  uint64_t stranger = b.id + 1000;
  unmap(&b);
  ack(&w1, e->id, &stranger, 1, "not mine");
  ck_assert_int_eq(stray_error(&w1), CODE(NOT_FOUND));
  ck_assert_int_eq(op_wait(&c, &r), CODE(OK)); /* its own buffer was unmapped */
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  wire_env_free(r);
  ack(&w1, e->id, NULL, 0, NULL);
  ck_assert_int_eq(stray_error(&w1), CODE(NOT_FOUND));
  wire_env_free(e);
  /* The sessions still work. */
  struct rbuf b2;
  raw_alloc(&w2, "other", 0, 2 * MiB, 0, &b2);
  unmap(&b2);
  raw_close(&w1);
  raw_close(&w2);
  raw_close(&c);
}
END_TEST

/* A worker that acknowledges an unmap but keeps the memory is caught by
 * the kernel's figures: the memory is not counted as free, and a later
 * pause releases it once the worker really lets go. */
START_TEST(ack_without_unmap_is_caught) {
  daemon_start(&d, NULL);
  struct raw w, c;
  raw_open(&w, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  raw_open(&c, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  struct rbuf b;
  raw_alloc(&w, "kv", 0, 4 * MiB, 0, &b);
  op_send(&c, false, "kv", 0, 0);
  wire_env *e = event(&w, NULL), *r;
  ack(&w, e->id, NULL, 0, NULL); /* a lie: b's fd stays open */
  wire_env_free(e);
  ck_assert_int_eq(op_wait(&c, &r), CODE(NOT_RELEASED));
  ck_assert_ptr_nonnull(strstr(r->error->message, "still maps it"));
  ck_assert_uint_eq(r->error->bytes_held, 4 * MiB);
  wire_env_free(r);
  wire_env *s = status_of(&c);
  ck_assert_uint_eq(s->status_reply->devices[0]->managed, 4 * MiB);
  wire_env_free(s);
  ck_assert_uint_eq(daemon_bytes(), 4 * MiB);
  unmap(&b);
  op_send(&c, false, "kv", 0, 0);
  ck_assert_int_eq(op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  wire_env_free(r);
  ck_assert_uint_eq(daemon_bytes(), 0);
  raw_close(&w);
  raw_close(&c);
}
END_TEST

/* Open fds of a process, and the highest one. */
static int fds_of(pid_t pid, int *maxfd) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *dir = opendir(path);
  int n = 0;
  *maxfd = -1;
  for (struct dirent *de; dir && (de = readdir(dir));) {
    if (de->d_name[0] == '.') continue;
    int fd = atoi(de->d_name);
    if (fd != dirfd(dir)) n++;
    if (fd > *maxfd) *maxfd = fd;
  }
  if (dir) closedir(dir);
  return n;
}

/* With room for every chunk but not for every export, the resume fails,
 * says why, and leaves every buffer PAUSED with nothing held. */
START_TEST(export_failure_leaves_everything_paused) {
  daemon_start(&d, "--chunk-size", "2M", NULL);
  struct raw w, c;
  raw_open(&w, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  raw_open(&c, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  struct rbuf b[2];
  raw_alloc(&w, "kv", 0, 8 * MiB, 0, &b[0]);
  raw_alloc(&w, "kv", 0, 8 * MiB, 0, &b[1]);
  op_send(&c, false, "kv", 0, 0);
  serve(&w, b, 2, 1);
  wire_env *r;
  ck_assert_int_eq(op_wait(&c, &r), CODE(OK));
  wire_env_free(r);
  /* 8 chunks to create, 8 fds to export: leave room for 12. */
  int maxfd, open_fds = fds_of(d.pid, &maxfd);
  struct rlimit rl = {(rlim_t)open_fds + 12, (rlim_t)open_fds + 12};
  ck_assert_int_lt(maxfd, open_fds + 12);
  ck_assert_int_eq(prlimit(d.pid, RLIMIT_NOFILE, &rl, NULL), 0);
  op_send(&c, true, "kv", 0, 0);
  ck_assert_int_eq(op_wait(&c, &r), CODE(BACKEND_ERROR));
  ck_assert_ptr_nonnull(strstr(r->error->message, "export"));
  ck_assert_ptr_nonnull(strstr(r->error->message, "nothing resumed"));
  wire_env_free(r);
  ck_assert_msg(!raw_waiting(&w), "a worker was sent a remap");
  ck_assert_uint_eq(daemon_bytes(), 0);
  wire_env *s = status_of(&c);
  ck_assert_int_eq(tag_of(s, "kv")->state, GPUMEM__WIRE__BUFFER_STATE__PAUSED);
  ck_assert_uint_eq(tag_of(s, "kv")->paused_buffers, 2);
  ck_assert_uint_eq(s->status_reply->devices[0]->managed, 0);
  wire_env_free(s);
  raw_close(&w);
  raw_close(&c);
}
END_TEST

/* More chunks than one frame carries: the remap comes in several events,
 * each acked, and the resume waits for all. */
START_TEST(remaps_split_over_several_frames) {
  daemon_start(&d, "--chunk-size", "2M", NULL);
  struct raw w, c;
  raw_open(&w, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  raw_open(&c, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  enum { N = 60 };
  static struct rbuf b[N];
  for (size_t i = 0; i < N; i++) raw_alloc(&w, "kv", 0, 10 * MiB, 0, &b[i]); /* 5 chunks each */
  wire_env *r;
  op_send(&c, false, "kv", 0, 0);
  serve(&w, b, N, 1);
  ck_assert_int_eq(op_wait(&c, &r), CODE(OK));
  wire_env_free(r);
  op_send(&c, true, "kv", 0, 0);
  serve(&w, b, N, 1); /* 300 fds: the first frame carries at most 253 */
  ck_assert(!raw_waiting(&c));
  serve(&w, b, N, 1);
  ck_assert_int_eq(op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, N);
  wire_env_free(r);
  for (size_t i = 0; i < N; i++) unmap(&b[i]);
  raw_close(&w);
  raw_close(&c);
}
END_TEST

/* Memory another process keeps on a device outside the daemon is named
 * with its pid, and a pause with --max-residual below it fails. */
START_TEST(residual_memory_fails_a_pause_that_allows_less) {
  daemon_start(&d, NULL);
  struct raw w, c;
  raw_open(&w, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  raw_open(&c, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  struct rbuf b;
  raw_alloc(&w, "kv", 0, 2 * MiB, 0, &b);
  /* "Device memory" of our own: a memfd named as the daemon's device 0. */
  wire_env *s0 = status_of(&c);
  char name[96];
  snprintf(name, sizeof name, "gpumem-%s", s0->status_reply->devices[0]->bus_id);
  wire_env_free(s0);
  int fd = memfd_create(name, MFD_CLOEXEC);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, 8 * MiB), 0);
  void *p = mmap(NULL, 8 * MiB, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ck_assert(p != MAP_FAILED);
  memset(p, 1, 8 * MiB);
  close(fd);
  wire_env *s = status_of(&c);
  ck_assert(s->status_reply->processes_known);
  bool named = false;
  for (size_t i = 0; i < s->status_reply->n_processes; i++) {
    const Gpumem__Wire__ProcessMemory *pm = s->status_reply->processes[i];
    if (pm->pid == (uint32_t)getpid() && pm->device == 0 && pm->residual == 8 * MiB) named = true;
  }
  ck_assert_msg(named, "our 8 MiB outside the daemon is not in status");
  wire_env_free(s);
  op_send(&c, false, "kv", 0, 4 * MiB);
  serve(&w, &b, 1, 1);
  wire_env *r;
  ck_assert_int_eq(op_wait(&c, &r), CODE(RESIDUAL_EXCEEDED));
  char pid[32];
  snprintf(pid, sizeof pid, "pid %d", (int)getpid());
  ck_assert_ptr_nonnull(strstr(r->error->message, pid));
  ck_assert_uint_eq(r->error->checks[0]->residual, 8 * MiB);
  wire_env_free(r);
  munmap(p, 8 * MiB);
  raw_close(&w);
  raw_close(&c);
}
END_TEST

/* On SIGTERM every session is told, outside any request. */
START_TEST(shutdown_is_announced) {
  daemon_start(&d, NULL);
  struct raw w;
  raw_open(&w, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  kill(d.pid, SIGTERM);
  ck_assert_int_eq(stray_error(&w), CODE(SHUTTING_DOWN));
  ck_assert_int_eq(daemon_stop(&d), 0);
  raw_close(&w);
}
END_TEST

int main(void) {
  return HARNESS_RUN("engine", 20, setup, teardown, failed_unmap_fails_the_pause,
                     failed_remap_rolls_the_resume_back, missed_unmap_is_held_until_the_late_ack,
                     missed_remap_is_rolled_back_at_the_late_ack,
                     device_subsets_keep_the_tag_state_true, wrong_acks_are_refused,
                     ack_without_unmap_is_caught, export_failure_leaves_everything_paused,
                     remaps_split_over_several_frames,
                     residual_memory_fails_a_pause_that_allows_less, shutdown_is_announced);
}
