/* libFuzzer: any byte stream, cut into reads of any sizes, through the
 * frame reader: frames come out whole or the stream is refused, and
 * nothing crashes or leaks. */
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/frame.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv) < 0) return 0;
  frame_reader *r = frame_reader_create(4096);
  size_t at = 0;
  while (at < size) {
    /* The first byte of each step says how much goes in this write. */
    size_t step = 1 + data[at] % 64;
    at++;
    if (step > size - at) step = size - at;
    if (step && write(sv[0], data + at, step) < 0) break;
    at += step;
    if (frame_reader_fill(r, sv[1]) < 0) continue;
    struct frame f;
    int rc;
    while ((rc = frame_reader_next(r, &f)) > 0) frame_release(&f);
    if (rc < 0) break;
  }
  frame_reader_destroy(r);
  close(sv[0]);
  close(sv[1]);
  return 0;
}
