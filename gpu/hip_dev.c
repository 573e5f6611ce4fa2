/* The HIP vendor table of the daemon's half (gpu/vmm_dev.h): chunks
 * created and exported, copies on streams, pinned host memory, legacy IPC
 * memory (on hipMalloc memory only), and the memory figures with no HIP
 * context and the per-process list from ROCm SMI (librocm_smi64), loaded
 * at run time where it is, as hip_lib.c loads the runtime. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "hip_lib.h"
#include "vmm_dev.h"

#define DEV_CALLS(X)                                                                      \
  X(hipDeviceGetPCIBusId) X(hipMemCreate) X(hipMemExportToShareableHandle)                \
  X(hipMemGetInfo) X(hipMalloc) X(hipFree) X(hipIpcGetMemHandle)                          \
  X(hipStreamCreateWithFlags) X(hipStreamDestroy) X(hipStreamSynchronize)                 \
  X(hipMemcpyDtoHAsync) X(hipMemcpyHtoDAsync) X(hipHostMalloc) X(hipHostFree)             \
  X(hipHostRegister) X(hipHostUnregister) X(hipMemGetAllocationPropertiesFromHandle)

DEV_CALLS(HIP_DECLARE)

/* ROCm SMI, declared here from its documented ABI (rocm_smi/rocm_smi.h):
 * its header is not always installed. Calls return an rsmi_status_t. */
typedef struct { /* rsmi_process_info_t */
  uint32_t process_id, pasid;
  uint64_t vram_usage, sdma_usage;
  uint32_t cu_occupancy;
} rsmi_process;
#define RSMI_MEM_TYPE_VRAM 0
#define RSMI_STATUS_INSUFFICIENT_SIZE 11
static int (*p_rsmi_init)(uint64_t flags);
static int (*p_rsmi_status_string)(int status, const char **text);
static int (*p_rsmi_num_monitor_devices)(uint32_t *n);
static int (*p_rsmi_dev_pci_id_get)(uint32_t dv, uint64_t *bdfid);
static int (*p_rsmi_dev_memory_total_get)(uint32_t dv, int type, uint64_t *total);
static int (*p_rsmi_dev_memory_usage_get)(uint32_t dv, int type, uint64_t *used);
static int (*p_rsmi_compute_process_info_get)(rsmi_process *procs, uint32_t *n);
static int (*p_rsmi_compute_process_info_by_device_get)(uint32_t pid, uint32_t dv,
                                                         rsmi_process *proc);

static void load_once(void);
static struct vmm_once once = {.once = PTHREAD_ONCE_INIT, .load = load_once};

/* Load ROCm SMI if it is there; without it, memory figures come from
 * hipMemGetInfo and there is no per-process list. */
static void smi_load(void) {
  static const char *const names[] = {"librocm_smi64.so", "librocm_smi64.so.7",
                                      "librocm_smi64.so.6", "librocm_smi64.so.5",
                                      "librocm_smi64.so.1"};
  void *smi = NULL;
  for (size_t i = 0; !smi && i < sizeof names / sizeof names[0]; i++)
    smi = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (!smi) return;
#define SMI_SYM(fn) (p_##fn = (__typeof__(p_##fn))dlsym(smi, #fn))
  if (!SMI_SYM(rsmi_init) || !SMI_SYM(rsmi_status_string) || !SMI_SYM(rsmi_num_monitor_devices) ||
      !SMI_SYM(rsmi_dev_pci_id_get) || !SMI_SYM(rsmi_dev_memory_total_get) ||
      !SMI_SYM(rsmi_dev_memory_usage_get) || !SMI_SYM(rsmi_compute_process_info_get) ||
      !SMI_SYM(rsmi_compute_process_info_by_device_get) || p_rsmi_init(0) != 0)
    p_rsmi_init = NULL;
}

/* Resolve the daemon's calls in the loaded runtime, then load ROCm SMI. */
static void load_once(void) {
  void *lib = hip_lib_handle();
  DEV_CALLS(HIP_LOAD)
  smi_load();
}

/* The device's PCI bus id. */
static int hip_bus_id(int dev, char *buf, int len) { return p_hipDeviceGetPCIBusId(buf, len, dev); }

/* A physical chunk with the properties of hip_lib_chunk_prop. */
static int hip_create(int dev, uint64_t size, uint64_t *handle) {
  hipMemAllocationProp p = hip_lib_chunk_prop(dev);
  hipMemGenericAllocationHandle_t h = NULL;
  hipError_t rc = p_hipMemCreate(&h, size, &p, 0);
  *handle = hip_from_handle(h);
  return (int)rc;
}

