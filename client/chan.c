/* The socket to the daemon. Reads and writes never block (the socket's
 * calls say MSG_DONTWAIT); chan_wait is the only place that waits. */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "chan.h"
#include "common/clock.h"
#include "common/wire.h"
#include "error.h"
#include "gpumem.h"

struct chan {
  int fd;            /* the socket, -1 while there is none */
  int wake;          /* an eventfd that interrupts chan_wait */
  frame_reader *reader;
  frame_writer *writer;
  uint64_t written;  /* bytes written on this socket */
  uint64_t watched;  /* written will have passed this when the last watched frame is out */
  double stalled_at; /* when the daemon last took bytes of a watched frame, or it was queued */
};

/* Give the channel a fresh reader and writer; false when out of memory
 * (it keeps the old ones). */
static bool fresh(chan *ch) {
  frame_reader *r = frame_reader_create(WIRE_MAX_REPLY);
  frame_writer *w = frame_writer_create();
  if (!r || !w) {
    frame_reader_destroy(r);
    frame_writer_destroy(w);
    return false;
  }
  frame_reader_destroy(ch->reader);
  frame_writer_destroy(ch->writer);
  ch->reader = r;
  ch->writer = w;
  ch->written = ch->watched = 0;
  return true;
}

/* Make a channel with no socket. */
chan *chan_create(void) {
  chan *ch = calloc(1, sizeof *ch);
  if (!ch) return NULL;
  ch->fd = -1;
  ch->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (ch->wake < 0 || !fresh(ch)) {
    chan_destroy(ch);
    return NULL;
  }
  return ch;
}

/* Free a channel. */
void chan_destroy(chan *ch) {
  if (!ch) return;
  if (ch->fd >= 0) close(ch->fd);
  if (ch->wake >= 0) close(ch->wake);
  frame_reader_destroy(ch->reader);
  frame_writer_destroy(ch->writer);
  free(ch);
}

/* Connect to the socket at path. */
int chan_open(chan *ch, const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof addr.sun_path)
    return error_set(GPUMEM_E_INVALID, "socket path too long: %s", path);
  if (!fresh(ch)) return error_set(GPUMEM_E_NOMEM, "out of memory");
  strcpy(addr.sun_path, path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return error_set(GPUMEM_E_CONNECT, "socket: %s", strerror(errno));
  if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
    int e = errno;
    close(fd);
    return error_set(GPUMEM_E_CONNECT, "cannot connect to gpumemd at %s: %s", path, strerror(e));
  }
  ch->fd = fd;
  return 0;
}

/* Close the socket; partial frames of it mean nothing on the next one. */
void chan_close(chan *ch) {
  if (ch->fd >= 0) close(ch->fd);
  ch->fd = -1;
  fresh(ch);
}

/* The socket. */
int chan_fd(const chan *ch) { return ch->fd; }

/* Interrupt chan_wait. */
void chan_wake(chan *ch) {
  uint64_t one = 1;
  ssize_t n = write(ch->wake, &one, sizeof one);
  (void)n; /* a counter already non-zero wakes all the same */
}

/* Queue a frame. */
int chan_push(chan *ch, const uint8_t *bytes, size_t len, const int *fds, size_t nfds,
              bool watched) {
  int rc = frame_writer_push(ch->writer, bytes, len, fds, nfds);
  if (rc < 0 || !watched) return rc;
  if (ch->written >= ch->watched) ch->stalled_at = clock_ms();
  ch->watched = ch->written + frame_writer_queued(ch->writer);
  return 0;
}

/* True when nothing waits to be written. */
bool chan_idle(const chan *ch) { return frame_writer_queued(ch->writer) == 0; }

/* Write what is queued. */
int chan_flush(chan *ch) {
  if (ch->fd < 0) return -ENOTCONN;
  size_t before = frame_writer_queued(ch->writer);
  int rc = frame_writer_flush(ch->writer, ch->fd);
  size_t sent = before - frame_writer_queued(ch->writer);
  ch->written += sent;
  if (sent && ch->written < ch->watched) ch->stalled_at = clock_ms();
  return rc;
}

/* Wait for the socket or a wake-up. */
int chan_wait(chan *ch, int timeout_ms) {
  struct pollfd p[2] = {{ch->fd, POLLIN, 0}, {ch->wake, POLLIN, 0}};
  if (!chan_idle(ch)) p[0].events |= POLLOUT;
  int n = poll(p, 2, timeout_ms);
  if (n < 0) return errno == EINTR ? 0 : -errno;
  if (p[1].revents) {
    uint64_t count;
    ssize_t got = read(ch->wake, &count, sizeof count);
    (void)got; /* EAGAIN: another wait took it */
  }
  int ready = 0;
  if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) ready |= CHAN_READABLE;
  if (p[0].revents & POLLOUT) ready |= CHAN_WRITABLE;
  if (p[0].revents & POLLNVAL) return -EBADF;
  return ready;
}

/* Read once. */
ssize_t chan_fill(chan *ch) {
  if (ch->fd < 0) return -ENOTCONN;
  return frame_reader_fill(ch->reader, ch->fd);
}

/* The next whole frame. */
int chan_next(chan *ch, struct frame *f) { return frame_reader_next(ch->reader, f); }

/* Since when a watched frame has waited. */
double chan_stalled_since(const chan *ch) {
  return ch->written < ch->watched ? ch->stalled_at : 0;
}
