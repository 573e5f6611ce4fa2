/* Persistent buffers: named, kept by the daemon (memory and contents,
 * as the kernel counts the daemon's memfds) when their holder frees them
 * or ends, paused and resumed with their tag while no process holds them,
 * attached again by a process of their uid with the same contents, and
 * freed only by a drop; names are per uid, and another uid can neither
 * take nor drop them. */
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpumem.h"
#include "harness.h"

#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x
#define WORKER GPUMEM__WIRE__ROLE__ROLE_WORKER
#define MiB (1ull << 20)
#define SIZE (8 * MiB)

static struct daemon d;

/* Bytes of memfds the daemon holds, by the kernel's figure. */
static uint64_t daemon_bytes(void) { return memfd_bytes(&d.pid, 1); }

/* Connect a libgpumem client in a role. */
static gpumem_client *open_client(const char *name, int role) {
  gpumem_client *c;
  ck_assert_msg(gpumem_connect(d.socket, name, role, 0, &c) == 0, "%s", gpumem_last_error());
  return c;
}

/* Fill a buffer with a pattern of seed. */
static void fill(gpumem_client *c, gpumem_buffer *b, uint32_t seed) {
  ck_assert_int_eq(gpumem_buffer_fill32(c, b, 0, gpumem_buffer_size(b), seed), 0);
}

/* Whether every word of a buffer is seed. */
static bool holds(gpumem_client *c, gpumem_buffer *b, uint32_t seed) {
  uint64_t n = gpumem_buffer_size(b);
  uint32_t *v = malloc(n);
  ck_assert_ptr_nonnull(v);
  ck_assert_int_eq(gpumem_buffer_read(c, b, 0, v, n), 0);
  bool same = true;
  for (uint64_t i = 0; i < n / 4 && same; i++) same = v[i] == seed;
  free(v);
  return same;
}

/* The status's persistent buffer named name (all zero when none). */
static struct gpumem_buffer_info persistent(gpumem_client *c, const char *name,
                                            uint64_t *total) {
  struct gpumem_status *s;
  ck_assert_msg(gpumem_status(c, &s) == 0, "%s", gpumem_last_error());
  struct gpumem_buffer_info out;
  memset(&out, 0, sizeof out);
  for (size_t i = 0; i < s->npersistent; i++)
    if (strcmp(s->persistent[i]->name, name) == 0) out = *s->persistent[i];
  out.name = out.tag = out.last_name = NULL; /* freed with the status */
  if (total) *total = s->total_persistent;
  gpumem_status_free(s);
  return out;
}

/* Wait until no session holds name (its holder's session ending is seen
 * by the daemon on its own turn, after the disconnect returned). */
static void await_unheld(gpumem_client *ctl, const char *name) {
  for (double end = now_ms() + harness_patience_ms(5000);
       persistent(ctl, name, NULL).pid != 0 && now_ms() < end;) {
  }
  ck_assert_uint_eq(persistent(ctl, name, NULL).pid, 0);
}

/* Wait until no session holds any persistent buffer. */
static void await_none_held(gpumem_client *ctl) {
  bool held = true;
  for (double end = now_ms() + harness_patience_ms(5000); held && now_ms() < end;) {
    struct gpumem_status *s;
    ck_assert_int_eq(gpumem_status(ctl, &s), 0);
    held = false;
    for (size_t i = 0; i < s->npersistent; i++) held |= s->persistent[i]->pid != 0;
    gpumem_status_free(s);
  }
  ck_assert(!held);
}

/* Cut this process's connections to the daemon (the library's socket),
 * as a daemon that ends a session does: the library reconnects to the
 * same daemon and re-registers what it holds. Returns how many. */
static int cut_connections(void) {
  int n = 0;
  for (int fd = 3; fd < 1024; fd++) {
    struct sockaddr_un peer;
    socklen_t len = sizeof peer;
    memset(&peer, 0, sizeof peer);
    if (getpeername(fd, (struct sockaddr *)&peer, &len) < 0 || peer.sun_family != AF_UNIX)
      continue;
    if (strcmp(peer.sun_path, d.socket) != 0) continue;
    ck_assert_int_eq(shutdown(fd, SHUT_RDWR), 0);
    n++;
  }
  return n;
}

/* A buffer outlives its holder's free and its session, held by the daemon
 * (its memfds by the kernel's count), shown with its last holder; a new
 * process attaches it with the contents, and a drop frees it. */
