/* The frame codec over socketpairs: partial I/O, fds riding with frames,
 * oversized and truncated frames. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/frame.h"
#include "harness.h"

static int sv[2];

static void pair_setup(void) {
  harness_fd_setup();
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv), 0);
}

static void pair_teardown(void) {
  close(sv[0]);
  close(sv[1]);
  harness_fd_teardown();
}

/* Read until one frame is complete (or the stream ends). */
static int read_frame(frame_reader *r, struct frame *f) {
  for (int i = 0; i < 100000; i++) {
    int rc = frame_reader_next(r, f);
    if (rc != 0) return rc;
    ssize_t n = frame_reader_fill(r, sv[1]);
    if (n == 0) return 0;
    if (n < 0 && n != -EAGAIN) return (int)n;
  }
  return 0;
}

static int memfd(void) { return memfd_create("t", MFD_CLOEXEC); }

static ino_t inode(int fd) {
  struct stat st;
  fstat(fd, &st);
  return st.st_ino;
}

START_TEST(frames_arrive_whole_and_in_order) {
  frame_writer *w = frame_writer_create();
  frame_reader *r = frame_reader_create(1 << 20);
  for (int i = 0; i < 10; i++) {
    char msg[32];
    int n = snprintf(msg, sizeof msg, "frame %d", i);
    ck_assert_int_eq(frame_writer_push(w, msg, (size_t)n, NULL, 0), 0);
  }
  ck_assert_int_eq(frame_writer_push(w, "", 0, NULL, 0), 0);
  ck_assert_int_eq(frame_writer_flush(w, sv[0]), 0);
  for (int i = 0; i < 10; i++) {
    struct frame f;
    char want[32];
    snprintf(want, sizeof want, "frame %d", i);
    ck_assert_int_eq(read_frame(r, &f), 1);
    ck_assert_uint_eq(f.len, strlen(want));
    ck_assert(memcmp(f.data, want, f.len) == 0);
    ck_assert_uint_eq(f.nfds, 0);
    frame_release(&f);
  }
  struct frame f;
  ck_assert_int_eq(read_frame(r, &f), 1);
  ck_assert_uint_eq(f.len, 0);
  frame_release(&f);
  frame_writer_destroy(w);
  frame_reader_destroy(r);
}
END_TEST

/* A frame larger than the socket buffer goes out in pieces with EAGAIN in
 * between, and comes in in pieces. */
