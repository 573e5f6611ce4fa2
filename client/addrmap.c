/* The process's map of the addresses this library handed out. One mutex
 * guards it and every owner's list; callers may hold their own locks (a
 * pool's) around these calls, never the other way round. A forked child
 * starts with an empty map: what the parent handed out is not the
 * child's to free. */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "addrmap.h"
#include "common/idmap.h"

static pthread_mutex_t map_mu = PTHREAD_MUTEX_INITIALIZER;
static idmap *map;      /* address -> struct addr_entry; made on first use */
static unsigned epoch;  /* forks seen: an owner made before one has no entries */

/* In a forked child: the parent's addresses are not the child's (the old
 * map is leaked knowingly; its lock may have been held at the fork). */
static void forget_in_child(void) {
  pthread_mutex_init(&map_mu, NULL);
  map = NULL;
  epoch++;
}

/* Register the fork handler when the library is loaded. */
__attribute__((constructor)) static void addrmap_init(void) {
  pthread_atfork(NULL, NULL, forget_in_child);
}

/* The key of an address. */
static uint64_t key(const void *ptr) { return (uint64_t)(uintptr_t)ptr; }

/* Make an owner's list empty. */
void addrmap_owner_init(struct addr_owner *o, void *client) {
  o->client = client;
  list_init(&o->entries);
  pthread_mutex_lock(&map_mu);
  o->epoch = epoch;
  pthread_mutex_unlock(&map_mu);
}

/* Record ptr with its entry. */
int addrmap_put(void *ptr, struct addr_entry *e, struct addr_owner *o, int kind) {
  pthread_mutex_lock(&map_mu);
  if (!map) map = idmap_create();
  int rc = map && ptr ? idmap_put(map, key(ptr), e) : -ENOMEM;
  if (rc == 0) {
    if (o->epoch != epoch) {
      /* A parent's owner in a forked child: its old entries went with the map. */
      list_init(&o->entries);
      o->epoch = epoch;
    }
    e->owner = o;
    e->kind = kind;
    e->ptr = ptr;
    list_append(&o->entries, &e->link);
  }
  pthread_mutex_unlock(&map_mu);
  return rc;
}

/* The entry at ptr, if o's. Called with map_mu held. */
static struct addr_entry *lookup(const void *ptr, const struct addr_owner *o) {
  struct addr_entry *e = map && ptr ? idmap_get(map, key(ptr)) : NULL;
  return e && (!o || e->owner == o) ? e : NULL;
}

/* Take an entry out of the map and its owner's list. Called with map_mu
 * held. */
static void unlink_entry(struct addr_entry *e) {
  idmap_del(map, key(e->ptr));
  list_remove(&e->link);
  e->ptr = NULL;
}

/* Find the entry at ptr. */
struct addr_entry *addrmap_find(const void *ptr, const struct addr_owner *o) {
  pthread_mutex_lock(&map_mu);
  struct addr_entry *e = lookup(ptr, o);
  pthread_mutex_unlock(&map_mu);
  return e;
}

/* Take the entry at ptr out of the map. */
struct addr_entry *addrmap_take(const void *ptr, const struct addr_owner *o) {
  pthread_mutex_lock(&map_mu);
  struct addr_entry *e = lookup(ptr, o);
  if (e) unlink_entry(e);
  pthread_mutex_unlock(&map_mu);
  return e;
}

/* Take e out of the map if it is there. */
void addrmap_remove(struct addr_entry *e) {
  pthread_mutex_lock(&map_mu);
  if (e->ptr && lookup(e->ptr, NULL) == e) unlink_entry(e);
  pthread_mutex_unlock(&map_mu);
}

/* Forget every address of o. */
void addrmap_forget(struct addr_owner *o) {
  pthread_mutex_lock(&map_mu);
  /* A parent's owner in a forked child: its entries went with the map. */
  if (o->epoch != epoch) list_init(&o->entries);
  while (map && !list_empty(&o->entries))
    unlink_entry(list_entry(o->entries.next, struct addr_entry, link));
  pthread_mutex_unlock(&map_mu);
}
