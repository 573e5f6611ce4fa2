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
#include <time.h>
#include <unistd.h>

#include "error.h"
#include "host.h"

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

/* How often a view walks /proc for processes that came or went. */
#define VIEW_WALK_NS (1000ull * 1000 * 1000)
/* How long a process that maps and holds no device memory goes unread by
 * views: between half of this and this (spread by pid, so that a node's
 * processes are not all read again in one walk). */
#define VIEW_IDLE_NS (10000ull * 1000 * 1000)

/* A device memfd one process maps or holds, as /proc said. */
struct seen_file {
  dev_t dev;
  ino_t ino;
  unsigned device;
  uint64_t mapped; /* bytes of its mappings */
  uint64_t held;   /* its committed bytes, where the process holds an fd */
  bool has_fd;
  bool live;       /* a chunk the daemon held when it was read */
};

/* What /proc said of one process when it was last read. */
struct seen {
  int pid;
  ino_t dir;        /* its /proc entry's inode: a new process under an old pid has another */
  uint64_t read_ns; /* when (0: never) */
  uint64_t walk;    /* the last walk that found it */
  struct seen_file *v;
  size_t n, cap;
  int scan_dev;     /* the device of the fd being read */
  bool oom;
};

/* Every process /proc showed at the last walk, but the daemon's own. */
struct host_seen {
  idmap *by_pid;      /* pid -> struct seen */
  struct seen **order; /* in the walk's order */
  size_t n, cap;
  uint64_t walk;
  uint64_t walked_ns;   /* when the last walk was */
  uint64_t all_read_ns; /* when the last walk that read every process began */
};

/* Nanoseconds on the monotonic clock (uv_hrtime's). */
static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* What reading one process needs: the host, the process, and its files
 * found so far by inode (index + 1: a process may map thousands). */
struct seen_scan {
  const struct host *h;
  struct seen *p;
  idmap *at;
};

/* The entry for a file of a process, added if new; NULL out of memory. */
static struct seen_file *seen_file_at(struct seen_scan *s, dev_t dev, ino_t ino, unsigned device) {
  struct seen *p = s->p;
  uintptr_t i = (uintptr_t)idmap_get(s->at, (uint64_t)ino);
  if (i && p->v[i - 1].dev == dev) return &p->v[i - 1];
  for (size_t k = 0; i && k < p->n; k++) /* another filesystem's inode of that number */
    if (p->v[k].dev == dev && p->v[k].ino == ino) return &p->v[k];
  if (p->n == p->cap) {
    size_t cap = p->cap ? p->cap * 2 : 4;
    struct seen_file *v = realloc(p->v, cap * sizeof *v);
    if (!v) return NULL;
    p->v = v;
    p->cap = cap;
  }
  p->v[p->n] = (struct seen_file){.dev = dev, .ino = ino, .device = device};
  if (!i && idmap_put(s->at, (uint64_t)ino, (void *)(uintptr_t)(p->n + 1)) < 0) return NULL;
  return &p->v[p->n++];
}

/* A mapping of device memory: count its bytes. */
static void seen_mapping(void *arg, uint64_t len, dev_t dev, ino_t ino, const char *path) {
  struct seen_scan *s = arg;
  int d = host_live_device_of(s->h, path);
  if (d < 0) return;
  struct seen_file *f = seen_file_at(s, dev, ino, (unsigned)d);
  if (f) f->mapped += len;
  else s->p->oom = true;
}

/* Whether an fd's link names device memory (its device noted). */
static bool seen_named(void *arg, const char *link) {
  struct seen_scan *s = arg;
  s->p->scan_dev = host_live_device_of(s->h, link);
  return s->p->scan_dev >= 0;
}

/* An fd of device memory: note what the memfd commits. */
static void seen_fd(void *arg, const struct stat *st) {
  struct seen_scan *s = arg;
  struct seen_file *f = seen_file_at(s, st->st_dev, st->st_ino, (unsigned)s->p->scan_dev);
  if (!f) {
    s->p->oom = true;
    return;
  }
  f->has_fd = true;
  f->held = (uint64_t)st->st_blocks * 512;
}

/* Note which of the files read are the daemon's chunks now. */
static void seen_mark_live(const struct host *h, struct seen *p) {
  for (size_t i = 0; i < p->n; i++) p->v[i].live = host_live_has(h, p->v[i].dev, p->v[i].ino);
}

/* Whether the daemon has let go of a chunk the process held when it was
 * read: whether the process still holds it, a new reading says. */
static bool seen_chunk_gone(const struct host *h, const struct seen *p) {
  for (size_t i = 0; i < p->n; i++)
    if (p->v[i].live && !host_live_has(h, p->v[i].dev, p->v[i].ino)) return true;
  return false;
}

