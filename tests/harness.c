#include "harness.h"

#include <grp.h>
#include <limits.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
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
int harness_fd_count(void) { return proc_fd_each(getpid(), NULL, NULL); }

/* Run one suite with Check: every test forks, has a timeout and the
 * fixture, which by default fails tests that leak fds. */
int harness_run(const char *name, const TTest *const *tests, size_t n, double timeout,
                void (*setup)(void), void (*teardown)(void)) {
  Suite *s = suite_create(name);
  TCase *tc = tcase_create(name);
  tcase_add_checked_fixture(tc, setup ? setup : harness_fd_setup,
                            teardown ? teardown : harness_fd_teardown);
  /* Under a sanitizer everything runs several times slower. */
  tcase_set_timeout(tc, timeout * (HARNESS_SANITIZED ? 3 : 1));
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

/* Stop the test's daemon if it runs, then check fds. */
void harness_daemon_teardown(struct daemon *d) {
  if (d->pid) ck_assert_int_eq(daemon_stop(d), 0);
  harness_fd_teardown();
}

/* Milliseconds on the monotonic clock. */
double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* The status of tag (harness.h). */
struct gpumem_tag_status client_tag(gpumem_client *c, const char *tag) {
  struct gpumem_status *s = NULL;
  ck_assert_msg(gpumem_status(c, &s) == 0, "%s", gpumem_last_error());
  struct gpumem_tag_status t;
  memset(&t, 0, sizeof t);
  for (size_t i = 0; i < s->ntags; i++)
    if (strcmp(s->tags[i]->name, tag) == 0) t = *s->tags[i];
  t.name = NULL; /* freed with the status */
  gpumem_status_free(s);
  return t;
}

/* One pause or resume of tag (harness.h). */
int client_op(gpumem_client *ctl, const char *tag, bool resume) {
  struct gpumem_op_report *r = NULL;
  int rc = resume ? gpumem_resume(ctl, &tag, 1, NULL, 0, NULL, &r)
                  : gpumem_pause(ctl, &tag, 1, NULL, 0, NULL, &r);
  gpumem_op_report_free(r);
  return rc;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* The build directory: $GPUMEM_BUILD, else "build". */
static const char *build_dir(void) {
  const char *build = getenv("GPUMEM_BUILD");
  return build ? build : "build";
}

/* The build directory whose programs user nobody runs. */
static const char *others_build(void) {
  const char *copy = getenv("GPUMEM_OTHERS_BUILD");
  return copy && *copy ? copy : build_dir();
}

/* "dir/sub/name" in one of eight buffers used in turn. */
static const char *path_in(const char *dir, const char *sub, const char *name) {
  static char path[8][512];
  static int next;
  char *p = path[next++ % 8];
  snprintf(p, sizeof path[0], "%s/%s%s", dir, sub, name);
  return p;
}

/* A path in the build directory. */
const char *harness_built(const char *rel) { return path_in(build_dir(), "", rel); }

/* Path of a built program. */
const char *harness_bin(const char *name) { return path_in(build_dir(), "bin/", name); }

/* Path of a built program that user nobody can run. */
const char *harness_others_bin(const char *name) { return path_in(others_build(), "bin/", name); }

/* Whether root may run the build's programs as nobody, asked of the
 * kernel as nobody. */
bool harness_others_can_run(const char *test) {
  if (geteuid() != 0) {
    printf("%s: skipped: needs root to run programs as nobody\n", test);
    return false;
  }
  char lib[512];
  snprintf(lib, sizeof lib, "%s/lib/libgpumem.so.1", others_build());
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    if (setgroups(0, NULL) < 0 || setresgid(65534, 65534, 65534) < 0 ||
        setresuid(65534, 65534, 65534) < 0)
      _exit(2);
    _exit(access(harness_others_bin("gpumemctl"), X_OK) == 0 && access(lib, R_OK) == 0 ? 0 : 1);
  }
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return true;
  printf("%s: skipped: user nobody cannot reach %s/bin (a private build directory; "
         "tests/run.sh copies the programs to a shared temporary directory where it can)\n",
         test, others_build());
  return false;
}

/* In a forked child: exec argv with stdout and stderr into out. */
void harness_exec(const char *const *argv, const char *out) {
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

/* Exec with stdout and stderr into a file. */
static pid_t spawn(const char *const *argv, const char *out) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) harness_exec(argv, out);
  return pid;
}

/* Copy NULL-terminated string arguments into out, NULL-terminated. */
void harness_collect_args(const char **out, size_t max, va_list ap) {
  size_t n = 0;
  for (const char *a; n + 1 < max && (a = va_arg(ap, const char *));) out[n++] = a;
  out[n] = NULL;
}

/* gpumemd's argv for a test daemon on socket, then extra. */
void daemon_argv(const char **argv, const char *socket, const char *const *extra) {
  const char *base[] = {harness_bin("gpumemd"), "--socket", socket, "--log-level", "debug",
                        "--backend", "host"};
  size_t n = 0;
  for (; n < sizeof base / sizeof base[0]; n++) argv[n] = base[n];
  for (; extra && *extra && n < DAEMON_ARGV_MAX - 1; extra++) argv[n++] = *extra;
  argv[n] = NULL;
}

