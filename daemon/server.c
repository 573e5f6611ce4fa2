#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"
#include "engine.h"
#include "fdbudget.h"
#include "listener.h"
#include "notify.h"
#include "peer.h"
#include "reclaim.h"
#include "registry.h"
#include "report.h"
#include "grace.h"
#include "journal.h"
#include "keeper.h"
#include "rejoin.h"
#include "safedir.h"
#include "session.h"
#include "stats.h"

struct server {
  uv_loop_t *loop;
  const struct config *cfg;
  gpudev *gpu;
  registry *reg;
  engine *eng;
  stats *stats; /* what the daemon did since it started */
  int listen_fd;
  uv_poll_t listen_poll;
  uv_signal_t sigterm, sigint;
  struct list sessions; /* struct owner.link of every session */
  struct list attach_waits; /* struct attach_wait.link, oldest first */
  uv_timer_t attach_timer;  /* looks at them again: a deadline, or a buffer let go of */
  struct outbox out;    /* the engine's way to the sessions */
  struct session_host host; /* the sessions' way to the server */
  uint64_t next_session_id;
  int reserve_fd; /* given up to accept-and-close when out of fds */
  bool starved;   /* out of fds: listening paused, counting refusals */
  unsigned long long refused;       /* in this episode */
  unsigned long long refused_total; /* since the start */
  unsigned long long backoffs;      /* pauses of listening in this episode */
  uint64_t starved_since;           /* the episode's start (uv_now) */
  size_t queued_total;              /* output queued over every session */
  uv_timer_t accept_timer; /* listens again after a back-off */
  uv_idle_t reaper;        /* closes doomed sessions on the loop's next turn */
  uv_idle_t backlog;       /* serves frames that waited for the next turn */
  struct list backlog_sessions; /* struct session.backlog_link, in turn */
  int exit_status;
  bool stopping;          /* told every session; waiting for them to drain */
  uv_timer_t stop_timer;  /* closes sessions that do not drain in time */
  grace *grace;           /* new tags wait while workers re-register */
  journal *journal;       /* what a daemon after us must know; NULL: none */
  bool journal_loaded;    /* the daemon before us left one: re-registrations are checked
                             against it, and new tags need not wait */
  uv_check_t journal_check; /* after a turn of the loop: starts journal_timer */
  uv_timer_t journal_timer; /* writes what changed, JOURNAL_DELAY_MS after */
  keeper *keeper;           /* holds persistent buffers no session holds */
  rejoin *rejoin;           /* buffers of ended sessions whose processes live on */
};

/* An attach that waits for its buffer's holder to let go of it. */
struct attach_wait {
  struct list link;
  struct session *s;
  uint64_t id;           /* the request's */
  uint64_t since_ms, deadline_ms; /* the loop's clock */
  Gpumem__Wire__AttachRequest req; /* name points at name */
  char name[WIRE_TAG_MAX + 1];
};

/* Attaches one session may have waiting. */
#define SERVER_ATTACH_WAITS_PER_SESSION 64
/* How often a waiting attach looks again while its buffer is busy in a
 * pause or resume, or still mapped by the process that let go of it. */
#define SERVER_ATTACH_RECHECK_MS 20

/* How long sessions may take to read the shutdown notice. */
#define SERVER_DRAIN_MS 1000
/* How long one turn of the loop serves waiting frames before it polls
 * again (a session's batch once begun is finished). */
#define SERVER_BACKLOG_BUDGET_NS 2000000
/* How long to stop listening when out of fds. */
#define SERVER_ACCEPT_BACKOFF_MS 100
/* The descriptors that answers to a session's backup requests may hold
 * while it has not read them. */
#define SERVER_BACKUP_FDS_QUEUED 64
/* How long a change no reply waits for may wait to be journaled. */
#define JOURNAL_DELAY_MS 10

static void on_accept(uv_poll_t *h, int status, int events);
static void on_signal(uv_signal_t *h, int signum);
static void serve_waiting(void *ctx, struct session *s, uint64_t id,
                          const Gpumem__Wire__AllocRequest *a);
static void on_grace_end(void *ctx);
static void refuse_session(struct session *s, uint64_t id, wire_code code, const char *text);
static void on_frame(void *ctx, struct session *s, struct frame *f);
static void on_doomed(void *ctx, struct session *s);
static void on_closed(void *ctx, struct session *s);
static void on_frames_wait(void *ctx, struct session *s);
static struct session *biggest_queue(void *ctx);
static size_t parked_fds(void *ctx, uid_t uid);
static void attach_wake(server *srv);
static void attach_forget(server *srv, struct session *s);

/* The outbox's send: session_send to the owner's session. */
static int out_send(void *ctx, struct owner *o, const wire_env *env, const int *fds, size_t nfds) {
  server *srv = ctx;
  if (o->keeper) { /* an event for the keeper: it maps nothing, it answers */
    for (size_t i = 0; i < nfds; i++) close(fds[i]);
    return keeper_event(srv->keeper, env->id);
  }
  return session_send(session_of(o), env, fds, nfds);
}

/* The outbox's send_error: session_send_error to the owner's session. */
static void out_send_error(void *ctx, struct owner *o, uint64_t id, const struct fault *f) {
  (void)ctx;
  if (o->keeper) {
    log_error("persistent buffers with no holder: %s", f->text);
    return;
  }
  session_send_error(session_of(o), id, f);
}

/* The outbox's end: say f, then end the owner's session. */
static void out_end(void *ctx, struct owner *o, const struct fault *f) {
  (void)ctx;
  if (o->keeper) return; /* no session: the daemon keeps what it holds */
  session_end(session_of(o), SESSION_END_NEXT_TURN, 0, f);
}

/* The outbox's stop: kill the owner's process. */
static int out_stop(void *ctx, struct owner *o) {
  (void)ctx;
  return o->keeper ? -EBADF : session_kill(session_of(o));
}

/* The outbox's pinned: whether the owner's process is the one pinned. */
static int out_pinned(void *ctx, struct owner *o) {
  (void)ctx;
  if (o->keeper) return -EBADF;
  struct session *s = session_of(o);
  return s->pidfd < 0 ? -EBADF : peer_signal(s->pidfd, 0);
}

/* The keeper's answer to its event: done, nothing failed, nothing mapped. */
static void on_keeper_ack(void *ctx, struct owner *o, uint64_t event_id) {
  server *srv = ctx;
  Gpumem__Wire__EventAck ack = GPUMEM__WIRE__EVENT_ACK__INIT;
  ack.nothing_mapped = true;
  if (srv->eng) engine_ack(srv->eng, o, event_id, &ack);
}

/* Write what changed to the journal. */
static void on_journal_timer(uv_timer_t *h) { journal_flush(((server *)h->data)->journal); }

/* What a turn of the loop changed is written within JOURNAL_DELAY_MS (what
 * a reply reports, such as a new buffer and its secret, before the reply):
 * a free or a pause then rides the next allocation's write, one write
 * instead of two on the alloc path, and what a crash meanwhile loses
 * (a buffer freed, paused or resumed) makes a successor wait for a buffer
 * that does not come back, or take one back in another state. */
static void on_journal_check(uv_check_t *h) {
  server *srv = h->data;
  if (journal_pending(srv->journal) && !uv_is_active((uv_handle_t *)&srv->journal_timer))
    uv_timer_start(&srv->journal_timer, on_journal_timer, JOURNAL_DELAY_MS, 0);
}

/* Open the journal (none with --journal none), take back what the daemon
 * before left in it, and write it whole for the daemon after: 0, or -1
 * with err filled (the daemon does not start). A journal found makes the
 * grace (*grace_ms) how long its buffers wait for their workers (10 s
 * unless --adopt-grace says), over as soon as every one is back. */
