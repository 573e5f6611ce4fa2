/* The host backend: Linux shared memory behaving like GPU VMM.
 *
 * A chunk is a memfd named gpumem-dev<d> whose pages are committed with
 * fallocate, so that the memory is really used (Shmem in /proc/meminfo) and
 * really returned when the daemon and every importer have unmapped and
 * closed it. Devices are simulated: each has a fixed capacity that chunk
 * creation enforces; <node> names this daemon's devices (from its socket),
 * so that two daemons on one machine do not see each other's memory as
 * their own. Any memfd of that name is "device memory" of d; the
 * ones this backend holds for the daemon are known by inode, so that the
 * kernel's view of each process (/proc/PID/maps and fd) plays the part of
 * the driver's per-process figures. Chunks are sealed against shrinking
 * and growing (and against more seals) before anyone else sees them: a
 * worker holding one can neither make the daemon's copies fault nor commit
 * memory the daemon does not count. */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif
#include <unistd.h>

#include "backend.h"
#include "common/idmap.h"
#include "common/limits.h"

#define HOST_DEFAULT_GRANULARITY (2ull << 20)

struct host {
  unsigned ndev;
  uint64_t granularity;
  uint64_t capacity;
  uint64_t committed[GPUMEM_MAX_DEVICES];
  char node[40];  /* names the simulated devices: bus id "host-<node>:<d>" */
  idmap *live;    /* inode -> device + 1 of every chunk held (daemon side) */
  dev_t live_dev; /* the filesystem those inodes are on (memfds share one) */
};

static int host_open(const struct gpu_ops *self, const struct gpu_options *opt, void **state,
                     char *err, size_t errlen) {
  (void)self;
  struct host *h = calloc(1, sizeof *h);
  if (!h) return -ENOMEM;
  if (!opt->client) {
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
  }
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
  if (!(h->live = idmap_create())) {
    free(h);
    return -ENOMEM;
  }
  *state = h;
  return 0;
}

static void host_close(void *state) {
  struct host *h = state;
  idmap_destroy(h->live);
  free(h);
}

/* Count a chunk as the daemon's own, by inode, so that scans of /proc can
 * tell it from memory made outside the daemon. */
static int live_add(struct host *h, int fd, unsigned dev) {
  struct stat st;
  if (fstat(fd, &st) < 0) return gpu_fail(-errno, "fstat: %s", strerror(errno));
  if (idmap_get(h->live, (uint64_t)st.st_ino) && st.st_dev == h->live_dev)
    return gpu_fail(-EEXIST, "chunk (inode %llu) is already held", (unsigned long long)st.st_ino);
  if (idmap_count(h->live) == 0) h->live_dev = st.st_dev;
  if (st.st_dev != h->live_dev)
    return gpu_fail(-EINVAL, "chunk is on another filesystem than the others");
  if (idmap_put(h->live, (uint64_t)st.st_ino, (void *)(uintptr_t)(dev + 1)) < 0)
    return gpu_fail(-ENOMEM, "out of memory");
  return 0;
}

/* Forget a chunk about to be closed. */
static void live_del(struct host *h, int fd) {
  struct stat st;
  if (fstat(fd, &st) == 0) idmap_del(h->live, (uint64_t)st.st_ino);
}

/* True if the file is a chunk this backend holds. */
static bool live_has(const struct host *h, dev_t dev, ino_t ino) {
  return dev == h->live_dev && idmap_get(h->live, (uint64_t)ino) != NULL;
}

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
/* The seals every chunk carries once made or adopted. */
#define CHUNK_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)

