/* libFuzzer: the real daemon in this process (server, sessions, registry,
 * pause engine, host backend of two small devices), driven by a sequence
 * of actions that the input spells: connect, send a frame (raw bytes, or a
 * hello, alloc, free, pause, resume, ack, status, list or adopt built from
 * the input) with fds of any kind attached, read the replies, run the loop,
 * stop reading, half-close, wait for timers. Every reply must parse and
 * carry the fds it declares; once every client has gone, the devices hold
 * nothing; once the daemon has stopped, no fd is left open.
 *
 * Input: one byte of configuration, then actions, each an opcode byte and
 * its arguments (read until the input ends; missing bytes read as 0). */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <uv.h>

#include "common/frame.h"
#include "tests/procfd.h"
#include "common/log.h"
#include "common/wire.h"
#include "daemon/config.h"
#include "daemon/server.h"
#include "gpu/gpudev.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define NDEV 2
#define DEV_SIZE (8ull << 20)
#define GRAN 4096ull
#define NCONN 4
#define MAX_CONNECTS 16 /* connections per input */
#define MAX_HELD 64     /* buffers a client keeps "mapped" */
#define MAX_IDS 32      /* buffer and event ids a client remembers */
#define MAX_SLOW 4      /* status and list per input: each reads /proc */

/* The input, read a byte at a time; past the end every byte is 0. */
struct in {
  const uint8_t *p;
  size_t n;
};

/* The next byte (0 past the end). */
static uint8_t u8(struct in *in) {
  if (!in->n) return 0;
  in->n--;
  return *in->p++;
}

/* Little-endian numbers, their bytes read in order (one statement each:
 * the order of calls within an expression is the compiler's choice). */
static uint32_t u16(struct in *in) {
  uint32_t lo = u8(in);
  return lo | (uint32_t)u8(in) << 8;
}

static uint32_t u32(struct in *in) {
  uint32_t lo = u16(in);
  return lo | u16(in) << 16;
}

static uint64_t u64(struct in *in) {
  uint64_t lo = u32(in);
  return lo | (uint64_t)u32(in) << 32;
}

/* A buffer a client holds: its chunk fds, as a mapping would. */
struct held {
  uint64_t id;
  int fds[32];
  size_t nfds;
};

/* One client connection. */
struct conn {
  int idx;
  int fd;             /* -1: not connected */
  frame_reader *r;
  bool reading;       /* false: the client stopped reading */
  int auto_ack;       /* 0: acks only when the input says; 1: OK; 2: a failure */
  struct held held[MAX_HELD];
  size_t nheld;
  uint64_t ids[MAX_IDS]; /* buffer ids from replies, newest last */
  size_t nids;
  uint64_t events[MAX_IDS]; /* event ids of unmaps and remaps */
  size_t nevents;
  struct ack { uint64_t event, failed; } acks[MAX_IDS]; /* auto acks to send */
  size_t nacks;
};

/* Everything one input runs against. */
struct world {
  uv_loop_t loop;
  gpudev *g;
  server *srv;
  struct config cfg;
  struct conn c[NCONN];
  unsigned connects, slow;
  bool waited; /* one wait per input: it costs milliseconds */
};

static bool trace; /* FUZZ_DAEMON_TRACE set: say what each action does */

static char dir[64], sock_path[96];
static int helper_fd = -1; /* asks the helper process to connect for us */
static pid_t helper_pid;

/* Die loudly: an invariant of the daemon does not hold. */
__attribute__((noreturn, format(printf, 1, 2))) static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "fuzz_daemon: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  abort();
}

/* Open fds of this process. */
static int fd_count(void) {
  int n = proc_fd_each(getpid(), NULL, NULL);
  if (n < 0) fail("/proc/self/fd: %s", strerror(errno));
  return n;
}

/* Print one fd and its target (for a leak report). */
static void fd_print(int fd, const char *target, void *arg) {
  (void)arg;
  fprintf(stderr, "  fd %d: %s\n", fd, target);
}

/* Print the fds open now (for a leak report). */
static void fd_dump(void) { proc_fd_each(getpid(), fd_print, NULL); }

/* Send one fd over a Unix socket. */
static int send_fd(int sock, int fd) {
  ssize_t n;
  do
    n = frame_sendmsg(sock, "f", 1, &fd, 1, 0);
  while (n < 0 && errno == EINTR);
  return n == 1 ? 0 : -1;
}

/* Receive one fd sent by send_fd, or -1. */
static int recv_fd(int sock) {
  union {
    struct cmsghdr align;
    char buf[CMSG_SPACE(sizeof(int))];
  } ctl;
  char b;
  struct iovec iov = {&b, 1};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                       .msg_controllen = sizeof ctl.buf};
  ssize_t n;
  do
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  while (n < 0 && errno == EINTR);
  if (n != 1) return -1;
  struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
  if (!c || c->cmsg_type != SCM_RIGHTS) return -1;
  int fd;
  memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

