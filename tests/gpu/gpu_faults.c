/* GPU fault checks for the CUDA backend, judged by the driver's own figure
 * of free memory (cuMemGetInfo in this process), not by the daemon's:
 *
 *   1. a worker stopped (SIGSTOP) during a pause, then continued;
 *   2. a worker killed (SIGKILL) during a pause, and another during a
 *      resume;
 *   3. memory a worker process allocated outside the daemon (cuMemAlloc),
 *      shown against its pid, and --max-residual failing the pause;
 *   4. the daemon killed (SIGKILL) while two workers hold 16 GiB,
 *      restarted on the same socket, and a pause that then frees it.
 *
 * This program starts gpumemd itself (it must kill and restart it), so no
 * other daemon should serve the GPU meanwhile. Each check prints PASS or
 * FAIL lines with the driver's figures; every wait is bounded, and an
 * alarm ends a check that hangs anyway (killing every child). The exit
 * status is the number of failures.
 *
 * usage: gpu_faults BIN_DIR SOCKET DAEMON_LOG
 * (internal: gpu_faults --outside SOCKET NAME TAG, the process that holds
 * memory outside the daemon)
 *
 * A dry run without a GPU: GPU_FAULTS_BACKEND=host GPU_FAULTS_UNIT_MB=64,
 * linked against a stand-in libcuda whose cuMemGetInfo reports the host's
 * Shmem as used (the figures are then the kernel's, not a driver's). */
#include <cuda.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "gpumem.h"

#define MiB (1ull << 20)
#define GiB (1ull << 30)
/* What the driver's figure may miss beyond one granularity a buffer. */
#define SLACK (64 * MiB)
/* The longest one check may take before the alarm ends the program. */
#define CHECK_ALARM_S 240

static const char *bin, *sock, *daemon_log;
static char outdir[64];
static gpumem_client *ctl; /* controller session of the running daemon */
static pid_t daemon_pid = -1;
static uint64_t gran = 2 * MiB;
/* The size every figure is made of: 1 GiB on the GPU. A dry run on the
 * host backend (GPU_FAULTS_BACKEND=host, with a stand-in for libcuda)
 * takes GPU_FAULTS_UNIT_MB to stay small. */
static uint64_t unit = GiB;
static char unit_s[24] = "1G";
static const char *backend = "cuda";

/* ---- children, and the alarm that ends a hung check ---- */

#define MAX_KIDS 32
static volatile pid_t kids[MAX_KIDS];
static const char *volatile current_check = "setup";

static void add_kid(pid_t pid) {
  for (int i = 0; i < MAX_KIDS; i++)
    if (kids[i] <= 0) {
      kids[i] = pid;
      return;
    }
}

static void drop_kid(pid_t pid) {
  for (int i = 0; i < MAX_KIDS; i++)
    if (kids[i] == pid) kids[i] = 0;
}

static void say(const char *s) {
  ssize_t r = write(1, s, strlen(s));
  (void)r;
}

/* A check that hangs despite the bounded waits: say so, kill every child
 * (workers and the daemon, so that the device is left clean) and leave. */
static void on_alarm(int sig) {
  (void)sig;
  say("FAIL ");
  say(current_check);
  say(": did not finish within the alarm; killing every child\n");
  for (int i = 0; i < MAX_KIDS; i++)
    if (kids[i] > 0) kill(kids[i], SIGKILL);
  _exit(100);
}

static bool start_daemon(void);
static void check(bool ok, const char *name, const char *fmt, ...);
static int reap(pid_t pid, int sig, unsigned ms);

/* Start a check: arm the alarm, and make sure a daemon serves (one that
 * died during the previous check is reported and replaced, so that the
 * checks stay independent). */
static void begin(const char *name) {
  current_check = name;
  printf("\n== %s\n", name);
  fflush(stdout);
  alarm(CHECK_ALARM_S);
  int status;
  if (daemon_pid > 0 && waitpid(daemon_pid, &status, WNOHANG) == daemon_pid) {
    drop_kid(daemon_pid);
    daemon_pid = -1;
    check(false, "gpumemd keeps running", "it ended (status 0x%x) before '%s'; restarting it",
          status, name);
  }
  if (daemon_pid <= 0 || !ctl) {
    if (ctl) gpumem_disconnect(ctl);
    ctl = NULL;
    if (daemon_pid > 0) reap(daemon_pid, SIGKILL, 5000);
    daemon_pid = -1;
    if (!start_daemon()) printf("gpumemd does not start; '%s' will fail\n", name);
  }
}

/* ---- small helpers ---- */

static double gib(uint64_t b) { return (double)b / (double)GiB; }
static double sgib(uint64_t a, uint64_t b) { return a >= b ? gib(a - b) : -gib(b - a); }

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Wait (at most ms) until the driver shows at least target free; then the
 * settled figure. */
static uint64_t wait_free_ge(uint64_t target, unsigned ms) {
  double until = now_ms() + ms;
  while (driver_free() < target && now_ms() < until) usleep(10000);
  return settled_free();
}

/* The most free memory the driver shows during ms: for what must NOT
 * happen (memory freed that is still held), where there is no condition
 * to wait for. */
static uint64_t max_free_over(unsigned ms) {
  uint64_t m = driver_free();
  double until = now_ms() + ms;
  while (now_ms() < until) {
    usleep(10000);
    uint64_t f = driver_free();
    if (f > m) m = f;
  }
  return m;
}

static uint64_t slack(uint64_t nbuf) { return nbuf * gran + SLACK; }

/* The whole of a (small) file, NUL-terminated; "" if it cannot be read. */
static char *slurp(const char *path) {
  FILE *f = fopen(path, "r");
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap + 1);
  if (!buf) return NULL;
  while (f) {
    if (n == cap) {
      char *nb = cap < (64u << 20) ? realloc(buf, 2 * cap + 1) : NULL;
      if (!nb) break;
      buf = nb;
      cap *= 2;
    }
    size_t k = fread(buf + n, 1, cap - n, f);
    if (k == 0) break;
    n += k;
  }
  if (f) fclose(f);
  buf[n] = '\0';
  return buf;
}

static int count_in(const char *file, const char *text) {
  char *buf = slurp(file);
  int k = 0;
  for (const char *p = buf; p && (p = strstr(p, text)); p += strlen(text)) k++;
  free(buf);
  return k;
}

/* Wait (at most ms) until text occurs n times in file; the count. */
static int wait_count(const char *file, const char *text, int n, unsigned ms) {
  double until = now_ms() + ms;
  int k;
  while ((k = count_in(file, text)) < n && now_ms() < until) usleep(20000);
  return k;
}

/* Print a file into the log (a worker's output after a failure). */
static void dump(const char *label, const char *file) {
  char *buf = slurp(file);
  size_t n = buf ? strlen(buf) : 0;
  const size_t max = 6000;
  printf("---- %s (%s)%s\n%s%s---- end\n", label, file, n > max ? ", last part" : "",
         buf ? buf + (n > max ? n - max : 0) : "", n && buf[n - 1] != '\n' ? "\n" : "");
  free(buf);
}

