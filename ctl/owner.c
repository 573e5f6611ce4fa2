/* The owner of gpumemd's socket, checked before gpumemctl trusts it. */
#include "ctl/owner.h"

#include <errno.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

/* A user name or a decimal uid into *uid; 0 or -1 when it is neither. */
int owner_parse(const char *s, uid_t *uid) {
  if (!s || !*s) return -1;
  struct passwd *pw = getpwnam(s);
  if (pw) {
    *uid = pw->pw_uid;
    return 0;
  }
  char *end;
  errno = 0;
  unsigned long v = strtoul(s, &end, 10);
  if (errno || *end || s[0] == '-' || v >= (unsigned long)(uid_t)-1) return -1;
  *uid = (uid_t)v;
  return 0;
}

/* "uid 1000 (alice)", or "uid 1000" where the name is unknown, in buf. */
static const char *uid_words(uid_t uid, char *buf, size_t len) {
  struct passwd *pw = getpwuid(uid);
  if (pw && pw->pw_name) snprintf(buf, len, "uid %u (%.64s)", (unsigned)uid, pw->pw_name);
  else snprintf(buf, len, "uid %u", (unsigned)uid);
  return buf;
}

/* Whose daemon is trusted: root's, want's, and this user's own (a socket
 * only this user or root could have placed, a daemon only they could run). */
static bool trusted(uid_t uid, uid_t want) {
  return uid == 0 || uid == want || uid == geteuid();
}

/* What the check expects, in words: "root" or "root or uid 65534 (nobody)"
 * (and this user, where it is neither). */
static const char *want_words(uid_t want, char *buf, size_t len) {
  char who[96], me[96];
  uid_t self = geteuid();
  size_t o = (size_t)snprintf(buf, len, "root");
  if (want != 0 && o < len)
    o += (size_t)snprintf(buf + o, len - o, " or %s", uid_words(want, who, sizeof who));
  if (self != 0 && self != want && o < len)
    snprintf(buf + o, len - o, " or %s", uid_words(self, me, sizeof me));
  return buf;
}

/* 0 when the socket file at path is owned by root or want. */
int owner_check_file(const char *path, uid_t want, char *why, size_t len) {
  struct stat st;
  /* The file a connect reaches (links followed); a missing one is for
   * the connect to report, as before. */
  if (stat(path, &st) < 0 || trusted(st.st_uid, want)) return 0;
  char got[96], exp[128];
  snprintf(why, len, "the socket %s is owned by %s, expected %s: refusing to trust it "
           "(--socket-owner names the daemon's user)",
           path, uid_words(st.st_uid, got, sizeof got), want_words(want, exp, sizeof exp));
  return -1;
}

/* 0 when the listening process on c's connection runs as root or want. */
int owner_check_peer(const gpumem_client *c, const char *path, uid_t want, char *why,
                     size_t len) {
  struct ucred cred;
  socklen_t n = sizeof cred;
  int fd = gpumem_fd(c);
  if (fd < 0 || getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &n) < 0) {
    snprintf(why, len, "gpumemd at %s: cannot tell who answers: %s: refusing to trust it",
             path, fd < 0 ? "no connection" : strerror(errno));
    return -1;
  }
  if (trusted(cred.uid, want)) return 0;
  char got[96], exp[128];
  snprintf(why, len, "gpumemd at %s answers as %s, expected %s: refusing to trust it "
           "(--socket-owner names the daemon's user)",
           path, uid_words(cred.uid, got, sizeof got), want_words(want, exp, sizeof exp));
  return -1;
}

/* Connect, checking the socket file first and the peer after. */
int owner_connect(const char *path, const char *name, uid_t want, bool fallback,
                  gpumem_client **c, char *why, size_t len) {
  const unsigned flags =
      GPUMEM_CONNECT_NO_THREAD | GPUMEM_CONNECT_NO_RECONNECT | GPUMEM_CONNECT_NODE_DEVICES;
  *c = NULL;
  if (owner_check_file(path, want, why, len) < 0) return OWNER_UNTRUSTED;
  int rc = gpumem_connect(path, name, GPUMEM_ROLE_CONTROLLER, flags, c);
  if (rc == GPUMEM_E_PERMISSION && fallback)
    rc = gpumem_connect(path, name, GPUMEM_ROLE_WORKER, flags, c);
  if (rc < 0) return rc;
  if (owner_check_peer(*c, path, want, why, len) < 0) {
    gpumem_disconnect(*c);
    *c = NULL;
    return OWNER_UNTRUSTED;
  }
  return 0;
}