/* Connect a socket to the daemon (blocking connect: a Unix socket is
 * queued at once while the backlog has room). */
static int connect_path(void) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  snprintf(a.sun_path, sizeof a.sun_path, "%s", sock_path);
  int rc;
  while ((rc = connect(fd, (struct sockaddr *)&a, sizeof a)) < 0 && errno == EINTR) {
  }
  if (rc < 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* The helper: a process that connects on request and hands the socket
 * back, so that the daemon sees a peer whose pid holds none of its chunks
 * (a worker in this process always "holds" them: the daemon's own fds). */
static void helper_main(int fd) {
  char b;
  for (;;) {
    ssize_t n = read(fd, &b, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n != 1) break;
    int c = connect_path();
    if (c < 0) c = open("/dev/null", O_RDONLY | O_CLOEXEC);
    send_fd(fd, c);
    close(c);
    /* Closed here before the parent goes on: a hang-up is the parent's. */
    if (write(fd, "k", 1) != 1) break;
  }
  _exit(0);
}

/* Once per process: a directory for the socket, the helper, no logs (the
 * daemon's errors about hostile inputs are expected; trace shows them). */
static void setup_once(void) {
  snprintf(dir, sizeof dir, "/tmp/fuzz_daemon.XXXXXX");
  if (!mkdtemp(dir)) fail("mkdtemp: %s", strerror(errno));
  snprintf(sock_path, sizeof sock_path, "%s/s", dir);
  log_set_level(LOG_SILENT);
  signal(SIGPIPE, SIG_IGN);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) fail("socketpair");
  helper_pid = fork();
  if (helper_pid < 0) fail("fork: %s", strerror(errno));
  if (helper_pid == 0) {
    close(sv[0]);
    helper_main(sv[1]);
  }
  close(sv[1]);
  helper_fd = sv[0];
}

/* Take a received message's fds into the buffers it names. */
static void take_fds(struct conn *c, uint64_t id, struct frame *f, size_t at, size_t n) {
  struct held *h = NULL;
  for (size_t i = 0; i < c->nheld; i++)
    if (c->held[i].id == id) h = &c->held[i];
  if (!h && c->nheld < MAX_HELD) {
    h = &c->held[c->nheld++];
    h->id = id;
    h->nfds = 0;
  }
  for (size_t i = 0; i < n && at + i < f->nfds; i++) {
    if (!h || h->nfds == 32) continue; /* frame_release closes it */
    h->fds[h->nfds++] = f->fds[at + i];
    f->fds[at + i] = -1;
  }
}

/* "Unmap" a buffer: close the fds the client holds for it. */
static void drop_held(struct conn *c, uint64_t id) {
  for (size_t i = 0; i < c->nheld; i++) {
    if (c->held[i].id != id) continue;
    for (size_t k = 0; k < c->held[i].nfds; k++) close(c->held[i].fds[k]);
    c->held[i] = c->held[--c->nheld];
    return;
  }
}

/* Keep an id in a client's memory, forgetting the oldest when full. */
static void remember(uint64_t *v, size_t *n, uint64_t id) {
  if (*n == MAX_IDS) {
    memmove(v, v + 1, (MAX_IDS - 1) * sizeof *v);
    --*n;
  }
  v[(*n)++] = id;
}

static void send_env(struct world *w, struct conn *c, wire_env *env, int *fds, size_t nfds,
                     bool split);

/* Queue an automatic ack of an event (sent once reading is done: the
 * client does not write from inside its reading). */
static void auto_ack(struct conn *c, const wire_env *ev) {
  if (c->nacks == MAX_IDS) return;
  uint64_t failed = 0;
  if (ev->body_case == GPUMEM__WIRE__ENVELOPE__BODY_UNMAP && ev->unmap->n_buffer_ids)
    failed = ev->unmap->buffer_ids[0];
  c->acks[c->nacks++] = (struct ack){ev->id, failed};
}

/* An envelope with an id and the kind of its body (the caller points the
 * body's member at it). */
static wire_env envelope(uint64_t id, Gpumem__Wire__Envelope__BodyCase body) {
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = id;
  env.body_case = body;
  return env;
}

/* Send the queued automatic acks: OK, or (auto_ack 2) a failure naming
 * the event's first buffer. */
static void send_acks(struct world *w, struct conn *c) {
  while (c->fd >= 0 && c->nacks) {
    struct ack k = c->acks[0];
    memmove(c->acks, c->acks + 1, --c->nacks * sizeof *c->acks);
    Gpumem__Wire__EventAck a = GPUMEM__WIRE__EVENT_ACK__INIT;
    if (c->auto_ack == 2) {
      a.code = GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR;
      a.message = (char *)"fuzz";
      a.failed_ids = &k.failed;
      a.n_failed_ids = k.failed != 0;
    }
    wire_env env = envelope(k.event, GPUMEM__WIRE__ENVELOPE__BODY_ACK);
    env.ack = &a;
    send_env(w, c, &env, NULL, 0, false);
  }
}

/* Check one message from the daemon, and play the client's part. */
static void on_message(struct conn *c, struct frame *f) {
  wire_env *env = wire_unpack(f->data, f->len);
  if (!env) fail("the daemon sent a frame of %zu bytes that does not parse", f->len);
  char why[256];
  wire_code code = wire_check_reply(env, f->nfds, why, sizeof why);
  if (trace)
    fprintf(stderr, "fuzz_daemon:   client %d got message %d, id %llu, %zu fds%s%s\n",
            c->idx, (int)env->body_case,
            (unsigned long long)env->id, f->nfds,
            env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR ? ": " : "",
            env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR ? env->error->message : "");
  if (code) fail("the daemon sent a bad message (type %d): %s", (int)env->body_case, why);
  switch (env->body_case) {
  case GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY:
    remember(c->ids, &c->nids, env->alloc_reply->buffer_id);
    if (f->nfds) take_fds(c, env->alloc_reply->buffer_id, f, 0, f->nfds);
    break;
  case GPUMEM__WIRE__ENVELOPE__BODY_ADOPT_REPLY:
    for (size_t i = 0; i < env->adopt_reply->n_buffer_ids; i++)
      remember(c->ids, &c->nids, env->adopt_reply->buffer_ids[i]);
    break;
  case GPUMEM__WIRE__ENVELOPE__BODY_UNMAP:
    remember(c->events, &c->nevents, env->id);
    if (c->auto_ack) {
      for (size_t i = 0; i < env->unmap->n_buffer_ids; i++) drop_held(c, env->unmap->buffer_ids[i]);
      auto_ack(c, env);
    }
    break;
  case GPUMEM__WIRE__ENVELOPE__BODY_REMAP: {
    remember(c->events, &c->nevents, env->id);
    size_t at = 0;
    for (size_t i = 0; i < env->remap->n_entries; i++) {
      const Gpumem__Wire__RemapEntry *e = env->remap->entries[i];
      take_fds(c, e->buffer_id, f, at, e->n_chunk_sizes);
      at += e->n_chunk_sizes;
    }
    if (c->auto_ack) auto_ack(c, env);
    break;
  }
  default: break;
  }
  wire_env_free(env);
}

/* Read what the daemon sent a client, unless it stopped reading. */
static void drain(struct conn *c) {
  if (c->fd < 0 || !c->reading) return;
  for (int i = 0; i < 64; i++) {
    ssize_t n = frame_reader_fill(c->r, c->fd);
    if (n <= 0 && n != -EPROTO) break;
    struct frame f;
    int rc;
    while (c->fd >= 0 && (rc = frame_reader_next(c->r, &f)) > 0) {
      on_message(c, &f);
      frame_release(&f);
    }
    if (c->fd < 0) return;
  }
}

/* One turn of the daemon's loop, then every client reads; outside a
 * send, clients then send their automatic acks. */
static void pump(struct world *w) {
  static int depth;
  uv_run(&w->loop, UV_RUN_NOWAIT);
  for (int i = 0; i < NCONN; i++) drain(&w->c[i]);
  if (depth) return;
  depth++;
  for (int i = 0; i < NCONN; i++) send_acks(w, &w->c[i]);
  depth--;
}

/* Hang up a client: its socket and every fd it holds. */
static void conn_close(struct conn *c) {
  if (c->fd < 0) return;
  close(c->fd);
  c->fd = -1;
  frame_reader_destroy(c->r);
  c->r = NULL;
  while (c->nheld) drop_held(c, c->held[0].id);
  c->nids = c->nevents = c->nacks = 0;
}

/* Connect a client, from this process or from the helper. */
static void conn_open(struct world *w, struct conn *c, uint8_t how) {
  conn_close(c);
  if (w->connects >= MAX_CONNECTS) return;
  w->connects++;
  int fd = -1;
  if (how & 1) {
    /* libFuzzer's SIGALRM (its -timeout) interrupts these. */
    char b = 'c';
    ssize_t n;
    while ((n = write(helper_fd, &b, 1)) < 0 && errno == EINTR) {
    }
    if (n != 1 || (fd = recv_fd(helper_fd)) < 0) fail("the helper process is gone");
    while ((n = read(helper_fd, &b, 1)) < 0 && errno == EINTR) {
    }
    if (n != 1) fail("the helper process is gone");
  } else {
    fd = connect_path();
  }
  if (fd < 0) return;
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  c->fd = fd;
  c->r = frame_reader_create(WIRE_MAX_REPLY);
  c->reading = true;
  c->auto_ack = (how >> 1) % 3;
  pump(w);
}

/* The client an action names, connected if it was not. */
static struct conn *conn_get(struct world *w, uint8_t b) {
  struct conn *c = &w->c[b % NCONN];
  if (c->fd < 0) conn_open(w, c, b >> 2);
  return c->fd >= 0 ? c : NULL;
}

/* Write all of buf (fds with its first byte), letting the daemon read
 * when the socket is full; gives up after a while (the daemon may have
 * stopped reading this client). */
static void send_bytes(struct world *w, struct conn *c, const uint8_t *buf, size_t len,
                       int *fds, size_t nfds) {
  size_t off = 0;
  for (int tries = 0; off < len && tries < 64 && c->fd >= 0;) {
    ssize_t n = frame_sendmsg(c->fd, buf + off, len - off, fds, nfds, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) {
      tries++;
      pump(w);
      continue;
    }
    if (n < 0) break; /* the daemon hung up */
    nfds = 0;
    off += (size_t)n;
  }
}

/* Frame a payload and send it, whole or in two writes with a turn of the
 * loop between them; the fds (closed here) ride with the first. */
static void send_frame(struct world *w, struct conn *c, const uint8_t *payload, size_t len,
                       int *fds, size_t nfds, bool split) {
  uint8_t *buf = malloc(4 + len);
  if (buf) {
    buf[0] = (uint8_t)len;
    buf[1] = (uint8_t)(len >> 8);
    buf[2] = (uint8_t)(len >> 16);
    buf[3] = (uint8_t)(len >> 24);
    if (len) memcpy(buf + 4, payload, len);
    size_t first = split ? (4 + len) / 2 : 4 + len;
    send_bytes(w, c, buf, first, fds, nfds);
    if (split && c->fd >= 0) {
      pump(w);
      send_bytes(w, c, buf + first, 4 + len - first, NULL, 0);
    }
    free(buf);
  }
  for (size_t i = 0; i < nfds; i++) close(fds[i]);
}

/* Pack an envelope and send it as one frame with fds (closed here). */
static void send_env(struct world *w, struct conn *c, wire_env *env, int *fds, size_t nfds,
                     bool split) {
  size_t len;
  uint8_t *p = wire_pack(env, &len);
  if (p) send_frame(w, c, p, len, fds, nfds, split);
  else
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
  free(p);
}

/* A memfd as the host backend makes chunks (named after device dev, or
 * not), of pages pages, committed or sparse, sealed or not. */
static int make_memfd(unsigned dev, uint64_t pages, uint8_t how) {
  char name[96];
  if (how & 1)
    snprintf(name, sizeof name, "gpumem-host-fuzz-%d:%u", (int)getpid(), dev);
  else
    snprintf(name, sizeof name, "other");
  int fd = memfd_create(name, MFD_CLOEXEC | ((how & 2) ? MFD_ALLOW_SEALING : 0));
  if (fd < 0) return -1;
  uint64_t size = pages * GRAN + ((how & 8) ? 1 : 0);
  if (ftruncate(fd, (off_t)size) < 0 ||
      (!(how & 4) && size && fallocate(fd, 0, 0, (off_t)size) < 0)) {
    close(fd);
    return -1;
  }
  if ((how & 0x12) == 0x12) fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  else if ((how & 0x22) == 0x22) fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE);
  return fd;
}

