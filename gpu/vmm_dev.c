/* The VMM backends' daemon side (gpu/vmm_dev.h): devices and their
 * figures, chunks created, exported, adopted and released, context holds
 * for backups, and legacy IPC memory; the backups themselves are in
 * gpu/vmm_backup.c. Every driver call goes through the gate
 * (gpu/vmm_gate.h), so that a backup piece is pinned only between them. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "error.h"
#include "gpudev_ops.h"
#include "vmm_backup.h"
#include "vmm_dev_ckpt.h"
#include "vmm_dev.h"

/* Load the vendor runtime with the daemon's calls, and learn its devices
 * and granularity. */
static int vmm_open_dev(const struct gpudev_ops *self, const struct gpudev_options *opt,
                        void **state, char *err, size_t errlen) {
  const struct vmm_dev_vendor *v = self->impl;
  (void)opt;
  int rc = vmm_open_state(v->base, v->once, sizeof(struct vmm_dev), state, err, errlen);
  if (rc < 0) return rc;
  struct vmm_dev *x = *state;
  x->v = v;
  if (!(x->backups = idmap_create())) {
    vmm_close_state(&x->m);
    snprintf(err, errlen, "out of memory");
    return -ENOMEM;
  }
  for (int d = 0; v->host_granularity && d < x->m.ndev && d < GPUMEM_MAX_DEVICES; d++)
    v->host_granularity(d, &x->host_gran[d]);
  vmm_gate_init(&x->gate);
  return 0;
}

/* Let go of every context still held and free the state. */
static void vmm_close_dev(void *state) {
  struct vmm_dev *x = state;
  vmm_gate_destroy(&x->gate);
  idmap_destroy(x->backups);
  vmm_close_state(&x->m);
}

/* Number of devices. */
static unsigned vmm_device_count(void *state) {
  return (unsigned)((struct vmm_dev *)state)->m.ndev;
}

/* The coarsest granularity of all devices. */
static uint64_t vmm_granularity(void *state) { return ((struct vmm_dev *)state)->m.granularity; }

/* Free and total bytes of a device, as the vendor table reads them. */
static int vmm_mem_info(void *state, unsigned dev, uint64_t *free_bytes, uint64_t *total) {
  struct vmm_dev *x = state;
  vmm_gate_begin(&x->gate);
  int st = x->v->mem_info((int)dev, free_bytes, total);
  vmm_gate_end_query(&x->gate);
  return vmm_check(&x->m, st, "MemGetInfo");
}

/* The driver's figures with its reserve apart, from the management
 * library without a context; where that says nothing, mem_info's figures
 * with no reserve. */
