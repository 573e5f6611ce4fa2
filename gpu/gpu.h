/* The GPU layer: one interface over device virtual-memory management.
 *
 * Backends: "host" (Linux shared memory modelling VMM; no GPU needed) and,
 * where built, the vendor backends. The daemon side creates physical
 * chunks, exports them as fds and releases them; the client side reserves
 * address ranges, imports fds, maps, sets access and unmaps. All functions
 * return 0 or a negative errno; gpu_error() then says what the backend
 * reported, in words. */
#ifndef GPUMEM_GPU_H
#define GPUMEM_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct gpu gpu;

/* How to open a backend. */
struct gpu_options {
  const char *backend;       /* "host" (others as built) */
  bool client;               /* client side only: no devices are probed */
  unsigned host_devices;     /* host backend: simulated devices */
  uint64_t host_device_size; /* host backend: bytes per device */
  uint64_t host_granularity; /* host backend: 0 for the default, 2 MiB */
  const char *host_node;     /* host backend: names this daemon's simulated
                                devices (bus ids "host-<node>:<d>", memfds
                                "gpumem-host-<node>:<d>"); NULL: "local" */
};

/* Open a backend. On failure returns a negative errno and writes why. */
/* The backends built in, with the vendor headers each was compiled
 * against: "host cuda (CUDA_VERSION 13000) hip (HIP 6.4.43484)". */
void gpu_describe_builtin(char *buf, size_t len);

int gpu_open(const struct gpu_options *opt, gpu **out, char *err, size_t errlen);

/* Close a backend; every chunk and mapping must be gone. */
void gpu_close(gpu *g);

/* The backend's name ("host"). */
const char *gpu_name(const gpu *g);

/* Number of devices (daemon side). */
unsigned gpu_device_count(const gpu *g);

/* Allocation granularity: sizes and offsets are multiples of it. */
uint64_t gpu_granularity(const gpu *g);

/* Total and free bytes of a device, as the driver (or model) says. */
int gpu_mem_info(gpu *g, unsigned dev, uint64_t *free_bytes, uint64_t *total);

/* A device's memory as the driver reports it: reserved is what the driver
 * keeps for itself (0 where it does not say), so that used by processes is
 * total - free - reserved. */
struct gpu_mem {
  uint64_t total, free, reserved;
};

/* Daemon side: a device's memory, read without creating a context. */
int gpu_mem_detail(gpu *g, unsigned dev, struct gpu_mem *m);

/* A process using a device, and the device memory it holds that this
 * backend did not create for the daemon (the driver's own figure), or
 * GPU_USED_UNKNOWN where the driver names the process but gives no figure
 * (NVML in some VMs and containers). */
struct gpu_process {
  int pid;
  uint64_t used;
};

#define GPU_USED_UNKNOWN UINT64_MAX

/* Daemon side: the processes using dev, the daemon's own left out (all
 * it holds it made for itself). Writes at most max to out and the number
 * that exist to *n; -ENOTSUP where the driver gives no per-process
 * figures. On CUDA, memory the daemon created and a worker imported is not
 * counted against the worker: its figure is its context and what it
 * allocated itself. */
int gpu_processes(gpu *g, unsigned dev, struct gpu_process *out, size_t max, size_t *n);

/* Daemon side: which of n chunks process pid still maps or holds
 * (held[i]), reading the process once. Returns how many it holds, or
 * -ENOTSUP where the backend cannot tell (the driver's free memory is the
 * check there). */
int gpu_chunks_held_by(gpu *g, int pid, const uint64_t *handles, size_t n, bool *held);

/* Daemon side: own a chunk that another process hands over (re-registration
 * after a daemon restart). Checks that the fd is this backend's memory of
 * size bytes on dev (the host backend checks all of it; VMM backends check
 * the device, but no driver tells an imported allocation's size, so size is
 * taken on trust there); the fd is consumed either way. */
int gpu_chunk_adopt(gpu *g, unsigned dev, int fd, uint64_t size, uint64_t *handle);

/* Daemon side: record which uid a chunk is for, where the backend can keep
 * it with the memory (the host backend: the memfd's owner); -ENOTSUP where
 * it cannot (the VMM drivers keep no owner). */
int gpu_chunk_set_owner(gpu *g, uint64_t handle, uint32_t uid);

/* Daemon side: the uid recorded with a chunk (an adopted one too), or
 * -ENOTSUP where the backend keeps none. */
int gpu_chunk_owner(gpu *g, uint64_t handle, uint32_t *uid);

/* Daemon side: create a physical chunk of size bytes on dev. */
int gpu_chunk_create(gpu *g, unsigned dev, uint64_t size, uint64_t *handle);

/* Daemon side: export a chunk as a new fd for another process. */
int gpu_chunk_export(gpu *g, uint64_t handle, int *fd);

/* Daemon side: release a chunk (memory returns once importers let go). */
void gpu_chunk_release(gpu *g, unsigned dev, uint64_t handle, uint64_t size);

/* Daemon side: copy whole chunks of dev, in order, to host memory at host
 * (to_host) or from it; on GPUs in pieces overlapped on several streams,
 * no piece crossing a multiple of GPU_BACKUP_PIECE from host (so that
 * each lies within one pinned piece of a backup made in pieces). */
int gpu_chunks_copy(gpu *g, unsigned dev, const uint64_t *handles, const uint64_t *sizes,
                    size_t n, void *host, bool to_host);