/* An fd of a kind the input picks. */
static int make_fd(struct conn *c, struct in *in) {
  uint8_t kind = u8(in);
  int fd = -1, sv[2];
  switch (kind % 6) {
  case 0: fd = make_memfd(kind >> 3 & 1, (kind >> 4) + 1u, (uint8_t)(0x13 | (kind & 4))); break;
  case 1: {
    uint8_t pages = u8(in) % 32;
    fd = make_memfd(0, pages, u8(in));
    break;
  }
  case 2: fd = open("/dev/null", O_RDWR | O_CLOEXEC); break;
  case 3:
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0) {
      close(sv[1]);
      fd = sv[0];
    }
    break;
  case 4:
    if (pipe2(sv, O_CLOEXEC) == 0) {
      close(sv[1]);
      fd = sv[0];
    }
    break;
  case 5: fd = fcntl(c->fd, F_DUPFD_CLOEXEC, 0); break; /* the client's own socket */
  }
  return fd >= 0 ? fd : open("/dev/null", O_RDONLY | O_CLOEXEC);
}

/* How an envelope goes out: its id, the fds with it, fd_count, split. */
struct how {
  uint64_t id;
  int fds[FRAME_MAX_FDS];
  size_t nfds;
  bool wrong_count;
  uint32_t count;
  bool split;
};

