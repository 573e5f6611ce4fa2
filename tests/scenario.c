#include "scenario.h"

#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

/* Teardown of a suite's daemon, then of its fd count. */
void scene_stop(struct daemon *d) {
  if (d->pid) ck_assert_int_eq(daemon_stop(d), 0);
  harness_fd_teardown();
}

/* Connect a raw worker, then a raw controller. */
void scene_open(struct peer *w, struct peer *c, const struct daemon *d) {
  peer_open(w, d, WORKER);
  peer_open(c, d, CONTROLLER);
}

/* A worker with one buffer and a controller, a pause of its tag sent;
 * the worker's event. */
wire_env *scene_pausing(struct peer *w, struct peer *c, const struct daemon *d, const char *tag,
                        uint64_t size, struct pbuf *b) {
  scene_open(w, c, d);
  peer_alloc(w, tag, 0, size, 0, b);
  peer_op(c, false, tag, 0, 0);
  return peer_event(w, NULL);
}

/* Allocate n alike buffers. */
void scene_alloc_n(struct peer *w, const char *tag, unsigned dev, uint64_t size, uint32_t flags,
                   struct pbuf *b, size_t n) {
  for (size_t i = 0; i < n; i++) peer_alloc(w, tag, dev, size, flags, &b[i]);
}

/* A pause or resume of one tag; the answer, of code want. */
wire_env *scene_op(struct peer *c, bool resume, const char *tag, wire_code want) {
  peer_op(c, resume, tag, 0, 0);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(c, &r), want);
  return r;
}

/* The code of a pause or resume of one tag. */
wire_code scene_op_code(struct peer *c, bool resume, const char *tag) {
  peer_op(c, resume, tag, 0, 0);
  return peer_op_code(c);
}

/* The OK answer to an operation, its owner's one event served. */
wire_env *scene_answer(struct peer *c, struct peer *w, struct pbuf *bufs, size_t n) {
  peer_serve(w, bufs, n, 1);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(c, &r), CODE(OK));
  return r;
}

/* A pause or resume served by its one owner; the OK reply. */
wire_env *scene_served_reply(struct peer *c, struct peer *w, struct pbuf *bufs, size_t n,
                             bool resume, const char *tag) {
  if (tag)
    peer_op(c, resume, tag, 0, 0);
  else
    peer_op_tags(c, resume, NULL, 0, 0, 0);
  return scene_answer(c, w, bufs, n);
}

/* A pause or resume served by its one owner, answered OK. */
void scene_served(struct peer *c, struct peer *w, struct pbuf *bufs, size_t n, bool resume,
                  const char *tag) {
  wire_env_free(scene_served_reply(c, w, bufs, n, resume, tag));
}

/* Answer an event in hand for a worker's buffers. */
void scene_serve_event(struct peer *w, wire_env *e, struct frame *f, struct pbuf *bufs, size_t n) {
  if (e->body_case == GPUMEM__WIRE__ENVELOPE__BODY_UNMAP) {
    for (size_t i = 0; i < e->unmap->n_buffer_ids; i++)
      for (size_t j = 0; j < n; j++)
        if (bufs[j].id == e->unmap->buffer_ids[i]) peer_unmap(&bufs[j]);
  } else {
    peer_take_remap(e, f, bufs, n);
  }
  frame_release(f);
  peer_ack(w, e->id, NULL, 0, NULL);
  wire_env_free(e);
}

/* Unmap the one buffer of an event and ack it. */
void scene_unmap_ack(struct peer *w, wire_env *e, struct pbuf *b) {
  peer_unmap(b);
  peer_ack(w, e->id, NULL, 0, NULL);
  wire_env_free(e);
}

/* Cap a process's fds at its open ones plus room. */
int scene_cap_fds(pid_t pid, int room) {
  int maxfd, open_fds = proc_fds(pid, &maxfd);
  struct rlimit rl = {(rlim_t)open_fds + room, (rlim_t)open_fds + room};
  ck_assert_int_lt(maxfd, open_fds + room);
  ck_assert_int_eq(prlimit(pid, RLIMIT_NOFILE, &rl, NULL), 0);
  return open_fds;
}

/* Free a buffer; the reply. */
wire_env *scene_free(struct peer *p, uint64_t id) {
  Gpumem__Wire__FreeRequest fr = GPUMEM__WIRE__FREE_REQUEST__INIT;
  fr.buffer_id = id;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_FREE;
  env.free = &fr;
  return peer_call(p, &env);
}

/* Free a buffer; the reply's code. */
wire_code scene_free_code(struct peer *p, uint64_t id) {
  wire_env *r = scene_free(p, id);
  wire_code code = peer_reply_code(r, NULL, 0);
  wire_env_free(r);
  return code;
}

/* The fields a PauseRequest and a ResumeRequest share, the tags and the
 * scope, set in either: two message types with the same field names,
 * which C can write once only as a macro. */
#define SET_SCOPED(req, tag_list, count, scope)                              \
  do {                                                                       \
    (req).tags = (char **)(tag_list);                                        \
    (req).n_tags = (count);                                                  \
    (req).own = (scope)->own;                                                \
    (req).pids = (uint32_t *)(scope)->pids;                                  \
    (req).n_pids = (scope)->npids;                                           \
    (req).session_prefix = (char *)((scope)->prefix ? (scope)->prefix : ""); \
    (req).timeout_ms = (scope)->timeout_ms;                                  \
  } while (0)

/* Send a scoped pause or resume. */
void scene_send_scoped(struct peer *p, bool resume, const char *const *tags, size_t ntags,
                       const struct scene_scope *sc) {
  Gpumem__Wire__PauseRequest pr = GPUMEM__WIRE__PAUSE_REQUEST__INIT;
  Gpumem__Wire__ResumeRequest rr = GPUMEM__WIRE__RESUME_REQUEST__INIT;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = p->next_id++;
  if (resume) {
    SET_SCOPED(rr, tags, ntags, sc);
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_RESUME;
    env.resume = &rr;
  } else {
    SET_SCOPED(pr, tags, ntags, sc);
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_PAUSE;
    env.pause = &pr;
  }
  peer_put(p, &env, NULL, 0);
}

/* The pattern's word i for seed. */
static uint32_t pattern(uint32_t seed, uint64_t i) { return seed ^ (uint32_t)(i * 2654435761u); }

/* Write the pattern of seed into a buffer's first chunk. */
void scene_fill(const struct pbuf *b, uint64_t len, uint32_t seed) {
  uint32_t *v = malloc(len);
  for (uint64_t i = 0; i < len / 4; i++) v[i] = pattern(seed, i);
  ck_assert_int_eq(pwrite(b->fds[0], v, len, 0), (ssize_t)len);
  free(v);
}

/* Whether a buffer's first chunk holds the pattern of seed. */
bool scene_holds(const struct pbuf *b, uint64_t len, uint32_t seed) {
  uint32_t *v = malloc(len);
  bool ok = pread(b->fds[0], v, len, 0) == (ssize_t)len;
  for (uint64_t i = 0; ok && i < len / 4; i++) ok = v[i] == pattern(seed, i);
  free(v);
  return ok;
}

/* Queue n copies of a request, each with its own id. */
int scene_queue(struct peer *p, wire_env *env, int n) {
  int first = 0;
  for (int i = 0; i < n; i++) {
    env->id = p->next_id++;
    size_t len;
    uint8_t *bytes = wire_pack(env, &len);
    int rc = frame_writer_push(p->w, bytes, len, NULL, 0);
    if (rc && !first) first = rc;
    free(bytes);
  }
  return first;
}
