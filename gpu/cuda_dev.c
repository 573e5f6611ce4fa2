/* The CUDA vendor table of the daemon's half (gpu/vmm_dev.h): chunks
 * created and exported, copies on streams, pinned host memory, legacy IPC
 * memory, and the device memory figures and per-process list from NVML,
 * which needs no context. Loaded at run time, as cuda_lib.c loads the
 * driver. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_lib.h"
#include "error.h"
#include "vmm_dev.h"

#define DEV_CALLS(X)                                                                      \
  X(cuDeviceGet) X(cuDeviceGetPCIBusId) X(cuMemCreate) X(cuMemExportToShareableHandle)    \
  X(cuMemGetInfo) X(cuMemAlloc) X(cuMemFree) X(cuIpcGetMemHandle) X(cuStreamCreate)       \
  X(cuStreamDestroy) X(cuStreamSynchronize) X(cuMemcpyDtoHAsync) X(cuMemcpyHtoDAsync)     \
  X(cuMemHostAlloc) X(cuMemFreeHost) X(cuMemHostRegister) X(cuMemHostUnregister)          \
  X(cuMemGetAllocationPropertiesFromHandle) X(cuMemGetAllocationGranularity) X(cuMemSetAccess) \
  X(cuDeviceGetAttribute)

DEV_CALLS(CUDA_DECLARE)

/* The checkpoint calls (cuda.h 12.8 on), looked up where the driver has
 * them: without them no process is released. */
#if CUDA_VERSION >= 12080
#define CKPT_CALLS(X) \
  X(cuCheckpointProcessLock) X(cuCheckpointProcessCheckpoint) X(cuCheckpointProcessRestore) \
  X(cuCheckpointProcessUnlock) X(cuCheckpointProcessGetState)
CKPT_CALLS(CUDA_DECLARE)
#endif

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

static void load_once(void);
static struct vmm_once once = {.once = PTHREAD_ONCE_INIT, .load = load_once};

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

/* Resolve the daemon's calls in the loaded driver, then load NVML. */
static void load_once(void) {
  void *lib = cuda_lib_handle();
  DEV_CALLS(CUDA_LOAD)
#if CUDA_VERSION >= 12080
#define CKPT_FIND(fn) p_##fn = (__typeof__(&fn))dlsym(lib, CUDA_XSTR(fn));
  CKPT_CALLS(CKPT_FIND)
#endif
  nvml_load();
}

/* The device's PCI bus id. */
static int cuda_bus_id(int dev, char *buf, int len) {
  CUdevice d;
  CUresult rc = p_cuDeviceGet(&d, dev);
  return rc ? (int)rc : (int)p_cuDeviceGetPCIBusId(buf, len, d);
}

/* A physical chunk with the properties of cuda_lib_chunk_prop. */
static int cuda_create(int dev, uint64_t size, uint64_t *handle) {
  CUmemAllocationProp p = cuda_lib_chunk_prop(dev);
  CUmemGenericAllocationHandle h;
  CUresult rc = p_cuMemCreate(&h, size, &p, 0);
  *handle = h;
  return (int)rc;
}

#if CUDA_VERSION >= 12020
/* The properties of backup host memory for dev: pinned memory of the host
 * NUMA node nearest dev (node 0 where the device names none). */
static CUmemAllocationProp host_prop(int dev) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  int node = -1;
  CUdevice d;
  if (p_cuDeviceGet(&d, dev) == 0) p_cuDeviceGetAttribute(&node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, d);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  p.location.id = node < 0 ? 0 : node;
  return p;
}

