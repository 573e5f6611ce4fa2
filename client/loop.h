/* The connection's loop (loop.c) and the state it shares with the
 * connection's users' side (conn.c): private to those two files.
 *
 * Whoever holds the token (stepping) owns the socket, its reader and
 * writer (ch); everything else of struct conn is under mu. The holder
 * never keeps mu while it waits for the socket, maps memory or runs a
 * hook. */
#ifndef GPUMEM_CLIENT_LOOP_H
#define GPUMEM_CLIENT_LOOP_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "adopt.h"
#include "chan.h"
#include "common/list.h"
#include "conn.h"

#define BACKOFF_FIRST_MS 10
#define BACKOFF_MAX_MS 1000

/* Where the connection stands. */
enum conn_state {
  CONN_DOWN,     /* no connection; the next attempt at retry_at */
  CONN_GREETING, /* connected; the Hello's answer awaited */
  CONN_ADOPTING, /* greeted; the buffers' re-registration awaited */
  CONN_LIVE,     /* calls go through */
  CONN_CLOSED,   /* for good */
};

/* What a request is for. */
enum request_kind {
  REQ_CALL,  /* a caller waits for it */
  REQ_HELLO, /* the loop's greeting */
  REQ_ADOPT, /* one of the loop's re-registration requests */
  REQ_FREE,  /* a free the library finishes (sent again while refused) */
};

/* A request, queued (not yet written) or sent (its answer awaited). */
struct request {
  struct list link;
  enum request_kind kind;
  uint64_t id;
  uint8_t *bytes; /* packed, until written (REQ_FREE packs when written) */
  size_t len;
  int *fds;       /* until written */
  size_t nfds;
  bool sent, done, routing; /* routing: its answer is being built */
  double due_ms;  /* REQ_FREE: not written before */
  struct call *call;   /* REQ_CALL */
  size_t batch;        /* REQ_ADOPT */
  gpumem_buffer *buf;  /* REQ_FREE */
  int err;        /* done without an answer: why (GPUMEM_E_DISCONNECTED) */
};

/* The connection's error: the daemon's last words outside any request,
 * and the first fatal error of the connection, sticky until it is live
 * again. */
struct conn_error {
  wire_code said;      /* 0: the daemon said nothing */
  char said_words[320];
  uint64_t said_gen;   /* on this connection */
  bool set;            /* the fatal error below is recorded */
  int code;            /* what calls fail with */
  char words[320];
};

struct conn {
  pthread_mutex_t mu; /* everything below but the parts and ch */
  pthread_cond_t cv;  /* a request done, the token free, closing */
  chan *ch;           /* the token holder's */
  gpumem_client *client;
  buffers *buffers;
  hello *hello;
  events *events;
  char *path, *name;
  int role;
  unsigned flags;
  enum conn_state state;
  bool first;         /* the first greeting is under way */
  bool closing;
  bool stepping;      /* someone holds the token */
  pthread_t stepper;  /* who */
  bool polling;       /* the holder waits for the socket: wake it */
  int fd;             /* chan_fd, for gpumem_fd */
  uint64_t gen;       /* connections made */
  uint64_t next_id;
  unsigned timeout_ms;
  struct list queue;  /* requests not yet written, in order */
  struct list sent;   /* requests written, awaiting their answers */
  struct conn_error err;
  int backoff_ms;     /* the wait after the next failed attempt */
  double retry_at;    /* monotonic time of the next attempt */
  int free_backoff_ms;
  double greet_until; /* greeting or re-registering: answered by then */
  adopt *plan;        /* re-registering */
  size_t answers;     /* of its requests */
  gpumem_conn_hook hook;
  void *hook_user;
};

/* Free a request and what it still holds. */
void loop_request_free(struct request *r);

/* The next back-off after ms: twice as long, up to BACKOFF_MAX_MS. */
int loop_backoff_next(int ms);

/* Take the token, waiting while someone else holds it. Called with mu
 * held. */
void loop_take(conn *k);

/* Give the token back. Called with mu held. */
void loop_give(conn *k);

/* One attempt to connect: open the socket and queue the Hello. By the
 * token holder, without mu. */
void loop_attempt(conn *k);

/* One turn of the loop, waiting until until_ms at the latest (-1: no
 * limit); a down connection is tried again only when may_attempt. By the
 * token holder, without mu. Returns the events handled, -EAGAIN when
 * nothing was read, or GPUMEM_E_DISCONNECTED when the connection is not
 * up (or ended in this turn). */
int loop_turn(conn *k, double until_ms, bool may_attempt);

/* End the connection (or a failed attempt) with code and why: record its
 * sticky error, fail every request waiting on it, forget which buffers
 * the daemon knew (destroying those whose free the library finished: the
 * daemon freed them with the session), and decide when to try again. By
 * the token holder, without mu. */
void loop_end(conn *k, int code, const char *why);

#endif
