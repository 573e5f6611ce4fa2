#include "backup_disk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#ifdef HAVE_LIBURING
#include <liburing.h>
#endif

#include "common/log.h"
#include "safedir.h"

/* Each request moves this much, and this many are in flight at once:
 * enough for an NVMe device's bandwidth (docs/benchmarks.md measures it
 * against dd oflag=direct on the H200 machine's disk). */
#define DISK_BLOCK (8ull << 20)
#define DISK_DEPTH 8
/* Direct I/O needs addresses, sizes and offsets in whole logical blocks. */
#define DISK_ALIGN 4096u
/* The names of files made where O_TMPFILE is not to be had, removed as
 * soon as made; a start removes any a crash left in between. */
#define DISK_PREFIX "gpumemd-backup."

struct backup_disk {
  char *path;
  int dirfd;           /* O_PATH */
  bool uring;          /* io_uring works here */
  atomic_uint_fast64_t names; /* for named files */
};

static const char WHAT[] = "backup directory";
static const char KEEPS[] = "the backups in it";

/* Remove the files an older daemon left (named ones: O_TMPFILE leaves none). */
static void sweep(backup_disk *d) {
  int fd = openat(d->dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *dir = fd >= 0 ? fdopendir(fd) : NULL;
  if (!dir) {
    if (fd >= 0) close(fd);
    log_warn("backup directory %s: cannot list it (%s): files a crash left are not removed",
             d->path, strerror(errno));
    return;
  }
  unsigned removed = 0;
  for (struct dirent *e; (e = readdir(dir));)
    if (strncmp(e->d_name, DISK_PREFIX, sizeof DISK_PREFIX - 1) == 0 &&
        unlinkat(d->dirfd, e->d_name, 0) == 0)
      removed++;
  closedir(dir);
  if (removed) log_info("backup directory %s: removed %u files a crash left", d->path, removed);
}

/* Whether io_uring can be used here (built with it, and let by the kernel). */
static bool uring_works(void) {
#ifdef HAVE_LIBURING
  struct io_uring ring;
  if (io_uring_queue_init(DISK_DEPTH, &ring, 0) < 0) return false;
  io_uring_queue_exit(&ring);
  return true;
#else
  return false;
#endif
}

/* Open and judge the backup directory (backup_disk.h). */
backup_disk *backup_disk_open(const char *path, char *why, size_t whylen) {
  int fd = safedir_open(WHAT, path, KEEPS, why, whylen);
  if (fd < 0) return NULL;
  backup_disk *d = calloc(1, sizeof *d);
  if (!d || !(d->path = strdup(path))) {
    snprintf(why, whylen, "out of host memory");
    free(d);
    close(fd);
    return NULL;
  }
  d->dirfd = fd;
  struct statvfs vfs;
  if (fstatvfs(fd, &vfs) == 0 && (vfs.f_flag & ST_RDONLY)) {
    snprintf(why, whylen, "backup directory %s is on a read-only filesystem", path);
    backup_disk_close(d);
    return NULL;
  }
  d->uring = uring_works();
  sweep(d);
  return d;
}

/* Close the directory. */
void backup_disk_close(backup_disk *d) {
  if (!d) return;
  close(d->dirfd);
  free(d->path);
  free(d);
}

/* The path it was opened with. */
const char *backup_disk_path(const backup_disk *d) { return d->path; }

/* How transfers are made. */
const char *backup_disk_engine(const backup_disk *d) {
  return d->uring ? "io_uring" : "pread/pwrite";
}

/* Bytes free for the daemon on the directory's filesystem. */
uint64_t backup_disk_free(const backup_disk *d) {
  struct statvfs vfs;
  if (fstatvfs(d->dirfd, &vfs) < 0) return 0;
  return (uint64_t)vfs.f_bavail * vfs.f_frsize;
}

/* Whether need more bytes can be written now (backup_disk.h). */
int backup_disk_check(const backup_disk *d, uint64_t need, char *why, size_t whylen) {
  int rc = safedir_recheck(d->dirfd, WHAT, d->path, KEEPS, why, whylen);
  if (rc < 0) return rc;
  struct stat st;
  struct statvfs vfs;
  if (fstat(d->dirfd, &st) < 0 || fstatvfs(d->dirfd, &vfs) < 0) {
    rc = -errno;
    snprintf(why, whylen, "backup directory %s: %s", d->path, strerror(-rc));
    return rc;
  }
  if (st.st_nlink == 0) {
    snprintf(why, whylen, "backup directory %s was removed", d->path);
    return -ENOENT;
  }
  if (vfs.f_flag & ST_RDONLY) {
    snprintf(why, whylen, "backup directory %s is on a read-only filesystem", d->path);
    return -EROFS;
  }
  uint64_t free_b = (uint64_t)vfs.f_bavail * vfs.f_frsize;
  if (need > free_b) {
    snprintf(why, whylen, "backup directory %s has %llu bytes free, %llu needed", d->path,
             (unsigned long long)free_b, (unsigned long long)need);
    return -ENOSPC;
  }
  return 0;
}

/* Record an item's failure (its first), with what failed. */
static void item_fail(struct backup_disk_item *it, int rc, const char *what) {
  if (it->rc) return;
  it->rc = rc;
  snprintf(it->why, sizeof it->why, "%s: %s", what, strerror(-rc));
}

/* Whether an item's I/O may be direct. */
static bool aligned(const struct backup_disk_item *it) {
  return (uintptr_t)it->host % DISK_ALIGN == 0 && it->size % DISK_ALIGN == 0;
}

/* A new unlinked file for an item, sized to it: direct where the
 * filesystem takes it. */
static int make_file(backup_disk *d, struct backup_disk_item *it) {
  int direct = aligned(it) ? O_DIRECT : 0;
  /* O_EXCL: never linked into a directory (an owner reading it holds a
   * descriptor of it, backup_disk_reader). */
  const int tmp = O_TMPFILE | O_EXCL | O_RDWR | O_CLOEXEC;
  int fd = openat(d->dirfd, ".", tmp | direct, 0600);
  if (fd < 0 && errno == EINVAL && direct) /* no direct I/O there */
    fd = openat(d->dirfd, ".", tmp, 0600);
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    char name[64];
    snprintf(name, sizeof name, DISK_PREFIX "%d.%llu", (int)getpid(),
             (unsigned long long)atomic_fetch_add(&d->names, 1));
    fd = openat(d->dirfd, name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC | direct, 0600);
    if (fd < 0 && errno == EINVAL && direct)
      fd = openat(d->dirfd, name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0) unlinkat(d->dirfd, name, 0);
  }
  if (fd < 0) {
    item_fail(it, -errno, "creating its file");
    return -1;
  }
  /* The room up front: a full disk fails here, before any write. */
  if (fallocate(fd, 0, 0, (off_t)it->size) < 0 && errno != EOPNOTSUPP) {
    item_fail(it, -errno, "making room for its file");
    close(fd);
    return -1;
  }
  return fd;
}

