/* A bounded load test: one daemon on the host backend, a few hundred
 * well-behaved sessions that allocate and free buffers of a few tags and
 * answer every Unmap and Remap, a controller that pauses and resumes those
 * tags all the while, and hostile peers (garbage, fds parked in frames that
 * never end, connections that never say Hello, sessions that never read).
 * Afterwards the daemon must be as it was before: its accounting, its fds,
 * its memfds and (within a stated tolerance) its memory.
 *
 * Forked processes drive the load, each many sessions from one poll loop:
 * CHILDREN workers, one controller (with an "anchor" worker session that
 * keeps every tag alive, so that no pause can be NOT_FOUND), one hostile.
 * They report through a shared mapping; none of them uses Check (a failure
 * is written there and the process exits 1). Timings are printed, never
 * judged. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/wire.h"
#include "harness.h"

#define KiB 1024ull
#define MiB (1024ull * KiB)
#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x
#define BODY(x) GPUMEM__WIRE__ENVELOPE__BODY_##x
#define WORKER GPUMEM__WIRE__ROLE__ROLE_WORKER
#define CONTROLLER GPUMEM__WIRE__ROLE__ROLE_CONTROLLER
#define F_ALLOW_PAUSED GPUMEM__WIRE__BUFFER_FLAG__FLAG_ALLOW_PAUSED


enum {
  CHILDREN = 3,            /* worker processes */
  SLOTS = 50,              /* sessions each keeps open at once */
  SESSIONS_PER_CHILD = 100, /* sessions each runs in all */
  SESSIONS = CHILDREN * SESSIONS_PER_CHILD,
  NCHILDREN = CHILDREN + 2, /* the workers, the controller, the hostile one */
  OPS_PER_SESSION = 12,    /* allocs and frees before a session may end */
  MAX_HELD = 3,            /* buffers a session holds at most */
  MAX_CHUNKS = 4,          /* chunk fds per buffer (one: chunks are 1G) */
  NTAGS = 3,
  NDEV = 2,
  MIN_CYCLES = 10,         /* pause+resume pairs before the last sessions end */
  MIN_HOSTILE_ROUNDS = 8,  /* hostile rounds before the last sessions end */
  PARKED = 4, SILENT = 8, DEAF = 3, /* hostile connections kept at once */
  PARK_FDS = 8,            /* fds parked in each unfinished frame */
  DEAF_REQUESTS = 1500,    /* requests a deaf session sends and never reads */
  MAX_LATENCIES = 1 << 16,
  RUN_LIMIT_MS = 120000,   /* a child gives up (and fails) after this */
  SETTLE_MS = 5000,         /* the daemon's time to be back at its baseline */
};
#define GRANULE (16 * KiB)
#define FRAME_TIMEOUT "500ms"

static const char *const tag_names[NTAGS] = {"kv", "weights", "graph"};

static struct daemon d;

/* What the processes of the load report, in a mapping they share. */
struct shared {
  atomic_int failed;      /* set once, with why */
  char why[1024];
  atomic_int cycles;        /* pause+resume pairs the controller finished */
  atomic_int hostile_rounds;
  atomic_int sessions_done; /* well-behaved sessions ended */
  atomic_long allocs, frees, tag_paused, allow_paused, free_retries;
  atomic_long unmaps, remaps, pauses, resumes;
  atomic_long garbage, parked, parked_ended, silent, deaf;
  atomic_int nlat;
  float lat_us[MAX_LATENCIES]; /* alloc round trips */
};

static struct shared *sh;
static char who[32] = "checker"; /* this process, for failure messages */

/* ===================== failing inside a child ===================== */

/* Record why this child fails (the first failure wins) and exit 1. */
__attribute__((format(printf, 1, 2), noreturn)) static void die(const char *fmt, ...) {
  int expected = 0;
  if (atomic_compare_exchange_strong(&sh->failed, &expected, 1)) {
    int n = snprintf(sh->why, sizeof sh->why, "%s: ", who);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(sh->why + n, sizeof sh->why - (size_t)n, fmt, ap);
    va_end(ap);
  }
  _exit(1);
}

/* Exit at once if another process failed, or this one ran past deadline. */
static void check_abort(double deadline, const char *what) {
  if (atomic_load(&sh->failed)) _exit(1);
  if (now_ms() > deadline) die("%s: past its deadline", what);
}

/* ===================== a connection driven without blocking ===================== */

/* The sessions are the harness's peers (struct peer) in their batched
 * mode; these calls die where the harness's would return an error. */

/* Connect to the daemon (no Hello yet). */
static void conn_connect(struct peer *c) {
  int fd = raw_connect(&d);
  if (fd < 0) die("connect: %s", strerror(errno));
  peer_attach(c, fd, WIRE_MAX_REPLY);
}

/* Send what the socket takes; false if the daemon went away. */
static bool conn_flush(struct peer *c) {
  int rc = peer_flush(c);
  return rc == 0 || rc == -EAGAIN;
}

/* Send everything queued, waiting (up to 5 s) for room. */
static void conn_flush_all(struct peer *c) {
  int rc = peer_flush_within(c, 5000);
  if (rc != 0) die("sending to gpumemd: %s", strerror(-rc));
}

/* Die of a peer's read error (a negative errno); 0 is none. */
static void die_of_read_error(int err) {
  if (err == -EBADMSG) die("gpumemd sent something that is not a message");
  if (err < 0) die("reading from gpumemd: %s", strerror(-err));
}

/* Read what is there; false at end of stream (or a reset). */
static bool conn_fill(struct peer *c) {
  int rc = peer_fill(c);
  die_of_read_error(rc);
  return rc > 0;
}

/* A message read (or NULL), which must come with the fds it declares. */
static wire_env *fds_as_declared(wire_env *env, const struct frame *f) {
  if (env && env->fd_count != f->nfds)
    die("a message declares %u fds and came with %zu", env->fd_count, f->nfds);
  return env;
}

