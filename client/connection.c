/* The connection to the daemon: requests and their replies, the reading
 * of the socket (by the background thread or by callers), and reconnection
 * with re-registration of every buffer when the daemon restarts. */
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "client.h"
#include "clock.h"

#define BACKOFF_FIRST_MS 10
#define BACKOFF_MAX_MS 1000

/* Wait on the client's condition until the monotonic time at_ms at the
 * latest. Called with mu held. */
static void wait_until(gpumem_client *c, double at_ms) {
  clock_cond_wait_until(&c->cv, &c->mu, at_ms);
}

/* Add a buffer to the client's list of every buffer. Called with mu held. */
static void buffer_link(gpumem_client *c, gpumem_buffer *b) {
  b->prev = NULL;
  b->next = c->all;
  if (c->all) c->all->prev = b;
  c->all = b;
}

/* Take a buffer out of the list and the id map (if it is there). Called
 * with mu held; doing it twice is harmless. */
void client_buffer_forget(gpumem_client *c, gpumem_buffer *b) {
  if (b->registered && idmap_get(c->buffers, b->id) == b) idmap_del(c->buffers, b->id);
  __atomic_store_n(&b->registered, false, __ATOMIC_RELAXED);
  if (b->prev) b->prev->next = b->next;
  else if (c->all == b) c->all = b->next;
  if (b->next) b->next->prev = b->prev;
  b->prev = b->next = NULL;
}

/* Record a buffer as known to the daemon under its id and in the list.
 * Called with mu held. */
int client_buffer_register(gpumem_client *c, gpumem_buffer *b) {
  if (idmap_put(c->buffers, b->id, b) < 0) return -ENOMEM;
  __atomic_store_n(&b->registered, true, __ATOMIC_RELAXED);
  if (!b->prev && c->all != b) buffer_link(c, b);
  return 0;
}

/* Lock the send mutex, giving up at the monotonic time until_ms (turned
 * into the real-time clock that pthread_mutex_timedlock takes). Returns 0
 * or ETIMEDOUT. */
static int send_lock(gpumem_client *c, double until_ms) {
  if (pthread_mutex_trylock(&c->send_mu) == 0) return 0;
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  double left = until_ms - clock_ms();
  double at = (double)now.tv_sec * 1e3 + (double)now.tv_nsec / 1e6 + (left > 0 ? left : 0);
  struct timespec ts;
  ts.tv_sec = (time_t)(at / 1e3);
  ts.tv_nsec = (long)((at - (double)ts.tv_sec * 1e3) * 1e6);
  if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
  if (ts.tv_nsec < 0) ts.tv_nsec = 0;
  int rc;
  while ((rc = pthread_mutex_timedlock(&c->send_mu, &ts)) == EINTR) continue;
  return rc == 0 ? 0 : ETIMEDOUT;
}

/* Send what the writer holds, waiting for room until the monotonic time
 * until_ms. Called with send_mu held and a connection open. Returns 0 when
 * all went, -ETIMEDOUT when the socket stayed full, another -errno. */
static int drain(gpumem_client *c, double until_ms) {
  int rc;
  while ((rc = frame_writer_flush(c->writer, c->fd)) == -EAGAIN) {
    double left = until_ms - clock_ms();
    if (left <= 0) return -ETIMEDOUT;
    struct pollfd p = {c->fd, POLLOUT, 0};
    if (poll(&p, 1, left > 1e9 ? 1000000000 : (int)left + 1) < 0 && errno != EINTR)
      return -errno;
  }
  return rc;
}

/* Send one message with fds (consumed) on connection gen (0: the current
 * one). A request passes its deadline (until_ms >= 0, monotonic): it is
 * not queued behind bytes the daemon has not read by then (GPUMEM_E_TIMEOUT,
 * nothing sent), and once queued it counts as sent even if part of it
 * still waits for room (the next send pushes the rest). Other messages
 * (acks, until_ms < 0) wait up to the request timeout for room; a daemon
 * that reads nothing for that long has its connection dropped. */
int client_send_fds(gpumem_client *c, uint64_t gen, const wire_env *env, const int *fds,
                    size_t nfds, double until_ms) {
  bool request = until_ms >= 0;
  pthread_mutex_lock(&c->mu);
  double limit_ms = c->request_timeout_ms;
  pthread_mutex_unlock(&c->mu);
  if (!request) until_ms = clock_ms() + limit_ms;
  size_t len;
  uint8_t *bytes = wire_pack(env, &len);
  if (!bytes || send_lock(c, until_ms) != 0) {
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    if (!bytes) return error_set(GPUMEM_E_NOMEM, "out of memory");
    free(bytes);
    if (request)
      return error_set(GPUMEM_E_TIMEOUT,
                         "gpumemd did not take the request in time: another message is "
                         "still waiting for it to read");
    /* Whoever holds the lock waits for a daemon that does not read. */
    pthread_mutex_lock(&c->mu);
    if (c->fd >= 0 && (!gen || gen == c->gen)) shutdown(c->fd, SHUT_RDWR);
    pthread_mutex_unlock(&c->mu);
    return error_set(GPUMEM_E_DISCONNECTED,
                       "gpumemd read nothing for %.1f s; the connection is dropped",
                       limit_ms / 1e3);
  }
  int rc;
  bool stalled = false;
  if (c->fd < 0 || (gen && gen != c->gen)) {
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    rc = -ENOTCONN;
  } else if (request && frame_writer_queued(c->writer) &&
             (rc = drain(c, until_ms)) < 0) {
    /* Earlier messages are still unread: this one is not queued. */
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    stalled = rc == -ETIMEDOUT;
  } else {
    rc = frame_writer_push(c->writer, bytes, len, fds, nfds);
    if (rc == 0) rc = drain(c, until_ms);
    if (rc == -ETIMEDOUT && request) rc = 0; /* queued; the rest goes later */
    if (rc == -ETIMEDOUT) shutdown(c->fd, SHUT_RDWR);
  }
  /* A daemon that said why before it closed: give its words. */
  char said[320] = "";
  pthread_mutex_lock(&c->mu);
  if (rc < 0 && c->daemon_code && c->daemon_gen + 1 >= c->gen)
    snprintf(said, sizeof said, " (gpumemd said %s: %.260s)", wire_code_name(c->daemon_code),
             c->daemon_words);
  pthread_mutex_unlock(&c->mu);
  pthread_mutex_unlock(&c->send_mu);
  free(bytes);
  if (stalled)
    return error_set(GPUMEM_E_TIMEOUT,
                       "gpumemd did not take the request in time: it has not read earlier "
                       "messages");
  if (rc == -ETIMEDOUT)
    return error_set(GPUMEM_E_DISCONNECTED,
                       "gpumemd read nothing for %.1f s; the connection is dropped",
                       limit_ms / 1e3);
  if (rc < 0)
    return error_set(GPUMEM_E_DISCONNECTED, "send to gpumemd: %s%s", strerror(-rc), said);
  return 0;
}

