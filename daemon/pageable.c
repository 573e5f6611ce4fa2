/* Pageable backup memory, made where the kernel has room for it. */
#include "pageable.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The first number in a file, or UINT64_MAX when it cannot be read or
 * says "max". */
static uint64_t read_number(const char *path) {
  FILE *f = fopen(path, "re");
  if (!f) return UINT64_MAX;
  char buf[64] = "";
  uint64_t v = UINT64_MAX;
  if (fgets(buf, sizeof buf, f) && strncmp(buf, "max", 3) != 0) {
    char *end = NULL;
    errno = 0;
    unsigned long long n = strtoull(buf, &end, 10);
    if (!errno && end != buf) v = n;
  }
  fclose(f);
  return v;
}

/* MemAvailable from a meminfo file, in bytes (UINT64_MAX when absent). */
static uint64_t mem_available(const char *meminfo) {
  FILE *f = fopen(meminfo, "re");
  if (!f) return UINT64_MAX;
  char line[128];
  uint64_t v = UINT64_MAX;
  unsigned long long kb;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
      v = (uint64_t)kb * 1024;
      break;
    }
  fclose(f);
  return v;
}

/* The least headroom (limit less usage, by the files named so) of the
 * cgroup at dir+rel and of its ancestors up to dir. */
static uint64_t walk_room(const char *dir, const char *rel_in, const char *limit_file,
                          const char *usage_file) {
  char rel[4096];
  snprintf(rel, sizeof rel, "%s", rel_in);
  if (strstr(rel, "/..")) rel[0] = '\0'; /* outside the namespace's root: its root only */
  uint64_t least = UINT64_MAX;
  for (;;) {
    char lim[8192], use[8192];
    snprintf(lim, sizeof lim, "%s%s/%s", dir, rel, limit_file);
    snprintf(use, sizeof use, "%s%s/%s", dir, rel, usage_file);
    uint64_t l = read_number(lim), u = read_number(use);
    if (l != UINT64_MAX && u != UINT64_MAX) {
      uint64_t room = l > u ? l - u : 0;
      if (room < least) least = room;
    }
    char *slash = strrchr(rel, '/');
    if (!slash || !rel[0]) break;
    *slash = '\0';
  }
  return least;
}

/* The least headroom of the daemon's memory cgroups and their ancestors:
 * v2 (memory.max less memory.current) and v1's memory controller
 * (memory.limit_in_bytes less memory.usage_in_bytes), whichever the
 * host has. */
static uint64_t cgroup_room(const char *root) {
  FILE *f = fopen("/proc/self/cgroup", "re");
  if (!f) return UINT64_MAX;
  char line[4096];
  uint64_t least = UINT64_MAX;
  while (fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = '\0';
    /* "hierarchy-id:controllers:path" */
    char *ctrl = strchr(line, ':');
    if (!ctrl) continue;
    *ctrl++ = '\0';
    char *path = strchr(ctrl, ':');
    if (!path) continue;
    *path++ = '\0';
    uint64_t room = UINT64_MAX;
    if (strcmp(line, "0") == 0 && !*ctrl) {
      room = walk_room(root, path, "memory.max", "memory.current");
    } else if (strcmp(ctrl, "memory") == 0 || strstr(ctrl, "memory,") || strstr(ctrl, ",memory")) {
      char dir[4096];
      snprintf(dir, sizeof dir, "%s/memory", root);
      room = walk_room(dir, path, "memory.limit_in_bytes", "memory.usage_in_bytes");
    }
    if (room < least) least = room;
  }
  fclose(f);
  return least;
}

/* What the kernel says could be made now. */
uint64_t pageable_room(const char *meminfo, const char *cgroup_root) {
  uint64_t a = mem_available(meminfo ? meminfo : "/proc/meminfo");
  uint64_t c = cgroup_room(cgroup_root ? cgroup_root : "/sys/fs/cgroup");
  return a < c ? a : c;
}

/* Make and fault in size bytes, if there is room. */
int pageable_make(uint64_t size, void **host, char *why, size_t whylen) {
  uint64_t room = pageable_room(NULL, NULL);
  if (size > room) {
    snprintf(why, whylen,
             "%" PRIu64 " bytes of pageable memory do not fit the %" PRIu64
             " the kernel says are available (MemAvailable, the memory cgroup's headroom)",
             size, room);
    return -ENOMEM;
  }
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    snprintf(why, whylen, "mmap of %" PRIu64 " bytes: %s", size, strerror(e));
    return -e;
  }
  madvise(p, size, MADV_HUGEPAGE); /* fewer faults; a kernel without THP says no */
  /* Faulted in now, so that the copy never finds the memory missing (a
   * kernel before 5.14 has no MADV_POPULATE_WRITE: a write per page). */
  if (madvise(p, size, MADV_POPULATE_WRITE) < 0) {
    int e = errno;
    if (e != EINVAL) {
      munmap(p, size);
      snprintf(why, whylen, "faulting in %" PRIu64 " bytes of pageable memory: %s", size,
               strerror(e));
      return -e;
    }
    for (uint64_t off = 0; off < size; off += 4096) ((volatile char *)p)[off] = 0;
  }
  *host = p;
  return 0;
}

/* Free pageable backup memory. */
void pageable_free(void *host, uint64_t size) {
  if (host) munmap(host, size);
}

/* Write into an owner's memfd what it asked to read. */
int pageable_copy_into(int fd, const void *host, uint64_t size, char *why, size_t whylen) {
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    snprintf(why, whylen, "the memory sent is not a memfd made with MFD_ALLOW_SEALING");
    return -EINVAL;
  }
  if (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) {
    snprintf(why, whylen, "the memfd sent is sealed against writes");
    return -EINVAL;
  }
  /* No shrinking from now on: a write never meets a file cut short. */
  if (!(seals & F_SEAL_SHRINK) && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) < 0) {
    snprintf(why, whylen, "the memfd sent cannot be sealed against shrinking: %s",
             strerror(errno));
    return -EINVAL;
  }
  struct stat st;
  if (fstat(fd, &st) < 0 || (uint64_t)st.st_size < size) {
    snprintf(why, whylen, "the memfd sent holds %lld bytes, not the %" PRIu64 " of the backup",
             (long long)st.st_size, size);
    return -EINVAL;
  }
  /* Its pages made by the sender, so that they are its memory: the
   * daemon's writes would make them, charged to the daemon. */
  if ((uint64_t)st.st_blocks * 512 < size) {
    snprintf(why, whylen, "the memfd sent has %llu of its %" PRIu64 " bytes made: fallocate it "
             "first", (unsigned long long)st.st_blocks * 512, size);
    return -EINVAL;
  }
  for (uint64_t done = 0; done < size;) {
    size_t len = size - done > (1u << 30) ? (1u << 30) : (size_t)(size - done);
    ssize_t w = pwrite(fd, (const char *)host + done, len, (off_t)done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      int e = w < 0 ? errno : ENOSPC;
      snprintf(why, whylen, "writing the backup into the memfd sent, at %" PRIu64 ": %s", done,
               strerror(e));
      return -e;
    }
    done += (uint64_t)w;
  }
  return 0;
}
