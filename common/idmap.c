#include "idmap.h"

#include <errno.h>
#include <stdlib.h>

/* Slots hold id 0 when empty; deletion shifts followers back (no
 * tombstones), so lookups stay short however many deletes happen. */
struct slot {
  uint64_t id;
  void *value;
};

struct idmap {
  struct slot *slots;
  size_t cap, count; /* cap is a power of two */
};

static size_t hash(uint64_t id, size_t cap) {
  id ^= id >> 33;
  id *= 0xff51afd7ed558ccdull;
  id ^= id >> 33;
  return (size_t)id & (cap - 1);
}

/* Create an empty map. */
idmap *idmap_create(void) {
  idmap *m = calloc(1, sizeof *m);
  if (!m) return NULL;
  m->cap = 64;
  m->slots = calloc(m->cap, sizeof *m->slots);
  if (!m->slots) {
    free(m);
    return NULL;
  }
  return m;
}

/* Destroy a map. */
void idmap_destroy(idmap *m) {
  if (!m) return;
  free(m->slots);
  free(m);
}

static struct slot *find(const idmap *m, uint64_t id) {
  for (size_t i = hash(id, m->cap);; i = (i + 1) & (m->cap - 1)) {
    struct slot *s = &m->slots[i];
    if (s->id == id || s->id == 0) return s;
  }
}

static int grow(idmap *m) {
  idmap bigger = {calloc(m->cap * 2, sizeof(struct slot)), m->cap * 2, 0};
  if (!bigger.slots) return -ENOMEM;
  for (size_t i = 0; i < m->cap; i++)
    if (m->slots[i].id) *find(&bigger, m->slots[i].id) = m->slots[i];
  free(m->slots);
  m->slots = bigger.slots;
  m->cap = bigger.cap;
  return 0;
}

/* Insert or replace id -> value. */
int idmap_put(idmap *m, uint64_t id, void *value) {
  if ((m->count + 1) * 4 > m->cap * 3 && grow(m) < 0) return -ENOMEM;
  struct slot *s = find(m, id);
  if (s->id == 0) m->count++;
  s->id = id;
  s->value = value;
  return 0;
}

/* The value for id, or NULL. */
void *idmap_get(const idmap *m, uint64_t id) {
  if (id == 0) return NULL;
  struct slot *s = find(m, id);
  return s->id ? s->value : NULL;
}

/* Remove id, then move later entries of its run into the hole. */
void idmap_del(idmap *m, uint64_t id) {
  if (id == 0) return;
  struct slot *s = find(m, id);
  if (!s->id) return;
  size_t hole = (size_t)(s - m->slots);
  m->slots[hole].id = 0;
  m->count--;
  for (size_t i = (hole + 1) & (m->cap - 1); m->slots[i].id;
       i = (i + 1) & (m->cap - 1)) {
    size_t mask = m->cap - 1;
    size_t home = hash(m->slots[i].id, m->cap);
    /* Move the entry if the hole lies between its home and where it is. */
    if (((i - home) & mask) >= ((i - hole) & mask)) {
      m->slots[hole] = m->slots[i];
      m->slots[i].id = 0;
      hole = i;
    }
  }
}

/* Number of entries. */
size_t idmap_count(const idmap *m) { return m->count; }

/* Copy up to max values into out. */
size_t idmap_values(const idmap *m, void **out, size_t max) {
  size_t n = 0;
  for (size_t i = 0; i < m->cap && n < max; i++)
    if (m->slots[i].id) out[n++] = m->slots[i].value;
  return n;
}
