/* Sub-allocation: gpumem_malloc carves allocations out of slabs, daemon
 * buffers of the allocation's tag, device and BACKUP flag (one bucket of
 * slabs each), so that a PyTorch segment costs no daemon round trip once
 * its bucket has room.
 *
 * Each bucket's slabs grow (64 MiB, then twice the last, up to 1 GiB); a
 * request larger than that gets a slab of its own. Inside a slab, blocks
 * sit in address order and free neighbours merge; the bucket keeps its
 * free blocks in one list, searched best-fit. Allocations are found by
 * address in the process's address map (addrmap.c). One mutex guards the
 * bookkeeping; it is never held across a daemon round trip, so two
 * threads that both find a bucket full may each add a slab. An empty
 * slab goes back to the daemon unless it is its bucket's only empty one
 * (kept, so that a free and a malloc in turn do not each cost a round
 * trip); gpumem_trim gives those back too. */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "addrmap.h"
#include "alloc.h"
#include "buffer.h"
#include "client.h"
#include "common/list.h"
#include "common/size.h"
#include "error.h"
#include "pool.h"

#define POOL_ALIGN 512ull         /* allocation sizes and offsets */
#define SLAB_FIRST (64ull << 20)  /* a pool's first slab */
#define SLAB_MAX (1ull << 30)     /* slabs grow to this; larger ones are one request's */

struct bucket;
struct slab;

/* A piece of a slab: one allocation, or a free gap. */
struct block {
  struct addr_entry at; /* an allocation's entry in the address map */
  uint64_t off, size;
  bool free;
  struct slab *slab;
  struct block *prev, *next;   /* the slab's blocks, by address */
  struct list flink;           /* in the bucket's free blocks, newest first */
};

/* A daemon buffer that allocations are carved from. */
struct slab {
  gpumem_buffer *buf;
  char *base;
  uint64_t size;
  uint64_t used; /* allocations in it */
  bool attached; /* in its pool (not on its way back to the daemon) */
  struct bucket *bucket;
  struct block *blocks;
  struct list link; /* in its bucket's slabs, newest first, while attached */
};

/* The flags that make slabs differ beyond tag and device. */
#define BACKUP_BITS (GPUMEM_BACKUP | GPUMEM_BACKUP_POLICY)

/* A bucket: the slabs of one tag, device and backup policy (BACKUP_BITS). */
struct bucket {
  char tag[WIRE_TAG_MAX + 1];
  int device;
  unsigned backup;
  uint64_t next_size; /* of the next slab made from the pool's growth */
  struct list slabs; /* of struct slab, by link */
  struct list free_blocks; /* of struct block, by flink */
  struct bucket *next;
};

/* A client's sub-allocations. */
struct pool {
  pthread_mutex_t mu; /* everything below */
  struct addr_owner *owner; /* the client's addresses */
  struct bucket *buckets;
  struct gpumem_pool_stats st;
};

/* Make a client's pool bookkeeping, whose allocations are owner's. */
pool *pool_create(struct addr_owner *owner) {
  pool *cp = calloc(1, sizeof *cp);
  if (!cp) return NULL;
  cp->owner = owner;
  pthread_mutex_init(&cp->mu, NULL);
  return cp;
}

/* Put a free block on its pool's free list. */
static void free_push(struct bucket *p, struct block *b) {
  list_prepend(&p->free_blocks, &b->flink);
}

/* Take a block off its pool's free list. */
static void free_unlink(struct block *b) { list_remove(&b->flink); }

/* The bucket of a tag, device and BACKUP flag, or NULL. */
static struct bucket *bucket_find(pool *cp, const char *tag, int device,
                              unsigned backup) {
  for (struct bucket *p = cp->buckets; p; p = p->next)
    if (p->device == device && p->backup == backup && strcmp(p->tag, tag) == 0) return p;
  return NULL;
}

/* Link an empty slab into its pool with one free block over all of it. */
static int slab_attach(pool *cp, struct slab *s) {
  struct block *b = calloc(1, sizeof *b);
  if (!b) return -ENOMEM;
  *b = (struct block){.size = s->size, .free = true, .slab = s};
  s->blocks = b;
  s->used = 0;
  s->attached = true;
  free_push(s->bucket, b);
  list_prepend(&s->bucket->slabs, &s->link);
  cp->st.pooled_buffers++;
  cp->st.pooled_bytes += s->size;
  return 0;
}

