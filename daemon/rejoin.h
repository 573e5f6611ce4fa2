/* What a process whose session ended may take back from the same daemon.
 * The library reconnects at once when its connection drops while the
 * process lives on (the daemon cut the session, say), and re-registers
 * the buffers it holds; the daemon freed its side of them when the
 * session ended. Each such buffer is noted here, with its uid, pid and
 * secret and what it was (tag, device, size, flags), for REJOIN_KEEP_MS;
 * a re-registration that names one, from that uid and process, with that
 * secret, is its holder coming back, journal or not. At most REJOIN_MAX
 * are kept, the oldest going first. */
#ifndef GPUMEMD_REJOIN_H
#define GPUMEMD_REJOIN_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "journal.h"
#include "registry.h"

enum { REJOIN_KEEP_MS = 30000, REJOIN_MAX = 100000 };

typedef struct rejoin rejoin;

/* An empty set on loop (its timer is made at the first note); NULL out of
 * memory. */
rejoin *rejoin_create(uv_loop_t *loop);

/* Note buffer b of pid's session, which ended while pid lives (nothing is
 * noted out of memory: the buffer is then judged as after a restart). */
void rejoin_note(rejoin *r, const struct buffer *b, pid_t pid);

/* The buffer noted under id for pid, or NULL. */
const struct journal_buffer *rejoin_find(const rejoin *r, uint64_t id, pid_t pid);

/* The buffer noted under id is back: forget it. */
void rejoin_take(rejoin *r, uint64_t id);

/* Buffers noted now. */
size_t rejoin_count(const rejoin *r);

/* Forget everything and close the timer (rejoin_free once the loop ran). */
void rejoin_close(rejoin *r);

/* Free the set (NULL is fine). */
void rejoin_free(rejoin *r);

#endif
