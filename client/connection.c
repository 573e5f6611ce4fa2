/* The connection to the daemon: requests and their replies, and the
 * reading of the socket, by the background thread or by callers. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "client.h"

/* End the connection for everyone waiting on it. Called with mu held. */
static void mark_dead(gpumem_client *c, int err) {
  if (!c->dead) c->dead = err;
  pthread_cond_broadcast(&c->cv);
}

/* Send one message, waiting for room as needed. */
int client_send(gpumem_client *c, const wire_env *env) {
  size_t len;
  uint8_t *bytes = wire_pack(env, &len);
  if (!bytes) return client_fail(GPUMEM_E_NOMEM, "out of memory");
  pthread_mutex_lock(&c->send_mu);
  int rc = frame_writer_push(c->writer, bytes, len, NULL, 0);
  while (rc == 0 && (rc = frame_writer_flush(c->writer, c->fd)) == -EAGAIN) {
    struct pollfd p = {c->fd, POLLOUT, 0};
    poll(&p, 1, -1);
    rc = 0;
  }
  pthread_mutex_unlock(&c->send_mu);
  free(bytes);
  if (rc < 0) return client_fail(GPUMEM_E_DISCONNECTED, "send: %s", strerror(-rc));
  return 0;
}

/* Route one frame: events are handled here, replies go to their waiter. */
static int route(gpumem_client *c, struct frame *f) {
  wire_env *env = wire_unpack(f->data, f->len);
  char why[256];
  if (!env) return client_fail(GPUMEM_E_PROTOCOL, "malformed message from gpumemd");
  if (wire_check_reply(env, f->nfds, why, sizeof why)) {
    wire_env_free(env);
    return client_fail(GPUMEM_E_PROTOCOL, "from gpumemd: %s", why);
  }
  if (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_UNMAP ||
      env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_REMAP) {
    client_handle_event(c, env, f);
    wire_env_free(env);
    return 1;
  }
  pthread_mutex_lock(&c->mu);
  struct pending *p = c->pending;
  while (p && p->id != env->id) p = p->next;
  if (p && !p->done) {
    p->env = env;
    p->frame = *f;
    memset(f, 0, sizeof *f);
    p->done = true;
    pthread_cond_broadcast(&c->cv);
    env = NULL;
  }
  pthread_mutex_unlock(&c->mu);
  wire_env_free(env); /* a reply nobody waits for */
  return 0;
}

/* Wait up to timeout_ms for the socket, read, and route every whole frame.
 * Returns the number of events handled or a negative error. */
static int pump(gpumem_client *c, int timeout_ms) {
  struct pollfd p = {c->fd, POLLIN, 0};
  int n = poll(&p, 1, timeout_ms);
  if (n < 0 && errno == EINTR) return 0;
  if (n <= 0) return n < 0 ? client_fail(GPUMEM_E_DISCONNECTED, "poll failed") : 0;
  ssize_t got = frame_reader_fill(c->reader, c->fd);
  if (got == -EAGAIN) return 0;
  if (got == 0) return client_fail(GPUMEM_E_DISCONNECTED, "gpumemd closed the connection");
  if (got < 0) return client_fail(GPUMEM_E_DISCONNECTED, "read: %s", strerror((int)-got));
  int events = 0, rc;
  struct frame f;
  while ((rc = frame_reader_next(c->reader, &f)) > 0) {
    int r = route(c, &f);
    frame_release(&f);
    if (r < 0) return r;
    events += r;
  }
  if (rc < 0) return client_fail(GPUMEM_E_PROTOCOL, "frame from gpumemd over the limit");
  return events;
}

/* Read on behalf of whoever waits, unless another thread already does.
 * Called and returns with mu held. */
static int pump_locked(gpumem_client *c, int timeout_ms) {
  if (c->threaded || c->reading) {
    pthread_cond_wait(&c->cv, &c->mu);
    return 0;
  }
  c->reading = true;
  pthread_mutex_unlock(&c->mu);
  int rc = pump(c, timeout_ms);
  pthread_mutex_lock(&c->mu);
  c->reading = false;
  if (rc < 0) mark_dead(c, rc);
  pthread_cond_broadcast(&c->cv);
  return rc;
}

