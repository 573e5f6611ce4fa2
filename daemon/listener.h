/* The listening Unix socket: made safely, once per node. */
#ifndef GPUMEMD_LISTENER_H
#define GPUMEMD_LISTENER_H

#include <stddef.h>

#include <sys/types.h>

/* Bind and listen on path with mode and, unless (gid_t)-1, group gid.
 * Refuses when another daemon answers there or the path is not a socket,
 * and a directory another user could change: the socket's directory and
 * every directory on the way to it (links followed) must be owned by root
 * or the daemon's uid, and not writable by group or others (a sticky one
 * above the socket's directory may be: /tmp). Replaces a stale socket
 * file. Returns a non-blocking fd or a negative errno with err filled; on
 * failure no socket is left behind. */
int listener_open(const char *path, mode_t mode, gid_t gid, char *err, size_t errlen);

#endif
