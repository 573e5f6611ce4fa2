/* For the tests, under LD_PRELOAD: fopen("/proc/meminfo") opens the
 * file $GPUMEM_TEST_MEMINFO instead, so that a daemon sees as much
 * available memory as a test says. It is never shipped. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
