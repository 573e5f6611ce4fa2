/* The pause engine against workers that misbehave on purpose: raw protocol
 * peers written here answer (or do not answer) each event exactly as a test
 * needs, so every interleaving is deterministic. Memory figures are the
 * kernel's, for the daemon's and this process's memfds only. */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/wire.h"
#include "common/procstat.h"
#include "harness.h"
#include "scenario.h"

static struct daemon d;

/* What the daemon process holds of the backend's memory. */
static uint64_t daemon_bytes(void) { return memfd_bytes(&d.pid, 1); }

static void teardown(void) { scene_stop(&d); }

/* A worker that cannot unmap one buffer: the pause fails, names it, and
 * the buffer stays ACTIVE and held; the other one is released. */
START_TEST(failed_unmap_fails_the_pause) {
  daemon_start(&d, NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  struct pbuf b[2];
  scene_alloc_n(&w, "kv", 0, 4 * MiB, 0, b, 2);
  peer_op(&c, false, "kv", 0, 0);
  wire_env *e = peer_event(&w, NULL);
  ck_assert_uint_eq(e->unmap->n_buffer_ids, 2);
  peer_unmap(&b[0]);
  peer_ack(&w, e->id, &b[1].id, 1, "device busy");
  wire_env_free(e);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(NOT_RELEASED));
  ck_assert_uint_eq(r->error->buffers_held, 1);
  ck_assert_uint_eq(r->error->bytes_held, 4 * MiB);
  ck_assert_uint_eq(r->error->n_pids, 1);
  ck_assert_uint_eq(r->error->pids[0], (uint32_t)getpid());
  ck_assert_ptr_nonnull(strstr(r->error->message, "device busy"));
  wire_env_free(r);
  ck_assert_uint_eq(daemon_bytes(), 4 * MiB);
  wire_env *s = peer_status(&c);
  const Gpumem__Wire__TagInfo *t = peer_tag(s, "kv");
  ck_assert(t->mixed);
  ck_assert_uint_eq(t->paused_buffers, 1);
  wire_env_free(s);
  peer_unmap(&b[1]);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* One owner fails its remap: the other owner is told to unmap again, the
 * memory is released, and every buffer is PAUSED as before. */
START_TEST(failed_remap_rolls_the_resume_back) {
  daemon_start(&d, NULL);
  struct peer w1, w2, c;
  peer_open(&w1, &d, WORKER);
  scene_open(&w2, &c, &d);
  struct pbuf b1, b2;
  peer_alloc(&w1, "kv", 0, 4 * MiB, 0, &b1);
  peer_alloc(&w2, "kv", 0, 6 * MiB, 0, &b2);
  peer_op(&c, false, "kv", 0, 0);
  wire_env *e1 = peer_event(&w1, NULL), *e2 = peer_event(&w2, NULL);
  peer_unmap(&b1);
  peer_unmap(&b2);
  peer_ack(&w1, e1->id, NULL, 0, NULL);
  peer_ack(&w2, e2->id, NULL, 0, NULL);
  wire_env_free(e1);
  wire_env_free(e2);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(OK));
  wire_env_free(r);
  ck_assert_uint_eq(daemon_bytes(), 0);
  peer_op(&c, true, "kv", 0, 0);
  struct frame f1, f2;
  e1 = peer_event(&w1, &f1);
  e2 = peer_event(&w2, &f2);
  peer_take_remap(e1, &f1, &b1, 1);
  peer_ack(&w1, e1->id, NULL, 0, NULL);
  peer_ack(&w2, e2->id, &b2.id, 1, "import failed");
  frame_release(&f1);
  frame_release(&f2);
  wire_env_free(e1);
  wire_env_free(e2);
  ck_assert_msg(!peer_waiting(&c), "the resume answered before rolling back");
  wire_env *rb = peer_event(&w1, NULL);
  ck_assert_int_eq(rb->body_case, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
  ck_assert_uint_eq(rb->unmap->buffer_ids[0], b1.id);
  scene_unmap_ack(&w1, rb, &b1);
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(BACKEND_ERROR));
  ck_assert_ptr_nonnull(strstr(r->error->message, "nothing resumed"));
  ck_assert_ptr_nonnull(strstr(r->error->message, "import failed"));
  wire_env_free(r);
  ck_assert_uint_eq(daemon_bytes(), 0);
  wire_env *s = peer_status(&c);
  const Gpumem__Wire__TagInfo *t = peer_tag(s, "kv");
  ck_assert_int_eq(t->state, GPUMEM__WIRE__BUFFER_STATE__PAUSED);
  ck_assert_uint_eq(t->paused_buffers, 2);
  ck_assert(!t->mixed);
  wire_env_free(s);
  /* Still paused for newcomers too, as before the resume. */
  struct pbuf late;
  ck_assert_int_eq(peer_try_alloc(&w1, "kv", 0, 2 * MiB, 0, &late), CODE(TAG_PAUSED));
  peer_close(&w1);
  peer_close(&w2);
  peer_close(&c);
}
END_TEST

