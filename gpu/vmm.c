/* The VMM backends: physical chunks exported as POSIX fds, imported and
 * mapped at reserved addresses, over a vendor table (gpu/vmm.h). Written
 * once for CUDA and HIP.
 *
 * The daemon holds no device context while idle (a CUDA primary context
 * costs about half a GiB per GPU): create, export and release need none;
 * copies and legacy IPC memory take the device's primary context only for
 * as long as they need it. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "vmm.h"

#define VMM_MAX_DEVICES 64

struct vmm {
  const struct vmm_vendor *v;
  bool client;
  int ndev;
  uint64_t granularity;
  pthread_mutex_t mu;
  unsigned ctx_refs[VMM_MAX_DEVICES]; /* contexts this process holds */
};

/* Turn a vendor status into -ENOMEM/-EIO, saying which call failed. */
static int fail(const struct vmm *m, int rc, const char *call) {
  return gpu_fail(rc == m->v->oom ? -ENOMEM : -EIO, "%s%s: %s", m->v->prefix, call,
                  m->v->error_name(rc));
}

#define TRY(m, expr, call)                 \
  do {                                     \
    int rc_ = (expr);                      \
    if (rc_ != 0) return fail(m, rc_, call); \
  } while (0)

/* Hold the device's primary context (counted) and make it current. */
static int ctx_get(struct vmm *m, int dev) {
  pthread_mutex_lock(&m->mu);
  int rc = m->ctx_refs[dev] ? 0 : m->v->ctx_retain(dev);
  if (rc == 0) m->ctx_refs[dev]++;
  pthread_mutex_unlock(&m->mu);
  if (rc != 0) return fail(m, rc, "DevicePrimaryCtxRetain");
  TRY(m, m->v->ctx_use(dev), "CtxSetCurrent");
  return 0;
}

/* Let go of a context taken with ctx_get. */
static void ctx_put(struct vmm *m, int dev) {
  pthread_mutex_lock(&m->mu);
  if (m->ctx_refs[dev] && --m->ctx_refs[dev] == 0) m->v->ctx_release(dev);
  pthread_mutex_unlock(&m->mu);
}

/* Clients keep one context per device they use, for the process's life,
 * as the application (PyTorch) does with the same primary context. */
static int ctx_client(struct vmm *m, unsigned dev) {
  if (dev >= VMM_MAX_DEVICES) return gpu_fail(-ENODEV, "no device %u", dev);
  pthread_mutex_lock(&m->mu);
  int rc = m->ctx_refs[dev] ? 0 : m->v->ctx_retain((int)dev);
  if (rc == 0 && !m->ctx_refs[dev]) m->ctx_refs[dev] = 1;
  pthread_mutex_unlock(&m->mu);
  if (rc != 0) return fail(m, rc, "DevicePrimaryCtxRetain");
  TRY(m, m->v->ctx_use((int)dev), "CtxSetCurrent");
  return 0;
}

static int vmm_open(const struct gpu_ops *self, const struct gpu_options *opt, void **state,
                    char *err, size_t errlen) {
  const struct vmm_vendor *v = self->impl;
  int rc = v->load(err, errlen);
  if (rc < 0) return rc;
  struct vmm *m = calloc(1, sizeof *m);
  if (!m) return -ENOMEM;
  m->v = v;
  m->client = opt->client;
  pthread_mutex_init(&m->mu, NULL);
  int n = 0;
  if ((rc = v->device_count(&n)) != 0 || n <= 0) {
    snprintf(err, errlen, "no %s device found%s%s", v->device_word, rc ? ": " : "",
             rc ? v->error_name(rc) : "");
    free(m);
    return -ENODEV;
  }
  m->ndev = n < VMM_MAX_DEVICES ? n : VMM_MAX_DEVICES;
  /* Granularity with the very properties chunks are created with; every
   * device must agree, and the coarsest wins. */
  for (int d = 0; d < m->ndev; d++) {
    uint64_t g = 0;
    if ((rc = v->granularity(d, &g)) != 0 || g == 0 || (g & (g - 1))) {
      snprintf(err, errlen, "%sMemGetAllocationGranularity on device %d: %s", v->prefix, d,
               rc ? v->error_name(rc) : "not a power of two");
      free(m);
      return -EIO;
    }
    if (g > m->granularity) m->granularity = g;
  }
  *state = m;
  return 0;
}

static void vmm_close(void *state) {
  struct vmm *m = state;
  for (int d = 0; d < VMM_MAX_DEVICES; d++)
    if (m->ctx_refs[d]) m->v->ctx_release(d);
  pthread_mutex_destroy(&m->mu);
  free(m);
}

static unsigned vmm_device_count(void *state) { return (unsigned)((struct vmm *)state)->ndev; }

static uint64_t vmm_granularity(void *state) { return ((struct vmm *)state)->granularity; }

