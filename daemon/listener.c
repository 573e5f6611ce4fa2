#include "listener.h"

#include "safedir.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define LISTEN_BACKLOG 128

/* The directory part of a socket path into dir ("." when there is none). */
static void dir_of(const char *path, char *dir, size_t len) {
  snprintf(dir, len, "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash) snprintf(dir, len, ".");
  else if (slash == dir) slash[1] = '\0';
  else *slash = '\0';
}

/* Fill err with what failed and return the negative errno. */
static int listen_err(int e, char *err, size_t errlen, const char *what, const char *path) {
  snprintf(err, errlen, "%s %s: %s", what, path, strerror(e));
  return -e;
}

/* 0 when the socket's directory exists, else -errno with err filled: the
 * daemon makes no directory (systemd's RuntimeDirectory= does). */
static int check_parent(const char *path, char *err, size_t errlen) {
  char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
  dir_of(path, dir, sizeof dir);
  struct stat st;
  if (stat(dir, &st) < 0) {
    int e = errno;
    snprintf(err, errlen, "socket directory %s: %s (create it first; under systemd "
             "RuntimeDirectory= makes it)", dir, strerror(e));
    return -e;
  }
  if (!S_ISDIR(st.st_mode)) {
    snprintf(err, errlen, "socket directory %s is not a directory", dir);
    return -ENOTDIR;
  }
  return 0;
}

/* Bind and listen on path, after making sure nobody else serves it and
 * nobody else can replace it. */
int listener_open(const char *path, mode_t mode, gid_t gid, char *err, size_t errlen) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof addr.sun_path) {
    snprintf(err, errlen, "socket path too long: %s", path);
    return -ENAMETOOLONG;
  }
  strcpy(addr.sun_path, path);
  int prc = check_parent(path, err, errlen);
  if (prc == 0) {
    char dir[sizeof addr.sun_path];
    dir_of(path, dir, sizeof dir);
    prc = safedir_open("socket directory", dir, "the socket", err, errlen);
    if (prc >= 0) close(prc);
  }
  if (prc < 0) return prc;
  struct stat st;
  if (lstat(path, &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      snprintf(err, errlen, "%s exists and is not a socket", path);
      return -EEXIST;
    }
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (probe < 0) return listen_err(errno, err, errlen, "socket for", path);
    int rc = connect(probe, (struct sockaddr *)&addr, sizeof addr);
    int e = errno;
    close(probe);
    if (rc == 0) {
      snprintf(err, errlen, "another gpumemd is answering on %s", path);
      return -EADDRINUSE;
    }
    if (e != ECONNREFUSED) return listen_err(e, err, errlen, "probing", path);
    if (unlink(path) < 0) return listen_err(errno, err, errlen, "removing stale", path);
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return listen_err(errno, err, errlen, "socket for", path);
  mode_t old = umask(0117);
  int rc = bind(fd, (struct sockaddr *)&addr, sizeof addr);
  int e = errno;
  umask(old);
  if (rc < 0 || listen(fd, LISTEN_BACKLOG) < 0) {
    if (rc == 0) e = errno;
    close(fd);
    if (rc == 0) unlink(path);
    return listen_err(e, err, errlen, "binding", path);
  }
  const char *what = NULL;
  if (gid != (gid_t)-1 && chown(path, (uid_t)-1, gid) < 0) what = "chown of";
  else if (chmod(path, mode) < 0) what = "chmod of";
  if (what) {
    e = errno;
    close(fd);
    unlink(path);
    return listen_err(e, err, errlen, what, path);
  }
  return fd;
}
