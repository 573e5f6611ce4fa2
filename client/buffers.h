/* A client's buffers: every one it holds, and those the daemon knows, by
 * the daemon's id (events name buffers by id). It has its own lock; the
 * buffers themselves are their owners' to destroy. */
#ifndef GPUMEM_CLIENT_BUFFERS_H
#define GPUMEM_CLIENT_BUFFERS_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem.h"

typedef struct buffers buffers;

/* Make an empty set of buffers; NULL when out of memory. */
buffers *buffers_create(void);

/* Free a set (not its buffers). */
void buffers_destroy(buffers *r);

/* Hold a buffer, known to the daemon under its current id. Returns 0 or
 * -ENOMEM (then it is not held). */
int buffers_add(buffers *r, gpumem_buffer *b);

/* Know a held buffer under a new id (a re-registration). Returns 0, or
 * -EEXIST when another buffer has that id, or -ENOMEM. */
int buffers_know(buffers *r, gpumem_buffer *b, uint64_t id);

/* Let go of a buffer (known or not); doing it twice is harmless. */
void buffers_remove(buffers *r, gpumem_buffer *b);

/* The known buffer with this id, or NULL. */
gpumem_buffer *buffers_find(buffers *r, uint64_t id);

/* Forget every id: the daemon that knew them went away. */
void buffers_unknow_all(buffers *r);

/* Every buffer held, in a malloc'd array (*n of them); NULL with *n 0
 * when there is none or out of memory. */
gpumem_buffer **buffers_list(buffers *r, size_t *n);

/* The held buffer whose range holds [ptr, ptr + len), with ptr's offset
 * in it into *off; NULL when none does. */
gpumem_buffer *buffers_holding(buffers *r, const void *ptr, uint64_t len, uint64_t *off);

/* The number of buffers held. */
size_t buffers_count(buffers *r);

/* Some held buffer, or NULL when none is left. */
gpumem_buffer *buffers_any(buffers *r);

#endif
