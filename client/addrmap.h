/* The process's one map of the addresses this library hands out: every
 * gpumem_malloc allocation and every gpumem_alloc buffer, each with the
 * client it belongs to. gpumem_free_ptr and gpumem_torch_free find a
 * pointer here, whichever client made it. */
#ifndef GPUMEM_CLIENT_ADDRMAP_H
#define GPUMEM_CLIENT_ADDRMAP_H

#include <stdbool.h>

#include "common/list.h"

/* What kind of thing an address is. */
enum addr_kind {
  ADDR_BUFFER = 1,     /* a buffer of gpumem_alloc (at its first byte) */
  ADDR_ALLOCATION = 2, /* an allocation of gpumem_malloc */
};

/* Whose addresses: one per client, inside it. */
struct addr_owner {
  void *client;        /* the gpumem_client */
  struct list entries; /* its entries in the map (under the map's lock) */
  unsigned epoch;      /* the map it was made with (a forked child has another) */
};

/* An entry of the map, kept inside the thing it describes (a pool's
 * block, a buffer), which owns its memory. */
struct addr_entry {
  struct addr_owner *owner;
  int kind;            /* enum addr_kind */
  const void *ptr;     /* the address (set by addrmap_put) */
  struct list link;    /* in its owner's entries */
};

/* Make an owner's list of entries empty (when its client is made). */
void addrmap_owner_init(struct addr_owner *o, void *client);

/* Record that ptr is described by e, of owner o and kind kind. Returns 0
 * or -ENOMEM. */
int addrmap_put(void *ptr, struct addr_entry *e, struct addr_owner *o, int kind);

/* The entry at ptr if it is o's (any owner's when o is NULL), or NULL. */
struct addr_entry *addrmap_find(const void *ptr, const struct addr_owner *o);

/* Take the entry at ptr out of the map if it is o's; NULL if there is
 * none. */
struct addr_entry *addrmap_take(const void *ptr, const struct addr_owner *o);

/* Take e out of the map if it is there (doing it twice is harmless). */
void addrmap_remove(struct addr_entry *e);

/* Forget every address of o (its client is being disconnected). */
void addrmap_forget(struct addr_owner *o);

#endif
