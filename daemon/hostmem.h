/* Host memory for backups, made on libuv's thread pool: pinned host memory
 * takes seconds per tens of GiB, so it is made when a BACKUP buffer is
 * allocated, off the loop, and neither the alloc reply nor a later pause
 * waits for a fresh allocation. */
#ifndef GPUMEMD_HOSTMEM_H
#define GPUMEMD_HOSTMEM_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "gpu/gpu.h"

typedef struct hostmem_job hostmem_job;

/* A job that finished by itself, on the loop thread: host is the memory
 * (now the callee's), or NULL with why saying what failed. */
typedef void (*hostmem_done)(void *ctx, void *arg, void *host, const char *why);

/* Queue making size bytes of backup memory for device dev; done(ctx, arg,
 * ...) runs on the loop thread unless the job is taken or dropped first.
 * NULL when out of memory (nothing queued). */
hostmem_job *hostmem_start(uv_loop_t *loop, gpu *g, unsigned dev, uint64_t size,
                           hostmem_done done, void *ctx, void *arg);

/* The job's memory now, on the loop thread: a job that has not started is
 * cancelled and the memory made here; one that is running is waited for.
 * done never runs. Returns 0 with *host, or a negative errno with the
 * backend's words in why. */
int hostmem_take(hostmem_job *job, void **host, char *why, size_t whylen);

/* Give a job up: whatever it makes is freed when it finishes, and done
 * never runs. */
void hostmem_drop(hostmem_job *job);

#endif
