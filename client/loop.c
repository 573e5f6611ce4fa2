/* The connection's loop: what the I/O owner does.
 *
 * A turn of the loop: make the next connection attempt when it is due
 * (down), write what waits, wait for the socket, a wake-up or the next
 * deadline, read and route what came, write again. A caller's request
 * enters the socket's queue only when nothing waits there (so that one
 * that cannot be sent in time fails unsent); the loop's own messages
 * (acks, Hello, re-registrations, the frees it finishes) go at once and
 * are watched: a daemon that takes none of them for the request timeout
 * loses the connection. A write that fails does not end the connection
 * before everything the daemon sent is read: its last words (why it
 * refused or closed the session) come before the broken pipe. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "error.h"
#include "loop.h"

/* Free a request and what it still holds. */
void loop_request_free(struct request *r) {
  for (size_t i = 0; i < r->nfds; i++) close(r->fds[i]);
  free(r->fds);
  free(r->bytes);
  free(r);
}

/* Double a back-off, up to its maximum. */
int loop_backoff_next(int ms) { return ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : ms * 2; }

/* Queue a request of the loop's own (bytes and fds taken). Called with
 * mu held. Returns it, or NULL when out of memory (nothing kept). */
static struct request *enqueue(conn *k, enum request_kind kind, uint64_t id, uint8_t *bytes,
                               size_t len, const int *fds, size_t nfds) {
  struct request *r = calloc(1, sizeof *r);
  if (r && nfds && (r->fds = malloc(nfds * sizeof *fds))) {
    memcpy(r->fds, fds, nfds * sizeof *fds);
    r->nfds = nfds;
  }
  if (!r || (nfds && !r->fds)) {
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    free(bytes);
    free(r);
    return NULL;
  }
  r->kind = kind;
  r->id = id;
  r->bytes = bytes;
  r->len = len;
  list_append(&k->queue, &r->link);
  if (k->polling) chan_wake(k->ch);
  return r;
}

/* Pack a FreeRequest of buffer id as request rid; NULL when out of
 * memory. */
static uint8_t *pack_free(uint64_t rid, uint64_t id, size_t *len) {
  Gpumem__Wire__FreeRequest fr = GPUMEM__WIRE__FREE_REQUEST__INIT;
  fr.buffer_id = id;
  wire_env req = wire_envelope(rid, GPUMEM__WIRE__ENVELOPE__BODY_FREE, &fr);
  return wire_pack(&req, len);
}

/* Write what may go now: the loop's own requests at once (a free after
 * its back-off), a caller's only into an empty queue. Called by the
 * token holder with mu held. Returns 0 or the -errno of a failed write. */
static int write_out(conn *k) {
  int rc = chan_flush(k->ch);
  if (rc < 0 && rc != -EAGAIN) return rc;
  double now = clock_ms();
  struct list *p, *t;
  list_for_each_safe(p, t, &k->queue) {
    struct request *r = list_entry(p, struct request, link);
    if (r->kind == REQ_FREE && r->due_ms > now) continue;
    if (r->kind == REQ_CALL && !chan_idle(k->ch)) continue;
    if (r->kind == REQ_FREE) {
      r->id = k->next_id++;
      if (!(r->bytes = pack_free(r->id, gpumem_buffer_id(r->buf), &r->len))) continue;
    }
    int pushed = chan_push(k->ch, r->bytes, r->len, r->fds, r->nfds, r->kind != REQ_CALL);
    free(r->bytes);
    free(r->fds);
    r->bytes = NULL;
    r->fds = NULL;
    r->nfds = 0;
    if (pushed < 0) {
      /* Out of memory: a caller is told, a free waits, the greeting's
       * requests are lost (it times out). */
      if (r->kind == REQ_FREE) {
        r->due_ms = now + BACKOFF_MAX_MS;
        continue;
      }
      list_remove(&r->link);
      if (r->kind != REQ_CALL) {
        loop_request_free(r);
        continue;
      }
      r->done = true;
      r->err = GPUMEM_E_NOMEM;
      pthread_cond_broadcast(&k->cv);
      continue;
    }
    list_remove(&r->link);
    r->sent = true;
    list_append(&k->sent, &r->link);
    rc = chan_flush(k->ch);
    if (rc < 0 && rc != -EAGAIN) return rc;
  }
  return 0;
}

/* The request written with this id, or NULL. Called with mu held. */
static struct request *find_sent(conn *k, uint64_t id) {
  for (struct list *p = k->sent.next; p != &k->sent; p = p->next) {
    struct request *r = list_entry(p, struct request, link);
    if (r->id == id) return r;
  }
  return NULL;
}

