/* Names as gpumemctl prints them: whatever bytes a client sent, a
 * terminal shows them escaped and JSON stays valid. */
#ifndef GPUMEM_CTL_TEXT_H
#define GPUMEM_CTL_TEXT_H

#include <stddef.h>

/* Length of the UTF-8 sequence at s, or 0 if it is not one. */
size_t utf8_len(const unsigned char *s);

/* Print s on stdout as a JSON string (quotes included). */
void json_str(const char *s);

/* s fit for a terminal, in buf of len bytes (cut to fit); returns buf. */
const char *printable(const char *s, char *buf, size_t len);

#endif
