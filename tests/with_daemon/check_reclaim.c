/* A restarted daemon takes the node back by its journal: every buffer
 * returns to its owner, who proves it with the buffer's secret; no other
 * uid can take a tag's name, re-register what is not its own, or make up
 * paused buffers that hold no memory; a journal cut by a crash keeps what
 * was answered, and one not to be trusted is put aside. The other uids
 * need root (the test connects under a borrowed effective uid); without
 * it those tests say so and pass. */
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpumem.h"
#include "harness.h"

#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x
#define WORKER GPUMEM__WIRE__ROLE__ROLE_WORKER
#define CONTROLLER GPUMEM__WIRE__ROLE__ROLE_CONTROLLER
#define MiB (1ull << 20)
#define ALICE 1000
#define BOB 1001
#define MALLORY 1002

static struct daemon d;

/* Start a daemon every uid may reach, with extra arguments. */
static void daemon_open_to_all(const char *const *extra) {
  const char *args[16] = {"--socket-mode", "0666"};
  size_t n = 2;
  for (; extra && *extra && n < 15; extra++) args[n++] = *extra;
  args[n] = NULL;
  daemon_start(&d, args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7],
               args[8], args[9], NULL);
  ck_assert_int_eq(chmod(d.dir, 0755), 0);
}

/* Whether this test can be other uids; says so when it cannot. */
static bool can_be_others(const char *test) {
  if (geteuid() == 0) return true;
  printf("%s: skipped: needs root to connect as other uids\n", test);
  return false;
}

/* Connect as uid (root's real uid is kept, to come back) and say hello. */
static void open_as(struct peer *p, uid_t uid, int role) {
  ck_assert_int_eq(seteuid(uid), 0);
  peer_connect(p, &d);
  ck_assert_int_eq(seteuid(0), 0);
  wire_env_free(peer_hello(p, role));
}

/* End the daemon with sig (0: it ended) and start the next one on its socket, every uid
 * let in, with extra arguments; returns once it listens. */
static void restart(int sig, const char *const *extra) {
  const char *args[16] = {"--socket-mode", "0666"};
  size_t n = 2;
  for (; extra && *extra && n < 15; extra++) args[n++] = *extra;
  args[n] = NULL;
  if (sig) { /* 0: it has ended already */
    kill(d.pid, sig);
    ck_assert_int_eq(waitpid(d.pid, NULL, 0), d.pid);
  }
  d.pid = daemon_spawn(d.socket, d.log, args);
  int fd = -1;
  for (double end = now_ms() + harness_patience_ms(2000); now_ms() < end;) {
    if ((fd = raw_connect(&d)) >= 0) break;
    struct pollfd none;
    poll(&none, 0, 10);
  }
  ck_assert_int_ge(fd, 0);
  close(fd);
}

/* How one buffer is re-registered: as the daemon gave it, or with a
 * secret or id of one's own. */
struct claim {
  const struct pbuf *b;
  const char *tag;
  bool paused;   /* no fds: it holds no memory */
  uint32_t flags;
  int secret;    /* 0: its own; 1: none; 2: made up */
  uint64_t id;   /* 0: its own */
  unsigned device;
};