/* Send a message without waiting (acks) on the current connection. */
int client_send(gpumem_client *c, const wire_env *env) {
  return client_send_fds(c, 0, env, NULL, 0, -1);
}

/* The connection ended (or a reconnection attempt failed): close it, fail
 * every request waiting on it, forget which buffers the daemon knew (and
 * destroy those whose free timed out: the daemon freed them with the
 * session), and decide whether to try again. Runs on the reading thread. */
static void conn_lost(gpumem_client *c, const char *why) {
  char words[320];
  pthread_mutex_lock(&c->send_mu);
  pthread_mutex_lock(&c->mu);
  bool was_live = c->state == CONN_LIVE;
  int code = GPUMEM_E_DISCONNECTED;
  if (c->daemon_code == GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN && c->daemon_gen == c->gen) {
    snprintf(words, sizeof words, "SHUTTING_DOWN: %.280s", c->daemon_words);
    code = error_from_wire(c->daemon_code);
  } else if (c->daemon_code && c->daemon_gen == c->gen) {
    snprintf(words, sizeof words, "gpumemd ended the connection: %s: %.240s",
             wire_code_name(c->daemon_code), c->daemon_words);
  } else {
    snprintf(words, sizeof words, "%s", why);
  }
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
  c->gen++;
  /* Partial frames of the old connection mean nothing on the next one. */
  frame_writer *w = frame_writer_create();
  frame_reader *r = frame_reader_create(WIRE_MAX_REPLY);
  if (w && r) {
    frame_writer_destroy(c->writer);
    frame_reader_destroy(c->reader);
    c->writer = w;
    c->reader = r;
  } else {
    frame_writer_destroy(w);
    frame_reader_destroy(r);
    c->closing = true; /* cannot reconnect without them */
  }
  for (struct pending *p = c->pending; p; p = p->next) {
    if (p->done) continue;
    p->done = true;
    p->err = GPUMEM_E_DISCONNECTED;
    snprintf(p->words, sizeof p->words, "%s", words);
  }
  for (gpumem_buffer *b = c->all; b; b = b->next) {
    if (b->registered && idmap_get(c->buffers, b->id) == b) idmap_del(c->buffers, b->id);
    __atomic_store_n(&b->registered, false, __ATOMIC_RELAXED);
  }
  struct late_free *late = c->late;
  c->late = NULL;
  c->late_waiting = 0;
  c->late_backoff_ms = BACKOFF_FIRST_MS;
  for (struct late_free *l = late; l; l = l->next) client_buffer_forget(c, l->buf);
  c->state = (c->closing || (c->flags & GPUMEM_CONNECT_NO_RECONNECT)) ? CONN_CLOSED
                                                                     : CONN_RECONNECTING;
  c->down_err = GPUMEM_E_DISCONNECTED;
  if (was_live) {
    snprintf(c->down_words, sizeof c->down_words, "%s", words);
    c->backoff_ms = BACKOFF_FIRST_MS;
  } else if (!c->down_words[0]) {
    snprintf(c->down_words, sizeof c->down_words, "%s", words);
  }
  c->retry_at_ms = clock_ms() + c->backoff_ms;
  if (!was_live) c->backoff_ms = c->backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS
                                                                    : c->backoff_ms * 2;
  gpumem_conn_hook hook = was_live && !c->closing ? c->conn_hook : NULL;
  void *user = c->conn_user;
  bool again = c->state == CONN_RECONNECTING;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  pthread_mutex_unlock(&c->send_mu);
  while (late) {
    struct late_free *next = late->next;
    client_buffer_destroy(c, late->buf);
    free(late);
    late = next;
  }
  if (hook) {
    char said[400];
    snprintf(said, sizeof said, "%s%s", words, again ? "; reconnecting" : "");
    hook(c, GPUMEM_CONN_LOST, code, said, 0, user);
  }
}

/* Record an error the daemon sent outside any request. Returns true when
 * it ends the connection (the daemon is shutting down). */
static bool note_daemon_error(gpumem_client *c, const Gpumem__Wire__Error *e) {
  pthread_mutex_lock(&c->mu);
  c->daemon_code = e->code ? e->code : GPUMEM__WIRE__ERROR_CODE__INTERNAL;
  c->daemon_gen = c->gen;
  snprintf(c->daemon_words, sizeof c->daemon_words, "%s", e->message ? e->message : "");
  pthread_mutex_unlock(&c->mu);
  return e->code == GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN;
}

/* Give an AdoptReply's new ids to the buffers of its request. Called with
 * mu held. */
static int adopt_apply(gpumem_client *c, struct adopt_ctx *a, const Gpumem__Wire__AdoptReply *r) {
  if (r->n_buffer_ids != a->n) return -EPROTO;
  for (size_t i = 0; i < a->n; i++) {
    gpumem_buffer *b = a->bufs[i];
    if (r->buffer_ids[i] == 0 || idmap_get(c->buffers, r->buffer_ids[i])) return -EPROTO;
    /* Atomic: gpumem_buffer_id may read it on another thread, unlocked. */
    __atomic_store_n(&b->id, r->buffer_ids[i], __ATOMIC_RELAXED);
    if (client_buffer_register(c, b) < 0) return -ENOMEM;
  }
  return 0;
}

/* A free the caller gave up on waits to be sent again, after the back-off.
 * Called with mu held. */
static void late_wait(gpumem_client *c, struct late_free *l) {
  l->id = 0;
  c->late_waiting++;
  c->late_at_ms = clock_ms() + c->late_backoff_ms;
  c->late_backoff_ms = c->late_backoff_ms * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS
                                                               : c->late_backoff_ms * 2;
  pthread_cond_broadcast(&c->cv);
}

/* Take over the free of a buffer the caller has given up: request id is
 * in flight for it, or (id 0) it waits to be sent. The buffer is doomed:
 * no longer the caller's, never re-registered. Called with mu held.
 * Returns false when out of memory (the buffer stays the client's). */