static int vmm_mem_info(void *state, unsigned dev, uint64_t *free_bytes, uint64_t *total) {
  struct vmm *m = state;
  TRY(m, m->v->mem_info((int)dev, free_bytes, total), "MemGetInfo");
  return 0;
}

static int vmm_chunk_create(void *state, unsigned dev, uint64_t size, uint64_t *handle) {
  struct vmm *m = state;
  TRY(m, m->v->create((int)dev, size, handle), "MemCreate");
  return 0;
}

static int vmm_chunk_export(void *state, uint64_t handle, int *fd) {
  struct vmm *m = state;
  TRY(m, m->v->export_fd(handle, fd), "MemExportToShareableHandle");
  return 0;
}

static void vmm_chunk_release(void *state, unsigned dev, uint64_t handle, uint64_t size) {
  struct vmm *m = state;
  (void)dev;
  (void)size;
  m->v->release(handle);
}

/* Map a chunk into this process for a copy, with a context held. */
static int map_for_copy(struct vmm *m, unsigned dev, uint64_t handle, uint64_t size,
                        uint64_t *va) {
  int rc = ctx_get(m, (int)dev);
  if (rc < 0) return rc;
  int st = m->v->reserve(size, m->granularity, va);
  const char *call = "MemAddressReserve";
  if (st == 0) {
    call = "MemMap";
    if ((st = m->v->map(*va, size, handle)) == 0) {
      call = "MemSetAccess";
      if ((st = m->v->set_access(*va, size, (int)dev)) == 0) return 0;
      m->v->unmap(*va, size);
    }
    m->v->address_free(*va, size);
  }
  ctx_put(m, (int)dev);
  return fail(m, st, call);
}

static void unmap_after_copy(struct vmm *m, unsigned dev, uint64_t va, uint64_t size) {
  m->v->unmap(va, size);
  m->v->address_free(va, size);
  ctx_put(m, (int)dev);
}

/* Copy a whole chunk through a temporary mapping. */
static int chunk_copy(struct vmm *m, unsigned dev, uint64_t handle, void *host, size_t len,
                      bool to_host) {
  uint64_t va;
  int rc = map_for_copy(m, dev, handle, len, &va);
  if (rc < 0) return rc;
  int st = to_host ? m->v->dtoh(host, va, len) : m->v->htod(va, host, len);
  unmap_after_copy(m, dev, va, len);
  if (st != 0) return fail(m, st, to_host ? "MemcpyDtoH" : "MemcpyHtoD");
  return 0;
}

static int vmm_chunk_read(void *state, unsigned dev, uint64_t handle, void *dst, size_t len) {
  return chunk_copy(state, dev, handle, dst, len, true);
}

static int vmm_chunk_write(void *state, unsigned dev, uint64_t handle, const void *src,
                           size_t len) {
  return chunk_copy(state, dev, handle, (void *)src, len, false);
}

static int vmm_bus_id(void *state, unsigned dev, char *buf, size_t len) {
  struct vmm *m = state;
  TRY(m, m->v->bus_id((int)dev, buf, (int)len), "DeviceGetPCIBusId");
  return 0;
}

static int vmm_device_by_bus_id(void *state, const char *bus_id) {
  struct vmm *m = state;
  int dev;
  if (m->v->device_by_bus_id(bus_id, &dev) != 0) return -ENODEV;
  return dev;
}

static int vmm_va_reserve(void *state, unsigned dev, uint64_t size, void **va) {
  struct vmm *m = state;
  int rc = ctx_client(m, dev);
  if (rc < 0) return rc;
  uint64_t p;
  TRY(m, m->v->reserve(size, m->granularity, &p), "MemAddressReserve");
  *va = (void *)(uintptr_t)p;
  return 0;
}

static void vmm_va_free(void *state, unsigned dev, void *va, uint64_t size) {
  struct vmm *m = state;
  if (ctx_client(m, dev) == 0) m->v->address_free((uint64_t)(uintptr_t)va, size);
}

/* Import consumes the fd: the imported handle keeps the memory alive. */
static int vmm_import(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  struct vmm *m = state;
  (void)size;
  int rc = ctx_client(m, dev);
  int st = rc < 0 ? 0 : m->v->import_fd(fd, handle);
  close(fd);
  if (rc < 0) return rc;
  if (st != 0) return fail(m, st, "MemImportFromShareableHandle");
  return 0;
}

static int vmm_map(void *state, unsigned dev, void *va, uint64_t size, uint64_t handle) {
  struct vmm *m = state;
  int rc = ctx_client(m, dev);
  if (rc < 0) return rc;
  TRY(m, m->v->map((uint64_t)(uintptr_t)va, size, handle), "MemMap");
  return 0;
}

static int vmm_set_access(void *state, unsigned dev, void *va, uint64_t size) {
  struct vmm *m = state;
  int rc = ctx_client(m, dev);
  if (rc < 0) return rc;
  TRY(m, m->v->set_access((uint64_t)(uintptr_t)va, size, (int)dev), "MemSetAccess");
  return 0;
}

