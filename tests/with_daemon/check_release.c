/* Context release (a pause with release_context) on the host backend,
 * whose stand-in for the driver's checkpoint stops the worker's process
 * (SIGSTOP) and lets it go on (SIGCONT): the kernel's word on the process
 * (/proc/PID/stat) says whether it is released. Real workers (gpumem-worker,
 * and forked processes on libgpumem) opt in with GPUMEM_RELEASE_CONTEXT=1;
 * the refusals, a worker that dies while released, and a daemon that stops
 * or dies while a worker is released. */
#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpumem.h"
#include "common/procstat.h"
#include "harness.h"

static struct daemon d;

/* Workers a test started: a failed assertion must not leave one stopped
 * (a stopped process keeps a SIGTERM pending for ever). */
static pid_t started[8];
static size_t nstarted;

/* Note a worker's pid for the teardown. */
static void track(pid_t pid) {
  if (nstarted < sizeof started / sizeof started[0]) started[nstarted++] = pid;
}

/* Let every worker of the test go on and end, then stop the daemon. */
static void teardown(void) {
  for (size_t i = 0; i < nstarted; i++) {
    kill(started[i], SIGCONT);
    kill(started[i], SIGKILL);
  }
  nstarted = 0;
  harness_daemon_teardown(&d);
}

/* The state letter of a process ('T': stopped, 'Z': a zombie), 0 when
 * it is gone. */
static char proc_state(pid_t pid) {
  struct procstat st;
  return procstat_read((int)pid, &st) == 0 ? st.state : 0;
}

/* A gpumem-worker of 8 MiB of kv, opted in to context release or not. */
static void start_worker(struct worker *w, bool opt_in) {
  if (opt_in) setenv("GPUMEM_RELEASE_CONTEXT", "1", 1);
  worker_start(w, &d, "--tag", "kv", "--size", "8M", NULL);
  unsetenv("GPUMEM_RELEASE_CONTEXT");
  track(w->pid);
}

/* A controller of d. */
static gpumem_client *controller(void) {
  gpumem_client *c;
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &c), 0);
  return c;
}

/* Pause tag (NULL: every tag) asking for a release: the call's code, the
 * report in *r. */
static int pause_releasing(gpumem_client *c, const char *tag, struct gpumem_op_report **r) {
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.release_context = 1;
  const char *tags[] = {tag};
  return gpumem_pause(c, tags, tag ? 1 : 0, NULL, 0, &o, r);
}

/* Resume every tag: the call's code, the report in *r. */
static int resume_all(gpumem_client *c, struct gpumem_op_report **r) {
  return gpumem_resume(c, NULL, 0, NULL, 0, NULL, r);
}

/* The session status of pid's first session; NULL-free: fails if none. */
static struct gpumem_session_status *session_of(struct gpumem_status *s, pid_t pid) {
  for (size_t i = 0; i < s->nsessions; i++)
    if (s->sessions[i]->pid == (uint32_t)pid) return s->sessions[i];
  ck_abort_msg("no session of pid %d", (int)pid);
  return NULL;
}

/* Wait (bounded) until the daemon lists n sessions. */
static void wait_sessions(gpumem_client *c, size_t n) {
  double end = now_ms() + harness_patience_ms(2000);
  size_t now;
  do {
    struct gpumem_status *s;
    ck_assert_int_eq(gpumem_status(c, &s), 0);
    now = s->nsessions;
    gpumem_status_free(s);
  } while (now != n && now_ms() < end);
  ck_assert_uint_eq(now, n);
}

/* One status round trip: the daemon's loop has turned since. */
static void round_trip(gpumem_client *c) {
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  gpumem_status_free(s);
}

/* The daemon's journal of released processes. */
static bool journal_names(pid_t pid) {
  char path[160], line[64];
  snprintf(path, sizeof path, "%s.released", d.socket);
  FILE *f = fopen(path, "re");
  bool found = false;
  while (f && fgets(line, sizeof line, f)) found |= atoi(line) == (int)pid;
  if (f) fclose(f);
  return found;
}

/* A worker that opted in is stopped once its buffers are paused, said so
 * in the reply, the status and the journal; the resume lets it go on
 * before its remap, and it verifies its buffer. */