/* Read an envelope's header: id, flags, and fds to attach. */
static void read_how(struct conn *c, struct in *in, struct how *h) {
  uint8_t id = u8(in);
  h->id = id == 0xff ? u64(in) : id;
  uint8_t flags = u8(in);
  h->nfds = flags & 3;
  if (flags & 0x10) h->nfds = 4 + u8(in) % (FRAME_MAX_FDS - 3);
  for (size_t i = 0; i < h->nfds; i++)
    h->fds[i] = i < 4 || (flags & 0x20) ? make_fd(c, in) : open("/dev/null", O_RDONLY | O_CLOEXEC);
  h->wrong_count = flags & 4;
  h->count = h->wrong_count ? u8(in) : 0;
  h->split = flags & 8;
}

/* Send an envelope with what the header said, adding extra fds after
 * those the body brings (adopt's chunks). */
static void send_how(struct world *w, struct conn *c, wire_env *env, struct how *h,
                     int *body_fds, size_t nbody) {
  int fds[FRAME_MAX_FDS];
  size_t n = 0;
  for (size_t i = 0; i < nbody; i++) {
    if (n < FRAME_MAX_FDS) fds[n++] = body_fds[i];
    else close(body_fds[i]);
  }
  for (size_t i = 0; i < h->nfds; i++) {
    if (n < FRAME_MAX_FDS) fds[n++] = h->fds[i];
    else close(h->fds[i]);
  }
  env->id = h->id;
  env->fd_count = h->wrong_count ? h->count : (uint32_t)n;
  send_env(w, c, env, fds, n, h->split);
}

