/* The HIP vendor table both halves use (gpu/vmm.h): the HIP runtime
 * (ROCm), loaded with dlopen at run time, so that nothing links
 * libamdhip64. The daemon's own calls are in hip_dev.c, the client's in
 * hip_va.c. The differences between ROCm releases are settled here at
 * build time:
 * - the allocation property's handle-type field is requestedHandleType
 *   before ROCm 7.0 and requestedHandleTypes from 7.0;
 * - hipMemImportFromShareableHandle takes a pointer to the fd before 7.1
 *   and the fd itself from 7.1. */
#include "hip_lib.h"

#include <pthread.h>
#include <string.h>

#include "vmm.h"

#define HIP_STR_(x) #x
#define HIP_STR(x) HIP_STR_(x)
const char vmm_hip_headers[] =
    "HIP " HIP_STR(HIP_VERSION_MAJOR) "." HIP_STR(HIP_VERSION_MINOR) "." HIP_STR(HIP_VERSION_PATCH);

#define HIP_CALLS(X)                                                                      \
  X(hipInit) X(hipGetErrorName) X(hipGetDeviceCount) X(hipMemGetAllocationGranularity)   \
  X(hipMemRelease) X(hipMemImportFromShareableHandle) X(hipMemAddressReserve)            \
  X(hipMemAddressFree) X(hipMemMap) X(hipMemUnmap) X(hipMemSetAccess) X(hipSetDevice)     \
  X(hipGetDevice)

HIP_CALLS(HIP_DECLARE)

static void *loaded; /* the library, once initialized */
static void load_once(void);
static struct vmm_once once = {.once = PTHREAD_ONCE_INIT, .load = load_once};

/* Open the runtime by the first name it has, resolve the common calls and
 * initialize it. */
static void load_once(void) {
  static const char *const names[] = {"libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6",
                                      "libamdhip64.so.5"};
  void *lib = NULL;
  for (size_t i = 0; !lib && i < sizeof names / sizeof names[0]; i++)
    lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    vmm_once_fail(&once, -ENOENT, "no HIP runtime (libamdhip64.so): %s", dlerror());
    return;
  }
  HIP_CALLS(HIP_LOAD)
  hipError_t rc = p_hipInit(0);
  if (rc != hipSuccess) {
    vmm_once_fail(&once, -ENODEV, "no HIP device found: hipInit: %s", p_hipGetErrorName(rc));
    return;
  }
  loaded = lib;
}

/* Load the runtime once per process; its status every time. */
static int hip_load(char *err, size_t errlen) { return vmm_once_run(&once, err, errlen); }

/* The runtime library, once loaded. */
void *hip_lib_handle(void) { return loaded; }

/* The runtime's name for a status. */
static const char *hip_error_name(int rc) {
  const char *name = p_hipGetErrorName((hipError_t)rc);
  return name ? name : "hipErrorUnknown";
}

/* Number of devices. */
static int hip_device_count(int *n) { return p_hipGetDeviceCount(n); }

/* The properties every chunk is created with. */
hipMemAllocationProp hip_lib_chunk_prop(int dev) {
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

/* The granularity of chunks with those properties: the recommended one,
 * or the minimum where that is coarser. */
static int hip_granularity(int dev, uint64_t *g) {
  hipMemAllocationProp p = hip_lib_chunk_prop(dev);
  size_t min = 0, rec = 0;
  hipError_t rc = p_hipMemGetAllocationGranularity(&min, &p, hipMemAllocationGranularityMinimum);
  if (rc == hipSuccess)
    rc = p_hipMemGetAllocationGranularity(&rec, &p, hipMemAllocationGranularityRecommended);
  *g = rec > min ? rec : min;
  return (int)rc;
}

/* Release a created or imported handle. */
static int hip_release(uint64_t handle) { return p_hipMemRelease(hip_to_handle(handle)); }

/* Import an exported POSIX fd (the fd stays the caller's). */
static int hip_import_fd(int fd, uint64_t *handle) {
  hipMemGenericAllocationHandle_t h = NULL;
#if HIP_AT_LEAST(7, 1)
  void *os_handle = (void *)(uintptr_t)fd;
#else
  void *os_handle = &fd;
#endif
  hipError_t rc = p_hipMemImportFromShareableHandle(&h, os_handle, hipMemHandleTypePosixFileDescriptor);
  *handle = hip_from_handle(h);
  return (int)rc;
}

/* Reserve a virtual address range. */
static int hip_reserve(uint64_t size, uint64_t align, uint64_t *va) {
  void *p = NULL;
  hipError_t rc = p_hipMemAddressReserve(&p, size, align, NULL, 0);
  *va = (uint64_t)(uintptr_t)p;
  return (int)rc;
}

/* Free a reserved range. */
static int hip_address_free(uint64_t va, uint64_t size) {
  return p_hipMemAddressFree(hip_ptr(va), size);
}

/* Map a handle at va. */
static int hip_map(uint64_t va, uint64_t size, uint64_t handle) {
  return p_hipMemMap(hip_ptr(va), size, 0, hip_to_handle(handle), 0);
}

/* Unmap one mapping. */
static int hip_unmap(uint64_t va, uint64_t size) { return p_hipMemUnmap(hip_ptr(va), size); }

/* Read/write access to a mapped range from dev. */
static int hip_set_access(uint64_t va, uint64_t size, int dev) {
  hipMemAccessDesc a;
  memset(&a, 0, sizeof a);
  a.location.type = hipMemLocationTypeDevice;
  a.location.id = dev;
  a.flags = hipMemAccessFlagsProtReadWrite;
  return p_hipMemSetAccess(hip_ptr(va), size, &a, 1);
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

/* Nothing to let go of: the runtime keeps the context. */
static int hip_ctx_release(int dev) {
  (void)dev;
  return 0;
}

/* The thread's device is saved and put back by hip_ctx_leave. */
static int hip_ctx_enter(int dev, int *saved) {
  hipError_t rc = p_hipGetDevice(saved);
  return rc == hipSuccess ? (int)p_hipSetDevice(dev) : (int)rc;
}

/* Set the thread's device back. */
static int hip_ctx_leave(int saved) { return p_hipSetDevice(saved); }

const struct vmm_vendor vmm_hip = {
    .name = "hip",
    .prefix = "hip",
    .device_word = "HIP",
    .oom = hipErrorOutOfMemory,
    .load = hip_load,
    .error_name = hip_error_name,
    .device_count = hip_device_count,
    .granularity = hip_granularity,
    .release = hip_release,
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
};
