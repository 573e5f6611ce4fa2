/* Hostile peers against the parts of the protocol that came with issue 7:
 * re-registration (AdoptRequest) of buffers after a daemon restart, acks
 * that name failed buffers, pauses and resumes that name unknown tags, and
 * SIGTERM. Written from proto/gpumemd.proto and the README only.
 *
 * Every attack is followed by the same checks: the daemon is still up, it
 * still serves other sessions, it holds exactly the memory (its memfds, the
 * kernel's figure) and the fds it held before, and status and list say what
 * they said before. Raw protocol peers send exactly the bytes and fds each
 * attack needs. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/wire.h"
#include "harness.h"

#define MiB (1024ull * 1024ull)
#define GiB (1024ull * MiB)
#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x
#define WORKER GPUMEM__WIRE__ROLE__ROLE_WORKER
#define CONTROLLER GPUMEM__WIRE__ROLE__ROLE_CONTROLLER
#define BODY(x) GPUMEM__WIRE__ENVELOPE__BODY_##x
#define F_BACKUP GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP
#define F_IPC GPUMEM__WIRE__BUFFER_FLAG__FLAG_IPC_LEGACY
#define F_ALLOW_PAUSED GPUMEM__WIRE__BUFFER_FLAG__FLAG_ALLOW_PAUSED

static struct daemon d;
static char bus[2][96]; /* the daemon's devices' bus ids, from HelloReply */

static void pause_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

/* Connect and say hello in a role; keeps the devices' bus ids. */
static void open_peer(struct peer *p, int role) {
  peer_connect(p, &d);
  wire_env *r = peer_hello(p, role);
  ck_assert_uint_ge(r->hello_reply->n_devices, 2);
  for (size_t i = 0; i < 2; i++)
    snprintf(bus[i], sizeof bus[i], "%s", r->hello_reply->devices[i]->bus_id);
  wire_env_free(r);
}

/* ---- what the daemon holds ---- */

/* Open fds of the daemon. */
static int daemon_fds(void) {
  int maxfd, n = proc_fds(d.pid, &maxfd);
  ck_assert_int_ge(maxfd, 0); /* its fd directory was read */
  return n;
}

enum { FD_LIST_MAX = 4096 }; /* bytes of daemon_fd_list's text */

/* Append " fd->target" to the FD_LIST_MAX string buffer arg. */
static void list_fd(int fd, const char *target, void *arg) {
  char *out = arg, entry[600];
  snprintf(entry, sizeof entry, " %d->%s", fd, target);
  strncat(out, entry, FD_LIST_MAX - strlen(out) - 1);
}

/* The daemon's fds as "n->target" words (static buffer), for messages. */
static const char *daemon_fd_list(void) {
  static char out[FD_LIST_MAX];
  out[0] = '\0';
  proc_fd_each(d.pid, list_fd, out);
  return out;
}

/* Sockets the daemon holds (the listener and one per session). */
static int daemon_sockets(void) { return proc_fds_with(d.pid, "socket:"); }

/* Start the daemon with the arguments in args (NULL-terminated, at least
 * 8 entries: 8 are passed on) and give it a bounded time to close
 * daemon_start's probe connection (it sometimes keeps it longer: fd
 * figures below count sockets apart for that reason). */
static void daemon_upv(const char *const *args) {
  daemon_start(&d, args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7],
               NULL);
  double end = now_ms() + 1000;
  while (daemon_sockets() != 1 && now_ms() < end) pause_ms(5);
}

/* A daemon without a journal, in its grace: paused re-registrations are
 * taken (allocations in new tags wait). */
#define GRACE_NO_JOURNAL ((const char *const[16]){"--journal", "none", "--adopt-grace", "600s"})

/* daemon_upv with no arguments. */
static void daemon_up(void) { daemon_upv((const char *const[16]){NULL}); }

/* daemon_upv with these arguments, then a controller c and a worker w. */
static void up_pair(struct peer *c, struct peer *w, ...) {
  const char *args[16] = {0};
  va_list ap;
  va_start(ap, w);
  harness_collect_args(args, 16, ap);
  va_end(ap);
  daemon_upv(args);
  open_peer(c, CONTROLLER);
  open_peer(w, WORKER);
}

/* What the daemon process holds of the backend's memory. */
static uint64_t daemon_bytes(void) { return memfd_bytes(&d.pid, 1); }

/* Everything a refused request must leave as it was. */
struct snap {
  int fds; /* all but sockets */
  int sockets;
  uint64_t mem;
  uint64_t managed[2];
  uint64_t free[2];
  size_t buffers;
  size_t tags;
};

static void take_snap(struct peer *c, struct snap *s) {
  wire_env *st = peer_status(c);
  for (int i = 0; i < 2; i++) {
    s->managed[i] = st->status_reply->devices[i]->managed;
    s->free[i] = st->status_reply->devices[i]->free;
  }
  s->tags = st->status_reply->n_tags;
  wire_env_free(st);
  s->buffers = peer_list_count(c);
  s->mem = daemon_bytes();
  s->sockets = daemon_sockets();
  s->fds = daemon_fds() - s->sockets;
}

/* The daemon is alive, serves c, and holds no more than it held at s (fds
 * within a bounded wait: the daemon may close a refused session's fds
 * after it answered; fewer when s caught an earlier session still ending,
 * its pidfd among its fds). extra_fds: sessions opened (+) or ended (-)
 * since. */
static void assert_unchanged(struct peer *c, const struct snap *s, int extra_fds,
                             const char *what) {
  ck_assert_msg(kill(d.pid, 0) == 0 && waitpid(d.pid, NULL, WNOHANG) == 0,
                "%s: gpumemd died; see %s", what, d.log);
  struct snap now;
  double end = now_ms() + harness_patience_ms(3000);
  do {
    take_snap(c, &now);
    if (now.fds <= s->fds && now.sockets <= s->sockets + extra_fds) break;
    pause_ms(10);
  } while (now_ms() < end);
  ck_assert_msg(now.fds <= s->fds && now.sockets <= s->sockets + extra_fds,
                "%s: gpumemd holds %d fds and %d sockets, %d and %d before:%s", what, now.fds,
                now.sockets, s->fds, s->sockets + extra_fds, daemon_fd_list());
  ck_assert_msg(now.mem == s->mem, "%s: gpumemd's memfds hold %llu bytes, %llu before", what,
                (unsigned long long)now.mem, (unsigned long long)s->mem);
  for (int i = 0; i < 2; i++) {
    ck_assert_msg(now.managed[i] == s->managed[i],
                  "%s: device %d manages %llu bytes, %llu before", what, i,
                  (unsigned long long)now.managed[i], (unsigned long long)s->managed[i]);
    ck_assert_msg(now.free[i] == s->free[i], "%s: device %d has %llu free, %llu before", what, i,
                  (unsigned long long)now.free[i], (unsigned long long)s->free[i]);
  }
  ck_assert_msg(now.buffers == s->buffers, "%s: %zu buffers listed, %zu before", what,
                now.buffers, s->buffers);
  ck_assert_msg(now.tags == s->tags, "%s: %zu tags, %zu before", what, now.tags, s->tags);
}

/* ---- memory and other fds to hand over ---- */

/* A memfd named as name, of size bytes, committed or not. */
static int memfd_named(const char *name, uint64_t size, bool commit, unsigned mflags) {
  int fd = memfd_create(name, MFD_CLOEXEC | mflags);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, (off_t)size), 0);
  if (commit && size) ck_assert_int_eq(fallocate(fd, 0, 0, (off_t)size), 0);
  return fd;
}

/* The name the host backend gives the memfds of the daemon's device dev
 * (a static buffer, which the next call and chunk rewrite). */
static const char *dev_memfd_name(unsigned dev) {
  static char name[128];
  snprintf(name, sizeof name, "gpumem-%s", bus[dev]);
  return name;
}

/* A chunk as the host backend makes them: a committed memfd named for the
 * daemon's device dev. */
