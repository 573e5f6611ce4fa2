/* The connection as its users see it: the first connection, the
 * background thread, gpumem_dispatch, requests and the waits for their
 * answers, and the end. The loop itself is loop.c. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "error.h"
#include "loop.h"

/* Make a connection. */
conn *conn_create(const struct conn_parts *p) {
  conn *k = calloc(1, sizeof *k);
  if (!k) return NULL;
  k->ch = chan_create();
  k->path = strdup(p->path);
  k->name = strdup(p->name);
  if (!k->ch || !k->path || !k->name) {
    chan_destroy(k->ch);
    free(k->path);
    free(k->name);
    free(k);
    return NULL;
  }
  pthread_mutex_init(&k->mu, NULL);
  clock_cond_init(&k->cv);
  k->client = p->client;
  k->buffers = p->buffers;
  k->hello = p->hello;
  k->events = p->events;
  k->role = p->role;
  k->flags = p->flags;
  k->state = CONN_DOWN;
  k->fd = -1;
  k->next_id = 1;
  k->timeout_ms = GPUMEM_DEFAULT_REQUEST_TIMEOUT_MS;
  k->backoff_ms = k->free_backoff_ms = BACKOFF_FIRST_MS;
  list_init(&k->queue);
  list_init(&k->sent);
  return k;
}

/* Free a stopped connection. */
void conn_destroy(conn *k) {
  if (!k) return;
  chan_destroy(k->ch);
  adopt_destroy(k->plan);
  pthread_mutex_destroy(&k->mu);
  pthread_cond_destroy(&k->cv);
  free(k->path);
  free(k->name);
  free(k);
}

/* Connect and greet for the first time. */
int conn_start(conn *k) {
  pthread_mutex_lock(&k->mu);
  loop_take(k);
  k->first = true;
  pthread_mutex_unlock(&k->mu);
  loop_attempt(k);
  for (;;) {
    pthread_mutex_lock(&k->mu);
    bool greeting = k->state == CONN_GREETING || k->state == CONN_ADOPTING;
    pthread_mutex_unlock(&k->mu);
    if (!greeting) break;
    loop_turn(k, -1, false);
  }
  pthread_mutex_lock(&k->mu);
  loop_give(k);
  int rc = k->state == CONN_LIVE ? 0 : k->err.code ? k->err.code : GPUMEM_E_DISCONNECTED;
  char words[320];
  snprintf(words, sizeof words, "%s", k->err.words);
  pthread_mutex_unlock(&k->mu);
  return rc < 0 ? error_set(rc, "%s", words) : 0;
}

/* The background thread: hold the token and turn until closed. */
void conn_run(conn *k) {
  pthread_mutex_lock(&k->mu);
  loop_take(k);
  while (!k->closing && k->state != CONN_CLOSED) {
    pthread_mutex_unlock(&k->mu);
    loop_turn(k, -1, true);
    pthread_mutex_lock(&k->mu);
  }
  loop_give(k);
  pthread_mutex_unlock(&k->mu);
}

/* Fail a call while the connection is not live, with its sticky error.
 * Called with mu held. */
static int not_live(conn *k) {
  if (k->state == CONN_CLOSED || k->closing)
    return error_set(GPUMEM_E_DISCONNECTED, "the connection to gpumemd is gone: %s",
                     k->err.words);
  return error_set(GPUMEM_E_DISCONNECTED, "reconnecting to gpumemd (%s)", k->err.words);
}

/* Step the loop for a client without a thread: while down, make the next
 * attempt once its back-off has passed (waiting at most timeout_ms for
 * it) and see the greeting and re-registration through; while live,
 * handle what comes within timeout_ms (-1: until something does). */
