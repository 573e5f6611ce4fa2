/* The daemon's limits and its own resources: sessions per uid, buffers per
 * session, frame size, fds where none belong, running out of fds, legacy
 * IPC buffers on the host backend, and no fd left behind in the daemon. */
#include <check.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "gpumem.h"
#include "harness.h"
#include "scenario.h"

static struct daemon d;

static void teardown(void) { scene_stop(&d); }

/* Wait (up to 2 s) until the daemon serves n sessions and holds a socket
 * for each and its listener, no more: a session that ended closes its
 * socket once the loop turns (the start-up probe's among them). */
static void settle(struct peer *c, size_t n) {
  size_t now = 0;
  int socks = 0;
  for (int i = 0; i < 200; i++) {
    wire_env *s = peer_status(c);
    now = s->status_reply->n_sessions;
    wire_env_free(s);
    socks = proc_fds_with(d.pid, "socket:");
    if (now == n && socks == (int)n + 1) break;
    usleep(10000);
  }
  ck_assert_uint_eq(now, n);
  ck_assert_int_eq(socks, (int)n + 1);
}

/* The code of the reply to an alloc on device 0 (its fds are closed). */
static wire_code alloc_code(struct peer *p, const char *tag, uint64_t size, uint32_t flags) {
  struct pbuf b;
  wire_code code = peer_try_alloc(p, tag, 0, size, flags, &b);
  peer_unmap(&b);
  return code;
}

/* A session past --max-sessions-per-uid is told why and closed; the others
 * go on. */
START_TEST(sessions_per_uid_are_limited) {
  daemon_start(&d, "--max-sessions-per-uid", "2", NULL);
  struct peer a, b;
  peer_open(&a, &d, WORKER);
  peer_open(&b, &d, CONTROLLER);
  int fd = raw_connect(&d);
  struct peer c = {.fd = fd, .r = frame_reader_create(WIRE_MAX_REPLY), .w = frame_writer_create()};
  ck_assert_int_eq(peer_stray_error(&c), CODE(LIMIT_EXCEEDED));
  ck_assert_ptr_null(peer_get(&c, NULL));
  peer_close(&c);
  ck_assert_int_eq(alloc_code(&a, "kv", 2 * MiB, 0), CODE(OK));
  peer_close(&a);
  peer_close(&b);
}
END_TEST

/* A session past --max-buffers-per-session gets LIMIT_EXCEEDED and keeps
 * what it has. */
START_TEST(buffers_per_session_are_limited) {
  daemon_start(&d, "--max-buffers-per-session", "2", NULL);
  struct peer a;
  peer_open(&a, &d, WORKER);
  ck_assert_int_eq(alloc_code(&a, "kv", 2 * MiB, 0), CODE(OK));
  ck_assert_int_eq(alloc_code(&a, "kv", 2 * MiB, 0), CODE(OK));
  ck_assert_int_eq(alloc_code(&a, "kv", 2 * MiB, 0), CODE(LIMIT_EXCEEDED));
  wire_env *s = peer_status(&a);
  ck_assert_uint_eq(s->status_reply->devices[0]->managed, 4 * MiB);
  wire_env_free(s);
  peer_close(&a);
}
END_TEST

/* A uid past --max-buffers-per-uid gets LIMIT_EXCEEDED in any of its
 * sessions, naming the limit, and keeps what it has; freeing one makes
 * room again. Before the limit, one uid's sessions could each hold the
 * per-session maximum: millions of buffers, hundreds of MiB of daemon. */
START_TEST(buffers_per_uid_are_limited) {
  daemon_start(&d, "--max-buffers-per-uid", "3", NULL);
  struct peer a, b;
  peer_open(&a, &d, WORKER);
  peer_open(&b, &d, WORKER);
  ck_assert_int_eq(alloc_code(&a, "kv", 2 * MiB, 0), CODE(OK));
  ck_assert_int_eq(alloc_code(&a, "kv", 2 * MiB, 0), CODE(OK));
  struct pbuf third;
  ck_assert_int_eq(peer_try_alloc(&b, "kv", 0, 2 * MiB, 0, &third), CODE(OK));
  struct pbuf none;
  ck_assert_int_eq(peer_try_alloc(&b, "kv", 0, 2 * MiB, 0, &none), CODE(LIMIT_EXCEEDED));
  ck_assert_int_eq(alloc_code(&a, "kv", 2 * MiB, 0), CODE(LIMIT_EXCEEDED));
  wire_env *s = peer_status(&a);
  ck_assert_uint_eq(s->status_reply->devices[0]->managed, 6 * MiB);
  wire_env_free(s);
  /* One freed: room for one. */
  peer_unmap(&third);
  ck_assert_int_eq(scene_free_code(&b, third.id), CODE(OK));
  ck_assert_int_eq(alloc_code(&b, "kv", 2 * MiB, 0), CODE(OK));
  peer_close(&a);
  peer_close(&b);
}
END_TEST

