/* libgpumem internals shared by its files. */
#ifndef GPUMEM_CLIENT_INTERNAL_H
#define GPUMEM_CLIENT_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>

#include "common/frame.h"
#include "common/idmap.h"
#include "common/wire.h"
#include "gpu/gpu.h"
#include "gpumem.h"

struct gpumem_buffer {
  uint64_t id;
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
  bool mapped;
};

/* A request waiting for its reply. */
struct pending {
  uint64_t id;
  wire_env *env;
  struct frame frame; /* keeps the reply's fds */
  bool done;
  struct pending *next;
};

struct gpumem_client {
  int fd;
  gpu *gpu;
  char backend[32];
  uint64_t granularity;
  unsigned ndevices;
  int local_of[WIRE_MAX_DEVICES]; /* daemon device -> ours, -1 if not visible */
  bool threaded;
  pthread_t thread;
  pthread_mutex_t mu; /* everything below */
  pthread_cond_t cv;
  bool reading; /* a thread is reading the socket */
  int dead;     /* 0, or the error that ended the connection */
  uint64_t next_id;
  struct pending *pending;
  idmap *buffers;
  gpumem_hook pre_unmap, post_remap;
  void *hook_user;
  pthread_mutex_t send_mu;
  frame_writer *writer;
  frame_reader *reader; /* used by the reading thread only */
};

/* Record words for this thread's last failure and return err. */
int client_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Send a request and wait for its reply; the reply (an Error turned into
 * its code) goes to *reply, whose fds the caller owns. */
int client_call(gpumem_client *c, wire_env *req, struct pending *reply);

/* Free a reply got from client_call (closing fds not taken). */
void client_reply_free(struct pending *reply);

/* Send a message without waiting (acks). */
int client_send(gpumem_client *c, const wire_env *env);

/* Handle an Unmap or Remap event from the daemon (on the reading thread). */
void client_handle_event(gpumem_client *c, const wire_env *env, struct frame *f);

/* Unmap and release what a buffer has mapped; keeps the address range. */
void client_buffer_unmap(gpumem_client *c, gpumem_buffer *b);

/* Forget a buffer completely: unmap, free the range and the struct. */
void client_buffer_destroy(gpumem_client *c, gpumem_buffer *b);

/* Turn a daemon error code into the library's. */
int client_code(wire_code code);

#endif
