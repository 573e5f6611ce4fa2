#include "safedir.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Symbolic links followed on the way, as many as the kernel follows
 * (MAXSYMLINKS). */
#define SAFEDIR_MAX_LINKS 40

/* What a judged directory is, for the messages. */
struct judged {
  const char *what;  /* "socket directory" */
  const char *dir;   /* as given */
  const char *keeps; /* "the socket" */
};

/* Whether a directory on the way can be trusted: whoever owns a directory
 * or may write it can rename what is in it, so only root and this
 * daemon's uid may own it, and the directory reached (last) must be
 * writable by no one else. A directory above it may be writable by others
 * when it is sticky (others may then add names, not move ours). 0, or
 * -EPERM with err naming the directory and why. */
static int judge_dir(const struct judged *j, const char *at, const struct stat *st, bool last,
                     char *err, size_t errlen) {
  const char *fix = "give gpumemd a directory that only root and its own user can change, "
                    "such as /run/gpumemd";
  char who[PATH_MAX + 32];
  if (last && strcmp(at, j->dir) == 0) snprintf(who, sizeof who, "it");
  else if (last) snprintf(who, sizeof who, "it (%s)", at);
  else snprintf(who, sizeof who, "%s, above it,", at);
  uid_t me = geteuid();
  char us[48] = "root";
  if (me != 0) snprintf(us, sizeof us, "root or this daemon's uid %u", (unsigned)me);
  if (st->st_uid != 0 && st->st_uid != me) {
    snprintf(err, errlen, "%s %s is not safe: %s is owned by uid %u, not %s: that user could "
             "replace %s; %s",
             j->what, j->dir, who, (unsigned)st->st_uid, us, j->keeps, fix);
    return -EPERM;
  }
  bool others = (st->st_mode & (S_IWGRP | S_IWOTH)) != 0;
  if (others && (last || !(st->st_mode & S_ISVTX))) {
    snprintf(err, errlen, "%s %s is not safe: %s is writable by %s (mode %04o): another user "
             "could replace %s; %s",
             j->what, j->dir, who, st->st_mode & S_IWOTH ? "every user" : "its group",
             (unsigned)(st->st_mode & 07777), j->keeps, fix);
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

/* Fill err with what failed and return the negative errno. */
static int dir_err(int e, char *err, size_t errlen, const char *what, const char *path) {
  snprintf(err, errlen, "%s %s: %s", what, path, strerror(e));
  return -e;
}

/* Open and judge a directory, name by name from / (safedir.h). A relative
 * path is judged from the root, through the working directory. */
int safedir_open(const char *what, const char *dir, const char *keeps, char *err,
                 size_t errlen) {
  const struct judged j = {what, dir, keeps};
  char rest[PATH_MAX], shown[PATH_MAX] = "/";
  char cwd[PATH_MAX] = "";
  if (dir[0] != '/' && !getcwd(cwd, sizeof cwd)) {
    int e = errno;
    snprintf(err, errlen, "working directory of %s %s: %s", what, dir, strerror(e));
    return -e;
  }
  if (snprintf(rest, sizeof rest, "%s/%s", cwd, dir) >= (int)sizeof rest)
    return dir_err(ENAMETOOLONG, err, errlen, what, dir);
  int fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return dir_err(errno, err, errlen, "opening / on the way to", dir);
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
      rc = dir_err(errno, err, errlen, what, dir);
      break;
    }
    if ((rc = judge_dir(&j, shown, &st, false, err, errlen)) < 0) break;
    if (fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
      rc = -errno;
      snprintf(err, errlen, "%s %s: %s/%s: %s", what, dir, strcmp(shown, "/") ? shown : "",
               name, strerror(-rc));
      break;
    }
    if (S_ISLNK(st.st_mode)) {
      char target[PATH_MAX], next[PATH_MAX];
      ssize_t n = readlinkat(fd, name, target, sizeof target - 1);
      if (n < 0 || ++links > SAFEDIR_MAX_LINKS) {
        rc = n < 0 ? -errno : -ELOOP;
        snprintf(err, errlen, "%s %s: %s: %s", what, dir, name, strerror(-rc));
        break;
      }
      target[n] = '\0';
      if (snprintf(next, sizeof next, "%s/%s", target, p) >= (int)sizeof next) {
        rc = -ENAMETOOLONG;
        snprintf(err, errlen, "%s %s: %s", what, dir, strerror(-rc));
        break;
      }
      snprintf(rest, sizeof rest, "%s", next);
      p = rest;
      if (target[0] == '/') {
        close(fd);
        fd = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0) return dir_err(errno, err, errlen, "opening / on the way to", dir);
        snprintf(shown, sizeof shown, "/");
      }
      continue;
    }
    if (!S_ISDIR(st.st_mode)) {
      rc = -ENOTDIR;
      snprintf(err, errlen, "%s %s: %s is not a directory", what, dir, name);
      break;
    }
    int next = openat(fd, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (next < 0) {
      rc = -errno;
      snprintf(err, errlen, "%s %s: %s: %s", what, dir, name, strerror(-rc));
      break;
    }
    close(fd);
    fd = next;
    if (strcmp(name, "..") == 0) shown_pop(shown);
    else shown_push(shown, sizeof shown, name);
  }
  if (rc == 0 && fstat(fd, &st) < 0) rc = dir_err(errno, err, errlen, what, dir);
  if (rc == 0) rc = judge_dir(&j, shown, &st, true, err, errlen);
  if (rc < 0) {
    close(fd);
    return rc;
  }
  return fd;
}

/* Judge an open directory again (safedir.h). */
int safedir_recheck(int fd, const char *what, const char *dir, const char *keeps, char *err,
                    size_t errlen) {
  const struct judged j = {what, dir, keeps};
  struct stat st;
  if (fstat(fd, &st) < 0) return dir_err(errno, err, errlen, what, dir);
  return judge_dir(&j, dir, &st, true, err, errlen);
}
