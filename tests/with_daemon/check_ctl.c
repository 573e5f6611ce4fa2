/* gpumemctl as an operator and an orchestrator see it: the real program
 * against a real daemon and real workers (exit codes, the driver's checks
 * after a pause, status --json), and against a scripted daemon that gives
 * the answers a real one gives only when things go wrong (NOT_RELEASED with
 * pids and bytes held, a shortfall, a process holding memory outside). */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/wire.h"
#include "gpumem.h"
#include "harness.h"

#define MiB (1ull << 20)
#define GiB (1ull << 30)

static struct daemon d;

/* A scripted daemon: a child process that greets every client and answers
 * each request with a canned reply, writing what it was asked to a file. */
struct fake {
  pid_t pid;
  char dir[64];
  char socket[96];
  char asked[128];
};

static struct fake fk;

/* The backend the scripted daemon names in its HelloReply. */
static const char *fake_backend = "host";

/* What gpumemctl printed, and where the files go. */
static char out_buf[1 << 16], err_buf[1 << 16];

/* Stop the scripted daemon and remove its directory. */
static void fake_stop(struct fake *f) {
  if (f->pid > 0) {
    kill(f->pid, SIGKILL);
    waitpid(f->pid, NULL, 0);
    f->pid = 0;
  }
  if (f->dir[0]) {
    char cmd[160];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", f->dir);
    f->dir[0] = '\0';
  }
}

/* Stop the scripted daemon and the test's daemon, then check fds. */
static void teardown(void) {
  fake_stop(&fk);
  harness_daemon_teardown(&d);
}

/* Read a file into buf (empty if it is missing). */
static void slurp(const char *path, char *buf, size_t len) {
  buf[0] = '\0';
  FILE *f = fopen(path, "r");
  if (!f) return;
  size_t n = fread(buf, 1, len - 1, f);
  buf[n] = '\0';
  fclose(f);
}

/* Run gpumemctl under a command prefix ("" for none) against socket with
 * shell-quoted args, in dir; its stdout and stderr go to out_buf and
 * err_buf (and dir/ctl.out, dir/ctl.err), and its exit status comes back. */
