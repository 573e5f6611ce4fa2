/* Backups that let go (GPUMEM_BACKUP_RELEASE, protocol 1.8): such a
 * buffer reserves no host memory while ACTIVE; its pause reserves its
 * backup against --backup-limit and makes it, its resume restores it and
 * lets go of it. A pause whose backups do not fit fails before it unmaps
 * anything, naming the limit. Status says, per tag, what backups hold and
 * reserve. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "common/wire.h"
#include "gpumem.h"
#include "harness.h"
#include "scenario.h"

static struct daemon d;

static void teardown(void) { scene_stop(&d); }

/* The daemon's host memory reserved for backups, by its status. */
static uint64_t reserved(gpumem_client *c) {
  struct gpumem_status *s = NULL;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  uint64_t r = s->backup_reserved;
  gpumem_status_free(s);
  return r;
}

/* A BACKUP_RELEASE buffer holds backup memory only while paused, and its
 * contents come back each time; a kept backup beside it stays reserved. */
START_TEST(a_released_backup_exists_only_while_paused) {
  daemon_start(&d, NULL);
  gpumem_client *w = NULL, *ctl = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  const uint64_t size = 4 * MiB;
  gpumem_buffer *rel = NULL, *kept = NULL;
  ck_assert_int_eq(
      gpumem_alloc(w, "weights", 0, size, GPUMEM_BACKUP | GPUMEM_BACKUP_RELEASE, &rel), 0);
  ck_assert_int_eq(gpumem_alloc(w, "kept", 0, size, GPUMEM_BACKUP, &kept), 0);
  ck_assert_uint_eq(client_tag(ctl, "weights").backup_reserved_bytes, 0);
  ck_assert_uint_eq(client_tag(ctl, "kept").backup_reserved_bytes, size);
  ck_assert_uint_eq(reserved(ctl), size);
  for (uint32_t round = 0; round < 3; round++) {
    ck_assert_int_eq(gpumem_buffer_fill32(w, rel, 0, size, 0xabc0 + round), 0);
    ck_assert_msg(client_op(ctl, "weights", false) == 0, "%s", gpumem_last_error());
    struct gpumem_tag_status t = client_tag(ctl, "weights");
    ck_assert_uint_eq(t.backup_pinned_bytes, size);
    ck_assert_uint_eq(t.backup_reserved_bytes, size);
    ck_assert_uint_eq(t.backup_bytes, size);
    ck_assert_uint_eq(reserved(ctl), 2 * size);
    ck_assert_msg(client_op(ctl, "weights", true) == 0, "%s", gpumem_last_error());
    t = client_tag(ctl, "weights");
    ck_assert_uint_eq(t.backup_pinned_bytes, 0);
    ck_assert_uint_eq(t.backup_reserved_bytes, 0);
    ck_assert_uint_eq(reserved(ctl), size);
    uint32_t got[2];
    ck_assert_int_eq(gpumem_buffer_read(w, rel, size - sizeof got, got, sizeof got), 0);
    ck_assert_uint_eq(got[1], 0xabc0 + round);
  }
  ck_assert_int_eq(gpumem_free(w, rel), 0);
  ck_assert_int_eq(gpumem_free(w, kept), 0);
  ck_assert_uint_eq(reserved(ctl), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* With --backup-limit 8M, a kept 6 MiB backup and a 4 MiB one that lets
 * go: the allocation of the second succeeds (it reserves nothing yet),
 * its pause fails naming the limit with the buffer still mapped and its
 * contents in it, and once the kept one is freed the pause succeeds. */
START_TEST(a_pause_whose_backups_do_not_fit_changes_nothing) {
  daemon_start(&d, "--backup-limit", "8M", NULL);
  gpumem_client *w = NULL, *ctl = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  gpumem_buffer *kept = NULL, *rel = NULL;
  ck_assert_int_eq(gpumem_alloc(w, "kept", 0, 6 * MiB, GPUMEM_BACKUP, &kept), 0);
  ck_assert_int_eq(
      gpumem_alloc(w, "weights", 0, 4 * MiB, GPUMEM_BACKUP | GPUMEM_BACKUP_RELEASE, &rel), 0);
  ck_assert_int_eq(gpumem_buffer_fill32(w, rel, 0, 4 * MiB, 0x5eed), 0);
  ck_assert_int_eq(client_op(ctl, "weights", false), GPUMEM_E_LIMIT);
  ck_assert_msg(strstr(gpumem_last_error(), "--backup-limit 8388608 has 2097152 left") &&
                    strstr(gpumem_last_error(), "nothing was paused"),
                "%s", gpumem_last_error());
  ck_assert_int_eq(gpumem_buffer_mapped(rel), 1);
  struct gpumem_tag_status t = client_tag(ctl, "weights");
  ck_assert_int_eq(t.state, GPUMEM_ACTIVE);
  ck_assert_uint_eq(t.backup_reserved_bytes, 0);
  ck_assert_uint_eq(reserved(ctl), 6 * MiB);
  uint32_t got = 0;
  ck_assert_int_eq(gpumem_buffer_read(w, rel, 0, &got, sizeof got), 0);
  ck_assert_uint_eq(got, 0x5eed);
  ck_assert_int_eq(gpumem_free(w, kept), 0);
  ck_assert_msg(client_op(ctl, "weights", false) == 0, "%s", gpumem_last_error());
  ck_assert_uint_eq(reserved(ctl), 4 * MiB);
  ck_assert_msg(client_op(ctl, "weights", true) == 0, "%s", gpumem_last_error());
  ck_assert_int_eq(gpumem_buffer_read(w, rel, 0, &got, sizeof got), 0);
  ck_assert_uint_eq(got, 0x5eed);
  ck_assert_uint_eq(reserved(ctl), 0);
  ck_assert_int_eq(gpumem_free(w, rel), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* BACKUP_RELEASE needs BACKUP: the library and the daemon's edge say so. */
START_TEST(a_release_policy_without_a_backup_is_refused) {
  daemon_start(&d, NULL);
  gpumem_client *w = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  void *p = NULL;
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, MiB, GPUMEM_BACKUP_RELEASE, &p), GPUMEM_E_INVALID);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "GPUMEM_BACKUP_DISK (with GPUMEM_BACKUP)"));
  ck_assert_int_eq(gpumem_set_thread_tag("kv", GPUMEM_BACKUP_RELEASE), GPUMEM_E_INVALID);
  gpumem_buffer *b = NULL;
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, MiB, GPUMEM_BACKUP_RELEASE, &b), GPUMEM_E_INVALID);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "a backup policy without BACKUP"));
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, MiB, GPUMEM_BACKUP_PAGEABLE, &b), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, MiB, GPUMEM_BACKUP | GPUMEM_BACKUP_RELEASE, &p), 0);
  ck_assert_int_eq(gpumem_free_ptr(w, p), 0);
  gpumem_disconnect(w);
}
END_TEST