/* A stopped worker misses its unmap: the pause says so with the bytes it
 * holds; so does every later pause or resume, until the late ack releases
 * the memory and the tag is PAUSED. */
START_TEST(missed_unmap_is_held_until_the_late_ack) {
  daemon_start(&d, "--ack-timeout", "200ms", NULL);
  struct peer w, c;
  struct pbuf b;
  wire_env *e = scene_pausing(&w, &c, &d, "kv", 8 * MiB, &b), *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(CLIENT_TIMEOUT));
  ck_assert_uint_eq(r->error->bytes_held, 8 * MiB);
  ck_assert_uint_eq(r->error->pids[0], (uint32_t)getpid());
  wire_env_free(r);
  r = scene_op(&c, false, "kv", CODE(CLIENT_TIMEOUT));
  ck_assert_uint_eq(r->error->bytes_held, 8 * MiB);
  ck_assert_ptr_nonnull(strstr(r->error->message, "has not acknowledged"));
  wire_env_free(r);
  r = scene_op(&c, true, "kv", CODE(CLIENT_TIMEOUT));
  ck_assert_ptr_nonnull(strstr(r->error->message, "nothing changed"));
  wire_env_free(r);
  ck_assert(peer_wait_tag(&c, "kv", GPUMEM__WIRE__BUFFER_STATE__PAUSING, 1));
  ck_assert_uint_eq(daemon_bytes(), 8 * MiB);
  scene_unmap_ack(&w, e, &b);
  ck_assert(peer_wait_tag(&c, "kv", GPUMEM__WIRE__BUFFER_STATE__PAUSED, 0));
  ck_assert_uint_eq(daemon_bytes(), 0);
  r = scene_op(&c, false, "kv", CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 0);
  wire_env_free(r);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A resume that times out is undone: a pause meanwhile is refused, and the
 * late remap ack is answered with an unmap, after which the tag is PAUSED
 * and its memory released. */
START_TEST(missed_remap_is_rolled_back_at_the_late_ack) {
  daemon_start(&d, "--ack-timeout", "200ms", NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 8 * MiB, 0, &b);
  scene_served(&c, &w, &b, 1, false, "kv");
  peer_op(&c, true, "kv", 0, 0);
  struct frame f;
  wire_env *e = peer_event(&w, &f), *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(CLIENT_TIMEOUT));
  ck_assert_ptr_nonnull(strstr(r->error->message, "nothing resumed"));
  wire_env_free(r);
  r = scene_op(&c, false, "kv", CODE(CLIENT_TIMEOUT));
  ck_assert_uint_eq(r->error->bytes_held, 8 * MiB);
  wire_env_free(r);
  peer_take_remap(e, &f, &b, 1);
  frame_release(&f);
  peer_ack(&w, e->id, NULL, 0, NULL);
  wire_env_free(e);
  e = peer_event(&w, NULL);
  ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
  scene_unmap_ack(&w, e, &b);
  ck_assert(peer_wait_tag(&c, "kv", GPUMEM__WIRE__BUFFER_STATE__PAUSED, 0));
  ck_assert_uint_eq(daemon_bytes(), 0);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Paused everywhere, resumed on one device: the tag says mixed, and a
 * resume of the other device makes it ACTIVE (it used to stay PAUSED). */
