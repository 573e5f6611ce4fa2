/* The VMM backends: physical chunks exported as POSIX fds, imported and
 * mapped at reserved addresses, over a vendor table (gpu/vmm.h). Written
 * once for CUDA and HIP.
 *
 * The daemon holds no device context while idle (a CUDA primary context
 * costs about half a GiB per GPU): create, export and release need none;
 * copies and legacy IPC memory take the device's primary context only for
 * as long as they need it. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "common/idmap.h"
#include "vmm.h"

#define VMM_MAX_DEVICES 64

struct vmm {
  const struct vmm_vendor *v;
  bool client;
  int ndev;
  uint64_t granularity;
  pthread_mutex_t mu;
  unsigned ctx_refs[VMM_MAX_DEVICES]; /* contexts this process holds */
  idmap *kept; /* imported handle -> fd + 1 it came from, under mu */
};

/* Keep the fd an allocation was imported from, for as long as the handle:
 * CUDA will not export an imported handle again (CUDA_ERROR_INVALID_VALUE
 * on an H200, driver 580, also through cuMemRetainAllocationHandle), and
 * a daemon that restarted needs an fd. Holding it changes nothing about
 * when memory is freed: the handle holds the allocation just as long. */
static int kept_put(struct vmm *m, uint64_t handle, int fd) {
  pthread_mutex_lock(&m->mu);
  int rc = idmap_put(m->kept, handle, (void *)(uintptr_t)(fd + 1));
  pthread_mutex_unlock(&m->mu);
  return rc;
}

/* The fd kept for a handle (-1 if none), forgotten if take. */
static int kept_get(struct vmm *m, uint64_t handle, bool take) {
  pthread_mutex_lock(&m->mu);
  int fd = (int)(uintptr_t)idmap_get(m->kept, handle) - 1;
  if (take && fd >= 0) idmap_del(m->kept, handle);
  pthread_mutex_unlock(&m->mu);
  return fd;
}

/* Release a handle and close the fd kept with it. */
static void release_handle(struct vmm *m, uint64_t handle) {
  int fd = kept_get(m, handle, true);
  m->v->release(handle);
  if (fd >= 0) close(fd);
}

/* Import fd and keep it with the handle; the fd is consumed either way.
 * Returns the vendor's status, or -ENOMEM. */
static int import_keep(struct vmm *m, int fd, uint64_t *handle) {
  int st = m->v->import_fd(fd, handle);
  if (st != 0) {
    close(fd);
    return st;
  }
  if (kept_put(m, *handle, fd) < 0) {
    m->v->release(*handle);
    close(fd);
    return -ENOMEM;
  }
  return 0;
}

/* A new fd for a handle: a copy of the kept one where the handle was
 * imported, else the driver's export. Returns the vendor's status, or
 * -errno. */
static int export_any(struct vmm *m, uint64_t handle, int *fd) {
  int kept = kept_get(m, handle, false);
  if (kept < 0) return m->v->export_fd(handle, fd);
  if ((*fd = fcntl(kept, F_DUPFD_CLOEXEC, 0)) < 0) return -errno;
  return 0;
}

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

/* Free a backend's state (contexts already let go of). */
static void vmm_free(struct vmm *m) {
  idmap_destroy(m->kept);
  pthread_mutex_destroy(&m->mu);
  free(m);
}

