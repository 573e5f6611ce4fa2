#include "harness.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int fds_at_setup;

/* Open fds of this process. */
int harness_fd_count(void) {
  DIR *d = opendir("/proc/self/fd");
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - 1; /* the directory's own fd */
}

/* Run one suite with Check: every test forks, has a timeout and the
 * fixture, which by default fails tests that leak fds. */
int harness_run(const char *name, const TTest *const *tests, size_t n, double timeout,
                void (*setup)(void), void (*teardown)(void)) {
  Suite *s = suite_create(name);
  TCase *tc = tcase_create(name);
  tcase_add_checked_fixture(tc, setup ? setup : harness_fd_setup,
                            teardown ? teardown : harness_fd_teardown);
  tcase_set_timeout(tc, timeout);
  for (size_t i = 0; i < n; i++) tcase_add_test(tc, tests[i]);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? 1 : 0;
}

/* Record the fds open before a test. */
void harness_fd_setup(void) { fds_at_setup = harness_fd_count(); }

/* Fail the test if it leaves fds behind. */
void harness_fd_teardown(void) {
  int now = harness_fd_count();
  ck_assert_msg(now == fds_at_setup, "fd leak: %d open before the test, %d after",
                fds_at_setup, now);
}

/* Milliseconds on the monotonic clock. */
double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Path of a built program. */
const char *harness_bin(const char *name) {
  static char path[4][512];
  static int next;
  const char *build = getenv("GPUMEM_BUILD");
  char *p = path[next++ % 4];
  snprintf(p, sizeof path[0], "%s/bin/%s", build ? build : "build", name);
  return p;
}

/* Exec with stdout and stderr into a file. */
static pid_t spawn(const char *const *argv, const char *out) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    int fd = open(out, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    close_range(3, ~0u, 0); /* nothing inherited: fd figures are the program's own */
    execv(argv[0], (char *const *)argv);
    _exit(127);
  }
  return pid;
}

/* Start gpumemd on an existing socket path. */
pid_t daemon_spawn(const char *socket, const char *log, const char *const *extra) {
  const char *argv[32] = {harness_bin("gpumemd"), "--socket", socket, "--log-level", "debug",
                          "--backend", "host"};
  int n = 7;
  for (; extra && *extra && n < 31; extra++) argv[n++] = *extra;
  argv[n] = NULL;
  return spawn(argv, log);
}