/* Start gpumemd on an existing socket path. */
pid_t daemon_spawn(const char *socket, const char *log, const char *const *extra) {
  const char *argv[DAEMON_ARGV_MAX];
  daemon_argv(argv, socket, extra);
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

/* Lines of the daemon's log that contain text. */
int daemon_log_count(const struct daemon *d, const char *text) {
  FILE *f = fopen(d->log, "re");
  char line[1024];
  int n = 0;
  while (f && fgets(line, sizeof line, f)) n += strstr(line, text) != NULL;
  if (f) fclose(f);
  return n;
}

/* Make a daemon's directory and name its socket and log in it. */
void daemon_paths(struct daemon *d, const char *name) {
  snprintf(d->dir, sizeof d->dir, "/tmp/%s.XXXXXX", name);
  ck_assert_ptr_nonnull(mkdtemp(d->dir));
  snprintf(d->socket, sizeof d->socket, "%s/sock", d->dir);
  snprintf(d->log, sizeof d->log, "%s/daemon.log", d->dir);
}

/* Wait (up to 5 s) until the daemon answers; false if it exits first. */
bool daemon_wait_ready(struct daemon *d) {
  for (int i = 0; i < 500; i++) {
    int fd = raw_connect(d);
    if (fd >= 0) {
      close(fd);
      return true;
    }
    if (waitpid(d->pid, NULL, WNOHANG) == d->pid) return false;
    sleep_ms(10); /* polling for the socket: nothing tells when it listens */
  }
  return false;
}

/* Start gpumemd through start in a fresh directory and wait until it
 * answers; false if start could not start it. */
bool daemon_startv(struct daemon *d, const char *name, daemon_spawner *start, va_list ap) {
  daemon_paths(d, name);
  const char *extra[24];
  harness_collect_args(extra, 24, ap);
  d->pid = start(d, extra);
  if (d->pid < 0) {
    d->pid = 0;
    return false;
  }
  ck_assert_msg(daemon_wait_ready(d), "gpumemd did not start; see %s", d->log);
  return true;
}

/* Spawn gpumemd plainly on d's socket and log. */
static pid_t spawn_plain(const struct daemon *d, const char *const *extra) {
  return daemon_spawn(d->socket, d->log, extra);
}

/* Start gpumemd and wait until it answers. */
void daemon_start(struct daemon *d, ...) {
  va_list ap;
  va_start(ap, d);
  daemon_startv(d, "gpumemd-test", spawn_plain, ap);
  va_end(ap);
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
  double end = now_ms() + harness_patience_ms(timeout_ms);
  while (now_ms() < end) {
    if (worker_count(w, text) >= count) return true;
    sleep_ms(5);
  }
  return false;
}

/* Start gpumem-worker and wait for its "ready" line. */
static void worker_spawnv(struct worker *w, const struct daemon *d, va_list ap) {
  static int seq;
  snprintf(w->out, sizeof w->out, "%s/worker%d.out", d->dir, seq++);
  const char *argv[32] = {harness_bin("gpumem-worker"), "--socket", d->socket};
  harness_collect_args(argv + 3, 32 - 3, ap);
  w->pid = spawn(argv, w->out);
}

/* Start a worker, without waiting. */
void worker_spawn(struct worker *w, const struct daemon *d, ...) {
  va_list ap;
  va_start(ap, d);
  worker_spawnv(w, d, ap);
  va_end(ap);
}

/* Start a worker with the arguments in ap and wait for its "ready" line. */
static void worker_startv(struct worker *w, const struct daemon *d, va_list ap) {
  worker_spawnv(w, d, ap);
  ck_assert_msg(worker_wait_for(w, "ready", 1, 20000), "worker not ready: %s", worker_output(w));
}

/* Start a worker and wait for its "ready" line. */
void worker_start(struct worker *w, const struct daemon *d, ...) {
  va_list ap;
  va_start(ap, d);
  worker_startv(w, d, ap);
  va_end(ap);
}

/* Start gpumemd and one worker against it, waiting for both. */
void daemon_with_worker(struct daemon *d, struct worker *w, ...) {
  daemon_start(d, NULL);
  va_list ap;
  va_start(ap, w);
  worker_startv(w, d, ap);
  va_end(ap);
}

/* A wait for what should happen at once, stretched for busy machines. */
int harness_patience_ms(int ms) {
  const char *v = getenv("GPUMEM_TEST_PATIENCE");
  int k = v && atoi(v) > 0 ? atoi(v) : 5;
  return ms > INT_MAX / k ? INT_MAX : ms * k;
}

/* Stop a child with SIGSTOP and wait until it is stopped. */
static void freeze(pid_t pid) {
  int status;
  ck_assert_int_eq(kill(pid, SIGSTOP), 0);
  ck_assert_int_eq(waitpid(pid, &status, WUNTRACED), pid);
  ck_assert(WIFSTOPPED(status));
}

/* Stop a worker and wait until it is stopped. */
void worker_freeze(struct worker *w) { freeze(w->pid); }

/* Stop the daemon and wait until it is stopped. */
void daemon_freeze(struct daemon *d) { freeze(d->pid); }

/* Let a frozen daemon go on. */
void daemon_thaw(struct daemon *d) { ck_assert_int_eq(kill(d->pid, SIGCONT), 0); }

/* Send sig and reap. */
int worker_stop(struct worker *w, int sig) {
  int status;
  kill(w->pid, sig);
  waitpid(w->pid, &status, 0);
  w->pid = 0;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}


enum { MEMFD_SEEN_MAX = 4096 };

/* Memfds seen so far: each inode once, with the larger of its figures. */
struct memfd_seen {
  unsigned long long inos[MEMFD_SEEN_MAX];
  uint64_t bytes[MEMFD_SEEN_MAX];
  size_t n;
  pid_t pid; /* the process whose fds are walked */
};

/* Record an inode's bytes once, keeping the larger figure. */
static void note_inode(struct memfd_seen *m, unsigned long long ino, uint64_t b) {
  for (size_t i = 0; i < m->n; i++)
    if (m->inos[i] == ino) {
      if (b > m->bytes[i]) m->bytes[i] = b;
      return;
    }
  if (m->n < MEMFD_SEEN_MAX) {
    m->inos[m->n] = ino;
    m->bytes[m->n++] = b;
  }
}

/* Record the blocks of an fd that is one of the backend's memfds. */
static void note_memfd_fd(int fd, const char *target, void *arg) {
  struct memfd_seen *m = arg;
  char path[64];
  struct stat st;
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)m->pid, fd);
  if (strstr(target, "/memfd:gpumem-host-") && stat(path, &st) == 0)
    note_inode(m, (unsigned long long)st.st_ino, (uint64_t)st.st_blocks * 512);
}