/* The next whole message read (NULL if none yet); its fds into f. */
static wire_env *conn_next(struct peer *c, struct frame *f) {
  int err;
  wire_env *env = peer_next(c, f, &err);
  die_of_read_error(err);
  return fds_as_declared(env, f);
}

/* Wait (up to ms) for the next message; NULL at end of stream. */
static wire_env *conn_wait(struct peer *c, struct frame *f, int ms) {
  wire_env *env;
  int rc = peer_await(c, f, ms, &env);
  if (rc == -ETIMEDOUT) die("nothing from gpumemd in %d ms", ms);
  die_of_read_error(rc);
  return rc ? fds_as_declared(env, f) : NULL;
}

/* Connect and say Hello, waiting for the answer. */
static void conn_open(struct peer *c, int role, const char *name) {
  conn_connect(c);
  peer_push_hello(c, role, name, WIRE_VERSION_MAJOR, WIRE_VERSION_MINOR);
  conn_flush_all(c);
  struct frame f;
  wire_env *r = conn_wait(c, &f, 5000);
  if (!r || r->body_case != BODY(HELLO_REPLY)) die("%s: no HelloReply", name);
  wire_env_free(r);
  frame_release(&f);
}

/* The text of an error reply, for messages. */
static const char *error_text(const wire_env *r) {
  static char text[600];
  if (r->body_case != BODY(ERROR)) return "not an error";
  snprintf(text, sizeof text, "%s: %s", wire_code_name(r->error->code), r->error->message);
  return text;
}

/* ===================== buffers a worker session holds ===================== */

/* A buffer as a worker holds it: its chunk fds while "mapped". */
struct held {
  uint64_t id;
  int fds[MAX_CHUNKS];
  size_t nfds;
  bool evented; /* an Unmap or Remap named it: the daemon may still have it in transition */
};

/* The held buffer with this id, or NULL. */
static struct held *held_find(struct held *h, size_t n, uint64_t id) {
  for (size_t i = 0; i < n; i++)
    if (h[i].id == id) return &h[i];
  return NULL;
}

/* Close a buffer's chunk fds ("unmap" it). */
static void held_unmap(struct held *b) {
  for (size_t i = 0; i < b->nfds; i++) close(b->fds[i]);
  b->nfds = 0;
}

/* Take fds [at, at+n) of a frame into a buffer ("map" it). */
static void held_map(struct held *b, struct frame *f, size_t at, size_t n) {
  if (b->nfds || n == 0 || n > MAX_CHUNKS || at + n > f->nfds)
    die("buffer %llu: %zu chunk fds to map (%zu held, %zu in the frame)",
        (unsigned long long)b->id, n, b->nfds, f->nfds);
  for (size_t i = 0; i < n; i++) {
    b->fds[i] = f->fds[at + i];
    f->fds[at + i] = -1;
  }
  b->nfds = n;
}

/* Answer an Unmap or Remap for held buffers, as a well-behaved worker:
 * unmap closes, remap takes the fds, then ack OK. False if e is neither. */
static bool serve_event(struct peer *c, const wire_env *e, struct frame *f, struct held *h,
                        size_t n) {
  if (e->body_case == BODY(UNMAP)) {
    for (size_t i = 0; i < e->unmap->n_buffer_ids; i++) {
      struct held *b = held_find(h, n, e->unmap->buffer_ids[i]);
      if (!b) die("Unmap of buffer %llu, which this session does not hold",
                  (unsigned long long)e->unmap->buffer_ids[i]);
      if (!b->nfds) die("Unmap of buffer %llu, which is not mapped", (unsigned long long)b->id);
      held_unmap(b);
      b->evented = true;
    }
    atomic_fetch_add(&sh->unmaps, 1);
  } else if (e->body_case == BODY(REMAP)) {
    size_t at = 0;
    for (size_t i = 0; i < e->remap->n_entries; i++) {
      const Gpumem__Wire__RemapEntry *en = e->remap->entries[i];
      struct held *b = held_find(h, n, en->buffer_id);
      if (!b) die("Remap of buffer %llu, which this session does not hold",
                  (unsigned long long)en->buffer_id);
      held_map(b, f, at, en->n_chunk_sizes);
      b->evented = true;
      at += en->n_chunk_sizes;
    }
    if (at != f->nfds) die("a Remap names %zu chunks and came with %zu fds", at, f->nfds);
    atomic_fetch_add(&sh->remaps, 1);
  } else {
    return false;
  }
  if (e->id == 0) die("an event with id 0");
  peer_push_ack(c, e->id, CODE(OK), NULL, 0, NULL);
  return true;
}

/* ===================== well-behaved worker sessions ===================== */

enum request { REQ_NONE, REQ_HELLO, REQ_ALLOC, REQ_FREE };

/* One well-behaved session: at most one request in flight, events
 * answered whenever they come. */
struct session {
  struct peer c;
  bool open;
  unsigned seed;
  enum request pending;
  uint64_t pending_id, pending_buf;
  uint32_t pending_flags;
  double sent_ms;
  struct held held[MAX_HELD];
  size_t nheld;
  int ops;
  bool drop_on_close; /* ends holding its buffers: the disconnect frees them */
};

/* Open session number k of worker child and queue its Hello. */
static void session_start(struct session *s, int child, int k) {
  memset(s, 0, sizeof *s);
  char name[64];
  snprintf(name, sizeof name, "load-%d-%d", child, k);
  conn_connect(&s->c);
  s->open = true;
  s->seed = (unsigned)(child * 7919 + k * 104729 + 1);
  s->drop_on_close = k % 5 == 4;
  s->pending = REQ_HELLO;
  s->pending_id = peer_push_hello(&s->c, WORKER, name, WIRE_VERSION_MAJOR, WIRE_VERSION_MINOR);
}

