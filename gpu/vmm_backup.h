/* The VMM backends' copies between chunks and host memory, and the host
 * memory for them (backups): the daemon's half's table entries
 * chunks_copy and backup_* (gpu/gpudev_ops.h), on a struct vmm_dev.
 * Internal to gpu/. */
#ifndef GPUMEM_GPU_VMM_BACKUP_H
#define GPUMEM_GPU_VMM_BACKUP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct vmm_dev;

/* Begin a call that leaves an allocation in dev's context (which it then
 * holds): under the gate, the context held and made current, the caller's
 * kept in *saved. 0, or -errno with nothing held and the gate left. */
int vmm_held_begin(struct vmm_dev *x, unsigned dev, int *saved);

/* End a call begun with vmm_held_begin whose vendor call (named call) had
 * status st: the caller's context back, the hold let go of where st is a
 * failure, the gate left. 0, or -errno. */
int vmm_held_end(struct vmm_dev *x, unsigned dev, int saved, int st, const char *call);

/* Begin freeing an allocation that holds dev's context: under the gate;
 * true with the context made current (the caller's kept in *saved), false
 * where it could not be (then nothing is to be freed in it). */
bool vmm_drop_begin(struct vmm_dev *x, unsigned dev, int *saved);

/* End what vmm_drop_begin began (entered: what it returned): the caller's
 * context back, the hold let go of, the gate left. */
void vmm_drop_end(struct vmm_dev *x, unsigned dev, int saved, bool entered);

/* Copy whole chunks to or from host memory in the device's context. */
int vmm_backup_copy(void *state, unsigned dev, const uint64_t *handles, const uint64_t *sizes,
                    size_t n, void *host, bool to_host);

/* A backup's address range, its pieces made by vmm_backup_make; holds the
 * device's context until vmm_backup_release. */
int vmm_backup_reserve(void *state, unsigned dev, uint64_t size, void **host);

/* Make one piece of a reserved backup: faulted in, then pinned. */
int vmm_backup_make(void *state, unsigned dev, void *host, uint64_t size, uint64_t off,
                    bool background);

/* Unpin the made pieces, let go of the context and unmap. */
void vmm_backup_release(void *state, unsigned dev, void *host, uint64_t size, uint64_t made);

/* One pinned allocation, in the device's context, held while it lives. */
int vmm_backup_alloc(void *state, unsigned dev, uint64_t size, void **host);

/* Free memory from vmm_backup_alloc and let go of its context. */
void vmm_backup_free(void *state, unsigned dev, void *host, uint64_t size);

/* Export a host-NUMA backup's pieces for its owner (gpudev_backup_export);
 * pinned backups: -ENOTSUP. */
int vmm_backup_export(void *state, unsigned dev, void *host, uint64_t size, int *fds,
                      uint64_t *sizes, size_t max, size_t *n);

/* Take the device's access to a host-NUMA backup away until its next
 * copy (gpudev_backup_host_only); pinned backups: nothing. */
void vmm_backup_host_only(void *state, unsigned dev, void *host);

#endif