static bool late_add(gpumem_client *c, gpumem_buffer *b, uint64_t id) {
  struct late_free *l = malloc(sizeof *l);
  if (!l) return false;
  l->buf = b;
  l->next = c->late;
  c->late = l;
  b->doomed = true;
  addrmap_remove(&b->at); /* not the caller's any more */
  l->id = id;
  if (!id) late_wait(c, l);
  return true;
}

/* Finish the free of a buffer the daemon refused to free now, for a
 * caller that has given it up; done when the daemon frees it or the
 * connection ends. */
void client_free_later(gpumem_client *c, gpumem_buffer *b) {
  pthread_mutex_lock(&c->mu);
  bool registered = b->registered;
  bool taken = c->state == CONN_LIVE && registered && late_add(c, b, 0);
  pthread_mutex_unlock(&c->mu);
  /* Off a live connection the daemon has freed it with the session. */
  if (!taken && !registered) client_buffer_destroy(c, b);
}

/* Send again the frees that wait, when their back-off has passed (all
 * of them unless due_only). */
static void late_retry(gpumem_client *c, bool due_only) {
  pthread_mutex_lock(&c->mu);
  size_t n = c->late_waiting;
  if (c->state != CONN_LIVE || !n || (due_only && clock_ms() < c->late_at_ms)) {
    pthread_mutex_unlock(&c->mu);
    return;
  }
  uint64_t *ids = calloc(2 * n, sizeof *ids);
  size_t k = 0;
  for (struct late_free *l = c->late; ids && l && k < n; l = l->next) {
    if (l->id || !l->buf->registered) continue;
    l->id = c->next_id++;
    ids[2 * k] = l->id;
    ids[2 * k + 1] = l->buf->id;
    k++;
  }
  c->late_waiting -= k;
  uint64_t gen = c->gen;
  pthread_mutex_unlock(&c->mu);
  /* A send that fails ends the connection, which settles these frees. */
  for (size_t i = 0; i < k; i++) {
    Gpumem__Wire__FreeRequest fr = GPUMEM__WIRE__FREE_REQUEST__INIT;
    fr.buffer_id = ids[2 * i + 1];
    wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
    req.id = ids[2 * i];
    req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_FREE;
    req.free = &fr;
    client_send_fds(c, gen, &req, NULL, 0, -1);
  }
  free(ids);
}

/* Milliseconds until a waiting free is due (0: now), -1 if none waits. */
static int late_due_ms(gpumem_client *c) {
  pthread_mutex_lock(&c->mu);
  int ms = -1;
  if (c->state == CONN_LIVE && c->late_waiting) {
    double left = c->late_at_ms - clock_ms();
    ms = left <= 0 ? 0 : (int)left + 1;
  }
  pthread_mutex_unlock(&c->mu);
  return ms;
}

/* A reply whose caller stopped waiting. A free's buffer is destroyed when
 * the daemon freed it (or does not know it); a free it refused (the buffer
 * is being paused or resumed) is sent again later (late_retry). An
 * allocation's memory is given back; anything else is dropped. */
static void late_reply(gpumem_client *c, const wire_env *env) {
  pthread_mutex_lock(&c->mu);
  struct late_free **lp = &c->late;
  while (*lp && ((*lp)->id == 0 || (*lp)->id != env->id)) lp = &(*lp)->next;
  struct late_free *l = *lp;
  bool gone = l && (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_FREE_REPLY ||
                    (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR &&
                     env->error->code == GPUMEM__WIRE__ERROR_CODE__NOT_FOUND));
  if (gone) {
    *lp = l->next;
    client_buffer_forget(c, l->buf);
    c->late_backoff_ms = BACKOFF_FIRST_MS;
  } else if (l) {
    late_wait(c, l);
  }
  pthread_mutex_unlock(&c->mu);
  if (gone) {
    client_buffer_destroy(c, l->buf);
    free(l);
  }
  if (l) return;
  if (env->body_case != GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY) return;
  /* Its fds close with the frame; the daemon frees the rest. */
  Gpumem__Wire__FreeRequest fr = GPUMEM__WIRE__FREE_REQUEST__INIT;
  fr.buffer_id = env->alloc_reply->buffer_id;
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_FREE;
  req.free = &fr;
  pthread_mutex_lock(&c->mu);
  req.id = c->next_id++;
  pthread_mutex_unlock(&c->mu);
  client_send(c, &req);
}

/* Route one frame: events are handled here, replies go to their waiter
 * (after the work that must precede the next frame: building an
 * allocated buffer, renumbering adopted ones, forgetting a freed one).
 * Returns the number of events handled, or -1 with why filled when the
 * connection must end. */
