/* libgpumem against a scripted fake daemon (deterministic interleavings:
 * a reply and an event in one write, errors outside requests, a daemon
 * that goes away and comes back) and against the real one. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/wire.h"
#include "gpumem.h"
#include "harness.h"

#define MIB (1ull << 20)

/* The fake daemon: a listening socket and the connection it accepted,
 * the daemon's side of a harness peer. */
struct fake {
  struct listener l;
  struct peer p;
};

/* Listen on a fresh socket path. */
static void fake_listen(struct fake *f) {
  peer_listen(&f->l, "gpumem-client");
  f->p = (struct peer){.fd = -1};
}

/* Accept the next connection (the previous one is closed first). */
static void fake_accept(struct fake *f) { peer_accept(&f->p, &f->l); }

/* Close the connection (not the listening socket). */
static void fake_hangup(struct fake *f) { peer_close(&f->p); }

/* Close the connection and stop listening: no daemon is there any more. */
static void fake_vanish(struct fake *f) {
  peer_close(&f->p);
  peer_unlisten(&f->l);
}

/* Close everything and remove the directory. */
static void fake_close(struct fake *f) {
  peer_close(&f->p);
  peer_listen_close(&f->l);
}

/* The next message from the client (NULL at end of stream); its fds go
 * to fr, which the caller releases. */
static wire_env *fake_recv(struct fake *f, struct frame *fr) {
  wire_env *env;
  return peer_await(&f->p, fr, -1, &env) == 1 ? env : NULL;
}

/* True if the client ends the connection before it sends anything more. */
static bool fake_ended(struct fake *f) {
  struct frame fr;
  wire_env *more = fake_recv(f, &fr);
  if (!more) return true;
  wire_env_free(more);
  frame_release(&fr);
  return false;
}

/* Queue a message with fds (consumed), declaring them; sent by fake_flush. */
static void fake_push(struct fake *f, wire_env *env, const int *fds, size_t nfds) {
  env->fd_count = (uint32_t)nfds;
  peer_push(&f->p, env, fds, nfds);
}

/* Send everything queued. */
static void fake_flush(struct fake *f) { peer_flush_within(&f->p, -1); }

/* Send one message now. */
static void fake_send(struct fake *f, wire_env *env, const int *fds, size_t nfds) {
  fake_push(f, env, fds, nfds);
  fake_flush(f);
}

/* The protocol minor version the fake daemon says it speaks. */
static unsigned fake_minor = WIRE_VERSION_MINOR;

/* Read the Hello and answer it: host backend, n devices with these bus
 * ids (the daemon's device i is "host-<node>:d", this process's d), 2 MiB. */
static bool fake_hello_devices(struct fake *f, const char *const *bus, size_t n) {
  struct frame fr;
  wire_env *in = fake_recv(f, &fr);
  bool ok = in && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_HELLO && n <= 4;
  if (ok) {
    Gpumem__Wire__DeviceInfo d[4], *dp[4];
    for (size_t i = 0; i < n; i++) {
      gpumem__wire__device_info__init(&d[i]);
      d[i].index = (uint32_t)i;
      d[i].bus_id = (char *)bus[i];
      d[i].total = 64 * MIB;
      dp[i] = &d[i];
    }
    Gpumem__Wire__HelloReply r = GPUMEM__WIRE__HELLO_REPLY__INIT;
    r.version_major = WIRE_VERSION_MAJOR;
    r.version_minor = fake_minor;
    r.backend = "host";
    r.granularity = 2 * MIB;
    r.devices = dp;
    r.n_devices = n;
    wire_env out = peer_env(in->id, GPUMEM__WIRE__ENVELOPE__BODY_HELLO_REPLY);
    out.hello_reply = &r;
    fake_send(f, &out, NULL, 0);
  }
  wire_env_free(in);
  if (in) frame_release(&fr);
  return ok;
}

/* Read the Hello and answer it: host backend, one device, 2 MiB. */
static bool fake_hello(struct fake *f) {
  static const char *const one[] = {"host-local:0"};
  return fake_hello_devices(f, one, 1);
}

