#include "session.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"
#include "peer.h"
#include "config.h"

/* Reads and requests per turn of the loop, so that one busy peer cannot
 * starve the others. */
#define SESSION_READS_PER_WAKEUP 16
#define SESSION_FRAMES_PER_TURN 4
/* Over the total cap, a session with less than this queued is not cut. */
#define SESSION_MIN_BLAME (64u << 10)
/* How long a session that is being ended has to read its last words. */
#define SESSION_DRAIN_MS 1000

static void on_poll(uv_poll_t *h, int status, int events);
static void on_timer(uv_timer_t *t);

/* Whether the session still reads and answers requests. */
static bool live(const struct session *s) { return !s->owner.closed && !s->draining && !s->doomed; }

/* Ask libuv for writability only while something is queued. */
static void update_poll(struct session *s) {
  if (s->owner.closed || s->doomed) return;
  int want = s->draining ? 0 : UV_READABLE;
  if (frame_writer_queued(s->writer)) want |= UV_WRITABLE;
  if (want == s->poll_events) return;
  s->poll_events = want;
  if (want)
    uv_poll_start(&s->poll, want, on_poll);
  else
    uv_poll_stop(&s->poll);
}

/* Start a session on an accepted socket. */
struct session *session_create(const struct session_host *host, uv_loop_t *loop, int fd,
                               uint64_t id) {
  struct session *s = calloc(1, sizeof *s);
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (s) s->pidfd = -1;
  if (!s || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) goto fail;
  s->owner.id = id;
  s->host = host;
  s->fd = fd;
  s->owner.pid = cred.pid;
  s->owner.uid = cred.uid;
  s->gid = cred.gid;
  s->pidfd = peer_pin(fd, &cred);
  if (s->pidfd < 0)
    log_debug("pid %d not pinned (%s): it will never be signalled", (int)cred.pid,
              cred.pid > 0 ? strerror(-s->pidfd) : "not in gpumemd's pid namespace");
  list_init(&s->owner.buffers);
  list_init(&s->owner.link);
  list_init(&s->backlog_link);
  s->reader = frame_reader_create(WIRE_MAX_REQUEST);
  s->writer = frame_writer_create();
  if (!s->reader || !s->writer) goto fail;
  if (uv_poll_init(loop, &s->poll, fd) < 0) goto fail;
  s->poll.data = s;
  uv_timer_init(loop, &s->timer);
  s->timer.data = s;
  s->handles = 2;
  frame_writer_count_into(s->writer, host->queued_total);
  update_poll(s);
  return s;
fail:
  if (s) {
    frame_reader_destroy(s->reader);
    frame_writer_destroy(s->writer);
    peer_unpin(s->pidfd);
    free(s);
  }
  close(fd);
  return NULL;
}

/* Kill the session's process. */
int session_kill(struct session *s) {
  if (s->doomed || s->owner.closed) return -ENOENT;
  if (s->pidfd < 0) return -EBADF;
  return peer_signal(s->pidfd, SIGKILL);
}

/* Free the session's memory once libuv is done with the handle. */
static void on_closed(uv_handle_t *h) {
  struct session *s = h->data;
  if (--s->handles > 0) return;
  close(s->fd);
  peer_unpin(s->pidfd);
  frame_reader_destroy(s->reader);
  frame_writer_destroy(s->writer);
  free(s);
}

/* End the session now. */
void session_close(struct session *s) {
  if (s->owner.closed) return;
  log_debug("session %llu (pid %d) closed", (unsigned long long)s->owner.id, (int)s->owner.pid);
  s->owner.closed = true;
  s->host->closed(s->host->ctx, s);
  uv_close((uv_handle_t *)&s->poll, on_closed);
  uv_close((uv_handle_t *)&s->timer, on_closed);
}

/* Send what the socket takes. A peer that cannot be written to any more
 * may still have requests buffered for us: those are carried out, and the
 * session ends when reading reaches the end of the stream. Returns true
 * when the session is done (drained, or unwritable while draining). */
static bool flush_done(struct session *s) {
  int rc = s->write_failed ? 0 : frame_writer_flush(s->writer, s->fd);
  if (rc < 0 && rc != -EAGAIN) {
    log_debug("session %llu: send: %s", (unsigned long long)s->owner.id, strerror(-rc));
    s->write_failed = true;
    frame_writer_destroy(s->writer);
    s->writer = frame_writer_create();
    if (s->writer) frame_writer_count_into(s->writer, s->host->queued_total);
    if (!s->writer || s->draining) return true;
  }
  if (s->draining && frame_writer_queued(s->writer) == 0) return true;
  update_poll(s);
  return false;
}

/* Flush, and end the session now if it is done (from the loop's own
 * callbacks, where nothing else holds on to the session). */
static void flush(struct session *s) {
  if (flush_done(s)) session_close(s);
}

