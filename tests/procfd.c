/* The one walk over a process's open fds. */
#include "procfd.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* Walk the fds of process pid: visit each with its number and link target. */
int proc_fd_each(pid_t pid, proc_fd_visitor *visit, void *arg) {
  char path[64], link[512];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *dir = opendir(path);
  if (!dir) return -1;
  int n = 0;
  for (struct dirent *de; (de = readdir(dir));) {
    if (de->d_name[0] == '.') continue;
    int fd = atoi(de->d_name);
    if (pid == getpid() && fd == dirfd(dir)) continue; /* our own listing's fd is not ours */
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, fd);
    ssize_t len = readlink(path, link, sizeof link - 1);
    link[len > 0 ? len : 0] = '\0';
    n++;
    if (visit) visit(fd, link, arg);
  }
  closedir(dir);
  return n;
}
