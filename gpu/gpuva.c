/* The client's half of the GPU layer: the backend chosen by name, and each
 * call passed to its table (gpu/gpuva_ops.h). */
#include "gpuva.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpuva_ops.h"

struct gpuva {
  const struct gpuva_ops *ops;
  void *state;
};

static const struct gpuva_ops *const backends[] = {
    &gpuva_host_ops,
#ifdef HAVE_CUDA
    &gpuva_cuda_ops,
#endif
#ifdef HAVE_HIP
    &gpuva_hip_ops,
#endif
};

/* Find the backend by name and open it. */
int gpuva_open(const char *backend, gpuva **out, char *err, size_t errlen) {
  const struct gpuva_ops *ops = NULL;
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
    if (strcmp(backends[i]->name, backend) == 0) ops = backends[i];
  if (!ops) {
    snprintf(err, errlen, "unknown backend '%s'", backend);
    return -ENOENT;
  }
  gpuva *g = calloc(1, sizeof *g);
  if (!g) return -ENOMEM;
  g->ops = ops;
  int rc = ops->open(ops, &g->state, err, errlen);
  if (rc < 0) {
    free(g);
    return rc;
  }
  *out = g;
  return 0;
}

/* Close a backend. */
void gpuva_close(gpuva *g) {
  if (!g) return;
  g->ops->close(g->state);
  free(g);
}

/* This process's device number for a PCI bus id. */
int gpuva_device_by_bus_id(gpuva *g, const char *bus_id) {
  return g->ops->device_by_bus_id(g->state, bus_id);
}

/* Reserve an address range. */
int gpuva_reserve(gpuva *g, unsigned dev, uint64_t size, void **va) {
  return g->ops->reserve(g->state, dev, size, va);
}

/* Free an address range. */
void gpuva_free(gpuva *g, unsigned dev, void *va, uint64_t size) {
  g->ops->free(g->state, dev, va, size);
}

/* Import an exported fd. */
int gpuva_import(gpuva *g, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  return g->ops->import(g->state, dev, fd, size, handle);
}

/* Map an imported handle. */
int gpuva_map(gpuva *g, unsigned dev, void *va, uint64_t size, uint64_t handle) {
  return g->ops->map(g->state, dev, va, size, handle);
}

/* Allow access to a mapped range. */
int gpuva_set_access(gpuva *g, unsigned dev, void *va, uint64_t size) {
  return g->ops->set_access(g->state, dev, va, size);
}

/* Unmap one mapping. */
int gpuva_unmap(gpuva *g, unsigned dev, void *va, uint64_t size) {
  return g->ops->unmap(g->state, dev, va, size);
}

/* Export an imported handle again. */
int gpuva_export(gpuva *g, unsigned dev, uint64_t handle, int *fd) {
  if (!g->ops->export_handle) return gpu_fail(-ENOTSUP, "%s: cannot export again", g->ops->name);
  return g->ops->export_handle(g->state, dev, handle, fd);
}

/* Release an imported handle. */
void gpuva_release(gpuva *g, unsigned dev, uint64_t handle) {
  g->ops->release(g->state, dev, handle);
}

/* Wait for a device. */
int gpuva_sync(gpuva *g, unsigned dev) { return g->ops->sync(g->state, dev); }

/* Copy device memory to the host. */
int gpuva_copy_from(gpuva *g, unsigned dev, void *dst, const void *va, uint64_t len) {
  return g->ops->copy_from(g->state, dev, dst, va, len);
}

/* Copy host memory to the device. */
int gpuva_copy_to(gpuva *g, unsigned dev, void *va, const void *src, uint64_t len) {
  return g->ops->copy_to(g->state, dev, va, src, len);
}

/* Copy between two mappings dev reaches. */
int gpuva_copy_device(gpuva *g, unsigned dev, void *dst, const void *src, uint64_t len) {
  return g->ops->copy_device(g->state, dev, dst, src, len);
}

/* Let the host reach a backup mapped here. */
int gpuva_host_view(gpuva *g, unsigned dev, void *va, uint64_t size) {
  if (!g->ops->host_view) return gpu_fail(-ENOTSUP, "%s: backups cannot be read here", g->ops->name);
  return g->ops->host_view(g->state, dev, va, size);
}

/* Fill device memory with a 32-bit value. */
int gpuva_fill32(gpuva *g, unsigned dev, void *va, uint64_t len, uint32_t value) {
  return g->ops->fill32(g->state, dev, va, len, value);
}

/* Open an IPC handle. */
int gpuva_ipc_open(gpuva *g, unsigned dev, const uint8_t handle[GPU_IPC_HANDLE_SIZE], void **va) {
  if (!g->ops->ipc_open) return gpu_fail(-ENOTSUP, "no legacy IPC on %s", g->ops->name);
  return g->ops->ipc_open(g->state, dev, handle, va);
}

/* Close an opened IPC handle. */
void gpuva_ipc_close(gpuva *g, unsigned dev, void *va) {
  if (g->ops->ipc_close) g->ops->ipc_close(g->state, dev, va);
}
