/* The keeper: the daemon's own owner of the persistent buffers no session
 * holds (their holder freed them or ended). The engine pauses and resumes
 * them like any owner's buffers, sending the keeper its Unmap and Remap
 * events through the outbox; the keeper maps nothing, so it answers each
 * event at once, on the loop's next turn (the outbox never calls back into
 * the engine), and the daemon copies their backups itself. */
#ifndef GPUMEMD_KEEPER_H
#define GPUMEMD_KEEPER_H

#include <stdint.h>
#include <uv.h>

#include "owner.h"

typedef struct keeper keeper;

/* Answer event event_id of owner o (the keeper's): done, nothing failed. */
typedef void (*keeper_ack_fn)(void *ctx, struct owner *o, uint64_t event_id);

/* Create the keeper on loop, answering its events through ack(ctx, ...).
 * NULL when out of memory. */
keeper *keeper_create(uv_loop_t *loop, keeper_ack_fn ack, void *ctx);

/* The keeper's owner: id UINT64_MAX, pid 0, uid 0, keeper set, a worker that
 * copies no backups. */
struct owner *keeper_owner(keeper *k);

/* An event was sent to the keeper: answer it on the loop's next turn.
 * 0, or -ENOMEM (the event goes unanswered and times out). */
int keeper_event(keeper *k, uint64_t event_id);

/* Stop answering (events queued are dropped) and close the keeper's
 * handle; the loop must run once more before keeper_free. */
void keeper_close(keeper *k);

/* Free a closed keeper, once no buffer is its any more. */
void keeper_free(keeper *k);

#endif
