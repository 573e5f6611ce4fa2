/* Backups end to end: contents, limits, verification, host memory made
 * in the background when a BACKUP buffer is allocated, a pause that
 * cannot back up, and what status, metrics and gpumemctl say. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/wire.h"
#include "gpumem.h"
#include "harness.h"
#include "scenario.h"

static struct daemon d;

static void teardown(void) { scene_stop(&d); }

/* What a pause or resume moved, as these tests read it. */
struct op_figures {
  uint64_t buffers, bytes, backup_bytes;
};

/* Pause or resume one tag and keep its figures (timeout_ms 0: default). */
static int op_tag(gpumem_client *c, bool resume, const char *tag, uint32_t timeout_ms,
                  struct op_figures *r) {
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.timeout_ms = timeout_ms;
  struct gpumem_op_report *rep = NULL;
  int rc = resume ? gpumem_resume(c, &tag, 1, NULL, 0, &o, &rep)
                  : gpumem_pause(c, &tag, 1, NULL, 0, &o, &rep);
  memset(r, 0, sizeof *r);
  if (rep) {
    r->buffers = rep->buffers;
    r->bytes = rep->bytes;
    r->backup_bytes = rep->backup_bytes;
  }
  gpumem_op_report_free(rep);
  return rc;
}

/* Pause one tag. */
static int pause_tag(gpumem_client *c, const char *tag, struct op_figures *r) {
  return op_tag(c, false, tag, 0, r);
}

/* Resume one tag, waiting up to timeout_ms for each owner. */
static int resume_tag(gpumem_client *c, const char *tag, uint32_t timeout_ms,
                      struct op_figures *r) {
  return op_tag(c, true, tag, timeout_ms, r);
}

/* The daemon's status. */
static int status_of(gpumem_client *c, struct gpumem_status **s) { return gpumem_status(c, s); }

static gpumem_client *controller(void) {
  gpumem_client *c = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "test", GPUMEM_ROLE_CONTROLLER,
                                  GPUMEM_CONNECT_NO_THREAD, &c), 0);
  return c;
}

/* Run gpumemctl with arguments; its exit status and output. */
static int ctl(char *out, size_t len, const char *args) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "%s --socket %s %s 2>&1", harness_bin("gpumemctl"), d.socket, args);
  FILE *p = popen(cmd, "r");
  size_t n = fread(out, 1, len - 1, p);
  out[n] = '\0';
  int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* With --verify-backups every restore is read back and compared; status
 * and metrics show the backups and the copy bandwidth. */
START_TEST(verified_backups_survive_and_are_reported) {
  daemon_start(&d, "--verify-backups", NULL);
  struct worker w;
  worker_start(&w, &d, "--tag", "weights", "--size", "40M", "--count", "2", "--backup", NULL);
  char out[8192];
  ck_assert_int_eq(ctl(out, sizeof out, "pause --json weights"), 0);
  ck_assert_msg(strstr(out, "\"backup_bytes\":83886080"), "%s", out);
  ck_assert_int_eq(ctl(out, sizeof out, "status --json"), 0);
  ck_assert_msg(strstr(out, "\"backup_bytes\":83886080"), "%s", out);
  ck_assert_msg(strstr(out, "\"last_backup_bytes\":83886080"), "%s", out);
  ck_assert_int_eq(ctl(out, sizeof out, "metrics"), 0);
  ck_assert_msg(strstr(out, "gpumem_tag_backup_bytes{tag=\"weights\"} 83886080"), "%s", out);
  ck_assert_msg(strstr(out, "# TYPE gpumem_device_free_bytes gauge"), "%s", out);
  ck_assert_int_eq(ctl(out, sizeof out, "resume weights"), 0);
  ck_assert(worker_wait_for(&w, "contents kept", 2, 5000));
  ck_assert_int_eq(ctl(out, sizeof out, "status"), 0);
  ck_assert_msg(strstr(out, "last pause copied 80.0 MiB at") && strstr(out, "last resume copied"),
                "%s", out);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

START_TEST(backup_limit_refuses_at_allocation) {
  daemon_start(&d, "--backup-limit", "64M", NULL);
  gpumem_client *w;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  gpumem_buffer *a, *b;
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 48 * MiB, GPUMEM_BACKUP, &a), 0);
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 32 * MiB, GPUMEM_BACKUP, &b), GPUMEM_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "--backup-limit"));
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 32 * MiB, 0, &b), 0);
  ck_assert_int_eq(gpumem_free(w, a), 0);
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 64 * MiB, GPUMEM_BACKUP, &a), 0);
  gpumem_disconnect(w);
}
END_TEST