static int journal_start(server *srv, uint64_t *grace_ms, char *err, size_t errlen) {
  const char *path = srv->cfg->journal_path;
  if (!path) {
    log_info("no journal (--journal none): a daemon after this one trusts re-registrations "
             "it cannot check");
    return 0;
  }
  char dir[4200];
  snprintf(dir, sizeof dir, "%s", path);
  int dfd = safedir_open("journal directory", dirname(dir), "the journal", err, errlen);
  if (dfd < 0 && !srv->cfg->journal_explicit) { /* its default place will not do */
    log_warn("no journal: %s (name one with --journal)", err);
    err[0] = 0;
    return 0;
  }
  if (dfd < 0) return -1;
  close(dfd);
  struct journal_identity who = {gpudev_name(srv->gpu), gpudev_device_count(srv->gpu)};
  if (!(srv->journal = journal_open(path, &who, err, errlen))) return -1;
  journal *j = srv->journal;
  const char *why;
  enum journal_found found = journal_found(j, &why);
  if (found == JOURNAL_LOADED) {
    if (!reclaim_restore(srv->reg, j, srv->cfg->fdstore, keeper_owner(srv->keeper))) {
      snprintf(err, errlen, "journal %s: out of memory taking it back", path);
      return -1;
    }
    srv->journal_loaded = true;
    if (!srv->cfg->adopt_grace_set) *grace_ms = 10000;
    size_t nt, nb = journal_expected_count(j);
    journal_tags(j, &nt);
    if (*why) log_warn("journal %s: %s", path, why);
    log_info("journal %s: %zu tags and %zu buffers of the daemon before; its buffers wait "
             "%.1f s for their workers, who must prove them theirs",
             path, nt, nb, (double)*grace_ms / 1e3);
    if (!nb || !*grace_ms) {
      reclaim_expire(srv->reg, j);
      *grace_ms = 0;
    }
  } else if (found == JOURNAL_REJECTED) {
    log_error("journal %s is not trusted: %s; put aside as %s.rejected, and re-registrations "
              "are trusted as by a daemon without a journal",
              path, why, path);
  } else {
    log_info("journal %s: none found (a first start, or it was lost): re-registrations are "
             "trusted as by a daemon without a journal",
             path);
  }
  registry_set_journal(srv->reg, j);
  char werr[256];
  if (journal_rewrite(j, registry_journal_fill, srv->reg, werr, sizeof werr) < 0)
    log_error("%s", werr);
  return 0;
}

/* Stop writing the journal: a daemon going away frees buffers that its
 * workers keep for the next one. */
static void journal_stop(server *srv) {
  if (!srv->journal) return;
  journal_flush(srv->journal);
  registry_set_journal(srv->reg, NULL);
  if (srv->journal_check.data && !uv_is_closing((uv_handle_t *)&srv->journal_check)) {
    uv_close((uv_handle_t *)&srv->journal_check, NULL);
    uv_close((uv_handle_t *)&srv->journal_timer, NULL);
  }
}

/* Bind the socket and get ready to serve. */
server *server_create(uv_loop_t *loop, const struct config *cfg, gpudev *g,
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
  srv->out = (struct outbox){.ctx = srv, .send = out_send, .send_error = out_send_error,
                             .end = out_end, .stop = out_stop, .pinned = out_pinned};
  srv->host = (struct session_host){.ctx = srv, .cfg = cfg, .queued_total = &srv->queued_total,
                                    .frame = on_frame, .doomed = on_doomed, .closed = on_closed,
                                    .frames_wait = on_frames_wait,
                                    .biggest_queue = biggest_queue, .parked_fds = parked_fds};
  list_init(&srv->sessions);
  list_init(&srv->attach_waits);
  list_init(&srv->backlog_sessions);
  srv->listen_fd = cfg->listen_fd >= 0 ? cfg->listen_fd
                                       : listener_open(cfg->socket_path, cfg->socket_mode,
                                                       cfg->socket_gid, err, errlen);
  if (srv->listen_fd < 0) {
    free(srv);
    return NULL;
  }
  struct registry_options ro = {.chunk_size = cfg->chunk_size,
                                .backup_limit = cfg->backup_limit,
                                .verify_backups = cfg->verify_backups,
                                .overflow_pageable = cfg->overflow_pageable,
                                .disk = cfg->backup_disk != NULL,
                                .quotas = {.buffers = cfg->max_buffers_per_uid,
                                           .device_bytes = cfg->max_device_bytes_per_uid,
                                           .backup_bytes = cfg->max_backup_bytes_per_uid},
                                .shared_names = cfg->shared_tags,
                                .nshared_names = cfg->nshared_tags,
                                .loop = loop};
  srv->reg = registry_create(g, &ro);
  srv->stats = stats_create();
  srv->eng = srv->reg && srv->stats
                 ? engine_create(loop, srv->reg, g, cfg, &srv->sessions, &srv->out, srv->stats)
                 : NULL;
  uint64_t grace_ms = cfg->adopt_grace_ms;
  /* The keeper first: the journal's persistent buffers that no process
   * held come back to it from systemd's fd store. Neither it nor rejoin
   * has a handle before its first use. */
  srv->keeper = srv->eng ? keeper_create(loop, on_keeper_ack, srv) : NULL;
  if (srv->keeper) registry_set_fdstore(srv->reg, cfg->fdstore);
  bool journal_ok = srv->keeper && journal_start(srv, &grace_ms, err, errlen) == 0;
  if (journal_ok) fdstore_forget_left(cfg->fdstore); /* chunks of buffers no journal named */
  srv->grace = journal_ok ? grace_create(loop, grace_ms, serve_waiting, on_grace_end, srv) : NULL;
  if (srv->grace) engine_set_grace(srv->eng, srv->grace);
  srv->rejoin = srv->grace ? rejoin_create(loop) : NULL;
  if (!srv->rejoin) {
    registry_set_fdstore(srv->reg, NULL); /* what is in it stays, for the next daemon */
    if (srv->eng) engine_set_grace(srv->eng, NULL);
    grace_destroy(srv->grace);
    if (journal_ok || !srv->keeper) snprintf(err, errlen, "out of memory"); /* else err says */
    journal_stop(srv);
    journal_close(srv->journal);
    engine_destroy(srv->eng);
    stats_destroy(srv->stats);
    registry_destroy(srv->reg);
    keeper_free(srv->keeper); /* after its buffers */
    close(srv->listen_fd);
    if (cfg->listen_fd < 0) unlink(cfg->socket_path);
    free(srv);
    return NULL;
  }
  if (srv->journal) {
    uv_check_init(loop, &srv->journal_check);
    uv_timer_init(loop, &srv->journal_timer);
    srv->journal_check.data = srv->journal_timer.data = srv;
    uv_check_start(&srv->journal_check, on_journal_check);
    uv_unref((uv_handle_t *)&srv->journal_check);
    uv_unref((uv_handle_t *)&srv->journal_timer);
  }
  srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  uv_timer_init(loop, &srv->accept_timer);
  srv->accept_timer.data = srv;
  uv_timer_init(loop, &srv->attach_timer);
  srv->attach_timer.data = srv;
  uv_idle_init(loop, &srv->reaper);
  srv->reaper.data = srv;
  uv_idle_init(loop, &srv->backlog);
  srv->backlog.data = srv;
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
           gpudev_name(srv->gpu), gpudev_device_count(srv->gpu));
  uv_run(srv->loop, UV_RUN_DEFAULT);
  return srv->exit_status;
}

/* Free everything that is left once the loop has stopped. */
void server_destroy(server *srv) {
  if (!srv) return;
  if (srv->eng) engine_set_grace(srv->eng, NULL);
  grace_destroy(srv->grace); /* NULL once stopping began */
  if (srv->stopping) {
    /* A second signal while the handles close stays pending, unanswered:
     * we are leaving anyway. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigprocmask(SIG_BLOCK, &set, NULL);
    uv_close((uv_handle_t *)&srv->sigterm, NULL);
    uv_close((uv_handle_t *)&srv->sigint, NULL);
    /* Closing them put back the default action, which would let a thread
     * that does not block them (a GPU driver's) die of one: ignore them. */
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    uv_run(srv->loop, UV_RUN_DEFAULT);
  }
  journal_stop(srv);
  registry_destroy(srv->reg);
  keeper_free(srv->keeper); /* after its buffers, which registry_destroy freed */
  rejoin_free(srv->rejoin);
  journal_close(srv->journal);
  /* Buffers that were still there gave up the jobs making their backup
   * memory: let those end (and free what they made). */
  if (srv->stopping) uv_run(srv->loop, UV_RUN_DEFAULT);
  if (srv->reserve_fd >= 0) close(srv->reserve_fd);
  stats_destroy(srv->stats);
  free(srv);
}

/* Sessions that did not take their shutdown notice in time are closed. */
static void on_stop_timer(uv_timer_t *t) {
  server *srv = t->data;
  struct list *p, *n;
  list_for_each_safe(p, n, &srv->sessions) session_close(list_entry(p, struct session, owner.link));
  if (!uv_is_closing((uv_handle_t *)t)) uv_close((uv_handle_t *)t, NULL);
}

