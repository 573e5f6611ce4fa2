/* The re-registration grace: for a while after the daemon starts, an
 * allocation that would make a new tag waits, so that the workers of the
 * daemon before it re-register their tags first, and no other uid takes
 * a tag's name in the meantime (the tag belongs to its first uid). */
#ifndef GPUMEMD_GRACE_H
#define GPUMEMD_GRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "common/wire.h"

struct session;
typedef struct grace grace;

/* What serves a waiting allocation once the grace ends. */
typedef void (*grace_serve_fn)(void *ctx, struct session *s, uint64_t id,
                               const Gpumem__Wire__AllocRequest *a);

/* What learns that the grace ended (after what waited was served). */
typedef void (*grace_ended_fn)(void *ctx);

/* A grace of ms from now on loop (0: none), serve called for each waiting
 * allocation when it ends, in arrival order, then ended (NULL: nothing);
 * NULL when out of memory. */
grace *grace_create(uv_loop_t *loop, uint64_t ms, grace_serve_fn serve, grace_ended_fn ended,
                    void *ctx);

/* End a grace that runs now, as its timer would. */
void grace_end(grace *g);

/* Whether the grace still runs. */
bool grace_active(const grace *g);

/* Milliseconds the grace still runs (0: over, or none; NULL is fine). */
uint64_t grace_left_ms(const grace *g);

/* Allocations waiting for the grace to end (NULL is fine). */
size_t grace_waiting(const grace *g);

/* Keep an allocation (copied) of session s of uid, request id, until the
 * grace ends. Returns 0, -EDQUOT when 256 of uid's wait already, -ENOSPC
 * when 65536 wait, or -ENOMEM (then nothing is kept). */
int grace_defer(grace *g, struct session *s, uint32_t uid, uint64_t id,
                const Gpumem__Wire__AllocRequest *a);

/* Drop the waiting allocations of a session that ended. */
void grace_forget(grace *g, struct session *s);

/* Drop every waiting allocation and close the timer (the loop frees it). */
void grace_destroy(grace *g);

#endif
