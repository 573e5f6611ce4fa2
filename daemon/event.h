/* The events the daemon sends a buffer's owner: Unmap (one for a group of
 * buffers) and Remap (the buffers again, with their chunks' fds, split so
 * that no frame carries more than FRAME_MAX_FDS). Ids are the engine's;
 * an owner acks each event by its id. */
#ifndef GPUMEMD_EVENT_H
#define GPUMEMD_EVENT_H

#include <stddef.h>
#include <stdint.h>

#include "outbox.h"
#include "registry.h"

/* Send o Unmap event id for the n buffers ids. */
void event_send_unmap(const struct outbox *out, struct owner *o, uint64_t id,
                      const uint64_t *ids, size_t n);

/* How many Remap events the n buffers ids take. */
size_t event_remap_count(registry *reg, const uint64_t *ids, size_t n);

/* Send o the Remap events first_id, first_id + 1, ... (event_remap_count
 * of them) for the n buffers ids, with fds (every chunk's, in id and chunk
 * order; each one sent is set to -1: the outbox owns it), and set ends[k]
 * to the index after the last buffer event k carries. Returns 0, or -1
 * when a send failed (the session then ends). */
int event_send_remap(const struct outbox *out, struct owner *o, registry *reg, uint64_t first_id,
                     const uint64_t *ids, size_t n, int *fds, size_t *ends);

#endif