/* Tell every session the daemon is going (workers keep their mappings and
 * re-register with the next daemon), answer operations in flight, and
 * close every handle so that uv_run returns. */
static void on_signal(uv_signal_t *h, int signum) {
  server *srv = h->data;
  if (srv->stopping) return;
  srv->stopping = true;
  log_info("%s: shutting down", strsignal(signum));
  journal_stop(srv); /* the journal says what was before the shutdown */
  keeper_close(srv->keeper);
  rejoin_close(srv->rejoin);
  attach_forget(srv, NULL); /* their sessions hear of the shutdown */
  uv_close((uv_handle_t *)&srv->attach_timer, NULL);
  engine_set_grace(srv->eng, NULL);
  grace_destroy(srv->grace); /* what waited is answered as below */
  srv->grace = NULL;
  notify_stopping();
  engine_destroy(srv->eng);
  srv->eng = NULL;
  uv_timer_init(srv->loop, &srv->stop_timer);
  srv->stop_timer.data = srv;
  uv_timer_start(&srv->stop_timer, on_stop_timer, SERVER_DRAIN_MS, 0);
  char text[128];
  snprintf(text, sizeof text, "gpumemd is shutting down (%s); buffers stay mapped",
           strsignal(signum));
  struct list *p, *t;
  struct fault f = {0};
  fault_set(&f, GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN, "%s", text);
  list_for_each_safe(p, t, &srv->sessions)
      session_end(list_entry(p, struct session, owner.link), SESSION_END_DRAIN, 0, &f);
  if (list_empty(&srv->sessions) && !uv_is_closing((uv_handle_t *)&srv->stop_timer))
    uv_close((uv_handle_t *)&srv->stop_timer, NULL);
  uv_close((uv_handle_t *)&srv->listen_poll, NULL);
  uv_close((uv_handle_t *)&srv->accept_timer, NULL);
  uv_close((uv_handle_t *)&srv->reaper, NULL);
  uv_close((uv_handle_t *)&srv->backlog, NULL);
  close(srv->listen_fd);
  /* A socket systemd passed is systemd's: it stays for the next start. */
  if (srv->cfg->listen_fd < 0) unlink(srv->cfg->socket_path);
  /* Still caught while sessions drain (a second SIGTERM must not kill us
   * half-way), but no longer keeping the loop alive. */
  uv_unref((uv_handle_t *)&srv->sigterm);
  uv_unref((uv_handle_t *)&srv->sigint);
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

/* Sessions served now. */
static size_t sessions_count(const server *srv) {
  size_t n = 0;
  for (struct list *p = srv->sessions.next; p != &srv->sessions; p = p->next) n++;
  return n;
}

/* Sessions of one uid. */
static unsigned sessions_of(const server *srv, uid_t uid) {
  unsigned n = 0;
  for (struct list *p = srv->sessions.next; p != &srv->sessions; p = p->next)
    n += list_entry(p, struct session, owner.link)->owner.uid == uid;
  return n;
}

/* The sessions one uid may hold, greeted or not: --max-sessions-per-uid,
 * and no more than an eighth of the descriptor limit (each holds one;
 * chunks have their own three quarters, half of it per uid), so that no
 * one uid's connections take the daemon's last descriptors; 16 at least. */
static unsigned session_cap(const server *srv) {
  uint64_t limit = fdbudget_limit(), share = limit / 8 < 16 ? 16 : limit / 8;
  unsigned cap = srv->cfg->max_sessions_per_uid;
  return limit != UINT64_MAX && share < cap ? (unsigned)share : cap;
}

/* Listen again after a pause for want of fds. */
static void on_accept_again(uv_timer_t *t) {
  server *srv = t->data;
  if (!srv->stopping) uv_poll_start(&srv->listen_poll, UV_READABLE, on_accept);
}

/* Out of fds: refuse the connection that is waiting (the reserve fd makes
 * room to accept and close it), say so once per episode, and stop
 * listening for a while; the kernel fails accept before it looks at the
 * queue, so trying again at once would spin. */
static void starve(server *srv, int err) {
  bool reserve = srv->reserve_fd >= 0;
  if (reserve) close(srv->reserve_fd); /* room to count the fds, and to refuse */
  srv->reserve_fd = -1;
  if (!srv->starved) {
    log_warn("out of file descriptors (%s; %llu open, limit %llu, %zu sessions): refusing "
             "connections until some are free",
             strerror(err), (unsigned long long)(fdbudget_open() + reserve),
             (unsigned long long)fdbudget_limit(), sessions_count(srv));
    srv->starved_since = uv_now(srv->loop);
  }
  srv->starved = true;
  srv->backoffs++;
  if (reserve) {
    int x = accept(srv->listen_fd, NULL, NULL);
    if (x >= 0) {
      close(x);
      srv->refused++;
      srv->refused_total++;
    }
    srv->reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  }
  uv_poll_stop(&srv->listen_poll);
  uv_timer_start(&srv->accept_timer, on_accept_again, SERVER_ACCEPT_BACKOFF_MS, 0);
}

/* Accept every waiting connection; out of fds, back off. */
static void on_accept(uv_poll_t *h, int status, int events) {
  (void)events;
  server *srv = h->data;
  if (status < 0) return;
  for (;;) {
    int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) starve(srv, errno);
      return;
    }
    if (srv->starved) {
      log_info("file descriptors free again after %llu ms: %llu connections refused, "
               "listening paused %llu times",
               (unsigned long long)(uv_now(srv->loop) - srv->starved_since), srv->refused,
               srv->backoffs);
      srv->starved = false;
      srv->refused = srv->backoffs = 0;
    }
    struct session *s = session_create(&srv->host, srv->loop, fd, srv->next_session_id++);
    if (!s) continue;
    s->may_control = may_control(srv, fd, s->owner.uid, s->gid);
    list_append(&srv->sessions, &s->owner.link);
    log_debug("session %llu: pid %d uid %d connected", (unsigned long long)s->owner.id,
              (int)s->owner.pid, (int)s->owner.uid);
    unsigned cap = session_cap(srv);
    if (sessions_of(srv, s->owner.uid) > cap) {
      char text[200];
      snprintf(text, sizeof text,
               "too many sessions for this uid (%u: --max-sessions-per-uid, and at most an "
               "eighth of the daemon's descriptor limit)", cap);
      refuse_session(s, 0, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED, text);
      return; /* the next turn accepts more, once the reaper has closed it */
    }
  }
}

/* Close every doomed session: nothing is in the middle of using them now. */
static void on_reap(uv_idle_t *h) {
  server *srv = h->data;
  uv_idle_stop(h);
  struct list *p, *t;
  list_for_each_safe(p, t, &srv->sessions) {
    struct session *s = list_entry(p, struct session, owner.link);
    if (s->doomed) session_close(s);
  }
}

/* One batch more of the waiting sessions' frames, in turn, for as long as
 * the turn's budget lasts; the loop polls (and hears everyone else)
 * between turns. */
static void on_backlog(uv_idle_t *h) {
  server *srv = h->data;
  struct list *q = &srv->backlog_sessions;
  struct list *last = q->prev; /* each session waiting now gets one batch at most */
  uint64_t end = uv_hrtime() + SERVER_BACKLOG_BUDGET_NS;
  while (!list_empty(q)) {
    struct list *first = q->next;
    bool was_last = first == last;
    list_remove(first);
    session_serve_backlog(list_entry(first, struct session, backlog_link));
    if (was_last || uv_hrtime() >= end) break;
  }
  if (list_empty(q)) uv_idle_stop(h);
}

/* Serve a session's waiting frames on the loop's next turns. */
static void on_frames_wait(void *ctx, struct session *s) {
  server *srv = ctx;
  if (srv->stopping || uv_is_closing((uv_handle_t *)&srv->backlog)) return;
  if (list_empty(&s->backlog_link)) list_append(&srv->backlog_sessions, &s->backlog_link);
  uv_idle_start(&srv->backlog, on_backlog);
}

/* Close a doomed session on the loop's next turn. */
static void on_doomed(void *ctx, struct session *s) {
  server *srv = ctx;
  (void)s;
  if (!uv_is_closing((uv_handle_t *)&srv->reaper)) uv_idle_start(&srv->reaper, on_reap);
}

