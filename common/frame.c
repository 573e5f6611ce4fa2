#include "frame.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* The most fds a reader keeps before they are claimed by frames. */
#define READER_MAX_HELD_FDS (4 * FRAME_MAX_FDS)
#define READ_CHUNK 65536

static void close_fds(int *fds, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (fds[i] >= 0) close(fds[i]);
}

/* Release a frame's payload and close any fds still in it. */
void frame_release(struct frame *f) {
  free(f->data);
  close_fds(f->fds, f->nfds);
  free(f->fds);
  memset(f, 0, sizeof *f);
}

/* An fd with the stream offset at which the read that carried it ended. */
struct held_fd {
  int fd;
  uint64_t end;
};

struct frame_reader {
  size_t max_len;
  uint8_t *buf;
  size_t cap, start, end; /* buffered bytes are buf[start..end) */
  uint64_t base;          /* stream offset of buf[start] */
  struct held_fd *fds;
  size_t nfds;
};

/* Create a reader that refuses payloads larger than max_len. */
frame_reader *frame_reader_create(size_t max_len) {
  frame_reader *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  r->max_len = max_len;
  r->fds = calloc(READER_MAX_HELD_FDS, sizeof *r->fds);
  if (!r->fds) {
    free(r);
    return NULL;
  }
  return r;
}

/* Destroy a reader, closing fds it still holds. */
void frame_reader_destroy(frame_reader *r) {
  if (!r) return;
  for (size_t i = 0; i < r->nfds; i++) close(r->fds[i].fd);
  free(r->fds);
  free(r->buf);
  free(r);
}

/* Make room for at least READ_CHUNK more bytes. */
static int reader_reserve(frame_reader *r) {
  if (r->start > 0 && r->start == r->end) r->start = r->end = 0;
  if (r->cap - r->end >= READ_CHUNK) return 0;
  if (r->start > 0) {
    memmove(r->buf, r->buf + r->start, r->end - r->start);
    r->end -= r->start;
    r->start = 0;
    if (r->cap - r->end >= READ_CHUNK) return 0;
  }
  size_t cap = r->cap ? r->cap * 2 : 2 * READ_CHUNK;
  uint8_t *nb = realloc(r->buf, cap);
  if (!nb) return -ENOMEM;
  r->buf = nb;
  r->cap = cap;
  return 0;
}

/* Read once; record each fd with the offset where this read ended. */
ssize_t frame_reader_fill(frame_reader *r, int sock) {
  if (reader_reserve(r) < 0) return -ENOMEM;
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(FRAME_MAX_FDS * sizeof(int))];
  } ctl;
  struct iovec iov = {r->buf + r->end, r->cap - r->end};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1,
                       .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
  ssize_t n;
  do
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  while (n < 0 && errno == EINTR);
  if (n < 0) return errno == EWOULDBLOCK ? -EAGAIN : -errno;
  r->end += (size_t)n;
  uint64_t read_end = r->base + (r->end - r->start);
  bool overflow = false;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const int *in = (const int *)CMSG_DATA(c);
    for (size_t i = 0; i < k; i++) {
      int fd;
      memcpy(&fd, in + i, sizeof fd);
      if (r->nfds == READER_MAX_HELD_FDS) {
        close(fd);
        overflow = true;
        continue;
      }
      r->fds[r->nfds++] = (struct held_fd){fd, read_end};
    }
  }
  if (overflow || (msg.msg_flags & MSG_CTRUNC)) return -EPROTO;
  return n;
}

