/* A session: one connected client, its socket I/O and its identity. */
#ifndef GPUMEMD_SESSION_H
#define GPUMEMD_SESSION_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "common/frame.h"
#include "common/list.h"
#include "common/wire.h"
#include "fault.h"
#include "owner.h"

struct session;
struct config;

/* What a session needs of the server that runs it, given at its start:
 * the limits, the total queued, and calls that never end the session
 * inside them. */
struct session_host {
  void *ctx; /* passed to every call */
  const struct config *cfg; /* the limits (frames, queues, fds) */
  size_t *queued_total;     /* output queued over every session */
  /* Handle one whole frame the session received. */
  void (*frame)(void *ctx, struct session *s, struct frame *f);
  /* The session is doomed: close it on the loop's next turn. */
  void (*doomed)(void *ctx, struct session *s);
  /* The session has ended: forget it and free its buffers. */
  void (*closed)(void *ctx, struct session *s);
  /* Whole frames of the session wait for the loop's next turns. */
  void (*frames_wait)(void *ctx, struct session *s);
  /* The session with the most output queued that still reads, or NULL. */
  struct session *(*biggest_queue)(void *ctx);
  /* Fds parked in frames still arriving, over the sessions of uid. */
  size_t (*parked_fds)(void *ctx, uid_t uid);
};

/* The session that holds owner o. */
#define session_of(o) list_entry((o), struct session, owner)

struct session {
  struct owner owner; /* who it is and what it owns (owner.h) */
  const struct session_host *host;
  int fd;
  uv_poll_t poll;
  int poll_events;
  uv_timer_t timer; /* a frame begun and not finished; a drain's deadline */
  int handles;      /* handles still to close before the memory goes */
  frame_reader *reader;
  frame_writer *writer;
  int pidfd; /* the peer process, pinned at connect (peer.h); -1: unpinned */
  gid_t gid;
  bool may_control; /* allowed to be a controller (credentials) */
  bool draining;     /* send what is queued, then close */
  bool write_failed; /* the peer stopped reading: replies are dropped */
  bool doomed;       /* to be closed by the server on the loop's next turn */
  bool cut;          /* ended for leaving too much unread: said once */
  bool backlog;      /* whole frames wait for the loop's next turn */
  struct list backlog_link; /* server's sessions with frames waiting */
};

/* Start a session on an accepted socket; NULL on failure (fd closed). */
struct session *session_create(const struct session_host *host, uv_loop_t *loop, int fd,
                               uint64_t id);

/* Queue a message with fds (consumed either way). Returns 0 or negative
 * errno; a session that cannot queue is ended on the loop's next turn,
 * never inside this call (callers may still hold its buffers). */
int session_send(struct session *s, const wire_env *env, const int *fds,
                 size_t nfds);

/* Queue an Error reply to request id. */
void session_send_error(struct session *s, uint64_t id, const struct fault *f);

/* How a session ends (session_end). */
enum session_end_how {
  /* Why is read first (SESSION_DRAIN_MS at most). Closed within the call
   * when the socket takes it at once: from the server's own callbacks. */
  SESSION_END_DRAIN,
  /* The peer leaves too much unread: what it has not begun to read is
   * dropped, and why is read first; never closed within the call. Said
   * once, whatever else ends it meanwhile. */
  SESSION_END_CUT,
  /* Why goes out as far as the socket takes it now; closed on the loop's
   * next turn, never within the call: safe while a caller still holds the
   * session (the engine, in an operation). */
  SESSION_END_NEXT_TURN,
};

/* End the session, saying why (an Error answering request id, 0: none;
 * NULL: nothing to say), which is logged here, once: the one way a
 * session ends. Its buffers are freed when it closes (session_close, the
 * last step, which the server's teardown also calls). */
void session_end(struct session *s, enum session_end_how how, uint64_t id,
                 const struct fault *why);

/* Kill the session's process (SIGKILL through the pidfd pinned at
 * connect). Returns 0, -ENOENT for a session that has ended or is ending,
 * -EBADF for a process never pinned, -ESRCH for one that is gone, or
 * another negative errno. */
int session_kill(struct session *s);

/* Hand the server the frames that waited for this turn of the loop. */
void session_serve_backlog(struct session *s);

/* Close the session now, with nothing said: the server forgets it and its
 * buffers are freed; memory goes in the handle's close callback. The last
 * step of session_end, of a peer that went away, and of the server's
 * teardown. */
void session_close(struct session *s);

#endif
