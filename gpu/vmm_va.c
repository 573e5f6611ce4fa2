/* The VMM backends' client side (gpu/vmm_va.h): address ranges reserved,
 * imported handles mapped in them with access set, unmapped and released,
 * and copies and fills through a mapping.
 *
 * The process holds one context per device it uses, for its life, as the
 * application (PyTorch) does with the same primary context, and it is
 * current only during a call: no call changes what is current on the
 * calling thread (HIP: the device is set and the caller's set back). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "error.h"
#include "gpuva_ops.h"
#include "vmm_va.h"

/* The client's half over a vendor. */
struct vmm_va {
  struct vmm m; /* first (vmm_open_state): devices, context holds, kept fds */
  const struct vmm_va_vendor *v;
  pthread_mutex_t mu;
  bool held[GPUMEM_MAX_DEVICES]; /* the device's context is held for life */
};

/* Load the vendor runtime with the client's calls, and learn its devices
 * and granularity. */
static int vmm_open_va(const struct gpuva_ops *self, void **state, char *err, size_t errlen) {
  const struct vmm_va_vendor *v = self->impl;
  int rc = vmm_open_state(v->base, v->once, sizeof(struct vmm_va), state, err, errlen);
  if (rc < 0) return rc;
  struct vmm_va *x = *state;
  x->v = v;
  pthread_mutex_init(&x->mu, NULL);
  return 0;
}

/* Let go of the contexts held and free the state. */
static void vmm_close_va(void *state) {
  struct vmm_va *x = state;
  pthread_mutex_destroy(&x->mu);
  vmm_close_state(&x->m);
}

/* A call begins: dev's context is held (from the first call on) and
 * current until va_leave. */