/* The length a buffered frame announces (at least 4 bytes buffered). */
static uint32_t announced(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Whether a whole frame (or an oversized one) is buffered. */
int frame_reader_ready(const frame_reader *r) {
  size_t avail = r->end - r->start;
  if (avail < 4) return 0;
  uint32_t len = announced(r->buf + r->start);
  return len > r->max_len || avail >= 4 + (size_t)len;
}

/* Take the next complete frame with the fds that arrived inside it. */
int frame_reader_next(frame_reader *r, struct frame *out) {
  size_t avail = r->end - r->start;
  if (avail < 4) return 0;
  const uint8_t *p = r->buf + r->start;
  uint32_t len = announced(p);
  if (len > r->max_len) return -EMSGSIZE;
  if (avail < 4 + (size_t)len) return 0;
  uint64_t frame_end = r->base + 4 + len;
  size_t k = 0;
  while (k < r->nfds && r->fds[k].end <= frame_end) k++;
  struct frame f = {0};
  f.data = malloc(len ? len : 1);
  f.fds = malloc((k ? k : 1) * sizeof(int));
  if (!f.data || !f.fds) {
    free(f.data);
    free(f.fds);
    return -ENOMEM;
  }
  memcpy(f.data, p + 4, len);
  f.len = len;
  for (size_t i = 0; i < k; i++) f.fds[i] = r->fds[i].fd;
  f.nfds = k;
  memmove(r->fds, r->fds + k, (r->nfds - k) * sizeof *r->fds);
  r->nfds -= k;
  r->start += 4 + (size_t)len;
  r->base = frame_end;
  *out = f;
  return 1;
}

/* Bytes buffered that do not yet form a whole frame. */
size_t frame_reader_pending(const frame_reader *r) { return r->end - r->start; }

/* Fds not yet taken by a whole frame. */
size_t frame_reader_held_fds(const frame_reader *r) { return r->nfds; }

/* One queued frame: length prefix and payload, and its fds until sent. */
struct out_frame {
  struct out_frame *next;
  uint8_t *bytes;
  size_t len, off;
  int *fds;
  size_t nfds;
};

struct frame_writer {
  struct out_frame *head, *tail;
  size_t queued;
  size_t queued_fds; /* fds of frames not yet sent */
  size_t *total; /* a sum over queues to keep up to date, or NULL */
};

/* Count n more (or fewer) bytes queued, here and in the shared total. */
static void writer_count(frame_writer *w, size_t n, bool add) {
  w->queued = add ? w->queued + n : w->queued - n;
  if (w->total) *w->total = add ? *w->total + n : *w->total - n;
}

/* Create an empty queue of outgoing frames. */
frame_writer *frame_writer_create(void) { return calloc(1, sizeof(frame_writer)); }

static void out_frame_free(struct out_frame *o) {
  close_fds(o->fds, o->nfds);
  free(o->fds);
  free(o->bytes);
  free(o);
}

/* Destroy a queue, closing the fds of frames never sent. */
void frame_writer_destroy(frame_writer *w) {
  if (!w) return;
  writer_count(w, w->queued, false);
  while (w->head) {
    struct out_frame *o = w->head;
    w->head = o->next;
    out_frame_free(o);
  }
  free(w);
}

/* Queue a frame; the queue owns the fds from here on. */
int frame_writer_push(frame_writer *w, const void *payload, size_t len,
                      const int *fds, size_t nfds) {
  struct out_frame *o = NULL;
  int err = -EINVAL;
  if (nfds > FRAME_MAX_FDS || len > UINT32_MAX) goto fail;
  err = -ENOMEM;
  if (!(o = calloc(1, sizeof *o))) goto fail;
  if (!(o->bytes = malloc(4 + len))) goto fail;
  if (nfds && !(o->fds = malloc(nfds * sizeof(int)))) goto fail;
  uint32_t l = (uint32_t)len;
  o->bytes[0] = (uint8_t)l;
  o->bytes[1] = (uint8_t)(l >> 8);
  o->bytes[2] = (uint8_t)(l >> 16);
  o->bytes[3] = (uint8_t)(l >> 24);
  if (len) memcpy(o->bytes + 4, payload, len);
  o->len = 4 + len;
  if (nfds) memcpy(o->fds, fds, nfds * sizeof(int));
  o->nfds = nfds;
  w->queued_fds += nfds;
  if (w->tail)
    w->tail->next = o;
  else
    w->head = o;
  w->tail = o;
  writer_count(w, o->len, true);
  return 0;
fail:
  if (o) {
    free(o->bytes);
    free(o->fds);
    free(o);
  }
  for (size_t i = 0; i < nfds; i++) close(fds[i]);
  return err;
}

/* One sendmsg of bytes with fds riding with them. */
ssize_t frame_sendmsg(int sock, const void *bytes, size_t len, const int *fds, size_t nfds,
                      int flags) {
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(FRAME_MAX_FDS * sizeof(int))];
  } ctl;
  struct iovec iov = {(void *)bytes, len};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
  if (nfds > FRAME_MAX_FDS) {
    errno = EINVAL;
    return -1;
  }
  if (nfds) {
    msg.msg_control = ctl.buf;
    msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
    memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
  }
  return sendmsg(sock, &msg, MSG_NOSIGNAL | flags);
}

/* Send frames in order; a frame's fds go with its first byte. */
int frame_writer_flush(frame_writer *w, int sock) {
  while (w->head) {
    struct out_frame *o = w->head;
    ssize_t n;
    do
      n = frame_sendmsg(sock, o->bytes + o->off, o->len - o->off, o->fds, o->nfds, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0) return errno == EWOULDBLOCK ? -EAGAIN : -errno;
    /* The fds went with these bytes; our copies are no longer needed. */
    close_fds(o->fds, o->nfds);
    w->queued_fds -= o->nfds;
    o->nfds = 0;
    o->off += (size_t)n;
    writer_count(w, (size_t)n, false);
    if (o->off < o->len) continue;
    w->head = o->next;
    if (!w->head) w->tail = NULL;
    out_frame_free(o);
  }
  return 0;
}

/* Bytes queued and not yet sent. */
size_t frame_writer_queued(const frame_writer *w) { return w->queued; }

/* Fds queued and not yet sent. */
size_t frame_writer_queued_fds(const frame_writer *w) { return w->queued_fds; }

/* Keep a shared total of queued bytes up to date from now on. */
void frame_writer_count_into(frame_writer *w, size_t *total) {
  w->total = total;
  if (total) *total += w->queued;
}

/* Drop the frames not yet started; a half-sent head stays. */
size_t frame_writer_drop_unsent(frame_writer *w) {
  struct out_frame *keep = w->head && w->head->off ? w->head : NULL;
  struct out_frame *o = keep ? keep->next : w->head;
  size_t dropped = 0;
  while (o) {
    struct out_frame *next = o->next;
    dropped += o->len;
    out_frame_free(o);
    o = next;
  }
  if (keep) keep->next = NULL;
  w->head = w->tail = keep;
  writer_count(w, dropped, false);
  return dropped;
}
