/* The GPU layer's last error of each thread. */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>

static _Thread_local char last_error[256];

/* Record what went wrong on this thread and return err. */
int gpu_fail(int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return err;
}

/* What the backend last reported on this thread. */
const char *gpu_error(void) { return last_error; }