/* Record one alloc round trip. */
static void note_latency(double ms) {
  int i = atomic_fetch_add(&sh->nlat, 1);
  if (i < MAX_LATENCIES) sh->lat_us[i] = (float)(ms * 1000);
}

/* The alloc's reply: a buffer (mapped unless it starts PAUSED), or
 * TAG_PAUSED for an alloc that did not allow a paused tag. */
static void on_alloc_reply(struct session *s, const wire_env *r, struct frame *f) {
  note_latency(now_ms() - s->sent_ms);
  if (r->body_case == BODY(ERROR)) {
    if (r->error->code != CODE(TAG_PAUSED) || (s->pending_flags & F_ALLOW_PAUSED))
      die("alloc (flags %u): %s", s->pending_flags, error_text(r));
    atomic_fetch_add(&sh->tag_paused, 1);
    return;
  }
  if (r->body_case != BODY(ALLOC_REPLY)) die("alloc answered with message %d", r->body_case);
  const Gpumem__Wire__AllocReply *a = r->alloc_reply;
  struct held *b = &s->held[s->nheld++];
  memset(b, 0, sizeof *b);
  b->id = a->buffer_id;
  if (a->state == GPUMEM__WIRE__BUFFER_STATE__PAUSED) {
    if (!(s->pending_flags & F_ALLOW_PAUSED) || f->nfds)
      die("buffer %llu starts PAUSED (flags %u, %zu fds)", (unsigned long long)b->id,
          s->pending_flags, f->nfds);
    atomic_fetch_add(&sh->allow_paused, 1);
  } else if (a->state == GPUMEM__WIRE__BUFFER_STATE__ACTIVE) {
    if (f->nfds != a->n_chunk_sizes) die("alloc: %zu chunks, %zu fds", a->n_chunk_sizes, f->nfds);
    held_map(b, f, 0, f->nfds);
  } else {
    die("buffer %llu starts %s", (unsigned long long)b->id, wire_state_name(a->state));
  }
  atomic_fetch_add(&sh->allocs, 1);
}

/* The free's reply: OK, or WRONG_STATE for a buffer an event named (the
 * daemon's pause or resume of it may not be over; it is freed later). */
static void on_free_reply(struct session *s, const wire_env *r) {
  struct held *b = held_find(s->held, s->nheld, s->pending_buf);
  if (r->body_case == BODY(ERROR)) {
    if (r->error->code != CODE(WRONG_STATE) || !b->evented)
      die("free of buffer %llu: %s", (unsigned long long)b->id, error_text(r));
    atomic_fetch_add(&sh->free_retries, 1);
    return;
  }
  if (r->body_case != BODY(FREE_REPLY)) die("free answered with message %d", r->body_case);
  held_unmap(b);
  *b = s->held[--s->nheld];
  atomic_fetch_add(&sh->frees, 1);
}

/* Handle one message for a session: an event, or its request's reply. */
static void session_on_message(struct session *s, const wire_env *r, struct frame *f) {
  if (serve_event(&s->c, r, f, s->held, s->nheld)) return;
  if (r->id == 0) die("gpumemd ended a well-behaved session: %s", error_text(r));
  if (s->pending == REQ_NONE || r->id != s->pending_id)
    die("a reply to request %llu, expected %llu", (unsigned long long)r->id,
        (unsigned long long)s->pending_id);
  if (s->pending == REQ_HELLO && r->body_case != BODY(HELLO_REPLY))
    die("hello: %s", error_text(r));
  if (s->pending == REQ_ALLOC) on_alloc_reply(s, r, f);
  if (s->pending == REQ_FREE) on_free_reply(s, r);
  if (s->pending != REQ_HELLO) s->ops++;
  s->pending = REQ_NONE;
}

/* Read and handle what the daemon sent a session. */
static void session_read(struct session *s) {
  if (!conn_fill(&s->c)) die("gpumemd closed a well-behaved session");
  struct frame f;
  wire_env *r;
  while ((r = conn_next(&s->c, &f))) {
    session_on_message(s, r, &f);
    wire_env_free(r);
    frame_release(&f);
  }
}

/* Queue an alloc of a random tag, device and size (one in four allows a
 * paused tag). */
static void session_alloc(struct session *s) {
  unsigned r = (unsigned)rand_r(&s->seed);
  s->pending_flags = r % 4 == 0 ? F_ALLOW_PAUSED : 0;
  s->pending = REQ_ALLOC;
  s->sent_ms = now_ms();
  s->pending_id = peer_push_alloc(&s->c, tag_names[(r >> 2) % NTAGS], (r >> 4) % NDEV,
                                  GRANULE * (1 + (r >> 5) % 4), s->pending_flags);
}

/* Queue a free of held buffer i. */
static void session_free(struct session *s, size_t i) {
  s->pending = REQ_FREE;
  s->pending_buf = s->held[i].id;
  s->pending_id = peer_push_free(&s->c, s->pending_buf);
}

/* Whether the last sessions may end: the controller and the hostile
 * process have done their minimum meanwhile. */
static bool load_may_end(void) {
  return atomic_load(&sh->cycles) >= MIN_CYCLES &&
         atomic_load(&sh->hostile_rounds) >= MIN_HOSTILE_ROUNDS;
}

/* Queue a session's next request; true when it is done (to be closed).
 * The last sessions, once their operations are done, wait holding their
 * buffers (answering events) until the load may end. */
static bool session_step(struct session *s, bool last_generation) {
  if (s->pending != REQ_NONE) return false;
  bool done = s->ops >= OPS_PER_SESSION;
  if (done && last_generation && !load_may_end()) return false;
  if (done && (s->drop_on_close || s->nheld == 0)) return true;
  if (!done && (s->nheld == 0 || (s->nheld < MAX_HELD && rand_r(&s->seed) % 2)))
    session_alloc(s);
  else
    session_free(s, (size_t)rand_r(&s->seed) % s->nheld);
  return false;
}

