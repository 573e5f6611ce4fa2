/* The CUDA vendor table for gpu/vmm.c: the CUDA driver API, loaded with
 * dlopen at run time, so that nothing links libcuda. Device memory figures
 * and the per-process list come from NVML, which needs no context. */
#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "common/limits.h"
#include "vmm.h"

#define STR(x) #x
#define XSTR(x) STR(x) /* the versioned name cuda.h maps a call to */

#define CUDA_CALLS(X)                                                                   \
  X(cuInit) X(cuGetErrorName) X(cuDeviceGetCount) X(cuDeviceGet) X(cuDeviceGetPCIBusId) \
  X(cuDeviceGetByPCIBusId) X(cuMemGetAllocationGranularity) X(cuMemCreate)              \
  X(cuMemRelease) X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle)     \
  X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess) \
  X(cuDevicePrimaryCtxRetain) X(cuDevicePrimaryCtxRelease) X(cuCtxPushCurrent)           \
  X(cuCtxPopCurrent) X(cuCtxSynchronize) X(cuMemcpyDtoH) X(cuMemcpyHtoD) X(cuMemsetD32) X(cuMemGetInfo)     \
  X(cuMemAlloc) X(cuMemFree) X(cuIpcGetMemHandle) X(cuIpcOpenMemHandle)                  \
  X(cuIpcCloseMemHandle) X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamSynchronize)     \
  X(cuMemcpyDtoHAsync) X(cuMemcpyHtoDAsync) X(cuMemHostAlloc) X(cuMemFreeHost)          \
  X(cuMemHostRegister) X(cuMemHostUnregister) X(cuMemGetAllocationPropertiesFromHandle)

#define DECLARE(fn) static __typeof__(&fn) p_##fn;
CUDA_CALLS(DECLARE)

/* NVML, declared here from its documented ABI (nvml.h): its header is not
 * always installed. */
typedef struct nvml_device *nvml_device;
typedef struct { /* nvmlMemory_t */
  unsigned long long total, free, used;
} nvml_memory;
typedef struct { /* nvmlMemory_v2_t: used leaves out the driver's reserve */
  unsigned version;
  unsigned long long total, reserved, free, used;
} nvml_memory_v2;
typedef struct { /* nvmlProcessInfo_t, as _v2 and _v3 of the process calls fill it */
  unsigned pid;
  unsigned long long used_gpu_memory;
  unsigned gpu_instance_id, compute_instance_id;
} nvml_process;
_Static_assert(sizeof(nvml_memory_v2) == 40, "nvmlMemory_v2_t is 40 bytes");
_Static_assert(sizeof(nvml_process) == 24, "nvmlProcessInfo_t is 24 bytes");
#define NVML_MEMORY_V2 ((unsigned)(sizeof(nvml_memory_v2) | (2u << 24))) /* nvmlMemory_v2 */
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_VALUE_NOT_AVAILABLE (~0ull)
static int (*p_nvmlInit)(void);
static const char *(*p_nvmlErrorString)(int rc);
static int (*p_nvmlDeviceGetHandleByPciBusId)(const char *bus, nvml_device *dev);
static int (*p_nvmlDeviceGetMemoryInfo)(nvml_device dev, nvml_memory *mem);
static int (*p_nvmlDeviceGetMemoryInfo_v2)(nvml_device dev, nvml_memory_v2 *mem); /* optional */
static int (*p_nvmlDeviceGetComputeRunningProcesses)(nvml_device dev, unsigned *count,
                                                     nvml_process *infos); /* optional */

static CUcontext contexts[GPUMEM_MAX_DEVICES];
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int load_status;
static char load_error[256];

/* Load NVML if it is there; without it, memory figures take a context and
 * there is no per-process list. The v2 memory call and the process list
 * are looked up by the newest name the driver has. */
static void nvml_load(void) {
  void *nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!nvml) return;
#define NVML_SYM(p, name) (p = (__typeof__(p))dlsym(nvml, name))
  NVML_SYM(p_nvmlInit, "nvmlInit_v2");
  NVML_SYM(p_nvmlErrorString, "nvmlErrorString");
  NVML_SYM(p_nvmlDeviceGetHandleByPciBusId, "nvmlDeviceGetHandleByPciBusId_v2");
  NVML_SYM(p_nvmlDeviceGetMemoryInfo, "nvmlDeviceGetMemoryInfo");
  NVML_SYM(p_nvmlDeviceGetMemoryInfo_v2, "nvmlDeviceGetMemoryInfo_v2");
  if (!NVML_SYM(p_nvmlDeviceGetComputeRunningProcesses, "nvmlDeviceGetComputeRunningProcesses_v3"))
    NVML_SYM(p_nvmlDeviceGetComputeRunningProcesses, "nvmlDeviceGetComputeRunningProcesses_v2");
  if (!p_nvmlInit || !p_nvmlErrorString || !p_nvmlDeviceGetHandleByPciBusId ||
      !p_nvmlDeviceGetMemoryInfo || p_nvmlInit() != 0)
    p_nvmlInit = NULL;
}

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
  nvml_load();
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

/* The caller's context stays under ours on the thread's stack, and comes
 * back (or none) when ours is popped. */
static int cuda_ctx_enter(int dev, int *saved) {
  (void)saved;
  return p_cuCtxPushCurrent(contexts[dev]);
}

static int cuda_ctx_leave(int saved) {
  CUcontext popped;
  (void)saved;
  return p_cuCtxPopCurrent(&popped);
}

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

static int cuda_host_register(void *p, uint64_t size) {
  return p_cuMemHostRegister(p, size, CU_MEMHOSTREGISTER_PORTABLE);
}

