#include "session.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"
#include "server.h"

/* A peer that lets this much pile up unread is dropped. */
#define SESSION_MAX_QUEUED (256u << 20)
/* Reads per wakeup, so that one busy peer cannot starve the others. */
#define SESSION_READS_PER_WAKEUP 16

static void on_poll(uv_poll_t *h, int status, int events);

/* Ask libuv for writability only while something is queued. */
static void update_poll(struct session *s) {
  if (s->closed || s->doomed) return;
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
struct session *session_create(struct server *srv, uv_loop_t *loop, int fd,
                               uint64_t id) {
  struct session *s = calloc(1, sizeof *s);
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (!s || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) goto fail;
  s->id = id;
  s->server = srv;
  s->fd = fd;
  s->pid = cred.pid;
  s->uid = cred.uid;
  s->gid = cred.gid;
  list_init(&s->buffers);
  list_init(&s->link);
  s->reader = frame_reader_create(WIRE_MAX_REQUEST);
  s->writer = frame_writer_create();
  if (!s->reader || !s->writer) goto fail;
  if (uv_poll_init(loop, &s->poll, fd) < 0) goto fail;
  s->poll.data = s;
  update_poll(s);
  return s;
fail:
  if (s) {
    frame_reader_destroy(s->reader);
    frame_writer_destroy(s->writer);
    free(s);
  }
  close(fd);
  return NULL;
}

/* Free the session's memory once libuv is done with the handle. */
static void on_closed(uv_handle_t *h) {
  struct session *s = h->data;
  close(s->fd);
  frame_reader_destroy(s->reader);
  frame_writer_destroy(s->writer);
  free(s);
}

/* End the session now. */
void session_close(struct session *s) {
  if (s->closed) return;
  log_debug("session %llu (pid %d) closed", (unsigned long long)s->id, (int)s->pid);
  s->closed = true;
  server_session_closed(s->server, s);
  uv_close((uv_handle_t *)&s->poll, on_closed);
}

/* Send what the socket takes. A peer that cannot be written to any more
 * may still have requests buffered for us: those are carried out, and the
 * session ends when reading reaches the end of the stream. Returns true
 * when the session is done (drained, or unwritable while draining). */
static bool flush_done(struct session *s) {
  int rc = s->write_failed ? 0 : frame_writer_flush(s->writer, s->fd);
  if (rc < 0 && rc != -EAGAIN) {
    log_debug("session %llu: send: %s", (unsigned long long)s->id, strerror(-rc));
    s->write_failed = true;
    frame_writer_destroy(s->writer);
    s->writer = frame_writer_create();
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
  if (s->doomed || s->closed) return;
  s->doomed = true;
  if (s->poll_events) uv_poll_stop(&s->poll);
  s->poll_events = 0;
  server_session_doomed(s->server, s);
}

/* Queue a message with fds and try to send it right away. */
int session_send(struct session *s, const wire_env *env, const int *fds,
                 size_t nfds) {
  size_t len;
  if (s->write_failed || s->doomed) {
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    return s->closed || s->doomed ? -EPIPE : 0;
  }
  uint8_t *bytes = s->closed ? NULL : wire_pack(env, &len);
  int rc = bytes ? frame_writer_push(s->writer, bytes, len, fds, nfds) : -ENOMEM;
  if (!bytes)
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
  free(bytes);
  if (s->closed) return -EPIPE;
  if (rc == 0 && frame_writer_queued(s->writer) > SESSION_MAX_QUEUED) {
    log_warn("session %llu (pid %d) reads too slowly: dropped",
             (unsigned long long)s->id, (int)s->pid);
    rc = -ENOBUFS;
  }
  if (rc < 0) {
    doom(s);
    return rc;
  }
  if (flush_done(s)) doom(s);
  return 0;
}

/* Queue an Error reply to request id. */
void session_send_error(struct session *s, uint64_t id, const struct fault *f) {
  Gpumem__Wire__Error err = GPUMEM__WIRE__ERROR__INIT;
  err.code = f->code;
  err.message = (char *)f->text;
  err.bytes_needed = f->bytes_needed;
  err.bytes_free = f->bytes_free;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = id;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ERROR;
  env.error = &err;
  session_send(s, &env, NULL, 0);
}

/* Answer with an error and close once it is sent. */
void session_fail(struct session *s, uint64_t id, wire_code code,
                  const char *text) {
  struct fault f = {.code = code};
  snprintf(f.text, sizeof f.text, "%s", text);
  log_info("session %llu (pid %d): %s: %s; closing", (unsigned long long)s->id,
           (int)s->pid, wire_code_name(code), text);
  if (s->closed) return;
  s->draining = true;
  session_send_error(s, id, &f);
  if (!s->closed) flush(s);
}

/* Read what arrived and hand each whole frame to the server. */
static void on_readable(struct session *s) {
  for (int i = 0; i < SESSION_READS_PER_WAKEUP && !s->closed && !s->draining; i++) {
    ssize_t n = frame_reader_fill(s->reader, s->fd);
    if (n == -EAGAIN) return;
    if (n == 0 || (n < 0 && n != -EPROTO)) {
      session_close(s);
      return;
    }
    if (n == -EPROTO) {
      session_fail(s, 0, GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR,
                   "too many file descriptors");
      return;
    }
    struct frame f;
    int rc = 0;
    while (!s->closed && !s->draining && (rc = frame_reader_next(s->reader, &f)) > 0) {
      server_dispatch(s->server, s, &f);
      frame_release(&f);
    }
    if (!s->closed && !s->draining && rc < 0) {
      session_fail(s, 0, GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR,
                   rc == -EMSGSIZE ? "frame larger than the limit" : "out of memory");
      return;
    }
  }
}

static void on_poll(uv_poll_t *h, int status, int events) {
  struct session *s = h->data;
  if (status < 0) {
    /* A peer that closed with our reply unread leaves an error on the
     * socket; the requests it sent before are still there to carry out. */
    on_readable(s);
    session_close(s);
    return;
  }
  if (events & UV_WRITABLE) flush(s);
  if (!s->closed && (events & UV_READABLE)) on_readable(s);
}