/* Re-register n buffers in one request; the code, words in why. */
static wire_code adopt(struct peer *w, const struct claim *c, size_t n, char *why, size_t len,
                       uint64_t *ids) {
  Gpumem__Wire__AdoptBuffer ab[8], *abp[8];
  uint8_t made_up[WIRE_SECRET_SIZE];
  memset(made_up, 0x5a, sizeof made_up);
  int fds[64];
  size_t nfds = 0;
  ck_assert_uint_le(n, 8);
  for (size_t i = 0; i < n; i++) {
    gpumem__wire__adopt_buffer__init(&ab[i]);
    ab[i].tag = (char *)c[i].tag;
    ab[i].device = c[i].device;
    ab[i].size = c[i].b->size;
    ab[i].flags = c[i].flags;
    ab[i].chunk_sizes = (uint64_t *)c[i].b->chunk_sizes;
    ab[i].n_chunk_sizes = c[i].b->nchunks;
    ab[i].paused = c[i].paused;
    ab[i].old_id = c[i].id ? c[i].id : c[i].b->id;
    if (c[i].secret == 0) {
      ab[i].secret.data = (uint8_t *)c[i].b->secret;
      ab[i].secret.len = c[i].b->secret_len;
    } else if (c[i].secret == 2) {
      ab[i].secret.data = made_up;
      ab[i].secret.len = sizeof made_up;
    }
    for (size_t k = 0; !c[i].paused && k < c[i].b->nfds; k++) fds[nfds++] = dup(c[i].b->fds[k]);
    abp[i] = &ab[i];
  }
  Gpumem__Wire__AdoptRequest q = GPUMEM__WIRE__ADOPT_REQUEST__INIT;
  q.buffers = abp;
  q.n_buffers = n;
  wire_env env = peer_env(w->next_id++, GPUMEM__WIRE__ENVELOPE__BODY_ADOPT);
  env.adopt = &q;
  env.fd_count = (uint32_t)nfds;
  peer_put(w, &env, fds, nfds);
  wire_env *r = peer_get(w, NULL);
  wire_code code = peer_reply_code(r, why, len);
  if (code == CODE(OK)) {
    ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_ADOPT_REPLY);
    ck_assert_uint_eq(r->adopt_reply->n_buffer_ids, n);
    ck_assert_uint_eq(r->adopt_reply->n_secrets, n);
    for (size_t i = 0; i < n; i++) {
      ck_assert_uint_eq(r->adopt_reply->secrets[i].len, WIRE_SECRET_SIZE);
      if (c[i].secret == 0 && c[i].b->secret_len) /* the journal's: kept */
        ck_assert_mem_eq(r->adopt_reply->secrets[i].data, c[i].b->secret, WIRE_SECRET_SIZE);
      if (ids) ids[i] = r->adopt_reply->buffer_ids[i];
    }
  }
  wire_env_free(r);
  return code;
}

/* One buffer re-registered must be refused with code and words. */
static void refused(struct peer *w, const struct claim *c, wire_code code, const char *words) {
  char why[256] = "";
  wire_code got = adopt(w, c, 1, why, sizeof why, NULL);
  ck_assert_msg(got == code && strstr(why, words), "%s: %s, not %s: %s", c->tag,
                wire_code_name(got), wire_code_name(code), why);
}

/* The tag of a controller's status (NULL: not there). */
static const Gpumem__Wire__TagInfo *tag_of(const wire_env *st, const char *name) {
  for (size_t i = 0; i < st->status_reply->n_tags; i++)
    if (strcmp(st->status_reply->tags[i]->name, name) == 0) return st->status_reply->tags[i];
  return NULL;
}

/* Start gpumem-worker as uid (its output file made for it first). */
static void worker_as(struct worker *w, uid_t uid, const char *tag, const char *count,
                      bool backup) {
  ck_assert_int_eq(chmod(d.dir, 01777), 0); /* for its output file; judged at start only */
  /* Real uid too: a program whose real and effective uids differ runs
   * without its library path. */
  ck_assert_int_eq(setresuid(uid, uid, 0), 0);
  if (backup)
    worker_spawn(w, &d, "--tag", tag, "--size", "4M", "--count", count, "--backup", NULL);
  else
    worker_spawn(w, &d, "--tag", tag, "--size", "4M", "--count", count, NULL);
  ck_assert_int_eq(setresuid(0, 0, 0), 0);
  ck_assert_msg(worker_wait_for(w, "ready", 1, 20000), "%s", worker_output(w));
  ck_assert_int_eq(chmod(d.dir, 0755), 0);
}

