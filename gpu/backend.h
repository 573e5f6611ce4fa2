/* What a backend provides: the table behind gpu.h. Internal to gpu/. */
#ifndef GPUMEM_GPU_BACKEND_H
#define GPUMEM_GPU_BACKEND_H

#include "gpu.h"

struct gpu_ops {
  const char *name;
  const char *built_with; /* the vendor headers compiled against (NULL: none) */
  const void *impl; /* what open needs beyond the options (vendor table) */
  bool fd_per_chunk; /* each chunk the daemon holds is one of its descriptors */
  int (*open)(const struct gpu_ops *self, const struct gpu_options *opt,
              void **state, char *err, size_t errlen);
  void (*close)(void *state);
  unsigned (*device_count)(void *state);
  uint64_t (*granularity)(void *state);
  int (*mem_info)(void *state, unsigned dev, uint64_t *free_bytes,
                  uint64_t *total);
  /* Optional (NULL: -ENOTSUP, or mem_info's figures with no reserve). */
  int (*mem_detail)(void *state, unsigned dev, struct gpu_mem *m);
  int (*processes)(void *state, unsigned dev, struct gpu_process *out, size_t max, size_t *n);
  int (*chunks_held_by)(void *state, int pid, const uint64_t *handles, size_t n, bool *held);
  int (*chunk_adopt)(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle);
  int (*export_handle)(void *state, unsigned dev, uint64_t handle, int *fd);
  int (*chunk_set_owner)(void *state, uint64_t handle, uint32_t uid);
  int (*chunk_owner)(void *state, uint64_t handle, uint32_t *uid);
  int (*chunk_create)(void *state, unsigned dev, uint64_t size,
                      uint64_t *handle);
  int (*chunk_export)(void *state, uint64_t handle, int *fd);
  void (*chunk_release)(void *state, unsigned dev, uint64_t handle,
                        uint64_t size);
  int (*chunks_copy)(void *state, unsigned dev, const uint64_t *handles, const uint64_t *sizes,
                     size_t n, void *host, bool to_host);
  int (*backup_reserve)(void *state, unsigned dev, uint64_t size, void **host);
  int (*backup_make)(void *state, unsigned dev, void *host, uint64_t size, uint64_t off,
                     bool background);
  void (*backup_release)(void *state, unsigned dev, void *host, uint64_t size, uint64_t made);
  int (*backup_alloc)(void *state, unsigned dev, uint64_t size, void **host);
  void (*backup_free)(void *state, unsigned dev, void *host, uint64_t size);
  int (*hold)(void *state, unsigned dev);
  void (*unhold)(void *state, unsigned dev);
  bool (*holding)(void *state, unsigned dev);
  int (*bus_id)(void *state, unsigned dev, char *buf, size_t len);
  int (*device_by_bus_id)(void *state, const char *bus_id);
  int (*va_reserve)(void *state, unsigned dev, uint64_t size, void **va);
  void (*va_free)(void *state, unsigned dev, void *va, uint64_t size);
  int (*import)(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle);
  int (*map)(void *state, unsigned dev, void *va, uint64_t size, uint64_t handle);
  int (*set_access)(void *state, unsigned dev, void *va, uint64_t size);
  int (*unmap)(void *state, unsigned dev, void *va, uint64_t size);
  void (*release)(void *state, unsigned dev, uint64_t handle);
  int (*sync)(void *state, unsigned dev);
  int (*copy_from)(void *state, unsigned dev, void *dst, const void *va, uint64_t len);
  int (*copy_to)(void *state, unsigned dev, void *va, const void *src, uint64_t len);
  int (*fill32)(void *state, unsigned dev, void *va, uint64_t len, uint32_t value);
  /* Legacy IPC; NULL where the backend has none. */
  int (*ipc_alloc)(void *state, unsigned dev, uint64_t size, uint64_t *dptr, uint8_t *handle);
  void (*ipc_free)(void *state, unsigned dev, uint64_t dptr, uint64_t size);
  int (*ipc_open)(void *state, unsigned dev, const uint8_t *handle, void **va);
  void (*ipc_close)(void *state, unsigned dev, void *va);
};

extern const struct gpu_ops gpu_host_ops;
extern const struct gpu_ops gpu_cuda_ops; /* where built (HAVE_CUDA) */
extern const struct gpu_ops gpu_hip_ops;  /* where built (HAVE_HIP) */

/* Record what went wrong on this thread (for gpu_error) and return err. */
int gpu_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Fault in len bytes of private anonymous memory at p and write them once,
 * a small step at a time (never long under the process's mmap lock). 0,
 * or a negative errno with words through gpu_fail. */
int gpu_populate(void *p, uint64_t len);

/* Bytes of the backup piece at off of a backup of size bytes. */
static inline uint64_t gpu_piece_len(uint64_t size, uint64_t off) {
  return size - off < GPU_BACKUP_PIECE ? size - off : GPU_BACKUP_PIECE;
}

#endif
