#include "peer.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux 6.5; glibc's headers may not have it yet (the value is the same
 * on every architecture but alpha, mips, parisc and sparc, which define
 * their own in the headers that have it). */
#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

/* Read a small /proc file of pid into buf (NUL-terminated); false if the
 * process is gone or the file cannot be read. */
static bool read_proc(pid_t pid, const char *what, char *buf, size_t len) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, what);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n = read(fd, buf, len - 1);
  close(fd);
  if (n <= 0) return false;
  buf[n] = '\0';
  return true;
}

/* A process's start time in clock ticks since boot (field 22 of its stat,
 * counted after the command's closing parenthesis); 0 if unknown. */
static unsigned long long start_time(pid_t pid) {
  char buf[1024];
  if (!read_proc(pid, "stat", buf, sizeof buf)) return 0;
  char *p = strrchr(buf, ')');
  for (int field = 2; p && field < 22; field++) p = strchr(p + 1, ' ');
  return p ? strtoull(p + 1, NULL, 10) : 0;
}

/* A process's effective uid (the one SO_PEERCRED reports); -1 if unknown. */
static long long effective_uid(pid_t pid) {
  char buf[2048];
  if (!read_proc(pid, "status", buf, sizeof buf)) return -1;
  const char *p = strstr(buf, "\nUid:");
  unsigned long long real, eff;
  if (!p || sscanf(p + 5, "%llu %llu", &real, &eff) != 2) return -1;
  return (long long)eff;
}

/* True while the process behind a pidfd runs (a pidfd polls readable
 * once its process has exited). */
static bool alive(int pidfd) {
  struct pollfd p = {.fd = pidfd, .events = POLLIN};
  return poll(&p, 1, 0) == 0;
}

/* Pin cred->pid by pidfd_open, checked against the credentials. */
int peer_pin_pid(const struct ucred *cred) {
  if (cred->pid <= 0) return -ESRCH;
  unsigned long long before = start_time(cred->pid);
  int pidfd = (int)syscall(SYS_pidfd_open, cred->pid, 0);
  if (pidfd < 0) return -errno;
  unsigned long long after = start_time(cred->pid);
  long long euid = effective_uid(cred->pid);
  int rc = 0;
  /* The /proc figures were read while the pidfd's process held the pid.
   * Without SO_PEERPIDFD a pid that its peer left and a process of the
   * same uid took between connect and here cannot be told apart; the
   * uid and a start time that did not move narrow it to that. */
  if (!before || before != after || !alive(pidfd))
    rc = -ESRCH;
  else if (euid != (long long)cred->uid)
    rc = -EPERM; /* not the process that connected: its pid was reused */
  if (rc < 0) {
    close(pidfd);
    return rc;
  }
  return pidfd;
}

/* Pin the peer of a connected Unix socket. */
int peer_pin(int sock, const struct ucred *cred) {
  if (cred->pid <= 0) return -ESRCH; /* not in our pid namespace */
  int pidfd = -1;
  socklen_t len = sizeof pidfd;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) == 0 && pidfd >= 0)
    return pidfd;
  if (errno != ENOPROTOOPT && errno != EINVAL) return -errno;
  return peer_pin_pid(cred);
}

/* Send sig to a pinned process. */
int peer_signal(int pidfd, int sig) {
  if (pidfd < 0) return -EBADF;
  return syscall(SYS_pidfd_send_signal, pidfd, sig, NULL, 0) == 0 ? 0 : -errno;
}

/* Let go of a pin. */
void peer_unpin(int pidfd) {
  if (pidfd >= 0) close(pidfd);
}
