/* The daemon's half of the GPU layer: the backend chosen by name, and each
 * call passed to its table (gpu/gpudev_ops.h). */
#include "gpudev.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpudev_ops.h"

struct gpudev {
  const struct gpudev_ops *ops;
  void *state;
};

static const struct gpudev_ops *const backends[] = {
    &gpudev_host_ops,
#ifdef HAVE_CUDA
    &gpudev_cuda_ops,
#endif
#ifdef HAVE_HIP
    &gpudev_hip_ops,
#endif
};

/* The backends built in and their vendor headers, into buf. */
void gpudev_describe_builtin(char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < sizeof backends / sizeof backends[0] && o < len; i++) {
    const struct gpudev_ops *b = backends[i];
    int n = b->built_with
                ? snprintf(buf + o, len - o, "%s%s (%s)", i ? " " : "", b->name, b->built_with)
                : snprintf(buf + o, len - o, "%s%s", i ? " " : "", b->name);
    if (n < 0) break;
    o += (size_t)n;
  }
}

/* Find the backend by name and open it. */
int gpudev_open(const struct gpudev_options *opt, gpudev **out, char *err, size_t errlen) {
  const struct gpudev_ops *ops = NULL;
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
    if (strcmp(backends[i]->name, opt->backend) == 0) ops = backends[i];
  if (!ops) {
    snprintf(err, errlen, "unknown backend '%s'", opt->backend);
    return -ENOENT;
  }
  gpudev *g = calloc(1, sizeof *g);
  if (!g) return -ENOMEM;
  g->ops = ops;
  int rc = ops->open(ops, opt, &g->state, err, errlen);
  if (rc < 0) {
    free(g);
    return rc;
  }
  *out = g;
  return 0;
}

/* Close a backend. */
void gpudev_close(gpudev *g) {
  if (!g) return;
  g->ops->close(g->state);
  free(g);
}

/* The backend's name. */
const char *gpudev_name(const gpudev *g) { return g->ops->name; }

/* Number of devices. */
unsigned gpudev_device_count(const gpudev *g) { return g->ops->device_count(g->state); }

/* Allocation granularity. */
uint64_t gpudev_granularity(const gpudev *g) { return g->ops->granularity(g->state); }

/* Total and free bytes of a device. */
int gpudev_mem_info(gpudev *g, unsigned dev, uint64_t *free_bytes, uint64_t *total) {
  return g->ops->mem_info(g->state, dev, free_bytes, total);
}

/* A device's memory with the driver's reserve. */
int gpudev_mem_detail(gpudev *g, unsigned dev, struct gpudev_mem *m) {
  memset(m, 0, sizeof *m);
  if (g->ops->mem_detail) return g->ops->mem_detail(g->state, dev, m);
  return g->ops->mem_info(g->state, dev, &m->free, &m->total);
}

/* The processes using a device. */
int gpudev_processes(gpudev *g, unsigned dev, struct gpudev_process *out, size_t max, size_t *n) {
  *n = 0;
  if (!g->ops->processes) return gpu_fail(-ENOTSUP, "%s: no per-process figures", g->ops->name);
  return g->ops->processes(g->state, dev, out, max, n);
}

/* The processes using a device, read at or after since_ns. */
int gpudev_processes_since(gpudev *g, unsigned dev, uint64_t since_ns,
                           struct gpudev_process *out, size_t max, size_t *n) {
  *n = 0;
  if (!g->ops->processes_since) return gpudev_processes(g, dev, out, max, n);
  return g->ops->processes_since(g->state, dev, since_ns, out, max, n);
}

/* The processes using a device, for a view. */
int gpudev_processes_view(gpudev *g, unsigned dev, uint64_t since_ns,
                          struct gpudev_process *out, size_t max, size_t *n) {
  *n = 0;
  if (!g->ops->processes_view) return gpudev_processes(g, dev, out, max, n);
  return g->ops->processes_view(g->state, dev, since_ns, out, max, n);
}

