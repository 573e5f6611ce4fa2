/* A pause's or resume's disk step, on a thread of its own: the backups of
 * its BACKUP_DISK buffers written to their files once its owners answered
 * (their host memory is then let go of), or read back into host memory
 * made for them before a resume hands anything out (backup_disk.h does
 * the I/O). The loop is told when it ends. */
#ifndef GPUMEMD_SPILL_H
#define GPUMEMD_SPILL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "backup_disk.h"
#include "gpu/gpudev.h"

/* One buffer's backup: which buffer, the memory's kind, and the transfer
 * (for a write, io.host and io.size; for a read, io.fd and io.size, and
 * io.host is made here). */
struct spill_item {
  uint64_t id;
  unsigned dev;
  bool pageable;
  struct backup_disk_item io;
};

typedef struct spill spill;

/* The step ended, on the loop thread: each item's io says how it went.
 * After a read, ok says whether every item was read (else no memory is
 * left made: each io.host is NULL). */
typedef void (*spill_done)(void *arg, struct spill_item *items, size_t n, bool ok);

/* Start writing (load false) or reading n items on a new thread. done
 * runs on the loop when it ends (items stay the caller's). NULL with why
 * when the thread cannot start (nothing was done). */
spill *spill_start(uv_loop_t *loop, backup_disk *d, gpudev *g, struct spill_item *items,
                   size_t n, bool load, spill_done done, void *arg, char *why, size_t whylen);

/* Wait for the step's thread, run done here and now, and free the step
 * (for a daemon that is stopping). */
void spill_finish(spill *s);

#endif
