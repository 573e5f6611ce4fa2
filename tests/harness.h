/* Test harness: fd-leak fixtures, a real daemon and real worker processes. */
#ifndef GPUMEM_TEST_HARNESS_H
#define GPUMEM_TEST_HARNESS_H

#include <check.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "procfd.h"

/* Run one suite: each test in its own process, with a timeout (seconds;
 * three times as long under a sanitizer) and the fixture (NULLs for
 * harness_fd_setup/teardown); the exit status for main. */
int harness_run(const char *name, const TTest *const *tests, size_t n, double timeout,
                void (*setup)(void), void (*teardown)(void));

#define HARNESS_RUN(name, timeout, setup, teardown, ...)                                  \
  harness_run(name, (const TTest *const[]){__VA_ARGS__},                                  \
              sizeof((const TTest *const[]){__VA_ARGS__}) / sizeof(const TTest *), timeout, \
              setup, teardown)

/* Open fds of this process. */
int harness_fd_count(void);

/* Checked fixture pair: teardown fails the test if fds leaked. */
void harness_fd_setup(void);
void harness_fd_teardown(void);

/* A daemon started for one test, in its own directory. */
struct daemon {
  pid_t pid;
  char dir[64];
  char socket[96];
  char log[128];
};

/* A teardown's work for a suite with one daemon d: stop it if it still
 * runs (it must exit 0), then harness_fd_teardown. */
void harness_daemon_teardown(struct daemon *d);

/* Path of a built program ("gpumemd", "gpumem-worker", ...). The paths
 * harness_bin, harness_others_bin and harness_built return stay valid for
 * the next seven such calls. */
const char *harness_bin(const char *name);

/* A path in the build directory ("lib/libgpumem_preload.so", ...). */
const char *harness_built(const char *rel);

/* Path of a built program that user nobody (65534) can run: a copy in
 * $GPUMEM_OTHERS_BUILD, which tests/run.sh makes when the build directory
 * is private (a clone under /root), else harness_bin's. */
const char *harness_others_bin(const char *name);

/* Whether this test may run the build's programs as nobody: root, and
 * nobody can reach them (harness_others_bin); when not, says why the test
 * named test is skipped. */
bool harness_others_can_run(const char *test);

/* Start gpumemd with extra arguments (NULL-terminated) and wait until it
 * answers. Fails the test if it does not. */
void daemon_start(struct daemon *d, ...);

/* Copy a NULL-terminated list of string arguments into out, at most max
 * - 1 of them, and end it with NULL. */
void harness_collect_args(const char **out, size_t max, va_list ap);

/* The most entries (with the NULL) of daemon_argv's argv. */
enum { DAEMON_ARGV_MAX = 32 };

/* gpumemd's argv (DAEMON_ARGV_MAX entries) for a test daemon on socket:
 * debug log, host backend, then extra (NULL-terminated; NULL: none). */
void daemon_argv(const char **argv, const char *socket, const char *const *extra);

/* Make d's own directory /tmp/<name>.XXXXXX and name its socket and log
 * in it (no daemon yet). */
void daemon_paths(struct daemon *d, const char *name);

/* Wait (up to 5 s) until d->pid answers on d's socket; false if it exited
 * first or did not answer. */
bool daemon_wait_ready(struct daemon *d);

/* In a forked child: exec argv[0] with stdout and stderr appended to the
 * file out and no other fd inherited; exits 127 if exec fails. */
_Noreturn void harness_exec(const char *const *argv, const char *out);

/* What starts a test daemon's process on d's socket and log with extra
 * arguments (NULL-terminated): its pid, or -1 (errno set) where it cannot. */
typedef pid_t daemon_spawner(const struct daemon *d, const char *const *extra);

/* Start gpumemd as daemon_start does, in a fresh directory
 * /tmp/<name>.XXXXXX, but through start and with the arguments in ap:
 * false (d->pid 0, errno from start) if start could not start it. */
bool daemon_startv(struct daemon *d, const char *name, daemon_spawner *start, va_list ap);

/* Start gpumemd on an existing socket path; returns its pid (no wait). */
pid_t daemon_spawn(const char *socket, const char *log, const char *const *argv_extra);

/* Stop the daemon with SIGTERM; returns its exit status (-1: killed). */
int daemon_stop(struct daemon *d);

/* A worker process with its output in a file. */
struct worker {
  pid_t pid;
  char out[160];
};

/* Start gpumem-worker against d with extra arguments (NULL-terminated)
 * and wait for its "ready" line. */
void worker_start(struct worker *w, const struct daemon *d, ...);

/* Start gpumemd with no extra arguments (daemon_start) and a worker
 * against it with these (worker_start, NULL-terminated), waiting for both. */
void daemon_with_worker(struct daemon *d, struct worker *w, ...);

