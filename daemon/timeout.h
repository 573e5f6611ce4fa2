/* An owner that does not ack in time, under --timeout-policy kill: its
 * process is killed, or, where it cannot be signalled, its session ends
 * as if it had died. Under the report policy nothing here runs: the
 * engine only reports such owners and holds their buffers. */
#ifndef GPUMEMD_TIMEOUT_H
#define GPUMEMD_TIMEOUT_H

#include <stdbool.h>
#include <stddef.h>

#include "outbox.h"

/* Kill owner o (the outbox's stop: through the pidfd its session pinned
 * at connect); its buffers then go with its session when it dies. One
 * that cannot be signalled (pid 0: another pid namespace; not pinned; the
 * process that connected is gone) has its session ended now instead (the
 * outbox's end, with CLIENT_TIMEOUT). Says what happened in what; returns
 * true when the session was ended (its buffers are freed, not held). */
bool timeout_kill(const struct outbox *out, struct owner *o, char *what, size_t len);

#endif