static int cuda_host_unregister(void *p) { return p_cuMemHostUnregister(p); }

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
  if (!(rc = cuda_ctx_enter(dev, NULL))) {
    rc = (int)p_cuMemGetInfo(&f, &t);
    cuda_ctx_leave(0);
  }
  cuda_ctx_release(dev);
  *free_bytes = f;
  *total = t;
  return rc;
}

/* NVML's handle of a CUDA device, found by PCI bus id (the two number
 * devices differently); -ENOTSUP without NVML. */
static int nvml_device_of(int dev, nvml_device *nd) {
  char bus[32];
  if (!p_nvmlInit) return gpu_fail(-ENOTSUP, "no NVML (libnvidia-ml.so.1)");
  int rc = cuda_bus_id(dev, bus, sizeof bus);
  if (rc) return gpu_fail(-EIO, "cuDeviceGetPCIBusId: %s", cuda_error_name(rc));
  if ((rc = p_nvmlDeviceGetHandleByPciBusId(bus, nd)) != 0)
    return gpu_fail(-EIO, "nvmlDeviceGetHandleByPciBusId(%s): %s", bus, p_nvmlErrorString(rc));
  return 0;
}

/* Memory figures without a context: NVML's v2 call keeps the driver's
 * reserve out of used (v1 counts it as used: about 600 MiB on an idle
 * H200); drivers without v2 get v1 and a reserve of 0. */
static int cuda_mem_detail(int dev, uint64_t *total, uint64_t *free_bytes, uint64_t *reserved) {
  nvml_device nd;
  int rc = nvml_device_of(dev, &nd);
  if (rc < 0) return rc;
  nvml_memory_v2 m2 = {.version = NVML_MEMORY_V2};
  if (p_nvmlDeviceGetMemoryInfo_v2 && p_nvmlDeviceGetMemoryInfo_v2(nd, &m2) == 0) {
    *total = m2.total;
    *free_bytes = m2.free;
    *reserved = m2.reserved;
    return 0;
  }
  nvml_memory m1;
  if ((rc = p_nvmlDeviceGetMemoryInfo(nd, &m1)) != 0)
    return gpu_fail(-EIO, "nvmlDeviceGetMemoryInfo: %s", p_nvmlErrorString(rc));
  *total = m1.total;
  *free_bytes = m1.free;
  *reserved = 0;
  return 0;
}

/* NVML's compute processes of a device, asked again while the list grows
 * between the call that counts and the call that fills. */
static int nvml_processes(nvml_device nd, nvml_process **out, unsigned *count) {
  nvml_process *p = NULL;
  unsigned n = 0;
  int rc = p_nvmlDeviceGetComputeRunningProcesses(nd, &n, NULL);
  for (int tries = 0; rc == NVML_ERROR_INSUFFICIENT_SIZE && tries < 8; tries++) {
    n += 8;
    nvml_process *q = realloc(p, n * sizeof *q);
    if (!q) {
      free(p);
      return gpu_fail(-ENOMEM, "out of memory");
    }
    p = q;
    rc = p_nvmlDeviceGetComputeRunningProcesses(nd, &n, p);
  }
  if (rc != 0) {
    free(p);
    return gpu_fail(-EIO, "nvmlDeviceGetComputeRunningProcesses: %s", p_nvmlErrorString(rc));
  }
  *out = p;
  *count = n;
  return 0;
}

/* The processes with a context on the device and NVML's figure for each:
 * its context and what it allocated itself, not memory it imported (the
 * creator's, measured on an H200). */
static int cuda_processes(int dev, struct gpu_process **list, size_t *n) {
  nvml_device nd;
  int rc = nvml_device_of(dev, &nd);
  if (rc < 0) return rc;
  if (!p_nvmlDeviceGetComputeRunningProcesses)
    return gpu_fail(-ENOTSUP, "NVML has no nvmlDeviceGetComputeRunningProcesses_v2/_v3");
  nvml_process *p = NULL;
  unsigned count = 0;
  if ((rc = nvml_processes(nd, &p, &count)) < 0) return rc;
  *list = malloc((count ? count : 1) * sizeof **list);
  if (!*list) {
    free(p);
    return gpu_fail(-ENOMEM, "out of memory");
  }
  for (unsigned i = 0; i < count; i++)
    (*list)[i] = (struct gpu_process){
        .pid = (int)p[i].pid,
        .used = p[i].used_gpu_memory == NVML_VALUE_NOT_AVAILABLE ? GPU_USED_UNKNOWN
                                                                 : p[i].used_gpu_memory};
  *n = count;
  free(p);
  return 0;
}

/* The device of the memory behind a handle (imported or created). */
static int cuda_handle_device(uint64_t handle, int *dev) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  CUresult rc = p_cuMemGetAllocationPropertiesFromHandle(&p, handle);
  *dev = p.location.type == CU_MEM_LOCATION_TYPE_DEVICE ? p.location.id : -1;
  return (int)rc;
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

const char vmm_cuda_headers[] = "CUDA_VERSION " XSTR(CUDA_VERSION);

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
    .ctx_enter = cuda_ctx_enter,
    .ctx_leave = cuda_ctx_leave,
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
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .memset32 = cuda_memset32,
    .mem_info = cuda_mem_info,
    .handle_device = cuda_handle_device,
    .mem_detail = cuda_mem_detail,
    .processes = cuda_processes,
    .ipc_alloc = cuda_ipc_alloc,
    .ipc_free = cuda_ipc_free,
    .ipc_open = cuda_ipc_open,
    .ipc_close = cuda_ipc_close,
};
