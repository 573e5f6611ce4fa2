/* The listening Unix socket: made safely, once per node. */
#ifndef GPUMEMD_LISTENER_H
#define GPUMEMD_LISTENER_H

#include <stddef.h>

/* Bind and listen on path with mode 0660. Refuses when another daemon
 * answers there or the path is not a socket; replaces a stale socket file.
 * Returns a non-blocking fd or a negative errno with err filled. */
int listener_open(const char *path, char *err, size_t errlen);

#endif