/* Where a transfer is: the next request's item and offset. */
struct cursor {
  size_t item;
  uint64_t off;
};

/* The next request of at most DISK_BLOCK bytes, skipping failed items;
 * false when none is left. */
static bool next_request(struct backup_disk_item *items, size_t n, struct cursor *c,
                         size_t *item, uint64_t *off, uint32_t *len) {
  while (c->item < n && (items[c->item].rc || c->off >= items[c->item].size)) {
    c->item++;
    c->off = 0;
  }
  if (c->item >= n) return false;
  uint64_t left = items[c->item].size - c->off;
  *item = c->item;
  *off = c->off;
  *len = (uint32_t)(left < DISK_BLOCK ? left : DISK_BLOCK);
  c->off += *len;
  return true;
}

/* One request's result: 0 done, 1 short (the rest asked again), or a
 * failure recorded. */
static int settle(struct backup_disk_item *it, bool write, ssize_t res, uint64_t *off,
                  uint32_t *len) {
  if (res < 0) {
    item_fail(it, (int)res, write ? "writing its file" : "reading its file");
    return -1;
  }
  if (res == 0) {
    item_fail(it, write ? -ENOSPC : -EIO, write ? "writing its file" : "its file ended early");
    return -1;
  }
  if ((uint64_t)res >= *len) return 0;
  *off += (uint64_t)res;
  *len -= (uint32_t)res;
  return 1;
}

/* Move every item with plain calls, one request at a time. */
static void transfer_plain(struct backup_disk_item *items, size_t n, bool write) {
  struct cursor c = {0};
  size_t i;
  uint64_t off;
  uint32_t len;
  while (next_request(items, n, &c, &i, &off, &len)) {
    int r;
    do {
      char *p = (char *)items[i].host + off;
      ssize_t res = write ? pwrite(items[i].fd, p, len, (off_t)off)
                          : pread(items[i].fd, p, len, (off_t)off);
      if (res < 0) res = -errno;
      r = settle(&items[i], write, res, &off, &len);
    } while (r == 1);
  }
}

#ifdef HAVE_LIBURING
/* Move every item through one ring, DISK_DEPTH requests in flight across
 * all of them; false when the ring cannot be made (then nothing moved). */
