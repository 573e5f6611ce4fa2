#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"
#include "engine.h"
#include "listener.h"
#include "registry.h"
#include "report.h"
#include "session.h"

struct server {
  uv_loop_t *loop;
  const struct config *cfg;
  gpu *gpu;
  registry *reg;
  engine *eng;
  int listen_fd;
  uv_poll_t listen_poll;
  uv_signal_t sigterm, sigint;
  struct list sessions;
  uint64_t next_session_id;
  int reserve_fd; /* given up to accept-and-close when out of fds */
  int exit_status;
};

static void on_accept(uv_poll_t *h, int status, int events);
static void on_signal(uv_signal_t *h, int signum);

/* Bind the socket and get ready to serve. */
server *server_create(uv_loop_t *loop, const struct config *cfg, gpu *g,
                      char *err, size_t errlen) {
  server *srv = calloc(1, sizeof *srv);
  if (!srv) {
    snprintf(err, errlen, "out of memory");
    return NULL;
  }
  srv->loop = loop;
  srv->cfg = cfg;
  srv->gpu = g;
  srv->next_session_id = 1;
  list_init(&srv->sessions);
  srv->listen_fd = listener_open(cfg->socket_path, err, errlen);
  if (srv->listen_fd < 0) {
    free(srv);
    return NULL;
  }
  struct registry_options ro = {.chunk_size = cfg->chunk_size,
                                .backup_limit = cfg->backup_limit,
                                .verify_backups = cfg->verify_backups};
  srv->reg = registry_create(g, &ro);
  srv->eng = srv->reg ? engine_create(loop, srv->reg, g, cfg) : NULL;
  if (!srv->eng) {
    snprintf(err, errlen, "out of memory");
    registry_destroy(srv->reg);
    close(srv->listen_fd);
    unlink(cfg->socket_path);
    free(srv);
    return NULL;
  }
  srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  uv_poll_init(loop, &srv->listen_poll, srv->listen_fd);
  srv->listen_poll.data = srv;
  uv_poll_start(&srv->listen_poll, UV_READABLE, on_accept);
  uv_signal_init(loop, &srv->sigterm);
  uv_signal_init(loop, &srv->sigint);
  srv->sigterm.data = srv->sigint.data = srv;
  uv_signal_start(&srv->sigterm, on_signal, SIGTERM);
  uv_signal_start(&srv->sigint, on_signal, SIGINT);
  return srv;
}

/* Serve until a signal stops the loop. */
int server_run(server *srv) {
  log_info("listening on %s (backend %s, %u devices)", srv->cfg->socket_path,
           gpu_name(srv->gpu), gpu_device_count(srv->gpu));
  uv_run(srv->loop, UV_RUN_DEFAULT);
  return srv->exit_status;
}

/* Free everything that is left once the loop has stopped. */
void server_destroy(server *srv) {
  if (!srv) return;
  registry_destroy(srv->reg);
  if (srv->reserve_fd >= 0) close(srv->reserve_fd);
  free(srv);
}

/* Close every session and handle so that uv_run returns. */
static void on_signal(uv_signal_t *h, int signum) {
  server *srv = h->data;
  log_info("%s: shutting down", strsignal(signum));
  struct list *p, *t;
  list_for_each_safe(p, t, &srv->sessions) session_close(list_entry(p, struct session, link));
  uv_close((uv_handle_t *)&srv->listen_poll, NULL);
  close(srv->listen_fd);
  unlink(srv->cfg->socket_path);
  engine_destroy(srv->eng);
  srv->eng = NULL;
  uv_close((uv_handle_t *)&srv->sigterm, NULL);
  uv_close((uv_handle_t *)&srv->sigint, NULL);
}

/* Root, our own uid, the configured uid, or a member of the configured
 * group may pause and resume. */
static bool may_control(const server *srv, int fd, uid_t uid, gid_t gid) {
  if (uid == 0 || uid == geteuid() || uid == srv->cfg->controller_uid) return true;
  gid_t want = srv->cfg->controller_gid;
  if (want == (gid_t)-1) return false;
  if (gid == want) return true;
  gid_t groups[256];
  socklen_t len = sizeof groups;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0) return false;
  for (size_t i = 0; i < len / sizeof(gid_t); i++)
    if (groups[i] == want) return true;
  return false;
}

static unsigned sessions_of(const server *srv, uid_t uid) {
  unsigned n = 0;
  for (struct list *p = srv->sessions.next; p != &srv->sessions; p = p->next)
    n += list_entry(p, struct session, link)->uid == uid;
  return n;
}

