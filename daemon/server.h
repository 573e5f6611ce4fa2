/* The server: the listening socket, the sessions, and the requests they
 * send, handed to the registry and the pause engine. */
#ifndef GPUMEMD_SERVER_H
#define GPUMEMD_SERVER_H

#include <stddef.h>
#include <uv.h>

#include "common/frame.h"
#include "config.h"
#include "gpu/gpu.h"

struct session;
typedef struct server server;

/* Bind the socket and get ready to serve. NULL with err filled on failure
 * (another daemon answering, a path we may not use, ...). */
server *server_create(uv_loop_t *loop, const struct config *cfg, gpu *g,
                      char *err, size_t errlen);

/* Serve until SIGTERM or SIGINT; returns the exit status. */
int server_run(server *srv);

/* Free everything; the socket file is removed. */
void server_destroy(server *srv);

/* Handle one frame that a session received (called by the session). */
void server_dispatch(server *srv, struct session *s, struct frame *f);

/* Close a doomed session on the loop's next turn. */
void server_session_doomed(server *srv, struct session *s);

/* Forget a session that ended: free its buffers, tell the engine. */
void server_session_closed(server *srv, struct session *s);

#endif
