/* The one walk over a process's open fds (/proc/PID/fd), for the suites
 * and the fuzzers alike: fd counts, leak checks, fds by target. */
#ifndef GPUMEM_TEST_PROCFD_H
#define GPUMEM_TEST_PROCFD_H

#include <sys/types.h>

/* What proc_fd_each calls for each fd: its number, the target its
 * /proc link names ("socket:[123]", "/memfd:gpumem-host-0 (deleted)", ...;
 * "" if it could not be read) and the walk's arg. */
typedef void proc_fd_visitor(int fd, const char *target, void *arg);

/* Walk the open fds of process pid (getpid() for this one: the fd the
 * walk itself reads the directory with is left out), calling visit (NULL:
 * none) for each in /proc's order; returns how many, -1 if /proc/PID/fd
 * could not be read. */
int proc_fd_each(pid_t pid, proc_fd_visitor *visit, void *arg);

#endif