/* The connection is live (again): the sticky error is cleared, and a
 * restored connection is announced with what was re-registered. */
static void go_live(conn *k) {
  size_t skipped = 0, adopted = 0;
  const char *words = "";
  if (k->plan) adopted = adopt_result(k->plan, &skipped, &words);
  char said[400];
  if (skipped)
    snprintf(said, sizeof said, "%zu buffers not re-registered: %s", skipped, words);
  else
    snprintf(said, sizeof said, "re-registered %zu buffers", adopted);
  pthread_mutex_lock(&k->mu);
  bool first = k->first;
  adopt_destroy(k->plan);
  k->plan = NULL;
  k->state = CONN_LIVE;
  k->first = false;
  k->err.set = false;
  k->backoff_ms = BACKOFF_FIRST_MS;
  gpumem_conn_hook hook = first || k->closing ? NULL : k->hook;
  void *user = k->hook_user;
  pthread_cond_broadcast(&k->cv);
  pthread_mutex_unlock(&k->mu);
  if (hook) hook(k->client, GPUMEM_CONN_RESTORED, skipped ? GPUMEM_E_DISCONNECTED : 0, said,
                 adopted, user);
}

/* The Hello's answer: take the greeting, then re-register the buffers (a
 * worker that holds some, after a restart) or go live. By the token
 * holder, without mu. Returns 0, or the code with why filled when the
 * connection must end. */
static int greeted(conn *k, const wire_env *env, char *why, size_t len) {
  int rc;
  if (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_HELLO_REPLY)
    rc = hello_apply(k->hello, env->hello_reply, k->first);
  else if (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR)
    rc = error_set(error_from_wire(env->error->code), "%s: %s",
                   wire_code_name(env->error->code), env->error->message);
  else
    rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered Hello with something else");
  if (rc < 0) {
    snprintf(why, len, "%s", gpumem_last_error());
    return rc;
  }
  if (k->first || k->role != GPUMEM_ROLE_WORKER || !buffers_count(k->buffers)) {
    go_live(k);
    return 0;
  }
  adopt *plan = adopt_create(k->buffers, k->hello);
  if (!plan) {
    snprintf(why, len, "re-registering buffers: out of memory");
    return GPUMEM_E_DISCONNECTED;
  }
  pthread_mutex_lock(&k->mu);
  k->plan = plan;
  k->answers = 0;
  k->state = CONN_ADOPTING;
  k->greet_until = clock_ms() + k->timeout_ms;
  for (size_t i = 0; i < adopt_count(plan); i++) {
    int *fds;
    size_t nfds, n;
    wire_env *req = adopt_request(plan, i, &fds, &nfds);
    req->id = k->next_id++;
    uint8_t *bytes = wire_pack(req, &n);
    struct request *r = bytes ? enqueue(k, REQ_ADOPT, req->id, bytes, n, fds, nfds) : NULL;
    if (!bytes)
      for (size_t f = 0; f < nfds; f++) close(fds[f]);
    if (r) r->batch = i;
    else k->answers++; /* out of memory: this one is answered "not re-registered" */
    if (!r) adopt_answer(plan, i, k->buffers, NULL, "out of memory");
  }
  bool all = k->answers == adopt_count(plan);
  pthread_mutex_unlock(&k->mu);
  if (all) go_live(k);
  return 0;
}

/* A reply whose caller stopped waiting: the memory of an allocation is
 * given back (its fds close with the frame); anything else is dropped.
 * By the token holder, with mu held. */
static void late_reply(conn *k, const wire_env *env) {
  if (env->body_case != GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY) return;
  size_t len;
  uint8_t *bytes = pack_free(k->next_id++, env->alloc_reply->buffer_id, &len);
  if (bytes) chan_push(k->ch, bytes, len, NULL, 0, true);
  free(bytes);
}

/* An answer to one of the library's frees: the buffer goes once the
 * daemon freed it (or does not know it); a refusal (a pause or resume has
 * it) sends the free again after a back-off. Called with mu held; returns
 * the buffer to destroy, if any. */
