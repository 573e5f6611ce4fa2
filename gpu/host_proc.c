/* The host backend's model of the driver's per-process figures: what the
 * kernel says each process maps (/proc/PID/maps) and holds
 * (/proc/PID/fd) of the simulated devices' memfds. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "error.h"
#include "host.h"

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

/* Call fn for each fd of pid with what it opens; where wanted is given,
 * only for fds whose link text it wants (one readlink each, and a stat
 * only for those: the other fds of a process holding thousands cost one
 * call, not two); -ENOENT if pid is gone. */
static int fds_each(int pid, bool (*wanted)(void *arg, const char *link),
                    void (*fn)(void *arg, const struct stat *st), void *arg) {
  char p[64];
  snprintf(p, sizeof p, "/proc/%d/fd", pid);
  DIR *d = opendir(p);
  if (!d) return -errno;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    if (wanted) {
      char link[256];
      ssize_t n = readlinkat(dirfd(d), e->d_name, link, sizeof link - 1);
      if (n <= 0) continue;
      link[n] = '\0';
      if (!wanted(arg, link)) continue;
    }
    struct stat st;
    if (fstatat(dirfd(d), e->d_name, &st, 0) == 0) fn(arg, &st);
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
  if (!host_live_is_device_memfd(s->h, path, s->dev) || host_live_has(s->h, dev, ino)) return;
  struct proc_file *f = files_at(&s->files, dev, ino);
  if (f) f->mapped += len;
  else s->oom = true;
}

/* Whether an fd's link names a memfd of the scanned device. */
static bool outside_named(void *arg, const char *link) {
  const struct outside_scan *s = arg;
  return host_live_is_device_memfd(s->h, link, s->dev);
}

/* An fd of outside memory of the device: count what the memfd commits. */
static void outside_fd(void *arg, const struct stat *st) {
  struct outside_scan *s = arg;
  if (host_live_has(s->h, st->st_dev, st->st_ino)) return;
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
  if (maps_each(pid, outside_mapping, &s) == 0) fds_each(pid, outside_named, outside_fd, &s);
  for (size_t i = 0; i < s.files.n; i++)
    *bytes += s.files.v[i].has_fd ? s.files.v[i].held : s.files.v[i].mapped;
  free(s.files.v);
  return s.oom ? gpu_fail(-ENOMEM, "out of memory") : 0;
}

/* Call fn for every process but the daemon's own that maps or holds
 * memfds of dev the daemon did not make, with their bytes; processes of
 * other users are seen only by a daemon that may read their /proc
 * entries. */
static int outside_each(struct host *h, unsigned dev, void (*fn)(void *arg, int pid, uint64_t bytes),
                        void *arg) {
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
    fn(arg, (int)pid, bytes);
  }
  closedir(d);
  return rc;
}

/* Where host_proc_processes writes the processes it finds. */
struct process_list {
  struct gpudev_process *out;
  size_t max, *n;
};

/* One process into the list. */
static void list_process(void *arg, int pid, uint64_t bytes) {
  struct process_list *l = arg;
  if (*l->n < l->max) l->out[*l->n] = (struct gpudev_process){.pid = pid, .used = bytes};
  ++*l->n;
}

/* Every process that maps or holds memfds of dev the daemon did not make,
 * from /proc: the model of the driver's per-process list. The daemon's own
 * process is left out (its memfds are its chunks). */
int host_proc_processes(void *state, unsigned dev, struct gpudev_process *out, size_t max,
                        size_t *n) {
  struct process_list l = {.out = out, .max = max, .n = n};
  return outside_each(state, dev, list_process, &l);
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
static void held_fd(void *arg, const struct stat *st) {
  struct held_scan *s = arg;
  if (st->st_dev == s->dev && idmap_put(s->inodes, (uint64_t)st->st_ino, s) < 0) s->oom = true;
}

/* Which chunks pid maps or holds an fd to, by the kernel's word (a worker
 * that acknowledged an unmap but kept its mapping is caught here), reading
 * its /proc entries once. A process that is gone holds nothing. */
int host_proc_chunks_held_by(void *state, int pid, const uint64_t *handles, size_t n,
                             bool *held) {
  struct host *h = state;
  struct held_scan s = {.dev = h->live_dev, .inodes = idmap_create()};
  if (!s.inodes) return gpu_fail(-ENOMEM, "out of memory");
  int rc = maps_each(pid, held_mapping, &s);
  if (rc == 0) rc = fds_each(pid, NULL, held_fd, &s);
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

/* Whether a path names a memfd of any simulated device. */
static bool any_device_memfd(const struct host *h, const char *path) {
  for (unsigned d = 0; d < h->ndev; d++)
    if (host_live_is_device_memfd(h, path, d)) return true;
  return false;
}

/* What a look for any device memory of one process needs. */
struct listed_scan {
  const struct host *h;
  bool found;
};

/* A mapping: device memory? */
static void listed_mapping(void *arg, uint64_t len, dev_t dev, ino_t ino, const char *path) {
  struct listed_scan *s = arg;
  (void)len;
  (void)dev;
  (void)ino;
  if (any_device_memfd(s->h, path)) s->found = true;
}

/* An fd's link: device memory? */
static bool listed_named(void *arg, const char *link) {
  struct listed_scan *s = arg;
  if (any_device_memfd(s->h, link)) s->found = true;
  return false;
}

/* Whether one thread's view (its mappings and fds: /proc/TID) shows
 * device memory; 0 when the thread is gone. */
static int thread_listed(struct listed_scan *s, int tid) {
  int rc = maps_each(tid, listed_mapping, s);
  if (rc == 0 && !s->found) rc = fds_each(tid, listed_named, NULL, s);
  if (rc == -ENOENT || rc == -ESRCH) return 0;
  return rc < 0 ? rc : s->found;
}

/* The model of "the driver lists pid": any thread of it maps or holds a
 * memfd of any simulated device, the daemon's or not. A process whose
 * main thread has exited while another still runs is listed for as long
 * as that one holds the memory (the main thread's own view is empty by
 * then), as a dying process stays in the driver's list for a moment; one
 * that has exited, a zombie too, holds none. */
int host_proc_listed(void *state, int pid) {
  struct listed_scan s = {.h = state};
  char p[64];
  snprintf(p, sizeof p, "/proc/%d/task", pid);
  DIR *d = opendir(p);
  if (!d) return errno == ENOENT || errno == ESRCH ? 0 : gpu_fail(-errno, "%s: %s", p, strerror(errno));
  int rc = 0;
  struct dirent *e;
  while (rc == 0 && (e = readdir(d))) {
    char *end;
    long tid = strtol(e->d_name, &end, 10);
    if (!*end && tid > 0) rc = thread_listed(&s, (int)tid);
  }
  closedir(d);
  if (rc < 0) return gpu_fail(rc, "reading /proc/%d: %s", pid, strerror(-rc));
  return rc;
}