static int ctl_as(const char *prefix, const char *dir, const char *socket, const char *args) {
  char cmd[1024], out[128], err[128];
  snprintf(out, sizeof out, "%s/ctl.out", dir);
  snprintf(err, sizeof err, "%s/ctl.err", dir);
  const char *bin = strstr(prefix, "setpriv") ? harness_others_bin("gpumemctl")
                                             : harness_bin("gpumemctl");
  snprintf(cmd, sizeof cmd, "%s %s --socket %s %s >%s 2>%s", prefix, bin, socket, args, out, err);
  int status = system(cmd);
  slurp(out, out_buf, sizeof out_buf);
  slurp(err, err_buf, sizeof err_buf);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Run gpumemctl as ctl_as does, with no prefix. */
static int ctl(const char *dir, const char *socket, const char *args) {
  return ctl_as("", dir, socket, args);
}

/* Run gpumemctl as ctl does: it must exit with status and say text, on
 * stdout if status is 0, else on stderr. */
static void ctl_says(const char *dir, const char *socket, const char *args, int status,
                     const char *text) {
  ck_assert_int_eq(ctl(dir, socket, args), status);
  const char *said = status == 0 ? out_buf : err_buf;
  ck_assert_msg(strstr(said, text), "%s", said);
}

/* Check the last stdout with Python: load (a statement that reads the
 * file at sys.argv[1]) then expr must be true; the exit status of python3
 * (0: loaded and true). */
static int py_check(const char *dir, const char *load, const char *expr) {
  char cmd[512], script[128], path[128], msg[128];
  snprintf(script, sizeof script, "%s/check.py", dir);
  snprintf(path, sizeof path, "%s/ctl.out", dir);
  snprintf(msg, sizeof msg, "%s/py.err", dir);
  FILE *f = fopen(script, "w");
  ck_assert_ptr_nonnull(f);
  fprintf(f, "import json, sys\n%s\nsys.exit(0 if (%s) else 1)\n", load, expr);
  fclose(f);
  snprintf(cmd, sizeof cmd, "python3 %s %s 2>%s", script, path, msg);
  int status = system(cmd);
  if (status != 0) {
    char why[4096];
    slurp(msg, why, sizeof why);
    fprintf(stderr, "python check failed: %s\n%s\non: %s\n", expr, why, out_buf);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Check the last stdout with a Python expression over `j`, its JSON
 * (py_check). */
static int json_check(const char *dir, const char *expr) {
  return py_check(dir, "j = json.load(open(sys.argv[1], encoding='utf-8'))", expr);
}

/* Whether the last stdout is strict UTF-8 (Python's decoder: no
 * surrogates, overlongs or code points past U+10FFFF) holding no control
 * character but newlines, C1 included. */
static bool stdout_is_clean_utf8(const char *dir) {
  return py_check(dir, "t = open(sys.argv[1], 'rb').read().decode('utf-8', 'strict')",
                  "not [c for c in t if c != '\\n' and (ord(c) < 32 or 127 <= ord(c) < 160)]") == 0;
}

/* Run gpumemctl as ctl does: it must exit with status, and its JSON on
 * stdout make the Python expression expr true (json_check). */
static void ctl_json(const char *dir, const char *socket, const char *args, int status,
                     const char *expr) {
  ck_assert_int_eq(ctl(dir, socket, args), status);
  ck_assert_int_eq(json_check(dir, expr), 0);
}

/* --- against a real daemon and real workers --- */

/* A typo is not a success: an unknown tag is NOT_FOUND, exit status 1,
 * for pause and resume, in words and in JSON. */
START_TEST(unknown_tag_is_not_found_and_fails) {
  struct worker w;
  daemon_with_worker(&d, &w, "--tag", "kv", "--size", "4M", NULL);
  ctl_says(d.dir, d.socket, "pause kv_cahce", 1, "pause failed: NOT_FOUND");
  ctl_says(d.dir, d.socket, "resume kv_cahce", 1, "resume failed: NOT_FOUND");
  ctl_json(d.dir, d.socket, "--json pause kv_cahce", 1,
           "j['error']['code']=='NOT_FOUND' and j['buffers']==0");
  /* The real tag is untouched. */
  ctl_json(d.dir, d.socket, "--json status", 0,
           "[t['state'] for t in j['tags'] if t['name']=='kv']==['ACTIVE']");
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* Pause and resume say per device what the daemon released or took and
 * what the driver shows; on the host backend the two agree exactly. */
START_TEST(pause_and_resume_print_the_driver_checks) {
  struct worker w;
  daemon_with_worker(&d, &w, "--tag", "kv", "--size", "8M", "--count", "2", NULL);
  ctl_says(d.dir, d.socket, "pause kv", 0, "paused 2 buffers, 16.0 MiB");
  ck_assert_msg(strstr(out_buf, "device 0: released 16.0 MiB, driver shows 16.0 MiB more free"),
                "%s", out_buf);
  ck_assert_msg(!strstr(out_buf, "does not show as free"), "%s", out_buf);
  ck_assert(worker_wait_for(&w, "paused buffer", 2, 5000));
  ctl_says(d.dir, d.socket, "resume kv", 0, "resumed 2 buffers, 16.0 MiB");
  ck_assert_msg(strstr(out_buf, "device 0: took 16.0 MiB, driver shows 16.0 MiB less free"),
                "%s", out_buf);
  ck_assert(worker_wait_for(&w, "resumed buffer", 2, 5000));
  ctl_json(d.dir, d.socket, "--json pause kv", 0,
           "j['error'] is None and j['buffers']==2 and j['bytes']==16777216"
           " and [(c['device'],c['released'],c['shortfall'])"
           " for c in j['checks']]==[(0,16777216,0)]"
           " and j['checks'][0]['free_after']-j['checks'][0]['free_before']"
           "==16777216 and 'residual_known' in j['checks'][0]"
           " and sum(x['bytes'] for x in j['details'])==16777216");
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* status --json parses and carries the new figures next to the old keys. */
START_TEST(status_json_carries_every_figure) {
  struct worker w;
  daemon_with_worker(&d, &w, "--tag", "kv", "--size", "8M", "--name", "rank0", NULL);
  ctl_json(d.dir, d.socket, "--json status", 0,
           "j['backend']=='host' and j['granularity']>0"
           " and all(set(x)>={'index','device','node_device','total','free',"
           "'managed','unmanaged','reserved','daemon_context','bus_id'}"
           " and x['index']==x['node_device']==x['device'] for x in j['devices'])"
           " and j['devices'][0]['managed']==8388608"
           " and all(set(t)>={'name','state','buffers','bytes','paused_buffers',"
           "'paused_bytes','backup_bytes','mixed','transit_buffers',"
           "'transit_bytes'} for t in j['tags'])"
           " and [(t['state'],t['mixed'],t['transit_buffers']) for t in j['tags']"
           " if t['name']=='kv']==[('ACTIVE',False,0)]"
           " and all(set(s)>={'id','pid','uid','name','role','buffers','bytes',"
           "'residual','residual_known'} for s in j['sessions'])"
           " and any(s['name']=='rank0' for s in j['sessions'])"
           " and isinstance(j['processes'],list)"
           " and isinstance(j['processes_known'],bool)"
           " and 'reserved' in j['backups']");
  /* The words say who holds memory outside gpumemd, or that nobody can tell. */
  ck_assert_int_eq(ctl(d.dir, d.socket, "status"), 0);
  ck_assert_msg(strstr(out_buf, "RESERVED") && strstr(out_buf, "OUTSIDE"), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "outside gpumemd") || strstr(out_buf, "no per-process figures"),
                "%s", out_buf);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* share and unshare go on past a tag that fails: one JSON document for
 * the invocation, a result per tag and the first failure as "error" (it
 * printed an object per tag, then an error object), exit 0 when all were
 * done, 3 when some, 1 when none. */
START_TEST(share_says_per_tag_in_one_document) {
  struct worker w;
  daemon_with_worker(&d, &w, "--tag", "kv", "--size", "4M", NULL);
  ctl_json(d.dir, d.socket, "--json share kv", 0,
           "j=={'tags':[{'tag':'kv','shared':True,'error':None}],'error':None}");
  ctl_json(d.dir, d.socket, "--json unshare kv a/b", 3,
           "len(j['tags'])==2 and j['tags'][0]=={'tag':'kv','shared':False,'error':None}"
           " and j['tags'][1]['shared'] is None and j['tags'][1]['error']['code']=='INVALID_ARGUMENT'"
           " and j['error']['code']=='INVALID_ARGUMENT' and 'a/b' in j['error']['message']");
  ck_assert_msg(strstr(err_buf, "unshare a/b failed"), "%s", err_buf);
  ctl_json(d.dir, d.socket, "--json share a/b c/d", 1,
           "[t['error']['code'] for t in j['tags']]==['INVALID_ARGUMENT','INVALID_ARGUMENT']"
           " and j['error']['code']=='INVALID_ARGUMENT'");
  ctl_says(d.dir, d.socket, "share kv a/b", 3, "share a/b failed");
  ck_assert_msg(strstr(out_buf, "kv: shared: every uid's buffers may join it"), "%s", out_buf);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* --max-residual takes a size and belongs to pause alone, --wait a
 * duration and to resume alone; a limit no device is near lets the pause
 * through, and a resume with room waits for nothing. */
START_TEST(max_residual_is_a_pause_option) {
  struct worker w;
  daemon_with_worker(&d, &w, "--tag", "kv", "--size", "4M", NULL);
  ctl_says(d.dir, d.socket, "pause --max-residual lots kv", 2, "invalid size");
  ctl_says(d.dir, d.socket, "resume --max-residual 1G kv", 2, "pause only");
  ctl_says(d.dir, d.socket, "pause --wait 1s kv", 2, "--wait applies to resume only");
  ctl_says(d.dir, d.socket, "resume --wait 11m kv", 2, "invalid wait");
  ctl_says(d.dir, d.socket, "pause --max-residual 1T kv", 0, "paused 1 buffers");
  ctl_says(d.dir, d.socket, "resume --wait 5s kv", 0, "resumed 1 buffers");
  ck_assert_msg(!strstr(out_buf, "waited"), "%s", out_buf); /* the room was there */
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* --- against a scripted daemon --- */

/* Send one envelope as a frame (no fds). */
static void fake_send(struct peer *p, uint64_t id, wire_env *env) {
  env->id = id;
  env->fd_count = 0;
  if (!peer_push(p, env, NULL, 0) || peer_flush_within(p, -1) != 0) _exit(3);
}

/* Record what a pause or resume asked for, for the test to read. */
static void fake_record(const char *path, const wire_env *req) {
  FILE *f = fopen(path, "a");
  if (!f) return;
  bool pause = req->body_case == GPUMEM__WIRE__ENVELOPE__BODY_PAUSE;
  size_t ntags = pause ? req->pause->n_tags : req->resume->n_tags;
  char **tags = pause ? req->pause->tags : req->resume->tags;
  size_t npids = pause ? req->pause->n_pids : req->resume->n_pids;
  uint32_t *pids = pause ? req->pause->pids : req->resume->pids;
  size_t ndevs = pause ? req->pause->n_devices : req->resume->n_devices;
  uint32_t *devs = pause ? req->pause->devices : req->resume->devices;
  const char *prefix = pause ? req->pause->session_prefix : req->resume->session_prefix;
  if (pause)
    fprintf(f, "pause max_residual=%llu timeout=%u tags=%s",
            (unsigned long long)req->pause->max_residual, req->pause->timeout_ms,
            ntags ? tags[0] : "");
  else
    fprintf(f, "resume tags=%s", ntags ? tags[0] : "");
  /* The scope, only where there is one (older lines stay as they were). */
  if (ntags == 0) fprintf(f, " all");
  for (size_t i = 0; i < ndevs; i++) fprintf(f, "%s%u", i ? "," : " devices=", devs[i]);
  for (size_t i = 0; i < npids; i++) fprintf(f, "%s%u", i ? "," : " pids=", pids[i]);
  if (prefix && *prefix) fprintf(f, " prefix=%s", prefix);
  fprintf(f, "\n");
  fclose(f);
}

/* What the scripted daemon does with a status request: answer it, hang
 * up, or never answer (set before fake_start: its child inherits it). */
static enum { STATUS_ANSWER, STATUS_HANG_UP, STATUS_SILENT } fake_status_mode;

/* Serve one client: greet it, then answer each request until it goes. */
static void fake_serve(struct peer *p, const char *asked, wire_env *op, wire_env *status) {
  /* Four devices, which this process sees under the same numbers. */
  Gpumem__Wire__DeviceInfo dev[4];
  Gpumem__Wire__DeviceInfo *devs[4];
  char bus[4][32];
  for (unsigned i = 0; i < 4; i++) {
    gpumem__wire__device_info__init(&dev[i]);
    dev[i].index = i;
    dev[i].total = 80 * GiB;
    snprintf(bus[i], sizeof bus[i], "host-local:%u", i);
    dev[i].bus_id = bus[i];
    devs[i] = &dev[i];
  }
  Gpumem__Wire__HelloReply hr = GPUMEM__WIRE__HELLO_REPLY__INIT;
  hr.version_major = WIRE_VERSION_MAJOR;
  hr.version_minor = WIRE_VERSION_MINOR;
  hr.backend = (char *)fake_backend;
  hr.granularity = 2 * MiB;
  hr.devices = devs;
  hr.n_devices = 4;
  hr.session_id = 1;
  for (;;) {
    struct frame fr;
    wire_env *req;
    int rc = peer_await(p, &fr, -1, &req);
    if (rc == 0) return;
    if (rc < 0) _exit(rc == -EBADMSG ? 5 : 4);
    frame_release(&fr);
    wire_env hello = peer_env(0, GPUMEM__WIRE__ENVELOPE__BODY_HELLO_REPLY);
    hello.hello_reply = &hr;
    switch (req->body_case) {
    case GPUMEM__WIRE__ENVELOPE__BODY_HELLO:
      fake_send(p, req->id, &hello);
      break;
    case GPUMEM__WIRE__ENVELOPE__BODY_PAUSE:
    case GPUMEM__WIRE__ENVELOPE__BODY_RESUME:
      fake_record(asked, req);
      fake_send(p, req->id, op);
      break;
    case GPUMEM__WIRE__ENVELOPE__BODY_STATUS:
      if (fake_status_mode == STATUS_HANG_UP) {
        wire_env_free(req);
        return;
      }
      if (fake_status_mode == STATUS_ANSWER && status) {
        /* one page: its totals are what it holds (1.10) */
        status->status_reply->total_tags = status->status_reply->n_tags;
        status->status_reply->total_sessions = status->status_reply->n_sessions;
        fake_send(p, req->id, status);
      }
      break;
    default:
      _exit(6);
    }
    wire_env_free(req);
  }
}

/* Start the scripted daemon as uid ((uid_t)-1: as this process), in a
 * directory of that uid's: it answers pauses and resumes with op and
 * status requests with status (either may be NULL when not asked). It
 * binds and listens as that uid (which the peer credentials then show),
 * and says it listens through a pipe. */
static void fake_start_as(struct fake *f, uid_t uid, wire_env *op, wire_env *status) {
  snprintf(f->dir, sizeof f->dir, "/tmp/gpumemctl-test.XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(f->dir));
  if (uid != (uid_t)-1) ck_assert_int_eq(chown(f->dir, uid, uid), 0);
  snprintf(f->socket, sizeof f->socket, "%s/sock", f->dir);
  snprintf(f->asked, sizeof f->asked, "%s/asked", f->dir);
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", f->socket);
  int ready[2];
  ck_assert_int_eq(pipe2(ready, O_CLOEXEC), 0);
  f->pid = fork();
  ck_assert_int_ge(f->pid, 0);
  if (f->pid == 0) {
    close(ready[0]);
    if (uid != (uid_t)-1 &&
        (setgroups(0, NULL) < 0 || setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0))
      _exit(7);
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(lfd, 8) < 0)
      _exit(8);
    if (write(ready[1], "r", 1) != 1) _exit(9);
    close(ready[1]);
    for (;;) {
      struct peer p;
      peer_attach(&p, accept4(lfd, NULL, NULL, SOCK_CLOEXEC), WIRE_MAX_REQUEST);
      if (p.fd < 0) _exit(2);
      fake_serve(&p, f->asked, op, status);
      peer_close(&p);
    }
  }
  close(ready[1]);
  char byte;
  ck_assert_msg(read(ready[0], &byte, 1) == 1, "the scripted daemon did not start");
  close(ready[0]);
}

/* Start the scripted daemon as this process (fake_start_as). */
static void fake_start(struct fake *f, wire_env *op, wire_env *status) {
  fake_start_as(f, (uid_t)-1, op, status);
}

/* Start the scripted daemon (as uid; (uid_t)-1: as this process)
 * answering every pause and resume with error, or with reply if error is
 * NULL. */
static void fake_answering(uid_t uid, Gpumem__Wire__Error *error, Gpumem__Wire__OpReply *reply) {
  wire_env op = peer_env(0, error ? GPUMEM__WIRE__ENVELOPE__BODY_ERROR
                                  : GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY);
  if (error)
    op.error = error;
  else
    op.op_reply = reply;
  fake_start_as(&fk, uid, &op, NULL);
}

/* Start the scripted daemon answering status requests with sr, of the
 * host backend on 2 MiB granules. */
static void fake_status(Gpumem__Wire__StatusReply *sr) {
  sr->backend = "host";
  sr->granularity = 2 * MiB;
  wire_env st = peer_env(0, GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY);
  st.status_reply = sr;
  fake_start(&fk, NULL, &st);
}

/* A worker's session in a status. */
static Gpumem__Wire__SessionInfo worker_session(uint64_t id, uint32_t pid, const char *name) {
  Gpumem__Wire__SessionInfo s = GPUMEM__WIRE__SESSION_INFO__INIT;
  s.id = id;
  s.pid = pid;
  s.name = (char *)name;
  s.role = GPUMEM__WIRE__ROLE__ROLE_WORKER;
  return s;
}

/* An Error with a code and words. */
static Gpumem__Wire__Error error_of(wire_code code, const char *message) {
  Gpumem__Wire__Error e = GPUMEM__WIRE__ERROR__INIT;
  e.code = code;
  e.message = (char *)message;
  return e;
}

/* Canned answers: a device check with a shortfall and residual. */
static Gpumem__Wire__DeviceCheck check0 = GPUMEM__WIRE__DEVICE_CHECK__INIT;
static Gpumem__Wire__DeviceCheck *checks[] = {&check0};

/* Fill the canned device check. */
static void canned_check(void) {
  check0.device = 0;
  check0.released = 8 * GiB;
  check0.free_before = 10 * GiB;
  check0.free_after = 14 * GiB;
  check0.shortfall = 4 * GiB;
  check0.residual = 1 * GiB;
  check0.residual_known = true;
  check0.used_after = 66 * GiB; /* of an 80 GiB device */
}

/* A failure that names the pids that hold buffers (one each) and bytes,
 * with the canned device check. */
static Gpumem__Wire__Error held_error(wire_code code, const char *message, uint32_t *pids,
                                      size_t npids, uint64_t bytes) {
  canned_check();
  Gpumem__Wire__Error e = error_of(code, message);
  e.pids = pids;
  e.n_pids = npids;
  e.buffers_held = npids;
  e.bytes_held = bytes;
  e.checks = checks;
  e.n_checks = 1;
  return e;
}

/* A pause that could not release everything: exit status 1, and stderr
 * gives the code, the daemon's words, the pids and bytes still held, and
 * what the driver shows; the request carried --max-residual. */
START_TEST(a_failed_pause_says_what_is_held_and_by_whom) {
  uint32_t pids[] = {4121, 4122};
  Gpumem__Wire__Error e =
      held_error(GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED, "2 buffers of tag kv were not released",
                 pids, 2, 8 * GiB);
  fake_answering((uid_t)-1, &e, NULL);
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "pause --max-residual 1G --timeout 500ms kv"), 1);
  ck_assert_msg(strstr(err_buf, "pause failed: NOT_RELEASED: 2 buffers of tag kv were not released"),
                "%s", err_buf);
  ck_assert_msg(strstr(err_buf, "2 buffers, 8.00 GiB still held by pids 4121, 4122"), "%s", err_buf);
  ck_assert_msg(strstr(err_buf, "device 0: released 8.00 GiB, driver shows 4.00 GiB more free; "
                                "1.00 GiB held outside gpumemd"),
                "%s", err_buf);
  ck_assert_msg(strstr(err_buf, "! device 0: 4.00 GiB released that the driver does not show as free"),
                "%s", err_buf);
  char asked[512];
  slurp(fk.asked, asked, sizeof asked);
  ck_assert_str_eq(asked, "pause max_residual=1073741824 timeout=500 tags=kv\n");
  /* --max-residual 0: nothing may remain (0 on the wire would mean no limit). */
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "pause --max-residual 0 kv"), 1);
  slurp(fk.asked, asked, sizeof asked);
  ck_assert_msg(strstr(asked, "pause max_residual=1 timeout=0 tags=kv\n"), "%s", asked);
  /* The same in JSON, on stdout, for scripts. */
  ctl_json(fk.dir, fk.socket, "--json pause kv", 1,
           "j['error']=={'code':'NOT_RELEASED','message':'2 buffers of tag kv "
           "were not released','pids':[4121,4122],'buffers_held':2,"
           "'bytes_held':8589934592,'bytes_needed':0,'bytes_free':0}"
           " and j['checks']==[{'device':0,'node_device':0,'released':8589934592,"
           "'free_before':10737418240,'free_after':15032385536,"
           "'shortfall':4294967296,'residual':1073741824,"
           "'residual_known':True,'exit_wait_ms':0,'exit_listed':0,'exit_listed_pid':0,"
           "'used_after':70866960384}]");
}
END_TEST

/* The library hands a controller the whole answer of a failure: the code,
 * every pid, the bytes held and the checks (and the old summary still
 * gets the pids). */
START_TEST(the_library_reports_failures_whole) {
  uint32_t pids[70];
  for (unsigned i = 0; i < 70; i++) pids[i] = 1000 + i;
  Gpumem__Wire__Error e = held_error(GPUMEM__WIRE__ERROR_CODE__CLIENT_TIMEOUT,
                                     "70 workers did not answer", pids, 70, 70 * MiB);
  fake_answering((uid_t)-1, &e, NULL);
  gpumem_client *c;
  ck_assert_int_eq(gpumem_connect(fk.socket, "t", GPUMEM_ROLE_CONTROLLER,
                                  GPUMEM_CONNECT_NO_THREAD, &c), 0);
  const char *tag = "kv";
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.max_residual = 5 * GiB;
  struct gpumem_op_report *r;
  ck_assert_int_eq(gpumem_pause(c, &tag, 1, NULL, 0, &o, &r), GPUMEM_E_CLIENT_TIMEOUT);
  ck_assert_ptr_nonnull(r);
  ck_assert_int_eq(r->error, GPUMEM_E_CLIENT_TIMEOUT);
  ck_assert_str_eq(r->code, "CLIENT_TIMEOUT");
  ck_assert_str_eq(r->message, "70 workers did not answer");
  ck_assert_uint_eq(r->npids, 70);
  ck_assert_uint_eq(r->pids[69], 1069);
  ck_assert_uint_eq(r->buffers_held, 70);
  ck_assert_uint_eq(r->bytes_held, 70 * MiB);
  ck_assert_uint_eq(r->nchecks, 1);
  ck_assert_uint_eq(r->checks[0]->size, sizeof(struct gpumem_device_check));
  ck_assert_uint_eq(r->checks[0]->shortfall, 4 * GiB);
  ck_assert_int_eq(r->checks[0]->residual_known, 1);
  gpumem_op_report_free(r);
  /* max_residual belongs to pause; the library says so before asking. */
  static struct gpumem_op_report sentinel;
  r = &sentinel;
  ck_assert_int_eq(gpumem_resume(c, &tag, 1, NULL, 0, &o, &r), GPUMEM_E_INVALID);
  ck_assert_ptr_null(r);
  /* Without options and without a report: the code alone. */
  ck_assert_int_eq(gpumem_pause(c, &tag, 1, NULL, 0, NULL, NULL), GPUMEM_E_CLIENT_TIMEOUT);
  gpumem_disconnect(c);
  char asked[512];
  slurp(fk.asked, asked, sizeof asked);
  ck_assert_str_eq(asked, "pause max_residual=5368709120 timeout=0 tags=kv\n"
                          "pause max_residual=0 timeout=0 tags=kv\n");
}
END_TEST

/* pause and resume select sessions by pid and name prefix; every tag
 * takes --all, so that a forgotten tag cannot pause a node; bad values
 * are usage errors and nothing reaches the daemon. */
START_TEST(pause_and_resume_select_sessions) {
  Gpumem__Wire__OpReply ok = GPUMEM__WIRE__OP_REPLY__INIT;
  ok.buffers = 1;
  fake_answering((uid_t)-1, NULL, &ok);
  static const char *const usage[] = {
      "pause", "resume", "pause --all kv", "status --all", "status --pid 5",
      "list --session-prefix x", "pause --pid 0 kv", "pause --pid x kv", "pause --pid -3 kv",
      "pause --pid 4294967296 kv", "resume --session-prefix '' kv",
  };
  for (size_t i = 0; i < sizeof usage / sizeof usage[0]; i++)
    ck_assert_msg(ctl(fk.dir, fk.socket, usage[i]) == 2, "%s: %s", usage[i], err_buf);
  ck_assert_msg(ctl(fk.dir, fk.socket, "pause") == 2 &&
                    strstr(err_buf, "pause needs tags, or --all for every tag"),
                "%s", err_buf);
  /* The library refuses what no session name could start with. */
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "pause --session-prefix \"$(printf 'a\\001b')\" kv"), 1);
  ck_assert_msg(strstr(err_buf, "session prefix is not UTF-8 text without control characters"),
                "%s", err_buf);
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "pause --all --pid 41 --pid 42 --session-prefix rank"),
                   0);
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "resume --session-prefix sglang- --device 1 kv"), 0);
  ctl_json(fk.dir, fk.socket, "--json resume --all", 0, "j['buffers']==1 and j['error'] is None");
  char asked[512];
  slurp(fk.asked, asked, sizeof asked);
  ck_assert_str_eq(asked, "pause max_residual=0 timeout=0 tags= all pids=41,42 prefix=rank\n"
                          "resume tags=kv devices=1 prefix=sglang-\n"
                          "resume tags= all\n");
}
END_TEST

