/* The VMM backends' backups: copies between chunks and host memory, and
 * the host memory they go to.
 *
 * Backup host memory is pinned a piece at a time (gpudev_backup_make):
 * pinning holds a driver-wide lock for as long as it runs (cuMemHostAlloc
 * of 1 GiB about 450-570 ms on an H200, most of it faulting the pages in),
 * and every other driver call of the process waits for it. Made in the
 * background for a fresh BACKUP buffer in one call, it stalled the
 * daemon's next allocations by that much each (16 buffers of 1 GiB took
 * 7.2 s to allocate instead of tens of ms). So the memory is faulted in
 * without the driver (gpu_populate, in small steps), and then pinned per
 * GPUDEV_BACKUP_PIECE by cuMemHostRegister, which on an H200 holds the
 * lock for 1.3-2.2 ms per 64 MiB of memory already faulted in; a gate
 * (gpu/vmm_gate.h) makes each piece wait while any other driver call of
 * the process is in progress, and lets one piece be pinned at a time, so
 * that a call of the daemon's loop waits for at most the one piece being
 * pinned. Copies then go per piece, each within one pinned registration
 * (no loss measured: 55 GB/s each way in 64 MiB copies, as from
 * cuMemHostAlloc memory).
 *
 * Where the vendor has host memory that lives apart from any context
 * (CUDA's host-NUMA allocations, gpu/vmm_dev.h), backups are made of it
 * instead, one allocation per piece (GPUDEV_BACKUP_PIECE, or a multiple
 * of it for a large backup: HOST_MAX_PIECES), made and mapped for the
 * host only, without a context, and exportable: the buffer's owner is
 * handed the pieces (vmm_backup_export) and copies with its own context,
 * and the daemon copies (letting the device in, holding a context while
 * the copy runs) only for an owner that cannot (measured on an H200:
 * made, mapped and written with no context, NVML listing no process; a
 * mapping that outlives the context; copies at 19.5 ms per GiB each way,
 * as from cuMemHostAlloc memory). */
#include "vmm_backup.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "error.h"
#include "gpudev_ops.h"
#include "populate.h"
#include "vmm_dev.h"

/* Copies go in pieces of GPUDEV_BACKUP_PIECE from the start of the host
 * memory, round-robin over the streams, so that both directions of the
 * link and the copy engines stay busy, and so that each copy lies within
 * one pinned piece of a backup made in pieces (a range across two
 * registrations is not pinned memory to the driver). */
#define COPY_PIECE GPUDEV_BACKUP_PIECE
#define COPY_STREAMS 4