START_TEST(a_released_worker_stops_and_comes_back) {
  daemon_start(&d, NULL);
  struct worker w;
  start_worker(&w, true);
  gpumem_client *c = controller();
  struct gpumem_op_report *r;
  ck_assert_int_eq(pause_releasing(c, "kv", &r), 0);
  ck_assert_uint_eq(r->nreleases, 1);
  ck_assert_uint_eq(r->releases[0]->pid, (uint32_t)w.pid);
  ck_assert_int_eq(r->releases[0]->released, 1);
  ck_assert_str_eq(r->releases[0]->why, "");
  gpumem_op_report_free(r);
  ck_assert_int_eq(proc_state(w.pid), 'T');
  ck_assert(journal_names(w.pid));
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_int_eq(session_of(s, w.pid)->release_context, 1);
  ck_assert_int_eq(session_of(s, w.pid)->context_released, 1);
  gpumem_status_free(s);
  /* A second pause finds it released already: nothing more to do. */
  ck_assert_int_eq(pause_releasing(c, "kv", &r), 0);
  ck_assert_uint_eq(r->nreleases, 1);
  ck_assert_int_eq(r->releases[0]->released, 1);
  gpumem_op_report_free(r);
  ck_assert_int_eq(resume_all(c, &r), 0);
  ck_assert_uint_eq(r->nreleases, 1);
  ck_assert_int_eq(r->releases[0]->released, 0);
  ck_assert_str_eq(r->releases[0]->why, "");
  gpumem_op_report_free(r);
  ck_assert_int_ne(proc_state(w.pid), 'T');
  ck_assert(worker_wait_for(&w, "verified buffer", 1, harness_patience_ms(2000)));
  ck_assert(!journal_names(w.pid));
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_int_eq(session_of(s, w.pid)->context_released, 0);
  gpumem_status_free(s);
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* A worker that did not opt in is refused with the reason, and the pause
 * itself happens: its buffer is paused, the process runs. */
START_TEST(a_worker_that_did_not_opt_in_is_refused_and_paused) {
  daemon_start(&d, NULL);
  struct worker w;
  start_worker(&w, false);
  gpumem_client *c = controller();
  struct gpumem_op_report *r;
  ck_assert_int_eq(pause_releasing(c, "kv", &r), GPUMEM_E_RELEASE_REFUSED);
  ck_assert_str_eq(r->code, "RELEASE_REFUSED");
  ck_assert_msg(strstr(r->message, "did not opt in"), "%s", r->message);
  ck_assert_uint_eq(r->nreleases, 1);
  ck_assert_int_eq(r->releases[0]->released, 0);
  ck_assert_ptr_nonnull(strstr(r->releases[0]->why, "did not opt in"));
  gpumem_op_report_free(r);
  ck_assert_int_ne(proc_state(w.pid), 'T');
  ck_assert(worker_wait_for(&w, "paused buffer", 1, harness_patience_ms(2000)));
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_int_eq(session_of(s, w.pid)->context_released, 0);
  ck_assert_str_eq(s->tags[0]->name, "kv");
  ck_assert_int_eq(s->tags[0]->state, GPUMEM_PAUSED);
  gpumem_status_free(s);
  ck_assert_int_eq(resume_all(c, &r), 0);
  ck_assert_uint_eq(r->nreleases, 0);
  gpumem_op_report_free(r);
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* A forked worker on libgpumem, opted in, with 4 MiB in each of two tags;
 * it leaves when its pipe closes. */
static pid_t two_tag_worker(int *hold_w) {
  int ready[2], hold[2];
  ck_assert_int_eq(pipe(ready), 0);
  ck_assert_int_eq(pipe(hold), 0);
  pid_t kid = fork();
  ck_assert_int_ge(kid, 0);
  if (kid == 0) {
    close(ready[0]);
    close(hold[1]);
    gpumem_client *c;
    gpumem_buffer *a, *b;
    if (gpumem_connect(d.socket, "two", GPUMEM_ROLE_WORKER, GPUMEM_CONNECT_RELEASE_CONTEXT, &c) ||
        gpumem_alloc(c, "kv", 0, 4 << 20, 0, &a) || gpumem_alloc(c, "weights", 0, 4 << 20, 0, &b))
      _exit(1);
    (void)!write(ready[1], "r", 1);
    char x;
    (void)!read(hold[0], &x, 1);
    gpumem_disconnect(c);
    _exit(0);
  }
  close(ready[1]);
  close(hold[0]);
  char x;
  ck_assert_int_eq(read(ready[0], &x, 1), 1);
  close(ready[0]);
  *hold_w = hold[1];
  track(kid);
  return kid;
}

/* A worker that still maps a buffer (of a tag the pause did not name) is
 * refused, names the buffer, and keeps running; once everything of it is
 * paused it is released. */
START_TEST(a_worker_that_still_maps_a_buffer_is_refused) {
  daemon_start(&d, NULL);
  int hold;
  pid_t kid = two_tag_worker(&hold);
  gpumem_client *c = controller();
  struct gpumem_op_report *r;
  ck_assert_int_eq(pause_releasing(c, "kv", &r), GPUMEM_E_RELEASE_REFUSED);
  ck_assert_msg(strstr(r->message, "still maps buffer") && strstr(r->message, "tag weights"),
                "%s", r->message);
  gpumem_op_report_free(r);
  ck_assert_int_ne(proc_state(kid), 'T');
  ck_assert_int_eq(pause_releasing(c, "weights", &r), 0);
  ck_assert_uint_eq(r->nreleases, 1);
  ck_assert_int_eq(r->releases[0]->released, 1);
  gpumem_op_report_free(r);
  ck_assert_int_eq(proc_state(kid), 'T');
  ck_assert_int_eq(resume_all(c, &r), 0);
  gpumem_op_report_free(r);
  ck_assert_int_ne(proc_state(kid), 'T');
  close(hold);
  int st;
  ck_assert_int_eq(waitpid(kid, &st, 0), kid);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  gpumem_disconnect(c);
}
END_TEST

/* A released worker that is killed is forgotten: its session and buffer
 * go, the journal no longer names it, and the next pause and resume work. */
START_TEST(a_released_worker_that_dies_is_forgotten) {
  daemon_start(&d, NULL);
  struct worker w, other;
  start_worker(&w, true);
  start_worker(&other, false);
  gpumem_client *c = controller();
  struct gpumem_op_report *r;
  ck_assert_int_eq(pause_releasing(c, "kv", &r), GPUMEM_E_RELEASE_REFUSED); /* other did not opt in */
  ck_assert_uint_eq(r->nreleases, 2);
  gpumem_op_report_free(r);
  ck_assert_int_eq(proc_state(w.pid), 'T');
  pid_t gone = w.pid;
  ck_assert_int_eq(worker_stop(&w, SIGKILL), 128 + SIGKILL);
  wait_sessions(c, 2); /* other and the controller */
  /* A restore its session's end started may still be running: bounded. */
  double until = now_ms() + harness_patience_ms(2000);
  while (journal_names(gone) && now_ms() < until) round_trip(c);
  ck_assert(!journal_names(gone));
  ck_assert_int_eq(resume_all(c, &r), 0);
  ck_assert_uint_eq(r->buffers, 1);
  gpumem_op_report_free(r);
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&other, SIGTERM), 0);
}
END_TEST

