/* The VMM backends: physical chunks exported as POSIX fds, imported and
 * mapped at reserved addresses, over a vendor table (gpu/vmm.h). Written
 * once for CUDA and HIP.
 *
 * The daemon holds no device context while idle (a CUDA primary context
 * costs about half a GiB per GPU): create, export and release need none;
 * copies, backups and legacy IPC memory hold the device's primary context
 * only for as long as they need it.
 *
 * No call changes what is current on the calling thread: a call that needs
 * a context pushes the device's primary context and pops it before it
 * returns (HIP: sets the device and sets the caller's back), so that a
 * multi-GPU application's current device and context are its own.
 *
 * Backup host memory is pinned a piece at a time (gpu_backup_make): pinning
 * holds a driver-wide lock for as long as it runs (cuMemHostAlloc of 1 GiB
 * about 450-570 ms on an H200, most of it faulting the pages in), and
 * every other driver call of the process waits for it. Made in the
 * background for a fresh BACKUP buffer in one call, it stalled the
 * daemon's next allocations by that much each (16 buffers of 1 GiB took
 * 7.2 s to allocate instead of tens of ms). So the memory is faulted in
 * without the driver (gpu_populate, in small steps), and then pinned per
 * GPU_BACKUP_PIECE by cuMemHostRegister, which on an H200 holds the lock
 * for 1.3-2.2 ms per 64 MiB of memory already faulted in; a gate makes
 * each piece wait while any other driver call of the process is in
 * progress, and lets one piece be pinned at a time, so that a call of the
 * daemon's loop waits for at most the one piece being pinned. Copies then
 * go per piece, each within one pinned registration (no loss measured:
 * 55 GB/s each way in 64 MiB copies, as from cuMemHostAlloc memory). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "common/idmap.h"
#include "common/limits.h"
#include "vmm.h"

struct vmm {
  const struct vmm_vendor *v;
  bool client;
  int ndev;
  uint64_t granularity;
  pthread_mutex_t mu;
  unsigned ctx_refs[GPUMEM_MAX_DEVICES]; /* contexts this process holds */
  bool client_held[GPUMEM_MAX_DEVICES];  /* one of them is the client side's */
  idmap *kept; /* imported handle -> fd + 1 it came from, under mu */
  /* The gate between backup pieces and every other driver call. */
  pthread_mutex_t gate_mu;
  pthread_cond_t gate_cv;
  atomic_uint calls;          /* other driver calls in progress */
  atomic_uint pieces_waiting; /* pieces waiting for them to end */
  atomic_uint_fast64_t last_end; /* when the last of them ended, in ns */
  bool piece_busy;            /* a piece is being pinned (under gate_mu) */
};

/* A background piece starts only once the other driver calls that change
 * something (not queries) have been quiet this long: a burst of
 * allocations (about half a millisecond apart) runs whole before the
 * background goes on. It waits for quiet no longer than QUIET_MAX_NS, so
 * that steady traffic cannot hold backups off for good (then a piece
 * still starts only between calls). */
#define QUIET_NS (5ull * 1000000)
#define QUIET_MAX_NS (100ull * 1000000)

/* Nanoseconds on the monotonic clock (the gate's condition clock). */
static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* A driver call other than pinning a backup piece begins: no piece starts
 * until it ends. */
static void call_begin(struct vmm *m) { atomic_fetch_add(&m->calls, 1); }

/* A driver call ends: the last one lets waiting pieces go. A piece counts
 * itself waiting before it reads calls, and a call drops calls before it
 * reads the waiting count, so one of the two sees the other (both
 * sequentially consistent) and no wake-up is lost. */
static void call_end(struct vmm *m) {
  atomic_store(&m->last_end, mono_ns());
  if (atomic_fetch_sub(&m->calls, 1) == 1 && atomic_load(&m->pieces_waiting) > 0) {
    pthread_mutex_lock(&m->gate_mu);
    pthread_cond_broadcast(&m->gate_cv);
    pthread_mutex_unlock(&m->gate_mu);
  }
}

/* A query (memory figures, processes, bus ids) ends: like call_end, but
 * it does not count as traffic a background piece waits to be quiet (a
 * monitor polling status must not hold backups off). */
static void query_end(struct vmm *m) {
  if (atomic_fetch_sub(&m->calls, 1) == 1 && atomic_load(&m->pieces_waiting) > 0) {
    pthread_mutex_lock(&m->gate_mu);
    pthread_cond_broadcast(&m->gate_cv);
    pthread_mutex_unlock(&m->gate_mu);
  }
}

/* A backup piece waits until no other driver call is in progress and,
 * in the background, none ended in the last QUIET_NS; to pin, also until
 * no other piece is being pinned, and then marks itself pinning. */