/* A string the input spells: a short one, or one of a few names. */
static char *str(struct in *in, char *buf, size_t cap) {
  uint8_t b = u8(in);
  static const char *const pool[] = {"a", "b", "tag-1", "", "w.0", "x y", "\xc3\xa9", "\n"};
  if (!(b & 0x80)) {
    snprintf(buf, cap, "%s", pool[b % 8]);
    return buf;
  }
  size_t n = b & 0x7f;
  if (n >= cap) n = cap - 1;
  for (size_t i = 0; i < n; i++) buf[i] = (char)u8(in);
  buf[n] = '\0';
  return buf;
}

/* A buffer id: one the client was given, or any. */
static uint64_t buffer_id(struct conn *c, struct in *in) {
  uint8_t b = u8(in);
  if (!(b & 0x80) && c->nids) return c->ids[c->nids - 1 - b % c->nids];
  return b & 0x40 ? u64(in) : b & 0x3f;
}

/* A pid for a scope: ours, the helper's, 0, or any. */
static uint32_t pid_of(struct in *in) {
  uint8_t b = u8(in);
  switch (b % 4) {
  case 0: return (uint32_t)getpid();
  case 1: return (uint32_t)helper_pid;
  case 2: return 0;
  default: return u32(in);
  }
}

/* Sizes: mostly a few pages, sometimes a lot, or anything. */
static uint64_t size_of(struct in *in) {
  uint8_t b = u8(in);
  switch (b >> 6) {
  case 0: return (b & 0x3f) * GRAN;
  case 1: return ((uint64_t)(b & 0x3f) + 1) * 64 * GRAN;
  case 2: return (b & 0x3f) * GRAN + u8(in);
  default: return u64(in);
  }
}

/* Hello in a role (any of the enum's, or one past), speaking protocol
 * 1 or a version the input gives, under a name. */
static void act_hello(struct world *w, struct conn *c, struct in *in, struct how *h) {
  char name[160];
  Gpumem__Wire__Hello m = GPUMEM__WIRE__HELLO__INIT;
  uint8_t b = u8(in);
  m.role = b & 3;
  m.version_major = (b & 4) ? u8(in) : WIRE_VERSION_MAJOR;
  m.version_minor = WIRE_VERSION_MINOR;
  m.name = str(in, name, sizeof name);
  wire_env env = envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_HELLO);
  env.hello = &m;
  send_how(w, c, &env, h, NULL, 0);
}

/* Allocate: a tag, a device (one past the last too), a size, flags. */
static void act_alloc(struct world *w, struct conn *c, struct in *in, struct how *h) {
  char tag[160];
  Gpumem__Wire__AllocRequest m = GPUMEM__WIRE__ALLOC_REQUEST__INIT;
  m.tag = str(in, tag, sizeof tag);
  uint8_t b = u8(in);
  m.device = b & 0x80 ? u32(in) : b % (NDEV + 1);
  m.size = size_of(in);
  m.flags = b & 0x40 ? u32(in) : (b >> 2) & 7;
  wire_env env = envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC);
  env.alloc = &m;
  send_how(w, c, &env, h, NULL, 0);
}

/* Free a buffer the client was given, or any id. */
static void act_free(struct world *w, struct conn *c, struct in *in, struct how *h) {
  Gpumem__Wire__FreeRequest m = GPUMEM__WIRE__FREE_REQUEST__INIT;
  m.buffer_id = buffer_id(c, in);
  wire_env env = envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_FREE);
  env.free = &m;
  send_how(w, c, &env, h, NULL, 0);
}