/* Send a request and wait for its reply. */
int client_call(gpumem_client *c, wire_env *req, struct pending *reply) {
  memset(reply, 0, sizeof *reply);
  pthread_mutex_lock(&c->mu);
  if (c->dead) {
    int err = c->dead;
    pthread_mutex_unlock(&c->mu);
    return client_fail(err, "the connection to gpumemd is gone");
  }
  req->id = reply->id = c->next_id++;
  reply->next = c->pending;
  c->pending = reply;
  pthread_mutex_unlock(&c->mu);
  int rc = client_send(c, req);
  pthread_mutex_lock(&c->mu);
  while (rc == 0 && !reply->done && !c->dead) pump_locked(c, -1);
  if (rc == 0 && !reply->done) rc = c->dead;
  struct pending **pp = &c->pending;
  while (*pp != reply) pp = &(*pp)->next;
  *pp = reply->next;
  pthread_mutex_unlock(&c->mu);
  if (rc < 0) {
    client_reply_free(reply);
    return client_fail(rc, "the connection to gpumemd is gone");
  }
  if (reply->env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) {
    const Gpumem__Wire__Error *e = reply->env->error;
    return client_fail(client_code(e->code), "%s: %s", wire_code_name(e->code), e->message);
  }
  return 0;
}

/* Free a reply got from client_call. */
void client_reply_free(struct pending *reply) {
  wire_env_free(reply->env);
  reply->env = NULL;
  frame_release(&reply->frame);
}

/* The background thread: read and handle until the connection ends. */
static void *reader_main(void *arg) {
  gpumem_client *c = arg;
  for (;;) {
    int rc = pump(c, -1);
    if (rc < 0) {
      pthread_mutex_lock(&c->mu);
      mark_dead(c, rc);
      pthread_mutex_unlock(&c->mu);
      return NULL;
    }
  }
}

/* Handle the daemon's events for applications with their own loop. */
int gpumem_dispatch(gpumem_client *c, int timeout_ms) {
  if (c->threaded)
    return client_fail(GPUMEM_E_INVALID, "a background thread dispatches this client");
  pthread_mutex_lock(&c->mu);
  int rc = c->dead;
  while (!rc && c->reading) pthread_cond_wait(&c->cv, &c->mu);
  if (!rc) rc = c->dead ? c->dead : pump_locked(c, timeout_ms);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* The connection's fd. */
int gpumem_fd(const gpumem_client *c) { return c->fd; }

static int open_socket(const char *path) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof addr.sun_path)
    return client_fail(GPUMEM_E_INVALID, "socket path too long: %s", path);
  strcpy(addr.sun_path, path);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return client_fail(GPUMEM_E_CONNECT, "socket: %s", strerror(errno));
  if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
    int e = errno;
    close(fd);
    return client_fail(GPUMEM_E_CONNECT, "cannot connect to gpumemd at %s: %s", path,
                       strerror(e));
  }
  return fd;
}

static void client_free(gpumem_client *c) {
  if (c->fd >= 0) close(c->fd);
  gpu_close(c->gpu);
  idmap_destroy(c->buffers);
  frame_writer_destroy(c->writer);
  frame_reader_destroy(c->reader);
  pthread_mutex_destroy(&c->mu);
  pthread_mutex_destroy(&c->send_mu);
  pthread_cond_destroy(&c->cv);
  free(c);
}