static int chunk(unsigned dev, uint64_t size) {
  return memfd_named(dev_memfd_name(dev), size, true, MFD_ALLOW_SEALING);
}

/* One buffer of an AdoptRequest. */
struct abuf {
  const char *tag;
  uint32_t device;
  uint64_t size;
  uint32_t flags;
  uint64_t chunks[4];
  size_t nchunks;
  bool paused;
};

/* A mapped buffer of one chunk. */
#define ONE(tag_, dev_, size_) {.tag = (tag_), .device = (dev_), .size = (size_), .chunks = {(size_)}, .nchunks = 1}

/* Send an AdoptRequest (fds consumed; fd_count as declared, -1 for nfds). */
static uint64_t adopt_send(struct peer *p, const struct abuf *b, size_t n, const int *fds,
                           size_t nfds, int fd_count) {
  Gpumem__Wire__AdoptBuffer *bufs = calloc(n ? n : 1, sizeof *bufs);
  Gpumem__Wire__AdoptBuffer **ptrs = calloc(n ? n : 1, sizeof *ptrs);
  for (size_t i = 0; i < n; i++) {
    gpumem__wire__adopt_buffer__init(&bufs[i]);
    bufs[i].tag = (char *)b[i].tag;
    bufs[i].device = b[i].device;
    bufs[i].size = b[i].size;
    bufs[i].flags = b[i].flags;
    bufs[i].chunk_sizes = (uint64_t *)b[i].chunks;
    bufs[i].n_chunk_sizes = b[i].nchunks;
    bufs[i].paused = b[i].paused;
    ptrs[i] = &bufs[i];
  }
  Gpumem__Wire__AdoptRequest a = GPUMEM__WIRE__ADOPT_REQUEST__INIT;
  a.buffers = ptrs;
  a.n_buffers = n;
  wire_env env = peer_env(p->next_id++, BODY(ADOPT));
  env.fd_count = fd_count < 0 ? (uint32_t)nfds : (uint32_t)fd_count;
  env.adopt = &a;
  peer_put(p, &env, fds, nfds);
  free(bufs);
  free(ptrs);
  return env.id;
}

/* Adopt and wait for the answer: the code, the message in why, the new
 * ids in ids (if OK). */
static wire_code adopt(struct peer *p, const struct abuf *b, size_t n, const int *fds,
                       size_t nfds, char *why, uint64_t *ids) {
  uint64_t id = adopt_send(p, b, n, fds, nfds, -1);
  wire_env *r = peer_get(p, NULL);
  ck_assert_msg(r != NULL, "gpumemd ended the session on an adopt");
  ck_assert_uint_eq(r->id, id);
  char text[512];
  wire_code code = peer_reply_code(r, text, sizeof text);
  if (why) snprintf(why, 512, "%s", text);
  if (code == CODE(OK)) {
    ck_assert_int_eq(r->body_case, BODY(ADOPT_REPLY));
    ck_assert_uint_eq(r->adopt_reply->n_buffer_ids, n);
    for (size_t i = 0; ids && i < n; i++) ids[i] = r->adopt_reply->buffer_ids[i];
  }
  wire_env_free(r);
  return code;
}

/* An adopt that must be refused with code and change nothing. */
static void refused(struct peer *w, struct peer *c, const struct abuf *b, size_t n,
                    const int *fds, size_t nfds, wire_code want, const char *what) {
  struct snap s;
  take_snap(c, &s);
  char why[512];
  wire_code got = adopt(w, b, n, fds, nfds, why, NULL);
  ck_assert_msg(got == want, "%s: adopt answered %s (%s), expected %s", what,
                wire_code_name(got), why, wire_code_name(want));
  assert_unchanged(c, &s, 0, what);
}

static void setup(void) {
  signal(SIGPIPE, SIG_IGN);
  harness_fd_setup();
}

/* Stop the test's daemon and check that no fd leaked. */
static void teardown(void) { harness_daemon_teardown(&d); }

/* up_pair, a 4 MiB buffer of tag kv on device 0 for w, and c's pause of
 * kv: the Unmap w now has to answer (its fds in *f). */
static wire_env *unmap_pending(struct peer *c, struct peer *w, struct pbuf *b, struct frame *f) {
  up_pair(c, w, NULL);
  peer_alloc(w, "kv", 0, 4 * MiB, 0, b);
  peer_op(c, false, "kv", 0, 0);
  return peer_event(w, f);
}

/* ======================= AdoptRequest ======================= */

/* The good case first, as a reference for the attacks: memory a worker
 * hands over is owned (status, list, memfds), paused by its new id, freed,
 * resumed; ids are new and distinct. */
START_TEST(adopted_memory_is_owned_paused_and_resumed) {
  daemon_upv(GRACE_NO_JOURNAL);
  struct peer w, c;
  open_peer(&w, WORKER);
  open_peer(&c, CONTROLLER);
  int mine[2] = {chunk(0, 4 * MiB), chunk(1, 2 * MiB)};
  int give[2] = {dup(mine[0]), dup(mine[1])};
  struct abuf b[3] = {ONE("kv", 0, 4 * MiB), ONE("kv", 1, 2 * MiB),
                      {.tag = "kv", .device = 0, .size = 6 * MiB, .chunks = {6 * MiB},
                       .nchunks = 1, .paused = true}};
  uint64_t ids[3];
  char why[512];
  ck_assert_msg(adopt(&w, b, 3, give, 2, why, ids) == CODE(OK), "%s", why);
  struct pbuf own; /* in a tag that exists: served during the grace */
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &own);
  ck_assert(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2]);
  for (int i = 0; i < 3; i++) ck_assert_uint_ne(ids[i], own.id);
  wire_env *st = peer_status(&c);
  ck_assert_uint_eq(st->status_reply->devices[0]->managed, 6 * MiB);
  ck_assert_uint_eq(st->status_reply->devices[1]->managed, 2 * MiB);
  const Gpumem__Wire__TagInfo *t = peer_tag(st, "kv");
  ck_assert_uint_eq(t->buffers, 4);
  ck_assert_uint_eq(t->paused_buffers, 1);
  wire_env_free(st);
  ck_assert_uint_eq(daemon_bytes(), 8 * MiB);
  struct pbuf bufs[3] = {own, {.id = ids[0], .fds = {mine[0]}, .nfds = 1},
                         {.id = ids[1], .fds = {mine[1]}, .nfds = 1}};
  peer_op_served(&c, false, "kv", &w, bufs, 3);
  ck_assert_uint_eq(daemon_bytes(), 0);
  peer_op_served(&c, true, "kv", &w, bufs, 3);
  ck_assert_uint_eq(daemon_bytes(), 14 * MiB);
  for (int i = 0; i < 3; i++) peer_unmap(&bufs[i]);
  peer_close(&w);
  /* The session's end frees what it adopted. */
  double end = now_ms() + 3000;
  while (daemon_bytes() != 0 && now_ms() < end) pause_ms(10);
  ck_assert_uint_eq(daemon_bytes(), 0);
  peer_close(&c);
}
END_TEST

/* Stop the daemon with SIGTERM (w is told, and closed) and start the next
 * one on the same socket. */
static void restart(struct peer *w) {
  kill(d.pid, SIGTERM);
  ck_assert_int_eq(peer_stray_error(w), CODE(SHUTTING_DOWN));
  ck_assert(peer_ended(w));
  int status;
  ck_assert_int_eq(waitpid(d.pid, &status, 0), d.pid);
  ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  peer_close(w);
  /* Without a journal: these re-registrations by hand bring no secret
   * (check_reclaim has the journal's). */
  d.pid = daemon_spawn(d.socket, d.log, (const char *const[]){"--journal", "none", NULL});
  double end = now_ms() + 5000;
  int fd;
  while ((fd = raw_connect(&d)) < 0 && now_ms() < end) pause_ms(10);
  ck_assert_int_ge(fd, 0);
  close(fd);
}

/* A daemon stopped with SIGTERM answers, and the next one on the socket
 * adopts the memory the worker kept (the raw version of a restart). */