/* Backup host memory made in pieces (gpu_backup_reserve, gpu_backup_make)
 * is made ready this much at a time: on GPUs each piece is pinned by a
 * driver call of its own, which holds the driver's lock only for that
 * piece, so that the daemon's other driver calls (creating and exporting
 * the next buffer) get in between pieces instead of waiting for a whole
 * buffer's pinning (about 450 ms per GiB on an H200). */
#define GPU_BACKUP_PIECE (64ull << 20)

/* Daemon side: an address range of size bytes for a backup of dev with
 * nothing made yet (no driver call beyond holding dev's context, counted,
 * until gpu_backup_release). */
int gpu_backup_reserve(gpu *g, unsigned dev, uint64_t size, void **host);

/* Daemon side: make the piece of a reserved backup that starts at off (a
 * multiple of GPU_BACKUP_PIECE below size) ready for copies: faulted in
 * and written once, and pinned on GPUs. Each piece is made once. On GPUs
 * one piece is pinned at a time process-wide, never while another driver
 * call of the process is in progress; a background piece (made ahead of
 * need) also waits until the process's other driver calls have been quiet
 * for a few milliseconds, so that a burst of allocations runs as if no
 * backup were being made. */
int gpu_backup_make(gpu *g, unsigned dev, void *host, uint64_t size, uint64_t off,
                    bool background);

/* Daemon side: free a reserved backup whose first made bytes (a multiple
 * of GPU_BACKUP_PIECE, or size) were made. */
void gpu_backup_release(gpu *g, unsigned dev, void *host, uint64_t size, uint64_t made);

/* Host memory for plain copies of any range (benchmarks' baselines): one
 * pinned allocation on GPUs, so that a copy may span all of it. The
 * daemon's backups are made in pieces instead. */
int gpu_backup_alloc(gpu *g, unsigned dev, uint64_t size, void **host);

/* Free memory from gpu_backup_alloc. */
void gpu_backup_free(gpu *g, unsigned dev, void *host, uint64_t size);

/* Daemon side: hold what backups on dev need (a device context on GPUs),
 * counted; gpu_unhold lets go. */
int gpu_hold(gpu *g, unsigned dev);

/* Daemon side: let go of one gpu_hold. */
void gpu_unhold(gpu *g, unsigned dev);

/* Daemon side: true while this process holds a context on dev. */
bool gpu_holding(gpu *g, unsigned dev);

/* Daemon side: the device's PCI bus id ("0000:17:00.0"), which names the
 * same GPU in every process whatever its device numbering. */
int gpu_bus_id(gpu *g, unsigned dev, char *buf, size_t len);

/* Client side: this process's device number for a PCI bus id, or -ENODEV. */
int gpu_device_by_bus_id(gpu *g, const char *bus_id);

/* Client side: reserve an address range with no memory behind it. */
int gpu_va_reserve(gpu *g, unsigned dev, uint64_t size, void **va);

/* Client side: give back a reserved range (everything unmapped). */
void gpu_va_free(gpu *g, unsigned dev, void *va, uint64_t size);

/* Client side: import an exported fd; the fd is consumed either way. */
int gpu_import(gpu *g, unsigned dev, int fd, uint64_t size, uint64_t *handle);

/* Client side: map an imported handle at va (no access yet). */
int gpu_map(gpu *g, unsigned dev, void *va, uint64_t size, uint64_t handle);

/* Client side: allow read/write access to a mapped range from dev. */
int gpu_set_access(gpu *g, unsigned dev, void *va, uint64_t size);

/* Client side: unmap one mapping, keeping the address range reserved. */
int gpu_unmap(gpu *g, unsigned dev, void *va, uint64_t size);

/* Client side: export an imported handle again as a new fd, for a daemon
 * that restarted and adopts the memory. */
int gpu_export(gpu *g, unsigned dev, uint64_t handle, int *fd);

/* Client side: release an imported handle. */
void gpu_release(gpu *g, unsigned dev, uint64_t handle);

/* Client side: wait until the device finished work touching its memory. */
int gpu_sync(gpu *g, unsigned dev);

/* Client side: copy device memory at va to host memory. */
int gpu_copy_from(gpu *g, unsigned dev, void *dst, const void *va, uint64_t len);

/* Client side: copy host memory to device memory at va. */
int gpu_copy_to(gpu *g, unsigned dev, void *va, const void *src, uint64_t len);

/* Client side: set len bytes (a multiple of 4) at va to a 32-bit value. */
int gpu_fill32(gpu *g, unsigned dev, void *va, uint64_t len, uint32_t value);

/* Size of a legacy IPC handle in bytes. */
#define GPU_IPC_HANDLE_SIZE 64

/* True if the backend has legacy IPC handles (plain device memory). */
bool gpu_has_ipc(const gpu *g);

/* True if each chunk the daemon holds is one of its file descriptors (the
 * host backend's memfds), so that chunks take from its descriptor limit. */
bool gpu_fd_per_chunk(const gpu *g);

/* Daemon side: allocate plain device memory and its IPC handle. */
int gpu_ipc_alloc(gpu *g, unsigned dev, uint64_t size, uint64_t *dptr,
                  uint8_t handle[GPU_IPC_HANDLE_SIZE]);

/* Daemon side: free memory from gpu_ipc_alloc. */
void gpu_ipc_free(gpu *g, unsigned dev, uint64_t dptr, uint64_t size);

/* Client side: open an IPC handle; *va is where the memory appears. */
int gpu_ipc_open(gpu *g, unsigned dev, const uint8_t handle[GPU_IPC_HANDLE_SIZE], void **va);

/* Client side: close memory opened with gpu_ipc_open. */
void gpu_ipc_close(gpu *g, unsigned dev, void *va);

/* What the backend last reported on this thread, in words. */
const char *gpu_error(void);

#endif
