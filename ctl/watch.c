/* A thread that asks gpumemd for the status at an interval. */
#include "ctl/watch.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "ctl/owner.h"

/* How long one status request may wait: a daemon that does not answer
 * within this is "not answering", and the next turn connects again. */
#define WATCH_REQUEST_TIMEOUT_MS 5000

/* How long watch_stop waits for the thread before leaving it behind. */
#define WATCH_STOP_WAIT_S 1

struct watch {
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* on CLOCK_MONOTONIC */
  bool stopping;     /* watch_stop was called: no more callbacks */
  bool finished;     /* the thread is at its end */
  bool orphaned;     /* watch_stop gave up waiting: the thread frees the watch */
  char *socket_path;
  char *name;
  uid_t owner; /* whose gpumemd is trusted (ctl/owner.h), besides root */
  uint64_t delay_ms, interval_ms;
  watch_fn fn;
  void *user;
};

/* Milliseconds on the monotonic clock. */
static uint64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Free the watch's memory (its thread is done). */
static void watch_free(watch *w) {
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->cv);
  free(w->socket_path);
  free(w->name);
  free(w);
}

/* Wait ms, or less when the watch is stopped; false once it is. */
static bool watch_sleep(watch *w, uint64_t ms) {
  uint64_t until = mono_ms() + ms;
  struct timespec dl = {.tv_sec = (time_t)(until / 1000), .tv_nsec = (long)(until % 1000) * 1000000};
  pthread_mutex_lock(&w->mu);
  while (!w->stopping && mono_ms() < until)
    if (pthread_cond_timedwait(&w->cv, &w->mu, &dl) == ETIMEDOUT) break;
  bool go = !w->stopping;
  pthread_mutex_unlock(&w->mu);
  return go;
}

/* Connect the way every gpumemctl connection does (ctl/owner.h), each
 * time checking whose gpumemd answers; why gets the reason of a failure. */
static int watch_connect(const watch *w, gpumem_client **c, char *why, size_t len) {
  int rc = owner_connect(w->socket_path, w->name, w->owner, true, c, why, len);
  if (rc == OWNER_UNTRUSTED) return GPUMEM_E_PERMISSION;
  if (rc < 0) snprintf(why, len, "%s", gpumem_last_error());
  if (rc == 0) gpumem_set_request_timeout(*c, WATCH_REQUEST_TIMEOUT_MS);
  return rc;
}

/* Hand one answer to the callback, unless the watch was stopped. */
static void watch_deliver(watch *w, struct gpumem_status *s, int err, const char *why) {
  pthread_mutex_lock(&w->mu);
  if (!w->stopping) {
    w->fn(w->user, s, err, why);
    s = NULL;
  }
  pthread_mutex_unlock(&w->mu);
  gpumem_status_free(s);
}

/* The thread: wait, ask, hand over, until stopped. A failed request drops
 * the connection; the next turn makes a new one. */
static void *watch_main(void *arg) {
  watch *w = arg;
  gpumem_client *c = NULL;
  uint64_t wait = w->delay_ms;
  char why[512];
  while (watch_sleep(w, wait)) {
    uint64_t t0 = mono_ms();
    struct gpumem_status *s = NULL;
    why[0] = '\0';
    int err = c ? 0 : watch_connect(w, &c, why, sizeof why);
    if (err == 0) {
      err = gpumem_status(c, &s);
      snprintf(why, sizeof why, "%s", err < 0 ? gpumem_last_error() : "");
    }
    if (err < 0 && c) {
      gpumem_disconnect(c);
      c = NULL;
    }
    watch_deliver(w, s, err < 0 ? err : 0, why);
    uint64_t spent = mono_ms() - t0;
    wait = spent < w->interval_ms ? w->interval_ms - spent : 0;
  }
  if (c) gpumem_disconnect(c);
  pthread_mutex_lock(&w->mu);
  w->finished = true;
  bool orphan = w->orphaned;
  pthread_mutex_unlock(&w->mu);
  if (orphan) watch_free(w);
  return NULL;
}

/* Start the thread, with every signal blocked in it: the caller's thread
 * gets them (top's poll must wake on SIGWINCH and SIGINT). */
int watch_start(const char *socket_path, uid_t owner, const char *name, uint64_t delay_ms,
                uint64_t interval_ms, watch_fn fn, void *user, watch **out) {
  watch *w = calloc(1, sizeof *w);
  if (!w) return -ENOMEM;
  w->socket_path = strdup(socket_path);
  w->name = strdup(name);
  if (!w->socket_path || !w->name) {
    free(w->socket_path);
    free(w->name);
    free(w);
    return -ENOMEM;
  }
  w->owner = owner;
  w->delay_ms = delay_ms;
  w->interval_ms = interval_ms;
  w->fn = fn;
  w->user = user;
  pthread_mutex_init(&w->mu, NULL);
  clock_cond_init(&w->cv);
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int rc = pthread_create(&w->thread, NULL, watch_main, w);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) {
    watch_free(w);
    return -rc;
  }
  *out = w;
  return 0;
}

/* Stop: no callback after this returns. The thread is joined when it
 * ends within WATCH_STOP_WAIT_S; a request to a daemon that does not
 * answer takes WATCH_REQUEST_TIMEOUT_MS (a connect's greeting, the
 * library's default request timeout), and quitting should not wait that
 * long. */
void watch_stop(watch *w) {
  if (!w) return;
  pthread_mutex_lock(&w->mu);
  w->stopping = true;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  dl.tv_sec += WATCH_STOP_WAIT_S;
  if (pthread_timedjoin_np(w->thread, NULL, &dl) == 0) {
    watch_free(w);
    return;
  }
  pthread_mutex_lock(&w->mu);
  if (w->finished) {
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    watch_free(w);
    return;
  }
  w->orphaned = true;
  pthread_detach(w->thread);
  pthread_mutex_unlock(&w->mu);
}
