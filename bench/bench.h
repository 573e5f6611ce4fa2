/* Shared helpers for benchmarks: timing, percentiles, a daemon to run
 * against, and one JSON line per figure. */
#ifndef GPUMEM_BENCH_H
#define GPUMEM_BENCH_H

#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* Nanoseconds on the monotonic clock. */
static inline uint64_t bench_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int bench_cmp(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

/* The p-th percentile (0..100) of n samples; sorts them. */
static inline double bench_percentile(uint64_t *v, size_t n, double p) {
  qsort(v, n, sizeof *v, bench_cmp);
  size_t i = (size_t)(p / 100.0 * (double)(n - 1) + 0.5);
  return (double)v[i];
}

static int bench_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* The median of n figures; sorts them. */
static inline double bench_median(double *v, size_t n) {
  qsort(v, n, sizeof *v, bench_cmp_double);
  return v[n / 2];
}

/* Print one figure as a table row and as a JSON line on fd 3 if open. */
static inline void bench_report(const char *name, double value, const char *unit,
                                double baseline) {
  double ratio = baseline > 0 ? value / baseline : 0;
  printf("%-44s %12.2f %-6s baseline %12.2f  ratio %6.2f\n", name, value, unit, baseline, ratio);
  FILE *f = fdopen(dup(3), "w");
  if (f) {
    fprintf(f, "{\"name\":\"%s\",\"value\":%.3f,\"unit\":\"%s\",\"baseline\":%.3f,\"ratio\":%.4f}\n",
            name, value, unit, baseline, ratio);
    fclose(f);
  }
}

/* Make the private directory sockdir (a mkdtemp template; gpumemd
 * refuses a socket directory others can write, as /tmp) and the socket
 * path in it into sock; exits where it cannot. */
static inline void bench_sockdir(char *sockdir, char *sock, size_t socklen) {
  if (!mkdtemp(sockdir)) {
    perror("mkdtemp");
    exit(1);
  }
  snprintf(sock, socklen, "%s/sock", sockdir);
}

/* Start gpumemd from build dir bin with extra args; returns its pid once
 * it answers on sock. */
static inline pid_t bench_daemon(const char *bin, const char *sock, const char *const *extra) {
  pid_t pid = fork();
  if (pid == 0) {
    const char *argv[32] = {NULL};
    char path[512];
    snprintf(path, sizeof path, "%s/gpumemd", bin);
    int n = 0;
    argv[n++] = path;
    argv[n++] = "--socket";
    argv[n++] = sock;
    argv[n++] = "--log-level";
    argv[n++] = "warn";
    for (; extra && *extra && n < 31; extra++) argv[n++] = *extra;
    execv(path, (char *const *)argv);
    _exit(127);
  }
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", sock);
  for (int i = 0; i < 500; i++) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) == 0) {
      close(fd);
      return pid;
    }
    close(fd);
    usleep(10000);
  }
  fprintf(stderr, "bench: gpumemd did not start\n");
  exit(1);
}

/* Stop a daemon started by bench_daemon. */
static inline void bench_daemon_stop(pid_t pid) {
  kill(pid, SIGTERM);
  waitpid(pid, NULL, 0);
}

#endif