/* A chunk of "device memory" as the host backend makes it. */
static int chunk(uint64_t size) {
  int fd = memfd_create("gpumem-host-local:0", MFD_CLOEXEC);
  if (fd >= 0 && ftruncate(fd, (off_t)size) < 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Queue an AllocReply for request id: buffer bid of one 2 MiB chunk,
 * active (with its fd) or paused. */
static void push_alloc_reply(struct fake *f, uint64_t id, uint64_t bid, bool paused) {
  uint64_t size = 2 * MIB;
  Gpumem__Wire__AllocReply r = GPUMEM__WIRE__ALLOC_REPLY__INIT;
  r.buffer_id = bid;
  r.size = size;
  r.state = paused ? GPUMEM__WIRE__BUFFER_STATE__PAUSED : GPUMEM__WIRE__BUFFER_STATE__ACTIVE;
  r.chunk_sizes = &size;
  r.n_chunk_sizes = 1;
  wire_env out = peer_env(id, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY);
  out.alloc_reply = &r;
  int fd = paused ? -1 : chunk(size);
  fake_push(f, &out, &fd, paused ? 0 : 1);
}

/* Queue an UnmapEvent with event id eid. */
static void push_unmap(struct fake *f, uint64_t eid, uint64_t *ids, size_t n) {
  Gpumem__Wire__UnmapEvent u = GPUMEM__WIRE__UNMAP_EVENT__INIT;
  u.buffer_ids = ids;
  u.n_buffer_ids = n;
  wire_env out = peer_env(eid, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
  out.unmap = &u;
  fake_push(f, &out, NULL, 0);
}

/* Send a RemapEvent of n one-chunk (2 MiB) entries with the given fds. */
static void send_remap(struct fake *f, uint64_t eid, uint64_t *ids, size_t n, int *fds) {
  uint64_t size = 2 * MIB;
  Gpumem__Wire__RemapEntry e[4], *ep[4];
  for (size_t i = 0; i < n; i++) {
    gpumem__wire__remap_entry__init(&e[i]);
    e[i].buffer_id = ids[i];
    e[i].chunk_sizes = &size;
    e[i].n_chunk_sizes = 1;
    ep[i] = &e[i];
  }
  Gpumem__Wire__RemapEvent r = GPUMEM__WIRE__REMAP_EVENT__INIT;
  r.entries = ep;
  r.n_entries = n;
  wire_env out = peer_env(eid, GPUMEM__WIRE__ENVELOPE__BODY_REMAP);
  out.remap = &r;
  fake_send(f, &out, fds, n);
}

/* Send an Error outside any request. */
static void send_error0(struct fake *f, wire_code code, const char *text) {
  Gpumem__Wire__Error e = GPUMEM__WIRE__ERROR__INIT;
  e.code = code;
  e.message = (char *)text;
  wire_env out = peer_env(0, GPUMEM__WIRE__ENVELOPE__BODY_ERROR);
  out.error = &e;
  fake_send(f, &out, NULL, 0);
}

/* Send a FreeReply to request id that gave bytes back. */
static void send_free_reply(struct fake *f, uint64_t id, uint64_t bytes) {
  Gpumem__Wire__FreeReply r = GPUMEM__WIRE__FREE_REPLY__INIT;
  r.bytes = bytes;
  wire_env out = peer_env(id, GPUMEM__WIRE__ENVELOPE__BODY_FREE_REPLY);
  out.free_reply = &r;
  fake_send(f, &out, NULL, 0);
}

/* Answer a FreeRequest. */
static uint64_t answer_free(struct fake *f) {
  struct frame fr;
  wire_env *in = fake_recv(f, &fr);
  uint64_t id = 0;
  if (in && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_FREE) {
    id = in->free->buffer_id;
    send_free_reply(f, in->id, 2 * MIB);
  }
  wire_env_free(in);
  if (in) frame_release(&fr);
  return id;
}

/* An ack as the fake daemon received it. */
struct got_ack {
  uint64_t id;
  int code;
  size_t nfailed;
  uint64_t failed[8];
  char message[512];
};

/* Read the next message, which must be an ack. */
static bool recv_ack(struct fake *f, struct got_ack *a) {
  struct frame fr;
  wire_env *in = fake_recv(f, &fr);
  bool ok = in && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ACK;
  if (ok) {
    a->id = in->id;
    a->code = in->ack->code;
    a->nfailed = in->ack->n_failed_ids;
    for (size_t i = 0; i < a->nfailed && i < 8; i++) a->failed[i] = in->ack->failed_ids[i];
    snprintf(a->message, sizeof a->message, "%s", in->ack->message);
  }
  wire_env_free(in);
  if (in) frame_release(&fr);
  return ok;
}

/* Read the next message, which must be an AllocRequest; returns its id. */
static uint64_t recv_alloc(struct fake *f) {
  struct frame fr;
  wire_env *in = fake_recv(f, &fr);
  uint64_t id = in && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ALLOC ? in->id : 0;
  wire_env_free(in);
  if (in) frame_release(&fr);
  return id;
}

/* The script a fake daemon thread runs, and what it saw. */
struct script {
  struct fake f;
  void (*run)(struct script *s);
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int stage;      /* how far the script got */
  int want;       /* how far the test let it go */
  bool ok;        /* every step went as expected */
  struct got_ack acks[4];
  uint64_t ids[4];
  char note[256];
  char log[2048]; /* what a recording script was asked, a line a request */
};

/* Mark a step of the script done. */
static void reach(struct script *s, int stage) {
  pthread_mutex_lock(&s->mu);
  s->stage = stage;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

/* Wait (in the script) until the test lets it go on to stage. */
static void hold(struct script *s, int stage) {
  pthread_mutex_lock(&s->mu);
  while (s->want < stage) pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
}

/* Wait (in the test) until the script reached stage. */
static void await(struct script *s, int stage) {
  pthread_mutex_lock(&s->mu);
  while (s->stage < stage) pthread_cond_wait(&s->cv, &s->mu);
  pthread_mutex_unlock(&s->mu);
}

/* Let the script go on to stage. */
static void release(struct script *s, int stage) {
  pthread_mutex_lock(&s->mu);
  s->want = stage;
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

static void *script_main(void *arg) {
  struct script *s = arg;
  s->run(s);
  return NULL;
}

/* Start a fake daemon running run. */
static void script_start(struct script *s, void (*run)(struct script *)) {
  memset(s, 0, sizeof *s);
  fake_listen(&s->f);
  s->run = run;
  s->ok = true;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  pthread_create(&s->thread, NULL, script_main, s);
}

/* Wait for the script to end and close the fake daemon. */
static void script_end(struct script *s) {
  release(s, 1000);
  pthread_join(s->thread, NULL);
  fake_close(&s->f);
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
}

/* Start a fake daemon running run and connect to it in a role under a
 * name (the connection must succeed). */
static gpumem_client *script_connect(struct script *s, void (*run)(struct script *),
                                     const char *name, int role) {
  script_start(s, run);
  gpumem_client *c;
  ck_assert_int_eq(gpumem_connect(s->f.l.path, name, role, 0, &c), 0);
  return c;
}

/* Disconnect c, end the script, and fail unless every step of it went as
 * expected. */
static void script_finish(struct script *s, gpumem_client *c) {
  gpumem_disconnect(c);
  script_end(s);
  ck_assert_msg(s->ok, "%s", s->note);
}

/* Fail the script's check unless cond holds. */
#define EXPECT(s, cond)                                                         \
  do {                                                                          \
    if (!(cond) && (s)->ok) {                                                   \
      (s)->ok = false;                                                          \
      snprintf((s)->note, sizeof (s)->note, "line %d: %s", __LINE__, #cond);    \
    }                                                                           \
  } while (0)

/* Accept the client's connection and answer its Hello (fake_hello). */
static void script_greet(struct script *s) {
  fake_accept(&s->f);
  EXPECT(s, fake_hello(&s->f));
}

/* True if this process maps a memfd of the host backend at va. */
static bool maps_memfd_at(const void *va) {
  FILE *m = fopen("/proc/self/maps", "r");
  char line[512];
  bool found = false;
  unsigned long lo, hi;
  while (m && fgets(line, sizeof line, m))
    if (sscanf(line, "%lx-%lx", &lo, &hi) == 2 && (unsigned long)va >= lo &&
        (unsigned long)va < hi && strstr(line, "memfd:gpumem-host-"))
      found = true;
  if (m) fclose(m);
  return found;
}

/* Script: the AllocReply and an Unmap of that buffer in one write. */
static void run_race(struct script *s) {
  script_greet(s);
  uint64_t id = recv_alloc(&s->f), bid = 7;
  EXPECT(s, id != 0);
  push_alloc_reply(&s->f, id, bid, false);
  push_unmap(&s->f, 100, &bid, 1);
  fake_flush(&s->f);
  EXPECT(s, recv_ack(&s->f, &s->acks[0]));
  reach(s, 1);
  s->ids[0] = answer_free(&s->f);
  reach(s, 2);
  EXPECT(s, fake_ended(&s->f));
}

/* An Unmap that arrives right behind the AllocReply finds the buffer:
 * the ack says done and the memory really is unmapped. */
START_TEST(test_unmap_right_after_alloc_reply_unmaps) {
  struct script s;
  gpumem_client *c = script_connect(&s, run_race, "race", GPUMEM_ROLE_WORKER);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &b), 0);
  await(&s, 1);
  ck_assert_msg(s.ok, "%s", s.note);
  ck_assert_int_eq(s.acks[0].id, 100);
  ck_assert_msg(s.acks[0].code == 0, "ack %d: %s", s.acks[0].code, s.acks[0].message);
  ck_assert_int_eq(s.acks[0].nfailed, 0);
  ck_assert_int_eq(gpumem_buffer_mapped(b), 0);
  ck_assert_msg(!maps_memfd_at(gpumem_buffer_ptr(b)), "the chunk is still mapped");
  ck_assert_int_eq(gpumem_free(c, b), 0);
  await(&s, 2);
  ck_assert_int_eq(s.ids[0], 7);
  script_finish(&s, c);
}
END_TEST

/* Script: unknown ids, a remap that cannot map, a remap half unknown. */
static void run_truth(struct script *s) {
  script_greet(s);
  uint64_t unknown[2] = {42, 43};
  push_unmap(&s->f, 101, unknown, 2);
  fake_flush(&s->f);
  EXPECT(s, recv_ack(&s->f, &s->acks[0]));
  reach(s, 1); /* only now does the test allocate: the order is fixed */
  uint64_t id = recv_alloc(&s->f), bid = 7;
  push_alloc_reply(&s->f, id, bid, true);
  fake_flush(&s->f);
  reach(s, 2);
  hold(s, 3);
  /* A pipe is no memory to map. */
  int p[2];
  EXPECT(s, pipe2(p, O_CLOEXEC) == 0);
  close(p[1]);
  send_remap(&s->f, 102, &bid, 1, &p[0]);
  EXPECT(s, recv_ack(&s->f, &s->acks[1]));
  uint64_t two[2] = {7, 99};
  int fds[2] = {chunk(2 * MIB), chunk(2 * MIB)};
  send_remap(&s->f, 103, two, 2, fds);
  EXPECT(s, recv_ack(&s->f, &s->acks[2]));
  reach(s, 4);
  s->ids[0] = answer_free(&s->f);
  EXPECT(s, fake_ended(&s->f));
}

/* Every event is answered truthfully: unknown ids are NOT_FOUND and named,
 * a buffer that does not map is BACKEND_ERROR and named, the buffers that
 * did map are not named. */
START_TEST(test_event_acks_name_what_failed) {
  struct script s;
  gpumem_client *c = script_connect(&s, run_truth, "truth", GPUMEM_ROLE_WORKER);
  await(&s, 1);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, GPUMEM_ALLOW_PAUSED, &b), 0);
  ck_assert_int_eq(gpumem_buffer_mapped(b), 0);
  await(&s, 2);
  release(&s, 3);
  await(&s, 4);
  ck_assert_msg(s.ok, "%s", s.note);
  ck_assert_int_eq(s.acks[0].code, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND);
  ck_assert_int_eq(s.acks[0].nfailed, 2);
  ck_assert_int_eq(s.acks[0].failed[0], 42);
  ck_assert_int_eq(s.acks[0].failed[1], 43);
  ck_assert_ptr_nonnull(strstr(s.acks[0].message, "no buffer 42"));
  ck_assert_int_eq(s.acks[1].code, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR);
  ck_assert_int_eq(s.acks[1].nfailed, 1);
  ck_assert_int_eq(s.acks[1].failed[0], 7);
  ck_assert_msg(strstr(s.acks[1].message, "mapping buffer 7"), "%s", s.acks[1].message);
  ck_assert_int_eq(s.acks[2].code, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND);
  ck_assert_int_eq(s.acks[2].nfailed, 1);
  ck_assert_int_eq(s.acks[2].failed[0], 99);
  ck_assert_int_eq(gpumem_buffer_mapped(b), 1);
  ck_assert(maps_memfd_at(gpumem_buffer_ptr(b)));
  memset(gpumem_buffer_ptr(b), 0x5a, 2 * MIB);
  ck_assert_int_eq(gpumem_free(c, b), 0);
  script_finish(&s, c);
  ck_assert_int_eq(s.ids[0], 7);
}
END_TEST

/* Script: an error outside any request, then the connection ends and the
 * socket stays silent (no daemon comes back). */
static void run_error0(struct script *s) {
  script_greet(s);
  hold(s, 1);
  send_error0(&s->f, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED, "too many buffers for uid 0");
  fake_vanish(&s->f);
}

/* An error the daemon sends outside a request (id 0) reaches the next
 * failing call and gpumem_daemon_error; calls fail fast while the
 * library tries to reconnect. */
START_TEST(test_error_outside_request_is_reported) {
  struct script s;
  struct conn_events l;
  gpumem_client *c = script_connect(&s, run_error0, "err0", GPUMEM_ROLE_WORKER);
  conn_events_watch(&l, c);
  release(&s, 1);
  ck_assert(conn_events_wait(&l, 1, 0));
  ck_assert_int_eq(l.code, GPUMEM_E_DISCONNECTED);
  ck_assert_msg(strstr(l.words, "LIMIT_EXCEEDED: too many buffers for uid 0"), "%s", l.words);
  gpumem_buffer *b;
  double t0 = now_ms();
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &b), GPUMEM_E_DISCONNECTED);
  ck_assert_msg(now_ms() - t0 < 1000, "a call while reconnecting waited");
  const char *e = gpumem_last_error();
  ck_assert_msg(strstr(e, "reconnecting to gpumemd") && strstr(e, "LIMIT_EXCEEDED") &&
                    strstr(e, "too many buffers for uid 0"),
                "%s", e);
  char buf[256];
  ck_assert_int_eq(gpumem_daemon_error(c, buf, sizeof buf), GPUMEM_E_LIMIT);
  ck_assert_str_eq(buf, "LIMIT_EXCEEDED: too many buffers for uid 0");
  script_finish(&s, c);
}
END_TEST

/* Script: a 1.5 daemon, which must be sent nothing after the Hello. */
static void run_minor5(struct script *s) {
  fake_minor = 5;
  script_greet(s);
  fake_minor = WIRE_VERSION_MINOR;
  EXPECT(s, fake_ended(&s->f));
}

/* A pause asking for a context release from a daemon older than 1.6 (which
 * would pause and release nothing, silently) fails before it is sent. */
START_TEST(test_release_context_needs_a_1_6_daemon) {
  struct script s;
  gpumem_client *c = script_connect(&s, run_minor5, "old", GPUMEM_ROLE_CONTROLLER);
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.release_context = 1;
  ck_assert_int_eq(gpumem_pause(c, NULL, 0, NULL, 0, &o, NULL), GPUMEM_E_VERSION);
  ck_assert_msg(strstr(gpumem_last_error(), "needs gpumemd 1.6 or later (it speaks 1.5)"), "%s",
                gpumem_last_error());
  script_finish(&s, c);
}
END_TEST

/* Script: refuse the session before Hello is answered. */
static void run_refuse(struct script *s) {
  fake_accept(&s->f);
  send_error0(&s->f, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED, "too many sessions for this uid");
  struct frame fr;
  wire_env *in = fake_recv(&s->f, &fr);
  if (in) frame_release(&fr);
  wire_env_free(in);
  fake_hangup(&s->f);
}

/* A daemon that refuses the session makes gpumem_connect fail with its
 * code and words, not "connection gone". */
START_TEST(test_refused_session_says_why) {
  struct script s;
  script_start(&s, run_refuse);
  gpumem_client *c = NULL;
  ck_assert_int_eq(gpumem_connect(s.f.l.path, "refused", GPUMEM_ROLE_WORKER, 0, &c),
                   GPUMEM_E_LIMIT);
  ck_assert_msg(strstr(gpumem_last_error(), "LIMIT_EXCEEDED: too many sessions for this uid"),
                "%s", gpumem_last_error());
  script_end(&s);
}
END_TEST