static int vmm_open(const struct gpu_ops *self, const struct gpu_options *opt, void **state,
                    char *err, size_t errlen) {
  const struct vmm_vendor *v = self->impl;
  int rc = v->load(err, errlen);
  if (rc < 0) return rc;
  struct vmm *m = calloc(1, sizeof *m);
  if (!m || !(m->kept = idmap_create())) {
    free(m);
    return -ENOMEM;
  }
  m->v = v;
  m->client = opt->client;
  pthread_mutex_init(&m->mu, NULL);
  int n = 0;
  if ((rc = v->device_count(&n)) != 0 || n <= 0) {
    snprintf(err, errlen, "no %s device found%s%s", v->device_word, rc ? ": " : "",
             rc ? v->error_name(rc) : "");
    vmm_free(m);
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
      vmm_free(m);
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
  vmm_free(m);
}

static unsigned vmm_device_count(void *state) { return (unsigned)((struct vmm *)state)->ndev; }

static uint64_t vmm_granularity(void *state) { return ((struct vmm *)state)->granularity; }

static int vmm_mem_info(void *state, unsigned dev, uint64_t *free_bytes, uint64_t *total) {
  struct vmm *m = state;
  TRY(m, m->v->mem_info((int)dev, free_bytes, total), "MemGetInfo");
  return 0;
}

/* The driver's figures with its reserve apart, from the management
 * library without a context; where that says nothing, mem_info's figures
 * with no reserve. */
static int vmm_mem_detail(void *state, unsigned dev, struct gpu_mem *mem) {
  struct vmm *m = state;
  if ((int)dev >= m->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  int rc = m->v->mem_detail((int)dev, &mem->total, &mem->free, &mem->reserved);
  if (rc != -ENOTSUP) return rc;
  mem->reserved = 0;
  return vmm_mem_info(state, dev, &mem->free, &mem->total);
}

/* The driver's per-process list, this process left out: what the daemon
 * holds (its context, IPC memory) it made for itself. */
static int vmm_processes(void *state, unsigned dev, struct gpu_process *out, size_t max,
                         size_t *n) {
  struct vmm *m = state;
  if ((int)dev >= m->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  struct gpu_process *list = NULL;
  size_t count = 0;
  int rc = m->v->processes((int)dev, &list, &count);
  if (rc < 0) return rc;
  int self = getpid();
  for (size_t i = 0; i < count; i++) {
    if (list[i].pid == self) continue;
    if (*n < max) out[*n] = list[i];
    ++*n;
  }
  free(list);
  return 0;
}

/* Import a handed-over fd and check what the driver can: that it is its
 * memory, on dev. The driver does not say how big an imported allocation
 * is, so size is taken on trust (a mapping past its end would fail). The
 * fd is kept with the handle, so the chunk exports like any other (CUDA
 * exports no imported handle). */
static int vmm_chunk_adopt(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  struct vmm *m = state;
  int rc = (int)dev >= m->ndev ? gpu_fail(-ENODEV, "no device %u", dev)
           : size == 0 || size % m->granularity
               ? gpu_fail(-EINVAL, "adopting: %llu bytes is not a multiple of the granularity",
                          (unsigned long long)size)
               : 0;
  if (rc < 0) {
    close(fd);
    return rc;
  }
  int st = import_keep(m, fd, handle);
  if (st == -ENOMEM) return gpu_fail(-ENOMEM, "out of memory");
  if (st != 0)
    return gpu_fail(st == m->v->oom ? -ENOMEM : -EINVAL,
                    "adopting: %sMemImportFromShareableHandle: %s (not this driver's memory?)",
                    m->v->prefix, m->v->error_name(st));
  int on = -1;
  if ((st = m->v->handle_device(*handle, &on)) == 0 && on == (int)dev) return 0;
  release_handle(m, *handle);
  return st ? fail(m, st, "MemGetAllocationPropertiesFromHandle")
            : gpu_fail(-EINVAL, "adopting: memory of device %d, not %u", on, dev);
}

static int vmm_chunk_create(void *state, unsigned dev, uint64_t size, uint64_t *handle) {
  struct vmm *m = state;
  TRY(m, m->v->create((int)dev, size, handle), "MemCreate");
  return 0;
}

/* Export a chunk; an adopted one by a copy of the fd it came from. */
static int vmm_chunk_export(void *state, uint64_t handle, int *fd) {
  struct vmm *m = state;
  int st = export_any(m, handle, fd);
  if (st < 0) return gpu_fail(st, "exporting: %s", strerror(-st));
  if (st > 0) return fail(m, st, "MemExportToShareableHandle");
  return 0;
}

static void vmm_chunk_release(void *state, unsigned dev, uint64_t handle, uint64_t size) {
  (void)dev;
  (void)size;
  release_handle(state, handle);
}

/* Copies go in pieces of this size, round-robin over the streams, so that
 * both directions of the link and the copy engines stay busy. */
#define COPY_PIECE (64ull << 20)
#define COPY_STREAMS 4

/* Map whole chunks at one fresh range of this process. */
static int map_chunks(struct vmm *m, unsigned dev, const uint64_t *handles,
                      const uint64_t *sizes, size_t n, uint64_t total, uint64_t *va) {
  TRY(m, m->v->reserve(total, m->granularity, va), "MemAddressReserve");
  uint64_t off = 0;
  size_t i = 0;
  int st = 0;
  for (; i < n && st == 0; off += sizes[i++]) st = m->v->map(*va + off, sizes[i], handles[i]);
  if (st == 0 && (st = m->v->set_access(*va, total, (int)dev)) == 0) return 0;
  for (off = 0; i-- > 0;) {
    m->v->unmap(*va + off, sizes[i]);
    off += sizes[i];
  }
  m->v->address_free(*va, total);
  return fail(m, st, "MemMap/MemSetAccess");
}

static void unmap_chunks(struct vmm *m, const uint64_t *sizes, size_t n, uint64_t total,
                         uint64_t va) {
  uint64_t off = 0;
  for (size_t i = 0; i < n; off += sizes[i++]) m->v->unmap(va + off, sizes[i]);
  m->v->address_free(va, total);
}

/* Copy whole chunks through a temporary mapping, overlapped on streams. */
static int vmm_chunks_copy(void *state, unsigned dev, const uint64_t *handles,
                           const uint64_t *sizes, size_t n, void *host, bool to_host) {
  struct vmm *m = state;
  int rc = ctx_get(m, (int)dev);
  if (rc < 0) return rc;
  uint64_t total = 0, va = 0;
  for (size_t i = 0; i < n; i++) total += sizes[i];
  void *streams[COPY_STREAMS] = {NULL};
  int st = 0, k = 0;
  const char *call = "StreamCreate";
  if ((rc = map_chunks(m, dev, handles, sizes, n, total, &va)) < 0) goto out;
  for (; k < COPY_STREAMS && st == 0; k++) st = m->v->stream_create(&streams[k]);
  if (st != 0) {
    k--;
    goto done;
  }
  call = to_host ? "MemcpyDtoHAsync" : "MemcpyHtoDAsync";
  for (uint64_t off = 0, i = 0; off < total && st == 0; off += COPY_PIECE, i++) {
    uint64_t len = total - off < COPY_PIECE ? total - off : COPY_PIECE;
    void *s = streams[i % COPY_STREAMS];
    st = to_host ? m->v->dtoh_async((char *)host + off, va + off, len, s)
                 : m->v->htod_async(va + off, (char *)host + off, len, s);
  }
  for (int j = 0; j < k; j++) {
    int sync = m->v->stream_sync(streams[j]);
    if (st == 0 && sync != 0) {
      st = sync;
      call = "StreamSynchronize";
    }
  }
done:
  for (int j = 0; j < k; j++) m->v->stream_destroy(streams[j]);
  unmap_chunks(m, sizes, n, total, va);
  if (st != 0) rc = fail(m, st, call);
out:
  ctx_put(m, (int)dev);
  return rc;
}

/* Pinned backups live in the device's context, held while they exist. */
static int vmm_backup_alloc(void *state, unsigned dev, uint64_t size, void **host) {
  struct vmm *m = state;
  int rc = ctx_get(m, (int)dev);
  if (rc < 0) return rc;
  int st = m->v->host_alloc(host, size);
  if (st != 0) {
    ctx_put(m, (int)dev);
    return fail(m, st, "MemHostAlloc");
  }
  return 0;
}

static void vmm_backup_free(void *state, unsigned dev, void *host, uint64_t size) {
  struct vmm *m = state;
  (void)size;
  if (m->v->ctx_use((int)dev) == 0) m->v->host_free(host);
  ctx_put(m, (int)dev);
}

static int vmm_hold(void *state, unsigned dev) { return ctx_get(state, (int)dev); }

static void vmm_unhold(void *state, unsigned dev) { ctx_put(state, (int)dev); }

static bool vmm_holding(void *state, unsigned dev) {
  struct vmm *m = state;
  pthread_mutex_lock(&m->mu);
  bool held = dev < VMM_MAX_DEVICES && m->ctx_refs[dev] > 0;
  pthread_mutex_unlock(&m->mu);
  return held;
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

/* Import consumes the fd: the imported handle keeps the memory alive, and
 * the fd is kept with it until gpu_release, to export again. */
static int vmm_import(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  struct vmm *m = state;
  (void)size;
  int rc = ctx_client(m, dev);
  if (rc < 0) {
    close(fd);
    return rc;
  }
  int st = import_keep(m, fd, handle);
  if (st == -ENOMEM) return gpu_fail(-ENOMEM, "out of memory");
  if (st != 0) return fail(m, st, "MemImportFromShareableHandle");
  return 0;
}

/* An imported handle again as a new fd, for a daemon that restarted: a
 * copy of the fd it was imported from (see kept_put). */
static int vmm_export_handle(void *state, unsigned dev, uint64_t handle, int *fd) {
  (void)dev;
  return vmm_chunk_export(state, handle, fd);
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

/* Release an imported handle and close the fd kept with it. */
static void vmm_release(void *state, unsigned dev, uint64_t handle) {
  (void)dev;
  release_handle(state, handle);
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
    .mem_info = vmm_mem_info, .mem_detail = vmm_mem_detail,                          \
    .processes = vmm_processes, .chunk_adopt = vmm_chunk_adopt,                      \
    .export_handle = vmm_export_handle, .chunk_create = vmm_chunk_create,            \
    .chunk_export = vmm_chunk_export, .chunk_release = vmm_chunk_release,            \
    .chunks_copy = vmm_chunks_copy, .backup_alloc = vmm_backup_alloc,                \
    .backup_free = vmm_backup_free, .hold = vmm_hold, .unhold = vmm_unhold,          \
    .holding = vmm_holding,                                                          \
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
