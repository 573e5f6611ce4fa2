/* The daemon's events to a worker: Unmap (before a pause releases the
 * memory) and Remap (a resume's new chunks), each answered by an ack that
 * names what failed; and the application's hooks around them. */
#ifndef GPUMEM_CLIENT_EVENTS_H
#define GPUMEM_CLIENT_EVENTS_H

#include <stddef.h>
#include <stdint.h>

#include "common/frame.h"
#include "common/wire.h"
#include "gpumem.h"
#include "buffers.h"

typedef struct events events;

/* Make the event handler of client c, which finds buffers in r. NULL
 * when out of memory. */
events *events_create(gpumem_client *c, buffers *r);

/* Keep the backup memory an event hands a buffer mapped with it for the
 * next events, which then hand it by reference (a Hello's keeps_backups;
 * never for a process whose context may be released). Set before the
 * first connection. */
void events_keep_backups(events *e, bool keep);

/* Free an event handler. */
void events_destroy(events *e);

/* Handle an Unmap or Remap (its fds in f, taken as used): run the hook,
 * unmap or map, and return the packed ack (malloc'd, *len bytes), or NULL
 * when out of memory for it. Runs with no library lock held. */
uint8_t *events_handle(events *e, const wire_env *env, struct frame *f, size_t *len);

#endif
