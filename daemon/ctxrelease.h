/* Context release: a pause that asks for it (release_context) moves the
 * own device state of each worker process it covers (its CUDA context,
 * what it allocated itself: CUDA-graph pools, cuBLAS workspaces,
 * PyTorch's cached blocks) to host memory once that process maps nothing
 * of the daemon's, so that a paused node holds nothing; a resume brings
 * it back before it sends the process its remaps.
 *
 * A process is released only when every worker session of it opted in
 * (Hello.release_context), every buffer of those sessions is paused with
 * no memory, each of them said in its last Unmap ack that it maps nothing
 * of ours, it is the process its session pinned at connect, and it lives
 * in the daemon's pid namespace; else it is refused with the reason
 * (RELEASE_REFUSED, the pause itself still done). The backend releases it
 * (gpudev_process_release: the driver's checkpoint, checked against the
 * driver's process list) on a thread of its own, in parallel across
 * processes; one that does not release fails the pause (NOT_RELEASED).
 *
 * Nothing may stay held for ever: a released process whose last session
 * ends is restored; the daemon restores every released process when it
 * stops; and the released pids are kept in a journal file, so that a
 * daemon that died is followed by one that restores them at its start. */
#ifndef GPUMEMD_CTXRELEASE_H
#define GPUMEMD_CTXRELEASE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/list.h"
#include "fault.h"
#include "gpu/gpudev.h"
#include "outbox.h"
#include "outcome.h"
#include "owner.h"
#include "registry.h"
#include "scope.h"

typedef struct ctxrelease ctxrelease;

/* Release over backend g, the server's owners (struct owner.link), reached
 * through out; lock_ms bounds the wait for a process's device calls to
 * stop; the journal is kept at journal_path (NULL: none). NULL out of
 * memory. */
ctxrelease *ctxrelease_create(gpudev *g, struct list *owners, const struct outbox *out,
                              const char *journal_path, uint32_t lock_ms);

/* Restore every process still released, remove the journal, free c. */
void ctxrelease_destroy(ctxrelease *c);

/* After a pause that asked for it (and that failed nothing): release each
 * worker process owning a buffer sc covers, into o (one entry each; the
 * refusals and failures become o's failure at outcome_fail_releases).
 * requester: the pid that asked (where the backend's release stops the
 * whole process, as the host stand-in does, it is refused). */
void ctxrelease_pause(ctxrelease *c, const struct scope *sc, pid_t requester,
                      struct outcome *o);

/* True while any session of pid is released. */
bool ctxrelease_holds(ctxrelease *c, pid_t pid);

/* Before a resume sends its remaps: restore each released process among
 * the owners of groups (struct group.link), into o. False, with f set,
 * when one could not be restored (the resume then sends nothing). */
bool ctxrelease_resume(ctxrelease *c, struct list *groups, struct outcome *o, struct fault *f);

/* Session s has ended (it has left the owners list): restore its process
 * if it was released and no other session of it still is. */
void ctxrelease_forget(ctxrelease *c, struct owner *s);

/* At the daemon's start: restore the processes the journal at
 * journal_path names that are still there and released (a daemon that
 * died left them so), then remove it. */
void ctxrelease_recover(gpudev *g, const char *journal_path);

#endif
