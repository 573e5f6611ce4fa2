/* The connection to the daemon and the one loop that does its I/O.
 *
 * One I/O owner at a time reads and writes the socket: the background
 * thread (conn_run) for its whole life, or, for a client without one,
 * whoever steps the loop: gpumem_dispatch, or a caller waiting for its
 * reply. Callers queue requests and wait. Connecting, greeting,
 * re-registering buffers after a restart, live and down are states of
 * that loop; frees the library finishes for callers are ordinary queued
 * requests of its own. Each connection keeps one sticky error: the first
 * fatal one (with the daemon's words when it said why), which every later
 * call reports until the connection is live again. */
#ifndef GPUMEM_CLIENT_CONN_H
#define GPUMEM_CLIENT_CONN_H

#include <stdbool.h>
#include <stddef.h>

#include "buffer.h"
#include "common/frame.h"
#include "common/wire.h"
#include "events.h"
#include "gpumem.h"
#include "hello.h"
#include "buffers.h"

typedef struct conn conn;

/* What a connection is made for, and the parts of its client it uses. */
struct conn_parts {
  gpumem_client *client; /* handed to the connection hook */
  buffers *buffers;     /* re-registered after a restart */
  hello *hello;          /* filled by each greeting */
  events *events;        /* handles the daemon's events */
  const char *path;      /* the socket (copied) */
  const char *name;      /* the session's name (copied) */
  int role;
  unsigned flags;        /* GPUMEM_CONNECT_* */
};

/* One request and its answer, for conn_call. The caller sets what it
 * needs of the first part and zeroes the rest. */
struct call {
  const struct buffer_spec *alloc; /* an AllocRequest: make its buffer from the reply */
  gpumem_buffer *freeing;          /* a FreeRequest of this buffer (its id is filled in) */
  unsigned extra_ms;               /* waits this much longer than the request timeout */
  const int *send_fds;             /* fds sent with the request: taken (closed) whether or */
  size_t nsend_fds;                /* not it is sent (set the request's fd_count) */
  wire_env *reply;                 /* the answer (an AllocReply, an Error, ...) or NULL */
  struct frame frame;              /* and its fds */
  gpumem_buffer *built;            /* alloc: the buffer made from the reply, or NULL */
  int built_rc;                    /* alloc: 0, or why it was not made (or not mapped) */
  char built_words[320];
};

/* Make a connection (not connected yet); NULL when out of memory. */
conn *conn_create(const struct conn_parts *p);

/* Free a stopped connection. */
void conn_destroy(conn *k);

/* Connect and greet for the first time, on the calling thread. Returns 0
 * when live, else the code (the daemon's when it refused the session)
 * with error_set's words; the connection is then closed for good. */
int conn_start(conn *k);

/* Be the connection's I/O owner until conn_stop: the background thread. */
void conn_run(conn *k);

/* Step the loop for a client without a thread (gpumem_dispatch). */
int conn_dispatch(conn *k, int timeout_ms);

/* Close for good: stop the loop (the background thread returns from
 * conn_run), fail what waits, and settle the frees the library took over
 * (their buffers are destroyed). */
void conn_stop(conn *k);

/* Send a request (its id set here) and wait for its answer (the
 * request timeout, plus call->extra_ms). Returns 0, the code of an Error
 * answer (call->reply holds it), or why there is no answer; free the
 * answer with conn_call_done. Fails at once unless the connection is
 * live. */
int conn_call(conn *k, wire_env *req, struct call *call);

/* Free a call's answer, closing fds not taken. */
void conn_call_done(struct call *call);

/* Take over the free of a buffer the daemon refused to free now, for a
 * caller that gave it up: the library sends it again after a back-off
 * until the daemon frees it or the connection ends (then the buffer is
 * destroyed). A buffer no daemon knows is destroyed at once. */
void conn_free_later(conn *k, gpumem_buffer *b);

/* True while the connection is live. */
bool conn_live(conn *k);

/* The socket (-1 while there is none). */
int conn_fd(conn *k);

/* Set the request timeout (ms; 0: the default). */
void conn_set_timeout(conn *k, unsigned ms);

/* Set the connection hook. */
void conn_set_hook(conn *k, gpumem_conn_hook hook, void *user);

/* The daemon's last error outside any request: its code, and "NAME:
 * words" in buf; 0 when there was none. */
int conn_daemon_error(conn *k, char *buf, size_t len);

#endif