/* A status with every new figure: the driver's reserve, tags in transit
 * and mixed, residual per session, and processes holding memory outside
 * gpumemd, named largest first. */
START_TEST(status_names_the_largest_holders_outside_gpumemd) {
  Gpumem__Wire__StatusReply sr = GPUMEM__WIRE__STATUS_REPLY__INIT;
  Gpumem__Wire__DeviceInfo dv = GPUMEM__WIRE__DEVICE_INFO__INIT;
  dv.index = 3;
  dv.total = 80 * GiB;
  dv.free = 20 * GiB;
  dv.reserved = 1 * GiB;
  dv.managed = 40 * GiB;
  dv.bus_id = "host-local:3";
  Gpumem__Wire__DeviceInfo *dvs[] = {&dv};
  Gpumem__Wire__TagInfo kv = GPUMEM__WIRE__TAG_INFO__INIT, wt = GPUMEM__WIRE__TAG_INFO__INIT;
  kv.name = "kv_cache";
  kv.state = GPUMEM__WIRE__BUFFER_STATE__PAUSING;
  kv.buffers = 16;
  kv.bytes = 16 * GiB;
  kv.paused_buffers = 8;
  kv.paused_bytes = 8 * GiB;
  kv.transit_buffers = 8;
  kv.transit_bytes = 8 * GiB;
  wt.name = "weights";
  wt.state = GPUMEM__WIRE__BUFFER_STATE__ACTIVE;
  wt.buffers = 2;
  wt.bytes = 2 * GiB;
  wt.paused_buffers = 1;
  wt.paused_bytes = 1 * GiB;
  wt.mixed = true;
  Gpumem__Wire__TagInfo *tags[] = {&kv, &wt};
  Gpumem__Wire__SessionInfo s1 = worker_session(7, 4121, "sglang-tp3");
  s1.residual = 55942366003ull; /* 52.1 GiB */
  s1.residual_known = true;
  Gpumem__Wire__SessionInfo *sessions[] = {&s1};
  Gpumem__Wire__ProcessMemory p1 = GPUMEM__WIRE__PROCESS_MEMORY__INIT,
                              p2 = GPUMEM__WIRE__PROCESS_MEMORY__INIT,
                              p3 = GPUMEM__WIRE__PROCESS_MEMORY__INIT;
  p1.pid = 77;
  p1.device = 3;
  p1.used = p1.residual = 2 * GiB;
  p1.name = "python3";
  p2.pid = 4121;
  p2.device = 3;
  p2.used = p2.residual = 55942366003ull;
  p2.session_id = 7;
  p2.name = "sglang-tp3";
  p3.pid = 99;
  p3.device = 3;
  p3.used = p3.managed = 1 * GiB;
  p3.name = "quiet";
  Gpumem__Wire__ProcessMemory *procs[] = {&p1, &p2, &p3};
  sr.devices = dvs;
  sr.n_devices = 1;
  sr.tags = tags;
  sr.n_tags = 2;
  sr.sessions = sessions;
  sr.n_sessions = 1;
  sr.processes = procs;
  sr.n_processes = 3;
  sr.processes_known = true;
  fake_status(&sr);
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "status"), 0);
  /* unmanaged = 80 - 20 free - 1 reserved - 40 managed */
  ck_assert_msg(strstr(out_buf, "3         80.0 GiB    20.0 GiB    1.00 GiB    40.0 GiB    19.0 GiB"),
                "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "! device 3: 19.0 GiB in use that gpumemd does not manage"), "%s",
                out_buf);
  const char *big = strstr(out_buf, "pid 4121 (sglang-tp3) holds 52.1 GiB on device 3 outside gpumemd");
  const char *small = strstr(out_buf, "pid 77 (python3) holds 2.00 GiB on device 3 outside gpumemd");
  ck_assert_msg(big && small && big < small, "%s", out_buf);
  ck_assert_msg(!strstr(out_buf, "pid 99"), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "kv_cache             PAUSING"), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "! kv_cache: 8 buffers (8.00 GiB) PAUSING: an owner has not answered"),
                "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "weights              mixed"), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "weights: mixed, 1 of 2 buffers paused"), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "sglang-tp3                 0         0 B    52.1 GiB"), "%s",
                out_buf);
  ctl_json(fk.dir, fk.socket, "--json status", 0,
           "j['devices'][0]['reserved']==1073741824"
           " and j['devices'][0]['unmanaged']==19*1073741824"
           " and j['processes_known'] is True and len(j['processes'])==3"
           " and j['processes'][1]=={'pid':4121,'device':3,'node_device':3,'used':55942366003,"
           "'managed':0,'residual':55942366003,'session_id':7,"
           "'name':'sglang-tp3'}"
           " and j['tags'][0]['transit_bytes']==8*1073741824"
           " and j['tags'][1]['mixed'] is True"
           " and j['sessions'][0]['residual']==55942366003");
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "metrics"), 0);
  ck_assert_msg(strstr(out_buf, "gpumem_process_residual_bytes{pid=\"4121\",device=\"3\","
                                "name=\"sglang-tp3\"} 55942366003"),
                "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "gpumem_device_reserved_bytes{device=\"3\"} 1073741824"), "%s",
                out_buf);
}
END_TEST