/* Unlink an empty slab from its pool. */
static void slab_detach(pool *cp, struct slab *s) {
  free_unlink(s->blocks);
  free(s->blocks);
  s->blocks = NULL;
  list_remove(&s->link);
  s->attached = false;
  cp->st.pooled_buffers--;
  cp->st.pooled_bytes -= s->size;
}

/* The smallest free block of at least need bytes in a slab that may be
 * used now (buffer_usable: a slab the daemon does not know never serves,
 * since a pause could not release it; while reconnecting, mapped ones
 * do). */
static struct block *best_fit(struct bucket *p, uint64_t need, bool allow_paused, bool live) {
  struct block *best = NULL;
  for (struct list *l = p->free_blocks.next; l != &p->free_blocks; l = l->next) {
    struct block *b = list_entry(l, struct block, flink);
    if (b->size < need || (best && b->size >= best->size)) continue;
    if (!buffer_usable(b->slab->buf, allow_paused, live)) continue;
    best = b;
    if (b->size == need) break;
  }
  return best;
}

/* Turn the front of free block b into an allocation of need bytes; the
 * rest stays free. Returns the address, or NULL when out of memory. */
static void *take(pool *cp, struct block *b, uint64_t need) {
  struct slab *s = b->slab;
  struct block *rest = NULL;
  if (b->size - need >= POOL_ALIGN && !(rest = calloc(1, sizeof *rest))) return NULL;
  char *at = s->base + b->off;
  if (addrmap_put(at, &b->at, cp->owner, ADDR_ALLOCATION) < 0) {
    free(rest);
    return NULL;
  }
  free_unlink(b);
  if (rest) {
    *rest = (struct block){.off = b->off + need, .size = b->size - need, .free = true,
                           .slab = s, .prev = b, .next = b->next};
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = need;
    free_push(s->bucket, rest);
  }
  b->free = false;
  s->used++;
  cp->st.allocations++;
  cp->st.allocated_bytes += b->size;
  return at;
}

/* Merge free block n into its free predecessor b. */
static void merge_next(struct block *b, struct block *n) {
  free_unlink(n);
  b->size += n->size;
  b->next = n->next;
  if (n->next) n->next->prev = b;
  free(n);
}

/* Another empty slab of s's pool that is kept, or NULL. */
static struct slab *other_empty(struct slab *s) {
  for (struct list *l = s->bucket->slabs.next; l != &s->bucket->slabs; l = l->next) {
    struct slab *x = list_entry(l, struct slab, link);
    if (x != s && x->used == 0 && x->size <= SLAB_MAX) return x;
  }
  return NULL;
}

/* Free an allocation's block (out of the address map already), merging
 * it with free neighbours. When its slab becomes empty, returns the slab
 * to give back (detached), if any. */
static struct slab *release(pool *cp, struct block *b) {
  struct slab *s = b->slab;
  struct bucket *p = s->bucket;
  cp->st.allocations--;
  cp->st.allocated_bytes -= b->size;
  s->used--;
  b->free = true;
  free_push(p, b);
  if (b->next && b->next->free) merge_next(b, b->next);
  if (b->prev && b->prev->free) merge_next(b->prev, b);
  if (s->used) return NULL;
  /* Keep one empty slab per pool, the larger of two; never a one-request
   * slab. */
  struct slab *victim = s;
  if (s->size <= SLAB_MAX) {
    struct slab *o = other_empty(s);
    if (!o) return NULL;
    if (o->size < s->size) victim = o;
  }
  slab_detach(cp, victim);
  return victim;
}

/* Give a detached slab's buffer back to the daemon; if the daemon keeps
 * it, it goes back into its pool (or, without memory for that, the
 * library frees it once the daemon agrees). A free that timed out is the
 * library's to finish (client_free_later). */
static int give_back(gpumem_client *c, pool *cp, struct slab *s) {
  gpumem_buffer *buf = s->buf;
  int rc = alloc_free(c, buf);
  pthread_mutex_lock(&cp->mu);
  bool kept = rc < 0 && rc != GPUMEM_E_TIMEOUT && slab_attach(cp, s) == 0;
  pthread_mutex_unlock(&cp->mu);
  if (!kept) free(s);
  if (!kept && rc < 0 && rc != GPUMEM_E_TIMEOUT) alloc_give_up(c, buf);
  return rc;
}

