/* The CUDA vendor table for gpu/vmm.c: the CUDA driver API, loaded with
 * dlopen at run time, so that nothing links libcuda. Free and total memory
 * come from NVML, which needs no context. */
#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "vmm.h"

#define STR(x) #x
#define XSTR(x) STR(x) /* the versioned name cuda.h maps a call to */

#define CUDA_CALLS(X)                                                                   \
  X(cuInit) X(cuGetErrorName) X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetPCIBusId) \
  X(cuDeviceGetByPCIBusId) X(cuMemGetAllocationGranularity) X(cuMemCreate)              \
  X(cuMemRelease) X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle)     \
  X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) \
  X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent)            \
  X(cuCtxSynchronize) X(cuMemcpyDtoH) X(cuMemcpyHtoD) X(cuMemsetD32) X(cuMemGetInfo)     \
  X(cuMemAlloc) X(cuMemFree) X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle)                  \
  X(cuIpcCloseMemHandle) X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamSynchronize)     \
  X(cuMemcpyDtoHAsync) X(cuMemcpyHtoDAsync) X(cuMemHostAlloc) X(cuMemFreeHost)

#define DECLARE(fn) static __typeof__(&fn) p_##fn;
CUDA_CALLS(DECLARE)

/* NVML, declared here: its header is not always installed. */
typedef struct nvml_device *nvml_device;
typedef struct {
  unsigned long long total, free, used;
} nvml_memory;
static int (*p_nvmlInit)(void);
static int (*p_nvmlDeviceGetHandleByPciBusId)(const char *bus, nvml_device *dev);
static int (*p_nvmlDeviceGetMemoryInfo)(nvml_device dev, nvml_memory *mem);

#define MAX_DEVICES 64
static CUcontext contexts[MAX_DEVICES];
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int load_status;
static char load_error[256];

static void load_once(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(load_error, sizeof load_error, "no CUDA driver (libcuda.so.1): %s", dlerror());
    load_status = -ENOENT;
    return;
  }
#define LOAD(fn)                                                                      \
  if (!(p_##fn = (__typeof__(&fn))dlsym(lib, XSTR(fn)))) {                            \
    snprintf(load_error, sizeof load_error, "libcuda.so.1 lacks %s", XSTR(fn));        \
    load_status = -ENOSYS;                                                             \
    return;                                                                            \
  }
  CUDA_CALLS(LOAD)
  CUresult rc = p_cuInit(0);
  if (rc != CUDA_SUCCESS) {
    const char *name = "?";
    p_cuGetErrorName(rc, &name);
    snprintf(load_error, sizeof load_error, "no CUDA device found: cuInit: %s", name);
    load_status = -ENODEV;
    return;
  }
  void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (nvml) {
    p_nvmlInit = (int (*)(void))dlsym(nvml, "nvmlInit_v2");
    p_nvmlDeviceGetHandleByPciBusId =
        (int (*)(const char *, nvml_device *))dlsym(nvml, "nvmlDeviceGetHandleByPciBusId_v2");
    p_nvmlDeviceGetMemoryInfo = (int (*)(nvml_device, nvml_memory *))dlsym(nvml, "nvmlDeviceGetMemoryInfo");
    if (!p_nvmlInit || !p_nvmlDeviceGetHandleByPciBusId || !p_nvmlDeviceGetMemoryInfo ||
        p_nvmlInit() != 0)
      p_nvmlInit = NULL;
  }
}

static int cuda_load(char *err, size_t errlen) {
  pthread_once(&once, load_once);
  if (load_status) snprintf(err, errlen, "%s", load_error);
  return load_status;
}

static const char *cuda_error_name(int rc) {
  const char *name = NULL;
  if (p_cuGetErrorName((CUresult)rc, &name) != CUDA_SUCCESS || !name) return "CUDA_ERROR_UNKNOWN";
  return name;
}

static int cuda_device_count(int *n) { return p_cuDeviceGetCount(n); }

