/* The HIP backend end to end on a machine without an AMD GPU: gpumemd
 * --backend hip and real workers (gpumem-worker, and processes forked
 * from the test on libgpumem) over the stand-in runtime
 * (tests/hip/fake_hip.c, $GPUMEM_BUILD/tests/hip/libamdhip64.so), whose
 * device memory is host memory and whose free memory is what every
 * process on the node still holds. Each test has a universe of its own
 * (FAKE_HIP_DIR): two devices of 256 MiB. Built with HIP=0 (no HIP
 * headers), the suite says it skipped. */
#include <stdio.h>

#ifdef HAVE_HIP
#include <check.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpumem.h"
#include "harness.h"
#include "scenario.h"

#define DEVICE_BYTES (256 * MiB)
#define KID_LINE 256

static struct daemon d;
static char universe[64]; /* this test's directory; FAKE_HIP_DIR is rt in it */

/* Processes a test forked: a failed assertion must not leave one behind. */
static pid_t kids[8];
static size_t nkids;

/* Note a forked process for the teardown. */
static void track(pid_t pid) {
  if (nkids < sizeof kids / sizeof kids[0]) kids[nkids++] = pid;
}

/* Give the test a universe of its own: two devices of 256 MiB. */
static void setup(void) {
  harness_fd_setup();
  snprintf(universe, sizeof universe, "/tmp/gpumem-hip.XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(universe));
  char rt[96];
  snprintf(rt, sizeof rt, "%s/rt", universe); /* made by the stand-in */
  setenv("FAKE_HIP_DIR", rt, 1);
  setenv("FAKE_HIP_DEVICES", "2", 1);
  setenv("FAKE_HIP_DEVICE_BYTES", "256M", 1);
}

/* End the test's processes, remove its universe, stop its daemon (which
 * must exit 0) and check that no fd leaked. */
static void teardown(void) {
  for (size_t i = 0; i < nkids; i++) {
    kill(kids[i], SIGKILL);
    waitpid(kids[i], NULL, 0);
  }
  nkids = 0;
  char path[128];
  snprintf(path, sizeof path, "%s/rt/lock", universe);
  unlink(path);
  snprintf(path, sizeof path, "%s/rt", universe);
  rmdir(path);
  rmdir(universe);
  harness_daemon_teardown(&d);
}

/* Start gpumemd on the HIP backend, in chunks of 4 MiB (so that buffers
 * are several mappings), with one more argument unless NULL. */
static void start_daemon(const char *extra) {
  daemon_start(&d, "--backend", "hip", "--chunk-size", "4M", extra, NULL);
}

/* A controller of d, on libgpumem (it loads the stand-in too). */
static gpumem_client *controller(void) {
  gpumem_client *c;
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, &c), 0);
  return c;
}

/* Pause or resume one tag (pause: asking for context releases or not). */
static int op(gpumem_client *c, bool resume, const char *tag, bool release,
              struct gpumem_op_report **r) {
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.release_context = release;
  return resume ? gpumem_resume(c, &tag, 1, NULL, 0, &o, r)
                : gpumem_pause(c, &tag, 1, NULL, 0, &o, r);
}

/* Pause or resume one tag, which must succeed; the report. */
static struct gpumem_op_report *op_ok(gpumem_client *c, bool resume, const char *tag) {
  struct gpumem_op_report *r = NULL;
  int rc = op(c, resume, tag, false, &r);
  ck_assert_msg(rc == 0, "%s %s: %s", resume ? "resume" : "pause", tag, gpumem_last_error());
  return r;
}

/* A device in a status, by the daemon's number. */
static const struct gpumem_device_status *device_of(const struct gpumem_status *s, unsigned dev) {
  for (size_t i = 0; i < s->ndevices; i++)
    if (s->devices[i]->node_device == dev) return s->devices[i];
  ck_abort_msg("no device %u in the status", dev);
  return NULL;
}

/* A tag in a status. */
static const struct gpumem_tag_status *tag_of(const struct gpumem_status *s, const char *tag) {
  for (size_t i = 0; i < s->ntags; i++)
    if (strcmp(s->tags[i]->name, tag) == 0) return s->tags[i];
  ck_abort_msg("no tag %s in the status", tag);
  return NULL;
}