/* Make a new slab of the pool for tag, device and flags that holds at
 * least need bytes, and carve need bytes from it into *ptr. */
static int grow(gpumem_client *c, pool *cp, const char *tag, int device,
                uint64_t need, unsigned flags, void **ptr) {
  uint64_t gran = gpumem_granularity(c);
  if (gran < POOL_ALIGN) gran = POOL_ALIGN;
  uint64_t least = size_round_up(need, gran);
  if (!least) return error_set(GPUMEM_E_INVALID, "size %llu is too large",
                                 (unsigned long long)need);
  unsigned backup = flags & BACKUP_BITS;
  pthread_mutex_lock(&cp->mu);
  struct bucket *p = bucket_find(cp, tag, device, backup);
  uint64_t next = p ? p->next_size : SLAB_FIRST;
  pthread_mutex_unlock(&cp->mu);
  uint64_t size = least > next ? least : size_round_up(next, gran);
  gpumem_buffer *buf;
  int rc = alloc_buffer(c, tag, device, size, flags, true, &buf);
  /* A device (or a backup limit) without room for a whole slab, or
   * smaller than one (INVALID), may still have room for this request. */
  if ((rc == GPUMEM_E_OUT_OF_MEMORY || rc == GPUMEM_E_LIMIT || rc == GPUMEM_E_INVALID) &&
      size > least)
    rc = alloc_buffer(c, tag, device, size = least, flags, true, &buf);
  if (rc < 0) return rc;
  struct slab *s = calloc(1, sizeof *s);
  pthread_mutex_lock(&cp->mu);
  p = bucket_find(cp, tag, device, backup);
  if (!p && s && (p = calloc(1, sizeof *p))) {
    snprintf(p->tag, sizeof p->tag, "%s", tag);
    p->device = device;
    p->backup = backup;
    p->next_size = SLAB_FIRST;
    list_init(&p->free_blocks);
    list_init(&p->slabs);
    p->next = cp->buckets;
    cp->buckets = p;
  }
  void *at = NULL;
  if (p && s) {
    *s = (struct slab){.buf = buf, .base = gpumem_buffer_ptr(buf),
                       .size = gpumem_buffer_size(buf), .bucket = p};
    if (slab_attach(cp, s) == 0) {
      cp->st.daemon_allocs++;
      if (size >= p->next_size && p->next_size < SLAB_MAX) p->next_size *= 2;
      at = take(cp, s->blocks, need);
      if (!at) slab_detach(cp, s);
    }
  }
  pthread_mutex_unlock(&cp->mu);
  if (at) {
    *ptr = at;
    return 0;
  }
  free(s);
  alloc_discard(c, buf);
  return error_set(GPUMEM_E_NOMEM, "out of memory for the pool's bookkeeping");
}

/* Allocate size bytes out of the pool of tag, device and flags. */
int gpumem_malloc(gpumem_client *c, const char *tag, int device, uint64_t size, unsigned flags,
                  void **ptr) {
  if (!c || !ptr) return error_set(GPUMEM_E_INVALID, "no client or no place for the pointer");
  if (!tag || !wire_tag_valid(tag))
    return error_set(GPUMEM_E_INVALID, "invalid tag: 1-%d characters of [A-Za-z0-9_.-]",
                       WIRE_TAG_MAX);
  if ((flags & ~(unsigned)(BACKUP_BITS | GPUMEM_ALLOW_PAUSED)) ||
      ((flags & BACKUP_BITS) && !(flags & GPUMEM_BACKUP)))
    return error_set(GPUMEM_E_INVALID,
                     "gpumem_malloc takes only GPUMEM_BACKUP, GPUMEM_BACKUP_RELEASE, "
                     "GPUMEM_BACKUP_PAGEABLE and GPUMEM_BACKUP_DISK (with GPUMEM_BACKUP) and "
                     "GPUMEM_ALLOW_PAUSED "
                     "(flags %#x)", flags);
  if (device < 0) return error_set(GPUMEM_E_INVALID, "device %d does not exist", device);
  uint64_t need = size_round_up(size, POOL_ALIGN);
  if (!size || !need)
    return error_set(GPUMEM_E_INVALID, "cannot allocate %llu bytes", (unsigned long long)size);
  pool *cp = c->pool;
  bool allow_paused = flags & GPUMEM_ALLOW_PAUSED;
  bool live = conn_live(c->conn);
  pthread_mutex_lock(&cp->mu);
  struct bucket *p = bucket_find(cp, tag, device, flags & BACKUP_BITS);
  struct block *b = p ? best_fit(p, need, allow_paused, live) : NULL;
  void *at = b ? take(cp, b, need) : NULL;
  pthread_mutex_unlock(&cp->mu);
  if (at) {
    *ptr = at;
    return 0;
  }
  if (b) return error_set(GPUMEM_E_NOMEM, "out of memory");
  return grow(c, cp, tag, device, need, flags, ptr);
}