/* Map whole chunks at one fresh range of this process. */
static int map_chunks(struct vmm *m, unsigned dev, const uint64_t *handles,
                      const uint64_t *sizes, size_t n, uint64_t total, uint64_t *va) {
  int st = m->v->reserve(total, m->granularity, va);
  if (st != 0) return vmm_fail(m, st, "MemAddressReserve");
  uint64_t off = 0;
  size_t mapped = 0; /* the chunks mapped, each at its own offset */
  for (; mapped < n; off += sizes[mapped++])
    if ((st = m->v->map(*va + off, sizes[mapped], handles[mapped])) != 0) break;
  if (st == 0 && (st = m->v->set_access(*va, total, (int)dev)) == 0) return 0;
  off = 0;
  for (size_t i = 0; i < mapped; off += sizes[i++]) m->v->unmap(*va + off, sizes[i]);
  m->v->address_free(*va, total);
  return vmm_fail(m, st, "MemMap/MemSetAccess");
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
static int copy_chunks(struct vmm_dev *x, unsigned dev, const uint64_t *handles,
                       const uint64_t *sizes, size_t n, void *host, bool to_host) {
  struct vmm *m = &x->m;
  uint64_t total = 0, va = 0;
  for (size_t i = 0; i < n; i++) total += sizes[i];
  void *streams[COPY_STREAMS] = {NULL};
  int st = 0, k = 0, rc;
  const char *call = "StreamCreate";
  if ((rc = map_chunks(m, dev, handles, sizes, n, total, &va)) < 0) return rc;
  for (; k < COPY_STREAMS && st == 0; k++) st = x->v->stream_create(&streams[k]);
  if (st != 0) {
    k--;
    goto done;
  }
  call = to_host ? "MemcpyDtoHAsync" : "MemcpyHtoDAsync";
  for (uint64_t off = 0, i = 0; off < total && st == 0; off += COPY_PIECE, i++) {
    uint64_t len = total - off < COPY_PIECE ? total - off : COPY_PIECE;
    void *s = streams[i % COPY_STREAMS];
    st = to_host ? x->v->dtoh_async((char *)host + off, va + off, len, s)
                 : x->v->htod_async(va + off, (char *)host + off, len, s);
  }
  for (int j = 0; j < k; j++) {
    int sync = x->v->stream_sync(streams[j]);
    if (st == 0 && sync != 0) {
      st = sync;
      call = "StreamSynchronize";
    }
  }
done:
  for (int j = 0; j < k; j++) x->v->stream_destroy(streams[j]);
  unmap_chunks(m, sizes, n, total, va);
  return vmm_check(m, st, call);
}

/* Under the gate, hold dev's context and make it current. */
int vmm_held_begin(struct vmm_dev *x, unsigned dev, int *saved) {
  struct vmm *m = &x->m;
  vmm_gate_begin(&x->gate);
  int rc = vmm_ctx_ref(m, (int)dev);
  if (rc == 0 && (rc = vmm_ctx_enter(m, (int)dev, saved)) < 0) vmm_ctx_unref(m, (int)dev);
  if (rc < 0) vmm_gate_end(&x->gate);
  return rc;
}

/* Put the caller's context back, keep the hold only on success, leave the
 * gate. */
int vmm_held_end(struct vmm_dev *x, unsigned dev, int saved, int st, const char *call) {
  struct vmm *m = &x->m;
  vmm_ctx_leave(m, saved);
  int rc = vmm_check(m, st, call);
  if (rc < 0) vmm_ctx_unref(m, (int)dev);
  vmm_gate_end(&x->gate);
  return rc;
}

/* Under the gate, make dev's held context current if it can be. */
bool vmm_drop_begin(struct vmm_dev *x, unsigned dev, int *saved) {
  vmm_gate_begin(&x->gate);
  return vmm_ctx_enter(&x->m, (int)dev, saved) == 0;
}

/* Put the caller's context back, let go of the hold, leave the gate. */
void vmm_drop_end(struct vmm_dev *x, unsigned dev, int saved, bool entered) {
  if (entered) vmm_ctx_leave(&x->m, saved);
  vmm_ctx_unref(&x->m, (int)dev);
  vmm_gate_end(&x->gate);
}


/* A host-NUMA backup has at most this many pieces, each one fd when
 * handed to its owner, so that a Remap of a buffer of up to 125 chunks
 * carries its chunks and its pieces in one frame (FRAME_MAX_FDS): up to
 * 8 GiB a piece is GPUDEV_BACKUP_PIECE, larger backups have pieces of a
 * multiple of it (16 GiB: 128 MiB). Making a piece holds the gate for as
 * long as the driver takes (289 ms per GiB on an H200). */
#define HOST_MAX_PIECES 128

/* A backup in host memory that lives apart from any context: its range
 * (the size rounded up to the granularity) and one allocation per piece
 * made so far (0: not yet). */
struct vmm_host_backup {
  uint64_t va, span;
  uint64_t piece; /* bytes of every piece but the last */
  unsigned dev;
  bool device; /* dev may reach every piece (under the gate) */
  size_t npieces;
  uint64_t handles[];
};

/* The host-NUMA backup at host, or NULL (a backup of the pinned kind). */
static struct vmm_host_backup *host_backup(struct vmm_dev *x, const void *host) {
  pthread_mutex_lock(&x->m.mu);
  struct vmm_host_backup *b = idmap_get(x->backups, (uint64_t)(uintptr_t)host);
  pthread_mutex_unlock(&x->m.mu);
  return b;
}

/* Bytes of piece i of a host-NUMA backup. */
static uint64_t host_piece_len(const struct vmm_host_backup *b, size_t i) {
  uint64_t off = (uint64_t)i * b->piece;
  return b->span - off < b->piece ? b->span - off : b->piece;
}

/* Reserve a host-NUMA backup's range: no context, no memory yet. */
static int host_reserve(struct vmm_dev *x, unsigned dev, uint64_t size, void **host) {
  struct vmm *m = &x->m;
  uint64_t g = x->host_gran[dev], span = (size + g - 1) / g * g;
  uint64_t steps = (span + GPUDEV_BACKUP_PIECE - 1) / GPUDEV_BACKUP_PIECE;
  uint64_t piece = GPUDEV_BACKUP_PIECE * ((steps + HOST_MAX_PIECES - 1) / HOST_MAX_PIECES);
  size_t n = (size_t)((span + piece - 1) / piece);
  struct vmm_host_backup *b = calloc(1, sizeof *b + n * sizeof b->handles[0]);
  if (!b) return gpu_fail(-ENOMEM, "out of memory");
  b->span = span;
  b->piece = piece;
  b->dev = dev;
  b->device = false; /* until a copy of the daemon's needs it */
  b->npieces = n;
  vmm_gate_begin(&x->gate);
  int st = m->v->reserve(span, g, &b->va);
  vmm_gate_end(&x->gate);
  int rc = vmm_check(m, st, "MemAddressReserve");
  pthread_mutex_lock(&m->mu);
  if (rc == 0 && idmap_put(x->backups, b->va, b) < 0) rc = gpu_fail(-ENOMEM, "out of memory");
  pthread_mutex_unlock(&m->mu);
  if (rc < 0) {
    if (st == 0) m->v->address_free(b->va, span);
    free(b);
    return rc;
  }
  *host = (void *)(uintptr_t)b->va;
  return 0;
}

/* Make piece i of a host-NUMA backup (once): an allocation mapped in its
 * place for the host (and the device, while the daemon's copies have let
 * it in), through the gate like a pinned piece. */
static int host_make(struct vmm_dev *x, struct vmm_host_backup *b, size_t i, bool background) {
  struct vmm *m = &x->m;
  uint64_t off = (uint64_t)i * b->piece, len = host_piece_len(b, i), h = 0;
  if (i >= b->npieces || b->handles[i]) return 0;
  if (background) vmm_gate_wait_piece(&x->gate, true, false);
  vmm_gate_wait_piece(&x->gate, background, true);
  const char *call = "MemCreate";
  int st = x->v->host_create((int)b->dev, len, &h);
  if (st == 0 && (call = "MemMap", st = m->v->map(b->va + off, len, h)) != 0) m->v->release(h);
  if (st == 0 &&
      (call = "MemSetAccess", st = x->v->host_access(b->va + off, len, (int)b->dev, b->device))) {
    m->v->unmap(b->va + off, len);
    m->v->release(h);
  }
  vmm_gate_end_piece(&x->gate);
  if (st == 0) b->handles[i] = h;
  return vmm_check(m, st, call);
}

/* Unmap and release a host-NUMA backup's pieces, free its range. */
static void host_release(struct vmm_dev *x, struct vmm_host_backup *b) {
  struct vmm *m = &x->m;
  pthread_mutex_lock(&m->mu);
  idmap_del(x->backups, b->va);
  pthread_mutex_unlock(&m->mu);
  vmm_gate_begin(&x->gate);
  for (size_t i = 0; i < b->npieces; i++) {
    if (!b->handles[i]) continue;
    m->v->unmap(b->va + (uint64_t)i * b->piece, host_piece_len(b, i));
    m->v->release(b->handles[i]);
  }
  m->v->address_free(b->va, b->span);
  vmm_gate_end(&x->gate);
  free(b);
}

/* Let dev in to (device true) or out of every piece of host-NUMA backup
 * b that overlaps [host, host + len), under the gate. */
static int host_device_access(struct vmm_dev *x, struct vmm_host_backup *b, const void *host,
                              uint64_t len, bool device) {
  uint64_t from = (uint64_t)(uintptr_t)host - b->va, to = from + len;
  for (size_t i = 0; i < b->npieces; i++) {
    uint64_t off = (uint64_t)i * b->piece, plen = host_piece_len(b, i);
    if (!b->handles[i] || off >= to || off + plen <= from) continue;
    int st = x->v->host_access(b->va + off, plen, (int)b->dev, device);
    if (st) return vmm_check(&x->m, st, "MemSetAccess");
  }
  return 0;
}

/* Copy whole chunks to or from host memory in the device's context (a
 * host-NUMA backup lets the device in again if it was kept out). */
int vmm_backup_copy(void *state, unsigned dev, const uint64_t *handles, const uint64_t *sizes,
                    size_t n, void *host, bool to_host) {
  struct vmm_dev *x = state;
  struct vmm_host_backup *b = host_backup(x, host);
  int saved = 0;
  int rc = vmm_held_begin(x, dev, &saved);
  if (rc < 0) return rc;
  if (b && !b->device && (rc = host_device_access(x, b, host, b->span, true)) == 0)
    b->device = true;
  if (rc == 0) rc = copy_chunks(x, dev, handles, sizes, n, host, to_host);
  vmm_drop_end(x, dev, saved, true);
  return rc;
}

/* Keep the device out of a host-NUMA backup until its next copy. */
void vmm_backup_host_only(void *state, unsigned dev, void *host) {
  struct vmm_dev *x = state;
  struct vmm_host_backup *b = host_backup(x, host);
  (void)dev;
  if (!b) return;
  vmm_gate_begin(&x->gate);
  /* Pieces taken away before a failure are given back at the next copy. */
  if (b->device) {
    b->device = false;
    host_device_access(x, b, host, b->span, false);
  }
  vmm_gate_end(&x->gate);
}

/* Export every piece of a host-NUMA backup, all made, for its owner. */
int vmm_backup_export(void *state, unsigned dev, void *host, uint64_t size, int *fds,
                      uint64_t *sizes, size_t max, size_t *n) {
  struct vmm_dev *x = state;
  struct vmm_host_backup *b = host_backup(x, host);
  (void)dev;
  *n = 0;
  if (!b) return gpu_fail(-ENOTSUP, "pinned backups cannot be handed out");
  if (b->npieces > max)
    return gpu_fail(-E2BIG, "a backup of %llu bytes is %zu pieces, more than %zu",
                    (unsigned long long)size, b->npieces, max);
  for (size_t i = 0; i < b->npieces; i++)
    if (!b->handles[i]) return gpu_fail(-EAGAIN, "backup piece %zu is not made yet", i);
  int st = 0;
  vmm_gate_begin(&x->gate);
  for (; *n < b->npieces && st == 0; (*n)++) {
    sizes[*n] = host_piece_len(b, *n);
    if ((st = x->v->export_fd(b->handles[*n], &fds[*n])) != 0) break;
  }
  vmm_gate_end(&x->gate);
  if (st == 0) return 0;
  while (*n > 0) close(fds[--*n]);
  return vmm_check(&x->m, st, "MemExportToShareableHandle");
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
int vmm_backup_reserve(void *state, unsigned dev, uint64_t size, void **host) {
  struct vmm_dev *x = state;
  struct vmm *m = &x->m;
  if (dev < GPUMEM_MAX_DEVICES && x->host_gran[dev]) return host_reserve(x, dev, size, host);
  vmm_gate_begin(&x->gate);
  int rc = vmm_ctx_ref(m, (int)dev);
  vmm_gate_end(&x->gate);
  if (rc < 0) return rc;
  void *p = map_backup(size);
  if (!p) {
    rc = gpu_fail(-ENOMEM, "backup of %llu bytes: %s", (unsigned long long)size,
                  strerror(errno));
    vmm_gate_begin(&x->gate);
    vmm_ctx_unref(m, (int)dev);
    vmm_gate_end(&x->gate);
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
int vmm_backup_make(void *state, unsigned dev, void *host, uint64_t size, uint64_t off,
                    bool background) {
  struct vmm_dev *x = state;
  struct vmm *m = &x->m;
  struct vmm_host_backup *b = host_backup(x, host);
  if (b) return host_make(x, b, (size_t)(off / b->piece), background);
  char *p = (char *)host + off;
  uint64_t len = gpudev_piece_len(size, off);
  int saved = 0, st = 0, rc;
  if (background) vmm_gate_wait_piece(&x->gate, true, false);
  if ((rc = gpu_populate(p, len)) < 0) return rc;
  vmm_gate_wait_piece(&x->gate, background, true);
  if ((rc = vmm_ctx_enter(m, (int)dev, &saved)) == 0) {
    st = x->v->host_register(p, len);
    vmm_ctx_leave(m, saved);
  }
  vmm_gate_end_piece(&x->gate);
  return rc < 0 ? rc : vmm_check(m, st, "MemHostRegister");
}

/* Unpin the made pieces, let go of the context and unmap. */
void vmm_backup_release(void *state, unsigned dev, void *host, uint64_t size, uint64_t made) {
  struct vmm_dev *x = state;
  struct vmm *m = &x->m;
  struct vmm_host_backup *b = host_backup(x, host);
  if (b) {
    host_release(x, b);
    return;
  }
  int saved = 0;
  vmm_gate_begin(&x->gate);
  if (made && vmm_ctx_enter(m, (int)dev, &saved) == 0) {
    for (uint64_t off = 0; off < made; off += GPUDEV_BACKUP_PIECE)
      x->v->host_unregister((char *)host + off);
    vmm_ctx_leave(m, saved);
  }
  vmm_ctx_unref(m, (int)dev);
  vmm_gate_end(&x->gate);
  munmap(host, size);
}

/* One pinned allocation, in the device's context, held while it lives. */
int vmm_backup_alloc(void *state, unsigned dev, uint64_t size, void **host) {
  int saved = 0, rc = vmm_held_begin(state, dev, &saved);
  if (rc < 0) return rc;
  int st = ((struct vmm_dev *)state)->v->host_alloc(host, size);
  return vmm_held_end(state, dev, saved, st, "MemHostAlloc");
}

/* Free memory from vmm_backup_alloc and let go of its context. */
void vmm_backup_free(void *state, unsigned dev, void *host, uint64_t size) {
  int saved = 0;
  (void)size;
  bool entered = vmm_drop_begin(state, dev, &saved);
  if (entered) ((struct vmm_dev *)state)->v->host_free(host);
  vmm_drop_end(state, dev, saved, entered);
}

