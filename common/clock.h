/* Time for deadlines: milliseconds on the monotonic clock, which is also
 * the clock of every condition variable the library and gpumemctl wait on. */
#ifndef GPUMEM_CLOCK_H
#define GPUMEM_CLOCK_H

#include <pthread.h>
#include <time.h>

/* Milliseconds on the monotonic clock. */
static inline double clock_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Make a condition variable that waits on the monotonic clock. */
static inline void clock_cond_init(pthread_cond_t *cv) {
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(cv, &ca);
  pthread_condattr_destroy(&ca);
}

/* Wait on cv (made by clock_cond_init) until the monotonic time at_ms at
 * the latest. */
static inline void clock_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu,
                                         double at_ms) {
  struct timespec ts;
  if (at_ms < 0) at_ms = 0;
  ts.tv_sec = (time_t)(at_ms / 1e3);
  ts.tv_nsec = (long)((at_ms - (double)ts.tv_sec * 1e3) * 1e6);
  if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
  if (ts.tv_nsec < 0) ts.tv_nsec = 0;
  pthread_cond_timedwait(cv, mu, &ts);
}

/* Milliseconds from now until the monotonic time at_ms, for poll (0 when
 * it has passed; -1 for no limit, at_ms < 0). */
static inline int clock_poll_ms(double at_ms) {
  if (at_ms < 0) return -1;
  double left = at_ms - clock_ms();
  return left <= 0 ? 0 : left > 1e9 ? 1000000000 : (int)left + 1;
}

#endif