/* Where the driver gives no per-process figures, status says so instead
 * of naming nobody, and residuals read "unknown". */
START_TEST(status_says_when_the_driver_gives_no_per_process_figures) {
  Gpumem__Wire__StatusReply sr = GPUMEM__WIRE__STATUS_REPLY__INIT;
  Gpumem__Wire__SessionInfo s1 = worker_session(1, 10, "w");
  Gpumem__Wire__SessionInfo *sessions[] = {&s1};
  sr.sessions = sessions;
  sr.n_sessions = 1;
  fake_status(&sr);
  ctl_says(fk.dir, fk.socket, "status", 0, "the driver gives no per-process figures");
  ck_assert_msg(strstr(out_buf, "unknown"), "%s", out_buf);
  ctl_json(fk.dir, fk.socket, "--json status", 0,
           "j['processes_known'] is False and j['processes']==[]"
           " and j['sessions'][0]['residual_known'] is False");
}
END_TEST

/* --version names this tool, the library and the daemon that answers;
 * status says the daemon's version too; with no daemon the version is
 * still printed and the daemon said to be unreachable. */
START_TEST(version_names_tool_library_and_daemon) {
  daemon_start(&d, NULL);
  char v[32];
  snprintf(v, sizeof v, "%d.%d.%d", GPUMEM_VERSION_MAJOR, GPUMEM_VERSION_MINOR,
           GPUMEM_VERSION_PATCH);
  char want[3][64];
  snprintf(want[0], sizeof want[0], "gpumemctl %s\n", v);
  snprintf(want[1], sizeof want[1], "libgpumem %s\n", gpumem_version_string());
  snprintf(want[2], sizeof want[2], "gpumemd %s\n", v);
  ck_assert_int_eq(ctl(d.dir, d.socket, "--version"), 0);
  for (int i = 0; i < 3; i++) ck_assert_msg(strstr(out_buf, want[i]), "%s", out_buf);
  char expr[256];
  snprintf(expr, sizeof expr, "j=={'gpumemctl':'%s','libgpumem':'%s','daemon':'%s'}", v,
           gpumem_version_string(), v);
  ck_assert_int_eq(ctl(d.dir, d.socket, "--json --version"), 0);
  ck_assert_int_eq(json_check(d.dir, expr), 0);
  ck_assert_int_eq(ctl(d.dir, d.socket, "status"), 0);
  snprintf(want[2], sizeof want[2], "gpumemd %s, backend host", v);
  ck_assert_msg(strncmp(out_buf, want[2], strlen(want[2])) == 0, "%s", out_buf);
  ck_assert_int_eq(ctl(d.dir, d.socket, "--json status"), 0);
  snprintf(expr, sizeof expr, "j['version']=='%s'", v);
  ck_assert_int_eq(json_check(d.dir, expr), 0);
  /* No daemon: the versions here, and why the daemon's is missing. */
  char gone[160];
  snprintf(gone, sizeof gone, "%s/none.sock", d.dir);
  ck_assert_int_eq(ctl(d.dir, gone, "--version"), 0);
  ck_assert_msg(strstr(out_buf, want[0]) && strstr(out_buf, "gpumemd: not reachable"), "%s",
                out_buf);
  ck_assert_int_eq(ctl(d.dir, gone, "--json --version"), 0);
  ck_assert_int_eq(json_check(d.dir, "j['daemon'] is None"), 0);
}
END_TEST