static int route(gpumem_client *c, struct frame *f, char *why, size_t whylen) {
  wire_env *env = wire_unpack(f->data, f->len);
  char bad[256];
  if (!env) {
    snprintf(why, whylen, "malformed message from gpumemd");
    return -1;
  }
  if (wire_check_reply(env, f->nfds, bad, sizeof bad)) {
    wire_env_free(env);
    snprintf(why, whylen, "from gpumemd: %s", bad);
    return -1;
  }
  if (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_UNMAP ||
      env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_REMAP) {
    client_handle_event(c, env, f);
    wire_env_free(env);
    /* An event moves buffers on: a refused free may go through now. */
    late_retry(c, false);
    return 1;
  }
  if (env->id == 0 && env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) {
    bool ends = note_daemon_error(c, env->error);
    if (ends)
      snprintf(why, whylen, "gpumemd is shutting down: %s", env->error->message);
    wire_env_free(env);
    return ends ? -1 : 0;
  }
  int rc = 0;
  pthread_mutex_lock(&c->mu);
  struct pending *p = c->pending;
  while (p && p->id != env->id) p = p->next;
  if (!p || p->done) {
    pthread_mutex_unlock(&c->mu);
    late_reply(c, env);
    wire_env_free(env);
    return 0;
  }
  if (p->alloc && env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY) {
    /* The pending stays until done, which only this thread sets; its
     * waiter does not time out while the buffer is being built. */
    p->routing = true;
    pthread_mutex_unlock(&c->mu);
    client_alloc_built(c, p->alloc, env, f);
    pthread_mutex_lock(&c->mu);
    p->routing = false;
  }
  if (p->adopt && env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ADOPT_REPLY &&
      adopt_apply(c, p->adopt, env->adopt_reply) < 0) {
    snprintf(why, whylen, "gpumemd answered a re-registration with %zu ids for %zu buffers",
             env->adopt_reply->n_buffer_ids, p->adopt->n);
    rc = -1;
  }
  if (p->freeing && env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_FREE_REPLY)
    client_buffer_forget(c, p->freeing);
  p->env = env;
  p->frame = *f;
  memset(f, 0, sizeof *f);
  p->done = true;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* Wait up to timeout_ms for the socket, read, and route every whole frame.
 * Returns the number of events handled, or GPUMEM_E_DISCONNECTED when the
 * connection ended (conn_lost has run). Only the reading thread calls it. */
static int pump(gpumem_client *c, int timeout_ms) {
  char why[320];
  struct pollfd p = {c->fd, POLLIN, 0};
  int n = poll(&p, 1, timeout_ms);
  if (n < 0 && errno == EINTR) return 0;
  if (n == 0) return 0;
  if (n < 0) {
    snprintf(why, sizeof why, "poll: %s", strerror(errno));
    goto lost;
  }
  ssize_t got = frame_reader_fill(c->reader, c->fd);
  if (got == -EAGAIN) return 0;
  if (got == 0) {
    snprintf(why, sizeof why, "gpumemd closed the connection");
    goto lost;
  }
  if (got < 0) {
    snprintf(why, sizeof why, "read from gpumemd: %s", strerror((int)-got));
    goto lost;
  }
  int events = 0, rc;
  struct frame f;
  while ((rc = frame_reader_next(c->reader, &f)) > 0) {
    int r = route(c, &f, why, sizeof why);
    frame_release(&f);
    if (r < 0) goto lost;
    events += r;
  }
  if (rc == 0) return events;
  snprintf(why, sizeof why, "frame from gpumemd over the limit");
lost:
  conn_lost(c, why);
  return error_set(GPUMEM_E_DISCONNECTED, "%s", why);
}

/* Read (and handle events) on behalf of whoever waits, until the
 * monotonic time until_ms at the latest (< 0: no limit), unless another
 * thread already reads: then wait for it. Called and returns with mu
 * held. */
static int pump_locked(gpumem_client *c, double until_ms) {
  if (c->threaded || c->reading) {
    if (until_ms < 0)
      pthread_cond_wait(&c->cv, &c->mu);
    else
      wait_until(c, until_ms);
    return 0;
  }
  int timeout_ms = -1;
  if (until_ms >= 0) {
    double left = until_ms - clock_ms();
    timeout_ms = left <= 0 ? 0 : left > 1e9 ? 1000000000 : (int)left + 1;
  }
  c->reading = true;
  pthread_mutex_unlock(&c->mu);
  int rc = pump(c, timeout_ms);
  pthread_mutex_lock(&c->mu);
  c->reading = false;
  pthread_cond_broadcast(&c->cv);
  return rc;
}

/* Put a request (zeroed but for its context) on the pending list with a
 * fresh id. Called with mu held. */
static void pending_add(gpumem_client *c, wire_env *req, struct pending *p) {
  req->id = p->id = c->next_id++;
  p->next = c->pending;
  c->pending = p;
}

/* Take a request off the pending list. Called with mu held. */
static void pending_del(gpumem_client *c, struct pending *p) {
  struct pending **pp = &c->pending;
  while (*pp && *pp != p) pp = &(*pp)->next;
  if (*pp) *pp = p->next;
}

/* The outcome of a finished request: 0, its Error's code, or why it got
 * no reply. */
static int pending_result(struct pending *p) {
  if (!p->env) return error_set(p->err ? p->err : GPUMEM_E_DISCONNECTED, "%s", p->words);
  if (p->env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) {
    const Gpumem__Wire__Error *e = p->env->error;
    return error_set(error_from_wire(e->code), "%s: %s", wire_code_name(e->code), e->message);
  }
  return 0;
}

/* A request got no reply in time (sent), or could not even be sent: its
 * reply will be dropped when it comes, and the library takes over a
 * free's buffer, freeing it when the daemon agrees (or the connection
 * ends). Called with mu held, the request off the pending list. */
static int call_timed_out(gpumem_client *c, struct pending *p, double wait_ms, bool sent) {
  const char *also = "";
  if (p->freeing) {
    if (late_add(c, p->freeing, sent ? p->id : 0))
      also = "; the library releases the buffer once gpumemd frees it";
    else
      also = "; the buffer stays until gpumem_disconnect (out of memory)";
  }
  if (!sent)
    return error_set(GPUMEM_E_TIMEOUT,
                       "gpumemd did not read the request in %.1f s (it has not read earlier "
                       "messages)%s", wait_ms / 1e3, also);
  return error_set(GPUMEM_E_TIMEOUT, "gpumemd did not answer in %.1f s%s", wait_ms / 1e3,
                     also);
}

/* Send a request and wait for its reply. */
int client_call(gpumem_client *c, wire_env *req, struct pending *reply) {
  memset(reply, 0, sizeof *reply);
  return client_call_with(c, req, reply);
}

/* Send a request whose pending carries a context, and wait for its reply.
 * Fails at once while the connection is down. */
int client_call_with(gpumem_client *c, wire_env *req, struct pending *reply) {
  pthread_mutex_lock(&c->mu);
  if (c->state != CONN_LIVE) {
    int err = c->down_err ? c->down_err : GPUMEM_E_DISCONNECTED;
    char words[320];
    snprintf(words, sizeof words, "%s", c->down_words);
    bool again = c->state == CONN_RECONNECTING;
    pthread_mutex_unlock(&c->mu);
    if (again) return error_set(err, "reconnecting to gpumemd (%s)", words);
    return error_set(err, "the connection to gpumemd is gone: %s", words);
  }
  pending_add(c, req, reply);
  if (reply->freeing) {
    /* Read the id here: a reconnection renumbers buffers. */
    if (!reply->freeing->registered) {
      pending_del(c, reply);
      pthread_mutex_unlock(&c->mu);
      return error_set(GPUMEM_E_NOT_FOUND, "buffer not registered with gpumemd");
    }
    req->free->buffer_id = reply->freeing->id;
  }
  uint64_t gen = c->gen;
  double wait_ms = (double)c->request_timeout_ms + reply->extra_ms;
  double until = clock_ms() + wait_ms;
  pthread_mutex_unlock(&c->mu);
  late_retry(c, true);
  int rc = client_send_fds(c, gen, req, NULL, 0, until);
  pthread_mutex_lock(&c->mu);
  /* A reply being built is waited for: that is local work. */
  while (rc == 0 && !reply->done && (reply->routing || clock_ms() < until))
    pump_locked(c, reply->routing ? -1 : until);
  pending_del(c, reply);
  if ((rc == 0 && !reply->done) || rc == GPUMEM_E_TIMEOUT)
    rc = call_timed_out(c, reply, wait_ms, rc == 0);
  pthread_mutex_unlock(&c->mu);
  if (rc < 0) {
    client_reply_free(reply);
    return rc;
  }
  return pending_result(reply);
}

/* Free a reply got from client_call. */
void client_reply_free(struct pending *reply) {
  wire_env_free(reply->env);
  reply->env = NULL;
  frame_release(&reply->frame);
}

/* As the reading thread: send requests (with their fds, consumed) and
 * read until each has its reply, the connection ended, or the request
 * timeout passed. Returns false when some got no reply in time (they fail
 * with GPUMEM_E_TIMEOUT). */
static bool reader_calls(gpumem_client *c, wire_env **reqs, struct pending **ps,
                         int *const *fds, const size_t *nfds, size_t n) {
  pthread_mutex_lock(&c->mu);
  for (size_t i = 0; i < n; i++) pending_add(c, reqs[i], ps[i]);
  uint64_t gen = c->gen;
  double wait_ms = c->request_timeout_ms;
  pthread_mutex_unlock(&c->mu);
  double until = clock_ms() + wait_ms;
  bool answered = true;
  bool sent = true;
  for (size_t i = 0; i < n; i++) {
    if (!sent) {
      for (size_t k = 0; k < nfds[i]; k++) close(fds[i][k]);
      continue;
    }
    if (client_send_fds(c, gen, reqs[i], fds ? fds[i] : NULL, nfds ? nfds[i] : 0, until) < 0)
      sent = false;
  }
  if (!sent) conn_lost(c, gpumem_last_error());
  for (;;) {
    pthread_mutex_lock(&c->mu);
    bool all = true;
    for (size_t i = 0; i < n; i++) all = all && ps[i]->done;
    pthread_mutex_unlock(&c->mu);
    if (all) break;
    double left = until - clock_ms();
    if (left <= 0) {
      answered = false;
      break;
    }
    pump(c, left > 1e9 ? 1000000000 : (int)left + 1);
  }
  pthread_mutex_lock(&c->mu);
  for (size_t i = 0; i < n; i++) {
    pending_del(c, ps[i]);
    if (ps[i]->done) continue;
    ps[i]->done = true;
    ps[i]->err = GPUMEM_E_TIMEOUT;
    snprintf(ps[i]->words, sizeof ps[i]->words, "gpumemd did not answer in %.1f s",
             wait_ms / 1e3);
  }
  pthread_mutex_unlock(&c->mu);
  return answered;
}

/* Open a connection to the socket at path. */
static int open_socket(const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof addr.sun_path)
    return error_set(GPUMEM_E_INVALID, "socket path too long: %s", path);
  strcpy(addr.sun_path, path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return error_set(GPUMEM_E_CONNECT, "socket: %s", strerror(errno));
  if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
    int e = errno;
    close(fd);
    return error_set(GPUMEM_E_CONNECT, "cannot connect to gpumemd at %s: %s", path,
                       strerror(e));
  }
  return fd;
}

