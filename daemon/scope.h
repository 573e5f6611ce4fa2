/* The scope of a pause or resume: the tags, the devices and the sessions
 * whose buffers it covers. Sessions: without a filter, every session's
 * buffers; with own, the requester's; else those of the worker sessions
 * whose pid is one of a list and whose name starts with a prefix. */
#ifndef GPUMEMD_SCOPE_H
#define GPUMEMD_SCOPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/list.h"
#include "grace.h"
#include "outcome.h"
#include "owner.h"
#include "registry.h"

/* The sessions of a scope as a request gives them: the requester's own
 * buffers (own), or those of worker sessions of these pids (when npids >
 * 0) named with this prefix (when not NULL or empty). */
struct scope_spec {
  bool own;
  const uint32_t *pids;
  size_t npids;
  const char *prefix;
};

/* A scope kept by an operation while it runs. */
struct scope {
  char **tags;        /* each once; every tag, once resolved, if none named */
  size_t ntags;
  bool all_tags;      /* no tags named */
  uint64_t devmask;   /* the devices (bit d: device d) */
  bool own;
  struct owner *self; /* with own: the requester; NULL once it is gone */
  uint32_t *pids;     /* sessions of these pids (none: any) */
  size_t npids;
  char prefix[WIRE_NAME_MAX + 1]; /* sessions named so ("": any) */
};

/* Make sc: tags (ntags of them, none: every tag; a tag named twice is one),
 * the devices in devmask (0: all) of the ndev there are, and the sessions
 * of spec (NULL: every session), requested by requester. Returns false
 * when out of memory (sc is then to be freed all the same). */
bool scope_init(struct scope *sc, char **tags, size_t ntags, uint64_t devmask, unsigned ndev,
                struct owner *requester, const struct scope_spec *spec);

/* Free what scope_init and scope_resolve made. */
void scope_free(struct scope *sc);

/* True if the scope covers every session. */
bool scope_is_all(const struct scope *sc);

/* True if the scope covers buffer b: its device and its owner. */
bool scope_covers(const struct scope *sc, const struct buffer *b);

/* Check what the scope names against what exists now: every tag (a typo
 * is NOT_FOUND; one that may be waiting for the re-registration grace g
 * says so), some live session in owners (struct owner.link) it selects,
 * and with own, a buffer of the requester in every tag named. A scope
 * naming no tags gets every tag there is now (with own: those the
 * requester has buffers in). Returns false with the failure in o. */
bool scope_resolve(struct scope *sc, registry *reg, const struct list *owners, const grace *g,
                   struct outcome *o);

#endif
