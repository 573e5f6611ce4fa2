/* Processes by pidfd, not pid: the kill policy signals only the process
 * that connected, pinned at connect, and never a pid the daemon cannot
 * see. A daemon in its own pid namespace (as in a container) sees this
 * process as pid 0, and pids there are handed out only by this test, so a
 * recycled pid can be made on purpose (ns_last_pid). Needs root; without
 * it the namespace cases say so and pass. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/wire.h"
#include "daemon/peer.h"
#include "harness.h"

#define MiB (1024ull * 1024ull)
#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x

static struct daemon d;

/* Stop the test's daemon and check that no fd leaked. */
static void teardown(void) { harness_daemon_teardown(&d); }

/* Fork a child as the first process of a new pid namespace (in its own
 * process group) that runs gpumemd on d's socket; -1 where namespaces
 * may not be made here. */
static pid_t spawn_in_pidns(const struct daemon *dm, const char *const *extra) {
  const char *argv[DAEMON_ARGV_MAX];
  daemon_argv(argv, dm->socket, extra);
  pid_t pid = (pid_t)syscall(SYS_clone, CLONE_NEWPID | SIGCHLD, NULL, NULL, NULL, 0);
  if (pid == 0) {
    setpgid(0, 0);
    harness_exec(argv, dm->log);
  }
  return pid;
}

/* Start gpumemd in a pid namespace of its own and wait until it answers;
 * false (nothing started) where namespaces may not be made. */
static bool daemon_start_pidns(struct daemon *dm, ...) {
  va_list ap;
  va_start(ap, dm);
  bool started = daemon_startv(dm, "gpumemd-pidfd", spawn_in_pidns, ap);
  va_end(ap);
  if (!started) {
    fprintf(stderr, "pid namespaces unavailable (%s): case skipped\n", strerror(errno));
    daemon_stop(dm);
  }
  return started;
}

/* True while the daemon runs (not exited, not killed). */
static bool daemon_alive(void) { return kill(d.pid, 0) == 0 && waitpid(d.pid, NULL, WNOHANG) == 0; }

/* The status has only the controller's session, and no managed bytes. */
static void assert_only_controller(struct peer *c) {
  wire_env *s = peer_status(c);
  ck_assert_uint_eq(s->status_reply->n_sessions, 1);
  ck_assert_uint_eq(s->status_reply->devices[0]->managed, 0);
  wire_env_free(s);
  ck_assert_uint_eq(memfd_bytes(&d.pid, 1), 0);
}

/* A worker that never acks, in a pid namespace the daemon cannot see
 * (pid 0: kill(0) would have hit the daemon's own process group): under
 * the kill policy it is not signalled, its session is ended and its
 * buffers freed, and the reply says so instead of "killed". */
START_TEST(unseen_pid_is_never_signalled_and_its_session_ends) {
  if (!daemon_start_pidns(&d, "--ack-timeout", "200ms", "--timeout-policy", "kill", NULL))
    return;
  struct peer w, c;
  struct pbuf b;
  wire_env *e = peer_pause_pending(&d, &w, &c, 4 * MiB, &b); /* the Unmap, never acked */
  ck_assert_int_eq(e->body_case, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP);
  wire_env_free(e);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(CLIENT_TIMEOUT));
  const char *m = r->error->message;
  fprintf(stderr, "pid 0, stuck (the answer expected): %s\n", m);
  ck_assert_msg(!strstr(m, "killed"), "claims a kill: %s", m);
  ck_assert_msg(strstr(m, "pid 0 (not signalled, pid not visible here: session ended)"), "%s", m);
  ck_assert_msg(strstr(m, "1 buffers (4.00 MiB) freed with their sessions"), "%s", m);
  ck_assert_uint_eq(r->error->buffers_held, 0);
  ck_assert_uint_eq(r->error->n_pids, 1);
  ck_assert_uint_eq(r->error->pids[0], 0);
  wire_env_free(r);
  ck_assert_msg(peer_ended(&w), "the unpinnable worker's session was not ended");
  ck_assert(daemon_alive());
  peer_unmap(&b);
  assert_only_controller(&c);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* Fork a child into the daemon's pid namespace (by its /proc entry); the
 * caller's own children go back to its namespace before this returns. */
