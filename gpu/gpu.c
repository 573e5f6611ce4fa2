#include "gpu.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

#include "backend.h"

struct gpu {
  const struct gpu_ops *ops;
  void *state;
};

static const struct gpu_ops *const backends[] = {
    &gpu_host_ops,
#ifdef HAVE_CUDA
    &gpu_cuda_ops,
#endif
#ifdef HAVE_HIP
    &gpu_hip_ops,
#endif
};

static _Thread_local char last_error[256];

/* Record what went wrong on this thread and return err. */
int gpu_fail(int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return err;
}

/* What the backend last reported on this thread. */
const char *gpu_error(void) { return last_error; }

/* The backends built in and their vendor headers, into buf. */
void gpu_describe_builtin(char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  for (size_t i = 0; i < sizeof backends / sizeof backends[0] && o < len; i++) {
    const struct gpu_ops *b = backends[i];
    int n = b->built_with ? snprintf(buf + o, len - o, "%s%s (%s)", i ? " " : "", b->name, b->built_with)
                          : snprintf(buf + o, len - o, "%s%s", i ? " " : "", b->name);
    if (n < 0) break;
    o += (size_t)n;
  }
}

/* Find the backend by name and open it. */
int gpu_open(const struct gpu_options *opt, gpu **out, char *err, size_t errlen) {
  const struct gpu_ops *ops = NULL;
  for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
    if (strcmp(backends[i]->name, opt->backend) == 0) ops = backends[i];
  if (!ops) {
    snprintf(err, errlen, "unknown backend '%s'", opt->backend);
    return -ENOENT;
  }
  gpu *g = calloc(1, sizeof *g);
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
void gpu_close(gpu *g) {
  if (!g) return;
  g->ops->close(g->state);
  free(g);
}

/* The backend's name. */
const char *gpu_name(const gpu *g) { return g->ops->name; }

/* Number of devices. */
unsigned gpu_device_count(const gpu *g) { return g->ops->device_count(g->state); }

/* Allocation granularity. */
uint64_t gpu_granularity(const gpu *g) { return g->ops->granularity(g->state); }

/* A device's memory with the driver's reserve. */
int gpu_mem_detail(gpu *g, unsigned dev, struct gpu_mem *m) {
  memset(m, 0, sizeof *m);
  if (g->ops->mem_detail) return g->ops->mem_detail(g->state, dev, m);
  return g->ops->mem_info(g->state, dev, &m->free, &m->total);
}

/* The processes using a device. */
int gpu_processes(gpu *g, unsigned dev, struct gpu_process *out, size_t max, size_t *n) {
  *n = 0;
  if (!g->ops->processes) return gpu_fail(-ENOTSUP, "%s: no per-process figures", g->ops->name);
  return g->ops->processes(g->state, dev, out, max, n);
}

/* Which chunks a process still holds. */
int gpu_chunks_held_by(gpu *g, int pid, const uint64_t *handles, size_t n, bool *held) {
  if (!g->ops->chunks_held_by) return -ENOTSUP;
  return g->ops->chunks_held_by(g->state, pid, handles, n, held);
}

/* Record which uid a chunk is for. */
int gpu_chunk_set_owner(gpu *g, uint64_t handle, uint32_t uid) {
  if (!g->ops->chunk_set_owner) return -ENOTSUP;
  return g->ops->chunk_set_owner(g->state, handle, uid);
}

/* The uid recorded with a chunk. */
int gpu_chunk_owner(gpu *g, uint64_t handle, uint32_t *uid) {
  if (!g->ops->chunk_owner) return -ENOTSUP;
  return g->ops->chunk_owner(g->state, handle, uid);
}

/* Own a chunk handed over by another process. */
int gpu_chunk_adopt(gpu *g, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  if (!g->ops->chunk_adopt) {
    close(fd);
    return gpu_fail(-ENOTSUP, "%s: cannot adopt memory", g->ops->name);
  }
  return g->ops->chunk_adopt(g->state, dev, fd, size, handle);
}

/* Export an imported handle again. */
int gpu_export(gpu *g, unsigned dev, uint64_t handle, int *fd) {
  if (!g->ops->export_handle) return gpu_fail(-ENOTSUP, "%s: cannot export again", g->ops->name);
  return g->ops->export_handle(g->state, dev, handle, fd);
}

/* Total and free bytes of a device. */
int gpu_mem_info(gpu *g, unsigned dev, uint64_t *free_bytes, uint64_t *total) {
  return g->ops->mem_info(g->state, dev, free_bytes, total);
}

/* Create a physical chunk. */
int gpu_chunk_create(gpu *g, unsigned dev, uint64_t size, uint64_t *handle) {
  return g->ops->chunk_create(g->state, dev, size, handle);
}

/* Export a chunk as a new fd. */
int gpu_chunk_export(gpu *g, uint64_t handle, int *fd) {
  return g->ops->chunk_export(g->state, handle, fd);
}

/* Release a chunk. */
void gpu_chunk_release(gpu *g, unsigned dev, uint64_t handle, uint64_t size) {
  g->ops->chunk_release(g->state, dev, handle, size);
}

/* Copy whole chunks to or from host memory. */
int gpu_chunks_copy(gpu *g, unsigned dev, const uint64_t *handles, const uint64_t *sizes,
                    size_t n, void *host, bool to_host) {
  return g->ops->chunks_copy(g->state, dev, handles, sizes, n, host, to_host);
}

/* An address range for a backup, nothing made yet. */
int gpu_backup_reserve(gpu *g, unsigned dev, uint64_t size, void **host) {
  return g->ops->backup_reserve(g->state, dev, size, host);
}

/* Make one piece of a reserved backup ready. */
int gpu_backup_make(gpu *g, unsigned dev, void *host, uint64_t size, uint64_t off,
                    bool background) {
  if (off >= size || off % GPU_BACKUP_PIECE)
    return gpu_fail(-EINVAL, "backup piece at %llu of %llu bytes", (unsigned long long)off,
                    (unsigned long long)size);
  return g->ops->backup_make(g->state, dev, host, size, off, background);
}

/* Free a reserved backup, its first made bytes made. */
void gpu_backup_release(gpu *g, unsigned dev, void *host, uint64_t size, uint64_t made) {
  g->ops->backup_release(g->state, dev, host, size, made);
}

/* Memory is faulted in this much at a time (see gpu_populate). */
#define POPULATE_STEP (2ull << 20)

/* Fault in and write memory a step at a time. Faulting in holds the
 * process's mmap lock (for reading) throughout one call, and an mmap or
 * munmap of another thread waits for it: on an H200 host faulting in ran
 * at about 3 GB/s, so 64 MiB at once held the daemon loop's next mmap
 * (the next BACKUP buffer's range) up for 20-30 ms; 2 MiB holds it up for
 * well under a millisecond. Each step is written once too: on the
 * development VM the first write to memory just faulted in ran at 0.3-0.5
 * GB/s and the next at 15 GB/s, a cost that belongs here and not in a
 * pause. */
int gpu_populate(void *p, uint64_t len) {
  for (uint64_t off = 0; off < len; off += POPULATE_STEP) {
    uint64_t n = len - off < POPULATE_STEP ? len - off : POPULATE_STEP;
    if (madvise((char *)p + off, n, MADV_POPULATE_WRITE) < 0 && errno != EINVAL)
      /* EINVAL: before Linux 5.14; the memset faults it in */
      return gpu_fail(-ENOMEM, "backup memory of %llu bytes: %s", (unsigned long long)len,
                      strerror(errno));
    memset((char *)p + off, 0, n);
  }
  return 0;
}

/* Host memory for plain copies, in one piece. */
int gpu_backup_alloc(gpu *g, unsigned dev, uint64_t size, void **host) {
  return g->ops->backup_alloc(g->state, dev, size, host);
}

/* Free memory from gpu_backup_alloc. */
void gpu_backup_free(gpu *g, unsigned dev, void *host, uint64_t size) {
  g->ops->backup_free(g->state, dev, host, size);
}

/* Hold what backups need. */
int gpu_hold(gpu *g, unsigned dev) { return g->ops->hold(g->state, dev); }

/* Let go of a hold. */
void gpu_unhold(gpu *g, unsigned dev) { g->ops->unhold(g->state, dev); }

/* True while this process holds a context on dev. */
bool gpu_holding(gpu *g, unsigned dev) { return g->ops->holding(g->state, dev); }

/* The device's PCI bus id. */
int gpu_bus_id(gpu *g, unsigned dev, char *buf, size_t len) {
  return g->ops->bus_id(g->state, dev, buf, len);
}

/* This process's device number for a PCI bus id. */
int gpu_device_by_bus_id(gpu *g, const char *bus_id) {
  return g->ops->device_by_bus_id(g->state, bus_id);
}

/* Reserve an address range. */
int gpu_va_reserve(gpu *g, unsigned dev, uint64_t size, void **va) {
  return g->ops->va_reserve(g->state, dev, size, va);
}

/* Free an address range. */
void gpu_va_free(gpu *g, unsigned dev, void *va, uint64_t size) {
  g->ops->va_free(g->state, dev, va, size);
}

/* Import an exported fd. */
int gpu_import(gpu *g, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  return g->ops->import(g->state, dev, fd, size, handle);
}

/* Map an imported handle. */
int gpu_map(gpu *g, unsigned dev, void *va, uint64_t size, uint64_t handle) {
  return g->ops->map(g->state, dev, va, size, handle);
}

/* Allow access to a mapped range. */
int gpu_set_access(gpu *g, unsigned dev, void *va, uint64_t size) {
  return g->ops->set_access(g->state, dev, va, size);
}

/* Unmap one mapping. */
int gpu_unmap(gpu *g, unsigned dev, void *va, uint64_t size) {
  return g->ops->unmap(g->state, dev, va, size);
}

/* Release an imported handle. */
void gpu_release(gpu *g, unsigned dev, uint64_t handle) { g->ops->release(g->state, dev, handle); }

/* Wait for a device. */
int gpu_sync(gpu *g, unsigned dev) { return g->ops->sync(g->state, dev); }

/* Copy device memory to the host. */
int gpu_copy_from(gpu *g, unsigned dev, void *dst, const void *va, uint64_t len) {
  return g->ops->copy_from(g->state, dev, dst, va, len);
}

/* Copy host memory to the device. */
int gpu_copy_to(gpu *g, unsigned dev, void *va, const void *src, uint64_t len) {
  return g->ops->copy_to(g->state, dev, va, src, len);
}

/* Fill device memory with a 32-bit value. */
int gpu_fill32(gpu *g, unsigned dev, void *va, uint64_t len, uint32_t value) {
  return g->ops->fill32(g->state, dev, va, len, value);
}

/* True if the backend has legacy IPC handles. */
bool gpu_has_ipc(const gpu *g) { return g->ops->ipc_alloc != NULL; }

/* True if each chunk is one of the daemon's descriptors. */
bool gpu_fd_per_chunk(const gpu *g) { return g->ops->fd_per_chunk; }

/* Allocate plain device memory with an IPC handle. */
int gpu_ipc_alloc(gpu *g, unsigned dev, uint64_t size, uint64_t *dptr,
                  uint8_t handle[GPU_IPC_HANDLE_SIZE]) {
  if (!g->ops->ipc_alloc) return gpu_fail(-ENOTSUP, "no legacy IPC on %s", g->ops->name);
  return g->ops->ipc_alloc(g->state, dev, size, dptr, handle);
}

/* Free IPC memory. */
void gpu_ipc_free(gpu *g, unsigned dev, uint64_t dptr, uint64_t size) {
  if (g->ops->ipc_free) g->ops->ipc_free(g->state, dev, dptr, size);
}

/* Open an IPC handle. */
int gpu_ipc_open(gpu *g, unsigned dev, const uint8_t handle[GPU_IPC_HANDLE_SIZE], void **va) {
  if (!g->ops->ipc_open) return gpu_fail(-ENOTSUP, "no legacy IPC on %s", g->ops->name);
  return g->ops->ipc_open(g->state, dev, handle, va);
}

/* Close an opened IPC handle. */
void gpu_ipc_close(gpu *g, unsigned dev, void *va) {
  if (g->ops->ipc_close) g->ops->ipc_close(g->state, dev, va);
}