/* Start gpumem-worker as worker_start does, without waiting for it. */
void worker_spawn(struct worker *w, const struct daemon *d, ...);

/* 1 where the test runs under a sanitizer (ASan or TSan): everything is
 * slower, and the daemon carries memory of the sanitizer's own (shadow,
 * quarantine) that figures about its memory must allow for. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define HARNESS_SANITIZED 1
#else
#define HARNESS_SANITIZED 0
#endif

/* How long a test waits for something that should happen at once: ms
 * times GPUMEM_TEST_PATIENCE (default 5), so that a busy machine is slow
 * without failing; the waits return as soon as it happens. */
int harness_patience_ms(int ms);

/* Wait until the worker's output has count lines containing text. */
bool worker_wait_for(const struct worker *w, const char *text, int count, int timeout_ms);

/* Number of output lines containing text. */
int worker_count(const struct worker *w, const char *text);

/* The worker's whole output (static buffer). */
const char *worker_output(const struct worker *w);

/* Stop a worker with SIGSTOP; returns once the kernel says it stopped. */
void worker_freeze(struct worker *w);

/* Stop the daemon the same way, so that what is sent meanwhile waits in
 * its sockets and is read in one turn of its loop; daemon_thaw lets it go
 * on. */
void daemon_freeze(struct daemon *d);
void daemon_thaw(struct daemon *d);

/* Send sig and reap; returns exit status, or 128+signal if killed. */
int worker_stop(struct worker *w, int sig);

/* Bytes of the host backend's memfds that these processes hold by fd or
 * mapping, each counted once (the kernel's figure, not machine-wide). */
uint64_t memfd_bytes(const pid_t *pids, size_t npids);

/* Bytes this process maps from files whose /proc/self/maps path holds
 * name, and the permissions ("r--s") of the first such mapping into perms
 * (5 bytes; "" when none). */
uint64_t self_mapped(const char *name, char *perms);

/* Milliseconds on the monotonic clock. */
double now_ms(void);


/* Connect a raw socket to the daemon. */
int raw_connect(const struct daemon *d);

/* Lines of the daemon's log that contain text. */
int daemon_log_count(const struct daemon *d, const char *text);


/* --- what libgpumem's connection hook saw --- */

#include <pthread.h>

#include "gpumem.h"

/* The status of tag by client c (all zero, name NULL, when the daemon
 * lists none); fails the test if the status cannot be had. */
struct gpumem_tag_status client_tag(gpumem_client *c, const char *tag);

/* One pause (resume false) or resume of tag by controller ctl; its code. */
int client_op(gpumem_client *ctl, const char *tag, bool resume);

/* What a connection hook saw (conn_events_watch). Read the fields under
 * mu, or once the events a test waits for have all come. */
struct conn_events {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int lost, restored;   /* events of each kind */
  int code;             /* the last event's code, count and words */
  size_t count;
  char words[512];
  char first_loss[512]; /* the words of the first loss */
};

/* Record c's connection events in e from now on (e starts empty). */
void conn_events_watch(struct conn_events *e, gpumem_client *c);

/* Wait (up to 20 s) until e saw at least lost losses and restored
 * restorations; false if they did not come. */
bool conn_events_wait(struct conn_events *e, int lost, int restored);


/* --- a raw protocol peer, to drive the daemon exactly as a test needs --- */

#include "common/frame.h"
#include "common/wire.h"

/* An envelope with an id (0: none yet, or outside any request) and the
 * kind of its body, which the caller then points the body's member at:
 *   wire_env env = peer_env(id, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC);
 *   env.alloc = &request; */
wire_env peer_env(uint64_t id, Gpumem__Wire__Envelope__BodyCase body);

/* A raw peer (worker or controller, or the daemon's side of a session a
 * test accepts): a socket with its own frame reader and writer. It sends
 * one message at a time (peer_put) or queues many to flush (peer_push,
 * peer_flush), and reads blocking (peer_get) or without blocking
 * (peer_fill, peer_next). The peer_* calls that do not say they assert
 * return what failed instead, for processes without Check. */
struct peer {
  int fd;
  frame_reader *r;
  frame_writer *w;
  uint64_t next_id;
  int err; /* the first push that failed (negative errno), told by peer_flush */
};

/* A listening socket at path, in its own directory dir, for a test that
 * plays the daemon: its connections become peers with peer_accept. */
struct listener {
  char dir[64];
  char path[96];
  int fd;
};

/* A buffer a raw worker holds: its id and the chunk fds it "maps". */
struct pbuf {
  uint64_t id;
  int fds[8];
  size_t nfds;
  uint64_t size, chunk_sizes[8];
  size_t nchunks;
  uint8_t secret[WIRE_SECRET_SIZE]; /* as the daemon gave it */
  size_t secret_len;
};

