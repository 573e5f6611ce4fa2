#include "scope.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Copy a scope for an operation. */
bool scope_init(struct scope *sc, struct owner *requester, const struct scope_spec *spec) {
  memset(sc, 0, sizeof *sc);
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

/* Free a scope's pids. */
void scope_free(struct scope *sc) {
  free(sc->pids);
  sc->pids = NULL;
  sc->npids = 0;
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

/* True if the scope covers buffer b's owner. */
bool scope_covers(const struct scope *sc, const struct buffer *b) {
  return sc->own ? b->owner == sc->self : selects(sc, b->owner);
}

/* True if a live session in owners is one the scope selects. */
bool scope_selects_any(const struct scope *sc, const struct list *owners) {
  for (const struct list *p = owners->next; p != owners; p = p->next) {
    const struct owner *o = list_entry(p, struct owner, link);
    if (!o->closed && selects(sc, o)) return true;
  }
  return false;
}

/* Describe a scope by pid and name. */
void scope_words(const struct scope *sc, char *buf, size_t len) {
  int at = 0;
  if (len) buf[0] = '\0';
  for (size_t i = 0; i < sc->npids && at < (int)len; i++)
    at += snprintf(buf + at, len - (size_t)at, "%s%u", i ? " or " : "with pid ", sc->pids[i]);
  if (sc->prefix[0] && at < (int)len)
    snprintf(buf + at, len - (size_t)at, "%snamed '%s*'", at ? " " : "", sc->prefix);
}