/* Bytes of the backend's memfds ("gpumem-host-...") that these processes hold
 * by fd or by mapping, each memfd counted once: the kernel's own figure
 * for memory the daemon and its workers keep, whatever else the machine
 * runs. */
uint64_t memfd_bytes(const pid_t *pids, size_t npids) {
  static struct memfd_seen m;
  m.n = 0;
  char path[64], line[512];
  for (size_t p = 0; p < npids; p++) {
    m.pid = pids[p];
    proc_fd_each(pids[p], note_memfd_fd, &m);
    snprintf(path, sizeof path, "/proc/%d/maps", (int)pids[p]);
    FILE *f = fopen(path, "re");
    while (f && fgets(line, sizeof line, f)) {
      unsigned long long lo, hi, ino;
      if (!strstr(line, "/memfd:gpumem-host-") ||
          sscanf(line, "%llx-%llx %*s %*s %*s %llu", &lo, &hi, &ino) != 3)
        continue;
      note_inode(&m, ino, hi - lo);
    }
    if (f) fclose(f);
  }
  uint64_t sum = 0;
  for (size_t i = 0; i < m.n; i++) sum += m.bytes[i];
  return sum;
}

/* Sum the lines of /proc/self/maps that name name. */
uint64_t self_mapped(const char *name, char *perms) {
  FILE *f = fopen("/proc/self/maps", "re");
  ck_assert_ptr_nonnull(f);
  char line[4608];
  uint64_t sum = 0;
  perms[0] = '\0';
  while (fgets(line, sizeof line, f)) {
    unsigned long long lo, hi;
    char p[5];
    if (!strstr(line, name) || sscanf(line, "%llx-%llx %4s", &lo, &hi, p) != 3) continue;
    if (!sum) memcpy(perms, p, 5);
    sum += hi - lo;
  }
  fclose(f);
  return sum;
}

/* --- what libgpumem's connection hook saw --- */

/* Record a connection event and wake the waiter. */
static void conn_events_hook(gpumem_client *c, int event, int code, const char *words, size_t count,
                      void *user) {
  (void)c;
  struct conn_events *e = user;
  pthread_mutex_lock(&e->mu);
  if (event == GPUMEM_CONN_LOST && e->lost++ == 0)
    snprintf(e->first_loss, sizeof e->first_loss, "%s", words);
  if (event == GPUMEM_CONN_RESTORED) e->restored++;
  e->code = code;
  e->count = count;
  snprintf(e->words, sizeof e->words, "%s", words);
  pthread_cond_broadcast(&e->cv);
  pthread_mutex_unlock(&e->mu);
}

