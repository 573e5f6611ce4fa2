/* The HIP vendor table for gpu/vmm.c: the HIP runtime (ROCm), loaded with
 * dlopen at run time, so that nothing links libamdhip64. The differences
 * between ROCm releases are settled here at build time:
 * - the allocation property's handle-type field is requestedHandleType
 *   before ROCm 7.0 and requestedHandleTypes from 7.0;
 * - hipMemImportFromShareableHandle takes a pointer to the fd before 7.1
 *   and the fd itself from 7.1.
 * Memory figures with no HIP context and the per-process list come from
 * ROCm SMI (librocm_smi64), also loaded at run time where it is. */
#define __HIP_PLATFORM_AMD__
#include <dlfcn.h>
#include <errno.h>
#include <hip/hip_runtime_api.h>
#include <hip/hip_version.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "vmm.h"

#define HIP_STR_(x) #x
#define HIP_STR(x) HIP_STR_(x)
const char vmm_hip_headers[] =
    "HIP " HIP_STR(HIP_VERSION_MAJOR) "." HIP_STR(HIP_VERSION_MINOR) "." HIP_STR(HIP_VERSION_PATCH);

#define HIP_AT_LEAST(major, minor) \
  (HIP_VERSION_MAJOR > (major) || (HIP_VERSION_MAJOR == (major) && HIP_VERSION_MINOR >= (minor)))

#define HIP_CALLS(X)                                                                       \
  X(hipInit) X(hipGetErrorName) X(hipGetDeviceCount) X(hipDeviceGetPCIBusId)              \
  X(hipDeviceGetByPCIBusId) X(hipMemGetAllocationGranularity) X(hipMemCreate)             \
  X(hipMemRelease) X(hipMemExportToShareableHandle) X(hipMemImportFromShareableHandle)    \
  X(hipMemAddressReserve) X(hipMemAddressFree) X(hipMemMap) X(hipMemUnmap)                \
  X(hipMemSetAccess) X(hipSetDevice) X(hipGetDevice) X(hipDeviceSynchronize) X(hipMemcpyDtoH)             \
  X(hipMemcpyHtoD) X(hipMemsetD32) X(hipMemGetInfo) X(hipMalloc) X(hipFree)               \
  X(hipIpcGetMemHandle) X(hipIpcOpenMemHandle) X(hipIpcCloseMemHandle)                   \
  X(hipStreamCreateWithFlags) X(hipStreamDestroy) X(hipStreamSynchronize)                 \
  X(hipMemcpyDtoHAsync) X(hipMemcpyHtoDAsync) X(hipHostMalloc) X(hipHostFree)             \
  X(hipHostRegister) X(hipHostUnregister) X(hipMemGetAllocationPropertiesFromHandle)

#define DECLARE(fn) static __typeof__(&fn) p_##fn;
HIP_CALLS(DECLARE)

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

static pthread_once_t once = PTHREAD_ONCE_INIT;
static int load_status;
static char load_error[256];

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

static void load_once(void) {
  static const char *const names[] = {"libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6",
                                      "libamdhip64.so.5"};
  void *lib = NULL;
  for (size_t i = 0; !lib && i < sizeof names / sizeof names[0]; i++)
    lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(load_error, sizeof load_error, "no HIP runtime (libamdhip64.so): %s", dlerror());
    load_status = -ENOENT;
    return;
  }
