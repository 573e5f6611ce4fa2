#include "grace.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/list.h"

/* One allocation waiting for the grace to end. */
struct waiting {
  struct list link;
  struct session *s;
  uint32_t uid; /* its session's */
  uint64_t id;
  char tag[WIRE_TAG_MAX + 1];
  uint32_t device, flags;
  uint64_t size, keep_free;
};

/* Allocations that may wait at once (each some 150 bytes), and of them
 * those of one uid: one uid filling the list would refuse the others'. */
#define GRACE_MAX_WAITING 65536
#define GRACE_MAX_WAITING_PER_UID 256

/* The waiting allocations of one uid. */
struct uid_count {
  uint32_t uid;
  size_t n;
};

struct grace {
  uv_timer_t timer;
  bool active;
  struct list waiting; /* struct waiting.link, in arrival order */
  size_t nwaiting;
  struct uid_count *uids; /* the uids with allocations waiting (n > 0) */
  size_t nuids, capuids;
  grace_serve_fn serve;
  grace_ended_fn ended;
  void *ctx;
};

/* The count of uid's waiting allocations (made, at 0, when make): NULL
 * when it has none and make is false, or out of memory. */
static struct uid_count *count_of(grace *g, uint32_t uid, bool make) {
  for (size_t i = 0; i < g->nuids; i++)
    if (g->uids[i].uid == uid) return &g->uids[i];
  if (!make) return NULL;
  if (g->nuids == g->capuids) {
    size_t cap = g->capuids ? g->capuids * 2 : 8;
    struct uid_count *u = realloc(g->uids, cap * sizeof *u);
    if (!u) return NULL;
    g->uids = u;
    g->capuids = cap;
  }
  g->uids[g->nuids] = (struct uid_count){uid, 0};
  return &g->uids[g->nuids++];
}

/* One waiting allocation fewer (w, off the list now). */
static void drop_waiting(grace *g, struct waiting *w) {
  g->nwaiting--;
  struct uid_count *c = count_of(g, w->uid, false);
  if (c && --c->n == 0) *c = g->uids[--g->nuids];
}

/* Serve what waited, in order (serving may end sessions: each is taken
 * off the list before it is served). */
static void on_end(uv_timer_t *t) {
  grace *g = t->data;
  g->active = false;
  while (!list_empty(&g->waiting)) {
    struct waiting *w = list_entry(g->waiting.next, struct waiting, link);
    list_remove(&w->link);
    drop_waiting(g, w);
    Gpumem__Wire__AllocRequest a = GPUMEM__WIRE__ALLOC_REQUEST__INIT;
    a.tag = w->tag;
    a.device = w->device;
    a.size = w->size;
    a.flags = w->flags;
    a.keep_free = w->keep_free;
    g->serve(g->ctx, w->s, w->id, &a);
    free(w);
  }
  if (g->ended) g->ended(g->ctx);
}

/* A grace of ms from now. */
grace *grace_create(uv_loop_t *loop, uint64_t ms, grace_serve_fn serve, grace_ended_fn ended,
                    void *ctx) {
  grace *g = calloc(1, sizeof *g);
  if (!g) return NULL;
  list_init(&g->waiting);
  g->serve = serve;
  g->ended = ended;
  g->ctx = ctx;
  uv_timer_init(loop, &g->timer);
  g->timer.data = g;
  g->active = ms > 0;
  if (g->active) uv_timer_start(&g->timer, on_end, ms, 0);
  return g;
}

/* End the grace now, as its timer would. */
void grace_end(grace *g) {
  if (!grace_active(g)) return;
  uv_timer_stop(&g->timer);
  on_end(&g->timer);
}

/* Whether the grace still runs. */
bool grace_active(const grace *g) { return g && g->active; }

/* Milliseconds the grace still runs: its timer's, at least 1 while it is
 * active (the timer may be due and not yet run). */
uint64_t grace_left_ms(const grace *g) {
  if (!grace_active(g)) return 0;
  uint64_t left = uv_timer_get_due_in(&g->timer);
  return left ? left : 1;
}

/* Allocations waiting for the grace to end. */
size_t grace_waiting(const grace *g) { return g ? g->nwaiting : 0; }

/* Keep an allocation until the grace ends. */
int grace_defer(grace *g, struct session *s, uint32_t uid, uint64_t id,
                const Gpumem__Wire__AllocRequest *a) {
  struct uid_count *c = count_of(g, uid, false);
  if (c && c->n == GRACE_MAX_WAITING_PER_UID) return -EDQUOT;
  if (g->nwaiting == GRACE_MAX_WAITING) return -ENOSPC;
  struct waiting *w = calloc(1, sizeof *w);
  if (!w || !(c = count_of(g, uid, true))) {
    free(w);
    return -ENOMEM;
  }
  c->n++;
  w->s = s;
  w->uid = uid;
  w->id = id;
  strncpy(w->tag, a->tag, WIRE_TAG_MAX); /* checked at the edge: it fits */
  w->device = a->device;
  w->flags = a->flags;
  w->size = a->size;
  w->keep_free = a->keep_free;
  list_append(&g->waiting, &w->link);
  g->nwaiting++;
  return 0;
}

/* Drop the waiting allocations of a session that ended. */
void grace_forget(grace *g, struct session *s) {
  struct list *p, *t;
  if (!g) return;
  list_for_each_safe(p, t, &g->waiting) {
    struct waiting *w = list_entry(p, struct waiting, link);
    if (w->s != s) continue;
    list_remove(&w->link);
    drop_waiting(g, w);
    free(w);
  }
}

/* Free the grace once its timer has closed. */
static void on_closed(uv_handle_t *h) { free(h->data); }

/* Drop everything waiting and close the timer. */
void grace_destroy(grace *g) {
  struct list *p, *t;
  if (!g) return;
  list_for_each_safe(p, t, &g->waiting) {
    list_remove(p);
    free(list_entry(p, struct waiting, link));
  }
  free(g->uids);
  g->uids = NULL;
  g->nuids = g->capuids = g->nwaiting = 0;
  g->active = false;
  uv_close((uv_handle_t *)&g->timer, on_closed);
}