/* The driver's figures must say that a pause released (resume: took)
 * exactly bytes of device dev. */
static void assert_moved(const struct gpumem_op_report *r, unsigned dev, uint64_t bytes,
                         bool resume) {
  const struct gpumem_device_check *k = NULL;
  for (size_t i = 0; i < r->nchecks; i++)
    if (r->checks[i]->node_device == dev) k = r->checks[i];
  ck_assert_msg(k, "no check of device %u in the report", dev);
  ck_assert_uint_eq(k->released, bytes);
  ck_assert_uint_eq(k->shortfall, 0);
  if (resume)
    ck_assert_uint_eq(k->free_before - k->free_after, bytes);
  else
    ck_assert_uint_eq(k->free_after - k->free_before, bytes);
}

/* Device dev as the status shows it must be the stand-in's (its bus id,
 * the same number here), use managed bytes, all of them gpumemd's (none
 * held outside it), and have a context of gpumemd's or not. */
static void assert_device(gpumem_client *c, unsigned dev, uint64_t managed, int context) {
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_str_eq(s->backend, "hip");
  const struct gpumem_device_status *v = device_of(s, dev);
  char bus[16];
  snprintf(bus, sizeof bus, "0000:%02x:00.0", 0x10 + dev);
  ck_assert_str_eq(v->bus_id, bus);
  ck_assert_int_eq(v->device, (int)dev);
  ck_assert_uint_eq(v->total, DEVICE_BYTES);
  ck_assert_uint_eq(v->free, DEVICE_BYTES - managed);
  ck_assert_uint_eq(v->managed, managed);
  ck_assert_uint_eq(v->unmanaged, 0);
  ck_assert_int_eq(v->daemon_context, context);
  gpumem_status_free(s);
}

/* Wait (bounded) until the daemon holds a context on dev or not. */
static bool wait_context(gpumem_client *c, unsigned dev, int context) {
  double end = now_ms() + harness_patience_ms(2000);
  int now;
  do {
    struct gpumem_status *s;
    ck_assert_int_eq(gpumem_status(c, &s), 0);
    now = device_of(s, dev)->daemon_context;
    gpumem_status_free(s);
  } while (now != context && now_ms() < end);
  return now == context;
}

/* --- workers forked from the test --- */

/* The runtime's calls an application makes itself, from the library
 * libgpumem loads too (the stand-in, first in the loader's path). */
struct app_calls {
  int (*init)(unsigned flags);
  int (*set_device)(int dev);
  int (*get_device)(int *dev);
  int (*malloc)(void **p, size_t size);
};

/* Load the runtime as an application does and initialize it, with dev
 * current on this thread; false where that fails. */