/* Free the allocation or buffer that starts at ptr: the address map
 * says which (a pool buffer's address is in it only as the allocation
 * that starts there, if any). */
int gpumem_free_ptr(gpumem_client *c, void *ptr) {
  if (!c) return error_set(GPUMEM_E_INVALID, "no client");
  struct addr_entry *e = addrmap_find(ptr, &c->addrs);
  if (e && e->kind == ADDR_BUFFER) return gpumem_free(c, buffer_of_addr(e));
  pool *cp = c->pool;
  if (!e || !cp || addrmap_take(ptr, &c->addrs) != e)
    return error_set(GPUMEM_E_NOT_FOUND, "no allocation starts at %p", ptr);
  struct block *b = (struct block *)((char *)e - offsetof(struct block, at));
  pthread_mutex_lock(&cp->mu);
  struct slab *s = release(cp, b);
  pthread_mutex_unlock(&cp->mu);
  if (s) give_back(c, cp, s); /* the allocation is freed either way */
  return 0;
}

/* Give every empty slab back to the daemon. */
int64_t gpumem_trim(gpumem_client *c) {
  if (!c) return error_set(GPUMEM_E_INVALID, "no client");
  pool *cp = c->pool;
  if (!cp) return 0;
  struct list empty, *l, *n;
  list_init(&empty);
  pthread_mutex_lock(&cp->mu);
  for (struct bucket *p = cp->buckets; p; p = p->next) {
    list_for_each_safe(l, n, &p->slabs) {
      struct slab *s = list_entry(l, struct slab, link);
      if (s->used) continue;
      slab_detach(cp, s);
      list_prepend(&empty, &s->link);
    }
  }
  pthread_mutex_unlock(&cp->mu);
  int64_t bytes = 0;
  int err = 0;
  char words[320] = "";
  list_for_each_safe(l, n, &empty) {
    struct slab *s = list_entry(l, struct slab, link);
    list_remove(&s->link); /* give_back frees it, or puts it back in its bucket */
    uint64_t size = s->size;
    int rc = give_back(c, cp, s);
    if (rc == 0) {
      bytes += (int64_t)size;
    } else if (!err) {
      err = rc;
      snprintf(words, sizeof words, "%s", gpumem_last_error());
    }
  }
  /* Slabs that did not go back stay in their pools; the bytes that did
   * go count more than the failure of others. */
  if (err && !bytes) return error_set(err, "%s", words);
  return bytes;
}

/* Copy the client's sub-allocation figures. */
int gpumem_pool_stats(gpumem_client *c, struct gpumem_pool_stats *out) {
  if (!c || !out || out->size < sizeof out->size)
    return error_set(GPUMEM_E_INVALID, "no client, or no size set in the stats struct");
  struct gpumem_pool_stats st = {0};
  pool *cp = c->pool;
  if (cp) {
    pthread_mutex_lock(&cp->mu);
    st = cp->st;
    pthread_mutex_unlock(&cp->mu);
  }
  size_t n = out->size < sizeof st ? out->size : sizeof st;
  st.size = n;
  memcpy(out, &st, n);
  return 0;
}

/* Free a slab's blocks and the slab. */
static void slab_free(struct slab *s) {
  for (struct block *b = s->blocks, *n; b; b = n) {
    n = b->next;
    free(b);
  }
  free(s);
}

/* Free every bucket, slab and block record; the buffers are the
 * client's. */
void pool_destroy(pool *cp) {
  if (!cp) return;
  for (struct bucket *p = cp->buckets, *pn; p; p = pn) {
    pn = p->next;
    struct list *l, *n;
    list_for_each_safe(l, n, &p->slabs) slab_free(list_entry(l, struct slab, link));
    free(p);
  }
  pthread_mutex_destroy(&cp->mu);
  free(cp);
}
