/* The socket path is safe: gpumemd binds only in a directory that no one
 * but root and its own user can change (every directory on the way
 * included), and says why otherwise, creating nothing; gpumemctl trusts
 * only a daemon that root, or the user it names, runs. Tests that need
 * other uids run as root and use nobody (65534); they say when skipped. */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

#define NOBODY ((uid_t)65534)

/* One test's private directory (root-owned, 0700 unless a test says). */
static char dir[64];

/* Make the test's directory. */
static void make_dir(void) {
  snprintf(dir, sizeof dir, "/tmp/gpumemd-sock.XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(dir));
}

/* Remove the test's directory. */
static void remove_dir(void) {
  char cmd[160];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  ck_assert_int_eq(system(cmd), 0);
  dir[0] = '\0';
}

/* Check fds, with no directory yet. */
static void setup(void) {
  dir[0] = '\0';
  harness_fd_setup();
}

/* Remove what a failed test left, then check fds. */
static void teardown(void) {
  if (dir[0]) remove_dir();
  harness_fd_teardown();
}

/* A path under the test's directory, in buf. */
static const char *in_dir(char *buf, size_t len, const char *rel) {
  snprintf(buf, len, "%s/%s", dir, rel);
  return buf;
}

/* A whole file (static buffer; empty when missing). */
static const char *slurp(const char *path) {
  static char buf[16384];
  buf[0] = '\0';
  FILE *f = fopen(path, "r");
  if (!f) return buf;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = '\0';
  fclose(f);
  return buf;
}

/* Whether this process may run gpumemd as another user (root) and learn
 * when it is ready (NOTIFY_SOCKET: a build with libsystemd); says so when
 * not. */
static bool can_switch_users(const char *test) {
#ifndef HAVE_SYSTEMD
  printf("%s: skipped: built without libsystemd (no READY=1 to wait for)\n", test);
  return false;
#endif
  return harness_others_can_run(test);
}

/* Fork gpumemd on socket as uid ((uid_t)-1: as we are), its output in log,
 * telling NOTIFY_SOCKET notify when given. */
static pid_t spawn_as(uid_t uid, const char *path, const char *log, const char *notify) {
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid > 0) return pid;
  int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0 || dup2(fd, 1) < 0 || dup2(fd, 2) < 0) _exit(126);
  if (uid != (uid_t)-1 &&
      (setgroups(0, NULL) < 0 || setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0))
    _exit(125);
  if (notify) setenv("NOTIFY_SOCKET", notify, 1);
  else unsetenv("NOTIFY_SOCKET");
  unsetenv("LISTEN_FDS");
  unsetenv("LISTEN_PID");
  execl(uid == (uid_t)-1 ? harness_bin("gpumemd") : harness_others_bin("gpumemd"), "gpumemd",
        "--socket", path, "--backend", "host",
        "--host-devices", "1", "--socket-mode", "0666", (char *)NULL);
  _exit(127);
}

