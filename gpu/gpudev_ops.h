/* What a backend provides to the daemon's half: the table behind
 * gpu/gpudev.h, one per backend (host, and CUDA and HIP where built).
 * Internal to gpu/. */
#ifndef GPUMEM_GPU_GPUDEV_OPS_H
#define GPUMEM_GPU_GPUDEV_OPS_H

#include "gpu/gpudev.h"

struct gpudev_ops {
  const char *name;
  const char *built_with; /* the vendor headers compiled against (NULL: none) */
  const void *impl;       /* what open needs beyond the options (vendor table) */
  bool fd_per_chunk;      /* each chunk the daemon holds is one of its descriptors */
  bool release_stops;     /* a process release stops the whole process */
  int (*open)(const struct gpudev_ops *self, const struct gpudev_options *opt, void **state,
              char *err, size_t errlen);
  void (*close)(void *state);
  unsigned (*device_count)(void *state);
  uint64_t (*granularity)(void *state);
  int (*mem_info)(void *state, unsigned dev, uint64_t *free_bytes, uint64_t *total);
  /* Optional (NULL: -ENOTSUP, or mem_info's figures with no reserve). */
  int (*mem_detail)(void *state, unsigned dev, struct gpudev_mem *m);
  int (*processes)(void *state, unsigned dev, struct gpudev_process *out, size_t max, size_t *n);
  /* Optional (NULL: processes, read now). */
  int (*processes_since)(void *state, unsigned dev, uint64_t since_ns,
                         struct gpudev_process *out, size_t max, size_t *n);
  int (*processes_view)(void *state, unsigned dev, uint64_t since_ns,
                        struct gpudev_process *out, size_t max, size_t *n);
  int (*chunks_held_by)(void *state, int pid, const uint64_t *handles, size_t n, bool *held);
  /* NULL: pid is looked for in processes' list of each device. */
  int (*process_listed)(void *state, int pid);
  /* NULL (all three): the backend cannot release a process's state. */
  int (*process_release)(void *state, int pid, uint32_t lock_ms, uint64_t *moved);
  int (*process_restore)(void *state, int pid);
  int (*process_released)(void *state, int pid);
  int (*chunk_adopt)(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle);
  int (*chunk_set_owner)(void *state, uint64_t handle, uint32_t uid);
  int (*chunk_owner)(void *state, uint64_t handle, uint32_t *uid);
  /* Required from here on, but for legacy IPC. */
  int (*chunk_create)(void *state, unsigned dev, uint64_t size, uint64_t *handle);
  int (*chunk_export)(void *state, uint64_t handle, int *fd);
  void (*chunk_release)(void *state, unsigned dev, uint64_t handle, uint64_t size);
  int (*chunks_copy)(void *state, unsigned dev, const uint64_t *handles, const uint64_t *sizes,
                     size_t n, void *host, bool to_host);
  int (*backup_reserve)(void *state, unsigned dev, uint64_t size, void **host);
  int (*backup_make)(void *state, unsigned dev, void *host, uint64_t size, uint64_t off,
                     bool background);
  void (*backup_release)(void *state, unsigned dev, void *host, uint64_t size, uint64_t made);
  int (*backup_alloc)(void *state, unsigned dev, uint64_t size, void **host);
  void (*backup_free)(void *state, unsigned dev, void *host, uint64_t size);
  void (*backup_host_only)(void *state, unsigned dev, void *host); /* NULL: nothing to do */
  int (*backup_export)(void *state, unsigned dev, void *host, uint64_t size, int *fds,
                       uint64_t *sizes, size_t max, size_t *n); /* NULL: cannot */
  int (*hold)(void *state, unsigned dev);
  void (*unhold)(void *state, unsigned dev);
  bool (*holding)(void *state, unsigned dev);
  int (*bus_id)(void *state, unsigned dev, char *buf, size_t len);
  /* Legacy IPC; NULL where the backend has none. */
  int (*ipc_alloc)(void *state, unsigned dev, uint64_t size, uint64_t *dptr, uint8_t *handle);
  void (*ipc_free)(void *state, unsigned dev, uint64_t dptr, uint64_t size);
};

extern const struct gpudev_ops gpudev_host_ops;
extern const struct gpudev_ops gpudev_cuda_ops; /* where built (HAVE_CUDA) */
extern const struct gpudev_ops gpudev_hip_ops;  /* where built (HAVE_HIP) */

/* Bytes of the backup piece at off of a backup of size bytes. */
static inline uint64_t gpudev_piece_len(uint64_t size, uint64_t off) {
  return size - off < GPUDEV_BACKUP_PIECE ? size - off : GPUDEV_BACKUP_PIECE;
}

#endif
