#include "event.h"

#include <string.h>

#include "common/frame.h"

/* Send one Unmap event for a group of buffers. */
void event_send_unmap(const struct outbox *out, struct owner *o, uint64_t id,
                      const uint64_t *ids, size_t n) {
  Gpumem__Wire__UnmapEvent ev = GPUMEM__WIRE__UNMAP_EVENT__INIT;
  ev.buffer_ids = (uint64_t *)ids;
  ev.n_buffer_ids = n;
  wire_env env = wire_envelope(id, GPUMEM__WIRE__ENVELOPE__BODY_UNMAP, &ev);
  out->send(out->ctx, o, &env, NULL, 0);
}

/* The fds buffer id's Remap carries (legacy IPC memory has none). */
static size_t fds_of(registry *reg, uint64_t id) {
  const struct buffer *b = registry_find(reg, id);
  return b->ipc ? 0 : b->nchunks;
}

/* Count the Remap events: a new one where the fds would pass the limit. */
size_t event_remap_count(registry *reg, const uint64_t *ids, size_t n) {
  size_t nevents = 0;
  for (size_t i = 0, fds = 0; i < n; i++) {
    size_t k = fds_of(reg, ids[i]);
    if (i == 0 || fds + k > FRAME_MAX_FDS) {
      nevents++;
      fds = 0;
    }
    fds += k;
  }
  return nevents;
}

/* Send the Remap events, each with as many buffers as its fds allow. */
int event_send_remap(const struct outbox *out, struct owner *o, registry *reg, uint64_t first_id,
                     const uint64_t *ids, size_t n, int *fds, size_t *ends) {
  size_t nevents = event_remap_count(reg, ids, n);
  Gpumem__Wire__RemapEntry ent[FRAME_MAX_FDS], *entp[FRAME_MAX_FDS];
  size_t i = 0, fd_at = 0;
  for (size_t ev_i = 0; ev_i < nevents; ev_i++) {
    size_t nent = 0, nfds = 0, first_fd = fd_at;
    while (i < n) {
      struct buffer *b = registry_find(reg, ids[i]);
      size_t k = b->ipc ? 0 : b->nchunks;
      if (nent > 0 && nfds + k > FRAME_MAX_FDS) break;
      gpumem__wire__remap_entry__init(&ent[nent]);
      ent[nent].buffer_id = b->id;
      ent[nent].chunk_sizes = b->chunk_sizes;
      ent[nent].n_chunk_sizes = b->nchunks;
      entp[nent] = &ent[nent];
      nent++;
      nfds += k;
      i++;
    }
    ends[ev_i] = i;
    fd_at += nfds;
    Gpumem__Wire__RemapEvent rm = GPUMEM__WIRE__REMAP_EVENT__INIT;
    rm.entries = entp;
    rm.n_entries = nent;
    wire_env env = wire_envelope(first_id + ev_i, GPUMEM__WIRE__ENVELOPE__BODY_REMAP, &rm);
    env.fd_count = (uint32_t)nfds;
    int sent[FRAME_MAX_FDS];
    memcpy(sent, fds + first_fd, nfds * sizeof *sent);
    for (size_t k = first_fd; k < fd_at; k++) fds[k] = -1; /* the outbox owns them */
    if (out->send(out->ctx, o, &env, sent, nfds) < 0) return -1;
  }
  return 0;
}
