/* SIGTERM (and SIGINT) of the daemon in every state it can be in: idle,
 * with workers holding buffers, in the middle of a pause or a resume that
 * waits for acks, while backup memory is being made or backups copied,
 * with a controller queued behind another, with a session whose output
 * queue is full, with a session that never said hello, with SIGTERM sent
 * twice, and again and again while the daemon frees its memory (with its
 * thread pool running), and with SIGINT. In each the daemon must exit 0
 * promptly, tell every session that reads (an Error SHUTTING_DOWN with
 * id 0, then the end of the stream), remove its socket and leave no
 * process behind. SIGTERM while out of fds, and with frames half sent, is
 * in check_fds.c. Raw protocol peers give every state exactly; one test
 * uses a real gpumem-worker. Nothing waits by sleeping: each step waits
 * for a condition, with a deadline. */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/wire.h"
#include "harness.h"
#include "scenario.h"

/* Under a sanitizer everything is slower: the deadlines are wider. */
#define SLOWER (HARNESS_SANITIZED ? 3 : 1)

/* How long the daemon may take to exit when every session reads (it has
 * nothing to wait for), and when one does not (it waits out its drain
 * time of 1 s for that session, then closes it). */
#define PROMPT_MS (1000 * SLOWER)
#define DRAIN_EXIT_MS (1000 + 1500 * SLOWER)
/* How long it may take when it is copying or freeing hundreds of MiB of
 * backups as the signal comes (the copy ends first). */
#define COPY_EXIT_MS (3000 * SLOWER)

static struct daemon d;
static struct worker workers[2]; /* real workers a test started, killed if it fails */

/* A test that fails ends its process with exit(): its daemon and workers
 * go with it instead of living on. */
static void kill_leftovers(void) {
  if (d.pid > 0) kill(d.pid, SIGKILL);
  for (size_t i = 0; i < sizeof workers / sizeof workers[0]; i++)
    if (workers[i].pid > 0) kill(workers[i].pid, SIGKILL);
}

/* Every test: count fds, and take in whatever the daemon might leave
 * behind (a child of an exited daemon is re-parented to this process). */
static void setup(void) {
  harness_fd_setup();
  memset(&d, 0, sizeof d);
  memset(workers, 0, sizeof workers);
  ck_assert_int_eq(prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), 0);
  atexit(kill_leftovers);
}

/* Remove the daemon's directory (its pid is 0 once a test reaped it). */
static void teardown(void) {
  if (d.pid) ck_assert_int_eq(daemon_stop(&d), 0);
  else if (d.dir[0]) daemon_stop(&d);
  harness_fd_teardown();
}

/* The end of the daemon's log, for failure messages (static buffer). */
static const char *log_tail(void) {
  static char buf[2048];
  buf[0] = '\0';
  FILE *f = fopen(d.log, "r");
  if (!f) return buf;
  if (fseek(f, -(long)(sizeof buf - 1), SEEK_END) < 0) rewind(f);
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = '\0';
  fclose(f);
  return buf;
}

/* Whether the daemon's socket file still exists. */
static bool socket_exists(void) {
  struct stat st;
  if (stat(d.socket, &st) == 0) return true;
  ck_assert_int_eq(errno, ENOENT);
  return false;
}

/* Wait up to ms for the socket file to go (the daemon took the signal). */
static bool socket_gone_within(int ms) {
  double end = now_ms() + ms;
  while (socket_exists()) {
    if (now_ms() >= end) return false;
    struct pollfd none;
    poll(&none, 0, 2); /* a polling interval, not a synchronisation */
  }
  return true;
}

/* Processes whose parent is this one, other than those in keep. */
static int children_but(const pid_t *keep, size_t nkeep) {
  DIR *dir = opendir("/proc");
  ck_assert_ptr_nonnull(dir);
  int n = 0;
  for (struct dirent *de; (de = readdir(dir));) {
    pid_t pid = (pid_t)atoi(de->d_name);
    if (pid <= 0) continue;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) continue; /* gone meanwhile */
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = '\0';
    const char *p = strrchr(buf, ')');
    int ppid = 0;
    if (!p || sscanf(p + 2, "%*c %d", &ppid) != 1 || ppid != (int)getpid()) continue;
    bool kept = false;
    for (size_t i = 0; i < nkeep; i++) kept |= keep[i] == pid;
    n += !kept;
  }
  closedir(dir);
  return n;
}