static void out_path(char *buf, size_t len, const char *name) {
  snprintf(buf, len, "%s/%s.out", outdir, name);
}

/* In a child between fork and exec: keep 0-2, close the rest (the parent's
 * driver and socket fds are not the child's business). */
static void close_from_3(void) {
  long max = sysconf(_SC_OPEN_MAX);
  if (max < 0 || max > 65536) max = 65536;
  for (int fd = 3; fd < max; fd++) close(fd);
}

/* ---- children: reap, stop, continue ---- */

/* Reap a child within ms (sending sig first unless 0); SIGKILL if it does
 * not go. Its exit status, or 128 + signal. */
static int reap(pid_t pid, int sig, unsigned ms) {
  if (pid <= 0) return -1;
  /* A stopped process acts on SIGTERM only once continued; SIGKILL needs
   * no SIGCONT (which would let it run, and answer, first). */
  if (sig && sig != SIGKILL) kill(pid, SIGCONT);
  if (sig) kill(pid, sig);
  int status = 0;
  double until = now_ms() + ms;
  pid_t r;
  while ((r = waitpid(pid, &status, WNOHANG)) == 0 && now_ms() < until) usleep(10000);
  if (r == 0) {
    printf("pid %d did not exit within %u ms of signal %d: SIGKILL\n", (int)pid, ms, sig);
    kill(pid, SIGKILL);
    r = waitpid(pid, &status, 0);
  }
  drop_kid(pid);
  if (r != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Stop a child and wait (bounded) until the kernel says it is stopped. */
static bool stop_child(pid_t pid) {
  kill(pid, SIGSTOP);
  int status;
  double until = now_ms() + 5000;
  while (now_ms() < until) {
    pid_t r = waitpid(pid, &status, WNOHANG | WUNTRACED);
    if (r == pid) {
      if (WIFSTOPPED(status)) return true;
      drop_kid(pid); /* it died */
      return false;
    }
    if (r < 0) return false;
    usleep(1000);
  }
  return false;
}

static bool alive(pid_t pid) {
  int status;
  return pid > 0 && waitpid(pid, &status, WNOHANG) == 0;
}

/* Start path with argv, its stdout into out; wait (bounded) for "ready".
 * The pid, or -1 (with its output shown, under label) if it did not get
 * there. */
static pid_t spawn_ready(const char *out, const char *path, const char *const *argv,
                         const char *label) {
  unlink(out);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || dup2(fd, 1) < 0) _exit(126);
    close_from_3();
    execv(path, (char *const *)argv);
    _exit(127);
  }
  if (pid < 0) return -1;
  add_kid(pid);
  double until = now_ms() + 60000;
  while (now_ms() < until) {
    if (count_in(out, "ready\n") > 0) return pid;
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      drop_kid(pid);
      printf("%s %d exited before it was ready\n", label, (int)pid);
      dump(label, out);
      return -1;
    }
    usleep(20000);
  }
  printf("%s %d not ready within 60 s\n", label, (int)pid);
  dump(label, out);
  reap(pid, SIGKILL, 5000);
  return -1;
}

/* Start gpumem-worker with args, its stdout into out, as spawn_ready
 * does. */
static pid_t spawn_worker(const char *out, const char *const *args) {
  const char *argv[32];
  char path[512];
  tool_argv(argv, 31, path, sizeof path, bin, "gpumem-worker", sock, args);
  return spawn_ready(out, path, argv, "worker");
}

/* ---- the daemon ---- */

static void ctl_close(void) {
  if (ctl) gpumem_disconnect(ctl);
  ctl = NULL;
}

/* Start gpumemd on the socket (log appended to daemon_log) and connect
 * the controller session once it serves; false if it does not. */
static bool start_daemon(void) {
  char path[512];
  snprintf(path, sizeof path, "%s/gpumemd", bin);
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(daemon_log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0) _exit(126);
    close_from_3();
    const char *argv[] = {path, "--backend", backend, "--socket", sock, "--chunk-size", "1G",
                          "--log-level", "info", NULL, NULL, NULL, NULL, NULL};
    if (strcmp(backend, "host") == 0) {
      argv[9] = "--host-devices";
      argv[10] = "1";
      argv[11] = "--host-device-size";
      argv[12] = "8G";
    }
    execv(path, (char *const *)argv);
    _exit(127);
  }
  if (pid < 0) return false;
  add_kid(pid);
  daemon_pid = pid;
  double t0 = now_ms(), until = t0 + 30000;
  while (now_ms() < until) {
    /* A stale socket file (a killed daemon's) refuses the connection
     * until the new daemon has replaced it. */
    if (gpumem_connect(sock, "gpu_faults", GPUMEM_ROLE_CONTROLLER,
                       GPUMEM_CONNECT_NO_THREAD | GPUMEM_CONNECT_NO_RECONNECT, &ctl) == 0) {
      printf("gpumemd pid %d serving on %s after %.0f ms\n", (int)pid, sock, now_ms() - t0);
      return true;
    }
    int status;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      drop_kid(pid);
      daemon_pid = -1;
      printf("gpumemd exited at start (status 0x%x); see %s\n", status, daemon_log);
      return false;
    }
    usleep(20000);
  }
  printf("gpumemd did not serve within 30 s: %s\n", gpumem_last_error());
  reap(pid, SIGKILL, 5000);
  daemon_pid = -1;
  return false;
}

/* ---- pause, resume, status ---- */

static int op(bool resume, const char *tag, unsigned timeout_ms, uint64_t max_residual,
              struct gpumem_op_report **r) {
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.timeout_ms = timeout_ms;
  o.max_residual = max_residual;
  *r = NULL;
  if (!ctl) return GPUMEM_E_DISCONNECTED;
  return resume ? gpumem_resume(ctl, &tag, 1, NULL, 0, &o, r)
                : gpumem_pause(ctl, &tag, 1, NULL, 0, &o, r);
}

/* A pause or resume on its own thread and controller session. */
struct bg {
  pthread_t th;
  gpumem_client *c;
  bool resume;
  const char *tag;
  unsigned timeout_ms;
  int rc;
  struct gpumem_op_report *r;
  char err[256];
  atomic_bool done;
};

/* A report in words: code, message, pids, what is held. */
static const char *words(int rc, const struct gpumem_op_report *r, char *buf, size_t len) {
  if (!r) {
    snprintf(buf, len, "rc %d, no answer: %s", rc, gpumem_last_error());
    return buf;
  }
  int n = snprintf(buf, len, "rc %d %s%s%s; pids [", rc, r->code ? r->code : "?",
                   r->message && r->message[0] ? ": " : "", r->message ? r->message : "");
  for (size_t i = 0; i < r->npids && n > 0 && (size_t)n < len; i++)
    n += snprintf(buf + n, len - (size_t)n, "%s%u", i ? " " : "", r->pids[i]);
  if (n > 0 && (size_t)n < len)
    snprintf(buf + n, len - (size_t)n, "]; held %llu buffers %.3f GiB",
             (unsigned long long)r->buffers_held, gib(r->bytes_held));
  return buf;
}