START_TEST(restart_then_adopt_by_hand) {
  daemon_up();
  struct peer w;
  open_peer(&w, WORKER);
  struct pbuf b;
  peer_alloc(&w, "kv", 1, 4 * MiB, 0, &b);
  ck_assert_uint_eq(b.nfds, 1);
  restart(&w);
  ck_assert_uint_eq(memfd_bytes((pid_t[]){getpid()}, 1), 4 * MiB); /* still ours */
  open_peer(&w, WORKER);
  struct abuf a = ONE("kv", 1, 4 * MiB);
  int give = dup(b.fds[0]);
  uint64_t id;
  char why[512];
  ck_assert_msg(adopt(&w, &a, 1, &give, 1, why, &id) == CODE(OK), "%s", why);
  ck_assert_uint_eq(daemon_bytes(), 4 * MiB);
  /* Adopting it again is refused: the daemon holds it now. */
  struct peer c;
  open_peer(&c, CONTROLLER);
  give = dup(b.fds[0]);
  refused(&w, &c, &a, 1, &give, 1, CODE(INVALID_ARGUMENT), "the same memory adopted twice");
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* After a restart, memory handed back by another uid than the one it was
 * made for is refused (the host backend keeps the owner with the memfd);
 * its owner gets it back. Needs root, to be another uid. */
START_TEST(adopt_of_another_uids_memory) {
  if (geteuid() != 0) return;
  daemon_up();
  struct peer w;
  open_peer(&w, WORKER);
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &b);
  restart(&w);
  ck_assert_int_eq(chmod(d.dir, 0755), 0);
  ck_assert_int_eq(chmod(d.socket, 0666), 0);
  struct abuf a = ONE("kv", 0, 4 * MiB);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) { /* nobody, holding root's memory */
    if (setgid(65534) < 0 || setuid(65534) < 0) _exit(99);
    struct peer x;
    open_peer(&x, WORKER);
    int give = dup(b.fds[0]);
    _exit((int)adopt(&x, &a, 1, &give, 1, NULL, NULL));
  }
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert(WIFEXITED(status));
  ck_assert_int_eq(WEXITSTATUS(status), CODE(PERMISSION_DENIED));
  ck_assert_uint_eq(daemon_bytes(), 0);
  open_peer(&w, WORKER);
  int give = dup(b.fds[0]);
  char why[512];
  ck_assert_msg(adopt(&w, &a, 1, &give, 1, why, NULL) == CODE(OK), "%s", why);
  ck_assert_uint_eq(daemon_bytes(), 4 * MiB);
  peer_unmap(&b);
  peer_close(&w);
}
END_TEST

/* Before Hello an adopt ends the session (PROTOCOL_ERROR) and every fd it
 * carried is closed; nothing is adopted. */
START_TEST(adopt_before_hello) {
  daemon_up();
  struct peer c, x;
  open_peer(&c, CONTROLLER);
  struct snap s;
  take_snap(&c, &s);
  peer_connect(&x, &d);
  struct abuf a = ONE("kv", 0, 2 * MiB);
  int fd = chunk(0, 2 * MiB);
  adopt_send(&x, &a, 1, &fd, 1, -1);
  wire_env *r = peer_get(&x, NULL);
  ck_assert_ptr_nonnull(r);
  ck_assert_int_eq(peer_reply_code(r, NULL, 0), CODE(PROTOCOL_ERROR));
  wire_env_free(r);
  ck_assert(peer_ended(&x));
  peer_close(&x);
  assert_unchanged(&c, &s, 0, "adopt before hello");
  peer_close(&c);
}
END_TEST

/* A controller does not own buffers: PERMISSION_DENIED, fds closed. */
START_TEST(adopt_as_controller) {
  daemon_up();
  struct peer c, c2;
  open_peer(&c, CONTROLLER);
  open_peer(&c2, CONTROLLER);
  struct abuf a[2] = {ONE("kv", 0, 2 * MiB), ONE("kv", 1, 2 * MiB)};
  int fds[2] = {chunk(0, 2 * MiB), chunk(1, 2 * MiB)};
  refused(&c2, &c, a, 2, fds, 2, CODE(PERMISSION_DENIED), "adopt as a controller");
  a[0].paused = true;
  a[1].paused = true;
  refused(&c2, &c, a, 2, NULL, 0, CODE(PERMISSION_DENIED), "paused adopt as a controller");
  peer_close(&c);
  peer_close(&c2);
}
END_TEST

/* fd_count against the chunks: too many, too few, declared not sent, fds
 * on a paused buffer. Each is a PROTOCOL_ERROR that ends the session and
 * closes every fd; other sessions and the memory are untouched. */
START_TEST(adopt_with_wrong_fd_counts) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  struct pbuf keep;
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &keep);
  struct snap s;
  take_snap(&c, &s);
  for (int attack = 0; attack < 6; attack++) {
    struct peer x;
    open_peer(&x, WORKER);
    struct abuf a[2] = {ONE("kv", 0, 2 * MiB), ONE("kv", 0, 4 * MiB)};
    a[1].chunks[0] = a[1].chunks[1] = 2 * MiB;
    a[1].nchunks = 2;
    int fds[5];
    size_t nfds = 0;
    int declared = -1;
    const char *what = "";
    switch (attack) {
    case 0: /* 3 chunks, 4 fds */
      what = "one fd too many";
      for (int i = 0; i < 4; i++) fds[nfds++] = chunk(0, 2 * MiB);
      break;
    case 1: /* 3 chunks, 2 fds */
      what = "one fd too few";
      for (int i = 0; i < 2; i++) fds[nfds++] = chunk(0, 2 * MiB);
      break;
    case 2:
      what = "fd_count 3, 2 sent";
      for (int i = 0; i < 2; i++) fds[nfds++] = chunk(0, 2 * MiB);
      declared = 3;
      break;
    case 3:
      what = "fd_count 2, 3 sent";
      for (int i = 0; i < 3; i++) fds[nfds++] = chunk(0, 2 * MiB);
      declared = 2;
      break;
    case 4:
      what = "paused buffers with fds";
      a[0].paused = a[1].paused = true;
      for (int i = 0; i < 3; i++) fds[nfds++] = chunk(0, 2 * MiB);
      break;
    case 5:
      what = "no fds for mapped buffers";
      break;
    }
    adopt_send(&x, a, 2, fds, nfds, declared);
    wire_env *r = peer_get(&x, NULL);
    ck_assert_msg(r != NULL, "%s: no answer", what);
    wire_code got = peer_reply_code(r, NULL, 0);
    ck_assert_msg(got == CODE(PROTOCOL_ERROR), "%s: answered %s", what, wire_code_name(got));
    wire_env_free(r);
    ck_assert_msg(peer_ended(&x), "%s: session not ended", what);
    peer_close(&x);
    assert_unchanged(&c, &s, 0, what);
  }
  /* The worker that did nothing wrong still works. */
  struct pbuf more;
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &more);
  peer_unmap(&more);
  peer_unmap(&keep);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* fds that are not the backend's memory: refused, closed, nothing owned. */
