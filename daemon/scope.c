#include "scope.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/idmap.h"
#include "common/limits.h"

/* Make a scope for an operation. */
bool scope_init(struct scope *sc, char **tags, size_t ntags, uint64_t devmask, unsigned ndev,
                struct owner *requester, const struct scope_spec *spec) {
  memset(sc, 0, sizeof *sc);
  uint64_t all = ndev >= GPUMEM_MAX_DEVICES ? ~0ull : (1ull << ndev) - 1;
  sc->devmask = (devmask ? devmask : ~0ull) & all;
  sc->all_tags = ntags == 0;
  if (!(sc->tags = calloc(ntags + 1, sizeof *sc->tags))) return false;
  for (size_t i = 0; i < ntags; i++) {
    bool seen = false;
    for (size_t j = 0; j < sc->ntags && !seen; j++) seen = strcmp(sc->tags[j], tags[i]) == 0;
    if (!seen && !(sc->tags[sc->ntags++] = strdup(tags[i]))) return false;
  }
  if (!spec) return true;
  sc->own = spec->own;
  sc->self = spec->own ? requester : NULL;
  if (spec->prefix) snprintf(sc->prefix, sizeof sc->prefix, "%s", spec->prefix);
  if (spec->npids == 0) return true;
  if (!(sc->pids = malloc(spec->npids * sizeof *sc->pids))) return false;
  memcpy(sc->pids, spec->pids, spec->npids * sizeof *sc->pids);
  sc->npids = spec->npids;
  return true;
}

/* Free a scope's tags and pids. */
void scope_free(struct scope *sc) {
  for (size_t i = 0; sc->tags && i < sc->ntags; i++) free(sc->tags[i]);
  free(sc->tags);
  free(sc->pids);
  sc->tags = NULL;
  sc->pids = NULL;
  sc->ntags = sc->npids = 0;
}

/* True if the scope covers every session. */
bool scope_is_all(const struct scope *sc) { return !sc->own && sc->npids == 0 && !sc->prefix[0]; }

/* True if a scope without own selects owner o: a worker, by pid and name. */
static bool selects(const struct scope *sc, const struct owner *o) {
  if (o->role != GPUMEM__WIRE__ROLE__ROLE_WORKER) return false;
  bool pid_ok = sc->npids == 0;
  for (size_t i = 0; i < sc->npids && !pid_ok; i++)
    pid_ok = o->pid > 0 && sc->pids[i] == (uint32_t)o->pid;
  return pid_ok && strncmp(o->name, sc->prefix, strlen(sc->prefix)) == 0;
}

/* True if the scope covers buffer b. */
bool scope_covers(const struct scope *sc, const struct buffer *b) {
  if (!(sc->devmask & (1ull << b->device))) return false;
  return sc->own ? b->owner == sc->self : selects(sc, b->owner);
}

/* Describe the sessions of a scope by pid and name ("with pid 12 or 34
 * named 'engine-*'"). */
static void words(const struct scope *sc, char *buf, size_t len) {
  int at = 0;
  if (len) buf[0] = '\0';
  for (size_t i = 0; i < sc->npids && at < (int)len; i++)
    at += snprintf(buf + at, len - (size_t)at, "%s%u", i ? " or " : "with pid ", sc->pids[i]);
  if (sc->prefix[0] && at < (int)len)
    snprintf(buf + at, len - (size_t)at, "%snamed '%s*'", at ? " " : "", sc->prefix);
}

/* Name every tag there is now (with own, those the requester has buffers
 * in, so that a worker's own operation costs what it holds, not what the
 * node holds). */
static bool name_all_tags(struct scope *sc, registry *reg) {
  struct list *tags = registry_tags(reg), *p;
  size_t most = sc->own ? (sc->self ? sc->self->nbuffers : 0) : registry_tag_count(reg);
  char **names = calloc(most + 1, sizeof *names);
  idmap *seen = sc->own ? idmap_create() : NULL;
  if (!names || (sc->own && !seen)) {
    free(names);
    idmap_destroy(seen);
    return false;
  }
  free(sc->tags);
  sc->tags = names;
  bool ok = true;
  if (sc->own) {
    for (p = sc->self ? sc->self->buffers.next : NULL; ok && p && p != &sc->self->buffers;
         p = p->next) {
      struct tag *t = list_entry(p, struct buffer, owner_link)->tag;
      if (idmap_get(seen, t->seq)) continue;
      ok = idmap_put(seen, t->seq, t) == 0 && (sc->tags[sc->ntags++] = strdup(t->name));
    }
  } else {
    for (p = tags->next; ok && p != tags; p = p->next)
      ok = (sc->tags[sc->ntags++] = strdup(list_entry(p, struct tag, link)->name)) != NULL;
  }
  idmap_destroy(seen);
  return ok;
}

/* True if owner o has a buffer in tag t. */
static bool has_buffer_in(const struct owner *o, const struct tag *t) {
  for (const struct list *p = t->buffers.next; p != &t->buffers; p = p->next)
    if (list_entry(p, struct buffer, tag_link)->owner == o) return true;
  return false;
}

/* Check the scope's names against what exists. */
bool scope_resolve(struct scope *sc, registry *reg, const struct list *owners, const grace *g,
                   struct outcome *o) {
  if (sc->all_tags && !name_all_tags(sc, reg)) {
    outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    return false;
  }
  for (size_t t = 0; t < sc->ntags; t++) {
    struct tag *tag = registry_tag(reg, sc->tags[t]);
    if (!tag && sc->own) { /* one answer whether or not another uid has the tag */
      outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND,
                   "this session has no buffers in tag '%s'", sc->tags[t]);
      return false;
    }
    if (!tag && grace_active(g)) {
      outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND,
                   "no tag '%s' yet: the re-registration grace runs %.1f s more, and "
                   "allocations in new tags wait for it to end (%zu waiting)",
                   sc->tags[t], (double)grace_left_ms(g) / 1e3, grace_waiting(g));
      return false;
    }
    if (!tag) {
      outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, "no tag '%s'", sc->tags[t]);
      return false;
    }
    if (sc->own && !sc->all_tags && (!sc->self || !has_buffer_in(sc->self, tag))) {
      outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND,
                   "this session has no buffers in tag '%s'", sc->tags[t]);
      return false;
    }
  }
  if (sc->own || scope_is_all(sc)) return true;
  for (const struct list *p = owners->next; p != owners; p = p->next) {
    const struct owner *w = list_entry(p, struct owner, link);
    if (!w->closed && selects(sc, w)) return true;
  }
  char said[WIRE_NAME_MAX + 128];
  words(sc, said, sizeof said);
  outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, "no worker session %s", said);
  return false;
}