/* Forget a session that ended: free its buffers, tell the engine. */
static void on_closed(void *ctx, struct session *s) {
  server *srv = ctx;
  grace_forget(srv->grace, s);
  attach_forget(srv, s);
  list_remove(&s->owner.link);
  list_remove(&s->backlog_link);
  engine_settle(srv->eng); /* its last acks count before its buffers go */
  /* A process that lives on may reconnect and re-register what it holds. */
  bool lives = s->pidfd >= 0 && peer_signal(s->pidfd, 0) == 0;
  struct list *p, *t;
  list_for_each_safe(p, t, &s->owner.buffers) {
    struct buffer *b = list_entry(p, struct buffer, owner_link);
    if (b->flags & BUF_FLAG_PERSIST) {
      log_info("pid %d ended its session: the daemon keeps persistent buffer '%s' (%llu) of "
               "uid %u", (int)s->owner.pid, b->name, (unsigned long long)b->id, b->uid);
      registry_hand(srv->reg, b, keeper_owner(srv->keeper));
      attach_wake(srv);
    } else {
      if (lives && s->owner.role == GPUMEM__WIRE__ROLE__ROLE_WORKER)
        rejoin_note(srv->rejoin, b, s->owner.pid);
      registry_free(srv->reg, b);
    }
  }
  if (srv->eng) engine_forget(srv->eng, &s->owner);
  if (srv->stopping && list_empty(&srv->sessions) &&
      !uv_is_closing((uv_handle_t *)&srv->stop_timer))
    uv_close((uv_handle_t *)&srv->stop_timer, NULL);
}

/* The session with the most output queued that still reads. */
static struct session *biggest_queue(void *ctx) {
  server *srv = ctx;
  struct session *big = NULL;
  size_t most = 0;
  for (struct list *p = srv->sessions.next; p != &srv->sessions; p = p->next) {
    struct session *x = list_entry(p, struct session, owner.link);
    size_t q = x->writer ? frame_writer_queued(x->writer) : 0;
    if (!x->owner.closed && !x->doomed && !x->draining && q > most) {
      most = q;
      big = x;
    }
  }
  return big;
}

/* Fds parked in frames still arriving, over the sessions of uid. */
static size_t parked_fds(void *ctx, uid_t uid) {
  const server *srv = ctx;
  size_t n = 0;
  for (struct list *p = srv->sessions.next; p != &srv->sessions; p = p->next) {
    const struct session *x = list_entry(p, struct session, owner.link);
    if (x->owner.uid == uid) n += frame_reader_held_fds(x->reader);
  }
  return n;
}

/* The daemon's own figures for a status: its fds and queues, the grace. */
static struct report_own own_figures(const server *srv) {
  struct report_own o = {.fd_limit = fdbudget_limit(),
                         .fds_open = fdbudget_open(),
                         .queued_bytes = srv->queued_total,
                         .connections_refused = srv->refused_total,
                         .grace_left_ms = grace_left_ms(srv->grace),
                         .grace_waiting = grace_waiting(srv->grace),
                         .disk = srv->cfg->backup_disk};
  for (struct list *p = srv->sessions.next; p != &srv->sessions; p = p->next)
    o.fds_parked += frame_reader_held_fds(list_entry(p, struct session, owner.link)->reader);
  return o;
}

/* The server that runs session s (its host). */
static server *server_of(const struct session *s) { return s->host->ctx; }

/* Answer request id with a fault, counting the error. */
static void answer_error(struct session *s, uint64_t id, const struct fault *f) {
  stats_error(server_of(s)->stats, f->code);
  session_send_error(s, id, f);
}

/* Answer request id with an error in words, counting it. */
static void reply_error(struct session *s, uint64_t id, wire_code code,
                        const char *text) {
  struct fault f = {0};
  fault_set(&f, code, "%s", text);
  answer_error(s, id, &f);
}

/* Answer request id with an error, counting it, and end the session. */
static void refuse_session(struct session *s, uint64_t id, wire_code code, const char *text) {
  stats_error(server_of(s)->stats, code);
  struct fault f = {0};
  fault_set(&f, code, "%s", text);
  session_end(s, SESSION_END_DRAIN, id, &f);
}

static void handle_hello(server *srv, struct session *s, const wire_env *env) {
  const Gpumem__Wire__Hello *h = env->hello;
  char text[160];
  if (s->owner.role != GPUMEM__WIRE__ROLE__ROLE_UNSPECIFIED) {
    refuse_session(s, env->id, GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR, "Hello sent twice");
    return;
  }
  if (h->version_major != WIRE_VERSION_MAJOR) {
    snprintf(text, sizeof text, "client speaks protocol %u.%u, daemon speaks %d.%d",
             h->version_major, h->version_minor, WIRE_VERSION_MAJOR, WIRE_VERSION_MINOR);
    refuse_session(s, env->id, GPUMEM__WIRE__ERROR_CODE__VERSION_MISMATCH, text);
    return;
  }
  if (h->role == GPUMEM__WIRE__ROLE__ROLE_CONTROLLER && !s->may_control) {
    /* Not counted in the errors: gpumemctl asks for the controller role
     * first and falls back to a worker's view, so this is routine (every
     * run of the metrics timer would count one). */
    snprintf(text, sizeof text, "uid %d may not pause or resume", (int)s->owner.uid);
    struct fault f = {0};
    fault_set(&f, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED, "%s", text);
    session_end(s, SESSION_END_DRAIN, env->id, &f);
    return;
  }
  s->owner.role = h->role;
  s->owner.minor = h->version_minor;
  s->owner.release_ok = h->role == GPUMEM__WIRE__ROLE__ROLE_WORKER && h->release_context;
  s->owner.copies_backups = h->role == GPUMEM__WIRE__ROLE__ROLE_WORKER && h->copies_backups;
  /* One that may be released must not keep host-NUMA memory imported:
   * the driver could not restore it. */
  s->owner.keeps_backups = s->owner.copies_backups && h->keeps_backups && !s->owner.release_ok;
  s->owner.nothing_mapped = true; /* until memory of ours goes to it */
  snprintf(s->owner.name, sizeof s->owner.name, "%s", h->name);
  Gpumem__Wire__HelloReply r = GPUMEM__WIRE__HELLO_REPLY__INIT;
  r.version_major = WIRE_VERSION_MAJOR;
  r.version_minor = WIRE_VERSION_MINOR;
  r.backend = (char *)gpudev_name(srv->gpu);
  r.granularity = gpudev_granularity(srv->gpu);
  r.session_id = s->owner.id;
  r.devices = report_devices(srv->reg, srv->gpu, &r.n_devices);
  wire_env out = wire_envelope(env->id, GPUMEM__WIRE__ENVELOPE__BODY_HELLO_REPLY, &r);
  session_send(s, &out, NULL, 0);
  report_devices_free(r.devices);
  log_debug("session %llu: pid %d is %s '%s'", (unsigned long long)s->owner.id, (int)s->owner.pid,
            s->owner.role == GPUMEM__WIRE__ROLE__ROLE_WORKER ? "worker" : "controller", s->owner.name);
}

/* 0 when the session may hold n more buffers; else LIMIT_EXCEEDED is
 * answered to request id and -1. (The registry checks the uid's quotas.) */
static int room_for_buffers(server *srv, struct session *s, uint64_t id, uint64_t n) {
  if (n <= srv->cfg->max_buffers_per_session - s->owner.nbuffers) return 0;
  char text[160];
  snprintf(text, sizeof text, "too many buffers in this session (limit %u)",
           srv->cfg->max_buffers_per_session);
  reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED, text);
  return -1;
}

/* Whether a persistent buffer's name is kept for one the journal of the
 * daemon before expects back (f says so): its holder re-registers it
 * within the grace, and nothing else of its uid takes the name first. */
static bool name_reserved(server *srv, const struct session *s,
                          const Gpumem__Wire__AllocRequest *a, struct fault *f) {
  if (!srv->journal_loaded || !a->name[0]) return false;
  const struct journal_buffer *e;
  int rc = journal_expected_named(srv->journal, (uint32_t)s->owner.uid, a->name, &e);
  if (rc < 0) fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  else if (rc > 0)
    fault_set(f, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
              "persistent buffer '%s' of uid %u (buffer %llu of the daemon before) may still "
              "be re-registered by its holder: its name is kept until the grace ends (%llu ms)",
              a->name, (unsigned)s->owner.uid, (unsigned long long)e->id,
              (unsigned long long)grace_left_ms(srv->grace));
  return rc != 0;
}