/* connect(2) for this test program and the library it links (the
 * executable's definition comes first): when the gate is armed, the
 * connection that libgpumem opens is held back after connecting until the
 * fake daemon has refused it and closed its end, so that the Hello meets
 * a socket the daemon has closed. That is what happens when gpumemd
 * refuses a session faster than the client writes its Hello. */
static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool armed;  /* the next connect waits for closed */
  bool closed; /* the fake daemon refused and closed */
} gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, false};

__attribute__((visibility("default"))) int connect(int fd, const struct sockaddr *addr,
                                                   socklen_t len);
int connect(int fd, const struct sockaddr *addr, socklen_t len) {
  int rc = (int)syscall(SYS_connect, fd, addr, len);
  pthread_mutex_lock(&gate.mu);
  if (gate.armed && rc == 0) {
    gate.armed = false;
    while (!gate.closed) pthread_cond_wait(&gate.cv, &gate.mu);
  }
  pthread_mutex_unlock(&gate.mu);
  return rc;
}

/* Script: refuse the session at once (before reading anything) and close;
 * then open the gate. */
static void run_refuse_first(struct script *s) {
  fake_accept(&s->f);
  send_error0(&s->f, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED, "too many sessions for this uid");
  fake_hangup(&s->f);
  pthread_mutex_lock(&gate.mu);
  gate.closed = true;
  pthread_cond_broadcast(&gate.cv);
  pthread_mutex_unlock(&gate.mu);
}

/* A daemon that refused the session and closed before the Hello was
 * written: the Hello's send fails (EPIPE), and gpumem_connect still
 * reports the daemon's code and words, read from the socket, not
 * "send to gpumemd: Broken pipe" (gpumemctl printed that in 2 of 6 tries
 * against a daemon at its --max-sessions-per-uid). */
START_TEST(test_refusal_read_before_the_send_failure_is_reported) {
  pthread_mutex_lock(&gate.mu);
  gate.armed = true;
  gate.closed = false;
  pthread_mutex_unlock(&gate.mu);
  struct script s;
  script_start(&s, run_refuse_first);
  gpumem_client *c = NULL;
  int rc = gpumem_connect(s.f.l.path, "refused", GPUMEM_ROLE_CONTROLLER,
                          GPUMEM_CONNECT_NO_THREAD | GPUMEM_CONNECT_NO_RECONNECT |
                              GPUMEM_CONNECT_NODE_DEVICES, &c);
  ck_assert_msg(rc == GPUMEM_E_LIMIT, "%d (%s): %s", rc, gpumem_error_name(rc),
                gpumem_last_error());
  ck_assert_msg(strstr(gpumem_last_error(), "LIMIT_EXCEEDED: too many sessions for this uid"),
                "%s", gpumem_last_error());
  ck_assert_ptr_null(c);
  script_end(&s);
}
END_TEST

/* gpumemd at its --max-sessions-per-uid: every refused connection, as
 * gpumemctl makes it, says LIMIT and the daemon's words, however the
 * daemon's close and the client's Hello interleave. */
START_TEST(test_every_refused_session_says_why) {
  struct daemon d;
  daemon_start(&d, "--max-sessions-per-uid", "1", NULL);
  /* The harness's probe of the socket may still count as a session. */
  gpumem_client *held = NULL;
  int rc = GPUMEM_E_LIMIT;
  for (int i = 0; i < 100 && rc == GPUMEM_E_LIMIT; i++)
    rc = gpumem_connect(d.socket, "held", GPUMEM_ROLE_CONTROLLER, GPUMEM_CONNECT_NO_THREAD,
                        &held);
  ck_assert_msg(rc == 0, "%s", gpumem_last_error());
  const unsigned flags =
      GPUMEM_CONNECT_NO_THREAD | GPUMEM_CONNECT_NO_RECONNECT | GPUMEM_CONNECT_NODE_DEVICES;
  int wrong = 0;
  char first[400] = "";
  for (int i = 0; i < 40; i++) {
    gpumem_client *c = NULL;
    rc = gpumem_connect(d.socket, "over", GPUMEM_ROLE_CONTROLLER, flags, &c);
    if (rc == 0) gpumem_disconnect(c);
    if (rc != GPUMEM_E_LIMIT || !strstr(gpumem_last_error(), "too many sessions for this uid")) {
      if (wrong++ == 0)
        snprintf(first, sizeof first, "%s: %s", gpumem_error_name(rc), gpumem_last_error());
    }
  }
  ck_assert_msg(wrong == 0, "%d of 40 refusals did not say why; first: %s", wrong, first);
  gpumem_disconnect(held);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* Script: greet, then say why outside any request and close; then tell
 * the test. */
static void run_limit_then_close(struct script *s) {
  script_greet(s);
  send_error0(&s->f, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED, "session cut: 64 MiB unread");
  fake_vanish(&s->f);
  reach(s, 1);
}

/* A client without a thread whose daemon said why and closed while nobody
 * read: the next request's send fails, and the call reports the daemon's
 * words (read first), not the broken pipe. */
START_TEST(test_request_after_unread_refusal_reports_the_daemon) {
  struct script s;
  script_start(&s, run_limit_then_close);
  gpumem_client *c;
  ck_assert_int_eq(gpumem_connect(s.f.l.path, "cut", GPUMEM_ROLE_WORKER,
                                  GPUMEM_CONNECT_NO_THREAD | GPUMEM_CONNECT_NO_RECONNECT, &c),
                   0);
  await(&s, 1);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &b), GPUMEM_E_DISCONNECTED);
  ck_assert_msg(strstr(gpumem_last_error(), "LIMIT_EXCEEDED: session cut: 64 MiB unread"), "%s",
                gpumem_last_error());
  char buf[256];
  ck_assert_int_eq(gpumem_daemon_error(c, buf, sizeof buf), GPUMEM_E_LIMIT);
  ck_assert_str_eq(buf, "LIMIT_EXCEEDED: session cut: 64 MiB unread");
  /* The error sticks: every later call reports it. */
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &b), GPUMEM_E_DISCONNECTED);
  ck_assert_msg(strstr(gpumem_last_error(), "LIMIT_EXCEEDED: session cut: 64 MiB unread"), "%s",
                gpumem_last_error());
  ck_assert_int_eq(gpumem_dispatch(c, 0), GPUMEM_E_DISCONNECTED);
  ck_assert_msg(strstr(gpumem_last_error(), "LIMIT_EXCEEDED: session cut: 64 MiB unread"), "%s",
                gpumem_last_error());
  script_finish(&s, c);
}
END_TEST

/* Script: take an alloc, never answer, go away. */
static void run_vanish(struct script *s) {
  script_greet(s);
  EXPECT(s, recv_alloc(&s->f) != 0);
  fake_vanish(&s->f);
}

/* A request in flight when the connection ends fails with
 * GPUMEM_E_DISCONNECTED instead of waiting for ever. */
START_TEST(test_request_in_flight_fails_on_loss) {
  struct script s;
  gpumem_client *c = script_connect(&s, run_vanish, "vanish", GPUMEM_ROLE_WORKER);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &b), GPUMEM_E_DISCONNECTED);
  ck_assert_msg(strstr(gpumem_last_error(), "gpumemd closed the connection"), "%s",
                gpumem_last_error());
  script_finish(&s, c);
}
END_TEST

/* With GPUMEM_CONNECT_NO_RECONNECT the end is final and says so. */
START_TEST(test_no_reconnect_flag) {
  struct script s;
  script_start(&s, run_error0);
  gpumem_client *c;
  ck_assert_int_eq(
      gpumem_connect(s.f.l.path, "once", GPUMEM_ROLE_WORKER, GPUMEM_CONNECT_NO_THREAD |
                     GPUMEM_CONNECT_NO_RECONNECT, &c), 0);
  release(&s, 1);
  int rc;
  while ((rc = gpumem_dispatch(c, -1)) >= 0) {
  }
  ck_assert_int_eq(rc, GPUMEM_E_DISCONNECTED);
  ck_assert_int_eq(gpumem_fd(c), -1);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &b), GPUMEM_E_DISCONNECTED);
  ck_assert_msg(strstr(gpumem_last_error(), "gone") &&
                    strstr(gpumem_last_error(), "LIMIT_EXCEEDED"),
                "%s", gpumem_last_error());
  gpumem_disconnect(c);
  script_end(&s);
}
END_TEST

/* Script: two buffers (one mapped, one paused), SHUTTING_DOWN, then a new
 * daemon on the same socket that adopts them with new ids. */
static void run_restart(struct script *s) {
  script_greet(s);
  uint64_t id = recv_alloc(&s->f);
  push_alloc_reply(&s->f, id, 7, false);
  fake_flush(&s->f);
  id = recv_alloc(&s->f);
  push_alloc_reply(&s->f, id, 8, true);
  fake_flush(&s->f);
  reach(s, 1);
  hold(s, 2);
  send_error0(&s->f, GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN, "gpumemd is stopping");
  script_greet(s);
  struct frame fr;
  wire_env *in = fake_recv(&s->f, &fr);
  EXPECT(s, in && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ADOPT);
  if (in && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ADOPT) {
    const Gpumem__Wire__AdoptRequest *a = in->adopt;
    EXPECT(s, a->n_buffers == 2);
    EXPECT(s, in->fd_count == 1 && fr.nfds == 1);
    uint64_t ids[2];
    for (size_t i = 0; i < a->n_buffers && i < 2; i++) {
      const Gpumem__Wire__AdoptBuffer *b = a->buffers[i];
      EXPECT(s, strcmp(b->tag, "kv") == 0 && b->device == 0 && b->size == 2 * MIB &&
                    b->n_chunk_sizes == 1);
      ids[i] = b->paused ? 80 : 70;
      if (!b->paused && fr.nfds == 1) {
        /* The fd is the worker's memory: it holds what the worker wrote. */
        struct stat st;
        EXPECT(s, fstat(fr.fds[0], &st) == 0 && st.st_size == (off_t)(2 * MIB));
        unsigned char *p = mmap(NULL, 2 * MIB, PROT_READ, MAP_SHARED, fr.fds[0], 0);
        EXPECT(s, p != MAP_FAILED);
        if (p != MAP_FAILED) {
          EXPECT(s, p[0] == 0xab && p[2 * MIB - 1] == 0xab);
          munmap(p, 2 * MIB);
        }
      }
    }
    Gpumem__Wire__AdoptReply r = GPUMEM__WIRE__ADOPT_REPLY__INIT;
    r.buffer_ids = ids;
    r.n_buffer_ids = a->n_buffers;
    wire_env out = peer_env(in->id, GPUMEM__WIRE__ENVELOPE__BODY_ADOPT_REPLY);
    out.adopt_reply = &r;
    fake_push(&s->f, &out, NULL, 0);
    /* The new daemon pauses the mapped buffer by its new id at once. */
    uint64_t seventy = 70;
    push_unmap(&s->f, 200, &seventy, 1);
    fake_flush(&s->f);
  }
  wire_env_free(in);
  if (in) frame_release(&fr);
  EXPECT(s, recv_ack(&s->f, &s->acks[0]));
  reach(s, 3);
  s->ids[0] = answer_free(&s->f);
  s->ids[1] = answer_free(&s->f);
  reach(s, 4);
  in = fake_recv(&s->f, &fr);
  EXPECT(s, in == NULL);
}

