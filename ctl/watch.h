/* A status watch: a thread with its own connection to gpumemd that asks
 * for the status at a fixed interval and hands each answer (or the reason
 * there is none) to a callback. gpumemctl top draws from it, and the
 * progress line of pause and resume reads its own operation in it; the
 * command's main connection may meanwhile be blocked in a request. */
#ifndef GPUMEM_CTL_WATCH_H
#define GPUMEM_CTL_WATCH_H

#include <stdint.h>
#include <sys/types.h>

#include "gpumem.h"

typedef struct watch watch;

/* Called on the watch's thread with a status it now owns (free it with
 * gpumem_status_free), or with s NULL, err < 0 and the reason in why when
 * gpumemd did not answer. It is never called once watch_stop returned. */
typedef void (*watch_fn)(void *user, struct gpumem_status *s, int err, const char *why);

/* Start watching the daemon at socket_path as a session named name, when
 * root or owner runs it (each connection checked as ctl/owner.h says): the
 * first status is asked for after delay_ms, then every interval_ms; a
 * connection that fails or is lost is made again at the next turn.
 * Returns 0 or a negative errno. */
int watch_start(const char *socket_path, uid_t owner, const char *name, uint64_t delay_ms,
                uint64_t interval_ms, watch_fn fn, void *user, watch **out);

/* Stop the thread and free the watch (NULL is fine). A thread stuck in a
 * request to a daemon that does not answer is given up to a second; then
 * it is left to finish and free the watch itself, with no more calls. */
void watch_stop(watch *w);

#endif