/* A daemon's exit status (-1 when killed). */
static int wait_exit(pid_t pid) {
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The exit status of a gpumemd that should refuse to start: the test
 * fails (and the daemon is killed) if it still runs after 10 s. */
static int wait_refusal(pid_t pid) {
  int pfd = (int)syscall(SYS_pidfd_open, pid, 0);
  ck_assert_int_ge(pfd, 0);
  struct pollfd p = {.fd = pfd, .events = POLLIN};
  int n = poll(&p, 1, 10000);
  close(pfd);
  if (n != 1) {
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    ck_abort_msg("gpumemd did not refuse: it still ran after 10 s");
  }
  return wait_exit(pid);
}

/* Run gpumemd on socket as uid, expecting it to refuse: exit 1, words in
 * its log, and no socket file made. */
static void refused(uid_t uid, const char *path, const char *words) {
  char log[128];
  in_dir(log, sizeof log, "refused.log");
  pid_t pid = spawn_as(uid, path, log, NULL);
  ck_assert_int_eq(wait_refusal(pid), 1);
  const char *text = slurp(log);
  ck_assert_msg(strstr(text, words), "no '%s' in: %s", words, text);
  struct stat st;
  ck_assert_msg(lstat(path, &st) != 0, "%s was created", path);
}

/* refused() for the socket "sock" in directory where, with the words
 * made of fmt. */
__attribute__((format(printf, 3, 4))) static void refused_in(uid_t uid, const char *where,
                                                             const char *fmt, ...) {
  char sock[512], words[1024];
  snprintf(sock, sizeof sock, "%s/sock", where);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(words, sizeof words, fmt, ap);
  va_end(ap);
  refused(uid, sock, words);
}

/* A directory under the test's with a mode, owned by uid ((uid_t)-1:
 * us); its path in buf. */
static const char *sub_dir(char *buf, size_t len, const char *rel, mode_t mode, uid_t uid) {
  in_dir(buf, len, rel);
  ck_assert_int_eq(mkdir(buf, 0700), 0);
  if (uid != (uid_t)-1) ck_assert_int_eq(chown(buf, uid, uid), 0);
  ck_assert_int_eq(chmod(buf, mode), 0);
  return buf;
}

/* A Unix address for path (the test fails if it does not fit). */
static struct sockaddr_un unix_addr(const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  ck_assert_uint_lt(strlen(path), sizeof addr.sun_path);
  memcpy(addr.sun_path, path, strlen(path) + 1);
  return addr;
}

/* Start gpumemd as uid on socket and wait for its READY=1; its pid. */
static pid_t start_ready_as(uid_t uid, const char *sock, const char *log) {
  char path[128], note[256];
  /* Another uid must reach the notify socket: root's 0755 is still safe. */
  ck_assert_int_eq(chmod(dir, 0755), 0);
  in_dir(path, sizeof path, "notify");
  struct sockaddr_un addr = unix_addr(path);
  int nfd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(nfd, 0);
  ck_assert_int_eq(bind(nfd, (struct sockaddr *)&addr, sizeof addr), 0);
  ck_assert_int_eq(chmod(path, 0666), 0);
  pid_t pid = spawn_as(uid, sock, log, path);
  for (;;) {
    struct pollfd p = {.fd = nfd, .events = POLLIN};
    ck_assert_msg(poll(&p, 1, 10000) == 1, "no READY=1; log: %s", slurp(log));
    ssize_t n = recv(nfd, note, sizeof note - 1, 0);
    ck_assert_int_gt(n, 0);
    note[n] = '\0';
    if (strncmp(note, "READY=1", 7) == 0) break;
  }
  close(nfd);
  unlink(path);
  return pid;
}

/* --- gpumemd: the directory of the socket --- */

/* A directory every user (or the group) may write: another user could
 * put a socket of their own there. /tmp itself is refused although it is
 * sticky; a stale socket in such a directory is left alone. */
START_TEST(a_socket_directory_others_can_write_is_refused) {
  make_dir();
  char d1[128], d2[128], sock[256];
  sub_dir(d1, sizeof d1, "world", 0777, (uid_t)-1);
  refused_in((uid_t)-1, d1, "is not safe: it is writable by every user (mode 0777)");
  sub_dir(d2, sizeof d2, "group", 0770, (uid_t)-1);
  refused_in((uid_t)-1, d2, "is not safe: it is writable by its group (mode 0770)");
  /* A stale socket there is neither replaced nor removed. */
  snprintf(sock, sizeof sock, "%s/sock", d1);
  struct sockaddr_un addr = unix_addr(sock);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ck_assert_int_eq(bind(fd, (struct sockaddr *)&addr, sizeof addr), 0);
  close(fd);
  struct stat before, after;
  ck_assert_int_eq(lstat(sock, &before), 0);
  char log[128];
  pid_t pid = spawn_as((uid_t)-1, sock, in_dir(log, sizeof log, "stale.log"), NULL);
  ck_assert_int_eq(wait_refusal(pid), 1);
  ck_assert_ptr_nonnull(strstr(slurp(log), "writable by every user"));
  ck_assert_int_eq(lstat(sock, &after), 0);
  ck_assert_uint_eq(before.st_ino, after.st_ino);
  /* A socket right in /tmp (root's, sticky, writable by all). */
  struct stat tmp;
  if (stat("/tmp", &tmp) == 0 && tmp.st_uid == 0 && (tmp.st_mode & 07777) == 01777) {
    snprintf(sock, sizeof sock, "/tmp/gpumemd-sock-test.%d.sock", (int)getpid());
    refused((uid_t)-1, sock, "socket directory /tmp is not safe: it is writable by every user "
                             "(mode 1777)");
  } else {
    printf("a_socket_directory_others_can_write_is_refused: /tmp is not root's 1777: that "
           "part skipped\n");
  }
  remove_dir();
}
END_TEST

/* A directory owned by another user, or one on the way to it: its owner
 * could rename it and put their own in its place. */
START_TEST(a_socket_directory_another_user_owns_is_refused) {
  if (!can_switch_users("a_socket_directory_another_user_owns_is_refused")) return;
  make_dir();
  char d1[128], d2[128], d3[256], sock[512];
  sub_dir(d1, sizeof d1, "theirs", 0700, NOBODY);
  refused_in((uid_t)-1, d1, "is not safe: it is owned by uid 65534, not root:");
  /* Ours, 0700, but inside a directory of theirs. */
  sub_dir(d2, sizeof d2, "above", 0755, NOBODY);
  snprintf(d3, sizeof d3, "%s/ours", d2);
  ck_assert_int_eq(mkdir(d3, 0700), 0);
  refused_in((uid_t)-1, d3, "socket directory %s is not safe: %s, above it, is owned by uid 65534",
             d3, d2);
  /* A daemon running as nobody may not use root's private directory
   * either (it could not bind there): but one of nobody's is its own. */
  snprintf(sock, sizeof sock, "%s/sock", d1);
  char log[128];
  pid_t pid = start_ready_as(NOBODY, sock, in_dir(log, sizeof log, "nobody.log"));
  struct stat st;
  ck_assert_int_eq(lstat(sock, &st), 0);
  ck_assert_uint_eq(st.st_uid, NOBODY);
  kill(pid, SIGTERM);
  ck_assert_int_eq(wait_exit(pid), 0);
  remove_dir();
}
END_TEST

/* Links are followed as the kernel would: the directory they lead to is
 * judged, and so is every directory a name on the way is looked up in
 * (a link in a directory others may write can be pointed elsewhere). */
START_TEST(links_to_or_through_unsafe_directories_are_refused) {
  make_dir();
  char world[128], ok[128], link[256];
  sub_dir(world, sizeof world, "world", 0777, (uid_t)-1);
  sub_dir(ok, sizeof ok, "ok", 0700, (uid_t)-1);
  in_dir(link, sizeof link, "to-world");
  ck_assert_int_eq(symlink("world", link), 0);
  refused_in((uid_t)-1, link, "socket directory %s is not safe: it (%s) is writable by every user",
             link, world);
  /* A link to a safe directory, kept in one others may write. */
  snprintf(link, sizeof link, "%s/to-ok", world);
  ck_assert_int_eq(symlink(ok, link), 0);
  refused_in((uid_t)-1, link, "%s, above it, is writable by every user (mode 0777)", world);
  /* A relative path is judged through the working directory. */
  char here[PATH_MAX];
  ck_assert_ptr_nonnull(getcwd(here, sizeof here));
  ck_assert_int_eq(chdir(world), 0);
  char log[128];
  pid_t pid = spawn_as((uid_t)-1, "sock", in_dir(log, sizeof log, "rel.log"), NULL);
  ck_assert_int_eq(chdir(here), 0);
  ck_assert_int_eq(wait_refusal(pid), 1);
  ck_assert_msg(strstr(slurp(log), "socket directory . is not safe: it ("), "%s", slurp(log));
  remove_dir();
}
END_TEST

/* --- gpumemctl: who answers --- */

/* Run gpumemctl with shell-quoted args (and an environment prefix); its
 * exit status, stdout in out and stderr in err (static buffers). */
static int ctl(const char *env, const char *args, const char **out, const char **err) {
  static char obuf[16384], ebuf[16384];
  char cmd[1024], o[128], e[128];
  in_dir(o, sizeof o, "ctl.out");
  in_dir(e, sizeof e, "ctl.err");
  snprintf(cmd, sizeof cmd, "%s %s %s >%s 2>%s", env, harness_bin("gpumemctl"), args, o, e);
  int status = system(cmd);
  snprintf(obuf, sizeof obuf, "%s", slurp(o));
  snprintf(ebuf, sizeof ebuf, "%s", slurp(e));
  *out = obuf;
  *err = ebuf;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* A real gpumemd run by nobody, in nobody's directory, is not root's: a
 * root gpumemctl refuses it unless told to trust nobody, by flag or by
 * GPUMEM_SOCKET_OWNER; once the socket file is root's, who answers is
 * still nobody, and still refused. */
START_TEST(gpumemctl_trusts_only_the_daemon_it_expects) {
  if (!can_switch_users("gpumemctl_trusts_only_the_daemon_it_expects")) return;
  make_dir();
  char theirs[128], sock[256], log[128], args[512];
  sub_dir(theirs, sizeof theirs, "theirs", 0755, NOBODY);
  snprintf(sock, sizeof sock, "%s/sock", theirs);
  pid_t pid = start_ready_as(NOBODY, sock, in_dir(log, sizeof log, "daemon.log"));
  const char *out, *err;
  char want[1024];
  snprintf(args, sizeof args, "--socket %s status", sock);
  ck_assert_int_eq(ctl("", args, &out, &err), 1);
  snprintf(want, sizeof want, "gpumemctl: the socket %s is owned by uid 65534 (nobody), "
           "expected root: refusing to trust it", sock);
  ck_assert_msg(strstr(err, want), "%s", err);
  ck_assert_str_eq(out, "");
  snprintf(args, sizeof args, "--socket %s --json pause --all", sock);
  ck_assert_int_eq(ctl("", args, &out, &err), 1);
  ck_assert_msg(strstr(out, "{\"error\":{\"code\":\"UNTRUSTED\",\"message\":\"the socket "), "%s",
                out);
  snprintf(args, sizeof args, "--socket %s --socket-owner nobody status", sock);
  ck_assert_msg(ctl("", args, &out, &err) == 0, "%s", err);
  ck_assert_msg(strstr(out, "backend host"), "%s", out);
  snprintf(args, sizeof args, "--socket %s --json status", sock);
  ck_assert_msg(ctl("GPUMEM_SOCKET_OWNER=65534", args, &out, &err) == 0, "%s", err);
  /* The file made root's: the peer's credentials still say nobody. */
  ck_assert_int_eq(chown(sock, 0, 0), 0);
  snprintf(args, sizeof args, "--socket %s pause --all", sock);
  ck_assert_int_eq(ctl("", args, &out, &err), 1);
  snprintf(want, sizeof want, "gpumemctl: gpumemd at %s answers as uid 65534 (nobody), "
           "expected root: refusing to trust it", sock);
  ck_assert_msg(strstr(err, want), "%s", err);
  ck_assert_msg(!strstr(out, "paused"), "%s", out);
  snprintf(args, sizeof args, "--socket %s --version", sock);
  ck_assert_int_eq(ctl("", args, &out, &err), 0);
  ck_assert_msg(strstr(out, "gpumemd: not trusted: gpumemd at "), "%s", out);
  snprintf(args, sizeof args, "--socket %s --socket-owner no-such-user-gpumem status", sock);
  ck_assert_int_eq(ctl("", args, &out, &err), 2);
  ck_assert_msg(strstr(err, "invalid --socket-owner 'no-such-user-gpumem'"), "%s", err);
  kill(pid, SIGTERM);
  ck_assert_int_eq(wait_exit(pid), 0);
  remove_dir();
}
END_TEST

int main(void) {
  return HARNESS_RUN("socket", 60, setup, teardown,
                     a_socket_directory_others_can_write_is_refused,
                     a_socket_directory_another_user_owns_is_refused,
                     links_to_or_through_unsafe_directories_are_refused,
                     gpumemctl_trusts_only_the_daemon_it_expects);
}
