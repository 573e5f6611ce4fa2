/* The CUDA vendor table of the client's half (gpu/vmm_va.h): its device
 * for a bus id, waiting for the device, plain copies and fills, and
 * legacy IPC handles opened. Loaded at run time, as cuda_lib.c loads the
 * driver. */
#include <pthread.h>
#include <string.h>

#include "cuda_lib.h"
#include "vmm_va.h"

#define VA_CALLS(X)                                                                       \
  X(cuDeviceGetByPCIBusId) X(cuCtxSynchronize) X(cuMemcpyDtoH) X(cuMemcpyHtoD)            \
  X(cuMemcpyDtoD)                                                                         \
  X(cuMemsetD32) X(cuIpcOpenMemHandle) X(cuIpcCloseMemHandle) X(cuMemSetAccess)           \
  X(cuDeviceGet) X(cuDeviceGetAttribute)

VA_CALLS(CUDA_DECLARE)

static void load_once(void);
static struct vmm_once once = {.once = PTHREAD_ONCE_INIT, .load = load_once};

/* Resolve the client's calls in the loaded driver. */
static void load_once(void) {
  void *lib = cuda_lib_handle();
  VA_CALLS(CUDA_LOAD)
}

/* This process's device number for a PCI bus id. */
static int cuda_device_by_bus_id(const char *bus_id, int *dev) {
  CUdevice d;
  CUresult rc = p_cuDeviceGetByPCIBusId(&d, bus_id);
  *dev = (int)d;
  return (int)rc;
}

/* Wait for the current context's work. */
static int cuda_sync(void) { return p_cuCtxSynchronize(); }

/* Copy device memory to host memory. */
static int cuda_dtoh(void *dst, uint64_t src, uint64_t n) { return p_cuMemcpyDtoH(dst, src, n); }

/* Copy host memory to device memory. */
static int cuda_htod(uint64_t dst, const void *src, uint64_t n) {
  return p_cuMemcpyHtoD(dst, src, n);
}

/* Copy between two device-reachable ranges (asynchronous to the host). */
static int cuda_dtod(uint64_t dst, uint64_t src, uint64_t n) { return p_cuMemcpyDtoD(dst, src, n); }

/* Set count 32-bit words of device memory. */
static int cuda_memset32(uint64_t dst, uint32_t value, uint64_t count) {
  return p_cuMemsetD32(dst, value, count);
}

/* Read-write access for dev and for the host (dev's NUMA node) to a
 * mapped range of host-NUMA memory. */
static int cuda_host_access(uint64_t va, uint64_t size, int dev) {
  int node = -1;
  CUdevice d;
  if (p_cuDeviceGet(&d, dev) == 0)
    p_cuDeviceGetAttribute(&node, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, d);
  CUmemAccessDesc a[2];
  memset(a, 0, sizeof a);
  a[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a[0].location.id = dev;
  a[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  a[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  a[1].location.id = node < 0 ? 0 : node;
  a[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return p_cuMemSetAccess(va, size, a, 2);
}

/* Open another process's legacy IPC handle. */
static int cuda_ipc_open(const uint8_t *handle, uint64_t *dptr) {
  CUipcMemHandle h;
  memcpy(&h, handle, sizeof h);
  CUdeviceptr p;
  CUresult rc = p_cuIpcOpenMemHandle(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  *dptr = p;
  return (int)rc;
}

/* Close memory opened with cuda_ipc_open. */
static int cuda_ipc_close(uint64_t dptr) { return p_cuIpcCloseMemHandle(dptr); }

const struct vmm_va_vendor vmm_cuda_va = {
    .base = &vmm_cuda,
    .once = &once,
    .device_by_bus_id = cuda_device_by_bus_id,
    .sync = cuda_sync,
    .dtoh = cuda_dtoh,
    .htod = cuda_htod,
    .dtod = cuda_dtod,
    .memset32 = cuda_memset32,
    .host_access = cuda_host_access,
    .ipc_open = cuda_ipc_open,
    .ipc_close = cuda_ipc_close,
};