START_TEST(partial_writes_and_reads_reassemble) {
  int small = 4096;
  setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof small);
  setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  size_t len = 3 << 20;
  unsigned char *big = malloc(len);
  for (size_t i = 0; i < len; i++) big[i] = (unsigned char)(i * 7);
  frame_writer *w = frame_writer_create();
  frame_reader *r = frame_reader_create(4 << 20);
  int fd = memfd();
  ino_t ino = inode(fd);
  ck_assert_int_eq(frame_writer_push(w, big, len, &fd, 1), 0);
  ck_assert_int_eq(frame_writer_push(w, "tail", 4, NULL, 0), 0);
  int eagain = 0, rc;
  struct frame f = {0}, g = {0};
  int got = 0;
  while ((rc = frame_writer_flush(w, sv[0])) == -EAGAIN || got < 2) {
    if (rc == -EAGAIN) eagain++;
    ck_assert(rc == 0 || rc == -EAGAIN);
    ssize_t n = frame_reader_fill(r, sv[1]);
    ck_assert(n > 0 || n == -EAGAIN);
    if (got == 0 && frame_reader_next(r, &f) == 1) got = 1;
    if (got == 1 && frame_reader_next(r, &g) == 1) got = 2;
  }
  ck_assert_int_gt(eagain, 0);
  ck_assert_uint_eq(frame_writer_queued(w), 0);
  ck_assert_uint_eq(f.len, len);
  ck_assert(memcmp(f.data, big, len) == 0);
  ck_assert_uint_eq(f.nfds, 1);
  ck_assert_uint_eq(inode(f.fds[0]), ino);
  ck_assert_int_eq(fcntl(f.fds[0], F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
  ck_assert_uint_eq(g.len, 4);
  ck_assert_uint_eq(g.nfds, 0);
  frame_release(&f);
  frame_release(&g);
  free(big);
  frame_writer_destroy(w);
  frame_reader_destroy(r);
}
END_TEST

/* Each frame gets exactly the fds sent with it, even when several frames
 * arrive in one read. */
START_TEST(fds_stay_with_their_frames) {
  frame_writer *w = frame_writer_create();
  frame_reader *r = frame_reader_create(1 << 20);
  int a[2] = {memfd(), memfd()}, b = memfd();
  ino_t ia0 = inode(a[0]), ia1 = inode(a[1]), ib = inode(b);
  ck_assert_int_eq(frame_writer_push(w, "none", 4, NULL, 0), 0);
  ck_assert_int_eq(frame_writer_push(w, "two", 3, a, 2), 0);
  ck_assert_int_eq(frame_writer_push(w, "none", 4, NULL, 0), 0);
  ck_assert_int_eq(frame_writer_push(w, "one", 3, &b, 1), 0);
  ck_assert_int_eq(frame_writer_flush(w, sv[0]), 0);
  size_t want[4] = {0, 2, 0, 1};
  for (int i = 0; i < 4; i++) {
    struct frame f;
    ck_assert_int_eq(read_frame(r, &f), 1);
    ck_assert_uint_eq(f.nfds, want[i]);
    if (i == 1) {
      ck_assert_uint_eq(inode(f.fds[0]), ia0);
      ck_assert_uint_eq(inode(f.fds[1]), ia1);
    }
    if (i == 3) ck_assert_uint_eq(inode(f.fds[0]), ib);
    frame_release(&f);
  }
  frame_writer_destroy(w);
  frame_reader_destroy(r);
}
END_TEST

START_TEST(oversized_frame_is_refused) {
  frame_writer *w = frame_writer_create();
  frame_reader *r = frame_reader_create(16);
  char data[17] = {0};
  ck_assert_int_eq(frame_writer_push(w, data, sizeof data, NULL, 0), 0);
  ck_assert_int_eq(frame_writer_flush(w, sv[0]), 0);
  struct frame f;
  ck_assert_int_eq(read_frame(r, &f), -EMSGSIZE);
  frame_writer_destroy(w);
  frame_reader_destroy(r);
}
END_TEST

/* A peer that dies mid-frame leaves bytes that never make a frame. */
START_TEST(truncated_frame_never_completes) {
  unsigned char partial[] = {10, 0, 0, 0, 'a', 'b', 'c'};
  ck_assert_int_eq(write(sv[0], partial, sizeof partial), (ssize_t)sizeof partial);
  close(sv[0]);
  sv[0] = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0); /* for teardown */
  frame_reader *r = frame_reader_create(1 << 20);
  struct frame f;
  ck_assert_int_eq(read_frame(r, &f), 0);
  ck_assert_uint_eq(frame_reader_pending(r), sizeof partial);
  frame_reader_destroy(r);
}
END_TEST

/* More fds than a frame may carry are refused before anything is sent,
 * and the queue closes them. */
START_TEST(too_many_fds_refused_and_closed) {
  frame_writer *w = frame_writer_create();
  int fds[FRAME_MAX_FDS + 1];
  for (int i = 0; i <= FRAME_MAX_FDS; i++) fds[i] = memfd();
  ck_assert_int_eq(frame_writer_push(w, "x", 1, fds, FRAME_MAX_FDS + 1), -EINVAL);
  ck_assert_uint_eq(frame_writer_queued(w), 0);
  frame_writer_destroy(w);
}
END_TEST

/* Fds of frames never sent, or never taken, are closed with the queue. */
START_TEST(unsent_and_untaken_fds_are_closed) {
  frame_writer *w = frame_writer_create();
  int a = memfd(), b = memfd();
  ck_assert_int_eq(frame_writer_push(w, "one", 3, &a, 1), 0);
  ck_assert_int_eq(frame_writer_flush(w, sv[0]), 0);
  ck_assert_int_eq(frame_writer_push(w, "two", 3, &b, 1), 0);
  frame_writer_destroy(w); /* "two" never sent */
  frame_reader *r = frame_reader_create(1 << 20);
  ck_assert_int_gt(frame_reader_fill(r, sv[1]), 0);
  frame_reader_destroy(r); /* "one" read but never taken */
}
END_TEST

int main(void) {
  return HARNESS_RUN("frame", 20, pair_setup, pair_teardown,
                     frames_arrive_whole_and_in_order,
                     partial_writes_and_reads_reassemble,
                     fds_stay_with_their_frames,
                     oversized_frame_is_refused,
                     truncated_frame_never_completes,
                     too_many_fds_refused_and_closed,
                     unsent_and_untaken_fds_are_closed);
}
