#include "exitwait.h"

#include <stdlib.h>

#include "common/log.h"
#include "common/procstat.h"


/* How often the driver's list is read while waiting. */
#define EXITWAIT_POLL_MS 10

struct exitwait {
  uv_timer_t timer;
  gpudev *gpu;
  int *pids; /* noted, then those still listed */
  size_t n, cap;
  uint64_t t0;   /* uv_hrtime at the start */
  uint64_t limit_ns;
  uint32_t waited_ms;
  void (*done)(void *arg);
  void *arg;
};

/* Create a waiter. */
exitwait *exitwait_create(uv_loop_t *loop, gpudev *g) {
  exitwait *w = calloc(1, sizeof *w);
  if (!w) return NULL;
  w->gpu = g;
  uv_timer_init(loop, &w->timer);
  w->timer.data = w;
  return w;
}

/* Free the waiter once its timer is closed. */
static void on_closed(uv_handle_t *h) {
  exitwait *w = h->data;
  free(w->pids);
  free(w);
}

/* Stop and free. */
void exitwait_destroy(exitwait *w) {
  if (w) uv_close((uv_handle_t *)&w->timer, on_closed);
}

/* Note a pid once. */
void exitwait_note(exitwait *w, int pid) {
  for (size_t i = 0; i < w->n; i++)
    if (w->pids[i] == pid) return;
  if (w->n == w->cap) {
    size_t cap = w->cap ? 2 * w->cap : 8;
    int *p = realloc(w->pids, cap * sizeof *p);
    if (!p) return;
    w->pids = p;
    w->cap = cap;
  }
  w->pids[w->n++] = pid;
}

/* Forget the pids and the figures. */
void exitwait_clear(exitwait *w) {
  uv_timer_stop(&w->timer);
  w->n = 0;
  w->waited_ms = 0;
  w->done = NULL;
}

/* Keep only the pids the driver still lists (one it cannot be asked about
 * is not waited for); true while any is left. */
static bool still_listed(exitwait *w) {
  size_t k = 0;
  for (size_t i = 0; i < w->n; i++)
    if (gpudev_process_listed(w->gpu, w->pids[i]) > 0) w->pids[k++] = w->pids[i];
  w->n = k;
  return k > 0;
}

/* One poll: done when none is listed or the bound has passed. */
static void on_poll(uv_timer_t *t) {
  exitwait *w = t->data;
  uint64_t spent = uv_hrtime() - w->t0;
  w->waited_ms = (uint32_t)(spent / 1000000);
  if (still_listed(w) && spent < w->limit_ns) return;
  uv_timer_stop(t);
  if (w->n)
    log_warn("pause: %zu owners whose sessions ended are still listed by the driver after %u ms",
             w->n, (unsigned)w->waited_ms);
  else
    log_info("pause: waited %u ms for ended owners to leave the driver", (unsigned)w->waited_ms);
  void (*done)(void *) = w->done;
  w->done = NULL;
  if (done) done(w->arg);
}

/* Whether pid has exited or is exiting, by the kernel's word: gone, a
 * zombie, or PF_EXITING among its flags (a process whose socket the kernel
 * closed on its way out may not be a zombie yet). A process that lives on
 * is not waited for: the driver lists a live process with a context for
 * as long as it lives. */
static bool exited(int pid) {
  struct procstat st;
  if (procstat_read(pid, &st) < 0) return true;
  return st.state == 'Z' || st.state == 'X' || (st.flags & PROCSTAT_PF_EXITING);
}

/* Start waiting for the noted pids without a session that have exited. */
bool exitwait_start(exitwait *w, uint32_t limit_ms, bool (*keep)(void *arg, int pid),
                    void (*done)(void *arg), void *arg) {
  size_t k = 0;
  for (size_t i = 0; i < w->n; i++)
    if (w->pids[i] > 0 && !keep(arg, w->pids[i]) && exited(w->pids[i])) w->pids[k++] = w->pids[i];
  w->n = k;
  w->waited_ms = 0;
  if (!still_listed(w) || limit_ms == 0) return false;
  log_info("pause: waiting up to %u ms for %zu ended owners to leave the driver: pid %d%s",
           (unsigned)limit_ms, w->n, w->pids[0], w->n > 1 ? ", ..." : "");
  w->t0 = uv_hrtime();
  w->limit_ns = (uint64_t)limit_ms * 1000000;
  w->done = done;
  w->arg = arg;
  uv_timer_start(&w->timer, on_poll, EXITWAIT_POLL_MS, EXITWAIT_POLL_MS);
  return true;
}

/* The last wait's figures. */
size_t exitwait_result(const exitwait *w, uint32_t *waited_ms, uint32_t *out, size_t max) {
  *waited_ms = w->waited_ms;
  size_t i;
  for (i = 0; i < w->n && i < max; i++) out[i] = (uint32_t)w->pids[i];
  return i;
}
