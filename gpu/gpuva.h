/* The client's half of the GPU layer: device memory as this process maps
 * it. It reserves address ranges, imports the fds the daemon's half
 * (gpu/gpudev.h) exported, maps them in a range, sets access, unmaps
 * (keeping the range), releases and re-exports imported handles, waits
 * for the device, copies and fills through a mapping, and opens legacy IPC
 * handles.
 *
 * Backends: "host" (Linux shared memory modelling VMM; no GPU needed) and,
 * where built, "cuda" and "hip"; none probes devices it is not asked
 * about. All functions return 0 or a negative errno; gpu_error()
 * (gpu/error.h) then says what the backend reported, in words. */
#ifndef GPUMEM_GPU_GPUVA_H
#define GPUMEM_GPU_GPUVA_H

#include <stddef.h>
#include <stdint.h>

#include "gpu/error.h"
#include "gpu/ipc.h"

typedef struct gpuva gpuva;

/* Open the backend of that name ("host", others as built). On failure
 * returns a negative errno and writes why. */
int gpuva_open(const char *backend, gpuva **out, char *err, size_t errlen);

/* Close a backend; every mapping and imported handle must be gone. */
void gpuva_close(gpuva *g);

/* This process's device number for a PCI bus id, or -ENODEV. */
int gpuva_device_by_bus_id(gpuva *g, const char *bus_id);

/* Reserve an address range with no memory behind it. */
int gpuva_reserve(gpuva *g, unsigned dev, uint64_t size, void **va);

/* Give back a reserved range (everything unmapped). */
void gpuva_free(gpuva *g, unsigned dev, void *va, uint64_t size);

/* Import an exported fd; the fd is consumed either way. */
int gpuva_import(gpuva *g, unsigned dev, int fd, uint64_t size, uint64_t *handle);

/* Map an imported handle at va (no access yet). */
int gpuva_map(gpuva *g, unsigned dev, void *va, uint64_t size, uint64_t handle);

/* Allow read/write access to a mapped range from dev. */
int gpuva_set_access(gpuva *g, unsigned dev, void *va, uint64_t size);

/* Unmap one mapping, keeping the address range reserved. */
int gpuva_unmap(gpuva *g, unsigned dev, void *va, uint64_t size);

/* Export an imported handle again as a new fd, for a daemon that
 * restarted and adopts the memory. */
int gpuva_export(gpuva *g, unsigned dev, uint64_t handle, int *fd);

/* Release an imported handle. */
void gpuva_release(gpuva *g, unsigned dev, uint64_t handle);

/* Wait until the device finished work touching its memory. */
int gpuva_sync(gpuva *g, unsigned dev);

/* Copy device memory at va to host memory. */
int gpuva_copy_from(gpuva *g, unsigned dev, void *dst, const void *va, uint64_t len);

/* Copy host memory to device memory at va. */
int gpuva_copy_to(gpuva *g, unsigned dev, void *va, const void *src, uint64_t len);

/* Copy len bytes from src to dst, two ranges mapped here that dev
 * reaches (device memory, or a backup's host memory mapped for it), and
 * wait until the copy is done. */
int gpuva_copy_device(gpuva *g, unsigned dev, void *dst, const void *src, uint64_t len);

/* Let the host read (and write) a range mapped here from a backup's host
 * memory, so that its bytes can be read at va itself; -ENOTSUP where the
 * backend cannot. */
int gpuva_host_view(gpuva *g, unsigned dev, void *va, uint64_t size);

/* Set len bytes (a multiple of 4) at va to a 32-bit value. */
int gpuva_fill32(gpuva *g, unsigned dev, void *va, uint64_t len, uint32_t value);

/* Open an IPC handle; *va is where the memory appears. */
int gpuva_ipc_open(gpuva *g, unsigned dev, const uint8_t handle[GPU_IPC_HANDLE_SIZE], void **va);

/* Close memory opened with gpuva_ipc_open. */
void gpuva_ipc_close(gpuva *g, unsigned dev, void *va);

#endif
