/* Reading a paused buffer's backup (protocol 1.8): gpumem_backup_read
 * copies what the pause saved, gpumem_backup_view shows it in place, for
 * a worker that copied its backup itself (the memory it keeps) and one
 * whose backup the daemon copied (handed by a BackupRequest), by an
 * address anywhere inside a buffer or a pooled allocation; and every
 * refusal, from the library and from the daemon's edge. */
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/wire.h"
#include "gpumem.h"
#include "harness.h"
#include "scenario.h"

static struct daemon d;

static void teardown(void) { scene_stop(&d); }

/* A pause or resume of tag by controller c (release: asking for context
 * release); its code. */
static int op_code(gpumem_client *c, const char *tag, bool resume, bool release) {
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.release_context = release;
  struct gpumem_op_report *r = NULL;
  int rc = resume ? gpumem_resume(c, &tag, 1, NULL, 0, NULL, &r)
                  : gpumem_pause(c, &tag, 1, NULL, 0, &o, &r);
  gpumem_op_report_free(r);
  return rc;
}

/* Pause or resume tag through controller ctl, which must succeed. */
static void op(gpumem_client *ctl, const char *tag, bool resume) {
  int rc = op_code(ctl, tag, resume, false);
  ck_assert_msg(rc == 0, "%s %s: %s", resume ? "resume" : "pause", tag, gpumem_last_error());
}

/* size bytes of a pattern of seed. */
static uint8_t *pattern(uint64_t size, unsigned seed) {
  uint8_t *p = malloc(size);
  for (uint64_t i = 0; i < size; i++) p[i] = (uint8_t)(i * 131 + i / 4099 + seed);
  return p;
}

/* Both kinds of worker read their paused buffer's backup, as copies and
 * in place, at an offset; after a resume, new contents and another pause,
 * they read the new contents; the buffer keeps its contents throughout. */
START_TEST(paused_backups_read_both_ways) {
  daemon_start(&d, NULL);
  gpumem_client *w[2] = {NULL, NULL}, *ctl = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "own", GPUMEM_ROLE_WORKER, 0, &w[0]), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "dae", GPUMEM_ROLE_WORKER,
                                  GPUMEM_CONNECT_DAEMON_COPIES, &w[1]), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  const uint64_t size = 6 * MiB, off = MiB + 4096 + 17, len = 3 * MiB;
  gpumem_buffer *b[2];
  for (int k = 0; k < 2; k++)
    ck_assert_int_eq(gpumem_alloc(w[k], "weights", 0, size, GPUMEM_BACKUP, &b[k]), 0);
  uint8_t *got = malloc(size);
  for (unsigned round = 0; round < 2; round++) {
    uint8_t *want = pattern(size, round);
    for (int k = 0; k < 2; k++) ck_assert_int_eq(gpumem_buffer_write(w[k], b[k], 0, want, size), 0);
    op(ctl, "weights", false);
    for (int k = 0; k < 2; k++) {
      const uint8_t *at = (const uint8_t *)gpumem_buffer_ptr(b[k]) + off;
      memset(got, 0, size);
      ck_assert_msg(gpumem_backup_read(w[k], at, len, got) == 0, "worker %d: %s", k,
                    gpumem_last_error());
      ck_assert_msg(memcmp(got, want + off, len) == 0, "worker %d round %u: the copy differs", k,
                    round);
      const void *view = NULL;
      ck_assert_msg(gpumem_backup_view(w[k], at, len, &view) == 0, "%s", gpumem_last_error());
      ck_assert_msg(memcmp(view, want + off, len) == 0, "worker %d round %u: the view differs", k,
                    round);
      ck_assert_int_eq(gpumem_backup_read(w[k], gpumem_buffer_ptr(b[k]), size, got), 0);
      ck_assert(memcmp(got, want, size) == 0);
    }
    op(ctl, "weights", true);
    for (int k = 0; k < 2; k++) {
      ck_assert_int_eq(gpumem_backup_read(w[k], gpumem_buffer_ptr(b[k]), 1, got),
                       GPUMEM_E_WRONG_STATE);
      ck_assert_int_eq(gpumem_buffer_read(w[k], b[k], 0, got, size), 0);
      ck_assert(memcmp(got, want, size) == 0);
    }
    free(want);
  }
  for (int k = 0; k < 2; k++) {
    ck_assert_int_eq(gpumem_free(w[k], b[k]), 0);
    gpumem_disconnect(w[k]);
  }
  free(got);
  gpumem_disconnect(ctl);
}
END_TEST

