#include "log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static enum log_level current_level = LOG_INFO;
static const char *const level_names[] = {"error", "warn", "info", "debug"};
/* syslog priorities: LOG_ERR, LOG_WARNING, LOG_INFO, LOG_DEBUG. */
static const int level_priorities[] = {3, 4, 6, 7};

/* How lines are written: as before, for journald, or for a person. */
static enum log_style_kind style = LOG_STYLE_PLAIN;
static pthread_once_t style_once = PTHREAD_ONCE_INIT;

/* Set the most verbose level that is printed. */
void log_set_level(enum log_level level) { current_level = level; }

/* Parse a level name. */
int log_level_parse(const char *name) {
  for (int i = 0; i <= LOG_DEBUG; i++)
    if (strcmp(name, level_names[i]) == 0) return i;
  return -1;
}

/* Whether JOURNAL_STREAM ("dev:inode") names the file stderr is. */
static bool stderr_is_journal(void) {
  const char *js = getenv("JOURNAL_STREAM");
  struct stat st;
  unsigned long long dev, ino;
  char tail;
  if (!js || sscanf(js, "%llu:%llu%c", &dev, &ino, &tail) != 2) return false;
  if (fstat(STDERR_FILENO, &st) < 0) return false;
  return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

/* Decide the style once, from what stderr is. */
static void style_detect(void) {
  if (stderr_is_journal()) style = LOG_STYLE_JOURNAL;
  else if (isatty(STDERR_FILENO)) style = LOG_STYLE_TERMINAL;
}

/* The style lines are written in (decided at the first line). */
enum log_style_kind log_style(void) {
  pthread_once(&style_once, style_detect);
  return style;
}

/* An ISO-8601 local time with milliseconds and offset into buf. */
static void iso_time(char *buf, size_t len) {
  struct timeval tv;
  struct tm tm;
  gettimeofday(&tv, NULL);
  localtime_r(&tv.tv_sec, &tm);
  char date[32];
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S", &tm);
  int off = (int)(tm.tm_gmtoff / 60) % (24 * 60);
  int aoff = off < 0 ? -off : off;
  snprintf(buf, len, "%s.%03d%c%02d:%02d", date, (int)(tv.tv_usec / 1000) % 1000,
           off < 0 ? '-' : '+', aoff / 60, aoff % 60);
}

/* One write per line so that lines from several threads never interleave. */
void log_msg(enum log_level level, const char *fmt, ...) {
  if (level > current_level) return;
  char line[1024], when[96];
  int n;
  switch (log_style()) {
  case LOG_STYLE_JOURNAL: n = snprintf(line, sizeof line, "<%d>", level_priorities[level]); break;
  case LOG_STYLE_TERMINAL:
    iso_time(when, sizeof when);
    n = snprintf(line, sizeof line, "%s gpumemd[%s]: ", when, level_names[level]);
    break;
  default: n = snprintf(line, sizeof line, "gpumemd[%s]: ", level_names[level]); break;
  }
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
  va_end(ap);
  /* journald reads one entry per line: keep a message one entry. */
  if (style == LOG_STYLE_JOURNAL)
    for (char *p = line + n; *p; p++)
      if (*p == '\n') *p = ' ';
  fprintf(stderr, "%s\n", line);
}