/* A pause or resume: tags, devices, timeout, scope. */
static void act_op(struct world *w, struct conn *c, struct in *in, struct how *h, bool resume) {
  char tagbuf[4][160], prefix[160];
  char *tags[4];
  uint32_t devs[4], pids[4];
  uint8_t b = u8(in);
  size_t ntags = b & 3, ndevs = (b >> 2) & 3, npids = (b >> 4) & 3;
  for (size_t i = 0; i < ntags; i++) tags[i] = str(in, tagbuf[i], sizeof tagbuf[i]);
  for (size_t i = 0; i < ndevs; i++) devs[i] = u8(in) % (NDEV + 2);
  for (size_t i = 0; i < npids; i++) pids[i] = pid_of(in);
  uint8_t t = u8(in);
  uint32_t timeout = t & 0x80 ? u32(in) : t & 0x7f;
  bool own = b & 0x40;
  char *pre = b & 0x80 ? str(in, prefix, sizeof prefix) : (char *)"";
  uint64_t residual = (t & 0x40) ? u64(in) : 0;
  wire_env env = envelope(0, resume ? GPUMEM__WIRE__ENVELOPE__BODY_RESUME
                                    : GPUMEM__WIRE__ENVELOPE__BODY_PAUSE);
  Gpumem__Wire__PauseRequest p = GPUMEM__WIRE__PAUSE_REQUEST__INIT;
  Gpumem__Wire__ResumeRequest r = GPUMEM__WIRE__RESUME_REQUEST__INIT;
  if (resume) {
    r.tags = tags, r.n_tags = ntags, r.devices = devs, r.n_devices = ndevs;
    r.timeout_ms = timeout, r.pids = pids, r.n_pids = npids, r.own = own;
    r.session_prefix = pre;
    env.resume = &r;
  } else {
    p.tags = tags, p.n_tags = ntags, p.devices = devs, p.n_devices = ndevs;
    p.timeout_ms = timeout, p.pids = pids, p.n_pids = npids, p.own = own;
    p.session_prefix = pre, p.max_residual = residual;
    env.pause = &p;
  }
  send_how(w, c, &env, h, NULL, 0);
}

/* Acknowledge an event with any code and failed buffers. */
static void act_ack(struct world *w, struct conn *c, struct in *in, struct how *h) {
  char msg[160];
  Gpumem__Wire__EventAck a = GPUMEM__WIRE__EVENT_ACK__INIT;
  uint8_t b = u8(in);
  uint64_t failed[3];
  a.code = b & 0x80 ? (Gpumem__Wire__ErrorCode)u32(in) : (Gpumem__Wire__ErrorCode)(b & 3);
  a.n_failed_ids = (b >> 2) & 3;
  for (size_t i = 0; i < a.n_failed_ids; i++) failed[i] = buffer_id(c, in);
  a.failed_ids = failed;
  a.message = str(in, msg, sizeof msg);
  /* The event: one the client was sent (the id byte picks which), unless
   * the header's id byte asks for itself. */
  if (!(b & 0x40) && c->nevents) h->id = c->events[c->nevents - 1 - h->id % c->nevents];
  if (b & 0x20) /* "unmap" first: the client lets go of what it holds */
    for (size_t i = 0; i < c->nids; i++) drop_held(c, c->ids[i]);
  wire_env env = envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_ACK);
  env.ack = &a;
  send_how(w, c, &env, h, NULL, 0);
}

/* A status or a list request (a page at cursors and a limit the input
 * picks), or a share of one of the tags. */
static void act_look(struct world *w, struct conn *c, struct in *in, struct how *h, int kind) {
  Gpumem__Wire__StatusRequest s = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  Gpumem__Wire__ListRequest l = GPUMEM__WIRE__LIST_REQUEST__INIT;
  Gpumem__Wire__ShareRequest sh = GPUMEM__WIRE__SHARE_REQUEST__INIT;
  char tag[160];
  uint8_t b = u8(in);
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  if (kind == 1) {
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_LIST;
    l.after = b & 1 ? u8(in) : 0;
    l.limit = b & 2 ? u8(in) : 0;
    env.list = &l;
  } else if (kind == 2) {
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_SHARE;
    sh.tag = str(in, tag, sizeof tag);
    sh.shared = b & 4;
    env.share = &sh;
  } else {
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_STATUS;
    s.tag_cursor = b & 1 ? u8(in) : 0;
    s.session_cursor = b & 2 ? u8(in) : 0;
    s.limit = b & 4 ? u8(in) : 0;
    env.status = &s;
  }
  send_how(w, c, &env, h, NULL, 0);
}

/* Re-register buffers, with memfds for their chunks made as the input
 * says (mostly as the backend makes them, so that some adopts succeed). */
