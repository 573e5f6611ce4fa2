/* Taking the node back after a restart, by the journal (journal.h) of
 * the daemon before: its tags come back at once with their owners,
 * shares, paused marks and generations, and each of its buffers waits for
 * its worker to re-register it, which must prove it its own (its uid, its
 * secret) and say what it is (tag, device, size, flags) as the journal
 * does. What no worker claims within the grace is forgotten. */
#ifndef GPUMEMD_RECLAIM_H
#define GPUMEMD_RECLAIM_H

#include <stdint.h>
#include <sys/types.h>

#include "common/wire.h"
#include "fault.h"
#include "fdstore.h"
#include "journal.h"
#include "registry.h"
#include "rejoin.h"

/* Make the journal's tags in reg, each keeping (registry_expect) the
 * journal's buffers of its name, and number new buffers above the
 * journal's. A persistent buffer no process held comes back at once, for
 * keeper, where systemd's fd store (store) passed its chunks back, and is
 * gone otherwise. False when out of memory. */
bool reclaim_restore(registry *reg, journal *j, fdstore *store, struct owner *keeper);

/* How a re-registered buffer is taken back. */
enum reclaim_kind {
  RECLAIM_NEW,     /* no daemon's record of it: the rules of a start without a journal */
  RECLAIM_JOURNAL, /* one the journal of the daemon before expects */
  RECLAIM_REJOIN,  /* one of its process's session on this daemon, which ended (rejoin.h) */
  RECLAIM_KEPT,    /* a persistent buffer the daemon kept since its process's session ended */
};

/* Judge each buffer of a re-registration by uid's process pid into
 * kinds (and for RECLAIM_KEPT, the buffer into kept; both room for every
 * buffer): one the daemon kept, or one noted in rj, must be pid's with
 * its secret and what it was; with a journal loaded (j; NULL: none) any
 * other must be one the journal expects, likewise. OK, else
 * PERMISSION_DENIED (no secret, not one given to this uid or not with
 * this secret, already back, named twice: the words do not tell another
 * uid's buffer from none), INVALID_ARGUMENT (the holder's own buffer,
 * said to be something else) or WRONG_STATE (a kept one paused or
 * resumed meanwhile), naming the buffer, with nothing changed. */
wire_code reclaim_check(registry *reg, const journal *j, const rejoin *rj, uint32_t uid,
                        pid_t pid, const Gpumem__Wire__AdoptRequest *a, enum reclaim_kind *kinds,
                        struct buffer **kept, struct fault *f);

/* Each buffer of a re-registration that reclaim_check judged
 * RECLAIM_JOURNAL stops counting against its uid's quotas as the
 * journal's (on false: its re-registration counts it), or counts again
 * (on true: that failed). From the daemon's start until it is back or its
 * wait ends, each buffer the journal expects counts against its uid's
 * quotas. */
void reclaim_charge(registry *reg, journal *j, const Gpumem__Wire__AdoptRequest *a,
                    const enum reclaim_kind *kinds, bool on);

/* The buffers of a re-registration that reclaim_check passed are back:
 * no longer expected, their tags no longer kept for them. */
void reclaim_claim(registry *reg, journal *j, const Gpumem__Wire__AdoptRequest *a);

/* The grace is over: forget (and log) each buffer no worker claimed, and
 * the tags kept only for them. */
void reclaim_expire(registry *reg, journal *j);

#endif