/* An allocation of gpumem_malloc inside a pooled buffer is found by its
 * address, and bytes in the middle of it read. */
START_TEST(a_pooled_allocation_is_read_by_its_address) {
  daemon_start(&d, NULL);
  gpumem_client *w = NULL, *ctl = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "pool", GPUMEM_ROLE_WORKER,
                                  GPUMEM_CONNECT_DAEMON_COPIES, &w), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  void *p = NULL, *q = NULL;
  ck_assert_int_eq(gpumem_malloc(w, "weights", 0, MiB, GPUMEM_BACKUP, &p), 0);
  ck_assert_int_eq(gpumem_malloc(w, "weights", 0, MiB, GPUMEM_BACKUP, &q), 0);
  memset(q, 0x3c, MiB); /* host backend: the memory is host memory */
  memset(p, 0x11, MiB);
  op(ctl, "weights", false);
  uint8_t got[4096];
  ck_assert_msg(gpumem_backup_read(w, (char *)q + 5000, sizeof got, got) == 0, "%s",
                gpumem_last_error());
  for (size_t i = 0; i < sizeof got; i++) ck_assert_uint_eq(got[i], 0x3c);
  op(ctl, "weights", true);
  ck_assert_int_eq(gpumem_free_ptr(w, p), 0);
  ck_assert_int_eq(gpumem_free_ptr(w, q), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* What the library refuses, saying why, and what the daemon refuses. */
START_TEST(reads_that_cannot_be_are_refused) {
  daemon_start(&d, NULL);
  gpumem_client *w = NULL, *ctl = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER,
                                  GPUMEM_CONNECT_DAEMON_COPIES, &w), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  gpumem_buffer *kv = NULL, *wt = NULL, *late = NULL;
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 2 * MiB, 0, &kv), 0);
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 2 * MiB, GPUMEM_BACKUP, &wt), 0);
  uint8_t got[64];
  const void *view = NULL;
  /* Mapped: the memory itself holds the contents. */
  ck_assert_int_eq(gpumem_backup_read(w, gpumem_buffer_ptr(wt), 8, got), GPUMEM_E_WRONG_STATE);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "is mapped"));
  op(ctl, "kv", false);
  op(ctl, "weights", false);
  ck_assert_int_eq(gpumem_backup_read(w, gpumem_buffer_ptr(kv), 8, got), GPUMEM_E_WRONG_STATE);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "without GPUMEM_BACKUP"));
  ck_assert_int_eq(gpumem_backup_read(w, got, 8, got), GPUMEM_E_NOT_FOUND);
  /* Past the buffer's end. */
  ck_assert_int_eq(gpumem_backup_read(w, (char *)gpumem_buffer_ptr(wt) + 2 * MiB - 4, 8, got),
                   GPUMEM_E_NOT_FOUND);
  ck_assert_int_eq(gpumem_backup_read(w, NULL, 8, got), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_backup_view(w, gpumem_buffer_ptr(wt), 8, NULL), GPUMEM_E_INVALID);
  /* Allocated into the paused tag: never backed up, the daemon says so. */
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 2 * MiB, GPUMEM_BACKUP | GPUMEM_ALLOW_PAUSED,
                                &late), 0);
  ck_assert_int_eq(gpumem_backup_view(w, gpumem_buffer_ptr(late), 8, &view),
                   GPUMEM_E_WRONG_STATE);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "PAUSED"));
  op(ctl, "weights", true);
  op(ctl, "kv", true);
  ck_assert_int_eq(gpumem_free(w, late), 0);
  ck_assert_int_eq(gpumem_free(w, wt), 0);
  ck_assert_int_eq(gpumem_free(w, kv), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* The daemon's edge: a BackupRequest for another session's buffer, for
 * an unknown one and for a mapped one is refused with an Error and no
 * fds; for a paused one it hands the pieces. */
START_TEST(the_daemon_hands_only_its_sessions_paused_backups) {
  daemon_start(&d, NULL);
  struct peer a = {0}, b = {0}, c = {0};
  peer_open(&a, &d, WORKER);
  peer_open(&b, &d, WORKER);
  peer_open(&c, &d, CONTROLLER);
  struct pbuf x;
  peer_alloc(&a, "weights", 0, 2 * MiB, BACKUP, &x);
  uint64_t ids[] = {x.id, x.id, 999999, x.id};
  struct peer *who[] = {&b, &a, &a, &a};
  const wire_code want[] = {CODE(NOT_FOUND), CODE(WRONG_STATE), CODE(NOT_FOUND), CODE(OK)};
  for (int i = 0; i < 4; i++) {
    if (i == 3) scene_served(&c, &a, &x, 1, false, "weights");
    Gpumem__Wire__BackupRequest q = GPUMEM__WIRE__BACKUP_REQUEST__INIT;
    q.buffer_id = ids[i];
    wire_env env = peer_env(who[i]->next_id++, GPUMEM__WIRE__ENVELOPE__BODY_BACKUP);
    env.backup = &q;
    peer_put(who[i], &env, NULL, 0);
    struct frame f;
    wire_env *r = peer_get(who[i], &f);
    char why[256] = "";
    ck_assert_msg(peer_reply_code(r, why, sizeof why) == want[i], "request %d: %s", i, why);
    if (want[i] == CODE(OK)) {
      ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_BACKUP_REPLY);
      ck_assert_uint_eq(r->backup_reply->backup->buffer_id, x.id);
      ck_assert_uint_eq(f.nfds, r->backup_reply->backup->n_piece_sizes);
      ck_assert_uint_ge(f.nfds, 1);
    } else {
      ck_assert_uint_eq(f.nfds, 0);
    }
    frame_release(&f);
    wire_env_free(r);
  }
  scene_served(&c, &a, &x, 1, true, "weights");
  peer_unmap(&x);
  peer_close(&c);
  peer_close(&b);
  peer_close(&a);
}
END_TEST