static void piece_wait(struct vmm *m, bool background, bool pin) {
  uint64_t give_up = mono_ns() + QUIET_MAX_NS;
  pthread_mutex_lock(&m->gate_mu);
  atomic_fetch_add(&m->pieces_waiting, 1);
  for (;;) {
    if (atomic_load(&m->calls) > 0 || (pin && m->piece_busy)) {
      pthread_cond_wait(&m->gate_cv, &m->gate_mu);
      continue;
    }
    uint64_t quiet = atomic_load(&m->last_end) + QUIET_NS;
    if (quiet > give_up) quiet = give_up;
    if (!background || mono_ns() >= quiet) break;
    struct timespec until = {.tv_sec = (time_t)(quiet / 1000000000ull),
                             .tv_nsec = (long)(quiet % 1000000000ull)};
    pthread_cond_timedwait(&m->gate_cv, &m->gate_mu, &until);
  }
  atomic_fetch_sub(&m->pieces_waiting, 1);
  if (pin) m->piece_busy = true;
  pthread_mutex_unlock(&m->gate_mu);
}

/* A backup piece is pinned: the next one may go. */
static void piece_end(struct vmm *m) {
  pthread_mutex_lock(&m->gate_mu);
  m->piece_busy = false;
  pthread_cond_broadcast(&m->gate_cv);
  pthread_mutex_unlock(&m->gate_mu);
}

/* Keep the fd an allocation was imported from, for as long as the handle:
 * CUDA will not export an imported handle again (CUDA_ERROR_INVALID_VALUE
 * on an H200, driver 580, also through cuMemRetainAllocationHandle), and
 * a daemon that restarted needs an fd. Holding it changes nothing about
 * when memory is freed: the handle holds the allocation just as long. */
static int kept_put(struct vmm *m, uint64_t handle, int fd) {
  pthread_mutex_lock(&m->mu);
  int rc = idmap_put(m->kept, handle, (void *)(uintptr_t)(fd + 1));
  pthread_mutex_unlock(&m->mu);
  return rc;
}

/* The fd kept for a handle (-1 if none), forgotten if take. */
static int kept_get(struct vmm *m, uint64_t handle, bool take) {
  pthread_mutex_lock(&m->mu);
  int fd = (int)(uintptr_t)idmap_get(m->kept, handle) - 1;
  if (take && fd >= 0) idmap_del(m->kept, handle);
  pthread_mutex_unlock(&m->mu);
  return fd;
}

/* Release a handle and close the fd kept with it. */
static void release_handle(struct vmm *m, uint64_t handle) {
  int fd = kept_get(m, handle, true);
  m->v->release(handle);
  if (fd >= 0) close(fd);
}

/* Import fd and keep it with the handle; the fd is consumed either way.
 * Returns the vendor's status, or -ENOMEM. */
static int import_keep(struct vmm *m, int fd, uint64_t *handle) {
  int st = m->v->import_fd(fd, handle);
  if (st != 0) {
    close(fd);
    return st;
  }
  if (kept_put(m, *handle, fd) < 0) {
    m->v->release(*handle);
    close(fd);
    return -ENOMEM;
  }
  return 0;
}

/* A new fd for a handle: a copy of the kept one where the handle was
 * imported, else the driver's export. Returns the vendor's status, or
 * -errno. */
static int export_any(struct vmm *m, uint64_t handle, int *fd) {
  int kept = kept_get(m, handle, false);
  if (kept < 0) return m->v->export_fd(handle, fd);
  if ((*fd = fcntl(kept, F_DUPFD_CLOEXEC, 0)) < 0) return -errno;
  return 0;
}

/* Turn a vendor status into -ENOMEM/-EIO, saying which call failed. */
static int fail(const struct vmm *m, int rc, const char *call) {
  return gpu_fail(rc == m->v->oom ? -ENOMEM : -EIO, "%s%s: %s", m->v->prefix, call,
                  m->v->error_name(rc));
}

/* Hold the device's primary context, counted: retained on the first hold.
 * What is current on the thread does not change. */
static int ctx_ref(struct vmm *m, int dev) {
  if (dev < 0 || dev >= m->ndev) return gpu_fail(-ENODEV, "no device %d", dev);
  pthread_mutex_lock(&m->mu);
  int rc = m->ctx_refs[dev] ? 0 : m->v->ctx_retain(dev);
  if (rc == 0) m->ctx_refs[dev]++;
  pthread_mutex_unlock(&m->mu);
  return rc ? fail(m, rc, "DevicePrimaryCtxRetain") : 0;
}