/* When the daemon says SHUTTING_DOWN and another comes up on the socket,
 * the library reconnects and re-registers both buffers (the mapped one
 * with its memory), takes the new ids, and answers events by them. */
START_TEST(test_restart_re_registers_buffers) {
  struct script s;
  struct conn_events l;
  gpumem_client *c = script_connect(&s, run_restart, "restart", GPUMEM_ROLE_WORKER);
  conn_events_watch(&l, c);
  gpumem_buffer *a, *p;
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &a), 0);
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, GPUMEM_ALLOW_PAUSED, &p), 0);
  memset(gpumem_buffer_ptr(a), 0xab, 2 * MIB);
  await(&s, 1);
  release(&s, 2);
  ck_assert(conn_events_wait(&l, 1, 0));
  ck_assert_int_eq(l.code, GPUMEM_E_SHUTTING_DOWN);
  ck_assert_msg(strstr(l.words, "SHUTTING_DOWN: gpumemd is stopping; reconnecting"), "%s",
                l.words);
  ck_assert(conn_events_wait(&l, 1, 1));
  ck_assert_msg(l.code == 0, "%s", l.words);
  ck_assert_int_eq(l.count, 2);
  await(&s, 3);
  ck_assert_msg(s.ok, "%s", s.note);
  ck_assert_int_eq(gpumem_buffer_id(a), 70);
  ck_assert_int_eq(gpumem_buffer_id(p), 80);
  ck_assert(gpumem_buffer_registered(a));
  ck_assert_int_eq(s.acks[0].code, 0);
  ck_assert_int_eq(gpumem_buffer_mapped(a), 0);
  ck_assert_int_eq(gpumem_free(c, a), 0);
  ck_assert_int_eq(gpumem_free(c, p), 0);
  await(&s, 4);
  ck_assert_int_eq(s.ids[0], 70);
  ck_assert_int_eq(s.ids[1], 80);
  script_finish(&s, c);
}
END_TEST

/* Script: go away, then come back (no buffers to adopt). */
static void run_bounce(struct script *s) {
  script_greet(s);
  hold(s, 1);
  fake_hangup(&s->f);
  script_greet(s);
  reach(s, 2);
  struct frame fr;
  wire_env *in = fake_recv(&s->f, &fr);
  EXPECT(s, in == NULL);
}

/* Applications with their own loop reconnect through gpumem_dispatch,
 * and gpumem_fd gives the new connection. */
START_TEST(test_dispatch_reconnects_without_thread) {
  struct script s;
  script_start(&s, run_bounce);
  gpumem_client *c;
  ck_assert_int_eq(
      gpumem_connect(s.f.l.path, "loop", GPUMEM_ROLE_CONTROLLER, GPUMEM_CONNECT_NO_THREAD, &c), 0);
  release(&s, 1);
  ck_assert_int_eq(gpumem_dispatch(c, -1), GPUMEM_E_DISCONNECTED);
  ck_assert_int_eq(gpumem_fd(c), -1);
  int rc;
  while ((rc = gpumem_dispatch(c, 100)) != 0) ck_assert_int_eq(rc, GPUMEM_E_DISCONNECTED);
  ck_assert_int_ge(gpumem_fd(c), 0);
  await(&s, 2);
  script_finish(&s, c);
}
END_TEST

/* gpumemd is killed with SIGKILL while a worker holds two buffers; a new
 * one on the same socket adopts them, a pause frees them, a resume brings
 * them back, and the worker's checks pass throughout. */
START_TEST(test_daemon_killed_and_restarted_adopts_worker) {
  struct daemon d;
  daemon_start(&d, "--host-devices", "1", "--host-device-size", "256M", NULL);
  struct worker w;
  worker_start(&w, &d, "--tag", "kv", "--size", "8M", "--count", "2", "--backup", NULL);
  kill(d.pid, SIGKILL);
  waitpid(d.pid, NULL, 0);
  ck_assert(worker_wait_for(&w, "gpumemd went away", 1, 10000));
  d.pid = daemon_spawn(d.socket, d.log, (const char *const[]){"--host-devices", "1",
                                                             "--host-device-size", "256M",
                                                             NULL});
  ck_assert_msg(worker_wait_for(&w, "re-registered 2 buffers with gpumemd", 1, 20000), "%s",
                worker_output(&w));
  ck_assert_msg(worker_wait_for(&w, "contents kept across the restart", 2, 20000), "%s",
                worker_output(&w));
  gpumem_client *ctl;
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  struct gpumem_list *list;
  ck_assert_int_eq(gpumem_list(ctl, &list), 2);
  ck_assert_str_eq(list->buffers[0]->tag, "kv");
  gpumem_list_free(list);
  const char *tags[] = {"kv"};
  struct gpumem_op_report *r;
  ck_assert_msg(gpumem_pause(ctl, tags, 1, NULL, 0, NULL, &r) == 0, "%s", gpumem_last_error());
  ck_assert_int_eq(r->buffers, 2);
  ck_assert_int_eq(r->bytes, 16 * MIB);
  gpumem_op_report_free(r);
  ck_assert_int_eq(memfd_bytes(&w.pid, 1), 0);
  ck_assert_msg(gpumem_resume(ctl, tags, 1, NULL, 0, NULL, NULL) == 0, "%s",
                gpumem_last_error());
  ck_assert(worker_wait_for(&w, "verified buffer", 2, 10000));
  gpumem_disconnect(ctl);
  ck_assert_msg(worker_stop(&w, SIGTERM) == 0, "%s", worker_output(&w));
  ck_assert_int_eq(worker_count(&w, "FAILED"), 0);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* The post_remap hook's record: each buffer's generation as it saw it. */
struct seen_generations {
  uint64_t last[4];
  size_t calls;
};

/* A post_remap hook: note the generation of each buffer it is shown. */
static void note_generations(gpumem_client *c, gpumem_buffer *const *bufs, size_t n, void *user) {
  (void)c;
  struct seen_generations *g = user;
  for (size_t i = 0; i < n && i < 4; i++) g->last[i] = gpumem_buffer_generation(bufs[i]);
  g->calls++;
}

/* A tag's generation (protocol 1.10) grows by one with every resume that
 * gives its buffers new memory, once however many of them it maps; the
 * buffers get it with their remap (a post_remap hook sees it), a new
 * buffer with its allocation; another tag and a resume that maps nothing
 * leave it; a daemon killed and started again takes it from the buffers
 * re-registered, so it never goes back. */
START_TEST(a_tag_generation_counts_the_resumes_that_remap_it) {
  struct daemon d;
  daemon_start(&d, NULL);
  gpumem_client *w, *ctl;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  struct conn_events l;
  conn_events_watch(&l, w);
  struct seen_generations seen = {{0}, 0};
  gpumem_set_hooks(w, NULL, note_generations, &seen);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  gpumem_buffer *a, *b, *other;
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 2 * MIB, 0, &a), 0);
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 2 * MIB, 0, &b), 0);
  ck_assert_int_eq(gpumem_alloc(w, "other", 0, 2 * MIB, 0, &other), 0);
  ck_assert_uint_eq(gpumem_buffer_generation(a), 0);
  ck_assert_uint_eq(client_tag(ctl, "kv").generation, 0);
  for (uint64_t round = 1; round <= 2; round++) {
    ck_assert_int_eq(client_op(ctl, "kv", false), 0);
    ck_assert_int_eq(client_op(ctl, "kv", true), 0);
    ck_assert_uint_eq(client_tag(ctl, "kv").generation, round);
    ck_assert_uint_eq(gpumem_buffer_generation(a), round);
    ck_assert_uint_eq(gpumem_buffer_generation(b), round);
    ck_assert_uint_eq(seen.last[0], round);
  }
  ck_assert_uint_eq(client_tag(ctl, "other").generation, 0);
  ck_assert_uint_eq(gpumem_buffer_generation(other), 0);
  ck_assert_int_eq(client_op(ctl, "kv", true), 0); /* nothing paused: nothing remapped */
  ck_assert_uint_eq(client_tag(ctl, "kv").generation, 2);
  uint64_t g = 0;
  ck_assert_int_eq(gpumem_generation(w, (char *)gpumem_buffer_ptr(b) + MIB, &g), 0);
  ck_assert_uint_eq(g, 2);
  ck_assert_int_eq(gpumem_generation(w, &g, &g), GPUMEM_E_NOT_FOUND);
  gpumem_buffer *late;
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 2 * MIB, 0, &late), 0);
  ck_assert_uint_eq(gpumem_buffer_generation(late), 2);
  gpumem_disconnect(ctl);
  /* The daemon killed and started again: the tag's generation comes back
   * with its buffers, and goes on from there. */
  kill(d.pid, SIGKILL);
  waitpid(d.pid, NULL, 0);
  d.pid = daemon_spawn(d.socket, d.log, (const char *const[]){NULL});
  ck_assert(conn_events_wait(&l, 1, 1));
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  ck_assert_uint_eq(client_tag(ctl, "kv").generation, 2);
  ck_assert_int_eq(client_op(ctl, "kv", false), 0);
  ck_assert_int_eq(client_op(ctl, "kv", true), 0);
  ck_assert_uint_eq(client_tag(ctl, "kv").generation, 3);
  ck_assert_uint_eq(gpumem_buffer_generation(a), 3);
  ck_assert_uint_eq(gpumem_buffer_generation(late), 3);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* SIGTERM of the daemon: the worker is told, keeps its memory, and the
 * next daemon adopts it. */
