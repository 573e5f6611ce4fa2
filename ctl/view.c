/* The words and orders gpumemctl's views share. */
#include "ctl/view.h"

#include <stdio.h>

/* A tag's state as people read it. */
const char *view_tag_state(const struct gpumem_tag_status *t) {
  if (!t->transit_buffers && t->mixed) return "mixed";
  return gpumem_state_name(t->state);
}

/* A device's number as people read it. */
const char *view_device(int device, unsigned node, char *buf, size_t len) {
  if (device < 0) snprintf(buf, len, "node %u", node);
  else if ((unsigned)device == node) snprintf(buf, len, "%d", device);
  else snprintf(buf, len, "%d (node %u)", device, node);
  return buf;
}

/* Largest residual first. */
int view_by_residual(const void *x, const void *y) {
  const struct gpumem_process_status *a = *(const struct gpumem_process_status *const *)x;
  const struct gpumem_process_status *b = *(const struct gpumem_process_status *const *)y;
  return a->residual < b->residual ? 1 : a->residual > b->residual ? -1 : 0;
}