static bool transfer_uring(struct backup_disk_item *items, size_t n, bool write) {
  struct io_uring ring;
  if (io_uring_queue_init(DISK_DEPTH, &ring, 0) < 0) return false;
  struct req {
    size_t item;
    uint64_t off;
    uint32_t len;
  } reqs[DISK_DEPTH];
  size_t freelist[DISK_DEPTH], nfree = DISK_DEPTH, inflight = 0;
  for (size_t k = 0; k < DISK_DEPTH; k++) freelist[k] = k;
  struct cursor c = {0};
  for (;;) {
    while (nfree) { /* fill the ring */
      size_t s = freelist[nfree - 1];
      if (!next_request(items, n, &c, &reqs[s].item, &reqs[s].off, &reqs[s].len)) break;
      struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
      if (!sqe) { /* cannot be: the ring has DISK_DEPTH entries */
        item_fail(&items[reqs[s].item], -EBUSY, "queueing its I/O");
        break;
      }
      nfree--;
      struct backup_disk_item *it = &items[reqs[s].item];
      char *p = (char *)it->host + reqs[s].off;
      if (write) io_uring_prep_write(sqe, it->fd, p, reqs[s].len, reqs[s].off);
      else io_uring_prep_read(sqe, it->fd, p, reqs[s].len, reqs[s].off);
      io_uring_sqe_set_data64(sqe, s);
      inflight++;
    }
    if (!inflight) break;
    struct io_uring_cqe *cqe;
    int rc = io_uring_submit_and_wait(&ring, 1);
    if (rc >= 0) rc = io_uring_wait_cqe(&ring, &cqe);
    if (rc == -EINTR) continue;
    if (rc < 0) { /* the ring broke: what is in flight is lost to us */
      for (size_t k = 0; k < n; k++) item_fail(&items[k], rc, "waiting for its I/O");
      break;
    }
    size_t s = (size_t)io_uring_cqe_get_data64(cqe);
    ssize_t res = cqe->res;
    io_uring_cqe_seen(&ring, cqe);
    inflight--;
    struct req *q = &reqs[s];
    if (settle(&items[q->item], write, res, &q->off, &q->len) == 1) { /* short: again */
      struct io_uring_sqe *sqe = io_uring_get_sqe(&ring);
      struct backup_disk_item *it = &items[q->item];
      char *p = (char *)it->host + q->off;
      if (write) io_uring_prep_write(sqe, it->fd, p, q->len, q->off);
      else io_uring_prep_read(sqe, it->fd, p, q->len, q->off);
      io_uring_sqe_set_data64(sqe, s);
      inflight++;
      continue;
    }
    freelist[nfree++] = s;
  }
  io_uring_queue_exit(&ring);
  return true;
}
#endif

/* Move every item one way. */
static void transfer(backup_disk *d, struct backup_disk_item *items, size_t n, bool write) {
#ifdef HAVE_LIBURING
  if (d->uring && transfer_uring(items, n, write)) return;
#endif
  (void)d;
  transfer_plain(items, n, write);
}

/* Whether a file bypasses the page cache; if not, what it wrote is
 * written out and dropped from it (the cache would keep the host memory
 * the disk tier exists to free). */
static void drop_cached(struct backup_disk_item *it) {
  int fl = fcntl(it->fd, F_GETFL);
  if (fl >= 0 && (fl & O_DIRECT)) return;
  if (fdatasync(it->fd) < 0 && !it->rc) item_fail(it, -errno, "writing its file out");
  posix_fadvise(it->fd, 0, (off_t)it->size, POSIX_FADV_DONTNEED);
}

/* Write every item to a new file (backup_disk.h). */
void backup_disk_write(backup_disk *d, struct backup_disk_item *items, size_t n) {
  for (size_t i = 0; i < n; i++) {
    items[i].rc = 0;
    items[i].why[0] = '\0';
    items[i].fd = make_file(d, &items[i]);
  }
  transfer(d, items, n, true);
  for (size_t i = 0; i < n; i++) {
    if (items[i].fd >= 0 && !items[i].rc) drop_cached(&items[i]);
    if (items[i].rc && items[i].fd >= 0) {
      close(items[i].fd);
      items[i].fd = -1;
    }
  }
}

/* Read every item's file back (backup_disk.h). */
void backup_disk_read(backup_disk *d, struct backup_disk_item *items, size_t n) {
  for (size_t i = 0; i < n; i++) {
    items[i].rc = 0;
    items[i].why[0] = '\0';
  }
  transfer(d, items, n, false);
  for (size_t i = 0; i < n; i++)
    if (!items[i].rc) posix_fadvise(items[i].fd, 0, (off_t)items[i].size, POSIX_FADV_DONTNEED);
}

/* Open a backup file again, read only, through /proc/self/fd. */
int backup_disk_reader(int fd, char *why, size_t whylen) {
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  int r = open(path, O_RDONLY | O_CLOEXEC);
  if (r < 0) {
    int e = errno;
    snprintf(why, whylen, "opening its backup file again, read only (%s): %s", path,
             strerror(e));
    return -e;
  }
  return r;
}
