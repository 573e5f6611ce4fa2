/* What a backend provides to the client's half: the table behind
 * gpu/gpuva.h, one per backend (host, and CUDA and HIP where built).
 * Internal to gpu/. */
#ifndef GPUMEM_GPU_GPUVA_OPS_H
#define GPUMEM_GPU_GPUVA_OPS_H

#include <stddef.h>

#include "gpu/gpuva.h"

struct gpuva_ops {
  const char *name;
  const void *impl; /* what open needs (vendor table) */
  int (*open)(const struct gpuva_ops *self, void **state, char *err, size_t errlen);
  void (*close)(void *state);
  int (*device_by_bus_id)(void *state, const char *bus_id);
  int (*reserve)(void *state, unsigned dev, uint64_t size, void **va);
  void (*free)(void *state, unsigned dev, void *va, uint64_t size);
  int (*import)(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle);
  int (*map)(void *state, unsigned dev, void *va, uint64_t size, uint64_t handle);
  int (*set_access)(void *state, unsigned dev, void *va, uint64_t size);
  int (*unmap)(void *state, unsigned dev, void *va, uint64_t size);
  /* Optional (NULL: -ENOTSUP). */
  int (*export_handle)(void *state, unsigned dev, uint64_t handle, int *fd);
  void (*release)(void *state, unsigned dev, uint64_t handle);
  int (*sync)(void *state, unsigned dev);
  int (*copy_from)(void *state, unsigned dev, void *dst, const void *va, uint64_t len);
  int (*copy_to)(void *state, unsigned dev, void *va, const void *src, uint64_t len);
  int (*copy_device)(void *state, unsigned dev, void *dst, const void *src, uint64_t len);
  int (*fill32)(void *state, unsigned dev, void *va, uint64_t len, uint32_t value);
  int (*host_view)(void *state, unsigned dev, void *va, uint64_t size); /* NULL: -ENOTSUP */
  /* Legacy IPC; NULL where the backend has none. */
  int (*ipc_open)(void *state, unsigned dev, const uint8_t *handle, void **va);
  void (*ipc_close)(void *state, unsigned dev, void *va);
};

extern const struct gpuva_ops gpuva_host_ops;
extern const struct gpuva_ops gpuva_cuda_ops; /* where built (HAVE_CUDA) */
extern const struct gpuva_ops gpuva_hip_ops;  /* where built (HAVE_HIP) */

#endif