/* A session that must end while a caller may still be using it (the
 * engine, in the middle of an operation): stop reading and writing, and
 * let the server close it on the loop's next turn. */
static void doom(struct session *s) {
  if (s->doomed || s->owner.closed) return;
  s->doomed = true;
  uv_timer_stop(&s->timer);
  if (s->poll_events) uv_poll_stop(&s->poll);
  s->poll_events = 0;
  s->host->doomed(s->host->ctx, s);
}

/* End the session, saying why. */
void session_end(struct session *s, enum session_end_how how, uint64_t id,
                 const struct fault *why) {
  if (how == SESSION_END_CUT) {
    if (s->cut || !live(s)) return;
    s->cut = true;
    log_warn("session %llu (pid %d, uid %d): %s; closing", (unsigned long long)s->owner.id,
             (int)s->owner.pid, (int)s->owner.uid, why->text);
  } else if (why) {
    log_info("session %llu (pid %d): %s: %s; closing", (unsigned long long)s->owner.id,
             (int)s->owner.pid, wire_code_name(why->code), why->text);
  }
  if (s->owner.closed) return;
  if (how == SESSION_END_NEXT_TURN) {
    if (why) session_send_error(s, id, why);
    doom(s);
    return;
  }
  if (how == SESSION_END_CUT) frame_writer_drop_unsent(s->writer);
  s->draining = true;
  if (why) session_send_error(s, id, why);
  if (how == SESSION_END_DRAIN && !s->owner.closed) flush(s);
  if (!s->owner.closed && !s->doomed) uv_timer_start(&s->timer, on_timer, SESSION_DRAIN_MS, 0);
}

/* End the session for a reason in words (DRAIN, or CUT), to no request. */
static void end_for(struct session *s, enum session_end_how how, wire_code code,
                    const char *text) {
  struct fault f = {0};
  fault_set(&f, code, "%s", text);
  session_end(s, how, 0, &f);
}

/* Past the per-session cap on output left unread, the session is cut
 * before anything more is queued; returns true if it was. */
static bool over_own_cap(struct session *s) {
  const struct config *cfg = s->host->cfg;
  size_t queued = frame_writer_queued(s->writer);
  if (!live(s) || queued <= cfg->max_queued_per_session) return false;
  char text[200];
  snprintf(text, sizeof text,
           "%zu bytes of replies and events left unread (limit %llu per session)", queued,
           (unsigned long long)cfg->max_queued_per_session);
  end_for(s, SESSION_END_CUT, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED, text);
  return true;
}

/* Past the cap over every session, the session with the most unread is
 * cut (which may be s itself). */
static void check_total_cap(struct session *s) {
  const struct config *cfg = s->host->cfg;
  size_t total = *s->host->queued_total;
  if (total <= cfg->max_queued_total) return;
  struct session *big = s->host->biggest_queue(s->host->ctx);
  /* Sessions already being ended may hold most of it for a moment (a half
   * sent reply): a session that keeps little queued is not to blame. */
  if (!big || frame_writer_queued(big->writer) < SESSION_MIN_BLAME) return;
  char text[200];
  snprintf(text, sizeof text,
           "replies left unread by all sessions passed %llu bytes; this session left the "
           "most (%zu bytes)",
           (unsigned long long)cfg->max_queued_total, frame_writer_queued(big->writer));
  end_for(big, SESSION_END_CUT, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED, text);
}

/* Queue a message with fds and try to send it right away. */
int session_send(struct session *s, const wire_env *env, const int *fds,
                 size_t nfds) {
  size_t len;
  if (s->write_failed || s->doomed || (!s->owner.closed && over_own_cap(s))) {
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    return s->owner.closed || s->doomed || s->cut ? -EPIPE : 0;
  }
  uint8_t *bytes = s->owner.closed ? NULL : wire_pack(env, &len);
  int rc = bytes ? frame_writer_push(s->writer, bytes, len, fds, nfds) : -ENOMEM;
  if (!bytes)
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
  free(bytes);
  if (s->owner.closed) return -EPIPE;
  if (rc < 0) {
    doom(s);
    return rc;
  }
  if (flush_done(s)) {
    doom(s);
    return 0;
  }
  check_total_cap(s);
  return 0;
}

/* Queue an Error reply to request id. */
void session_send_error(struct session *s, uint64_t id, const struct fault *f) {
  Gpumem__Wire__Error err = GPUMEM__WIRE__ERROR__INIT;
  char text[sizeof f->text];
  fault_to_wire(f, text, &err);
  wire_env env = wire_envelope(id, GPUMEM__WIRE__ENVELOPE__BODY_ERROR, &err);
  session_send(s, &env, NULL, 0);
}

/* A frame begun too long ago ends the session; a session that was being
 * ended and still has not read its last words is closed. */