/* The daemon's anonymous memory, by the kernel (RssAnon, bytes). */
static uint64_t daemon_anon(void) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)d.pid);
  FILE *f = fopen(path, "re");
  ck_assert_ptr_nonnull(f);
  unsigned long long kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "RssAnon: %llu kB", &kb) == 1) break;
  fclose(f);
  return (uint64_t)kb * 1024;
}

/* --backup-overflow pageable: a backup past --backup-limit is pageable
 * memory instead of refused; the pause makes it (the kernel's RssAnon of
 * the daemon grows by it), the daemon copies it although the worker
 * copies its own pinned backups, and the contents come back. A buffer
 * that asks (GPUMEM_BACKUP_PAGEABLE) gets one too. Read while paused,
 * each is copied into memory of the reader's (1.10). */
START_TEST(a_backup_past_the_limit_can_be_pageable) {
  daemon_start(&d, "--backup-limit", "8M", "--backup-overflow", "pageable", NULL);
  gpumem_client *w = NULL, *ctl = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  const uint64_t size = 6 * MiB;
  gpumem_buffer *pinned = NULL, *over = NULL, *asked = NULL;
  ck_assert_int_eq(gpumem_alloc(w, "a", 0, size, GPUMEM_BACKUP, &pinned), 0);
  ck_assert_int_eq(gpumem_alloc(w, "b", 0, size, GPUMEM_BACKUP, &over), 0);
  ck_assert_int_eq(gpumem_alloc(w, "c", 0, size, GPUMEM_BACKUP | GPUMEM_BACKUP_PAGEABLE, &asked),
                   0);
  ck_assert_uint_eq(reserved(ctl), size); /* only the first fit the pinned budget */
  gpumem_buffer *all[] = {pinned, over, asked};
  for (int i = 0; i < 3; i++) ck_assert_int_eq(gpumem_buffer_fill32(w, all[i], 0, size, 0x100 + i), 0);
  uint64_t anon0 = daemon_anon();
  const char *tags[] = {"a", "b", "c"};
  struct gpumem_op_report *r = NULL;
  ck_assert_msg(gpumem_pause(ctl, tags, 3, NULL, 0, NULL, &r) == 0, "%s", gpumem_last_error());
  ck_assert_uint_eq(r->backup_bytes, 3 * size);
  gpumem_op_report_free(r);
  ck_assert_uint_eq(client_tag(ctl, "a").backup_pinned_bytes, size);
  ck_assert_uint_eq(client_tag(ctl, "a").backup_pageable_bytes, 0);
  ck_assert_uint_eq(client_tag(ctl, "b").backup_pageable_bytes, size);
  ck_assert_uint_eq(client_tag(ctl, "b").backup_pinned_bytes, 0);
  ck_assert_uint_eq(client_tag(ctl, "c").backup_pageable_bytes, size);
  uint64_t anon = daemon_anon();
  ck_assert_msg(anon >= anon0 + 2 * size, "RssAnon %llu -> %llu", (unsigned long long)anon0,
                (unsigned long long)anon);
  /* Read while paused: copied into memory of this process (a memfd of
   * ours, mapped read only), not the daemon's; the daemon's anonymous
   * memory does not grow for it. */
  char perms[5];
  ck_assert_uint_eq(self_mapped("memfd:gpumem-backup-read", perms), 0);
  uint32_t *all_of = malloc(size);
  for (int i = 1; i < 3; i++) {
    memset(all_of, 0, size);
    ck_assert_msg(gpumem_backup_read(w, gpumem_buffer_ptr(all[i]), size, all_of) == 0, "%s",
                  gpumem_last_error());
    for (uint64_t k = 0; k < size / 4; k++) ck_assert_uint_eq(all_of[k], 0x100 + (uint32_t)i);
    const void *view = NULL;
    ck_assert_int_eq(gpumem_backup_view(w, (char *)gpumem_buffer_ptr(all[i]) + 4, 8, &view), 0);
    ck_assert_int_eq(memcmp(view, all_of + 1, 8), 0);
  }
  free(all_of);
  ck_assert_uint_eq(self_mapped("memfd:gpumem-backup-read", perms), 2 * size);
  ck_assert_str_eq(perms, "r--s");
  ck_assert_uint_lt(daemon_anon(), anon + size);
  uint32_t got[2];
  ck_assert_msg(gpumem_resume(ctl, tags, 3, NULL, 0, NULL, &r) == 0, "%s", gpumem_last_error());
  gpumem_op_report_free(r);
  /* The copies were true only while paused: gone with the resume. */
  ck_assert_uint_eq(self_mapped("memfd:gpumem-backup-read", perms), 0);
  for (int i = 0; i < 3; i++) {
    ck_assert_int_eq(gpumem_buffer_read(w, all[i], size - sizeof got, got, sizeof got), 0);
    ck_assert_uint_eq(got[1], 0x100 + (uint32_t)i);
    ck_assert_int_eq(gpumem_free(w, all[i]), 0);
  }
  ck_assert_uint_eq(reserved(ctl), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* What a backup request with memory must carry (1.10): a memfd, not sealed
 * against writes, large enough, its pages made, for a pageable backup;
 * anything else is
 * refused, saying why, and the session goes on (the memory it sent then
 * holds the backup, sealed against shrinking). */
START_TEST(memory_sent_for_a_pageable_backup_is_checked) {
  daemon_start(&d, NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  const uint32_t pageable = GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP |
                            GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_PAGEABLE;
  struct pbuf both[2];
  peer_alloc(&w, "kv", 0, 4 * MiB, pageable, &both[0]);
  peer_alloc(&w, "kv", 0, 2 * MiB, GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP, &both[1]);
  scene_fill(&both[0], 4 * MiB, 5);
  scene_served(&c, &w, both, 2, false, "kv");
  int pipefd[2];
  ck_assert_int_eq(pipe(pipefd), 0);
  close(pipefd[1]);
  int small = memfd_create("small", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_eq(ftruncate(small, 4 * MiB - 4096), 0);
  int sealed = memfd_create("sealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_eq(ftruncate(sealed, 4 * MiB), 0);
  ck_assert_int_eq(fcntl(sealed, F_ADD_SEALS, F_SEAL_WRITE), 0);
  int sparse = memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_eq(ftruncate(sparse, 4 * MiB), 0); /* no page made: the daemon's writes would */
  int good = memfd_create("good", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ck_assert_int_eq(ftruncate(good, 4 * MiB), 0);
  ck_assert_int_eq(posix_fallocate(good, 0, 4 * MiB), 0);
  struct {
    uint64_t id;
    int fd;
    wire_code code;
    const char *says;
  } cases[] = {
      {both[0].id, pipefd[0], CODE(INVALID_ARGUMENT), "not a memfd"},
      {both[0].id, small, CODE(INVALID_ARGUMENT), "not the 4194304"},
      {both[0].id, sealed, CODE(INVALID_ARGUMENT), "sealed against writes"},
      {both[0].id, sparse, CODE(INVALID_ARGUMENT), "fallocate it first"},
      {both[1].id, good, CODE(WRONG_STATE), "without memory"},
      {both[0].id, good, CODE(OK), NULL},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    Gpumem__Wire__BackupRequest q = GPUMEM__WIRE__BACKUP_REQUEST__INIT;
    q.buffer_id = cases[i].id;
    q.memory = true;
    wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
    env.id = 40 + i;
    env.fd_count = 1;
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_BACKUP;
    env.backup = &q;
    int sent = dup(cases[i].fd);
    peer_put(&w, &env, &sent, 1);
    close(sent);
    struct frame f;
    wire_env *r = peer_get(&w, &f);
    ck_assert_uint_eq(f.nfds, 0);
    frame_release(&f);
    if (cases[i].says) {
      ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_ERROR);
      ck_assert_int_eq(r->error->code, cases[i].code);
      ck_assert_msg(strstr(r->error->message, cases[i].says), "%s", r->error->message);
    } else {
      ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_BACKUP_REPLY);
      ck_assert(r->backup_reply->copied);
      ck_assert_uint_eq(r->backup_reply->backup->piece_sizes[0], 4 * MiB);
      ck_assert_int_eq(ftruncate(good, MiB), -1); /* sealed against shrinking */
      struct pbuf copy = {.fds = {good}, .nfds = 1};
      ck_assert(scene_holds(&copy, 4 * MiB, 5));
    }
    wire_env_free(r);
  }
  int fds[] = {pipefd[0], small, sealed, sparse, good};
  for (size_t i = 0; i < 5; i++) close(fds[i]);
  /* Asked without memory, the daemon says to send some. */
  Gpumem__Wire__BackupRequest q = GPUMEM__WIRE__BACKUP_REQUEST__INIT;
  q.buffer_id = both[0].id;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = 60;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_BACKUP;
  env.backup = &q;
  peer_put(&w, &env, NULL, 0);
  wire_env *r = peer_get(&w, NULL);
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_BACKUP_REPLY);
  ck_assert(r->backup_reply->send_memory);
  ck_assert_uint_eq(r->backup_reply->backup->n_piece_sizes, 0);
  wire_env_free(r);
  peer_op_served(&c, true, "kv", &w, both, 2);
  ck_assert(scene_holds(&both[0], 4 * MiB, 5));
  peer_unmap(&both[0]);
  peer_unmap(&both[1]);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Without --backup-overflow, a backup past the limit is refused at the
 * allocation, naming the limit. */
START_TEST(a_backup_past_the_limit_is_refused_by_default) {
  daemon_start(&d, "--backup-limit", "8M", NULL);
  gpumem_client *w = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  gpumem_buffer *a = NULL, *b = NULL;
  ck_assert_int_eq(gpumem_alloc(w, "a", 0, 6 * MiB, GPUMEM_BACKUP, &a), 0);
  ck_assert_int_eq(gpumem_alloc(w, "b", 0, 6 * MiB, GPUMEM_BACKUP, &b), GPUMEM_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "--backup-limit 8388608"));
  ck_assert_int_eq(gpumem_free(w, a), 0);
  gpumem_disconnect(w);
}
END_TEST

/* A resume that another buffer's owner fails rolls a BACKUP_RELEASE
 * buffer back to PAUSED after its owner copied its backup in and let go
 * of it: the next resume hands the memory anew, and the contents hold. */
START_TEST(a_rolled_back_resume_hands_a_released_backup_anew) {
  daemon_start(&d, NULL);
  gpumem_client *w = NULL, *ctl = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  gpumem_buffer *rel = NULL;
  ck_assert_int_eq(
      gpumem_alloc(w, "weights", 0, 4 * MiB, GPUMEM_BACKUP | GPUMEM_BACKUP_RELEASE, &rel), 0);
  ck_assert_int_eq(gpumem_buffer_fill32(w, rel, 0, 4 * MiB, 0x1234), 0);
  struct peer p = {0}, c = {0};
  peer_open(&p, &d, WORKER);
  peer_open(&c, &d, CONTROLLER);
  struct pbuf x;
  peer_alloc(&p, "weights", 0, 2 * MiB, 0, &x);
  scene_served(&c, &p, &x, 1, false, "weights");
  peer_op(&c, true, "weights", 0, 0); /* the raw peer fails its remap */
  struct frame f;
  wire_env *e = peer_event(&p, &f);
  ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_REMAP);
  frame_release(&f);
  peer_ack(&p, e->id, &x.id, 1, "not this time");
  wire_env_free(e);
  wire_env *r = NULL;
  ck_assert_int_ne(peer_op_wait(&c, &r), CODE(OK));
  wire_env_free(r);
  ck_assert_int_eq(gpumem_buffer_mapped(rel), 0);
  ck_assert_uint_eq(client_tag(ctl, "weights").backup_pinned_bytes, 4 * MiB);
  peer_op(&c, true, "weights", 0, 0);
  e = peer_event(&p, &f);
  scene_serve_event(&p, e, &f, &x, 1);
  char why[512] = "";
  wire_code code = peer_op_wait(&c, &r);
  peer_reply_code(r, why, sizeof why);
  wire_env_free(r);
  ck_assert_msg(code == CODE(OK), "the second resume: %s", why);
  uint32_t v = 0;
  ck_assert_int_eq(gpumem_buffer_read(w, rel, 0, &v, sizeof v), 0);
  ck_assert_uint_eq(v, 0x1234);
  ck_assert_uint_eq(client_tag(ctl, "weights").backup_pinned_bytes, 0);
  ck_assert_uint_eq(reserved(ctl), 0);
  peer_unmap(&x);
  peer_close(&c);
  peer_close(&p);
  ck_assert_int_eq(gpumem_free(w, rel), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* A BACKUP_RELEASE buffer whose owner cannot unmap it in a resume's
 * rollback is ACTIVE again: its backup and its room go. */
START_TEST(a_release_buffer_active_after_a_failed_rollback_lets_go) {
  daemon_start(&d, NULL);
  struct peer p = {0}, c = {0};
  peer_open(&p, &d, WORKER);
  peer_open(&c, &d, CONTROLLER);
  struct pbuf bufs[2];
  peer_alloc(&p, "weights", 0, 4 * MiB, BACKUP | GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_RELEASE,
             &bufs[0]);
  peer_alloc(&p, "weights", 0, 2 * MiB, 0, &bufs[1]);
  scene_served(&c, &p, bufs, 2, false, "weights");
  peer_op(&c, true, "weights", 0, 0);
  struct frame f;
  wire_env *e = peer_event(&p, &f);
  ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_REMAP);
  peer_take_remap(e, &f, bufs, 2);
  frame_release(&f);
  peer_ack(&p, e->id, &bufs[1].id, 1, "cannot map this one");
  wire_env_free(e);
  e = peer_event(&p, &f); /* the rollback's Unmap of bufs[0] */
  ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
  frame_release(&f);
  peer_ack(&p, e->id, &bufs[0].id, 1, "it stays mapped");
  wire_env_free(e);
  wire_env *r = NULL;
  ck_assert_int_ne(peer_op_wait(&c, &r), CODE(OK));
  wire_env_free(r);
  wire_env *st = peer_status(&c);
  ck_assert_uint_eq(st->status_reply->backup_reserved, 0);
  const Gpumem__Wire__TagInfo *t = peer_tag(st, "weights");
  ck_assert_uint_eq(t->backup_reserved_bytes + t->backup_pinned_bytes, 0);
  wire_env_free(st);
  scene_served(&c, &p, bufs, 2, true, "weights");
  peer_unmap(&bufs[0]);
  peer_unmap(&bufs[1]);
  peer_close(&c);
  peer_close(&p);
}
END_TEST

/* At the host backend's descriptor budget, where each backup is one
 * descriptor: a pause of BACKUP_RELEASE buffers whose backups' slots do
 * not all fit fails whole, unmapping nothing, and gives back the slots
 * it took. */
START_TEST(a_pause_past_the_descriptor_budget_pauses_nothing) {
  daemon_start(&d, "--chunk-size", "2M", NULL);
  struct peer p = {0}, c = {0};
  peer_open(&p, &d, WORKER);
  peer_open(&c, &d, CONTROLLER);
  scene_cap_fds(d.pid, 60);
  struct pbuf b[64];
  size_t n = 0;
  while (n < 64 && peer_try_alloc(&p, "weights", 0, 2 * MiB,
                                  BACKUP | GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_RELEASE,
                                  &b[n]) == CODE(OK))
    n++;
  ck_assert_uint_ge(n, 4);
  ck_assert_int_eq(scene_free_code(&p, b[n - 1].id), CODE(OK)); /* one slot left */
  peer_unmap(&b[--n]);
  for (int round = 0; round < 2; round++) {
    ck_assert_int_eq(scene_op_code(&c, false, "weights"), CODE(LIMIT_EXCEEDED));
    wire_env *st = peer_status(&c);
    ck_assert_uint_eq(st->status_reply->backup_reserved, 0);
    ck_assert_int_eq(peer_tag(st, "weights")->state, GPUMEM__WIRE__BUFFER_STATE__ACTIVE);
    wire_env_free(st);
  }
  for (size_t i = 0; i < n; i++) peer_unmap(&b[i]);
  peer_close(&c);
  peer_close(&p);
}
END_TEST

/* The made-up /proc/meminfo of start_seeing (the test removes it). */
static char meminfo_path[128];

/* Start the daemon (extra: two more arguments) seeing avail_kb of
 * MemAvailable in a made-up /proc/meminfo (libfake_kernel.so), which it
 * reads whenever it needs the figure. */
static void start_seeing(unsigned long avail_kb, const char *a1, const char *a2) {
  char *path = meminfo_path;
  snprintf(path, sizeof meminfo_path, "%s/gpumem-meminfo.XXXXXX",
           getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  FILE *f = fdopen(fd, "w");
  ck_assert_ptr_nonnull(f);
  fprintf(f, "MemTotal: 100000000 kB\nMemFree: %lu kB\nMemAvailable: %lu kB\n", avail_kb,
          avail_kb);
  fclose(f);
  const char *asan = getenv("ASAN_OPTIONS");
  char *saved = asan ? strdup(asan) : NULL, opts[1024];
  snprintf(opts, sizeof opts, "%s%sverify_asan_link_order=0", asan ? asan : "", asan ? ":" : "");
  setenv("ASAN_OPTIONS", opts, 1);
  setenv("GPUMEM_TEST_MEMINFO", path, 1);
  setenv("LD_PRELOAD", harness_built("tests/libfake_kernel.so"), 1);
  daemon_start(&d, a1, a2, NULL);
  unsetenv("LD_PRELOAD");
  unsetenv("GPUMEM_TEST_MEMINFO");
  if (saved) setenv("ASAN_OPTIONS", saved, 1);
  else unsetenv("ASAN_OPTIONS");
  free(saved);
}

/* A pause whose pageable backups the kernel has no room for (8 MiB
 * available, 16 MiB wanted) fails before it unmaps anything, saying so;
 * the buffers beside them stay mapped too, and nothing stays reserved. */
START_TEST(a_pause_short_of_pageable_room_pauses_nothing) {
  start_seeing(8 * 1024, "--backup-limit", "64M");
  gpumem_client *w = NULL, *ctl = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  gpumem_buffer *a = NULL, *b = NULL;
  ck_assert_int_eq(gpumem_alloc(w, "a", 0, 4 * MiB, GPUMEM_BACKUP | GPUMEM_BACKUP_RELEASE, &a), 0);
  ck_assert_int_eq(gpumem_alloc(w, "b", 0, 16 * MiB,
                                GPUMEM_BACKUP | GPUMEM_BACKUP_RELEASE | GPUMEM_BACKUP_PAGEABLE,
                                &b), 0);
  ck_assert_int_eq(gpumem_buffer_fill32(w, b, 0, 16 * MiB, 0xb), 0);
  const char *tags[] = {"a", "b"};
  struct gpumem_op_report *r = NULL;
  ck_assert_int_eq(gpumem_pause(ctl, tags, 2, NULL, 0, NULL, &r), GPUMEM_E_OUT_OF_MEMORY);
  gpumem_op_report_free(r);
  ck_assert_msg(strstr(gpumem_last_error(), "16777216 bytes of pageable backups") &&
                    strstr(gpumem_last_error(), "nothing was paused"),
                "%s", gpumem_last_error());
  ck_assert_int_eq(gpumem_buffer_mapped(a), 1);
  ck_assert_int_eq(gpumem_buffer_mapped(b), 1);
  ck_assert_int_eq(client_tag(ctl, "a").state, GPUMEM_ACTIVE);
  ck_assert_uint_eq(reserved(ctl), 0);
  uint32_t v = 0;
  ck_assert_int_eq(gpumem_buffer_read(w, b, 0, &v, sizeof v), 0);
  ck_assert_uint_eq(v, 0xb);
  ck_assert_int_eq(client_op(ctl, "a", false), 0); /* the pinned one alone fits */
  ck_assert_int_eq(client_op(ctl, "a", true), 0);
  ck_assert_int_eq(gpumem_free(w, a), 0);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
  unlink(meminfo_path);
}
END_TEST

/* Under --backup-overflow pageable, a backup that does not fit the
 * descriptor budget is pageable memory too (it takes no descriptor). */
START_TEST(overflow_helps_at_the_descriptor_budget) {
  daemon_start(&d, "--chunk-size", "2M", "--backup-overflow", "pageable", NULL);
  struct peer p = {0}, c = {0};
  peer_open(&p, &d, WORKER);
  peer_open(&c, &d, CONTROLLER);
  scene_cap_fds(d.pid, 60);
  struct pbuf b[64];
  size_t n = 0;
  while (n < 64 && peer_try_alloc(&p, "weights", 0, 2 * MiB,
                                  BACKUP | GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_RELEASE,
                                  &b[n]) == CODE(OK))
    n++;
  ck_assert_uint_ge(n, 4);
  scene_served(&c, &p, b, n, false, "weights");
  wire_env *st = peer_status(&c);
  ck_assert_uint_gt(peer_tag(st, "weights")->backup_pageable_bytes, 0);
  wire_env_free(st);
  scene_served(&c, &p, b, n, true, "weights");
  for (size_t i = 0; i < n; i++) peer_unmap(&b[i]);
  peer_close(&c);
  peer_close(&p);
}
END_TEST

/* The daemon's RssAnon (kB), by the kernel. */
static unsigned long long anon_kb(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "re");
  unsigned long long kb = 0;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "RssAnon: %llu kB", &kb) == 1) break;
  if (f) fclose(f);
  return kb;
}

/* An owner that acks in time while the daemon is busy copying another
 * owner's pageable backup on its loop (longer than --ack-timeout) is not
 * reported late: the timeout is judged after the loop read its ack. */
START_TEST(an_ack_that_waited_for_a_busy_daemon_is_in_time) {
  daemon_start(&d, "--ack-timeout", "100ms", NULL);
  gpumem_client *w = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  gpumem_buffer *big = NULL;
  ck_assert_int_eq(
      gpumem_alloc(w, "t", 0, 512 * MiB, GPUMEM_BACKUP | GPUMEM_BACKUP_PAGEABLE, &big), 0);
  ck_assert_int_eq(gpumem_buffer_fill32(w, big, 0, 512 * MiB, 0x77), 0);
  struct peer b = {0}, c = {0};
  peer_open(&b, &d, WORKER);
  peer_open(&c, &d, CONTROLLER);
  struct pbuf bb;
  peer_alloc(&b, "t", 0, 2 * MiB, 0, &bb);
  unsigned long long anon0 = anon_kb(d.pid);
  peer_op(&c, false, "t", 0, 0);
  struct frame f;
  wire_env *e = peer_event(&b, &f);
  frame_release(&f);
  /* Ack once the daemon is making the other owner's backup (its RssAnon
   * grows as it faults the memory in), so that the ack waits for it. */
  double end = now_ms() + 10000;
  while (anon_kb(d.pid) < anon0 + 64 * 1024 && now_ms() < end) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  ck_assert_msg(anon_kb(d.pid) >= anon0 + 64 * 1024, "the daemon never made the backup");
  scene_unmap_ack(&b, e, &bb);
  wire_env *r = NULL;
  wire_code code = peer_op_wait(&c, &r);
  char why[700] = "";
  peer_reply_code(r, why, sizeof why);
  wire_env_free(r);
  ck_assert_msg(code == CODE(OK), "the pause: %s", why);
  scene_served(&c, &b, &bb, 1, true, "t");
  uint32_t v = 0;
  ck_assert_int_eq(gpumem_buffer_read(w, big, 0, &v, sizeof v), 0);
  ck_assert_uint_eq(v, 0x77);
  peer_unmap(&bb);
  peer_close(&c);
  peer_close(&b);
  ck_assert_int_eq(gpumem_free(w, big), 0);
  gpumem_disconnect(w);
}
END_TEST

int main(void) {
  return HARNESS_RUN("backup_policy", 60, NULL, teardown,
                     a_released_backup_exists_only_while_paused,
                     a_pause_whose_backups_do_not_fit_changes_nothing,
                     a_release_policy_without_a_backup_is_refused,
                     a_backup_past_the_limit_can_be_pageable,
                     memory_sent_for_a_pageable_backup_is_checked,
                     a_backup_past_the_limit_is_refused_by_default,
                     a_rolled_back_resume_hands_a_released_backup_anew,
                     a_release_buffer_active_after_a_failed_rollback_lets_go,
                     a_pause_past_the_descriptor_budget_pauses_nothing,
                     a_pause_short_of_pageable_room_pauses_nothing,
                     overflow_helps_at_the_descriptor_budget,
                     an_ack_that_waited_for_a_busy_daemon_is_in_time);
}
