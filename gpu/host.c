/* The host backend: Linux shared memory behaving like GPU VMM.
 *
 * A chunk is a memfd whose pages are committed with fallocate, so that the
 * memory is really used (Shmem in /proc/meminfo) and really returned when
 * the daemon and every importer have unmapped and closed it. Devices are
 * simulated: each has a fixed capacity that chunk creation enforces. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif
#include <unistd.h>

#include "backend.h"

#define HOST_DEFAULT_GRANULARITY (2ull << 20)
#define HOST_MAX_DEVICES 64

struct host {
  unsigned ndev;
  uint64_t granularity;
  uint64_t capacity;
  uint64_t committed[HOST_MAX_DEVICES];
};

static int host_open(const struct gpu_ops *self, const struct gpu_options *opt, void **state,
                     char *err, size_t errlen) {
  (void)self;
  struct host *h = calloc(1, sizeof *h);
  if (!h) return -ENOMEM;
  if (!opt->client) {
    if (opt->host_devices == 0 || opt->host_devices > HOST_MAX_DEVICES) {
      snprintf(err, errlen, "host devices must be 1..%d", HOST_MAX_DEVICES);
      free(h);
      return -EINVAL;
    }
    uint64_t gran = opt->host_granularity ? opt->host_granularity : HOST_DEFAULT_GRANULARITY;
    if (gran < (uint64_t)sysconf(_SC_PAGESIZE) || (gran & (gran - 1))) {
      snprintf(err, errlen, "host granularity must be a power of two of at least a page");
      free(h);
      return -EINVAL;
    }
    if (opt->host_device_size < gran || opt->host_device_size % gran) {
      snprintf(err, errlen, "host device size must be a multiple of the granularity (%llu)",
               (unsigned long long)gran);
      free(h);
      return -EINVAL;
    }
    h->granularity = gran;
    h->ndev = opt->host_devices;
    h->capacity = opt->host_device_size;
  }
  *state = h;
  return 0;
}

static void host_close(void *state) { free(state); }

static unsigned host_device_count(void *state) {
  return ((struct host *)state)->ndev;
}

static uint64_t host_granularity(void *state) { return ((struct host *)state)->granularity; }

static int host_mem_info(void *state, unsigned dev, uint64_t *free_bytes,
                         uint64_t *total) {
  struct host *h = state;
  if (dev >= h->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  *total = h->capacity;
  *free_bytes = h->capacity - h->committed[dev];
  return 0;
}

/* A committed memfd; the model of a physical allocation. */
static int host_chunk_create(void *state, unsigned dev, uint64_t size,
                             uint64_t *handle) {
  struct host *h = state;
  if (dev >= h->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  if (size > h->capacity - h->committed[dev])
    return gpu_fail(-ENOMEM, "device %u: %llu bytes free, %llu asked", dev,
                    (unsigned long long)(h->capacity - h->committed[dev]),
                    (unsigned long long)size);
  char name[32];
  snprintf(name, sizeof name, "gpumem-dev%u", dev);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return gpu_fail(-errno, "memfd_create: %s", strerror(errno));
  if (ftruncate(fd, (off_t)size) < 0 || fallocate(fd, 0, 0, (off_t)size) < 0) {
    int e = errno;
    close(fd);
    return gpu_fail(e == ENOSPC ? -ENOMEM : -e, "committing %llu bytes: %s",
                    (unsigned long long)size, strerror(e));
  }
  h->committed[dev] += size;
  *handle = (uint64_t)fd;
  return 0;
}

static int host_chunk_export(void *state, uint64_t handle, int *fd) {
  (void)state;
  int d = fcntl((int)handle, F_DUPFD_CLOEXEC, 0);
  if (d < 0) return gpu_fail(-errno, "dup: %s", strerror(errno));
  *fd = d;
  return 0;
}

static void host_chunk_release(void *state, unsigned dev, uint64_t handle,
                               uint64_t size) {
  struct host *h = state;
  close((int)handle);
  h->committed[dev] -= size;
}

/* One piece of a copy between a chunk and host memory. */
struct piece {
  int fd;
  char *host;
  uint64_t off, len;
  bool to_host;
  int err;
};

/* Map the piece with its page tables filled in one go and memcpy: about
 * twice as fast as pread's page-by-page copy. */
static void *copy_piece(void *arg) {
  struct piece *p = arg;
  if (p->len == 0) return NULL;
  /* Writes need writable page tables: MAP_POPULATE maps shared pages
   * read-only, and every first write would fault. */
  void *m = mmap(NULL, p->len, PROT_READ | PROT_WRITE,
                 MAP_SHARED | (p->to_host ? MAP_POPULATE : 0), p->fd, (off_t)p->off);
  if (m == MAP_FAILED) {
    p->err = errno;
    return NULL;
  }
  if (!p->to_host) madvise(m, p->len, MADV_POPULATE_WRITE);
  if (p->to_host)
    memcpy(p->host, m, p->len);
  else
    memcpy(m, p->host, p->len);
  munmap(m, p->len);
  return NULL;
}

#define COPY_THREADS 8
#define COPY_MIN_PIECE (16ull << 20)

/* Copy chunks in pieces on as many threads as there are CPUs (up to 8),
 * so that mapping and copying the pieces overlap. */
static int host_chunks_copy(void *state, unsigned dev, const uint64_t *handles,
                            const uint64_t *sizes, size_t n, void *host, bool to_host) {
  (void)state;
  (void)dev;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int threads = cpus < 1 ? 1 : cpus > COPY_THREADS ? COPY_THREADS : (int)cpus;
  char *at = host;
  for (size_t i = 0; i < n; at += sizes[i++]) {
    struct piece pieces[COPY_THREADS];
    pthread_t tids[COPY_THREADS];
    bool threaded[COPY_THREADS] = {false};
    int k = sizes[i] / (uint64_t)threads < COPY_MIN_PIECE ? 1 : threads;
    uint64_t per = (sizes[i] / (uint64_t)k + 4095) & ~4095ull;
    for (int t = 0; t < k; t++) {
      uint64_t off = (uint64_t)t * per;
      uint64_t len = off >= sizes[i] ? 0 : sizes[i] - off < per ? sizes[i] - off : per;
      pieces[t] = (struct piece){(int)handles[i], at + off, off, len, to_host, 0};
      /* The last piece runs here, as does any a thread could not take. */
      threaded[t] = t < k - 1 && pthread_create(&tids[t], NULL, copy_piece, &pieces[t]) == 0;
      if (!threaded[t]) copy_piece(&pieces[t]);
    }
    int err = 0;
    for (int t = 0; t < k; t++) {
      if (threaded[t]) pthread_join(tids[t], NULL);
      if (pieces[t].err) err = pieces[t].err;
    }
    if (err) return gpu_fail(-err, "%s chunk: %s", to_host ? "reading" : "writing", strerror(err));
  }
  return 0;
}

/* Backups live in anonymous memory, faulted in once and then reused. */
static int host_backup_alloc(void *state, unsigned dev, uint64_t size, void **host) {
  (void)state;
  (void)dev;
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (p == MAP_FAILED) return gpu_fail(-ENOMEM, "backup of %llu bytes: %s",
                                       (unsigned long long)size, strerror(errno));
  *host = p;
  return 0;
}

static void host_backup_free(void *state, unsigned dev, void *host, uint64_t size) {
  (void)state;
  (void)dev;
  munmap(host, size);
}

/* Host memory needs no context. */
static int host_hold(void *state, unsigned dev) {
  (void)state;
  (void)dev;
  return 0;
}

static void host_unhold(void *state, unsigned dev) {
  (void)state;
  (void)dev;
}

static bool host_holding(void *state, unsigned dev) {
  (void)state;
  (void)dev;
  return false;
}

/* Host devices have made-up bus ids, the same in every process. */
static int host_bus_id(void *state, unsigned dev, char *buf, size_t len) {
  (void)state;
  snprintf(buf, len, "host:%u", dev);
  return 0;
}

static int host_device_by_bus_id(void *state, const char *bus_id) {
  (void)state;
  unsigned dev;
  if (sscanf(bus_id, "host:%u", &dev) != 1) return -ENODEV;
  return (int)dev;
}

static const int reserve_flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;

static int host_va_reserve(void *state, unsigned dev, uint64_t size, void **va) {
  (void)state;
  (void)dev;
  void *p = mmap(NULL, size, PROT_NONE, reserve_flags, -1, 0);
  if (p == MAP_FAILED) return gpu_fail(-errno, "reserve: %s", strerror(errno));
  *va = p;
  return 0;
}

static void host_va_free(void *state, unsigned dev, void *va, uint64_t size) {
  (void)state;
  (void)dev;
  munmap(va, size);
}

/* The fd is the handle until it is mapped; the mapping then keeps the
 * memory alive and the fd is closed, so clients hold no fd per chunk. */
static int host_import(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  (void)state;
  (void)dev;
  (void)size;
  *handle = (uint64_t)fd;
  return 0;
}

/* Map without access, as cuMemMap does; gpu_set_access grants it. The
 * handle (fd) is consumed either way. */
static int host_map(void *state, unsigned dev, void *va, uint64_t size, uint64_t handle) {
  (void)state;
  (void)dev;
  void *p = mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, (int)handle, 0);
  int e = errno;
  close((int)handle);
  if (p == MAP_FAILED) return gpu_fail(-e, "map: %s", strerror(e));
  return 0;
}