/* Close a session, with whatever it still holds. */
static void session_end(struct session *s) {
  for (size_t i = 0; i < s->nheld; i++) held_unmap(&s->held[i]);
  peer_close(&s->c);
  s->open = false;
  atomic_fetch_add(&sh->sessions_done, 1);
}

/* What to poll for on each slot's session (nothing for a closed one). */
static void sessions_pollfds(const struct session *s, struct pollfd *pf) {
  for (int i = 0; i < SLOTS; i++) {
    pf[i] = (struct pollfd){-1, 0, 0};
    if (!s[i].open) continue;
    pf[i].fd = s[i].c.fd;
    pf[i].events = (short)(POLLIN | (frame_writer_queued(s[i].c.w) ? POLLOUT : 0));
  }
}

/* A worker process: SESSIONS_PER_CHILD sessions, SLOTS at a time. */
static void worker_main(int child) {
  snprintf(who, sizeof who, "worker %d", child);
  static struct session s[SLOTS];
  int started = 0, ended = 0;
  for (int i = 0; i < SLOTS; i++) session_start(&s[i], child, started++);
  double deadline = now_ms() + RUN_LIMIT_MS;
  while (ended < SESSIONS_PER_CHILD) {
    check_abort(deadline, "a worker process");
    struct pollfd pf[SLOTS];
    sessions_pollfds(s, pf);
    poll(pf, SLOTS, 100); /* 100 ms at most: the abort flag is looked at again */
    for (int i = 0; i < SLOTS; i++)
      if (s[i].open && (pf[i].revents & (POLLIN | POLLHUP | POLLERR))) session_read(&s[i]);
    for (int i = 0; i < SLOTS; i++) {
      if (!s[i].open || !session_step(&s[i], started == SESSIONS_PER_CHILD)) continue;
      session_end(&s[i]);
      ended++;
      if (started < SESSIONS_PER_CHILD) session_start(&s[i], child, started++);
    }
    for (int i = 0; i < SLOTS; i++)
      if (s[i].open && !conn_flush(&s[i].c)) die("gpumemd went away from a session");
  }
  _exit(0);
}

/* ===================== the controller and its anchor ===================== */

/* The tags of cycle k: one tag in turn, and all of them every fourth. */
static size_t cycle_tags(int k, const char **tags) {
  if (k % 4 == 3) {
    for (size_t i = 0; i < NTAGS; i++) tags[i] = tag_names[i];
    return NTAGS;
  }
  tags[0] = tag_names[k % NTAGS];
  return 1;
}

/* Read and answer what the anchor was sent (events only). */
static void anchor_read(struct peer *a, struct held *h, size_t n) {
  if (!conn_fill(a)) die("gpumemd closed the anchor session");
  struct frame f;
  wire_env *e;
  while ((e = conn_next(a, &f))) {
    if (!serve_event(a, e, &f, h, n)) die("anchor: unexpected message %d", e->body_case);
    wire_env_free(e);
    frame_release(&f);
  }
  if (!conn_flush(a)) die("gpumemd went away from the anchor");
}

/* Pause or resume tags and wait for the answer, serving the anchor's
 * events meanwhile; anything but an OpReply fails. */
static void run_op(struct peer *ctl, struct peer *a, struct held *h, size_t n, bool resume,
                   const char **tags, size_t ntags) {
  peer_push_op_tags(ctl, resume, tags, ntags, 0, 0); /* every device */
  conn_flush_all(ctl);
  double end = now_ms() + 30000;
  for (;;) {
    struct frame f;
    wire_env *r = conn_next(ctl, &f);
    if (r) {
      if (r->body_case != BODY(OP_REPLY))
        die("%s of %s%s: %s", resume ? "resume" : "pause", tags[0], ntags > 1 ? ",..." : "",
            error_text(r));
      wire_env_free(r);
      frame_release(&f);
      atomic_fetch_add(resume ? &sh->resumes : &sh->pauses, 1);
      return;
    }
    check_abort(end, "a pause or resume");
    struct pollfd pf[2] = {{ctl->fd, POLLIN, 0}, {a->fd, POLLIN, 0}};
    poll(pf, 2, 100);
    if (pf[1].revents) anchor_read(a, h, n);
    if (pf[0].revents && !conn_fill(ctl)) die("gpumemd closed the controller session");
  }
}

/* Allocate the anchor's buffer of a tag on a device, waiting for it. */
static void anchor_alloc(struct peer *a, struct held *b, const char *tag, unsigned dev) {
  peer_push_alloc(a, tag, dev, GRANULE, 0);
  conn_flush_all(a);
  struct frame f;
  wire_env *r = conn_wait(a, &f, 5000);
  if (!r || r->body_case != BODY(ALLOC_REPLY)) die("anchor alloc: %s", r ? error_text(r) : "EOF");
  memset(b, 0, sizeof *b);
  b->id = r->alloc_reply->buffer_id;
  held_map(b, &f, 0, f.nfds);
  wire_env_free(r);
  frame_release(&f);
}

/* Free an anchor buffer (no operation runs any more), waiting for it. */
static void anchor_free(struct peer *a, struct held *b) {
  peer_push_free(a, b->id);
  conn_flush_all(a);
  struct frame f;
  wire_env *r = conn_wait(a, &f, 5000);
  if (!r || r->body_case != BODY(FREE_REPLY)) die("anchor free: %s", r ? error_text(r) : "EOF");
  held_unmap(b);
  wire_env_free(r);
  frame_release(&f);
}

/* The controller process: pauses and resumes while the workers run (at
 * least MIN_CYCLES times), with an anchor session holding a buffer of
 * every tag on every device so that every tag always exists. */
