/* Waiting, bounded, for owners whose sessions ended during a pause to
 * leave the driver's process list. The driver frees what a dead process
 * held a moment after its exit, not at once (on an H200, 16 GiB freed
 * 0.3 s after the session closed): judged at once, the pause would fail
 * with memory that is on its way back. The engine notes each owner that
 * ended while it waited for it, and before judging the pause waits until
 * none of those whose process exited is listed, or the bound has passed;
 * the reply says how long it waited and who was still listed. */
#ifndef GPUMEMD_EXITWAIT_H
#define GPUMEMD_EXITWAIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "gpu/gpudev.h"

typedef struct exitwait exitwait;

/* A waiter over the loop and the backend; NULL when out of memory. */
exitwait *exitwait_create(uv_loop_t *loop, gpudev *g);

/* Stop any wait (its callback is not called) and free the waiter once
 * the loop has closed its timer. */
void exitwait_destroy(exitwait *w);

/* Note that pid's session ended while the operation waited for it; a pid
 * noted twice is kept once. Out of host memory, the pid is not waited for. */
void exitwait_note(exitwait *w, int pid);

/* Forget the noted pids and the last wait's figures (a new operation). */
void exitwait_clear(exitwait *w);

/* Start waiting, at most limit_ms, for the noted pids to leave the
 * driver's list, polling it; those that still have a session (keep is
 * true for them), and those whose process lives on (the kernel does not
 * show it exited or exiting), are not waited for. Returns false when there is nothing
 * to wait for (none noted, none listed, or the driver lists no processes),
 * and then done is never called; else done(arg) is called from the loop
 * once none is listed or the bound has passed. */
bool exitwait_start(exitwait *w, uint32_t limit_ms, bool (*keep)(void *arg, int pid),
                    void (*done)(void *arg), void *arg);

/* What the last wait saw: how long it waited (ms), and the pids still
 * listed when it ended (the first max of them into out; returns how many
 * it wrote). */
size_t exitwait_result(const exitwait *w, uint32_t *waited_ms, uint32_t *out, size_t max);

#endif
