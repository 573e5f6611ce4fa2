/* Pageable backup memory, made where the kernel has room for it. */
#include "pageable.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

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

/* The least headroom of the daemon's cgroup (v2) and its ancestors. */
static uint64_t cgroup_room(const char *root) {
  FILE *f = fopen("/proc/self/cgroup", "re");
  if (!f) return UINT64_MAX;
  char line[4096], rel[4096] = "";
  while (fgets(line, sizeof line, f))
    if (strncmp(line, "0::", 3) == 0) {
      snprintf(rel, sizeof rel, "%s", line + 3);
      rel[strcspn(rel, "\n")] = '\0';
      break;
    }
  fclose(f);
  uint64_t least = UINT64_MAX;
  for (;;) {
    char max[8192], cur[8192];
    snprintf(max, sizeof max, "%s%s/memory.max", root, rel);
    snprintf(cur, sizeof cur, "%s%s/memory.current", root, rel);
    uint64_t m = read_number(max), c = read_number(cur);
    if (m != UINT64_MAX && c != UINT64_MAX) {
      uint64_t room = m > c ? m - c : 0;
      if (room < least) least = room;
    }
    char *slash = strrchr(rel, '/');
    if (!slash || !rel[0]) break;
    *slash = '\0';
  }
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
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                 -1, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    snprintf(why, whylen, "mmap of %" PRIu64 " bytes: %s", size, strerror(e));
    return -e;
  }
  *host = p;
  return 0;
}

/* Free pageable backup memory. */
void pageable_free(void *host, uint64_t size) {
  if (host) munmap(host, size);
}
