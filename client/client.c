/* A client's life: connecting (the first greeting on the caller's thread,
 * then the background thread unless the application drives the loop),
 * the settings and views of its connection, and disconnecting. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buffer.h"
#include "buffers.h"
#include "client.h"
#include "default.h"
#include "error.h"

/* The background thread: the connection's I/O owner until disconnect. */
static void *thread_main(void *arg) {
  gpumem_client *c = arg;
  conn_run(c->conn);
  return NULL;
}

/* Free a client's parts (its buffers are gone already). */
static void client_free(gpumem_client *c) {
  conn_destroy(c->conn);
  pool_destroy(c->pool);
  events_destroy(c->events);
  buffers_destroy(c->buffers);
  hello_destroy(c->hello);
  free(c);
}

/* Connect, greet, and start the background thread. */
int gpumem_connect(const char *socket_path, const char *name, int role, unsigned flags,
                   gpumem_client **out) {
  if (role != GPUMEM_ROLE_WORKER && role != GPUMEM_ROLE_CONTROLLER)
    return error_set(GPUMEM_E_INVALID, "role must be worker or controller");
  if (name && strlen(name) > WIRE_NAME_MAX)
    return error_set(GPUMEM_E_INVALID, "name longer than %d bytes", WIRE_NAME_MAX);
  if (flags & ~(unsigned)(GPUMEM_CONNECT_NO_THREAD | GPUMEM_CONNECT_NO_RECONNECT |
                          GPUMEM_CONNECT_NODE_DEVICES | GPUMEM_CONNECT_RELEASE_CONTEXT |
                          GPUMEM_CONNECT_DAEMON_COPIES))
    return error_set(GPUMEM_E_INVALID, "unknown connect flags 0x%x", flags);
  const char *release = getenv("GPUMEM_RELEASE_CONTEXT");
  if (role == GPUMEM_ROLE_WORKER && release && strcmp(release, "1") == 0)
    flags |= GPUMEM_CONNECT_RELEASE_CONTEXT;
  const char *daemon_copies = getenv("GPUMEM_DAEMON_COPIES");
  if (daemon_copies && strcmp(daemon_copies, "1") == 0) flags |= GPUMEM_CONNECT_DAEMON_COPIES;
  if (!socket_path || !*socket_path) socket_path = getenv("GPUMEM_SOCKET");
  if (!socket_path || !*socket_path) socket_path = GPUMEM_DEFAULT_SOCKET;
  gpumem_client *c = calloc(1, sizeof *c);
  if (!c) return error_set(GPUMEM_E_NOMEM, "out of memory");
  addrmap_owner_init(&c->addrs, c);
  c->hello = hello_create(flags & GPUMEM_CONNECT_NODE_DEVICES);
  c->buffers = buffers_create();
  c->events = c->buffers ? events_create(c, c->buffers) : NULL;
  bool keep = false;
  hello_copies_backups(role, flags, &keep);
  if (c->events) events_keep_backups(c->events, keep);
  c->pool = pool_create(&c->addrs);
  struct conn_parts parts = {.client = c, .buffers = c->buffers, .hello = c->hello,
                             .events = c->events, .path = socket_path,
                             .name = name ? name : "", .role = role, .flags = flags};
  if (c->hello && c->events && c->pool) c->conn = conn_create(&parts);
  if (!c->conn) {
    client_free(c);
    return error_set(GPUMEM_E_NOMEM, "out of memory");
  }
  int rc = conn_start(c->conn);
  if (rc == 0 && !(flags & GPUMEM_CONNECT_NO_THREAD)) {
    c->threaded = pthread_create(&c->thread, NULL, thread_main, c) == 0;
    if (!c->threaded) {
      conn_stop(c->conn);
      rc = error_set(GPUMEM_E_NOMEM, "cannot start the event thread");
    }
  }
  if (rc < 0) {
    client_free(c);
    return rc;
  }
  *out = c;
  return 0;
}

/* Unmap everything, stop the loop (and any reconnecting), and close. */
void gpumem_disconnect(gpumem_client *c) {
  if (!c) return;
  default_forget(c);
  addrmap_forget(&c->addrs);
  conn_stop(c->conn);
  if (c->threaded) pthread_join(c->thread, NULL);
  gpumem_buffer *b;
  while ((b = buffers_any(c->buffers))) {
    buffers_remove(c->buffers, b);
    buffer_destroy(b);
  }
  client_free(c);
}

/* Handle the daemon's events for applications with their own loop, and
 * reconnect for them when the daemon went away. */
int gpumem_dispatch(gpumem_client *c, int timeout_ms) {
  if (c->threaded)
    return error_set(GPUMEM_E_INVALID, "a background thread dispatches this client");
  return conn_dispatch(c->conn, timeout_ms);
}

/* The connection's fd (-1 while reconnecting). */
int gpumem_fd(const gpumem_client *c) { return conn_fd(c->conn); }

/* Set how long requests wait for their replies. */
void gpumem_set_request_timeout(gpumem_client *c, unsigned ms) {
  conn_set_timeout(c->conn, ms);
}

/* Set the margin allocations keep free. */
void gpumem_set_keep_free(gpumem_client *c, uint64_t bytes) { atomic_store(&c->keep_free, bytes); }

/* Set the hook told about lost and restored connections. */
void gpumem_set_connection_hook(gpumem_client *c, gpumem_conn_hook hook, void *user) {
  conn_set_hook(c->conn, hook, user);
}

/* The daemon's last error outside a request. */
int gpumem_daemon_error(gpumem_client *c, char *buf, size_t len) {
  return conn_daemon_error(c->conn, buf, len);
}

/* Wait until a device has finished its work. */
int gpumem_sync(gpumem_client *c, int device) {
  if (!c) return error_set(GPUMEM_E_INVALID, "no client");
  int map[GPUMEM_MAX_DEVICES];
  unsigned seen = hello_local_map(c->hello, map);
  if (hello_node_device(map, device) < 0)
    return error_set(GPUMEM_E_INVALID,
                     "device %d is not one of the %u gpumemd devices this process sees",
                     device, seen);
  gpuva *g = hello_gpu(c->hello);
  if (!g) return 0; /* it maps nothing: nothing to wait for */
  if (gpuva_sync(g, (unsigned)device) < 0) return error_set(GPUMEM_E_BACKEND, "%s", gpu_error());
  return 0;
}

/* The generation of the buffer of c holding ptr. */
int gpumem_generation(gpumem_client *c, const void *ptr, uint64_t *generation) {
  if (!c || !ptr || !generation)
    return error_set(GPUMEM_E_INVALID, "no client, no address or no place for the generation");
  uint64_t off;
  gpumem_buffer *b = buffers_holding(c->buffers, ptr, 1, &off);
  if (!b) return error_set(GPUMEM_E_NOT_FOUND, "no buffer of this client holds %p", ptr);
  *generation = gpumem_buffer_generation(b);
  return 0;
}