/* A chunk as a new POSIX fd. */
static int hip_export_fd(uint64_t handle, int *fd) {
  return p_hipMemExportToShareableHandle(fd, hip_to_handle(handle),
                                         hipMemHandleTypePosixFileDescriptor, 0);
}

/* A stream that does not wait for the null stream. */
static int hip_stream_create(void **stream) {
  hipStream_t s = NULL;
  hipError_t rc = p_hipStreamCreateWithFlags(&s, hipStreamNonBlocking);
  *stream = s;
  return (int)rc;
}

/* Destroy a stream. */
static int hip_stream_destroy(void *stream) { return p_hipStreamDestroy((hipStream_t)stream); }

/* Wait for a stream's work. */
static int hip_stream_sync(void *stream) { return p_hipStreamSynchronize((hipStream_t)stream); }

/* Queue a copy from device to host memory. */
static int hip_dtoh_async(void *dst, uint64_t src, uint64_t n, void *stream) {
  return p_hipMemcpyDtoHAsync(dst, hip_ptr(src), n, (hipStream_t)stream);
}

/* Queue a copy from host to device memory. */
static int hip_htod_async(uint64_t dst, const void *src, uint64_t n, void *stream) {
  return p_hipMemcpyHtoDAsync(hip_ptr(dst), (void *)src, n, (hipStream_t)stream);
}

/* Pinned host memory for every device. */
static int hip_host_alloc(void **p, uint64_t size) {
  return p_hipHostMalloc(p, size, hipHostMallocPortable);
}

/* Free memory from hip_host_alloc. */
static int hip_host_free(void *p) { return p_hipHostFree(p); }

/* Pin host memory for every device. */
static int hip_host_register(void *p, uint64_t size) {
  return p_hipHostRegister(p, size, hipHostRegisterPortable);
}

/* Unpin a range pinned by hip_host_register. */
static int hip_host_unregister(void *p) { return p_hipHostUnregister(p); }

/* hipMemGetInfo is the figure to trust for reclaim on ROCm (SMI tools
 * have disagreed with it); the thread's device is set back after. */
static int hip_mem_info(int dev, uint64_t *free_bytes, uint64_t *total) {
  size_t f = 0, t = 0;
  int was = 0;
  hipError_t rc = (hipError_t)vmm_hip.ctx_enter(dev, &was);
  if (rc == hipSuccess) {
    rc = p_hipMemGetInfo(&f, &t);
    vmm_hip.ctx_leave(was);
  }
  *free_bytes = f;
  *total = t;
  return (int)rc;
}

/* ROCm SMI's words for a status. */
static const char *smi_error(int st) {
  const char *text = NULL;
  return p_rsmi_status_string(st, &text) == 0 && text ? text : "unknown ROCm SMI status";
}

/* ROCm SMI's index of a HIP device, matched by PCI address (domain, bus,
 * device, function; the partition bits of SMI's id are left out); -ENOTSUP
 * without SMI or a match. */
static int smi_index(int dev, uint32_t *index) {
  char bus[32];
  unsigned dom, b, d, f;
  uint32_t n = 0;
  if (!p_rsmi_init) return gpu_fail(-ENOTSUP, "no ROCm SMI (librocm_smi64)");
  if (p_hipDeviceGetPCIBusId(bus, sizeof bus, dev) != hipSuccess ||
      sscanf(bus, "%x:%x:%x.%x", &dom, &b, &d, &f) != 4 || p_rsmi_num_monitor_devices(&n) != 0)
    return gpu_fail(-ENOTSUP, "ROCm SMI: no PCI address for HIP device %d", dev);
  uint64_t want = (uint64_t)dom << 32 | (b & 0xff) << 8 | (d & 0x1f) << 3 | (f & 7);
  for (uint32_t i = 0; i < n; i++) {
    uint64_t id;
    if (p_rsmi_dev_pci_id_get(i, &id) == 0 && (id & ~0xf0000000ull) == want) {
      *index = i;
      return 0;
    }
  }
  return gpu_fail(-ENOTSUP, "ROCm SMI does not list HIP device %d (%s)", dev, bus);
}

/* VRAM total and used from ROCm SMI, with no HIP context; it does not
 * report a driver reserve. */
static int hip_mem_detail(int dev, uint64_t *total, uint64_t *free_bytes, uint64_t *reserved) {
  uint32_t i;
  uint64_t used = 0;
  int rc = smi_index(dev, &i);
  if (rc < 0) return rc;
  if ((rc = p_rsmi_dev_memory_total_get(i, RSMI_MEM_TYPE_VRAM, total)) != 0 ||
      (rc = p_rsmi_dev_memory_usage_get(i, RSMI_MEM_TYPE_VRAM, &used)) != 0)
    return gpu_fail(-EIO, "rsmi_dev_memory_*_get: %s", smi_error(rc));
  *free_bytes = used < *total ? *total - used : 0;
  *reserved = 0;
  return 0;
}