/* True unless allocation a would take device memory (not a buffer that
 * starts paused) and leave less than its keep_free free by the driver's
 * figure; then f says so (OUT_OF_MEMORY). A device out of range and a
 * paused tag are registry_alloc's to refuse. */
static bool leaves_keep_free(server *srv, const Gpumem__Wire__AllocRequest *a, struct fault *f) {
  if (!a->keep_free || a->device >= gpudev_device_count(srv->gpu)) return true;
  const struct tag *t = registry_tag(srv->reg, a->tag);
  if (t && (t->paused_devices & (1ull << a->device)))
    return true; /* it starts paused (no memory now), or registry_alloc refuses it */
  uint64_t free_b = 0, total = 0, g = gpudev_granularity(srv->gpu);
  if (gpudev_mem_info(srv->gpu, a->device, &free_b, &total) < 0) return true;
  uint64_t size = a->size > UINT64_MAX - g ? UINT64_MAX : (a->size + g - 1) / g * g;
  if (size <= free_b && free_b - size >= a->keep_free) return true;
  f->bytes_needed = size > UINT64_MAX - a->keep_free ? UINT64_MAX : size + a->keep_free;
  f->bytes_free = free_b;
  fault_set(f, GPUMEM__WIRE__ERROR_CODE__OUT_OF_MEMORY,
            "device %u: %llu bytes asked with %llu to keep free, %llu free: it would leave %s",
            a->device, (unsigned long long)size, (unsigned long long)a->keep_free,
            (unsigned long long)free_b,
            size > free_b ? "nothing" : "less than the margin");
  return false;
}

/* Send s buffer b, which it now holds (an allocation's, or with attached
 * an Attach's: its tag, device and flags too), with its chunks' fds when
 * it is ACTIVE. -1 with f filled when they cannot be exported (nothing
 * sent). */
static int reply_buffer(server *srv, struct session *s, uint64_t id, struct buffer *b,
                        bool attached, struct fault *f) {
  int fds[FRAME_MAX_FDS];
  size_t nfds = 0;
  if (b->state == BUF_ACTIVE) {
    if (registry_export(srv->reg, b, fds, f)) return -1;
    nfds = b->ipc ? 0 : b->nchunks;
    s->owner.nothing_mapped = false; /* it maps this one now */
  }
  Gpumem__Wire__AllocReply r = GPUMEM__WIRE__ALLOC_REPLY__INIT;
  r.buffer_id = b->id;
  r.size = b->size;
  r.state = b->state;
  r.chunk_sizes = b->chunk_sizes;
  r.n_chunk_sizes = b->nchunks;
  r.generation = b->tag->generation;
  r.secret.data = b->secret;
  r.secret.len = sizeof b->secret;
  if (b->ipc) {
    r.ipc_handle.data = b->ipc_handle;
    r.ipc_handle.len = sizeof b->ipc_handle;
  }
  if (attached) {
    r.tag = b->tag->name;
    r.device = b->device;
    r.flags = b->flags;
  }
  wire_env out = wire_envelope(id, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY, &r);
  out.fd_count = (uint32_t)nfds;
  journal_flush(srv->journal); /* the journal knows the secret before its holder does */
  session_send(s, &out, fds, nfds);
  return 0;
}

/* Allocate a buffer for a worker (request id), unless it would make a new
 * tag during the re-registration grace: then it waits for the grace to end
 * (grace.h). */
static void handle_alloc(server *srv, struct session *s, uint64_t id,
                         const Gpumem__Wire__AllocRequest *a) {
  if (s->owner.role != GPUMEM__WIRE__ROLE__ROLE_WORKER) {
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                "only workers allocate; connect as a worker");
    return;
  }
  if (room_for_buffers(srv, s, id, 1) < 0) return;
  if (srv->eng && engine_released(srv->eng, s->owner.pid)) {
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
                "this process's device state is released (a pause with release_context): "
                "resume it before allocating");
    return;
  }
  if (grace_active(srv->grace) && !srv->journal_loaded && !registry_tag(srv->reg, a->tag)) {
    int rc = grace_defer(srv->grace, s, (uint32_t)s->owner.uid, id, a);
    if (rc == 0) {
      log_debug("pid %d: alloc in new tag '%s' waits for the re-registration grace",
                (int)s->owner.pid, a->tag);
      return;
    }
    if (rc == -EDQUOT || rc == -ENOSPC) {
      char text[200];
      snprintf(text, sizeof text,
               "too many allocations in new tags%s wait for the re-registration grace "
               "(--adopt-grace) to end: try again after it",
               rc == -EDQUOT ? " of this uid" : "");
      reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED, text);
    }
    else /* not served now either: that would skip the grace */
      reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    return;
  }
  struct fault f = {0};
  struct buffer *b;
  if (name_reserved(srv, s, a, &f) || !leaves_keep_free(srv, a, &f)) {
    answer_error(s, id, &f);
    return;
  }
  if (registry_alloc_named(srv->reg, &s->owner, a->name, a->tag, a->device, a->size, a->flags,
                           &b, &f)) {
    answer_error(s, id, &f);
    return;
  }
  if (reply_buffer(srv, s, id, b, false, &f) < 0) {
    registry_free(srv->reg, b);
    answer_error(s, id, &f);
    return;
  }
  log_debug("pid %d: alloc %llu bytes '%s' on device %u: buffer %llu", (int)s->owner.pid,
            (unsigned long long)b->size, a->tag, a->device, (unsigned long long)b->id);
}

static void handle_free(server *srv, struct session *s, const wire_env *env) {
  struct buffer *b = registry_find(srv->reg, env->free->buffer_id);
  char text[96];
  if (!b || b->owner != &s->owner) {
    snprintf(text, sizeof text, "no buffer %llu in this session",
             (unsigned long long)env->free->buffer_id);
    reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, text);
    return;
  }
  if (!registry_can_free(b)) {
    snprintf(text, sizeof text, "buffer %llu is %s; free it when that is done",
             (unsigned long long)b->id, wire_state_name(b->state));
    reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE, text);
    return;
  }
  Gpumem__Wire__FreeReply r = GPUMEM__WIRE__FREE_REPLY__INIT;
  if (b->flags & BUF_FLAG_PERSIST) {
    log_info("pid %d let go of persistent buffer '%s' (%llu): the daemon keeps it",
             (int)s->owner.pid, b->name, (unsigned long long)b->id);
    registry_hand(srv->reg, b, keeper_owner(srv->keeper));
    journal_flush(srv->journal); /* a daemon after this one expects no holder for it */
    r.kept = true;
    attach_wake(srv);
  } else {
    r.bytes = b->size;
    registry_free(srv->reg, b);
  }
  wire_env out = wire_envelope(env->id, GPUMEM__WIRE__ENVELOPE__BODY_FREE_REPLY, &r);
  session_send(s, &out, NULL, 0);
}

/* Why a persistent buffer cannot be taken or dropped now (NULL: it can):
 * a session holds it, or a pause or resume has it. */
static const char *persistent_busy(const struct buffer *b, char *text, size_t len) {
  if (!b->owner->keeper)
    snprintf(text, len, "persistent buffer '%s' is held by pid %d (session %llu): it must free it "
             "first", b->name, (int)b->owner->pid, (unsigned long long)b->owner->id);
  else if (!registry_can_free(b))
    snprintf(text, len, "persistent buffer '%s' is %s; try again when that is done", b->name,
             wire_state_name(b->state));
  else
    return NULL;
  return text;
}

/* Whether the last holder of a persistent buffer no session holds still
 * maps its memory (a process may end its session and keep its mappings),
 * unless that is process pid; then text says so. */
static bool mapped_elsewhere(server *srv, struct buffer *b, pid_t pid, char *text, size_t len) {
  if (!b->has_memory || !b->last_pid || b->last_pid == pid) return false;
  bool held;
  registry_held_by(srv->reg, &b, 1, &held);
  if (held)
    snprintf(text, len, "pid %d (%s) let go of persistent buffer '%s' but still maps it: it "
             "must unmap it, or exit, first", (int)b->last_pid, b->last_name, b->name);
  return held;
}

/* Hand persistent buffer b, which no session holds, to s and answer its
 * attach id with it; as it was, with the error answered, if that cannot
 * be done. */
