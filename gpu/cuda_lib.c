/* The CUDA vendor table both halves use (gpu/vmm.h): the CUDA driver API,
 * loaded with dlopen at run time, so that nothing links libcuda. The
 * daemon's own calls are in cuda_dev.c, the client's in cuda_va.c. */
#include "cuda_lib.h"

#include <pthread.h>
#include <string.h>

#include "common/limits.h"
#include "vmm.h"

#define CUDA_CALLS(X)                                                                     \
  X(cuInit) X(cuGetErrorName) X(cuDeviceGetCount) X(cuDeviceGet)                          \
  X(cuMemGetAllocationGranularity) X(cuMemRelease) X(cuMemImportFromShareableHandle)      \
  X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)  \
  X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxPushCurrent)            \
  X(cuCtxPopCurrent)

CUDA_CALLS(CUDA_DECLARE)

static CUcontext contexts[GPUMEM_MAX_DEVICES];
static void *loaded; /* the library, once initialized */
static void load_once(void);
static struct vmm_once once = {.once = PTHREAD_ONCE_INIT, .load = load_once};

/* Open the driver, resolve the common calls and initialize it. */
static void load_once(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    vmm_once_fail(&once, -ENOENT, "no CUDA driver (libcuda.so.1): %s", dlerror());
    return;
  }
  CUDA_CALLS(CUDA_LOAD)
  CUresult rc = p_cuInit(0);
  if (rc != CUDA_SUCCESS) {
    const char *name = "?";
    p_cuGetErrorName(rc, &name);
    vmm_once_fail(&once, -ENODEV, "no CUDA device found: cuInit: %s", name);
    return;
  }
  loaded = lib;
}

/* Load the driver once per process; its status every time. */
static int cuda_load(char *err, size_t errlen) { return vmm_once_run(&once, err, errlen); }

/* The driver library, once loaded. */
void *cuda_lib_handle(void) { return loaded; }

/* The driver's name for a status. */
static const char *cuda_error_name(int rc) {
  const char *name = NULL;
  if (p_cuGetErrorName((CUresult)rc, &name) != CUDA_SUCCESS || !name) return "CUDA_ERROR_UNKNOWN";
  return name;
}

/* Number of devices. */
static int cuda_device_count(int *n) { return p_cuDeviceGetCount(n); }

/* The properties every chunk is created with. */
CUmemAllocationProp cuda_lib_chunk_prop(int dev) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = dev;
  return p;
}

/* The granularity of chunks with those properties: the recommended one,
 * or the minimum where that is coarser. */
static int cuda_granularity(int dev, uint64_t *g) {
  CUmemAllocationProp p = cuda_lib_chunk_prop(dev);
  size_t min = 0, rec = 0;
  CUresult rc = p_cuMemGetAllocationGranularity(&min, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (rc == CUDA_SUCCESS)
    rc = p_cuMemGetAllocationGranularity(&rec, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  *g = rec > min ? rec : min;
  return (int)rc;
}

/* Release a created or imported handle. */
static int cuda_release(uint64_t handle) { return p_cuMemRelease(handle); }

/* Import an exported POSIX fd (the fd stays the caller's). */
static int cuda_import_fd(int fd, uint64_t *handle) {
  CUmemGenericAllocationHandle h;
  CUresult rc = p_cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  *handle = h;
  return (int)rc;
}

/* Reserve a virtual address range. */
static int cuda_reserve(uint64_t size, uint64_t align, uint64_t *va) {
  CUdeviceptr p;
  CUresult rc = p_cuMemAddressReserve(&p, size, align, 0, 0);
  *va = p;
  return (int)rc;
}

/* Free a reserved range. */
static int cuda_address_free(uint64_t va, uint64_t size) { return p_cuMemAddressFree(va, size); }

/* Map a handle at va. */
static int cuda_map(uint64_t va, uint64_t size, uint64_t handle) {
  return p_cuMemMap(va, size, 0, handle, 0);
}

/* Unmap one mapping. */
static int cuda_unmap(uint64_t va, uint64_t size) { return p_cuMemUnmap(va, size); }

/* Read/write access to a mapped range from dev. */
static int cuda_set_access(uint64_t va, uint64_t size, int dev) {
  CUmemAccessDesc a;
  memset(&a, 0, sizeof a);
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = dev;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return p_cuMemSetAccess(va, size, &a, 1);
}

/* Retain the device's primary context (kept for ctx_enter). */
static int cuda_ctx_retain(int dev) {
  CUdevice d;
  CUresult rc = p_cuDeviceGet(&d, dev);
  return rc ? (int)rc : (int)p_cuDevicePrimaryCtxRetain(&contexts[dev], d);
}

/* Release the device's primary context. */
static int cuda_ctx_release(int dev) {
  CUdevice d;
  CUresult rc = p_cuDeviceGet(&d, dev);
  return rc ? (int)rc : (int)p_cuDevicePrimaryCtxRelease(d);
}

/* The caller's context stays under ours on the thread's stack, and comes
 * back (or none) when ours is popped. */
static int cuda_ctx_enter(int dev, int *saved) {
  (void)saved;
  return p_cuCtxPushCurrent(contexts[dev]);
}

/* Pop the context cuda_ctx_enter pushed. */
static int cuda_ctx_leave(int saved) {
  CUcontext popped;
  (void)saved;
  return p_cuCtxPopCurrent(&popped);
}

const char vmm_cuda_headers[] = "CUDA_VERSION " CUDA_XSTR(CUDA_VERSION);

const struct vmm_vendor vmm_cuda = {
    .name = "cuda",
    .prefix = "cu",
    .device_word = "CUDA",
    .oom = CUDA_ERROR_OUT_OF_MEMORY,
    .load = cuda_load,
    .error_name = cuda_error_name,
    .device_count = cuda_device_count,
    .granularity = cuda_granularity,
    .release = cuda_release,
    .import_fd = cuda_import_fd,
    .reserve = cuda_reserve,
    .address_free = cuda_address_free,
    .map = cuda_map,
    .unmap = cuda_unmap,
    .set_access = cuda_set_access,
    .ctx_retain = cuda_ctx_retain,
    .ctx_release = cuda_ctx_release,
    .ctx_enter = cuda_ctx_enter,
    .ctx_leave = cuda_ctx_leave,
};