/* A frame over the request limit, or fds on a request that takes none,
 * ends that session only. */
START_TEST(oversized_frames_and_stray_fds_end_the_session) {
  daemon_start(&d, NULL);
  struct peer a, b, keep;
  peer_open(&a, &d, WORKER);
  peer_open(&b, &d, WORKER);
  peer_open(&keep, &d, CONTROLLER);
  uint8_t hdr[4] = {0, 0, 2, 0}; /* 128 KiB announced */
  ck_assert_int_eq(write(a.fd, hdr, 4), 4);
  ck_assert_int_eq(peer_stray_error(&a), CODE(PROTOCOL_ERROR));
  ck_assert_ptr_null(peer_get(&a, NULL));
  Gpumem__Wire__StatusRequest sr = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = 9;
  env.fd_count = 1;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_STATUS;
  env.status = &sr;
  int extra = dup(2);
  peer_put(&b, &env, &extra, 1);
  wire_env *r = peer_get(&b, NULL);
  ck_assert_int_eq(r->error->code, CODE(PROTOCOL_ERROR));
  ck_assert_ptr_nonnull(strstr(r->error->message, "only adopt and a backup request with memory carry fds"));
  wire_env_free(r);
  ck_assert_ptr_null(peer_get(&b, NULL));
  wire_env *s = peer_status(&keep);
  ck_assert_uint_eq(s->status_reply->n_sessions, 1);
  wire_env_free(s);
  peer_close(&a);
  peer_close(&b);
  peer_close(&keep);
}
END_TEST

/* Out of fds, the daemon refuses new connections instead of failing, and
 * serves again once fds are free. */
START_TEST(out_of_fds_the_daemon_refuses_and_recovers) {
  daemon_start(&d, NULL);
  struct peer ctl;
  peer_open(&ctl, &d, CONTROLLER);
  settle(&ctl, 1);
  int open_fds = scene_cap_fds(d.pid, 4);
  enum { N = 8 };
  struct peer p[N];
  int refused = 0;
  for (int i = 0; i < N; i++) peer_connect(&p[i], &d);
  /* Each connection is either served or closed at once. */
  Gpumem__Wire__Hello h = GPUMEM__WIRE__HELLO__INIT;
  h.version_major = WIRE_VERSION_MAJOR;
  h.role = WORKER;
  h.name = "many";
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_HELLO;
  env.hello = &h;
  for (int i = 0; i < N; i++) {
    scene_queue(&p[i], &env, 1); /* id 1, its first */
    frame_writer_flush(p[i].w, p[i].fd); /* may fail: refused */
    wire_env *r = peer_get(&p[i], NULL);
    if (!r) refused++;
    wire_env_free(r);
  }
  /* Some are served (a session holds its socket and, where the kernel
   * has pidfds, one for its peer), the rest refused. */
  ck_assert_int_gt(refused, 0);
  ck_assert_int_lt(refused, N);
  wire_env *s = peer_status(&ctl);
  wire_env_free(s);
  for (int i = 0; i < N; i++) peer_close(&p[i]);
  struct rlimit rl = {(rlim_t)open_fds + 64, (rlim_t)open_fds + 64};
  prlimit(d.pid, RLIMIT_NOFILE, &rl, NULL); /* raising needs privilege: then fds freed suffice */
  struct peer again;
  peer_open(&again, &d, WORKER);
  ck_assert_int_eq(alloc_code(&again, "kv", 2 * MiB, 0), CODE(OK));
  peer_close(&again);
  peer_close(&ctl);
  ck_assert_int_eq(kill(d.pid, 0), 0);
}
END_TEST

/* On the host backend a legacy IPC buffer is shared memory that never
 * pauses: a pause of its tag skips it and says so. */