#define LOAD(fn)                                                                 \
  if (!(p_##fn = (__typeof__(&fn))dlsym(lib, #fn))) {                            \
    snprintf(load_error, sizeof load_error, "libamdhip64 lacks %s", #fn);         \
    load_status = -ENOSYS;                                                        \
    return;                                                                       \
  }
  HIP_CALLS(LOAD)
  hipError_t rc = p_hipInit(0);
  if (rc != hipSuccess) {
    snprintf(load_error, sizeof load_error, "no HIP device found: hipInit: %s",
             p_hipGetErrorName(rc));
    load_status = -ENODEV;
    return;
  }
  smi_load();
}

static int hip_load(char *err, size_t errlen) {
  pthread_once(&once, load_once);
  if (load_status) snprintf(err, errlen, "%s", load_error);
  return load_status;
}

static const char *hip_error_name(int rc) {
  const char *name = p_hipGetErrorName((hipError_t)rc);
  return name ? name : "hipErrorUnknown";
}

static int hip_device_count(int *n) { return p_hipGetDeviceCount(n); }

static int hip_bus_id(int dev, char *buf, int len) { return p_hipDeviceGetPCIBusId(buf, len, dev); }

static int hip_device_by_bus_id(const char *bus_id, int *dev) {
  return p_hipDeviceGetByPCIBusId(dev, bus_id);
}

/* The properties every chunk is created with. */
static hipMemAllocationProp chunk_prop(int dev) {
  hipMemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = hipMemAllocationTypePinned;
#if HIP_AT_LEAST(7, 0)
  p.requestedHandleTypes = hipMemHandleTypePosixFileDescriptor;
#else
  p.requestedHandleType = hipMemHandleTypePosixFileDescriptor;
#endif
  p.location.type = hipMemLocationTypeDevice;
  p.location.id = dev;
  return p;
}

static int hip_granularity(int dev, uint64_t *g) {
  hipMemAllocationProp p = chunk_prop(dev);
  size_t min = 0, rec = 0;
  hipError_t rc = p_hipMemGetAllocationGranularity(&min, &p, hipMemAllocationGranularityMinimum);
  if (rc == hipSuccess)
    rc = p_hipMemGetAllocationGranularity(&rec, &p, hipMemAllocationGranularityRecommended);
  *g = rec > min ? rec : min;
  return (int)rc;
}

static uint64_t from_handle(hipMemGenericAllocationHandle_t h) { return (uint64_t)(uintptr_t)h; }

static hipMemGenericAllocationHandle_t to_handle(uint64_t h) {
  return (hipMemGenericAllocationHandle_t)(uintptr_t)h;
}

static void *ptr(uint64_t va) { return (void *)(uintptr_t)va; }

static int hip_create(int dev, uint64_t size, uint64_t *handle) {
  hipMemAllocationProp p = chunk_prop(dev);
  hipMemGenericAllocationHandle_t h = NULL;
  hipError_t rc = p_hipMemCreate(&h, size, &p, 0);
  *handle = from_handle(h);
  return (int)rc;
}

static int hip_release(uint64_t handle) { return p_hipMemRelease(to_handle(handle)); }

static int hip_export_fd(uint64_t handle, int *fd) {
  return p_hipMemExportToShareableHandle(fd, to_handle(handle), hipMemHandleTypePosixFileDescriptor,
                                         0);
}

static int hip_import_fd(int fd, uint64_t *handle) {
  hipMemGenericAllocationHandle_t h = NULL;
#if HIP_AT_LEAST(7, 1)
  void *os_handle = (void *)(uintptr_t)fd;
#else
  void *os_handle = &fd;
#endif
  hipError_t rc = p_hipMemImportFromShareableHandle(&h, os_handle, hipMemHandleTypePosixFileDescriptor);
  *handle = from_handle(h);
  return (int)rc;
}

static int hip_reserve(uint64_t size, uint64_t align, uint64_t *va) {
  void *p = NULL;
  hipError_t rc = p_hipMemAddressReserve(&p, size, align, NULL, 0);
  *va = (uint64_t)(uintptr_t)p;
  return (int)rc;
}

static int hip_address_free(uint64_t va, uint64_t size) { return p_hipMemAddressFree(ptr(va), size); }

static int hip_map(uint64_t va, uint64_t size, uint64_t handle) {
  return p_hipMemMap(ptr(va), size, 0, to_handle(handle), 0);
}

static int hip_unmap(uint64_t va, uint64_t size) { return p_hipMemUnmap(ptr(va), size); }

static int hip_set_access(uint64_t va, uint64_t size, int dev) {
  hipMemAccessDesc a;
  memset(&a, 0, sizeof a);
  a.location.type = hipMemLocationTypeDevice;
  a.location.id = dev;
  a.flags = hipMemAccessFlagsProtReadWrite;
  return p_hipMemSetAccess(ptr(va), size, &a, 1);
}

/* The HIP runtime keeps its own per-device context; choosing the device
 * is all there is to it. Retaining checks the device and sets it up, and
 * gives the thread back the device it had. */
static int hip_ctx_retain(int dev) {
  int was = 0;
  hipError_t rc = p_hipGetDevice(&was);
  if (rc == hipSuccess) rc = p_hipSetDevice(dev);
  if (rc == hipSuccess) rc = p_hipSetDevice(was);
  return (int)rc;
}

static int hip_ctx_release(int dev) {
  (void)dev;
  return 0;
}

/* The thread's device is saved and put back by hip_ctx_leave. */
static int hip_ctx_enter(int dev, int *saved) {
  hipError_t rc = p_hipGetDevice(saved);
  return rc == hipSuccess ? (int)p_hipSetDevice(dev) : (int)rc;
}

static int hip_ctx_leave(int saved) { return p_hipSetDevice(saved); }

static int hip_sync(void) { return p_hipDeviceSynchronize(); }

static int hip_dtoh(void *dst, uint64_t src, uint64_t n) { return p_hipMemcpyDtoH(dst, ptr(src), n); }

static int hip_htod(uint64_t dst, const void *src, uint64_t n) {
  return p_hipMemcpyHtoD(ptr(dst), (void *)src, n);
}

static int hip_stream_create(void **stream) {
  hipStream_t s = NULL;
  hipError_t rc = p_hipStreamCreateWithFlags(&s, hipStreamNonBlocking);
  *stream = s;
  return (int)rc;
}

static int hip_stream_destroy(void *stream) { return p_hipStreamDestroy((hipStream_t)stream); }

static int hip_stream_sync(void *stream) { return p_hipStreamSynchronize((hipStream_t)stream); }

static int hip_dtoh_async(void *dst, uint64_t src, uint64_t n, void *stream) {
  return p_hipMemcpyDtoHAsync(dst, ptr(src), n, (hipStream_t)stream);
}

static int hip_htod_async(uint64_t dst, const void *src, uint64_t n, void *stream) {
  return p_hipMemcpyHtoDAsync(ptr(dst), (void *)src, n, (hipStream_t)stream);
}

static int hip_host_alloc(void **p, uint64_t size) {
  return p_hipHostMalloc(p, size, hipHostMallocPortable);
}

static int hip_host_free(void *p) { return p_hipHostFree(p); }

static int hip_host_register(void *p, uint64_t size) {
  return p_hipHostRegister(p, size, hipHostRegisterPortable);
}

static int hip_host_unregister(void *p) { return p_hipHostUnregister(p); }

static int hip_memset32(uint64_t dst, uint32_t value, uint64_t count) {
  return p_hipMemsetD32(ptr(dst), (int)value, count);
}

/* hipMemGetInfo is the figure to trust for reclaim on ROCm (SMI tools
 * have disagreed with it). */
static int hip_mem_info(int dev, uint64_t *free_bytes, uint64_t *total) {
  size_t f = 0, t = 0;
  int was = 0;
  hipError_t rc = (hipError_t)hip_ctx_enter(dev, &was);
  if (rc == hipSuccess) {
    rc = p_hipMemGetInfo(&f, &t);
    p_hipSetDevice(was);
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
static int hip_processes(int dev, struct gpu_process **list, size_t *n) {
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
      (*list)[(*n)++] = (struct gpu_process){.pid = (int)p[i].process_id, .used = on.vram_usage};
  }
  free(p);
  return 0;
}

/* The device of the memory behind a handle (imported or created). */
static int hip_handle_device(uint64_t handle, int *dev) {
  hipMemAllocationProp p;
  memset(&p, 0, sizeof p);
  hipError_t rc = p_hipMemGetAllocationPropertiesFromHandle(&p, to_handle(handle));
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
  _Static_assert(sizeof h == 64, "HIP IPC handles are 64 bytes");
  memcpy(handle, &h, sizeof h);
  *dptr = (uint64_t)(uintptr_t)p;
  return 0;
}

static int hip_ipc_free(uint64_t dptr) { return p_hipFree(ptr(dptr)); }

static int hip_ipc_open(const uint8_t *handle, uint64_t *dptr) {
  hipIpcMemHandle_t h;
  memcpy(&h, handle, sizeof h);
  void *p = NULL;
  hipError_t rc = p_hipIpcOpenMemHandle(&p, h, hipIpcMemLazyEnablePeerAccess);
  *dptr = (uint64_t)(uintptr_t)p;
  return (int)rc;
}

static int hip_ipc_close(uint64_t dptr) { return p_hipIpcCloseMemHandle(ptr(dptr)); }

const struct vmm_vendor vmm_hip = {
    .name = "hip",
    .prefix = "hip",
    .device_word = "HIP",
    .oom = hipErrorOutOfMemory,
    .load = hip_load,
    .error_name = hip_error_name,
    .device_count = hip_device_count,
    .bus_id = hip_bus_id,
    .device_by_bus_id = hip_device_by_bus_id,
    .granularity = hip_granularity,
    .create = hip_create,
    .release = hip_release,
    .export_fd = hip_export_fd,
    .import_fd = hip_import_fd,
    .reserve = hip_reserve,
    .address_free = hip_address_free,
    .map = hip_map,
    .unmap = hip_unmap,
    .set_access = hip_set_access,
    .ctx_retain = hip_ctx_retain,
    .ctx_release = hip_ctx_release,
    .ctx_enter = hip_ctx_enter,
    .ctx_leave = hip_ctx_leave,
    .sync = hip_sync,
    .dtoh = hip_dtoh,
    .htod = hip_htod,
    .stream_create = hip_stream_create,
    .stream_destroy = hip_stream_destroy,
    .stream_sync = hip_stream_sync,
    .dtoh_async = hip_dtoh_async,
    .htod_async = hip_htod_async,
    .host_alloc = hip_host_alloc,
    .host_free = hip_host_free,
    .host_register = hip_host_register,
    .host_unregister = hip_host_unregister,
    .memset32 = hip_memset32,
    .mem_info = hip_mem_info,
    .handle_device = hip_handle_device,
    .mem_detail = hip_mem_detail,
    .processes = hip_processes,
    .ipc_alloc = hip_ipc_alloc,
    .ipc_free = hip_ipc_free,
    .ipc_open = hip_ipc_open,
    .ipc_close = hip_ipc_close,
};