static bool app_start(struct app_calls *a, int dev) {
  void *lib = dlopen("libamdhip64.so", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return false;
  a->init = (int (*)(unsigned))dlsym(lib, "hipInit");
  a->set_device = (int (*)(int))dlsym(lib, "hipSetDevice");
  a->get_device = (int (*)(int *))dlsym(lib, "hipGetDevice");
  a->malloc = (int (*)(void **, size_t))dlsym(lib, "hipMalloc");
  return a->init && a->set_device && a->get_device && a->malloc && a->init(0) == 0 &&
         a->set_device(dev) == 0;
}

/* Whether dev is still current on this thread. */
static bool app_device_is(const struct app_calls *a, int dev) {
  int now = -1;
  return a->get_device(&now) == 0 && now == dev;
}

/* A worker forked from the test, on libgpumem, with one buffer: the test
 * writes a step's letter to it, and it answers with one line, "ok" or
 * what went wrong. */
struct kid {
  pid_t pid;
  int to, from;
};

/* Word i of the pattern of seed. */
static uint32_t word(uint32_t seed, size_t i) { return (uint32_t)i * 2654435761u ^ seed; }

/* Write the pattern of seed to memory, word by word. */
static void put_pattern(uint32_t *p, size_t words, uint32_t seed) {
  for (size_t i = 0; i < words; i++) p[i] = word(seed, i);
}

/* Whether memory holds the pattern of seed. */
static bool has_pattern(const uint32_t *p, size_t words, uint32_t seed) {
  for (size_t i = 0; i < words; i++)
    if (p[i] != word(seed, i)) return false;
  return true;
}

/* A buffer used both ways: a pattern written through its pointer reads
 * back through the library, and one the library writes (the next seed)
 * shows through the pointer, which *seed then names. Empty, or what
 * failed. */
static const char *round_trip(gpumem_client *c, gpumem_buffer *b, uint32_t *seed) {
  uint64_t size = gpumem_buffer_size(b);
  uint32_t *dev = gpumem_buffer_ptr(b), *host = malloc(size), s = *seed + 1;
  const char *bad = !host ? "out of memory" : "";
  if (!*bad) put_pattern(dev, size / 4, s);
  if (!*bad && gpumem_buffer_read(c, b, 0, host, size) < 0) bad = "the read failed";
  if (!*bad && !has_pattern(host, size / 4, s)) bad = "the read differs from the pointer";
  if (!*bad) put_pattern(host, size / 4, s + 1);
  if (!*bad && gpumem_buffer_write(c, b, 0, host, size) < 0) bad = "the write failed";
  if (!*bad && !has_pattern(dev, size / 4, s + 1)) bad = "the write does not show";
  free(host);
  *seed = s + 1;
  return bad;
}

/* One step on the kid's buffer, whose pointer was first and which holds
 * the pattern of *seed: 'p' paused (unmapped, copies refused), 'k' kept
 * mapped with its pattern (never paused), 'r' resumed (its pointer back,
 * a BACKUP buffer with its pattern), 'q' freed; 'k' and 'r' then use it
 * both ways. Empty, or what is wrong. */
static const char *kid_step(char step, gpumem_client *c, gpumem_buffer *b, void *first,
                            uint32_t *seed) {
  uint32_t x = 0, *p = gpumem_buffer_ptr(b);
  size_t words = gpumem_buffer_size(b) / 4;
  bool backup = gpumem_buffer_flags(b) & GPUMEM_BACKUP;
  switch (step) {
  case 'p':
    if (gpumem_buffer_mapped(b)) return "still mapped while paused";
    return gpumem_buffer_write(c, b, 0, &x, sizeof x) == GPUMEM_E_WRONG_STATE
               ? "" : "a write while paused did not fail with GPUMEM_E_WRONG_STATE";
  case 'k':
    if (!gpumem_buffer_mapped(b) || !has_pattern(p, words, *seed)) return "its contents are gone";
    return round_trip(c, b, seed);
  case 'r':
    if (p != first || !gpumem_buffer_mapped(b)) return "not mapped at its pointer again";
    if (backup && !has_pattern(p, words, *seed)) return "a BACKUP buffer lost its contents";
    return round_trip(c, b, seed);
  case 'q':
    return gpumem_free(c, b) == 0 ? "" : gpumem_last_error();
  }
  return "no such step";
}

/* Answer the test with one line. */
static void kid_answer(int fd, const char *bad) {
  char line[KID_LINE] = "";
  snprintf(line, sizeof line, "%s", *bad ? bad : "ok");
  (void)!write(fd, line, sizeof line);
}

/* The kid: with the other device current on its thread, as an
 * application may have it, connect, allocate, write a pattern through the
 * pointer, answer; then one answer per step, until 'q' or the end. No
 * gpumem call may change the thread's device. */
static _Noreturn void kid_main(int in, int out, const char *tag, int dev, uint64_t size,
                               unsigned flags) {
  struct app_calls app;
  int mine = !dev;
  gpumem_client *c;
  gpumem_buffer *b;
  if (!app_start(&app, mine)) {
    kid_answer(out, "cannot load the runtime");
    _exit(1);
  }
  if (gpumem_connect(d.socket, "kid", GPUMEM_ROLE_WORKER, 0, &c) < 0 ||
      gpumem_alloc(c, tag, dev, size, flags, &b) < 0) {
    kid_answer(out, gpumem_last_error());
    _exit(1);
  }
  void *first = gpumem_buffer_ptr(b);
  uint32_t seed = 1;
  put_pattern(first, gpumem_buffer_size(b) / 4, seed);
  const char *moved = "a gpumem call changed the thread's device";
  kid_answer(out, app_device_is(&app, mine) ? "" : moved);
  for (char step = 0; step != 'q' && read(in, &step, 1) == 1;) {
    const char *bad = kid_step(step, c, b, first, &seed);
    kid_answer(out, *bad || app_device_is(&app, mine) ? bad : moved);
  }
  gpumem_disconnect(c);
  _exit(0);
}

/* The kid's next answer, which must be "ok". */
static void kid_ok(struct kid *k, const char *what) {
  char line[KID_LINE];
  size_t got = 0;
  for (ssize_t n; got < sizeof line && (n = read(k->from, line + got, sizeof line - got)) > 0;)
    got += (size_t)n;
  ck_assert_msg(got == sizeof line, "%s: the worker ended", what);
  line[sizeof line - 1] = '\0';
  ck_assert_msg(strcmp(line, "ok") == 0, "%s: %s", what, line);
}

/* Fork a kid with a buffer of tag on dev, of size bytes and flags. */
static void kid_start(struct kid *k, const char *tag, int dev, uint64_t size, unsigned flags) {
  int to[2], from[2];
  ck_assert_int_eq(pipe2(to, O_CLOEXEC), 0);
  ck_assert_int_eq(pipe2(from, O_CLOEXEC), 0);
  k->pid = fork();
  ck_assert_int_ge(k->pid, 0);
  if (k->pid == 0) {
    close(to[1]);
    close(from[0]);
    kid_main(to[0], from[1], tag, dev, size, flags);
  }
  track(k->pid);
  close(to[0]);
  close(from[1]);
  k->to = to[1];
  k->from = from[0];
  kid_ok(k, "allocating");
}

/* Have the kid take a step; it must answer "ok". */
static void kid_do(struct kid *k, char step) {
  char what[] = {'s', 't', 'e', 'p', ' ', step, '\0'};
  ck_assert_int_eq(write(k->to, &step, 1), 1);
  kid_ok(k, what);
}

/* Have the kid free its buffer and exit, which it must do with 0. */
static void kid_end(struct kid *k) {
  kid_do(k, 'q');
  int st;
  ck_assert_int_eq(waitpid(k->pid, &st, 0), k->pid);
  ck_assert_msg(WIFEXITED(st) && WEXITSTATUS(st) == 0, "status %d", st);
  close(k->to);
  close(k->from);
}

/* --- the tests --- */

/* A paused buffer leaves the device: the reply's driver check shows its
 * bytes free again (every mapping of it, in every process, gone), status
 * shows it paused; resumed, the worker finds it at the same pointer, and
 * it works through the pointer and through the library. */
START_TEST(a_paused_buffer_leaves_the_device_and_comes_back_at_its_pointer) {
  start_daemon(NULL);
  struct kid k;
  kid_start(&k, "kv", 1, 16 * MiB, 0);
  gpumem_client *c = controller();
  assert_device(c, 1, 16 * MiB, 0);
  assert_device(c, 0, 0, 0);
  struct gpumem_op_report *r = op_ok(c, false, "kv");
  ck_assert_uint_eq(r->buffers, 1);
  ck_assert_uint_eq(r->bytes, 16 * MiB);
  assert_moved(r, 1, 16 * MiB, false);
  gpumem_op_report_free(r);
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_int_eq(tag_of(s, "kv")->state, GPUMEM_PAUSED);
  ck_assert_uint_eq(tag_of(s, "kv")->paused_bytes, 16 * MiB);
  gpumem_status_free(s);
  assert_device(c, 1, 0, 0);
  kid_do(&k, 'p');
  r = op_ok(c, true, "kv");
  assert_moved(r, 1, 16 * MiB, true);
  gpumem_op_report_free(r);
  assert_device(c, 1, 16 * MiB, 0);
  kid_do(&k, 'r');
  kid_end(&k);
  assert_device(c, 1, 0, 0);
  gpumem_disconnect(c);
}
END_TEST

/* The driver check is real: a worker that acknowledges the unmap but
 * still holds the memory (a raw worker, by the fds it was given) fails
 * the pause with NOT_RELEASED and the figures (past the check's slack:
 * 16 MiB and a granule per buffer); once it lets go, the memory is free. */
START_TEST(memory_still_held_fails_the_pause) {
  start_daemon(NULL);
  struct peer w, c;
  struct pbuf b;
  wire_env *e = scene_pausing(&w, &c, &d, "kv", 32 * MiB, &b);
  peer_ack(&w, e->id, NULL, 0, NULL);
  wire_env_free(e);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(NOT_RELEASED));
  ck_assert_msg(strstr(r->error->message,
                       "device 0: released 32.0 MiB, but the driver shows only 0 B more free: "
                       "32.0 MiB not returned"),
                "%s", r->error->message);
  wire_env_free(r);
  peer_unmap(&b);
  gpumem_client *ctl = controller();
  assert_device(ctl, 0, 0, 0);
  gpumem_disconnect(ctl);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* BACKUP buffers (of unequal chunks: 10 MiB is 4 + 4 + 2) keep their
 * contents across pause and resume, checked by the daemon
 * (--verify-backups) and by the workers; their pinned host memory lives
 * in the runtime's context, which the daemon holds while they exist. */
START_TEST(backup_buffers_keep_their_contents) {
  start_daemon("--verify-backups");
  struct kid k;
  kid_start(&k, "weights", 0, 12 * MiB, GPUMEM_BACKUP);
  struct worker w;
  worker_start(&w, &d, "--tag", "weights", "--size", "10M", "--count", "2", "--device", "1",
               "--backup", NULL);
  gpumem_client *c = controller();
  ck_assert(wait_context(c, 0, 1) && wait_context(c, 1, 1));
  struct gpumem_op_report *r = op_ok(c, false, "weights");
  ck_assert_uint_eq(r->buffers, 3);
  ck_assert_uint_eq(r->backup_bytes, 32 * MiB);
  assert_moved(r, 0, 12 * MiB, false);
  assert_moved(r, 1, 20 * MiB, false);
  gpumem_op_report_free(r);
  kid_do(&k, 'p');
  r = op_ok(c, true, "weights");
  ck_assert_uint_eq(r->backup_bytes, 32 * MiB);
  assert_moved(r, 0, 12 * MiB, true);
  assert_moved(r, 1, 20 * MiB, true);
  gpumem_op_report_free(r);
  kid_do(&k, 'r');
  ck_assert(worker_wait_for(&w, "contents kept", 2, 2000));
  assert_device(c, 0, 12 * MiB, 1);
  kid_end(&k);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
  ck_assert(wait_context(c, 0, 0) && wait_context(c, 1, 0));
  gpumem_disconnect(c);
}
END_TEST

/* A legacy IPC buffer (plain device memory opened from its handle) is
 * skipped by a pause and keeps working; the daemon holds the context its
 * memory lives in until it is freed. */
START_TEST(a_legacy_ipc_buffer_is_skipped_and_keeps_working) {
  start_daemon(NULL);
  struct kid k;
  kid_start(&k, "kv", 1, 8 * MiB, GPUMEM_IPC_LEGACY);
  gpumem_client *c = controller();
  assert_device(c, 1, 8 * MiB, 1);
  struct gpumem_op_report *r = op_ok(c, false, "kv");
  ck_assert_uint_eq(r->buffers, 0);
  ck_assert_uint_eq(r->skipped, 1);
  gpumem_op_report_free(r);
  kid_do(&k, 'k');
  assert_device(c, 1, 8 * MiB, 1);
  gpumem_op_report_free(op_ok(c, true, "kv"));
  kid_do(&k, 'k');
  kid_end(&k);
  assert_device(c, 1, 0, 0);
  gpumem_disconnect(c);
}
END_TEST

/* A pause that asks for context releases is refused them on HIP, which
 * has no checkpoint calls, saying so; the pause itself happens (the
 * memory leaves the device), and the worker runs on and comes back. */
START_TEST(a_context_release_is_refused_and_the_pause_happens) {
  start_daemon(NULL);
  setenv("GPUMEM_RELEASE_CONTEXT", "1", 1);
  struct worker w;
  worker_start(&w, &d, "--tag", "kv", "--size", "8M", NULL);
  unsetenv("GPUMEM_RELEASE_CONTEXT");
  gpumem_client *c = controller();
  struct gpumem_op_report *r;
  ck_assert_int_eq(op(c, false, "kv", true, &r), GPUMEM_E_RELEASE_REFUSED);
  ck_assert_str_eq(r->code, "RELEASE_REFUSED");
  ck_assert_msg(strstr(r->message, "context release refused: the hip driver has no checkpoint "
                                   "calls (its buffers are paused)"),
                "%s", r->message);
  assert_moved(r, 0, 8 * MiB, false);
  ck_assert_uint_eq(r->nreleases, 1);
  ck_assert_uint_eq(r->releases[0]->pid, (uint32_t)w.pid);
  ck_assert_int_eq(r->releases[0]->released, 0);
  ck_assert_msg(strstr(r->releases[0]->why, "no checkpoint calls"), "%s", r->releases[0]->why);
  gpumem_op_report_free(r);
  ck_assert(worker_wait_for(&w, "paused buffer", 1, 2000));
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_int_eq(tag_of(s, "kv")->state, GPUMEM_PAUSED);
  ck_assert_uint_eq(tag_of(s, "kv")->paused_bytes, 8 * MiB);
  bool opted_in = false;
  for (size_t i = 0; i < s->nsessions; i++) {
    opted_in |= s->sessions[i]->pid == (uint32_t)w.pid && s->sessions[i]->release_context;
    ck_assert_int_eq(s->sessions[i]->context_released, 0);
  }
  ck_assert(opted_in);
  gpumem_status_free(s);
  gpumem_op_report_free(op_ok(c, true, "kv"));
  ck_assert(worker_wait_for(&w, "verified buffer", 1, 2000));
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
  gpumem_disconnect(c);
}
END_TEST

/* The daemon holds no context on a device while idle, nor for plain
 * buffers, their pauses and resumes (create, export, import and release
 * need none): status says so throughout. */
START_TEST(the_daemon_holds_no_context_for_plain_buffers) {
  start_daemon(NULL);
  gpumem_client *c = controller();
  assert_device(c, 0, 0, 0);
  assert_device(c, 1, 0, 0);
  struct worker w0, w1;
  worker_start(&w0, &d, "--tag", "kv", "--size", "8M", NULL);
  worker_start(&w1, &d, "--tag", "kv", "--size", "6M", "--device", "1", NULL);
  assert_device(c, 0, 8 * MiB, 0);
  assert_device(c, 1, 6 * MiB, 0);
  struct gpumem_op_report *r = op_ok(c, false, "kv");
  assert_moved(r, 0, 8 * MiB, false);
  assert_moved(r, 1, 6 * MiB, false);
  gpumem_op_report_free(r);
  assert_device(c, 0, 0, 0);
  assert_device(c, 1, 0, 0);
  gpumem_op_report_free(op_ok(c, true, "kv"));
  ck_assert(worker_wait_for(&w0, "verified buffer", 1, 2000));
  ck_assert(worker_wait_for(&w1, "verified buffer", 1, 2000));
  assert_device(c, 0, 8 * MiB, 0);
  assert_device(c, 1, 6 * MiB, 0);
  ck_assert_int_eq(worker_stop(&w0, SIGTERM), 0);
  ck_assert_int_eq(worker_stop(&w1, SIGTERM), 0);
  gpumem_disconnect(c);
}
END_TEST

/* A daemon that dies is followed by one that adopts the memory its
 * worker still maps (imported from the fds the worker kept): counted
 * once, on its device, and paused and resumed like any other. */
START_TEST(a_restarted_daemon_adopts_mapped_memory) {
  start_daemon(NULL);
  struct kid k;
  kid_start(&k, "kv", 1, 12 * MiB, 0);
  kill(d.pid, SIGKILL);
  ck_assert_int_eq(waitpid(d.pid, NULL, 0), d.pid);
  const char *const again[] = {"--backend", "hip", "--chunk-size", "4M", NULL};
  d.pid = daemon_spawn(d.socket, d.log, again);
  ck_assert(daemon_wait_ready(&d));
  gpumem_client *c = controller();
  double end = now_ms() + harness_patience_ms(2000);
  while (daemon_log_count(&d, "re-registered 1 buffers") < 1 && now_ms() < end) {
    struct gpumem_status *s; /* a round trip: the daemon's loop has turned */
    ck_assert_int_eq(gpumem_status(c, &s), 0);
    gpumem_status_free(s);
  }
  assert_device(c, 1, 12 * MiB, 0);
  kid_do(&k, 'k');
  struct gpumem_op_report *r = op_ok(c, false, "kv");
  assert_moved(r, 1, 12 * MiB, false);
  gpumem_op_report_free(r);
  kid_do(&k, 'p');
  gpumem_op_report_free(op_ok(c, true, "kv"));
  kid_do(&k, 'r');
  kid_end(&k);
  assert_device(c, 1, 0, 0);
  gpumem_disconnect(c);
}
END_TEST

/* A process holding device memory outside gpumemd (hipMalloc, on dev):
 * its pid; it lets go and exits when *hold (the write end) closes. */
static pid_t hold_outside(int dev, uint64_t bytes, int *hold) {
  int ready[2], wait[2];
  ck_assert_int_eq(pipe2(ready, O_CLOEXEC), 0);
  ck_assert_int_eq(pipe2(wait, O_CLOEXEC), 0);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    close(ready[0]);
    close(wait[1]);
    struct app_calls app;
    void *p;
    char ok = app_start(&app, dev) && app.malloc(&p, bytes) == 0 ? 'y' : 'n';
    (void)!write(ready[1], &ok, 1);
    (void)!read(wait[0], &ok, 1);
    _exit(0);
  }
  track(pid);
  close(ready[1]);
  close(wait[0]);
  char ok = 0;
  ck_assert_int_eq(read(ready[0], &ok, 1), 1);
  close(ready[0]);
  ck_assert_int_eq(ok, 'y');
  *hold = wait[1];
  return pid;
}