static void controller_main(void) {
  snprintf(who, sizeof who, "controller");
  struct peer a, ctl;
  struct held h[NTAGS * NDEV];
  conn_open(&a, WORKER, "load-anchor");
  for (size_t i = 0; i < NTAGS * NDEV; i++) anchor_alloc(&a, &h[i], tag_names[i / NDEV], i % NDEV);
  conn_open(&ctl, CONTROLLER, "load-controller");
  const char *tags[NTAGS];
  for (int k = 0; atomic_load(&sh->sessions_done) < SESSIONS || k < MIN_CYCLES; k++) {
    size_t n = cycle_tags(k, tags);
    run_op(&ctl, &a, h, NTAGS * NDEV, false, tags, n);
    run_op(&ctl, &a, h, NTAGS * NDEV, true, tags, n);
    atomic_fetch_add(&sh->cycles, 1);
  }
  for (size_t i = 0; i < NTAGS * NDEV; i++) anchor_free(&a, &h[i]);
  peer_close(&ctl);
  peer_close(&a);
  _exit(0);
}

/* ===================== hostile peers ===================== */

/* Send bytes with fds (not closed) in one sendmsg, all of them. */
static void send_raw(int sock, const void *bytes, size_t len, const int *fds, size_t nfds) {
  if (frame_sendmsg(sock, bytes, len, fds, nfds, 0) != (ssize_t)len) die("sendmsg: %s", strerror(errno));
}

/* Wait (up to ms) until the daemon ends c: the error it says first (its
 * code; -1 if none came before the end). */
static int ended_with(struct peer *c, int ms) {
  int code = -1;
  double end = now_ms() + ms;
  for (;;) {
    struct frame f;
    wire_env *r;
    while ((r = conn_next(c, &f))) {
      if (code < 0 && r->body_case == BODY(ERROR)) code = r->error->code;
      wire_env_free(r);
      frame_release(&f);
    }
    struct pollfd pf = {c->fd, POLLIN, 0};
    int left = (int)(end - now_ms());
    if (left <= 0 || poll(&pf, 1, left) != 1) die("gpumemd did not end a hostile session");
    if (!conn_fill(c)) return code;
  }
}

/* A garbage frame of kind k: junk bytes, junk after Hello, a length over
 * the limit, a request before Hello. The daemon must answer
 * PROTOCOL_ERROR and end the session. */
static void hostile_garbage(int k) {
  struct peer c;
  if (k % 4 == 1) conn_open(&c, WORKER, "load-garbage");
  else conn_connect(&c);
  static const uint8_t junk[] = {5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff};
  static const uint8_t huge[] = {0xff, 0xff, 0xff, 0x7f, 1, 2, 3, 4};
  if (k % 4 == 2) {
    send_raw(c.fd, huge, sizeof huge, NULL, 0);
  } else if (k % 4 == 3) {
    Gpumem__Wire__StatusRequest sr = GPUMEM__WIRE__STATUS_REQUEST__INIT;
    wire_env env = peer_env(1, BODY(STATUS));
    env.status = &sr;
    peer_push(&c, &env, NULL, 0);
    conn_flush_all(&c);
  } else {
    send_raw(c.fd, junk, sizeof junk, NULL, 0);
  }
  int code = ended_with(&c, 5000);
  if (code != CODE(PROTOCOL_ERROR))
    die("garbage of kind %d: ended with code %d, not PROTOCOL_ERROR", k % 4, code);
  peer_close(&c);
  atomic_fetch_add(&sh->garbage, 1);
}

/* Open a session and park PARK_FDS fds in a frame that never ends. */
static void hostile_park(struct peer *c) {
  conn_open(c, WORKER, "load-parked");
  uint8_t bytes[8] = {0xe8, 0x03, 0, 0, 8, 1, 0, 0}; /* 1000 bytes announced, 4 sent */
  int fds[PARK_FDS], fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  for (size_t i = 0; i < PARK_FDS; i++) fds[i] = fd;
  send_raw(c->fd, bytes, sizeof bytes, fds, PARK_FDS);
  close(fd);
  atomic_fetch_add(&sh->parked, 1);
}

/* Wait for the daemon to end a parked session (its frame timed out) and
 * close it. */
static void hostile_unpark(struct peer *c) {
  int code = ended_with(c, 30000);
  if (code != CODE(PROTOCOL_ERROR)) die("a parked session ended with code %d", code);
  peer_close(c);
  atomic_fetch_add(&sh->parked_ended, 1);
}

/* Open a controller session that asks for DEAF_REQUESTS status replies
 * (list replies if list) in one write and never reads them. */
static void hostile_deaf(struct peer *c, bool list) {
  conn_open(c, CONTROLLER, "load-deaf");
  Gpumem__Wire__StatusRequest sr = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  Gpumem__Wire__ListRequest lr = GPUMEM__WIRE__LIST_REQUEST__INIT;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  if (list) {
    env.body_case = BODY(LIST);
    env.list = &lr;
  } else {
    env.body_case = BODY(STATUS);
    env.status = &sr;
  }
  static uint8_t all[DEAF_REQUESTS * 16];
  size_t at = 0;
  for (int i = 0; i < DEAF_REQUESTS; i++) {
    env.id = c->next_id++;
    size_t len;
    uint8_t *bytes = wire_pack(&env, &len);
    if (!bytes || len > 12) die("a request of %zu bytes", len);
    uint32_t n = (uint32_t)len; /* the frame's length, little-endian */
    for (int b = 0; b < 4; b++) all[at++] = (uint8_t)(n >> (8 * b));
    memcpy(all + at, bytes, len);
    at += len;
    free(bytes);
  }
  send_raw(c->fd, all, at, NULL, 0); /* one write of some 15 KiB: the socket takes it */
  atomic_fetch_add(&sh->deaf, 1);
}

/* The hostile process's connections kept open across rounds. */
struct hostile {
  struct peer parked[PARKED], deaf[DEAF];
  int silent[SILENT];
  int nparked, ndeaf, nsilent;
};

