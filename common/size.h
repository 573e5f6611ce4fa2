/* Byte sizes as people write them: 512, 64K, 2M, 1.5G (powers of 1024). */
#ifndef GPUMEM_SIZE_H
#define GPUMEM_SIZE_H

#include <stddef.h>
#include <stdint.h>

/* Parse a size with an optional K/M/G/T suffix (and optional "iB"/"B").
 * Returns 0, or -EINVAL for malformed text and -ERANGE on overflow. */
int size_parse(const char *text, uint64_t *out);

/* Format bytes for people ("1.50 GiB", "64.0 MiB", "512 B") into buf. */
const char *size_format(uint64_t bytes, char *buf, size_t buflen);

/* Round n up to a multiple of align (a power of two); 0 on overflow. */
uint64_t size_round_up(uint64_t n, uint64_t align);

/* Parse a duration into milliseconds: "500ms", "10s", "2m", or a plain
 * number of seconds ("2" is 2s; fractions allowed, "1.5s"). Returns 0, or
 * -EINVAL for malformed text and -ERANGE above max_ms or below 1 ms. */
int duration_parse(const char *text, uint64_t max_ms, uint64_t *ms);

#endif