/* Connect a raw socket to the daemon. */
int raw_connect(const struct daemon *d) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", d->socket);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Start gpumemd and wait until it answers. */
void daemon_start(struct daemon *d, ...) {
  snprintf(d->dir, sizeof d->dir, "/tmp/gpumemd-test.XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(d->dir));
  snprintf(d->socket, sizeof d->socket, "%s/sock", d->dir);
  snprintf(d->log, sizeof d->log, "%s/daemon.log", d->dir);
  const char *extra[24];
  int n = 0;
  va_list ap;
  va_start(ap, d);
  for (const char *a; n < 23 && (a = va_arg(ap, const char *));) extra[n++] = a;
  va_end(ap);
  extra[n] = NULL;
  d->pid = daemon_spawn(d->socket, d->log, extra);
  for (int i = 0; i < 500; i++) {
    int fd = raw_connect(d);
    if (fd >= 0) {
      close(fd);
      return;
    }
    if (waitpid(d->pid, NULL, WNOHANG) == d->pid) break;
    sleep_ms(10);
  }
  ck_abort_msg("gpumemd did not start; see %s", d->log);
}

/* Stop the daemon with SIGTERM. */
int daemon_stop(struct daemon *d) {
  int status = -1;
  if (d->pid > 0) {
    kill(d->pid, SIGTERM);
    waitpid(d->pid, &status, 0);
    d->pid = 0;
  }
  char cmd[160];
  snprintf(cmd, sizeof cmd, "rm -rf %s", d->dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", d->dir);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The worker's whole output. */
const char *worker_output(const struct worker *w) {
  static char buf[1 << 16];
  buf[0] = '\0';
  FILE *f = fopen(w->out, "r");
  if (!f) return buf;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = '\0';
  fclose(f);
  return buf;
}

/* Number of output lines containing text. */
int worker_count(const struct worker *w, const char *text) {
  int n = 0;
  for (const char *p = worker_output(w); (p = strstr(p, text)); p += strlen(text)) n++;
  return n;
}

/* Wait until the output has count lines containing text. */
bool worker_wait_for(const struct worker *w, const char *text, int count, int timeout_ms) {
  double end = now_ms() + timeout_ms;
  while (now_ms() < end) {
    if (worker_count(w, text) >= count) return true;
    sleep_ms(5);
  }
  return false;
}

/* Start gpumem-worker and wait for its "ready" line. */
void worker_start(struct worker *w, const struct daemon *d, ...) {
  static int seq;
  snprintf(w->out, sizeof w->out, "%s/worker%d.out", d->dir, seq++);
  const char *argv[32] = {harness_bin("gpumem-worker"), "--socket", d->socket};
  int n = 3;
  va_list ap;
  va_start(ap, d);
  for (const char *a; n < 31 && (a = va_arg(ap, const char *));) argv[n++] = a;
  va_end(ap);
  argv[n] = NULL;
  w->pid = spawn(argv, w->out);
  ck_assert_msg(worker_wait_for(w, "ready", 1, 20000), "worker not ready: %s", worker_output(w));
}

/* Send sig and reap. */
int worker_stop(struct worker *w, int sig) {
  int status;
  kill(w->pid, sig);
  waitpid(w->pid, &status, 0);
  w->pid = 0;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}


/* Record an inode's bytes once, keeping the larger figure. */
static void note_inode(unsigned long long *inos, uint64_t *bytes, size_t *n, size_t max,
                       unsigned long long ino, uint64_t b) {
  for (size_t i = 0; i < *n; i++)
    if (inos[i] == ino) {
      if (b > bytes[i]) bytes[i] = b;
      return;
    }
  if (*n < max) {
    inos[*n] = ino;
    bytes[(*n)++] = b;
  }
}

/* Bytes of the backend's memfds ("gpumem-host-...") that these processes hold
 * by fd or by mapping, each memfd counted once: the kernel's own figure
 * for memory the daemon and its workers keep, whatever else the machine
 * runs. */
uint64_t memfd_bytes(const pid_t *pids, size_t npids) {
  enum { MAX = 4096 };
  static unsigned long long inos[MAX];
  static uint64_t bytes[MAX];
  size_t n = 0;
  char path[300], link[256], line[512];
  for (size_t p = 0; p < npids; p++) {
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pids[p]);
    DIR *dir = opendir(path);
    for (struct dirent *de; dir && (de = readdir(dir));) {
      snprintf(path, sizeof path, "/proc/%d/fd/%s", (int)pids[p], de->d_name);
      ssize_t len = readlink(path, link, sizeof link - 1);
      if (len <= 0) continue;
      link[len] = '\0';
      struct stat st;
      if (strstr(link, "/memfd:gpumem-host-") && stat(path, &st) == 0)
        note_inode(inos, bytes, &n, MAX, (unsigned long long)st.st_ino,
                   (uint64_t)st.st_blocks * 512);
    }
    if (dir) closedir(dir);
    snprintf(path, sizeof path, "/proc/%d/maps", (int)pids[p]);
    FILE *f = fopen(path, "re");
    while (f && fgets(line, sizeof line, f)) {
      unsigned long long lo, hi, ino;
      if (!strstr(line, "/memfd:gpumem-host-") ||
          sscanf(line, "%llx-%llx %*s %*s %*s %llu", &lo, &hi, &ino) != 3)
        continue;
      note_inode(inos, bytes, &n, MAX, ino, hi - lo);
    }
    if (f) fclose(f);
  }
  uint64_t sum = 0;
  for (size_t i = 0; i < n; i++) sum += bytes[i];
  return sum;
}