/* Wait up to ms for the daemon to exit (all its threads: the kernel
 * reports the exit only then) and reap it; its exit status, 128+signal if
 * a signal killed it. Still running then: it is killed and the test fails. */
static int daemon_exit_within(int ms) {
  int pidfd = (int)syscall(SYS_pidfd_open, d.pid, 0);
  ck_assert_int_ge(pidfd, 0);
  struct pollfd pf = {pidfd, POLLIN, 0};
  double end = now_ms() + ms;
  int ready;
  do ready = poll(&pf, 1, (int)(end - now_ms() > 0 ? end - now_ms() : 0));
  while (ready < 0 && errno == EINTR);
  close(pidfd);
  if (ready != 1) {
    kill(d.pid, SIGKILL);
    waitpid(d.pid, NULL, 0);
    d.pid = 0;
    ck_abort_msg("gpumemd still runs %d ms after the signal; its log ends:\n%s", ms, log_tail());
  }
  int status;
  ck_assert_int_eq(waitpid(d.pid, &status, 0), d.pid);
  d.pid = 0;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Send sig, and check that the daemon exits 0 within ms, its socket file
 * is gone and it left no process behind (keep: workers of the test). */
static void stop_and_check(int sig, int ms, const char *state, const pid_t *keep, size_t nkeep) {
  double t0 = now_ms();
  ck_assert_int_eq(kill(d.pid, sig), 0);
  int status = daemon_exit_within(ms);
  double took = now_ms() - t0;
  ck_assert_msg(status == 0, "%s: gpumemd exited %d; its log ends:\n%s", strsignal(sig), status,
                log_tail());
  ck_assert_msg(!socket_exists(), "%s: the socket %s is still there", state, d.socket);
  ck_assert_int_eq(children_but(keep, nkeep), 0);
  fprintf(stderr, "%s: %s, exit 0 in %.0f ms\n", state, strsignal(sig), took);
}

/* What a session read until the daemon closed it. */
struct ending {
  bool told;              /* an Error SHUTTING_DOWN with id 0 came */
  bool after_notice;      /* something came after that notice */
  char words[256];        /* the notice's message */
  wire_code req_code;     /* the answer to req_id (-1: none came) */
  size_t messages;        /* messages read in all */
};

/* Read a session to its end (the test fails if that takes over 5 s a
 * message): the shutdown notice, the answer to req_id (0: none asked),
 * and whatever else came (fds closed). */
static struct ending read_to_end(struct peer *p, uint64_t req_id) {
  struct ending e = {.req_code = (wire_code)-1};
  for (wire_env *r; (r = peer_get_within(p, NULL, 5000 * SLOWER)); wire_env_free(r)) {
    e.messages++;
    e.after_notice |= e.told;
    if (r->id == 0 && r->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) {
      ck_assert_msg(r->error->code == CODE(SHUTTING_DOWN), "stray error %s: %s",
                    wire_code_name(r->error->code), r->error->message);
      e.told = true;
      snprintf(e.words, sizeof e.words, "%s", r->error->message);
    } else if (req_id && r->id == req_id) {
      e.req_code = peer_reply_code(r, NULL, 0);
    }
  }
  return e;
}

/* Read a session to its end and check that it was told last, with the
 * answer to req_id (if any) before. */
static struct ending expect_told(struct peer *p, uint64_t req_id) {
  struct ending e = read_to_end(p, req_id);
  ck_assert_msg(e.told, "the session was not told SHUTTING_DOWN (%zu messages)", e.messages);
  ck_assert_msg(!e.after_notice, "messages came after the shutdown notice");
  return e;
}

/* The status a controller gets. */
static Gpumem__Wire__StatusReply *status_of(struct peer *c, wire_env **env) {
  *env = peer_status(c);
  return (*env)->status_reply;
}

/* Sessions the daemon serves, as a controller sees them. */
static size_t sessions_seen(struct peer *c) {
  wire_env *env;
  size_t n = status_of(c, &env)->n_sessions;
  wire_env_free(env);
  return n;
}

/* Send n status requests (or cheap list requests) on p without reading
 * the replies. */
static void send_requests(struct peer *p, bool status, int n) {
  Gpumem__Wire__StatusRequest sr = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  Gpumem__Wire__ListRequest lr = GPUMEM__WIRE__LIST_REQUEST__INIT;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  if (status) {
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_STATUS;
    env.status = &sr;
  } else {
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_LIST;
    env.list = &lr;
  }
  ck_assert_int_eq(scene_queue(p, &env, n), 0);
  int rc;
  while ((rc = frame_writer_flush(p->w, p->fd)) == -EAGAIN) {
    struct pollfd pf = {p->fd, POLLOUT, 0};
    ck_assert_int_eq(poll(&pf, 1, 5000), 1);
  }
  ck_assert_int_eq(rc, 0);
}

/* Have p ask for status, then for lists (a status costs the daemon some
 * milliseconds, a list next to nothing), never reading, until the daemon
 * holds more than total bytes of output it cannot send (the socket is
 * full; c, a controller, watches), well under the per-session cap. */
static void fill_output_queue(struct peer *p, struct peer *c, uint64_t total) {
  double end = now_ms() + 5000 * SLOWER;
  send_requests(p, true, 4);
  for (int rounds = 1;; rounds++) {
    wire_env *env;
    uint64_t queued = status_of(c, &env)->queued_bytes;
    wire_env_free(env);
    if (queued > total) {
      fprintf(stderr, "queue full: %llu bytes after %d rounds\n", (unsigned long long)queued,
              rounds);
      return;
    }
    ck_assert_msg(now_ms() < end, "only %llu bytes queued", (unsigned long long)queued);
    send_requests(p, false, 4000);
  }
}

/* A raw worker w holding one buffer b (4 MiB of kv), then a controller c
 * and, unless NULL, a second controller, watch, that looks on. */
static void open_watched(struct peer *w, struct pbuf *b, struct peer *c, struct peer *watch) {
  peer_open(w, &d, WORKER);
  peer_alloc(w, "kv", 0, 4 * MiB, 0, b);
  peer_open(c, &d, CONTROLLER);
  if (watch) peer_open(watch, &d, CONTROLLER);
}

/* Take w's next event, which must be of kind body, and leave it
 * unanswered (its fds closed); how many fds came with it. */
static size_t leave_event(struct peer *w, int body) {
  struct frame f;
  wire_env *e = peer_event(w, &f);
  ck_assert_int_eq(e->body_case, body);
  size_t nfds = f.nfds;
  wire_env_free(e);
  frame_release(&f);
  return nfds;
}

/* Once watch sees kv in state st with one buffer in transit, SIGTERM in
 * that state: the operation c asked for as req is answered SHUTTING_DOWN,
 * then c, w and watch are told. */
static void stop_mid_op(struct peer *w, struct peer *c, uint64_t req, struct peer *watch, int st,
                        const char *state) {
  ck_assert(peer_wait_tag(watch, "kv", st, 1));
  stop_and_check(SIGTERM, PROMPT_MS, state, NULL, 0);
  ck_assert_int_eq(expect_told(c, req).req_code, CODE(SHUTTING_DOWN));
  expect_told(w, 0);
  expect_told(watch, 0);
}

/* Idle, nobody connected: exit 0 at once, socket gone. */
START_TEST(idle_with_no_sessions) {
  daemon_start(&d, NULL);
  stop_and_check(SIGTERM, PROMPT_MS, "idle", NULL, 0);
}
END_TEST

/* Workers hold ACTIVE buffers (a real gpumem-worker and a raw one) and a
 * controller is connected: each is told, the workers keep their memory
 * (buffers stay mapped), and the real worker says why it lost the daemon. */
START_TEST(workers_holding_active_buffers) {
  daemon_start(&d, "--host-devices", "1", "--host-device-size", "256M", NULL);
  worker_start(&workers[0], &d, "--tag", "kv", "--size", "8M", "--count", "2", NULL);
  struct peer w, c;
  struct pbuf b;
  open_watched(&w, &b, &c, NULL);
  ck_assert_uint_eq(sessions_seen(&c), 3);
  stop_and_check(SIGTERM, PROMPT_MS, "workers holding buffers", &workers[0].pid, 1);
  expect_told(&w, 0);
  expect_told(&c, 0);
  ck_assert_msg(worker_wait_for(&workers[0], "gpumemd went away: SHUTTING_DOWN", 1, 5000),
                "%s", worker_output(&workers[0]));
  ck_assert_uint_eq(memfd_bytes(&workers[0].pid, 1), 16 * MiB);
  ck_assert_int_eq(b.nfds, 1); /* the raw worker's chunk, still its own */
  ck_assert_msg(worker_stop(&workers[0], SIGTERM) == 0, "%s", worker_output(&workers[0]));
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A pause waits for an Unmap ack that never comes: the controller's pause
 * is answered SHUTTING_DOWN, then everyone is told. */
START_TEST(mid_pause_waiting_for_an_unmap_ack) {
  daemon_start(&d, NULL);
  struct peer w, c, watch;
  struct pbuf b;
  open_watched(&w, &b, &c, &watch);
  uint64_t req = c.next_id;
  peer_op(&c, false, "kv", 0, 0);
  leave_event(&w, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP); /* the Unmap, never acked */
  stop_mid_op(&w, &c, req, &watch, GPUMEM__WIRE__BUFFER_STATE__PAUSING, "mid-pause");
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
  peer_close(&watch);
}
END_TEST

/* A resume waits for a Remap ack that never comes (its memory made and
 * exported): the resume is answered SHUTTING_DOWN, everyone is told. */
START_TEST(mid_resume_waiting_for_a_remap_ack) {
  daemon_start(&d, NULL);
  struct peer w, c, watch;
  struct pbuf b;
  open_watched(&w, &b, &c, &watch);
  scene_served(&c, &w, &b, 1, false, "kv");
  uint64_t req = c.next_id;
  peer_op(&c, true, "kv", 0, 0);
  /* the Remap with its fds, never acked */
  ck_assert_uint_ge(leave_event(&w, GPUMEM__WIRE__ENVELOPE__BODY_REMAP), 1);
  stop_mid_op(&w, &c, req, &watch, GPUMEM__WIRE__BUFFER_STATE__RESUMING, "mid-resume");
  peer_close(&w);
  peer_close(&c);
  peer_close(&watch);
}
END_TEST

/* BACKUP buffers whose host memory the thread pool is still making (the
 * status says less is ready than reserved): the jobs are given up and the
 * daemon exits 0 at once. */
START_TEST(backup_memory_being_made_on_the_thread_pool) {
  daemon_start(&d, "--host-devices", "1", "--host-device-size", "1G", NULL);
  struct peer w, c;
  struct pbuf b[8];
  size_t n = 0;
  peer_open(&w, &d, WORKER);
  peer_open(&c, &d, CONTROLLER);
  bool in_flight = false;
  while (!in_flight && n < 8) {
    peer_alloc(&w, "bk", 0, 64 * MiB, BACKUP, &b[n++]);
    wire_env *env;
    Gpumem__Wire__StatusReply *st = status_of(&c, &env);
    in_flight = st->backup_ready < st->backup_reserved;
    wire_env_free(env);
  }
  ck_assert_msg(in_flight, "every backup's memory was made before a status could look");
  stop_and_check(SIGTERM, COPY_EXIT_MS, "backup memory being made", NULL, 0);
  expect_told(&w, 0);
  expect_told(&c, 0);
  for (size_t i = 0; i < n; i++) peer_unmap(&b[i]);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A pause of BACKUP buffers (their host memory maybe still being made)
 * whose owner acked: the signal comes while the daemon takes that memory
 * and copies 128 MiB. The pause is answered (done or SHUTTING_DOWN) and
 * everyone is told after. */
START_TEST(backup_copy_in_flight) {
  daemon_start(&d, "--host-devices", "1", "--host-device-size", "1G", NULL);
  struct peer w, c;
  struct pbuf b[4];
  peer_open(&w, &d, WORKER);
  for (size_t i = 0; i < 4; i++) peer_alloc(&w, "bk", 0, 32 * MiB, BACKUP, &b[i]);
  peer_open(&c, &d, CONTROLLER);
  uint64_t req = c.next_id;
  peer_op(&c, false, "bk", 0, 0);
  peer_serve(&w, b, 4, 1); /* unmaps and acks: the copies begin */
  stop_and_check(SIGTERM, COPY_EXIT_MS, "backup copy in flight", NULL, 0);
  struct ending e = expect_told(&c, req);
  ck_assert_msg(e.req_code == CODE(OK) || e.req_code == CODE(SHUTTING_DOWN),
                "the pause was answered %d", (int)e.req_code);
  fprintf(stderr, "backup copy in flight: the pause was answered %s\n",
          wire_code_name(e.req_code));
  expect_told(&w, 0);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A controller's pause waits in the queue behind another's running pause
 * (whose Unmap is never acked): both are answered SHUTTING_DOWN. */
START_TEST(controller_queued_behind_a_running_pause) {
  daemon_start(&d, NULL);
  struct peer w, first, second;
  struct pbuf a, b;
  peer_open(&w, &d, WORKER);
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &a);
  peer_alloc(&w, "weights", 0, 4 * MiB, 0, &b);
  peer_open(&first, &d, CONTROLLER);
  peer_open(&second, &d, CONTROLLER);
  uint64_t req1 = first.next_id;
  peer_op(&first, false, "kv", 0, 0);
  struct frame f;
  wire_env *e = peer_event(&w, &f); /* the first pause runs: its Unmap, never acked */
  wire_env_free(e);
  frame_release(&f);
  uint64_t req2 = second.next_id;
  peer_op(&second, false, "weights", 0, 0);
  /* Frames are served in order: once the status is answered, the second
   * pause was read and queued (it is not answered while the first runs). */
  wire_env_free(peer_status(&second));
  ck_assert(!peer_waiting(&w)); /* the second pause sent no Unmap: it waits */
  stop_and_check(SIGTERM, PROMPT_MS, "controller queued", NULL, 0);
  ck_assert_int_eq(expect_told(&first, req1).req_code, CODE(SHUTTING_DOWN));
  ck_assert_int_eq(expect_told(&second, req2).req_code, CODE(SHUTTING_DOWN));
  expect_told(&w, 0);
  peer_unmap(&a);
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&first);
  peer_close(&second);
}
END_TEST

/* Sessions whose output queue is full (they ask for status and never
 * read): the daemon exits 0 once its drain time is over. One that never
 * reads is closed (its stream ends); one that starts reading after the
 * signal gets every reply and then the notice. */
START_TEST(session_with_a_full_output_queue) {
  daemon_start(&d, NULL);
  struct peer deaf, late, c;
  peer_open(&deaf, &d, WORKER);
  peer_open(&late, &d, WORKER);
  peer_open(&c, &d, CONTROLLER);
  fill_output_queue(&deaf, &c, 32 << 10);
  fill_output_queue(&late, &c, 64 << 10);
  double t0 = now_ms();
  ck_assert_int_eq(kill(d.pid, SIGTERM), 0);
  struct ending e = expect_told(&late, 0);
  fprintf(stderr, "full output queue: %zu messages read after the signal, in %.0f ms\n",
          e.messages, now_ms() - t0);
  expect_told(&c, 0);
  int status = daemon_exit_within(DRAIN_EXIT_MS);
  ck_assert_msg(status == 0, "gpumemd exited %d; its log ends:\n%s", status, log_tail());
  ck_assert(!socket_exists());
  ck_assert_int_eq(children_but(NULL, 0), 0);
  fprintf(stderr, "full output queue: exit 0 in %.0f ms\n", now_ms() - t0);
  read_to_end(&deaf, 0); /* what reached its socket, then the end */
  peer_close(&deaf);
  peer_close(&late);
  peer_close(&c);
}
END_TEST

/* A session that connected and never said hello is told too. */
START_TEST(session_that_never_said_hello) {
  daemon_start(&d, NULL);
  struct peer silent, c;
  peer_connect(&silent, &d);
  peer_open(&c, &d, CONTROLLER);
  ck_assert_uint_eq(sessions_seen(&c), 2); /* the silent one was accepted */
  stop_and_check(SIGTERM, PROMPT_MS, "never said hello", NULL, 0);
  expect_told(&silent, 0);
  expect_told(&c, 0);
  peer_close(&silent);
  peer_close(&c);
}
END_TEST

/* SIGTERM twice: at once, and again while the daemon drains a session
 * that does not read (it has taken the first: its socket is gone). The
 * second changes nothing: one shutdown, exit 0. */
START_TEST(sigterm_twice) {
  daemon_start(&d, NULL);
  struct peer deaf, c;
  peer_open(&deaf, &d, WORKER);
  peer_open(&c, &d, CONTROLLER);
  fill_output_queue(&deaf, &c, 32 << 10);
  double t0 = now_ms();
  ck_assert_int_eq(kill(d.pid, SIGTERM), 0);
  ck_assert_int_eq(kill(d.pid, SIGTERM), 0);
  ck_assert(socket_gone_within(PROMPT_MS));
  ck_assert_int_eq(waitpid(d.pid, NULL, WNOHANG), 0); /* still draining */
  ck_assert_int_eq(kill(d.pid, SIGTERM), 0);
  int status = daemon_exit_within(DRAIN_EXIT_MS);
  ck_assert_msg(status == 0, "gpumemd exited %d; its log ends:\n%s", status, log_tail());
  ck_assert_int_eq(children_but(NULL, 0), 0);
  ck_assert_int_eq(daemon_log_count(&d, "Terminated: shutting down"), 1);
  fprintf(stderr, "SIGTERM twice (and once more while draining): exit 0 in %.0f ms\n",
          now_ms() - t0);
  expect_told(&c, 0);
  read_to_end(&deaf, 0);
  peer_close(&deaf);
  peer_close(&c);
}
END_TEST

/* SIGTERM again and again, every 200 us until the daemon is gone,
 * while it frees 512 MiB of BACKUP buffers whose host memory its thread
 * pool made: the later signals land after it stopped listening for them,
 * while it frees memory with the pool's threads still there, and it still
 * exits 0. */
START_TEST(sigterm_again_and_again_while_the_daemon_frees_its_memory) {
  daemon_start(&d, "--host-devices", "1", "--host-device-size", "1G", NULL);
  struct peer w;
  struct pbuf b[8];
  peer_open(&w, &d, WORKER);
  for (size_t i = 0; i < 8; i++) peer_alloc(&w, "bk", 0, 64 * MiB, BACKUP, &b[i]);
  int pidfd = (int)syscall(SYS_pidfd_open, d.pid, 0);
  ck_assert_int_ge(pidfd, 0);
  double t0 = now_ms(), end = t0 + COPY_EXIT_MS;
  int sent = 0;
  struct pollfd pf = {pidfd, POLLIN, 0};
  const struct timespec interval = {0, 200000};
  do {
    ck_assert_int_eq(kill(d.pid, SIGTERM), 0);
    sent++;
  } while (ppoll(&pf, 1, &interval, NULL) == 0 && now_ms() < end);
  close(pidfd);
  int status = daemon_exit_within(PROMPT_MS);
  fprintf(stderr, "SIGTERM %d times, every 200 us: exit status %d after %.0f ms\n", sent, status,
          now_ms() - t0);
  ck_assert_msg(status == 0, "gpumemd exited %d after %d SIGTERMs; its log ends:\n%s", status,
                sent, log_tail());
  ck_assert(!socket_exists());
  ck_assert_int_eq(children_but(NULL, 0), 0);
  expect_told(&w, 0);
  for (size_t i = 0; i < 8; i++) peer_unmap(&b[i]);
  peer_close(&w);
}
END_TEST

/* SIGINT does what SIGTERM does, and the notice names it. */
START_TEST(sigint_once) {
  daemon_start(&d, NULL);
  struct peer w, c;
  struct pbuf b;
  open_watched(&w, &b, &c, NULL);
  stop_and_check(SIGINT, PROMPT_MS, "SIGINT", NULL, 0);
  struct ending e = expect_told(&w, 0);
  ck_assert_msg(strstr(e.words, strsignal(SIGINT)), "notice: %s", e.words);
  expect_told(&c, 0);
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

int main(void) {
  return HARNESS_RUN("sigterm", 30, setup, teardown, idle_with_no_sessions,
                     workers_holding_active_buffers, mid_pause_waiting_for_an_unmap_ack,
                     mid_resume_waiting_for_a_remap_ack,
                     backup_memory_being_made_on_the_thread_pool, backup_copy_in_flight,
                     controller_queued_behind_a_running_pause, session_with_a_full_output_queue,
                     session_that_never_said_hello, sigterm_twice,
                     sigterm_again_and_again_while_the_daemon_frees_its_memory, sigint_once);
}
