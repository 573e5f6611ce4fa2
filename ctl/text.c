/* Escaping names for terminals, JSON and Prometheus labels. */
#include "ctl/text.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

/* Length of the UTF-8 sequence at s, or 0 if it is not one. */
size_t utf8_len(const unsigned char *s) {
  size_t n = s[0] < 0x80 ? 1 : (s[0] & 0xe0) == 0xc0 ? 2 : (s[0] & 0xf0) == 0xe0 ? 3
           : (s[0] & 0xf8) == 0xf0 ? 4 : 0;
  if (n == 2 && s[0] < 0xc2) return 0;
  for (size_t i = 1; i < n; i++)
    if ((s[i] & 0xc0) != 0x80) return 0;
  return n;
}

/* Print s as a JSON string; bytes that are not UTF-8 become U+00XX, so
 * that the output always parses. */
void json_str(const char *s) {
  putchar('"');
  for (const unsigned char *p = (const unsigned char *)s; *p;) {
    size_t n = utf8_len(p);
    if (*p == '"' || *p == '\\') printf("\\%c", *p);
    else if (*p < 0x20 || *p == 0x7f || n == 0) printf("\\u%04x", *p);
    else fwrite(p, 1, n, stdout);
    p += n ? n : 1;
  }
  putchar('"');
}

/* A name fit for a terminal: control characters and bytes that are not
 * UTF-8 become \xNN, a backslash \\; cut to fit buf. */
const char *printable(const char *s, char *buf, size_t len) {
  size_t o = 0;
  for (const unsigned char *p = (const unsigned char *)s; *p;) {
    size_t n = utf8_len(p);
    bool esc = n == 0 || *p < 0x20 || *p == 0x7f || *p == '\\';
    size_t need = esc ? (*p == '\\' ? 2 : 4) : n;
    if (o + need + 1 > len) break;
    if (*p == '\\') o += (size_t)snprintf(buf + o, len - o, "\\\\");
    else if (esc) o += (size_t)snprintf(buf + o, len - o, "\\x%02x", *p);
    else memcpy(buf + o, p, n), o += n;
    p += n ? n : 1;
  }
  buf[o] = '\0';
  return buf;
}