static void give(server *srv, struct session *s, uint64_t id, struct buffer *b) {
  /* Its last holder and when it let go stay as they are if the reply
   * cannot be made. */
  pid_t last_pid = b->last_pid;
  char last_name[sizeof b->last_name];
  memcpy(last_name, b->last_name, sizeof last_name);
  uint64_t let_go = b->let_go_ns;
  registry_hand(srv->reg, b, &s->owner);
  struct fault f = {0};
  if (reply_buffer(srv, s, id, b, true, &f) < 0) {
    registry_hand(srv->reg, b, keeper_owner(srv->keeper)); /* as it was */
    b->last_pid = last_pid;
    memcpy(b->last_name, last_name, sizeof last_name);
    b->let_go_ns = let_go;
    answer_error(s, id, &f);
    return;
  }
  log_info("pid %d attached persistent buffer '%s' (%llu, %s)", (int)s->owner.pid, b->name,
           (unsigned long long)b->id, wire_state_name(b->state));
}

/* Why s cannot take b now (text filled; NULL: it can): held by a session
 * (*later: when it lets go), or busy in a pause or resume or still mapped
 * by the process that let go of it (*later: look again soon). */
static const char *not_yet(server *srv, struct session *s, struct buffer *b, bool *soon,
                           char *text, size_t len) {
  *soon = b->owner->keeper;
  if (persistent_busy(b, text, len) || mapped_elsewhere(srv, b, s->owner.pid, text, len))
    return text;
  return NULL;
}

static void on_attach_timer(uv_timer_t *h);

/* Queue an attach (request id) to wait for its buffer, up to a's wait_ms. */
static void wait_for_buffer(server *srv, struct session *s, uint64_t id,
                            const Gpumem__Wire__AttachRequest *a) {
  if (srv->stopping) {
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN, "gpumemd is stopping");
    return;
  }
  size_t mine = 0;
  for (struct list *p = srv->attach_waits.next; p != &srv->attach_waits; p = p->next)
    mine += list_entry(p, struct attach_wait, link)->s == s;
  if (mine >= SERVER_ATTACH_WAITS_PER_SESSION) {
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED,
                "this session has 64 attaches waiting already");
    return;
  }
  struct attach_wait *w = calloc(1, sizeof *w);
  if (!w) {
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    return;
  }
  w->s = s;
  w->id = id;
  w->since_ms = uv_now(srv->loop);
  w->deadline_ms = w->since_ms + a->wait_ms;
  snprintf(w->name, sizeof w->name, "%s", a->name);
  gpumem__wire__attach_request__init(&w->req);
  w->req.name = w->name;
  w->req.devices = a->devices;
  list_append(&srv->attach_waits, &w->link);
  log_debug("pid %d waits up to %u ms to attach '%s'", (int)s->owner.pid, a->wait_ms, w->name);
  uv_timer_start(&srv->attach_timer, on_attach_timer, 0, 0); /* then at its deadline */
}

/* A worker takes its uid's persistent buffer that no session holds, at
 * once or, asked to, once its holder lets go of it. */
static void handle_attach(server *srv, struct session *s, uint64_t id,
                          const Gpumem__Wire__AttachRequest *a) {
  char text[2 * WIRE_TAG_MAX + 320];
  if (s->owner.role != GPUMEM__WIRE__ROLE__ROLE_WORKER) {
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                "only workers attach buffers; connect as a worker");
    return;
  }
  if (a->wait_ms > WIRE_MAX_WAIT_MS) {
    snprintf(text, sizeof text, "wait_ms %u: at most %d", a->wait_ms, WIRE_MAX_WAIT_MS);
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT, text);
    return;
  }
  if (room_for_buffers(srv, s, id, 1) < 0) return;
  if (srv->eng && engine_released(srv->eng, s->owner.pid)) {
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
                "this process's device state is released (a pause with release_context): "
                "resume it before attaching");
    return;
  }
  struct buffer *b = registry_persistent(srv->reg, (uint32_t)s->owner.uid, a->name);
  if (!b) {
    snprintf(text, sizeof text, "uid %u has no persistent buffer '%s'", (unsigned)s->owner.uid,
             a->name);
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, text);
    return;
  }
  if (a->devices && b->device < 64 && !(a->devices & (1ull << b->device))) {
    snprintf(text, sizeof text, "persistent buffer '%s' is on gpumemd's device %u, which this "
             "process does not see", b->name, b->device);
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT, text);
    return;
  }
  bool soon;
  if (not_yet(srv, s, b, &soon, text, sizeof text)) {
    if (a->wait_ms) wait_for_buffer(srv, s, id, a);
    else reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE, text);
    return;
  }
  give(srv, s, id, b);
}

/* Look at the waiting attaches again: serve those whose buffer is free
 * now, end those whose time is up or whose buffer is gone, and wake again
 * at the next deadline (sooner while one's buffer is busy or still
 * mapped: nothing else says when that ends). */
static void on_attach_timer(uv_timer_t *h) {
  server *srv = h->data;
  uint64_t now = uv_now(srv->loop), next = UINT64_MAX;
  struct list *p, *t;
  list_for_each_safe(p, t, &srv->attach_waits) {
    struct attach_wait *w = list_entry(p, struct attach_wait, link);
    struct buffer *b = registry_persistent(srv->reg, (uint32_t)w->s->owner.uid, w->name);
    char text[2 * WIRE_TAG_MAX + 360];
    bool soon = false;
    if (b && not_yet(srv, w->s, b, &soon, text, sizeof text) && now < w->deadline_ms) {
      uint64_t at = soon ? now + SERVER_ATTACH_RECHECK_MS : w->deadline_ms;
      next = at < next ? at : next;
      continue;
    }
    list_remove(&w->link);
    if (!b || !not_yet(srv, w->s, b, &soon, text, sizeof text)) {
      handle_attach(srv, w->s, w->id, &w->req); /* NOT_FOUND when it was dropped */
    } else {
      size_t n = strlen(text);
      snprintf(text + n, sizeof text - n, " (waited %llu ms)",
               (unsigned long long)(now - w->since_ms));
      reply_error(w->s, w->id, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE, text);
    }
    free(w);
  }
  if (next != UINT64_MAX) uv_timer_start(&srv->attach_timer, on_attach_timer, next - now, 0);
}

/* Persistent buffers were let go of (or dropped): look at the waiting
 * attaches on the loop's next turn. */
static void attach_wake(server *srv) {
  if (!srv->stopping && !list_empty(&srv->attach_waits))
    uv_timer_start(&srv->attach_timer, on_attach_timer, 0, 0);
}

/* A session's waiting attaches end with it, unanswered. */
static void attach_forget(server *srv, struct session *s) {
  struct list *p, *t;
  list_for_each_safe(p, t, &srv->attach_waits) {
    struct attach_wait *w = list_entry(p, struct attach_wait, link);
    if (s && w->s != s) continue;
    list_remove(&w->link);
    free(w);
  }
}

/* Free a persistent buffer no session holds: a worker's uid's, or any
 * uid's for a controller. */
static void handle_drop(server *srv, struct session *s, uint64_t id,
                        const Gpumem__Wire__DropRequest *d) {
  char text[2 * WIRE_TAG_MAX + 320];
  bool ctl = s->owner.role == GPUMEM__WIRE__ROLE__ROLE_CONTROLLER;
  uint32_t uid = ctl ? d->uid : (uint32_t)s->owner.uid;
  struct buffer *b = registry_persistent(srv->reg, uid, d->name);
  if (!b) {
    snprintf(text, sizeof text, "uid %u has no persistent buffer '%s'", (unsigned)uid, d->name);
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, text);
    return;
  }
  if (persistent_busy(b, text, sizeof text)) {
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE, text);
    return;
  }
  if (mapped_elsewhere(srv, b, 0, text, sizeof text)) {
    reply_error(s, id, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED, text);
    return;
  }
  Gpumem__Wire__DropReply r = GPUMEM__WIRE__DROP_REPLY__INIT;
  r.bytes = b->has_memory ? b->size : 0;
  log_info("pid %d dropped persistent buffer '%s' (%llu) of uid %u", (int)s->owner.pid, b->name,
           (unsigned long long)b->id, (unsigned)uid);
  registry_free(srv->reg, b);
  journal_flush(srv->journal); /* a daemon after this one does not wait for it */
  attach_wake(srv); /* those waiting for it learn it is gone */
  wire_env out = wire_envelope(id, GPUMEM__WIRE__ENVELOPE__BODY_DROP_REPLY, &r);
  session_send(s, &out, NULL, 0);
}

