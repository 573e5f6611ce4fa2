/* A map from non-zero 64-bit ids to pointers (open addressing). */
#ifndef GPUMEM_IDMAP_H
#define GPUMEM_IDMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct idmap idmap;

/* Create an empty map. */
idmap *idmap_create(void);

/* Destroy a map (not the values). */
void idmap_destroy(idmap *m);

/* Insert or replace id -> value. Returns 0 or -ENOMEM. */
int idmap_put(idmap *m, uint64_t id, void *value);

/* The value for id, or NULL. */
void *idmap_get(const idmap *m, uint64_t id);

/* Remove id if present. */
void idmap_del(idmap *m, uint64_t id);

/* Copy up to max values into out; returns how many were copied. */
size_t idmap_values(const idmap *m, void **out, size_t max);

/* Number of entries. */
size_t idmap_count(const idmap *m);

#endif