START_TEST(a_persistent_buffer_outlives_its_holder) {
  daemon_start(&d, NULL);
  uint64_t before = daemon_bytes();
  gpumem_client *w = open_client("engine-1", GPUMEM_ROLE_WORKER);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc_persistent(w, "w0", "weights", 0, SIZE, 0, &b), 0);
  ck_assert_str_eq(gpumem_buffer_name(b), "w0");
  ck_assert_uint_ne(gpumem_buffer_flags(b) & GPUMEM_PERSIST, 0);
  uint64_t id = gpumem_buffer_id(b);
  fill(w, b, 0xfeed0001u);
  /* A free lets go of it here; the daemon keeps it. */
  ck_assert_int_eq(gpumem_free(w, b), 0);
  ck_assert_uint_eq(daemon_bytes(), before + SIZE);
  gpumem_buffer *again;
  ck_assert_int_eq(gpumem_attach(w, "w0", &again), 0);
  ck_assert_uint_eq(gpumem_buffer_id(again), id);
  ck_assert(holds(w, again, 0xfeed0001u));
  fill(w, again, 0xfeed0002u);
  gpumem_disconnect(w); /* its session ends: kept again */
  ck_assert_uint_eq(daemon_bytes(), before + SIZE);
  gpumem_client *ctl = open_client("ctl", GPUMEM_ROLE_CONTROLLER);
  await_unheld(ctl, "w0");
  uint64_t total;
  struct gpumem_buffer_info p = persistent(ctl, "w0", &total);
  ck_assert_uint_eq(total, 1);
  ck_assert_uint_eq(p.id, id);
  ck_assert_uint_eq(p.pid, 0);
  ck_assert_uint_eq(p.session_id, 0);
  ck_assert_uint_eq(p.last_pid, (uint32_t)getpid());
  ck_assert_uint_eq(p.uid, (uint32_t)getuid());
  ck_assert_uint_eq(p.bytes, SIZE);
  ck_assert_int_eq(p.state, GPUMEM_ACTIVE);
  /* A restarted engine (another session) takes it with the contents. */
  gpumem_client *w2 = open_client("engine-2", GPUMEM_ROLE_WORKER);
  ck_assert_int_eq(gpumem_attach(w2, "w0", &b), 0);
  ck_assert_str_eq(gpumem_buffer_tag(b), "weights");
  ck_assert_uint_eq(gpumem_buffer_size(b), SIZE);
  ck_assert(holds(w2, b, 0xfeed0002u));
  p = persistent(ctl, "w0", NULL);
  ck_assert_uint_eq(p.pid, (uint32_t)getpid());
  ck_assert_uint_eq(p.idle_ms, 0);
  /* Held: nobody drops it or attaches it twice. */
  uint64_t freed = 1;
  ck_assert_int_eq(gpumem_drop(ctl, "w0", (uint32_t)getuid(), &freed), GPUMEM_E_WRONG_STATE);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "held by pid"));
  gpumem_buffer *twice;
  gpumem_client *w3 = open_client("engine-3", GPUMEM_ROLE_WORKER);
  ck_assert_int_eq(gpumem_attach(w3, "w0", &twice), GPUMEM_E_WRONG_STATE);
  ck_assert_int_eq(gpumem_free(w2, b), 0);
  ck_assert_int_eq(gpumem_drop(w3, "w0", 0, &freed), 0);
  ck_assert_uint_eq(freed, SIZE);
  ck_assert_uint_eq(daemon_bytes(), before);
  ck_assert_int_eq(gpumem_attach(w3, "w0", &twice), GPUMEM_E_NOT_FOUND);
  persistent(ctl, "w0", &total);
  ck_assert_uint_eq(total, 0);
  gpumem_disconnect(w3);
  gpumem_disconnect(w2);
  gpumem_disconnect(ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* While no process holds it, a pause releases it (the daemon keeps its
 * backup) and a resume makes it again with its contents; attached while
 * paused, it comes mapped at the resume. */
START_TEST(a_held_by_none_buffer_pauses_and_resumes_with_its_tag) {
  daemon_start(&d, NULL);
  uint64_t before = daemon_bytes();
  gpumem_client *w = open_client("engine-1", GPUMEM_ROLE_WORKER);
  gpumem_client *ctl = open_client("ctl", GPUMEM_ROLE_CONTROLLER);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc_persistent(w, "w0", "weights", 0, SIZE, GPUMEM_BACKUP, &b), 0);
  fill(w, b, 0xabcd0001u);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  ck_assert_int_eq(client_op(ctl, "weights", false), 0);
  ck_assert_uint_eq(daemon_bytes(), before);
  ck_assert_int_eq(persistent(ctl, "w0", NULL).state, GPUMEM_PAUSED);
  ck_assert_int_eq(client_op(ctl, "weights", true), 0);
  ck_assert_uint_eq(daemon_bytes(), before + SIZE);
  ck_assert_int_eq(persistent(ctl, "w0", NULL).state, GPUMEM_ACTIVE);
  ck_assert_int_eq(gpumem_attach(w, "w0", &b), 0);
  ck_assert(holds(w, b, 0xabcd0001u));
  fill(w, b, 0xabcd0002u);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  /* Paused, then attached: reserved only, mapped with the contents at the
   * resume. */
  ck_assert_int_eq(client_op(ctl, "weights", false), 0);
  ck_assert_int_eq(gpumem_attach(w, "w0", &b), 0);
  ck_assert_int_eq(gpumem_buffer_mapped(b), 0);
  ck_assert_int_eq(client_op(ctl, "weights", true), 0);
  ck_assert_int_eq(gpumem_buffer_mapped(b), 1);
  ck_assert(holds(w, b, 0xabcd0002u));
  gpumem_disconnect(w);
  await_unheld(ctl, "w0");
  uint64_t freed = 0;
  ck_assert_int_eq(gpumem_drop(ctl, "w0", (uint32_t)getuid(), &freed), 0);
  ck_assert_uint_eq(freed, SIZE);
  ck_assert_uint_eq(daemon_bytes(), before);
  gpumem_disconnect(ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* A holder that ends its session but still maps the memory: the pause
 * says so (NOT_RELEASED) rather than count it released. */
START_TEST(a_pause_sees_a_last_holder_that_still_maps_it) {
  daemon_start(&d, NULL);
  struct peer p;
  peer_open(&p, &d, WORKER);
  Gpumem__Wire__AllocRequest a = GPUMEM__WIRE__ALLOC_REQUEST__INIT;
  a.tag = "weights";
  a.size = SIZE;
  a.flags = GPUMEM__WIRE__BUFFER_FLAG__FLAG_PERSIST;
  a.name = "w0";
  wire_env env = peer_env(p.next_id++, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC);
  env.alloc = &a;
  peer_put(&p, &env, NULL, 0);
  struct frame f;
  wire_env *r = peer_get_within(&p, &f, harness_patience_ms(5000));
  ck_assert_ptr_nonnull(r);
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY);
  ck_assert_uint_eq(f.nfds, 1);
  void *m = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, f.fds[0], 0);
  ck_assert_ptr_ne(m, MAP_FAILED);
  frame_release(&f); /* closes the fd; the mapping stays */
  wire_env_free(r);
  peer_close(&p); /* the session ends; the mapping stays */
  gpumem_client *ctl = open_client("ctl", GPUMEM_ROLE_CONTROLLER);
  await_unheld(ctl, "w0");
  ck_assert_int_eq(client_op(ctl, "weights", false), GPUMEM_E_NOT_RELEASED);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "still maps it"));
  munmap(m, SIZE);
  ck_assert_int_eq(client_op(ctl, "weights", false), 0);
  ck_assert_int_eq(persistent(ctl, "w0", NULL).state, GPUMEM_PAUSED);
  gpumem_disconnect(ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* Names are per uid: another uid can take the same name for its own
 * buffer, and can neither attach nor drop this uid's. */
START_TEST(another_uid_cannot_take_or_drop_a_name) {
  if (geteuid() != 0) {
    printf("another_uid_cannot_take_or_drop_a_name: skipped: needs root\n");
    return;
  }
  daemon_start(&d, "--socket-mode", "0666", NULL);
  ck_assert_int_eq(chmod(d.dir, 0755), 0);
  gpumem_client *w = open_client("alice", GPUMEM_ROLE_WORKER);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc_persistent(w, "w0", "weights", 0, SIZE, 0, &b), 0);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  ck_assert_int_eq(seteuid(1002), 0);
  gpumem_client *m = open_client("mallory", GPUMEM_ROLE_WORKER);
  ck_assert_int_eq(seteuid(0), 0);
  gpumem_buffer *mb;
  ck_assert_int_eq(gpumem_attach(m, "w0", &mb), GPUMEM_E_NOT_FOUND);
  ck_assert_int_eq(gpumem_drop(m, "w0", 0, NULL), GPUMEM_E_NOT_FOUND);
  ck_assert_int_eq(gpumem_alloc_persistent(m, "w0", "mallory-w", 0, SIZE, 0, &mb), 0);
  ck_assert_int_eq(gpumem_attach(w, "w0", &b), 0);
  ck_assert_str_eq(gpumem_buffer_tag(b), "weights");
  /* The name taken twice by one uid is refused, saying which. */
  gpumem_buffer *dup;
  ck_assert_int_eq(gpumem_alloc_persistent(w, "w0", "weights", 0, SIZE, 0, &dup),
                   GPUMEM_E_WRONG_STATE);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "has a persistent buffer 'w0' already"));
  gpumem_disconnect(m);
  gpumem_disconnect(w);
  gpumem_client *ctl = open_client("ctl", GPUMEM_ROLE_CONTROLLER);
  await_none_held(ctl);
  uint64_t total;
  persistent(ctl, "w0", &total);
  ck_assert_uint_eq(total, 2);
  ck_assert_int_eq(gpumem_drop(ctl, "w0", 1002, NULL), 0);
  ck_assert_int_eq(gpumem_drop(ctl, "w0", (uint32_t)getuid(), NULL), 0);
  persistent(ctl, "w0", &total);
  ck_assert_uint_eq(total, 0);
  gpumem_disconnect(ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* Bad requests: each refused, saying why, nothing made. */
START_TEST(bad_persistent_requests_are_refused) {
  daemon_start(&d, NULL);
  gpumem_client *w = open_client("engine", GPUMEM_ROLE_WORKER);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, SIZE, GPUMEM_PERSIST, &b), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_alloc_persistent(w, "bad name", "weights", 0, SIZE, 0, &b),
                   GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_alloc_persistent(w, "w0", "weights", 0, SIZE, GPUMEM_IPC_LEGACY, &b),
                   GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_attach(w, "", &b), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_attach(w, "nothing", &b), GPUMEM_E_NOT_FOUND);
  gpumem_disconnect(w);
  /* The daemon's edge, without the library's checks. */
  struct peer p;
  peer_open(&p, &d, WORKER);
  const struct {
    uint32_t flags;
    const char *name;
    const char *why;
  } bad[] = {
      {GPUMEM__WIRE__BUFFER_FLAG__FLAG_PERSIST, "", "needs a name"},
      {0, "w0", "for PERSIST buffers only"},
      {GPUMEM__WIRE__BUFFER_FLAG__FLAG_PERSIST, "a/b", "needs a name"},
      {GPUMEM__WIRE__BUFFER_FLAG__FLAG_PERSIST | GPUMEM__WIRE__BUFFER_FLAG__FLAG_IPC_LEGACY,
       "w0", "cannot be PERSIST"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    Gpumem__Wire__AllocRequest a = GPUMEM__WIRE__ALLOC_REQUEST__INIT;
    a.tag = "weights";
    a.size = SIZE;
    a.flags = bad[i].flags;
    a.name = (char *)bad[i].name;
    wire_env env = peer_env(p.next_id++, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC);
    env.alloc = &a;
    peer_put(&p, &env, NULL, 0);
    wire_env *r = peer_get_within(&p, NULL, harness_patience_ms(5000));
    ck_assert_ptr_nonnull(r);
    ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_ERROR);
    ck_assert_int_eq(r->error->code, CODE(INVALID_ARGUMENT));
    ck_assert_msg(strstr(r->error->message, bad[i].why), "%zu: %s", i, r->error->message);
    wire_env_free(r);
  }
  Gpumem__Wire__AttachRequest at = GPUMEM__WIRE__ATTACH_REQUEST__INIT;
  at.name = "..\x1b[2J";
  wire_env env = peer_env(p.next_id++, GPUMEM__WIRE__ENVELOPE__BODY_ATTACH);
  env.attach = &at;
  peer_put(&p, &env, NULL, 0);
  wire_env *r = peer_get_within(&p, NULL, harness_patience_ms(5000));
  ck_assert_ptr_nonnull(r);
  ck_assert_int_eq(r->error->code, CODE(INVALID_ARGUMENT));
  wire_env_free(r);
  peer_close(&p);
  gpumem_client *ctl = open_client("ctl", GPUMEM_ROLE_CONTROLLER);
  ck_assert_int_eq(gpumem_attach(ctl, "w0", &b), GPUMEM_E_PERMISSION);
  uint64_t total = 1;
  persistent(ctl, "w0", &total);
  ck_assert_uint_eq(total, 0);
  gpumem_disconnect(ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* A daemon killed with SIGKILL: the buffer a worker holds comes back with
 * its name when the worker re-registers (the journal knows it), and can be
 * let go of and attached again; the one no process held went with the
 * daemon, as the next one logs, and its name is free again. */
START_TEST(a_held_persistent_buffer_survives_a_daemon_restart) {
  daemon_start(&d, NULL);
  gpumem_client *w = open_client("engine", GPUMEM_ROLE_WORKER);
  struct conn_events ev;
  conn_events_watch(&ev, w);
  gpumem_buffer *held, *kept;
  ck_assert_int_eq(gpumem_alloc_persistent(w, "held", "weights", 0, SIZE, 0, &held), 0);
  ck_assert_int_eq(gpumem_alloc_persistent(w, "kept", "weights", 0, SIZE, 0, &kept), 0);
  fill(w, held, 0x600d0001u);
  ck_assert_int_eq(gpumem_free(w, kept), 0);
  kill(d.pid, SIGKILL);
  ck_assert_int_eq(waitpid(d.pid, NULL, 0), d.pid);
  d.pid = daemon_spawn(d.socket, d.log, NULL);
  ck_assert(conn_events_wait(&ev, 1, 1));
  ck_assert_int_eq(daemon_log_count(&d, "persistent buffer 'kept' of uid"), 1);
  ck_assert_int_eq(daemon_log_count(&d, "went with it"), 1);
  ck_assert(holds(w, held, 0x600d0001u));
  ck_assert_str_eq(gpumem_buffer_name(held), "held");
  gpumem_client *ctl = open_client("ctl", GPUMEM_ROLE_CONTROLLER);
  uint64_t total;
  struct gpumem_buffer_info p = persistent(ctl, "held", &total);
  ck_assert_uint_eq(total, 1);
  ck_assert_uint_eq(p.pid, (uint32_t)getpid());
  ck_assert_uint_eq(p.id, gpumem_buffer_id(held));
  ck_assert_int_eq(gpumem_free(w, held), 0);
  ck_assert_int_eq(gpumem_attach(w, "held", &held), 0);
  ck_assert(holds(w, held, 0x600d0001u));
  ck_assert_int_eq(gpumem_alloc_persistent(w, "kept", "weights", 0, SIZE, 0, &kept), 0);
  gpumem_disconnect(w);
  await_none_held(ctl);
  ck_assert_int_eq(gpumem_drop(ctl, "held", (uint32_t)getuid(), NULL), 0);
  ck_assert_int_eq(gpumem_drop(ctl, "kept", (uint32_t)getuid(), NULL), 0);
  gpumem_disconnect(ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* A connection that drops while the process lives (the daemon ended its
 * session) is made again to the same daemon, and what the process held
 * comes back with it: its persistent buffer (which the daemon kept
 * meanwhile) under the same id and contents, its plain buffer too; also
 * after a restart that loaded a journal, where the daemon takes back only
 * what it can prove. */
static void reconnect_keeps_buffers(bool journal_loaded) {
  daemon_start(&d, NULL);
  if (journal_loaded) { /* a daemon that started from its predecessor's journal */
    kill(d.pid, SIGKILL);
    ck_assert_int_eq(waitpid(d.pid, NULL, 0), d.pid);
    d.pid = daemon_spawn(d.socket, d.log, NULL);
    ck_assert(daemon_wait_ready(&d));
  }
  gpumem_client *w = open_client("engine", GPUMEM_ROLE_WORKER);
  struct conn_events ev;
  conn_events_watch(&ev, w);
  gpumem_buffer *kept, *plain, *paused;
  ck_assert_int_eq(gpumem_alloc_persistent(w, "w0", "weights", 0, SIZE, 0, &kept), 0);
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, SIZE, 0, &plain), 0);
  ck_assert_int_eq(gpumem_alloc(w, "cache", 0, SIZE, 0, &paused), 0);
  uint64_t id = gpumem_buffer_id(kept);
  fill(w, kept, 0x0dd0001u);
  fill(w, plain, 0x0dd0002u);
  gpumem_client *ctl = open_client("ctl", GPUMEM_ROLE_CONTROLLER);
  ck_assert_int_eq(client_op(ctl, "cache", false), 0); /* one comes back paused, memory-less */
  gpumem_disconnect(ctl);
  ck_assert_int_eq(cut_connections(), 1);
  ck_assert(conn_events_wait(&ev, 1, 1));
  ck_assert_msg(ev.code == 0, "%s", ev.words);
  ck_assert_uint_eq(ev.count, 3);
  ck_assert_uint_eq(gpumem_buffer_id(kept), id);
  ck_assert(holds(w, kept, 0x0dd0001u));
  ck_assert(holds(w, plain, 0x0dd0002u));
  ctl = open_client("ctl", GPUMEM_ROLE_CONTROLLER);
  uint64_t total;
  struct gpumem_buffer_info p = persistent(ctl, "w0", &total);
  ck_assert_uint_eq(total, 1);
  ck_assert_uint_eq(p.pid, (uint32_t)getpid());
  /* Held by this process again: a pause and a resume go through it. */
  ck_assert_int_eq(client_op(ctl, "weights", false), 0);
  ck_assert_int_eq(client_op(ctl, "weights", true), 0);
  ck_assert_int_eq(gpumem_buffer_mapped(paused), 0);
  ck_assert_int_eq(client_op(ctl, "cache", true), 0);
  ck_assert_int_eq(gpumem_buffer_mapped(paused), 1);
  ck_assert_int_eq(gpumem_free(w, plain), 0);
  ck_assert_int_eq(gpumem_free(w, paused), 0);
  ck_assert_int_eq(gpumem_free(w, kept), 0);
  gpumem_disconnect(w);
  await_none_held(ctl);
  ck_assert_int_eq(gpumem_drop(ctl, "w0", (uint32_t)getuid(), NULL), 0);
  gpumem_disconnect(ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}

START_TEST(a_reconnection_keeps_what_the_process_held) { reconnect_keeps_buffers(false); }
END_TEST

START_TEST(a_reconnection_after_a_journaled_restart_keeps_it_too) {
  reconnect_keeps_buffers(true);
}
END_TEST

/* Allocate persistent buffer name in tag through a raw peer and map its
 * memory (the mapping outlives the fd and the session). */
static void *peer_alloc_mapped(struct peer *p, const char *name) {
  Gpumem__Wire__AllocRequest a = GPUMEM__WIRE__ALLOC_REQUEST__INIT;
  a.tag = "weights";
  a.size = SIZE;
  a.flags = GPUMEM__WIRE__BUFFER_FLAG__FLAG_PERSIST;
  a.name = (char *)name;
  wire_env env = peer_env(p->next_id++, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC);
  env.alloc = &a;
  peer_put(p, &env, NULL, 0);
  struct frame f;
  wire_env *r = peer_get_within(p, &f, harness_patience_ms(5000));
  ck_assert_ptr_nonnull(r);
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY);
  ck_assert_uint_eq(f.nfds, 1);
  void *m = mmap(NULL, SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, f.fds[0], 0);
  ck_assert_ptr_ne(m, MAP_FAILED);
  frame_release(&f);
  wire_env_free(r);
  return m;
}

/* In a child process (another pid than the last holder's), attach name:
 * the library's code. */
static int attach_from_child(const char *name) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    gpumem_client *c;
    if (gpumem_connect(d.socket, "standby", GPUMEM_ROLE_WORKER, 0, &c) < 0) _exit(100);
    gpumem_buffer *b;
    int rc = gpumem_attach(c, name, &b);
    if (rc == GPUMEM_E_WRONG_STATE && !strstr(gpumem_last_error(), "still maps it")) _exit(101);
    gpumem_disconnect(c);
    _exit(-rc);
  }
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert(WIFEXITED(status));
  return -WEXITSTATUS(status);
}

