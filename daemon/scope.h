/* The scope of a pause or resume: whose buffers it covers. Without one,
 * every session's; with own, the requester's; else those of the worker
 * sessions whose pid is one of a list and whose name starts with a
 * prefix. */
#ifndef GPUMEMD_SCOPE_H
#define GPUMEMD_SCOPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/list.h"
#include "owner.h"
#include "registry.h"

/* A scope as a request gives it: the requester's own buffers (own), or
 * those of worker sessions of these pids (when npids > 0) named with
 * this prefix (when not NULL or empty). */
struct scope_spec {
  bool own;
  const uint32_t *pids;
  size_t npids;
  const char *prefix;
};

/* A scope kept by an operation while it runs. */
struct scope {
  bool own;
  struct owner *self; /* with own: the requester; NULL once it is gone */
  uint32_t *pids;     /* sessions of these pids (none: any) */
  size_t npids;
  char prefix[WIRE_NAME_MAX + 1]; /* sessions named so ("": any) */
};

/* Copy spec (NULL: every session) into sc, requested by requester.
 * Returns false when out of memory. */
bool scope_init(struct scope *sc, struct owner *requester, const struct scope_spec *spec);

/* Free what scope_init made. */
void scope_free(struct scope *sc);

/* True if the scope covers every session. */
bool scope_is_all(const struct scope *sc);

/* True if the scope covers buffer b: its owner (not its device). */
bool scope_covers(const struct scope *sc, const struct buffer *b);

/* True if some session in owners (a list of struct owner.link) that has
 * not ended is one the scope selects by pid and name. */
bool scope_selects_any(const struct scope *sc, const struct list *owners);

/* Say the pids and name the scope selects ("with pid 12 or 34 named
 * 'engine-*'") into buf. */
void scope_words(const struct scope *sc, char *buf, size_t len);

#endif