static gpumem_buffer *freed(conn *k, struct request *r, const wire_env *env) {
  bool gone = env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_FREE_REPLY ||
              (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR &&
               env->error->code == GPUMEM__WIRE__ERROR_CODE__NOT_FOUND);
  list_remove(&r->link);
  if (!gone) {
    r->sent = false;
    r->due_ms = clock_ms() + k->free_backoff_ms;
    k->free_backoff_ms = loop_backoff_next(k->free_backoff_ms);
    list_append(&k->queue, &r->link);
    return NULL;
  }
  k->free_backoff_ms = BACKOFF_FIRST_MS;
  gpumem_buffer *b = r->buf;
  loop_request_free(r);
  return b;
}

/* Build the buffer of a caller's AllocReply before the next frame is
 * read, so that an Unmap right behind the reply finds it. A buffer that
 * is made but does not map is held all the same (doomed: the caller gives
 * it back), so that events for it are answered truthfully. By the token
 * holder, without mu. */
static void build(conn *k, struct call *call, const wire_env *env, struct frame *f) {
  gpumem_buffer *b = NULL;
  const Gpumem__Wire__AllocReply *r = env->alloc_reply;
  struct buffer_spec spec = *call->alloc;
  int map[GPUMEM_MAX_DEVICES];
  if (spec.attach) { /* what the buffer is comes with it */
    if (!wire_tag_valid(r->tag) || !(r->flags & GPUMEM__WIRE__BUFFER_FLAG__FLAG_PERSIST)) {
      call->built_rc = GPUMEM_E_PROTOCOL;
      snprintf(call->built_words, sizeof call->built_words,
               "gpumemd answered an attach with a buffer that is not a persistent one of a "
               "tag");
      call->built = NULL;
      return;
    }
    hello_local_map(k->hello, map);
    int local = hello_local_device(map, r->device);
    spec.tag = r->tag;
    spec.device = r->device;
    spec.local = local < 0 ? 0 : (unsigned)local;
    spec.flags = r->flags;
    if (local < 0) {
      call->built_rc = GPUMEM_E_INVALID;
      snprintf(call->built_words, sizeof call->built_words,
               "the buffer is on gpumemd's device %u, which this process does not see",
               r->device);
      call->built = NULL;
      return;
    }
  }
  call->built_rc = buffer_create(hello_gpu(k->hello), &spec, r, f->fds, &b);
  if (call->built_rc < 0)
    snprintf(call->built_words, sizeof call->built_words, "%s", gpumem_last_error());
  if (b && buffers_add(k->buffers, b) < 0) {
    buffer_destroy(b);
    b = NULL;
    call->built_rc = GPUMEM_E_NOMEM;
    snprintf(call->built_words, sizeof call->built_words, "out of memory");
  }
  call->built = b;
}

/* Route an answer to its request. By the token holder, without mu.
 * Returns 0, or the code to end the connection with (why filled). */
static int answer(conn *k, wire_env *env, struct frame *f, char *why, size_t len) {
  pthread_mutex_lock(&k->mu);
  struct request *r = find_sent(k, env->id);
  if (!r) {
    late_reply(k, env);
    pthread_mutex_unlock(&k->mu);
    wire_env_free(env);
    return 0;
  }
  if (r->kind == REQ_FREE) {
    gpumem_buffer *b = freed(k, r, env);
    pthread_mutex_unlock(&k->mu);
    wire_env_free(env);
    if (b) {
      buffers_remove(k->buffers, b);
      buffer_destroy(b);
    }
    return 0;
  }
  list_remove(&r->link);
  if (r->kind != REQ_CALL) {
    bool greeting = r->kind == REQ_HELLO;
    size_t batch = r->batch;
    loop_request_free(r);
    adopt *plan = k->plan;
    pthread_mutex_unlock(&k->mu);
    int rc = 0;
    if (greeting) {
      rc = greeted(k, env, why, len);
    } else if (plan && adopt_answer(plan, batch, k->buffers, env, NULL) < 0) {
      snprintf(why, len, "gpumemd answered a re-registration with %zu ids that do not fit",
               env->adopt_reply->n_buffer_ids);
      rc = GPUMEM_E_DISCONNECTED;
    }
    bool all = false;
    if (!greeting && plan && rc == 0) {
      pthread_mutex_lock(&k->mu);
      all = ++k->answers == adopt_count(plan);
      pthread_mutex_unlock(&k->mu);
    }
    wire_env_free(env);
    if (all) go_live(k);
    return rc;
  }
  struct call *call = r->call;
  if (call->alloc && env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY) {
    /* Its waiter does not time out while the buffer is being built. */
    r->routing = true;
    pthread_mutex_unlock(&k->mu);
    build(k, call, env, f);
    pthread_mutex_lock(&k->mu);
    r->routing = false;
  }
  if (call->freeing && env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_FREE_REPLY)
    buffers_remove(k->buffers, call->freeing);
  call->reply = env;
  call->frame = *f;
  memset(f, 0, sizeof *f);
  r->done = true;
  pthread_cond_broadcast(&k->cv);
  pthread_mutex_unlock(&k->mu);
  return 0;
}

