/* --verify-backups' check of a restore: the buffer's memory read back and
 * hashed, against the hash its backup had when it was made. */
#ifndef GPUMEMD_BACKUP_VERIFY_H
#define GPUMEMD_BACKUP_VERIFY_H

#include "fault.h"
#include "gpu/gpudev.h"
#include "registry.h"

/* Read buffer b's memory back from g and compare its hash with
 * b->backup_hash: OK, or BACKEND_ERROR (logged with both hashes) when it
 * differs or cannot be read, INTERNAL out of host memory, with f set. */
wire_code backup_verify(gpudev *g, const struct buffer *b, struct fault *f);

#endif
