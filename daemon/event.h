/* The events the daemon sends a buffer's owner: Unmap (one for a group of
 * buffers, with the backup memory the owner copies into) and Remap (the
 * buffers again, with their chunks' fds and the backup memory the owner
 * copies out of, split so that no frame carries more than FRAME_MAX_FDS).
 * Ids are the group's (group_number); an owner acks each event by its id. */
#ifndef GPUMEMD_EVENT_H
#define GPUMEMD_EVENT_H

#include <stddef.h>
#include <stdint.h>

#include "group.h"
#include "outbox.h"
#include "registry.h"

/* Send g's owner its Unmap event (the group's first event id) for all of
 * its buffers, with the backup pieces handed (group_hand_backups; each fd
 * sent is set to -1: the outbox owns it). */
void event_send_unmap(const struct outbox *out, struct group *g);

/* How many Remap events g's buffers take. */
size_t event_remap_count(registry *reg, const struct group *g);

/* Send g's owner the Remap events g->first_event, + 1, ...
 * (event_remap_count of them) with g->fds (group_export's: every chunk's
 * and backup piece's, in id order; each one sent is set to -1: the outbox
 * owns it), and set g->ends[k] to the index after the last buffer event k
 * carries. Returns 0, or -1 when a send failed (the session then ends). */
int event_send_remap(const struct outbox *out, registry *reg, struct group *g);

#endif