/* A daemon, a gpumem-worker that opted in, and a controller's pause of kv
 * with a release that stopped the worker: the controller. */
static gpumem_client *released_worker(struct worker *w) {
  daemon_start(&d, NULL);
  start_worker(w, true);
  gpumem_client *c = controller();
  struct gpumem_op_report *r;
  ck_assert_int_eq(pause_releasing(c, "kv", &r), 0);
  gpumem_op_report_free(r);
  ck_assert_int_eq(proc_state(w->pid), 'T');
  return c;
}

/* A daemon that stops (SIGTERM) lets its released workers go on first. */
START_TEST(a_stopping_daemon_restores_its_released_workers) {
  struct worker w;
  gpumem_disconnect(released_worker(&w));
  int st;
  kill(d.pid, SIGTERM);
  ck_assert_int_eq(waitpid(d.pid, &st, 0), d.pid);
  d.pid = 0;
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  ck_assert_int_ne(proc_state(w.pid), 'T');
  ck_assert_int_eq(daemon_log_count(&d, "device state restored (gpumemd is stopping)"), 1);
  ck_assert_int_eq(worker_stop(&w, SIGKILL), 128 + SIGKILL);
}
END_TEST

/* A daemon that dies (SIGKILL) leaves its released worker stopped; the
 * daemon that follows on the socket restores it from the journal before
 * it serves, and the worker re-registers with it. */