/* Say hello and learn the devices; the first time also open the backend
 * for mapping, unless the client maps nothing (GPUMEM_CONNECT_NODE_DEVICES:
 * then it loads no GPU driver and numbers devices as the daemon does). As
 * the reading thread (or before there is one). */
static int greet(gpumem_client *c, bool first) {
  Gpumem__Wire__Hello h = GPUMEM__WIRE__HELLO__INIT;
  h.version_major = WIRE_VERSION_MAJOR;
  h.version_minor = WIRE_VERSION_MINOR;
  h.role = (Gpumem__Wire__Role)c->role;
  h.name = c->name;
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT, *reqs[1] = {&req};
  req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_HELLO;
  req.hello = &h;
  struct pending reply = {0}, *ps[1] = {&reply};
  reader_calls(c, reqs, ps, NULL, NULL, 1);
  int rc = pending_result(&reply);
  if (rc < 0 && !reply.env) {
    /* A daemon that refuses a session says why before it closes. */
    pthread_mutex_lock(&c->mu);
    int code = c->daemon_code;
    char words[320];
    snprintf(words, sizeof words, "%s", c->daemon_words);
    pthread_mutex_unlock(&c->mu);
    if (code)
      rc = error_set(first ? error_from_wire(code) : GPUMEM_E_DISCONNECTED,
                       "gpumemd refused the session: %s: %s", wire_code_name(code), words);
  }
  if (rc == 0 && reply.env->body_case != GPUMEM__WIRE__ENVELOPE__BODY_HELLO_REPLY)
    rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered Hello with something else");
  if (rc == 0) {
    const Gpumem__Wire__HelloReply *r = reply.env->hello_reply;
    if (first) {
      snprintf(c->backend, sizeof c->backend, "%s", r->backend);
      struct gpu_options opt = {.backend = c->backend, .client = true};
      char err[256] = "";
      if (!(c->flags & GPUMEM_CONNECT_NODE_DEVICES) && gpu_open(&opt, &c->gpu, err, sizeof err) < 0)
        rc = error_set(GPUMEM_E_BACKEND, "backend %s: %s", c->backend, err);
    } else if (c->gpu && strcmp(c->backend, r->backend) != 0) {
      rc = error_set(GPUMEM_E_BACKEND,
                       "gpumemd came back with backend %s; this process maps %s memory",
                       r->backend, c->backend);
    }
    /* Device numbers differ between processes (CUDA_VISIBLE_DEVICES), and
     * between daemons: the bus id says which of ours each device is. */
    pthread_mutex_lock(&c->mu);
    c->granularity = r->granularity;
    c->daemon_minor = r->version_minor;
    c->ndevices = (unsigned)r->n_devices;
    for (size_t i = 0; i < GPUMEM_MAX_DEVICES; i++) c->local_of[i] = -1;
    for (size_t i = 0; rc == 0 && i < r->n_devices && i < GPUMEM_MAX_DEVICES; i++)
      c->local_of[i] = c->gpu ? gpu_device_by_bus_id(c->gpu, r->devices[i]->bus_id) : (int)i;
    pthread_mutex_unlock(&c->mu);
  }
  client_reply_free(&reply);
  return rc;
}

/* The new daemon's index of a buffer's device, or -1. Called with mu held. */
static int daemon_index(const gpumem_client *c, unsigned local) {
  for (unsigned i = 0; i < c->ndevices && i < GPUMEM_MAX_DEVICES; i++)
    if (c->local_of[i] == (int)local) return (int)i;
  return -1;
}

