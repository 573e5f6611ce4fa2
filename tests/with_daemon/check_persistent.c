/* Persistent buffers: named, kept by the daemon (memory and contents,
 * as the kernel counts the daemon's memfds) when their holder frees them
 * or ends, paused and resumed with their tag while no process holds them,
 * attached again by a process of their uid with the same contents, and
 * freed only by a drop; names are per uid, and another uid can neither
 * take nor drop them. */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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

static void teardown(void) { harness_daemon_teardown(&d); }

int main(void) {
  return HARNESS_RUN("persistent", 30, harness_fd_setup, teardown,
                     a_persistent_buffer_outlives_its_holder,
                     a_held_by_none_buffer_pauses_and_resumes_with_its_tag,
                     a_pause_sees_a_last_holder_that_still_maps_it,
                     another_uid_cannot_take_or_drop_a_name, bad_persistent_requests_are_refused,
                     a_held_persistent_buffer_survives_a_daemon_restart);
}