/* Route one frame: events are handled (and acked) here, errors outside
 * any request noted, answers go to their requests. By the token holder,
 * without mu. Returns the events handled, or the code to end the
 * connection with (why filled). */
static int route(conn *k, struct frame *f, char *why, size_t len) {
  wire_env *env = wire_unpack(f->data, f->len);
  char bad[256];
  if (!env) {
    snprintf(why, len, "malformed message from gpumemd");
    return GPUMEM_E_DISCONNECTED;
  }
  if (wire_check_reply(env, f->nfds, bad, sizeof bad)) {
    wire_env_free(env);
    snprintf(why, len, "from gpumemd: %s", bad);
    return GPUMEM_E_DISCONNECTED;
  }
  if (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_UNMAP ||
      env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_REMAP) {
    size_t n;
    uint8_t *ack = events_handle(k->events, env, f, &n);
    if (ack) chan_push(k->ch, ack, n, NULL, 0, true);
    free(ack);
    wire_env_free(env);
    /* An event moves buffers on: a refused free may go through now. */
    pthread_mutex_lock(&k->mu);
    for (struct list *p = k->queue.next; p != &k->queue; p = p->next)
      list_entry(p, struct request, link)->due_ms = 0;
    pthread_mutex_unlock(&k->mu);
    return 1;
  }
  if (env->id == 0 && env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) {
    const Gpumem__Wire__Error *e = env->error;
    pthread_mutex_lock(&k->mu);
    k->err.said = e->code ? e->code : GPUMEM__WIRE__ERROR_CODE__INTERNAL;
    k->err.said_gen = k->gen;
    snprintf(k->err.said_words, sizeof k->err.said_words, "%s", e->message ? e->message : "");
    pthread_mutex_unlock(&k->mu);
    bool ends = e->code == GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN;
    if (ends) snprintf(why, len, "gpumemd is shutting down: %s", e->message);
    wire_env_free(env);
    return ends ? GPUMEM_E_DISCONNECTED : 0;
  }
  return answer(k, env, f, why, len);
}

/* Read once and route every whole frame. By the token holder, without
 * mu. Returns the events handled, -EAGAIN when nothing was there, or
 * GPUMEM_E_DISCONNECTED when the connection ended. */
static int read_in(conn *k) {
  char why[320];
  ssize_t got = chan_fill(k->ch);
  if (got == -EAGAIN) return -EAGAIN;
  if (got == 0) {
    loop_end(k, GPUMEM_E_DISCONNECTED, "gpumemd closed the connection");
    return GPUMEM_E_DISCONNECTED;
  }
  if (got < 0) {
    snprintf(why, sizeof why, "read from gpumemd: %s", strerror((int)-got));
    loop_end(k, GPUMEM_E_DISCONNECTED, why);
    return GPUMEM_E_DISCONNECTED;
  }
  int handled = 0, rc;
  struct frame f;
  while ((rc = chan_next(k->ch, &f)) > 0) {
    int r = route(k, &f, why, sizeof why);
    frame_release(&f);
    if (r < 0) {
      loop_end(k, r, why);
      return GPUMEM_E_DISCONNECTED;
    }
    handled += r;
  }
  if (rc == 0) return handled;
  loop_end(k, GPUMEM_E_DISCONNECTED, "frame from gpumemd over the limit");
  return GPUMEM_E_DISCONNECTED;
}

/* A write failed (err, -errno): read what the daemon sent before it went,
 * so that its words (why it closed) are the connection's error rather
 * than the broken pipe, then end the connection. By the token holder,
 * without mu. */
static void write_failed(conn *k, int err) {
  int rc;
  while ((rc = read_in(k)) >= 0) continue;
  if (rc == GPUMEM_E_DISCONNECTED) return; /* read to its end: ended there */
  char why[320];
  snprintf(why, sizeof why, "send to gpumemd: %s", strerror(-err));
  loop_end(k, GPUMEM_E_DISCONNECTED, why);
}

/* The connection ended (or an attempt failed): record its error, fail
 * every request waiting on it, forget which buffers the daemon knew (and
 * destroy those whose free the library finished: the daemon freed them
 * with the session), and decide when to try again. By the token holder,
 * without mu. */