static int cuda_bus_id(int dev, char *buf, int len) {
  CUdevice d;
  CUresult rc = p_cuDeviceGet(&d, dev);
  return rc ? (int)rc : (int)p_cuDeviceGetPCIBusId(buf, len, d);
}

static int cuda_device_by_bus_id(const char *bus_id, int *dev) {
  CUdevice d;
  CUresult rc = p_cuDeviceGetByPCIBusId(&d, bus_id);
  *dev = (int)d;
  return (int)rc;
}

/* The properties every chunk is created with: pinned device memory that
 * can be exported as a POSIX fd. */
static CUmemAllocationProp chunk_prop(int dev) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = dev;
  return p;
}

static int cuda_granularity(int dev, uint64_t *g) {
  CUmemAllocationProp p = chunk_prop(dev);
  size_t min = 0, rec = 0;
  CUresult rc = p_cuMemGetAllocationGranularity(&min, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (rc == CUDA_SUCCESS)
    rc = p_cuMemGetAllocationGranularity(&rec, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  *g = rec > min ? rec : min;
  return (int)rc;
}

static int cuda_create(int dev, uint64_t size, uint64_t *handle) {
  CUmemAllocationProp p = chunk_prop(dev);
  CUmemGenericAllocationHandle h;
  CUresult rc = p_cuMemCreate(&h, size, &p, 0);
  *handle = h;
  return (int)rc;
}

static int cuda_release(uint64_t handle) { return p_cuMemRelease(handle); }

static int cuda_export_fd(uint64_t handle, int *fd) {
  return p_cuMemExportToShareableHandle(fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
}

static int cuda_import_fd(int fd, uint64_t *handle) {
  CUmemGenericAllocationHandle h;
  CUresult rc = p_cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd,
                                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  *handle = h;
  return (int)rc;
}

static int cuda_reserve(uint64_t size, uint64_t align, uint64_t *va) {
  CUdeviceptr p;
  CUresult rc = p_cuMemAddressReserve(&p, size, align, 0, 0);
  *va = p;
  return (int)rc;
}

static int cuda_address_free(uint64_t va, uint64_t size) { return p_cuMemAddressFree(va, size); }

static int cuda_map(uint64_t va, uint64_t size, uint64_t handle) {
  return p_cuMemMap(va, size, 0, handle, 0);
}

static int cuda_unmap(uint64_t va, uint64_t size) { return p_cuMemUnmap(va, size); }

static int cuda_set_access(uint64_t va, uint64_t size, int dev) {
  CUmemAccessDesc a;
  memset(&a, 0, sizeof a);
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = dev;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return p_cuMemSetAccess(va, size, &a, 1);
}

static int cuda_ctx_retain(int dev) {
  CUdevice d;
  CUresult rc = p_cuDeviceGet(&d, dev);
  return rc ? (int)rc : (int)p_cuDevicePrimaryCtxRetain(&contexts[dev], d);
}

static int cuda_ctx_release(int dev) {
  CUdevice d;
  CUresult rc = p_cuDeviceGet(&d, dev);
  return rc ? (int)rc : (int)p_cuDevicePrimaryCtxRelease(d);
}

static int cuda_ctx_use(int dev) { return p_cuCtxSetCurrent(contexts[dev]); }

static int cuda_sync(void) { return p_cuCtxSynchronize(); }

static int cuda_dtoh(void *dst, uint64_t src, uint64_t n) { return p_cuMemcpyDtoH(dst, src, n); }

static int cuda_htod(uint64_t dst, const void *src, uint64_t n) {
  return p_cuMemcpyHtoD(dst, src, n);
}

static int cuda_stream_create(void **stream) {
  CUstream s;
  CUresult rc = p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  *stream = s;
  return (int)rc;
}

static int cuda_stream_destroy(void *stream) { return p_cuStreamDestroy((CUstream)stream); }

static int cuda_stream_sync(void *stream) { return p_cuStreamSynchronize((CUstream)stream); }

static int cuda_dtoh_async(void *dst, uint64_t src, uint64_t n, void *stream) {
  return p_cuMemcpyDtoHAsync(dst, src, n, (CUstream)stream);
}

static int cuda_htod_async(uint64_t dst, const void *src, uint64_t n, void *stream) {
  return p_cuMemcpyHtoDAsync(dst, src, n, (CUstream)stream);
}

static int cuda_host_alloc(void **p, uint64_t size) {
  return p_cuMemHostAlloc(p, size, CU_MEMHOSTALLOC_PORTABLE);
}

static int cuda_host_free(void *p) { return p_cuMemFreeHost(p); }

static int cuda_memset32(uint64_t dst, uint32_t value, uint64_t count) {
  return p_cuMemsetD32(dst, value, count);
}

/* NVML needs no context; without it, a context is taken for the call. */
static int cuda_mem_info(int dev, uint64_t *free_bytes, uint64_t *total) {
  char bus[32];
  nvml_device nd;
  nvml_memory mem;
  if (p_nvmlInit && cuda_bus_id(dev, bus, sizeof bus) == 0 &&
      p_nvmlDeviceGetHandleByPciBusId(bus, &nd) == 0 && p_nvmlDeviceGetMemoryInfo(nd, &mem) == 0) {
    *free_bytes = mem.free;
    *total = mem.total;
    return 0;
  }
  int rc = cuda_ctx_retain(dev);
  if (rc) return rc;
  size_t f = 0, t = 0;
  if (!(rc = (int)p_cuCtxSetCurrent(contexts[dev]))) rc = (int)p_cuMemGetInfo(&f, &t);
  cuda_ctx_release(dev);
  *free_bytes = f;
  *total = t;
  return rc;
}

static int cuda_ipc_alloc(uint64_t size, uint64_t *dptr, uint8_t *handle) {
  CUdeviceptr p;
  CUresult rc = p_cuMemAlloc(&p, size);
  if (rc) return (int)rc;
  CUipcMemHandle h;
  if ((rc = p_cuIpcGetMemHandle(&h, p))) {
    p_cuMemFree(p);
    return (int)rc;
  }
  _Static_assert(sizeof h == 64, "CUDA IPC handles are 64 bytes");
  memcpy(handle, &h, sizeof h);
  *dptr = p;
  return 0;
}

static int cuda_ipc_free(uint64_t dptr) { return p_cuMemFree(dptr); }

static int cuda_ipc_open(const uint8_t *handle, uint64_t *dptr) {
  CUipcMemHandle h;
  memcpy(&h, handle, sizeof h);
  CUdeviceptr p;
  CUresult rc = p_cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  *dptr = p;
  return (int)rc;
}

static int cuda_ipc_close(uint64_t dptr) { return p_cuIpcCloseMemHandle(dptr); }

const struct vmm_vendor vmm_cuda = {
    .name = "cuda",
    .prefix = "cu",
    .device_word = "CUDA",
    .oom = CUDA_ERROR_OUT_OF_MEMORY,
    .load = cuda_load,
    .error_name = cuda_error_name,
    .device_count = cuda_device_count,
    .bus_id = cuda_bus_id,
    .device_by_bus_id = cuda_device_by_bus_id,
    .granularity = cuda_granularity,
    .create = cuda_create,
    .release = cuda_release,
    .export_fd = cuda_export_fd,
    .import_fd = cuda_import_fd,
    .reserve = cuda_reserve,
    .address_free = cuda_address_free,
    .map = cuda_map,
    .unmap = cuda_unmap,
    .set_access = cuda_set_access,
    .ctx_retain = cuda_ctx_retain,
    .ctx_release = cuda_ctx_release,
    .ctx_use = cuda_ctx_use,
    .sync = cuda_sync,
    .dtoh = cuda_dtoh,
    .htod = cuda_htod,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_sync = cuda_stream_sync,
    .dtoh_async = cuda_dtoh_async,
    .htod_async = cuda_htod_async,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .memset32 = cuda_memset32,
    .mem_info = cuda_mem_info,
    .ipc_alloc = cuda_ipc_alloc,
    .ipc_free = cuda_ipc_free,
    .ipc_open = cuda_ipc_open,
    .ipc_close = cuda_ipc_close,
};
