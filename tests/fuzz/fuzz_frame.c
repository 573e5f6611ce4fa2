/* libFuzzer: any byte stream, cut into writes of any sizes, some carrying
 * fds (SCM_RIGHTS), through the frame reader: frames come out whole and in
 * order, each with exactly the fds of the writes that ended inside it, or
 * the stream is refused; nothing crashes and no fd leaks.
 *
 * Input: steps, each a control byte and the bytes to write. The control
 * byte: bits 0-5 the write's size less one; bit 6: fds ride with it (a
 * count byte follows: 1-4, or with its top bit up to 127 + 1); bit 7:
 * the reader reads after this write (else writes pile up unread). */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/frame.h"
#include "tests/procfd.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_LEN 4096 /* the reader's limit on a payload */

/* A write that carried fds: where it ended in the stream, and how many. */
struct batch {
  size_t end;
  size_t n;
};

/* Die loudly: the reader broke its promise. */
static void fail(const char *what, size_t frame) {
  fprintf(stderr, "fuzz_frame: frame %zu: %s\n", frame, what);
  abort();
}

/* Write bytes with n fds (of /dev/null) in one sendmsg; false if the
 * socket took nothing. */
static bool send_with_fds(int sock, const uint8_t *p, size_t len, size_t n) {
  int fds[FRAME_MAX_FDS] = {0};
  size_t k = 0;
  for (; k < n; k++)
    if ((fds[k] = open("/dev/null", O_RDONLY | O_CLOEXEC)) < 0) break;
  ssize_t rc = frame_sendmsg(sock, p, len, fds, k, MSG_DONTWAIT);
  for (size_t i = 0; i < k; i++) close(fds[i]);
  return rc == (ssize_t)len && k == n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  int before = proc_fd_each(getpid(), NULL, NULL);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv) < 0) return 0;
  frame_reader *r = frame_reader_create(MAX_LEN);
  uint8_t *stream = malloc(size + 1); /* what was written, to check frames against */
  struct batch *batches = calloc(size + 1, sizeof *batches);
  size_t written = 0, nbatches = 0, at = 0;
  size_t next = 0;   /* stream offset of the next frame to come out */
  size_t frames = 0; /* frames out so far */
  size_t bi = 0;     /* the first batch not yet given to a frame */
  bool refused = false;
  while (at < size && !refused) {
    uint8_t ctl = data[at++];
    size_t nfds = 0;
    if (ctl & 0x40) {
      uint8_t k = at < size ? data[at++] : 0;
      nfds = k & 0x80 ? 1 + (k & 0x7f) : 1 + k % 4;
    }
    size_t step = 1 + (ctl & 0x3f);
    if (step > size - at) step = size - at;
    if (step == 0) break;
    if (!send_with_fds(sv[0], data + at, step, nfds)) break;
    memcpy(stream + written, data + at, step);
    written += step;
    at += step;
    if (nfds) batches[nbatches++] = (struct batch){written, nfds};
    if (!(ctl & 0x80) && at < size) continue;
    for (;;) {
      ssize_t n = frame_reader_fill(r, sv[1]);
      if (n == -EAGAIN) break;
      if (n < 0) { /* -EPROTO: more fds than a reader holds */
        refused = true;
        break;
      }
      struct frame f;
      int rc;
      while ((rc = frame_reader_next(r, &f)) > 0) {
        /* The frame is the next one in what was written... */
        if (written - next < 4) fail("came out before its length did", frames);
        const uint8_t *p = stream + next;
        size_t len = (size_t)p[0] | (size_t)p[1] << 8 | (size_t)p[2] << 16 | (size_t)p[3] << 24;
        if (f.len != len || written - next - 4 < len || (len && memcmp(f.data, p + 4, len)))
          fail("is not the frame that was written", frames);
        next += 4 + len;
        /* ...with the fds of every write that ended inside it. */
        size_t want = 0;
        while (bi < nbatches && batches[bi].end <= next) want += batches[bi++].n;
        if (f.nfds != want) fail("has the wrong fds", frames);
        frames++;
        frame_release(&f);
      }
      if (rc < 0) {
        refused = true;
        break;
      }
    }
  }
  frame_reader_destroy(r);
  close(sv[0]);
  close(sv[1]);
  free(stream);
  free(batches);
  if (proc_fd_each(getpid(), NULL, NULL) != before) fail("fds leaked", frames);
  return 0;
}
