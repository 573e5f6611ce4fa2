/* The VMM backends' client side (CUDA and HIP): the vendor calls only a
 * client makes (its device for a bus id, waiting for the device, plain
 * copies and fills, opening legacy IPC handles). Internal to gpu/. */
#ifndef GPUMEM_GPU_VMM_VA_H
#define GPUMEM_GPU_VMM_VA_H

#include "gpu/vmm.h"

struct vmm_va_vendor {
  const struct vmm_vendor *base;
  /* Load the client's calls (after base's load), once per process. */
  struct vmm_once *once;
  int (*device_by_bus_id)(const char *bus_id, int *dev);
  int (*sync)(void);
  int (*dtoh)(void *dst, uint64_t src, uint64_t n);
  int (*htod)(uint64_t dst, const void *src, uint64_t n);
  int (*dtod)(uint64_t dst, uint64_t src, uint64_t n);
  int (*memset32)(uint64_t dst, uint32_t value, uint64_t count);
  /* Read-write access for the host and dev to a mapped range of host
   * memory (NULL where the vendor's backups are not handed out). */
  int (*host_access)(uint64_t va, uint64_t size, int dev);
  int (*ipc_open)(const uint8_t *handle, uint64_t *dptr);
  int (*ipc_close)(uint64_t dptr);
};

extern const struct vmm_va_vendor vmm_cuda_va;
extern const struct vmm_va_vendor vmm_hip_va;

#endif