/* Under --json every failure is one error object on stdout, with the
 * exit status kept: 2 for usage, 1 for the daemon or the library. */
START_TEST(json_failures_print_an_error_object) {
  daemon_start(&d, NULL);
  static const struct {
    const char *args;
    int status;
    const char *code;
  } cases[] = {
      {"--json pause", 2, "USAGE"},
      {"--json --timeout 5x pause kv", 2, "USAGE"},
      {"--json --no-such-option status", 2, "USAGE"},
      {"--json frobnicate", 2, "USAGE"},
      {"status --json --device 1", 2, "USAGE"},
      {"--json --pid 0 pause kv", 2, "USAGE"},
      {"--json resume nosuchtag", 1, "NOT_FOUND"},
  };
  char expr[256];
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ck_assert_msg(ctl(d.dir, d.socket, cases[i].args) == cases[i].status, "%s: %s",
                  cases[i].args, err_buf);
    snprintf(expr, sizeof expr,
             "j['error']['code']=='%s' and isinstance(j['error']['message'],str)"
             " and len(j['error']['message'])>0 and isinstance(j['error']['pids'],list)",
             cases[i].code);
    ck_assert_msg(json_check(d.dir, expr) == 0, "%s", cases[i].args);
    ck_assert_msg(err_buf[0], "%s: nothing on stderr", cases[i].args);
  }
  /* A daemon that is not there: CONNECT, for every command. */
  char gone[160];
  snprintf(gone, sizeof gone, "%s/none.sock", d.dir);
  const char *cmds[] = {"--json status", "--json list", "--json pause kv", "--json metrics"};
  for (size_t i = 0; i < 4; i++) {
    ck_assert_int_eq(ctl(d.dir, gone, cmds[i]), 1);
    ck_assert_int_eq(json_check(d.dir, "j['error']['code']=='CONNECT' and 'none.sock' in "
                                       "j['error']['message'] and j['error']['pids']==[]"),
                     0);
  }
}
END_TEST

/* --timeout takes the daemon's duration syntax (500ms, 10s, 2m; a plain
 * number is seconds) and rejects anything else as a usage error. */
START_TEST(timeout_takes_durations) {
  Gpumem__Wire__Error e = error_of(GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, "no tag");
  fake_answering((uid_t)-1, &e, NULL);
  static const struct {
    const char *arg;
    const char *ms;
  } ok[] = {{"500ms", "500"}, {"10s", "10000"}, {"2m", "120000"}, {"3", "3000"},
            {"1.5s", "1500"}};
  char args[128], want[128], asked[512];
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    snprintf(args, sizeof args, "pause --timeout %s kv", ok[i].arg);
    ck_assert_int_eq(ctl(fk.dir, fk.socket, args), 1);
    slurp(fk.asked, asked, sizeof asked);
    snprintf(want, sizeof want, "timeout=%s tags=kv\n", ok[i].ms);
    ck_assert_msg(strstr(asked, want), "%s: %s", ok[i].arg, asked);
  }
  const char *bad[] = {"0", "5x", "-1s", "ms", "10 s", "2h", "86401s"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    snprintf(args, sizeof args, "pause --timeout '%s' kv", bad[i]);
    ck_assert_msg(ctl(fk.dir, fk.socket, args) == 2, "%s", bad[i]);
    ck_assert_msg(strstr(err_buf, "invalid timeout"), "%s: %s", bad[i], err_buf);
  }
}
END_TEST

/* Session names, tags and process names with control characters or bytes
 * that are not UTF-8 reach neither the terminal nor the JSON raw: words
 * escape them as \xNN, JSON stays valid, metrics stay one line each. */