/* A daemon killed with SIGKILL, two uids' workers (one's tag paused by a
 * controller, the other's buffer with a backup): while they are stopped
 * another uid tries to take the names and the buffers (the real ids, with
 * no secret or a made-up one) and is refused at once, without waiting;
 * then every buffer is back under its owner, the paused tag paused, the
 * daemon holding exactly the memory the kernel shows it holding, and the
 * grace over as soon as the last one is back. The buffers resume and
 * pause as before (the backup's contents kept). */
START_TEST(every_buffer_comes_back_to_its_owner_after_sigkill) {
  if (!can_be_others("every_buffer_comes_back_to_its_owner_after_sigkill")) return;
  daemon_open_to_all((const char *const[]){"--host-devices", "1", NULL});
  struct worker a, b;
  worker_as(&a, ALICE, "kv", "2", false);
  worker_as(&b, BOB, "wb", "1", true);
  struct peer ctl;
  open_as(&ctl, 0, CONTROLLER);
  peer_op(&ctl, false, "kv", 0, 0);
  peer_op_ok(&ctl, 2, 8 * MiB);
  wire_env *l = peer_list(&ctl);
  ck_assert_uint_eq(l->list_reply->n_buffers, 3);
  struct pbuf old[3] = {0}; /* the real ids, secrets unknown */
  for (int i = 0; i < 3; i++) {
    old[i].id = l->list_reply->buffers[i]->id;
    old[i].size = 4 * MiB;
    old[i].chunk_sizes[0] = 4 * MiB;
    old[i].nchunks = 1;
  }
  wire_env_free(l);
  peer_close(&ctl);
  worker_freeze(&a);
  worker_freeze(&b);
  restart(SIGKILL, (const char *const[]){"--host-devices", "1", NULL});
  struct peer m;
  open_as(&m, MALLORY, WORKER);
  for (int i = 0; i < 3; i++) {
    const char *tag = i < 2 ? "kv" : "wb";
    uint32_t flags = i < 2 ? 0 : GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP;
    refused(&m, &(struct claim){&old[i], tag, true, flags, 1, 0, 0}, CODE(PERMISSION_DENIED),
            "no secret");
    refused(&m, &(struct claim){&old[i], tag, true, flags, 2, 0, 0}, CODE(PERMISSION_DENIED),
            "is not one the daemon before gave this uid");
  }
  struct pbuf x;
  ck_assert_int_eq(peer_try_alloc(&m, "kv", 0, 2 * MiB, 0, &x), CODE(PERMISSION_DENIED));
  ck_assert_int_eq(peer_try_alloc(&m, "wb", 0, 2 * MiB, 0, &x), CODE(PERMISSION_DENIED));
  ck_assert_int_eq(peer_try_alloc(&m, "m", 0, 2 * MiB, 0, &x), CODE(OK)); /* a new tag: no wait */
  peer_unmap(&x);
  open_as(&ctl, 0, CONTROLLER);
  wire_env *st = peer_status(&ctl);
  ck_assert_uint_gt(st->status_reply->grace_left_ms, 0);
  const Gpumem__Wire__TagInfo *t = tag_of(st, "kv");
  ck_assert_ptr_nonnull(t);
  ck_assert(t->owned && t->owner_uid == ALICE && t->state == GPUMEM__WIRE__BUFFER_STATE__PAUSED && t->buffers == 0);
  ck_assert((t = tag_of(st, "wb")) && t->owned && t->owner_uid == BOB);
  wire_env_free(st);
  peer_close(&m); /* its buffer goes with it */
  kill(a.pid, SIGCONT);
  kill(b.pid, SIGCONT);
  ck_assert_msg(worker_wait_for(&a, "re-registered 2 buffers with gpumemd", 1, 20000), "%s",
                worker_output(&a));
  ck_assert_msg(worker_wait_for(&b, "re-registered 1 buffers with gpumemd", 1, 20000), "%s",
                worker_output(&b));
  st = peer_status(&ctl);
  ck_assert_uint_eq(st->status_reply->grace_left_ms, 0); /* every one is back */
  ck_assert((t = tag_of(st, "kv")) && t->owner_uid == ALICE && t->buffers == 2 &&
            t->paused_buffers == 2 && t->state == GPUMEM__WIRE__BUFFER_STATE__PAUSED);
  ck_assert((t = tag_of(st, "wb")) && t->owner_uid == BOB && t->buffers == 1 &&
            t->paused_buffers == 0);
  ck_assert_ptr_null(tag_of(st, "m"));
  ck_assert_uint_eq(st->status_reply->n_tenants, 2);
  for (size_t i = 0; i < 2; i++) {
    const Gpumem__Wire__TenantInfo *u = st->status_reply->tenants[i];
    ck_assert_uint_eq(u->buffers, u->uid == ALICE ? 2 : 1);
  }
  /* What the daemon says it holds is what the kernel shows it holding:
   * Bob's active buffer; Alice's paused ones hold nothing anywhere. */
  ck_assert_uint_eq(st->status_reply->devices[0]->managed, 4 * MiB);
  ck_assert_uint_eq(memfd_bytes(&d.pid, 1), 4 * MiB);
  ck_assert_uint_eq(memfd_bytes(&a.pid, 1), 0);
  ck_assert_uint_eq(memfd_bytes(&b.pid, 1), 4 * MiB);
  wire_env_free(st);
  peer_op(&ctl, true, "kv", 0, 0);
  peer_op_ok(&ctl, 2, 8 * MiB);
  ck_assert_msg(worker_wait_for(&a, "verified buffer", 2, 10000), "%s", worker_output(&a));
  peer_op(&ctl, false, "wb", 0, 0);
  peer_op_ok(&ctl, 1, 4 * MiB);
  peer_op(&ctl, true, "wb", 0, 0);
  peer_op_ok(&ctl, 1, 4 * MiB);
  ck_assert_msg(worker_wait_for(&b, "contents kept", 1, 10000), "%s", worker_output(&b));
  ck_assert_int_eq(worker_count(&a, "FAILED") + worker_count(&b, "FAILED"), 0);
  peer_close(&ctl);
  ck_assert_int_eq(worker_stop(&a, SIGTERM), 0);
  ck_assert_int_eq(worker_stop(&b, SIGTERM), 0);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* A secret proves a buffer once: its holder re-registers it (mapped or
 * paused), the same request again is refused, and so is one with a
 * changed tag, size or flags; after the next restart the old id is
 * nothing, the new one is (with the same secret). */
START_TEST(a_secret_proves_a_buffer_once) {
  daemon_open_to_all(NULL);
  struct peer w;
  peer_open(&w, &d, WORKER);
  struct pbuf a, b;
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &a);
  peer_alloc(&w, "kv", 1, 2 * MiB, GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP, &b);
  ck_assert_uint_eq(a.secret_len, WIRE_SECRET_SIZE);
  ck_assert_mem_ne(a.secret, b.secret, WIRE_SECRET_SIZE);
  restart(SIGKILL, NULL);
  peer_close(&w);
  peer_open(&w, &d, WORKER);
  struct claim wrong_tag = {&a, "other", false, 0, 0, 0, 0};
  refused(&w, &wrong_tag, CODE(INVALID_ARGUMENT), "was 4.00 MiB on device 0 in tag 'kv'");
  struct claim wrong_flags = {&b, "kv", true, 0, 0, 0, 1};
  refused(&w, &wrong_flags, CODE(INVALID_ARGUMENT), "with flags 0x1");
  struct claim both[2] = {{&a, "kv", false, 0, 0, 0, 0},
                          {&b, "kv", true, GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP, 0, 0, 1}};
  char why[256];
  uint64_t ids[2];
  ck_assert_msg(adopt(&w, both, 2, why, sizeof why, ids) == CODE(OK), "%s", why);
  refused(&w, &both[0], CODE(PERMISSION_DENIED), "or it is back already");
  restart(SIGTERM, NULL);
  peer_close(&w);
  peer_open(&w, &d, WORKER);
  refused(&w, &both[0], CODE(PERMISSION_DENIED), "is not one the daemon before gave");
  struct pbuf a2 = a;
  a2.id = ids[0];
  struct claim again = {&a2, "kv", false, 0, 0, 0, 0};
  ck_assert_msg(adopt(&w, &again, 1, why, sizeof why, NULL) == CODE(OK), "%s", why);
  peer_unmap(&a);
  peer_unmap(&b);
  peer_close(&w);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* While a buffer the journal expects is away, it still counts against its
 * uid's quotas: another process of the uid cannot take the room meanwhile
 * (before, it could, and the owner's re-registration was then refused
 * over the quota), and the re-registration is counted once, not twice. */
START_TEST(a_buffer_away_counts_against_its_quotas) {
  const char *quota[] = {"--max-device-bytes-per-uid", "16M", NULL};
  daemon_open_to_all(quota);
  struct peer w;
  peer_open(&w, &d, WORKER);
  struct pbuf a, b;
  peer_alloc(&w, "kv", 0, 8 * MiB, 0, &a);
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &b);
  const char *extra[] = {"--max-device-bytes-per-uid", "16M", "--adopt-grace", "60s", NULL};
  restart(SIGKILL, extra);
  peer_close(&w);
  struct peer other;
  peer_open(&other, &d, WORKER);
  struct pbuf c;
  ck_assert_int_eq(peer_try_alloc(&other, "kv", 0, 8 * MiB, 0, &c), CODE(LIMIT_EXCEEDED));
  peer_alloc(&other, "kv", 0, 4 * MiB, 0, &c);
  peer_open(&w, &d, WORKER);
  struct claim both[2] = {{&a, "kv", false, 0, 0, 0, 0}, {&b, "kv", false, 0, 0, 0, 0}};
  char why[256];
  ck_assert_msg(adopt(&w, both, 2, why, sizeof why, NULL) == CODE(OK), "%s", why);
  /* Now all 16 MiB are held, and counted once. */
  struct pbuf e;
  ck_assert_int_eq(peer_try_alloc(&other, "kv", 0, 2 * MiB, 0, &e), CODE(LIMIT_EXCEEDED));
  peer_unmap(&a);
  peer_unmap(&b);
  peer_unmap(&c);
  peer_close(&w);
  peer_close(&other);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* Paused re-registrations hold no memory yet count: outside a restart
 * they are refused (before, they were taken at any time: a uid's made-up
 * BACKUP buffers reserved the node's backup limit, and the owner's real
 * backup allocation failed), and after one only the journal's are taken. */
START_TEST(made_up_paused_buffers_are_refused) {
  if (!can_be_others("made_up_paused_buffers_are_refused")) return;
  daemon_open_to_all((const char *const[]){"--backup-limit", "8M", NULL});
  struct peer m, a;
  open_as(&m, MALLORY, WORKER);
  struct pbuf fake = {.size = 8 * MiB, .chunk_sizes = {8 * MiB}, .nchunks = 1, .id = 1};
  struct claim c = {&fake, "x", true, GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP, 1, 0, 0};
  refused(&m, &c, CODE(PERMISSION_DENIED), "takes one back only during the grace");
  open_as(&a, ALICE, WORKER);
  struct pbuf real;
  ck_assert_int_eq(peer_try_alloc(&a, "kv", 0, 8 * MiB, GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP,
                                  &real),
                   CODE(OK));
  restart(SIGKILL, (const char *const[]){"--backup-limit", "8M", NULL});
  peer_close(&m);
  open_as(&m, MALLORY, WORKER);
  c.secret = 2;
  refused(&m, &c, CODE(PERMISSION_DENIED), "is not one the daemon before gave this uid");
  peer_close(&a);
  open_as(&a, ALICE, WORKER);
  struct claim mine = {&real, "kv", false, GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP, 0, 0, 0};
  char why[256];
  ck_assert_msg(adopt(&a, &mine, 1, why, sizeof why, NULL) == CODE(OK), "%s", why);
  struct peer ctl;
  open_as(&ctl, 0, CONTROLLER);
  wire_env *st = peer_status(&ctl);
  ck_assert_uint_eq(st->status_reply->n_tenants, 1); /* Mallory holds nothing */
  wire_env_free(st);
  peer_close(&ctl);
  peer_unmap(&real);
  peer_close(&a);
  peer_close(&m);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* A daemon killed while it appends leaves a cut last record: the next one
 * reads the rest, says so, and takes back what the whole records name
 * (the cut one was never answered: its holder could not have it). */
START_TEST(a_cut_journal_keeps_its_whole_records) {
  daemon_open_to_all(NULL);
  struct peer w;
  peer_open(&w, &d, WORKER);
  struct pbuf a, b;
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &a);
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &b);
  kill(d.pid, SIGKILL);
  ck_assert_int_eq(waitpid(d.pid, NULL, 0), d.pid);
  char path[160];
  snprintf(path, sizeof path, "%s.journal", d.socket);
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert_uint_eq(st.st_mode & 0777, 0600);
  ck_assert_int_eq(truncate(path, st.st_size - 3), 0); /* b's record */
  d.pid = daemon_spawn(d.socket, d.log, (const char *const[]){"--socket-mode", "0666", NULL});
  peer_close(&w);
  for (double end = now_ms() + harness_patience_ms(2000); now_ms() < end;) {
    int fd = raw_connect(&d);
    if (fd >= 0) {
      close(fd);
      break;
    }
    struct pollfd none;
    poll(&none, 0, 10);
  }
  peer_open(&w, &d, WORKER);
  ck_assert_int_eq(daemon_log_count(&d, "its last record was cut"), 1);
  char why[256];
  struct claim ca = {&a, "kv", false, 0, 0, 0, 0}, cb = {&b, "kv", false, 0, 0, 0, 0};
  ck_assert_msg(adopt(&w, &ca, 1, why, sizeof why, NULL) == CODE(OK), "%s", why);
  refused(&w, &cb, CODE(PERMISSION_DENIED), "is not one the daemon before gave");
  peer_unmap(&a);
  peer_unmap(&b);
  peer_close(&w);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* A journal not to be trusted (another owner's) is put aside with its
 * bytes, said in the log, and the daemon serves as one without a journal
 * (a paused re-registration outside a grace is refused); a new journal
 * is written. */
START_TEST(an_untrusted_journal_is_put_aside) {
  if (!can_be_others("an_untrusted_journal_is_put_aside")) return;
  daemon_open_to_all(NULL);
  struct peer w;
  peer_open(&w, &d, WORKER);
  struct pbuf a;
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &a);
  kill(d.pid, SIGKILL);
  ck_assert_int_eq(waitpid(d.pid, NULL, 0), d.pid);
  char path[160], aside[176];
  snprintf(path, sizeof path, "%s.journal", d.socket);
  snprintf(aside, sizeof aside, "%s.rejected", path);
  struct stat before;
  ck_assert_int_eq(stat(path, &before), 0);
  ck_assert_int_eq(chown(path, ALICE, ALICE), 0);
  restart(0, (const char *const[]){NULL});
  peer_close(&w);
  peer_open(&w, &d, WORKER);
  ck_assert_int_eq(daemon_log_count(&d, "is not trusted: it is owned by uid 1000"), 1);
  struct stat put;
  ck_assert_int_eq(stat(aside, &put), 0);
  ck_assert_uint_eq(put.st_size, before.st_size);
  ck_assert_uint_eq(put.st_uid, ALICE);
  struct stat fresh;
  ck_assert_int_eq(stat(path, &fresh), 0);
  ck_assert_uint_eq(fresh.st_uid, geteuid());
  struct claim c = {&a, "kv", true, 0, 0, 0, 0};
  refused(&w, &c, CODE(PERMISSION_DENIED), "takes one back only during the grace");
  peer_unmap(&a);
  peer_close(&w);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* What no worker claims within the grace is forgotten, and said: the tag
 * kept for it goes, and its name is free again. */
START_TEST(unclaimed_buffers_are_forgotten_after_the_grace) {
  daemon_open_to_all(NULL);
  struct peer w;
  peer_open(&w, &d, WORKER);
  struct pbuf a;
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &a);
  restart(SIGKILL, (const char *const[]){"--adopt-grace", "200ms", NULL});
  peer_close(&w);
  peer_unmap(&a);
  bool said = false;
  for (double end = now_ms() + harness_patience_ms(2000); !said && now_ms() < end;) {
    said = daemon_log_count(&d, "was not re-registered within the grace: forgotten") == 1;
    struct pollfd none;
    poll(&none, 0, 10);
  }
  ck_assert(said);
  peer_open(&w, &d, WORKER);
  wire_env *st = peer_status(&w);
  ck_assert_uint_eq(st->status_reply->n_tags, 0);
  ck_assert_uint_eq(st->status_reply->grace_left_ms, 0);
  wire_env_free(st);
  peer_close(&w);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

/* One journal is one daemon's: another daemon (on another socket) that
 * names it does not start, and says why; --journal none keeps none. */
START_TEST(a_journal_is_one_daemons) {
  daemon_open_to_all(NULL);
  char path[160], sock[96], log[128];
  snprintf(path, sizeof path, "%s.journal", d.socket);
  snprintf(sock, sizeof sock, "%.60s/other", d.dir);
  snprintf(log, sizeof log, "%.60s/other.log", d.dir);
  pid_t other = daemon_spawn(sock, log, (const char *const[]){"--journal", path, NULL});
  int status;
  ck_assert_int_eq(waitpid(other, &status, 0), other);
  ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 1);
  struct daemon o = {0};
  snprintf(o.log, sizeof o.log, "%s", log);
  ck_assert_int_eq(daemon_log_count(&o, "another gpumemd holds it"), 1);
  other = daemon_spawn(sock, log, (const char *const[]){"--journal", "none", NULL});
  snprintf(o.socket, sizeof o.socket, "%s", sock);
  o.pid = other;
  for (double end = now_ms() + harness_patience_ms(2000); now_ms() < end;) {
    int fd = raw_connect(&o);
    if (fd >= 0) {
      close(fd);
      break;
    }
    struct pollfd none;
    poll(&none, 0, 10);
  }
  ck_assert_int_eq(daemon_log_count(&o, "no journal (--journal none)"), 1);
  kill(other, SIGTERM);
  ck_assert_int_eq(waitpid(other, &status, 0), other);
  char none[176];
  snprintf(none, sizeof none, "%s.journal", sock);
  ck_assert_int_eq(access(none, F_OK), -1);
  ck_assert_int_eq(daemon_stop(&d), 0);
}
END_TEST

int main(void) {
  return HARNESS_RUN("reclaim", 60, harness_fd_setup, harness_fd_teardown,
                     every_buffer_comes_back_to_its_owner_after_sigkill,
                     a_secret_proves_a_buffer_once, a_buffer_away_counts_against_its_quotas,
                     made_up_paused_buffers_are_refused,
                     a_cut_journal_keeps_its_whole_records, an_untrusted_journal_is_put_aside,
                     unclaimed_buffers_are_forgotten_after_the_grace, a_journal_is_one_daemons);
}
