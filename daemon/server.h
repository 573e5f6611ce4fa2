/* The server: the listening socket, the sessions, and the requests they
 * send, handed to the registry and the pause engine. */
#ifndef GPUMEMD_SERVER_H
#define GPUMEMD_SERVER_H

#include <stddef.h>
#include <sys/types.h>
#include <uv.h>

#include "common/frame.h"
#include "common/wire.h"
#include "config.h"
#include "gpu/gpudev.h"

struct session;
typedef struct server server;

/* Bind the socket and get ready to serve. NULL with err filled on failure
 * (another daemon answering, a path we may not use, ...). */
server *server_create(uv_loop_t *loop, const struct config *cfg, gpudev *g,
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

/* Serve a session's waiting frames on the loop's next turns. */
void server_session_backlog(server *srv, struct session *s);

/* The daemon's settings (the sessions' limits among them). */
const struct config *server_config(const server *srv);

/* The bytes queued for sending over every session (kept by their
 * writers). */
size_t *server_queued_total(server *srv);

/* The session with the most output queued that still reads, or NULL. */
struct session *server_biggest_queue(server *srv);

/* Fds parked in frames still arriving, over the sessions of uid. */
size_t server_parked_fds(const server *srv, uid_t uid);

#endif
