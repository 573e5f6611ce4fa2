/* What a backend provides: the table behind gpu.h. Internal to gpu/. */
#ifndef GPUMEM_GPU_BACKEND_H
#define GPUMEM_GPU_BACKEND_H

#include "gpu.h"

struct gpu_ops {
  const char *name;
  int (*open)(const struct gpu_options *opt, void **state, char *err,
              size_t errlen);
  void (*close)(void *state);
  unsigned (*device_count)(void *state);
  uint64_t (*granularity)(void *state);
  int (*mem_info)(void *state, unsigned dev, uint64_t *free_bytes,
                  uint64_t *total);
  int (*chunk_create)(void *state, unsigned dev, uint64_t size,
                      uint64_t *handle);
  int (*chunk_export)(void *state, uint64_t handle, int *fd);
  void (*chunk_release)(void *state, unsigned dev, uint64_t handle,
                        uint64_t size);
  int (*chunk_read)(void *state, uint64_t handle, uint64_t off, void *dst,
                    size_t len);
  int (*chunk_write)(void *state, uint64_t handle, uint64_t off,
                     const void *src, size_t len);
  int (*va_reserve)(void *state, uint64_t size, void **va);
  void (*va_free)(void *state, void *va, uint64_t size);
  int (*import)(void *state, int fd, uint64_t size, uint64_t *handle);
  int (*map)(void *state, void *va, uint64_t size, uint64_t handle);
  int (*set_access)(void *state, void *va, uint64_t size, unsigned dev);
  int (*unmap)(void *state, void *va, uint64_t size);
  void (*release)(void *state, uint64_t handle);
  int (*sync)(void *state, unsigned dev);
};

extern const struct gpu_ops gpu_host_ops;

/* Record what went wrong on this thread (for gpu_error) and return err. */
int gpu_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
