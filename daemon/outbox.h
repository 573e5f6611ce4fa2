/* The outbox: how the engine reaches the sessions it works with, given to
 * it by the server (and by tests, a fake). The engine knows an owner
 * (owner.h) and nothing else of a session: it sends through these calls,
 * and ends or stops an owner through them. None of them calls back into
 * the engine. */
#ifndef GPUMEMD_OUTBOX_H
#define GPUMEMD_OUTBOX_H

#include <stddef.h>
#include <stdint.h>

#include "common/wire.h"
#include "fault.h"
#include "owner.h"

struct outbox {
  void *ctx; /* passed to every call */
  /* Queue a message with fds (consumed either way) for o: an event, or a
   * reply. Returns 0 or a negative errno; an owner that cannot queue has
   * its session ended on the loop's next turn, never inside this call. */
  int (*send)(void *ctx, struct owner *o, const wire_env *env, const int *fds, size_t nfds);
  /* Queue an Error for o: the answer to request id (0: to no request). */
  void (*send_error)(void *ctx, struct owner *o, uint64_t id, const struct fault *f);
  /* End o's session on the loop's next turn (its buffers are freed then),
   * after queueing f (when not NULL) for it. */
  void (*end)(void *ctx, struct owner *o, const struct fault *f);
  /* Kill o's process, through the pidfd its session pinned at connect.
   * Returns 0 when signalled, -ENOENT when its session has ended or is
   * ending, -EBADF when it was never pinned, -ESRCH when the process is
   * gone, or another negative errno. */
  int (*stop)(void *ctx, struct owner *o);
  /* Whether o's process is still the one its session pinned at connect:
   * 0, -EBADF when it was never pinned, -ESRCH when it is gone. */
  int (*pinned)(void *ctx, struct owner *o);
};

#endif
