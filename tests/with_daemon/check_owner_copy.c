/* Backups that their owner copies (protocol 1.7): a worker that says
 * copies_backups at Hello is handed its BACKUP buffers' backup memory in
 * the pause's Unmap and the resume's Remap, and copies with its own
 * context, so that the daemon needs none. Raw workers play the owner
 * (they see the events and fds themselves); libgpumem workers show the
 * contents kept both ways, and which way a worker asks for. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/wire.h"
#include "gpumem.h"
#include "harness.h"
#include "scenario.h"

static struct daemon d;

static void teardown(void) { scene_stop(&d); }

/* Connect a raw worker that says it copies its backups itself (and keeps
 * the memory handed to it, if keeps). */
static void owner_open(struct peer *w, bool keeps) {
  peer_connect(w, &d);
  Gpumem__Wire__Hello h = GPUMEM__WIRE__HELLO__INIT;
  h.version_major = WIRE_VERSION_MAJOR;
  h.version_minor = WIRE_VERSION_MINOR;
  h.role = WORKER;
  h.name = "owner";
  h.copies_backups = true;
  h.keeps_backups = keeps;
  wire_env env = peer_env(w->next_id++, GPUMEM__WIRE__ENVELOPE__BODY_HELLO);
  env.hello = &h;
  peer_push(w, &env, NULL, 0);
  wire_env *r = peer_answer(w);
  ck_assert_int_eq(r->body_case, GPUMEM__WIRE__ENVELOPE__BODY_HELLO_REPLY);
  wire_env_free(r);
}

/* Copy len bytes between two fds' shared mappings, src's to dst's. */
static void fd_copy(int dst, int src, uint64_t len) {
  void *s = mmap(NULL, len, PROT_READ, MAP_SHARED, src, 0);
  void *t = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, dst, 0);
  ck_assert_ptr_ne(s, MAP_FAILED);
  ck_assert_ptr_ne(t, MAP_FAILED);
  memcpy(t, s, len);
  munmap(s, len);
  munmap(t, len);
}

/* The bytes of the pieces a backup was handed in. */
static uint64_t pieces_total(const uint64_t *sizes, size_t n) {
  uint64_t t = 0;
  for (size_t i = 0; i < n; i++) t += sizes[i];
  return t;
}

/* The pause's Unmap for the one buffer b: it hands b's backup memory,
 * one piece (the host backend's memfd) covering it; the piece's fd is
 * dup'ed into *piece. */
static wire_env *unmap_with_backup(struct peer *w, const struct pbuf *b, uint64_t size,
                                   int *piece) {
  struct frame f;
  wire_env *e = peer_event(w, &f);
  ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
  ck_assert_uint_eq(e->unmap->n_buffer_ids, 1);
  ck_assert_uint_eq(e->unmap->n_backups, 1);
  const Gpumem__Wire__BackupMemory *m = e->unmap->backups[0];
  ck_assert_uint_eq(m->buffer_id, b->id);
  ck_assert_uint_eq(m->n_piece_sizes, 1);
  ck_assert_uint_ge(pieces_total(m->piece_sizes, m->n_piece_sizes), size);
  ck_assert_uint_eq(f.nfds, 1);
  struct stat st;
  ck_assert_int_eq(fstat(f.fds[0], &st), 0);
  ck_assert_uint_ge((uint64_t)st.st_size, size);
  *piece = dup(f.fds[0]);
  frame_release(&f);
  return e;
}

/* The resume's Remap for the one buffer b: its new chunk (taken into b)
 * and its backup's piece (dup'ed into *piece). */
static wire_env *remap_with_backup(struct peer *w, struct pbuf *b, int *piece) {
  struct frame f;
  wire_env *e = peer_event(w, &f);
  ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_REMAP);
  ck_assert_uint_eq(e->remap->n_entries, 1);
  const Gpumem__Wire__RemapEntry *en = e->remap->entries[0];
  ck_assert_uint_eq(en->buffer_id, b->id);
  ck_assert_uint_eq(en->n_chunk_sizes, 1);
  ck_assert_uint_eq(en->n_backup_piece_sizes, 1);
  ck_assert_uint_eq(f.nfds, 2);
  *piece = dup(f.fds[1]);
  peer_take_remap(e, &f, b, 1);
  frame_release(&f);
  return e;
}