START_TEST(a_daemon_that_dies_is_followed_by_one_that_restores) {
  struct worker w;
  gpumem_client *c = released_worker(&w);
  struct gpumem_op_report *r;
  gpumem_disconnect(c);
  kill(d.pid, SIGKILL);
  ck_assert_int_eq(waitpid(d.pid, NULL, 0), d.pid);
  ck_assert_int_eq(proc_state(w.pid), 'T');
  ck_assert(journal_names(w.pid));
  d.pid = daemon_spawn(d.socket, d.log, NULL);
  ck_assert(daemon_wait_ready(&d)); /* it listens: its loop may not run yet */
  c = controller(); /* answered: the loop runs, after the restore */
  ck_assert_int_ne(proc_state(w.pid), 'T');
  ck_assert_int_eq(daemon_log_count(&d, "restored (released by a gpumemd that stopped)"), 1);
  ck_assert(worker_wait_for(&w, "re-registered 1 buffers", 1, harness_patience_ms(3000)));
  ck_assert_int_eq(resume_all(c, &r), 0);
  ck_assert_uint_eq(r->buffers, 1);
  gpumem_op_report_free(r);
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* A pause that fails (a tag that does not exist) releases nothing. */
START_TEST(a_failed_pause_releases_nothing) {
  daemon_start(&d, NULL);
  struct worker w;
  start_worker(&w, true);
  gpumem_client *c = controller();
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.release_context = 1;
  const char *tags[] = {"kv", "nope"};
  struct gpumem_op_report *r;
  ck_assert_int_eq(gpumem_pause(c, tags, 2, NULL, 0, &o, &r), GPUMEM_E_NOT_FOUND);
  ck_assert_uint_eq(r->nreleases, 0);
  gpumem_op_report_free(r);
  ck_assert_int_ne(proc_state(w.pid), 'T');
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* A worker that pauses its own buffers asking for a release is refused on
 * the host backend, whose stand-in would stop the process that waits for
 * the answer; it gets RELEASE_REFUSED with the reason, and keeps running. */
START_TEST(a_release_of_the_process_that_asked_is_refused_here) {
  daemon_start(&d, NULL);
  pid_t kid = fork();
  ck_assert_int_ge(kid, 0);
  if (kid == 0) {
    gpumem_client *c;
    gpumem_buffer *b;
    struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
    o.scope = GPUMEM_SCOPE_OWN;
    o.release_context = 1;
    struct gpumem_op_report *r = NULL;
    if (gpumem_connect(d.socket, "self", GPUMEM_ROLE_WORKER, GPUMEM_CONNECT_RELEASE_CONTEXT, &c) ||
        gpumem_alloc(c, "kv", 0, 4 << 20, 0, &b))
      _exit(10);
    int rc = gpumem_pause(c, NULL, 0, NULL, 0, &o, &r);
    bool said = r && r->nreleases == 1 && strstr(r->releases[0]->why, "asked for the pause itself");
    gpumem_op_report_free(r);
    gpumem_disconnect(c);
    _exit(rc == GPUMEM_E_RELEASE_REFUSED && said ? 0 : 11);
  }
  track(kid);
  int st;
  ck_assert_int_eq(waitpid(kid, &st, 0), kid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d", st);
}
END_TEST

/* A resume request that asks for a release is bad input: refused before
 * anything is sent, and so is the tool's flag on a resume. */
START_TEST(a_release_asked_of_a_resume_is_refused) {
  daemon_start(&d, NULL);
  gpumem_client *c = controller();
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.release_context = 1;
  ck_assert_int_eq(gpumem_resume(c, NULL, 0, NULL, 0, &o, NULL), GPUMEM_E_INVALID);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "pause only"));
  gpumem_disconnect(c);
}
END_TEST

/* What the vfork child of a held worker does: it says it runs (a byte on
 * ready), waits for a byte on go; with a socket (not -1), it shuts it
 * down (its parent's session ends), says so, and waits for another. */
struct held {
  int go, ready, socket;
};

/* The vfork child of a held worker (struct held), then it ends. Until
 * then its parent's thread waits for it uninterruptibly, where no SIGSTOP
 * takes it: the stand-in's release cannot stop the process. Raw system
 * calls only, on a stack of its own in its parent's memory. */
__attribute__((no_sanitize("address", "thread"))) static int vfork_child(void *arg) {
  const struct held *h = arg;
  char byte = 1;
  syscall(SYS_write, h->ready, &byte, 1);
  syscall(SYS_read, h->go, &byte, 1);
  if (h->socket >= 0) {
    syscall(SYS_shutdown, h->socket, SHUT_RDWR);
    syscall(SYS_write, h->ready, &byte, 1);
    syscall(SYS_read, h->go, &byte, 1);
  }
  syscall(SYS_exit, 0);
  return 0;
}

/* A worker on libgpumem (opted in, 4 MiB of kv) whose main thread then
 * waits for a vfork child (struct held) told through go[1], heard on
 * ready[0]; with end_session the child shuts the worker's connection
 * down when told. After the child, the worker waits for a byte on
 * end[0] and exits 0. */
static pid_t start_held_worker(int go[2], int end[2], int ready[2], bool end_session) {
  ck_assert_int_eq(pipe(ready), 0);
  ck_assert_int_eq(pipe(go), 0);
  ck_assert_int_eq(pipe(end), 0);
  pid_t kid = fork();
  ck_assert_int_ge(kid, 0);
  if (kid == 0) {
    gpumem_client *c;
    gpumem_buffer *b;
    /* A session that ends stays ended: no reconnection. */
    unsigned flags = GPUMEM_CONNECT_RELEASE_CONTEXT | (end_session ? GPUMEM_CONNECT_NO_RECONNECT : 0);
    if (gpumem_connect(d.socket, "held", GPUMEM_ROLE_WORKER, flags, &c) ||
        gpumem_alloc(c, "kv", 0, 4 << 20, 0, &b))
      _exit(10);
    size_t size = 64 << 10;
    char *stack = malloc(size), byte;
    struct held h = {.go = go[0], .ready = ready[1], .socket = end_session ? gpumem_fd(c) : -1};
    if (!stack || (end_session && h.socket < 0)) _exit(11);
    if (clone(vfork_child, stack + size, CLONE_VM | CLONE_VFORK | SIGCHLD, &h) < 0) _exit(12);
    if (read(end[0], &byte, 1) != 1) _exit(13);
    _exit(0);
  }
  track(kid);
  char byte;
  ck_assert_int_eq(read(ready[0], &byte, 1), 1); /* the vfork child runs */
  return kid;
}

/* Close the pipes of a held worker. */
static void close_pipes(int go[2], int end[2], int ready[2]) {
  for (int i = 0; i < 2; i++) {
    close(go[i]);
    close(end[i]);
    close(ready[i]);
  }
}

/* The owners' timeout of resume_short's resume: short, as the stand-in's
 * restore waits at most 1 s for the process (twice this must fit). */
static unsigned short_timeout_ms(void) {
  int ms = harness_patience_ms(40);
  return ms < 400 ? (unsigned)ms : 400;
}

/* A pause of kv asking for a release. */
static int pause_kv_releasing(gpumem_client *c, struct gpumem_op_report **r) {
  return pause_releasing(c, "kv", r);
}

/* A pause of a tag nobody has. */
static int pause_nope(gpumem_client *c, struct gpumem_op_report **r) {
  const char *nope[] = {"nope"};
  return gpumem_pause(c, nope, 1, NULL, 0, NULL, r);
}

/* A resume of every tag, owners' timeout short_timeout_ms. */
static int resume_short(gpumem_client *c, struct gpumem_op_report **r) {
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.timeout_ms = short_timeout_ms();
  return gpumem_resume(c, NULL, 0, NULL, 0, &o, r);
}

/* A controller's operation (call) on a thread of its own. */
struct pausing {
  gpumem_client *c;
  int (*call)(gpumem_client *c, struct gpumem_op_report **r);
  int rc;
  struct gpumem_op_report *r;
  bool done; /* under lock */
  pthread_mutex_t lock;
  pthread_t thread;
};

/* Run the operation (thread). */
static void *op_thread(void *arg) {
  struct pausing *p = arg;
  int rc = p->call(p->c, &p->r);
  pthread_mutex_lock(&p->lock);
  p->rc = rc;
  p->done = true;
  pthread_mutex_unlock(&p->lock);
  return NULL;
}

/* Start call by c on a thread, into p. */
static void op_start(struct pausing *p, gpumem_client *c,
                     int (*call)(gpumem_client *, struct gpumem_op_report **)) {
  *p = (struct pausing){.c = c, .call = call, .lock = PTHREAD_MUTEX_INITIALIZER};
  ck_assert_int_eq(pthread_create(&p->thread, NULL, op_thread, p), 0);
}

/* A daemon whose context releases wait up to 60 s for device calls and
 * whose driver calls are bounded short (--release-timeout). */
static void start_bounded_daemon(void) {
  char bound[32];
  snprintf(bound, sizeof bound, "%dms", harness_patience_ms(200));
  daemon_start(&d, "--lock-timeout", "60s", "--release-timeout", bound, NULL);
}

/* Let a held worker past its vfork child's end exit, see it exit 0, and
 * close its pipes. */
static void finish_held_worker(pid_t kid, int go[2], int end[2], int ready[2]) {
  char byte = 1;
  int st;
  ck_assert_int_eq(write(end[1], &byte, 1), 1);
  ck_assert_int_eq(waitpid(kid, &st, 0), kid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d", st);
  close_pipes(go, end, ready);
}

/* A release the driver takes longer over than --release-timeout (here a
 * worker the stand-in cannot stop) runs while the daemon serves others,
 * and fails the pause with NOT_RELEASED at the bound, saying so; the
 * worker counts as released, a resume fails while the release is still
 * in the driver, and once it returns, the worker is released and the
 * next resume restores it. */
START_TEST(a_release_that_outlasts_its_bound_fails_the_pause_and_is_kept) {
  start_bounded_daemon();
  int go[2], end[2], ready[2];
  pid_t kid = start_held_worker(go, end, ready, false);
  gpumem_client *c = controller(), *other = controller();
  wait_sessions(c, 3);
  struct pausing p;
  op_start(&p, c, pause_kv_releasing);
  /* Served while the release runs: the status says the worker is held. */
  bool held = false;
  double until = now_ms() + harness_patience_ms(1000);
  while (!held && now_ms() < until) {
    struct gpumem_status *s;
    ck_assert_int_eq(gpumem_status(other, &s), 0);
    held = session_of(s, kid)->context_released;
    gpumem_status_free(s);
  }
  pthread_mutex_lock(&p.lock);
  bool answered = p.done;
  pthread_mutex_unlock(&p.lock);
  ck_assert(held);
  ck_assert(!answered);
  ck_assert_int_eq(pthread_join(p.thread, NULL), 0);
  ck_assert_int_eq(p.rc, GPUMEM_E_NOT_RELEASED);
  ck_assert_uint_eq(p.r->nreleases, 1);
  ck_assert_int_eq(p.r->releases[0]->released, 0);
  ck_assert_ptr_nonnull(strstr(p.r->releases[0]->why, "has not returned from the release"));
  gpumem_op_report_free(p.r);
  ck_assert_int_ne(proc_state(kid), 'T');
  struct gpumem_op_report *r;
  ck_assert_int_eq(resume_all(other, &r), GPUMEM_E_NOT_RELEASED);
  gpumem_op_report_free(r);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "has not yet returned from an earlier release"));
  /* The vfork child ends: the stop takes, and the release returns. */
  char byte = 1;
  ck_assert_int_eq(write(go[1], &byte, 1), 1);
  until = now_ms() + harness_patience_ms(3000);
  while (daemon_log_count(&d, "released after its pause answered") < 1 && now_ms() < until)
    round_trip(other);
  ck_assert_int_eq(daemon_log_count(&d, "released after its pause answered"), 1);
  ck_assert_int_eq(proc_state(kid), 'T');
  ck_assert(journal_names(kid));
  ck_assert_int_eq(resume_all(other, &r), 0);
  ck_assert_uint_eq(r->nreleases, 1);
  ck_assert_str_eq(r->releases[0]->why, "");
  gpumem_op_report_free(r);
  ck_assert_int_ne(proc_state(kid), 'T');
  finish_held_worker(kid, go, end, ready);
  gpumem_disconnect(other);
  gpumem_disconnect(c);
}
END_TEST