/* The answer of a background operation in words. */
static const char *bg_words(const struct bg *b, char *buf, size_t len) {
  if (!b->r) {
    snprintf(buf, len, "rc %d, no answer: %s", b->rc, b->err);
    return buf;
  }
  return words(b->rc, b->r, buf, len);
}

static bool has_pid(const struct gpumem_op_report *r, pid_t pid) {
  for (size_t i = 0; r && i < r->npids; i++)
    if (r->pids[i] == (uint32_t)pid) return true;
  return false;
}

/* A tag's status (found = false when the daemon has no such tag or did
 * not answer). */
struct tagview {
  bool found;
  struct gpumem_tag_status t;
};

static struct tagview tag_status(const char *name) {
  struct tagview v = {0};
  struct gpumem_status *s;
  if (!ctl || gpumem_status(ctl, &s) < 0) return v;
  for (size_t i = 0; i < s->ntags; i++)
    if (strcmp(s->tags[i]->name, name) == 0) {
      v.found = true;
      v.t = *s->tags[i];
      v.t.name = NULL; /* freed with the status */
    }
  gpumem_status_free(s);
  return v;
}

static const char *tag_words(const struct tagview *v, char *buf, size_t len) {
  if (!v->found) {
    snprintf(buf, len, "no such tag");
    return buf;
  }
  snprintf(buf, len, "%s%s, %llu buffers %.3f GiB, %llu paused (%.3f GiB released), %llu in transit "
           "(%.3f GiB)",
           gpumem_state_name(v->t.state), v->t.mixed ? " (mixed)" : "",
           (unsigned long long)v->t.buffers, gib(v->t.bytes),
           (unsigned long long)v->t.paused_buffers, gib(v->t.paused_bytes),
           (unsigned long long)v->t.transit_buffers, gib(v->t.transit_bytes));
  return buf;
}

/* Wait (at most ms) until the tag shows state with nothing in transit and
 * paused_buffers paused. */
static struct tagview wait_tag(const char *name, int state, uint64_t paused, unsigned ms) {
  double until = now_ms() + ms;
  struct tagview v;
  for (;;) {
    v = tag_status(name);
    if (v.found && v.t.state == state && v.t.transit_buffers == 0 && !v.t.mixed &&
        v.t.paused_buffers == paused)
      return v;
    if (now_ms() >= until) return v;
    usleep(20000);
  }
}

/* Wait (at most ms) until the tag has transit buffers in transit and
 * paused buffers paused. */
static struct tagview wait_transit(const char *name, uint64_t transit, uint64_t paused,
                                   unsigned ms) {
  double until = now_ms() + ms;
  struct tagview v;
  for (;;) {
    v = tag_status(name);
    if (v.found && v.t.transit_buffers == transit && v.t.paused_buffers == paused) return v;
    if (now_ms() >= until) return v;
    usleep(10000);
  }
}

/* The session of pid in the daemon's status, if any. */
static bool session_of(pid_t pid, struct gpumem_session_status *out) {
  struct gpumem_status *s;
  bool found = false;
  if (!ctl || gpumem_status(ctl, &s) < 0) return false;
  for (size_t i = 0; i < s->nsessions; i++)
    if (s->sessions[i]->pid == (uint32_t)pid) {
      *out = *s->sessions[i];
      out->name = NULL; /* freed with the status */
      found = true;
    }
  gpumem_status_free(s);
  return found;
}

/* Run gpumemctl with args, its stdout and stderr into file and then into
 * the log; its exit status (-1 if it did not run). */
static int gpumemctl(const char *file, const char *args) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "'%s/gpumemctl' --socket '%s' %s >'%s' 2>&1", bin, sock, args, file);
  fflush(stdout);
  int st = system(cmd);
  printf("$ gpumemctl %s\n", args);
  char *buf = slurp(file);
  printf("%s", buf ? buf : "");
  free(buf);
  fflush(stdout);
  return st == -1 || !WIFEXITED(st) ? -1 : WEXITSTATUS(st);
}

/* ---- a pause or resume on its own thread and session ---- */

static void *bg_main(void *arg) {
  struct bg *b = arg;
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.timeout_ms = b->timeout_ms;
  b->rc = b->resume ? gpumem_resume(b->c, &b->tag, 1, NULL, 0, &o, &b->r)
                    : gpumem_pause(b->c, &b->tag, 1, NULL, 0, &o, &b->r);
  snprintf(b->err, sizeof b->err, "%s", gpumem_last_error());
  atomic_store(&b->done, true);
  return NULL;
}

/* Start a pause or resume in the background, on its own controller
 * session; NULL if it cannot start. */
static struct bg *bg_start(bool resume, const char *tag, unsigned timeout_ms) {
  struct bg *b = calloc(1, sizeof *b);
  if (!b) return NULL;
  b->resume = resume;
  b->tag = tag;
  b->timeout_ms = timeout_ms;
  atomic_init(&b->done, false);
  if (gpumem_connect(sock, "gpu_faults-bg", GPUMEM_ROLE_CONTROLLER,
                     GPUMEM_CONNECT_NO_THREAD | GPUMEM_CONNECT_NO_RECONNECT, &b->c) < 0) {
    printf("background %s: connect: %s\n", resume ? "resume" : "pause", gpumem_last_error());
    free(b);
    return NULL;
  }
  if (pthread_create(&b->th, NULL, bg_main, b) != 0) {
    gpumem_disconnect(b->c);
    free(b);
    return NULL;
  }
  return b;
}

/* Wait (at most ms) for the background operation. True when it answered;
 * else it is left running (and leaked) so that nothing here hangs. */
static bool bg_wait(struct bg *b, unsigned ms) {
  if (!b) return false;
  double until = now_ms() + ms;
  while (!atomic_load(&b->done) && now_ms() < until) usleep(10000);
  if (!atomic_load(&b->done)) {
    pthread_detach(b->th);
    return false;
  }
  pthread_join(b->th, NULL);
  gpumem_disconnect(b->c);
  b->c = NULL;
  return true;
}

static void bg_free(struct bg *b) {
  if (!b || !atomic_load(&b->done)) return; /* still running: leave it */
  gpumem_op_report_free(b->r);
  free(b);
}

/* Two workers of one tag with buffers of unit bytes, started for a
 * check, and what its end reports. */
struct two {
  const char *check; /* the check's name: "killed during pause" */
  char out[2][128];  /* the workers' output files */
  pid_t pid[2];
  int fail0;   /* failures before the check */
  uint64_t fb; /* the driver's free bytes before the workers */
};

/* Start a check's two workers of count buffers each, named names[0] and
 * names[1] (the second with b_extra among its arguments where that is
 * not NULL), their output in <prefix>_<name>: false, with the check's
 * setup failed, where one did not start. */