/* Record c's connection events in e. */
void conn_events_watch(struct conn_events *e, gpumem_client *c) {
  *e = (struct conn_events){.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
  gpumem_set_connection_hook(c, conn_events_hook, e);
}

/* Wait up to 20 s for that many losses and restorations. */
bool conn_events_wait(struct conn_events *e, int lost, int restored) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += 20;
  pthread_mutex_lock(&e->mu);
  while ((e->lost < lost || e->restored < restored) &&
         pthread_cond_timedwait(&e->cv, &e->mu, &until) == 0)
    continue;
  bool ok = e->lost >= lost && e->restored >= restored;
  pthread_mutex_unlock(&e->mu);
  return ok;
}

/* --- the raw protocol peer --- */

/* An envelope with an id and the kind of its body. */
wire_env peer_env(uint64_t id, Gpumem__Wire__Envelope__BodyCase body) {
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = id;
  env.body_case = body;
  return env;
}

/* Make a peer of a socket (owned from now on) with a reader of frames up to max_len. */
void peer_attach(struct peer *p, int fd, size_t max_len) {
  p->fd = fd;
  p->r = frame_reader_create(max_len);
  p->w = frame_writer_create();
  p->next_id = 1;
  p->err = 0;
}

/* Queue a message with fds (consumed); a failure is kept for peer_flush. */
bool peer_push(struct peer *p, const wire_env *env, const int *fds, size_t nfds) {
  size_t len;
  uint8_t *bytes = wire_pack(env, &len);
  int rc = bytes ? frame_writer_push(p->w, bytes, len, fds, nfds) : -ENOMEM;
  free(bytes);
  if (rc < 0 && !p->err) p->err = rc;
  return rc == 0;
}

/* Send what the socket takes now. */
int peer_flush(struct peer *p) { return p->err ? p->err : frame_writer_flush(p->w, p->fd); }

/* Send everything queued, waiting up to ms (-1: no limit) for room. */
int peer_flush_within(struct peer *p, int ms) {
  double end = now_ms() + ms;
  int rc;
  while ((rc = peer_flush(p)) == -EAGAIN) {
    int left = ms < 0 ? -1 : (int)(end - now_ms());
    if (ms >= 0 && left <= 0) break;
    struct pollfd pf = {p->fd, POLLOUT, 0};
    poll(&pf, 1, left);
  }
  return rc;
}

/* Send a message with fds (consumed). */
void peer_put(struct peer *p, const wire_env *env, const int *fds, size_t nfds) {
  ck_assert(peer_push(p, env, fds, nfds));
  ck_assert_int_eq(peer_flush_within(p, 5000), 0);
}

/* Read once what the socket has: 1, 0 at end of stream, or the error. */
int peer_fill(struct peer *p) {
  ssize_t got = frame_reader_fill(p->r, p->fd);
  if (got == 0 || got == -ECONNRESET) return 0;
  return got > 0 || got == -EAGAIN ? 1 : (int)got;
}

/* The next whole message already read (NULL if none yet or bad: *err says). */
wire_env *peer_next(struct peer *p, struct frame *f, int *err) {
  int rc = frame_reader_next(p->r, f);
  *err = rc < 0 ? rc : 0;
  if (rc <= 0) return NULL;
  wire_env *env = wire_unpack(f->data, f->len);
  if (!env) {
    frame_release(f);
    *err = -EBADMSG;
  }
  return env;
}

/* Wait up to ms (-1: no limit) for the next message: 1 (*env), 0 at the
 * end of stream, -ETIMEDOUT or another error. */
int peer_await(struct peer *p, struct frame *f, int ms, wire_env **env) {
  double end = now_ms() + ms;
  for (;;) {
    int err;
    if ((*env = peer_next(p, f, &err))) return 1;
    if (err) return err;
    struct pollfd pf = {p->fd, POLLIN, 0};
    int left = ms < 0 ? -1 : (int)(end - now_ms());
    if (ms >= 0 && left <= 0) return -ETIMEDOUT;
    int ready = poll(&pf, 1, left);
    if (ready < 0 && errno == EINTR) continue;
    if (ready != 1) return -ETIMEDOUT;
    int rc = peer_fill(p);
    if (rc <= 0) return rc;
  }
}

/* The next message within ms; its fds go to keep (NULL: closed). NULL at
 * end of stream (closed or reset); any other read error fails the test. */
wire_env *peer_get_within(struct peer *p, struct frame *keep, int ms) {
  struct frame f;
  wire_env *env;
  int wait = harness_patience_ms(ms);
  int rc = peer_await(p, &f, wait, &env);
  ck_assert_msg(rc != -ETIMEDOUT, "nothing from gpumemd in %d ms", wait);
  ck_assert_int_ge(rc, 0);
  if (rc == 0) return NULL;
  if (keep) {
    *keep = f;
    free(keep->data);
    keep->data = NULL;
  } else {
    frame_release(&f);
  }
  return env;
}

/* The next message (waiting up to 5 s); its fds go to keep (NULL: closed). */
wire_env *peer_get(struct peer *p, struct frame *keep) { return peer_get_within(p, keep, 5000); }

/* True if a message is waiting (without blocking). */
bool peer_waiting(struct peer *p) {
  struct pollfd pf = {p->fd, POLLIN, 0};
  return poll(&pf, 1, 0) == 1;
}

