#include "gpu.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"

struct gpu {
  const struct gpu_ops *ops;
  void *state;
};

static const struct gpu_ops *const backends[] = {&gpu_host_ops};

static _Thread_local char last_error[256];

/* Record what went wrong on this thread and return err. */
int gpu_fail(int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return err;
}

/* What the backend last reported on this thread. */
const char *gpu_error(void) { return last_error; }

/* Find the backend by name and open it. */
int gpu_open(const struct gpu_options *opt, gpu **out, char *err, size_t errlen) {
  const struct gpu_ops *ops = NULL;
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
    if (strcmp(backends[i]->name, opt->backend) == 0) ops = backends[i];
  if (!ops) {
    snprintf(err, errlen, "unknown backend '%s'", opt->backend);
    return -ENOENT;
  }
  gpu *g = calloc(1, sizeof *g);
  if (!g) return -ENOMEM;
  g->ops = ops;
  int rc = ops->open(opt, &g->state, err, errlen);
  if (rc < 0) {
    free(g);
    return rc;
  }
  *out = g;
  return 0;
}

/* Close a backend. */
void gpu_close(gpu *g) {
  if (!g) return;
  g->ops->close(g->state);
  free(g);
}

/* The backend's name. */
const char *gpu_name(const gpu *g) { return g->ops->name; }

/* Number of devices. */
unsigned gpu_device_count(const gpu *g) { return g->ops->device_count(g->state); }

/* Allocation granularity. */
uint64_t gpu_granularity(const gpu *g) { return g->ops->granularity(g->state); }

/* Total and free bytes of a device. */
int gpu_mem_info(gpu *g, unsigned dev, uint64_t *free_bytes, uint64_t *total) {
  return g->ops->mem_info(g->state, dev, free_bytes, total);
}

/* Create a physical chunk. */
int gpu_chunk_create(gpu *g, unsigned dev, uint64_t size, uint64_t *handle) {
  return g->ops->chunk_create(g->state, dev, size, handle);
}

/* Export a chunk as a new fd. */
int gpu_chunk_export(gpu *g, uint64_t handle, int *fd) {
  return g->ops->chunk_export(g->state, handle, fd);
}

/* Release a chunk. */
void gpu_chunk_release(gpu *g, unsigned dev, uint64_t handle, uint64_t size) {
  g->ops->chunk_release(g->state, dev, handle, size);
}

/* Copy a chunk's bytes to host memory. */
int gpu_chunk_read(gpu *g, uint64_t handle, uint64_t off, void *dst, size_t len) {
  return g->ops->chunk_read(g->state, handle, off, dst, len);
}

/* Copy host memory into a chunk. */
int gpu_chunk_write(gpu *g, uint64_t handle, uint64_t off, const void *src,
                    size_t len) {
  return g->ops->chunk_write(g->state, handle, off, src, len);
}

/* Reserve an address range. */
int gpu_va_reserve(gpu *g, uint64_t size, void **va) {
  return g->ops->va_reserve(g->state, size, va);
}

/* Free an address range. */
void gpu_va_free(gpu *g, void *va, uint64_t size) { g->ops->va_free(g->state, va, size); }

/* Import an exported fd. */
int gpu_import(gpu *g, int fd, uint64_t size, uint64_t *handle) {
  return g->ops->import(g->state, fd, size, handle);
}

/* Map an imported handle. */
int gpu_map(gpu *g, void *va, uint64_t size, uint64_t handle) {
  return g->ops->map(g->state, va, size, handle);
}

/* Allow access to a mapped range. */
int gpu_set_access(gpu *g, void *va, uint64_t size, unsigned dev) {
  return g->ops->set_access(g->state, va, size, dev);
}

/* Unmap one mapping. */
int gpu_unmap(gpu *g, void *va, uint64_t size) { return g->ops->unmap(g->state, va, size); }

/* Release an imported handle. */
void gpu_release(gpu *g, uint64_t handle) { g->ops->release(g->state, handle); }

/* Wait for a device. */
int gpu_sync(gpu *g, unsigned dev) { return g->ops->sync(g->state, dev); }