static bool two_start(struct two *t, const char *check_name, const char *tag, const char *count,
                      const char *prefix, const char *const names[2], const char *b_extra) {
  t->check = check_name;
  for (int i = 0; i < 2; i++) {
    char file[32];
    snprintf(file, sizeof file, "%s_%s", prefix, names[i]);
    out_path(t->out[i], sizeof t->out[i], file);
  }
  t->fail0 = failures;
  t->fb = settled_free();
  for (int i = 0; i < 2; i++) {
    const char *args[] = {"--tag",  tag,      "--size",                 unit_s, "--count",
                          count,    "--name", names[i], i ? b_extra : NULL, NULL};
    t->pid[i] = spawn_worker(t->out[i], args);
  }
  if (t->pid[0] >= 0 && t->pid[1] >= 0) return true;
  char name[96];
  snprintf(name, sizeof name, "%s: setup", check_name);
  check(false, name, "workers did not start");
  return false;
}

/* A check's last word on its two workers, exited with ea and eb (wait
 * statuses; what (the workers) in the message): the device has its
 * memory back; where the check failed, both outputs are shown, labelled
 * la and lb. */
static void two_end(const struct two *t, int ea, int eb, const char *what, const char *la,
                    const char *lb) {
  uint64_t fe = wait_free_ge(t->fb - SLACK, 15000);
  char name[96];
  snprintf(name, sizeof name, "%s: device clean afterwards", t->check);
  check(ea == 0 && eb == 0 && fe + SLACK >= t->fb, name, "%s; driver free %.3f GiB (%.3f before)",
        what, gib(fe), gib(t->fb));
  if (failures != t->fail0) {
    dump(la, t->out[0]);
    dump(lb, t->out[1]);
  }
}

/* The names of a kill check's two workers. */
static const char *const victim_survivor[2] = {"victim", "survivor"};

/* Kill a check's first worker (the victim) while an operation (opname,
 * in b) is in flight, and wait for the operation's answer: whether it
 * came; the victim's exit status in *ek. */
static bool kill_victim(struct two *t, struct bg *b, const char *opname, int *ek) {
  char buf[1024];
  *ek = reap(t->pid[0], SIGKILL, 10000);
  t->pid[0] = -1;
  bool answered = bg_wait(b, 25000);
  printf("the %s answered: %s\n", opname,
         answered ? bg_words(b, buf, sizeof buf) : "no answer within 25 s");
  return answered;
}

/* The end of a kill check: what is left of the victim killed, the
 * survivor stopped, and the device clean. */
static void killed_end(const struct two *t) {
  char what[64];
  reap(t->pid[0], SIGKILL, 10000);
  int es = reap(t->pid[1], SIGTERM, 20000);
  snprintf(what, sizeof what, "survivor exited %d", es);
  two_end(t, 0, es, what, "victim", "survivor");
}

/* ---- 1. a worker stopped during a pause ---- */

static void stopped_worker(void) {
  begin("stopped worker");
  const char *tag = "f_stop";
  const uint64_t each = 4 * unit; /* 4 x 1 GiB per worker */
  char buf[1024], tb[256];
  struct two t;
  bool started =
      two_start(&t, "stopped worker", tag, "4", "stop", (const char *[]){"healthy", "stopped"}, NULL);
  pid_t h = t.pid[0], w = t.pid[1];
  const char *oh = t.out[0], *ow = t.out[1];
  uint64_t fb = t.fb;
  struct gpumem_op_report *r = NULL;
  if (!started) goto out;
  uint64_t f1 = settled_free();
  printf("free %.3f GiB before the workers, %.3f GiB with them (2 x %.3f GiB)\n", gib(fb),
         gib(f1), gib(each));
  if (!stop_child(w)) {
    check(false, "stopped worker: setup", "pid %d did not stop", (int)w);
    goto out;
  }
  double t0 = now_ms();
  int rc = op(false, tag, 1000, 0, &r);
  double took = now_ms() - t0;
  uint64_t f2 = settled_free(), f2max = max_free_over(500);
  check(rc == GPUMEM_E_CLIENT_TIMEOUT && r && r->npids == 1 && has_pid(r, w) &&
            r->bytes_held == each && r->buffers_held == 4,
        "stopped worker: pause answers CLIENT_TIMEOUT naming it",
        "after %.0f ms (timeout 1000 ms): %s; the stopped pid %d holds %.3f GiB", took,
        words(rc, r, buf, sizeof buf), (int)w, gib(each));
  check(f2 >= f1 + each - slack(4) && f2max < f1 + each + each / 2,
        "stopped worker: only the healthy worker's memory is freed",
        "driver free %.3f -> %.3f GiB (at most %.3f over 0.5 s): rose %.3f GiB, the healthy "
        "worker's %.3f GiB, not also the stopped worker's %.3f GiB",
        gib(f1), gib(f2), gib(f2max), sgib(f2, f1), gib(each), gib(each));
  gpumem_op_report_free(r);
  r = NULL;
  struct tagview v = tag_status(tag);
  char st[128];
  out_path(st, sizeof st, "stop_status");
  int ctl_rc = gpumemctl(st, "status");
  char line[96];
  snprintf(line, sizeof line, "%s: 4 buffers (", tag);
  bool said = ctl_rc == 0 && count_in(st, line) == 1 &&
              count_in(st, "PAUSING: an owner has not answered; their memory is still held") >= 1;
  check(v.found && v.t.state == GPUMEM_PAUSING && v.t.transit_buffers == 4 &&
            v.t.transit_bytes == each && v.t.paused_buffers == 4 && said,
        "stopped worker: status shows the tag in transition",
        "%s; gpumemctl status %s", tag_words(&v, tb, sizeof tb),
        said ? "names the 4 buffers still held" : "does not say so");
  /* The case: a second pause must not answer success. */
  int rc2 = op(false, tag, 1000, 0, &r);
  bool second_ok = rc2 == GPUMEM_E_CLIENT_TIMEOUT && has_pid(r, w) && r->bytes_held == each;
  char buf2[1024];
  words(rc2, r, buf2, sizeof buf2);
  gpumem_op_report_free(r);
  r = NULL;
  int rc3 = op(true, tag, 1000, 0, &r);
  bool resume_refused = rc3 == GPUMEM_E_CLIENT_TIMEOUT && has_pid(r, w);
  uint64_t f3 = settled_free();
  v = tag_status(tag);
  check(second_ok && resume_refused && v.t.transit_buffers == 4 && f3 + slack(4) >= f2 &&
            f3 < f2 + each / 2,
        "stopped worker: pause and resume meanwhile refuse, naming it",
        "second pause: %s; resume: %s; free %.3f GiB; %s", buf2, words(rc3, r, buf, sizeof buf),
        gib(f3), tag_words(&v, tb, sizeof tb));
  gpumem_op_report_free(r);
  r = NULL;
  /* The late ack settles the stopped worker's buffers. */
  kill(w, SIGCONT);
  t0 = now_ms();
  v = wait_tag(tag, GPUMEM_PAUSED, 8, 20000);
  double settled_ms = now_ms() - t0;
  uint64_t f4 = wait_free_ge(f1 + 2 * each - slack(8), 15000);
  check(v.found && v.t.state == GPUMEM_PAUSED && v.t.transit_buffers == 0 &&
            v.t.paused_buffers == 8 && f4 + slack(8) >= f1 + 2 * each,
        "stopped worker: after SIGCONT the late ack releases its memory",
        "%s after %.0f ms; driver free %.3f -> %.3f GiB: rose %.3f GiB since the pause began "
        "(both workers' %.3f GiB)",
        tag_words(&v, tb, sizeof tb), settled_ms, gib(f3), gib(f4), sgib(f4, f1),
        gib(2 * each));
  int rc4 = op(true, tag, 30000, 0, &r);
  int vh = wait_count(oh, "verified buffer", 4, 60000), vw = wait_count(ow, "verified buffer", 4, 60000);
  uint64_t f5 = settled_free();
  v = tag_status(tag);
  check(rc4 == 0 && vh == 4 && vw == 4 && count_in(oh, "FAILED") + count_in(ow, "FAILED") == 0 &&
            v.t.state == GPUMEM_ACTIVE && f4 >= f5 + 2 * each - slack(8),
        "stopped worker: then resume works and both workers verify",
        "%s; driver free %.3f -> %.3f GiB: dropped %.3f GiB; verified %d/4 healthy, %d/4 "
        "stopped; %s",
        words(rc4, r, buf, sizeof buf), gib(f4), gib(f5), sgib(f4, f5), vh, vw,
        tag_words(&v, tb, sizeof tb));
out:
  gpumem_op_report_free(r);
  int eh = reap(h, SIGTERM, 20000), ew = reap(w, SIGTERM, 20000);
  snprintf(buf, sizeof buf, "workers exited %d and %d", eh, ew);
  two_end(&t, eh, ew, buf, "healthy worker", "stopped worker");
}

