#include "event.h"

#include <stdlib.h>
#include <string.h>

#include "common/frame.h"

/* Send one Unmap event for a group of buffers, with its backups. */
void event_send_unmap(const struct outbox *out, struct group *g) {
  Gpumem__Wire__UnmapEvent ev = GPUMEM__WIRE__UNMAP_EVENT__INIT;
  Gpumem__Wire__BackupMemory mem[FRAME_MAX_FDS], *memp[FRAME_MAX_FDS];
  ev.buffer_ids = g->ids;
  ev.n_buffer_ids = g->nids;
  for (size_t i = 0, at = 0; i < g->nids; at += g->pieces[i++]) {
    if (!group_owner_copies(g, i) || ev.n_backups == FRAME_MAX_FDS) continue; /* never more */
    gpumem__wire__backup_memory__init(&mem[ev.n_backups]);
    mem[ev.n_backups].buffer_id = g->ids[i];
    mem[ev.n_backups].kept = g->kept[i];
    mem[ev.n_backups].piece_sizes = g->piece_sizes + at;
    mem[ev.n_backups].n_piece_sizes = g->pieces[i];
    memp[ev.n_backups] = &mem[ev.n_backups];
    ev.n_backups++;
  }
  ev.backups = memp;
  wire_env env = wire_envelope(g->first_event, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP, &ev);
  env.fd_count = (uint32_t)g->nfds;
  int sent[FRAME_MAX_FDS];
  if (g->nfds) memcpy(sent, g->fds, g->nfds * sizeof *sent);
  for (size_t k = 0; k < g->nfds; k++) g->fds[k] = -1; /* the outbox owns them */
  out->send(out->ctx, g->s, &env, sent, g->nfds);
}

/* The fds buffer i of g's Remap carries: its chunks' (legacy IPC memory
 * has none) and its backup's pieces. */
static size_t fds_of(registry *reg, const struct group *g, size_t i) {
  const struct buffer *b = registry_find(reg, g->ids[i]);
  return (b->ipc ? 0 : b->nchunks) + g->pieces[i];
}

/* Count the Remap events: a new one where the fds would pass the limit. */
size_t event_remap_count(registry *reg, const struct group *g) {
  size_t nevents = 0;
  for (size_t i = 0, fds = 0, entries = 0; i < g->nids; i++) {
    size_t k = fds_of(reg, g, i);
    if (i == 0 || fds + k > FRAME_MAX_FDS || entries == FRAME_MAX_FDS) {
      nevents++;
      fds = 0;
      entries = 0;
    }
    fds += k;
    entries++;
  }
  return nevents;
}

/* Send the Remap events, each with as many buffers as its fds allow. */
int event_send_remap(const struct outbox *out, registry *reg, struct group *g) {
  size_t nevents = event_remap_count(reg, g);
  Gpumem__Wire__RemapEntry ent[FRAME_MAX_FDS], *entp[FRAME_MAX_FDS];
  size_t i = 0, fd_at = 0, piece_at = 0;
  for (size_t ev_i = 0; ev_i < nevents; ev_i++) {
    size_t nent = 0, nfds = 0, first_fd = fd_at;
    while (i < g->nids) {
      struct buffer *b = registry_find(reg, g->ids[i]);
      size_t k = fds_of(reg, g, i);
      if (nent > 0 && (nfds + k > FRAME_MAX_FDS || nent == FRAME_MAX_FDS)) break;
      gpumem__wire__remap_entry__init(&ent[nent]);
      ent[nent].buffer_id = b->id;
      ent[nent].chunk_sizes = b->chunk_sizes;
      ent[nent].n_chunk_sizes = b->nchunks;
      ent[nent].backup_piece_sizes = g->piece_sizes + piece_at;
      ent[nent].n_backup_piece_sizes = g->pieces[i];
      ent[nent].backup_kept = g->kept[i];
      ent[nent].generation = b->tag->generation;
      entp[nent] = &ent[nent];
      piece_at += g->pieces[i];
      nent++;
      nfds += k;
      i++;
    }
    g->ends[ev_i] = i;
    fd_at += nfds;
    Gpumem__Wire__RemapEvent rm = GPUMEM__WIRE__REMAP_EVENT__INIT;
    rm.entries = entp;
    rm.n_entries = nent;
    wire_env env = wire_envelope(g->first_event + ev_i, GPUMEM__WIRE__ENVELOPE__BODY_REMAP, &rm);
    env.fd_count = (uint32_t)nfds;
    int sent[FRAME_MAX_FDS];
    if (nfds) memcpy(sent, g->fds + first_fd, nfds * sizeof *sent);
    for (size_t k = first_fd; k < fd_at; k++) g->fds[k] = -1; /* the outbox owns them */
    if (out->send(out->ctx, g->s, &env, sent, nfds) < 0) return -1;
  }
  return 0;
}