static int vmm_unmap(void *state, unsigned dev, void *va, uint64_t size) {
  struct vmm *m = state;
  int rc = ctx_client(m, dev);
  if (rc < 0) return rc;
  TRY(m, m->v->unmap((uint64_t)(uintptr_t)va, size), "MemUnmap");
  return 0;
}

static void vmm_release(void *state, unsigned dev, uint64_t handle) {
  struct vmm *m = state;
  (void)dev;
  m->v->release(handle);
}

static int vmm_sync(void *state, unsigned dev) {
  struct vmm *m = state;
  int rc = ctx_client(m, dev);
  if (rc < 0) return rc;
  TRY(m, m->v->sync(), "CtxSynchronize");
  return 0;
}

static int vmm_copy_from(void *state, unsigned dev, void *dst, const void *va, uint64_t len) {
  struct vmm *m = state;
  int rc = ctx_client(m, dev);
  if (rc < 0) return rc;
  TRY(m, m->v->dtoh(dst, (uint64_t)(uintptr_t)va, len), "MemcpyDtoH");
  return 0;
}

static int vmm_copy_to(void *state, unsigned dev, void *va, const void *src, uint64_t len) {
  struct vmm *m = state;
  int rc = ctx_client(m, dev);
  if (rc < 0) return rc;
  TRY(m, m->v->htod((uint64_t)(uintptr_t)va, src, len), "MemcpyHtoD");
  return 0;
}

static int vmm_fill32(void *state, unsigned dev, void *va, uint64_t len, uint32_t value) {
  struct vmm *m = state;
  int rc = ctx_client(m, dev);
  if (rc < 0) return rc;
  TRY(m, m->v->memset32((uint64_t)(uintptr_t)va, value, len / 4), "MemsetD32");
  TRY(m, m->v->sync(), "CtxSynchronize");
  return 0;
}

/* Legacy IPC memory lives in a context the daemon holds while it exists. */
static int vmm_ipc_alloc(void *state, unsigned dev, uint64_t size, uint64_t *dptr,
                         uint8_t *handle) {
  struct vmm *m = state;
  int rc = ctx_get(m, (int)dev);
  if (rc < 0) return rc;
  int st = m->v->ipc_alloc(size, dptr, handle);
  if (st != 0) {
    ctx_put(m, (int)dev);
    return fail(m, st, "MemAlloc/IpcGetMemHandle");
  }
  return 0;
}

static void vmm_ipc_free(void *state, unsigned dev, uint64_t dptr, uint64_t size) {
  struct vmm *m = state;
  (void)size;
  if (m->v->ctx_use((int)dev) == 0) m->v->ipc_free(dptr);
  ctx_put(m, (int)dev);
}

static int vmm_ipc_open(void *state, unsigned dev, const uint8_t *handle, void **va) {
  struct vmm *m = state;
  int rc = ctx_client(m, dev);
  if (rc < 0) return rc;
  uint64_t p;
  TRY(m, m->v->ipc_open(handle, &p), "IpcOpenMemHandle");
  *va = (void *)(uintptr_t)p;
  return 0;
}

static void vmm_ipc_close(void *state, unsigned dev, void *va) {
  struct vmm *m = state;
  if (ctx_client(m, dev) == 0) m->v->ipc_close((uint64_t)(uintptr_t)va);
}

#define VMM_OPS(vendor)                                                              \
  {                                                                                  \
    .name = #vendor, .impl = &vmm_##vendor, .open = vmm_open, .close = vmm_close,    \
    .device_count = vmm_device_count, .granularity = vmm_granularity,                \
    .mem_info = vmm_mem_info, .chunk_create = vmm_chunk_create,                      \
    .chunk_export = vmm_chunk_export, .chunk_release = vmm_chunk_release,            \
    .chunk_read = vmm_chunk_read, .chunk_write = vmm_chunk_write,                    \
    .bus_id = vmm_bus_id, .device_by_bus_id = vmm_device_by_bus_id,                  \
    .va_reserve = vmm_va_reserve, .va_free = vmm_va_free, .import = vmm_import,      \
    .map = vmm_map, .set_access = vmm_set_access, .unmap = vmm_unmap,                \
    .release = vmm_release, .sync = vmm_sync, .copy_from = vmm_copy_from,            \
    .copy_to = vmm_copy_to, .fill32 = vmm_fill32, .ipc_alloc = vmm_ipc_alloc,        \
    .ipc_free = vmm_ipc_free, .ipc_open = vmm_ipc_open, .ipc_close = vmm_ipc_close,  \
  }

#ifdef HAVE_CUDA
const struct gpu_ops gpu_cuda_ops = VMM_OPS(cuda);
#endif
#ifdef HAVE_HIP
const struct gpu_ops gpu_hip_ops = VMM_OPS(hip);
#endif