/* The figures of an OpReply that must be OK. */
static uint64_t op_backup_bytes(struct peer *c) {
  wire_env *r = NULL;
  wire_code code = peer_op_wait(c, &r);
  ck_assert_msg(code == CODE(OK), "%s: %s", wire_code_name(code),
                r && r->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR ? r->error->message : "");
  uint64_t bytes = r->op_reply->backup_bytes;
  wire_env_free(r);
  return bytes;
}

/* A raw owner w (keeping its backups' memory, if keeps) and a raw
 * controller c of the daemon, w holding a BACKUP buffer a of size bytes
 * of tag weights filled with the pattern of seed. */
static void owned_backup(struct peer *w, struct peer *c, bool keeps, uint64_t size,
                         uint32_t seed, struct pbuf *a) {
  owner_open(w, keeps);
  peer_open(c, &d, CONTROLLER);
  peer_alloc(w, "weights", 0, size, BACKUP, a);
  scene_fill(a, size, seed);
}

/* The owner copies buffer a into the backup memory at piece and acks the
 * Unmap e; the pause must answer OK, counting a's backup. */
static void copy_and_ack(struct peer *w, struct peer *c, wire_env *e, struct pbuf *a, int piece,
                         uint64_t size) {
  fd_copy(piece, a->fds[0], size);
  scene_unmap_ack(w, e, a);
  ck_assert_uint_eq(op_backup_bytes(c), size);
}

/* c pauses weights and w copies a into the backup memory it is handed
 * (copy_and_ack): that memory's fd (w's to close). */
static int pause_copied(struct peer *w, struct peer *c, struct pbuf *a, uint64_t size) {
  peer_op(c, false, "weights", 0, 0);
  int piece = -1;
  wire_env *e = unmap_with_backup(w, a, size, &piece);
  copy_and_ack(w, c, e, a, piece, size);
  return piece;
}

/* An owner that says so copies its buffer into the backup memory the
 * pause hands it, and out of it at the resume: the pause counts the
 * backup, and the buffer's new memory holds what the owner put back. */