START_TEST(device_subsets_keep_the_tag_state_true) {
  daemon_start(&d, NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  struct pbuf b[2];
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &b[0]);
  peer_alloc(&w, "kv", 1, 2 * MiB, 0, &b[1]);
  wire_env *r = scene_served_reply(&c, &w, b, 2, false, "kv");
  ck_assert_uint_eq(r->op_reply->n_checks, 2);
  wire_env_free(r);
  /* Status keeps the last pause's figures: released, and the driver's rise. */
  wire_env *st = peer_status(&c);
  ck_assert_uint_eq(st->status_reply->n_last_pause_checks, 2);
  for (size_t i = 0; i < 2; i++) {
    const Gpumem__Wire__DeviceCheck *k = st->status_reply->last_pause_checks[i];
    ck_assert_uint_eq(k->released, 2 * MiB);
    ck_assert_uint_eq(k->free_after - k->free_before, 2 * MiB);
    ck_assert_uint_eq(k->shortfall, 0);
  }
  wire_env_free(st);
  peer_op(&c, true, "kv", 1u << 1, 0);
  r = scene_answer(&c, &w, b, 2);
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  wire_env_free(r);
  wire_env *s = peer_status(&c);
  ck_assert(peer_tag(s, "kv")->mixed);
  ck_assert_int_eq(peer_tag(s, "kv")->state, GPUMEM__WIRE__BUFFER_STATE__PAUSED);
  wire_env_free(s);
  peer_op(&c, true, "kv", 1u << 0, 0);
  wire_env_free(scene_answer(&c, &w, b, 2));
  s = peer_status(&c);
  ck_assert(!peer_tag(s, "kv")->mixed);
  ck_assert_int_eq(peer_tag(s, "kv")->state, GPUMEM__WIRE__BUFFER_STATE__ACTIVE);
  wire_env_free(s);
  peer_unmap(&b[0]);
  peer_unmap(&b[1]);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Acks for events never sent, acked twice, or sent to another session get
 * an error and change nothing; the right ack still counts. */
START_TEST(wrong_acks_are_refused) {
  daemon_start(&d, NULL);
  struct peer w1, w2, c;
  peer_open(&w1, &d, WORKER);
  scene_open(&w2, &c, &d);
  struct pbuf b;
  peer_alloc(&w1, "kv", 0, 2 * MiB, 0, &b);
  peer_ack(&w1, 999, NULL, 0, NULL);
  ck_assert_int_eq(peer_stray_error(&w1), CODE(NOT_FOUND));
  peer_op(&c, false, "kv", 0, 0);
  wire_env *e = peer_event(&w1, NULL), *r;
  peer_ack(&w2, e->id, NULL, 0, NULL);
  ck_assert_int_eq(peer_stray_error(&w2), CODE(NOT_FOUND));
  ck_assert(!peer_waiting(&c));
  uint64_t stranger = b.id + 1000;
  peer_unmap(&b);
  peer_ack(&w1, e->id, &stranger, 1, "not mine");
  ck_assert_int_eq(peer_stray_error(&w1), CODE(NOT_FOUND));
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(OK)); /* its own buffer was unmapped */
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  wire_env_free(r);
  peer_ack(&w1, e->id, NULL, 0, NULL);
  ck_assert_int_eq(peer_stray_error(&w1), CODE(NOT_FOUND));
  wire_env_free(e);
  /* The sessions still work. */
  struct pbuf b2;
  peer_alloc(&w2, "other", 0, 2 * MiB, 0, &b2);
  peer_unmap(&b2);
  peer_close(&w1);
  peer_close(&w2);
  peer_close(&c);
}
END_TEST

/* A worker that acknowledges an unmap but keeps the memory is caught by
 * the kernel's figures: the memory is not counted as free, and a later
 * pause releases it once the worker really lets go. */
START_TEST(ack_without_unmap_is_caught) {
  daemon_start(&d, NULL);
  struct peer w, c;
  struct pbuf b;
  wire_env *e = scene_pausing(&w, &c, &d, "kv", 4 * MiB, &b), *r;
  peer_ack(&w, e->id, NULL, 0, NULL); /* a lie: b's fd stays open */
  wire_env_free(e);
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(NOT_RELEASED));
  ck_assert_ptr_nonnull(strstr(r->error->message, "still maps it"));
  ck_assert_uint_eq(r->error->bytes_held, 4 * MiB);
  wire_env_free(r);
  wire_env *s = peer_status(&c);
  ck_assert_uint_eq(s->status_reply->devices[0]->managed, 4 * MiB);
  wire_env_free(s);
  ck_assert_uint_eq(daemon_bytes(), 4 * MiB);
  peer_unmap(&b);
  r = scene_op(&c, false, "kv", CODE(OK));
  ck_assert_uint_eq(r->op_reply->buffers, 1);
  wire_env_free(r);
  ck_assert_uint_eq(daemon_bytes(), 0);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* With room for every chunk but not for every export, the resume fails,
 * says why, and leaves every buffer PAUSED with nothing held. */
