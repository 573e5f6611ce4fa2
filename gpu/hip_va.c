/* The HIP vendor table of the client's half (gpu/vmm_va.h): its device
 * for a bus id, waiting for the device, plain copies and fills, and
 * legacy IPC handles opened. Loaded at run time, as hip_lib.c loads the
 * runtime. */
#include <pthread.h>
#include <string.h>

#include "hip_lib.h"
#include "vmm_va.h"

#define VA_CALLS(X)                                                                       \
  X(hipDeviceGetByPCIBusId) X(hipDeviceSynchronize) X(hipMemcpyDtoH) X(hipMemcpyHtoD)     \
  X(hipMemcpyDtoD)                                                                        \
  X(hipMemsetD32) X(hipIpcOpenMemHandle) X(hipIpcCloseMemHandle)

VA_CALLS(HIP_DECLARE)

static void load_once(void);
static struct vmm_once once = {.once = PTHREAD_ONCE_INIT, .load = load_once};

/* Resolve the client's calls in the loaded runtime. */
static void load_once(void) {
  void *lib = hip_lib_handle();
  VA_CALLS(HIP_LOAD)
}

/* This process's device number for a PCI bus id. */
static int hip_device_by_bus_id(const char *bus_id, int *dev) {
  return p_hipDeviceGetByPCIBusId(dev, bus_id);
}

/* Wait for the current device's work. */
static int hip_sync(void) { return p_hipDeviceSynchronize(); }

/* Copy device memory to host memory. */
static int hip_dtoh(void *dst, uint64_t src, uint64_t n) {
  return p_hipMemcpyDtoH(dst, hip_ptr(src), n);
}

/* Copy host memory to device memory. */
static int hip_htod(uint64_t dst, const void *src, uint64_t n) {
  return p_hipMemcpyHtoD(hip_ptr(dst), (void *)src, n);
}

/* Copy between two device-reachable ranges. */
static int hip_dtod(uint64_t dst, uint64_t src, uint64_t n) {
  return p_hipMemcpyDtoD(hip_ptr(dst), hip_ptr(src), n);
}

/* Set count 32-bit words of device memory. */
static int hip_memset32(uint64_t dst, uint32_t value, uint64_t count) {
  return p_hipMemsetD32(hip_ptr(dst), (int)value, count);
}

/* Open another process's legacy IPC handle. */
static int hip_ipc_open(const uint8_t *handle, uint64_t *dptr) {
  hipIpcMemHandle_t h;
  memcpy(&h, handle, sizeof h);
  void *p = NULL;
  hipError_t rc = p_hipIpcOpenMemHandle(&p, h, hipIpcMemLazyEnablePeerAccess);
  *dptr = (uint64_t)(uintptr_t)p;
  return (int)rc;
}

/* Close memory opened with hip_ipc_open. */
static int hip_ipc_close(uint64_t dptr) { return p_hipIpcCloseMemHandle(hip_ptr(dptr)); }

const struct vmm_va_vendor vmm_hip_va = {
    .base = &vmm_hip,
    .once = &once,
    .device_by_bus_id = hip_device_by_bus_id,
    .sync = hip_sync,
    .dtoh = hip_dtoh,
    .htod = hip_htod,
    .dtod = hip_dtod,
    .memset32 = hip_memset32,
    .ipc_open = hip_ipc_open,
    .ipc_close = hip_ipc_close,
};
