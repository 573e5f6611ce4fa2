/* A resume's device memory, all or none: created for every selected
 * buffer that has none before anything is sent, or, where any creation
 * fails, for none of them (what was made is released again). */
#ifndef GPUMEMD_RESUME_MEMORY_H
#define GPUMEMD_RESUME_MEMORY_H

#include <stdbool.h>
#include <stddef.h>

#include "fault.h"
#include "gpu/gpudev.h"
#include "registry.h"

/* Create memory for each of the n buffers that has none, marking made[i];
 * on the first failure release what was made and return false with f
 * saying why ("...; nothing resumed", and for want of memory how much the
 * device needs and has free). */
bool resume_memory_make(registry *reg, gpudev *g, struct buffer **bufs, bool *made, size_t n,
                        struct fault *f);

/* Fill f: device dev lacks the needed bytes for a resume (OUT_OF_MEMORY,
 * with what the driver says is free). */
void resume_memory_short(struct fault *f, gpudev *g, unsigned dev, uint64_t needed);

/* Release the memory of each buffer made[i] says this resume created. */
void resume_memory_undo(registry *reg, struct buffer **bufs, const bool *made, size_t n);

#endif
