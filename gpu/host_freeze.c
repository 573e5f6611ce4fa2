/* The host backend's stand-in for releasing a process's device state (on
 * CUDA the driver's checkpoint calls): the process is stopped with
 * SIGSTOP, as a checkpointed process can make no device call, and goes on
 * with SIGCONT when restored. Like the driver, it refuses a process that
 * still maps or holds device memory (a checkpoint then would release
 * nothing and leave the process hung). The kernel's word (the state in
 * /proc/PID/stat) says whether the process has stopped. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "common/procstat.h"
#include "error.h"
#include "host.h"

/* The state letter of pid ('T' stopped), or 0 when it is gone. */
static char proc_state(int pid) {
  struct procstat st;
  return procstat_read(pid, &st) == 0 ? st.state : 0;
}

/* Milliseconds of the monotonic clock. */
static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

/* Wait, at most ms, until pid is stopped (stopped true) or not; true when
 * it got there. */
static bool wait_state(int pid, bool stopped, uint32_t ms) {
  double end = now_ms() + ms;
  for (;;) {
    char st = proc_state(pid);
    if (!st) return false;
    if ((st == 'T' || st == 't') == stopped) return true;
    if (now_ms() >= end) return false;
    nanosleep(&(struct timespec){.tv_nsec = 200000}, NULL); /* the kernel's, no event for it */
  }
}

/* Stop pid, unless it maps or holds device memory. */
int host_freeze_release(void *state, int pid, uint32_t lock_ms, uint64_t *moved) {
  *moved = 0; /* a host process holds no device state of its own */
  int listed = host_proc_listed(state, pid);
  if (listed < 0) return listed;
  if (listed)
    return gpu_fail(-EBUSY, "pid %d still maps or holds device memory: not released", pid);
  if (kill(pid, SIGSTOP) < 0) return gpu_fail(-errno, "kill(%d, SIGSTOP): %s", pid, strerror(errno));
  if (wait_state(pid, true, lock_ms)) return 0;
  kill(pid, SIGCONT);
  return gpu_fail(-ETIMEDOUT, "pid %d did not stop within %u ms: not released", pid,
                  (unsigned)lock_ms);
}

/* Let a stopped pid go on. */
int host_freeze_restore(void *state, int pid) {
  (void)state;
  if (kill(pid, SIGCONT) < 0) return gpu_fail(-errno, "kill(%d, SIGCONT): %s", pid, strerror(errno));
  if (wait_state(pid, false, 1000)) return 0;
  return gpu_fail(-ETIMEDOUT, "pid %d is still stopped 1 s after SIGCONT", pid);
}

/* Whether pid is stopped. */
int host_freeze_released(void *state, int pid) {
  (void)state;
  char st = proc_state(pid);
  return st == 'T' || st == 't';
}