/* Adopt a buffer of one chunk, fd's memory (consumed); the code, the
 * words in why. */
static wire_code adopt_fd(struct peer *w, int fd, uint64_t size, char *why, size_t len) {
  uint64_t chunks[] = {size};
  Gpumem__Wire__AdoptBuffer b = GPUMEM__WIRE__ADOPT_BUFFER__INIT;
  b.tag = (char *)"kv";
  b.size = size;
  b.chunk_sizes = chunks;
  b.n_chunk_sizes = 1;
  Gpumem__Wire__AdoptBuffer *bufs[] = {&b};
  Gpumem__Wire__AdoptRequest a = GPUMEM__WIRE__ADOPT_REQUEST__INIT;
  a.buffers = bufs;
  a.n_buffers = 1;
  wire_env env = peer_env(w->next_id++, GPUMEM__WIRE__ENVELOPE__BODY_ADOPT);
  env.adopt = &a;
  env.fd_count = 1;
  peer_put(w, &env, &fd, 1);
  wire_env *r = peer_get(w, NULL);
  ck_assert_ptr_nonnull(r);
  wire_code code = peer_reply_code(r, why, len);
  wire_env_free(r);
  return code;
}

/* Bad input to a daemon on the stand-in gets clear errors: an allocation
 * larger than the device (its size from the runtime), one larger than
 * what is free (memory another process holds outside gpumemd counts, and
 * status shows it unmanaged) with the figures and the runtime's word, and
 * memory that is not the driver's handed over for adoption. */