static void act_adopt(struct world *w, struct conn *c, struct in *in, struct how *h) {
  enum { MAXB = 3, MAXC = 3 };
  Gpumem__Wire__AdoptBuffer bufs[MAXB], *pb[MAXB];
  char tags[MAXB][160];
  uint64_t sizes[MAXB][MAXC];
  int fds[MAXB * MAXC];
  size_t nfds = 0;
  uint8_t b = u8(in);
  size_t n = b % (MAXB + 1);
  for (size_t i = 0; i < n; i++) {
    Gpumem__Wire__AdoptBuffer *a = &bufs[i];
    gpumem__wire__adopt_buffer__init(a);
    pb[i] = a;
    a->tag = str(in, tags[i], sizeof tags[i]);
    uint8_t x = u8(in);
    a->device = x % (NDEV + 1);
    a->flags = (x >> 2) & 7;
    a->paused = x & 0x20;
    a->n_chunk_sizes = 1 + (x >> 6) % MAXC;
    a->chunk_sizes = sizes[i];
    uint8_t how = u8(in); /* how the memfds are made: 0 as the backend does */
    for (size_t k = 0; k < a->n_chunk_sizes; k++) {
      uint8_t pages = u8(in);
      sizes[i][k] = (pages % 16 + (how & 0x40 ? 0 : 1)) * GRAN;
      a->size += sizes[i][k];
      if (a->paused) continue;
      int fd = make_memfd(a->device, sizes[i][k] / GRAN, (uint8_t)((how ^ 0x13) & 0x3f));
      fds[nfds++] = fd >= 0 ? fd : open("/dev/null", O_RDONLY | O_CLOEXEC);
    }
    if (how & 0x80) a->size += u8(in) * GRAN;
  }
  Gpumem__Wire__AdoptRequest m = GPUMEM__WIRE__ADOPT_REQUEST__INIT;
  m.buffers = pb;
  m.n_buffers = n;
  wire_env env = envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_ADOPT);
  env.adopt = &m;
  send_how(w, c, &env, h, fds, nfds);
}

/* Raw bytes: a frame of them, or bytes straight onto the stream (a frame
 * header of any length, a half-sent frame). */
static void act_raw(struct world *w, struct conn *c, struct in *in, struct how *h) {
  uint8_t b = u8(in);
  size_t len = b & 0x7f;
  if (len == 0x7f) len = u16(in);
  if (len > in->n) len = in->n;
  if (b & 0x80) {
    send_bytes(w, c, in->p, len, h->fds, h->nfds);
    for (size_t i = 0; i < h->nfds; i++) close(h->fds[i]);
  } else {
    send_frame(w, c, in->p, len, h->fds, h->nfds, h->split);
  }
  in->p += len;
  in->n -= len;
}

/* Let the daemon's timers run: the loop waits up to ms milliseconds. */
static void on_wait(uv_timer_t *t) { *(bool *)t->data = true; }

/* Run the loop, sleeping in it, until ms have passed. */
static void wait_ms(struct world *w, unsigned ms) {
  uv_timer_t t;
  bool fired = false;
  uv_timer_init(&w->loop, &t);
  t.data = &fired;
  /* Repeating: UV_RUN_ONCE that runs the timer as it starts would block
   * on the daemon's sockets for ever; a timer still due keeps it short. */
  uv_timer_start(&t, on_wait, ms, 1);
  for (int i = 0; i < 100 && !fired; i++) {
    uv_run(&w->loop, UV_RUN_ONCE);
    for (int k = 0; k < NCONN; k++) drain(&w->c[k]);
  }
  uv_close((uv_handle_t *)&t, NULL);
  pump(w);
}

/* Run one action. */
static void act(struct world *w, struct in *in) {
  uint8_t op = u8(in);
  uint8_t who = u8(in);
  struct conn *c;
  struct how h;
  static const char *const names[] = {"connect", "close", "pump", "reading", "half-close",
                                      "wait", "hello", "alloc", "alloc", "free", "pause",
                                      "resume", "ack", "status/list", "adopt", "raw"};
  if (trace)
    fprintf(stderr, "fuzz_daemon: %s, client %d (0x%02x), %zu bytes left\n", names[op % 16],
            who % NCONN, who, in->n);
  switch (op % 16) {
  case 0: conn_open(w, &w->c[who % NCONN], who >> 2); return;
  case 1: conn_close(&w->c[who % NCONN]); pump(w); return;
  case 2:
    for (unsigned i = 0; i <= who % 8u; i++) pump(w);
    return;
  case 3: /* stop or start reading */
    w->c[who % NCONN].reading = who & 4;
    pump(w);
    return;
  case 4: /* half-close: no more requests */
    if (w->c[who % NCONN].fd >= 0) shutdown(w->c[who % NCONN].fd, SHUT_WR);
    pump(w);
    return;
  case 5:
    if (!w->waited) {
      w->waited = true;
      wait_ms(w, 1 + who % 8u);
    }
    return;
  }
  if (!(c = conn_get(w, who))) return;
  read_how(c, in, &h);
  switch (op % 16) {
  case 6: act_hello(w, c, in, &h); break;
  case 7:
  case 8: act_alloc(w, c, in, &h); break;
  case 9: act_free(w, c, in, &h); break;
  case 10: act_op(w, c, in, &h, false); break;
  case 11: act_op(w, c, in, &h, true); break;
  case 12: act_ack(w, c, in, &h); break;
  case 13:
    if (w->slow < MAX_SLOW) {
      w->slow++;
      act_look(w, c, in, &h, op & 0x10 ? 1 : op & 0x20 ? 2 : 0);
    } else {
      for (size_t i = 0; i < h.nfds; i++) close(h.fds[i]);
    }
    break;
  case 14: act_adopt(w, c, in, &h); break;
  default: act_raw(w, c, in, &h); break;
  }
  pump(w);
}