/* While the process that let go of a buffer still maps it, a drop frees
 * nothing and says so, and another process cannot attach it (two
 * processes would write one buffer, each thinking it its own); once it
 * unmaps, both go through. */
START_TEST(a_last_holder_that_maps_it_keeps_drop_and_attach_away) {
  daemon_start(&d, NULL);
  uint64_t before = daemon_bytes();
  struct peer p;
  peer_open(&p, &d, WORKER);
  void *m = peer_alloc_mapped(&p, "w0");
  peer_close(&p);
  gpumem_client *ctl = open_client("ctl", GPUMEM_ROLE_CONTROLLER);
  await_unheld(ctl, "w0");
  uint64_t bytes = 1;
  ck_assert_int_eq(gpumem_drop(ctl, "w0", (uint32_t)getuid(), &bytes), GPUMEM_E_NOT_RELEASED);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "still maps it"));
  ck_assert_uint_eq(daemon_bytes(), before + SIZE);
  ck_assert_int_eq(attach_from_child("w0"), GPUMEM_E_WRONG_STATE);
  ck_assert_uint_eq(persistent(ctl, "w0", NULL).pid, 0);
  munmap(m, SIZE);
  ck_assert_int_eq(attach_from_child("w0"), 0); /* attached, then let go of at its exit */
  await_unheld(ctl, "w0");
  ck_assert_int_eq(gpumem_drop(ctl, "w0", (uint32_t)getuid(), &bytes), 0);
  ck_assert_uint_eq(bytes, SIZE);
  ck_assert_uint_eq(daemon_bytes(), before);
  gpumem_disconnect(ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* An attach that says which devices the process sees is refused for a
 * buffer on another, before anything is handed over: the buffer stays
 * with the daemon, for a process that sees its device. */
START_TEST(an_attach_from_a_process_that_does_not_see_the_device_is_refused) {
  daemon_start(&d, "--host-devices", "2", NULL);
  gpumem_client *w = open_client("engine", GPUMEM_ROLE_WORKER);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc_persistent(w, "w0", "weights", 0, SIZE, 0, &b), 0);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  struct peer p;
  peer_open(&p, &d, WORKER);
  Gpumem__Wire__AttachRequest at = GPUMEM__WIRE__ATTACH_REQUEST__INIT;
  at.name = "w0";
  at.devices = 2; /* device 1 only */
  wire_env env = peer_env(p.next_id++, GPUMEM__WIRE__ENVELOPE__BODY_ATTACH);
  env.attach = &at;
  peer_put(&p, &env, NULL, 0);
  wire_env *r = peer_get_within(&p, NULL, harness_patience_ms(5000));
  ck_assert_ptr_nonnull(r);
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_ERROR);
  ck_assert_int_eq(r->error->code, CODE(INVALID_ARGUMENT));
  ck_assert_msg(strstr(r->error->message, "does not see"), "%s", r->error->message);
  wire_env_free(r);
  peer_close(&p);
  ck_assert_int_eq(gpumem_attach(w, "w0", &b), 0);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  ck_assert_int_eq(gpumem_drop(w, "w0", 0, NULL), 0);
  gpumem_disconnect(w);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* After a restart, the name of a persistent buffer the journal expects
 * back is its holder's until the grace ends: another process of the uid
 * cannot take it first. */