/* Read what a process maps and holds of device memory, now. A process
 * that cannot be read holds none. */
static void seen_read(const struct host *h, struct seen *p) {
  struct seen_scan s = {.h = h, .p = p, .at = idmap_create()};
  p->n = 0;
  p->oom = !s.at;
  p->read_ns = now_ns();
  if (s.at && maps_each(p->pid, seen_mapping, &s) == 0) fds_each(p->pid, seen_named, seen_fd, &s);
  idmap_destroy(s.at);
  seen_mark_live(h, p);
  if (p->oom) p->read_ns = 0; /* read again next time */
}

/* Bytes of dev's memory a process holds outside the daemon, by what it
 * was last seen with: each memfd once, by what it commits where the
 * process holds an fd to it, else by the bytes it maps. */
static uint64_t seen_outside(const struct host *h, const struct seen *p, unsigned dev) {
  uint64_t bytes = 0;
  for (size_t i = 0; i < p->n; i++) {
    const struct seen_file *f = &p->v[i];
    if (f->device == dev && !f->live && !host_live_has(h, f->dev, f->ino))
      bytes += f->has_fd ? f->held : f->mapped;
  }
  return bytes;
}

/* Whether a view begun at since_ns may take a process as last read: one
 * with device memory if read since, or less than VIEW_WALK_NS before (a
 * process holding thousands of chunks costs milliseconds to read: once a
 * second, not once per page of each status); one without if read
 * VIEW_IDLE_NS ago or a little less. */
static bool seen_fresh(const struct seen *p, uint64_t since_ns, uint64_t now) {
  if (!p->read_ns) return false;
  if (p->n) return p->read_ns >= since_ns || now - p->read_ns < VIEW_WALK_NS;
  uint64_t spread = (uint64_t)p->pid * 0x9e3779b97f4a7c15ull % (VIEW_IDLE_NS / 2); /* by pid */
  return now - p->read_ns < VIEW_IDLE_NS / 2 + spread;
}

/* Whether the process an entry was read from has exited (its /proc entry
 * gone, or another process's under its pid): one stat. */
static bool seen_gone(const struct seen *p) {
  char path[32];
  struct stat st;
  snprintf(path, sizeof path, "/proc/%d", p->pid);
  return stat(path, &st) != 0 || st.st_ino != p->dir;
}

/* Free a process's entry. */
static void seen_free(struct seen *p) {
  if (!p) return;
  free(p->v);
  free(p);
}

/* Walk /proc: every process but the daemon's own gets an entry (read
 * again if all is set, new, or not fresh for a view begun at since_ns),
 * those gone are dropped. Out of memory, -ENOMEM (every entry dropped). */
static int seen_walk(struct host *h, struct host_seen *c, bool all, uint64_t since_ns) {
  DIR *d = opendir("/proc");
  if (!d) return gpu_fail(-errno, "/proc: %s", strerror(errno));
  uint64_t now = now_ns();
  int self = getpid(), rc = 0;
  c->walk++;
  c->n = 0;
  struct dirent *e;
  while (rc == 0 && (e = readdir(d))) {
    char *end;
    long pid = strtol(e->d_name, &end, 10);
    if (*end || pid <= 0 || pid == self) continue;
    struct seen *p = idmap_get(c->by_pid, (uint64_t)pid);
    if (p && p->dir != e->d_ino) p->read_ns = 0; /* another process under that pid */
    if (!p) {
      if (!(p = calloc(1, sizeof *p)) || idmap_put(c->by_pid, (uint64_t)pid, p) < 0) {
        free(p);
        rc = -ENOMEM;
        break;
      }
      p->pid = (int)pid;
    }
    p->dir = e->d_ino;
    p->walk = c->walk;
    if (c->n == c->cap) {
      size_t cap = c->cap ? c->cap * 2 : 256;
      struct seen **v = realloc(c->order, cap * sizeof *v);
      if (!v) {
        rc = -ENOMEM;
        break;
      }
      c->order = v;
      c->cap = cap;
    }
    c->order[c->n++] = p;
    if (all || !seen_fresh(p, since_ns, now)) {
      seen_read(h, p);
      if (p->oom) rc = -ENOMEM;
    }
  }
  closedir(d);
  /* Those the walk did not find are gone (all of them, cut short: the
   * next walk finds those that are not). */
  size_t n = idmap_count(c->by_pid);
  void **all_seen = malloc((n + 1) * sizeof *all_seen);
  n = all_seen ? idmap_values(c->by_pid, all_seen, n) : 0;
  for (size_t i = 0; i < n; i++) {
    struct seen *p = all_seen[i];
    if (p->walk == c->walk && rc == 0) continue;
    idmap_del(c->by_pid, (uint64_t)p->pid);
    seen_free(p);
  }
  free(all_seen);
  if (rc < 0) {
    c->n = 0;
    c->walked_ns = c->all_read_ns = 0;
    return gpu_fail(rc, "out of memory");
  }
  c->walked_ns = now;
  if (all) c->all_read_ns = now;
  return 0;
}

