/* The gate between the daemon's backup pieces and its other driver calls
 * (gpu/vmm_backup.c says why pieces wait). Every driver call of the
 * daemon's half is between vmm_gate_begin and vmm_gate_end (a query:
 * vmm_gate_end_query); a piece waits in vmm_gate_wait_piece until none is
 * in progress and, in the background, none ended a moment ago. Internal
 * to gpu/. */
#ifndef GPUMEM_GPU_VMM_GATE_H
#define GPUMEM_GPU_VMM_GATE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

struct vmm_gate {
  pthread_mutex_t mu;
  pthread_cond_t cv;             /* on the monotonic clock */
  atomic_uint calls;             /* other driver calls in progress */
  atomic_uint pieces_waiting;    /* pieces waiting for them to end */
  atomic_uint_fast64_t last_end; /* when the last of them ended, in ns */
  bool piece_busy;               /* a piece is being pinned (under mu) */
};

/* Make a gate with nothing in progress. */
void vmm_gate_init(struct vmm_gate *g);

/* Free a gate nobody waits at. */
void vmm_gate_destroy(struct vmm_gate *g);

/* A driver call other than pinning a backup piece begins: no piece starts
 * until it ends. */
void vmm_gate_begin(struct vmm_gate *g);

/* A driver call ends: the last one lets waiting pieces go. */
void vmm_gate_end(struct vmm_gate *g);

/* A query (memory figures, processes, bus ids) ends: like vmm_gate_end,
 * but it does not count as traffic a background piece waits to be quiet
 * (a monitor polling status must not hold backups off). */
void vmm_gate_end_query(struct vmm_gate *g);

/* A backup piece waits until no other driver call is in progress and, in
 * the background, none ended in the last few milliseconds; to pin, also
 * until no other piece is being pinned, and then marks itself pinning. */
void vmm_gate_wait_piece(struct vmm_gate *g, bool background, bool pin);

/* A backup piece is pinned: the next one may go. */
void vmm_gate_end_piece(struct vmm_gate *g);

#endif