START_TEST(names_are_escaped_whatever_bytes_they_hold) {
  Gpumem__Wire__StatusReply sr = GPUMEM__WIRE__STATUS_REPLY__INIT;
  Gpumem__Wire__SessionInfo s1 = worker_session(1, 10, "r0\x1b[2J\n\xff");
  Gpumem__Wire__SessionInfo *sessions[] = {&s1};
  Gpumem__Wire__TagInfo t1 = GPUMEM__WIRE__TAG_INFO__INIT;
  t1.name = "kv\x07\"\\\xc3";
  t1.transit_buffers = 1;
  t1.mixed = 1;
  Gpumem__Wire__TagInfo *tags[] = {&t1};
  sr.version = "9.9.9\x1b";
  sr.sessions = sessions;
  sr.n_sessions = 1;
  sr.tags = tags;
  sr.n_tags = 1;
  fake_status(&sr);
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "status"), 0);
  for (const char *p = out_buf; *p; p++)
    ck_assert_msg((unsigned char)*p >= 0x20 || *p == '\n', "raw control byte 0x%02x in: %s",
                  (unsigned char)*p, out_buf);
  ck_assert_msg(!strchr(out_buf, '\xff') && !strchr(out_buf, '\xc3'), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "r0\\x1b[2J\\x0a\\xff"), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "kv\\x07\"\\\\\\xc3"), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "gpumemd 9.9.9\\x1b, backend host"), "%s", out_buf);
  ctl_json(fk.dir, fk.socket, "--json status", 0,
           "j['sessions'][0]['name'].startswith('r0\\x1b[2J\\n')"
           " and j['tags'][0]['name'].startswith('kv\\x07\"\\\\')"
           " and len(j['tags'][0]['name'])==6");
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "metrics"), 0);
  for (const char *p = out_buf; *p; p++)
    ck_assert_msg((unsigned char)*p >= 0x20 || *p == '\n', "raw control byte in: %s", out_buf);
  ck_assert_msg(strstr(out_buf, "{tag=\"kv\xef\xbf\xbd\\\"\\\\\xef\xbf\xbd\"}"), "%s", out_buf);
}
END_TEST

/* Each class of text the daemon's edge refuses, sent by a hostile daemon
 * (a C1 control introducing an escape sequence, an encoded surrogate,
 * overlong forms, a code point past U+10FFFF, a five-byte form, a cut
 * sequence): gpumemctl escapes every one, and its words, its JSON and its
 * metrics are strict UTF-8 with no control character. */
START_TEST(every_class_of_bad_text_is_escaped) {
  Gpumem__Wire__StatusReply sr = GPUMEM__WIRE__STATUS_REPLY__INIT;
  Gpumem__Wire__SessionInfo s1 = worker_session(1, 10, "a\xc2\x9b" "31mb");
  Gpumem__Wire__SessionInfo *sessions[] = {&s1};
  const char *names[] = {"s\xed\xa0\x80", "o\xc0\xaf\xe0\x80\xaf", "h\xf4\x90\x80\x80",
                         "f\xf8\x88\x80\x80\x80", "t\xe2\x82"};
  enum { N = sizeof names / sizeof names[0] };
  Gpumem__Wire__TagInfo t[N], *tags[N];
  for (size_t i = 0; i < N; i++) {
    gpumem__wire__tag_info__init(&t[i]);
    t[i].name = (char *)names[i];
    tags[i] = &t[i];
  }
  sr.version = "9.9.9\xc2\x85";
  sr.sessions = sessions;
  sr.n_sessions = 1;
  sr.tags = tags;
  sr.n_tags = N;
  fake_status(&sr);
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "status"), 0);
  ck_assert_msg(stdout_is_clean_utf8(fk.dir), "%s", out_buf);
  const char *words[] = {"a\\xc2\\x9b31mb", "s\\xed\\xa0\\x80", "o\\xc0\\xaf\\xe0\\x80\\xaf",
                         "h\\xf4\\x90\\x80\\x80", "f\\xf8\\x88\\x80\\x80\\x80", "t\\xe2\\x82",
                         "9.9.9\\xc2\\x85"};
  for (size_t i = 0; i < sizeof words / sizeof words[0]; i++)
    ck_assert_msg(strstr(out_buf, words[i]), "%s not in: %s", words[i], out_buf);
  ctl_json(fk.dir, fk.socket, "--json status", 0,
           "j['sessions'][0]['name']=='a\\x9b31mb' and j['version']=='9.9.9\\x85'"
           " and [x['name'] for x in j['tags']]==['s\\xed\\xa0\\x80','o\\xc0\\xaf\\xe0\\x80\\xaf',"
           "'h\\xf4\\x90\\x80\\x80','f\\xf8\\x88\\x80\\x80\\x80','t\\xe2\\x82']");
  ck_assert_msg(stdout_is_clean_utf8(fk.dir), "%s", out_buf);
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "metrics"), 0);
  ck_assert_msg(stdout_is_clean_utf8(fk.dir), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "{tag=\"s\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\"}"), "%s", out_buf);
}
END_TEST

/* Whether this process maps a file whose name contains text. */
static bool maps_contain(const char *text) {
  FILE *f = fopen("/proc/self/maps", "r");
  ck_assert_ptr_nonnull(f);
  char line[4096];
  bool found = false;
  while (!found && fgets(line, sizeof line, f)) found = strstr(line, text) != NULL;
  fclose(f);
  return found;
}

/* A controller loads no GPU driver: against a daemon whose backend this
 * process could not open (or would have to load a vendor library for),
 * gpumemctl and a controller session work, device numbers are the
 * daemon's, and no driver is mapped; a worker still needs the backend. */
START_TEST(controllers_open_no_gpu_backend) {
  Gpumem__Wire__StatusReply sr = GPUMEM__WIRE__STATUS_REPLY__INIT;
  sr.backend = "cuda";
  sr.granularity = 2 * MiB;
  wire_env st = peer_env(0, GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY);
  st.status_reply = &sr;
  fake_backend = "cuda";
  fake_start(&fk, NULL, &st);
  ctl_says(fk.dir, fk.socket, "status", 0, "backend cuda");
  const unsigned flags = GPUMEM_CONNECT_NO_THREAD | GPUMEM_CONNECT_NO_RECONNECT;
  const unsigned node = flags | GPUMEM_CONNECT_NODE_DEVICES;
  gpumem_client *c = NULL;
  ck_assert_int_eq(gpumem_connect(fk.socket, "ctl", GPUMEM_ROLE_CONTROLLER, node, &c), 0);
  ck_assert_uint_eq(gpumem_device_count(c), 4);
  ck_assert_int_eq(gpumem_sync(c, 3), 0);
  ck_assert_int_eq(gpumem_sync(c, 4), GPUMEM_E_INVALID);
  ck_assert_msg(!maps_contain("libcuda") && !maps_contain("libamdhip64"), "a driver is mapped");
  gpumem_disconnect(c);
  fake_stop(&fk);
  /* A backend no build has: the controller does not care, a worker does. */
  fake_backend = "no-such-backend";
  fake_start(&fk, NULL, &st);
  ck_assert_int_eq(gpumem_connect(fk.socket, "ctl", GPUMEM_ROLE_CONTROLLER, node, &c), 0);
  gpumem_disconnect(c);
  ck_assert_int_eq(gpumem_connect(fk.socket, "w", GPUMEM_ROLE_WORKER, flags, &c), GPUMEM_E_BACKEND);
  ck_assert_msg(strstr(gpumem_last_error(), "no-such-backend"), "%s", gpumem_last_error());
}
END_TEST

/* Metrics an operator can alert on: gpumem_up, a tag's pause as its own
 * gauge (series stay the same across a pause), and gpumemctl's own
 * controller session not counted; with no daemon, gpumem_up 0. */
/* While the re-registration grace runs, status, its JSON and the metrics
 * say so and how long it has left, and a worker's allocation in a new tag
 * is counted as waiting; after the grace none of it shows. */