START_TEST(adopt_fds_of_the_wrong_kind) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  struct abuf a = ONE("kv", 0, 2 * MiB);
  char dir[] = "/tmp/gpumem-hostile.XXXXXX", path[400];
  ck_assert_ptr_nonnull(mkdtemp(dir));
  const char *name = dev_memfd_name(0);
  for (int attack = 0; attack < 11; attack++) {
    int fd = -1, sv[2], pp[2];
    const char *what = "";
    switch (attack) {
    case 0:
      what = "a pipe";
      ck_assert_int_eq(pipe2(pp, O_CLOEXEC), 0);
      close(pp[1]);
      fd = pp[0];
      break;
    case 1:
      what = "a socket";
      ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
      close(sv[1]);
      fd = sv[0];
      break;
    case 2:
      what = "/dev/null";
      fd = open("/dev/null", O_RDWR | O_CLOEXEC);
      break;
    case 3:
      what = "/dev/zero";
      fd = open("/dev/zero", O_RDWR | O_CLOEXEC);
      break;
    case 4:
      what = "a directory";
      fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      break;
    case 5:
      what = "an eventfd";
      fd = eventfd(0, EFD_CLOEXEC);
      break;
    case 6:
      what = "a regular file of the right size";
      snprintf(path, sizeof path, "%s/plain", dir);
      fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
      ck_assert_int_eq(fallocate(fd, 0, 0, 2 * MiB), 0);
      break;
    case 7:
      what = "a file whose path looks like the backend's memfd";
      snprintf(path, sizeof path, "%s/memfd:%s", dir, name);
      fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
      ck_assert_int_eq(fallocate(fd, 0, 0, 2 * MiB), 0);
      unlink(path);
      break;
    case 8:
      what = "a tmpfs file in /dev/shm named like the backend's memfd";
      snprintf(path, sizeof path, "/dev/shm/memfd:%s", name);
      fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      if (fd < 0) continue; /* no /dev/shm here */
      ck_assert_int_eq(fallocate(fd, 0, 0, 2 * MiB), 0);
      unlink(path);
      break;
    case 9:
      what = "a memfd with another name";
      fd = memfd_named("not-gpumem", 2 * MiB, true, 0);
      break;
    case 10:
      what = "a memfd named for another daemon's device";
      fd = memfd_named("gpumem-host-0123456789abcdef:0", 2 * MiB, true, 0);
      break;
    }
    ck_assert_int_ge(fd, 0);
    refused(&w, &c, &a, 1, &fd, 1, CODE(INVALID_ARGUMENT), what);
  }
  snprintf(path, sizeof path, "rm -rf %s", dir);
  ck_assert_int_eq(system(path), 0);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* The backend's memory of the wrong device or size, or split otherwise
 * than the request says. */
START_TEST(adopt_memfds_of_the_wrong_device_or_size) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  struct abuf a = ONE("kv", 0, 4 * MiB);
  int fd = chunk(1, 4 * MiB);
  refused(&w, &c, &a, 1, &fd, 1, CODE(INVALID_ARGUMENT), "device 1's memory said to be device 0's");
  a.device = 2;
  fd = chunk(0, 4 * MiB);
  refused(&w, &c, &a, 1, &fd, 1, CODE(INVALID_ARGUMENT), "device 2 of 2");
  a.device = UINT32_MAX;
  fd = chunk(0, 4 * MiB);
  refused(&w, &c, &a, 1, &fd, 1, CODE(INVALID_ARGUMENT), "device 2^32-1");
  a.device = 0;
  fd = chunk(0, 2 * MiB);
  refused(&w, &c, &a, 1, &fd, 1, CODE(INVALID_ARGUMENT), "a 2 MiB memfd said to be 4 MiB");
  fd = chunk(0, 8 * MiB);
  refused(&w, &c, &a, 1, &fd, 1, CODE(INVALID_ARGUMENT), "an 8 MiB memfd said to be 4 MiB");
  /* Two chunks of 2 MiB declared, one of 4 MiB and an empty one sent. */
  a.chunks[0] = a.chunks[1] = 2 * MiB;
  a.nchunks = 2;
  int two[2] = {chunk(0, 4 * MiB), chunk(0, 0)};
  refused(&w, &c, &a, 1, two, 2, CODE(INVALID_ARGUMENT), "chunks split otherwise");
  two[0] = chunk(0, 2 * MiB);
  two[1] = chunk(1, 2 * MiB);
  refused(&w, &c, &a, 1, two, 2, CODE(INVALID_ARGUMENT), "chunks of two devices in one buffer");
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Sizes the daemon would never have made: zero, not a multiple of the
 * granularity, larger than the device, overflowing, unmatched. */
START_TEST(adopt_sizes_that_cannot_be) {
  struct peer c, w;
  up_pair(&c, &w, "--host-device-size", "64M", NULL);
  struct abuf a = ONE("kv", 0, 0);
  refused(&w, &c, &a, 1, (int[]){chunk(0, 0)}, 1, CODE(INVALID_ARGUMENT), "size 0");
  a.paused = true;
  refused(&w, &c, &a, 1, NULL, 0, CODE(INVALID_ARGUMENT), "paused, size 0");
  a = (struct abuf)ONE("kv", 0, 3 * MiB);
  refused(&w, &c, &a, 1, (int[]){chunk(0, 3 * MiB)}, 1, CODE(INVALID_ARGUMENT),
          "3 MiB: not a multiple of the 2 MiB granularity");
  a = (struct abuf)ONE("kv", 0, 4096);
  refused(&w, &c, &a, 1, (int[]){chunk(0, 4096)}, 1, CODE(INVALID_ARGUMENT), "4 KiB");
  a = (struct abuf)ONE("kv", 0, 128 * MiB);
  refused(&w, &c, &a, 1, (int[]){chunk(0, 128 * MiB)}, 1, CODE(INVALID_ARGUMENT),
          "mapped, larger than the device");
  a.paused = true;
  a.device = 2;
  refused(&w, &c, &a, 1, NULL, 0, CODE(INVALID_ARGUMENT), "paused, device out of range");
  a.size = 2 * MiB;
  a.chunks[0] = UINT64_MAX;
  a.chunks[1] = 2 * MiB + 1;
  a.nchunks = 2;
  refused(&w, &c, &a, 1, NULL, 0, CODE(INVALID_ARGUMENT), "chunk sizes that overflow");
  a = (struct abuf)ONE("kv", 0, 4 * MiB);
  a.chunks[0] = 2 * MiB;
  a.paused = true;
  refused(&w, &c, &a, 1, NULL, 0, CODE(INVALID_ARGUMENT), "chunks short of the size");
  a.nchunks = 0;
  refused(&w, &c, &a, 1, NULL, 0, CODE(INVALID_ARGUMENT), "no chunks");
  peer_close(&w);
  peer_close(&c);
}
END_TEST




/* A paused buffer larger than its device (which an alloc refuses, and
 * which could never be resumed) is INVALID_ARGUMENT, and so are two paused
 * buffers of 2^63 bytes whose sum would wrap; nothing is adopted. */
