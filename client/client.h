/* libgpumem internals shared by its files. */
#ifndef GPUMEM_CLIENT_INTERNAL_H
#define GPUMEM_CLIENT_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>

#include "addrmap.h"
#include "common/frame.h"
#include "common/idmap.h"
#include "common/wire.h"
#include "error.h"
#include "gpu/gpu.h"
#include "gpumem.h"

struct gpumem_buffer {
  struct addr_entry at; /* in the address map while the caller's (gpumem_alloc) */
  uint64_t id;     /* the daemon's id; meaningful while registered */
  bool registered; /* the daemon knows it (false while reconnecting, or
                    * when the new daemon did not adopt it) */
  char tag[WIRE_TAG_MAX + 1];
  unsigned device; /* the daemon's device index */
  unsigned local;  /* the same device in this process's numbering */
  bool ipc;        /* legacy IPC memory: opened, never paused */
  uint64_t size;
  unsigned flags;
  void *va;
  size_t nchunks;
  uint64_t *chunk_sizes;
  uint64_t *handles;
  bool *held;  /* chunk i is imported and mapped (handles[i] live) */
  /* Every chunk is mapped and accessible. Written under mu with an atomic
   * store; read atomically (gpumem_buffer_mapped) or under mu. */
  bool mapped;
  /* An Unmap event is taking it; copies refused. Written under mu with
   * atomic stores; read under mu, or atomically (the pool). */
  bool unmapping;
  unsigned copies; /* under mu: reads, writes and fills in flight */
  /* No longer the caller's: its alloc failed here, or the library finishes
   * a free the caller gave up on (struct late_free). Never re-registered. */
  bool doomed;
  bool pooled; /* a slab of gpumem_malloc's pool: gpumem_free refuses it */
  struct gpumem_buffer *prev, *next; /* every buffer of the client */
};

/* What an alloc asked for: the routing thread builds the buffer from it
 * when the reply arrives, before it reads the next frame. */
struct alloc_ctx {
  const char *tag;
  unsigned device, local, flags;
  bool pooled;        /* the buffer is to be a pool's slab */
  gpumem_buffer *buf; /* the result, or NULL */
  int rc;             /* the routing thread's failure */
  char words[320];
};

/* One AdoptRequest of a reconnection: the buffers it names, in order. */
struct adopt_ctx {
  gpumem_buffer **bufs;
  size_t n;
};

/* A request waiting for its reply. */
struct pending {
  uint64_t id;
  wire_env *env;      /* the reply; NULL when the connection ended first */
  struct frame frame; /* keeps the reply's fds */
  bool done;
  int err;            /* with env NULL: why there is no reply */
  char words[320];
  struct alloc_ctx *alloc;
  struct adopt_ctx *adopt;
  gpumem_buffer *freeing; /* a FreeRequest: forgotten when the reply comes */
  bool routing;           /* the reading thread is building its result */
  unsigned extra_ms;      /* waits this much longer than the request timeout */
  struct pending *next;
};

/* A free the caller gave up on (it timed out, or is the library's own):
 * the buffer is destroyed when the daemon frees it (FreeReply, or
 * NOT_FOUND) or the connection ends; a refusal (the buffer is being paused
 * or resumed) sends the FreeRequest again after a back-off. */
struct late_free {
  uint64_t id; /* the FreeRequest in flight; 0 while waiting to be sent */
  gpumem_buffer *buf;
  struct late_free *next;
};

/* Where the connection stands. */
enum conn_state {
  CONN_LIVE,         /* greeted; buffers registered */
  CONN_RECONNECTING, /* the daemon went away; calls fail fast */
  CONN_CLOSED,       /* for good: reconnection is off, or disconnecting */
};

struct gpumem_client {
  int fd; /* -1 while there is no connection */
  gpu *gpu;
  char *path; /* the socket connected to, for reconnecting */
  char *name;
  int role;
  unsigned flags;
  char backend[32];
  uint64_t granularity;
  unsigned daemon_minor; /* the daemon's protocol minor version (its Hello) */
  unsigned ndevices;
  int local_of[GPUMEM_MAX_DEVICES]; /* daemon device -> ours, -1 if not visible */
  bool threaded;
  pthread_t thread;
  pthread_mutex_t mu; /* everything below */
  pthread_cond_t cv;  /* on CLOCK_MONOTONIC */
  bool reading; /* a thread is reading the socket */
  enum conn_state state;
  bool closing;       /* gpumem_disconnect runs */
  uint64_t gen;       /* connection number: a send checks it is still on it */
  int down_err;       /* while not live: the code calls fail with */
  char down_words[320];
  int backoff_ms;     /* the next wait before reconnecting */
  double retry_at_ms; /* monotonic time of the next attempt */
  int daemon_code;    /* the daemon's last error outside a request (wire code) */
  uint64_t daemon_gen; /* the connection it came on */
  char daemon_words[320];
  uint64_t next_id;
  unsigned request_timeout_ms; /* how long a request waits for its reply */
  struct pending *pending;
  struct late_free *late; /* frees the library finishes for callers */
  size_t late_waiting;    /* of which waiting to be sent again */
  double late_at_ms;      /* monotonic time of the next such send */
  int late_backoff_ms;    /* the wait after the next refusal */
  idmap *buffers; /* registered buffers by id */
  gpumem_buffer *all; /* every buffer, registered or not */
  gpumem_hook pre_unmap, post_remap;
  void *hook_user;
  gpumem_conn_hook conn_hook;
  void *conn_user;
  pthread_mutex_t send_mu; /* the writer, and fd/gen for sending; before mu */
  frame_writer *writer;
  frame_reader *reader; /* used by the reading thread only */
  struct client_pool *pool; /* gpumem_malloc's sub-allocations (client/pool.c) */
  struct addr_owner addrs;  /* its addresses in the process's address map */
};

