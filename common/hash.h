/* A fast 64-bit hash of memory, for checking backups (not cryptographic). */
#ifndef GPUMEM_HASH_H
#define GPUMEM_HASH_H

#include <stddef.h>
#include <stdint.h>

/* Hash n bytes at p, continuing from seed (0 to start). */
uint64_t hash64(const void *p, size_t n, uint64_t seed);

#endif
