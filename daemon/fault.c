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