/* ---- 2. workers killed during a pause and during a resume ---- */

/* A kill check: its two workers (victim and survivor, 4 buffers each),
 * its tag, and what its steps leave for the end to let go of. */
struct kill {
  struct two t;
  const char *tag;
  uint64_t each, f1; /* a worker's bytes; the driver's free bytes with both */
  struct bg *b;      /* the operation the victim is killed in */
  struct gpumem_op_report *r;
};

/* Run a kill check (name, tag, output prefix): its workers started and,
 * once the driver's figure settled, steps; then all let go of and the
 * device checked clean. */
static void kill_check(const char *name, const char *tag, const char *prefix,
                       void (*steps)(struct kill *k)) {
  begin(name);
  struct kill k = {.tag = tag, .each = 4 * unit};
  if (two_start(&k.t, name, tag, "4", prefix, victim_survivor, NULL)) {
    k.f1 = settled_free();
    steps(&k);
  }
  gpumem_op_report_free(k.r);
  bg_free(k.b);
  killed_end(&k.t);
}

/* The victim killed while a pause waits for it. */
static void pause_steps(struct kill *k) {
  const char *tag = k->tag, *os = k->t.out[1];
  const uint64_t each = k->each, f1 = k->f1;
  char buf[1024], tb[256];
  if (!stop_child(k->t.pid[0])) {
    check(false, "killed during pause: setup", "pid %d did not stop", (int)k->t.pid[0]);
    return;
  }
  k->b = bg_start(false, tag, 20000);
  /* In flight: the survivor's buffers paused, the victim's still PAUSING. */
  struct tagview v = wait_transit(tag, 4, 4, 10000);
  bool inflight = v.found && v.t.transit_buffers == 4 && v.t.paused_buffers == 4 &&
                  k->b && !atomic_load(&k->b->done);
  printf("pause in flight: %s; killing pid %d\n", tag_words(&v, tb, sizeof tb), (int)k->t.pid[0]);
  pid_t vpid = k->t.pid[0];
  int ek;
  bool answered = kill_victim(&k->t, k->b, "pause", &ek);
  uint64_t f2 = wait_free_ge(f1 + 2 * each - slack(8), 15000);
  check(inflight && answered && f2 + slack(8) >= f1 + 2 * each,
        "killed during pause: the driver gets its memory back",
        "killed (status %d) while its unmap was pending; driver free %.3f -> %.3f GiB: rose "
        "%.3f GiB (the victim's %.3f GiB and the survivor's %.3f GiB)",
        ek, gib(f1), gib(f2), sgib(f2, f1), gib(each), gib(each));
  v = wait_tag(tag, GPUMEM_PAUSED, 4, 5000);
  struct gpumem_session_status ss;
  bool gone = !session_of(vpid, &ss);
  check(v.found && v.t.state == GPUMEM_PAUSED && v.t.transit_buffers == 0 && v.t.buffers == 4 &&
            v.t.paused_buffers == 4 && gone,
        "killed during pause: no tag stuck in transition", "%s; the victim's session %s",
        tag_words(&v, tb, sizeof tb), gone ? "is gone" : "is still there");
  uint64_t f3 = settled_free();
  int rc = op(true, tag, 30000, 0, &k->r);
  int vs = wait_count(os, "verified buffer", 4, 60000);
  uint64_t f4 = settled_free();
  v = tag_status(tag);
  check(rc == 0 && vs == 4 && count_in(os, "FAILED") == 0 && v.t.state == GPUMEM_ACTIVE &&
            v.t.buffers == 4 && f3 >= f4 + each - slack(4),
        "killed during pause: the survivor resumes and verifies",
        "%s; driver free %.3f -> %.3f GiB: dropped %.3f GiB (its %.3f GiB); verified %d/4; %s",
        words(rc, k->r, buf, sizeof buf), gib(f3), gib(f4), sgib(f3, f4), gib(each), vs,
        tag_words(&v, tb, sizeof tb));
}

