#include "fault.h"

#include <stdarg.h>
#include <stdio.h>

/* Fill a fault and return its code. */
wire_code fault_set(struct fault *f, wire_code code, const char *fmt, ...) {
  f->code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(f->text, sizeof f->text, fmt, ap);
  va_end(ap);
  return code;
}

/* Fill err from f; text holds a copy of its words made valid UTF-8, since a
 * worker's words may be cut mid-character. */
void fault_to_wire(const struct fault *f, char *text, Gpumem__Wire__Error *err) {
  snprintf(text, sizeof f->text, "%s", f->text);
  wire_text_clean(text);
  err->code = f->code;
  err->message = text;
  err->bytes_needed = f->bytes_needed;
  err->bytes_free = f->bytes_free;
}
