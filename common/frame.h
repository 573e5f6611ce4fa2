/* Length-prefixed frames with file descriptors over a non-blocking Unix
 * stream socket.
 *
 * On the wire a frame is a little-endian u32 payload length and the payload.
 * A frame's fds ride (SCM_RIGHTS) with the sendmsg that starts the frame.
 * Because the kernel ends a recvmsg right after the segment that carried
 * fds, every fd batch that arrives belongs to the frame holding the last
 * byte of that read; the reader uses this to give each frame exactly the
 * fds that came with it, so a peer that sends too many or too few is
 * caught by comparing with the count the message declares. */
#ifndef GPUMEM_FRAME_H
#define GPUMEM_FRAME_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* The most fds one frame may carry (the kernel's SCM_MAX_FD). */
#define FRAME_MAX_FDS 253

/* One received frame: the payload and the fds that came with it. */
struct frame {
  uint8_t *data; /* payload, owned by the frame */
  size_t len;
  int *fds; /* owned by the frame until taken (set to -1 when taken) */
  size_t nfds;
};

/* Release a frame's payload and close any fds still in it. */
void frame_release(struct frame *f);

typedef struct frame_reader frame_reader;

/* Create a reader that refuses payloads larger than max_len. */
frame_reader *frame_reader_create(size_t max_len);

/* Destroy a reader, closing fds it still holds. */
void frame_reader_destroy(frame_reader *r);

/* Read once from sock. Returns the bytes read, 0 at end of stream, -EAGAIN
 * when nothing is there, -EPROTO when the kernel had to drop fds (too many
 * for one read), or another negative errno. */
ssize_t frame_reader_fill(frame_reader *r, int sock);

/* Take the next complete frame. Returns 1 and fills *out, 0 if no complete
 * frame is buffered, -EMSGSIZE if the next frame is over the limit. */
int frame_reader_next(frame_reader *r, struct frame *out);

/* True when frame_reader_next would return a frame or an error, without
 * reading. */
int frame_reader_ready(const frame_reader *r);

/* Bytes buffered and not yet taken as frames: whole frames waiting to be
 * taken and a frame still arriving (0 at a frame edge with none waiting). */
size_t frame_reader_pending(const frame_reader *r);

/* Fds received and not yet taken by a whole frame: after frame_reader_next
 * returned 0, the fds parked in the frame still arriving. */
size_t frame_reader_held_fds(const frame_reader *r);

typedef struct frame_writer frame_writer;

/* Create an empty queue of outgoing frames. */
frame_writer *frame_writer_create(void);

/* Destroy a queue, closing the fds of frames never sent. */
void frame_writer_destroy(frame_writer *w);

/* Queue a payload (copied) with fds (owned by the queue from now on, closed
 * once sent). Returns 0, -EINVAL for too many fds or too long a payload,
 * -ENOMEM. On error the fds are closed all the same. */
int frame_writer_push(frame_writer *w, const void *payload, size_t len,
                      const int *fds, size_t nfds);

/* Send as much as the socket takes. Returns 0 when the queue is empty,
 * -EAGAIN when the socket is full, or another negative errno. */
int frame_writer_flush(frame_writer *w, int sock);

/* One sendmsg of bytes with nfds fds (at most FRAME_MAX_FDS) riding with
 * them (SCM_RIGHTS), never raising SIGPIPE; flags are sendmsg's others
 * (MSG_DONTWAIT, or 0). Returns what sendmsg returns; the fds stay the
 * caller's. */
ssize_t frame_sendmsg(int sock, const void *bytes, size_t len, const int *fds, size_t nfds,
                      int flags);

/* Bytes queued and not yet sent. */
size_t frame_writer_queued(const frame_writer *w);

/* Fds queued with frames not yet sent (the daemon holds them open). */
size_t frame_writer_queued_fds(const frame_writer *w);

/* Also keep *total up to date with the bytes this queue holds (a sum over
 * many queues); the bytes already queued are added now. */
void frame_writer_count_into(frame_writer *w, size_t *total);

/* Drop every frame not yet started, closing its fds; a frame half sent
 * stays, so that the stream can still end on a frame edge. Returns the
 * bytes dropped. */
size_t frame_writer_drop_unsent(frame_writer *w);

#endif
