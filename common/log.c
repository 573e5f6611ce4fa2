#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static enum log_level current_level = LOG_INFO;
static const char *const level_names[] = {"error", "warn", "info", "debug"};

/* Set the most verbose level that is printed. */
void log_set_level(enum log_level level) { current_level = level; }

/* Parse a level name. */
int log_level_parse(const char *name) {
  for (int i = 0; i <= LOG_DEBUG; i++)
    if (strcmp(name, level_names[i]) == 0) return i;
  return -1;
}

/* One write per line so that lines from several threads never interleave. */
void log_msg(enum log_level level, const char *fmt, ...) {
  if (level > current_level) return;
  char line[1024];
  int n = snprintf(line, sizeof line, "gpumemd[%s]: ", level_names[level]);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
  va_end(ap);
  fprintf(stderr, "%s\n", line);
}