/* Accept every waiting connection; out of fds, shed one to make room. */
static void on_accept(uv_poll_t *h, int status, int events) {
  (void)events;
  server *srv = h->data;
  if (status < 0) return;
  for (;;) {
    int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if ((errno == EMFILE || errno == ENFILE) && srv->reserve_fd >= 0) {
        log_warn("out of file descriptors: refusing a connection");
        close(srv->reserve_fd);
        int x = accept(srv->listen_fd, NULL, NULL);
        if (x >= 0) close(x);
        srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        continue;
      }
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return;
    }
    struct session *s = session_create(srv, srv->loop, fd, srv->next_session_id++);
    if (!s) continue;
    s->may_control = may_control(srv, fd, s->uid, s->gid);
    list_append(&srv->sessions, &s->link);
    log_debug("session %llu: pid %d uid %d connected", (unsigned long long)s->id,
              (int)s->pid, (int)s->uid);
    if (sessions_of(srv, s->uid) > srv->cfg->max_sessions_per_uid)
      session_fail(s, 0, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED,
                   "too many sessions for this uid");
  }
}

/* Forget a session that ended: free its buffers, tell the engine. */
void server_session_closed(server *srv, struct session *s) {
  list_remove(&s->link);
  struct list *p, *t;
  list_for_each_safe(p, t, &s->buffers)
      registry_free(srv->reg, list_entry(p, struct buffer, owner_link));
  s->nbuffers = 0;
  if (srv->eng) engine_forget(srv->eng, s);
}

static void reply_error(struct session *s, uint64_t id, wire_code code,
                        const char *text) {
  struct fault f = {0};
  fault_set(&f, code, "%s", text);
  session_send_error(s, id, &f);
}

static void handle_hello(server *srv, struct session *s, const wire_env *env) {
  const Gpumem__Wire__Hello *h = env->hello;
  char text[160];
  if (s->role != GPUMEM__WIRE__ROLE__ROLE_UNSPECIFIED) {
    session_fail(s, env->id, GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR, "Hello sent twice");
    return;
  }
  if (h->version_major != WIRE_VERSION_MAJOR) {
    snprintf(text, sizeof text, "client speaks protocol %u.%u, daemon speaks %d.%d",
             h->version_major, h->version_minor, WIRE_VERSION_MAJOR, WIRE_VERSION_MINOR);
    session_fail(s, env->id, GPUMEM__WIRE__ERROR_CODE__VERSION_MISMATCH, text);
    return;
  }
  if (h->role == GPUMEM__WIRE__ROLE__ROLE_CONTROLLER && !s->may_control) {
    snprintf(text, sizeof text, "uid %d may not pause or resume", (int)s->uid);
    session_fail(s, env->id, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED, text);
    return;
  }
  s->role = h->role;
  snprintf(s->name, sizeof s->name, "%s", h->name);
  Gpumem__Wire__HelloReply r = GPUMEM__WIRE__HELLO_REPLY__INIT;
  r.version_major = WIRE_VERSION_MAJOR;
  r.version_minor = WIRE_VERSION_MINOR;
  r.backend = (char *)gpu_name(srv->gpu);
  r.granularity = gpu_granularity(srv->gpu);
  r.session_id = s->id;
  r.devices = report_devices(srv->reg, srv->gpu, &r.n_devices);
  wire_env out = GPUMEM__WIRE__ENVELOPE__INIT;
  out.id = env->id;
  out.body_case = GPUMEM__WIRE__ENVELOPE__BODY_HELLO_REPLY;
  out.hello_reply = &r;
  session_send(s, &out, NULL, 0);
  report_devices_free(r.devices);
  log_debug("session %llu: pid %d is %s '%s'", (unsigned long long)s->id, (int)s->pid,
            s->role == GPUMEM__WIRE__ROLE__ROLE_WORKER ? "worker" : "controller", s->name);
}

static void handle_alloc(server *srv, struct session *s, const wire_env *env) {
  const Gpumem__Wire__AllocRequest *a = env->alloc;
  if (s->role != GPUMEM__WIRE__ROLE__ROLE_WORKER) {
    reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                "only workers allocate; connect as a worker");
    return;
  }
  if (s->nbuffers >= srv->cfg->max_buffers_per_session) {
    reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED,
                "too many buffers in this session");
    return;
  }
  struct fault f = {0};
  struct buffer *b;
  if (registry_alloc(srv->reg, s, &s->buffers, a->tag, a->device, a->size, a->flags,
                     &b, &f)) {
    session_send_error(s, env->id, &f);
    return;
  }
  int fds[FRAME_MAX_FDS];
  size_t nfds = 0;
  if (b->state == BUF_ACTIVE) {
    if (registry_export(srv->reg, b, fds, &f)) {
      registry_free(srv->reg, b);
      session_send_error(s, env->id, &f);
      return;
    }
    nfds = b->ipc ? 0 : b->nchunks;
  }
  s->nbuffers++;
  Gpumem__Wire__AllocReply r = GPUMEM__WIRE__ALLOC_REPLY__INIT;
  r.buffer_id = b->id;
  r.size = b->size;
  r.state = b->state;
  r.chunk_sizes = b->chunk_sizes;
  r.n_chunk_sizes = b->nchunks;
  if (b->ipc) {
    r.ipc_handle.data = b->ipc_handle;
    r.ipc_handle.len = sizeof b->ipc_handle;
  }
  wire_env out = GPUMEM__WIRE__ENVELOPE__INIT;
  out.id = env->id;
  out.fd_count = (uint32_t)nfds;
  out.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY;
  out.alloc_reply = &r;
  log_debug("pid %d: alloc %llu bytes '%s' on device %u: buffer %llu", (int)s->pid,
            (unsigned long long)b->size, a->tag, a->device, (unsigned long long)b->id);
  session_send(s, &out, fds, nfds);
}

