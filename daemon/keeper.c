#include "keeper.h"

#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

struct keeper {
  struct owner owner;
  uv_loop_t *loop;
  uv_idle_t idle; /* runs while events wait for their answer */
  bool idle_made; /* at the first event: a keeper never used has no handle to close */
  keeper_ack_fn ack;
  void *ctx;
  uint64_t *events; /* waiting, in the order they were sent */
  size_t n, cap;
  bool closed;
};

/* Create the keeper (its idle handle is made at its first event). */
keeper *keeper_create(uv_loop_t *loop, keeper_ack_fn ack, void *ctx) {
  keeper *k = calloc(1, sizeof *k);
  if (!k) return NULL;
  k->owner.id = UINT64_MAX; /* no session's: theirs count up from 1 */
  k->owner.keeper = true;
  k->owner.role = GPUMEM__WIRE__ROLE__ROLE_WORKER;
  k->owner.minor = WIRE_VERSION_MINOR;
  strcpy(k->owner.name, "gpumemd (persistent, no holder)");
  list_init(&k->owner.buffers);
  list_init(&k->owner.link);
  k->ack = ack;
  k->ctx = ctx;
  k->loop = loop;
  return k;
}

/* The keeper's owner. */
struct owner *keeper_owner(keeper *k) { return &k->owner; }

/* Answer every waiting event, in order; those sent meanwhile wait for the
 * next turn. */
static void on_idle(uv_idle_t *h) {
  keeper *k = h->data;
  size_t n = k->n;
  uint64_t *events = k->events;
  k->events = NULL;
  k->n = k->cap = 0;
  uv_idle_stop(&k->idle);
  for (size_t i = 0; i < n && !k->closed; i++) k->ack(k->ctx, &k->owner, events[i]);
  free(events);
}

/* Queue an event's answer. */
int keeper_event(keeper *k, uint64_t event_id) {
  if (k->closed) return 0;
  if (k->n == k->cap) {
    size_t cap = k->cap ? k->cap * 2 : 16;
    uint64_t *more = realloc(k->events, cap * sizeof *more);
    if (!more) return -ENOMEM;
    k->events = more;
    k->cap = cap;
  }
  k->events[k->n++] = event_id;
  if (!k->idle_made) {
    uv_idle_init(k->loop, &k->idle);
    k->idle.data = k;
    k->idle_made = true;
  }
  uv_idle_start(&k->idle, on_idle);
  return 0;
}

/* Close the handle; nothing more is answered. */
void keeper_close(keeper *k) {
  if (!k || k->closed) return;
  k->closed = true;
  if (k->idle_made) uv_close((uv_handle_t *)&k->idle, NULL);
}

/* Free the keeper. */
void keeper_free(keeper *k) {
  if (!k) return;
  free(k->events);
  free(k);
}
