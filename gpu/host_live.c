/* The host backend's chunks that the daemon holds, known by inode, and
 * the names that make a memfd device memory of a simulated device. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "error.h"
#include "host.h"

/* Count a chunk as the daemon's own, by inode. */
int host_live_add(struct host *h, int fd, unsigned dev) {
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
void host_live_del(struct host *h, int fd) {
  struct stat st;
  if (fstat(fd, &st) == 0) idmap_del(h->live, (uint64_t)st.st_ino);
}

/* True if the file is a chunk the daemon holds. */
bool host_live_has(const struct host *h, dev_t dev, ino_t ino) {
  return dev == h->live_dev && idmap_get(h->live, (uint64_t)ino) != NULL;
}

/* The device whose memfd path names, by its name alone; -1 if none. */
int host_live_device_of(const struct host *h, const char *path) {
  char name[64];
  int len = snprintf(name, sizeof name, "/memfd:gpumem-host-%s:", h->node);
  if (strncmp(path, name, (size_t)len) != 0) return -1;
  const char *p = path + len;
  unsigned dev = 0;
  if (*p < '0' || *p > '9' || (*p == '0' && p[1] >= '0' && p[1] <= '9')) return -1;
  for (; *p >= '0' && *p <= '9'; p++) {
    dev = dev * 10 + (unsigned)(*p - '0');
    if (dev >= h->ndev) return -1;
  }
  return *p == '\0' || strcmp(p, " (deleted)") == 0 ? (int)dev : -1;
}

/* True if path names a memfd of device dev, by its name alone. */
bool host_live_is_device_memfd(const struct host *h, const char *path, unsigned dev) {
  return host_live_device_of(h, path) == (int)dev;
}
