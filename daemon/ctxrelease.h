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
 * processes, while the loop serves on; one that does not release fails
 * the pause (NOT_RELEASED). A resume's restores run the same way. The
 * driver's calls are bounded: an operation goes on at most
 * --release-timeout after its releases or restores began, and one still
 * in the driver then fails it (a release counts as released until it
 * returns: a driver that never returns holds only that process).
 *
 * Nothing may stay held for ever: a released process whose last session
 * ends is restored; the daemon restores every released process when it
 * stops; and the released pids are kept in a journal file, so that a
 * daemon that died is followed by one that restores them at its start. */
#ifndef GPUMEMD_CTXRELEASE_H
#define GPUMEMD_CTXRELEASE_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "common/list.h"
#include "fault.h"
#include "gpu/gpudev.h"
#include "outbox.h"
#include "outcome.h"
#include "owner.h"
#include "registry.h"
#include "scope.h"

typedef struct ctxrelease ctxrelease;

/* Called from the loop when a pause's releases have ended. */
typedef void (*ctxrelease_done)(void *arg);

/* Release over the loop and backend g, the server's owners (struct
 * owner.link), reached through out; lock_ms bounds the wait for a
 * process's device calls to stop, limit_ms the driver's release or
 * restore of a process; the journal is kept at journal_path (NULL: none).
 * NULL out of memory. */
ctxrelease *ctxrelease_create(uv_loop_t *loop, gpudev *g, struct list *owners,
                              const struct outbox *out, const char *journal_path,
                              uint32_t lock_ms, uint32_t limit_ms);

/* Restore every process still released (waiting at most the bound for
 * the driver), remove the journal (or keep it for what is still held),
 * and free c once the loop has closed its handles. */
void ctxrelease_destroy(ctxrelease *c);

/* After a pause that asked for it (and that failed nothing): start
 * releasing each worker process owning a buffer sc covers, into o (one
 * entry each; the refusals and failures become o's failure at
 * outcome_fail_releases). requester: the pid that asked (where the
 * backend's release stops the whole process, as the host stand-in does,
 * it is refused). Returns true when releases run: done(arg) is called
 * once they have all ended, or the bound passed (o must live until then);
 * false when all was decided at once (done is not called). */
bool ctxrelease_pause(ctxrelease *c, const struct scope *sc, pid_t requester,
                      struct outcome *o, ctxrelease_done done, void *arg);

/* True while any session of pid is released, or its release or restore
 * is still in the driver. */
bool ctxrelease_holds(ctxrelease *c, pid_t pid);

/* Before a resume sends its remaps: start restoring each released
 * process among the owners of groups (struct group.link), into o. Returns
 * true when restores run: done(arg) is called once they have all ended,
 * or the bound passed, with later (the caller's, living until then) set
 * to the first that failed. f is set at once where one cannot start (a
 * release or restore of it still in the driver, no memory): the resume
 * then sends nothing, once any started restores ended (true) or at once
 * (false). */
bool ctxrelease_resume(ctxrelease *c, struct list *groups, struct outcome *o, struct fault *f,
                       struct fault *later, ctxrelease_done done, void *arg);

/* Session s has ended (it has left the owners list): restore its process
 * if it was released and no other session of it still is. */
void ctxrelease_forget(ctxrelease *c, struct owner *s);

/* Whether a release or restore is still in the driver on a thread of its
 * own (after ctxrelease_destroy: the backend must not be closed under it). */
bool ctxrelease_in_driver(void);

/* At the daemon's start: restore the processes the journal at
 * journal_path names that are still there and released (a daemon that
 * died left them so), then remove it. */
void ctxrelease_recover(gpudev *g, const char *journal_path);

#endif