/* One AdoptRequest being built: its buffers, their wire form and fds. */
struct adopt_batch {
  struct adopt_ctx ctx;
  Gpumem__Wire__AdoptBuffer *ab;
  Gpumem__Wire__AdoptBuffer **abp;
  Gpumem__Wire__AdoptRequest req;
  wire_env env;
  struct pending p;
  int fds[FRAME_MAX_FDS];
  size_t nfds, bytes;
};

/* Note a buffer left out of the re-registration; the first one's words
 * are kept. */
__attribute__((format(printf, 4, 5))) static void adopt_skip(size_t *skipped, char *words,
                                                             size_t len, const char *fmt, ...) {
  if ((*skipped)++ == 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(words, len, fmt, ap);
    va_end(ap);
  }
}

/* Re-register every buffer with the daemon that came back, in as many
 * AdoptRequests as the limits on fds and frame size need. Returns the
 * number re-registered; *skipped and words say what was not, *late
 * whether the daemon left some request unanswered in time. */
static size_t adopt_all(gpumem_client *c, size_t *skipped, char *words, size_t len,
                        bool *late) {
  *skipped = 0;
  *late = false;
  pthread_mutex_lock(&c->mu);
  size_t n = 0;
  for (gpumem_buffer *b = c->all; b; b = b->next) n++;
  gpumem_buffer **bufs = calloc(n + 1, sizeof *bufs);
  int *dev = calloc(n + 1, sizeof *dev);
  size_t k = 0;
  for (gpumem_buffer *b = c->all; bufs && dev && b; b = b->next) {
    unsigned long long id = (unsigned long long)b->id;
    int d = daemon_index(c, b->local);
    bool partial = false;
    for (size_t i = 0; i < b->nchunks; i++) partial = partial || (b->held[i] != b->mapped);
    if (b->doomed) continue;
    if (b->ipc)
      adopt_skip(skipped, words, len,
                 "buffer %llu is legacy IPC memory of the daemon that went away", id);
    else if (d < 0)
      adopt_skip(skipped, words, len, "buffer %llu: its device is not one gpumemd manages", id);
    else if (partial)
      adopt_skip(skipped, words, len, "buffer %llu is partly mapped after a failed unmap", id);
    else if (b->nchunks > FRAME_MAX_FDS)
      adopt_skip(skipped, words, len, "buffer %llu has more chunks than one frame carries", id);
    else {
      dev[k] = d;
      bufs[k++] = b;
    }
  }
  pthread_mutex_unlock(&c->mu);
  if (!bufs || !dev) {
    free(bufs);
    free(dev);
    *skipped = n;
    snprintf(words, len, "out of memory");
    return 0;
  }
  /* Export the mapped buffers' chunks first; one that fails stays out. */
  int **ef = calloc(k + 1, sizeof *ef);
  size_t kept = 0;
  for (size_t i = 0; ef && i < k; i++) {
    gpumem_buffer *b = bufs[i];
    if (b->mapped) {
      ef[i] = malloc(b->nchunks * sizeof **ef + 1);
      if (!ef[i] || client_buffer_export(c, b, ef[i]) < 0) {
        char why[320];
        snprintf(why, sizeof why, "%s", ef[i] ? gpumem_last_error() : "out of memory");
        free(ef[i]);
        ef[i] = NULL;
        if ((*skipped)++ == 0)
          snprintf(words, len, "buffer %llu: %.250s", (unsigned long long)b->id, why);
        continue;
      }
    }
    bufs[kept] = b;
    dev[kept] = dev[i];
    ef[kept++] = ef[i];
  }
  if (!ef) *skipped += k;
  k = kept;
  /* At most one batch per buffer. */
  struct adopt_batch *bs = calloc(k + 1, sizeof *bs);
  Gpumem__Wire__AdoptBuffer *abs = calloc(k + 1, sizeof *abs);
  Gpumem__Wire__AdoptBuffer **abp = calloc(k + 1, sizeof *abp);
  size_t nb = 0, adopted = 0;
  bool ok = bs && abs && abp;
  for (size_t i = 0; i < k; i++) {
    gpumem_buffer *b = bufs[i];
    size_t nf = b->mapped ? b->nchunks : 0;
    if (!ok) {
      for (size_t j = 0; j < nf; j++) close(ef[i][j]);
      free(ef[i]);
      continue;
    }
    Gpumem__Wire__AdoptBuffer *ab = &abs[i];
    gpumem__wire__adopt_buffer__init(ab);
    ab->tag = b->tag;
    ab->device = (uint32_t)dev[i];
    ab->size = b->size;
    ab->flags = b->flags;
    ab->chunk_sizes = b->chunk_sizes;
    ab->n_chunk_sizes = b->nchunks;
    ab->paused = !b->mapped;
    abp[i] = ab;
    size_t sz = gpumem__wire__adopt_buffer__get_packed_size(ab) + 16;
    struct adopt_batch *t = nb ? &bs[nb - 1] : NULL;
    if (!t || t->nfds + nf > FRAME_MAX_FDS || t->bytes + sz > WIRE_MAX_REQUEST - 256) {
      t = &bs[nb++];
      t->abp = &abp[i];
      t->ctx.bufs = &bufs[i];
    }
    if (nf) memcpy(t->fds + t->nfds, ef[i], nf * sizeof *ef[i]);
    free(ef[i]);
    t->ctx.n++;
    t->nfds += nf;
    t->bytes += sz;
  }
  free(ef);
  if (!ok) {
    *skipped += k;
    snprintf(words, len, "out of memory");
    nb = 0;
  }
  wire_env **reqs = calloc(nb + 1, sizeof *reqs);
  struct pending **ps = calloc(nb + 1, sizeof *ps);
  int **fds = calloc(nb + 1, sizeof *fds);
  size_t *nfds = calloc(nb + 1, sizeof *nfds);
  if (nb && (!reqs || !ps || !fds || !nfds)) {
    for (size_t i = 0; i < nb; i++)
      for (size_t j = 0; j < bs[i].nfds; j++) close(bs[i].fds[j]);
    *skipped += k;
    snprintf(words, len, "out of memory");
    nb = 0;
  }
  for (size_t i = 0; i < nb; i++) {
    struct adopt_batch *t = &bs[i];
    gpumem__wire__adopt_request__init(&t->req);
    t->req.buffers = t->abp;
    t->req.n_buffers = t->ctx.n;
    gpumem__wire__envelope__init(&t->env);
    t->env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ADOPT;
    t->env.adopt = &t->req;
    t->env.fd_count = (uint32_t)t->nfds;
    t->p.adopt = &t->ctx;
    reqs[i] = &t->env;
    ps[i] = &t->p;
    fds[i] = t->fds;
    nfds[i] = t->nfds;
  }
  if (nb) *late = !reader_calls(c, reqs, ps, fds, nfds, nb);
  for (size_t i = 0; i < nb; i++) {
    struct pending *p = &bs[i].p;
    if (p->env && p->env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ADOPT_REPLY) {
      adopted += bs[i].ctx.n;
    } else {
      int had = (int)*skipped;
      *skipped += bs[i].ctx.n;
      if (had == 0) {
        if (p->env && p->env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR)
          snprintf(words, len, "%zu buffers: %s: %s", bs[i].ctx.n,
                   wire_code_name(p->env->error->code), p->env->error->message);
        else
          snprintf(words, len, "%zu buffers: %s", bs[i].ctx.n,
                   p->env ? "gpumemd answered with something else" : p->words);
      }
    }
    client_reply_free(p);
  }
  free(reqs);
  free(ps);
  free(fds);
  free(nfds);
  free(bs);
  free(abs);
  free(abp);
  free(bufs);
  free(dev);
  return adopted;
}

