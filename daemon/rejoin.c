#include "rejoin.h"

#include <stdlib.h>

#include "common/idmap.h"
#include "common/list.h"

struct noted {
  struct journal_buffer b;
  pid_t pid;
  uint64_t until_ms; /* the loop's clock */
  struct list link;  /* oldest first */
};

struct rejoin {
  uv_loop_t *loop;
  uv_timer_t timer; /* runs while anything is noted: fires at the oldest's end */
  bool timer_made;  /* at the first note: a set never used has no handle to close */
  idmap *by_id;     /* id -> struct noted */
  struct list all;
  bool closed;
};

/* Forget one note. */
static void forget(rejoin *r, struct noted *n) {
  idmap_del(r->by_id, n->b.id);
  list_remove(&n->link);
  free(n);
}

/* Start the timer for the oldest note, if any. */
static void arm(rejoin *r);

/* Forget the notes whose time is over. */
static void on_timer(uv_timer_t *t) {
  rejoin *r = t->data;
  uint64_t now = uv_now(r->loop);
  while (!list_empty(&r->all)) {
    struct noted *n = list_entry(r->all.next, struct noted, link);
    if (n->until_ms > now) break;
    forget(r, n);
  }
  arm(r);
}

static void arm(rejoin *r) {
  if (r->closed || list_empty(&r->all)) {
    uv_timer_stop(&r->timer);
    return;
  }
  struct noted *n = list_entry(r->all.next, struct noted, link);
  uint64_t now = uv_now(r->loop);
  uv_timer_start(&r->timer, on_timer, n->until_ms > now ? n->until_ms - now : 0, 0);
}

/* An empty set. */
rejoin *rejoin_create(uv_loop_t *loop) {
  rejoin *r = calloc(1, sizeof *r);
  if (!r || !(r->by_id = idmap_create())) {
    free(r);
    return NULL;
  }
  r->loop = loop;
  list_init(&r->all);
  return r;
}

/* Note a buffer of an ended session. */
void rejoin_note(rejoin *r, const struct buffer *b, pid_t pid) {
  if (r->closed) return;
  if (!r->timer_made) {
    uv_timer_init(r->loop, &r->timer);
    r->timer.data = r;
    r->timer_made = true;
  }
  if (idmap_count(r->by_id) >= REJOIN_MAX)
    forget(r, list_entry(r->all.next, struct noted, link));
  struct noted *n = calloc(1, sizeof *n);
  if (!n) return;
  n->b = registry_buffer_record(b);
  n->pid = pid;
  n->until_ms = uv_now(r->loop) + REJOIN_KEEP_MS;
  if (idmap_put(r->by_id, n->b.id, n) < 0) {
    free(n);
    return;
  }
  bool first = list_empty(&r->all);
  list_append(&r->all, &n->link);
  if (first) arm(r);
}

/* The note under id, for pid. */
const struct journal_buffer *rejoin_find(const rejoin *r, uint64_t id, pid_t pid) {
  const struct noted *n = id ? idmap_get(r->by_id, id) : NULL;
  return n && n->pid == pid ? &n->b : NULL;
}

/* Forget the note under id. */
void rejoin_take(rejoin *r, uint64_t id) {
  struct noted *n = idmap_get(r->by_id, id);
  if (n) forget(r, n);
}

/* Notes kept. */
size_t rejoin_count(const rejoin *r) { return idmap_count(r->by_id); }

/* Forget all and close the timer. */
void rejoin_close(rejoin *r) {
  if (!r || r->closed) return;
  r->closed = true;
  while (!list_empty(&r->all)) forget(r, list_entry(r->all.next, struct noted, link));
  if (r->timer_made) uv_close((uv_handle_t *)&r->timer, NULL);
}

/* Free the set. */
void rejoin_free(rejoin *r) {
  if (!r) return;
  while (!list_empty(&r->all)) forget(r, list_entry(r->all.next, struct noted, link));
  idmap_destroy(r->by_id);
  free(r);
}