START_TEST(test_daemon_sigterm_worker_told_and_adopted) {
  struct daemon d;
  daemon_start(&d, "--host-devices", "1", "--host-device-size", "256M", NULL);
  struct worker w;
  worker_start(&w, &d, "--tag", "kv", "--size", "4M", "--backup", NULL);
  kill(d.pid, SIGTERM);
  waitpid(d.pid, NULL, 0);
  ck_assert_msg(worker_wait_for(&w, "gpumemd went away: SHUTTING_DOWN", 1, 10000), "%s",
                worker_output(&w));
  ck_assert_int_eq(memfd_bytes(&w.pid, 1), 4 * MIB);
  d.pid = daemon_spawn(d.socket, d.log, (const char *const[]){"--host-devices", "1",
                                                             "--host-device-size", "256M",
                                                             NULL});
  ck_assert_msg(worker_wait_for(&w, "re-registered 1 buffers with gpumemd", 1, 20000), "%s",
                worker_output(&w));
  ck_assert_msg(worker_stop(&w, SIGTERM) == 0, "%s", worker_output(&w));
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* Append a printf'd line to the script's log. */
__attribute__((format(printf, 2, 3))) static void log_line(struct script *s, const char *fmt,
                                                           ...) {
  size_t l = strlen(s->log);
  va_list ap;
  va_start(ap, fmt);
  if (l + 1 < sizeof s->log) vsnprintf(s->log + l, sizeof s->log - l, fmt, ap);
  va_end(ap);
}

/* Append a comma-separated list of numbers to the script's log. */
static void log_u32s(struct script *s, const uint32_t *v, size_t n) {
  for (size_t i = 0; i < n; i++) log_line(s, "%s%u", i ? "," : "", v[i]);
}

/* Log a pause or resume as it came. */
static void log_op(struct script *s, const char *verb, char **tags, size_t ntags,
                   const uint32_t *devs, size_t ndevs, const uint32_t *pids, size_t npids,
                   const char *prefix, bool own, uint32_t timeout) {
  log_line(s, "%s own=%d pids=", verb, own);
  log_u32s(s, pids, npids);
  log_line(s, " prefix=%s devices=", prefix ? prefix : "");
  log_u32s(s, devs, ndevs);
  log_line(s, " tags=");
  for (size_t i = 0; i < ntags; i++) log_line(s, "%s%s", i ? "," : "", tags[i]);
  log_line(s, " timeout=%u\n", timeout);
}

/* Answer a pause or resume: one buffer of tag kv on the daemon's device 1. */
static void answer_op(struct fake *f, uint64_t id) {
  Gpumem__Wire__DeviceCheck k = GPUMEM__WIRE__DEVICE_CHECK__INIT, *kp = &k;
  k.device = 1;
  k.released = 2 * MIB;
  Gpumem__Wire__TagDeviceBytes t = GPUMEM__WIRE__TAG_DEVICE_BYTES__INIT, *tp = &t;
  t.tag = "kv";
  t.device = 1;
  t.buffers = 1;
  t.bytes = 2 * MIB;
  Gpumem__Wire__OpReply r = GPUMEM__WIRE__OP_REPLY__INIT;
  r.buffers = 1;
  r.bytes = 2 * MIB;
  r.checks = &kp;
  r.n_checks = 1;
  r.detail = &tp;
  r.n_detail = 1;
  wire_env out = peer_env(id, GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY);
  out.op_reply = &r;
  fake_send(f, &out, NULL, 0);
}

/* Answer a status: the daemon's two devices and a process on device 0. */
static void answer_status(struct fake *f, uint64_t id) {
  Gpumem__Wire__DeviceInfo d[2], *dp[2];
  static const char *const bus[] = {"host-local:1", "host-local:0"};
  for (int i = 0; i < 2; i++) {
    gpumem__wire__device_info__init(&d[i]);
    d[i].index = (uint32_t)i;
    d[i].bus_id = (char *)bus[i];
    d[i].total = 64 * MIB;
    d[i].free = 64 * MIB;
    dp[i] = &d[i];
  }
  Gpumem__Wire__ProcessMemory p = GPUMEM__WIRE__PROCESS_MEMORY__INIT, *pp = &p;
  p.pid = 77;
  p.device = 0;
  p.name = "outside";
  Gpumem__Wire__StatusReply r = GPUMEM__WIRE__STATUS_REPLY__INIT;
  r.backend = "host";
  r.granularity = 2 * MIB;
  r.devices = dp;
  r.n_devices = 2;
  r.processes = &pp;
  r.n_processes = 1;
  r.processes_known = true;
  wire_env out = peer_env(id, GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY);
  out.status_reply = &r;
  fake_send(f, &out, NULL, 0);
}

/* Answer a list: one buffer on the daemon's device 1. */
static void answer_list(struct fake *f, uint64_t id) {
  Gpumem__Wire__BufferInfo b = GPUMEM__WIRE__BUFFER_INFO__INIT, *bp = &b;
  b.id = 3;
  b.tag = "kv";
  b.device = 1;
  b.size = 2 * MIB;
  Gpumem__Wire__ListReply r = GPUMEM__WIRE__LIST_REPLY__INIT;
  r.buffers = &bp;
  r.n_buffers = 1;
  r.total = 1;
  wire_env out = peer_env(id, GPUMEM__WIRE__ENVELOPE__BODY_LIST_REPLY);
  out.list_reply = &r;
  fake_send(f, &out, NULL, 0);
}

/* Script: two devices that this process numbers the other way round (the
 * daemon's 0 is our 1); log and answer every pause, resume, status and
 * list until the client goes. */
static void run_recorder(struct script *s) {
  fake_accept(&s->f);
  static const char *const swapped[] = {"host-local:1", "host-local:0"};
  EXPECT(s, fake_hello_devices(&s->f, swapped, 2));
  struct frame fr;
  wire_env *in;
  while ((in = fake_recv(&s->f, &fr))) {
    if (in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_PAUSE) {
      const Gpumem__Wire__PauseRequest *p = in->pause;
      log_op(s, "pause", p->tags, p->n_tags, p->devices, p->n_devices, p->pids, p->n_pids,
             p->session_prefix, p->own, p->timeout_ms);
      answer_op(&s->f, in->id);
    } else if (in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_RESUME) {
      const Gpumem__Wire__ResumeRequest *p = in->resume;
      log_op(s, "resume", p->tags, p->n_tags, p->devices, p->n_devices, p->pids, p->n_pids,
             p->session_prefix, p->own, p->timeout_ms);
      answer_op(&s->f, in->id);
    } else if (in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_STATUS) {
      log_line(s, "status\n");
      answer_status(&s->f, in->id);
    } else if (in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_LIST) {
      log_line(s, "list\n");
      answer_list(&s->f, in->id);
    } else {
      log_line(s, "unexpected %d\n", (int)in->body_case);
    }
    wire_env_free(in);
    frame_release(&fr);
  }
}

/* Answer a list request with one page: n buffers (ids from first), the
 * walk's total and the next cursor. */
static void answer_page(struct fake *f, uint64_t id, size_t n, uint64_t first, uint64_t total,
                        uint64_t next) {
  Gpumem__Wire__BufferInfo b[2], *bp[2];
  for (size_t i = 0; i < n && i < 2; i++) {
    gpumem__wire__buffer_info__init(&b[i]);
    b[i].id = first + i;
    b[i].tag = "kv";
    b[i].size = 2 * MIB;
    bp[i] = &b[i];
  }
  Gpumem__Wire__ListReply r = GPUMEM__WIRE__LIST_REPLY__INIT;
  r.buffers = bp;
  r.n_buffers = n;
  r.total = total;
  r.next = next;
  wire_env out = peer_env(id, GPUMEM__WIRE__ENVELOPE__BODY_LIST_REPLY);
  out.list_reply = &r;
  fake_send(f, &out, NULL, 0);
}

/* Script: pages that would not end, in turn: an empty list page with a
 * cursor; more buffers than the total announced; totals that change on
 * every walk; an empty status page with a cursor. */
static void run_bad_pages(struct script *s) {
  script_greet(s);
  struct frame fr;
  wire_env *in;
  int step = 0;
  while ((in = fake_recv(&s->f, &fr))) {
    if (in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_LIST) {
      uint64_t after = in->list->after;
      step++;
      if (step == 1)
        answer_page(&s->f, in->id, 0, 0, 5, after + 1);
      else if (step == 2)
        answer_page(&s->f, in->id, 1, 3, 1, 3);
      else if (step == 3)
        answer_page(&s->f, in->id, 1, 4, 1, 0);
      else /* each walk: its second page's total is not its first's */
        answer_page(&s->f, in->id, 1, after ? 4 : 3, after ? 100u + (unsigned)step : 2, after ? 0 : 3);
    } else if (in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_STATUS) {
      Gpumem__Wire__StatusReply r = GPUMEM__WIRE__STATUS_REPLY__INIT;
      r.backend = "host";
      r.total_tags = 1;
      r.next_tag = in->status->tag_cursor + 1; /* no tags, and more to come */
      wire_env out = peer_env(in->id, GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY);
      out.status_reply = &r;
      fake_send(&s->f, &out, NULL, 0);
    }
    wire_env_free(in);
    frame_release(&fr);
  }
}

/* Paging that ends (protocol 1.10): a walk stops, saying why, at an empty
 * page with a cursor and at more items than the first page announced; a
 * walk whose totals change is walked again, three times at most. (A
 * daemon answering every page with nothing and the next cursor kept a
 * walk going for ever.) */
START_TEST(pages_that_would_not_end_are_refused) {
  struct script s;
  gpumem_client *c = script_connect(&s, run_bad_pages, "pages", GPUMEM_ROLE_CONTROLLER);
  struct gpumem_list *l = NULL;
  ck_assert_int_eq(gpumem_list(c, &l), GPUMEM_E_PROTOCOL);
  ck_assert_msg(strstr(gpumem_last_error(), "an empty page of buffers and a cursor"), "%s",
                gpumem_last_error());
  ck_assert_int_eq(gpumem_list(c, &l), GPUMEM_E_PROTOCOL);
  ck_assert_msg(strstr(gpumem_last_error(), "more buffers (2) than the 1 it announced"), "%s",
                gpumem_last_error());
  ck_assert_int_eq(gpumem_list(c, &l), GPUMEM_E_WRONG_STATE);
  ck_assert_msg(strstr(gpumem_last_error(), "changed during each of 3 walks"), "%s",
                gpumem_last_error());
  struct gpumem_status *st = NULL;
  ck_assert_int_eq(gpumem_status(c, &st), GPUMEM_E_PROTOCOL);
  ck_assert_msg(strstr(gpumem_last_error(), "an empty page of tags and a cursor"), "%s",
                gpumem_last_error());
  script_finish(&s, c);
}
END_TEST

/* Scopes and devices: bad options fail before anything is sent, the rest
 * reach the daemon as given, with device numbers turned into the daemon's
 * on the way out and into this process's on the way back; an older
 * caller's smaller options struct is read only as far as it goes. */
START_TEST(test_scopes_and_devices_reach_the_daemon_as_meant) {
  struct script s;
  gpumem_client *c = script_connect(&s, run_recorder, "rec", GPUMEM_ROLE_CONTROLLER);
  ck_assert_uint_eq(gpumem_device_count(c), 2);
  const char *tag = "kv";
  uint32_t pids[] = {7, 8}, zero[] = {0};
  int dev0 = 0, dev2 = 2, minus = -1;
  char long_prefix[200];
  memset(long_prefix, 'r', sizeof long_prefix - 1);
  long_prefix[sizeof long_prefix - 1] = '\0';
  struct {
    int scope;
    const uint32_t *pids;
    size_t npids;
    const char *prefix;
    const int *dev;
    const char *words;
  } bad[] = {
      {GPUMEM_SCOPE_OWN, pids, 2, NULL, NULL, "scope OWN"},
      {GPUMEM_SCOPE_OWN, NULL, 0, "rank", NULL, "scope OWN"},
      {7, NULL, 0, NULL, NULL, "unknown scope 7"},
      {0, NULL, 2, NULL, NULL, "no pid list"},
      {0, zero, 1, NULL, NULL, "pid 0"},
      {0, NULL, 0, "bad\nname", NULL, "control characters"},
      {0, NULL, 0, "\xff\xfe", NULL, "not UTF-8"},
      /* The one text check, the daemon's: a C1 control (CSI), an encoded
       * surrogate and an overlong encoding are refused too. */
      {0, NULL, 0, "rank\xc2\x9b", NULL, "control characters"},
      {0, NULL, 0, "rank\xed\xa0\x80", NULL, "not UTF-8"},
      {0, NULL, 0, "rank\xe0\x80\xaf", NULL, "not UTF-8"},
      {0, NULL, 0, long_prefix, NULL, "longer than"},
      {0, NULL, 0, NULL, &dev2, "device 2 is not one of the 2 gpumemd devices"},
      {0, NULL, 0, NULL, &minus, "device -1 is not one of the 2"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
    o.scope = bad[i].scope;
    o.pids = bad[i].pids;
    o.npids = bad[i].npids;
    o.session_prefix = bad[i].prefix;
    struct gpumem_op_report *r = (void *)&o;
    ck_assert_int_eq(gpumem_pause(c, &tag, 1, bad[i].dev, bad[i].dev ? 1 : 0, &o, &r),
                     GPUMEM_E_INVALID);
    ck_assert_ptr_null(r);
    ck_assert_msg(strstr(gpumem_last_error(), bad[i].words), "%zu: %s", i, gpumem_last_error());
  }
  struct gpumem_op_options nosize = GPUMEM_OP_OPTIONS_INIT;
  nosize.size = 0;
  ck_assert_int_eq(gpumem_resume(c, &tag, 1, NULL, 0, &nosize, NULL), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_pause(c, NULL, 1, NULL, 0, NULL, NULL), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_sync(c, 2), GPUMEM_E_INVALID);
  /* A pause of some sessions on our device 0, which is the daemon's 1. */
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.pids = pids;
  o.npids = 2;
  o.session_prefix = "rank";
  o.timeout_ms = 500;
  struct gpumem_op_report *r;
  ck_assert_msg(gpumem_pause(c, &tag, 1, &dev0, 1, &o, &r) == 0, "%s", gpumem_last_error());
  ck_assert_uint_eq(r->size, sizeof *r);
  ck_assert_str_eq(r->code, "OK");
  ck_assert_uint_eq(r->nchecks, 1);
  ck_assert_uint_eq(r->checks[0]->size, sizeof(struct gpumem_device_check));
  ck_assert_int_eq(r->checks[0]->device, 0);
  ck_assert_uint_eq(r->checks[0]->node_device, 1);
  ck_assert_uint_eq(r->ndetails, 1);
  ck_assert_str_eq(r->details[0]->tag, "kv");
  ck_assert_int_eq(r->details[0]->device, 0);
  ck_assert_uint_eq(r->details[0]->node_device, 1);
  gpumem_op_report_free(r);
  /* Every tag of this client's own. */
  struct gpumem_op_options own = GPUMEM_OP_OPTIONS_INIT;
  own.scope = GPUMEM_SCOPE_OWN;
  ck_assert_int_eq(gpumem_resume(c, NULL, 0, NULL, 0, &own, NULL), 0);
  /* A caller built against the 1.1 header: what lies past its struct is
   * not read. */
  struct gpumem_op_options old = GPUMEM_OP_OPTIONS_INIT;
  old.size = offsetof(struct gpumem_op_options, scope);
  old.scope = GPUMEM_SCOPE_OWN;
  old.pids = zero;
  old.npids = 1;
  ck_assert_int_eq(gpumem_pause(c, &tag, 1, NULL, 0, &old, NULL), 0);
  struct gpumem_status *st;
  ck_assert_int_eq(gpumem_status(c, &st), 0);
  ck_assert_uint_eq(st->size, sizeof *st);
  ck_assert_str_eq(st->backend, "host");
  ck_assert_uint_eq(st->ndevices, 2);
  ck_assert_uint_eq(st->devices[0]->size, sizeof(struct gpumem_device_status));
  ck_assert_int_eq(st->devices[0]->device, 1);
  ck_assert_uint_eq(st->devices[0]->node_device, 0);
  ck_assert_str_eq(st->devices[0]->bus_id, "host-local:1");
  ck_assert_int_eq(st->devices[1]->device, 0);
  ck_assert_uint_eq(st->nprocesses, 1);
  ck_assert_int_eq(st->processes[0]->device, 1);
  ck_assert_str_eq(st->processes[0]->name, "outside");
  gpumem_status_free(st);
  struct gpumem_list *l;
  ck_assert_int_eq(gpumem_list(c, &l), 1);
  ck_assert_uint_eq(l->size, sizeof *l);
  ck_assert_uint_eq(l->nbuffers, 1);
  ck_assert_uint_eq(l->buffers[0]->bytes, 2 * MIB);
  ck_assert_int_eq(l->buffers[0]->device, 0);
  ck_assert_uint_eq(l->buffers[0]->node_device, 1);
  ck_assert_str_eq(l->buffers[0]->tag, "kv");
  gpumem_list_free(l);
  script_finish(&s, c);
  ck_assert_str_eq(s.log, "pause own=0 pids=7,8 prefix=rank devices=1 tags=kv timeout=500\n"
                          "resume own=1 pids= prefix= devices= tags= timeout=0\n"
                          "pause own=0 pids= prefix= devices= tags=kv timeout=0\n"
                          "status\n"
                          "list\n");
}
END_TEST

/* Poll (up to 5 s) until this process holds no memfd of the host backend
 * by fd or mapping. */
static bool own_memfds_gone(void) {
  pid_t me = getpid();
  double until = now_ms() + 5000;
  while (memfd_bytes(&me, 1) != 0) {
    if (now_ms() > until) return false;
    usleep(1000);
  }
  return true;
}

/* Script: leave an alloc unanswered until the test says, answer it late,
 * take the free the library sends for it; then leave a free unanswered
 * until the test says. */
static void run_late(struct script *s) {
  script_greet(s);
  uint64_t id = recv_alloc(&s->f);
  EXPECT(s, id != 0);
  reach(s, 1);
  hold(s, 2);
  push_alloc_reply(&s->f, id, 9, false);
  fake_flush(&s->f);
  s->ids[0] = answer_free(&s->f);
  reach(s, 3);
  id = recv_alloc(&s->f);
  EXPECT(s, id != 0);
  push_alloc_reply(&s->f, id, 10, false);
  fake_flush(&s->f);
  struct frame fr;
  wire_env *in = fake_recv(&s->f, &fr);
  bool is_free = in && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_FREE;
  EXPECT(s, is_free && in->free->buffer_id == 10);
  uint64_t fid = in ? in->id : 0;
  wire_env_free(in);
  if (in) frame_release(&fr);
  reach(s, 4);
  hold(s, 5);
  send_free_reply(&s->f, fid, 0);
  reach(s, 6);
  EXPECT(s, fake_ended(&s->f));
}

/* A daemon that does not answer: the request fails with GPUMEM_E_TIMEOUT
 * after the request timeout; the late AllocReply's memory is given back
 * (freed at the daemon, its fd closed here), and a free that timed out
 * releases its buffer when the answer comes. */
START_TEST(test_unanswered_requests_time_out_and_late_replies_are_handled) {
  struct script s;
  gpumem_client *c = script_connect(&s, run_late, "late", GPUMEM_ROLE_WORKER);
  gpumem_set_request_timeout(c, 200);
  gpumem_buffer *b = NULL;
  double t0 = now_ms();
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &b), GPUMEM_E_TIMEOUT);
  double took = now_ms() - t0;
  ck_assert_msg(took >= 195 && took < 5000, "waited %.0f ms", took);
  ck_assert_msg(strstr(gpumem_last_error(), "gpumemd did not answer in 0.2 s"), "%s",
                gpumem_last_error());
  ck_assert_ptr_null(b);
  ck_assert_str_eq(gpumem_error_name(GPUMEM_E_TIMEOUT), "TIMEOUT");
  release(&s, 2);
  await(&s, 3);
  ck_assert_msg(s.ok, "%s", s.note);
  ck_assert_int_eq(s.ids[0], 9);
  ck_assert(own_memfds_gone());
  /* The connection carries on. */
  gpumem_set_request_timeout(c, 0);
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &b), 0);
  void *va = gpumem_buffer_ptr(b);
  ck_assert(maps_memfd_at(va));
  gpumem_set_request_timeout(c, 200);
  ck_assert_int_eq(gpumem_free(c, b), GPUMEM_E_TIMEOUT);
  ck_assert_msg(strstr(gpumem_last_error(), "releases the buffer once gpumemd frees it"), "%s",
                gpumem_last_error());
  await(&s, 4);
  ck_assert_msg(maps_memfd_at(va), "the buffer went before gpumemd freed it");
  release(&s, 5);
  await(&s, 6);
  ck_assert(own_memfds_gone());
  ck_assert(!maps_memfd_at(va));
  script_finish(&s, c);
}
END_TEST

