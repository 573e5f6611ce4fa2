/* systemd's protocols driven for real without systemd as PID 1: a socket
 * passed as LISTEN_FDS/LISTEN_PID, notifications read from NOTIFY_SOCKET,
 * and the socket's group and mode for a daemon that binds it itself. */
#include <errno.h>
#include <fcntl.h>
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

#include "gpumem.h"
#include "harness.h"

#ifndef HAVE_SYSTEMD
/* The activation and notify tests are not run without libsystemd. */
#pragma GCC diagnostic ignored "-Wunused-variable"
#endif

/* How the child sets up systemd's environment before exec. */
enum listen_pid { PID_NONE, PID_OURS, PID_OTHER };

/* One test's directory and socket (pid unused: each test waits for its own). */
static struct daemon d;

/* Make a unique directory with its socket and log paths. */
static void make_dir(void) {
  memset(&d, 0, sizeof d);
  snprintf(d.dir, sizeof d.dir, "/tmp/gpumemd-sd.XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(d.dir));
  snprintf(d.socket, sizeof d.socket, "%s/sock", d.dir);
  snprintf(d.log, sizeof d.log, "%s/daemon.log", d.dir);
}

/* Bind a Unix socket of a type at path (listening when a stream). */
static int unix_socket(int type, const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  ck_assert_uint_lt(strlen(path), sizeof addr.sun_path);
  memcpy(addr.sun_path, path, strlen(path) + 1);
  int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(bind(fd, (struct sockaddr *)&addr, sizeof addr), 0);
  if (type == SOCK_STREAM) ck_assert_int_eq(listen(fd, 16), 0);
  return fd;
}

/* Fork and exec gpumemd as systemd would: fd 3 when listen_fd >= 0,
 * LISTEN_FDS=nfds and LISTEN_PID per how, NOTIFY_SOCKET when notify. */
static pid_t spawn_sd(int listen_fd, const char *nfds, enum listen_pid how, const char *notify,
                      const char *const *extra) {
  const char *argv[24] = {harness_bin("gpumemd"), "--socket", d.socket, "--backend", "host",
                          "--host-devices", "1"};
  int n = 7;
  for (; extra && *extra && n < 23; extra++) argv[n++] = *extra;
  argv[n] = NULL;
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid > 0) return pid;
  int log = open(d.log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (log < 0 || dup2(log, 1) < 0 || dup2(log, 2) < 0) _exit(126);
  if (listen_fd >= 0 && (listen_fd == 3 ? fcntl(3, F_SETFD, 0) : dup2(listen_fd, 3)) < 0)
    _exit(126);
  char buf[32];
  if (nfds) setenv("LISTEN_FDS", nfds, 1);
  if (how != PID_NONE) {
    snprintf(buf, sizeof buf, "%d", (int)(how == PID_OURS ? getpid() : getppid()));
    setenv("LISTEN_PID", buf, 1);
  }
  if (notify) setenv("NOTIFY_SOCKET", notify, 1);
  else unsetenv("NOTIFY_SOCKET");
  execv(argv[0], (char *const *)argv);
  _exit(127);
}

/* Wait for a daemon's exit status (-1 when killed). */
static int wait_exit(pid_t pid) {
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The daemon's whole log. */
static const char *log_text(void) {
  static char buf[8192];
  buf[0] = '\0';
  FILE *f = fopen(d.log, "r");
  if (!f) return buf;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = '\0';
  fclose(f);
  return buf;
}

/* Receive one notification datagram within 10 s. */
static void recv_note(int fd, char *buf, size_t len) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  ck_assert_msg(poll(&p, 1, 10000) == 1, "no notification; log: %s", log_text());
  ssize_t n = recv(fd, buf, len - 1, 0);
  ck_assert_int_gt(n, 0);
  buf[n] = '\0';
}

/* Say hello as a controller and check the host backend answers. */
static void hello_works(void) {
  struct peer p;
  peer_connect(&p, &d);
  wire_env *r = peer_hello(&p, GPUMEM__WIRE__ROLE__ROLE_CONTROLLER);
  ck_assert_ptr_nonnull(r->hello_reply);
  ck_assert_str_eq(r->hello_reply->backend, "host");
  wire_env_free(r);
  peer_close(&p);
}

/* Remove the test's directory. */
static void remove_dir(void) {
  char cmd[160];
  snprintf(cmd, sizeof cmd, "rm -rf %s", d.dir);
  ck_assert_int_eq(system(cmd), 0);
}

START_TEST(passed_socket_is_served_and_left_to_systemd) {
  make_dir();
  int lfd = unix_socket(SOCK_STREAM, d.socket);
  struct stat before, after;
  ck_assert_int_eq(stat(d.socket, &before), 0);
  /* The daemon binds nothing: its --socket names a path that is not used. */
  char unused[128];
  snprintf(unused, sizeof unused, "%s/unused", d.dir);
  const char *const extra[] = {"--socket", unused, NULL};
  pid_t pid = spawn_sd(lfd, "1", PID_OURS, NULL, extra);
  close(lfd);
  hello_works(); /* the backlog holds the connection until the daemon serves */
  kill(pid, SIGTERM);
  ck_assert_int_eq(wait_exit(pid), 0);
  ck_assert_int_eq(stat(d.socket, &after), 0);
  ck_assert_uint_eq(before.st_ino, after.st_ino);
  ck_assert_int_ne(access(unused, F_OK), 0);
  ck_assert_ptr_nonnull(strstr(log_text(), d.socket));
  remove_dir();
}
END_TEST

/* The socket's directory is judged only where the daemon binds: one that
 * systemd made and passed is systemd's business, wherever it lies, while
 * the same directory is refused to a daemon binding there itself. */
START_TEST(passed_socket_is_not_judged_by_its_directory) {
  make_dir();
  ck_assert_int_eq(chmod(d.dir, 0777), 0);
  int lfd = unix_socket(SOCK_STREAM, d.socket);
  const char *const extra[] = {"--socket", d.socket, NULL};
  pid_t pid = spawn_sd(lfd, "1", PID_OURS, NULL, extra);
  close(lfd);
  hello_works();
  kill(pid, SIGTERM);
  ck_assert_int_eq(wait_exit(pid), 0);
  ck_assert_int_eq(unlink(d.socket), 0);
  pid = spawn_sd(-1, NULL, PID_NONE, NULL, NULL);
  ck_assert_int_eq(wait_exit(pid), 1);
  ck_assert_msg(strstr(log_text(), "is writable by every user (mode 0777)"), "%s", log_text());
  ck_assert_int_ne(access(d.socket, F_OK), 0);
  remove_dir();
}
END_TEST

START_TEST(notifies_ready_status_and_stopping) {
  make_dir();
  char path[128], note[512], want[256];
  snprintf(path, sizeof path, "%s/notify", d.dir);
  int nfd = unix_socket(SOCK_DGRAM, path);
  pid_t pid = spawn_sd(-1, NULL, PID_NONE, path, NULL);
  recv_note(nfd, note, sizeof note);
  ck_assert_str_eq(note, "STATUS=starting");
  recv_note(nfd, note, sizeof note);
  snprintf(want, sizeof want, "READY=1\nSTATUS=serving 1 host device on %s", d.socket);
  ck_assert_str_eq(note, want);
  hello_works(); /* READY=1 came after the socket listened */
  kill(pid, SIGTERM);
  recv_note(nfd, note, sizeof note);
  ck_assert_str_eq(note, "STOPPING=1");
  ck_assert_int_eq(wait_exit(pid), 0);
  close(nfd);
  remove_dir();
}
END_TEST

/* Run the daemon with a bad systemd environment; it must fail with words
 * and create no socket. */
static void fails_cleanly(int lfd, const char *nfds, enum listen_pid how, const char *notify,
                          const char *words) {
  pid_t pid = spawn_sd(lfd, nfds, how, notify, NULL);
  ck_assert_int_ne(wait_exit(pid), 0);
  ck_assert_msg(strstr(log_text(), words), "no '%s' in: %s", words, log_text());
  ck_assert_int_ne(access(d.socket, F_OK), 0);
}

START_TEST(bad_systemd_environment_fails_clearly) {
  make_dir();
  char path[128];
  snprintf(path, sizeof path, "%s/passed", d.dir);
  int lfd = unix_socket(SOCK_STREAM, path);
  fails_cleanly(lfd, "1", PID_OTHER, NULL, "LISTEN_PID=");
  fails_cleanly(lfd, "2", PID_OURS, NULL, "LISTEN_FDS=2, but fd 4 is not open");
  fails_cleanly(lfd, "1", PID_NONE, NULL, "LISTEN_PID=(unset)");
  close(lfd);
  snprintf(path, sizeof path, "%s/dgram", d.dir);
  int dfd = unix_socket(SOCK_DGRAM, path);
  fails_cleanly(dfd, "1", PID_OURS, NULL, "not a listening AF_UNIX stream socket");
  close(dfd);
  snprintf(path, sizeof path, "%s/no-such-notify", d.dir);
  fails_cleanly(-1, NULL, PID_NONE, path, "NOTIFY_SOCKET=");
  ck_assert_ptr_nonnull(strstr(log_text(), "No such file or directory"));
  remove_dir();
}
END_TEST

/* Start a daemon that binds its socket with extra flags and wait for its
 * READY=1; returns its pid. */
static pid_t start_ready(const char *const *extra) {
  char path[128], note[512];
  snprintf(path, sizeof path, "%s/notify", d.dir);
  int nfd = unix_socket(SOCK_DGRAM, path);
  pid_t pid = spawn_sd(-1, NULL, PID_NONE, path, extra);
  recv_note(nfd, note, sizeof note);
  recv_note(nfd, note, sizeof note);
  ck_assert_msg(strncmp(note, "READY=1", 7) == 0, "got %s", note);
  close(nfd);
  unlink(path);
  return pid;
}

START_TEST(socket_group_and_mode_apply) {
  make_dir();
  char gid[16];
  snprintf(gid, sizeof gid, "%u", (unsigned)getgid());
  const char *const extra[] = {"--socket-group", gid, "--socket-mode", "0600", NULL};
  pid_t pid = start_ready(extra);
  struct stat st;
  ck_assert_int_eq(stat(d.socket, &st), 0);
  ck_assert_uint_eq(st.st_mode & 07777, 0600);
  ck_assert_uint_eq(st.st_gid, getgid());
  hello_works();
  kill(pid, SIGTERM);
  ck_assert_int_eq(wait_exit(pid), 0);
  ck_assert_int_ne(access(d.socket, F_OK), 0);
  /* the default is 0660 */
  pid = start_ready(NULL);
  ck_assert_int_eq(stat(d.socket, &st), 0);
  ck_assert_uint_eq(st.st_mode & 07777, 0660);
  kill(pid, SIGTERM);
  ck_assert_int_eq(wait_exit(pid), 0);
  remove_dir();
}
END_TEST

START_TEST(unknown_socket_group_or_mode_fails_without_a_socket) {
  make_dir();
  const char *const group[] = {"--socket-group", "no-such-group-gpumemd", NULL};
  pid_t pid = spawn_sd(-1, NULL, PID_NONE, NULL, group);
  ck_assert_int_ne(wait_exit(pid), 0);
  ck_assert_ptr_nonnull(strstr(log_text(), "no group named 'no-such-group-gpumemd'"));
  ck_assert_int_ne(access(d.socket, F_OK), 0);
  const char *const mode[] = {"--socket-mode", "0999", NULL};
  pid = spawn_sd(-1, NULL, PID_NONE, NULL, mode);
  ck_assert_int_ne(wait_exit(pid), 0);
  ck_assert_ptr_nonnull(strstr(log_text(), "--socket-mode"));
  ck_assert_int_ne(access(d.socket, F_OK), 0);
  remove_dir();
}
END_TEST

START_TEST(socket_in_a_missing_directory_fails_and_makes_nothing) {
  make_dir();
  char missing[sizeof d.dir + 16];
  snprintf(missing, sizeof missing, "%s/missing", d.dir);
  snprintf(d.socket, sizeof d.socket, "%s/sock", missing);
  pid_t pid = spawn_sd(-1, NULL, PID_NONE, NULL, NULL);
  ck_assert_int_ne(wait_exit(pid), 0);
  ck_assert_ptr_nonnull(strstr(log_text(), "No such file or directory"));
  ck_assert_ptr_nonnull(strstr(log_text(), missing));
  ck_assert_int_ne(access(missing, F_OK), 0);
  snprintf(d.socket, sizeof d.socket, "%s/sock", d.dir);
  remove_dir();
}
END_TEST

START_TEST(version_names_the_backends) {
  make_dir();
  const char *const extra[] = {"--version", NULL};
  pid_t pid = spawn_sd(-1, NULL, PID_NONE, NULL, extra);
  ck_assert_int_eq(wait_exit(pid), 0);
  char want[64];
  snprintf(want, sizeof want, "gpumemd %d.%d.%d", GPUMEM_VERSION_MAJOR, GPUMEM_VERSION_MINOR,
           GPUMEM_VERSION_PATCH);
  ck_assert_ptr_nonnull(strstr(log_text(), want));
  ck_assert_ptr_nonnull(strstr(log_text(), "backends: host"));
  remove_dir();
}
END_TEST

int main(void) {
#ifdef HAVE_SYSTEMD
  return HARNESS_RUN("systemd", 60, harness_fd_setup, harness_fd_teardown,
                     passed_socket_is_served_and_left_to_systemd,
                     passed_socket_is_not_judged_by_its_directory,
                     notifies_ready_status_and_stopping, bad_systemd_environment_fails_clearly,
                     socket_group_and_mode_apply,
                     unknown_socket_group_or_mode_fails_without_a_socket,
                     socket_in_a_missing_directory_fails_and_makes_nothing,
                     version_names_the_backends);
#else
  printf("check_systemd: built without libsystemd: activation and notify tests skipped\n");
  return HARNESS_RUN("systemd", 60, harness_fd_setup, harness_fd_teardown,
                     unknown_socket_group_or_mode_fails_without_a_socket,
                     socket_in_a_missing_directory_fails_and_makes_nothing,
                     version_names_the_backends);
#endif
}
