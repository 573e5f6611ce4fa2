/* What the kernel says of one process in /proc/PID/stat: its state
 * letter, its flags and its start time, for the daemon's checks of a
 * process it deals with by pid (stopped, exiting, still the same one). */
#ifndef GPUMEM_COMMON_PROCSTAT_H
#define GPUMEM_COMMON_PROCSTAT_H

struct procstat {
  char state;                    /* 'R', 'S', 'T' (stopped), 'Z' (zombie), ... */
  unsigned long flags;           /* the kernel's task flags (PF_EXITING: 0x4) */
  unsigned long long start_time; /* clock ticks after boot */
};

/* The kernel's task flag of a process on its way out (linux/sched.h). */
#define PROCSTAT_PF_EXITING 0x00000004ul

/* Read pid's line: 0, or -ENOENT when the process is gone or its line
 * cannot be read. */
int procstat_read(int pid, struct procstat *s);

#endif