/* True if the daemon ends the session within 3 s (messages before the end
 * are skipped). */
bool peer_ended(struct peer *p) {
  double end = now_ms() + 3000;
  for (;;) {
    struct frame f;
    wire_env *env;
    int left = (int)(end - now_ms());
    int rc = left > 0 ? peer_await(p, &f, left, &env) : -ETIMEDOUT;
    if (rc != 1) return rc == 0;
    wire_env_free(env);
    frame_release(&f);
  }
}

/* Connect without saying hello. */
void peer_connect(struct peer *p, const struct daemon *d) {
  int fd = raw_connect(d);
  ck_assert_int_ge(fd, 0);
  peer_attach(p, fd, WIRE_MAX_REPLY);
}

/* Say hello in a role; the HelloReply. */
wire_env *peer_hello(struct peer *p, int role) {
  return peer_hello_as(p, role,
                       role == GPUMEM__WIRE__ROLE__ROLE_WORKER ? "raw-worker" : "raw-ctl");
}

/* Queue a Hello in a role under a name at a version; its request id. */
uint64_t peer_push_hello(struct peer *p, int role, const char *name, uint32_t major,
                         uint32_t minor) {
  Gpumem__Wire__Hello h = GPUMEM__WIRE__HELLO__INIT;
  h.version_major = major;
  h.version_minor = minor;
  h.role = role;
  h.name = (char *)name;
  wire_env env = peer_env(p->next_id++, GPUMEM__WIRE__ENVELOPE__BODY_HELLO);
  env.hello = &h;
  peer_push(p, &env, NULL, 0);
  return env.id;
}

/* Say hello in a role under a name; returns the HelloReply. */
wire_env *peer_hello_as(struct peer *p, int role, const char *name) {
  peer_push_hello(p, role, name, WIRE_VERSION_MAJOR, WIRE_VERSION_MINOR);
  wire_env *r = peer_answer(p);
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_HELLO_REPLY);
  return r;
}

/* Connect and say hello in a role. */
void peer_open(struct peer *p, const struct daemon *d, int role) {
  peer_connect(p, d);
  wire_env_free(peer_hello(p, role));
}

/* Close a peer (again: nothing). */
void peer_close(struct peer *p) {
  if (p->fd >= 0) close(p->fd);
  frame_reader_destroy(p->r);
  frame_writer_destroy(p->w);
  *p = (struct peer){.fd = -1};
}

/* Listen on a fresh socket path in a fresh directory under /tmp. */
void peer_listen(struct listener *l, const char *name) {
  snprintf(l->dir, sizeof l->dir, "/tmp/%s.XXXXXX", name);
  ck_assert_ptr_nonnull(mkdtemp(l->dir));
  snprintf(l->path, sizeof l->path, "%s/sock", l->dir);
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", l->path);
  l->fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(l->fd, 0);
  ck_assert_int_eq(bind(l->fd, (struct sockaddr *)&addr, sizeof addr), 0);
  ck_assert_int_eq(listen(l->fd, 8), 0);
}

/* Take the next connection into p (what p had is closed first). */
void peer_accept(struct peer *p, const struct listener *l) {
  peer_close(p);
  peer_attach(p, accept4(l->fd, NULL, NULL, SOCK_CLOEXEC), WIRE_MAX_REQUEST);
}

/* Stop listening: close the socket (again: nothing) and remove its path. */
void peer_unlisten(struct listener *l) {
  if (l->fd >= 0) close(l->fd);
  l->fd = -1;
  unlink(l->path);
}

/* Stop listening and remove the directory too. */
void peer_listen_close(struct listener *l) {
  peer_unlisten(l);
  rmdir(l->dir);
}

