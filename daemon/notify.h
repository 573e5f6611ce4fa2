/* systemd's protocols without systemd as a dependency of the design:
 * readiness notification (sd_notify) and socket activation (sd_listen_fds). */
#ifndef GPUMEMD_NOTIFY_H
#define GPUMEMD_NOTIFY_H

#include <stddef.h>

#include "fdstore.h"

/* Check that NOTIFY_SOCKET, when set, reaches a listener, before anything is
 * created. Returns 0, or -1 with err filled. */
int notify_check(char *err, size_t errlen);

/* Say READY=1 and what is served. Returns 0 (also without NOTIFY_SOCKET),
 * or -1 with err filled when the notification cannot be sent. */
int notify_ready(const char *backend, unsigned devices, const char *path, char *err,
                 size_t errlen);

/* Say STOPPING=1; a failure is only logged. */
void notify_stopping(void);

/* Take what systemd passed (LISTEN_FDS, LISTEN_PID, LISTEN_FDNAMES): the
 * fd store's chunks (named gpumem.*) go to store, and of the rest one
 * listening socket may be passed. Returns it (non-blocking,
 * close-on-exec), -1 when none was passed, or -2 with err filled when
 * what was passed is wrong. When a path is bound to it, copies it to
 * path. */
int activation_take(char *path, size_t pathlen, fdstore *store, char *err, size_t errlen);

#endif