/* Whether the driver lists a process on any device. */
int gpudev_process_listed(gpudev *g, int pid) {
  if (g->ops->process_listed) return g->ops->process_listed(g->state, pid);
  if (!g->ops->processes) return gpu_fail(-ENOTSUP, "%s: no per-process figures", g->ops->name);
  int rc = 0;
  for (unsigned d = 0; rc == 0 && d < gpudev_device_count(g); d++) {
    size_t n = 0, room;
    if ((rc = g->ops->processes(g->state, d, NULL, 0, &n)) < 0) break;
    struct gpudev_process *list = calloc((room = n + 8), sizeof *list);
    if (!list) return gpu_fail(-ENOMEM, "out of memory");
    n = 0;
    rc = g->ops->processes(g->state, d, list, room, &n);
    for (size_t i = 0; rc == 0 && i < n && i < room; i++)
      if (list[i].pid == pid) rc = 1;
    free(list);
  }
  return rc;
}

/* Release a process's own device state to host memory. */
int gpudev_process_release(gpudev *g, int pid, uint32_t lock_ms, uint64_t *moved) {
  *moved = 0;
  if (!g->ops->process_release)
    return gpu_fail(-ENOTSUP, "the %s backend cannot release a process's device state",
                    g->ops->name);
  return g->ops->process_release(g->state, pid, lock_ms, moved);
}

/* Whether a release stops the whole process. */
bool gpudev_release_stops_process(const gpudev *g) { return g->ops->release_stops; }

/* Bring a released process's device state back. */
int gpudev_process_restore(gpudev *g, int pid) {
  if (!g->ops->process_restore)
    return gpu_fail(-ENOTSUP, "the %s backend cannot restore a process", g->ops->name);
  return g->ops->process_restore(g->state, pid);
}

/* Whether a process's device state is released. */
int gpudev_process_released(gpudev *g, int pid) {
  if (!g->ops->process_released) return 0;
  return g->ops->process_released(g->state, pid);
}

/* Which chunks a process still holds. */
int gpudev_chunks_held_by(gpudev *g, int pid, const uint64_t *handles, size_t n, bool *held) {
  if (!g->ops->chunks_held_by) return -ENOTSUP;
  return g->ops->chunks_held_by(g->state, pid, handles, n, held);
}

/* Own a chunk handed over by another process. */
int gpudev_chunk_adopt(gpudev *g, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  if (!g->ops->chunk_adopt) {
    close(fd);
    return gpu_fail(-ENOTSUP, "%s: cannot adopt memory", g->ops->name);
  }
  return g->ops->chunk_adopt(g->state, dev, fd, size, handle);
}

/* Record which uid a chunk is for. */
int gpudev_chunk_set_owner(gpudev *g, uint64_t handle, uint32_t uid) {
  if (!g->ops->chunk_set_owner) return -ENOTSUP;
  return g->ops->chunk_set_owner(g->state, handle, uid);
}

/* The uid recorded with a chunk. */
int gpudev_chunk_owner(gpudev *g, uint64_t handle, uint32_t *uid) {
  if (!g->ops->chunk_owner) return -ENOTSUP;
  return g->ops->chunk_owner(g->state, handle, uid);
}

/* Create a physical chunk. */
int gpudev_chunk_create(gpudev *g, unsigned dev, uint64_t size, uint64_t *handle) {
  return g->ops->chunk_create(g->state, dev, size, handle);
}

/* Export a chunk as a new fd. */
int gpudev_chunk_export(gpudev *g, uint64_t handle, int *fd) {
  return g->ops->chunk_export(g->state, handle, fd);
}

/* Release a chunk. */
void gpudev_chunk_release(gpudev *g, unsigned dev, uint64_t handle, uint64_t size) {
  g->ops->chunk_release(g->state, dev, handle, size);
}