/* The code of a reply: OK, or the Error's code (its message into why). */
wire_code peer_reply_code(const wire_env *r, char *why, size_t whylen) {
  ck_assert_ptr_nonnull(r);
  if (r->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) {
    if (why) snprintf(why, whylen, "%s", r->error->message);
    return r->error->code;
  }
  if (why) why[0] = '\0';
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Queue an alloc; its request id. */
uint64_t peer_push_alloc(struct peer *p, const char *tag, unsigned dev, uint64_t size,
                         uint32_t flags) {
  Gpumem__Wire__AllocRequest a = GPUMEM__WIRE__ALLOC_REQUEST__INIT;
  a.tag = (char *)tag;
  a.device = dev;
  a.size = size;
  a.flags = flags;
  wire_env env = peer_env(p->next_id++, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC);
  env.alloc = &a;
  peer_push(p, &env, NULL, 0);
  return env.id;
}

/* Queue a free of a buffer; its request id. */
uint64_t peer_push_free(struct peer *p, uint64_t buffer) {
  Gpumem__Wire__FreeRequest fr = GPUMEM__WIRE__FREE_REQUEST__INIT;
  fr.buffer_id = buffer;
  wire_env env = peer_env(p->next_id++, GPUMEM__WIRE__ENVELOPE__BODY_FREE);
  env.free = &fr;
  peer_push(p, &env, NULL, 0);
  return env.id;
}

/* Allocate a buffer, keeping its chunk fds; the reply's code (b zeroed if
 * not OK). */
wire_code peer_try_alloc(struct peer *p, const char *tag, unsigned dev, uint64_t size,
                         uint32_t flags, struct pbuf *b) {
  uint64_t id = peer_push_alloc(p, tag, dev, size, flags);
  ck_assert_int_eq(peer_flush_within(p, 5000), 0);
  struct frame f;
  wire_env *r = peer_get(p, &f);
  ck_assert_ptr_nonnull(r);
  ck_assert_uint_eq(r->id, id);
  wire_code code = peer_reply_code(r, NULL, 0);
  memset(b, 0, sizeof *b);
  if (code == GPUMEM__WIRE__ERROR_CODE__OK) {
    ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY);
    const Gpumem__Wire__AllocReply *ar = r->alloc_reply;
    b->id = ar->buffer_id;
    b->size = ar->size;
    ck_assert_uint_le(ar->n_chunk_sizes, 8);
    b->nchunks = ar->n_chunk_sizes;
    memcpy(b->chunk_sizes, ar->chunk_sizes, b->nchunks * sizeof *b->chunk_sizes);
    ck_assert_uint_le(ar->secret.len, sizeof b->secret);
    b->secret_len = ar->secret.len;
    memcpy(b->secret, ar->secret.data, ar->secret.len);
    ck_assert_uint_le(f.nfds, 8);
    b->nfds = f.nfds;
    for (size_t i = 0; i < f.nfds; i++) {
      b->fds[i] = f.fds[i];
      f.fds[i] = -1;
    }
  }
  frame_release(&f);
  wire_env_free(r);
  return code;
}

/* Allocate a buffer and keep its chunk fds, as a mapping would. */
void peer_alloc(struct peer *p, const char *tag, unsigned dev, uint64_t size, uint32_t flags,
                struct pbuf *b) {
  wire_code code = peer_try_alloc(p, tag, dev, size, flags, b);
  ck_assert_msg(code == GPUMEM__WIRE__ERROR_CODE__OK, "alloc of %llu bytes of %s: %s",
                (unsigned long long)size, tag, wire_code_name(code));
}

/* "Unmap": close the fds a buffer holds. */
void peer_unmap(struct pbuf *b) {
  for (size_t i = 0; i < b->nfds; i++) close(b->fds[i]);
  b->nfds = 0;
}

/* Queue an ack of an event with any code and failed buffers. */
void peer_push_ack(struct peer *p, uint64_t event, int code, const uint64_t *failed,
                   size_t nfailed, const char *why) {
  Gpumem__Wire__EventAck a = GPUMEM__WIRE__EVENT_ACK__INIT;
  a.code = code;
  a.message = (char *)(why ? why : "");
  a.failed_ids = (uint64_t *)failed;
  a.n_failed_ids = nfailed;
  wire_env env = peer_env(event, GPUMEM__WIRE__ENVELOPE__BODY_ACK);
  env.ack = &a;
  peer_push(p, &env, NULL, 0);
}

/* Acknowledge an event with any code (even one outside the enum). */
void peer_ack_code(struct peer *p, uint64_t event, int code, const uint64_t *failed,
                   size_t nfailed, const char *why) {
  peer_push_ack(p, event, code, failed, nfailed, why);
  ck_assert_int_eq(peer_flush_within(p, 5000), 0);
}

/* Acknowledge an event, naming failed buffers (code OK if none). */
void peer_ack(struct peer *p, uint64_t event, const uint64_t *failed, size_t nfailed,
              const char *why) {
  peer_ack_code(p, event,
                nfailed ? GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR : GPUMEM__WIRE__ERROR_CODE__OK,
                failed, nfailed, why);
}

/* Point a PauseRequest or a ResumeRequest (two types with the same scope
 * fields: a macro, as C has no other way to share this) at tags and devices. */
#define OP_SCOPE(req, tags_, ntags_, devs_, ndevs_)                                      \
  ((req).tags = (char **)(tags_), (req).n_tags = (ntags_), (req).devices = (devs_),     \
   (req).n_devices = (ndevs_))

/* Queue a pause or resume of tags (devmask: devices 0-63, 0 for all). */
void peer_push_op_tags(struct peer *c, bool resume, const char *const *tags, size_t ntags,
                       uint64_t devmask, uint64_t max_residual) {
  uint32_t devs[64];
  size_t ndev = 0;
  for (unsigned i = 0; i < 64; i++)
    if (devmask & (1ull << i)) devs[ndev++] = i;
  Gpumem__Wire__PauseRequest pr = GPUMEM__WIRE__PAUSE_REQUEST__INIT;
  Gpumem__Wire__ResumeRequest rr = GPUMEM__WIRE__RESUME_REQUEST__INIT;
  wire_env env = peer_env(c->next_id++, resume ? GPUMEM__WIRE__ENVELOPE__BODY_RESUME
                                                : GPUMEM__WIRE__ENVELOPE__BODY_PAUSE);
  if (resume) {
    OP_SCOPE(rr, tags, ntags, devs, ndev);
    env.resume = &rr;
  } else {
    OP_SCOPE(pr, tags, ntags, devs, ndev);
    pr.max_residual = max_residual;
    env.pause = &pr;
  }
  peer_push(c, &env, NULL, 0);
}