/* Let go of a hold taken with ctx_ref; the last one releases the context. */
static void ctx_unref(struct vmm *m, int dev) {
  pthread_mutex_lock(&m->mu);
  if (m->ctx_refs[dev] && --m->ctx_refs[dev] == 0) m->v->ctx_release(dev);
  pthread_mutex_unlock(&m->mu);
}

/* Make dev's held context current on this thread over the caller's, which
 * ctx_leave(saved) puts back. */
static int ctx_enter(struct vmm *m, int dev, int *saved) {
  int st = m->v->ctx_enter(dev, saved);
  return st ? fail(m, st, "CtxPushCurrent") : 0;
}

/* Put back what was current before ctx_enter. */
static void ctx_leave(struct vmm *m, int saved) { m->v->ctx_leave(saved); }

/* A client-side call begins: the process holds one context per device it
 * uses, for its life, as the application (PyTorch) does with the same
 * primary context, and it is current only until client_leave. */
static int client_enter(struct vmm *m, unsigned dev, int *saved) {
  if (dev >= (unsigned)m->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  call_begin(m);
  pthread_mutex_lock(&m->mu);
  int rc = 0;
  if (!m->client_held[dev]) {
    rc = m->ctx_refs[dev] ? 0 : m->v->ctx_retain((int)dev);
    if (rc == 0) {
      m->ctx_refs[dev]++;
      m->client_held[dev] = true;
    }
  }
  pthread_mutex_unlock(&m->mu);
  if (rc == 0) rc = ctx_enter(m, (int)dev, saved);
  else rc = fail(m, rc, "DevicePrimaryCtxRetain");
  if (rc < 0) call_end(m);
  return rc;
}

/* A client-side call ends: the caller's context is current again. */
static void client_leave(struct vmm *m, int saved) {
  ctx_leave(m, saved);
  call_end(m);
}

/* Free a backend's state (contexts already let go of). */
static void vmm_free(struct vmm *m) {
  idmap_destroy(m->kept);
  pthread_cond_destroy(&m->gate_cv);
  pthread_mutex_destroy(&m->gate_mu);
  pthread_mutex_destroy(&m->mu);
  free(m);
}

/* Load the vendor runtime and learn its devices and granularity. */
static int vmm_open(const struct gpu_ops *self, const struct gpu_options *opt, void **state,
                    char *err, size_t errlen) {
  const struct vmm_vendor *v = self->impl;
  int rc = v->load(err, errlen);
  if (rc < 0) return rc;
  struct vmm *m = calloc(1, sizeof *m);
  if (!m || !(m->kept = idmap_create())) {
    free(m);
    return -ENOMEM;
  }
  m->v = v;
  m->client = opt->client;
  pthread_mutex_init(&m->mu, NULL);
  pthread_mutex_init(&m->gate_mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&m->gate_cv, &ca);
  pthread_condattr_destroy(&ca);
  int n = 0;
  if ((rc = v->device_count(&n)) != 0 || n <= 0) {
    snprintf(err, errlen, "no %s device found%s%s", v->device_word, rc ? ": " : "",
             rc ? v->error_name(rc) : "");
    vmm_free(m);
    return -ENODEV;
  }
  m->ndev = n < GPUMEM_MAX_DEVICES ? n : GPUMEM_MAX_DEVICES;
  /* Granularity with the very properties chunks are created with; every
   * device must agree, and the coarsest wins. */
  for (int d = 0; d < m->ndev; d++) {
    uint64_t g = 0;
    if ((rc = v->granularity(d, &g)) != 0 || g == 0 || (g & (g - 1))) {
      snprintf(err, errlen, "%sMemGetAllocationGranularity on device %d: %s", v->prefix, d,
               rc ? v->error_name(rc) : "not a power of two");
      vmm_free(m);
      return -EIO;
    }
    if (g > m->granularity) m->granularity = g;
  }
  *state = m;
  return 0;
}

/* Let go of every context still held and free the state. */
static void vmm_close(void *state) {
  struct vmm *m = state;
  for (int d = 0; d < GPUMEM_MAX_DEVICES; d++)
    if (m->ctx_refs[d]) m->v->ctx_release(d);
  vmm_free(m);
}

/* Number of devices. */
static unsigned vmm_device_count(void *state) { return (unsigned)((struct vmm *)state)->ndev; }

/* The coarsest granularity of all devices. */
static uint64_t vmm_granularity(void *state) { return ((struct vmm *)state)->granularity; }

/* Turn a vendor status into 0, or -ENOMEM/-EIO saying which call failed. */
static int check(const struct vmm *m, int st, const char *call) {
  return st ? fail(m, st, call) : 0;
}

/* Free and total bytes of a device, as the vendor table reads them. */
static int vmm_mem_info(void *state, unsigned dev, uint64_t *free_bytes, uint64_t *total) {
  struct vmm *m = state;
  call_begin(m);
  int st = m->v->mem_info((int)dev, free_bytes, total);
  query_end(m);
  return check(m, st, "MemGetInfo");
}

/* The driver's figures with its reserve apart, from the management
 * library without a context; where that says nothing, mem_info's figures
 * with no reserve. */
static int vmm_mem_detail(void *state, unsigned dev, struct gpu_mem *mem) {
  struct vmm *m = state;
  if ((int)dev >= m->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  call_begin(m);
  int rc = m->v->mem_detail((int)dev, &mem->total, &mem->free, &mem->reserved);
  query_end(m);
  if (rc != -ENOTSUP) return rc;
  mem->reserved = 0;
  return vmm_mem_info(state, dev, &mem->free, &mem->total);
}

/* The driver's per-process list, this process left out: what the daemon
 * holds (its context, IPC memory) it made for itself. */
static int vmm_processes(void *state, unsigned dev, struct gpu_process *out, size_t max,
                         size_t *n) {
  struct vmm *m = state;
  if ((int)dev >= m->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  struct gpu_process *list = NULL;
  size_t count = 0;
  call_begin(m);
  int rc = m->v->processes((int)dev, &list, &count);
  query_end(m);
  if (rc < 0) return rc;
  int self = getpid();
  for (size_t i = 0; i < count; i++) {
    if (list[i].pid == self) continue;
    if (*n < max) out[*n] = list[i];
    ++*n;
  }
  free(list);
  return 0;
}

/* Import a handed-over fd and check that it is the driver's memory on dev
 * (see vmm_chunk_adopt). */
static int adopt(struct vmm *m, unsigned dev, int fd, uint64_t *handle) {
  int st = import_keep(m, fd, handle);
  if (st == -ENOMEM) return gpu_fail(-ENOMEM, "out of memory");
  if (st != 0)
    return gpu_fail(st == m->v->oom ? -ENOMEM : -EINVAL,
                    "adopting: %sMemImportFromShareableHandle: %s (not this driver's memory?)",
                    m->v->prefix, m->v->error_name(st));
  int on = -1;
  if ((st = m->v->handle_device(*handle, &on)) == 0 && on == (int)dev) return 0;
  release_handle(m, *handle);
  return st ? fail(m, st, "MemGetAllocationPropertiesFromHandle")
            : gpu_fail(-EINVAL, "adopting: memory of device %d, not %u", on, dev);
}

/* Import a handed-over fd and check what the driver can: that it is its
 * memory, on dev. The driver does not say how big an imported allocation
 * is, so size is taken on trust (a mapping past its end would fail). The
 * fd is kept with the handle, so the chunk exports like any other (CUDA
 * exports no imported handle). */
static int vmm_chunk_adopt(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  struct vmm *m = state;
  int rc = (int)dev >= m->ndev ? gpu_fail(-ENODEV, "no device %u", dev)
           : size == 0 || size % m->granularity
               ? gpu_fail(-EINVAL, "adopting: %llu bytes is not a multiple of the granularity",
                          (unsigned long long)size)
               : 0;
  if (rc < 0) {
    close(fd);
    return rc;
  }
  call_begin(m);
  rc = adopt(m, dev, fd, handle);
  call_end(m);
  return rc;
}

/* Create a physical chunk (no context needed). */
static int vmm_chunk_create(void *state, unsigned dev, uint64_t size, uint64_t *handle) {
  struct vmm *m = state;
  call_begin(m);
  int st = m->v->create((int)dev, size, handle);
  call_end(m);
  return check(m, st, "MemCreate");
}

/* Export a chunk; an adopted one by a copy of the fd it came from. */
static int vmm_chunk_export(void *state, uint64_t handle, int *fd) {
  struct vmm *m = state;
  call_begin(m);
  int st = export_any(m, handle, fd);
  call_end(m);
  if (st < 0) return gpu_fail(st, "exporting: %s", strerror(-st));
  return check(m, st, "MemExportToShareableHandle");
}

/* Release a chunk and close any fd kept with it. */
static void vmm_chunk_release(void *state, unsigned dev, uint64_t handle, uint64_t size) {
  struct vmm *m = state;
  (void)dev;
  (void)size;
  call_begin(m);
  release_handle(m, handle);
  call_end(m);
}

/* Copies go in pieces of GPU_BACKUP_PIECE from the start of the host
 * memory, round-robin over the streams, so that both directions of the
 * link and the copy engines stay busy, and so that each copy lies within
 * one pinned piece of a backup made in pieces (a range across two
 * registrations is not pinned memory to the driver). */
#define COPY_PIECE GPU_BACKUP_PIECE
#define COPY_STREAMS 4

/* Map whole chunks at one fresh range of this process. */
static int map_chunks(struct vmm *m, unsigned dev, const uint64_t *handles,
                      const uint64_t *sizes, size_t n, uint64_t total, uint64_t *va) {
  int st = m->v->reserve(total, m->granularity, va);
  if (st != 0) return fail(m, st, "MemAddressReserve");
  uint64_t off = 0;
  size_t i = 0;
  for (; i < n && st == 0; off += sizes[i++]) st = m->v->map(*va + off, sizes[i], handles[i]);
  if (st == 0 && (st = m->v->set_access(*va, total, (int)dev)) == 0) return 0;
  for (off = 0; i-- > 0;) {
    m->v->unmap(*va + off, sizes[i]);
    off += sizes[i];
  }
  m->v->address_free(*va, total);
  return fail(m, st, "MemMap/MemSetAccess");
}

/* Unmap each chunk mapped by map_chunks, then free the range. */
static void unmap_chunks(struct vmm *m, const uint64_t *sizes, size_t n, uint64_t total,
                         uint64_t va) {
  uint64_t off = 0;
  for (size_t i = 0; i < n; off += sizes[i++]) m->v->unmap(va + off, sizes[i]);
  m->v->address_free(va, total);
}

/* Copy whole chunks through a temporary mapping, overlapped on streams, in
 * the device's context (the caller's comes back after). */
static int copy_chunks(struct vmm *m, unsigned dev, const uint64_t *handles,
                       const uint64_t *sizes, size_t n, void *host, bool to_host) {
  uint64_t total = 0, va = 0;
  for (size_t i = 0; i < n; i++) total += sizes[i];
  void *streams[COPY_STREAMS] = {NULL};
  int st = 0, k = 0, rc;
  const char *call = "StreamCreate";
  if ((rc = map_chunks(m, dev, handles, sizes, n, total, &va)) < 0) return rc;
  for (; k < COPY_STREAMS && st == 0; k++) st = m->v->stream_create(&streams[k]);
  if (st != 0) {
    k--;
    goto done;
  }
  call = to_host ? "MemcpyDtoHAsync" : "MemcpyHtoDAsync";
  for (uint64_t off = 0, i = 0; off < total && st == 0; off += COPY_PIECE, i++) {
    uint64_t len = total - off < COPY_PIECE ? total - off : COPY_PIECE;
    void *s = streams[i % COPY_STREAMS];
    st = to_host ? m->v->dtoh_async((char *)host + off, va + off, len, s)
                 : m->v->htod_async(va + off, (char *)host + off, len, s);
  }
  for (int j = 0; j < k; j++) {
    int sync = m->v->stream_sync(streams[j]);
    if (st == 0 && sync != 0) {
      st = sync;
      call = "StreamSynchronize";
    }
  }
done:
  for (int j = 0; j < k; j++) m->v->stream_destroy(streams[j]);
  unmap_chunks(m, sizes, n, total, va);
  return check(m, st, call);
}

/* Copy whole chunks to or from host memory in the device's context. */
static int vmm_chunks_copy(void *state, unsigned dev, const uint64_t *handles,
                           const uint64_t *sizes, size_t n, void *host, bool to_host) {
  struct vmm *m = state;
  int saved = 0;
  call_begin(m);
  int rc = ctx_ref(m, (int)dev);
  if (rc == 0) {
    if ((rc = ctx_enter(m, (int)dev, &saved)) == 0) {
      rc = copy_chunks(m, dev, handles, sizes, n, host, to_host);
      ctx_leave(m, saved);
    }
    ctx_unref(m, (int)dev);
  }
  call_end(m);
  return rc;
}

/* Backup ranges start at a multiple of this, so that huge pages fit. */
#define HUGE_PAGE (2ull << 20)

/* Private anonymous memory of size bytes starting at a multiple of
 * HUGE_PAGE, asking for transparent huge pages: on an H200 host they made
 * faulting in 1.7 times and pinning 1.8 times faster (same copy speed). */
static void *map_backup(uint64_t size) {
  uint64_t len = size + HUGE_PAGE;
  char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return NULL;
  char *at = (char *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
  if (at > p) munmap(p, (size_t)(at - p));
  if (at + size < p + len) munmap(at + size, (size_t)(p + len - (at + size)));
  madvise(at, size, MADV_HUGEPAGE); /* a hint: without THP, small pages */
  return at;
}

/* A backup's address range, its pieces made by vmm_backup_make; pinned
 * memory lives in the device's context, held until the release. */
static int vmm_backup_reserve(void *state, unsigned dev, uint64_t size, void **host) {
  struct vmm *m = state;
  call_begin(m);
  int rc = ctx_ref(m, (int)dev);
  call_end(m);
  if (rc < 0) return rc;
  void *p = map_backup(size);
  if (!p) {
    rc = gpu_fail(-ENOMEM, "backup of %llu bytes: %s", (unsigned long long)size,
                  strerror(errno));
    call_begin(m);
    ctx_unref(m, (int)dev);
    call_end(m);
    return rc;
  }
  *host = p;
  return 0;
}

/* One piece: faulted in and written without the driver, then pinned
 * through the gate (see the top of this file); in the background only
 * once the process's other driver calls have been quiet a moment (a
 * burst of allocations is left alone: its client's map and set-access
 * calls are in another process, where the gate cannot see them). */
static int vmm_backup_make(void *state, unsigned dev, void *host, uint64_t size, uint64_t off,
                           bool background) {
  struct vmm *m = state;
  char *p = (char *)host + off;
  uint64_t len = gpu_piece_len(size, off);
  int saved = 0, st = 0, rc;
  if (background) piece_wait(m, true, false);
  if ((rc = gpu_populate(p, len)) < 0) return rc;
  piece_wait(m, background, true);
  if ((rc = ctx_enter(m, (int)dev, &saved)) == 0) {
    st = m->v->host_register(p, len);
    ctx_leave(m, saved);
  }
  piece_end(m);
  return rc < 0 ? rc : check(m, st, "MemHostRegister");
}

/* Unpin the made pieces, let go of the context and unmap. */
static void vmm_backup_release(void *state, unsigned dev, void *host, uint64_t size,
                               uint64_t made) {
  struct vmm *m = state;
  int saved = 0;
  call_begin(m);
  if (made && ctx_enter(m, (int)dev, &saved) == 0) {
    for (uint64_t off = 0; off < made; off += GPU_BACKUP_PIECE)
      m->v->host_unregister((char *)host + off);
    ctx_leave(m, saved);
  }
  ctx_unref(m, (int)dev);
  call_end(m);
  munmap(host, size);
}

/* One pinned allocation, in the device's context, held while it lives. */
static int vmm_backup_alloc(void *state, unsigned dev, uint64_t size, void **host) {
  struct vmm *m = state;
  int saved = 0, st = 0;
  call_begin(m);
  int rc = ctx_ref(m, (int)dev);
  if (rc == 0) {
    if ((rc = ctx_enter(m, (int)dev, &saved)) == 0) {
      st = m->v->host_alloc(host, size);
      ctx_leave(m, saved);
      rc = check(m, st, "MemHostAlloc");
    }
    if (rc < 0) ctx_unref(m, (int)dev);
  }
  call_end(m);
  return rc;
}

/* Free memory from vmm_backup_alloc and let go of its context. */
static void vmm_backup_free(void *state, unsigned dev, void *host, uint64_t size) {
  struct vmm *m = state;
  int saved = 0;
  (void)size;
  call_begin(m);
  if (ctx_enter(m, (int)dev, &saved) == 0) {
    m->v->host_free(host);
    ctx_leave(m, saved);
  }
  ctx_unref(m, (int)dev);
  call_end(m);
}

/* Hold the device's primary context (backups need it). */
static int vmm_hold(void *state, unsigned dev) {
  struct vmm *m = state;
  call_begin(m);
  int rc = ctx_ref(m, (int)dev);
  call_end(m);
  return rc;
}

/* Let go of a vmm_hold. */
static void vmm_unhold(void *state, unsigned dev) {
  struct vmm *m = state;
  call_begin(m);
  ctx_unref(m, (int)dev);
  call_end(m);
}

/* True while this process holds the device's context. */
static bool vmm_holding(void *state, unsigned dev) {
  struct vmm *m = state;
  pthread_mutex_lock(&m->mu);
  bool held = dev < GPUMEM_MAX_DEVICES && m->ctx_refs[dev] > 0;
  pthread_mutex_unlock(&m->mu);
  return held;
}

/* The device's PCI bus id. */
static int vmm_bus_id(void *state, unsigned dev, char *buf, size_t len) {
  struct vmm *m = state;
  call_begin(m);
  int st = m->v->bus_id((int)dev, buf, (int)len);
  query_end(m);
  return check(m, st, "DeviceGetPCIBusId");
}

/* This process's device number for a PCI bus id. */
static int vmm_device_by_bus_id(void *state, const char *bus_id) {
  struct vmm *m = state;
  int dev;
  call_begin(m);
  int st = m->v->device_by_bus_id(bus_id, &dev);
  query_end(m);
  return st != 0 ? -ENODEV : dev;
}

/* Reserve an address range for mappings. */
static int vmm_va_reserve(void *state, unsigned dev, uint64_t size, void **va) {
  struct vmm *m = state;
  int saved, rc = client_enter(m, dev, &saved);
  if (rc < 0) return rc;
  uint64_t p = 0;
  int st = m->v->reserve(size, m->granularity, &p);
  client_leave(m, saved);
  if (st != 0) return fail(m, st, "MemAddressReserve");
  *va = (void *)(uintptr_t)p;
  return 0;
}

/* Free a reserved address range. */
static void vmm_va_free(void *state, unsigned dev, void *va, uint64_t size) {
  struct vmm *m = state;
  int saved;
  if (client_enter(m, dev, &saved) < 0) return;
  m->v->address_free((uint64_t)(uintptr_t)va, size);
  client_leave(m, saved);
}

/* Import consumes the fd: the imported handle keeps the memory alive, and
 * the fd is kept with it until gpu_release, to export again. */
static int vmm_import(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  struct vmm *m = state;
  (void)size;
  int saved, rc = client_enter(m, dev, &saved);
  if (rc < 0) {
    close(fd);
    return rc;
  }
  int st = import_keep(m, fd, handle);
  client_leave(m, saved);
  if (st == -ENOMEM) return gpu_fail(-ENOMEM, "out of memory");
  return check(m, st, "MemImportFromShareableHandle");
}

/* An imported handle again as a new fd, for a daemon that restarted: a
 * copy of the fd it was imported from (see kept_put). */
static int vmm_export_handle(void *state, unsigned dev, uint64_t handle, int *fd) {
  (void)dev;
  return vmm_chunk_export(state, handle, fd);
}

/* Map an imported handle at va. */
static int vmm_map(void *state, unsigned dev, void *va, uint64_t size, uint64_t handle) {
  struct vmm *m = state;
  int saved, rc = client_enter(m, dev, &saved);
  if (rc < 0) return rc;
  int st = m->v->map((uint64_t)(uintptr_t)va, size, handle);
  client_leave(m, saved);
  return check(m, st, "MemMap");
}

/* Allow read/write access from dev to a mapped range. */
static int vmm_set_access(void *state, unsigned dev, void *va, uint64_t size) {
  struct vmm *m = state;
  int saved, rc = client_enter(m, dev, &saved);
  if (rc < 0) return rc;
  int st = m->v->set_access((uint64_t)(uintptr_t)va, size, (int)dev);
  client_leave(m, saved);
  return check(m, st, "MemSetAccess");
}

/* Unmap one mapping, keeping the range reserved. */
static int vmm_unmap(void *state, unsigned dev, void *va, uint64_t size) {
  struct vmm *m = state;
  int saved, rc = client_enter(m, dev, &saved);
  if (rc < 0) return rc;
  int st = m->v->unmap((uint64_t)(uintptr_t)va, size);
  client_leave(m, saved);
  return check(m, st, "MemUnmap");
}

/* Release an imported handle and close the fd kept with it. */
static void vmm_release(void *state, unsigned dev, uint64_t handle) {
  struct vmm *m = state;
  (void)dev;
  call_begin(m);
  release_handle(m, handle);
  call_end(m);
}

/* Wait for the device's work (its primary context). */
static int vmm_sync(void *state, unsigned dev) {
  struct vmm *m = state;
  int saved, rc = client_enter(m, dev, &saved);
  if (rc < 0) return rc;
  int st = m->v->sync();
  client_leave(m, saved);
  return check(m, st, "CtxSynchronize");
}

/* Copy device memory to host memory. */
static int vmm_copy_from(void *state, unsigned dev, void *dst, const void *va, uint64_t len) {
  struct vmm *m = state;
  int saved, rc = client_enter(m, dev, &saved);
  if (rc < 0) return rc;
  int st = m->v->dtoh(dst, (uint64_t)(uintptr_t)va, len);
  client_leave(m, saved);
  return check(m, st, "MemcpyDtoH");
}

/* Copy host memory to device memory. */
static int vmm_copy_to(void *state, unsigned dev, void *va, const void *src, uint64_t len) {
  struct vmm *m = state;
  int saved, rc = client_enter(m, dev, &saved);
  if (rc < 0) return rc;
  int st = m->v->htod((uint64_t)(uintptr_t)va, src, len);
  client_leave(m, saved);
  return check(m, st, "MemcpyHtoD");
}

/* Fill device memory with a 32-bit value and wait for it. */
static int vmm_fill32(void *state, unsigned dev, void *va, uint64_t len, uint32_t value) {
  struct vmm *m = state;
  int saved, rc = client_enter(m, dev, &saved);
  if (rc < 0) return rc;
  const char *call = "MemsetD32";
  int st = m->v->memset32((uint64_t)(uintptr_t)va, value, len / 4);
  if (st == 0) {
    call = "CtxSynchronize";
    st = m->v->sync();
  }
  client_leave(m, saved);
  return check(m, st, call);
}

/* Legacy IPC memory lives in a context the daemon holds while it exists. */
static int vmm_ipc_alloc(void *state, unsigned dev, uint64_t size, uint64_t *dptr,
                         uint8_t *handle) {
  struct vmm *m = state;
  int saved = 0, st = 0;
  call_begin(m);
  int rc = ctx_ref(m, (int)dev);
  if (rc == 0) {
    if ((rc = ctx_enter(m, (int)dev, &saved)) == 0) {
      st = m->v->ipc_alloc(size, dptr, handle);
      ctx_leave(m, saved);
      rc = check(m, st, "MemAlloc/IpcGetMemHandle");
    }
    if (rc < 0) ctx_unref(m, (int)dev);
  }
  call_end(m);
  return rc;
}

/* Free legacy IPC memory and let go of its context. */
static void vmm_ipc_free(void *state, unsigned dev, uint64_t dptr, uint64_t size) {
  struct vmm *m = state;
  int saved = 0;
  (void)size;
  call_begin(m);
  if (ctx_enter(m, (int)dev, &saved) == 0) {
    m->v->ipc_free(dptr);
    ctx_leave(m, saved);
  }
  ctx_unref(m, (int)dev);
  call_end(m);
}

/* Open a legacy IPC handle. */
static int vmm_ipc_open(void *state, unsigned dev, const uint8_t *handle, void **va) {
  struct vmm *m = state;
  int saved, rc = client_enter(m, dev, &saved);
  if (rc < 0) return rc;
  uint64_t p = 0;
  int st = m->v->ipc_open(handle, &p);
  client_leave(m, saved);
  if (st != 0) return fail(m, st, "IpcOpenMemHandle");
  *va = (void *)(uintptr_t)p;
  return 0;
}

/* Close memory opened with vmm_ipc_open. */
static void vmm_ipc_close(void *state, unsigned dev, void *va) {
  struct vmm *m = state;
  int saved;
  if (client_enter(m, dev, &saved) < 0) return;
  m->v->ipc_close((uint64_t)(uintptr_t)va);
  client_leave(m, saved);
}

#define VMM_OPS(vendor)                                                              \
  {                                                                                  \
    .name = #vendor, .built_with = vmm_##vendor##_headers, .impl = &vmm_##vendor, .open = vmm_open, .close = vmm_close,    \
    .device_count = vmm_device_count, .granularity = vmm_granularity,                \
    .mem_info = vmm_mem_info, .mem_detail = vmm_mem_detail,                          \
    .processes = vmm_processes, .chunk_adopt = vmm_chunk_adopt,                      \
    .export_handle = vmm_export_handle, .chunk_create = vmm_chunk_create,            \
    .chunk_export = vmm_chunk_export, .chunk_release = vmm_chunk_release,            \
    .chunks_copy = vmm_chunks_copy, .backup_reserve = vmm_backup_reserve,            \
    .backup_make = vmm_backup_make, .backup_release = vmm_backup_release,            \
    .backup_alloc = vmm_backup_alloc,                                                \
    .backup_free = vmm_backup_free, .hold = vmm_hold, .unhold = vmm_unhold,          \
    .holding = vmm_holding,                                                          \
    .bus_id = vmm_bus_id, .device_by_bus_id = vmm_device_by_bus_id,                  \
    .va_reserve = vmm_va_reserve, .va_free = vmm_va_free, .import = vmm_import,      \
    .map = vmm_map, .set_access = vmm_set_access, .unmap = vmm_unmap,                \
    .release = vmm_release, .sync = vmm_sync, .copy_from = vmm_copy_from,            \
    .copy_to = vmm_copy_to, .fill32 = vmm_fill32, .ipc_alloc = vmm_ipc_alloc,        \
    .ipc_free = vmm_ipc_free, .ipc_open = vmm_ipc_open, .ipc_close = vmm_ipc_close,  \
  }

#ifdef HAVE_CUDA
const struct gpu_ops gpu_cuda_ops = VMM_OPS(cuda);
#endif
#ifdef HAVE_HIP
const struct gpu_ops gpu_hip_ops = VMM_OPS(hip);
#endif