/* A daemon that stops while a release is still in the driver waits at
 * most the bound for it, keeps the worker in the journal and leaves the
 * backend open; when the release returns the worker is stopped, and the
 * daemon that follows on the socket restores it. */
START_TEST(a_release_in_the_driver_when_the_daemon_stops_is_restored_after) {
  start_bounded_daemon();
  int go[2], end[2], ready[2];
  pid_t kid = start_held_worker(go, end, ready, false);
  gpumem_client *c = controller();
  struct gpumem_op_report *r;
  ck_assert_int_eq(pause_releasing(c, "kv", &r), GPUMEM_E_NOT_RELEASED);
  gpumem_op_report_free(r);
  gpumem_disconnect(c);
  int st;
  kill(d.pid, SIGTERM);
  ck_assert_int_eq(waitpid(d.pid, &st, 0), d.pid);
  d.pid = 0;
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  ck_assert(journal_names(kid));
  ck_assert_int_eq(daemon_log_count(&d, "kept for the next gpumemd"), 1);
  ck_assert_int_eq(daemon_log_count(&d, "the backend is left open at exit"), 1);
  char byte = 1;
  ck_assert_int_eq(write(go[1], &byte, 1), 1); /* the vfork child ends: the stop takes */
  double until = now_ms() + harness_patience_ms(2000);
  while (proc_state(kid) != 'T' && now_ms() < until) sched_yield();
  ck_assert_int_eq(proc_state(kid), 'T');
  d.pid = daemon_spawn(d.socket, d.log, NULL);
  ck_assert(daemon_wait_ready(&d));
  c = controller(); /* answered: the restore came first */
  ck_assert_int_ne(proc_state(kid), 'T');
  ck_assert_int_eq(daemon_log_count(&d, "restored (released by a gpumemd that stopped)"), 1);
  finish_held_worker(kid, go, end, ready);
  gpumem_disconnect(c);
}
END_TEST