/* The victim killed while a resume waits for it. */
static void resume_steps(struct kill *k) {
  const char *tag = k->tag, *os = k->t.out[1];
  const uint64_t each = k->each, f1 = k->f1;
  char buf[1024], tb[256];
  int rc = op(false, tag, 10000, 0, &k->r);
  uint64_t fp = wait_free_ge(f1 + 2 * each - slack(8), 15000);
  if (rc != 0 || fp + slack(8) < f1 + 2 * each) {
    check(false, "killed during resume: setup", "pause: %s; driver free %.3f -> %.3f GiB",
          words(rc, k->r, buf, sizeof buf), gib(f1), gib(fp));
    return;
  }
  gpumem_op_report_free(k->r);
  k->r = NULL;
  if (!stop_child(k->t.pid[0])) {
    check(false, "killed during resume: setup", "pid %d did not stop", (int)k->t.pid[0]);
    return;
  }
  k->b = bg_start(true, tag, 20000);
  /* In flight: every buffer RESUMING (the victim cannot ack), and the
   * survivor has mapped and checked its buffers. */
  struct tagview v = wait_transit(tag, 8, 0, 10000);
  int vs0 = wait_count(os, "verified buffer", 4, 30000);
  v = tag_status(tag);
  bool inflight =
      v.found && v.t.transit_buffers == 8 && vs0 == 4 && k->b && !atomic_load(&k->b->done);
  printf("resume in flight: %s; survivor verified %d/4; killing pid %d\n",
         tag_words(&v, tb, sizeof tb), vs0, (int)k->t.pid[0]);
  pid_t vpid = k->t.pid[0];
  int ek;
  bool answered = kill_victim(&k->t, k->b, "resume", &ek);
  /* What the resume made for the victim must go back: only the
   * survivor's 4 GiB may be taken since the pause. */
  uint64_t f2 = wait_free_ge(fp - each - slack(4), 15000);
  check(inflight && answered && f2 + each + slack(4) >= fp,
        "killed during resume: the driver gets its memory back",
        "killed (status %d) while its remap was pending; driver free %.3f GiB paused -> %.3f "
        "GiB: %.3f GiB taken, the survivor's %.3f GiB (the victim's %.3f GiB not held)",
        ek, gib(fp), gib(f2), sgib(fp, f2), gib(each), gib(each));
  v = tag_status(tag);
  bool again = false;
  if (v.found && v.t.transit_buffers == 0 && v.t.state == GPUMEM_PAUSED) {
    /* The daemon may also have rolled the resume back: then the rest must
     * resume now. */
    again = true;
    rc = op(true, tag, 30000, 0, &k->r);
    printf("the tag was PAUSED after the failed resume; resumed again: %s\n",
           words(rc, k->r, buf, sizeof buf));
    gpumem_op_report_free(k->r);
    k->r = NULL;
  }
  v = wait_tag(tag, GPUMEM_ACTIVE, 0, 5000);
  struct gpumem_session_status ss;
  bool gone = !session_of(vpid, &ss);
  /* 4 verifications per resume the survivor mapped (two if rolled back). */
  int vs1 = wait_count(os, "verified buffer", again ? 8 : 4, 30000);
  check(v.found && v.t.state == GPUMEM_ACTIVE && v.t.transit_buffers == 0 && v.t.buffers == 4 &&
            gone && vs1 == (again ? 8 : 4) && count_in(os, "FAILED") == 0,
        "killed during resume: no tag stuck in transition, the survivor resumed",
        "%s%s; the victim's session %s; survivor verified %d/%d", tag_words(&v, tb, sizeof tb),
        again ? " (after a second resume)" : "", gone ? "is gone" : "is still there", vs1,
        again ? 8 : 4);
  /* The survivor's buffers stay consistent: one more round. */
  uint64_t f3 = settled_free();
  rc = op(false, tag, 10000, 0, &k->r);
  uint64_t f4 = wait_free_ge(f3 + each - slack(4), 15000);
  char buf2[1024];
  words(rc, k->r, buf2, sizeof buf2);
  gpumem_op_report_free(k->r);
  k->r = NULL;
  int rc2 = op(true, tag, 30000, 0, &k->r);
  int vs2 = wait_count(os, "verified buffer", vs1 + 4, 60000);
  uint64_t f5 = settled_free();
  v = tag_status(tag);
  check(rc == 0 && rc2 == 0 && f4 + slack(4) >= f3 + each && f4 + slack(4) >= f5 + each &&
            vs2 == vs1 + 4 && count_in(os, "FAILED") == 0 && v.t.state == GPUMEM_ACTIVE,
        "killed during resume: the survivor pauses and resumes again",
        "pause: %s, driver free %.3f -> %.3f GiB; resume: %s, -> %.3f GiB; verified %d more; %s",
        buf2, gib(f3), gib(f4), words(rc2, k->r, buf, sizeof buf), gib(f5), vs2 - vs1,
        tag_words(&v, tb, sizeof tb));
}

/* ---- 3. memory held outside the daemon, by pid ---- */

#define OUTSIDE_BYTES (2 * unit)
#define OUTSIDE_TAG_BYTES (4 * unit)

/* The child: 2 GiB with cuMemAlloc, outside gpumemd, and a 4 GiB buffer
 * from it, until SIGTERM. */
static int outside_main(const char *socket_path, const char *name, const char *tag) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  prctl(PR_SET_NAME, name, 0, 0, 0);
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &term, NULL); /* before any thread starts */
  CUdevice dev;
  CUcontext ctx;
  CUdeviceptr p = 0;
  CUresult cr;
  if ((cr = cuInit(0)) || (cr = cuDeviceGet(&dev, 0)) ||
      (cr = cuDevicePrimaryCtxRetain(&ctx, dev)) || (cr = cuCtxSetCurrent(ctx)) ||
      (cr = cuMemAlloc(&p, OUTSIDE_BYTES)) || (cr = cuMemsetD8(p, 0x5a, OUTSIDE_BYTES)) ||
      (cr = cuCtxSynchronize())) {
    printf("outside: CUDA error %d\n", (int)cr);
    return 1;
  }
  gpumem_client *c;
  gpumem_buffer *b;
  if (gpumem_connect(socket_path, name, GPUMEM_ROLE_WORKER, 0, &c) < 0 ||
      gpumem_alloc(c, tag, 0, OUTSIDE_TAG_BYTES, 0, &b) < 0) {
    printf("outside: %s\n", gpumem_last_error());
    return 1;
  }
  printf("pid %d: %.3f GiB with cuMemAlloc at 0x%llx outside gpumemd, %.3f GiB tagged %s from "
         "it at %p\nready\n",
         (int)getpid(), gib(OUTSIDE_BYTES), (unsigned long long)p, gib(OUTSIDE_TAG_BYTES), tag,
         gpumem_buffer_ptr(b));
  int sig;
  sigwait(&term, &sig);
  gpumem_disconnect(c);
  cuMemFree(p);
  return 0;
}

/* Start the outside child (outside_main) with its stdout into out, as
 * spawn_ready does. */
static pid_t spawn_outside(const char *out, const char *name, const char *tag) {
  const char *argv[] = {"gpu_faults", "--outside", sock, name, tag, NULL};
  return spawn_ready(out, "/proc/self/exe", argv, "outside");
}

