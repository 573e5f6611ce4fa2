/* The progress line of gpumemctl pause and resume: on a terminal, an
 * operation still running after a second gets one line on stderr,
 * rewritten as it advances ("pausing kv_cache: 12.0 GiB of 100 GiB,
 * 2.3 s") and cleared when it ends. The figures come from the daemon's
 * record of this process's operation, read over a connection of its own
 * while the command's request blocks. */
#ifndef GPUMEM_CTL_PROGRESS_H
#define GPUMEM_CTL_PROGRESS_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

typedef struct progress progress;

/* Start showing the progress of this process's pause (or resume) of tags
 * (ntags 0: every tag) when stderr is a terminal, asking the daemon at
 * socket_path that root or owner runs; NULL when nothing will be shown. */
progress *progress_start(const char *socket_path, uid_t owner, bool resume, char *const *tags,
                         size_t ntags);

/* Stop, and clear the line if one was shown (NULL is fine). */
void progress_stop(progress *p);

#endif