/* A pause releases the workers of the tags it pauses only: one of
 * another tag on the same device runs on, and is not asked about. */
START_TEST(a_release_covers_the_workers_of_the_tags_paused) {
  daemon_start(&d, NULL);
  struct worker kv, other;
  start_worker(&kv, true);
  setenv("GPUMEM_RELEASE_CONTEXT", "1", 1);
  worker_start(&other, &d, "--tag", "other", "--size", "8M", NULL);
  unsetenv("GPUMEM_RELEASE_CONTEXT");
  track(other.pid);
  gpumem_client *c = controller();
  struct gpumem_op_report *r;
  ck_assert_int_eq(pause_releasing(c, "kv", &r), 0);
  ck_assert_uint_eq(r->nreleases, 1);
  ck_assert_uint_eq(r->releases[0]->pid, (uint32_t)kv.pid);
  gpumem_op_report_free(r);
  ck_assert_int_eq(proc_state(kv.pid), 'T');
  ck_assert_int_ne(proc_state(other.pid), 'T');
  ck_assert_int_eq(resume_all(c, &r), 0);
  gpumem_op_report_free(r);
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&kv, SIGTERM), 0);
  ck_assert_int_eq(worker_stop(&other, SIGTERM), 0);
}
END_TEST

/* A worker whose session ends while its release is still in the driver
 * stays in the journal; when the release returns, the daemon restores it
 * (nobody is left to resume it) and the journal lets it go. */
