/* The vendor side of the VMM backends (CUDA and HIP): the same calls with
 * the same meaning, loaded at run time, so that gpu/vmm.c holds the logic
 * once and every test on one vendor exercises the code the other runs.
 * Every call returns the vendor's status: 0 is success. Internal to gpu/. */
#ifndef GPUMEM_GPU_VMM_H
#define GPUMEM_GPU_VMM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu.h"

/* The vendor headers each backend was compiled against ("HIP 6.4.43484"). */
extern const char vmm_cuda_headers[];
extern const char vmm_hip_headers[];

struct vmm_vendor {
  const char *name;   /* "cuda", "hip" */
  const char *prefix; /* "cu", "hip": error messages name calls prefix+Name */
  const char *device_word; /* "CUDA", "HIP": for "no CUDA device found" */
  int oom;            /* the vendor's out-of-memory status */
  /* dlopen the runtime and initialize it; 0, or -errno with err filled. */
  int (*load)(char *err, size_t errlen);
  const char *(*error_name)(int rc);
  int (*device_count)(int *n);
  int (*bus_id)(int dev, char *buf, int len);
  int (*device_by_bus_id)(const char *bus_id, int *dev);
  int (*granularity)(int dev, uint64_t *g);
  int (*create)(int dev, uint64_t size, uint64_t *handle);
  int (*release)(uint64_t handle);
  int (*export_fd)(uint64_t handle, int *fd);
  int (*import_fd)(int fd, uint64_t *handle);
  int (*reserve)(uint64_t size, uint64_t align, uint64_t *va);
  int (*address_free)(uint64_t va, uint64_t size);
  int (*map)(uint64_t va, uint64_t size, uint64_t handle);
  int (*unmap)(uint64_t va, uint64_t size);
  int (*set_access)(uint64_t va, uint64_t size, int dev);
  /* Hold (retain) the device's primary context, or let go of it; neither
   * changes what is current on the calling thread. */
  int (*ctx_retain)(int dev);
  int (*ctx_release)(int dev);
  /* Make the retained context of dev current on this thread over what was
   * (CUDA: pushed; HIP: the device chosen, the one before kept in *saved);
   * ctx_leave puts back what was current, context or none. */
  int (*ctx_enter)(int dev, int *saved);
  int (*ctx_leave)(int saved);
  int (*sync)(void);
  int (*dtoh)(void *dst, uint64_t src, uint64_t n);
  int (*htod)(uint64_t dst, const void *src, uint64_t n);
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
  int (*memset32)(uint64_t dst, uint32_t value, uint64_t count);
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
   * used GPU_USED_UNKNOWN where the library gives no figure. */
  int (*processes)(int dev, struct gpu_process **list, size_t *n);
  int (*ipc_alloc)(uint64_t size, uint64_t *dptr, uint8_t *handle);
  int (*ipc_free)(uint64_t dptr);
  int (*ipc_open)(const uint8_t *handle, uint64_t *dptr);
  int (*ipc_close)(uint64_t dptr);
};

extern const struct vmm_vendor vmm_cuda;
extern const struct vmm_vendor vmm_hip;

#endif