/* Make a peer of a socket fd (owned from now on; -1 for none), reading
 * frames up to max_len (WIRE_MAX_REPLY from a daemon, WIRE_MAX_REQUEST
 * from a client); its first request id is 1. */
void peer_attach(struct peer *p, int fd, size_t max_len);

/* Connect to d without saying hello. */
void peer_connect(struct peer *p, const struct daemon *d);

/* Listen on a fresh socket path, in a fresh directory /tmp/<name>.XXXXXX
 * (the test fails if it cannot). */
void peer_listen(struct listener *l, const char *name);

/* Accept the next connection into p, closing what p held first (p is a
 * closed peer or {.fd = -1}); the peer reads requests. Nothing asserted:
 * p->fd is -1 if accept failed. */
void peer_accept(struct peer *p, const struct listener *l);

/* Close the listening socket (again: nothing) and remove its path, so
 * that connecting fails; the directory stays. */
void peer_unlisten(struct listener *l);

/* peer_unlisten, and remove the directory. */
void peer_listen_close(struct listener *l);

/* Queue a message with fds (consumed) for peer_flush. False if it could
 * not be queued; that error is kept and the next flush returns it. */
bool peer_push(struct peer *p, const wire_env *env, const int *fds, size_t nfds);

/* Send what the socket takes now: 0 when all is sent, -EAGAIN when the
 * socket is full, or a negative errno (the daemon went away, a failed push). */
int peer_flush(struct peer *p);

/* Send everything queued, waiting up to ms (-1: no limit) for room: 0,
 * -EAGAIN if there was no room in time, or peer_flush's error. */
int peer_flush_within(struct peer *p, int ms);

/* Read once what the socket has, without blocking: 1 (something or
 * nothing there), 0 at end of stream (closed or reset), or a negative errno. */
int peer_fill(struct peer *p);

/* The next whole message already read, with its fds in *f (the caller
 * releases f), or NULL: none yet (*err 0), or a bad frame (*err
 * -EMSGSIZE) or one that is no message (*err -EBADMSG). */
wire_env *peer_next(struct peer *p, struct frame *f, int *err);

/* Wait up to ms (-1: no limit) for the next message: 1 with it in *env
 * and its fds in *f, 0 at end of stream, -ETIMEDOUT, or peer_next's or
 * peer_fill's error. */
int peer_await(struct peer *p, struct frame *f, int ms, wire_env **env);

/* Queue a Hello in a role under a name, at version major.minor; its
 * request id. */
uint64_t peer_push_hello(struct peer *p, int role, const char *name, uint32_t major,
                         uint32_t minor);

/* Queue an AllocRequest; its request id. */
uint64_t peer_push_alloc(struct peer *p, const char *tag, unsigned dev, uint64_t size,
                         uint32_t flags);

/* Queue a FreeRequest of a buffer; its request id. */
uint64_t peer_push_free(struct peer *p, uint64_t buffer);

/* Queue an ack of an event with any code and failed buffers (why: NULL
 * for none). */
void peer_push_ack(struct peer *p, uint64_t event, int code, const uint64_t *failed,
                   size_t nfailed, const char *why);

/* Say hello in a role (GPUMEM__WIRE__ROLE__...); the HelloReply (free it
 * with wire_env_free). */
wire_env *peer_hello(struct peer *p, int role);

/* Say hello in a role under a name; returns the HelloReply. */
wire_env *peer_hello_as(struct peer *p, int role, const char *name);

/* Connect to d and say hello in a role (GPUMEM__WIRE__ROLE__...). */
void peer_open(struct peer *p, const struct daemon *d, int role);

/* Close a peer; it is left {.fd = -1}, which closing again leaves alone. */
void peer_close(struct peer *p);

/* Send a message with fds (consumed), waiting for room (the test fails
 * if it cannot). */
void peer_put(struct peer *p, const wire_env *env, const int *fds, size_t nfds);

/* The next message within ms (the test fails if none comes); its fds go
 * to keep (NULL: closed). NULL at end of stream (closed or reset); any
 * other read error fails the test. */
wire_env *peer_get_within(struct peer *p, struct frame *keep, int ms);

/* peer_get_within 5 s. */
wire_env *peer_get(struct peer *p, struct frame *keep);

/* True if a message (or the end) is waiting (without blocking). */
bool peer_waiting(struct peer *p);

/* True if the daemon ends the session within 3 s (messages before the end
 * are skipped). */
bool peer_ended(struct peer *p);

/* The code of a reply: OK, or the Error's code (its message into why
 * unless NULL, "" for OK). */
wire_code peer_reply_code(const wire_env *r, char *why, size_t whylen);

/* Allocate a buffer and keep its chunk fds; the reply's code, not asserted
 * (b is zeroed and holds nothing unless OK). */
