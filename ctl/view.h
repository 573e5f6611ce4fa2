/* What every gpumemctl view of the status (status, top) words the same
 * way: a tag's state, a device's number, the order of memory holders. */
#ifndef GPUMEM_CTL_VIEW_H
#define GPUMEM_CTL_VIEW_H

#include <stddef.h>

#include "gpumem.h"

/* A tag's state as people read it: "mixed" when neither ACTIVE nor PAUSED
 * covers its buffers and none is in transit, else the state's name. */
const char *view_tag_state(const struct gpumem_tag_status *t);

/* A device as people read it, in buf: the number, and the daemon's where
 * it differs ("1 (node 3)", "node 3" where this process cannot see it). */
const char *view_device(int device, unsigned node, char *buf, size_t len);

/* qsort order of struct gpumem_process_status pointers: the most device
 * memory held outside gpumemd first. */
int view_by_residual(const void *x, const void *y);

#endif