/* Copy whole chunks to or from host memory. */
int gpudev_chunks_copy(gpudev *g, unsigned dev, const uint64_t *handles, const uint64_t *sizes,
                       size_t n, void *host, bool to_host) {
  return g->ops->chunks_copy(g->state, dev, handles, sizes, n, host, to_host);
}

/* An address range for a backup, nothing made yet. */
int gpudev_backup_reserve(gpudev *g, unsigned dev, uint64_t size, void **host) {
  return g->ops->backup_reserve(g->state, dev, size, host);
}

/* Make one piece of a reserved backup ready. */
int gpudev_backup_make(gpudev *g, unsigned dev, void *host, uint64_t size, uint64_t off,
                       bool background) {
  if (off >= size || off % GPUDEV_BACKUP_PIECE)
    return gpu_fail(-EINVAL, "backup piece at %llu of %llu bytes", (unsigned long long)off,
                    (unsigned long long)size);
  return g->ops->backup_make(g->state, dev, host, size, off, background);
}

/* Free a reserved backup, its first made bytes made. */
void gpudev_backup_release(gpudev *g, unsigned dev, void *host, uint64_t size, uint64_t made) {
  g->ops->backup_release(g->state, dev, host, size, made);
}

/* Host memory for plain copies, in one piece. */
int gpudev_backup_alloc(gpudev *g, unsigned dev, uint64_t size, void **host) {
  return g->ops->backup_alloc(g->state, dev, size, host);
}

/* Free memory from gpudev_backup_alloc. */
void gpudev_backup_free(gpudev *g, unsigned dev, void *host, uint64_t size) {
  g->ops->backup_free(g->state, dev, host, size);
}

/* Let only the host reach a backup until its next copy. */
void gpudev_backup_host_only(gpudev *g, unsigned dev, void *host) {
  if (g->ops->backup_host_only) g->ops->backup_host_only(g->state, dev, host);
}

/* Export a backup's pieces for its owner. */
int gpudev_backup_export(gpudev *g, unsigned dev, void *host, uint64_t size, int *fds,
                         uint64_t *sizes, size_t max, size_t *n) {
  *n = 0;
  if (!g->ops->backup_export)
    return gpu_fail(-ENOTSUP, "%s backups cannot be handed out", g->ops->name);
  return g->ops->backup_export(g->state, dev, host, size, fds, sizes, max, n);
}

/* Hold what backups need. */
int gpudev_hold(gpudev *g, unsigned dev) { return g->ops->hold(g->state, dev); }

/* Let go of a hold. */
void gpudev_unhold(gpudev *g, unsigned dev) { g->ops->unhold(g->state, dev); }

/* True while this backend holds a context on dev. */
bool gpudev_holding(gpudev *g, unsigned dev) { return g->ops->holding(g->state, dev); }

/* The device's PCI bus id. */
int gpudev_bus_id(gpudev *g, unsigned dev, char *buf, size_t len) {
  return g->ops->bus_id(g->state, dev, buf, len);
}

/* True if the backend has legacy IPC handles. */
bool gpudev_has_ipc(const gpudev *g) { return g->ops->ipc_alloc != NULL; }

/* True if each chunk is one of the daemon's descriptors. */
bool gpudev_fd_per_chunk(const gpudev *g) { return g->ops->fd_per_chunk; }

/* Allocate plain device memory with an IPC handle. */
int gpudev_ipc_alloc(gpudev *g, unsigned dev, uint64_t size, uint64_t *dptr,
                     uint8_t handle[GPU_IPC_HANDLE_SIZE]) {
  if (!g->ops->ipc_alloc) return gpu_fail(-ENOTSUP, "no legacy IPC on %s", g->ops->name);
  return g->ops->ipc_alloc(g->state, dev, size, dptr, handle);
}

/* Free IPC memory. */
void gpudev_ipc_free(gpudev *g, unsigned dev, uint64_t dptr, uint64_t size) {
  if (g->ops->ipc_free) g->ops->ipc_free(g->state, dev, dptr, size);
}