START_TEST(an_owner_copies_its_backup_out_and_in) {
  daemon_start(&d, NULL);
  struct peer w, c;
  struct pbuf a;
  const uint64_t size = 8 * MiB;
  owned_backup(&w, &c, false, size, 41, &a);
  int piece = pause_copied(&w, &c, &a, size);
  /* The backup is the daemon's memory: the owner's copy is in it. */
  struct pbuf back = {.fds = {piece}, .nfds = 1};
  ck_assert(scene_holds(&back, size, 41));
  peer_op(&c, true, "weights", 0, 0);
  int piece2 = -1;
  wire_env *e = remap_with_backup(&w, &a, &piece2);
  ck_assert(!scene_holds(&a, size, 41)); /* new memory: nothing in it yet */
  fd_copy(a.fds[0], piece2, size);
  peer_ack(&w, e->id, NULL, 0, NULL);
  wire_env_free(e);
  ck_assert_uint_eq(op_backup_bytes(&c), size);
  ck_assert(scene_holds(&a, size, 41));
  close(piece);
  close(piece2);
  peer_unmap(&a);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* An owner that cannot copy says so in its ack: the buffer keeps its
 * memory and stays ACTIVE, the pause fails naming it, and the next pause
 * hands the backup again. */
START_TEST(an_owner_that_cannot_copy_keeps_its_buffer) {
  daemon_start(&d, NULL);
  struct peer w, c;
  struct pbuf a;
  const uint64_t size = 4 * MiB;
  owned_backup(&w, &c, false, size, 7, &a);
  peer_op(&c, false, "weights", 0, 0);
  int piece = -1;
  wire_env *e = unmap_with_backup(&w, &a, size, &piece);
  close(piece);
  peer_ack(&w, e->id, &a.id, 1, "backup of buffer: import: out of luck");
  wire_env_free(e);
  wire_env *r = NULL;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(NOT_RELEASED));
  ck_assert_ptr_nonnull(strstr(r->error->message, "out of luck"));
  wire_env_free(r);
  ck_assert(scene_holds(&a, size, 7)); /* still mapped, still its contents */
  close(pause_copied(&w, &c, &a, size));
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* With --verify-backups the daemon hashes what the owner copied, and
 * restores itself: a backup changed while paused fails the resume, and
 * nothing is resumed. */
START_TEST(a_backup_changed_while_paused_is_caught) {
  daemon_start(&d, "--verify-backups", NULL);
  struct peer w, c;
  struct pbuf a;
  const uint64_t size = 4 * MiB;
  owned_backup(&w, &c, false, size, 9, &a);
  int piece = pause_copied(&w, &c, &a, size);
  struct pbuf back = {.fds = {piece}, .nfds = 1};
  scene_fill(&back, size, 10); /* the owner kept the fd and wrote through it */
  close(piece);
  wire_env *r = NULL;
  peer_op(&c, true, "weights", 0, 0);
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(BACKEND_ERROR));
  ck_assert_msg(strstr(r->error->message, "changed while paused"), "%s", r->error->message);
  wire_env_free(r);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* An owner that keeps its backup memory is handed it once: later pauses
 * and resumes name it kept, with no fds; after the owner fails an event
 * about the buffer, the memory is handed anew. */
START_TEST(an_owner_that_keeps_its_backup_is_handed_it_once) {
  daemon_start(&d, NULL);
  struct peer w, c;
  struct pbuf a;
  const uint64_t size = 4 * MiB;
  owned_backup(&w, &c, true, size, 3, &a);
  int kept = pause_copied(&w, &c, &a, size); /* the owner's "mapping" of its backup memory */
  wire_env *e;
  for (int round = 0; round < 2; round++) {
    peer_op(&c, true, "weights", 0, 0);
    struct frame f;
    e = peer_event(&w, &f);
    ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_REMAP);
    const Gpumem__Wire__RemapEntry *en = e->remap->entries[0];
    ck_assert(en->backup_kept);
    ck_assert_uint_eq(en->n_backup_piece_sizes, 0);
    ck_assert_uint_eq(f.nfds, 1); /* its chunk only */
    peer_take_remap(e, &f, &a, 1);
    frame_release(&f);
    fd_copy(a.fds[0], kept, size);
    peer_ack(&w, e->id, NULL, 0, NULL);
    wire_env_free(e);
    ck_assert_uint_eq(op_backup_bytes(&c), size);
    ck_assert(scene_holds(&a, size, 3));
    peer_op(&c, false, "weights", 0, 0);
    e = peer_event(&w, &f);
    ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
    ck_assert_uint_eq(e->unmap->n_backups, 1);
    ck_assert(e->unmap->backups[0]->kept);
    ck_assert_uint_eq(f.nfds, 0);
    frame_release(&f);
    if (round == 0) { /* the owner lost what it kept: it says so */
      peer_ack(&w, e->id, &a.id, 1, "none kept here");
      wire_env_free(e);
      ck_assert_int_eq(peer_op_code(&c), CODE(NOT_RELEASED));
      peer_op(&c, false, "weights", 0, 0);
      close(kept);
      e = unmap_with_backup(&w, &a, size, &kept); /* handed anew, with its fd */
    }
    copy_and_ack(&w, &c, e, &a, kept, size);
  }
  close(kept);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A fake daemon that answers one Hello and records what it said. */
struct hello_seen {
  struct listener l;
  pthread_t t;
  int copies, keeps; /* -1: no Hello came */
};

/* Accept one connection, answer its Hello, wait for its end. */
static void *answer_hello(void *arg) {
  struct hello_seen *h = arg;
  struct peer p = {.fd = -1}; /* peer_accept closes what p held */
  peer_accept(&p, &h->l);
  struct frame fr;
  wire_env *in = NULL;
  if (peer_await(&p, &fr, 10000, &in) == 1 && in->body_case == GPUMEM__WIRE__ENVELOPE__BODY_HELLO) {
    h->copies = in->hello->copies_backups;
    h->keeps = in->hello->keeps_backups;
    Gpumem__Wire__HelloReply r = GPUMEM__WIRE__HELLO_REPLY__INIT;
    r.version_major = WIRE_VERSION_MAJOR;
    r.version_minor = WIRE_VERSION_MINOR;
    r.backend = "host";
    r.granularity = 2 * MiB;
    wire_env out = peer_env(in->id, GPUMEM__WIRE__ENVELOPE__BODY_HELLO_REPLY);
    out.hello_reply = &r;
    peer_push(&p, &out, NULL, 0);
    peer_flush_within(&p, 5000);
    frame_release(&fr);
    wire_env_free(in);
    while (peer_await(&p, &fr, 10000, &in) == 1) { /* until the client hangs up */
      frame_release(&fr);
      wire_env_free(in);
    }
  }
  peer_close(&p);
  return NULL;
}

/* What a client connecting with role and flags says of copies_backups
 * (1 or 0), plus 2 if it says keeps_backups. */
static int hello_copies(int role, unsigned flags) {
  struct hello_seen h = {.copies = -1, .keeps = -1};
  peer_listen(&h.l, "owner-copy");
  pthread_create(&h.t, NULL, answer_hello, &h);
  gpumem_client *c = NULL;
  ck_assert_msg(gpumem_connect(h.l.path, "who", role, flags, &c) == 0, "%s", gpumem_last_error());
  gpumem_disconnect(c);
  pthread_join(h.t, NULL);
  peer_listen_close(&h.l);
  return h.copies < 0 ? -1 : h.copies + 2 * h.keeps;
}

/* A libgpumem worker copies its own backups and keeps their memory
 * mapped, unless it asks the daemon to copy (the connect flag, or
 * GPUMEM_DAEMON_COPIES=1); one that opted in to context release copies
 * and keeps nothing; a controller never says it copies. */
START_TEST(workers_copy_by_default_and_the_daemon_on_request) {
  unsetenv("GPUMEM_DAEMON_COPIES");
  unsetenv("GPUMEM_RELEASE_CONTEXT");
  ck_assert_int_eq(hello_copies(GPUMEM_ROLE_WORKER, 0), 3);
  ck_assert_int_eq(hello_copies(GPUMEM_ROLE_WORKER, GPUMEM_CONNECT_RELEASE_CONTEXT), 1);
  ck_assert_int_eq(hello_copies(GPUMEM_ROLE_WORKER, GPUMEM_CONNECT_DAEMON_COPIES), 0);
  ck_assert_int_eq(hello_copies(GPUMEM_ROLE_CONTROLLER, 0), 0);
  setenv("GPUMEM_DAEMON_COPIES", "1", 1);
  ck_assert_int_eq(hello_copies(GPUMEM_ROLE_WORKER, 0), 0);
  unsetenv("GPUMEM_DAEMON_COPIES");
  setenv("GPUMEM_RELEASE_CONTEXT", "1", 1);
  ck_assert_int_eq(hello_copies(GPUMEM_ROLE_WORKER, 0), 1);
  unsetenv("GPUMEM_RELEASE_CONTEXT");
}
END_TEST

/* Real libgpumem workers, one copying its backups and one leaving them to
 * the daemon, on one daemon: both keep their contents across pauses and
 * resumes, and the pause counts both backups. */
START_TEST(libgpumem_workers_keep_contents_either_way) {
  daemon_start(&d, NULL);
  gpumem_client *own = NULL, *dae = NULL, *ctl = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "own", GPUMEM_ROLE_WORKER, 0, &own), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "dae", GPUMEM_ROLE_WORKER,
                                  GPUMEM_CONNECT_DAEMON_COPIES, &dae), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  const uint64_t size = 6 * MiB;
  gpumem_buffer *b[2];
  gpumem_client *w[2] = {own, dae};
  uint8_t *want = malloc(size), *got = malloc(size);
  for (uint64_t i = 0; i < size; i++) want[i] = (uint8_t)(i * 7 + i / 65521);
  for (int k = 0; k < 2; k++) {
    ck_assert_int_eq(gpumem_alloc(w[k], "weights", 0, size, GPUMEM_BACKUP, &b[k]), 0);
    ck_assert_int_eq(gpumem_buffer_write(w[k], b[k], 0, want, size), 0);
  }
  const char *tag = "weights";
  for (int round = 0; round < 3; round++) {
    struct gpumem_op_report *r = NULL;
    ck_assert_msg(gpumem_pause(ctl, &tag, 1, NULL, 0, NULL, &r) == 0, "%s", gpumem_last_error());
    ck_assert_uint_eq(r->backup_bytes, 2 * size);
    gpumem_op_report_free(r);
    for (int k = 0; k < 2; k++) ck_assert_int_eq(gpumem_buffer_mapped(b[k]), 0);
    ck_assert_msg(gpumem_resume(ctl, &tag, 1, NULL, 0, NULL, &r) == 0, "%s", gpumem_last_error());
    ck_assert_uint_eq(r->backup_bytes, 2 * size);
    gpumem_op_report_free(r);
    for (int k = 0; k < 2; k++) {
      memset(got, 0, size);
      ck_assert_int_eq(gpumem_buffer_read(w[k], b[k], 0, got, size), 0);
      ck_assert_msg(memcmp(got, want, size) == 0, "worker %d round %d: contents differ", k, round);
    }
  }
  for (int k = 0; k < 2; k++) ck_assert_int_eq(gpumem_free(w[k], b[k]), 0);
  free(want);
  free(got);
  gpumem_disconnect(ctl);
  gpumem_disconnect(dae);
  gpumem_disconnect(own);
}
END_TEST

