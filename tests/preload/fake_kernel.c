/* For the tests, under LD_PRELOAD, what the kernel says as a test says:
 * fopen("/proc/meminfo") opens the file $GPUMEM_TEST_MEMINFO instead (the
 * memory available to a daemon), and fstatvfs reports the filesystem
 * read-only where $GPUMEM_TEST_STATVFS is "ro", and with as many bytes
 * free as it says where it is "free=BYTES" (a backup directory's disk);
 * fallocate of files (not memfds) fails with ENOSPC once the bytes asked
 * for pass $GPUMEM_TEST_DISK_FULL_AFTER (a disk that fills as the daemon
 * writes). It is never shipped. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <sys/statvfs.h>
#include <unistd.h>

/* The file to open instead of path. */
static const char *instead(const char *path) {
  const char *m = getenv("GPUMEM_TEST_MEMINFO");
  return m && path && strcmp(path, "/proc/meminfo") == 0 ? m : path;
}

/* fopen, through the next definition. */
__attribute__((visibility("default"))) FILE *fopen(const char *path, const char *mode) {
  static FILE *(*real)(const char *, const char *);
  if (!real) real = (FILE * (*)(const char *, const char *)) dlsym(RTLD_NEXT, "fopen");
  return real(instead(path), mode);
}

/* fopen64, the same. */
__attribute__((visibility("default"))) FILE *fopen64(const char *path, const char *mode) {
  static FILE *(*real)(const char *, const char *);
  if (!real) real = (FILE * (*)(const char *, const char *)) dlsym(RTLD_NEXT, "fopen64");
  return real(instead(path), mode);
}

/* fstatvfs, through the next definition, then as $GPUMEM_TEST_STATVFS says. */
__attribute__((visibility("default"))) int fstatvfs(int fd, struct statvfs *st) {
  static int (*real)(int, struct statvfs *);
  if (!real) real = (int (*)(int, struct statvfs *))dlsym(RTLD_NEXT, "fstatvfs");
  int rc = real(fd, st);
  const char *say = getenv("GPUMEM_TEST_STATVFS");
  if (rc < 0 || !say) return rc;
  if (strcmp(say, "ro") == 0) st->f_flag |= ST_RDONLY;
  if (strncmp(say, "free=", 5) == 0 && st->f_frsize)
    st->f_bavail = strtoull(say + 5, NULL, 10) / st->f_frsize;
  return rc;
}

/* Bytes fallocate has given files so far. */
static atomic_ullong allocated;

/* fallocate, through the next definition, until the made-up disk is full. */
__attribute__((visibility("default"))) int fallocate(int fd, int mode, off_t off, off_t len) {
  static int (*real)(int, int, off_t, off_t);
  if (!real) real = (int (*)(int, int, off_t, off_t))dlsym(RTLD_NEXT, "fallocate");
  const char *full = getenv("GPUMEM_TEST_DISK_FULL_AFTER");
  char link[64], target[256] = "";
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, target, sizeof target - 1);
  if (n > 0) target[n] = '\0';
  if (full && strncmp(target, "/memfd:", 7) != 0 &&
      atomic_fetch_add(&allocated, (unsigned long long)len) + (unsigned long long)len >
          strtoull(full, NULL, 10)) {
    errno = ENOSPC;
    return -1;
  }
  return real(fd, mode, off, len);
}