static pid_t fork_into_daemon_ns(void) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/ns/pid", (int)d.pid);
  int theirs = open(path, O_RDONLY | O_CLOEXEC), ours = open("/proc/self/ns/pid", O_RDONLY | O_CLOEXEC);
  ck_assert_int_ge(theirs, 0);
  ck_assert_int_ge(ours, 0);
  ck_assert_int_eq(setns(theirs, CLONE_NEWPID), 0);
  pid_t pid = fork();
  int back = pid == 0 ? 0 : setns(ours, CLONE_NEWPID); /* the child is in theirs now */
  close(theirs);
  close(ours);
  ck_assert_int_eq(back, 0);
  ck_assert_int_ge(pid, 0);
  return pid;
}

/* Set the pid namespace's last pid so that the next process gets want. */
static void next_pid_is(pid_t want) {
  pid_t h = fork_into_daemon_ns();
  if (h == 0) {
    int fd = open("/proc/sys/kernel/ns_last_pid", O_WRONLY | O_CLOEXEC);
    char num[16];
    int len = snprintf(num, sizeof num, "%d", (int)want - 1);
    _exit(fd >= 0 && write(fd, num, (size_t)len) == len ? 0 : 1);
  }
  int status;
  ck_assert_int_eq(waitpid(h, &status, 0), h);
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "could not set ns_last_pid");
}

/* A child in the daemon's namespace that connects connect_fd (unless
 * -1), keeps no other fd but out and hold, tells its pid there on out
 * and waits for hold to close. */
static pid_t ns_child(int out, int hold, int connect_fd) {
  pid_t pid = fork_into_daemon_ns();
  if (pid == 0) {
    if (connect_fd >= 0) {
      struct sockaddr_un addr = {.sun_family = AF_UNIX};
      snprintf(addr.sun_path, sizeof addr.sun_path, "%s", d.socket);
      if (connect(connect_fd, (struct sockaddr *)&addr, sizeof addr) < 0) _exit(1);
    }
    for (int fd = 3; fd < 1024; fd++)
      if (fd != out && fd != hold) close(fd);
    pid_t me = getpid();
    char c;
    if (write(out, &me, sizeof me) != sizeof me) _exit(1);
    _exit(read(hold, &c, 1) == 0 ? 0 : 1);
  }
  return pid;
}

/* A worker connects, hands its connection on (here: to this process) and
 * exits; its pid goes to an unrelated process. The kill policy must not
 * signal that process: the pid the daemon recorded is no longer the peer.
 * The session ends, its buffers are freed, and the reply says why. */
