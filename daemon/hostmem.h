/* Host memory for backups, made on libuv's thread pool: pinned host memory
 * takes seconds per tens of GiB, so it is made when a BACKUP buffer is
 * allocated, off the loop, and neither the alloc reply nor a later pause
 * waits for a fresh allocation.
 *
 * A job makes its memory a GPUDEV_BACKUP_PIECE at a time (gpudev_backup_make):
 * pinning a whole buffer in one driver call held the driver's lock for
 * about 450 ms per GiB on an H200, and the loop's next cuMemCreate and
 * export waited for it (16 fresh BACKUP buffers of 1 GiB took 7.2 s to
 * allocate). Per piece, the loop's driver calls get in between pieces and
 * wait for at most the piece being pinned. A pause that finds a job
 * unfinished takes it: it waits for the piece in progress, if any, and
 * makes the rest itself; each piece is made once. */
#ifndef GPUMEMD_HOSTMEM_H
#define GPUMEMD_HOSTMEM_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "gpu/gpudev.h"

typedef struct hostmem_job hostmem_job;

/* A job that finished by itself, on the loop thread: host is the memory
 * (now the callee's, freed with hostmem_free), or NULL with why saying
 * what failed. */
typedef void (*hostmem_done)(void *ctx, void *arg, void *host, const char *why);

/* Queue reserving size bytes of backup memory for device dev and making
 * its pieces, all on the thread pool (the loop maps nothing: an mmap there
 * would wait for the mmap lock that faulting memory in holds); done(ctx,
 * arg, ...) runs on the loop thread unless the job is taken or dropped
 * first. NULL (nothing queued) when the job cannot be queued, with why. */
hostmem_job *hostmem_start(uv_loop_t *loop, gpudev *g, unsigned dev, uint64_t size,
                           hostmem_done done, void *ctx, void *arg, char *why, size_t whylen);

/* The job's memory now, on the loop thread: the pool thread makes no
 * further piece, the piece it is making (if any) is waited for, and the
 * rest are made here. done never runs. Returns 0 with *host, or a negative
 * errno with the backend's words in why (then nothing is left). */
int hostmem_take(hostmem_job *job, void **host, char *why, size_t whylen);

/* Give a job up: no further piece is made, what was made is freed once the
 * piece in progress ends, and done never runs. */
void hostmem_drop(hostmem_job *job);

/* Make size bytes of backup memory for dev here and now, piece by piece.
 * Returns 0 with *host, or a negative errno with the backend's words in
 * why. */
int hostmem_make(gpudev *g, unsigned dev, uint64_t size, void **host, char *why, size_t whylen);

/* Free backup memory from hostmem_take, hostmem_make or a done callback. */
void hostmem_free(gpudev *g, unsigned dev, void *host, uint64_t size);

#endif
