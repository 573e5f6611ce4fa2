/* Levelled logging to stderr, one line per event. Where JOURNAL_STREAM
 * names stderr (systemd), each line starts with its syslog priority
 * ("<3>" error, "<4>" warning, "<6>" info, "<7>" debug) and nothing else;
 * on a terminal with an ISO-8601 time and the level; otherwise with
 * "gpumemd[level]: ". */
#ifndef GPUMEM_LOG_H
#define GPUMEM_LOG_H

#include <stdbool.h>

/* LOG_SILENT, as a level to set only, prints nothing (the fuzzers: a
 * hostile input's errors are what the daemon should say, not news). */
enum log_level { LOG_SILENT = -1, LOG_ERROR = 0, LOG_WARN, LOG_INFO, LOG_DEBUG };

/* Set the most verbose level that is printed. */
void log_set_level(enum log_level level);

/* Parse "error", "warn", "info" or "debug"; returns -1 for anything else. */
int log_level_parse(const char *name);

enum log_style_kind { LOG_STYLE_PLAIN, LOG_STYLE_JOURNAL, LOG_STYLE_TERMINAL };

/* The style lines are written in, decided from stderr at the first line. */
enum log_style_kind log_style(void);

/* Print one line at a level, with the level's name in front. */
void log_msg(enum log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define log_error(...) log_msg(LOG_ERROR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_WARN, __VA_ARGS__)
#define log_info(...) log_msg(LOG_INFO, __VA_ARGS__)
#define log_debug(...) log_msg(LOG_DEBUG, __VA_ARGS__)

#endif