/* Remove entry 0 of an array of n. */
#define SHIFT(arr, n) memmove(&(arr)[0], &(arr)[1], (size_t)--(n) * sizeof (arr)[0])

/* One hostile round: garbage, a parked frame, a silent connection, a
 * deaf session; the oldest of each kind goes when its list is full. */
static void hostile_round(struct hostile *h, int k) {
  hostile_garbage(k);
  if (h->nparked == PARKED) {
    /* Every other one is closed by us mid-frame, the others time out. */
    if (k % 2) peer_close(&h->parked[0]);
    else hostile_unpark(&h->parked[0]);
    SHIFT(h->parked, h->nparked);
  }
  hostile_park(&h->parked[h->nparked++]);
  if (h->nsilent == SILENT) {
    close(h->silent[0]);
    SHIFT(h->silent, h->nsilent);
  }
  h->silent[h->nsilent] = raw_connect(&d);
  if (h->silent[h->nsilent++] < 0) die("connect: %s", strerror(errno));
  atomic_fetch_add(&sh->silent, 1);
  if (h->ndeaf == DEAF) {
    peer_close(&h->deaf[0]); /* cut by the daemon or not: check_fds tests the cut */
    SHIFT(h->deaf, h->ndeaf);
  }
  hostile_deaf(&h->deaf[h->ndeaf++], k % 4 != 0); /* a status reads all of /proc: one in four */
}

/* The hostile process: rounds until the workers are done, then closes
 * what it still holds. */
static void hostile_main(void) {
  snprintf(who, sizeof who, "hostile");
  static struct hostile h;
  double deadline = now_ms() + RUN_LIMIT_MS;
  for (int k = 0; atomic_load(&sh->sessions_done) < SESSIONS || k < MIN_HOSTILE_ROUNDS; k++) {
    check_abort(deadline, "the hostile process");
    hostile_round(&h, k);
    atomic_fetch_add(&sh->hostile_rounds, 1);
  }
  for (int i = 0; i < h.nparked; i++) peer_close(&h.parked[i]);
  for (int i = 0; i < h.ndeaf; i++) peer_close(&h.deaf[i]);
  for (int i = 0; i < h.nsilent; i++) close(h.silent[i]);
  _exit(0);
}

/* ===================== the checker (the test process) ===================== */

/* Fork a child that runs fn with only `alive` (the write end of a pipe
 * whose end of stream says every child is gone) kept of our fds. */
static pid_t fork_child(void (*fn)(int), int arg, int alive) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* a test that failed takes its load along */
    if (alive != 3 && dup2(alive, 3) < 0) _exit(2);
    close_range(4, ~0u, 0);
    fn(arg);
    _exit(0);
  }
  return pid;
}

/* Adapters to fork_child's signature. */
static void run_controller(int unused) { controller_main(); }
static void run_hostile(int unused) { hostile_main(); }

/* Fork the load: the workers, the controller, the hostile process (none
 * of them reaped yet: status -1). */
static void start_load(pid_t *pids, int *status, int alive) {
  for (int i = 0; i < NCHILDREN; i++) status[i] = -1;
  for (int i = 0; i < CHILDREN; i++) pids[i] = fork_child(worker_main, i, alive);
  pids[CHILDREN] = fork_child(run_controller, 0, alive);
  pids[CHILDREN + 1] = fork_child(run_hostile, 0, alive);
}

/* A figure from /proc/PID/status ("VmRSS", "RssShmem", "VmHWM"), in bytes. */
static uint64_t proc_status_bytes(const char *key) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)d.pid);
  FILE *f = fopen(path, "re");
  unsigned long long kb = 0;
  size_t klen = strlen(key);
  while (f && fgets(line, sizeof line, f))
    if (strncmp(line, key, klen) == 0 && line[klen] == ':')
      kb = strtoull(line + klen + 1, NULL, 10);
  if (f) fclose(f);
  return kb * 1024;
}

/* The daemon's fds that are the host backend's memfds. */
static int daemon_memfds(void) { return proc_fds_with(d.pid, "memfd:gpumem-host-"); }

/* The daemon's open fds. */
static int daemon_fds(void) {
  int maxfd;
  return proc_fds(d.pid, &maxfd);
}

/* The daemon's fd count once stable (three equal readings around status
 * round trips: daemon_start's probe connection may still be closing). */
static int fd_baseline(struct peer *c) {
  int last = -1, same = 0;
  double end = now_ms() + 3000;
  while (now_ms() < end && same < 3) {
    wire_env_free(peer_status(c));
    int n = daemon_fds();
    same = n == last ? same + 1 : 0;
    last = n;
  }
  return last;
}

/* What the daemon holds, from status, list and /proc. */
struct holdings {
  size_t sessions, tags, buffers;
  uint64_t checker_session; /* the one session left, or 0 */
  char others[256];         /* the others: "id pid name role" */
  uint64_t managed[NDEV], free[NDEV], total[NDEV];
  uint64_t fds_parked, queued_bytes;
  int fds, memfds;
  uint64_t memfd_bytes;
};

/* Read what the daemon holds now. */
static void holdings_read(struct peer *c, struct holdings *h) {
  memset(h, 0, sizeof *h);
  wire_env *st = peer_status(c);
  const Gpumem__Wire__StatusReply *s = st->status_reply;
  h->sessions = s->n_sessions;
  h->checker_session = s->n_sessions == 1 ? s->sessions[0]->id : 0;
  for (size_t i = 0; i < s->n_sessions; i++) {
    size_t at = strlen(h->others);
    snprintf(h->others + at, sizeof h->others - at, " [%llu pid %u '%s' role %d]",
             (unsigned long long)s->sessions[i]->id, s->sessions[i]->pid, s->sessions[i]->name,
             s->sessions[i]->role);
  }
  h->tags = s->n_tags;
  ck_assert_uint_eq(s->n_devices, NDEV);
  for (size_t i = 0; i < NDEV; i++) {
    h->managed[i] = s->devices[i]->managed;
    h->free[i] = s->devices[i]->free;
    h->total[i] = s->devices[i]->total;
  }
  h->fds_parked = s->fds_parked;
  h->queued_bytes = s->queued_bytes;
  wire_env_free(st);
  h->buffers = peer_list_count(c);
  h->fds = daemon_fds();
  h->memfds = daemon_memfds();
  h->memfd_bytes = memfd_bytes(&d.pid, 1);
}