/* Answer an adopt with the new ids of its n buffers and their secrets
 * (room for n in secrets, the caller's). */
static void reply_adopt(server *srv, struct session *s, uint64_t id, struct buffer **bufs,
                        size_t n, uint64_t *ids, ProtobufCBinaryData *secrets) {
  for (size_t i = 0; i < n; i++) {
    ids[i] = bufs[i]->id;
    secrets[i] = (ProtobufCBinaryData){.len = sizeof bufs[i]->secret, .data = bufs[i]->secret};
  }
  Gpumem__Wire__AdoptReply r = GPUMEM__WIRE__ADOPT_REPLY__INIT;
  r.buffer_ids = ids;
  r.n_buffer_ids = n;
  r.secrets = secrets;
  r.n_secrets = n;
  journal_flush(srv->journal); /* the journal knows them before their holder does */
  wire_env out = wire_envelope(id, GPUMEM__WIRE__ENVELOPE__BODY_ADOPT_REPLY, &r);
  session_send(s, &out, NULL, 0);
}

/* Check one buffer of an adopt against this daemon's devices. */
static wire_code adopt_check(server *srv, const Gpumem__Wire__AdoptBuffer *a, size_t i,
                             struct fault *f) {
  uint64_t gran = gpudev_granularity(srv->gpu);
  unsigned ndev = gpudev_device_count(srv->gpu);
  if (a->device >= ndev)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT,
                     "adopt buffer %zu: device %u out of range (%u devices)", i, a->device, ndev);
  struct gpudev_mem m = {0};
  gpudev_mem_detail(srv->gpu, a->device, &m);
  if (a->size > m.total)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT,
                     "adopt buffer %zu: %llu bytes is larger than device %u (%llu bytes)", i,
                     (unsigned long long)a->size, a->device, (unsigned long long)m.total);
  if ((a->flags & BUF_FLAG_IPC_LEGACY) && gpudev_has_ipc(srv->gpu))
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT,
                     "adopt buffer %zu: IPC_LEGACY memory belonged to the old daemon", i);
  for (size_t k = 0; k < a->n_chunk_sizes; k++)
    if (a->chunk_sizes[k] % gran)
      return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT,
                       "adopt buffer %zu: chunk of %llu bytes is not a multiple of %llu", i,
                       (unsigned long long)a->chunk_sizes[k], (unsigned long long)gran);
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Take back the buffers of a re-registration, as reclaim_check judged
 * them, into bufs: f filled and nothing taken on failure. */
static void take_back(server *srv, struct session *s, const Gpumem__Wire__AdoptRequest *a,
                      struct frame *fr, const enum reclaim_kind *kinds, struct buffer **bufs,
                      struct fault *f) {
  size_t done = 0, fd_at = 0;
  uint64_t *let_go = calloc(a->n_buffers + 1, sizeof *let_go);
  if (!let_go) fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  for (; !f->code && done < a->n_buffers; done++) {
    const Gpumem__Wire__AdoptBuffer *b = a->buffers[done];
    size_t nfds = b->paused ? 0 : b->n_chunk_sizes;
    if (kinds[done] == RECLAIM_KEPT) { /* the daemon has its memory: the fds are spares */
      for (size_t k = 0; k < nfds; k++) {
        close(fr->fds[fd_at + k]);
        fr->fds[fd_at + k] = -1;
      }
      let_go[done] = bufs[done]->let_go_ns;
      registry_hand(srv->reg, bufs[done], &s->owner);
    } else {
      const uint8_t *secret = kinds[done] == RECLAIM_NEW ? NULL : b->secret.data;
      if (registry_adopt(srv->reg, &s->owner, b->tag, b->device, b->size, b->flags, b->name,
                         b->paused, b->chunk_sizes, b->n_chunk_sizes, fr->fds + fd_at, secret,
                         &bufs[done], f))
        break;
      registry_generation_seen(srv->reg, bufs[done]->tag, b->generation);
    }
    fd_at += nfds;
    if (!b->paused) s->owner.nothing_mapped = false;
    if (b->paused && (b->flags & BUF_FLAG_BACKUP) && kinds[done] != RECLAIM_KEPT)
      log_warn("pid %d: BACKUP buffer %llu ('%s') was paused when its session or the daemon "
               "before went away: its saved contents are lost",
               (int)s->owner.pid, (unsigned long long)bufs[done]->id, b->tag);
  }
  for (size_t i = 0; f->code && i < done; i++) {
    if (kinds[i] != RECLAIM_KEPT) {
      registry_free(srv->reg, bufs[i]);
      continue;
    }
    registry_hand(srv->reg, bufs[i], keeper_owner(srv->keeper)); /* as it was */
    bufs[i]->let_go_ns = let_go[i];
  }
  free(let_go);
}

/* A worker re-registers buffers it kept when its session or the daemon
 * before went away: all of them, or none (then the fds it sent are closed
 * and it keeps its own). Each is judged by reclaim_check: its own
 * persistent buffer the daemon kept since is handed back; one of its
 * ended session or of the journal must be the one it says, with its
 * secret, and keeps it. */
static void handle_adopt(server *srv, struct session *s, const wire_env *env, struct frame *fr) {
  const Gpumem__Wire__AdoptRequest *a = env->adopt;
  struct fault f = {0};
  if (s->owner.role != GPUMEM__WIRE__ROLE__ROLE_WORKER) {
    reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                "only workers re-register buffers");
    return;
  }
  if (room_for_buffers(srv, s, env->id, a->n_buffers) < 0) return;
  for (size_t i = 0; i < a->n_buffers; i++)
    if (adopt_check(srv, a->buffers[i], i, &f)) {
      answer_error(s, env->id, &f);
      return;
    }
  uint64_t *ids = calloc(a->n_buffers + 1, sizeof *ids);
  struct buffer **bufs = calloc(a->n_buffers + 1, sizeof *bufs);
  ProtobufCBinaryData *secrets = calloc(a->n_buffers + 1, sizeof *secrets);
  enum reclaim_kind *kinds = calloc(a->n_buffers + 1, sizeof *kinds);
  if (!ids || !bufs || !secrets || !kinds) {
    fault_set(&f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  } else if (reclaim_check(srv->reg, srv->journal_loaded ? srv->journal : NULL, srv->rejoin,
                           (uint32_t)s->owner.uid, s->owner.pid, a, kinds, bufs, &f)) {
    log_warn("pid %d (uid %u): re-registration refused: %s", (int)s->owner.pid,
             (unsigned)s->owner.uid, f.text);
  } else if (!grace_active(srv->grace)) {
    for (size_t i = 0; i < a->n_buffers && !f.code; i++)
      if (kinds[i] == RECLAIM_NEW && a->buffers[i]->paused)
        fault_set(&f, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                  "a paused buffer brings no memory to check: without the journal of the "
                  "daemon before, this daemon takes one back only during the grace after its "
                  "start (--adopt-grace)");
  }
  if (!f.code && srv->journal_loaded) reclaim_charge(srv->reg, srv->journal, a, kinds, false);
  if (!f.code) take_back(srv, s, a, fr, kinds, bufs, &f);
  if (f.code && srv->journal_loaded && kinds)
    reclaim_charge(srv->reg, srv->journal, a, kinds, true);
  if (f.code) {
    answer_error(s, env->id, &f);
  } else {
    log_info("pid %d re-registered %zu buffers", (int)s->owner.pid, a->n_buffers);
    for (size_t i = 0; i < a->n_buffers; i++)
      if (kinds[i] == RECLAIM_REJOIN) rejoin_take(srv->rejoin, a->buffers[i]->old_id);
    if (srv->journal_loaded) {
      reclaim_claim(srv->reg, srv->journal, a);
      if (!journal_expected_count(srv->journal) && grace_active(srv->grace)) {
        log_info("journal: every buffer of the daemon before is back with its owner: the "
                 "grace ends");
        grace_end(srv->grace);
      }
    }
    reply_adopt(srv, s, env->id, bufs, a->n_buffers, ids, secrets);
  }
  free(ids);
  free(bufs);
  free(secrets);
  free(kinds);
}

/* The grace is over: the journal's buffers that no worker claimed are
 * forgotten. */
static void on_grace_end(void *ctx) {
  server *srv = ctx;
  if (srv->journal_loaded) reclaim_expire(srv->reg, srv->journal);
}