/* Say hello, learn the backend and open it for mapping. */
static int greet(gpumem_client *c, const char *name, int role) {
  Gpumem__Wire__Hello h = GPUMEM__WIRE__HELLO__INIT;
  h.version_major = WIRE_VERSION_MAJOR;
  h.version_minor = WIRE_VERSION_MINOR;
  h.role = (Gpumem__Wire__Role)role;
  h.name = (char *)(name ? name : "");
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_HELLO;
  req.hello = &h;
  struct pending reply;
  int rc = client_call(c, &req, &reply);
  if (rc == 0 && reply.env->body_case != GPUMEM__WIRE__ENVELOPE__BODY_HELLO_REPLY)
    rc = client_fail(GPUMEM_E_PROTOCOL, "gpumemd answered Hello with something else");
  if (rc == 0) {
    const Gpumem__Wire__HelloReply *r = reply.env->hello_reply;
    snprintf(c->backend, sizeof c->backend, "%s", r->backend);
    c->granularity = r->granularity;
    c->ndevices = (unsigned)r->n_devices;
    struct gpu_options opt = {.backend = c->backend, .client = true};
    char err[256] = "";
    if (gpu_open(&opt, &c->gpu, err, sizeof err) < 0)
      rc = client_fail(GPUMEM_E_BACKEND, "backend %s: %s", c->backend, err);
    /* Device numbers differ between processes (CUDA_VISIBLE_DEVICES): the
     * bus id says which of ours each of the daemon's devices is. */
    for (size_t i = 0; rc == 0 && i < r->n_devices && i < WIRE_MAX_DEVICES; i++)
      c->local_of[i] = gpu_device_by_bus_id(c->gpu, r->devices[i]->bus_id);
  }
  client_reply_free(&reply);
  return rc;
}

/* Connect, greet, and start the background thread. */
int gpumem_connect(const char *socket_path, const char *name, int role,
                   unsigned flags, gpumem_client **out) {
  if (role != GPUMEM_ROLE_WORKER && role != GPUMEM_ROLE_CONTROLLER)
    return client_fail(GPUMEM_E_INVALID, "role must be worker or controller");
  if (name && strlen(name) > WIRE_NAME_MAX)
    return client_fail(GPUMEM_E_INVALID, "name longer than %d bytes", WIRE_NAME_MAX);
  if (!socket_path || !*socket_path) socket_path = getenv("GPUMEM_SOCKET");
  if (!socket_path || !*socket_path) socket_path = GPUMEM_DEFAULT_SOCKET;
  gpumem_client *c = calloc(1, sizeof *c);
  if (!c) return client_fail(GPUMEM_E_NOMEM, "out of memory");
  c->fd = -1;
  c->next_id = 1;
  pthread_mutex_init(&c->mu, NULL);
  pthread_mutex_init(&c->send_mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  c->buffers = idmap_create();
  c->writer = frame_writer_create();
  c->reader = frame_reader_create(WIRE_MAX_REPLY);
  if (!c->buffers || !c->writer || !c->reader) {
    client_free(c);
    return client_fail(GPUMEM_E_NOMEM, "out of memory");
  }
  int rc = c->fd = open_socket(socket_path);
  if (rc >= 0) rc = greet(c, name, role);
  if (rc >= 0 && !(flags & GPUMEM_CONNECT_NO_THREAD)) {
    c->threaded = true;
    if (pthread_create(&c->thread, NULL, reader_main, c) != 0) {
      c->threaded = false;
      rc = client_fail(GPUMEM_E_NOMEM, "cannot start the event thread");
    }
  }
  if (rc < 0) {
    client_free(c);
    return rc;
  }
  *out = c;
  return 0;
}

/* Unmap everything, stop the thread, and close. */
void gpumem_disconnect(gpumem_client *c) {
  if (!c) return;
  if (c->threaded) {
    shutdown(c->fd, SHUT_RDWR);
    pthread_join(c->thread, NULL);
  }
  size_t n = idmap_count(c->buffers);
  void **bufs = malloc((n + 1) * sizeof *bufs);
  if (bufs) n = idmap_values(c->buffers, bufs, n);
  for (size_t i = 0; bufs && i < n; i++) client_buffer_destroy(c, bufs[i]);
  free(bufs);
  client_free(c);
}

/* The daemon's backend. */
const char *gpumem_backend(const gpumem_client *c) { return c->backend; }

/* The allocation granularity. */
uint64_t gpumem_granularity(const gpumem_client *c) { return c->granularity; }

/* The number of devices. */
unsigned gpumem_device_count(const gpumem_client *c) { return c->ndevices; }
