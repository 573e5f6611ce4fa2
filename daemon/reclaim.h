/* Taking the node back after a restart, by the journal (journal.h) of
 * the daemon before: its tags come back at once with their owners,
 * shares, paused marks and generations, and each of its buffers waits for
 * its worker to re-register it, which must prove it its own (its uid, its
 * secret) and say what it is (tag, device, size, flags) as the journal
 * does. What no worker claims within the grace is forgotten. */
#ifndef GPUMEMD_RECLAIM_H
#define GPUMEMD_RECLAIM_H

#include <stdint.h>

#include "common/wire.h"
#include "fault.h"
#include "journal.h"
#include "registry.h"

/* Make the journal's tags in reg, each keeping (registry_expect) the
 * journal's buffers of its name, and number new buffers above the
 * journal's. False when out of memory. */
bool reclaim_restore(registry *reg, journal *j);

/* Whether every buffer of a re-registration by uid is one the journal
 * expects: OK, else PERMISSION_DENIED (no secret, not one the daemon
 * before gave this uid or not with this secret, already back, named
 * twice: the words do not tell another uid's buffer from none) or
 * INVALID_ARGUMENT (the holder's own buffer, said to be something else),
 * naming the buffer, with nothing changed. */
wire_code reclaim_check(const journal *j, uint32_t uid, const Gpumem__Wire__AdoptRequest *a,
                        struct fault *f);

/* The buffers of a re-registration that reclaim_check passed are back:
 * no longer expected, their tags no longer kept for them. */
void reclaim_claim(registry *reg, journal *j, const Gpumem__Wire__AdoptRequest *a);

/* The grace is over: forget (and log) each buffer no worker claimed, and
 * the tags kept only for them. */
void reclaim_expire(registry *reg, journal *j);

#endif