static int host_chunk_create(void *state, unsigned dev, uint64_t size,
                             uint64_t *handle) {
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
  int rc = live_add(h, fd, dev);
  if (rc < 0) {
    close(fd);
    return rc;
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
  live_del(h, (int)handle);
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

/* Backups live in anonymous memory, made ready once and then reused. */
static int host_backup_reserve(void *state, unsigned dev, uint64_t size, void **host) {
  (void)state;
  (void)dev;
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return gpu_fail(-ENOMEM, "backup of %llu bytes: %s", (unsigned long long)size,
                    strerror(errno));
  *host = p;
  return 0;
}

/* A piece is made ready by faulting it in and writing it once. */
static int host_backup_make(void *state, unsigned dev, void *host, uint64_t size, uint64_t off,
                            bool background) {
  (void)state;
  (void)dev;
  (void)background;
  return gpu_populate((char *)host + off, gpu_piece_len(size, off));
}

/* Unmap a backup (nothing is pinned on the host backend). */
static void host_backup_release(void *state, unsigned dev, void *host, uint64_t size,
                                uint64_t made) {
  (void)state;
  (void)dev;
  (void)made;
  munmap(host, size);
}

/* All of it made ready at once. */
static int host_backup_alloc(void *state, unsigned dev, uint64_t size, void **host) {
  int rc = host_backup_reserve(state, dev, size, host);
  if (rc == 0 && (rc = gpu_populate(*host, size)) < 0) munmap(*host, size);
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
/* The device's name: the same in every process of this daemon's node. */
static int host_bus_id(void *state, unsigned dev, char *buf, size_t len) {
  snprintf(buf, len, "host-%s:%u", ((struct host *)state)->node, dev);
  return 0;
}

/* A client's device for the daemon's bus id "host-<node>:<d>": d. */
static int host_device_by_bus_id(void *state, const char *bus_id) {
  (void)state;
  const char *colon = strrchr(bus_id, ':');
  char *end;
  if (strncmp(bus_id, "host-", 5) != 0 || !colon || !colon[1]) return -ENODEV;
  unsigned long dev = strtoul(colon + 1, &end, 10);
  if (*end || dev >= GPUMEM_MAX_DEVICES) return -ENODEV;
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

/* The fd is the handle, held while mapped and closed by host_release, as
 * an imported handle holds a VMM allocation: so that it can be exported
 * again to a daemon that restarted. */
static int host_import(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  (void)state;
  (void)dev;
  (void)size;
  *handle = (uint64_t)fd;
  return 0;
}

/* Map without access, as cuMemMap does; gpu_set_access grants it. The
 * handle (fd) stays open either way: gpu_release closes it. */
static int host_map(void *state, unsigned dev, void *va, uint64_t size, uint64_t handle) {
  (void)state;
  (void)dev;
  void *p = mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, (int)handle, 0);
  if (p == MAP_FAILED) return gpu_fail(-errno, "map: %s", strerror(errno));
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

/* Close the imported fd; the memory goes once nothing maps it either. */
static void host_release(void *state, unsigned dev, uint64_t handle) {
  (void)state;
  (void)dev;
  close((int)handle);
}

/* An imported chunk again as a new fd, for a daemon that adopts it. */
static int host_export_handle(void *state, unsigned dev, uint64_t handle, int *fd) {
  (void)dev;
  return host_chunk_export(state, handle, fd);
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

/* What /proc says of one file a process maps or holds. */
struct proc_file {
  dev_t dev;
  ino_t ino;
  uint64_t mapped; /* bytes of its mappings */
  uint64_t held;   /* its committed bytes, where the process holds an fd */
  bool has_fd;
};

/* The files of one process that are device memory of a device. */
struct proc_files {
  struct proc_file *v;
  size_t n, cap;
};

/* The entry for a file, added if new; NULL when out of memory. */
static struct proc_file *files_at(struct proc_files *f, dev_t dev, ino_t ino) {
  for (size_t i = 0; i < f->n; i++)
    if (f->v[i].dev == dev && f->v[i].ino == ino) return &f->v[i];
  if (f->n == f->cap) {
    size_t cap = f->cap ? f->cap * 2 : 8;
    struct proc_file *v = realloc(f->v, cap * sizeof *v);
    if (!v) return NULL;
    f->v = v;
    f->cap = cap;
  }
  f->v[f->n] = (struct proc_file){.dev = dev, .ino = ino};
  return &f->v[f->n++];
}

/* True if path names a memfd of device dev ("/memfd:gpumem-host-local:0
 * (deleted)" in maps and fd links): the name alone, so 1 is not 10. */
static bool is_device_memfd(const struct host *h, const char *path, unsigned dev) {
  char name[96];
  int len = snprintf(name, sizeof name, "/memfd:gpumem-host-%s:%u", h->node, dev);
  if (strncmp(path, name, (size_t)len) != 0) return false;
  return path[len] == '\0' || strcmp(path + len, " (deleted)") == 0;
}

/* One line of /proc/PID/maps: its length, file and path (NULL if none). */
static bool maps_line(char *line, uint64_t *len, dev_t *dev, ino_t *ino, char **path) {
  unsigned long long start, end, inode;
  unsigned maj, min;
  int at = 0;
  if (sscanf(line, "%llx-%llx %*s %*x %x:%x %llu %n", &start, &end, &maj, &min, &inode, &at) < 5)
    return false;
  line[strcspn(line, "\n")] = '\0';
  *len = end - start;
  *dev = makedev(maj, min);
  *ino = (ino_t)inode;
  *path = line[at] ? line + at : NULL;
  return true;
}

/* Call fn for each file mapping of pid; -ENOENT if pid is gone. */
static int maps_each(int pid, void (*fn)(void *arg, uint64_t len, dev_t dev, ino_t ino,
                                         const char *path),
                     void *arg) {
  char p[64];
  snprintf(p, sizeof p, "/proc/%d/maps", pid);
  FILE *f = fopen(p, "re");
  if (!f) return -errno;
  char *line = NULL;
  size_t cap = 0;
  while (getline(&line, &cap, f) > 0) {
    uint64_t len;
    dev_t dev;
    ino_t ino;
    char *path;
    if (maps_line(line, &len, &dev, &ino, &path) && path && ino) fn(arg, len, dev, ino, path);
  }
  free(line);
  fclose(f);
  return 0;
}

/* Call fn for each fd of pid, with its link text and what it opens;
 * -ENOENT if pid is gone. */
static int fds_each(int pid, void (*fn)(void *arg, const struct stat *st, const char *link),
                    void *arg) {
  char p[64];
  snprintf(p, sizeof p, "/proc/%d/fd", pid);
  DIR *d = opendir(p);
  if (!d) return -errno;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char link[256];
    ssize_t n = readlinkat(dirfd(d), e->d_name, link, sizeof link - 1);
    struct stat st;
    if (n <= 0 || fstatat(dirfd(d), e->d_name, &st, 0) < 0) continue;
    link[n] = '\0';
    fn(arg, &st, link);
  }
  closedir(d);
  return 0;
}

/* What a scan of one process for outside memory of one device needs. */
struct outside_scan {
  const struct host *h;
  unsigned dev;
  struct proc_files files;
  bool oom;
};

/* A mapping of outside memory of the device: count its bytes. */
static void outside_mapping(void *arg, uint64_t len, dev_t dev, ino_t ino, const char *path) {
  struct outside_scan *s = arg;
  if (!is_device_memfd(s->h, path, s->dev) || live_has(s->h, dev, ino)) return;
  struct proc_file *f = files_at(&s->files, dev, ino);
  if (f) f->mapped += len;
  else s->oom = true;
}

/* An fd of outside memory of the device: count what the memfd commits. */
static void outside_fd(void *arg, const struct stat *st, const char *link) {
  struct outside_scan *s = arg;
  if (!is_device_memfd(s->h, link, s->dev) || live_has(s->h, st->st_dev, st->st_ino)) return;
  struct proc_file *f = files_at(&s->files, st->st_dev, st->st_ino);
  if (!f) {
    s->oom = true;
    return;
  }
  f->has_fd = true;
  f->held = (uint64_t)st->st_blocks * 512;
}

/* Bytes of device memory pid holds outside the daemon: each memfd once,
 * by what it commits where the process holds an fd to it, else by the
 * bytes it maps. A process that cannot be read counts 0. */
static int outside_bytes(const struct host *h, unsigned dev, int pid, uint64_t *bytes) {
  struct outside_scan s = {.h = h, .dev = dev};
  *bytes = 0;
  if (maps_each(pid, outside_mapping, &s) == 0) fds_each(pid, outside_fd, &s);
  for (size_t i = 0; i < s.files.n; i++)
    *bytes += s.files.v[i].has_fd ? s.files.v[i].held : s.files.v[i].mapped;
  free(s.files.v);
  return s.oom ? gpu_fail(-ENOMEM, "out of memory") : 0;
}

/* Every process that maps or holds memfds of dev the daemon did not make,
 * from /proc: the model of the driver's per-process list. The daemon's own
 * process is left out (its memfds are its chunks); processes of other users
 * are seen only by a daemon that may read their /proc entries. */
static int host_processes(void *state, unsigned dev, struct gpu_process *out, size_t max,
                          size_t *n) {
  struct host *h = state;
  if (dev >= h->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  DIR *d = opendir("/proc");
  if (!d) return gpu_fail(-errno, "/proc: %s", strerror(errno));
  int self = getpid(), rc = 0;
  struct dirent *e;
  while (rc == 0 && (e = readdir(d))) {
    char *end;
    long pid = strtol(e->d_name, &end, 10);
    if (*end || pid <= 0 || pid == self) continue;
    uint64_t bytes;
    if ((rc = outside_bytes(h, dev, (int)pid, &bytes)) < 0 || bytes == 0) continue;
    if (*n < max) out[*n] = (struct gpu_process){.pid = (int)pid, .used = bytes};
    ++*n;
  }
  closedir(d);
  return rc;
}

/* The memfds one process maps or holds, by inode (memfds share one
 * filesystem, the live chunks' dev). */
struct held_scan {
  dev_t dev;
  idmap *inodes;
  bool oom;
};

/* Note a mapping's inode. */
static void held_mapping(void *arg, uint64_t len, dev_t dev, ino_t ino, const char *path) {
  struct held_scan *s = arg;
  (void)len;
  (void)path;
  if (dev == s->dev && idmap_put(s->inodes, (uint64_t)ino, s) < 0) s->oom = true;
}

/* Note an fd's inode. */
static void held_fd(void *arg, const struct stat *st, const char *link) {
  struct held_scan *s = arg;
  (void)link;
  if (st->st_dev == s->dev && idmap_put(s->inodes, (uint64_t)st->st_ino, s) < 0) s->oom = true;
}

/* Which chunks pid maps or holds an fd to, by the kernel's word (a worker
 * that acknowledged an unmap but kept its mapping is caught here), reading
 * its /proc entries once. A process that is gone holds nothing. */
static int host_chunks_held_by(void *state, int pid, const uint64_t *handles, size_t n,
                               bool *held) {
  struct host *h = state;
  struct held_scan s = {.dev = h->live_dev, .inodes = idmap_create()};
  if (!s.inodes) return gpu_fail(-ENOMEM, "out of memory");
  int rc = maps_each(pid, held_mapping, &s);
  if (rc == 0) rc = fds_each(pid, held_fd, &s);
  if (rc == -ENOENT || rc == -ESRCH) { /* gone: it holds nothing */
    idmap_destroy(s.inodes);
    memset(held, 0, n * sizeof *held);
    return 0;
  }
  if (rc < 0 || s.oom) {
    rc = s.oom ? gpu_fail(-ENOMEM, "out of memory")
               : gpu_fail(rc, "reading /proc/%d: %s", pid, strerror(-rc));
    idmap_destroy(s.inodes);
    return rc;
  }
  int count = 0;
  for (size_t i = 0; i < n; i++) {
    struct stat st;
    held[i] = fstat((int)handles[i], &st) == 0 && st.st_dev == s.dev &&
              idmap_get(s.inodes, (uint64_t)st.st_ino) != NULL;
    count += held[i];
  }
  idmap_destroy(s.inodes);
  return count;
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
  if (!is_device_memfd(h, link, dev))
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
  if (rc == 0) rc = live_add(h, fd, dev);
  if (rc < 0) {
    close(fd);
    return rc;
  }
  h->committed[dev] += size;
  *handle = (uint64_t)fd;
  return 0;
}

const struct gpu_ops gpu_host_ops = {
    .name = "host",
    .fd_per_chunk = true,
    .open = host_open,
    .close = host_close,
    .device_count = host_device_count,
    .granularity = host_granularity,
    .mem_info = host_mem_info,
    .processes = host_processes,
    .chunks_held_by = host_chunks_held_by,
    .chunk_set_owner = host_chunk_set_owner,
    .chunk_owner = host_chunk_owner,
    .chunk_adopt = host_chunk_adopt,
    .export_handle = host_export_handle,
    .chunk_create = host_chunk_create,
    .chunk_export = host_chunk_export,
    .chunk_release = host_chunk_release,
    .chunks_copy = host_chunks_copy,
    .backup_reserve = host_backup_reserve,
    .backup_make = host_backup_make,
    .backup_release = host_backup_release,
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