/* Send a pause or resume of tags (devmask: devices 0-63, 0 for all). */
void peer_op_tags(struct peer *c, bool resume, const char *const *tags, size_t ntags,
                  uint64_t devmask, uint64_t max_residual) {
  peer_push_op_tags(c, resume, tags, ntags, devmask, max_residual);
  ck_assert_int_eq(peer_flush_within(c, 5000), 0);
}

/* Send a pause or resume of one tag. */
void peer_op(struct peer *c, bool resume, const char *tag, uint64_t devmask,
             uint64_t max_residual) {
  peer_op_tags(c, resume, &tag, 1, devmask, max_residual);
}

/* The controller's answer: OK (with the OpReply in *out) or an error code
 * (with the Error in *out). Free *out with wire_env_free. */
wire_code peer_op_wait(struct peer *c, wire_env **out) {
  wire_env *r = peer_get(c, NULL);
  ck_assert_ptr_nonnull(r);
  *out = r;
  if (r->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) return r->error->code;
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY);
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* The controller's answer: OK, for these buffers and bytes. */
void peer_op_ok(struct peer *c, uint64_t buffers, uint64_t bytes) {
  wire_env *r;
  wire_code code = peer_op_wait(c, &r);
  ck_assert_msg(code == GPUMEM__WIRE__ERROR_CODE__OK, "operation: %s: %s", wire_code_name(code),
                code ? r->error->message : "");
  ck_assert_uint_eq(r->op_reply->buffers, buffers);
  ck_assert_uint_eq(r->op_reply->bytes, bytes);
  wire_env_free(r);
}

/* A pause or resume of one tag on every device that w's n buffers serve
 * (one event), answered OK. */
void peer_op_served(struct peer *c, bool resume, const char *tag, struct peer *w,
                    struct pbuf *bufs, size_t n) {
  peer_op(c, resume, tag, 0, 0);
  peer_serve(w, bufs, n, 1);
  ck_assert_int_eq(peer_op_code(c), GPUMEM__WIRE__ERROR_CODE__OK);
}

/* The controller's answer: its code only. */
wire_code peer_op_code(struct peer *c) {
  wire_env *r;
  wire_code code = peer_op_wait(c, &r);
  wire_env_free(r);
  return code;
}

/* The next event for a worker, with its fds kept in *f. */
wire_env *peer_event(struct peer *w, struct frame *f) {
  wire_env *e = peer_get(w, f);
  ck_assert_ptr_nonnull(e);
  ck_assert_msg(e->body_case == GPUMEM__WIRE__ENVELOPE__BODY_UNMAP ||
                    e->body_case == GPUMEM__WIRE__ENVELOPE__BODY_REMAP,
                "expected an event, got message %d", e->body_case);
  return e;
}

/* Open a worker and a controller, give the worker a kv buffer, pause kv:
 * the worker's first event. */
