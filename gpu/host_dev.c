/* The host backend's daemon side: Linux shared memory behaving like GPU
 * VMM (gpu/host.h says what a chunk is).
 *
 * Devices are simulated: each has a fixed capacity that chunk creation
 * enforces; <node> names this daemon's devices (from its socket), so that
 * two daemons on one machine do not see each other's memory as their own.
 * Chunks are sealed against shrinking and growing (and against more
 * seals) before anyone else sees them: a worker holding one can neither
 * make the daemon's copies fault nor commit memory the daemon does not
 * count. */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

#include "error.h"
#include "gpudev_ops.h"
#include "host.h"
#include "populate.h"

#define HOST_DEFAULT_GRANULARITY (2ull << 20)

/* Check the simulated devices asked for and make their state. */
static int host_open(const struct gpudev_ops *self, const struct gpudev_options *opt,
                     void **state, char *err, size_t errlen) {
  (void)self;
  struct host *h = calloc(1, sizeof *h);
  if (!h) return -ENOMEM;
  if (opt->host_devices == 0 || opt->host_devices > GPUMEM_MAX_DEVICES) {
    snprintf(err, errlen, "host devices must be 1..%d", GPUMEM_MAX_DEVICES);
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
  const char *node = opt->host_node ? opt->host_node : "local";
  bool node_ok = *node && strlen(node) < sizeof h->node;
  for (const char *c = node; *c; c++)
    node_ok = node_ok && (isalnum((unsigned char)*c) || *c == '_' || *c == '.' || *c == '-');
  if (!node_ok) {
    snprintf(err, errlen, "host node name must be 1-%zu characters of [A-Za-z0-9_.-]",
             sizeof h->node - 1);
    free(h);
    return -EINVAL;
  }
  snprintf(h->node, sizeof h->node, "%s", node);
  if (!(h->live = idmap_create()) || !(h->backups = idmap_create())) {
    idmap_destroy(h->live);
    free(h);
    return -ENOMEM;
  }
  pthread_mutex_init(&h->mu, NULL);
  *state = h;
  return 0;
}

/* Free the state (every chunk already released). */
static void host_close(void *state) {
  struct host *h = state;
  host_proc_forget(h);
  idmap_destroy(h->live);
  idmap_destroy(h->backups);
  pthread_mutex_destroy(&h->mu);
  free(h);
}

/* Number of simulated devices. */
static unsigned host_device_count(void *state) { return ((struct host *)state)->ndev; }

/* The granularity asked for at open. */
static uint64_t host_granularity(void *state) { return ((struct host *)state)->granularity; }

/* A device's capacity, and what chunks have not committed of it. */
static int host_mem_info(void *state, unsigned dev, uint64_t *free_bytes, uint64_t *total) {
  struct host *h = state;
  if (dev >= h->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  *total = h->capacity;
  *free_bytes = h->capacity - h->committed[dev];
  return 0;
}

/* The seals every chunk carries once made or adopted. */
#define CHUNK_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/* A committed, sealed memfd: the model of a physical allocation. */
static int host_chunk_create(void *state, unsigned dev, uint64_t size, uint64_t *handle) {
  struct host *h = state;
  if (dev >= h->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  if (size > h->capacity - h->committed[dev])
    return gpu_fail(-ENOMEM, "device %u: %llu bytes free, %llu asked", dev,
                    (unsigned long long)(h->capacity - h->committed[dev]),
                    (unsigned long long)size);
  char name[96];
  snprintf(name, sizeof name, "gpumem-host-%s:%u", h->node, dev);
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return gpu_fail(-errno, "memfd_create: %s", strerror(errno));
  if (ftruncate(fd, (off_t)size) < 0 || fallocate(fd, 0, 0, (off_t)size) < 0) {
    int e = errno;
    close(fd);
    return gpu_fail(e == ENOSPC ? -ENOMEM : -e, "committing %llu bytes: %s",
                    (unsigned long long)size, strerror(e));
  }
  if (fcntl(fd, F_ADD_SEALS, CHUNK_SEALS) < 0) {
    int e = errno;
    close(fd);
    return gpu_fail(-e, "sealing a chunk: %s", strerror(e));
  }
  int rc = host_live_add(h, fd, dev);
  if (rc < 0) {
    close(fd);
    return rc;
  }
  h->committed[dev] += size;
  *handle = (uint64_t)fd;
  return 0;
}

/* The chunk's memfd again, as a new fd for a worker. */
static int host_chunk_export(void *state, uint64_t handle, int *fd) {
  (void)state;
  int d = fcntl((int)handle, F_DUPFD_CLOEXEC, 0);
  if (d < 0) return gpu_fail(-errno, "dup: %s", strerror(errno));
  *fd = d;
  return 0;
}

/* Close the daemon's memfd; the memory goes once no worker holds it. */
static void host_chunk_release(void *state, unsigned dev, uint64_t handle, uint64_t size) {
  struct host *h = state;
  host_live_del(h, (int)handle);
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

/* The seals of a backup's memfd: its size is fixed before an owner gets
 * it, so that no owner can make the daemon's reads of it fault. */
#define BACKUP_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

/* Backups live in a sealed memfd of their own (not device memory: not
 * named as chunks are), mapped here, made ready once and then reused;
 * its owner may be handed the memfd to copy through (host_backup_export). */
static int host_backup_reserve(void *state, unsigned dev, uint64_t size, void **host) {
  struct host *h = state;
  (void)dev;
  int fd = memfd_create("gpumem-backup", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return gpu_fail(-errno, "backup memfd_create: %s", strerror(errno));
  void *p = MAP_FAILED;
  int err = 0;
  if (ftruncate(fd, (off_t)size) < 0 || fcntl(fd, F_ADD_SEALS, BACKUP_SEALS) < 0)
    err = errno;
  else if ((p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
    err = errno;
  pthread_mutex_lock(&h->mu);
  if (!err && idmap_put(h->backups, (uint64_t)(uintptr_t)p, (void *)(intptr_t)(fd + 1)) < 0)
    err = ENOMEM;
  pthread_mutex_unlock(&h->mu);
  if (err) {
    if (p != MAP_FAILED) munmap(p, size);
    close(fd);
    return gpu_fail(-ENOMEM, "backup of %llu bytes: %s", (unsigned long long)size,
                    strerror(err));
  }
  *host = p;
  return 0;
}

/* The memfd of the backup at host, or -1. */
static int backup_fd(struct host *h, const void *host) {
  pthread_mutex_lock(&h->mu);
  intptr_t v = (intptr_t)idmap_get(h->backups, (uint64_t)(uintptr_t)host);
  pthread_mutex_unlock(&h->mu);
  return (int)v - 1;
}

/* A backup is one piece: its memfd again, for its buffer's owner. */
static int host_backup_export(void *state, unsigned dev, void *host, uint64_t size, int *fds,
                              uint64_t *sizes, size_t max, size_t *n) {
  (void)dev;
  int fd = backup_fd(state, host);
  if (fd < 0) return gpu_fail(-EINVAL, "no backup at %p", host);
  if (max < 1) return gpu_fail(-E2BIG, "a backup is one fd; room for none");
  if ((fds[0] = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0)
    return gpu_fail(-errno, "backup dup: %s", strerror(errno));
  sizes[0] = size;
  *n = 1;
  return 0;
}

/* A piece is made ready by faulting it in and writing it once. */
static int host_backup_make(void *state, unsigned dev, void *host, uint64_t size, uint64_t off,
                            bool background) {
  (void)state;
  (void)dev;
  (void)background;
  return gpu_populate((char *)host + off, gpudev_piece_len(size, off));
}

/* Unmap a backup and close its memfd (nothing is pinned on the host
 * backend); the memory goes once no owner holds it either. */
static void host_backup_release(void *state, unsigned dev, void *host, uint64_t size,
                                uint64_t made) {
  struct host *h = state;
  (void)dev;
  (void)made;
  int fd = backup_fd(h, host);
  pthread_mutex_lock(&h->mu);
  idmap_del(h->backups, (uint64_t)(uintptr_t)host);
  pthread_mutex_unlock(&h->mu);
  munmap(host, size);
  if (fd >= 0) close(fd);
}

/* All of it made ready at once. */
static int host_backup_alloc(void *state, unsigned dev, uint64_t size, void **host) {
  int rc = host_backup_reserve(state, dev, size, host);
  if (rc == 0 && (rc = gpu_populate(*host, size)) < 0) host_backup_release(state, dev, *host, size, 0);
  return rc;
}

/* Free memory from host_backup_alloc. */
static void host_backup_free(void *state, unsigned dev, void *host, uint64_t size) {
  host_backup_release(state, dev, host, size, size);
}

/* Host memory needs no context. */
static int host_hold(void *state, unsigned dev) {
  (void)state;
  (void)dev;
  return 0;
}

/* Nothing held, nothing to let go of. */
static void host_unhold(void *state, unsigned dev) {
  (void)state;
  (void)dev;
}

/* The host backend never holds a context. */
static bool host_holding(void *state, unsigned dev) {
  (void)state;
  (void)dev;
  return false;
}

/* A made-up bus id, the same in every process of this daemon's node. */
static int host_bus_id(void *state, unsigned dev, char *buf, size_t len) {
  snprintf(buf, len, "host-%s:%u", ((struct host *)state)->node, dev);
  return 0;
}

/* Check that the memfd holds exactly size committed bytes and fits on dev. */
static int adopt_check_size(const struct host *h, unsigned dev, int fd, uint64_t size) {
  struct stat st;
  if (fstat(fd, &st) < 0) return gpu_fail(-errno, "adopting: fstat: %s", strerror(errno));
  if ((uint64_t)st.st_size != size || size == 0 || size % h->granularity)
    return gpu_fail(-EINVAL, "adopting: chunk has %llu bytes, %llu claimed",
                    (unsigned long long)st.st_size, (unsigned long long)size);
  if ((uint64_t)st.st_blocks * 512 < size)
    return gpu_fail(-EINVAL, "adopting: only %llu of the chunk's %llu bytes are committed",
                    (unsigned long long)st.st_blocks * 512, (unsigned long long)size);
  if (size > h->capacity - h->committed[dev])
    return gpu_fail(-ENOMEM, "adopting: device %u: %llu bytes free, %llu asked", dev,
                    (unsigned long long)(h->capacity - h->committed[dev]),
                    (unsigned long long)size);
  return 0;
}

/* Check that fd is a chunk of dev of size bytes, as this backend makes
 * them: a memfd named gpumem-dev<dev>, sealed as chunks are (or sealable
 * with no seals yet: adopting seals it), of exactly size bytes, all
 * committed. One that cannot be sealed is refused: its holder could
 * shrink it under the daemon's copies. */
static int adopt_check(const struct host *h, unsigned dev, int fd, uint64_t size) {
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) return gpu_fail(-EINVAL, "adopting: fd %d is not a memfd", fd);
  if (seals == F_SEAL_SEAL)
    return gpu_fail(-EINVAL, "adopting: the memfd cannot be sealed against resizing (made "
                    "without MFD_ALLOW_SEALING, as before gpumemd 1.3)");
  if (seals != 0 && seals != CHUNK_SEALS)
    return gpu_fail(-EINVAL, "adopting: memfd has seals %#x", seals);
  char p[64], link[256];
  snprintf(p, sizeof p, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(p, link, sizeof link - 1);
  if (n < 0) return gpu_fail(-errno, "adopting: %s: %s", p, strerror(errno));
  link[n] = '\0';
  if (!host_live_is_device_memfd(h, link, dev))
    return gpu_fail(-EINVAL, "adopting: %s is not memory of device %u", link, dev);
  int rc = adopt_check_size(h, dev, fd, size);
  if (rc < 0 || seals != 0) return rc;
  /* Sealed only once it passed, then looked at again: it cannot have
   * changed size between the look and the seal. */
  if (fcntl(fd, F_ADD_SEALS, CHUNK_SEALS) < 0)
    return gpu_fail(-errno, "adopting: sealing: %s", strerror(errno));
  return adopt_check_size(h, dev, fd, size);
}

/* The memfd's owner is the uid the chunk is for: it survives the daemon,
 * so that a restarted daemon can tell whose memory a worker hands back. A
 * daemon that may not chown (not root) leaves its own uid there. */
static int host_chunk_set_owner(void *state, uint64_t handle, uint32_t uid) {
  (void)state;
  if (fchown((int)handle, (uid_t)uid, (gid_t)-1) < 0)
    return gpu_fail(-errno, "chown of a chunk to uid %u: %s", uid, strerror(errno));
  return 0;
}

/* The uid that owns a chunk's memfd. */
static int host_chunk_owner(void *state, uint64_t handle, uint32_t *uid) {
  (void)state;
  struct stat st;
  if (fstat((int)handle, &st) < 0) return gpu_fail(-errno, "chunk: %s", strerror(errno));
  *uid = (uint32_t)st.st_uid;
  return 0;
}

/* Own a chunk a worker hands back after a daemon restart: the fd becomes
 * the handle, counted like a chunk made here. The fd is consumed. */
static int host_chunk_adopt(void *state, unsigned dev, int fd, uint64_t size,
                            uint64_t *handle) {
  struct host *h = state;
  int rc = dev >= h->ndev ? gpu_fail(-ENODEV, "no device %u", dev) : adopt_check(h, dev, fd, size);
  if (rc == 0 && fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) rc = gpu_fail(-errno, "adopting: %s", strerror(errno));
  if (rc == 0) rc = host_live_add(h, fd, dev);
  if (rc < 0) {
    close(fd);
    return rc;
  }
  h->committed[dev] += size;
  *handle = (uint64_t)fd;
  return 0;
}

const struct gpudev_ops gpudev_host_ops = {
    .name = "host",
    .fd_per_chunk = true,
    .release_stops = true,
    .open = host_open,
    .close = host_close,
    .device_count = host_device_count,
    .granularity = host_granularity,
    .mem_info = host_mem_info,
    .processes = host_proc_processes,
    .processes_since = host_proc_since,
    .processes_view = host_proc_view,
    .chunks_held_by = host_proc_chunks_held_by,
    .process_listed = host_proc_listed,
    .process_release = host_freeze_release,
    .process_restore = host_freeze_restore,
    .process_released = host_freeze_released,
    .chunk_set_owner = host_chunk_set_owner,
    .chunk_owner = host_chunk_owner,
    .chunk_adopt = host_chunk_adopt,
    .chunk_create = host_chunk_create,
    .chunk_export = host_chunk_export,
    .chunk_release = host_chunk_release,
    .chunks_copy = host_chunks_copy,
    .backup_reserve = host_backup_reserve,
    .backup_make = host_backup_make,
    .backup_release = host_backup_release,
    .backup_alloc = host_backup_alloc,
    .backup_free = host_backup_free,
    .backup_export = host_backup_export,
    .hold = host_hold,
    .unhold = host_unhold,
    .holding = host_holding,
    .bus_id = host_bus_id,
};
