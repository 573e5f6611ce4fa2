/* The daemon's half of the GPU layer: the devices and the physical memory
 * on them. It creates physical chunks, exports them as fds for workers,
 * adopts the ones handed back after a restart, releases them, reads the
 * devices' memory figures and who holds memory outside the daemon, copies
 * chunks to and from host memory for backups, holds device contexts for
 * them, and makes legacy IPC memory. The client's half (gpu/gpuva.h) maps
 * what it exports.
 *
 * Backends: "host" (Linux shared memory modelling VMM; no GPU needed) and,
 * where built, "cuda" and "hip". All functions return 0 or a negative
 * errno; gpu_error() (gpu/error.h) then says what the backend reported, in
 * words. */
#ifndef GPUMEM_GPU_GPUDEV_H
#define GPUMEM_GPU_GPUDEV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/error.h"
#include "gpu/ipc.h"

typedef struct gpudev gpudev;

/* How to open a backend. */
struct gpudev_options {
  const char *backend;       /* "host" (others as built) */
  unsigned host_devices;     /* host backend: simulated devices */
  uint64_t host_device_size; /* host backend: bytes per device */
  uint64_t host_granularity; /* host backend: 0 for the default, 2 MiB */
  const char *host_node;     /* host backend: names this daemon's simulated
                                devices (bus ids "host-<node>:<d>", memfds
                                "gpumem-host-<node>:<d>"); NULL: "local" */
};

/* The backends built in, with the vendor headers each was compiled
 * against: "host cuda (CUDA_VERSION 13000) hip (HIP 6.4.43484)". */
void gpudev_describe_builtin(char *buf, size_t len);

/* Open a backend. On failure returns a negative errno and writes why. */
int gpudev_open(const struct gpudev_options *opt, gpudev **out, char *err, size_t errlen);

/* Close a backend; every chunk must be gone. */
void gpudev_close(gpudev *g);

/* The backend's name ("host"). */
const char *gpudev_name(const gpudev *g);

/* Number of devices. */
unsigned gpudev_device_count(const gpudev *g);

/* Allocation granularity: sizes and offsets are multiples of it. */
uint64_t gpudev_granularity(const gpudev *g);

/* Total and free bytes of a device, as the driver (or model) says. */
int gpudev_mem_info(gpudev *g, unsigned dev, uint64_t *free_bytes, uint64_t *total);

/* A device's memory as the driver reports it: reserved is what the driver
 * keeps for itself (0 where it does not say), so that used by processes is
 * total - free - reserved. */
struct gpudev_mem {
  uint64_t total, free, reserved;
};

/* A device's memory, read without creating a context. */
int gpudev_mem_detail(gpudev *g, unsigned dev, struct gpudev_mem *m);

/* A process using a device, and the device memory it holds that this
 * backend did not create for the daemon (the driver's own figure), or
 * GPUDEV_USED_UNKNOWN where the driver names the process but gives no
 * figure (NVML in some VMs and containers). */
struct gpudev_process {
  int pid;
  uint64_t used;
};

#define GPUDEV_USED_UNKNOWN UINT64_MAX

/* The processes using dev, the daemon's own left out (all it holds it
 * made for itself). Writes at most max to out and the number that exist
 * to *n; -ENOTSUP where the driver gives no per-process figures. On CUDA,
 * memory the daemon created and a worker imported is not counted against
 * the worker: its figure is its context and what it allocated itself. */
int gpudev_processes(gpudev *g, unsigned dev, struct gpudev_process *out, size_t max, size_t *n);

/* gpudev_processes with figures read at or after since_ns (the
 * CLOCK_MONOTONIC clock, uv_hrtime's), so that an operation's checks of
 * every device share one reading where the backend keeps them (the host
 * backend's walk of /proc); a backend that keeps none reads them now. */
int gpudev_processes_since(gpudev *g, unsigned dev, uint64_t since_ns,
                           struct gpudev_process *out, size_t max, size_t *n);

/* gpudev_processes for a view (status, top) begun at since_ns, where
 * figures a moment old will do: the host backend reads a process with
 * device memory at or after since_ns or at most 1 s before (one that has
 * exited is left out at once), one that holds none again only within
 * 10 s, and finds a new one within 1 s, so that a node of thousands of
 * processes costs each view little; the others read now. */
