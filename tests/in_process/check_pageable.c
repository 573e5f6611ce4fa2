/* Pageable backup memory (daemon/pageable.c): the room it sees is the
 * least of MemAvailable and the headroom of each memory cgroup the
 * process is in, from the kernel's files (here a made-up copy of them),
 * and memory past that room is refused, saying so. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/pageable.h"
#include "harness.h"

/* Write text to the file at path. */
static void put(const char *path, const char *text) {
  FILE *f = fopen(path, "we");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
}

/* mkdir -p of a path. */
static void mkdirs(char *path) {
  for (char *p = path + 1; *p; p++)
    if (*p == '/') {
      *p = '\0';
      mkdir(path, 0700);
      *p = '/';
    }
  mkdir(path, 0700);
}

/* This process's cgroup (v2) path, "" at the root or without one. */
static void own_cgroup(char *rel, size_t len) {
  FILE *f = fopen("/proc/self/cgroup", "re");
  char line[4096];
  rel[0] = '\0';
  while (f && fgets(line, sizeof line, f))
    if (strncmp(line, "0::", 3) == 0) {
      snprintf(rel, len, "%s", line + 3);
      rel[strcspn(rel, "\n")] = '\0';
    }
  if (f) fclose(f);
  if (strcmp(rel, "/") == 0) rel[0] = '\0';
}

/* This process's cgroup v1 memory controller path (false: none). */
static bool own_v1_memory(char *rel, size_t len) {
  FILE *f = fopen("/proc/self/cgroup", "re");
  char line[4096];
  bool found = false;
  while (f && !found && fgets(line, sizeof line, f)) {
    line[strcspn(line, "\n")] = '\0';
    char *ctrl = strchr(line, ':');
    char *path = ctrl ? strchr(ctrl + 1, ':') : NULL;
    if (!path) continue;
    *path++ = '\0';
    if (strcmp(ctrl + 1, "memory") == 0 || strstr(ctrl + 1, "memory,") || strstr(ctrl + 1, ",memory")) {
      snprintf(rel, len, "%s", strcmp(path, "/") == 0 ? "" : path);
      found = true;
    }
  }
  if (f) fclose(f);
  return found;
}

START_TEST(the_room_is_the_least_the_kernel_gives) {
  char dir[] = "/tmp/gpumem-pageable.XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  char meminfo[128], root[128], cg[8192], path[8400], rel[4096];
  snprintf(meminfo, sizeof meminfo, "%s/meminfo", dir);
  snprintf(root, sizeof root, "%s/cg", dir);
  put(meminfo, "MemTotal:       1000000 kB\nMemFree:         10 kB\nMemAvailable:     2048 kB\n");
  own_cgroup(rel, sizeof rel);
  snprintf(cg, sizeof cg, "%s%s", root, rel);
  mkdirs(cg);
  /* No cgroup figures: MemAvailable alone. */
  ck_assert_uint_eq(pageable_room(meminfo, root), 2048 * 1024);
  /* The own cgroup leaves 1 MiB; an unlimited one says max. */
  snprintf(path, sizeof path, "%s/memory.max", cg);
  put(path, "4194304\n");
  snprintf(path, sizeof path, "%s/memory.current", cg);
  put(path, "3145728\n");
  ck_assert_uint_eq(pageable_room(meminfo, root), 1024 * 1024);
  snprintf(path, sizeof path, "%s/memory.max", cg);
  put(path, "max\n");
  ck_assert_uint_eq(pageable_room(meminfo, root), 2048 * 1024);
  /* A cgroup over its limit leaves nothing. */
  put(path, "1000\n");
  ck_assert_uint_eq(pageable_room(meminfo, root), 0);
  /* A v1 memory controller's limit counts too, where the process has one. */
  char v1[4096];
  if (own_v1_memory(v1, sizeof v1)) {
    snprintf(path, sizeof path, "%s/memory.max", cg);
    unlink(path);
    char v1dir[4300];
    snprintf(v1dir, sizeof v1dir, "%s/memory%s", root, v1);
    mkdirs(v1dir);
    snprintf(path, sizeof path, "%s/memory.limit_in_bytes", v1dir);
    put(path, "3145728\n");
    snprintf(path, sizeof path, "%s/memory.usage_in_bytes", v1dir);
    put(path, "2097152\n");
    ck_assert_uint_eq(pageable_room(meminfo, root), 1024 * 1024);
  }
  /* Nothing readable: no figure says no. */
  ck_assert_uint_eq(pageable_room("/nonexistent/meminfo", "/nonexistent"), UINT64_MAX);
  char cmd[256];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  ck_assert_int_eq(system(cmd), 0);
}
END_TEST

START_TEST(memory_past_the_room_is_refused_and_some_is_made) {
  void *p = NULL;
  char why[256] = "";
  ck_assert_int_eq(pageable_make(UINT64_MAX / 2, &p, why, sizeof why), -ENOMEM);
  ck_assert_ptr_nonnull(strstr(why, "the kernel says are available"));
  ck_assert_int_eq(pageable_make(1 << 20, &p, why, sizeof why), 0);
  memset(p, 0x5a, 1 << 20);
  pageable_free(p, 1 << 20);
}
END_TEST

int main(void) {
  return HARNESS_RUN("pageable", 10, NULL, NULL, the_room_is_the_least_the_kernel_gives,
                     memory_past_the_room_is_refused_and_some_is_made);
}