START_TEST(export_failure_leaves_everything_paused) {
  daemon_start(&d, "--chunk-size", "2M", NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  struct pbuf b[2];
  scene_alloc_n(&w, "kv", 0, 8 * MiB, 0, b, 2);
  scene_served(&c, &w, b, 2, false, "kv");
  /* 8 chunks to create, 8 fds to export: leave room for 12. */
  scene_cap_fds(d.pid, 12);
  wire_env *r = scene_op(&c, true, "kv", CODE(BACKEND_ERROR));
  ck_assert_ptr_nonnull(strstr(r->error->message, "export"));
  ck_assert_ptr_nonnull(strstr(r->error->message, "nothing resumed"));
  wire_env_free(r);
  ck_assert_msg(!peer_waiting(&w), "a worker was sent a remap");
  ck_assert_uint_eq(daemon_bytes(), 0);
  wire_env *s = peer_status(&c);
  ck_assert_int_eq(peer_tag(s, "kv")->state, GPUMEM__WIRE__BUFFER_STATE__PAUSED);
  ck_assert_uint_eq(peer_tag(s, "kv")->paused_buffers, 2);
  ck_assert_uint_eq(s->status_reply->devices[0]->managed, 0);
  wire_env_free(s);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* More chunks than one frame carries: the remap comes in several events,
 * each acked, and the resume waits for all. */
START_TEST(remaps_split_over_several_frames) {
  daemon_start(&d, "--chunk-size", "2M", NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  enum { N = 60 };
  static struct pbuf b[N];
  scene_alloc_n(&w, "kv", 0, 10 * MiB, 0, b, N); /* 5 chunks each */
  scene_served(&c, &w, b, N, false, "kv");
  peer_op(&c, true, "kv", 0, 0);
  peer_serve(&w, b, N, 1); /* 300 fds: the first frame carries at most 253 */
  ck_assert(!peer_waiting(&c));
  wire_env *r = scene_answer(&c, &w, b, N);
  ck_assert_uint_eq(r->op_reply->buffers, N);
  wire_env_free(r);
  for (size_t i = 0; i < N; i++) peer_unmap(&b[i]);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Bytes status says pid holds on device 0 outside the daemon (0: not listed). */
static uint64_t status_residual_of(struct peer *c, pid_t pid) {
  wire_env *s = peer_status(c);
  ck_assert(s->status_reply->processes_known);
  uint64_t bytes = 0;
  for (size_t i = 0; i < s->status_reply->n_processes; i++) {
    const Gpumem__Wire__ProcessMemory *pm = s->status_reply->processes[i];
    if (pm->pid == (uint32_t)pid && pm->device == 0) bytes = pm->residual;
  }
  wire_env_free(s);
  return bytes;
}

/* Memory another process keeps on a device outside the daemon is named
 * with its pid, and a pause with --max-residual below it fails. */
START_TEST(residual_memory_fails_a_pause_that_allows_less) {
  daemon_start(&d, NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &b);
  /* "Device memory" of our own: a memfd named as the daemon's device 0. */
  wire_env *s0 = peer_status(&c);
  char name[96];
  snprintf(name, sizeof name, "gpumem-%s", s0->status_reply->devices[0]->bus_id);
  wire_env_free(s0);
  int fd = memfd_create(name, MFD_CLOEXEC);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(ftruncate(fd, 8 * MiB), 0);
  void *p = mmap(NULL, 8 * MiB, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ck_assert(p != MAP_FAILED);
  memset(p, 1, 8 * MiB);
  close(fd);
  /* Status may take what it read of this process a moment ago (1 s at
   * most, on the host backend): it names the memory within that. */
  double until = now_ms() + harness_patience_ms(400);
  while (status_residual_of(&c, getpid()) != 8 * MiB && now_ms() < until) sched_yield();
  ck_assert_msg(status_residual_of(&c, getpid()) == 8 * MiB,
                "our 8 MiB outside the daemon is not in status");
  peer_op(&c, false, "kv", 0, 4 * MiB);
  peer_serve(&w, &b, 1, 1);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(RESIDUAL_EXCEEDED));
  char pid[32];
  snprintf(pid, sizeof pid, "pid %d", (int)getpid());
  ck_assert_ptr_nonnull(strstr(r->error->message, pid));
  ck_assert_uint_eq(r->error->checks[0]->residual, 8 * MiB);
  /* The reply names it too, per process, with what it still holds. */
  ck_assert_uint_eq(r->error->n_processes, 1);
  ck_assert_uint_eq(r->error->processes[0]->pid, (uint32_t)getpid());
  ck_assert_uint_eq(r->error->processes[0]->device, 0);
  ck_assert_uint_eq(r->error->processes[0]->used, 8 * MiB);
  wire_env_free(r);
  munmap(p, 8 * MiB);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A process that holds no device memory until told ('m'), then 8 MiB of
 * device 0 outside the daemon (a memfd named as the daemon names device
 * memory), saying 'y' when it does; it exits when its pipe closes. */
struct outsider {
  pid_t pid;
  int to, from;
};

static void outsider_start(struct outsider *o, const char *name) {
  int down[2], up[2];
  ck_assert_int_eq(pipe2(down, O_CLOEXEC), 0);
  ck_assert_int_eq(pipe2(up, O_CLOEXEC), 0);
  o->pid = fork();
  ck_assert_int_ge(o->pid, 0);
  if (o->pid == 0) {
    close(down[1]);
    close(up[0]);
    char c;
    while (read(down[0], &c, 1) == 1) {
      int fd = memfd_create(name, MFD_CLOEXEC);
      void *p = fd >= 0 && ftruncate(fd, 8 * MiB) == 0
                    ? mmap(NULL, 8 * MiB, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                    : MAP_FAILED;
      if (p != MAP_FAILED) memset(p, 1, 8 * MiB);
      if (write(up[1], p != MAP_FAILED ? "y" : "n", 1) != 1) _exit(1);
    }
    _exit(0);
  }
  close(down[0]);
  close(up[1]);
  o->to = down[1];
  o->from = up[0];
}

/* Have the process take its memory. */
static void outsider_take(struct outsider *o) {
  char c = 0;
  ck_assert_int_eq(write(o->to, "m", 1), 1);
  ck_assert_int_eq(read(o->from, &c, 1), 1);
  ck_assert_int_eq(c, 'y');
}

/* End the process and reap it. */
static void outsider_stop(struct outsider *o) {
  close(o->to);
  close(o->from);
  ck_assert_int_eq(waitpid(o->pid, NULL, 0), o->pid);
}

/* The host backend's views may take what /proc said of a process with no
 * device memory a moment ago, but a pause reads every process now: memory
 * one took after a status is caught by the pause's residual check at
 * once, and shown by status from then on. Another's memory taken after
 * the pause is shown by status in a bounded while (its process read again
 * without any operation), and processes that exit leave status at once. */
START_TEST(a_pause_reads_processes_now_whatever_status_remembers) {
  daemon_start(&d, NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  wire_env *s0 = peer_status(&c);
  char name[96];
  snprintf(name, sizeof name, "gpumem-%s", s0->status_reply->devices[0]->bus_id);
  wire_env_free(s0);
  struct outsider early, late; /* before the buffer, whose chunk they would inherit */
  outsider_start(&early, name);
  outsider_start(&late, name);
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 2 * MiB, 0, &b);
  ck_assert_uint_eq(status_residual_of(&c, early.pid), 0); /* both seen holding nothing */
  outsider_take(&early);
  peer_op(&c, false, "kv", 0, 4 * MiB);
  peer_serve(&w, &b, 1, 1);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(RESIDUAL_EXCEEDED));
  char pid[32];
  snprintf(pid, sizeof pid, "pid %d", (int)early.pid);
  ck_assert_msg(strstr(r->error->message, pid), "%s", r->error->message);
  ck_assert_uint_eq(r->error->checks[0]->residual, 8 * MiB);
  wire_env_free(r);
  ck_assert_uint_eq(status_residual_of(&c, early.pid), 8 * MiB);
  outsider_take(&late);
  double until = now_ms() + 11000 + harness_patience_ms(1000); /* 11 s at most by design */
  while (status_residual_of(&c, late.pid) == 0 && now_ms() < until) sched_yield();
  ck_assert_uint_eq(status_residual_of(&c, late.pid), 8 * MiB);
  outsider_stop(&late); /* first: it holds early's pipe too, from the fork */
  outsider_stop(&early);
  ck_assert_uint_eq(status_residual_of(&c, early.pid), 0);
  ck_assert_uint_eq(status_residual_of(&c, late.pid), 0);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A buffer its owner freed is not memory held outside the daemon, even to
 * a status that takes what it read of the owner's process a moment ago:
 * the chunk was the daemon's when it was read, and is read again. */
START_TEST(a_freed_buffer_is_not_shown_as_held_outside) {
  daemon_start(&d, NULL);
  struct peer c;
  peer_open(&c, &d, CONTROLLER);
  gpumem_client *w = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  gpumem_buffer *b = NULL;
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 64 * MiB, 0, &b), 0);
  ck_assert_uint_eq(status_residual_of(&c, getpid()), 0); /* read: it maps the chunk */
  ck_assert_int_eq(gpumem_free(w, b), 0);
  ck_assert_uint_eq(status_residual_of(&c, getpid()), 0);
  gpumem_disconnect(w);
  peer_close(&c);
}
END_TEST

/* A worker's ack of its pause of an 8 MiB buffer b, left for the daemon
 * to read in one turn with what the test sends next: the daemon is frozen
 * and the ack pushed (flush, then daemon_thaw). Before it, frees Frees of
 * a buffer that does not exist; late: the pause timed out first. */
static void ack_frozen(struct peer *w, struct peer *c, struct pbuf *b, int frees, bool late) {
  wire_env *e = scene_pausing(w, c, &d, "kv", 8 * MiB, b), *r;
  if (late) {
    ck_assert_int_eq(peer_op_wait(c, &r), CODE(CLIENT_TIMEOUT));
    wire_env_free(r);
  }
  peer_unmap(b);
  daemon_freeze(&d);
  for (int i = 0; i < frees; i++) peer_push_free(w, 999999);
  peer_push_ack(w, e->id, CODE(OK), NULL, 0, NULL);
  wire_env_free(e);
}

/* An Unmap's ack is settled with the other acks of its turn of the
 * loop; whatever is read with it sees it settled. Here: a Free of the
 * buffer sent right behind the ack frees it (not WRONG_STATE: PAUSING). */
START_TEST(a_free_read_with_the_ack_frees_the_buffer) {
  daemon_start(&d, NULL);
  struct peer w, c;
  struct pbuf b;
  ack_frozen(&w, &c, &b, 0, false);
  peer_push_free(&w, b.id);
  ck_assert_int_eq(peer_flush_within(&w, 1000), 0);
  daemon_thaw(&d);
  wire_env *r = peer_answer(&w);
  char why[300] = "";
  ck_assert_msg(peer_reply_code(r, why, sizeof why) == CODE(OK), "free: %s", why);
  wire_env_free(r);
  peer_op_ok(&c, 1, 8 * MiB);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A worker that acks and exits at once, both read in one turn: its
 * buffer counts in the pause it answered (1 buffer, 8 MiB), though its
 * session's end frees it. */
START_TEST(an_owner_that_acks_and_exits_is_counted) {
  daemon_start(&d, NULL);
  struct peer w, c;
  struct pbuf b;
  ack_frozen(&w, &c, &b, 0, false);
  ck_assert_int_eq(peer_flush_within(&w, 1000), 0);
  peer_close(&w);
  daemon_thaw(&d);
  peer_op_ok(&c, 1, 8 * MiB);
  peer_close(&c);
}
END_TEST

/* An ack that waits behind other frames (served on a later step of the
 * loop, from the session's backlog) is settled as soon: the pause is
 * answered without waiting for the ack timeout (300 s here). */
START_TEST(an_ack_behind_other_frames_is_settled_at_once) {
  daemon_start(&d, "--ack-timeout", "300s", NULL);
  struct peer w, c;
  struct pbuf b;
  ack_frozen(&w, &c, &b, 6, false); /* more frames than one step serves */
  ck_assert_int_eq(peer_flush_within(&w, 1000), 0);
  daemon_thaw(&d);
  peer_op_ok(&c, 1, 8 * MiB);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A straggler's late ack and a new pause read in one turn: the pause
 * finds the buffer settled (PAUSED), not still held by the owner. */
START_TEST(a_pause_read_with_a_late_ack_finds_it_settled) {
  daemon_start(&d, "--ack-timeout", "200ms", NULL);
  struct peer w, c;
  struct pbuf b;
  ack_frozen(&w, &c, &b, 0, true);
  ck_assert_int_eq(peer_flush_within(&w, 1000), 0);
  const char *tags[] = {"kv"};
  peer_push_op_tags(&c, false, tags, 1, 0, 0);
  ck_assert_int_eq(peer_flush_within(&c, 1000), 0);
  daemon_thaw(&d);
  peer_op_ok(&c, 0, 0);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* The state letter of a process ('T': stopped, 'Z': a zombie), 0 when
 * it is gone. */
static char proc_state(pid_t pid) {
  struct procstat st;
  return procstat_read((int)pid, &st) == 0 ? st.state : 0;
}

/* What the last thread of a dying owner holds: its session's socket and
 * the pipe end it waits on. */
struct dying {
  int sock, hold;
};

/* The last thread of a dying owner: once the main thread has exited (the
 * kernel shows the process a zombie), it ends the session, then keeps the
 * memory (the fds it shares) until a byte comes on hold or the pipe
 * closes: a process on its way out that the driver still lists. */
static void *last_thread(void *arg) {
  struct dying *x = arg;
  while (proc_state(getpid()) != 'Z') poll(NULL, 0, 1); /* the kernel's word, no event */
  close(x->sock);
  char c;
  (void)!read(x->hold, &c, 1);
  _exit(0); /* every thread, a sanitizer's own too */
}

/* A child owning 64 MiB of kv that dies during the pause: at the Unmap
 * its main thread exits and its last thread holds on (last_thread) until
 * the test closes hold_w (the child's copy is closed). */
static pid_t dying_owner(int ready, int hold, int hold_w) {
  pid_t kid = fork();
  ck_assert_int_ge(kid, 0);
  if (kid) return kid;
  close(hold_w);
  static struct peer w;
  static struct pbuf b;
  peer_open(&w, &d, WORKER);
  peer_alloc(&w, "kv", 0, 64 * MiB, 0, &b);
  ck_assert_int_eq(write(ready, "r", 1), 1);
  wire_env_free(peer_event(&w, NULL));
  static struct dying x;
  x = (struct dying){.sock = w.fd, .hold = hold};
  pthread_t t;
  if (pthread_create(&t, NULL, last_thread, &x) != 0) _exit(3);
  syscall(SYS_exit, 0); /* this thread only */
  return 0;
}

/* Start a dying owner and a controller's pause of kv; the owner's pipes. */
static pid_t pause_a_dying_owner(struct peer *c, int *hold_w) {
  int ready[2], hold[2];
  ck_assert_int_eq(pipe(ready), 0);
  ck_assert_int_eq(pipe(hold), 0);
  pid_t kid = dying_owner(ready[1], hold[0], hold[1]);
  close(ready[1]);
  close(hold[0]);
  peer_open(c, &d, CONTROLLER);
  char x;
  ck_assert_int_eq(read(ready[0], &x, 1), 1);
  close(ready[0]);
  *hold_w = hold[1];
  const char *tags[] = {"kv"};
  peer_push_op_tags(c, false, tags, 1, 0, 0);
  ck_assert_int_eq(peer_flush_within(c, 1000), 0);
  return kid;
}

/* An owner that dies during a pause while the driver still lists it (its
 * last thread holds the memory): the pause waits for it to leave the
 * list, and says how long it waited. */
START_TEST(a_pause_waits_for_a_dead_owner_to_leave_the_driver) {
  daemon_start(&d, NULL);
  struct peer c;
  int hold;
  pid_t kid = pause_a_dying_owner(&c, &hold);
  double end = now_ms() + harness_patience_ms(2000);
  while (daemon_log_count(&d, "to leave the driver: pid") == 0 && now_ms() < end)
    poll(NULL, 0, 5); /* the log line says the wait began */
  ck_assert_int_eq(daemon_log_count(&d, "to leave the driver: pid"), 1);
  close(hold); /* the last thread goes: the process is gone */
  int st;
  ck_assert_int_eq(waitpid(kid, &st, 0), kid);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->n_checks, 1);
  ck_assert_uint_gt(r->op_reply->checks[0]->exit_wait_ms, 0);
  ck_assert_uint_eq(r->op_reply->checks[0]->n_exit_listed_pids, 0);
  wire_env_free(r);
  ck_assert_int_eq(daemon_log_count(&d, "waited"), 1);
  peer_close(&c);
}
END_TEST

/* The wait is bounded (--exit-wait): for a dead owner that goes on being
 * listed the daemon says how long it waited and that the driver still
 * lists it (the host model's free memory is the daemon's own figure, so
 * the pause itself is judged a success here; on a GPU the memory it
 * holds is not free and the pause fails). An owner that ends its session
 * and lives on is not waited for at all. */
START_TEST(an_ended_owner_is_waited_for_a_bounded_time_and_only_if_dead) {
  daemon_start(&d, "--exit-wait", "300ms", NULL);
  struct peer c;
  int hold;
  pid_t kid = pause_a_dying_owner(&c, &hold);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(OK));
  const Gpumem__Wire__DeviceCheck *k = r->op_reply->checks[0];
  ck_assert_uint_ge(k->exit_wait_ms, 300);
  ck_assert_uint_eq(k->n_exit_listed_pids, 1);
  ck_assert_uint_eq(k->exit_listed_pids[0], (uint32_t)kid);
  wire_env_free(r);
  ck_assert_int_eq(daemon_log_count(&d, "still listed by the driver after"), 1);
  wire_env *last = peer_status(&c); /* the last pause's figures are kept */
  ck_assert_uint_eq(last->status_reply->n_last_pause_checks, 1);
  ck_assert_uint_eq(last->status_reply->last_pause_checks[0]->exit_listed_pids[0],
                    (uint32_t)kid);
  wire_env_free(last);
  close(hold);
  int st;
  ck_assert_int_eq(waitpid(kid, &st, 0), kid);
  /* A live owner that ends its session: not waited for. */
  struct peer w;
  struct pbuf b;
  peer_open(&w, &d, WORKER);
  peer_alloc(&w, "kv2", 0, 64 * MiB, 0, &b);
  const char *tags[] = {"kv2"};
  peer_push_op_tags(&c, false, tags, 1, 0, 0);
  ck_assert_int_eq(peer_flush_within(&c, 1000), 0);
  wire_env_free(peer_event(&w, NULL));
  peer_close(&w);
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(OK));
  ck_assert_uint_eq(r->op_reply->checks[0]->exit_wait_ms, 0);
  wire_env_free(r);
  peer_unmap(&b);
  peer_close(&c);
}
END_TEST

/* On SIGTERM every session is told, outside any request. */
START_TEST(shutdown_is_announced) {
  daemon_start(&d, NULL);
  struct peer w;
  peer_open(&w, &d, WORKER);
  kill(d.pid, SIGTERM);
  ck_assert_int_eq(peer_stray_error(&w), CODE(SHUTTING_DOWN));
  ck_assert_int_eq(daemon_stop(&d), 0);
  peer_close(&w);
}
END_TEST

int main(void) {
  return HARNESS_RUN("engine", 20, NULL, teardown, failed_unmap_fails_the_pause,
                     failed_remap_rolls_the_resume_back, missed_unmap_is_held_until_the_late_ack,
                     missed_remap_is_rolled_back_at_the_late_ack,
                     device_subsets_keep_the_tag_state_true, wrong_acks_are_refused,
                     ack_without_unmap_is_caught, export_failure_leaves_everything_paused,
                     remaps_split_over_several_frames,
                     residual_memory_fails_a_pause_that_allows_less,
                     a_pause_reads_processes_now_whatever_status_remembers,
                     a_freed_buffer_is_not_shown_as_held_outside, shutdown_is_announced,
                     a_free_read_with_the_ack_frees_the_buffer,
                     an_owner_that_acks_and_exits_is_counted,
                     an_ack_behind_other_frames_is_settled_at_once,
                     a_pause_read_with_a_late_ack_finds_it_settled,
                     a_pause_waits_for_a_dead_owner_to_leave_the_driver,
                     an_ended_owner_is_waited_for_a_bounded_time_and_only_if_dead);
}