/* The daemon's settings for this input: main.c's defaults, small devices,
 * and limits or timeouts the first byte picks. */
static void configure(struct config *cfg, uint8_t b) {
  *cfg = (struct config){
      .socket_path = sock_path,
      .backend = "host",
      .host_devices = NDEV,
      .host_device_size = DEV_SIZE,
      .host_granularity = GRAN,
      .chunk_size = b & 1 ? GRAN * 64 : 1ull << 30,
      .backup_limit = b & 2 ? DEV_SIZE : 4 * DEV_SIZE,
      .verify_backups = b & 4,
      .ack_timeout_ms = b & 8 ? 5 : 10000,
      .timeout_policy = TIMEOUT_REPORT, /* kill would signal this process */
      .max_sessions_per_uid = b & 16 ? 2 : 4096,
      .max_buffers_per_session = b & 32 ? 3 : 1000000,
      .max_buffers_per_uid = b & 32 ? 5 : 1000000,
      .max_device_bytes_per_uid = b & 32 ? 16 * GRAN : 0,
      .max_backup_bytes_per_uid = b & 32 ? 8 * GRAN : 0,
      .max_parked_fds_per_session = b & 64 ? 8 : 253,
      .max_parked_fds_per_uid = b & 64 ? 16 : 4096,
      .frame_timeout_ms = b & 128 ? 5 : 10000,
      .max_queued_per_session = b & 64 ? 4096 : 4ull << 20,
      .max_queued_total = b & 64 ? 16384 : 256ull << 20,
      .controller_uid = (uid_t)-1,
      .controller_gid = (gid_t)-1,
      .socket_gid = (gid_t)-1,
      .socket_mode = 0600,
      .listen_fd = -1,
  };
}

/* Stop the daemon as SIGTERM does, let it drain and free everything. */
static void stop(struct world *w) {
  sigset_t mask;
  sigprocmask(SIG_SETMASK, NULL, &mask);
  raise(SIGTERM);
  uv_run(&w->loop, UV_RUN_DEFAULT);
  server_destroy(w->srv);
  /* server_destroy leaves SIGTERM and SIGINT blocked (the daemon exits
   * next); the next input needs them. */
  sigprocmask(SIG_SETMASK, &mask, NULL);
  int rc = uv_loop_close(&w->loop);
  if (rc) fail("handles still open on the loop after the daemon stopped: %s", uv_strerror(rc));
  gpudev_close(w->g);
}

/* Run one input against a fresh daemon. */
static void run(const uint8_t *data, size_t size) {
  static struct world w;
  struct in in = {data, size};
  memset(&w, 0, sizeof w);
  for (int i = 0; i < NCONN; i++) w.c[i].fd = -1, w.c[i].idx = i;
  configure(&w.cfg, u8(&in));
  char node[32], err[256];
  snprintf(node, sizeof node, "fuzz-%d", (int)getpid());
  struct gpudev_options o = {.backend = "host", .host_devices = NDEV,
                             .host_device_size = DEV_SIZE, .host_granularity = GRAN,
                             .host_node = node};
  if (gpudev_open(&o, &w.g, err, sizeof err) < 0) fail("gpudev_open: %s", err);
  if (w.cfg.chunk_size < gpudev_granularity(w.g)) w.cfg.chunk_size = gpudev_granularity(w.g);
  uv_loop_init(&w.loop);
  w.srv = server_create(&w.loop, &w.cfg, w.g, err, sizeof err);
  if (!w.srv) fail("server_create: %s", err);
  while (in.n) act(&w, &in);
  /* Every client goes: the daemon must give back all device memory. */
  for (int i = 0; i < 4; i++) pump(&w);
  for (int i = 0; i < NCONN; i++) conn_close(&w.c[i]);
  for (int i = 0; i < 8; i++) uv_run(&w.loop, UV_RUN_NOWAIT);
  for (unsigned d = 0; d < NDEV; d++) {
    uint64_t free_bytes, total;
    if (gpudev_mem_info(w.g, d, &free_bytes, &total) < 0) fail("gpudev_mem_info: %s", gpu_error());
    if (free_bytes != total)
      fail("device %u: %llu bytes still committed after every client left", d,
           (unsigned long long)(total - free_bytes));
  }
  stop(&w);
}

/* The fds are counted around each input: libFuzzer itself opens some
 * between inputs (the symbolizer's pipes). */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static bool warm;
  if (!warm) {
    warm = true;
    setup_once();
    trace = getenv("FUZZ_DAEMON_TRACE") != NULL;
    if (trace) log_set_level(LOG_DEBUG);
    run(NULL, 0); /* libuv's process-wide fds open on first use */
  }
  int before = fd_count();
  run(data, size);
  int after = fd_count();
  if (after != before) {
    fd_dump();
    fail("%d fds open after the daemon stopped, %d before", after, before);
  }
  return 0;
}