static void on_timer(uv_timer_t *t) {
  struct session *s = t->data;
  if (s->owner.closed || s->doomed) return;
  if (s->draining) {
    log_debug("session %llu (pid %d): last reply unread after %d ms; closed",
             (unsigned long long)s->owner.id, (int)s->owner.pid, SESSION_DRAIN_MS);
    session_close(s);
    return;
  }
  char text[200];
  snprintf(text, sizeof text,
           "a frame begun %u ms ago is not finished (%zu bytes and %zu fds of it arrived)",
           (unsigned)s->host->cfg->frame_timeout_ms,
           frame_reader_pending(s->reader), frame_reader_held_fds(s->reader));
  end_for(s, SESSION_END_DRAIN, GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR, text);
}

/* Time the frame still arriving: from its first byte (a frame that ended
 * in this wakeup started the clock again), stopped at a frame edge. Whole
 * frames waiting for the loop's next turn (the backlog) are ours to
 * serve, not the peer's to finish: no clock runs for them, and it starts
 * again when the backlog is served down to a frame still arriving. */
static void watch_frame(struct session *s, bool completed) {
  if (frame_reader_pending(s->reader) == 0 || frame_reader_ready(s->reader)) {
    uv_timer_stop(&s->timer);
    return;
  }
  if (completed || !uv_is_active((uv_handle_t *)&s->timer))
    uv_timer_start(&s->timer, on_timer, s->host->cfg->frame_timeout_ms, 0);
}

/* Fds parked in a frame still arriving are bounded per session and per
 * uid (they count against the daemon's own limit); false when the session
 * was ended for it. */
static bool parked_fds_ok(struct session *s) {
  size_t held = frame_reader_held_fds(s->reader);
  if (!held) return true;
  const struct config *cfg = s->host->cfg;
  char text[200];
  if (held > cfg->max_parked_fds_per_session) {
    snprintf(text, sizeof text, "%zu fds wait in an unfinished frame (limit %u per session)",
             held, cfg->max_parked_fds_per_session);
  } else {
    size_t uid_held = s->host->parked_fds(s->host->ctx, s->owner.uid);
    if (uid_held <= cfg->max_parked_fds_per_uid) return true;
    snprintf(text, sizeof text,
             "uid %d's sessions hold %zu fds in unfinished frames (limit %u per uid)",
             (int)s->owner.uid, uid_held, cfg->max_parked_fds_per_uid);
  }
  end_for(s, SESSION_END_DRAIN, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED, text);
  return false;
}

/* Hand whole frames to the server, at most SESSION_FRAMES_PER_TURN (the
 * rest wait for the loop's next turn, so that a peer that floods requests
 * delays the others by one batch at most), reading more (when can_read)
 * once none is left buffered. */
static void serve(struct session *s, bool can_read) {
  bool completed = false;
  int frames = 0, reads = 0;
  s->backlog = false;
  while (live(s)) {
    if (frame_reader_ready(s->reader)) {
      if (frames == SESSION_FRAMES_PER_TURN) {
        s->backlog = true;
        s->host->frames_wait(s->host->ctx, s);
        break;
      }
      struct frame f;
      int rc = frame_reader_next(s->reader, &f);
      if (rc < 0) {
        end_for(s, SESSION_END_DRAIN, GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR,
                     rc == -EMSGSIZE ? "frame larger than the limit" : "out of memory");
        return;
      }
      frames++;
      completed = true;
      s->host->frame(s->host->ctx, s, &f);
      frame_release(&f);
      continue;
    }
    if (!parked_fds_ok(s) || !can_read || reads++ == SESSION_READS_PER_WAKEUP) break;
    ssize_t n = frame_reader_fill(s->reader, s->fd);
    if (n == -EAGAIN) break;
    if (n == 0 || (n < 0 && n != -EPROTO)) {
      session_close(s);
      return;
    }
    if (n == -EPROTO) {
      end_for(s, SESSION_END_DRAIN, GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR,
                   "too many file descriptors");
      return;
    }
  }
  if (live(s)) watch_frame(s, completed);
}

/* Go on with frames left waiting on the last turn. */
void session_serve_backlog(struct session *s) {
  if (s->backlog) serve(s, false);
}

/* Read what arrived and hand each whole frame to the server. */
static void on_readable(struct session *s) { serve(s, true); }

static void on_poll(uv_poll_t *h, int status, int events) {
  struct session *s = h->data;
  if (status < 0) {
    /* A peer that closed with our reply unread leaves an error on the
     * socket; the requests it sent before are still there to carry out,
     * all of them now (the session ends here). */
    do
      on_readable(s);
    while (s->backlog && live(s));
    session_close(s);
    return;
  }
  if (events & UV_WRITABLE) flush(s);
  if (!s->owner.closed && (events & UV_READABLE)) on_readable(s);
}