/* The daemon's VmSize in KiB. */
static unsigned long long daemon_vm_kb(void) {
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)d.pid);
  FILE *f = fopen(path, "r");
  unsigned long long vm_kb = 0;
  while (fgets(line, sizeof line, f)) sscanf(line, "VmSize: %llu kB", &vm_kb);
  fclose(f);
  return vm_kb;
}

/* The status's backup_ready, through a raw controller. */
static uint64_t backup_ready(struct peer *c) {
  wire_env *s = peer_status(c);
  uint64_t ready = s->status_reply->backup_ready;
  wire_env_free(s);
  return ready;
}

/* Poll status until backup_ready is want (up to 30 s). */
static bool wait_ready(struct peer *c, uint64_t want) {
  for (double end = now_ms() + 30000; now_ms() < end; usleep(5000))
    if (backup_ready(c) == want) return true;
  return false;
}

/* Without host memory for a backup, the buffer is still allocated, keeps
 * its device memory and its contents, and the pause says so; once there
 * is room, the next pause makes the memory on its own path. */
START_TEST(pause_without_room_for_a_backup_releases_nothing_of_it) {
  daemon_start(&d, NULL);
  /* Leave the daemon no address space for a 256 MiB backup, from before
   * the buffer exists (its memory is made as it is allocated). */
  struct rlimit old, lim;
  ck_assert_int_eq(prlimit(d.pid, RLIMIT_AS, NULL, &old), 0);
  lim.rlim_cur = (daemon_vm_kb() + 64 * 1024) * 1024; /* the soft limit only: it can go back up */
  lim.rlim_max = old.rlim_max;
  ck_assert_int_eq(prlimit(d.pid, RLIMIT_AS, &lim, NULL), 0);
  struct worker w;
  worker_start(&w, &d, "--tag", "weights", "--size", "256M", "--backup", NULL);
  struct peer raw;
  peer_open(&raw, &d, CONTROLLER);
  gpumem_client *c = controller();
  struct op_figures r;
  ck_assert_int_eq(pause_tag(c, "weights", &r), GPUMEM_E_OUT_OF_MEMORY);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "no host memory for the backup"));
  ck_assert_uint_eq(backup_ready(&raw), 0);
  struct gpumem_status *s;
  ck_assert_int_eq(status_of(c, &s), 0);
  ck_assert_uint_eq(s->devices[0]->managed, 256 * MiB);
  ck_assert_uint_eq(s->tags[0]->paused_bytes, 0);
  gpumem_status_free(s);
  ck_assert_int_eq(prlimit(d.pid, RLIMIT_AS, &old, NULL), 0);
  /* The buffer comes back with its contents: its memory never left. */
  ck_assert_int_eq(resume_tag(c, "weights", 60000, &r), 0);
  ck_assert(worker_wait_for(&w, "contents kept", 1, 5000));
  /* With room again, the pause makes the backup memory itself. */
  ck_assert_int_eq(pause_tag(c, "weights", &r), 0);
  ck_assert_uint_eq(r.backup_bytes, 256 * MiB);
  ck_assert_uint_eq(backup_ready(&raw), 256 * MiB);
  ck_assert_int_eq(resume_tag(c, "weights", 60000, &r), 0);
  ck_assert(worker_wait_for(&w, "contents kept", 2, 5000));
  gpumem_disconnect(c);
  peer_close(&raw);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* BACKUP buffers get their host memory as they are allocated, without a
 * pause; freeing them gives it back. */