wire_env *peer_pause_pending(const struct daemon *d, struct peer *w, struct peer *c,
                             uint64_t size, struct pbuf *b) {
  peer_open(w, d, GPUMEM__WIRE__ROLE__ROLE_WORKER);
  peer_open(c, d, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  peer_alloc(w, "kv", 0, size, 0, b);
  peer_op(c, false, "kv", 0, 0);
  return peer_event(w, NULL);
}

/* Take a Remap's fds into the buffers it names ("map" them). */
void peer_take_remap(const wire_env *e, struct frame *f, struct pbuf *bufs, size_t n) {
  size_t at = 0;
  for (size_t i = 0; i < e->remap->n_entries; i++) {
    const Gpumem__Wire__RemapEntry *en = e->remap->entries[i];
    for (size_t k = 0; k < n; k++) {
      if (bufs[k].id != en->buffer_id) continue;
      for (size_t c = 0; c < en->n_chunk_sizes; c++) {
        bufs[k].fds[bufs[k].nfds++] = f->fds[at + c];
        f->fds[at + c] = -1;
      }
    }
    at += en->n_chunk_sizes + en->n_backup_piece_sizes; /* pieces: closed with f */
  }
}

/* Send what is queued and take the next message, of any kind. */
wire_env *peer_answer(struct peer *p) {
  ck_assert_int_eq(peer_flush_within(p, 5000), 0);
  wire_env *r = peer_get(p, NULL);
  ck_assert_ptr_nonnull(r);
  return r;
}

/* Send a request and take its reply, of any kind. */
wire_env *peer_call(struct peer *p, wire_env *env) {
  env->id = p->next_id++;
  ck_assert(peer_push(p, env, NULL, 0));
  return peer_answer(p);
}

/* Send a request and return its reply, which must be of kind want. */
wire_env *peer_ask(struct peer *c, wire_env *env, Gpumem__Wire__Envelope__BodyCase want) {
  wire_env *r = peer_call(c, env);
  ck_assert_int_eq(r->body_case, want);
  return r;
}

/* Send a request; its reply's code (its words into why). */
wire_code peer_call_code(struct peer *p, wire_env *env, char *why, size_t whylen) {
  wire_env *r = peer_call(p, env);
  wire_code code = peer_reply_code(r, why, whylen);
  wire_env_free(r);
  return code;
}

/* A status as the daemon sends it (raw). */
wire_env *peer_status(struct peer *c) {
  Gpumem__Wire__StatusRequest sr = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  wire_env env = peer_env(0, GPUMEM__WIRE__ENVELOPE__BODY_STATUS);
  env.status = &sr;
  return peer_ask(c, &env, GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY);
}

/* A list as the daemon sends it (raw). */
wire_env *peer_list(struct peer *c) {
  Gpumem__Wire__ListRequest lr = GPUMEM__WIRE__LIST_REQUEST__INIT;
  wire_env env = peer_env(0, GPUMEM__WIRE__ENVELOPE__BODY_LIST);
  env.list = &lr;
  return peer_ask(c, &env, GPUMEM__WIRE__ENVELOPE__BODY_LIST_REPLY);
}

/* The number of buffers a list names. */
size_t peer_list_count(struct peer *c) {
  wire_env *l = peer_list(c);
  size_t n = l->list_reply->n_buffers;
  wire_env_free(l);
  return n;
}

/* A tag in a status; the test fails if there is none. */
const Gpumem__Wire__TagInfo *peer_tag(const wire_env *st, const char *name) {
  for (size_t i = 0; i < st->status_reply->n_tags; i++)
    if (strcmp(st->status_reply->tags[i]->name, name) == 0) return st->status_reply->tags[i];
  ck_abort_msg("no tag %s in status", name);
  return NULL;
}

/* Poll status (up to 2 s) until the tag is in state st with n in transit. */
bool peer_wait_tag(struct peer *c, const char *tag, int st, uint64_t transit) {
  for (int i = 0; i < 200; i++) {
    wire_env *s = peer_status(c);
    const Gpumem__Wire__TagInfo *t = peer_tag(s, tag);
    bool ok = (int)t->state == st && t->transit_buffers == transit;
    wire_env_free(s);
    if (ok) return true;
    usleep(10000);
  }
  return false;
}

/* Answer every event of one operation: unmaps close, remaps take fds. */
void peer_serve(struct peer *w, struct pbuf *bufs, size_t n, size_t events) {
  for (size_t k = 0; k < events; k++) {
    struct frame f;
    wire_env *e = peer_event(w, &f);
    if (e->body_case == GPUMEM__WIRE__ENVELOPE__BODY_UNMAP) {
      for (size_t i = 0; i < e->unmap->n_buffer_ids; i++)
        for (size_t j = 0; j < n; j++)
          if (bufs[j].id == e->unmap->buffer_ids[i]) peer_unmap(&bufs[j]);
    } else {
      peer_take_remap(e, &f, bufs, n);
    }
    frame_release(&f);
    peer_ack(w, e->id, NULL, 0, NULL);
    wire_env_free(e);
  }
}

/* The error a session gets outside a request (id 0). */
wire_code peer_stray_error(struct peer *p) {
  wire_env *e = peer_get(p, NULL);
  ck_assert_ptr_nonnull(e);
  ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_ERROR);
  ck_assert_uint_eq(e->id, 0);
  wire_code code = e->error->code;
  wire_env_free(e);
  return code;
}

/* Keep the highest fd number seen in *(int *)arg. */
static void note_max_fd(int fd, const char *target, void *arg) {
  (void)target;
  int *maxfd = arg;
  if (fd > *maxfd) *maxfd = fd;
}

/* A text to look for in fds' targets, and how many have it. */
struct fd_text_count {
  const char *text;
  int n;
};

/* Count an fd whose target contains the text (arg: a struct fd_text_count). */
static void count_fd_with(int fd, const char *target, void *arg) {
  struct fd_text_count *c = arg;
  (void)fd;
  c->n += strstr(target, c->text) != NULL;
}

/* Open fds of a process whose target contains text. */
int proc_fds_with(pid_t pid, const char *text) {
  struct fd_text_count c = {text, 0};
  proc_fd_each(pid, count_fd_with, &c);
  return c.n;
}

/* Open fds of a process, and the highest one. */
int proc_fds(pid_t pid, int *maxfd) {
  *maxfd = -1;
  int n = proc_fd_each(pid, note_max_fd, maxfd);
  return n < 0 ? 0 : n;
}