static void residual_by_pid(void) {
  begin("memory outside gpumemd");
  const char *tag = "f_resid", *name = "outside-2g";
  char oc[128], st[128], pc[128], buf[1024], tb[256];
  out_path(oc, sizeof oc, "outside");
  out_path(st, sizeof st, "outside_status");
  out_path(pc, sizeof pc, "outside_pause");
  int fail0 = failures;
  struct gpumem_op_report *r = NULL;
  uint64_t fb = settled_free();
  pid_t child = spawn_outside(oc, name, tag);
  if (child < 0) {
    check(false, "outside: setup", "the child did not start");
    goto out;
  }
  uint64_t f1 = settled_free();
  printf("free %.3f GiB before the child, %.3f GiB with it (%.3f GiB outside + %.3f GiB "
         "tagged + its context)\n",
         gib(fb), gib(f1), gib(OUTSIDE_BYTES), gib(OUTSIDE_TAG_BYTES));
  /* The status's process list and session, against the child's pid. */
  struct gpumem_status *s = NULL;
  uint64_t p_res = 0, p_used = 0, s_res = 0;
  bool p_found = false, s_found = false, known = false;
  if (gpumem_status(ctl, &s) == 0) {
    known = s->processes_known;
    for (size_t i = 0; i < s->nprocesses; i++)
      if (s->processes[i]->pid == (uint32_t)child && s->processes[i]->device == 0) {
        p_found = true;
        p_res = s->processes[i]->residual;
        p_used = s->processes[i]->used;
      }
    for (size_t i = 0; i < s->nsessions; i++)
      if (s->sessions[i]->pid == (uint32_t)child && s->sessions[i]->residual_known) {
        s_found = true;
        s_res = s->sessions[i]->residual;
      }
    gpumem_status_free(s);
  }
  int ctl_rc = gpumemctl(st, "status");
  char line[128];
  snprintf(line, sizeof line, "pid %d (%s) holds ", (int)child, name);
  char *text = slurp(st), *at = text ? strstr(text, line) : NULL;
  char *eol = at ? strchr(at, '\n') : NULL;
  if (eol) *eol = '\0';
  bool named = ctl_rc == 0 && at && strstr(at, " outside gpumemd");
  check(known && p_found && p_res >= OUTSIDE_BYTES && s_found && s_res >= OUTSIDE_BYTES && named,
        "outside: status shows it against the pid",
        "processes: pid %d used %.3f GiB, residual %.3f GiB; its session: residual %.3f GiB; "
        "gpumemctl status: \"%s\"",
        (int)child, gib(p_used), gib(p_res), gib(s_res), at ? at : "(no line for the pid)");
  free(text);
  /* A pause with max_residual 1 GiB: fails, naming the pid, yet releases. */
  int rc = op(false, tag, 10000, unit, &r);
  uint64_t f2 = wait_free_ge(f1 + OUTSIDE_TAG_BYTES - slack(1), 15000);
  char pidword[32];
  snprintf(pidword, sizeof pidword, "pid %d (", (int)child);
  bool says_pid = r && r->message && strstr(r->message, pidword);
  uint64_t c_res = r && r->nchecks ? r->checks[0]->residual : 0;
  bool c_known = r && r->nchecks && r->checks[0]->residual_known;
  struct tagview v = tag_status(tag);
  check(rc == GPUMEM_E_RESIDUAL && says_pid && c_known && c_res >= OUTSIDE_BYTES,
        "outside: pause with max_residual 1 GiB fails naming the pid",
        "%s; the device check: residual %.3f GiB", words(rc, r, buf, sizeof buf), gib(c_res));
  check(f2 + slack(1) >= f1 + OUTSIDE_TAG_BYTES && v.found && v.t.state == GPUMEM_PAUSED &&
            v.t.transit_buffers == 0,
        "outside: the failed pause still released the tag",
        "driver free %.3f -> %.3f GiB: rose %.3f GiB for the tag's %.3f GiB; daemon's check: "
        "released %.3f GiB, free %.3f -> %.3f GiB; %s",
        gib(f1), gib(f2), sgib(f2, f1), gib(OUTSIDE_TAG_BYTES),
        gib(r && r->nchecks ? r->checks[0]->released : 0),
        gib(r && r->nchecks ? r->checks[0]->free_before : 0),
        gib(r && r->nchecks ? r->checks[0]->free_after : 0), tag_words(&v, tb, sizeof tb));
  gpumem_op_report_free(r);
  r = NULL;
  /* The same through gpumemctl: exit status 1. */
  rc = op(true, tag, 30000, 0, &r);
  uint64_t f3 = settled_free();
  char args[128];
  snprintf(args, sizeof args, "--timeout 10000 --max-residual %s pause %s", unit_s, tag);
  int ex = gpumemctl(pc, args);
  uint64_t f4 = wait_free_ge(f3 + OUTSIDE_TAG_BYTES - slack(1), 15000);
  text = slurp(pc);
  bool ctl_says = text && strstr(text, "RESIDUAL") && strstr(text, pidword);
  free(text);
  check(rc == 0 && ex == 1 && ctl_says && f4 + slack(1) >= f3 + OUTSIDE_TAG_BYTES,
        "outside: gpumemctl pause --max-residual 1G exits 1",
        "resume first: %s; gpumemctl exit %d, %s; driver free %.3f -> %.3f GiB (rose %.3f GiB)",
        words(rc, r, buf, sizeof buf), ex,
        ctl_says ? "names RESIDUAL and the pid" : "does not name RESIDUAL and the pid", gib(f3),
        gib(f4), sgib(f4, f3));
out:
  gpumem_op_report_free(r);
  int ec = reap(child, SIGTERM, 20000);
  uint64_t fe = wait_free_ge(fb - SLACK, 15000);
  check(ec == 0 && fe + SLACK >= fb, "outside: device clean afterwards",
        "child exited %d; driver free %.3f GiB (%.3f before)", ec, gib(fe), gib(fb));
  if (failures != fail0) dump("outside child", oc);
}

/* ---- 4. the daemon killed and restarted under two workers ---- */