/* Queue an Error answering request id. */
static void push_error(struct fake *f, uint64_t id, wire_code code, const char *text) {
  Gpumem__Wire__Error e = GPUMEM__WIRE__ERROR__INIT;
  e.code = code;
  e.message = (char *)text;
  wire_env out = peer_env(id, GPUMEM__WIRE__ENVELOPE__BODY_ERROR);
  out.error = &e;
  fake_push(f, &out, NULL, 0);
}

/* Read the next message, which must be a FreeRequest of buffer bid;
 * returns its request id (0 if it is not). */
static uint64_t recv_free_of(struct fake *f, uint64_t bid) {
  struct frame fr;
  wire_env *in = fake_recv(f, &fr);
  uint64_t id = in && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_FREE &&
                        in->free->buffer_id == bid ? in->id : 0;
  wire_env_free(in);
  if (in) frame_release(&fr);
  return id;
}

/* Script: hold a free until its caller timed out, then refuse it (the
 * buffer is being paused) and send an Unmap of the buffer in the same
 * write; take the ack and the free sent again (in either order), refuse
 * that too, and free the buffer at the third try. */
static void run_refused_free(struct script *s) {
  script_greet(s);
  uint64_t id = recv_alloc(&s->f), bid = 11;
  EXPECT(s, id != 0);
  push_alloc_reply(&s->f, id, bid, false);
  fake_flush(&s->f);
  uint64_t fid = recv_free_of(&s->f, bid);
  EXPECT(s, fid != 0);
  reach(s, 1);
  hold(s, 2);
  push_error(&s->f, fid, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
             "buffer 11 is PAUSING; free it when that is done");
  push_unmap(&s->f, 300, &bid, 1);
  fake_flush(&s->f);
  int acks = 0, frees = 0;
  for (int i = 0; i < 2; i++) {
    struct frame fr;
    wire_env *in = fake_recv(&s->f, &fr);
    if (in && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ACK && in->id == 300) {
      acks++;
      s->acks[0].id = in->id;
      s->acks[0].code = in->ack->code;
      snprintf(s->acks[0].message, sizeof s->acks[0].message, "%s", in->ack->message);
    } else if (in && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_FREE &&
               in->free->buffer_id == bid) {
      frees++;
      fid = in->id;
    }
    wire_env_free(in);
    if (in) frame_release(&fr);
  }
  EXPECT(s, acks == 1 && frees == 1);
  push_error(&s->f, fid, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE, "buffer 11 is still PAUSING");
  fake_flush(&s->f);
  fid = recv_free_of(&s->f, bid);
  EXPECT(s, fid != 0);
  reach(s, 3);
  send_free_reply(&s->f, fid, 0);
  reach(s, 4);
  EXPECT(s, fake_ended(&s->f));
}