static int vmm_mem_detail(void *state, unsigned dev, struct gpudev_mem *mem) {
  struct vmm_dev *x = state;
  struct vmm *m = &x->m;
  if ((int)dev >= m->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  vmm_gate_begin(&x->gate);
  int rc = x->v->mem_detail((int)dev, &mem->total, &mem->free, &mem->reserved);
  vmm_gate_end_query(&x->gate);
  if (rc != -ENOTSUP) return rc;
  mem->reserved = 0;
  return vmm_mem_info(state, dev, &mem->free, &mem->total);
}

/* The driver's per-process list, this process left out: what the daemon
 * holds (its context, IPC memory) it made for itself. */
static int vmm_processes(void *state, unsigned dev, struct gpudev_process *out, size_t max,
                         size_t *n) {
  struct vmm_dev *x = state;
  struct vmm *m = &x->m;
  if ((int)dev >= m->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  struct gpudev_process *list = NULL;
  size_t count = 0;
  vmm_gate_begin(&x->gate);
  int rc = x->v->processes((int)dev, &list, &count);
  vmm_gate_end_query(&x->gate);
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

/* Import a handed-over fd and check that it is the driver's memory on dev
 * (see vmm_chunk_adopt). */
static int adopt(struct vmm_dev *x, unsigned dev, int fd, uint64_t *handle) {
  struct vmm *m = &x->m;
  int st = vmm_import_keep(m, fd, handle);
  if (st == -ENOMEM) return gpu_fail(-ENOMEM, "out of memory");
  if (st != 0)
    return gpu_fail(st == m->v->oom ? -ENOMEM : -EINVAL,
                    "adopting: %sMemImportFromShareableHandle: %s (not this driver's memory?)",
                    m->v->prefix, m->v->error_name(st));
  int on = -1;
  if ((st = x->v->handle_device(*handle, &on)) == 0 && on == (int)dev) return 0;
  vmm_release_handle(m, *handle);
  return st ? vmm_fail(m, st, "MemGetAllocationPropertiesFromHandle")
            : gpu_fail(-EINVAL, "adopting: memory of device %d, not %u", on, dev);
}

/* Import a handed-over fd and check what the driver can: that it is its
 * memory, on dev. The driver does not say how big an imported allocation
 * is, so size is taken on trust (a mapping past its end would fail). The
 * fd is kept with the handle, so the chunk exports like any other (CUDA
 * exports no imported handle). */
static int vmm_chunk_adopt(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  struct vmm_dev *x = state;
  struct vmm *m = &x->m;
  int rc = (int)dev >= m->ndev ? gpu_fail(-ENODEV, "no device %u", dev)
           : size == 0 || size % m->granularity
               ? gpu_fail(-EINVAL, "adopting: %llu bytes is not a multiple of the granularity",
                          (unsigned long long)size)
               : 0;
  if (rc < 0) {
    close(fd);
    return rc;
  }
  vmm_gate_begin(&x->gate);
  rc = adopt(x, dev, fd, handle);
  vmm_gate_end(&x->gate);
  return rc;
}

/* Create a physical chunk (no context needed). */
static int vmm_chunk_create(void *state, unsigned dev, uint64_t size, uint64_t *handle) {
  struct vmm_dev *x = state;
  vmm_gate_begin(&x->gate);
  int st = x->v->create((int)dev, size, handle);
  vmm_gate_end(&x->gate);
  return vmm_check(&x->m, st, "MemCreate");
}

/* A new fd for a chunk: a copy of the kept one where the chunk was
 * adopted, else the driver's export. Returns the vendor's status, or
 * -errno. */
static int export_any(struct vmm_dev *x, uint64_t handle, int *fd) {
  int rc = vmm_kept_dup(&x->m, handle, fd);
  return rc == -ENOENT ? x->v->export_fd(handle, fd) : rc;
}

/* Export a chunk; an adopted one by a copy of the fd it came from. */
static int vmm_chunk_export(void *state, uint64_t handle, int *fd) {
  struct vmm_dev *x = state;
  vmm_gate_begin(&x->gate);
  int st = export_any(x, handle, fd);
  vmm_gate_end(&x->gate);
  if (st < 0) return gpu_fail(st, "exporting: %s", strerror(-st));
  return vmm_check(&x->m, st, "MemExportToShareableHandle");
}

/* Release a chunk and close any fd kept with it. */
static void vmm_chunk_release(void *state, unsigned dev, uint64_t handle, uint64_t size) {
  struct vmm_dev *x = state;
  struct vmm *m = &x->m;
  (void)dev;
  (void)size;
  vmm_gate_begin(&x->gate);
  vmm_release_handle(m, handle);
  vmm_gate_end(&x->gate);
}

/* Hold the device's primary context (backups need it). */
static int vmm_hold(void *state, unsigned dev) {
  struct vmm_dev *x = state;
  struct vmm *m = &x->m;
  vmm_gate_begin(&x->gate);
  int rc = vmm_ctx_ref(m, (int)dev);
  vmm_gate_end(&x->gate);
  return rc;
}

/* Let go of a vmm_hold. */
static void vmm_unhold(void *state, unsigned dev) {
  struct vmm_dev *x = state;
  struct vmm *m = &x->m;
  vmm_gate_begin(&x->gate);
  vmm_ctx_unref(m, (int)dev);
  vmm_gate_end(&x->gate);
}

/* True while the daemon's half holds the device's context. */
static bool vmm_holding(void *state, unsigned dev) {
  struct vmm_dev *x = state;
  return vmm_ctx_held(&x->m, dev);
}

/* The device's PCI bus id. */
static int vmm_bus_id(void *state, unsigned dev, char *buf, size_t len) {
  struct vmm_dev *x = state;
  vmm_gate_begin(&x->gate);
  int st = x->v->bus_id((int)dev, buf, (int)len);
  vmm_gate_end_query(&x->gate);
  return vmm_check(&x->m, st, "DeviceGetPCIBusId");
}

/* Legacy IPC memory lives in a context the daemon holds while it exists. */
static int vmm_ipc_alloc(void *state, unsigned dev, uint64_t size, uint64_t *dptr,
                         uint8_t *handle) {
  int saved = 0, rc = vmm_held_begin(state, dev, &saved);
  if (rc < 0) return rc;
  int st = ((struct vmm_dev *)state)->v->ipc_alloc(size, dptr, handle);
  return vmm_held_end(state, dev, saved, st, "MemAlloc/IpcGetMemHandle");
}

/* Free legacy IPC memory and let go of its context. */
static void vmm_ipc_free(void *state, unsigned dev, uint64_t dptr, uint64_t size) {
  int saved = 0;
  (void)size;
  bool entered = vmm_drop_begin(state, dev, &saved);
  if (entered) ((struct vmm_dev *)state)->v->ipc_free(dptr);
  vmm_drop_end(state, dev, saved, entered);
}


#define VMM_DEV_OPS(vendor)                                                                  \
  {                                                                                          \
    .name = #vendor, .built_with = vmm_##vendor##_headers, .impl = &vmm_##vendor##_dev,     \
    .open = vmm_open_dev, .close = vmm_close_dev, .device_count = vmm_device_count,          \
    .granularity = vmm_granularity, .mem_info = vmm_mem_info, .mem_detail = vmm_mem_detail,  \
    .processes = vmm_processes, .chunk_adopt = vmm_chunk_adopt,                              \
    .process_release = vmm_process_release, .process_restore = vmm_process_restore,          \
    .process_released = vmm_process_released,                                                \
    .chunk_create = vmm_chunk_create, .chunk_export = vmm_chunk_export,                      \
    .chunk_release = vmm_chunk_release, .chunks_copy = vmm_backup_copy,                      \
    .backup_reserve = vmm_backup_reserve, .backup_make = vmm_backup_make,                    \
    .backup_release = vmm_backup_release, .backup_alloc = vmm_backup_alloc,                  \
    .backup_free = vmm_backup_free, .backup_host_only = vmm_backup_host_only,               \
    .backup_export = vmm_backup_export,                                                      \
    .hold = vmm_hold, .unhold = vmm_unhold,                                                  \
    .holding = vmm_holding, .bus_id = vmm_bus_id, .ipc_alloc = vmm_ipc_alloc,                \
    .ipc_free = vmm_ipc_free,                                                                \
  }

#ifdef HAVE_CUDA
const struct gpudev_ops gpudev_cuda_ops = VMM_DEV_OPS(cuda);
#endif
#ifdef HAVE_HIP
const struct gpudev_ops gpudev_hip_ops = VMM_DEV_OPS(hip);
#endif