static void daemon_restart(void) {
  begin("daemon restart");
  const char *tag = "f_restart";
  const uint64_t each = 8 * unit, total = 2 * each; /* 2 x (8 x 1 GiB) */
  char buf[1024], tb[256];
  struct gpumem_op_report *r = NULL;
  struct two t;
  bool started =
      two_start(&t, "restart", tag, "8", "restart", (const char *[]){"plain", "backup"}, "--backup");
  pid_t w1 = t.pid[0], w2 = t.pid[1];
  const char *op1 = t.out[0], *op2 = t.out[1];
  uint64_t fb = t.fb;
  if (!started) goto out;
  uint64_t f1 = settled_free();
  struct gpumem_status *s = NULL;
  uint64_t managed0 = 0;
  if (gpumem_status(ctl, &s) == 0) {
    managed0 = s->devices[0]->managed;
    gpumem_status_free(s);
  }
  check(fb + slack(16) >= f1 + total && managed0 == total, "restart: two workers hold 16 GiB",
        "driver free %.3f -> %.3f GiB: dropped %.3f GiB; the daemon manages %.3f GiB", gib(fb),
        gib(f1), sgib(fb, f1), gib(managed0));
  /* SIGKILL the daemon: nothing is told, nothing is cleaned up. */
  ctl_close();
  pid_t old = daemon_pid;
  int ed = reap(daemon_pid, SIGKILL, 10000);
  daemon_pid = -1;
  uint64_t f2 = settled_free(), f2max = max_free_over(1000);
  bool both = alive(w1) && alive(w2);
  check(ed == 128 + SIGKILL && both && fb + slack(16) >= f2max + total &&
            f2max < f1 + total / 2,
        "restart: after SIGKILL of the daemon the driver still shows the 16 GiB used",
        "daemon %d status %d; workers %s; driver free %.3f -> %.3f GiB (at most %.3f over 1 s): "
        "rose %.3f GiB (the daemon's own context at most, not the workers' %.3f GiB), %.3f GiB "
        "still used since the start",
        (int)old, ed, both ? "alive" : "not both alive", gib(f1), gib(f2), gib(f2max),
        sgib(f2max, f1), gib(total), sgib(fb, f2max));
  double t0 = now_ms();
  if (!start_daemon()) {
    check(false, "restart: the daemon restarts on the same socket", "see %s", daemon_log);
    goto out;
  }
  int re1 = wait_count(op1, "re-registered 8 buffers with gpumemd", 1, 30000);
  int re2 = wait_count(op2, "re-registered 8 buffers with gpumemd", 1, 30000);
  double re_ms = now_ms() - t0;
  /* Each worker reads its buffers back after the re-registration. */
  int k1 = wait_count(op1, "contents kept across the restart", 8, 60000);
  int k2 = wait_count(op2, "contents kept across the restart", 8, 60000);
  struct tagview v = tag_status(tag);
  struct gpumem_session_status s1 = {0}, s2 = {0};
  bool h1 = session_of(w1, &s1), h2 = session_of(w2, &s2);
  uint64_t managed1 = 0;
  if (gpumem_status(ctl, &s) == 0) {
    managed1 = s->devices[0]->managed;
    gpumem_status_free(s);
  }
  check(re1 >= 1 && re2 >= 1 && k1 == 8 && k2 == 8 && v.found && v.t.state == GPUMEM_ACTIVE &&
            v.t.buffers == 16 && v.t.bytes == total && managed1 == total && h1 &&
            s1.buffers == 8 && h2 && s2.buffers == 8,
        "restart: the workers re-register with the new daemon",
        "re-registered lines %d and %d within %.0f ms of the restart; contents kept %d/8 and "
        "%d/8; %s; the daemon manages %.3f GiB; sessions: pid %d %llu buffers, pid %d %llu "
        "buffers",
        re1, re2, re_ms, k1, k2, tag_words(&v, tb, sizeof tb), gib(managed1), (int)w1,
        (unsigned long long)s1.buffers, (int)w2, (unsigned long long)s2.buffers);
  uint64_t f3 = settled_free();
  int rc = op(false, tag, 60000, 0, &r);
  uint64_t f4 = wait_free_ge(f3 + total - slack(16), 20000);
  check(rc == 0 && r && r->bytes == total && f4 + slack(16) >= f3 + total,
        "restart: a pause then frees the 16 GiB",
        "%s, %.3f GiB released (%.3f GiB backed up) in %.1f ms; driver free %.3f -> %.3f GiB: "
        "rose %.3f GiB",
        words(rc, r, buf, sizeof buf), gib(r ? r->bytes : 0), gib(r ? r->backup_bytes : 0),
        r ? r->elapsed_us / 1e3 : 0.0, gib(f3), gib(f4), sgib(f4, f3));
  gpumem_op_report_free(r);
  r = NULL;
  rc = op(true, tag, 60000, 0, &r);
  int m1 = wait_count(op1, "writable and readable", 8, 60000);
  int m2 = wait_count(op2, ": contents kept\n", 8, 60000);
  uint64_t f5 = settled_free();
  int bad = count_in(op1, "FAILED") + count_in(op2, "FAILED");
  check(rc == 0 && f4 + slack(16) >= f5 + total && m1 == 8 && m2 == 8 && bad == 0,
        "restart: resume, and the workers' contents verify",
        "%s; driver free %.3f -> %.3f GiB: dropped %.3f GiB; plain worker %d/8 writable and "
        "readable, backup worker %d/8 contents kept; %d failures",
        words(rc, r, buf, sizeof buf), gib(f4), gib(f5), sgib(f4, f5), m1, m2, bad);
out:
  gpumem_op_report_free(r);
  int e1 = reap(w1, SIGTERM, 20000), e2 = reap(w2, SIGTERM, 20000);
  snprintf(buf, sizeof buf, "workers exited %d and %d", e1, e2);
  two_end(&t, e1, e2, buf, "plain worker", "backup worker");
}

int main(int argc, char **argv) {
  if (getenv("GPU_FAULTS_BACKEND")) backend = getenv("GPU_FAULTS_BACKEND");
  if (getenv("GPU_FAULTS_UNIT_MB")) {
    unsigned long mb = strtoul(getenv("GPU_FAULTS_UNIT_MB"), NULL, 10);
    if (mb == 0 || mb % 2) return 2;
    unit = (uint64_t)mb * MiB;
    snprintf(unit_s, sizeof unit_s, "%luM", mb);
  }
  if (argc == 5 && strcmp(argv[1], "--outside") == 0) return outside_main(argv[2], argv[3], argv[4]);
  if (argc != 4) {
    fprintf(stderr, "usage: gpu_faults BIN_DIR SOCKET DAEMON_LOG\n");
    return 2;
  }
  bin = argv[1];
  sock = argv[2];
  daemon_log = argv[3];
  setvbuf(stdout, NULL, _IOLBF, 0);
  signal(SIGALRM, on_alarm);
  snprintf(outdir, sizeof outdir, "/tmp/gpu_faults.XXXXXX");
  if (!mkdtemp(outdir)) {
    perror("mkdtemp");
    return 100;
  }
  CUdevice dev;
  CUcontext ctx;
  if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) ||
      cuCtxSetCurrent(ctx)) {
    fprintf(stderr, "gpu_faults: no CUDA device\n");
    return 100;
  }
  alarm(60);
  if (!start_daemon()) {
    printf("FAIL setup: gpumemd did not start; see %s\n", daemon_log);
    return 100;
  }
  alarm(0);
  struct gpumem_status *s;
  if (gpumem_status(ctl, &s) == 0) {
    gran = s->granularity ? s->granularity : gran;
    printf("backend %s, granularity %llu bytes, %zu devices; worker output in %s\n", s->backend,
           (unsigned long long)gran, s->ndevices, outdir);
    gpumem_status_free(s);
  }
  double t0 = now_ms();
  stopped_worker();
  kill_check("killed during pause", "f_killp", "killp", pause_steps);
  kill_check("killed during resume", "f_killr", "killr", resume_steps);
  residual_by_pid();
  daemon_restart();
  current_check = "daemon stops";
  alarm(CHECK_ALARM_S);
  ctl_close();
  int ed = daemon_pid > 0 ? reap(daemon_pid, SIGTERM, 15000) : -1;
  check(ed == 0, "gpumemd stops cleanly on SIGTERM", "exit status %d", ed);
  alarm(0);
  printf("%d failures in %.1f s\n", failures, (now_ms() - t0) / 1e3);
  return failures;
}