/* One attempt to reconnect: connect, greet, re-register. As the reading
 * thread. Returns 0 when the connection is live again. */
static int reconnect(gpumem_client *c) {
  int fd = open_socket(c->path);
  if (fd < 0) {
    char why[320];
    snprintf(why, sizeof why, "%s", gpumem_last_error());
    conn_lost(c, why);
    return GPUMEM_E_DISCONNECTED;
  }
  pthread_mutex_lock(&c->send_mu);
  pthread_mutex_lock(&c->mu);
  bool closing = c->closing;
  if (!closing) {
    c->fd = fd;
    c->gen++;
  }
  pthread_mutex_unlock(&c->mu);
  pthread_mutex_unlock(&c->send_mu);
  if (closing) {
    close(fd);
    return GPUMEM_E_DISCONNECTED;
  }
  int rc = greet(c, false);
  if (rc < 0) {
    char why[320];
    snprintf(why, sizeof why, "%s", gpumem_last_error());
    pthread_mutex_lock(&c->mu);
    bool open = c->fd >= 0;
    pthread_mutex_unlock(&c->mu);
    if (open) conn_lost(c, why);
    return GPUMEM_E_DISCONNECTED;
  }
  size_t skipped = 0, adopted = 0;
  char words[320] = "";
  bool late = false;
  if (c->role == GPUMEM_ROLE_WORKER)
    adopted = adopt_all(c, &skipped, words, sizeof words, &late);
  if (late) {
    /* The daemon may yet adopt what it did not answer: start over. */
    char why[400];
    snprintf(why, sizeof why, "re-registering buffers: %s", words);
    pthread_mutex_lock(&c->mu);
    bool open = c->fd >= 0;
    pthread_mutex_unlock(&c->mu);
    if (open) conn_lost(c, why);
    return GPUMEM_E_DISCONNECTED;
  }
  pthread_mutex_lock(&c->mu);
  bool live = c->fd >= 0 && !c->closing;
  if (live) {
    c->state = CONN_LIVE;
    c->down_err = 0;
    c->down_words[0] = '\0';
    c->backoff_ms = BACKOFF_FIRST_MS;
  }
  gpumem_conn_hook hook = c->conn_hook;
  void *user = c->conn_user;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  if (!live) return GPUMEM_E_DISCONNECTED;
  if (hook) {
    char said[400];
    if (skipped)
      snprintf(said, sizeof said, "%zu buffers not re-registered: %s", skipped, words);
    else
      snprintf(said, sizeof said, "re-registered %zu buffers", adopted);
    hook(c, GPUMEM_CONN_RESTORED, skipped ? GPUMEM_E_DISCONNECTED : 0, said, adopted, user);
  }
  return 0;
}

/* The background thread: read and handle until the connection ends, then
 * reconnect with back-off, until gpumem_disconnect. */
static void *reader_main(void *arg) {
  gpumem_client *c = arg;
  for (;;) {
    pthread_mutex_lock(&c->mu);
    while (c->state == CONN_RECONNECTING && !c->closing && clock_ms() < c->retry_at_ms)
      wait_until(c, c->retry_at_ms);
    enum conn_state st = c->state;
    bool closing = c->closing;
    pthread_mutex_unlock(&c->mu);
    if (closing || st == CONN_CLOSED) return NULL;
    if (st == CONN_RECONNECTING) {
      reconnect(c);
    } else {
      pump(c, late_due_ms(c));
      late_retry(c, true);
    }
  }
}

/* Handle the daemon's events for applications with their own loop, and
 * reconnect for them when the daemon went away. */
int gpumem_dispatch(gpumem_client *c, int timeout_ms) {
  if (c->threaded)
    return error_set(GPUMEM_E_INVALID, "a background thread dispatches this client");
  pthread_mutex_lock(&c->mu);
  while (c->reading) pthread_cond_wait(&c->cv, &c->mu);
  int rc;
  if (c->state == CONN_CLOSED) {
    rc = error_set(c->down_err ? c->down_err : GPUMEM_E_DISCONNECTED,
                     "the connection to gpumemd is gone: %s", c->down_words);
  } else if (c->state == CONN_RECONNECTING) {
    double now = clock_ms();
    double until = c->retry_at_ms;
    if (timeout_ms >= 0 && now + timeout_ms < until) until = now + timeout_ms;
    while (!c->closing && clock_ms() < until) wait_until(c, until);
    if (c->closing || clock_ms() < c->retry_at_ms) {
      rc = error_set(GPUMEM_E_DISCONNECTED, "reconnecting to gpumemd (%s)", c->down_words);
    } else {
      c->reading = true;
      pthread_mutex_unlock(&c->mu);
      rc = reconnect(c);
      pthread_mutex_lock(&c->mu);
      c->reading = false;
      pthread_cond_broadcast(&c->cv);
      if (rc < 0)
        rc = error_set(GPUMEM_E_DISCONNECTED, "reconnecting to gpumemd (%s)",
                         c->down_words);
    }
  } else {
    rc = pump_locked(c, timeout_ms < 0 ? -1.0 : clock_ms() + timeout_ms);
  }
  pthread_mutex_unlock(&c->mu);
  if (rc >= 0) late_retry(c, true);
  return rc;
}

/* The connection's fd (-1 while reconnecting). */
int gpumem_fd(const gpumem_client *c) {
  gpumem_client *m = (gpumem_client *)c;
  pthread_mutex_lock(&m->mu);
  int fd = m->fd;
  pthread_mutex_unlock(&m->mu);
  return fd;
}