START_TEST(recycled_pid_is_never_signalled) {
  if (!daemon_start_pidns(&d, "--ack-timeout", "200ms", "--timeout-policy", "kill", NULL))
    return;
  int out[2], hold_w[2], hold_v[2];
  ck_assert_int_eq(pipe2(out, O_CLOEXEC), 0);
  ck_assert_int_eq(pipe2(hold_w, O_CLOEXEC), 0);
  ck_assert_int_eq(pipe2(hold_v, O_CLOEXEC), 0);
  struct peer w;
  peer_attach(&w, socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), WIRE_MAX_REPLY);
  ck_assert_int_ge(w.fd, 0);
  /* The worker connects (the daemon records its pid) and waits. */
  pid_t worker = ns_child(out[1], hold_w[0], w.fd), wpid, vpid;
  ck_assert_int_eq(read(out[0], &wpid, sizeof wpid), sizeof wpid);
  wire_env_free(peer_hello(&w, GPUMEM__WIRE__ROLE__ROLE_WORKER)); /* accepted: pinned */
  struct pbuf b;
  peer_alloc(&w, "kv", 0, 4 * MiB, 0, &b);
  /* It exits, and an unrelated process gets its pid. */
  close(hold_w[1]);
  int status;
  ck_assert_int_eq(waitpid(worker, &status, 0), worker);
  ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  next_pid_is(wpid);
  pid_t victim = ns_child(out[1], hold_v[0], -1);
  ck_assert_int_eq(read(out[0], &vpid, sizeof vpid), sizeof vpid);
  ck_assert_int_eq(vpid, wpid);
  struct peer c;
  peer_open(&c, &d, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  peer_op(&c, false, "kv", 0, 0);
  wire_env *e = peer_event(&w, NULL); /* the Unmap, never acked */
  wire_env_free(e);
  wire_env *r;
  ck_assert_int_eq(peer_op_wait(&c, &r), CODE(CLIENT_TIMEOUT));
  const char *m = r->error->message;
  ck_assert_msg(waitpid(victim, &status, WNOHANG) == 0, "the process that got pid %d was %s",
                (int)wpid, WIFSIGNALED(status) ? strsignal(WTERMSIG(status)) : "ended");
  fprintf(stderr, "recycled pid %d (the answer expected): %s\n", (int)wpid, m);
  char want[96];
  snprintf(want, sizeof want, "pid %d (not signalled, process gone: session ended)", (int)wpid);
  ck_assert_msg(strstr(m, want), "%s", m);
  ck_assert_msg(!strstr(m, "killed"), "claims a kill: %s", m);
  ck_assert_uint_eq(r->error->buffers_held, 0);
  wire_env_free(r);
  ck_assert_msg(peer_ended(&w), "the worker's session was not ended");
  ck_assert(daemon_alive());
  peer_unmap(&b);
  assert_only_controller(&c);
  close(hold_v[1]);
  ck_assert_int_eq(waitpid(victim, &status, 0), victim);
  ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  close(out[0]);
  close(out[1]);
  close(hold_w[0]);
  close(hold_v[0]);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A child that waits to be killed. */
static pid_t sleeper(void) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    pause();
    _exit(0);
  }
  return pid;
}

/* The fallback for kernels without SO_PEERPIDFD pins a live process with
 * the connection's uid, and refuses pid 0, a pid held by another uid and
 * a pid that has gone; what it pins, it can signal. */
START_TEST(pidfd_open_fallback_checks_the_credentials) {
  pid_t child = sleeper();
  struct ucred cred = {.pid = child, .uid = geteuid(), .gid = getegid()};
  int pidfd = peer_pin_pid(&cred);
  ck_assert_int_ge(pidfd, 0);
  cred.uid = geteuid() + 1;
  ck_assert_int_eq(peer_pin_pid(&cred), -EPERM);
  cred.pid = 0;
  ck_assert_int_eq(peer_pin_pid(&cred), -ESRCH);
  ck_assert_int_eq(peer_signal(-1, SIGKILL), -EBADF);
  ck_assert_int_eq(peer_signal(pidfd, SIGKILL), 0);
  int status;
  ck_assert_int_eq(waitpid(child, &status, 0), child);
  ck_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  ck_assert_int_eq(peer_signal(pidfd, SIGKILL), -ESRCH); /* reaped: never anyone else */
  peer_unpin(pidfd);
  cred = (struct ucred){.pid = child, .uid = geteuid(), .gid = getegid()};
  int gone = peer_pin_pid(&cred);
  peer_unpin(gone);
  ck_assert_int_lt(gone, 0);
}
END_TEST

/* A connection pins the process at its other end, wherever the kernel
 * can say which (SO_PEERPIDFD, else the fallback). */
START_TEST(connection_pins_its_peer) {
  int sv[2];
  ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  struct ucred cred;
  socklen_t len = sizeof cred;
  ck_assert_int_eq(getsockopt(sv[0], SOL_SOCKET, SO_PEERCRED, &cred, &len), 0);
  int pidfd = peer_pin(sv[0], &cred);
  ck_assert_int_ge(pidfd, 0);
  ck_assert_int_eq(peer_signal(pidfd, 0), 0);
  peer_unpin(pidfd);
  cred.pid = 0;
  ck_assert_int_eq(peer_pin(sv[0], &cred), -ESRCH);
  close(sv[0]);
  close(sv[1]);
}
END_TEST

int main(void) {
  return HARNESS_RUN("pidfd", 30, NULL, teardown,
                     unseen_pid_is_never_signalled_and_its_session_ends,
                     recycled_pid_is_never_signalled, pidfd_open_fallback_checks_the_credentials,
                     connection_pins_its_peer);
}
