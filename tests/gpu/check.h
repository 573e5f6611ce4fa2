/* What the GPU check programs share: one PASS or FAIL line per check, a
 * count of failures, and (where cuda.h comes first) the driver's free
 * memory, the figure every check is judged by. */
#ifndef GPUMEM_GPU_CHECK_H
#define GPUMEM_GPU_CHECK_H

#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

static int failures;

/* Print one check's verdict and figures. */
static inline void check(bool ok, const char *name, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  printf("%s %s: ", ok ? "PASS" : "FAIL", name);
  vprintf(fmt, ap);
  printf("\n");
  fflush(stdout);
  va_end(ap);
  failures += !ok;
}

/* The words that run the build's bin/<prog> (dir bin) on the daemon at
 * sock, then args (NULL-ended): into argv (NULL-ended, at most max words
 * before the NULL) with the program's path in path, which argv[0] is. */
static inline void tool_argv(const char **argv, int max, char *path, size_t pathlen,
                             const char *bin, const char *prog, const char *sock,
                             const char *const *args) {
  snprintf(path, pathlen, "%s/%s", bin, prog);
  int n = 0;
  argv[n++] = path;
  argv[n++] = "--socket";
  argv[n++] = sock;
  for (; *args && n < max; args++) argv[n++] = *args;
  argv[n] = NULL;
}

#ifdef CUDA_VERSION
/* The driver's free memory on the current context's device. */
static inline uint64_t driver_free(void) {
  size_t f = 0, t = 0;
  cuMemGetInfo(&f, &t);
  return f;
}

/* Free memory once it stops moving (releases land asynchronously). */
static inline uint64_t settled_free(void) {
  uint64_t prev = driver_free();
  for (int i = 0; i < 50; i++) {
    usleep(20000);
    uint64_t now = driver_free();
    if (now == prev) return now;
    prev = now;
  }
  return prev;
}
#endif

#endif