START_TEST(a_release_in_the_driver_when_its_session_ends_is_restored_when_it_returns) {
  start_bounded_daemon();
  int go[2], end[2], ready[2];
  pid_t kid = start_held_worker(go, end, ready, true);
  gpumem_client *c = controller();
  struct gpumem_op_report *r;
  ck_assert_int_eq(pause_releasing(c, "kv", &r), GPUMEM_E_NOT_RELEASED);
  gpumem_op_report_free(r);
  char byte = 1;
  ck_assert_int_eq(write(go[1], &byte, 1), 1); /* the session ends */
  ck_assert_int_eq(read(ready[0], &byte, 1), 1);
  wait_sessions(c, 1);
  ck_assert(journal_names(kid));
  ck_assert_int_eq(write(go[1], &byte, 1), 1); /* the release returns */
  double until = now_ms() + harness_patience_ms(2000);
  while ((journal_names(kid) || daemon_log_count(&d, "its last session ended") < 1) &&
         now_ms() < until)
    round_trip(c);
  ck_assert(!journal_names(kid));
  ck_assert_int_eq(daemon_log_count(&d, "device state restored (its last session ended)"), 1);
  ck_assert_int_ne(proc_state(kid), 'T');
  finish_held_worker(kid, go, end, ready);
  gpumem_disconnect(c);
}
END_TEST

