/* The daemon's file descriptor budget: the limit it runs under (raised to
 * the hard limit at start) and the fds it holds now. */
#ifndef GPUMEMD_FDBUDGET_H
#define GPUMEMD_FDBUDGET_H

#include <stdint.h>

/* Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit
 * in force afterwards. */
uint64_t fdbudget_raise(void);

/* The soft RLIMIT_NOFILE in force now (the most fds the daemon may hold). */
uint64_t fdbudget_limit(void);

/* How many fds the daemon holds now (0 if /proc cannot say). */
uint64_t fdbudget_open(void);

#endif
