#include "group.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <uv.h>

#include "common/frame.h"
#include "common/log.h"

/* A new group of one owner's buffers. */
struct group *group_new(struct op *op, struct owner *o, enum group_kind kind) {
  struct group *g = calloc(1, sizeof *g);
  if (!g) return NULL;
  g->s = o;
  g->op = op;
  g->kind = kind;
  list_init(&g->link);
  list_init(&g->unmapped);
  return g;
}

/* Add a buffer id to a group. */
int group_add(struct group *g, uint64_t id, bool made) {
  if (g->nids == g->cap) {
    size_t cap = g->cap ? 2 * g->cap : 16;
    uint64_t *ids = realloc(g->ids, cap * sizeof *ids);
    if (ids) g->ids = ids;
    bool *failed = ids ? realloc(g->failed, cap * sizeof *failed) : NULL;
    if (failed) g->failed = failed;
    bool *m = failed ? realloc(g->made, cap * sizeof *m) : NULL;
    if (m) g->made = m;
    size_t *pieces = m ? realloc(g->pieces, cap * sizeof *pieces) : NULL;
    if (pieces) g->pieces = pieces;
    bool *kept = pieces ? realloc(g->kept, cap * sizeof *kept) : NULL;
    if (!kept) return -1;
    g->kept = kept;
    g->cap = cap;
  }
  g->pieces[g->nids] = 0;
  g->kept[g->nids] = false;
  g->failed[g->nids] = false;
  g->made[g->nids] = made;
  g->ids[g->nids++] = id;
  return 0;
}

/* Give a group its events' ids. */
void group_number(struct group *g, idmap *events, uint64_t *next_event, size_t nevents) {
  g->first_event = *next_event;
  g->nevents = nevents;
  *next_event += nevents;
  for (size_t i = 0; i < nevents; i++) idmap_put(events, g->first_event + i, g);
}

/* Room for fds and piece sizes: a buffer's chunks and backup pieces
 * together never pass one frame's fds. */
static bool room(struct group *g, size_t fds, size_t pieces) {
  return (g->fds = malloc((fds + 1) * sizeof *g->fds)) &&
         (g->piece_sizes = malloc((pieces + 1) * sizeof *g->piece_sizes));
}

/* Hand buffer i (b) of the group its backup memory, within max more
 * fds, appended to the group's fds and piece sizes. */
static bool hand(struct group *g, registry *reg, size_t i, struct buffer *b, size_t max) {
  if (!registry_hand_backup(reg, b, g->fds + g->nfds, g->piece_sizes + g->npiece_sizes, max,
                            &g->pieces[i], &g->kept[i]))
    return false;
  g->nfds += g->pieces[i];
  g->npiece_sizes += g->pieces[i];
  g->handed += b->size;
  return true;
}

/* Export every chunk of the group's buffers, and the backup pieces of
 * those whose owner copies them in. */
wire_code group_export(struct group *g, registry *reg, struct fault *f) {
  size_t total = 0, pieces = 0;
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = registry_find(reg, g->ids[i]);
    total += b->ipc ? 0 : b->nchunks;
    if (registry_owner_copies(reg, b, true)) pieces += FRAME_MAX_FDS - b->nchunks;
  }
  if (!room(g, total + pieces, pieces))
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = registry_find(reg, g->ids[i]);
    wire_code rc = registry_export(reg, b, g->fds + g->nfds, f);
    if (rc) return rc;
    g->nfds += b->ipc ? 0 : b->nchunks;
    if (registry_owner_copies(reg, b, true) && !hand(g, reg, i, b, FRAME_MAX_FDS - b->nchunks) &&
        (rc = registry_restore(reg, b, f)))
      return rc;
  }
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Hand out backups within one Unmap's fds, and as many backups (kept
 * ones carry no fds) as one event lists (event_send_unmap). */
void group_hand_backups(struct group *g, registry *reg) {
  if (!room(g, FRAME_MAX_FDS, FRAME_MAX_FDS)) return; /* out of memory: the daemon copies */
  size_t handed = 0;
  for (size_t i = 0; i < g->nids && g->nfds < FRAME_MAX_FDS && handed < FRAME_MAX_FDS; i++) {
    struct buffer *b = registry_find(reg, g->ids[i]);
    if (registry_owner_copies(reg, b, false) && hand(g, reg, i, b, FRAME_MAX_FDS - g->nfds))
      handed++;
  }
}

/* Whether the owner copies buffer i. */
bool group_owner_copies(const struct group *g, size_t i) { return g->pieces[i] || g->kept[i]; }

/* A buffer's share of the owner's copying time. */
uint64_t group_copy_us(const struct group *g, uint64_t size) {
  double share = g->handed ? (double)size / (double)g->handed : 1.0;
  uint64_t us = (uint64_t)((double)(uv_hrtime() - g->sent_ns) / 1e3 * share);
  return us ? us : 1;
}

/* Note which buffers an ack says failed, and why. */
size_t group_note_ack(struct group *g, size_t from, size_t to, const Gpumem__Wire__EventAck *ack,
                      uint64_t *stranger) {
  bool bad = ack->code != GPUMEM__WIRE__ERROR_CODE__OK || ack->n_failed_ids;
  for (size_t i = from; bad && ack->n_failed_ids == 0 && i < to; i++) g->failed[i] = true;
  size_t strangers = 0;
  for (size_t j = 0; j < ack->n_failed_ids; j++) {
    size_t i = from;
    while (i < to && g->ids[i] != ack->failed_ids[j]) i++;
    if (i < to)
      g->failed[i] = true;
    else if (strangers++ == 0)
      *stranger = ack->failed_ids[j];
  }
  if (bad && !g->why[0])
    snprintf(g->why, sizeof g->why, "%s", ack->message[0] ? ack->message : wire_code_name(ack->code));
  if (bad)
    log_warn("pid %d: %s failed: %s", (int)g->s->pid, g->kind == GROUP_REMAP ? "remap" : "unmap",
             g->why);
  return strangers;
}

/* Record the buffers a Remap's owner could not map. */
void group_fail_remaps(const struct group *g, struct outcome *o) {
  for (size_t i = 0; i < g->nids; i++)
    if (g->failed[i]) {
      outcome_note_pid(o, g->s->pid);
      outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
                   "pid %d could not map buffer %llu: %s; nothing resumed", (int)g->s->pid,
                   (unsigned long long)g->ids[i], g->why);
    }
}

/* Free a group and what it holds. */
void group_free(struct group *g, idmap *events) {
  for (size_t i = 0; i < g->nevents; i++)
    if (idmap_get(events, g->first_event + i) == g) idmap_del(events, g->first_event + i);
  for (size_t i = 0; i < g->nfds; i++)
    if (g->fds[i] >= 0) close(g->fds[i]);
  list_remove(&g->link);
  list_remove(&g->unmapped);
  free(g->ends);
  free(g->ids);
  free(g->failed);
  free(g->made);
  free(g->pieces);
  free(g->kept);
  free(g->piece_sizes);
  free(g->fds);
  free(g);
}
