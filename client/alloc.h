/* Buffers at the daemon: allocation (gpumem_alloc, and the slabs of
 * gpumem_malloc's pool) and their frees. */
#ifndef GPUMEM_CLIENT_ALLOC_H
#define GPUMEM_CLIENT_ALLOC_H

#include <stdbool.h>
#include <stdint.h>

#include "gpumem.h"

/* The flags that say how a backup is kept (each with GPUMEM_BACKUP). */
#define GPUMEM_BACKUP_POLICY (GPUMEM_BACKUP_RELEASE | GPUMEM_BACKUP_PAGEABLE | GPUMEM_BACKUP_DISK)

/* Allocate a buffer (gpumem_alloc's work); pooled marks it a slab of the
 * pool from the start. Returns 0 with *out, or a negative code. */
int alloc_buffer(gpumem_client *c, const char *tag, int device, uint64_t size, unsigned flags,
                 bool pooled, gpumem_buffer **out);

/* Free a buffer at the daemon, then here (gpumem_free without its refusal
 * of a pool's slab). A free that times out is the library's to finish
 * (the buffer is gone for the caller); any other failure leaves the
 * buffer the caller's. */
int alloc_free(gpumem_client *c, gpumem_buffer *b);

/* Give up a buffer whose alloc_free failed other than by timing out (a
 * free that timed out is the library's already, and the buffer may be
 * gone): the library finishes its free, sending it again while the
 * daemon refuses it. */
void alloc_give_up(gpumem_client *c, gpumem_buffer *b);

/* Free a buffer the caller no longer wants: alloc_free, then
 * alloc_give_up if it failed other than by timing out. */
int alloc_discard(gpumem_client *c, gpumem_buffer *b);

#endif