START_TEST(adopt_paused_larger_than_the_device) {
  struct peer c, w;
  up_pair(&c, &w, "--host-device-size", "64M", NULL);
  struct abuf a = ONE("kv", 0, 128 * MiB);
  a.paused = true;
  refused(&w, &c, &a, 1, NULL, 0, CODE(INVALID_ARGUMENT), "paused, 128 MiB on a 64 MiB device");
  struct abuf two[2] = {ONE("kv", 1, 1ull << 63), ONE("kv", 1, 1ull << 63)};
  two[0].paused = two[1].paused = true;
  refused(&w, &c, two, 2, NULL, 0, CODE(INVALID_ARGUMENT), "paused, 2 x 2^63 bytes");
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Flags: unknown bits, and the combinations an alloc refuses
 * (IPC_LEGACY|BACKUP, IPC_LEGACY|ALLOW_PAUSED), and a paused IPC_LEGACY
 * buffer, a state that cannot exist, are INVALID_ARGUMENT; nothing is
 * adopted. */
START_TEST(adopt_flags_an_alloc_refuses) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  struct abuf a = ONE("kv", 0, 2 * MiB);
  a.flags = 8;
  refused(&w, &c, &a, 1, (int[]){chunk(0, 2 * MiB)}, 1, CODE(INVALID_ARGUMENT), "flag 0x8");
  a.flags = 0x80000000u;
  refused(&w, &c, &a, 1, (int[]){chunk(0, 2 * MiB)}, 1, CODE(INVALID_ARGUMENT),
          "flag 0x80000000");
  a.flags = F_IPC | F_BACKUP;
  refused(&w, &c, &a, 1, (int[]){chunk(0, 2 * MiB)}, 1, CODE(INVALID_ARGUMENT),
          "IPC_LEGACY|BACKUP");
  a.flags = F_IPC | F_ALLOW_PAUSED;
  refused(&w, &c, &a, 1, (int[]){chunk(0, 2 * MiB)}, 1, CODE(INVALID_ARGUMENT),
          "IPC_LEGACY|ALLOW_PAUSED");
  a.flags = F_IPC;
  a.paused = true;
  refused(&w, &c, &a, 1, NULL, 0, CODE(INVALID_ARGUMENT), "a paused IPC_LEGACY buffer");
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* BACKUP buffers adopted reserve host memory like allocated ones: past
 * --backup-limit the adopt is refused as an alloc would be. */
START_TEST(adopt_backup_beyond_the_limit) {
  struct peer c, w;
  up_pair(&c, &w, "--backup-limit", "4M", "--journal", "none", "--adopt-grace", "600s", NULL);
  struct abuf a = ONE("kv", 0, 8 * MiB);
  a.flags = F_BACKUP;
  a.paused = true;
  refused(&w, &c, &a, 1, NULL, 0, CODE(LIMIT_EXCEEDED), "paused BACKUP over --backup-limit");
  a.paused = false;
  refused(&w, &c, &a, 1, (int[]){chunk(0, 8 * MiB)}, 1, CODE(LIMIT_EXCEEDED),
          "mapped BACKUP over --backup-limit");
  a = (struct abuf)ONE("kv", 0, 4 * MiB);
  a.flags = F_BACKUP;
  a.paused = true;
  char why[512];
  ck_assert_msg(adopt(&w, &a, 1, NULL, 0, why, NULL) == CODE(OK), "%s", why);
  struct pbuf x; /* kv exists now: not waiting for the grace */
  ck_assert_int_eq(peer_try_alloc(&w, "kv", 0, 8 * MiB, F_BACKUP, &x), CODE(LIMIT_EXCEEDED));
  wire_env *st = peer_status(&c);
  ck_assert_uint_eq(st->status_reply->backup_reserved, 4 * MiB);
  wire_env_free(st);
  a.size = a.chunks[0] = 2 * MiB;
  refused(&w, &c, &a, 1, NULL, 0, CODE(LIMIT_EXCEEDED), "one more BACKUP buffer");
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A memfd sealed against writes cannot be device memory that a worker
 * maps writable; refused. */
START_TEST(adopt_sealed_memfd) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  const char *name = dev_memfd_name(0);
  struct abuf a = ONE("kv", 0, 2 * MiB);
  int fd = memfd_named(name, 2 * MiB, true, MFD_ALLOW_SEALING);
  ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), 0);
  refused(&w, &c, &a, 1, &fd, 1, CODE(INVALID_ARGUMENT), "a write-sealed memfd");
  fd = memfd_named(name, 2 * MiB, true, MFD_ALLOW_SEALING);
  ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE), 0);
  refused(&w, &c, &a, 1, &fd, 1, CODE(INVALID_ARGUMENT), "a future-write-sealed memfd");
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A memfd of the right name and size that holds no memory: the daemon
 * must not count memory that does not exist; refused. */
START_TEST(adopt_uncommitted_memfd) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  const char *name = dev_memfd_name(0);
  struct abuf a = ONE("kv", 0, 4 * MiB);
  int fd = memfd_named(name, 4 * MiB, false, MFD_ALLOW_SEALING);
  refused(&w, &c, &a, 1, &fd, 1, CODE(INVALID_ARGUMENT), "an uncommitted memfd");
  /* Half committed. */
  fd = memfd_named(name, 4 * MiB, false, MFD_ALLOW_SEALING);
  ck_assert_int_eq(fallocate(fd, 0, 0, 2 * MiB), 0);
  refused(&w, &c, &a, 1, &fd, 1, CODE(INVALID_ARGUMENT), "a half-committed memfd");
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* The same memory twice in one request (two fds of one memfd) would be
 * counted twice and released twice: refused. */
START_TEST(adopt_the_same_memfd_twice) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  struct abuf a[2] = {ONE("kv", 0, 2 * MiB), ONE("other", 0, 2 * MiB)};
  int fd = chunk(0, 2 * MiB);
  int fds[2] = {fd, dup(fd)};
  refused(&w, &c, a, 2, fds, 2, CODE(INVALID_ARGUMENT), "one memfd as two buffers");
  a[0].size = 4 * MiB;
  a[0].chunks[0] = a[0].chunks[1] = 2 * MiB;
  a[0].nchunks = 2;
  fd = chunk(0, 2 * MiB);
  fds[0] = fd;
  fds[1] = dup(fd);
  refused(&w, &c, a, 1, fds, 2, CODE(INVALID_ARGUMENT), "one memfd as two chunks of a buffer");
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Memory the daemon already holds (a chunk of a live buffer, from its
 * alloc reply) is refused, alone or after good buffers, from its owner or
 * another session; the live buffer is untouched and still pauses. */
START_TEST(adopt_memory_the_daemon_holds) {
  struct peer c, w, w2;
  up_pair(&c, &w, NULL);
  open_peer(&w2, WORKER);
  struct pbuf b;
  peer_alloc(&w, "kv", 1, 4 * MiB, 0, &b);
  ck_assert_uint_eq(b.nfds, 1);
  struct abuf a = ONE("kv", 1, 4 * MiB);
  refused(&w, &c, &a, 1, (int[]){dup(b.fds[0])}, 1, CODE(INVALID_ARGUMENT),
          "a live buffer's chunk, by its owner");
  refused(&w2, &c, &a, 1, (int[]){dup(b.fds[0])}, 1, CODE(INVALID_ARGUMENT),
          "a live buffer's chunk, by another session");
  a.tag = "elsewhere";
  refused(&w2, &c, &a, 1, (int[]){dup(b.fds[0])}, 1, CODE(INVALID_ARGUMENT),
          "a live buffer's chunk, under another tag");
  struct abuf two[3] = {ONE("new", 1, 2 * MiB), ONE("new", 0, 2 * MiB), ONE("new", 1, 4 * MiB)};
  refused(&w2, &c, two, 3, (int[]){chunk(1, 2 * MiB), chunk(0, 2 * MiB), dup(b.fds[0])}, 3,
          CODE(INVALID_ARGUMENT), "good buffers, then a live buffer's chunk");
  peer_op_served(&c, false, "kv", &w, &b, 1);
  ck_assert_uint_eq(daemon_bytes(), 0);
  peer_close(&w);
  peer_close(&w2);
  peer_close(&c);
}
END_TEST

/* An adopt that fails on its last buffer, or its first, leaves nothing
 * behind: no buffer, no tag, no memory, every fd of the frame closed. */
START_TEST(adopt_that_fails_half_way_leaves_nothing) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  enum { N = 100 };
  static struct abuf a[N];
  static int fds[N];
  for (int order = 0; order < 2; order++) {
    int bad = order == 0 ? N - 1 : 0;
    for (int i = 0; i < N; i++) {
      a[i] = (struct abuf)ONE(i % 2 ? "odd" : "even", (uint32_t)(i % 2), 2 * MiB);
      fds[i] = i == bad ? open("/dev/null", O_RDWR | O_CLOEXEC) : chunk((unsigned)(i % 2), 2 * MiB);
    }
    refused(&w, &c, a, N, fds, N, CODE(INVALID_ARGUMENT),
            order == 0 ? "99 good buffers, then /dev/null" : "/dev/null, then 99 good buffers");
  }
  /* The last chunk too small: the check that fails is about memory. */
  for (int i = 0; i < N; i++) {
    a[i] = (struct abuf)ONE("kv", 0, 2 * MiB);
    fds[i] = chunk(0, i == N - 1 ? 4 * MiB : 2 * MiB);
  }
  refused(&w, &c, a, N, fds, N, CODE(INVALID_ARGUMENT), "99 good buffers, then a wrong size");
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* --max-buffers-per-session counts adopted buffers: an adopt that would
 * pass it is refused whole. A frame over the request limit ends the
 * session. */