int conn_dispatch(conn *k, int timeout_ms) {
  double until = timeout_ms < 0 ? -1 : clock_ms() + timeout_ms;
  pthread_mutex_lock(&k->mu);
  if (k->stepping && pthread_equal(k->stepper, pthread_self())) {
    pthread_mutex_unlock(&k->mu);
    return error_set(GPUMEM_E_INVALID, "a hook may not call gpumem_dispatch");
  }
  loop_take(k);
  int rc;
  if (k->closing || k->state == CONN_CLOSED) {
    rc = not_live(k);
  } else if (k->state != CONN_LIVE) {
    pthread_mutex_unlock(&k->mu);
    loop_turn(k, until, true);
    pthread_mutex_lock(&k->mu);
    while (k->state == CONN_GREETING || k->state == CONN_ADOPTING) {
      pthread_mutex_unlock(&k->mu);
      loop_turn(k, -1, false);
      pthread_mutex_lock(&k->mu);
    }
    rc = k->state == CONN_LIVE ? 0 : not_live(k);
  } else {
    do {
      pthread_mutex_unlock(&k->mu);
      rc = loop_turn(k, until, false);
      pthread_mutex_lock(&k->mu);
    } while (rc == -EAGAIN && k->state == CONN_LIVE && (until < 0 || clock_ms() < until));
    if (k->state != CONN_LIVE)
      rc = error_set(GPUMEM_E_DISCONNECTED, "%s", k->err.words);
    else if (rc < 0)
      rc = 0;
  }
  loop_give(k);
  pthread_mutex_unlock(&k->mu);
  return rc;
}

/* Send a request and wait for its answer, stepping the loop meanwhile
 * when nobody else does (a client without a thread). */
int conn_call(conn *k, wire_env *req, struct call *call) {
  call->reply = NULL;
  memset(&call->frame, 0, sizeof call->frame);
  call->built = NULL;
  call->built_rc = 0;
  pthread_mutex_lock(&k->mu);
  int rc = 0;
  struct request *r = NULL;
  if (k->stepping && pthread_equal(k->stepper, pthread_self()))
    rc = error_set(GPUMEM_E_INVALID, "a hook may not call gpumem functions that talk to gpumemd");
  else if (k->state != CONN_LIVE || k->closing)
    rc = not_live(k);
  else if (call->freeing && !gpumem_buffer_registered(call->freeing))
    rc = error_set(GPUMEM_E_NOT_FOUND, "buffer not registered with gpumemd");
  else if (!(r = calloc(1, sizeof *r)))
    rc = error_set(GPUMEM_E_NOMEM, "out of memory");
  if (rc == 0) {
    r->kind = REQ_CALL;
    r->call = call;
    r->id = req->id = k->next_id++;
    /* Read the id here: a reconnection renumbers buffers. */
    if (call->freeing) req->free->buffer_id = gpumem_buffer_id(call->freeing);
    if (call->nsend_fds && (r->fds = malloc(call->nsend_fds * sizeof *r->fds))) {
      memcpy(r->fds, call->send_fds, call->nsend_fds * sizeof *r->fds);
      r->nfds = call->nsend_fds;
    }
    if ((call->nsend_fds && !r->fds) || !(r->bytes = wire_pack(req, &r->len))) {
      free(r->fds);
      free(r);
      rc = error_set(GPUMEM_E_NOMEM, "out of memory");
    }
  }
  if (rc < 0) {
    pthread_mutex_unlock(&k->mu);
    for (size_t i = 0; i < call->nsend_fds; i++) close(call->send_fds[i]);
    return rc;
  }
  double wait_ms = (double)k->timeout_ms + call->extra_ms;
  double until = clock_ms() + wait_ms;
  list_append(&k->queue, &r->link);
  if (k->polling) chan_wake(k->ch);
  /* An answer being built is waited for: that is local work. */
  while (!r->done && (r->routing || (!k->closing && clock_ms() < until))) {
    if (k->stepping) {
      if (r->routing)
        pthread_cond_wait(&k->cv, &k->mu);
      else
        clock_cond_wait_until(&k->cv, &k->mu, until);
      continue;
    }
    loop_take(k);
    pthread_mutex_unlock(&k->mu);
    loop_turn(k, until, false);
    pthread_mutex_lock(&k->mu);
    loop_give(k);
  }
  if (r->done) {
    int err = r->err;
    loop_request_free(r);
    if (err == GPUMEM_E_DISCONNECTED)
      rc = error_set(err, "%s", k->err.words);
    else if (err)
      rc = error_set(err, "out of memory");
    pthread_mutex_unlock(&k->mu);
    if (rc < 0) return rc;
    const wire_env *env = call->reply;
    if (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR)
      return error_set(error_from_wire(env->error->code), "%s: %s",
                       wire_code_name(env->error->code), env->error->message);
    return 0;
  }
  /* No answer in time: it is dropped when it comes; the library takes
   * over a free, releasing the buffer once the daemon frees it. */
  bool sent = r->sent;
  const char *also = "";
  list_remove(&r->link);
  if (k->closing) {
    rc = error_set(GPUMEM_E_DISCONNECTED, "the connection to gpumemd is gone: disconnecting");
    loop_request_free(r);
    pthread_mutex_unlock(&k->mu);
    return rc;
  }
  if (call->freeing) {
    r->kind = REQ_FREE;
    r->call = NULL;
    r->buf = call->freeing;
    r->due_ms = 0;
    free(r->bytes);
    r->bytes = NULL;
    buffer_doom(r->buf);
    list_append(sent ? &k->sent : &k->queue, &r->link);
    if (!sent && k->polling) chan_wake(k->ch);
    r = NULL;
    also = "; the library releases the buffer once gpumemd frees it";
  }
  if (sent)
    rc = error_set(GPUMEM_E_TIMEOUT, "gpumemd did not answer in %.1f s%s", wait_ms / 1e3, also);
  else
    rc = error_set(GPUMEM_E_TIMEOUT,
                   "gpumemd did not read the request in %.1f s (it has not read earlier "
                   "messages)%s", wait_ms / 1e3, also);
  if (r) loop_request_free(r);
  pthread_mutex_unlock(&k->mu);
  return rc;
}

