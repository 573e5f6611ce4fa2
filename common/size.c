#include "size.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Parse a size; fractions are allowed with a suffix ("1.5G"). */
int size_parse(const char *text, uint64_t *out) {
  if (!text || !isdigit((unsigned char)text[0])) return -EINVAL;
  char *end;
  errno = 0;
  unsigned long long whole = strtoull(text, &end, 10);
  if (errno == ERANGE) return -ERANGE;
  double frac = 0;
  if (*end == '.') {
    char *fend;
    frac = strtod(end, &fend);
    if (fend == end + 1) return -EINVAL;
    end = fend;
  }
  uint64_t mult = 1;
  if (*end) {
    switch (toupper((unsigned char)*end)) {
    case 'K': mult = 1ull << 10; break;
    case 'M': mult = 1ull << 20; break;
    case 'G': mult = 1ull << 30; break;
    case 'T': mult = 1ull << 40; break;
    case 'B': mult = 1; break;
    default: return -EINVAL;
    }
    end++;
    if (mult > 1 && (strcasecmp(end, "iB") == 0 || strcasecmp(end, "B") == 0))
      end += strlen(end);
    if (*end) return -EINVAL;
  }
  if (frac != 0 && mult == 1) return -EINVAL;
  if (whole > UINT64_MAX / mult) return -ERANGE;
  uint64_t v = whole * mult;
  uint64_t f = (uint64_t)llround(frac * (double)mult);
  if (v > UINT64_MAX - f) return -ERANGE;
  *out = v + f;
  return 0;
}

/* Format bytes with the largest unit that keeps the number at least 1. */
const char *size_format(uint64_t bytes, char *buf, size_t buflen) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  double v = (double)bytes;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(buf, buflen, "%llu B", (unsigned long long)bytes);
  else
    snprintf(buf, buflen, v < 10 ? "%.2f %s" : v < 100 ? "%.1f %s" : "%.0f %s",
             v, units[u]);
  return buf;
}

/* Round up to a power-of-two multiple. */
uint64_t size_round_up(uint64_t n, uint64_t align) {
  if (n > UINT64_MAX - (align - 1)) return 0;
  return (n + align - 1) & ~(align - 1);
}

/* Parse "500ms", "10s", "2m" or plain seconds into milliseconds. */
int duration_parse(const char *text, uint64_t max_ms, uint64_t *ms) {
  if (!text || !(isdigit((unsigned char)text[0]) || text[0] == '.')) return -EINVAL;
  char *end;
  errno = 0;
  double v = strtod(text, &end);
  if (errno == ERANGE) return -ERANGE;
  if (end == text || v != v) return -EINVAL;
  double mult;
  if (strcmp(end, "ms") == 0) mult = 1;
  else if (*end == '\0' || strcmp(end, "s") == 0) mult = 1000;
  else if (strcmp(end, "m") == 0 || strcmp(end, "min") == 0) mult = 60000;
  else return -EINVAL;
  double r = v * mult;
  if (r < 1 || r > (double)max_ms) return -ERANGE;
  *ms = (uint64_t)(r + 0.5);
  return 0;
}
