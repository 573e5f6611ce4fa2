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

struct server;

struct session {
  uint64_t id;
  struct server *server;
  int fd;
  uv_poll_t poll;
  int poll_events;
  uv_timer_t timer; /* a frame begun and not finished; a drain's deadline */
  int handles;      /* handles still to close before the memory goes */
  frame_reader *reader;
  frame_writer *writer;
  pid_t pid;
  int pidfd; /* the peer process, pinned at connect (peer.h); -1: unpinned */
  uid_t uid;
  gid_t gid;
  bool may_control; /* allowed to be a controller (credentials) */
  Gpumem__Wire__Role role; /* ROLE_UNSPECIFIED until Hello */
  uint32_t minor;          /* the client's protocol minor version (Hello) */
  char name[WIRE_NAME_MAX + 1];
  struct list buffers; /* struct buffer.owner_link */
  size_t nbuffers;
  bool draining;     /* send what is queued, then close */
  bool write_failed; /* the peer stopped reading: replies are dropped */
  bool doomed;       /* to be closed by the server on the loop's next turn */
  bool cut;          /* ended for leaving too much unread: said once */
  bool backlog;      /* whole frames wait for the loop's next turn */
  struct list backlog_link; /* server's sessions with frames waiting */
  bool closed;
  struct list link; /* server's sessions */
};

/* Start a session on an accepted socket; NULL on failure (fd closed). */
struct session *session_create(struct server *srv, uv_loop_t *loop, int fd,
                               uint64_t id);

/* Queue a message with fds (consumed either way). Returns 0 or negative
 * errno; a session that cannot queue is ended on the loop's next turn,
 * never inside this call (callers may still hold its buffers). */
int session_send(struct session *s, const wire_env *env, const int *fds,
                 size_t nfds);

/* Queue an Error reply to request id. */
void session_send_error(struct session *s, uint64_t id, const struct fault *f);

/* Answer with an error and close once it is sent. */
void session_fail(struct session *s, uint64_t id, wire_code code,
                  const char *text);

/* End the session on the loop's next turn, its buffers freed then; safe
 * while a caller still holds it (the engine, in an operation). */
void session_end(struct session *s);

/* Hand the server the frames that waited for this turn of the loop. */
void session_serve_backlog(struct session *s);

/* End the session now: the server forgets it and its buffers are freed;
 * memory goes in the handle's close callback. */
void session_close(struct session *s);

#endif