START_TEST(bad_input_gets_clear_errors) {
  start_daemon("--chunk-size=64M"); /* 200 MiB in 4 chunks, the last one smaller */
  int hold;
  pid_t holder = hold_outside(1, 64 * MiB, &hold);
  gpumem_client *c = controller(), *w;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 512 * MiB, 0, &b), GPUMEM_E_INVALID);
  ck_assert_msg(strstr(gpumem_last_error(), "is larger than device 0 (268435456 bytes)"), "%s",
                gpumem_last_error());
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_uint_eq(device_of(s, 1)->unmanaged, 64 * MiB);
  ck_assert_uint_eq(device_of(s, 1)->free, DEVICE_BYTES - 64 * MiB);
  gpumem_status_free(s);
  ck_assert_int_eq(gpumem_alloc(w, "kv", 1, 200 * MiB, 0, &b), GPUMEM_E_OUT_OF_MEMORY);
  ck_assert_msg(strstr(gpumem_last_error(), "device 1: 209715200 bytes needed, 201326592 free") &&
                    strstr(gpumem_last_error(), "hipErrorOutOfMemory"),
                "%s", gpumem_last_error());
  close(hold);
  ck_assert_int_eq(waitpid(holder, NULL, 0), holder);
  ck_assert_int_eq(gpumem_alloc(w, "kv", 1, 200 * MiB, 0, &b), 0);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  struct peer raw;
  peer_open(&raw, &d, WORKER);
  char why[512];
  int fd = memfd_create("not-hip", MFD_CLOEXEC);
  ck_assert_int_eq(ftruncate(fd, 4 * MiB), 0);
  ck_assert_int_eq(adopt_fd(&raw, fd, 4 * MiB, why, sizeof why), CODE(INVALID_ARGUMENT));
  ck_assert_msg(strstr(why, "hipMemImportFromShareableHandle: hipErrorInvalidValue (not this "
                            "driver's memory?)"),
                "%s", why);
  peer_close(&raw);
  assert_device(c, 0, 0, 0);
  assert_device(c, 1, 0, 0);
  gpumem_disconnect(w);
  gpumem_disconnect(c);
}
END_TEST