START_TEST(adopt_more_buffers_than_allowed) {
  struct peer c, w;
  up_pair(&c, &w, "--max-buffers-per-session", "8", "--journal", "none", "--adopt-grace", "600s",
          NULL);
  static struct abuf a[3000];
  for (int i = 0; i < 3000; i++) {
    a[i] = (struct abuf)ONE("kv", 0, 2 * MiB);
    a[i].paused = true;
  }
  struct snap s;
  take_snap(&c, &s);
  uint64_t id = adopt_send(&w, a, 9, NULL, 0, -1);
  wire_env *r = peer_get(&w, NULL);
  ck_assert_ptr_nonnull(r);
  ck_assert_int_eq(peer_reply_code(r, NULL, 0), CODE(LIMIT_EXCEEDED));
  ck_assert(r->id == id || r->id == 0);
  wire_env_free(r);
  if (peer_ended(&w)) { /* a session over its limit may be ended */
    peer_close(&w);
    open_peer(&w, WORKER);
  }
  assert_unchanged(&c, &s, 0, "9 buffers, 8 allowed");
  char why[512];
  ck_assert_msg(adopt(&w, a, 8, NULL, 0, why, NULL) == CODE(OK), "%s", why);
  /* 3000 paused buffers in one frame (under 64 KiB). */
  take_snap(&c, &s);
  id = adopt_send(&w, a, 3000, NULL, 0, -1);
  r = peer_get(&w, NULL);
  ck_assert_ptr_nonnull(r);
  ck_assert_int_eq(peer_reply_code(r, NULL, 0), CODE(LIMIT_EXCEEDED));
  wire_env_free(r);
  if (peer_ended(&w)) {
    peer_close(&w);
    open_peer(&w, WORKER);
    s.buffers -= 8; /* the ended session's buffers went with it */
    s.tags -= 1;
  }
  ck_assert_uint_eq(peer_list_count(&c), s.buffers);
  /* 5000 buffers: more than a request may be. */
  struct peer x;
  open_peer(&x, WORKER);
  static struct abuf big[5000];
  for (int i = 0; i < 5000; i++) big[i] = a[0];
  adopt_send(&x, big, 5000, NULL, 0, -1);
  r = peer_get(&x, NULL);
  if (r) {
    ck_assert_int_eq(peer_reply_code(r, NULL, 0), CODE(PROTOCOL_ERROR));
    wire_env_free(r);
  }
  ck_assert(peer_ended(&x));
  peer_close(&x);
  ck_assert_uint_eq(peer_list_count(&c), s.buffers);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Adopted memory beyond the device's size: the adopt that does not fit
 * is refused whole (its first two buffers fit). */
START_TEST(adopt_beyond_the_device) {
  struct peer c, w;
  up_pair(&c, &w, "--host-device-size", "8M", NULL);
  struct abuf a[3] = {ONE("kv", 0, 4 * MiB), ONE("kv", 0, 4 * MiB), ONE("kv", 0, 4 * MiB)};
  struct snap s;
  take_snap(&c, &s);
  char why[512];
  wire_code code = adopt(&w, a, 3, (int[]){chunk(0, 4 * MiB), chunk(0, 4 * MiB), chunk(0, 4 * MiB)},
                         3, why, NULL);
  ck_assert_msg(code == CODE(OUT_OF_MEMORY) || code == CODE(INVALID_ARGUMENT), "%s: %s",
                wire_code_name(code), why);
  assert_unchanged(&c, &s, 0, "12 MiB adopted on an 8 MiB device");
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* ======================= EventAck ======================= */

/* Messages until a status reply on p (sent now): how many were errors. */
static int errors_until_status(struct peer *p) {
  Gpumem__Wire__StatusRequest sr = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  wire_env env = peer_env(p->next_id++, BODY(STATUS));
  env.status = &sr;
  peer_put(p, &env, NULL, 0);
  int errors = 0;
  for (;;) {
    wire_env *r = peer_get(p, NULL);
    ck_assert_ptr_nonnull(r);
    bool done = r->body_case == BODY(STATUS_REPLY);
    if (r->body_case == BODY(ERROR)) errors++;
    wire_env_free(r);
    if (done) return errors;
  }
}

/* A failed id named many times counts once; strangers mixed in (6000 of
 * them, near the request limit) get at most one error, not one each (a
 * 64 KiB request must not buy thousands of replies); the rest of the ack
 * stands. */
START_TEST(ack_failed_ids_repeated_and_by_thousands) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  struct pbuf b[2];
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &b[0]);
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &b[1]);
  peer_op(&c, false, "kv", 0, 0);
  wire_env *e = peer_event(&w, NULL), *r;
  peer_unmap(&b[0]);
  uint64_t same[4] = {b[1].id, b[1].id, b[1].id, b[1].id};
  peer_ack(&w, e->id, same, 4, "busy");
  wire_env_free(e);
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(NOT_RELEASED));
  ck_assert_uint_eq(r->error->buffers_held, 1);
  ck_assert_uint_eq(r->error->bytes_held, 4 * MiB);
  wire_env_free(r);
  ck_assert_uint_eq(daemon_bytes(), 4 * MiB);
  /* Again, b[1] among 6000 strangers. */
  peer_op(&c, false, "kv", 0, 0);
  e = peer_event(&w, NULL);
  ck_assert_uint_eq(e->unmap->n_buffer_ids, 1);
  enum { N = 6000 };
  static uint64_t many[N];
  for (int i = 0; i < N; i++) many[i] = (1ull << 62) + (uint64_t)i;
  many[N / 2] = b[1].id;
  peer_ack(&w, e->id, many, N, "busy");
  wire_env_free(e);
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(NOT_RELEASED));
  ck_assert_uint_eq(r->error->buffers_held, 1);
  ck_assert_uint_eq(r->error->bytes_held, 4 * MiB);
  wire_env_free(r);
  int errors = errors_until_status(&w);
  ck_assert_msg(errors <= 1, "%d errors for one ack", errors);
  ck_assert_uint_eq(daemon_bytes(), 4 * MiB);
  peer_unmap(&b[1]);
  peer_op_served(&c, false, "kv", &w, b, 2);
  ck_assert_uint_eq(daemon_bytes(), 0);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Codes outside the enum, or negative, mean failure (the worker kept its
 * memory, as it says): the pause fails NOT_RELEASED and the daemon goes on. */
/* An ack whose message would start a forged log line (or is not UTF-8)
 * is refused at the edge with a clear error; the pause waits for a proper
 * ack, which settles it, and no forged line reaches the log. */
