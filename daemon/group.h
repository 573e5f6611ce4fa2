/* A group: one owner's buffers in one step of a pause or resume, and the
 * events sent for them. The engine (engine.c) makes one per owner and
 * step, and settles it when the owner has acked every event; a group
 * whose operation stopped waiting is a straggler, settled by its late
 * ack. */
#ifndef GPUMEMD_GROUP_H
#define GPUMEMD_GROUP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/idmap.h"
#include "common/list.h"
#include "fault.h"
#include "outcome.h"
#include "owner.h"
#include "registry.h"

enum group_kind {
  GROUP_UNMAP,    /* a pause's Unmap */
  GROUP_REMAP,    /* a resume's Remap */
  GROUP_ROLLBACK, /* Unmap of what a failed resume had mapped */
};

struct op; /* the engine's operation */

struct group {
  struct owner *s;
  struct op *op; /* NULL once the operation stopped waiting (a straggler) */
  enum group_kind kind;
  bool done;
  uint64_t first_event;
  size_t nevents, acked;
  size_t *ends;   /* event k carried ids[ends[k-1] .. ends[k]) */
  uint64_t *ids;
  bool *failed;   /* the owner could not unmap or map it */
  bool *made;     /* this resume created its memory */
  size_t *pieces; /* backup pieces handed to the owner to copy (0: the daemon copies) */
  bool *kept;     /* or the backup memory the owner kept was handed by reference */
  uint64_t *piece_sizes; /* theirs, in id and piece order */
  size_t npiece_sizes;
  uint64_t handed; /* bytes of the buffers whose backups were handed */
  int *fds;       /* the fds its events carry: a Remap's chunks and backup
                     pieces, per buffer in id order; an Unmap's pieces */
  size_t nfds;
  uint64_t sent_ns; /* its events went out (uv_hrtime) */
  size_t nids, cap;
  char why[WIRE_MAX_MESSAGE + 1]; /* the owner's words for its first failure */
  struct list link; /* op's groups, or the engine's stragglers */
  struct list unmapped; /* the engine's acked Unmaps, settled at the turn's end */
  bool later; /* acked, but left by the last settling for its process's other acks */
};

/* A new, empty group of owner o's buffers for op; NULL out of memory. */
struct group *group_new(struct op *op, struct owner *o, enum group_kind kind);

/* Add buffer id (made: this resume created its memory). Returns 0, or -1
 * out of memory. */
int group_add(struct group *g, uint64_t id, bool made);

/* Give the group nevents event ids from *next_event on, each found in
 * events (event id -> group) until acked or the group is freed. */
void group_number(struct group *g, idmap *events, uint64_t *next_event, size_t nevents);

/* Export every chunk of the group's buffers into g->fds (a Remap's),
 * each followed by its backup's pieces where its owner copies it in
 * (registry_owner_copies); where they cannot be handed, the backup is
 * copied in here. */
wire_code group_export(struct group *g, registry *reg, struct fault *f);

/* Hand the owner of an Unmap group the backup memory of each buffer it
 * copies itself (registry_owner_copies), as many as one event's fds
 * allow; the daemon copies the others once they are unmapped. */
void group_hand_backups(struct group *g, registry *reg);

/* True if the owner copies buffer i's backup (handed by fds or kept). */
bool group_owner_copies(const struct group *g, size_t i);

/* The share of buffer i (of size bytes) in the time since the group's
 * events went out, in microseconds (at least 1): the owner copied the
 * backups handed to it one after another. */
uint64_t group_copy_us(const struct group *g, uint64_t size);

/* Note what an owner's ack of the group's events from..to says: the
 * buffers it could not handle (all of them when it names none but fails)
 * and, first time, its words (logged for a failed ack). Returns how many
 * ids it named that those events did not carry, the first in *stranger. */
size_t group_note_ack(struct group *g, size_t from, size_t to, const Gpumem__Wire__EventAck *ack,
                      uint64_t *stranger);

/* Record in o, naming the owner, each buffer of a Remap group its owner
 * could not map (the resume then fails: nothing resumed). */
void group_fail_remaps(const struct group *g, struct outcome *o);

/* Free a group: its event ids leave events, its fds not sent are closed,
 * it leaves its list. */
void group_free(struct group *g, idmap *events);

#endif