/* Another request that comes while a resume restores its released
 * workers waits for it: the resume's owners get the whole timeout from
 * their remaps, not from the request (it used to start their timer, and
 * the resume failed with its buffers left RESUMING). The restore is held
 * in the stand-in's "driver" by tracing the worker: a stopped tracee
 * stays stopped after SIGCONT until its tracer lets go. */
START_TEST(a_request_during_a_resumes_restores_waits_for_them) {
  daemon_start(&d, NULL);
  struct worker w;
  start_worker(&w, true);
  gpumem_client *c = controller(), *other = controller();
  struct gpumem_op_report *r;
  ck_assert_int_eq(pause_releasing(c, "kv", &r), 0);
  gpumem_op_report_free(r);
  ck_assert_int_eq(proc_state(w.pid), 'T');
  if (ptrace(PTRACE_SEIZE, w.pid, 0, 0) != 0) { /* a machine that forbids tracing */
    fprintf(stderr, "skipped: cannot trace the worker: %s\n", strerror(errno));
    resume_all(c, &r);
    gpumem_op_report_free(r);
    gpumem_disconnect(other);
    gpumem_disconnect(c);
    return;
  }
  double until = now_ms() + harness_patience_ms(2000); /* traced: 't' */
  while (proc_state(w.pid) != 't' && now_ms() < until) sched_yield();
  ck_assert_int_eq(proc_state(w.pid), 't');
  struct pausing p, q;
  op_start(&p, c, resume_short);
  bool restoring = false; /* the resume's buffers are RESUMING while it restores */
  until = now_ms() + harness_patience_ms(2000);
  while (!restoring && now_ms() < until) {
    struct gpumem_status *s;
    ck_assert_int_eq(gpumem_status(other, &s), 0);
    for (size_t i = 0; i < s->ntags; i++)
      restoring |= strcmp(s->tags[i]->name, "kv") == 0 && s->tags[i]->transit_buffers == 1;
    gpumem_status_free(s);
  }
  ck_assert(restoring);
  gpumem_client *third = controller(); /* its pause waits behind the resume */
  op_start(&q, third, pause_nope);
  /* Twice the resume's timeout passes, the loop turning. */
  until = now_ms() + 2 * short_timeout_ms();
  while (now_ms() < until) round_trip(other);
  ck_assert_int_eq(ptrace(PTRACE_DETACH, w.pid, 0, 0), 0);
  ck_assert_int_eq(pthread_join(p.thread, NULL), 0);
  ck_assert_int_eq(pthread_join(q.thread, NULL), 0);
  ck_assert_msg(p.rc == 0, "resume: %d %s", p.rc, p.r ? p.r->message : "");
  ck_assert_int_eq(q.rc, GPUMEM_E_NOT_FOUND);
  gpumem_op_report_free(p.r);
  gpumem_op_report_free(q.r);
  gpumem_disconnect(third);
  ck_assert(worker_wait_for(&w, "verified buffer", 1, harness_patience_ms(2000)));
  gpumem_disconnect(other);
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

int main(void) {
  return HARNESS_RUN("release", 30, harness_fd_setup, teardown,
                     a_released_worker_stops_and_comes_back,
                     a_worker_that_did_not_opt_in_is_refused_and_paused,
                     a_worker_that_still_maps_a_buffer_is_refused,
                     a_released_worker_that_dies_is_forgotten,
                     a_stopping_daemon_restores_its_released_workers,
                     a_daemon_that_dies_is_followed_by_one_that_restores,
                     a_release_asked_of_a_resume_is_refused, a_failed_pause_releases_nothing,
                     a_release_of_the_process_that_asked_is_refused_here,
                     a_release_that_outlasts_its_bound_fails_the_pause_and_is_kept,
                     a_release_in_the_driver_when_the_daemon_stops_is_restored_after,
                     a_release_covers_the_workers_of_the_tags_paused,
                     a_release_in_the_driver_when_its_session_ends_is_restored_when_it_returns,
                     a_request_during_a_resumes_restores_waits_for_them);
}
