/* A client's buffers: one map of every buffer held (by its address in
 * memory) and one of those the daemon knows (by its id). */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "buffer.h"
#include "common/idmap.h"
#include "buffers.h"

struct buffers {
  pthread_mutex_t mu; /* both maps */
  idmap *all;         /* struct address -> buffer */
  idmap *known;       /* the daemon's id -> buffer */
};

/* The key of a buffer in the map of every buffer. */
static uint64_t key(const gpumem_buffer *b) { return (uint64_t)(uintptr_t)b; }

/* Make an empty set of buffers. */
buffers *buffers_create(void) {
  buffers *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  r->all = idmap_create();
  r->known = idmap_create();
  if (!r->all || !r->known) {
    buffers_destroy(r);
    return NULL;
  }
  pthread_mutex_init(&r->mu, NULL);
  return r;
}

/* Free a set of buffers. */
void buffers_destroy(buffers *r) {
  if (!r) return;
  if (r->all && r->known) pthread_mutex_destroy(&r->mu);
  idmap_destroy(r->all);
  idmap_destroy(r->known);
  free(r);
}

/* Hold a buffer, known under its id. */
int buffers_add(buffers *r, gpumem_buffer *b) {
  uint64_t id = gpumem_buffer_id(b);
  pthread_mutex_lock(&r->mu);
  int rc = idmap_put(r->all, key(b), b);
  if (rc == 0 && (rc = idmap_put(r->known, id, b)) < 0) idmap_del(r->all, key(b));
  if (rc == 0) buffer_set_known(b, id, true);
  pthread_mutex_unlock(&r->mu);
  return rc;
}

/* Know a held buffer under a new id. */
int buffers_know(buffers *r, gpumem_buffer *b, uint64_t id) {
  pthread_mutex_lock(&r->mu);
  gpumem_buffer *other = idmap_get(r->known, id);
  int rc = other && other != b ? -EEXIST : idmap_put(r->known, id, b);
  uint64_t old = gpumem_buffer_id(b);
  if (rc == 0 && old != id && idmap_get(r->known, old) == b) idmap_del(r->known, old);
  if (rc == 0) buffer_set_known(b, id, true);
  pthread_mutex_unlock(&r->mu);
  return rc;
}

/* Let go of a buffer. */
void buffers_remove(buffers *r, gpumem_buffer *b) {
  pthread_mutex_lock(&r->mu);
  uint64_t id = gpumem_buffer_id(b);
  if (gpumem_buffer_registered(b) && idmap_get(r->known, id) == b) idmap_del(r->known, id);
  idmap_del(r->all, key(b));
  buffer_set_known(b, id, false);
  pthread_mutex_unlock(&r->mu);
}

/* The known buffer with this id. */
gpumem_buffer *buffers_find(buffers *r, uint64_t id) {
  pthread_mutex_lock(&r->mu);
  gpumem_buffer *b = idmap_get(r->known, id);
  pthread_mutex_unlock(&r->mu);
  return b;
}

/* Every buffer held, with the lock held; NULL when out of memory. */
static gpumem_buffer **snapshot(buffers *r, size_t *n) {
  *n = idmap_count(r->all);
  gpumem_buffer **v = *n ? calloc(*n, sizeof *v) : NULL;
  *n = v ? idmap_values(r->all, (void **)v, *n) : 0;
  return v;
}

/* Forget every id. */
void buffers_unknow_all(buffers *r) {
  pthread_mutex_lock(&r->mu);
  size_t n;
  gpumem_buffer **v = snapshot(r, &n);
  for (size_t i = 0; i < n; i++) {
    uint64_t id = gpumem_buffer_id(v[i]);
    if (idmap_get(r->known, id) == v[i]) idmap_del(r->known, id);
    buffer_set_known(v[i], id, false);
  }
  /* Out of memory for the list: empty the id map all the same. */
  idmap *fresh = idmap_count(r->known) ? idmap_create() : NULL;
  if (fresh) {
    idmap_destroy(r->known);
    r->known = fresh;
  }
  pthread_mutex_unlock(&r->mu);
  free(v);
}

/* Every buffer held. */
gpumem_buffer **buffers_list(buffers *r, size_t *n) {
  pthread_mutex_lock(&r->mu);
  gpumem_buffer **v = snapshot(r, n);
  pthread_mutex_unlock(&r->mu);
  return v;
}

/* The number of buffers held. */
size_t buffers_count(buffers *r) {
  pthread_mutex_lock(&r->mu);
  size_t n = idmap_count(r->all);
  pthread_mutex_unlock(&r->mu);
  return n;
}

/* Some held buffer. */
gpumem_buffer *buffers_any(buffers *r) {
  pthread_mutex_lock(&r->mu);
  void *v = NULL;
  idmap_values(r->all, &v, 1);
  pthread_mutex_unlock(&r->mu);
  return v;
}

/* Look through every held buffer's range. */
gpumem_buffer *buffers_holding(buffers *r, const void *ptr, uint64_t len, uint64_t *off) {
  size_t n = 0;
  gpumem_buffer **all = buffers_list(r, &n);
  gpumem_buffer *found = NULL;
  uintptr_t p = (uintptr_t)ptr;
  for (size_t i = 0; i < n && !found; i++) {
    uintptr_t va = (uintptr_t)gpumem_buffer_ptr(all[i]);
    uint64_t size = gpumem_buffer_size(all[i]);
    if (va && p >= va && p - va < size && len <= size - (p - va)) {
      found = all[i];
      *off = p - va;
    }
  }
  free(all);
  return found;
}