static int host_set_access(void *state, unsigned dev, void *va, uint64_t size) {
  (void)state;
  (void)dev;
  if (mprotect(va, size, PROT_READ | PROT_WRITE) < 0)
    return gpu_fail(-errno, "set access: %s", strerror(errno));
  return 0;
}

/* Put an inaccessible anonymous mapping over the range: the pages of the
 * chunk are dropped from this process and touching the range faults. */
static int host_unmap(void *state, unsigned dev, void *va, uint64_t size) {
  (void)state;
  (void)dev;
  void *p = mmap(va, size, PROT_NONE, reserve_flags | MAP_FIXED, -1, 0);
  if (p == MAP_FAILED) return gpu_fail(-errno, "unmap: %s", strerror(errno));
  return 0;
}

/* Nothing left to release: host_map closed the fd. */
static void host_release(void *state, unsigned dev, uint64_t handle) {
  (void)state;
  (void)dev;
  (void)handle;
}

/* Host memory is coherent: nothing to wait for. */
static int host_sync(void *state, unsigned dev) {
  (void)state;
  (void)dev;
  return 0;
}

static int host_copy_from(void *state, unsigned dev, void *dst, const void *va, uint64_t len) {
  (void)state;
  (void)dev;
  memcpy(dst, va, len);
  return 0;
}

