/* Test harness: fd-leak fixtures, a real daemon and real worker processes. */
#ifndef GPUMEM_TEST_HARNESS_H
#define GPUMEM_TEST_HARNESS_H

#include <check.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

/* Run one suite: each test in its own process, with a timeout (seconds)
 * and the fixture (NULLs for harness_fd_setup/teardown); the exit status
 * for main. */
int harness_run(const char *name, const TTest *const *tests, size_t n, double timeout,
                void (*setup)(void), void (*teardown)(void));

#define HARNESS_RUN(name, timeout, setup, teardown, ...)                                  \
  harness_run(name, (const TTest *const[]){__VA_ARGS__},                                  \
              sizeof((const TTest *const[]){__VA_ARGS__}) / sizeof(const TTest *), timeout, \
              setup, teardown)

/* Open fds of this process. */
int harness_fd_count(void);

/* Checked fixture pair: teardown fails the test if fds leaked. */
void harness_fd_setup(void);
void harness_fd_teardown(void);

/* A daemon started for one test, in its own directory. */
struct daemon {
  pid_t pid;
  char dir[64];
  char socket[96];
  char log[128];
};

/* Path of a built program ("gpumemd", "gpumem-worker", ...). */
const char *harness_bin(const char *name);

/* Start gpumemd with extra arguments (NULL-terminated) and wait until it
 * answers. Fails the test if it does not. */
void daemon_start(struct daemon *d, ...);

/* Start gpumemd on an existing socket path; returns its pid (no wait). */
pid_t daemon_spawn(const char *socket, const char *log, const char *const *argv_extra);

/* Stop the daemon with SIGTERM; returns its exit status (-1: killed). */
int daemon_stop(struct daemon *d);

/* A worker process with its output in a file. */
struct worker {
  pid_t pid;
  char out[160];
};

/* Start gpumem-worker against d with extra arguments (NULL-terminated)
 * and wait for its "ready" line. */
void worker_start(struct worker *w, const struct daemon *d, ...);

/* Wait until the worker's output has count lines containing text. */
bool worker_wait_for(const struct worker *w, const char *text, int count, int timeout_ms);

/* Number of output lines containing text. */
int worker_count(const struct worker *w, const char *text);

/* The worker's whole output (static buffer). */
const char *worker_output(const struct worker *w);

/* Send sig and reap; returns exit status, or 128+signal if killed. */
int worker_stop(struct worker *w, int sig);

/* Bytes of the host backend's memfds that these processes hold by fd or
 * mapping, each counted once (the kernel's figure, not machine-wide). */
uint64_t memfd_bytes(const pid_t *pids, size_t npids);

/* Milliseconds on the monotonic clock. */
double now_ms(void);

/* Connect a raw socket to the daemon. */
int raw_connect(const struct daemon *d);

#endif