int gpudev_processes_view(gpudev *g, unsigned dev, uint64_t since_ns,
                          struct gpudev_process *out, size_t max, size_t *n);

/* Whether the driver still lists process pid on any device (1) or not
 * (0): a process that has exited stays listed, its memory not yet free,
 * until the driver has let go of it (on an H200 a moment after the exit).
 * -ENOTSUP where the driver lists no processes. */
int gpudev_process_listed(gpudev *g, int pid);

/* Release process pid's own device state (its contexts and what it
 * allocated itself; nothing it imported may still be mapped) to host
 * memory, giving the driver lock_ms to stop the process's device calls.
 * It succeeds only where the driver then lists the process holding
 * nothing; a release that did not is undone where the driver allows and
 * fails (-EBUSY), with the driver's words. *moved: the device bytes the
 * driver listed for the process before. -ENOTSUP where the backend
 * cannot (HIP; a CUDA driver without the checkpoint API). The host
 * backend's stand-in stops the process (SIGSTOP) and refuses one that
 * still maps or holds device memory. */
int gpudev_process_release(gpudev *g, int pid, uint32_t lock_ms, uint64_t *moved);

/* True where a release stops the whole process (the host stand-in), not
 * only its device calls (CUDA): a process may then not be released by its
 * own pause, whose answer it waits for. */
bool gpudev_release_stops_process(const gpudev *g);

/* Bring back what gpudev_process_release moved to host memory and let
 * the process make device calls again (the host stand-in: SIGCONT). */
int gpudev_process_restore(gpudev *g, int pid);

/* 1 while pid's device state is released (or its device calls are held
 * by a release that did not finish), 0 if it runs, or a negative errno. */
int gpudev_process_released(gpudev *g, int pid);

/* Which of n chunks process pid still maps or holds (held[i]), reading
 * the process once. Returns how many it holds, or -ENOTSUP where the
 * backend cannot tell (the driver's free memory is the check there). */
int gpudev_chunks_held_by(gpudev *g, int pid, const uint64_t *handles, size_t n, bool *held);

/* Own a chunk that another process hands over (re-registration after a
 * daemon restart). Checks that the fd is this backend's memory of size
 * bytes on dev (the host backend checks all of it; VMM backends check the
 * device, but no driver tells an imported allocation's size, so size is
 * taken on trust there); the fd is consumed either way. */
int gpudev_chunk_adopt(gpudev *g, unsigned dev, int fd, uint64_t size, uint64_t *handle);

/* Record which uid a chunk is for, where the backend can keep it with the
 * memory (the host backend: the memfd's owner); -ENOTSUP where it cannot
 * (the VMM drivers keep no owner). */
int gpudev_chunk_set_owner(gpudev *g, uint64_t handle, uint32_t uid);

/* The uid recorded with a chunk (an adopted one too), or -ENOTSUP where
 * the backend keeps none. */
int gpudev_chunk_owner(gpudev *g, uint64_t handle, uint32_t *uid);

/* Create a physical chunk of size bytes on dev. */
int gpudev_chunk_create(gpudev *g, unsigned dev, uint64_t size, uint64_t *handle);

/* Export a chunk as a new fd for another process. */
int gpudev_chunk_export(gpudev *g, uint64_t handle, int *fd);

/* Release a chunk (memory returns once importers let go). */
void gpudev_chunk_release(gpudev *g, unsigned dev, uint64_t handle, uint64_t size);

/* Copy whole chunks of dev, in order, to host memory at host (to_host) or
 * from it; on GPUs in pieces overlapped on several streams, no piece
 * crossing a multiple of GPUDEV_BACKUP_PIECE from host (so that each lies
 * within one pinned piece of a backup made in pieces). */
int gpudev_chunks_copy(gpudev *g, unsigned dev, const uint64_t *handles, const uint64_t *sizes,
                       size_t n, void *host, bool to_host);