START_TEST(status_shows_the_grace_while_it_runs) {
  daemon_start(&d, "--adopt-grace", "60s", NULL);
  struct worker w;
  worker_spawn(&w, &d, "--tag", "kv", "--size", "4M", NULL);
  double end = now_ms() + harness_patience_ms(5000);
  while (ctl(d.dir, d.socket, "--json status") == 0 && !strstr(out_buf, ",\"waiting\":1}") &&
         now_ms() < end) {
    struct pollfd none;
    poll(&none, 0, 10); /* the worker's allocation is not seen from here */
  }
  ck_assert_int_eq(json_check(d.dir, "0<j['grace']['left_ms']<=60000 and j['grace']['waiting']==1"
                                     " and j['tags']==[]"),
                   0);
  ck_assert_int_eq(ctl(d.dir, d.socket, "status"), 0);
  ck_assert_msg(strstr(out_buf, " s left; allocations in new tags wait for it (1 waiting)\n") &&
                    strstr(out_buf, "\nre-registration grace: "),
                "%s", out_buf);
  ctl_says(d.dir, d.socket, "metrics", 0, "\ngpumem_grace_waiting 1\n");
  ctl_says(d.dir, d.socket, "pause kv", 1, "no tag 'kv' yet: the re-registration grace runs");
  worker_stop(&w, SIGKILL); /* still waiting in its allocation */
  ck_assert_int_eq(daemon_stop(&d), 0);
  daemon_start(&d, NULL);
  ck_assert_int_eq(ctl(d.dir, d.socket, "status"), 0);
  ck_assert_msg(!strstr(out_buf, "grace"), "%s", out_buf);
  ctl_json(d.dir, d.socket, "--json status", 0, "j['grace']=={'left_ms':0,'waiting':0}");
}
END_TEST

START_TEST(metrics_say_up_and_paused_and_count_workers) {
  struct worker w;
  daemon_with_worker(&d, &w, "--tag", "kv", "--size", "4M", NULL);
  ctl_says(d.dir, d.socket, "metrics", 0, "\ngpumem_up 1\n");
  ck_assert_msg(strstr(out_buf, "\ngpumem_sessions 1\n"), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "\ngpumem_tag_paused{tag=\"kv\"} 0\n"), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "\ngpumem_tag_bytes{tag=\"kv\"} 4194304\n"), "%s", out_buf);
  ck_assert_msg(!strstr(out_buf, "state="), "%s", out_buf);
  ck_assert_int_eq(ctl(d.dir, d.socket, "pause kv"), 0);
  ck_assert(worker_wait_for(&w, "paused buffer", 1, 5000));
  ck_assert_int_eq(ctl(d.dir, d.socket, "metrics"), 0);
  ck_assert_msg(strstr(out_buf, "\ngpumem_tag_paused{tag=\"kv\"} 1\n"), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "\ngpumem_tag_bytes{tag=\"kv\"} 4194304\n"), "%s", out_buf);
  /* Paused bytes still count against the uid. */
  char line[80];
  snprintf(line, sizeof line, "\ngpumem_uid_bytes{uid=\"%u\",device=\"0\"} 4194304\n", getuid());
  ck_assert_msg(strstr(out_buf, line), "%s", out_buf);
  ck_assert_msg(strstr(out_buf, "\ngpumem_uid_quota{kind=\"buffers\"} 1000000\n"), "%s", out_buf);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
  char gone[160];
  snprintf(gone, sizeof gone, "%s/none.sock", d.dir);
  ck_assert_int_eq(ctl(d.dir, gone, "metrics"), 1);
  ck_assert_msg(strstr(out_buf, "# TYPE gpumem_up gauge\ngpumem_up 0\n"), "%s", out_buf);
}
END_TEST

/* A daemon that greets and then hangs up, or stops answering, at the
 * status: metrics prints gpumem_up 0 alone (nothing a scrape could take
 * for figures) and exits 1, the second within its request timeout. */
START_TEST(metrics_say_down_when_the_daemon_fails_after_hello) {
  const int modes[] = {STATUS_HANG_UP, STATUS_SILENT};
  for (int i = 0; i < 2; i++) {
    fake_status_mode = modes[i];
    fake_start(&fk, NULL, NULL);
    int rc = ctl(fk.dir, fk.socket, i ? "--request-timeout 300ms metrics" : "metrics");
    ck_assert_msg(rc == 1, "exit %d: %s %s", rc, out_buf, err_buf);
    ck_assert_msg(strcmp(out_buf, "# HELP gpumem_up 1 when gpumemd answered gpumemctl.\n"
                                  "# TYPE gpumem_up gauge\ngpumem_up 0\n") == 0,
                  "%s", out_buf);
    ck_assert_msg(strstr(err_buf, i ? "did not answer in 0.3 s" : "closed the connection"), "%s", err_buf);
    fake_stop(&fk);
  }
  fake_status_mode = STATUS_ANSWER;
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "--request-timeout 0 metrics"), 2);
}
END_TEST

/* Run a shell command in dir with its output in dir/cmd.out (into
 * err_buf); its exit status. */
