/* Levelled logging to stderr, one line per event. */
#ifndef GPUMEM_LOG_H
#define GPUMEM_LOG_H

enum log_level { LOG_ERROR = 0, LOG_WARN, LOG_INFO, LOG_DEBUG };

/* Set the most verbose level that is printed. */
void log_set_level(enum log_level level);

/* Parse "error", "warn", "info" or "debug"; returns -1 for anything else. */
int log_level_parse(const char *name);

/* Print one line at a level, with the level's name in front. */
void log_msg(enum log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#define log_error(...) log_msg(LOG_ERROR, __VA_ARGS__)
#define log_warn(...) log_msg(LOG_WARN, __VA_ARGS__)
#define log_info(...) log_msg(LOG_INFO, __VA_ARGS__)
#define log_debug(...) log_msg(LOG_DEBUG, __VA_ARGS__)

#endif