START_TEST(backup_memory_is_made_at_allocation) {
  daemon_start(&d, NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  struct pbuf a, b, plain;
  peer_alloc(&w, "weights", 0, 32 * MiB, BACKUP, &a);
  peer_alloc(&w, "weights", 1, 16 * MiB, BACKUP, &b);
  peer_alloc(&w, "kv", 0, 8 * MiB, 0, &plain);
  ck_assert(wait_ready(&c, 48 * MiB));
  wire_env *s = peer_status(&c);
  ck_assert_uint_eq(s->status_reply->backup_reserved, 48 * MiB);
  ck_assert_uint_eq(s->status_reply->last_backup_bytes, 0); /* no pause made it */
  wire_env_free(s);
  /* A pause uses it: no more is made. */
  struct pbuf both[] = {a, b};
  wire_env *r = scene_served_reply(&c, &w, both, 2, false, "weights");
  ck_assert_uint_eq(r->op_reply->backup_bytes, 48 * MiB);
  wire_env_free(r);
  ck_assert_uint_eq(backup_ready(&c), 48 * MiB);
  scene_served(&c, &w, both, 2, true, "weights");
  a = both[0];
  b = both[1];
  /* Freed, their host memory goes. */
  struct pbuf *bufs[] = {&a, &b};
  uint64_t left[] = {16 * MiB, 0};
  for (int i = 0; i < 2; i++) {
    ck_assert_int_eq(scene_free_code(&w, bufs[i]->id), CODE(OK));
    peer_unmap(bufs[i]);
    ck_assert_uint_eq(backup_ready(&c), left[i]);
  }
  peer_unmap(&plain);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Answer one event for one raw buffer, however long the daemon's copies
 * take on a slow machine. */
static void serve_one(struct peer *w, struct pbuf *b) {
  struct frame f;
  wire_env *e = peer_get_within(w, &f, 60000);
  ck_assert_ptr_nonnull(e);
  scene_serve_event(w, e, &f, b, 1);
}

/* Ask for a buffer without waiting for the reply. */
static void send_alloc(struct peer *w, const char *tag, unsigned dev, uint64_t size) {
  peer_push_alloc(w, tag, dev, size, BACKUP);
  ck_assert_int_eq(peer_flush_within(w, 5000), 0);
}

/* The next alloc reply, its one chunk fd kept in b. */
static void take_alloc(struct peer *w, struct pbuf *b) {
  struct frame f;
  wire_env *r = peer_get(w, &f);
  ck_assert_int_eq(peer_reply_code(r, NULL, 0), CODE(OK));
  ck_assert_uint_eq(f.nfds, 1);
  memset(b, 0, sizeof *b);
  b->id = r->alloc_reply->buffer_id;
  b->fds[b->nfds++] = f.fds[0];
  f.fds[0] = -1;
  frame_release(&f);
  wire_env_free(r);
}

/* Send a pause or resume of one tag, the worker's own buffers only. */
static void send_own(struct peer *w, bool resume, const char *tag) {
  const struct scene_scope own = {.own = true};
  scene_send_scoped(w, resume, &tag, 1, &own);
}

/* The worker's own pause of one buffer, already sent: at its Unmap the
 * worker writes the pattern of seed into the first len bytes (its last
 * writes before it lets go), unmaps and acks; then its own resume. The
 * pause's backup bytes. */
static uint64_t own_cycle(struct peer *w, const char *tag, struct pbuf *b, uint64_t len,
                          uint32_t seed) {
  wire_env *e = peer_get_within(w, NULL, 60000);
  ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
  scene_fill(b, len, seed);
  scene_unmap_ack(w, e, b);
  wire_env *r = peer_get_within(w, NULL, 60000);
  ck_assert_int_eq(peer_reply_code(r, NULL, 0), CODE(OK));
  uint64_t backed = r->op_reply->backup_bytes;
  wire_env_free(r);
  send_own(w, true, tag);
  serve_one(w, b);
  r = peer_get_within(w, NULL, 60000);
  ck_assert_int_eq(peer_reply_code(r, NULL, 0), CODE(OK));
  wire_env_free(r);
  ck_assert(scene_holds(b, len, seed));
  return backed;
}

/* Pauses that come while host memory is still being made: the one pool
 * thread has 1 GiB of backups to make first (256 MiB under a sanitizer,
 * whose memset makes host memory at some 40 MB/s: still seconds of work
 * ahead of the pause). Buffers that start paused need no device memory,
 * so they are allocated at once. The pause finds its buffer's job still
 * queued and makes the memory itself, never a second one, and backs up
 * right. */
START_TEST(pause_racing_the_background_allocation_backs_up_right) {
  setenv("UV_THREADPOOL_SIZE", "1", 1);
  daemon_start(&d, NULL);
  unsetenv("UV_THREADPOOL_SIZE");
  struct peer w, c;
  scene_open(&w, &c, &d);
  struct pbuf seed, big[4], small;
  const uint64_t size = (HARNESS_SANITIZED ? 64 : 256) * MiB;
  peer_alloc(&w, "big", 0, 2 * MiB, 0, &seed);
  scene_served(&c, &w, &seed, 1, false, "big");
  for (int i = 0; i < 4; i++)
    peer_alloc(&w, "big", 0, size, BACKUP | GPUMEM__WIRE__BUFFER_FLAG__FLAG_ALLOW_PAUSED,
               &big[i]);
  send_alloc(&w, "small", 1, 2 * MiB);
  send_own(&w, false, "small");
  take_alloc(&w, &small);
  ck_assert_uint_eq(own_cycle(&w, "small", &small, 2 * MiB, 0x5eed), 2 * MiB);
  ck_assert_int_eq(daemon_log_count(&d, "still queued: made on the pause path"), 1);
  /* Exactly one backup each: what was made is what the buffers need. */
  ck_assert_msg(wait_ready(&c, 4 * size + 2 * MiB), "backup memory ready: %llu bytes",
                (unsigned long long)backup_ready(&c));
  peer_unmap(&seed);
  peer_unmap(&small);
  peer_close(&w);
  ck_assert(wait_ready(&c, 0));
  peer_close(&c);
}
END_TEST

/* The debug line in which a pause that took a running job says how many
 * bytes of a backup of size bytes were made in the background and how
 * many on its own path; false if there is none. */
static bool taken_split(uint64_t size, unsigned long long *background,
                        unsigned long long *on_path) {
  char want[96], line[1024];
  snprintf(want, sizeof want, "backup memory of %llu bytes: ", (unsigned long long)size);
  FILE *f = fopen(d.log, "r");
  bool found = false;
  while (f && !found && fgets(line, sizeof line, f)) {
    const char *at = strstr(line, want);
    found = at && sscanf(at + strlen(want), "%llu made in the background, %llu on the pause",
                         background, on_path) == 2;
  }
  if (f) fclose(f);
  return found;
}

/* A pause that comes while the thread pool is making its buffer's host
 * memory (a piece at a time) takes the job: the piece in progress is
 * waited for, the rest made on the pause path, each piece once, and the
 * backup is right. */
START_TEST(pause_taking_a_running_job_makes_each_piece_once) {
  daemon_start(&d, NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  uint64_t size = 512 * MiB, piece = 64 * MiB;
  struct pbuf big;
  send_alloc(&w, "big", 0, size);
  take_alloc(&w, &big);
  send_own(&w, false, "big");
  ck_assert_uint_eq(own_cycle(&w, "big", &big, 4 * MiB, 0xb16), size);
  unsigned long long background = 0, on_path = 0;
  if (taken_split(size, &background, &on_path)) {
    ck_assert_uint_eq(background + on_path, size);
    ck_assert_uint_eq(background % piece, 0);
  } else { /* the pool had not started it: all of it on the pause path */
    ck_assert_int_eq(daemon_log_count(&d, "still queued: made on the pause path"), 1);
  }
  /* Made once: the daemon holds exactly the buffer's backup. */
  ck_assert(wait_ready(&c, size));
  peer_unmap(&big);
  peer_close(&w);
  ck_assert(wait_ready(&c, 0));
  peer_close(&c);
}
END_TEST

/* BACKUP buffers freed (or their session gone) while their host memory is
 * being made leave nothing behind, and a daemon stopped meanwhile waits
 * for the work and exits cleanly (ASan checks the rest). */
START_TEST(buffers_freed_while_their_backup_memory_is_made_leak_nothing) {
  daemon_start(&d, NULL);
  struct peer w, c;
  peer_open(&c, &d, CONTROLLER);
  /* A first BACKUP buffer starts the thread pool (its stacks count). */
  peer_open(&w, &d, WORKER);
  struct pbuf first;
  peer_alloc(&w, "warm", 0, 2 * MiB, BACKUP, &first);
  ck_assert(wait_ready(&c, 2 * MiB));
  peer_unmap(&first);
  peer_close(&w);
  ck_assert(wait_ready(&c, 0));
  unsigned long long vm0 = daemon_vm_kb();
  for (int round = 0; round < 4; round++) {
    peer_open(&w, &d, WORKER);
    struct pbuf b[4];
    for (int i = 0; i < 4; i++) peer_alloc(&w, "weights", (unsigned)i % 2, 64 * MiB, BACKUP, &b[i]);
    for (int i = 0; i < 2; i++) /* two freed, two go with the session */
      ck_assert_int_eq(scene_free_code(&w, b[i].id), CODE(OK));
    for (int i = 0; i < 4; i++) peer_unmap(&b[i]);
    peer_close(&w);
  }
  ck_assert(wait_ready(&c, 0));
  wire_env *s = peer_status(&c);
  ck_assert_uint_eq(s->status_reply->backup_reserved, 0);
  ck_assert_uint_eq(s->status_reply->n_sessions, 1);
  wire_env_free(s);
  /* Every job ended and its memory went (the address space is back). */
  bool back = false;
  for (double end = now_ms() + 10000; !back && now_ms() < end; usleep(5000))
    back = daemon_vm_kb() < vm0 + 32 * 1024; /* a backup left behind is 64 MiB */
  ck_assert_msg(back, "VmSize %llu kB, %llu kB before", daemon_vm_kb(), vm0);
  /* Stopped while a job runs: it waits for it and exits 0. */
  peer_open(&w, &d, WORKER);
  struct pbuf last;
  peer_alloc(&w, "weights", 0, 256 * MiB, BACKUP, &last);
  peer_unmap(&last);
  ck_assert_int_eq(daemon_stop(&d), 0);
  d.pid = 0;
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* gpumemctl: 0 done, 1 failed with the daemon's words, 2 usage. */
START_TEST(gpumemctl_exit_codes) {
  daemon_start(&d, NULL);
  char out[4096];
  ck_assert_int_eq(ctl(out, sizeof out, ""), 2);
  ck_assert_int_eq(ctl(out, sizeof out, "frobnicate"), 2);
  ck_assert_int_eq(ctl(out, sizeof out, "pause"), 2);
  ck_assert_int_eq(ctl(out, sizeof out, "--device x pause kv"), 2);
  ck_assert_int_eq(ctl(out, sizeof out, "pause 'kv cache'"), 1);
  ck_assert_ptr_nonnull(strstr(out, "invalid tag"));
  ck_assert_int_eq(ctl(out, sizeof out, "--device 9 pause kv"), 1);
  ck_assert_ptr_nonnull(strstr(out, "device 9 is not one of the"));
  ck_assert_int_eq(ctl(out, sizeof out, "pause kv"), 1); /* no such tag: not success */
  ck_assert_ptr_nonnull(strstr(out, "no tag 'kv'"));
  ck_assert_int_eq(ctl(out, sizeof out, "list --json"), 0);
  ck_assert_str_eq(out, "[]\n");
  char cmd[256];
  snprintf(cmd, sizeof cmd, "%s --socket /nonexistent/sock status 2>&1", harness_bin("gpumemctl"));
  FILE *p = popen(cmd, "r");
  size_t n = fread(out, 1, sizeof out - 1, p);
  out[n] = '\0';
  int status = pclose(p);
  ck_assert_int_eq(WEXITSTATUS(status), 1);
  ck_assert_ptr_nonnull(strstr(out, "cannot connect"));
}
END_TEST

/* Run gpumemctl as user nobody; its exit status and output. */
static int ctl_as_nobody(char *out, size_t len, const char *cmd, const char *tag) {
  int fds[2];
  ck_assert_int_eq(pipe(fds), 0);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    if (setgid(65534) < 0 || setuid(65534) < 0) _exit(99);
    execl(harness_others_bin("gpumemctl"), "gpumemctl", "--socket", d.socket, cmd, tag,
          (char *)NULL);
    _exit(98);
  }
  close(fds[1]);
  size_t n = 0;
  ssize_t k;
  while (n < len - 1 && (k = read(fds[0], out + n, len - 1 - n)) > 0) n += (size_t)k;
  out[n] = '\0';
  close(fds[0]);
  int status;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Anyone who may reach the socket may look; only controllers may pause. */
START_TEST(only_controllers_pause_but_anyone_may_look) {
  if (!harness_others_can_run("only_controllers_pause_but_anyone_may_look")) return;
  daemon_start(&d, NULL);
  ck_assert_int_eq(chmod(d.dir, 0755), 0);
  ck_assert_int_eq(chmod(d.socket, 0666), 0);
  char out[4096];
  ck_assert_int_eq(ctl_as_nobody(out, sizeof out, "pause", "kv"), 1);
  ck_assert_msg(strstr(out, "PERMISSION_DENIED") && strstr(out, "may not pause"), "%s", out);
  ck_assert_int_eq(ctl_as_nobody(out, sizeof out, "status", NULL), 0);
  ck_assert_msg(strstr(out, "backend host"), "%s", out);
  ck_assert_int_eq(ctl_as_nobody(out, sizeof out, "metrics", NULL), 0);
  /* gpumemctl's own worker session is left out. */
  ck_assert_msg(strstr(out, "\ngpumem_sessions 0\n"), "%.2000s", out);
}
END_TEST

/* A worker holds its chunks' memfds: it may not shrink one (the daemon's
 * backup copy would fault with SIGBUS), grow one (memory the daemon does
 * not count), or seal one against the daemon's writes. The pause and the
 * resume after the attempts work and keep the contents. */
START_TEST(a_worker_cannot_resize_or_seal_its_chunks) {
  daemon_start(&d, NULL);
  struct peer w, c;
  scene_open(&w, &c, &d);
  struct pbuf a;
  peer_alloc(&w, "weights", 0, 8 * MiB, BACKUP, &a);
  ck_assert_uint_ge(a.nfds, 1);
  int fd = a.fds[0];
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  uint8_t *m = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ck_assert_ptr_ne(m, MAP_FAILED);
  memset(m, 0x5a, (size_t)st.st_size);
  ck_assert_int_eq(munmap(m, (size_t)st.st_size), 0);
  errno = 0;
  ck_assert_int_eq(ftruncate(fd, 0), -1);
  ck_assert_int_eq(errno, EPERM);
  ck_assert_int_eq(ftruncate(fd, st.st_size * 4), -1);
  ck_assert_int_eq(errno, EPERM);
  ck_assert_int_eq(fallocate(fd, 0, st.st_size, st.st_size), -1);
  ck_assert_int_eq(errno, EPERM);
  ck_assert_int_eq(fcntl(fd, F_ADD_SEALS, F_SEAL_FUTURE_WRITE), -1);
  ck_assert_int_eq(errno, EPERM);
  scene_served(&c, &w, &a, 1, false, "weights");
  scene_served(&c, &w, &a, 1, true, "weights");
  m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, a.fds[0], 0);
  ck_assert_ptr_ne(m, MAP_FAILED);
  for (off_t i = 0; i < st.st_size; i += 4096) ck_assert_uint_eq(m[i], 0x5a);
  ck_assert_int_eq(munmap(m, (size_t)st.st_size), 0);
  peer_unmap(&a);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

int main(void) {
  return HARNESS_RUN("backup", 60, NULL, teardown,
                     a_worker_cannot_resize_or_seal_its_chunks,
                     verified_backups_survive_and_are_reported,
                     backup_limit_refuses_at_allocation,
                     pause_without_room_for_a_backup_releases_nothing_of_it,
                     backup_memory_is_made_at_allocation,
                     pause_racing_the_background_allocation_backs_up_right,
                     pause_taking_a_running_job_makes_each_piece_once,
                     buffers_freed_while_their_backup_memory_is_made_leak_nothing,
                     gpumemctl_exit_codes,
                     only_controllers_pause_but_anyone_may_look);
}
