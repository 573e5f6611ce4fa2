#include "listener.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define LISTEN_BACKLOG 128
/* Symbolic links followed on the way to the socket's directory, as many
 * as the kernel follows (MAXSYMLINKS). */
#define LISTEN_MAX_LINKS 40

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

/* Whether a directory on the way to the socket can be trusted: whoever
 * owns a directory or may write it can rename what is in it, so only root
 * and this daemon's uid may own it, and the socket's own directory (last)
 * must be writable by no one else. A directory above it may be writable by
 * others when it is sticky (others may then add names, not move ours).
 * 0, or -EPERM with err naming the directory and why. */
static int judge_dir(const char *dir, const char *at, const struct stat *st, bool last,
                     char *err, size_t errlen) {
  const char *fix = "give gpumemd a directory that only root and its own user can change, "
                    "such as /run/gpumemd";
  char who[PATH_MAX + 32];
  if (last && strcmp(at, dir) == 0) snprintf(who, sizeof who, "it");
  else if (last) snprintf(who, sizeof who, "it (%s)", at);
  else snprintf(who, sizeof who, "%s, above it,", at);
  uid_t me = geteuid();
  char us[48] = "root";
  if (me != 0) snprintf(us, sizeof us, "root or this daemon's uid %u", (unsigned)me);
  if (st->st_uid != 0 && st->st_uid != me) {
    snprintf(err, errlen, "socket directory %s is not safe: %s is owned by uid %u, not %s: "
             "that user could replace the socket; %s",
             dir, who, (unsigned)st->st_uid, us, fix);
    return -EPERM;
  }
  bool others = (st->st_mode & (S_IWGRP | S_IWOTH)) != 0;
  if (others && (last || !(st->st_mode & S_ISVTX))) {
    snprintf(err, errlen, "socket directory %s is not safe: %s is writable by %s (mode %04o): "
             "another user could replace the socket; %s",
             dir, who, st->st_mode & S_IWOTH ? "every user" : "its group",
             (unsigned)(st->st_mode & 07777), fix);
    return -EPERM;
  }
  return 0;
}

/* Append a name to a shown path (cut to fit: it is only shown). */
static void shown_push(char *shown, size_t len, const char *name) {
  size_t n = strlen(shown);
  if (n > 1 && n + 1 < len) shown[n++] = '/';
  size_t k = strlen(name);
  if (k > len - n - 1) k = len - n - 1;
  memcpy(shown + n, name, k);
  shown[n + k] = '\0';
}

/* Drop the last name of a shown path ("/" stays). */
static void shown_pop(char *shown) {
  char *slash = strrchr(shown, '/');
  if (slash == shown) shown[1] = '\0';
  else if (slash) *slash = '\0';
}

/* Resolve the socket's directory from / as the kernel would, one name at a
 * time, following links, and judge every directory a name is looked up in
 * (whoever may change one could send the path elsewhere) and the directory
 * reached. A relative path is judged from the root, through the working
 * directory. 0 or -errno with err filled. */
static int check_dir_safe(const char *path, char *err, size_t errlen) {
  char dir[PATH_MAX], rest[PATH_MAX], shown[PATH_MAX] = "/";
  dir_of(path, dir, sizeof dir);
  char cwd[PATH_MAX] = "";
  if (dir[0] != '/' && !getcwd(cwd, sizeof cwd)) return listen_err(errno, err, errlen,
                                                                     "working directory of", dir);
  if (snprintf(rest, sizeof rest, "%s/%s", cwd, dir) >= (int)sizeof rest)
    return listen_err(ENAMETOOLONG, err, errlen, "socket directory", dir);
  int fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return listen_err(errno, err, errlen, "opening / on the way to", dir);
  int rc = 0, links = 0;
  struct stat st;
  char *p = rest;
  while (rc == 0 && *p) {
    while (*p == '/') p++;
    char *name = p;
    while (*p && *p != '/') p++;
    if (*p) *p++ = '\0';
    if (!*name || strcmp(name, ".") == 0) continue;
    if (fstat(fd, &st) < 0) {
      rc = listen_err(errno, err, errlen, "socket directory", dir);
      break;
    }
    if ((rc = judge_dir(dir, shown, &st, false, err, errlen)) < 0) break;
    if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
      rc = -errno;
      snprintf(err, errlen, "socket directory %s: %s/%s: %s", dir, strcmp(shown, "/") ? shown : "",
               name, strerror(-rc));
      break;
    }
    if (S_ISLNK(st.st_mode)) {
      char target[PATH_MAX], next[PATH_MAX];
      ssize_t n = readlinkat(fd, name, target, sizeof target - 1);
      if (n < 0 || ++links > LISTEN_MAX_LINKS) {
        rc = n < 0 ? -errno : -ELOOP;
        snprintf(err, errlen, "socket directory %s: %s: %s", dir, name, strerror(-rc));
        break;
      }
      target[n] = '\0';
      if (snprintf(next, sizeof next, "%s/%s", target, p) >= (int)sizeof next) {
        rc = -ENAMETOOLONG;
        snprintf(err, errlen, "socket directory %s: %s", dir, strerror(-rc));
        break;
      }
      snprintf(rest, sizeof rest, "%s", next);
      p = rest;
      if (target[0] == '/') {
        close(fd);
        fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0) return listen_err(errno, err, errlen, "opening / on the way to", dir);
        snprintf(shown, sizeof shown, "/");
      }
      continue;
    }
    if (!S_ISDIR(st.st_mode)) {
      rc = -ENOTDIR;
      snprintf(err, errlen, "socket directory %s: %s is not a directory", dir, name);
      break;
    }
    int next = openat(fd, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) {
      rc = -errno;
      snprintf(err, errlen, "socket directory %s: %s: %s", dir, name, strerror(-rc));
      break;
    }
    close(fd);
    fd = next;
    if (strcmp(name, "..") == 0) shown_pop(shown);
    else shown_push(shown, sizeof shown, name);
  }
  if (rc == 0 && fstat(fd, &st) < 0) rc = listen_err(errno, err, errlen, "socket directory", dir);
  if (rc == 0) rc = judge_dir(dir, shown, &st, true, err, errlen);
  close(fd);
  return rc;
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
  if (prc == 0) prc = check_dir_safe(path, err, errlen);
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