void loop_end(conn *k, int code, const char *why) {
  struct list settled;
  list_init(&settled);
  pthread_mutex_lock(&k->mu);
  bool was_live = k->state == CONN_LIVE;
  struct conn_error *e = &k->err;
  bool said = e->said && e->said_gen == k->gen && k->fd >= 0;
  int hook_code = said && e->said == GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN
                      ? GPUMEM_E_SHUTTING_DOWN
                      : GPUMEM_E_DISCONNECTED;
  if (!e->set) {
    e->set = true;
    e->code = code;
    if (said && code == GPUMEM_E_DISCONNECTED && k->state == CONN_GREETING) {
      /* A daemon that refuses a session says why before it closes. */
      if (k->first) e->code = error_from_wire(e->said);
      snprintf(e->words, sizeof e->words, "gpumemd refused the session: %s: %.260s",
               wire_code_name(e->said), e->said_words);
    } else if (said && code == GPUMEM_E_DISCONNECTED &&
               e->said == GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN) {
      snprintf(e->words, sizeof e->words, "SHUTTING_DOWN: %.280s", e->said_words);
    } else if (said && code == GPUMEM_E_DISCONNECTED) {
      snprintf(e->words, sizeof e->words, "gpumemd ended the connection: %s: %.240s",
               wire_code_name(e->said), e->said_words);
    } else {
      snprintf(e->words, sizeof e->words, "%s", why);
    }
  }
  chan_close(k->ch);
  k->fd = -1;
  struct list *lists[2] = {&k->queue, &k->sent};
  for (int i = 0; i < 2; i++) {
    struct list *p, *t;
    list_for_each_safe(p, t, lists[i]) {
      struct request *r = list_entry(p, struct request, link);
      list_remove(&r->link);
      if (r->kind == REQ_CALL) {
        r->done = true;
        r->err = GPUMEM_E_DISCONNECTED;
      } else if (r->kind == REQ_FREE) {
        list_append(&settled, &r->link);
      } else {
        loop_request_free(r);
      }
    }
  }
  adopt_destroy(k->plan);
  k->plan = NULL;
  buffers_unknow_all(k->buffers);
  k->state = k->closing || k->first || (k->flags & GPUMEM_CONNECT_NO_RECONNECT) ? CONN_CLOSED
                                                                               : CONN_DOWN;
  if (was_live) k->backoff_ms = BACKOFF_FIRST_MS;
  k->retry_at = clock_ms() + k->backoff_ms;
  if (!was_live) k->backoff_ms = loop_backoff_next(k->backoff_ms);
  k->free_backoff_ms = BACKOFF_FIRST_MS;
  gpumem_conn_hook hook = was_live && !k->closing ? k->hook : NULL;
  void *user = k->hook_user;
  char words[400];
  snprintf(words, sizeof words, "%s%s", e->words, k->state == CONN_DOWN ? "; reconnecting" : "");
  pthread_cond_broadcast(&k->cv);
  pthread_mutex_unlock(&k->mu);
  while (!list_empty(&settled)) {
    struct request *r = list_entry(settled.next, struct request, link);
    list_remove(&r->link);
    buffers_remove(k->buffers, r->buf);
    buffer_destroy(r->buf);
    loop_request_free(r);
  }
  if (hook) hook(k->client, GPUMEM_CONN_LOST, hook_code, words, 0, user);
}

/* One attempt to connect: open the socket and queue the Hello. By the
 * token holder, without mu. */
void loop_attempt(conn *k) {
  int rc = chan_open(k->ch, k->path);
  if (rc < 0) {
    char why[320];
    snprintf(why, sizeof why, "%s", gpumem_last_error());
    loop_end(k, rc, why);
    return;
  }
  Gpumem__Wire__Hello h;
  hello_request(&h, k->role, k->name, k->flags);
  wire_env req = wire_envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_HELLO, &h);
  pthread_mutex_lock(&k->mu);
  k->gen++;
  k->fd = chan_fd(k->ch);
  k->state = CONN_GREETING;
  k->greet_until = clock_ms() + k->timeout_ms;
  req.id = k->next_id++;
  size_t len;
  uint8_t *bytes = wire_pack(&req, &len);
  bool queued = bytes && enqueue(k, REQ_HELLO, req.id, bytes, len, NULL, 0);
  pthread_mutex_unlock(&k->mu);
  if (!queued) loop_end(k, GPUMEM_E_NOMEM, "out of memory");
}