/* An allocation that waited for the re-registration grace is served now
 * (a session ended meanwhile took its own away). */
static void serve_waiting(void *ctx, struct session *s, uint64_t id,
                          const Gpumem__Wire__AllocRequest *a) {
  server *srv = ctx;
  if (!s->doomed && !s->owner.closed) handle_alloc(srv, s, id, a);
}

/* A worker asks for the backup memory of its paused buffer, to read
 * (with memory of its own, fr's one fd, to copy a pageable one into). */
static void handle_backup(server *srv, struct session *s, const wire_env *env, struct frame *fr) {
  const Gpumem__Wire__BackupRequest *q = env->backup;
  struct buffer *b = registry_find(srv->reg, q->buffer_id);
  if (!b || b->owner != &s->owner) {
    char text[96];
    snprintf(text, sizeof text, "no buffer %llu in this session",
             (unsigned long long)q->buffer_id);
    reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, text);
    return;
  }
  /* Each answer holds descriptors open until the peer reads it: a peer
   * that asks without reading could hold the daemon's all. */
  if (frame_writer_queued_fds(s->writer) >= SERVER_BACKUP_FDS_QUEUED) {
    reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED,
                "answers to earlier backup requests, and the descriptors they carry, wait "
                "to be read: read them first");
    return;
  }
  int fds[FRAME_MAX_FDS];
  uint64_t sizes[FRAME_MAX_FDS];
  size_t n = 0;
  enum backup_form form = BACKUP_FORM_MEMORY;
  struct fault f = {0};
  wire_code rc = q->memory ? registry_backup_copy_into(srv->reg, b, fr->fds[0], &f)
                           : registry_backup_for_reading(srv->reg, b, fds, sizes, FRAME_MAX_FDS,
                                                         &n, &form, &f);
  if (rc) {
    session_send_error(s, env->id, &f);
    return;
  }
  Gpumem__Wire__BackupMemory m = GPUMEM__WIRE__BACKUP_MEMORY__INIT;
  m.buffer_id = b->id;
  m.piece_sizes = sizes;
  m.n_piece_sizes = n;
  Gpumem__Wire__BackupReply r = GPUMEM__WIRE__BACKUP_REPLY__INIT;
  r.backup = &m;
  r.files = form == BACKUP_FORM_FILES;
  r.send_memory = form == BACKUP_FORM_SEND_MEMORY;
  if (q->memory) { /* the owner's memfd holds it now */
    r.copied = true;
    sizes[0] = b->size;
    m.n_piece_sizes = 1;
  }
  wire_env out = wire_envelope(env->id, GPUMEM__WIRE__ENVELOPE__BODY_BACKUP_REPLY, &r);
  out.fd_count = (uint32_t)n;
  session_send(s, &out, fds, n);
}

/* A controller shares a tag with every uid, or takes that back. */
static void handle_share(server *srv, struct session *s, const wire_env *env) {
  const Gpumem__Wire__ShareRequest *q = env->share;
  if (s->owner.role != GPUMEM__WIRE__ROLE__ROLE_CONTROLLER) {
    reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                "sharing a tag needs a controller session");
    return;
  }
  struct fault f = {0};
  struct tag *t;
  if (registry_share(srv->reg, q->tag, q->shared, &t, &f)) {
    answer_error(s, env->id, &f);
    return;
  }
  log_info("pid %d: tag '%s' %s", (int)s->owner.pid, q->tag,
           q->shared ? "shared with every uid" : "no longer shared");
  report_share(&srv->out, &s->owner, env->id, t);
}

/* Pause and resume: check role, scope and devices, then queue for the
 * engine. Workers may pause and resume only their own buffers (own). */
static void handle_op(server *srv, struct session *s, const wire_env *env, bool resume) {
  const Gpumem__Wire__PauseRequest *pr = env->pause;
  const Gpumem__Wire__ResumeRequest *rr = env->resume;
  char **tags = resume ? rr->tags : pr->tags;
  size_t ntags = resume ? rr->n_tags : pr->n_tags;
  uint32_t *devs = resume ? rr->devices : pr->devices;
  size_t ndevs = resume ? rr->n_devices : pr->n_devices;
  uint32_t timeout = resume ? rr->timeout_ms : pr->timeout_ms;
  uint64_t max_residual = resume ? 0 : pr->max_residual;
  struct scope_spec scope = {
      .own = resume ? rr->own : pr->own,
      .pids = resume ? rr->pids : pr->pids,
      .npids = resume ? rr->n_pids : pr->n_pids,
      .prefix = resume ? rr->session_prefix : pr->session_prefix,
  };
  if (s->owner.role != GPUMEM__WIRE__ROLE__ROLE_CONTROLLER && !scope.own) {
    reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                scope.npids || (scope.prefix && scope.prefix[0])
                    ? "pause and resume of other sessions need a controller session"
                    : "pause and resume need a controller session, or own for a worker's "
                      "own buffers");
    return;
  }
  uint64_t mask = 0;
  unsigned ndev = gpudev_device_count(srv->gpu);
  for (size_t i = 0; i < ndevs; i++) {
    if (devs[i] >= ndev) {
      char text[64];
      snprintf(text, sizeof text, "device %u out of range (%u devices)", devs[i], ndev);
      reply_error(s, env->id, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT, text);
      return;
    }
    mask |= 1ull << devs[i];
  }
  engine_submit(srv->eng, &s->owner, env->id, resume, tags, ntags, mask, timeout, max_residual,
                resume ? rr->wait_ms : 0, !resume && pr->release_context, &scope);
}

/* Parse, check and route one request. */
static void on_frame(void *ctx, struct session *s, struct frame *f) {
  server *srv = ctx;
  if (srv->stopping) return;
  wire_env *env = wire_unpack(f->data, f->len);
  if (!env) {
    refuse_session(s, 0, GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR,
                   "malformed frame: not a gpumemd message");
    return;
  }
  char why[256];
  wire_code code = wire_check_request(env, f->nfds, why, sizeof why);
  bool hello = env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_HELLO;
  if (code == GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR || (code && hello)) {
    refuse_session(s, env->id, code, why);
  } else if (code) {
    reply_error(s, env->id, code, why);
  } else if (!hello && s->owner.role == GPUMEM__WIRE__ROLE__ROLE_UNSPECIFIED) {
    refuse_session(s, env->id, GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR,
                   "the first message must be Hello");
  } else {
    /* What the acks read so far did, before a request acts on their
     * buffers; a view shows them as they are (an operation's acks from one
     * process wait for its others: settled now, it would be read again). */
    bool view = env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_STATUS ||
                env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_LIST;
    if (env->body_case != GPUMEM__WIRE__ENVELOPE__BODY_ACK && !view) engine_settle(srv->eng);
    switch (env->body_case) {
    case GPUMEM__WIRE__ENVELOPE__BODY_HELLO: handle_hello(srv, s, env); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_ALLOC: handle_alloc(srv, s, env->id, env->alloc); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_FREE: handle_free(srv, s, env); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_ATTACH: handle_attach(srv, s, env->id, env->attach); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_DROP: handle_drop(srv, s, env->id, env->drop); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_PAUSE: handle_op(srv, s, env, false); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_RESUME: handle_op(srv, s, env, true); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_STATUS:
    {
      /* A status or a list changes nothing: for a peer that stopped
       * reading it is only work (a status reads all of /proc). */
      if (s->write_failed) break;
      size_t nlast;
      Gpumem__Wire__DeviceCheck *const *last = engine_last_checks(srv->eng, &nlast);
      struct report_own own = own_figures(srv);
      report_status(&srv->out, &s->owner, env->id, env->status, srv->reg, srv->gpu,
                    &srv->sessions, last, nlast,
                    srv->stats, &own);
    }
      break;
    case GPUMEM__WIRE__ENVELOPE__BODY_LIST:
      if (!s->write_failed) report_list(&srv->out, &s->owner, env->id, env->list, srv->reg);
      break;
    case GPUMEM__WIRE__ENVELOPE__BODY_SHARE: handle_share(srv, s, env); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_BACKUP: handle_backup(srv, s, env, f); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_ACK: engine_ack(srv->eng, &s->owner, env->id, env->ack); break;
    case GPUMEM__WIRE__ENVELOPE__BODY_ADOPT: handle_adopt(srv, s, env, f); break;
    default: break; /* wire_check_request let only requests through */
    }
  }
  wire_env_free(env);
}