/* Backup host memory made in pieces (gpudev_backup_reserve,
 * gpudev_backup_make) is made ready this much at a time: on GPUs each
 * piece is pinned by a driver call of its own, which holds the driver's
 * lock only for that piece, so that the daemon's other driver calls
 * (creating and exporting the next buffer) get in between pieces instead
 * of waiting for a whole buffer's pinning (about 450 ms per GiB on an
 * H200). */
#define GPUDEV_BACKUP_PIECE (64ull << 20)

/* An address range of size bytes for a backup of dev with nothing made
 * yet (no driver call beyond holding dev's context, counted, until
 * gpudev_backup_release). */
int gpudev_backup_reserve(gpudev *g, unsigned dev, uint64_t size, void **host);

/* Make the piece of a reserved backup that starts at off (a multiple of
 * GPUDEV_BACKUP_PIECE below size) ready for copies: faulted in and written
 * once, and pinned on GPUs. Each piece is made once. On GPUs one piece is
 * pinned at a time process-wide, never while another driver call of the
 * process is in progress; a background piece (made ahead of need) also
 * waits until the process's other driver calls have been quiet for a few
 * milliseconds, so that a burst of allocations runs as if no backup were
 * being made. */
int gpudev_backup_make(gpudev *g, unsigned dev, void *host, uint64_t size, uint64_t off,
                       bool background);

/* Free a reserved backup whose first made bytes (a multiple of
 * GPUDEV_BACKUP_PIECE, or size) were made. */
void gpudev_backup_release(gpudev *g, unsigned dev, void *host, uint64_t size, uint64_t made);

/* Host memory for plain copies of any range (benchmarks' baselines): one
 * pinned allocation on GPUs, so that a copy may span all of it. The
 * daemon's backups are made in pieces instead. */
int gpudev_backup_alloc(gpudev *g, unsigned dev, uint64_t size, void **host);

/* Free memory from gpudev_backup_alloc. */
void gpudev_backup_free(gpudev *g, unsigned dev, void *host, uint64_t size);

/* Let only the host reach the backup at host (made by gpudev_backup_make
 * on dev) until the next copy through it: where the device's access
 * costs device memory (CUDA's host-NUMA backups, 2 MiB per GiB on an
 * H200, by NVML), it is given back; the next copy lets the device in. */
void gpudev_backup_host_only(gpudev *g, unsigned dev, void *host);

/* Export the pieces of the backup at host (size bytes, every piece made)
 * as new fds, for its buffer's owner to copy into or out of with its own
 * context (so that the daemon needs none): at most max of them into fds
 * (the caller's to close), their sizes, end to end covering size bytes,
 * into sizes, their count into *n. -ENOTSUP where the backend's backups
 * cannot be handed out (pinned memory, HIP), -E2BIG where more than max
 * pieces would be needed. */
int gpudev_backup_export(gpudev *g, unsigned dev, void *host, uint64_t size, int *fds,
                         uint64_t *sizes, size_t max, size_t *n);

/* Hold what backups on dev need (a device context on GPUs), counted;
 * gpudev_unhold lets go. */
int gpudev_hold(gpudev *g, unsigned dev);

/* Let go of one gpudev_hold. */
void gpudev_unhold(gpudev *g, unsigned dev);

/* True while this backend holds a context on dev. */
bool gpudev_holding(gpudev *g, unsigned dev);

/* The device's PCI bus id ("0000:17:00.0"), which names the same GPU in
 * every process whatever its device numbering. */
int gpudev_bus_id(gpudev *g, unsigned dev, char *buf, size_t len);

/* True if the backend has legacy IPC handles (plain device memory). */
bool gpudev_has_ipc(const gpudev *g);

/* True if each chunk the daemon holds is one of its file descriptors (the
 * host backend's memfds), so that chunks take from its descriptor limit. */
bool gpudev_fd_per_chunk(const gpudev *g);

/* Allocate plain device memory and its IPC handle. */
int gpudev_ipc_alloc(gpudev *g, unsigned dev, uint64_t size, uint64_t *dptr,
                     uint8_t handle[GPU_IPC_HANDLE_SIZE]);

/* Free memory from gpudev_ipc_alloc. */
void gpudev_ipc_free(gpudev *g, unsigned dev, uint64_t dptr, uint64_t size);

#endif
