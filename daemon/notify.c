#include "notify.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#ifdef HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif
#include <unistd.h>

#include "common/log.h"

#ifndef HAVE_SYSTEMD
/* Built without libsystemd: there is no way to notify. */
static int sd_notify(int unset, const char *state) {
  (void)unset;
  (void)state;
  return -ENOSYS;
}
#endif

/* Send one notification; a negative errno from sd_notify becomes err. */
static int send_state(const char *state, char *err, size_t errlen) {
  int rc = sd_notify(0, state);
  if (rc >= 0) return 0;
  snprintf(err, errlen, "cannot notify NOTIFY_SOCKET=%s: %s", getenv("NOTIFY_SOCKET"),
           rc == -ENOSYS ? "this gpumemd was built without libsystemd" : strerror(-rc));
  return -1;
}

/* Probe NOTIFY_SOCKET with a status line before anything is created. */
int notify_check(char *err, size_t errlen) {
  const char *ns = getenv("NOTIFY_SOCKET");
  if (!ns) return 0;
  if (!*ns) {
    snprintf(err, errlen, "NOTIFY_SOCKET is set but empty");
    return -1;
  }
  return send_state("STATUS=starting", err, errlen);
}

/* Tell the service manager the socket listens and what it serves. */
int notify_ready(const char *backend, unsigned devices, const char *path, char *err,
                 size_t errlen) {
  if (!getenv("NOTIFY_SOCKET")) return 0;
  char msg[512];
  snprintf(msg, sizeof msg, "READY=1\nSTATUS=serving %u %s device%s on %s", devices, backend,
           devices == 1 ? "" : "s", path);
  return send_state(msg, err, errlen);
}

/* Tell the service manager that shutdown has begun. */
void notify_stopping(void) {
  char err[256];
  if (getenv("NOTIFY_SOCKET") && send_state("STOPPING=1", err, sizeof err) < 0)
    log_warn("%s", err);
}

/* Parse a decimal environment value; -1 when absent or malformed. */
static long env_number(const char *name) {
  const char *s = getenv(name);
  if (!s || !*s) return -1;
  char *end;
  errno = 0;
  long v = strtol(s, &end, 10);
  return errno || *end || v < 0 ? -1 : v;
}

/* Check and take fd 3 as systemd passes it. */
int activation_take(char *path, size_t pathlen, char *err, size_t errlen) {
  const char *fds = getenv("LISTEN_FDS"), *pid = getenv("LISTEN_PID");
  if (!fds && !pid) return -1;
  if (env_number("LISTEN_PID") != (long)getpid()) {
    snprintf(err, errlen,
             "socket activation: LISTEN_PID=%s is not this process (pid %d); "
             "the sockets were passed to another process",
             pid ? pid : "(unset)", (int)getpid());
    return -2;
  }
  if (env_number("LISTEN_FDS") != 1) {
    snprintf(err, errlen, "socket activation: LISTEN_FDS=%s, expected exactly one socket",
             fds ? fds : "(unset)");
    return -2;
  }
#ifndef HAVE_SYSTEMD
  snprintf(err, errlen, "socket activation: this gpumemd was built without libsystemd");
  return -2;
#else
  int n = sd_listen_fds(1);
  if (n != 1) {
    snprintf(err, errlen, "socket activation: %s", n < 0 ? strerror(-n) : "no socket passed");
    return -2;
  }
  int fd = SD_LISTEN_FDS_START;
  if (sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0) <= 0) {
    snprintf(err, errlen, "socket activation: fd %d is not a listening AF_UNIX stream socket",
             fd);
    return -2;
  }
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) {
    snprintf(err, errlen, "socket activation: fd %d: %s", fd, strerror(errno));
    return -2;
  }
  struct sockaddr_un addr;
  socklen_t len = sizeof addr;
  memset(&addr, 0, sizeof addr);
  if (getsockname(fd, (struct sockaddr *)&addr, &len) == 0 && addr.sun_path[0])
    snprintf(path, pathlen, "%.*s", (int)sizeof addr.sun_path, addr.sun_path);
  return fd;
#endif
}
