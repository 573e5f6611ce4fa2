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
#include "fdstore.h"

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

/* Check and take what systemd passes: the listening socket, and chunks
 * of its fd store (fdstore.h). */
int activation_take(char *path, size_t pathlen, fdstore *store, char *err, size_t errlen) {
  const char *fds = getenv("LISTEN_FDS"), *pid = getenv("LISTEN_PID");
  if (!fds && !pid) return -1;
  if (env_number("LISTEN_PID") != (long)getpid()) {
    snprintf(err, errlen,
             "socket activation: LISTEN_PID=%s is not this process (pid %d); "
             "the sockets were passed to another process",
             pid ? pid : "(unset)", (int)getpid());
    return -2;
  }
  long nfds = env_number("LISTEN_FDS");
  if (nfds < 1) {
    snprintf(err, errlen, "socket activation: LISTEN_FDS=%s, expected one socket (and the "
             "fd store's chunks)", fds ? fds : "(unset)");
    return -2;
  }
#ifndef HAVE_SYSTEMD
  (void)store;
  snprintf(err, errlen, "socket activation: this gpumemd was built without libsystemd");
  return -2;
#else
  for (long i = 0; i < nfds; i++)
    if (fcntl(SD_LISTEN_FDS_START + (int)i, F_GETFD) < 0) {
      snprintf(err, errlen, "socket activation: LISTEN_FDS=%s, but fd %d is not open", fds,
               SD_LISTEN_FDS_START + (int)i);
      return -2;
    }
  char **names = NULL;
  int n = sd_listen_fds_with_names(1, &names);
  if (n < 1) {
    snprintf(err, errlen, "socket activation: %s", n < 0 ? strerror(-n) : "no socket passed");
    return -2;
  }
  int fd = -1, sockets = 0;
  for (int i = 0; i < n; i++) {
    int at = SD_LISTEN_FDS_START + i;
    if (names && names[i] && fdstore_found(store, names[i], at)) continue;
    sockets++;
    if (fd < 0) fd = at;
    else close(at);
  }
  for (int i = 0; names && i < n; i++) free(names[i]);
  free(names);
  if (sockets > 1) {
    if (fd >= 0) close(fd);
    snprintf(err, errlen, "socket activation: LISTEN_FDS=%s with %d sockets, expected exactly "
             "one (besides the fd store's chunks)", fds, sockets);
    return -2;
  }
  if (fd < 0) return -1; /* the fd store's alone: the daemon makes its socket */
  if (sd_is_socket_unix(fd, SOCK_STREAM, 1, NULL, 0) <= 0) {
    snprintf(err, errlen, "socket activation: fd %d is not a listening AF_UNIX stream socket",
             fd);
    close(fd);
    return -2;
  }
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) {
    snprintf(err, errlen, "socket activation: fd %d: %s", fd, strerror(errno));
    close(fd);
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