/* Free a client's sub-allocation pools (in gpumem_disconnect, after the
 * connection is shut down and the event thread joined, before every
 * buffer of c->all, pooled ones included, is destroyed): frees only the
 * pools' own memory, talks to no daemon. */
void client_pool_destroy(gpumem_client *c);

/* Forget a client that is being disconnected as the default client
 * (client/default.c). */
void client_default_forget(gpumem_client *c);

/* Send a request and wait for its reply; the reply (an Error turned into
 * its code) goes to *reply, whose fds the caller owns. */
int client_call(gpumem_client *c, wire_env *req, struct pending *reply);

/* client_call for a pending that is zeroed but for its context (alloc,
 * freeing); the FreeRequest's id is read when it is sent. */
int client_call_with(gpumem_client *c, wire_env *req, struct pending *reply);

/* Free a reply got from client_call (closing fds not taken). */
void client_reply_free(struct pending *reply);

/* Send a message without waiting (acks) on the current connection; a
 * daemon that takes nothing for the request timeout loses the connection. */
int client_send(gpumem_client *c, const wire_env *env);

/* Send a message with fds (consumed) if the connection is still number
 * gen: a request with its deadline until_ms (monotonic; GPUMEM_E_TIMEOUT
 * when the daemon has not read earlier messages by then, nothing sent),
 * other messages with until_ms < 0 (as client_send). */
int client_send_fds(gpumem_client *c, uint64_t gen, const wire_env *env, const int *fds,
                    size_t nfds, double until_ms);

/* Take over the free of a buffer the daemon refused to free now, for a
 * caller that gave it up: it is sent again until the daemon frees it or
 * the connection ends. */
void client_free_later(gpumem_client *c, gpumem_buffer *b);

/* Free a buffer at the daemon, then here (gpumem_free without its check
 * that the buffer is not a pool's slab). */
int client_free_buffer(gpumem_client *c, gpumem_buffer *b);

/* Allocate a buffer (gpumem_alloc); pooled marks it a pool's slab from the
 * start. */
int client_alloc(gpumem_client *c, const char *tag, int device, uint64_t size,
                 unsigned flags, bool pooled, gpumem_buffer **out);

/* Handle an Unmap or Remap event from the daemon (on the reading thread). */
void client_handle_event(gpumem_client *c, const wire_env *env, struct frame *f);

/* On the routing thread: make, map and register the buffer of an
 * AllocReply, so that the events after it find it. */
void client_alloc_built(gpumem_client *c, struct alloc_ctx *a, const wire_env *env,
                        struct frame *f);

/* Unmap and release what a buffer has mapped; keeps the address range.
 * Returns 0, or a negative errno when a chunk stayed mapped. */
int client_buffer_unmap(gpumem_client *c, gpumem_buffer *b);

/* Record a buffer as known to the daemon under its id. Called with mu
 * held. Returns 0 or -ENOMEM. */
int client_buffer_register(gpumem_client *c, gpumem_buffer *b);

/* Take a buffer out of the id map and the client's list. Called with mu
 * held. */
void client_buffer_forget(gpumem_client *c, gpumem_buffer *b);

/* The buffer an address map entry of kind ADDR_BUFFER is in. */
gpumem_buffer *buffer_of_addr(struct addr_entry *e);

/* Forget a buffer completely: unmap, free the range and the struct. */
void client_buffer_destroy(gpumem_client *c, gpumem_buffer *b);

/* Export a mapped buffer's chunks again as fds (for adoption); on failure
 * none stays open. */
int client_buffer_export(gpumem_client *c, gpumem_buffer *b, int *fds);

/* Copy the daemon -> this process device map (-1: not visible) into
 * map[GPUMEM_MAX_DEVICES]; returns how many devices this process sees. */
unsigned client_local_map(gpumem_client *c, int *map);

/* This process's number of the daemon's device node, or -1. */
int client_local_device(const int *map, uint32_t node);

/* The daemon's number of this process's device local, or -1. */
int client_node_device(const int *map, int local);

#endif