/* A free that timed out and that the daemon then refuses (a pause has the
 * buffer) does not destroy the buffer: the pause's Unmap still finds it
 * (the ack says done, not "no buffer"), the library sends the free again
 * after a back-off until the daemon frees it, and only then lets the
 * memory go. For the caller the buffer is gone from the timeout on. */
START_TEST(test_refused_late_free_keeps_the_buffer_and_retries) {
  struct script s;
  gpumem_client *c = script_connect(&s, run_refused_free, "refused", GPUMEM_ROLE_WORKER);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &b), 0);
  void *va = gpumem_buffer_ptr(b);
  gpumem_set_request_timeout(c, 200);
  ck_assert_int_eq(gpumem_free(c, b), GPUMEM_E_TIMEOUT);
  await(&s, 1);
  ck_assert_int_eq(gpumem_free_ptr(c, va), GPUMEM_E_NOT_FOUND); /* not the caller's */
  ck_assert(maps_memfd_at(va));
  release(&s, 2);
  await(&s, 3);
  ck_assert_msg(s.ok, "%s", s.note);
  ck_assert_msg(s.acks[0].code == 0, "ack %d: %s", s.acks[0].code, s.acks[0].message);
  await(&s, 4);
  ck_assert(own_memfds_gone());
  script_finish(&s, c);
}
END_TEST

/* Script: greet, then read nothing until the test says; then send an
 * Unmap event and again read nothing until the test says; then read
 * until the client goes. */
static void run_deaf(struct script *s) {
  script_greet(s);
  reach(s, 1);
  hold(s, 2);
  uint64_t bid = 99;
  push_unmap(&s->f, 400, &bid, 1);
  fake_flush(&s->f);
  reach(s, 3);
  hold(s, 4);
  struct frame fr;
  wire_env *in;
  while ((in = fake_recv(&s->f, &fr))) {
    wire_env_free(in);
    frame_release(&fr);
  }
}

/* A daemon that reads nothing: requests fail with GPUMEM_E_TIMEOUT within
 * the request timeout even once the socket is full (they are then not
 * sent at all), and an ack that cannot be sent for that long drops the
 * connection. */
START_TEST(test_a_daemon_that_reads_nothing_blocks_no_call) {
  struct script s;
  gpumem_client *c = script_connect(&s, run_deaf, "deaf", GPUMEM_ROLE_WORKER);
  struct conn_events l;
  conn_events_watch(&l, c);
  await(&s, 1);
  int small = 4096;
  ck_assert_int_eq(setsockopt(gpumem_fd(c), SOL_SOCKET, SO_SNDBUF, &small, sizeof small), 0);
  gpumem_set_request_timeout(c, 100);
  /* Pauses of 64 long tags: about 4 KiB each, so the socket fills fast. */
  static char names[64][64];
  const char *tags[64];
  for (int i = 0; i < 64; i++) {
    snprintf(names[i], sizeof names[i], "t%02d%060d", i, 0);
    tags[i] = names[i];
  }
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.timeout_ms = 1;
  o.scope = GPUMEM_SCOPE_OWN;
  bool unsent = false;
  for (int i = 0; i < 16; i++) {
    double t0 = now_ms();
    ck_assert_int_eq(gpumem_pause(c, tags, 64, NULL, 0, &o, NULL), GPUMEM_E_TIMEOUT);
    double took = now_ms() - t0;
    ck_assert_msg(took < 2000, "pause %d took %.0f ms", i, took);
    unsent |= strstr(gpumem_last_error(), "did not read the request") != NULL;
  }
  ck_assert_msg(unsent, "the socket never filled: %s", gpumem_last_error());
  gpumem_buffer *b = NULL;
  double t0 = now_ms();
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &b), GPUMEM_E_TIMEOUT);
  ck_assert_msg(now_ms() - t0 < 2000, "alloc took %.0f ms", now_ms() - t0);
  /* The ack of an Unmap cannot be sent: the connection is dropped. */
  release(&s, 2);
  conn_events_wait(&l, 1, 0);
  pthread_mutex_lock(&l.mu);
  int lost = l.lost;
  pthread_mutex_unlock(&l.mu);
  ck_assert_int_eq(lost, 1);
  ck_assert_msg(strstr(l.first_loss, "gpumemd closed the connection") ||
                    strstr(l.first_loss, "read nothing"),
                "%s", l.first_loss);
  release(&s, 4);
  script_finish(&s, c);
}
END_TEST

/* Script: serve two allocations (2 MiB buffers 21 and 22), then answer the
 * first free with FreeReply and the second with WRONG_STATE; the next free
 * gets a FreeReply. */
static void run_trim(struct script *s) {
  script_greet(s);
  for (uint64_t bid = 21; bid <= 22; bid++) {
    uint64_t id = recv_alloc(&s->f);
    EXPECT(s, id != 0);
    push_alloc_reply(&s->f, id, bid, false);
    fake_flush(&s->f);
  }
  for (int i = 0; i < 3; i++) {
    struct frame fr;
    wire_env *in = fake_recv(&s->f, &fr);
    bool ok = in && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_FREE;
    EXPECT(s, ok);
    if (ok && i == 1) {
      push_error(&s->f, in->id, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE, "buffer is PAUSING");
    } else if (ok) {
      send_free_reply(&s->f, in->id, 0);
    }
    fake_flush(&s->f);
    wire_env_free(in);
    if (in) frame_release(&fr);
  }
  EXPECT(s, fake_ended(&s->f));
}

/* A trim where one empty pool buffer goes back and the daemon keeps the
 * other returns the bytes that went; the kept one stays in its pool and
 * the next trim gives it back. */
START_TEST(test_trim_returns_bytes_when_some_buffers_stay) {
  struct script s;
  gpumem_client *c = script_connect(&s, run_trim, "trim", GPUMEM_ROLE_WORKER);
  void *a, *b;
  ck_assert_int_eq(gpumem_malloc(c, "a", 0, MIB, 0, &a), 0);
  ck_assert_int_eq(gpumem_malloc(c, "b", 0, MIB, 0, &b), 0);
  ck_assert_int_eq(gpumem_free_ptr(c, a), 0);
  ck_assert_int_eq(gpumem_free_ptr(c, b), 0);
  struct gpumem_pool_stats st = {.size = sizeof st};
  ck_assert_int_eq(gpumem_pool_stats(c, &st), 0);
  ck_assert_uint_eq(st.pooled_buffers, 2);
  ck_assert_int_eq(gpumem_trim(c), 2 * MIB);
  ck_assert_int_eq(gpumem_pool_stats(c, &st), 0);
  ck_assert_uint_eq(st.pooled_buffers, 1);
  ck_assert_int_eq(gpumem_trim(c), 2 * MIB);
  ck_assert_int_eq(gpumem_pool_stats(c, &st), 0);
  ck_assert_uint_eq(st.pooled_buffers, 0);
  ck_assert(own_memfds_gone());
  script_finish(&s, c);
}
END_TEST

/* Script: answer an alloc with a chunk whose memfd is shorter than the
 * size the reply claims, then answer the free the client sends for it. */
static void run_short_chunk(struct script *s) {
  script_greet(s);
  uint64_t id = recv_alloc(&s->f);
  EXPECT(s, id != 0);
  uint64_t size = 2 * MIB;
  Gpumem__Wire__AllocReply r = GPUMEM__WIRE__ALLOC_REPLY__INIT;
  r.buffer_id = 9;
  r.size = size;
  r.state = GPUMEM__WIRE__BUFFER_STATE__ACTIVE;
  r.chunk_sizes = &size;
  r.n_chunk_sizes = 1;
  wire_env out = peer_env(id, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY);
  out.alloc_reply = &r;
  int fd = chunk(4096); /* 4 KiB behind a 2 MiB claim */
  fake_send(&s->f, &out, &fd, 1);
  s->ids[0] = answer_free(&s->f);
  EXPECT(s, fake_ended(&s->f));
}

