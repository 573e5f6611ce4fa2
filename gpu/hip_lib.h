/* What the HIP files share (hip_lib.c, hip_dev.c, hip_va.c): the runtime
 * loaded at run time, how each file resolves the calls it makes, the
 * properties every chunk is created with, and the conversions between
 * HIP's pointers and the vendor tables' integers. Internal to gpu/; only
 * the HIP files include it (it includes hip/hip_runtime_api.h). */
#ifndef GPUMEM_GPU_HIP_LIB_H
#define GPUMEM_GPU_HIP_LIB_H

#define __HIP_PLATFORM_AMD__
#include <dlfcn.h>
#include <errno.h>
#include <hip/hip_runtime_api.h>
#include <hip/hip_version.h>
#include <stdint.h>
#include <stdio.h>

#define HIP_AT_LEAST(major, minor) \
  (HIP_VERSION_MAJOR > (major) || (HIP_VERSION_MAJOR == (major) && HIP_VERSION_MINOR >= (minor)))

/* Declare the pointer a call is made through, p_<call>, of the call's
 * type. */
#define HIP_DECLARE(fn) static __typeof__(&fn) p_##fn;

/* Resolve one call by name, from the library the caller has in lib; on
 * failure record why in once (the caller's struct vmm_once, gpu/vmm.h)
 * and return from the caller. */
#define HIP_LOAD(fn)                                            \
  if (!(p_##fn = (__typeof__(&fn))dlsym(lib, #fn))) {           \
    vmm_once_fail(&once, -ENOSYS, "libamdhip64 lacks %s", #fn); \
    return;                                                     \
  }

/* The runtime library, once vmm_hip has loaded it (NULL before). */
void *hip_lib_handle(void);

/* The properties every chunk is created with. */
hipMemAllocationProp hip_lib_chunk_prop(int dev);

/* A handle as the vendor tables carry it. */
static inline uint64_t hip_from_handle(hipMemGenericAllocationHandle_t h) {
  return (uint64_t)(uintptr_t)h;
}

/* A vendor table's handle as HIP takes it. */
static inline hipMemGenericAllocationHandle_t hip_to_handle(uint64_t h) {
  return (hipMemGenericAllocationHandle_t)(uintptr_t)h;
}

/* A vendor table's address as HIP takes it. */
static inline void *hip_ptr(uint64_t va) { return (void *)(uintptr_t)va; }

#endif
