/* What the CUDA files share (cuda_lib.c, cuda_dev.c, cuda_va.c): the driver
 * library loaded at run time, how each file resolves the calls it makes,
 * and the properties every chunk is created with. Internal to gpu/; only
 * the CUDA files include it (it includes cuda.h). */
#ifndef GPUMEM_GPU_CUDA_LIB_H
#define GPUMEM_GPU_CUDA_LIB_H

#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>

#define CUDA_STR(x) #x
#define CUDA_XSTR(x) CUDA_STR(x) /* the versioned name cuda.h maps a call to */

/* Declare the pointer a call is made through, p_<call>, of the call's
 * type. */
#define CUDA_DECLARE(fn) static __typeof__(&fn) p_##fn;

/* Resolve one call by the name cuda.h maps it to, from the library the
 * caller has in lib; on failure record why in once (the caller's struct
 * vmm_once, gpu/vmm.h) and return from the caller. */
#define CUDA_LOAD(fn)                                                      \
  if (!(p_##fn = (__typeof__(&fn))dlsym(lib, CUDA_XSTR(fn)))) {            \
    vmm_once_fail(&once, -ENOSYS, "libcuda.so.1 lacks %s", CUDA_XSTR(fn)); \
    return;                                                                \
  }

/* The driver library, once vmm_cuda has loaded it (NULL before). */
void *cuda_lib_handle(void);

/* The properties every chunk is created with: pinned device memory that
 * can be exported as a POSIX fd. */
CUmemAllocationProp cuda_lib_chunk_prop(int dev);

#endif