/* More kept backups than one event may list (FRAME_MAX_FDS): each pause
 * and resume still copies every one, in as many events as it takes, and
 * the contents hold. */
START_TEST(more_kept_backups_than_one_event_lists) {
  daemon_start(&d, "--host-granularity", "64K", NULL);
  gpumem_client *w = NULL, *ctl = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "many", GPUMEM_ROLE_WORKER, 0, &w), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &ctl), 0);
  enum { N = FRAME_MAX_FDS + 47 };
  const uint64_t size = 64 * 1024;
  gpumem_buffer **b = calloc(N, sizeof *b);
  for (int i = 0; i < N; i++) {
    ck_assert_msg(gpumem_alloc(w, "many", 0, size, GPUMEM_BACKUP, &b[i]) == 0, "%s",
                  gpumem_last_error());
    uint32_t v = 0x1000u + (uint32_t)i;
    ck_assert_int_eq(gpumem_buffer_fill32(w, b[i], 0, size, v), 0);
  }
  const char *tag = "many";
  for (int round = 0; round < 3; round++) { /* round 0 hands the memory, then kept */
    struct gpumem_op_report *r = NULL;
    ck_assert_msg(gpumem_pause(ctl, &tag, 1, NULL, 0, NULL, &r) == 0, "%s", gpumem_last_error());
    ck_assert_uint_eq(r->backup_bytes, N * size);
    gpumem_op_report_free(r);
    ck_assert_msg(gpumem_resume(ctl, &tag, 1, NULL, 0, NULL, &r) == 0, "%s", gpumem_last_error());
    ck_assert_uint_eq(r->backup_bytes, N * size);
    gpumem_op_report_free(r);
  }
  for (int i = 0; i < N; i++) {
    uint32_t got[2] = {0, 0};
    ck_assert_int_eq(gpumem_buffer_read(w, b[i], size - sizeof got, got, sizeof got), 0);
    ck_assert_uint_eq(got[1], 0x1000u + (uint32_t)i);
    ck_assert_int_eq(gpumem_free(w, b[i]), 0);
  }
  free(b);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

int main(void) {
  return HARNESS_RUN("owner_copy", 60, NULL, teardown,
                     an_owner_copies_its_backup_out_and_in,
                     an_owner_that_cannot_copy_keeps_its_buffer,
                     a_backup_changed_while_paused_is_caught,
                     an_owner_that_keeps_its_backup_is_handed_it_once,
                     more_kept_backups_than_one_event_lists,
                     workers_copy_by_default_and_the_daemon_on_request,
                     libgpumem_workers_keep_contents_either_way);
}