static int va_enter(struct vmm_va *x, unsigned dev, int *saved) {
  if (dev >= (unsigned)x->m.ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  pthread_mutex_lock(&x->mu);
  int rc = x->held[dev] ? 0 : vmm_ctx_ref(&x->m, (int)dev);
  if (rc == 0) x->held[dev] = true;
  pthread_mutex_unlock(&x->mu);
  return rc < 0 ? rc : vmm_ctx_enter(&x->m, (int)dev, saved);
}

/* A call ends: the caller's context is current again. */
static void va_leave(struct vmm_va *x, int saved) { vmm_ctx_leave(&x->m, saved); }

/* A call whose vendor call (named call) returned st ends: the caller's
 * context is current again; 0, or -errno saying which call failed. */
static int va_done(struct vmm_va *x, int saved, int st, const char *call) {
  va_leave(x, saved);
  return vmm_check(&x->m, st, call);
}

/* A call that gives an address ends as va_done does; where it succeeded,
 * *va is p, the address the vendor call gave. */
static int va_done_at(struct vmm_va *x, int saved, int st, const char *call, uint64_t p,
                      void **va) {
  int rc = va_done(x, saved, st, call);
  if (rc == 0) *va = (void *)(uintptr_t)p;
  return rc;
}

/* This process's device number for a PCI bus id. */
static int vmm_device_by_bus_id(void *state, const char *bus_id) {
  struct vmm_va *x = state;
  int dev;
  int st = x->v->device_by_bus_id(bus_id, &dev);
  return st != 0 ? -ENODEV : dev;
}

/* Reserve an address range for mappings. */
static int vmm_reserve(void *state, unsigned dev, uint64_t size, void **va) {
  struct vmm_va *x = state;
  int saved, rc = va_enter(x, dev, &saved);
  if (rc < 0) return rc;
  uint64_t p = 0;
  int st = x->m.v->reserve(size, x->m.granularity, &p);
  return va_done_at(x, saved, st, "MemAddressReserve", p, va);
}

/* Free a reserved address range. */
static void vmm_free_va(void *state, unsigned dev, void *va, uint64_t size) {
  struct vmm_va *x = state;
  struct vmm *m = &x->m;
  int saved;
  if (va_enter(x, dev, &saved) < 0) return;
  m->v->address_free((uint64_t)(uintptr_t)va, size);
  va_leave(x, saved);
}

/* Import consumes the fd: the imported handle keeps the memory alive, and
 * the fd is kept with it until gpuva_release, to export again. */
static int vmm_import(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  struct vmm_va *x = state;
  struct vmm *m = &x->m;
  (void)size;
  int saved, rc = va_enter(x, dev, &saved);
  if (rc < 0) {
    close(fd);
    return rc;
  }
  int st = vmm_import_keep(m, fd, handle);
  va_leave(x, saved);
  if (st == -ENOMEM) return gpu_fail(-ENOMEM, "out of memory");
  return vmm_check(m, st, "MemImportFromShareableHandle");
}

/* An imported handle again as a new fd, for a daemon that restarted: a
 * copy of the fd it was imported from (vmm_import_keep kept it: CUDA
 * exports no imported handle). */
static int vmm_export_handle(void *state, unsigned dev, uint64_t handle, int *fd) {
  struct vmm_va *x = state;
  (void)dev;
  int rc = vmm_kept_dup(&x->m, handle, fd);
  if (rc < 0) return gpu_fail(rc, "exporting: %s", strerror(-rc));
  return 0;
}

/* Map an imported handle at va. */
static int vmm_map(void *state, unsigned dev, void *va, uint64_t size, uint64_t handle) {
  struct vmm_va *x = state;
  int saved, rc = va_enter(x, dev, &saved);
  if (rc < 0) return rc;
  int st = x->m.v->map((uint64_t)(uintptr_t)va, size, handle);
  return va_done(x, saved, st, "MemMap");
}

/* Allow read/write access from dev to a mapped range. */
static int vmm_set_access(void *state, unsigned dev, void *va, uint64_t size) {
  struct vmm_va *x = state;
  int saved, rc = va_enter(x, dev, &saved);
  if (rc < 0) return rc;
  int st = x->m.v->set_access((uint64_t)(uintptr_t)va, size, (int)dev);
  return va_done(x, saved, st, "MemSetAccess");
}

/* Unmap one mapping, keeping the range reserved. */
static int vmm_unmap(void *state, unsigned dev, void *va, uint64_t size) {
  struct vmm_va *x = state;
  int saved, rc = va_enter(x, dev, &saved);
  if (rc < 0) return rc;
  int st = x->m.v->unmap((uint64_t)(uintptr_t)va, size);
  return va_done(x, saved, st, "MemUnmap");
}

/* Release an imported handle and close the fd kept with it. */
static void vmm_release(void *state, unsigned dev, uint64_t handle) {
  struct vmm_va *x = state;
  (void)dev;
  vmm_release_handle(&x->m, handle);
}

/* Wait for the device's work (its primary context). */
static int vmm_sync(void *state, unsigned dev) {
  struct vmm_va *x = state;
  int saved, rc = va_enter(x, dev, &saved);
  if (rc < 0) return rc;
  int st = x->v->sync();
  return va_done(x, saved, st, "CtxSynchronize");
}

/* Copy device memory to host memory. */
static int vmm_copy_from(void *state, unsigned dev, void *dst, const void *va, uint64_t len) {
  struct vmm_va *x = state;
  int saved, rc = va_enter(x, dev, &saved);
  if (rc < 0) return rc;
  int st = x->v->dtoh(dst, (uint64_t)(uintptr_t)va, len);
  return va_done(x, saved, st, "MemcpyDtoH");
}

/* Copy host memory to device memory. */
static int vmm_copy_to(void *state, unsigned dev, void *va, const void *src, uint64_t len) {
  struct vmm_va *x = state;
  int saved, rc = va_enter(x, dev, &saved);
  if (rc < 0) return rc;
  int st = x->v->htod((uint64_t)(uintptr_t)va, src, len);
  return va_done(x, saved, st, "MemcpyHtoD");
}

/* Copy between two mappings the device reaches, and wait for it. */
static int vmm_copy_device(void *state, unsigned dev, void *dst, const void *src, uint64_t len) {
  struct vmm_va *x = state;
  int saved, rc = va_enter(x, dev, &saved);
  if (rc < 0) return rc;
  const char *call = "MemcpyDtoD";
  int st = x->v->dtod((uint64_t)(uintptr_t)dst, (uint64_t)(uintptr_t)src, len);
  if (st == 0) {
    call = "CtxSynchronize";
    st = x->v->sync();
  }
  return va_done(x, saved, st, call);
}

/* Let the host reach a backup's host memory mapped here. */
static int vmm_host_view(void *state, unsigned dev, void *va, uint64_t size) {
  struct vmm_va *x = state;
  if (!x->v->host_access) return gpu_fail(-ENOTSUP, "%s backups cannot be read here",
                                          x->m.v->name);
  int saved, rc = va_enter(x, dev, &saved);
  if (rc < 0) return rc;
  int st = x->v->host_access((uint64_t)(uintptr_t)va, size, (int)dev);
  return va_done(x, saved, st, "MemSetAccess");
}

/* Fill device memory with a 32-bit value and wait for it. */
static int vmm_fill32(void *state, unsigned dev, void *va, uint64_t len, uint32_t value) {
  struct vmm_va *x = state;
  int saved, rc = va_enter(x, dev, &saved);
  if (rc < 0) return rc;
  const char *call = "MemsetD32";
  int st = x->v->memset32((uint64_t)(uintptr_t)va, value, len / 4);
  if (st == 0) {
    call = "CtxSynchronize";
    st = x->v->sync();
  }
  return va_done(x, saved, st, call);
}

/* Open a legacy IPC handle. */
static int vmm_ipc_open(void *state, unsigned dev, const uint8_t *handle, void **va) {
  struct vmm_va *x = state;
  int saved, rc = va_enter(x, dev, &saved);
  if (rc < 0) return rc;
  uint64_t p = 0;
  int st = x->v->ipc_open(handle, &p);
  return va_done_at(x, saved, st, "IpcOpenMemHandle", p, va);
}

/* Close memory opened with vmm_ipc_open. */
static void vmm_ipc_close(void *state, unsigned dev, void *va) {
  struct vmm_va *x = state;
  int saved;
  if (va_enter(x, dev, &saved) < 0) return;
  x->v->ipc_close((uint64_t)(uintptr_t)va);
  va_leave(x, saved);
}

#define VMM_VA_OPS(vendor)                                                                  \
  {                                                                                         \
    .name = #vendor, .impl = &vmm_##vendor##_va, .open = vmm_open_va, .close = vmm_close_va, \
    .device_by_bus_id = vmm_device_by_bus_id, .reserve = vmm_reserve, .free = vmm_free_va,  \
    .import = vmm_import, .map = vmm_map, .set_access = vmm_set_access, .unmap = vmm_unmap, \
    .export_handle = vmm_export_handle, .release = vmm_release, .sync = vmm_sync,           \
    .copy_from = vmm_copy_from, .copy_to = vmm_copy_to, .copy_device = vmm_copy_device,     \
    .host_view = vmm_host_view, .fill32 = vmm_fill32,                                       \
    .ipc_open = vmm_ipc_open, .ipc_close = vmm_ipc_close,                                   \
  }

#ifdef HAVE_CUDA
const struct gpuva_ops gpuva_cuda_ops = VMM_VA_OPS(cuda);
#endif
#ifdef HAVE_HIP
const struct gpuva_ops gpuva_hip_ops = VMM_VA_OPS(hip);
#endif
