#include "hash.h"

#include <string.h>

static uint64_t mix(uint64_t h, uint64_t w) {
  h ^= w * 0x87c37b91114253d5ull;
  h = (h << 31 | h >> 33) * 0x4cf5ad432745937full;
  return h;
}

/* Four independent lanes of 8-byte words keep the multiplier busy; the
 * tail is hashed byte by byte. */
uint64_t hash64(const void *p, size_t n, uint64_t seed) {
  const unsigned char *b = p;
  uint64_t h[4] = {seed ^ 0x9E3779B97F4A7C15ull, seed + 1, seed + 2, seed + 3};
  size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; k++) {
      uint64_t w;
      memcpy(&w, b + i + 8 * k, 8);
      h[k] = mix(h[k], w);
    }
  uint64_t out = mix(mix(mix(h[0], h[1]), h[2]), h[3]);
  for (; i < n; i++) out = mix(out, b[i]);
  return mix(out, n);
}