/* Every process ROCm SMI knows (KFD's list), asked again while it grows. */
static int smi_processes(rsmi_process **out, uint32_t *count) {
  rsmi_process *p = NULL;
  uint32_t n = 0;
  int rc = p_rsmi_compute_process_info_get(NULL, &n);
  for (int tries = 0; rc == 0 && tries < 8; tries++) {
    uint32_t want = n + 8;
    rsmi_process *q = realloc(p, want * sizeof *q);
    if (!q) {
      free(p);
      return gpu_fail(-ENOMEM, "out of memory");
    }
    p = q;
    n = want;
    if ((rc = p_rsmi_compute_process_info_get(p, &n)) != RSMI_STATUS_INSUFFICIENT_SIZE) break;
    rc = 0;
  }
  if (rc != 0) {
    free(p);
    return gpu_fail(-EIO, "rsmi_compute_process_info_get: %s", smi_error(rc));
  }
  *out = p;
  *count = n;
  return 0;
}

/* The processes holding VRAM on the device, by KFD's per-process figure.
 * Not checked on AMD hardware: whether VRAM a process imported from the
 * daemon counts against it is not known. */
static int hip_processes(int dev, struct gpudev_process **list, size_t *n) {
  uint32_t index, count = 0;
  rsmi_process *p = NULL;
  int rc = smi_index(dev, &index);
  if (rc < 0 || (rc = smi_processes(&p, &count)) < 0) return rc;
  *list = malloc((count ? count : 1) * sizeof **list);
  if (!*list) {
    free(p);
    return gpu_fail(-ENOMEM, "out of memory");
  }
  *n = 0;
  for (uint32_t i = 0; i < count; i++) {
    rsmi_process on;
    memset(&on, 0, sizeof on);
    if (p_rsmi_compute_process_info_by_device_get(p[i].process_id, index, &on) == 0 &&
        on.vram_usage > 0)
      (*list)[(*n)++] = (struct gpudev_process){.pid = (int)p[i].process_id, .used = on.vram_usage};
  }
  free(p);
  return 0;
}

/* The device of the memory behind a handle (imported or created). */
static int hip_handle_device(uint64_t handle, int *dev) {
  hipMemAllocationProp p;
  memset(&p, 0, sizeof p);
  hipError_t rc = p_hipMemGetAllocationPropertiesFromHandle(&p, hip_to_handle(handle));
  *dev = p.location.type == hipMemLocationTypeDevice ? p.location.id : -1;
  return (int)rc;
}

/* Legacy IPC handles only ever on hipMalloc memory, never on VMM memory. */
static int hip_ipc_alloc(uint64_t size, uint64_t *dptr, uint8_t *handle) {
  void *p = NULL;
  hipError_t rc = p_hipMalloc(&p, size);
  if (rc) return (int)rc;
  hipIpcMemHandle_t h;
  if ((rc = p_hipIpcGetMemHandle(&h, p))) {
    p_hipFree(p);
    return (int)rc;
  }
  _Static_assert(sizeof h == GPU_IPC_HANDLE_SIZE, "HIP IPC handles are 64 bytes");
  memcpy(handle, &h, sizeof h);
  *dptr = (uint64_t)(uintptr_t)p;
  return 0;
}

/* Free memory from hip_ipc_alloc. */
static int hip_ipc_free(uint64_t dptr) { return p_hipFree(hip_ptr(dptr)); }

const struct vmm_dev_vendor vmm_hip_dev = {
    .base = &vmm_hip,
    .once = &once,
    .bus_id = hip_bus_id,
    .create = hip_create,
    .export_fd = hip_export_fd,
    .stream_create = hip_stream_create,
    .stream_destroy = hip_stream_destroy,
    .stream_sync = hip_stream_sync,
    .dtoh_async = hip_dtoh_async,
    .htod_async = hip_htod_async,
    .host_alloc = hip_host_alloc,
    .host_free = hip_host_free,
    .host_register = hip_host_register,
    .host_unregister = hip_host_unregister,
    .mem_info = hip_mem_info,
    .handle_device = hip_handle_device,
    .mem_detail = hip_mem_detail,
    .processes = hip_processes,
    .ipc_alloc = hip_ipc_alloc,
    .ipc_free = hip_ipc_free,
};