/* Whether dev can have host-NUMA memory, and its granularity (0: none). */
static int cuda_host_granularity(int dev, uint64_t *g) {
  int ok = 0;
  CUdevice d;
  *g = 0;
  if (p_cuDeviceGet(&d, dev) != 0 ||
      p_cuDeviceGetAttribute(&ok, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                             d) != 0 || !ok)
    return 0;
  CUmemAllocationProp p = host_prop(dev);
  size_t min = 0;
  CUresult rc = p_cuMemGetAllocationGranularity(&min, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  *g = rc == CUDA_SUCCESS ? min : 0;
  return 0;
}

/* Pinned host memory for dev's backups, made without a context, that
 * the buffer's owner may be handed as fds. */
static int cuda_host_create(int dev, uint64_t size, uint64_t *handle) {
  CUmemAllocationProp p = host_prop(dev);
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle h;
  CUresult rc = p_cuMemCreate(&h, size, &p, 0);
  *handle = h;
  return (int)rc;
}

/* Let the host read and write a mapped range of host memory, and dev
 * too where device is true (else dev's access is taken away). */
static int cuda_host_access(uint64_t va, uint64_t size, int dev, bool device) {
  CUmemAccessDesc a[2];
  memset(a, 0, sizeof a);
  a[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a[0].location.id = dev;
  a[0].flags = device ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE : CU_MEM_ACCESS_FLAGS_PROT_NONE;
  a[1].location = host_prop(dev).location;
  a[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return p_cuMemSetAccess(va, size, a, 2);
}
#endif

/* A chunk as a new POSIX fd. */
static int cuda_export_fd(uint64_t handle, int *fd) {
  return p_cuMemExportToShareableHandle(fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
}

/* A stream that does not wait for the legacy default stream. */
static int cuda_stream_create(void **stream) {
  CUstream s;
  CUresult rc = p_cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  *stream = s;
  return (int)rc;
}

/* Destroy a stream. */
static int cuda_stream_destroy(void *stream) { return p_cuStreamDestroy((CUstream)stream); }

/* Wait for a stream's work. */
static int cuda_stream_sync(void *stream) { return p_cuStreamSynchronize((CUstream)stream); }

/* Queue a copy from device to host memory. */
static int cuda_dtoh_async(void *dst, uint64_t src, uint64_t n, void *stream) {
  return p_cuMemcpyDtoHAsync(dst, src, n, (CUstream)stream);
}

/* Queue a copy from host to device memory. */
static int cuda_htod_async(uint64_t dst, const void *src, uint64_t n, void *stream) {
  return p_cuMemcpyHtoDAsync(dst, src, n, (CUstream)stream);
}

/* Pinned host memory for every context. */
static int cuda_host_alloc(void **p, uint64_t size) {
  return p_cuMemHostAlloc(p, size, CU_MEMHOSTALLOC_PORTABLE);
}

/* Free memory from cuda_host_alloc. */
static int cuda_host_free(void *p) { return p_cuMemFreeHost(p); }

/* Pin host memory for every context. */
static int cuda_host_register(void *p, uint64_t size) {
  return p_cuMemHostRegister(p, size, CU_MEMHOSTREGISTER_PORTABLE);
}

/* Unpin a range pinned by cuda_host_register. */
static int cuda_host_unregister(void *p) { return p_cuMemHostUnregister(p); }

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
  int rc = vmm_cuda.ctx_retain(dev);
  if (rc) return rc;
  size_t f = 0, t = 0;
  if (!(rc = vmm_cuda.ctx_enter(dev, NULL))) {
    rc = (int)p_cuMemGetInfo(&f, &t);
    vmm_cuda.ctx_leave(0);
  }
  vmm_cuda.ctx_release(dev);
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
  if (rc) return gpu_fail(-EIO, "cuDeviceGetPCIBusId: %s", vmm_cuda.error_name(rc));
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
static int cuda_processes(int dev, struct gpudev_process **list, size_t *n) {
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
    (*list)[i] = (struct gpudev_process){
        .pid = (int)p[i].pid,
        .used = p[i].used_gpu_memory == NVML_VALUE_NOT_AVAILABLE ? GPUDEV_USED_UNKNOWN
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

/* Plain device memory (cuMemAlloc, never VMM memory) and its IPC handle. */
static int cuda_ipc_alloc(uint64_t size, uint64_t *dptr, uint8_t *handle) {
  CUdeviceptr p;
  CUresult rc = p_cuMemAlloc(&p, size);
  if (rc) return (int)rc;
  CUipcMemHandle h;
  if ((rc = p_cuIpcGetMemHandle(&h, p))) {
    p_cuMemFree(p);
    return (int)rc;
  }
  _Static_assert(sizeof h == GPU_IPC_HANDLE_SIZE, "CUDA IPC handles are 64 bytes");
  memcpy(handle, &h, sizeof h);
  *dptr = p;
  return 0;
}

/* Free memory from cuda_ipc_alloc. */
static int cuda_ipc_free(uint64_t dptr) { return p_cuMemFree(dptr); }

#if CUDA_VERSION >= 12080
/* Hold pid's CUDA calls, waiting at most timeout_ms for those in flight. */
static int cuda_ckpt_lock(int pid, unsigned timeout_ms) {
  if (!p_cuCheckpointProcessLock) return -ENOTSUP;
  CUcheckpointLockArgs a = {.timeoutMs = timeout_ms};
  return (int)p_cuCheckpointProcessLock(pid, &a);
}

/* Move a locked pid's device state to host memory. */
static int cuda_ckpt_checkpoint(int pid) {
  CUcheckpointCheckpointArgs a = {{0}};
  return p_cuCheckpointProcessCheckpoint ? (int)p_cuCheckpointProcessCheckpoint(pid, &a) : -ENOTSUP;
}

/* Bring a checkpointed pid's device state back (it stays locked). */
static int cuda_ckpt_restore(int pid) {
  CUcheckpointRestoreArgs a;
  memset(&a, 0, sizeof a);
  return p_cuCheckpointProcessRestore ? (int)p_cuCheckpointProcessRestore(pid, &a) : -ENOTSUP;
}

/* Let a locked pid's CUDA calls go on. */
static int cuda_ckpt_unlock(int pid) {
  CUcheckpointUnlockArgs a = {{0}};
  return p_cuCheckpointProcessUnlock ? (int)p_cuCheckpointProcessUnlock(pid, &a) : -ENOTSUP;
}

/* Where pid stands under the checkpoint calls. */
static int cuda_ckpt_state(int pid, enum vmm_ckpt_state *state) {
  if (!p_cuCheckpointProcessGetState || !p_cuCheckpointProcessLock ||
      !p_cuCheckpointProcessCheckpoint || !p_cuCheckpointProcessRestore ||
      !p_cuCheckpointProcessUnlock)
    return -ENOTSUP;
  CUprocessState s = CU_PROCESS_STATE_RUNNING;
  CUresult rc = p_cuCheckpointProcessGetState(pid, &s);
  *state = s == CU_PROCESS_STATE_LOCKED         ? VMM_CKPT_LOCKED
           : s == CU_PROCESS_STATE_CHECKPOINTED ? VMM_CKPT_CHECKPOINTED
           : s == CU_PROCESS_STATE_FAILED       ? VMM_CKPT_FAILED
                                                : VMM_CKPT_RUNNING;
  return (int)rc;
}
#endif

const struct vmm_dev_vendor vmm_cuda_dev = {
    .base = &vmm_cuda,
    .once = &once,
    .bus_id = cuda_bus_id,
    .create = cuda_create,
    .export_fd = cuda_export_fd,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_sync = cuda_stream_sync,
    .dtoh_async = cuda_dtoh_async,
    .htod_async = cuda_htod_async,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .mem_info = cuda_mem_info,
    .handle_device = cuda_handle_device,
    .mem_detail = cuda_mem_detail,
    .processes = cuda_processes,
    .ipc_alloc = cuda_ipc_alloc,
    .ipc_free = cuda_ipc_free,
#if CUDA_VERSION >= 12020
    .host_granularity = cuda_host_granularity,
    .host_create = cuda_host_create,
    .host_access = cuda_host_access,
#endif
#if CUDA_VERSION >= 12080
    .ckpt_lock = cuda_ckpt_lock,
    .ckpt_checkpoint = cuda_ckpt_checkpoint,
    .ckpt_restore = cuda_ckpt_restore,
    .ckpt_unlock = cuda_ckpt_unlock,
    .ckpt_state = cuda_ckpt_state,
#endif
};
