/* The owner's half of a backup: a worker copies a BACKUP buffer's
 * contents into the backup memory an Unmap hands it, or out of the
 * memory a Remap hands it, with its own device context, so that the
 * daemon needs none (protocol 1.7, BackupMemory). The memory is imported
 * and mapped end to end in a range of its own (a backup map), and either
 * kept mapped for the buffer's next pauses and resumes (the daemon then
 * hands it by reference: kept) or let go of entirely after the one copy,
 * as a worker that may have its context released must (a process that
 * still imports host-NUMA memory cannot be restored by the driver). */
#ifndef GPUMEM_CLIENT_BACKUP_IO_H
#define GPUMEM_CLIENT_BACKUP_IO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/gpuva.h"
#include "gpumem.h"

/* Backup memory mapped here: n pieces imported as handles, mapped end to
 * end at va (total bytes, access set for the device). All zero: none. */
struct backup_map {
  void *va;
  uint64_t total;
  size_t n;
  uint64_t *handles;
  uint64_t *sizes;
  bool files; /* files mapped read only in host memory (backup_io_map_files):
               * no handles, never copied through */
};

/* Import n pieces (their sizes, one fd each, taken: set to -1) on dev
 * and map them end to end. Returns 0, or a GPUMEM_E_* code with
 * error_set's words and nothing left mapped or imported. */
int backup_io_map(gpuva *g, unsigned dev, const uint64_t *sizes, size_t n, int *fds,
                  struct backup_map *m);

/* Map n files (their sizes, one fd each, taken: closed) read only, end
 * to end, in host memory: a backup read while paused from the daemon's
 * --backup-dir, or copied into this process's own memfd. Each file must
 * hold its size (a shorter one would fault its reader). Returns 0, or a
 * GPUMEM_E_* code with error_set's words and nothing left mapped. */
int backup_io_map_files(const uint64_t *sizes, size_t n, int *fds, struct backup_map *m);

/* Unmap and release what backup_io_map or backup_io_map_files made (nothing for none); m is
 * then none. */
void backup_io_unmap(gpuva *g, unsigned dev, struct backup_map *m);

/* Copy size bytes mapped at mem on dev (buffer id's, for the words) into
 * (to_backup) or out of backup map m, which must cover them, and wait for
 * the copy. Returns 0, or a GPUMEM_E_* code with error_set's words. */
int backup_io_copy(gpuva *g, unsigned dev, void *mem, uint64_t size, uint64_t id,
                   const struct backup_map *m, bool to_backup);

#endif