/* Run this suite again with the stand-in's directory first in the
 * loader's path: the loader reads LD_LIBRARY_PATH only as a program
 * starts, and the test's own clients and forked workers must load the
 * stand-in, as gpumemd and gpumem-worker do. */
static void use_stand_in(char **argv) {
  char dir[PATH_MAX], lib[PATH_MAX + 32], path[2 * PATH_MAX];
  if (!realpath(harness_built("tests/hip"), dir)) {
    fprintf(stderr, "check_hip: no stand-in runtime in %s: build it (make HIP=1)\n",
            harness_built("tests/hip"));
    exit(1);
  }
  snprintf(lib, sizeof lib, "%s/libamdhip64.so", dir);
  if (access(lib, R_OK) < 0) {
    fprintf(stderr, "check_hip: %s is not built\n", lib);
    exit(1);
  }
  const char *now = getenv("LD_LIBRARY_PATH");
  size_t n = strlen(dir);
  if (now && strncmp(now, dir, n) == 0 && (now[n] == ':' || now[n] == '\0')) return;
  snprintf(path, sizeof path, "%s%s%s", dir, now && *now ? ":" : "", now ? now : "");
  setenv("LD_LIBRARY_PATH", path, 1);
  execv("/proc/self/exe", argv);
  perror("check_hip: execv /proc/self/exe");
  exit(1);
}

int main(int argc, char **argv) {
  (void)argc;
  use_stand_in(argv);
  return HARNESS_RUN("hip", 20, setup, teardown,
                     a_paused_buffer_leaves_the_device_and_comes_back_at_its_pointer,
                     memory_still_held_fails_the_pause, backup_buffers_keep_their_contents,
                     a_legacy_ipc_buffer_is_skipped_and_keeps_working,
                     a_context_release_is_refused_and_the_pause_happens,
                     the_daemon_holds_no_context_for_plain_buffers,
                     a_restarted_daemon_adopts_mapped_memory, bad_input_gets_clear_errors);
}

#else

int main(void) {
  printf("check_hip: skipped: built with HIP=0 (no HIP headers), so there is no HIP backend "
         "to run\n");
  return 0;
}

#endif
