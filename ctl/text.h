/* Names as gpumemctl prints them: whatever bytes a daemon sends, a
 * terminal shows them escaped and JSON and metrics stay valid UTF-8. The
 * check is the daemon's own (wire_char): what its edge would refuse is
 * escaped here. */
#ifndef GPUMEM_CTL_TEXT_H
#define GPUMEM_CTL_TEXT_H

#include <stdbool.h>
#include <stddef.h>

/* The length of the character at p (1 for a byte that starts no UTF-8
 * sequence); *esc says whether it must be escaped: not UTF-8 (truncated,
 * overlong, a surrogate, past U+10FFFF) or a C0, DEL or C1 control. */
size_t text_char(const unsigned char *p, bool *esc);

/* Print s on stdout as a JSON string (quotes included). */
void json_str(const char *s);

/* s fit for a terminal, in buf of len bytes (cut to fit); returns buf. */
const char *printable(const char *s, char *buf, size_t len);

#endif
