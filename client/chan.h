/* The socket to the daemon: frames in and out (fds with them), a queue of
 * frames to write, a watch on messages the daemon does not take, and a
 * wake-up by which other threads interrupt the wait for the socket. Only
 * the thread that drives the connection (conn.c) calls these, except
 * chan_wake. */
#ifndef GPUMEM_CLIENT_CHAN_H
#define GPUMEM_CLIENT_CHAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/frame.h"

typedef struct chan chan;

/* What chan_wait saw. */
enum chan_ready {
  CHAN_READABLE = 1, /* the socket has something to read (or ended) */
  CHAN_WRITABLE = 2, /* the socket takes more */
};

/* Make a channel with no socket; NULL when out of memory or fds. */
chan *chan_create(void);

/* Close a channel's socket and wake-up and free it. */
void chan_destroy(chan *ch);

/* Connect to the socket at path. Returns 0, or GPUMEM_E_CONNECT or
 * GPUMEM_E_INVALID with error_set's words. */
int chan_open(chan *ch, const char *path);

/* Close the socket (if open); what was read or queued of it is dropped. */
void chan_close(chan *ch);

/* The socket (-1: none). */
int chan_fd(const chan *ch);

/* Interrupt chan_wait, from any thread. */
void chan_wake(chan *ch);

/* Queue a frame (payload copied, fds consumed). A watched frame (one the
 * library must get out: an ack) counts towards chan_stalled until it is
 * written. Returns 0, -EINVAL or -ENOMEM. */
int chan_push(chan *ch, const uint8_t *bytes, size_t len, const int *fds, size_t nfds,
              bool watched);

/* True when nothing waits to be written. */
bool chan_idle(const chan *ch);

/* Write what is queued, as far as the socket takes it. Returns 0 when
 * all went, -EAGAIN when the socket is full, another -errno when writing
 * failed (the daemon is gone, most likely). */
int chan_flush(chan *ch);

/* Wait for the socket (readable, or writable while frames wait) or a
 * wake-up, at most timeout_ms (-1: no limit). Returns enum chan_ready
 * flags (0: timeout or woken), or -errno. */
int chan_wait(chan *ch, int timeout_ms);

/* Read once. Returns the bytes read, 0 at the end of the stream, -EAGAIN
 * when nothing is there, another -errno. */
ssize_t chan_fill(chan *ch);

/* The next whole frame read: 1 (filled), 0 (none), -EMSGSIZE. */
int chan_next(chan *ch, struct frame *f);

/* Since when (monotonic ms) a watched frame has waited with the daemon
 * taking nothing; 0 when none waits. */
double chan_stalled_since(const chan *ch);

#endif