static void handle_free(server *srv, struct session *s, const wire_env *env) {
  struct buffer *b = registry_find(srv->reg, env->free->buffer_id);
  char text[96];
  if (!b || b->owner != s) {
    snprintf(text, sizeof text, "no buffer %llu in this session",
             (unsigned long long)env->free->buffer_id);
    reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, text);
    return;
  }
  if (b->state != BUF_ACTIVE && b->state != BUF_PAUSED) {
    snprintf(text, sizeof text, "buffer %llu is %s; free it when that is done",
             (unsigned long long)b->id, wire_state_name(b->state));
    reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE, text);
    return;
  }
  Gpumem__Wire__FreeReply r = GPUMEM__WIRE__FREE_REPLY__INIT;
  r.bytes = b->size;
  registry_free(srv->reg, b);
  s->nbuffers--;
  wire_env out = GPUMEM__WIRE__ENVELOPE__INIT;
  out.id = env->id;
  out.body_case = GPUMEM__WIRE__ENVELOPE__BODY_FREE_REPLY;
  out.free_reply = &r;
  session_send(s, &out, NULL, 0);
}

/* Pause and resume: check role and devices, then queue for the engine. */
static void handle_op(server *srv, struct session *s, const wire_env *env, bool resume) {
  char **tags = resume ? env->resume->tags : env->pause->tags;
  size_t ntags = resume ? env->resume->n_tags : env->pause->n_tags;
  uint32_t *devs = resume ? env->resume->devices : env->pause->devices;
  size_t ndevs = resume ? env->resume->n_devices : env->pause->n_devices;
  uint32_t timeout = resume ? env->resume->timeout_ms : env->pause->timeout_ms;
  if (s->role != GPUMEM__WIRE__ROLE__ROLE_CONTROLLER) {
    reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                "pause and resume need a controller session");
    return;
  }
  uint64_t mask = 0;
  unsigned ndev = gpu_device_count(srv->gpu);
  for (size_t i = 0; i < ndevs; i++) {
    if (devs[i] >= ndev) {
      char text[64];
      snprintf(text, sizeof text, "device %u out of range (%u devices)", devs[i], ndev);
      reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT, text);
      return;
    }
    mask |= 1ull << devs[i];
  }
  engine_submit(srv->eng, s, env->id, resume, tags, ntags, mask, timeout);
}

/* Parse, check and route one request. */
void server_dispatch(server *srv, struct session *s, struct frame *f) {
  wire_env *env = wire_unpack(f->data, f->len);
  if (!env) {
    session_fail(s, 0, GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR,
                 "malformed frame: not a gpumemd message");
    return;
  }
  char why[256];
  wire_code code = wire_check_request(env, f->nfds, why, sizeof why);
  bool hello = env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_HELLO;
  if (code == GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR || (code && hello)) {
    session_fail(s, env->id, code, why);
  } else if (code) {
    reply_error(s, env->id, code, why);
  } else if (!hello && s->role == GPUMEM__WIRE__ROLE__ROLE_UNSPECIFIED) {
    session_fail(s, env->id, GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR,
                 "the first message must be Hello");
  } else {
    switch (env->body_case) {
    case GPUMEM__WIRE__ENVELOPE__BODY_HELLO: handle_hello(srv, s, env); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_ALLOC: handle_alloc(srv, s, env); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_FREE: handle_free(srv, s, env); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_PAUSE: handle_op(srv, s, env, false); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_RESUME: handle_op(srv, s, env, true); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_STATUS:
      report_status(s, env->id, srv->reg, srv->gpu, &srv->sessions);
      break;
    case GPUMEM__WIRE__ENVELOPE__BODY_LIST: report_list(s, env->id, srv->reg); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_ACK: engine_ack(srv->eng, s, env->id, env->ack); break;
    default: break; /* wire_check_request let only requests through */
    }
  }
  wire_env_free(env);
}
