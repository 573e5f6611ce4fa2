/* Escaping names for terminals, JSON and Prometheus labels. */
#include "ctl/text.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "common/wire.h"

/* The character at p under the daemon's own text check: its length, 1 for
 * a byte that does not start UTF-8 (*bad true then), and whether it must
 * be escaped (*esc: not UTF-8, or a C0, DEL or C1 control character). */
size_t text_char(const unsigned char *p, bool *esc) {
  bool control = false;
  size_t n = wire_char((const char *)p, &control);
  *esc = n == 0 || control;
  return n ? n : 1;
}

/* Print s as a JSON string: a control character as \u00XX of its code
 * point, a byte that is not UTF-8 as \u00XX of the byte, so that the
 * output is always valid UTF-8 and always parses. */
void json_str(const char *s) {
  putchar('"');
  for (const unsigned char *p = (const unsigned char *)s; *p;) {
    bool esc;
    size_t n = text_char(p, &esc);
    if (*p == '"' || *p == '\\') printf("\\%c", *p);
    else if (esc && n == 2) printf("\\u%04x", (unsigned)((p[0] & 0x1f) << 6 | (p[1] & 0x3f)));
    else if (esc) printf("\\u%04x", *p);
    else fwrite(p, 1, n, stdout);
    p += n;
  }
  putchar('"');
}

/* A name fit for a terminal: each byte of a control character or of what
 * is not UTF-8 becomes \xNN, a backslash \\; cut to fit buf. */
const char *printable(const char *s, char *buf, size_t len) {
  size_t o = 0;
  for (const unsigned char *p = (const unsigned char *)s; *p;) {
    bool esc;
    size_t n = text_char(p, &esc);
    size_t need = *p == '\\' ? 2 : esc ? 4 * n : n;
    if (o + need + 1 > len) break;
    if (*p == '\\') {
      o += (size_t)snprintf(buf + o, len - o, "\\\\");
    } else if (esc) {
      for (size_t i = 0; i < n; i++) o += (size_t)snprintf(buf + o, len - o, "\\x%02x", p[i]);
    } else {
      memcpy(buf + o, p, n);
      o += n;
    }
    p += n;
  }
  buf[o] = '\0';
  return buf;
}