/* A worker whose backups the daemon copies, opted in to context release,
 * reads its paused buffer's backup (the daemon hands it the memory): its
 * next pause still releases its context, the memory read having been let
 * go of with the unmap (so later reads ask the daemon, which hands only a
 * backup that holds the contents). */
START_TEST(a_read_keeps_no_memory_past_the_next_pause) {
  daemon_start(&d, NULL);
  int to_c[2], to_p[2];
  ck_assert_int_eq(pipe(to_c), 0);
  ck_assert_int_eq(pipe(to_p), 0);
  pid_t child = fork();
  if (child == 0) {
    char x;
    gpumem_client *w = NULL;
    gpumem_buffer *b = NULL;
    if (gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER,
                       GPUMEM_CONNECT_RELEASE_CONTEXT | GPUMEM_CONNECT_DAEMON_COPIES, &w) ||
        gpumem_alloc(w, "weights", 0, 2 * MiB, GPUMEM_BACKUP, &b) ||
        gpumem_buffer_fill32(w, b, 0, 2 * MiB, 0x11))
      _exit(2);
    (void)!write(to_p[1], "a", 1);
    (void)!read(to_c[0], &x, 1); /* paused */
    uint32_t v = 0;
    int rc = gpumem_backup_read(w, gpumem_buffer_ptr(b), 4, &v);
    (void)!write(to_p[1], rc == 0 && v == 0x11 ? "r" : "f", 1);
    (void)!read(to_c[0], &x, 1);
    _exit(0);
  }
  char x;
  ck_assert_int_eq(read(to_p[0], &x, 1), 1);
  ck_assert_int_eq(x, 'a');
  gpumem_client *c = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &c), 0);
  ck_assert_int_eq(op_code(c, "weights", false, false), 0);
  ck_assert_int_eq(write(to_c[1], "g", 1), 1);
  ck_assert_int_eq(read(to_p[0], &x, 1), 1);
  ck_assert_int_eq(x, 'r');
  ck_assert_int_eq(op_code(c, "weights", true, false), 0);
  ck_assert_msg(op_code(c, "weights", false, true) == 0, "the release after a read: %s",
                gpumem_last_error());
  ck_assert_int_eq(op_code(c, "weights", true, false), 0);
  ck_assert_int_eq(write(to_c[1], "e", 1), 1);
  int st;
  ck_assert_int_eq(waitpid(child, &st, 0), child);
  ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  gpumem_disconnect(c);
  close(to_c[0]);
  close(to_c[1]);
  close(to_p[0]);
  close(to_p[1]);
}
END_TEST

int main(void) {
  return HARNESS_RUN("backup_read", 60, NULL, teardown, paused_backups_read_both_ways,
                     a_pooled_allocation_is_read_by_its_address,
                     reads_that_cannot_be_are_refused,
                     the_daemon_hands_only_its_sessions_paused_backups,
                     a_read_keeps_no_memory_past_the_next_pause);
}