/* Whether the daemon holds nothing but the checker's session and its
 * baseline fds. */
static bool holdings_at_baseline(const struct holdings *h, uint64_t checker, int base_fds) {
  bool ok = h->sessions == 1 && h->checker_session == checker && h->tags == 0 &&
            h->buffers == 0 && h->fds_parked == 0 && h->queued_bytes == 0 &&
            h->fds == base_fds && h->memfds == 0 && h->memfd_bytes == 0;
  for (size_t i = 0; i < NDEV; i++) ok = ok && h->managed[i] == 0 && h->free[i] == h->total[i];
  return ok;
}

/* Wait (up to SETTLE_MS, status round trips between readings) until the
 * daemon is back at its baseline; what it holds then. */
static void holdings_settle(struct peer *c, uint64_t checker, int base_fds, struct holdings *h) {
  double end = now_ms() + SETTLE_MS;
  do holdings_read(c, h);
  while (!holdings_at_baseline(h, checker, base_fds) && now_ms() < end);
}

/* Assert each figure of the daemon's holdings against its baseline. */
static void holdings_assert(const struct holdings *h, uint64_t checker, int base_fds) {
  ck_assert_msg(h->sessions == 1 && h->checker_session == checker,
                "%zu sessions left (the checker's is %llu):%s", h->sessions,
                (unsigned long long)checker, h->others);
  ck_assert_msg(h->tags == 0, "%zu tags left", h->tags);
  ck_assert_msg(h->buffers == 0, "%zu buffers left", h->buffers);
  for (size_t i = 0; i < NDEV; i++) {
    ck_assert_msg(h->managed[i] == 0, "device %zu: %llu bytes managed", i,
                  (unsigned long long)h->managed[i]);
    ck_assert_msg(h->free[i] == h->total[i], "device %zu: %llu of %llu free", i,
                  (unsigned long long)h->free[i], (unsigned long long)h->total[i]);
  }
  ck_assert_msg(h->fds_parked == 0, "%llu fds parked", (unsigned long long)h->fds_parked);
  ck_assert_msg(h->queued_bytes == 0, "%llu bytes queued", (unsigned long long)h->queued_bytes);
  ck_assert_msg(h->memfds == 0 && h->memfd_bytes == 0, "%d memfds (%llu bytes) left", h->memfds,
                (unsigned long long)h->memfd_bytes);
  ck_assert_msg(h->fds == base_fds, "gpumemd holds %d fds, %d after start", h->fds, base_fds);
}

/* The most the daemon showed while the load ran. */
struct peaks {
  size_t sessions;
  uint64_t fds_parked, queued_bytes;
};

/* Reap the children that have exited (all of them if wait); one that
 * failed without saying why (a crash) is recorded, and stops the others. */
static void reap_children(const pid_t *pids, int *status, bool wait) {
  for (int i = 0; i < NCHILDREN; i++) {
    if (status[i] != -1 || waitpid(pids[i], &status[i], wait ? 0 : WNOHANG) != pids[i]) continue;
    int expected = 0;
    if ((!WIFEXITED(status[i]) || WEXITSTATUS(status[i]) != 0) &&
        atomic_compare_exchange_strong(&sh->failed, &expected, 1))
      snprintf(sh->why, sizeof sh->why, "child %d ended with wait status %#x", i, status[i]);
  }
}

/* Wait (up to 3 minutes) until every child is gone (end of stream on
 * alive), sampling the daemon's status meanwhile. */
static void wait_children(struct peer *c, int alive, const pid_t *pids, int *status,
                          struct peaks *pk) {
  double end = now_ms() + 180000;
  for (;;) {
    struct pollfd pf = {alive, POLLIN, 0};
    if (poll(&pf, 1, 250) == 1) { /* a sample every 250 ms: a status reads all of /proc */
      char b;
      if (read(alive, &b, 1) == 0) break;
    }
    reap_children(pids, status, false);
    ck_assert_msg(now_ms() < end, "the load did not end in 3 minutes");
    wire_env *st = peer_status(c);
    const Gpumem__Wire__StatusReply *s = st->status_reply;
    if (s->n_sessions > pk->sessions) pk->sessions = s->n_sessions;
    if (s->fds_parked > pk->fds_parked) pk->fds_parked = s->fds_parked;
    if (s->queued_bytes > pk->queued_bytes) pk->queued_bytes = s->queued_bytes;
    wire_env_free(st);
  }
  reap_children(pids, status, true);
}

/* Order floats (qsort). */
static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* The p-th percentile of the alloc round trips, in ms. */
static double latency_ms(double p) {
  int n = atomic_load(&sh->nlat);
  if (n > MAX_LATENCIES) n = MAX_LATENCIES;
  if (n == 0) return 0;
  int i = (int)(p / 100 * (n - 1) + 0.5);
  return sh->lat_us[i] / 1000.0;
}

/* The daemon's memory, from /proc/PID/status. */
struct memory {
  uint64_t rss, shmem, peak; /* VmRSS, RssShmem, VmHWM */
};

/* The daemon's memory now. */
static struct memory memory_now(void) {
  return (struct memory){proc_status_bytes("VmRSS"), proc_status_bytes("RssShmem"),
                         proc_status_bytes("VmHWM")};
}

/* Print the one summary line: what was done, how fast, what the daemon
 * held before and after. */