START_TEST(a_journaled_name_is_kept_for_its_holder_during_the_grace) {
  daemon_start(&d, NULL);
  struct peer p;
  peer_open(&p, &d, WORKER);
  void *m = peer_alloc_mapped(&p, "w0");
  kill(d.pid, SIGKILL);
  ck_assert_int_eq(waitpid(d.pid, NULL, 0), d.pid);
  const char *extra[] = {"--adopt-grace", "60s", NULL};
  d.pid = daemon_spawn(d.socket, d.log, extra);
  ck_assert(daemon_wait_ready(&d));
  gpumem_client *w = open_client("engine-2", GPUMEM_ROLE_WORKER);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc_persistent(w, "w0", "weights", 0, SIZE, 0, &b),
                   GPUMEM_E_WRONG_STATE);
  ck_assert_msg(strstr(gpumem_last_error(), "its name is kept until the grace ends"), "%s",
                gpumem_last_error());
  ck_assert_int_eq(gpumem_alloc_persistent(w, "w1", "weights", 0, SIZE, 0, &b), 0);
  gpumem_disconnect(w);
  munmap(m, SIZE);
  peer_close(&p);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* What a standby's waiting attach got. */
struct standby {
  gpumem_client *c;
  unsigned wait_ms;
  int rc;
  gpumem_buffer *b;
  char why[256];
};