static int shell(const char *dir, const char *cmd) {
  char line[1024], out[128];
  snprintf(out, sizeof out, "%s/cmd.out", dir);
  snprintf(line, sizeof line, "%s >%s 2>&1", cmd, out);
  int status = system(line);
  slurp(out, err_buf, sizeof err_buf);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Metrics count what the daemon did: pauses and resumes by result, the
 * bytes they released and gave back, their durations as a histogram and
 * the errors answered; counters never go down; and promtool (where it
 * is installed) takes the whole output. */
START_TEST(metrics_count_operations_and_pass_promtool) {
  struct worker w;
  daemon_with_worker(&d, &w, "--tag", "kv", "--size", "4M", NULL);
  for (int i = 0; i < 2; i++) {
    ck_assert_int_eq(ctl(d.dir, d.socket, "pause kv"), 0);
    ck_assert_int_eq(ctl(d.dir, d.socket, "resume kv"), 0);
  }
  ck_assert_int_eq(ctl(d.dir, d.socket, "pause kv_cahce"), 1);
  ck_assert_int_eq(ctl(d.dir, d.socket, "metrics"), 0);
  static const char *const want[] = {
      "\n# TYPE gpumem_operations_total counter\n",
      "\ngpumem_operations_total{op=\"pause\",result=\"OK\"} 2\n",
      "\ngpumem_operations_total{op=\"pause\",result=\"NOT_FOUND\"} 1\n",
      "\ngpumem_operations_total{op=\"resume\",result=\"OK\"} 2\n",
      "\ngpumem_released_bytes_total 8388608\n",
      "\ngpumem_restored_bytes_total 8388608\n",
      "\n# TYPE gpumem_operation_duration_seconds histogram\n",
      "\ngpumem_operation_duration_seconds_bucket{op=\"pause\",le=\"+Inf\"} 3\n",
      "\ngpumem_operation_duration_seconds_count{op=\"pause\"} 3\n",
      "\ngpumem_operation_duration_seconds_bucket{op=\"resume\",le=\"60\"} 2\n",
      "\ngpumem_operation_duration_seconds_count{op=\"resume\"} 2\n",
      "\ngpumem_operation_duration_seconds_sum{op=\"resume\"} ",
      "\ngpumem_errors_total{code=\"NOT_FOUND\"} 1\n",
      "\ngpumem_operations_running 0\n",
      "\ngpumem_uptime_seconds ",
      "\ngpumem_sessions 1\n",
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
    ck_assert_msg(strstr(out_buf, want[i]), "no %s in:\n%s", want[i], out_buf);
  ck_assert_msg(!strstr(out_buf, "state="), "%s", out_buf);
  char first[1 << 16];
  snprintf(first, sizeof first, "%s", out_buf);
  /* promtool on exactly what gpumemctl printed. */
  char cmd[512];
  if (shell(d.dir, "command -v promtool") != 0) {
    printf("metrics_count_operations_and_pass_promtool: promtool check: skipped: no promtool\n");
  } else {
    snprintf(cmd, sizeof cmd, "promtool check metrics < %s/ctl.out", d.dir);
    ck_assert_msg(shell(d.dir, cmd) == 0, "promtool check metrics: %s\non:\n%s", err_buf, out_buf);
  }
  /* Counters only grow: one more pause and the same failure. */
  ck_assert_int_eq(ctl(d.dir, d.socket, "pause kv"), 0);
  ck_assert_int_eq(ctl(d.dir, d.socket, "pause kv_cahce"), 1);
  ck_assert_int_eq(ctl(d.dir, d.socket, "metrics"), 0);
  ck_assert_msg(strstr(out_buf, "\ngpumem_operations_total{op=\"pause\",result=\"OK\"} 3\n") &&
                    strstr(out_buf, "\ngpumem_errors_total{code=\"NOT_FOUND\"} 2\n") &&
                    strstr(out_buf, "\ngpumem_released_bytes_total 12582912\n") &&
                    strstr(out_buf, "\ngpumem_restored_bytes_total 8388608\n"),
                "%s", out_buf);
  for (const char *p = first; (p = strstr(p, "_total")); p++) {
    /* Every counter sample of the first scrape is there, no lower. */
    const char *line = p;
    while (line > first && line[-1] != '\n') line--;
    if (*line == '#') continue;
    const char *sp = strchr(p, ' ');
    char name[256];
    snprintf(name, sizeof name, "\n%.*s ", (int)(sp - line), line);
    const char *now = strstr(out_buf, name);
    ck_assert_msg(now, "%s gone", name);
    ck_assert_uint_ge(strtoull(now + strlen(name), NULL, 10), strtoull(sp + 1, NULL, 10));
  }
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* The daemon's words carry a worker's (an ack's message): a newline or an
 * escape sequence in them cannot forge a line or rewrite the terminal; in
 * JSON they stay as sent, as one valid string. */
START_TEST(daemon_words_cannot_forge_lines) {
  Gpumem__Wire__Error e = error_of(GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED,
                                   "worker 7: done\ngpumemctl: paused 7 buffers, 64.0 GiB\x1b[2K");
  fake_answering((uid_t)-1, &e, NULL);
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "pause kv"), 1);
  ck_assert_msg(!strstr(err_buf, "\ngpumemctl: paused") && !strchr(err_buf, '\x1b'), "%s",
                err_buf);
  ck_assert_msg(strstr(err_buf, "gpumemctl: pause failed: NOT_RELEASED: worker 7: "
                                "done\\x0agpumemctl: paused 7 buffers, 64.0 GiB\\x1b[2K\n"),
                "%s", err_buf);
  ctl_json(fk.dir, fk.socket, "--json pause kv", 1,
           "j['error']['message']=='worker 7: done\\ngpumemctl: "
           "paused 7 buffers, 64.0 GiB\\x1b[2K'");
}
END_TEST

/* A daemon another user runs lies to root at will (the issue: "paused 7
 * buffers, 64.0 GiB" from a socket swapped in): gpumemctl refuses it
 * before sending anything, in words and in JSON, unless --socket-owner or
 * GPUMEM_SOCKET_OWNER names that user; a socket file made root's does not
 * help, as the peer's credentials say who answers. */
START_TEST(a_daemon_another_user_runs_is_not_trusted) {
  if (!harness_others_can_run("a_daemon_another_user_runs_is_not_trusted")) return;
  Gpumem__Wire__OpReply ok = GPUMEM__WIRE__OP_REPLY__INIT;
  ok.buffers = 7;
  ok.bytes = 64 * GiB;
  fake_answering(65534, NULL, &ok);
  char asked[512], want[512];
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "pause kv"), 1);
  snprintf(want, sizeof want, "gpumemctl: the socket %s is owned by uid 65534 (nobody), "
           "expected root: refusing to trust it", fk.socket);
  ck_assert_msg(strstr(err_buf, want), "%s", err_buf);
  ck_assert_msg(!strstr(out_buf, "paused"), "%s", out_buf);
  ctl_json(fk.dir, fk.socket, "--json resume --all", 1,
           "j['error']['code']=='UNTRUSTED' and "
           "'refusing to trust it' in j['error']['message']");
  slurp(fk.asked, asked, sizeof asked);
  ck_assert_str_eq(asked, "");
  /* Named, it is trusted. */
  ck_assert_msg(ctl(fk.dir, fk.socket, "--socket-owner nobody pause kv") == 0, "%s", err_buf);
  ck_assert_msg(strstr(out_buf, "paused 7 buffers, 64.0 GiB"), "%s", out_buf);
  ck_assert_msg(ctl_as("GPUMEM_SOCKET_OWNER=65534", fk.dir, fk.socket, "resume kv") == 0, "%s",
                err_buf);
  /* The file root's, the answer still nobody's: refused after the
   * hello, before any request. */
  ck_assert_int_eq(chown(fk.socket, 0, 0), 0);
  ck_assert_int_eq(ctl(fk.dir, fk.socket, "pause kv"), 1);
  snprintf(want, sizeof want, "gpumemctl: gpumemd at %s answers as uid 65534 (nobody), "
           "expected root: refusing to trust it", fk.socket);
  ck_assert_msg(strstr(err_buf, want), "%s", err_buf);
  ck_assert_msg(!strstr(out_buf, "paused"), "%s", out_buf);
  slurp(fk.asked, asked, sizeof asked);
  ck_assert_str_eq(asked, "pause max_residual=0 timeout=0 tags=kv\nresume tags=kv\n");
  /* Its own user trusts it: a user's own daemon (make demo as that user). */
  ck_assert_int_eq(chmod(fk.dir, 0755), 0);
  ck_assert_int_eq(chmod(fk.socket, 0666), 0);
  ck_assert_msg(ctl_as("setpriv --reuid=65534 --regid=65534 --clear-groups", fk.dir, fk.socket,
                       "pause kv") == 0, "%s", err_buf);
}
END_TEST

/* gpumemctl without a controller's rights looks through a worker session,
 * which sees only its own uid's sessions, tags and tenants (root's worker
 * and its tag stay hidden); gpumem_sessions leaves its own session out (a
 * root test, where it can run gpumemctl as nobody). */
START_TEST(metrics_leave_out_gpumemctl_own_worker_session) {
  if (system("command -v setpriv >/dev/null 2>&1") != 0) {
    printf("metrics_leave_out_gpumemctl_own_worker_session: skipped: needs setpriv\n");
    return;
  }
  if (!harness_others_can_run("metrics_leave_out_gpumemctl_own_worker_session")) return;
  daemon_start(&d, "--socket-mode", "0666", NULL);
  ck_assert_int_eq(chmod(d.dir, 0755), 0);
  struct worker w;
  worker_start(&w, &d, "--tag", "kv", "--size", "4M", NULL);
  const char *nobody = "setpriv --reuid=65534 --regid=65534 --clear-groups";
  /* Refused as a controller, it looks as a worker: its session is there. */
  ck_assert_msg(ctl_as(nobody, d.dir, d.socket, "--json status") == 0, "%s", err_buf);
  ck_assert_int_eq(json_check(d.dir, "[(s['role'],s['name'],s['uid']) for s in j['sessions']]"
                                     "==[('worker','gpumemctl',65534)]"),
                   0);
  ck_assert_int_eq(json_check(d.dir, "j['tags']==[] and j['tenants']==[]"), 0);
  /* Root's controller view has all of it. */
  ck_assert_msg(ctl_as("", d.dir, d.socket, "--json status") == 0, "%s", err_buf);
  ck_assert_int_eq(json_check(d.dir, "[t['name'] for t in j['tags']]==['kv'] and "
                                     "[t['uid'] for t in j['tenants']]==[0]"),
                   0);
  ck_assert_msg(ctl_as(nobody, d.dir, d.socket, "metrics") == 0, "%s", err_buf);
  ck_assert_msg(strstr(out_buf, "\ngpumem_sessions 0\n"), "%s", out_buf);
  /* Its refused requests for the controller role are routine, not errors. */
  ck_assert_msg(!strstr(out_buf, "gpumem_errors_total{code=\"PERMISSION_DENIED\"}"), "%s",
                out_buf);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

int main(void) {
  return HARNESS_RUN("ctl", 60, NULL, teardown,
                     unknown_tag_is_not_found_and_fails, pause_and_resume_select_sessions,
                     pause_and_resume_print_the_driver_checks,
                     status_json_carries_every_figure,
                     max_residual_is_a_pause_option,
                     a_failed_pause_says_what_is_held_and_by_whom,
                     the_library_reports_failures_whole,
                     status_names_the_largest_holders_outside_gpumemd,
                     status_says_when_the_driver_gives_no_per_process_figures,
                     version_names_tool_library_and_daemon, json_failures_print_an_error_object,
                     timeout_takes_durations, names_are_escaped_whatever_bytes_they_hold,
                     every_class_of_bad_text_is_escaped,
                     controllers_open_no_gpu_backend,
                     metrics_say_up_and_paused_and_count_workers,
                     metrics_say_down_when_the_daemon_fails_after_hello,
                     share_says_per_tag_in_one_document,
                     metrics_count_operations_and_pass_promtool,
                     metrics_leave_out_gpumemctl_own_worker_session,
                     a_daemon_another_user_runs_is_not_trusted, daemon_words_cannot_forge_lines,
                     status_shows_the_grace_while_it_runs);
}