START_TEST(ack_messages_cannot_forge_log_lines) {
  struct peer c, w;
  struct pbuf b;
  struct frame f;
  wire_env *e = unmap_pending(&c, &w, &b, &f);
  const char *lies[] = {"busy\ngpumemd[info]: pause kv: 0 buffers, forged", "\xff\xfe not text",
                        "bell\x07", "c1 \xc2\x85 next line"};
  for (size_t i = 0; i < sizeof lies / sizeof lies[0]; i++) {
    peer_ack_code(&w, e->id, CODE(NOT_RELEASED), NULL, 0, lies[i]);
    wire_env *r = peer_get(&w, NULL);
    ck_assert_ptr_nonnull(r);
    char why[256];
    ck_assert_int_eq(peer_reply_code(r, why, sizeof why), CODE(INVALID_ARGUMENT));
    ck_assert_msg(strstr(why, "control characters"), "%s", why);
    wire_env_free(r);
  }
  peer_unmap(&b);
  peer_ack(&w, e->id, NULL, 0, NULL);
  wire_env_free(e);
  frame_release(&f);
  ck_assert_int_eq(peer_op_code(&c), CODE(OK));
  char log[65536] = "";
  FILE *lf = fopen(d.log, "r");
  ck_assert_ptr_nonnull(lf);
  log[fread(log, 1, sizeof log - 1, lf)] = '\0';
  fclose(lf);
  ck_assert_msg(!strstr(log, "forged"), "%s", log);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A worker's words in a failed ack, cut to fit the controller's error,
 * are never cut in the middle of a character: the error stays UTF-8 that
 * a strict proto3 parser takes. */
START_TEST(errors_cut_at_a_character) {
  struct peer c, w;
  struct pbuf b;
  struct frame f;
  wire_env *e = unmap_pending(&c, &w, &b, &f);
  char words[WIRE_MAX_MESSAGE + 1] = "";
  for (size_t i = 0; i + 2 <= WIRE_MAX_MESSAGE; i += 2) strcat(words, "\xc3\xa9"); /* é */
  peer_unmap(&b);
  peer_ack_code(&w, e->id, CODE(BACKEND_ERROR), NULL, 0, words);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(NOT_RELEASED)); /* "could not unmap: ..." */
  ck_assert_msg(wire_text_valid(r->error->message, 4096), "%s", r->error->message);
  ck_assert_ptr_nonnull(strstr(r->error->message, "\xc3\xa9\xc3\xa9"));
  wire_env_free(r);
  wire_env_free(e);
  frame_release(&f);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A process may give itself any bytes as a name (prctl); when it holds
 * device memory outside gpumemd, the status names it in valid text. */
START_TEST(process_names_are_made_valid_text) {
  daemon_up();
  struct peer c;
  open_peer(&c, CONTROLLER);
  int ready[2];
  ck_assert_int_eq(pipe(ready), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    prctl(PR_SET_NAME, "ev\x1b[2Jl\xff\n", 0, 0, 0);
    int fd = chunk(0, 2 * MiB);
    (void)fd;
    if (write(ready[1], "r", 1) != 1) _exit(1);
    pause();
    _exit(0);
  }
  char ch;
  ck_assert_int_eq(read(ready[0], &ch, 1), 1);
  close(ready[0]);
  close(ready[1]);
  bool seen = false;
  for (double end = now_ms() + 5000; !seen && now_ms() < end; pause_ms(20)) {
    wire_env *st = peer_status(&c);
    for (size_t i = 0; i < st->status_reply->n_processes; i++) {
      const Gpumem__Wire__ProcessMemory *p = st->status_reply->processes[i];
      if ((pid_t)p->pid != pid) continue;
      seen = true;
      ck_assert_msg(wire_text_valid(p->name, 64), "name %s", p->name);
      ck_assert_str_eq(p->name, "ev?[2Jl?");
    }
    wire_env_free(st);
  }
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  ck_assert(seen);
  peer_close(&c);
}
END_TEST

START_TEST(ack_with_absurd_codes) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &b);
  const int codes[] = {9999, -1, INT32_MAX, CODE(SHUTTING_DOWN)};
  for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++) {
    peer_op(&c, false, "kv", 0, 0);
    wire_env *e = peer_event(&w, NULL), *r;
    peer_ack_code(&w, e->id, codes[i], NULL, 0, "strange");
    wire_env_free(e);
    wire_code got = peer_op_wait(&c, &r);
    ck_assert_msg(got == CODE(NOT_RELEASED), "code %d: pause answered %s", codes[i],
                  wire_code_name(got));
    ck_assert_uint_eq(r->error->bytes_held, 4 * MiB);
    wire_env_free(r);
  }
  wire_env *st = peer_status(&c);
  const Gpumem__Wire__TagInfo *t = peer_tag(st, "kv");
  ck_assert_int_eq(t->state, GPUMEM__WIRE__BUFFER_STATE__ACTIVE);
  ck_assert_uint_eq(t->paused_buffers, 0);
  wire_env_free(st);
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Two acks for one event in one write: the first one counts, the second
 * is NOT_FOUND, whichever way round. */
START_TEST(ack_twice_back_to_back) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  for (int order = 0; order < 2; order++) {
    struct pbuf b;
    peer_alloc(&w, order ? "b" : "a", 0, 4 * MiB, 0, &b);
    peer_op(&c, false, order ? "b" : "a", 0, 0);
    wire_env *e = peer_event(&w, NULL), *r;
    if (order == 0) peer_unmap(&b); /* true OK first, then a false failure */
    int first = order == 0 ? CODE(OK) : CODE(BACKEND_ERROR);
    int second = order == 0 ? CODE(BACKEND_ERROR) : CODE(OK);
    peer_push_ack(&w, e->id, first, NULL, 0, NULL);
    peer_push_ack(&w, e->id, second, NULL, 0, NULL);
    ck_assert_int_eq(peer_flush(&w), 0); /* both in one write */
    wire_env_free(e);
    wire_code got = peer_op_wait(&c, &r);
    wire_env_free(r);
    ck_assert_int_eq(got, order == 0 ? CODE(OK) : CODE(NOT_RELEASED));
    ck_assert_int_eq(peer_stray_error(&w), CODE(NOT_FOUND));
    ck_assert_uint_eq(daemon_bytes(), order == 0 ? 0 : 4 * MiB);
    peer_unmap(&b);
  }
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Another session's ack naming the owner's buffer as failed, and an ack of
 * event 0: NOT_FOUND to the sender, nothing else; the owner's ack counts. */
START_TEST(ack_for_another_sessions_event) {
  struct peer c, w1, w2;
  up_pair(&c, &w1, NULL);
  open_peer(&w2, WORKER);
  struct pbuf b;
  peer_alloc(&w1, "kv", 0, 4 * MiB, 0, &b);
  peer_op(&c, false, "kv", 0, 0);
  wire_env *e = peer_event(&w1, NULL);
  peer_ack(&w2, e->id, &b.id, 1, "not yours");
  ck_assert_int_eq(peer_stray_error(&w2), CODE(NOT_FOUND));
  peer_ack(&w2, 0, &b.id, 1, "event 0");
  ck_assert_int_eq(peer_stray_error(&w2), CODE(NOT_FOUND));
  ck_assert_int_eq(errors_until_status(&c), 0); /* the pause still waits */
  peer_unmap(&b);
  peer_ack(&w1, e->id, NULL, 0, NULL);
  wire_env_free(e);
  ck_assert_int_eq(peer_op_code(&c), CODE(OK));
  ck_assert_uint_eq(daemon_bytes(), 0);
  peer_close(&w1);
  peer_close(&w2);
  peer_close(&c);
}
END_TEST

/* ======================= pause and resume ======================= */

/* Unknown tags are NOT_FOUND, alone, with devices, or next to a tag that
 * exists (a typo in a list must not look like success), and change
 * nothing; a tag named twice, or a device named twice, counts once. */
START_TEST(pause_and_resume_of_unknown_tags) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &b);
  struct snap s;
  take_snap(&c, &s);
  const char *nosuch[] = {"kv_cahce"};
  for (int resume = 0; resume < 2; resume++) {
    peer_op_tags(&c, resume, nosuch, 1, 0, 0);
    ck_assert_int_eq(peer_op_code(&c), CODE(NOT_FOUND));
    peer_op_tags(&c, resume, nosuch, 1, 1u << 1, 0);
    ck_assert_int_eq(peer_op_code(&c), CODE(NOT_FOUND));
  }
  peer_op_tags(&c, false, nosuch, 1, 0, 1);
  ck_assert_int_eq(peer_op_code(&c), CODE(NOT_FOUND));
  assert_unchanged(&c, &s, 0, "pause and resume of an unknown tag");
  ck_assert_msg(!peer_waiting(&w), "the worker was sent an event");
  /* A known tag and a typo: NOT_FOUND, and kv is not paused either. */
  const char *mixed[] = {"kv", "kv_cahce"};
  peer_op_tags(&c, false, mixed, 2, 0, 0);
  struct pollfd both[2] = {{c.fd, POLLIN, 0}, {w.fd, POLLIN, 0}};
  ck_assert_int_ge(poll(both, 2, 5000), 1);
  if (both[1].revents) {
    /* The daemon went ahead: answer so that the pause ends, then fail. */
    peer_serve(&w, &b, 1, 1);
    wire_code got = peer_op_code(&c);
    ck_abort_msg("a pause of kv and an unknown tag answered %s and paused kv",
                 wire_code_name(got));
  }
  ck_assert_int_eq(peer_op_code(&c), CODE(NOT_FOUND));
  assert_unchanged(&c, &s, 0, "pause of a known and an unknown tag");
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A device named twice counts once; so does a tag: a pause or resume
 * naming {"kv","kv","kv"} of a worker with one 4 MiB buffer sends one
 * event and answers OK with 1 buffer and 4 MiB. */