/* Free a call's answer. */
void conn_call_done(struct call *call) {
  wire_env_free(call->reply);
  call->reply = NULL;
  frame_release(&call->frame);
}

/* Take over the free of a buffer the daemon refused to free now. */
void conn_free_later(conn *k, gpumem_buffer *b) {
  pthread_mutex_lock(&k->mu);
  bool known = gpumem_buffer_registered(b);
  struct request *r = k->state == CONN_LIVE && known ? calloc(1, sizeof *r) : NULL;
  if (r) {
    r->kind = REQ_FREE;
    r->buf = b;
    r->due_ms = clock_ms() + k->free_backoff_ms;
    k->free_backoff_ms = loop_backoff_next(k->free_backoff_ms);
    list_append(&k->queue, &r->link);
    if (k->polling) chan_wake(k->ch);
    buffer_doom(b);
  }
  pthread_mutex_unlock(&k->mu);
  /* Off a live connection the daemon has freed it with the session. */
  if (!r && !known) {
    buffers_remove(k->buffers, b);
    buffer_destroy(b);
  }
}

/* True while live. */
bool conn_live(conn *k) {
  pthread_mutex_lock(&k->mu);
  bool live = k->state == CONN_LIVE;
  pthread_mutex_unlock(&k->mu);
  return live;
}

/* The socket. */
int conn_fd(conn *k) {
  pthread_mutex_lock(&k->mu);
  int fd = k->fd;
  pthread_mutex_unlock(&k->mu);
  return fd;
}

/* Set the request timeout. */
void conn_set_timeout(conn *k, unsigned ms) {
  pthread_mutex_lock(&k->mu);
  k->timeout_ms = ms ? ms : GPUMEM_DEFAULT_REQUEST_TIMEOUT_MS;
  pthread_mutex_unlock(&k->mu);
}

/* Set the connection hook. */
void conn_set_hook(conn *k, gpumem_conn_hook hook, void *user) {
  pthread_mutex_lock(&k->mu);
  k->hook = hook;
  k->hook_user = user;
  pthread_mutex_unlock(&k->mu);
}

/* The daemon's last error outside any request. */
int conn_daemon_error(conn *k, char *buf, size_t len) {
  pthread_mutex_lock(&k->mu);
  wire_code code = k->err.said;
  if (buf && len)
    snprintf(buf, len, "%s%s%s", code ? wire_code_name(code) : "", code ? ": " : "",
             code ? k->err.said_words : "");
  pthread_mutex_unlock(&k->mu);
  return code ? error_from_wire(code) : 0;
}

/* Close for good. */
void conn_stop(conn *k) {
  pthread_mutex_lock(&k->mu);
  k->closing = true;
  pthread_cond_broadcast(&k->cv);
  if (k->polling) chan_wake(k->ch);
  loop_take(k); /* the thread (or a stepping caller) lets go of it */
  bool open = k->state != CONN_CLOSED && k->state != CONN_DOWN;
  pthread_mutex_unlock(&k->mu);
  if (open) loop_end(k, GPUMEM_E_DISCONNECTED, "disconnecting");
  pthread_mutex_lock(&k->mu);
  k->state = CONN_CLOSED;
  loop_give(k);
  pthread_mutex_unlock(&k->mu);
}
