/* gpumemctl top: a live view of the node for the operator of an RL run,
 * redrawn in place: each device's memory split into what gpumemd manages,
 * what it does not and what is free; the tags and their states; the
 * processes that hold the most device memory outside gpumemd; the last
 * pauses and resumes, and those running. */
#ifndef GPUMEM_CTL_TOP_H
#define GPUMEM_CTL_TOP_H

#include <stdint.h>
#include <sys/types.h>

/* The refresh interval when none is given. */
#define TOP_DEFAULT_INTERVAL_MS 1000
/* The shortest refresh interval top takes. */
#define TOP_MIN_INTERVAL_MS 100

/* Show the view of the daemon at socket_path that root or owner runs,
 * asking for the status every interval_ms, until q, Ctrl-C
 * or SIGTERM; a daemon that does not answer is said so and asked again.
 * Returns the exit status: 0, or 2 (said on stderr) where stdin or stdout
 * is not a terminal, the terminal type is unknown, or gpumemctl was built
 * without curses. */
int top_run(const char *socket_path, uid_t owner, uint64_t interval_ms);

#endif