static int host_copy_to(void *state, unsigned dev, void *va, const void *src, uint64_t len) {
  (void)state;
  (void)dev;
  memcpy(va, src, len);
  return 0;
}

static int host_fill32(void *state, unsigned dev, void *va, uint64_t len, uint32_t value) {
  (void)state;
  (void)dev;
  uint32_t *p = va;
  for (uint64_t i = 0; i < len / 4; i++) p[i] = value;
  return 0;
}

const struct gpu_ops gpu_host_ops = {
    .name = "host",
    .open = host_open,
    .close = host_close,
    .device_count = host_device_count,
    .granularity = host_granularity,
    .mem_info = host_mem_info,
    .chunk_create = host_chunk_create,
    .chunk_export = host_chunk_export,
    .chunk_release = host_chunk_release,
    .chunks_copy = host_chunks_copy,
    .backup_alloc = host_backup_alloc,
    .backup_free = host_backup_free,
    .hold = host_hold,
    .unhold = host_unhold,
    .holding = host_holding,
    .bus_id = host_bus_id,
    .device_by_bus_id = host_device_by_bus_id,
    .va_reserve = host_va_reserve,
    .va_free = host_va_free,
    .import = host_import,
    .map = host_map,
    .set_access = host_set_access,
    .unmap = host_unmap,
    .release = host_release,
    .sync = host_sync,
    .copy_from = host_copy_from,
    .copy_to = host_copy_to,
    .fill32 = host_fill32,
};