/* A chunk shorter than the daemon claims is refused at import (mapping it
 * would fault past its end), the allocation fails saying so, and the
 * buffer is given back. */
START_TEST(test_a_short_chunk_is_refused) {
  struct script s;
  gpumem_client *c = script_connect(&s, run_short_chunk, "short", GPUMEM_ROLE_WORKER);
  gpumem_buffer *b = NULL;
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &b), GPUMEM_E_MAP);
  ck_assert_msg(strstr(gpumem_last_error(), "4096 bytes, 2097152 claimed"), "%s",
                gpumem_last_error());
  script_finish(&s, c);
  ck_assert_int_eq(s.ids[0], 9);
}
END_TEST

/* Script: the client pauses its own tag; the daemon sends this session
 * the Unmap and answers the pause only after the ack. */
static void run_self_pause(struct script *s) {
  script_greet(s);
  uint64_t id = recv_alloc(&s->f), bid = 5;
  EXPECT(s, id != 0);
  push_alloc_reply(&s->f, id, bid, false);
  fake_flush(&s->f);
  struct frame fr;
  wire_env *in = fake_recv(&s->f, &fr);
  bool pause = in && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_PAUSE;
  EXPECT(s, pause && in->pause->own && in->pause->n_tags == 1 &&
                strcmp(in->pause->tags[0], "kv") == 0);
  uint64_t pid = in ? in->id : 0;
  wire_env_free(in);
  if (in) frame_release(&fr);
  push_unmap(&s->f, 200, &bid, 1);
  fake_flush(&s->f);
  EXPECT(s, recv_ack(&s->f, &s->acks[0]));
  answer_op(&s->f, pid);
  s->ids[0] = answer_free(&s->f);
  EXPECT(s, fake_ended(&s->f));
}

/* Without a background thread, a request handles the daemon's events
 * while it waits: a worker that pauses its own buffers acks the Unmap
 * that its own pause causes and gets the answer. */
START_TEST(test_no_thread_request_handles_events_while_waiting) {
  struct script s;
  script_start(&s, run_self_pause);
  gpumem_client *c;
  ck_assert_int_eq(gpumem_connect(s.f.l.path, "self", GPUMEM_ROLE_WORKER,
                                  GPUMEM_CONNECT_NO_THREAD, &c), 0);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc(c, "kv", 0, 2 * MIB, 0, &b), 0);
  void *va = gpumem_buffer_ptr(b);
  const char *tag = "kv";
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.scope = GPUMEM_SCOPE_OWN;
  struct gpumem_op_report *r;
  ck_assert_msg(gpumem_pause(c, &tag, 1, NULL, 0, &o, &r) == 0, "%s", gpumem_last_error());
  ck_assert_uint_eq(r->buffers, 1);
  gpumem_op_report_free(r);
  ck_assert_int_eq(gpumem_buffer_mapped(b), 0);
  ck_assert(!maps_memfd_at(va));
  ck_assert_int_eq(gpumem_free(c, b), 0);
  script_finish(&s, c);
  ck_assert_int_eq(s.acks[0].id, 200);
  ck_assert_msg(s.acks[0].code == 0, "ack %d: %s", s.acks[0].code, s.acks[0].message);
  ck_assert_int_eq(s.ids[0], 5);
}
END_TEST

/* A reader thread and what it saw. */
struct reader {
  gpumem_client *c;
  gpumem_buffer *b;
  const uint8_t *pattern;
  uint64_t size;
  atomic_bool stop;
  atomic_long ok, wrong_state, bad;
  char why[256];
};

/* Read the buffer in pieces until told to stop, checking every piece. */
static void *read_loop(void *arg) {
  struct reader *r = arg;
  enum { PIECE = 64 * 1024 };
  uint8_t *tmp = malloc(PIECE);
  while (!atomic_load(&r->stop)) {
    for (uint64_t off = 0; off < r->size && !atomic_load(&r->stop); off += PIECE) {
      int rc = gpumem_buffer_read(r->c, r->b, off, tmp, PIECE);
      if (rc == 0 && memcmp(tmp, r->pattern + off, PIECE) == 0) {
        atomic_fetch_add(&r->ok, 1);
      } else if (rc == GPUMEM_E_WRONG_STATE) {
        atomic_fetch_add(&r->wrong_state, 1);
      } else if (atomic_fetch_add(&r->bad, 1) == 0) {
        snprintf(r->why, sizeof r->why, "read at %llu: %d %s", (unsigned long long)off, rc,
                 rc ? gpumem_last_error() : "wrong contents");
      }
    }
  }
  free(tmp);
  return NULL;
}

/* Wait (up to 10 s) until a counter moves past a value. */
static bool moves_past(atomic_long *v, long was) {
  double until = now_ms() + 10000;
  while (atomic_load(v) <= was) {
    if (now_ms() > until) return false;
    usleep(100);
  }
  return true;
}

/* Reads of a BACKUP buffer on one thread while another pauses and resumes
 * its tag: each read either gives the right contents or fails with
 * GPUMEM_E_WRONG_STATE; none touches unmapped memory. */
START_TEST(test_reads_race_pauses_safely) {
  struct daemon d;
  daemon_start(&d, "--host-devices", "1", "--host-device-size", "256M", NULL);
  gpumem_client *w, *ctl;
  ck_assert_int_eq(gpumem_connect(d.socket, "reader", GPUMEM_ROLE_WORKER, 0, &w), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER,
                                  GPUMEM_CONNECT_NO_THREAD, &ctl), 0);
  struct reader r = {.c = w, .size = 4 * MIB};
  ck_assert_int_eq(gpumem_alloc(w, "rw", 0, r.size, GPUMEM_BACKUP, &r.b), 0);
  uint8_t *pattern = malloc(r.size);
  for (uint64_t i = 0; i < r.size; i++) pattern[i] = (uint8_t)(i * 131 + i / 4099);
  r.pattern = pattern;
  ck_assert_int_eq(gpumem_buffer_write(w, r.b, 0, pattern, r.size), 0);
  pthread_t t;
  pthread_create(&t, NULL, read_loop, &r);
  const char *tag = "rw";
  for (int i = 0; i < 20; i++) {
    long seen = atomic_load(&r.wrong_state);
    ck_assert_msg(gpumem_pause(ctl, &tag, 1, NULL, 0, NULL, NULL) == 0, "%s",
                  gpumem_last_error());
    ck_assert(moves_past(&r.wrong_state, seen));
    seen = atomic_load(&r.ok);
    ck_assert_msg(gpumem_resume(ctl, &tag, 1, NULL, 0, NULL, NULL) == 0, "%s",
                  gpumem_last_error());
    ck_assert(moves_past(&r.ok, seen));
  }
  atomic_store(&r.stop, true);
  pthread_join(t, NULL);
  ck_assert_msg(atomic_load(&r.bad) == 0, "%ld bad reads; first: %s", atomic_load(&r.bad),
                r.why);
  ck_assert_int_eq(gpumem_free(w, r.b), 0);
  free(pattern);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* The version, the error names and the words of the new code. */
START_TEST(test_version_and_error_names) {
  ck_assert_int_eq(gpumem_version(), GPUMEM_VERSION);
  ck_assert_int_eq(GPUMEM_VERSION, 11200);
  ck_assert_str_eq(gpumem_version_string(), "1.12.0");
  ck_assert_str_eq(gpumem_error_name(0), "OK");
  ck_assert_str_eq(gpumem_error_name(GPUMEM_E_TAG_PAUSED), "TAG_PAUSED");
  ck_assert_str_eq(gpumem_error_name(GPUMEM_E_INVALID), "INVALID_ARGUMENT");
  ck_assert_str_eq(gpumem_error_name(GPUMEM_E_NOT_RELEASED), "NOT_RELEASED");
  ck_assert_str_eq(gpumem_error_name(GPUMEM_E_SHUTTING_DOWN), "SHUTTING_DOWN");
  ck_assert_str_eq(gpumem_error_name(GPUMEM_E_DISCONNECTED), "DISCONNECTED");
  ck_assert_str_eq(gpumem_error_name(GPUMEM_E_TIMEOUT), "TIMEOUT");
  ck_assert_str_eq(gpumem_error_name(GPUMEM_E_RELEASE_REFUSED), "RELEASE_REFUSED");
  ck_assert_str_eq(gpumem_error_name(-22), "UNKNOWN");
  ck_assert_str_eq(gpumem_error_name(5), "UNKNOWN");
  ck_assert_str_eq(gpumem_strerror(GPUMEM_E_TIMEOUT), "gpumemd did not answer in time");
  ck_assert_str_eq(gpumem_strerror(GPUMEM_E_RELEASE_REFUSED), "context release refused");
  ck_assert_str_eq(gpumem_strerror(-22), "unknown error");
}
END_TEST

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  return HARNESS_RUN("client", 60, NULL, NULL, test_unmap_right_after_alloc_reply_unmaps,
                     pages_that_would_not_end_are_refused,
                     test_release_context_needs_a_1_6_daemon,
                     test_event_acks_name_what_failed, test_error_outside_request_is_reported,
                     test_refused_session_says_why,
                     test_refusal_read_before_the_send_failure_is_reported,
                     test_every_refused_session_says_why,
                     test_request_after_unread_refusal_reports_the_daemon,
                     test_request_in_flight_fails_on_loss,
                     test_no_reconnect_flag, test_restart_re_registers_buffers,
                     test_dispatch_reconnects_without_thread,
                     test_daemon_killed_and_restarted_adopts_worker,
                     a_tag_generation_counts_the_resumes_that_remap_it,
                     test_daemon_sigterm_worker_told_and_adopted,
                     test_scopes_and_devices_reach_the_daemon_as_meant,
                     test_unanswered_requests_time_out_and_late_replies_are_handled,
                     test_no_thread_request_handles_events_while_waiting, test_a_short_chunk_is_refused,
                     test_reads_race_pauses_safely, test_version_and_error_names,
                     test_refused_late_free_keeps_the_buffer_and_retries,
                     test_a_daemon_that_reads_nothing_blocks_no_call,
                     test_trim_returns_bytes_when_some_buffers_stay);
}