START_TEST(pause_names_twice_count_once) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &b);
  const char *kv[] = {"kv", "kv", "kv"};
  Gpumem__Wire__PauseRequest pr = GPUMEM__WIRE__PAUSE_REQUEST__INIT;
  uint32_t devs[] = {0, 0, 0, 1};
  pr.tags = (char **)kv;
  pr.n_tags = 1;
  pr.devices = devs;
  pr.n_devices = 4;
  wire_env env = peer_env(c.next_id++, BODY(PAUSE));
  env.pause = &pr;
  peer_put(&c, &env, NULL, 0);
  peer_serve(&w, &b, 1, 1);
  peer_op_ok(&c, 1, 4 * MiB);
  ck_assert_uint_eq(daemon_bytes(), 0);
  for (int resume = 1; resume >= 0; resume--) {
    peer_op_tags(&c, resume, kv, 3, 0, 0); /* of {kv,kv,kv} */
    peer_serve(&w, &b, 1, 1);
    peer_op_ok(&c, 1, 4 * MiB);
  }
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* max_residual: a pause that fails for residual memory still released
 * what it released (the tag is PAUSED, the memory gone), and says so;
 * UINT64_MAX allows anything. */
START_TEST(pause_with_max_residual) {
  struct peer c, w;
  up_pair(&c, &w, NULL);
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &b);
  const char *kv[] = {"kv"};
  peer_op_tags(&c, false, kv, 1, 0, UINT64_MAX);
  peer_serve(&w, &b, 1, 1);
  ck_assert_int_eq(peer_op_code(&c), CODE(OK));
  peer_op_tags(&c, true, kv, 1, 0, 0);
  peer_serve(&w, &b, 1, 1);
  ck_assert_int_eq(peer_op_code(&c), CODE(OK));
  /* 6 MiB of "device 0" held outside the daemon by this process. */
  int out = memfd_named(dev_memfd_name(0), 6 * MiB, true, 0);
  peer_op_tags(&c, false, kv, 1, 0, 1);
  peer_serve(&w, &b, 1, 1);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(RESIDUAL_EXCEEDED));
  ck_assert_uint_ge(r->error->n_checks, 1);
  ck_assert_uint_eq(r->error->checks[0]->residual, 6 * MiB);
  ck_assert_uint_eq(r->error->checks[0]->released, 4 * MiB);
  wire_env_free(r);
  ck_assert_uint_eq(daemon_bytes(), 0);
  wire_env *st = peer_status(&c);
  ck_assert_int_eq(peer_tag(st, "kv")->state, GPUMEM__WIRE__BUFFER_STATE__PAUSED);
  wire_env_free(st);
  close(out);
  peer_op_tags(&c, true, kv, 1, 0, 0);
  peer_serve(&w, &b, 1, 1);
  ck_assert_int_eq(peer_op_code(&c), CODE(OK));
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* ======================= SIGTERM ======================= */

/* Wait (bounded) for the daemon to exit; its exit status, -2 if it did not. */
static int daemon_exit_within(int ms) {
  double end = now_ms() + ms;
  int status;
  while (now_ms() < end) {
    pid_t p = waitpid(d.pid, &status, WNOHANG);
    if (p == d.pid) {
      d.pid = 0;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    pause_ms(5);
  }
  return -2;
}

/* SIGTERM during a pause a worker has not answered: the controller's
 * request is answered SHUTTING_DOWN (its own id), the worker is told, and
 * the daemon exits 0 at once, not after the ack timeout; the worker keeps
 * its memory. */
START_TEST(sigterm_answers_the_operation_in_flight) {
  struct peer c, w;
  up_pair(&c, &w, "--ack-timeout", "60s", NULL);
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &b);
  peer_op(&c, false, "kv", 0, 0);
  uint64_t op = c.next_id - 1;
  wire_env *e = peer_event(&w, NULL);
  wire_env_free(e);
  kill(d.pid, SIGTERM);
  bool answered = false;
  for (wire_env *r; (r = peer_get(&c, NULL));) {
    if (r->body_case == BODY(ERROR) && r->id == op) {
      ck_assert_int_eq(r->error->code, CODE(SHUTTING_DOWN));
      answered = true;
    }
    wire_env_free(r);
  }
  ck_assert_msg(answered, "the pause in flight was not answered");
  ck_assert_int_eq(peer_stray_error(&w), CODE(SHUTTING_DOWN));
  ck_assert(peer_ended(&w));
  ck_assert_int_eq(daemon_exit_within(3000), 0);
  ck_assert_uint_eq(memfd_bytes((pid_t[]){getpid()}, 1), 4 * MiB);
  ck_assert_int_eq(access(d.socket, F_OK), -1);
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
  ck_assert_int_eq(daemon_stop(&d), -1); /* only removes the directory */
}
END_TEST

/* SIGTERM with a peer that never reads (megabytes of replies queued for
 * it), one that sent half a frame, and one that sent an adopt with fds and
 * waits: the daemon still exits 0 promptly. */
START_TEST(sigterm_with_stuck_peers) {
  struct peer glut, half, w;
  up_pair(&glut, &half, NULL);
  open_peer(&w, WORKER);
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &b);
  /* 20000 list requests, never read. */
  Gpumem__Wire__ListRequest lr = GPUMEM__WIRE__LIST_REQUEST__INIT;
  wire_env env = peer_env(0, BODY(LIST));
  env.list = &lr;
  int sndbuf = 1 << 20;
  setsockopt(glut.fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
  fcntl(glut.fd, F_SETFL, fcntl(glut.fd, F_GETFL) | O_NONBLOCK);
  for (int i = 0; i < 20000; i++) {
    env.id = glut.next_id++;
    peer_push(&glut, &env, NULL, 0);
  }
  peer_flush_within(&glut, 3000);
  uint8_t partial[] = {100, 0, 0, 0, 0x08};
  ck_assert_int_eq(write(half.fd, partial, sizeof partial), (ssize_t)sizeof partial);
  /* The daemon has answered something of the glut: it is busy with it. */
  ck_assert_int_eq(errors_until_status(&w), 0);
  kill(d.pid, SIGTERM);
  ck_assert_int_eq(daemon_exit_within(3000), 0);
  peer_unmap(&b);
  peer_close(&glut);
  peer_close(&half);
  peer_close(&w);
  ck_assert_int_eq(daemon_stop(&d), -1);
}
END_TEST




int main(void) {
  return HARNESS_RUN(
      "hostile", 20, setup, teardown, adopted_memory_is_owned_paused_and_resumed,
      restart_then_adopt_by_hand, adopt_of_another_uids_memory, adopt_before_hello, adopt_as_controller,
      adopt_with_wrong_fd_counts, adopt_fds_of_the_wrong_kind,
      adopt_memfds_of_the_wrong_device_or_size, adopt_sizes_that_cannot_be,
      adopt_paused_larger_than_the_device, adopt_flags_an_alloc_refuses,
      adopt_backup_beyond_the_limit, adopt_sealed_memfd, adopt_uncommitted_memfd,
      adopt_the_same_memfd_twice, adopt_memory_the_daemon_holds,
      adopt_that_fails_half_way_leaves_nothing, adopt_more_buffers_than_allowed,
      adopt_beyond_the_device, ack_failed_ids_repeated_and_by_thousands,
      ack_with_absurd_codes, ack_messages_cannot_forge_log_lines, errors_cut_at_a_character,
                     process_names_are_made_valid_text, ack_twice_back_to_back, ack_for_another_sessions_event,
      pause_and_resume_of_unknown_tags, pause_names_twice_count_once, pause_with_max_residual,
      sigterm_answers_the_operation_in_flight, sigterm_with_stuck_peers);
}