/* One turn of the loop (see the top of this file), waiting until until_ms
 * at the latest (-1: no limit); a down connection is tried again only
 * when may_attempt. By the token holder, without mu. Returns the events
 * handled, -EAGAIN when nothing was read, or GPUMEM_E_DISCONNECTED when
 * the connection is not up (or ended in this turn). */
int loop_turn(conn *k, double until_ms, bool may_attempt) {
  pthread_mutex_lock(&k->mu);
  if (k->closing || k->state == CONN_CLOSED) {
    pthread_mutex_unlock(&k->mu);
    return GPUMEM_E_DISCONNECTED;
  }
  if (k->state == CONN_DOWN) {
    double at = until_ms >= 0 && until_ms < k->retry_at ? until_ms : k->retry_at;
    while (may_attempt && !k->closing && clock_ms() < at) clock_cond_wait_until(&k->cv, &k->mu, at);
    bool due = may_attempt && !k->closing && clock_ms() >= k->retry_at;
    pthread_mutex_unlock(&k->mu);
    if (due) loop_attempt(k);
    return GPUMEM_E_DISCONNECTED;
  }
  int rc = write_out(k);
  if (rc < 0) {
    pthread_mutex_unlock(&k->mu);
    write_failed(k, rc);
    return GPUMEM_E_DISCONNECTED;
  }
  /* Wake for the next deadline: a stalled ack, a free's back-off, the
   * greeting's answer. */
  double wake = until_ms, stalled = chan_stalled_since(k->ch);
  double at[3] = {stalled ? stalled + k->timeout_ms : -1, -1,
                  k->state == CONN_LIVE ? -1 : k->greet_until};
  for (struct list *p = k->queue.next; p != &k->queue; p = p->next) {
    struct request *r = list_entry(p, struct request, link);
    if (r->kind == REQ_FREE && (at[1] < 0 || r->due_ms < at[1])) at[1] = r->due_ms;
  }
  for (int i = 0; i < 3; i++)
    if (at[i] >= 0 && (wake < 0 || at[i] < wake)) wake = at[i];
  k->polling = true;
  uint64_t gen = k->gen;
  unsigned timeout_ms = k->timeout_ms;
  pthread_mutex_unlock(&k->mu);
  int ready = chan_wait(k->ch, clock_poll_ms(wake));
  pthread_mutex_lock(&k->mu);
  k->polling = false;
  pthread_mutex_unlock(&k->mu);
  char why[320];
  if (ready < 0) {
    snprintf(why, sizeof why, "poll: %s", strerror(-ready));
    loop_end(k, GPUMEM_E_DISCONNECTED, why);
    return GPUMEM_E_DISCONNECTED;
  }
  int handled = ready & CHAN_READABLE ? read_in(k) : -EAGAIN;
  if (handled == GPUMEM_E_DISCONNECTED) return handled;
  pthread_mutex_lock(&k->mu);
  rc = k->gen == gen ? write_out(k) : 0;
  double now = clock_ms();
  stalled = chan_stalled_since(k->ch);
  bool late = k->gen == gen && k->state != CONN_LIVE && now >= k->greet_until;
  bool greeting = k->state == CONN_GREETING;
  pthread_mutex_unlock(&k->mu);
  if (rc < 0) {
    write_failed(k, rc);
    return GPUMEM_E_DISCONNECTED;
  }
  if (stalled && now - stalled >= timeout_ms) {
    snprintf(why, sizeof why, "gpumemd read nothing for %.1f s; the connection is dropped",
             timeout_ms / 1e3);
    loop_end(k, GPUMEM_E_DISCONNECTED, why);
    return GPUMEM_E_DISCONNECTED;
  }
  if (late) {
    snprintf(why, sizeof why, "%sgpumemd did not answer in %.1f s",
             greeting ? "" : "re-registering buffers: ", timeout_ms / 1e3);
    loop_end(k, greeting ? GPUMEM_E_TIMEOUT : GPUMEM_E_DISCONNECTED, why);
    return GPUMEM_E_DISCONNECTED;
  }
  return handled;
}

/* Take the token (waiting while someone else holds it). Called with mu
 * held. */
void loop_take(conn *k) {
  while (k->stepping) pthread_cond_wait(&k->cv, &k->mu);
  k->stepping = true;
  k->stepper = pthread_self();
}

/* Give the token back. Called with mu held. */
void loop_give(conn *k) {
  k->stepping = false;
  pthread_cond_broadcast(&k->cv);
}

