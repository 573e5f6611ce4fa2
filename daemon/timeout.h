/* An owner that does not ack in time, under --timeout-policy kill: its
 * process is killed, or, where it cannot be signalled, its session ends
 * as if it had died. Under the report policy nothing here runs: the
 * engine only reports such owners and holds their buffers. */
#ifndef GPUMEMD_TIMEOUT_H
#define GPUMEMD_TIMEOUT_H

#include <stdbool.h>
#include <stddef.h>

#include "group.h"
#include "outbox.h"
#include "outcome.h"

/* What an operation's timeout found: the owners that missed their acks
 * (pids, with what was done to each) and the buffers freed with sessions
 * that were ended. */
struct timeout_tally {
  char pids[200];
  int len;
  size_t owners;
  uint64_t ended_buffers, ended_bytes;
};

/* Kill owner o (the outbox's stop: through the pidfd its session pinned
 * at connect); its buffers then go with its session when it dies. One
 * that cannot be signalled (pid 0: another pid namespace; not pinned; the
 * process that connected is gone) has its session ended now instead (the
 * outbox's end, with CLIENT_TIMEOUT). Says what happened in what; returns
 * true when the session was ended (its buffers are freed, not held). */
bool timeout_kill(const struct outbox *out, struct owner *o, char *what, size_t len);

/* Count group g, whose owner missed its ack, into the tally and o: under
 * the kill policy (kill) its owner is killed, or its session ended and its
 * buffers then freed, not held; else its buffers are held. */
void timeout_tally_group(struct timeout_tally *t, const struct group *g, registry *reg,
                         const struct outbox *out, bool kill, struct outcome *o);

/* Make the timeout the operation's failure (CLIENT_TIMEOUT, naming the
 * owners and what is held), an earlier failure following it. */
void timeout_fail(struct outcome *o, const struct timeout_tally *t, uint32_t timeout_ms,
                  bool nothing_resumed);

#endif
