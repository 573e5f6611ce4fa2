#include "resume_memory.h"

#include <stdio.h>
#include <string.h>

/* Release what a resume made before it sent anything. */
void resume_memory_undo(registry *reg, struct buffer **bufs, const bool *made, size_t n) {
  for (size_t j = 0; j < n; j++)
    if (made[j]) registry_memory_release(reg, bufs[j]);
}

/* Say how much a device lacks. */
void resume_memory_short(struct fault *f, gpudev *g, unsigned dev, uint64_t needed) {
  struct gpudev_mem m = {0};
  gpudev_mem_detail(g, dev, &m);
  fault_set(f, GPUMEM__WIRE__ERROR_CODE__OUT_OF_MEMORY,
            "device %u: resume needs %llu bytes, %llu free; nothing resumed", dev,
            (unsigned long long)needed, (unsigned long long)m.free);
  f->bytes_free = m.free;
  f->bytes_needed = needed;
  f->device = dev;
}

/* Create memory for every buffer that has none, or for none of them. */
bool resume_memory_make(registry *reg, gpudev *g, struct buffer **bufs, bool *made, size_t n,
                        struct fault *f) {
  for (size_t i = 0; i < n; i++) {
    if (bufs[i]->has_memory) continue;
    if (!registry_memory_create(reg, bufs[i], f)) {
      made[i] = true;
      continue;
    }
    uint64_t needed = 0;
    for (size_t j = 0; j < n; j++)
      if (bufs[j]->device == bufs[i]->device && (!bufs[j]->has_memory || made[j]))
        needed += bufs[j]->size;
    resume_memory_undo(reg, bufs, made, n);
    size_t len = strlen(f->text);
    snprintf(f->text + len, sizeof f->text - len, "; nothing resumed");
    if (f->code == GPUMEM__WIRE__ERROR_CODE__OUT_OF_MEMORY)
      resume_memory_short(f, g, bufs[i]->device, needed);
    return false;
  }
  return true;
}