START_TEST(ipc_legacy_buffers_never_pause) {
  daemon_start(&d, NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  struct pbuf b[2];
  peer_alloc(&w, "kv", 0, 2 * MiB, GPUMEM__WIRE__BUFFER_FLAG__FLAG_IPC_LEGACY, &b[0]);
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &b[1]);
  peer_op(&c, false, "kv", 0, 0);
  wire_env *e = peer_event(&w, NULL), *r;
  ck_assert_uint_eq(e->unmap->n_buffer_ids, 1);
  ck_assert_uint_eq(e->unmap->buffer_ids[0], b[1].id);
  scene_unmap_ack(&w, e, &b[1]);
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  ck_assert_uint_eq(r->op_reply->skipped, 1);
  wire_env_free(r);
  ck_assert_uint_eq(memfd_bytes(&d.pid, 1), 2 * MiB);
  peer_unmap(&b[0]);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A whole life of buffers (alloc, pause, resume, free, a session that
 * ends with buffers) leaves the daemon with the fds it started with. */
START_TEST(the_daemon_keeps_no_fd_behind) {
  daemon_start(&d, NULL);
  struct peer w, c;
  peer_open(&c, &d, CONTROLLER);
  settle(&c, 1);
  int maxfd, before = proc_fds(d.pid, &maxfd);
  peer_open(&w, &d, WORKER);
  struct pbuf b[3];
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &b[0]);
  peer_alloc(&w, "kv", 1, 4 * MiB, 0, &b[1]);
  peer_alloc(&w, "w", 0, 2 * MiB, BACKUP, &b[2]);
  for (int round = 0; round < 2; round++) {
    scene_served(&c, &w, b, 3, false, "kv");
    scene_served(&c, &w, b, 3, true, "kv");
  }
  wire_env *r = scene_free(&w, b[0].id);
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_FREE_REPLY);
  wire_env_free(r);
  for (int i = 0; i < 3; i++) peer_unmap(&b[i]);
  peer_close(&w);
  settle(&c, 1); /* the worker's session ended with two buffers: they are freed */
  ck_assert_int_eq(proc_fds(d.pid, &maxfd), before);
  peer_close(&c);
  ck_assert_uint_eq(memfd_bytes(&d.pid, 1), 0);
}
END_TEST

/* A client's margin (gpumem_set_keep_free, torch_memory_saver's
 * memory_margin_bytes): an allocation that would leave less than it free
 * on its device fails OUT_OF_MEMORY saying so, and takes nothing; one
 * that leaves enough, or starts paused, goes through; 0 is no margin. */
START_TEST(an_allocation_keeps_the_clients_margin_free) {
  daemon_start(&d, "--host-devices", "1", "--host-device-size", "64M", NULL);
  gpumem_client *w = NULL, *ctl = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "margin", GPUMEM_ROLE_WORKER, 0, &w), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  gpumem_buffer *a = NULL, *b = NULL, *p = NULL;
  gpumem_set_keep_free(w, 32 * MiB);
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 32 * MiB, 0, &a), 0); /* leaves 32 MiB */
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 2 * MiB, 0, &b), GPUMEM_E_OUT_OF_MEMORY);
  ck_assert_msg(strstr(gpumem_last_error(), "32 MiB") || strstr(gpumem_last_error(), "33554432"),
                "%s", gpumem_last_error());
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "to keep free"));
  struct gpumem_status *s = NULL;
  ck_assert_int_eq(gpumem_status(ctl, &s), 0);
  ck_assert_uint_eq(s->devices[0]->managed, 32 * MiB); /* the refusal took nothing */
  gpumem_status_free(s);
  const char *tag = "kv";
  ck_assert_int_eq(gpumem_pause(ctl, &tag, 1, NULL, 0, NULL, NULL), 0);
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 48 * MiB, GPUMEM_ALLOW_PAUSED, &p), 0);
  ck_assert_int_eq(gpumem_buffer_mapped(p), 0); /* starts paused: no memory, no margin */
  ck_assert_int_eq(gpumem_free(w, p), 0);
  ck_assert_int_eq(gpumem_resume(ctl, &tag, 1, NULL, 0, NULL, NULL), 0);
  gpumem_set_keep_free(w, 0);
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 30 * MiB, 0, &b), 0);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  ck_assert_int_eq(gpumem_free(w, a), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

int main(void) {
  return HARNESS_RUN("limits", 20, NULL, teardown, sessions_per_uid_are_limited,
                     buffers_per_session_are_limited, buffers_per_uid_are_limited,
                     oversized_frames_and_stray_fds_end_the_session,
                     out_of_fds_the_daemon_refuses_and_recovers, ipc_legacy_buffers_never_pause,
                     the_daemon_keeps_no_fd_behind, an_allocation_keeps_the_clients_margin_free);
}
