/* The server: the listening socket, the sessions, and the requests they
 * send, handed to the registry and the pause engine. */
#ifndef GPUMEMD_SERVER_H
#define GPUMEMD_SERVER_H

#include <stddef.h>
#include <sys/types.h>
#include <uv.h>

#include "common/wire.h"
#include "config.h"
#include "gpu/gpudev.h"

typedef struct server server;

/* Bind the socket and get ready to serve. NULL with err filled on failure
 * (another daemon answering, a path we may not use, ...). */
server *server_create(uv_loop_t *loop, const struct config *cfg, gpudev *g,
                      char *err, size_t errlen);

/* Serve until SIGTERM or SIGINT; returns the exit status. */
int server_run(server *srv);

/* Free everything; the socket file is removed. */
void server_destroy(server *srv);

#endif