wire_code peer_try_alloc(struct peer *p, const char *tag, unsigned dev, uint64_t size,
                         uint32_t flags, struct pbuf *b);

/* Allocate a buffer and keep its chunk fds, as a mapping would (the test
 * fails unless it is OK). */
void peer_alloc(struct peer *p, const char *tag, unsigned dev, uint64_t size, uint32_t flags,
                struct pbuf *b);

/* "Unmap": close the fds a buffer holds. */
void peer_unmap(struct pbuf *b);

/* Acknowledge an event with any code (even one outside the enum) and
 * failed buffers. */
void peer_ack_code(struct peer *p, uint64_t event, int code, const uint64_t *failed,
                   size_t nfailed, const char *why);

/* Acknowledge an event, naming failed buffers (code OK if none). */
void peer_ack(struct peer *p, uint64_t event, const uint64_t *failed, size_t nfailed,
              const char *why);

/* Queue a pause or resume of ntags tags, as peer_op_tags sends it. */
void peer_push_op_tags(struct peer *c, bool resume, const char *const *tags, size_t ntags,
                       uint64_t devmask, uint64_t max_residual);

/* Send a pause or resume of ntags tags, as given (devmask: bit mask of
 * devices 0-63, 0 for all). */
void peer_op_tags(struct peer *c, bool resume, const char *const *tags, size_t ntags,
                  uint64_t devmask, uint64_t max_residual);

/* Send a pause or resume of one tag (devmask: bit mask, 0 for all). */
void peer_op(struct peer *c, bool resume, const char *tag, uint64_t devmask,
             uint64_t max_residual);

/* The controller's answer: OK (OpReply in *out) or the error code (Error
 * in *out). Free *out with wire_env_free. */
wire_code peer_op_wait(struct peer *c, wire_env **out);

/* The controller's answer, which must be OK (else the test fails with
 * the Error's words) for this many buffers and bytes. */
void peer_op_ok(struct peer *c, uint64_t buffers, uint64_t bytes);

/* The controller's answer, as peer_op_wait, but only its code. */
wire_code peer_op_code(struct peer *c);

/* c pauses (resume: resumes) tag on every device, w answers the one
 * event with its n buffers (peer_serve), and the answer must be OK. */
void peer_op_served(struct peer *c, bool resume, const char *tag, struct peer *w,
                    struct pbuf *bufs, size_t n);

/* The next event for a worker, with its fds kept in *f (NULL: closed). */
wire_env *peer_event(struct peer *w, struct frame *f);

/* Open a worker w and then a controller c of d, allocate w a buffer b of
 * size bytes of tag kv on device 0, send c's pause of kv, and return the
 * event that w gets for it (its fds closed; free it with wire_env_free). */
wire_env *peer_pause_pending(const struct daemon *d, struct peer *w, struct peer *c,
                             uint64_t size, struct pbuf *b);

/* Take a Remap's fds into the buffers it names ("map" them). */
void peer_take_remap(const wire_env *e, struct frame *f, struct pbuf *bufs, size_t n);

/* Answer every event of one operation: unmaps close, remaps take fds. */
void peer_serve(struct peer *w, struct pbuf *bufs, size_t n, size_t events);

/* Send what is queued (peer_push_...) and take the next message, of any
 * kind (the test fails if none comes); its fds are closed. */
wire_env *peer_answer(struct peer *p);

/* Send a request (its id set here) and take the reply, of any kind (the
 * test fails if none comes). */
wire_env *peer_call(struct peer *p, wire_env *env);

/* peer_call, and the reply must be of kind want. */
wire_env *peer_ask(struct peer *c, wire_env *env, Gpumem__Wire__Envelope__BodyCase want);

/* peer_call, and only the reply's code (peer_reply_code: its words into
 * why unless NULL). */
wire_code peer_call_code(struct peer *p, wire_env *env, char *why, size_t whylen);

/* A status as the daemon sends it. */
wire_env *peer_status(struct peer *c);

/* A list as the daemon sends it. */
wire_env *peer_list(struct peer *c);

/* The number of buffers a list (peer_list) names. */
size_t peer_list_count(struct peer *c);

/* A tag in a status (the test fails if there is none). */
const Gpumem__Wire__TagInfo *peer_tag(const wire_env *st, const char *name);

/* Poll status (up to 2 s) until a tag is in state st with n in transit. */
bool peer_wait_tag(struct peer *c, const char *tag, int st, uint64_t transit);

/* The error a session gets outside a request (id 0): its code. */
wire_code peer_stray_error(struct peer *p);

/* Open fds of a process, and the highest one. */
int proc_fds(pid_t pid, int *maxfd);

/* Open fds of a process whose target contains text ("socket:",
 * "memfd:gpumem-host-", ...). */
int proc_fds_with(pid_t pid, const char *text);

#endif
