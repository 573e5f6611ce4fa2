/* The gate between backup pieces and every other driver call of the
 * daemon's half (gpu/vmm_gate.h). */
#include "vmm_gate.h"

#include <time.h>

#include "common/clock.h"

/* A background piece starts only once the other driver calls that change
 * something (not queries) have been quiet this long: a burst of
 * allocations (about half a millisecond apart) runs whole before the
 * background goes on. It waits for quiet no longer than QUIET_MAX_NS, so
 * that steady traffic cannot hold backups off for good (then a piece
 * still starts only between calls). */
#define QUIET_NS (5ull * 1000000)
#define QUIET_MAX_NS (100ull * 1000000)

/* Nanoseconds on the monotonic clock (the gate's condition clock). */
static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Make a gate with nothing in progress, its condition on the monotonic
 * clock. */
void vmm_gate_init(struct vmm_gate *g) {
  pthread_mutex_init(&g->mu, NULL);
  clock_cond_init(&g->cv);
}

/* Free a gate nobody waits at. */
void vmm_gate_destroy(struct vmm_gate *g) {
  pthread_cond_destroy(&g->cv);
  pthread_mutex_destroy(&g->mu);
}

/* A driver call begins. */
void vmm_gate_begin(struct vmm_gate *g) { atomic_fetch_add(&g->calls, 1); }

/* The last call in progress wakes the pieces waiting. A piece counts
 * itself waiting before it reads calls, and a call drops calls before it
 * reads the waiting count, so one of the two sees the other (both
 * sequentially consistent) and no wake-up is lost. */
static void end_call(struct vmm_gate *g) {
  if (atomic_fetch_sub(&g->calls, 1) == 1 && atomic_load(&g->pieces_waiting) > 0) {
    pthread_mutex_lock(&g->mu);
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
  }
}

/* A driver call ends, and the quiet a background piece waits for starts
 * again. */
void vmm_gate_end(struct vmm_gate *g) {
  atomic_store(&g->last_end, mono_ns());
  end_call(g);
}

/* A query ends, leaving the quiet alone. */
void vmm_gate_end_query(struct vmm_gate *g) { end_call(g); }

/* Wait until a piece may go (see vmm_gate.h). */
void vmm_gate_wait_piece(struct vmm_gate *g, bool background, bool pin) {
  uint64_t give_up = mono_ns() + QUIET_MAX_NS;
  pthread_mutex_lock(&g->mu);
  atomic_fetch_add(&g->pieces_waiting, 1);
  for (;;) {
    if (atomic_load(&g->calls) > 0 || (pin && g->piece_busy)) {
      pthread_cond_wait(&g->cv, &g->mu);
      continue;
    }
    uint64_t quiet = atomic_load(&g->last_end) + QUIET_NS;
    if (quiet > give_up) quiet = give_up;
    if (!background || mono_ns() >= quiet) break;
    struct timespec until = {.tv_sec = (time_t)(quiet / 1000000000ull),
                             .tv_nsec = (long)(quiet % 1000000000ull)};
    pthread_cond_timedwait(&g->cv, &g->mu, &until);
  }
  atomic_fetch_sub(&g->pieces_waiting, 1);
  if (pin) g->piece_busy = true;
  pthread_mutex_unlock(&g->mu);
}

/* A piece is pinned: the next one may go. */
void vmm_gate_end_piece(struct vmm_gate *g) {
  pthread_mutex_lock(&g->mu);
  g->piece_busy = false;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}
