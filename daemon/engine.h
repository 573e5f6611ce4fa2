/* The pause engine: runs controllers' pause and resume operations one at a
 * time, in order, through the two-phase protocol with the buffers' owners. */
#ifndef GPUMEMD_ENGINE_H
#define GPUMEMD_ENGINE_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "config.h"
#include "outbox.h"
#include "owner.h"
#include "registry.h"
#include "scope.h"
#include "stats.h"

struct grace;
typedef struct engine engine;

/* Create an engine over the registry; owners is the server's list of
 * struct owner.link (one per session), where scopes find the sessions they
 * name; everything the engine sends goes through out (which must outlive
 * it); each operation is counted and recorded in st as it runs. */
engine *engine_create(uv_loop_t *loop, registry *reg, gpudev *g, const struct config *cfg,
                      struct list *owners, const struct outbox *out, stats *st);

/* The re-registration grace (grace.h) the server runs: a pause naming a
 * tag that is not there yet says that it may be waiting for it. */
void engine_set_grace(engine *e, const struct grace *g);

/* Answer queued and running operations with SHUTTING_DOWN and free the
 * engine; closes its timer, so the loop must run once more before the
 * memory is gone. */
void engine_destroy(engine *e);

/* Queue a pause (or resume) of tags (none: every tag) on the devices in
 * devmask (0: all), of the buffers of the sessions scope selects (NULL:
 * all), answering request req_id of session ctl when done. timeout_ms (0:
 * the configured one) is capped; a pause with max_residual (0: none) fails
 * when a device it touched still holds more than that outside the daemon;
 * a pause with release_context then releases the device state of the
 * worker processes it covers (ctxrelease.h); a resume with wait_ms (0:
 * none) waits that long for room on a device that lacks it (capped at
 * --ack-timeout for a worker's own). */
void engine_submit(engine *e, struct owner *ctl, uint64_t req_id, bool resume,
                   char **tags, size_t ntags, uint64_t devmask,
                   uint32_t timeout_ms, uint64_t max_residual, uint32_t wait_ms,
                   bool release_context, const struct scope_spec *scope);

/* The driver's figures of the last pause that finished, per device it
 * touched (*n entries; none before the first). */
Gpumem__Wire__DeviceCheck *const *engine_last_checks(const engine *e, size_t *n);

/* A worker acknowledged event event_id. What an Unmap's ack released is
 * settled when the loop's turn ends, with the turn's other acks (one look
 * at each owner's process for all), or at engine_settle. */
void engine_ack(engine *e, struct owner *s, uint64_t event_id,
                const Gpumem__Wire__EventAck *ack);

/* Settle the Unmap acks read so far now (e may be NULL): called before
 * anything but an ack is served, and before a session's buffers are freed,
 * so that nothing sees a buffer its owner's ack has already settled as
 * still PAUSING. The operation's own end still comes at the turn's end. */
void engine_settle(engine *e);

/* True while process pid's device state is released (ctxrelease.h). */
bool engine_released(const engine *e, pid_t pid);

/* A session is ending: stop waiting for it and never answer it. Called
 * once its buffers are freed (its persistent ones handed to the keeper). */
void engine_forget(engine *e, struct owner *s);

#endif
