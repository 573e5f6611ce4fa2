/* The VMM backends' daemon side (CUDA and HIP): the vendor calls only the
 * daemon makes (creating and exporting chunks, copies on streams, pinned
 * host memory, the management library's figures, legacy IPC memory) and
 * the state of the daemon's half over them.
 *
 * The daemon holds no device context while idle (a CUDA primary context
 * costs about half a GiB per GPU): create, export and release need none;
 * copies, backups and legacy IPC memory hold the device's primary context
 * only for as long as they need it. No call changes what is current on
 * the calling thread: a call that needs a context pushes the device's
 * primary context and pops it before it returns (HIP: sets the device and
 * sets the caller's back). Internal to gpu/. */
#ifndef GPUMEM_GPU_VMM_DEV_H
#define GPUMEM_GPU_VMM_DEV_H

#include "gpu/gpudev.h"
#include "gpu/vmm.h"
#include "gpu/vmm_gate.h"

/* A process's state under the driver's checkpoint calls. */
enum vmm_ckpt_state { VMM_CKPT_RUNNING, VMM_CKPT_LOCKED, VMM_CKPT_CHECKPOINTED, VMM_CKPT_FAILED };

struct vmm_dev_vendor {
  const struct vmm_vendor *base;
  /* Load the daemon's calls (after base's load) and the management
   * library where it is, once per process. */
  struct vmm_once *once;
  int (*bus_id)(int dev, char *buf, int len);
  int (*create)(int dev, uint64_t size, uint64_t *handle);
  int (*export_fd)(uint64_t handle, int *fd);
  int (*stream_create)(void **stream);
  int (*stream_destroy)(void *stream);
  int (*stream_sync)(void *stream);
  int (*dtoh_async)(void *dst, uint64_t src, uint64_t n, void *stream);
  int (*htod_async)(uint64_t dst, const void *src, uint64_t n, void *stream);
  /* Pinned host memory, usable from every context. */
  int (*host_alloc)(void **p, uint64_t size);
  int (*host_free)(void *p);
  /* Pin (page-lock) host memory the process has, for every context, or
   * let go of a pinned range by its start. */
  int (*host_register)(void *p, uint64_t size);
  int (*host_unregister)(void *p);
  /* Free and total device memory, without a context where possible. */
  int (*mem_info)(int dev, uint64_t *free_bytes, uint64_t *total);
  /* The device a handle's memory is on (to check memory handed over). */
  int (*handle_device)(uint64_t handle, int *dev);
  /* From the vendor's management library (NVML, ROCm SMI), which needs no
   * context; these two return 0 or -errno, with words through gpu_fail,
   * and -ENOTSUP where the library is missing or says nothing. */
  /* Total, free and driver-reserved bytes of a device. */
  int (*mem_detail)(int dev, uint64_t *total, uint64_t *free_bytes, uint64_t *reserved);
  /* The processes using a device: a malloc'd list (the caller frees it),
   * used GPUDEV_USED_UNKNOWN where the library gives no figure. */
  int (*processes)(int dev, struct gpudev_process **list, size_t *n);
  int (*ipc_alloc)(uint64_t size, uint64_t *dptr, uint8_t *handle);
  int (*ipc_free)(uint64_t dptr);
  /* Backup host memory that lives apart from any context (CUDA's
   * host-NUMA allocations; NULL where the vendor has none, HIP): the
   * granularity of such memory for dev (0: dev cannot have it), one made
   * (a handle, released with base->release, mapped with base->map, all
   * without a context), and read-write access to a mapped range for the
   * host, and for dev too where device is true (dev's access costs 2 MiB
   * of device memory per GiB on an H200, by NVML: it is taken away when a
   * node is to hold nothing, gpudev_backup_host_only). Copies
   * through it run as from pinned memory. */
  int (*host_granularity)(int dev, uint64_t *g);
  int (*host_create)(int dev, uint64_t size, uint64_t *handle);
  int (*host_access)(uint64_t va, uint64_t size, int dev, bool device);
  /* The driver's checkpoint of another process, by pid (NULL, or -ENOTSUP
   * from ckpt_state, where the driver has none): hold its device calls
   * (waiting at most timeout_ms), move its device state to host memory,
   * bring it back, let its calls go on; its state now. Vendor statuses. */
  int (*ckpt_lock)(int pid, unsigned timeout_ms);
  int (*ckpt_checkpoint)(int pid);
  int (*ckpt_restore)(int pid);
  int (*ckpt_unlock)(int pid);
  int (*ckpt_state)(int pid, enum vmm_ckpt_state *state);
};

extern const struct vmm_dev_vendor vmm_cuda_dev;
extern const struct vmm_dev_vendor vmm_hip_dev;

/* The daemon's half over a vendor. */
struct vmm_dev {
  struct vmm m; /* first (vmm_open_state): devices, context holds, kept fds */
  const struct vmm_dev_vendor *v;
  struct vmm_gate gate; /* between backup pieces and every other call */
  idmap *backups; /* host address -> struct vmm_host_backup, under m.mu */
  uint64_t host_gran[GPUMEM_MAX_DEVICES]; /* of host-NUMA memory; 0: none */
};

#endif