/* The entries, made on first use. */
static struct host_seen *seen_of(struct host *h) {
  if (!h->seen && (h->seen = calloc(1, sizeof *h->seen)) && !(h->seen->by_pid = idmap_create())) {
    free(h->seen);
    h->seen = NULL;
  }
  return h->seen;
}

/* Free every entry (the backend closing). */
void host_proc_forget(struct host *h) {
  struct host_seen *c = h->seen;
  if (!c) return;
  size_t n = idmap_count(c->by_pid);
  void **v = malloc((n + 1) * sizeof *v);
  n = v ? idmap_values(c->by_pid, v, n) : 0;
  for (size_t i = 0; i < n; i++) seen_free(v[i]);
  free(v);
  idmap_destroy(c->by_pid);
  free(c->order);
  free(c);
  h->seen = NULL;
}

/* List into out (at most max, the number found in *n) every process
 * holding memory of dev outside the daemon, as the entries say. */
static void seen_list(const struct host *h, const struct host_seen *c, unsigned dev,
                      struct gpudev_process *out, size_t max, size_t *n) {
  for (size_t i = 0; i < c->n; i++) {
    if (seen_chunk_gone(h, c->order[i])) seen_read(h, c->order[i]); /* freed since: held still? */
    uint64_t bytes = seen_outside(h, c->order[i], dev);
    if (!bytes) continue;
    if (*n < max) out[*n] = (struct gpudev_process){.pid = c->order[i]->pid, .used = bytes};
    ++*n;
  }
}

/* A list of dev's processes begins: none yet in *n, the entries in *c;
 * -ENODEV for a device there is not, -ENOMEM. */
static int seen_start(struct host *h, unsigned dev, size_t *n, struct host_seen **c) {
  *n = 0;
  if (dev >= h->ndev) return gpu_fail(-ENODEV, "no device %u", dev);
  if (!(*c = seen_of(h))) return gpu_fail(-ENOMEM, "out of memory");
  return 0;
}

/* Every process that maps or holds memfds of dev the daemon did not make,
 * read from /proc at or after since_ns: the model of the driver's
 * per-process list. The daemon's own process is left out (its memfds are
 * its chunks); processes of other users are seen only by a daemon that
 * may read their /proc entries. One walk serves every device. */
int host_proc_since(void *state, unsigned dev, uint64_t since_ns, struct gpudev_process *out,
                    size_t max, size_t *n) {
  struct host *h = state;
  struct host_seen *c;
  int rc = seen_start(h, dev, n, &c);
  if (rc < 0) return rc;
  if (!c->all_read_ns || c->all_read_ns < since_ns) {
    if ((rc = seen_walk(h, c, true, since_ns)) < 0) return rc;
  }
  seen_list(h, c, dev, out, max, n);
  return 0;
}

/* The same list read now (the table's processes). */
int host_proc_processes(void *state, unsigned dev, struct gpudev_process *out, size_t max,
                        size_t *n) {
  return host_proc_since(state, dev, now_ns(), out, max, n);
}

/* The same list for a view (status, top) begun at since_ns: processes
 * that came are found by a walk at most VIEW_WALK_NS old; one with device
 * memory is read at or after since_ns or VIEW_WALK_NS before at most (and
 * left out once it has exited), one without (most of a node's)
 * VIEW_IDLE_NS before at most. */
int host_proc_view(void *state, unsigned dev, uint64_t since_ns, struct gpudev_process *out,
                   size_t max, size_t *n) {
  struct host *h = state;
  struct host_seen *c;
  int rc = seen_start(h, dev, n, &c);
  if (rc < 0) return rc;
  uint64_t now = now_ns();
  if (!c->walked_ns || now - c->walked_ns >= VIEW_WALK_NS) {
    if ((rc = seen_walk(h, c, false, since_ns)) < 0) return rc;
  } else {
    for (size_t i = 0; i < c->n; i++) {
      struct seen *p = c->order[i];
      if (!p->n) continue;
      if (!seen_fresh(p, since_ns, now)) seen_read(h, p);
      else if (seen_gone(p)) seen_read(h, p); /* exited (nothing read), or its entry made anew */
    }
  }
  seen_list(h, c, dev, out, max, n);
  return 0;
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
  if (host_live_device_of(s->h, path) >= 0) s->found = true;
}

/* An fd's link: device memory? */
static bool listed_named(void *arg, const char *link) {
  struct listed_scan *s = arg;
  if (host_live_device_of(s->h, link) >= 0) s->found = true;
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