/* A thread's waiting attach of w0. */
static void *standby_attach(void *arg) {
  struct standby *sb = arg;
  sb->rc = gpumem_attach_wait(sb->c, "w0", sb->wait_ms, &sb->b);
  snprintf(sb->why, sizeof sb->why, "%s", sb->rc < 0 ? gpumem_last_error() : "");
  return NULL;
}

/* A standby's attach waits while the engine holds the buffer, and gets it
 * with its contents the moment the engine dies; one whose wait ends first
 * is told so, and the buffer stays where it was. */
START_TEST(a_standby_attach_waits_for_the_engine_to_die) {
  daemon_start(&d, NULL);
  int ready[2];
  ck_assert_int_eq(pipe(ready), 0);
  pid_t engine = fork();
  ck_assert_int_ge(engine, 0);
  if (engine == 0) {
    close(ready[0]);
    gpumem_client *e;
    gpumem_buffer *b;
    if (gpumem_connect(d.socket, "engine", GPUMEM_ROLE_WORKER, 0, &e) < 0 ||
        gpumem_alloc_persistent(e, "w0", "weights", 0, SIZE, 0, &b) < 0 ||
        gpumem_buffer_fill32(e, b, 0, SIZE, 0x57a0db1u) < 0)
      _exit(1);
    char c = 1;
    if (write(ready[1], &c, 1) != 1) _exit(2);
    for (;;) pause(); /* holds it until killed */
  }
  close(ready[1]);
  char c;
  ck_assert_int_eq(read(ready[0], &c, 1), 1);
  close(ready[0]);
  gpumem_client *w = open_client("standby", GPUMEM_ROLE_WORKER);
  struct standby early = {.c = w, .wait_ms = 100};
  standby_attach(&early);
  ck_assert_int_eq(early.rc, GPUMEM_E_WRONG_STATE);
  ck_assert_msg(strstr(early.why, "is held by pid") && strstr(early.why, "waited"), "%s",
                early.why);
  struct standby sb = {.c = w, .wait_ms = 20000};
  pthread_t t;
  ck_assert_int_eq(pthread_create(&t, NULL, standby_attach, &sb), 0);
  for (double end = now_ms() + harness_patience_ms(5000);
       daemon_log_count(&d, "waits up to 20000 ms to attach 'w0'") < 1 && now_ms() < end;) {
  }
  ck_assert_int_eq(daemon_log_count(&d, "waits up to 20000 ms to attach 'w0'"), 1);
  kill(engine, SIGKILL);
  ck_assert_int_eq(waitpid(engine, NULL, 0), engine);
  pthread_join(t, NULL);
  ck_assert_msg(sb.rc == 0, "%s", sb.why);
  ck_assert(holds(w, sb.b, 0x57a0db1u));
  ck_assert_int_eq(gpumem_free(w, sb.b), 0);
  ck_assert_int_eq(gpumem_drop(w, "w0", 0, NULL), 0);
  gpumem_disconnect(w);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* Run gpumemctl as nobody with args (NULL-terminated); its exit status,
 * its output in out. */
static int ctl_as_nobody(char *out, size_t len, ...) {
  const char *argv[16] = {"gpumemctl", "--socket", d.socket};
  va_list ap;
  va_start(ap, len);
  size_t n = 3;
  for (const char *a; n < 15 && (a = va_arg(ap, const char *));) argv[n++] = a;
  va_end(ap);
  argv[n] = NULL;
  int fds[2];
  ck_assert_int_eq(pipe(fds), 0);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    if (setgid(65534) < 0 || setuid(65534) < 0) _exit(99);
    execv(harness_others_bin("gpumemctl"), (char *const *)argv);
    _exit(98);
  }
  close(fds[1]);
  size_t got = 0;
  ssize_t k;
  while (got < len - 1 && (k = read(fds[0], out + got, len - 1 - got)) > 0) got += (size_t)k;
  out[got] = '\0';
  close(fds[0]);
  int status;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* gpumemctl drop by a user with no controller's rights drops that user's
 * own buffer through a worker session; another uid's it cannot, and says
 * what it would need. */
START_TEST(gpumemctl_drops_its_users_own_buffer_without_rights) {
  if (!harness_others_can_run("gpumemctl_drops_its_users_own_buffer_without_rights")) return;
  daemon_start(&d, "--socket-mode", "0666", NULL);
  ck_assert_int_eq(chmod(d.dir, 0755), 0);
  ck_assert_int_eq(seteuid(65534), 0);
  gpumem_client *w = open_client("nobody-engine", GPUMEM_ROLE_WORKER);
  ck_assert_int_eq(seteuid(0), 0);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc_persistent(w, "w0", "weights", 0, SIZE, 0, &b), 0);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  gpumem_disconnect(w);
  char out[4096];
  ck_assert_int_eq(ctl_as_nobody(out, sizeof out, "drop", "w0", "--uid", "0", NULL), 1);
  ck_assert_msg(strstr(out, "PERMISSION_DENIED") && strstr(out, "needs a controller's rights"),
                "%s", out);
  ck_assert_int_eq(ctl_as_nobody(out, sizeof out, "drop", "w0", NULL), 0);
  ck_assert_msg(strstr(out, "w0 of uid 65534: dropped, 8.00 MiB"), "%s", out);
  ck_assert_int_eq(ctl_as_nobody(out, sizeof out, "drop", "w0", NULL), 1);
  ck_assert_msg(strstr(out, "NOT_FOUND"), "%s", out);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

static void teardown(void) { harness_daemon_teardown(&d); }

int main(void) {
  return HARNESS_RUN("persistent", 30, harness_fd_setup, teardown,
                     a_persistent_buffer_outlives_its_holder,
                     a_held_by_none_buffer_pauses_and_resumes_with_its_tag,
                     a_pause_sees_a_last_holder_that_still_maps_it,
                     another_uid_cannot_take_or_drop_a_name, bad_persistent_requests_are_refused,
                     a_held_persistent_buffer_survives_a_daemon_restart,
                     a_reconnection_keeps_what_the_process_held,
                     a_reconnection_after_a_journaled_restart_keeps_it_too,
                     a_last_holder_that_maps_it_keeps_drop_and_attach_away,
                     an_attach_from_a_process_that_does_not_see_the_device_is_refused,
                     a_journaled_name_is_kept_for_its_holder_during_the_grace,
                     a_standby_attach_waits_for_the_engine_to_die,
                     gpumemctl_drops_its_users_own_buffer_without_rights);
}