static void print_summary(const struct peaks *pk, const struct memory *before,
                          const struct memory *after, int fds0, int fds1, double took_ms) {
  int n = atomic_load(&sh->nlat) < MAX_LATENCIES ? atomic_load(&sh->nlat) : MAX_LATENCIES;
  qsort(sh->lat_us, (size_t)n, sizeof sh->lat_us[0], cmp_float);
  fprintf(stderr,
          "load: %d sessions (%zu at most at once), %ld ops (%ld allocs, %ld frees, %ld "
          "TAG_PAUSED, %ld started paused, %ld free retries), %ld pauses + %ld resumes, %ld "
          "unmaps + %ld remaps acked; hostile: %ld garbage, %ld parked (%ld timed out), %ld "
          "silent, %ld deaf (%d cut), peak %llu fds parked and %llu KiB queued; alloc round "
          "trip p50 %.2f ms p99 %.2f ms; daemon fds %d -> %d, RSS %.1f -> %.1f MiB (peak %.1f, "
          "shmem %llu -> %llu KiB); %.1f s\n",
          atomic_load(&sh->sessions_done), pk->sessions,
          sh->allocs + sh->frees + sh->tag_paused + sh->free_retries, (long)sh->allocs,
          (long)sh->frees, (long)sh->tag_paused, (long)sh->allow_paused, (long)sh->free_retries,
          (long)sh->pauses, (long)sh->resumes, (long)sh->unmaps, (long)sh->remaps,
          (long)sh->garbage, (long)sh->parked, (long)sh->parked_ended, (long)sh->silent,
          (long)sh->deaf, daemon_log_count(&d, "left unread"), (unsigned long long)pk->fds_parked,
          (unsigned long long)(pk->queued_bytes >> 10), latency_ms(50), latency_ms(99), fds0,
          fds1, (double)before->rss / MiB, (double)after->rss / MiB, (double)after->peak / MiB,
          (unsigned long long)(before->shmem >> 10), (unsigned long long)(after->shmem >> 10),
          took_ms / 1000);
}

/* How much the daemon's RSS may grow over the load without a leak, in
 * bytes. glibc keeps freed heap (only the top of an arena past 128 KiB is
 * trimmed), so what the load's peak used (some 180 sessions at once, each
 * with its buffers, queues and replies, and status replies of as many
 * sessions) stays resident: about 4 MiB here. 16 MiB is four times that.
 * A leak of 4 KiB per request (some 4,000 here), or 50 KiB per session,
 * would pass it; smaller leaks are LeakSanitizer's to find: the ASan
 * build's daemon must exit 0 at the end (teardown). Under ASan freed
 * memory waits in a quarantine (256 MiB by default) and shadow memory
 * grows with it (some 130 MiB here), and TSan's shadow grows with the
 * memory the daemon touches: the bound there only catches a leak of a
 * size the sanitizer would not hold anyway. */
static uint64_t rss_tolerance(void) { return HARNESS_SANITIZED ? 320 * MiB : 16 * MiB; }

/* A few hundred sessions, a pausing controller and hostile peers at once;
 * afterwards the daemon is as it was. */
START_TEST(a_bounded_load_leaves_the_daemon_as_it_found_it) {
  double t0 = now_ms();
  daemon_start(&d, "--host-devices", "2", "--host-device-size", "128M", "--host-granularity",
               "16K", "--max-sessions-per-uid", "400", "--max-buffers-per-session", "8",
               "--max-buffers-per-uid", "2000", "--frame-timeout", FRAME_TIMEOUT,
               "--max-queued-per-session", "64K", "--max-queued-total", "64M", "--ack-timeout",
               "10s", NULL);
  struct peer checker;
  peer_connect(&checker, &d);
  wire_env *hello = peer_hello_as(&checker, CONTROLLER, "load-checker");
  uint64_t checker_id = hello->hello_reply->session_id;
  wire_env_free(hello);
  int base_fds = fd_baseline(&checker);
  struct memory before = memory_now();

  sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(sh, MAP_FAILED);
  int alive[2];
  ck_assert_int_eq(pipe2(alive, O_CLOEXEC), 0);
  pid_t pids[NCHILDREN];
  int status[NCHILDREN];
  start_load(pids, status, alive[1]);
  close(alive[1]);
  struct peaks pk = {0};
  wait_children(&checker, alive[0], pids, status, &pk);
  close(alive[0]);
  ck_assert_msg(!sh->failed, "%s", sh->why);

  struct holdings h;
  holdings_settle(&checker, checker_id, base_fds, &h);
  struct memory after = memory_now();
  print_summary(&pk, &before, &after, base_fds, h.fds, now_ms() - t0);

  ck_assert_int_eq(atomic_load(&sh->sessions_done), SESSIONS);
  ck_assert_int_ge(sh->pauses, MIN_CYCLES);
  ck_assert_int_eq(sh->pauses, sh->resumes);
  holdings_assert(&h, checker_id, base_fds);
  ck_assert_msg(after.shmem <= before.shmem, "gpumemd maps %llu KiB of shared memory, %llu "
                "before", (unsigned long long)(after.shmem >> 10),
                (unsigned long long)(before.shmem >> 10));
  ck_assert_msg(after.rss <= before.rss + rss_tolerance(),
                "gpumemd's RSS grew from %.1f to %.1f MiB", (double)before.rss / MiB,
                (double)after.rss / MiB);
  munmap(sh, sizeof *sh);
  peer_close(&checker);
}
END_TEST

/* Stop the daemon (it must exit 0: under ASan that includes LeakSanitizer)
 * and check for fd leaks here. */
static void teardown(void) { harness_daemon_teardown(&d); }

int main(void) {
  return HARNESS_RUN("load", 120, harness_fd_setup, teardown,
                     a_bounded_load_leaves_the_daemon_as_it_found_it);
}
