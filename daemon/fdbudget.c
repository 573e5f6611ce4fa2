#include "fdbudget.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Raise the soft limit to the hard one: many sessions each hold fds. */
uint64_t fdbudget_raise(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  return fdbudget_limit();
}

/* The soft limit, read each time: an operator may change it (prlimit). */
uint64_t fdbudget_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) < 0) return 0;
  return rl.rlim_cur == RLIM_INFINITY ? UINT64_MAX : (uint64_t)rl.rlim_cur;
}

/* Count the entries of /proc/self/fd with getdents64, which needs no fd
 * beyond the directory's own (opendir's buffer would be a malloc each time,
 * and at the limit even the directory may not open: then 0). */
uint64_t fdbudget_open(void) {
  int dir = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return 0;
  _Alignas(8) char buf[32768];
  uint64_t n = 0;
  for (;;) {
    long got = syscall(SYS_getdents64, dir, buf, sizeof buf);
    if (got <= 0) break;
    for (long off = 0; off < got;) {
      const struct dirent64 *de = (const struct dirent64 *)(buf + off);
      if (de->d_name[0] != '.') n++;
      off += de->d_reclen;
    }
  }
  close(dir);
  return n ? n - 1 : 0; /* the directory's own fd */
}