/* Release everything a client holds except its buffers. */
static void client_free(gpumem_client *c) {
  if (c->fd >= 0) close(c->fd);
  gpu_close(c->gpu);
  idmap_destroy(c->buffers);
  frame_writer_destroy(c->writer);
  frame_reader_destroy(c->reader);
  pthread_mutex_destroy(&c->mu);
  pthread_mutex_destroy(&c->send_mu);
  pthread_cond_destroy(&c->cv);
  while (c->late) {
    struct late_free *l = c->late;
    c->late = l->next;
    free(l);
  }
  free(c->path);
  free(c->name);
  free(c);
}

/* Connect, greet, and start the background thread. */
int gpumem_connect(const char *socket_path, const char *name, int role,
                   unsigned flags, gpumem_client **out) {
  if (role != GPUMEM_ROLE_WORKER && role != GPUMEM_ROLE_CONTROLLER)
    return error_set(GPUMEM_E_INVALID, "role must be worker or controller");
  if (name && strlen(name) > WIRE_NAME_MAX)
    return error_set(GPUMEM_E_INVALID, "name longer than %d bytes", WIRE_NAME_MAX);
  if (flags & ~(unsigned)(GPUMEM_CONNECT_NO_THREAD | GPUMEM_CONNECT_NO_RECONNECT |
                          GPUMEM_CONNECT_NODE_DEVICES))
    return error_set(GPUMEM_E_INVALID, "unknown connect flags 0x%x", flags);
  if (!socket_path || !*socket_path) socket_path = getenv("GPUMEM_SOCKET");
  if (!socket_path || !*socket_path) socket_path = GPUMEM_DEFAULT_SOCKET;
  gpumem_client *c = calloc(1, sizeof *c);
  if (!c) return error_set(GPUMEM_E_NOMEM, "out of memory");
  c->fd = -1;
  c->next_id = 1;
  c->gen = 1;
  c->role = role;
  c->flags = flags;
  c->backoff_ms = BACKOFF_FIRST_MS;
  c->late_backoff_ms = BACKOFF_FIRST_MS;
  c->request_timeout_ms = GPUMEM_DEFAULT_REQUEST_TIMEOUT_MS;
  addrmap_owner_init(&c->addrs, c);
  pthread_mutex_init(&c->mu, NULL);
  pthread_mutex_init(&c->send_mu, NULL);
  clock_cond_init(&c->cv);
  c->path = strdup(socket_path);
  c->name = strdup(name ? name : "");
  c->buffers = idmap_create();
  c->writer = frame_writer_create();
  c->reader = frame_reader_create(WIRE_MAX_REPLY);
  if (!c->path || !c->name || !c->buffers || !c->writer || !c->reader) {
    client_free(c);
    return error_set(GPUMEM_E_NOMEM, "out of memory");
  }
  int rc = c->fd = open_socket(socket_path);
  if (rc >= 0) rc = greet(c, true);
  if (rc >= 0 && !(flags & GPUMEM_CONNECT_NO_THREAD)) {
    c->threaded = true;
    if (pthread_create(&c->thread, NULL, reader_main, c) != 0) {
      c->threaded = false;
      rc = error_set(GPUMEM_E_NOMEM, "cannot start the event thread");
    }
  }
  if (rc < 0) {
    if (c->fd < 0) c->fd = -1;
    client_free(c);
    return rc;
  }
  *out = c;
  return 0;
}

/* Unmap everything, stop the thread (and any reconnecting), and close. */
void gpumem_disconnect(gpumem_client *c) {
  if (!c) return;
  client_default_forget(c);
  addrmap_forget(&c->addrs);
  pthread_mutex_lock(&c->mu);
  c->closing = true;
  if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR);
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  if (c->threaded) pthread_join(c->thread, NULL);
  client_pool_destroy(c);
  while (c->all) client_buffer_destroy(c, c->all);
  client_free(c);
}

/* Set how long requests wait for their replies. */
void gpumem_set_request_timeout(gpumem_client *c, unsigned ms) {
  pthread_mutex_lock(&c->mu);
  c->request_timeout_ms = ms ? ms : GPUMEM_DEFAULT_REQUEST_TIMEOUT_MS;
  pthread_mutex_unlock(&c->mu);
}

/* Set the hook told about lost and restored connections. */
void gpumem_set_connection_hook(gpumem_client *c, gpumem_conn_hook hook, void *user) {
  pthread_mutex_lock(&c->mu);
  c->conn_hook = hook;
  c->conn_user = user;
  pthread_mutex_unlock(&c->mu);
}

/* The daemon's last error outside a request. */
int gpumem_daemon_error(gpumem_client *c, char *buf, size_t len) {
  pthread_mutex_lock(&c->mu);
  int code = c->daemon_code;
  if (buf && len)
    snprintf(buf, len, "%s%s%s", code ? wire_code_name(code) : "", code ? ": " : "",
             code ? c->daemon_words : "");
  pthread_mutex_unlock(&c->mu);
  return code ? error_from_wire(code) : 0;
}

/* The daemon's backend. */
const char *gpumem_backend(const gpumem_client *c) { return c->backend; }

/* The allocation granularity (a daemon that came back may say another). */
uint64_t gpumem_granularity(const gpumem_client *c) {
  gpumem_client *m = (gpumem_client *)c;
  pthread_mutex_lock(&m->mu);
  uint64_t g = m->granularity;
  pthread_mutex_unlock(&m->mu);
  return g;
}

/* Copy the device map of the current connection. */
unsigned client_local_map(gpumem_client *c, int *map) {
  unsigned seen = 0;
  pthread_mutex_lock(&c->mu);
  for (unsigned i = 0; i < GPUMEM_MAX_DEVICES; i++) {
    map[i] = i < c->ndevices ? c->local_of[i] : -1;
    if (map[i] >= 0) seen++;
  }
  pthread_mutex_unlock(&c->mu);
  return seen;
}

/* This process's number of a daemon device. */
int client_local_device(const int *map, uint32_t node) {
  return node < GPUMEM_MAX_DEVICES ? map[node] : -1;
}

/* The daemon's number of one of this process's devices. */
int client_node_device(const int *map, int local) {
  for (int i = 0; local >= 0 && i < GPUMEM_MAX_DEVICES; i++)
    if (map[i] == local) return i;
  return -1;
}

/* The number of the daemon's devices this process sees. */
unsigned gpumem_device_count(const gpumem_client *c) {
  int map[GPUMEM_MAX_DEVICES];
  return client_local_map((gpumem_client *)c, map);
}
