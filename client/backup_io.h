/* The owner's half of a backup: a worker copies a BACKUP buffer's
 * contents into the backup memory an Unmap hands it, or out of the
 * memory a Remap hands it, with its own device context, so that the
 * daemon needs none (protocol 1.7, BackupMemory). The memory is imported,
 * mapped end to end in a range of its own for the one copy, and then let
 * go of entirely: nothing of it stays imported or mapped here. */
#ifndef GPUMEM_CLIENT_BACKUP_IO_H
#define GPUMEM_CLIENT_BACKUP_IO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpumem.h"

/* Copy mapped buffer b into (to_backup) or out of the backup memory of n
 * pieces (their sizes, one fd each, taken: set to -1), which must cover
 * the buffer. Returns 0, or a GPUMEM_E_* code with error_set's words. */
int backup_io_copy(gpumem_buffer *b, const uint64_t *sizes, size_t n, int *fds, bool to_backup);

#endif
