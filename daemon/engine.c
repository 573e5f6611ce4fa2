/* Pause: every matching ACTIVE buffer becomes PAUSING and its owner gets
 * one Unmap event; as each owner acks, the buffers it unmapped are backed
 * up (BACKUP) and released and become PAUSED, and those it could not
 * unmap are ACTIVE again and reported.
 *
 * Resume, all or nothing: memory for every matching PAUSED buffer is
 * created, backups restored and fds exported before anything is sent;
 * owners get Remap events and the buffers stay RESUMING until every owner
 * has acked. Only then do they become ACTIVE. If any owner failed or did
 * not answer, the owners that did map are told to unmap again, the memory
 * is released and every buffer is PAUSED, as before the resume.
 *
 * An owner that does not ack in time is reported with its pid; its buffers
 * stay in transition (counted as held) until its late ack settles them, or
 * its session ends. At the end of each operation the driver's figures for
 * the devices it touched are compared with what the daemon did.
 *
 * A scope narrows an operation to some sessions' buffers (the requester's
 * own, or sessions by pid and name). The requester may then be an owner
 * itself: it gets its Unmap or Remap like any other and the reply only
 * after its ack.
 *
 * A tag is fully paused on a device when a pause that covered every
 * session (no scope) paused it there and no resume has since made any of
 * its buffers there ACTIVE: the tag's paused mark (paused_devices). Only
 * then are new buffers there refused (TAG_PAUSED) or started PAUSED
 * (ALLOW_PAUSED). A scoped pause leaves the mark alone, so that sessions
 * outside the scope go on allocating; the tag's state, derived from its
 * buffers, shows it paused and mixed. */
#include "engine.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/idmap.h"
#include "common/log.h"
#include "common/size.h"
#include "grace.h"
#include "peer.h"
#include "report.h"
#include "session.h"
#include "stats.h"

/* What the driver's free memory may miss beyond one granularity a buffer. */
#define ENGINE_CHECK_SLACK (16ull << 20)

enum kind {
  K_UNMAP,    /* a pause's Unmap */
  K_REMAP,    /* a resume's Remap */
  K_ROLLBACK, /* Unmap of what a failed resume had mapped */
};

/* The buffers of one owner in one step, and the events sent for them. */
struct group {
  struct session *s;
  struct op *op; /* NULL once the operation stopped waiting (a straggler) */
  enum kind kind;
  bool done;
  uint64_t first_event;
  size_t nevents, acked;
  size_t *ends;   /* event k carried ids[ends[k-1] .. ends[k]) */
  uint64_t *ids;
  bool *failed;   /* the owner could not unmap or map it */
  bool *made;     /* this resume created its memory */
  int *fds;       /* remap: exported chunk fds, in id and chunk order */
  size_t nfds;
  size_t nids, cap;
  char why[WIRE_MAX_MESSAGE + 1]; /* the owner's words for its first failure */
  struct list link; /* op's groups, or the engine's stragglers */
};

struct detail {
  char tag[WIRE_TAG_MAX + 1];
  unsigned device;
  uint64_t buffers, bytes;
};

/* One device during an operation: what the daemon did there, and the
 * driver's figures to compare it with. */
struct devfig {
  bool touched;
  uint64_t released, nbuf; /* released (pause) or taken (resume) */
  uint64_t free_before, managed_before;
};

struct op {
  struct list link;
  bool resume;
  bool rolling_back;
  struct session *ctl;
  uint64_t req_id;
  uint32_t pid;          /* the requester's, for the record */
  uint32_t uid;
  bool by_controller;    /* else a worker's pause or resume of its own */
  struct stats_op *rec;  /* the record while it runs */
  char **tags;
  size_t ntags;
  bool all_tags;         /* no tags named: every tag that exists at the start */
  bool own;              /* scope: the requester's buffers (self) */
  struct session *self;  /* the requester, NULL once it is gone */
  uint32_t *scope_pids;  /* scope: sessions of these pids (none: any) */
  size_t nscope_pids;
  char prefix[WIRE_NAME_MAX + 1]; /* scope: sessions named so ("": any) */
  uint64_t devmask;
  uint32_t timeout_ms;
  uint64_t max_residual;
  uint64_t t0, t_sent; /* start; all events sent (phase one done) */
  struct list groups;
  size_t pending; /* groups not done */
  uint64_t buffers, bytes, backup_bytes, skipped;
  uint64_t held_buffers, held_bytes; /* still holding memory they should not */
  uint32_t *pids;                    /* owners involved in a failure */
  size_t npids;
  uint64_t copied0, copy_us0; /* the registry's copy totals at the start */
  struct detail *detail;
  size_t ndetail;
  struct devfig *dev;
  unsigned ndev;
  struct fault fault; /* first failure, reported instead of success */
};

struct engine {
  uv_loop_t *loop;
  registry *reg;
  gpudev *gpu;
  const struct config *cfg;
  stats *stats;
  struct list *sessions; /* the server's, for scopes */
  const grace *grace;    /* the server's, for what a missing tag may mean */
  struct list queue;
  struct op *current;
  uv_timer_t timer;
  struct list stragglers;
  idmap *events; /* event id -> group */
  Gpumem__Wire__DeviceCheck last[GPUMEM_MAX_DEVICES]; /* the last pause's checks */
  Gpumem__Wire__DeviceCheck *lastp[GPUMEM_MAX_DEVICES];
  size_t nlast;
  uint64_t next_event;
  bool busy; /* inside a step: completion is checked at its end */
};

static void run_queue(engine *e);
static void check_done(engine *e);

/* Create an engine over the registry and the server's sessions. */
engine *engine_create(uv_loop_t *loop, registry *reg, gpudev *g, const struct config *cfg,
                      struct list *sessions, stats *st) {
  engine *e = calloc(1, sizeof *e);
  if (!e || !(e->events = idmap_create())) {
    free(e);
    return NULL;
  }
  e->loop = loop;
  e->reg = reg;
  e->gpu = g;
  e->cfg = cfg;
  e->stats = st;
  e->sessions = sessions;
  e->next_event = 1;
  list_init(&e->queue);
  list_init(&e->stragglers);
  uv_timer_init(loop, &e->timer);
  e->timer.data = e;
  return e;
}

/* Forget a group's events that were not acked, close unsent fds, free it. */
static void group_free(engine *e, struct group *g) {
  for (size_t i = 0; i < g->nevents; i++)
    if (idmap_get(e->events, g->first_event + i) == g) idmap_del(e->events, g->first_event + i);
  for (size_t i = 0; i < g->nfds; i++)
    if (g->fds[i] >= 0) close(g->fds[i]);
  list_remove(&g->link);
  free(g->ends);
  free(g->ids);
  free(g->failed);
  free(g->made);
  free(g->fds);
  free(g);
}

static void op_free(engine *e, struct op *op) {
  struct list *p, *t;
  list_for_each_safe(p, t, &op->groups) group_free(e, list_entry(p, struct group, link));
  for (size_t i = 0; i < op->ntags; i++) free(op->tags[i]);
  free(op->tags);
  free(op->scope_pids);
  free(op->detail);
  free(op->pids);
  free(op->dev);
  free(op);
}

/* Answer a controller's request with a fault and nothing else. */
static void answer_fault(engine *e, struct session *ctl, uint64_t req_id, wire_code code,
                         const char *text) {
  struct fault f = {0};
  fault_set(&f, code, "%s", text);
  stats_error(e->stats, code);
  session_send_error(ctl, req_id, &f);
}

static void on_timer_closed(uv_handle_t *h) { free(h->data); }

/* Know the server's re-registration grace (NULL once it is gone). */
void engine_set_grace(engine *e, const grace *g) { e->grace = g; }

/* Answer every operation with SHUTTING_DOWN and free the engine. */
void engine_destroy(engine *e) {
  if (!e) return;
  struct list *p, *t;
  const char *why = "gpumemd is shutting down; the operation did not complete";
  list_for_each_safe(p, t, &e->queue) {
    struct op *op = list_entry(p, struct op, link);
    if (op->ctl) answer_fault(e, op->ctl, op->req_id, GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN, why);
    list_remove(&op->link);
    op_free(e, op);
  }
  if (e->current) {
    struct op *op = e->current;
    stats_op_end(e->stats, op->rec, GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN, op->bytes,
                 op->backup_bytes, (uv_hrtime() - op->t0) / 1000);
    if (op->ctl)
      answer_fault(e, op->ctl, op->req_id, GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN, why);
    op_free(e, e->current);
  }
  list_for_each_safe(p, t, &e->stragglers)
      group_free(e, list_entry(p, struct group, link));
  idmap_destroy(e->events);
  uv_close((uv_handle_t *)&e->timer, on_timer_closed);
}

/* Copy a scope into an operation; false when out of memory. */
static bool take_scope(struct op *op, struct session *ctl, const struct engine_scope *scope) {
  if (!scope) return true;
  op->own = scope->own;
  op->self = scope->own ? ctl : NULL;
  if (scope->prefix) snprintf(op->prefix, sizeof op->prefix, "%s", scope->prefix);
  if (scope->npids == 0) return true;
  if (!(op->scope_pids = malloc(scope->npids * sizeof *op->scope_pids))) return false;
  memcpy(op->scope_pids, scope->pids, scope->npids * sizeof *op->scope_pids);
  op->nscope_pids = scope->npids;
  return true;
}

/* Queue an operation: a controller's goes ahead of the workers' own ones
 * waiting (in order among controllers'), so that workers, however many,
 * delay a controller by the one running at most. */
static void enqueue(engine *e, struct op *op) {
  struct list *p;
  if (op->by_controller)
    for (p = e->queue.next; p != &e->queue; p = p->next)
      if (!list_entry(p, struct op, link)->by_controller) {
        list_append(p, &op->link); /* just before it */
        return;
      }
  list_append(&e->queue, &op->link);
}

/* Queue an operation and start it if nothing runs. */
void engine_submit(engine *e, struct session *ctl, uint64_t req_id, bool resume,
                   char **tags, size_t ntags, uint64_t devmask,
                   uint32_t timeout_ms, uint64_t max_residual,
                   const struct engine_scope *scope) {
  struct op *op = calloc(1, sizeof *op);
  unsigned ndev = gpudev_device_count(e->gpu);
  if (op) {
    op->tags = calloc(ntags + 1, sizeof *op->tags);
    op->dev = calloc(ndev + 1, sizeof *op->dev);
  }
  bool nomem = !op || !op->tags || !op->dev || !take_scope(op, ctl, scope);
  for (size_t i = 0; !nomem && i < ntags; i++) {
    bool seen = false; /* a tag named twice is one tag */
    for (size_t j = 0; j < op->ntags && !seen; j++) seen = strcmp(op->tags[j], tags[i]) == 0;
    if (!seen && !(op->tags[op->ntags++] = strdup(tags[i]))) nomem = true;
  }
  if (nomem) {
    if (op) op_free(e, op);
    answer_fault(e, ctl, req_id, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    return;
  }
  list_init(&op->groups);
  op->pid = ctl->pid > 0 ? (uint32_t)ctl->pid : 0;
  op->uid = (uint32_t)ctl->uid;
  op->all_tags = ntags == 0;
  op->resume = resume;
  op->ctl = ctl;
  op->req_id = req_id;
  op->ndev = ndev;
  uint64_t all = ndev >= GPUMEM_MAX_DEVICES ? ~0ull : (1ull << ndev) - 1;
  op->devmask = (devmask ? devmask : ~0ull) & all;
  op->timeout_ms = timeout_ms ? timeout_ms : e->cfg->ack_timeout_ms;
  if (op->timeout_ms > GPUMEM_OWNER_TIMEOUT_MAX_MS) {
    log_info("timeout of %u ms capped at %u ms", op->timeout_ms, GPUMEM_OWNER_TIMEOUT_MAX_MS);
    op->timeout_ms = GPUMEM_OWNER_TIMEOUT_MAX_MS;
  }
  /* A worker's own operation holds the one queue while it waits for its
   * owners: no longer than --ack-timeout. */
  op->by_controller = ctl->role == GPUMEM__WIRE__ROLE__ROLE_CONTROLLER;
  if (!op->by_controller && op->timeout_ms > e->cfg->ack_timeout_ms)
    op->timeout_ms = e->cfg->ack_timeout_ms;
  op->max_residual = max_residual;
  enqueue(e, op);
  run_queue(e);
}

/* Record the first failure of an operation. */
__attribute__((format(printf, 3, 4))) static void fail(struct op *op, wire_code code,
                                                       const char *fmt, ...) {
  if (!op || op->fault.code) return;
  op->fault.code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(op->fault.text, sizeof op->fault.text, fmt, ap);
  va_end(ap);
}

/* Name an owner among those a failure involves (once). */
static void note_pid(struct op *op, pid_t pid) {
  for (size_t i = 0; i < op->npids; i++)
    if (op->pids[i] == (uint32_t)pid) return;
  uint32_t *np = realloc(op->pids, (op->npids + 1) * sizeof *np);
  if (!np) return;
  op->pids = np;
  op->pids[op->npids++] = (uint32_t)pid;
}

/* Count a buffer that still holds memory the operation should have freed
 * (or, for a resume, memory it could not take back). */
static void hold(struct op *op, const struct buffer *b) {
  if (!op) return;
  op->held_buffers++;
  if (b->has_memory) op->held_bytes += b->size;
  note_pid(op, b->owner->pid);
}

/* Count a buffer that finished into the operation's figures. */
static void count(struct op *op, const struct buffer *b) {
  if (!op) return;
  op->buffers++;
  op->bytes += b->size;
  if (b->device < op->ndev) {
    op->dev[b->device].released += b->size;
    op->dev[b->device].nbuf++;
  }
  struct detail *d = NULL;
  for (size_t i = 0; i < op->ndetail && !d; i++)
    if (op->detail[i].device == b->device && strcmp(op->detail[i].tag, b->tag->name) == 0)
      d = &op->detail[i];
  if (!d) {
    struct detail *nd = realloc(op->detail, (op->ndetail + 1) * sizeof *nd);
    if (!nd) return;
    op->detail = nd;
    d = &nd[op->ndetail++];
    memset(d, 0, sizeof *d);
    snprintf(d->tag, sizeof d->tag, "%s", b->tag->name);
    d->device = b->device;
  }
  d->buffers++;
  d->bytes += b->size;
}

/* Which of bufs (PAUSED, with memory, of one owner) the owner's process
 * still maps or holds, as the kernel or driver can tell (none, where it
 * cannot): one look at the process for all of them. */
static void owner_holds(engine *e, struct buffer **bufs, size_t n, bool *held) {
  memset(held, 0, n * sizeof *held);
  size_t total = 0;
  for (size_t i = 0; i < n; i++) total += bufs[i]->ipc ? 0 : bufs[i]->nchunks;
  uint64_t *handles = malloc((total + 1) * sizeof *handles);
  bool *chunk_held = calloc(total + 1, sizeof *chunk_held);
  size_t k = 0;
  for (size_t i = 0; handles && i < n; i++)
    for (size_t c = 0; !bufs[i]->ipc && c < bufs[i]->nchunks; c++) handles[k++] = bufs[i]->handles[c];
  if (handles && chunk_held && total &&
      gpudev_chunks_held_by(e->gpu, (int)bufs[0]->owner->pid, handles, total, chunk_held) > 0) {
    k = 0;
    for (size_t i = 0; i < n; i++)
      for (size_t c = 0; !bufs[i]->ipc && c < bufs[i]->nchunks; c++) held[i] |= chunk_held[k++];
  }
  free(handles);
  free(chunk_held);
}

/* A PAUSED buffer that still has memory: back it up and release it, unless
 * its owner still maps it or its backup fails (then it keeps its memory,
 * is counted as held, and the operation fails). */
static void release(engine *e, struct op *op, struct buffer *b, bool still_held) {
  unsigned long long id = (unsigned long long)b->id;
  if (still_held) {
    log_error("pid %d acknowledged the unmap of buffer %llu but still maps it", (int)b->owner->pid,
              id);
    hold(op, b);
    fail(op, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED,
         "pid %d acknowledged the unmap of buffer %llu but still maps it", (int)b->owner->pid, id);
    return;
  }
  uint64_t copied = 0;
  if ((b->flags & BUF_FLAG_BACKUP) && !b->backup_valid) {
    struct fault f = {0};
    if (registry_backup(e->reg, b, &f)) {
      log_error("pause: %s; buffer %llu keeps its memory", f.text, id);
      hold(op, b);
      fail(op, f.code, "%s; buffer %llu keeps its memory", f.text, id);
      return;
    }
    copied = b->size;
    if (op) op->backup_bytes += b->size;
  }
  registry_memory_release(e->reg, b);
  /* Counted as it happens, also for a straggler's late ack (no op). */
  stats_bytes(e->stats, false, b->size);
  if (op) stats_op_progress(op->rec, b->size, copied);
  count(op, b);
}

/* An owner answered its Unmap: what it unmapped is released, what it could
 * not unmap is ACTIVE again. Out of host memory for the check, unmapped
 * buffers are PAUSED and keep their memory, counted as held (a later
 * pause releases them). */
static void finish_unmap(engine *e, struct group *g) {
  struct buffer **bufs = calloc(g->nids + 1, sizeof *bufs);
  bool *held = calloc(g->nids + 1, sizeof *held);
  size_t n = 0;
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = registry_find(e->reg, g->ids[i]);
    if (!b || b->state != BUF_PAUSING) continue;
    if (g->failed[i]) {
      registry_set_state(e->reg, b, BUF_ACTIVE);
      hold(g->op, b);
      fail(g->op, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED, "pid %d could not unmap buffer %llu: %s",
           (int)g->s->pid, (unsigned long long)b->id, g->why);
      continue;
    }
    registry_set_state(e->reg, b, BUF_PAUSED);
    if (bufs && held)
      bufs[n++] = b;
    else
      hold(g->op, b);
  }
  if (!bufs || !held) {
    fail(g->op, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory; buffers keep their memory");
  } else {
    owner_holds(e, bufs, n, held);
    for (size_t i = 0; i < n; i++) release(e, g->op, bufs[i], held[i]);
  }
  free(bufs);
  free(held);
}

/* A buffer a failed resume had mapped is unmapped again: release what the
 * resume made, and it is PAUSED as before. */
static void undo_resume(engine *e, struct buffer *b, bool made) {
  if (made) registry_memory_release(e->reg, b);
  registry_set_state(e->reg, b, BUF_PAUSED);
}

/* An owner answered a rollback Unmap. */
static void finish_rollback(engine *e, struct group *g) {
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = registry_find(e->reg, g->ids[i]);
    if (!b || b->state != BUF_RESUMING) continue;
    if (g->failed[i]) {
      /* The owner keeps it mapped: it is in use, whatever the resume said. */
      registry_set_state(e->reg, b, BUF_ACTIVE);
      hold(g->op, b);
      log_error("pid %d could not unmap buffer %llu after a failed resume: %s", (int)g->s->pid,
                (unsigned long long)b->id, g->why);
      fail(g->op, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
           "pid %d could not unmap buffer %llu after a failed resume: %s", (int)g->s->pid,
           (unsigned long long)b->id, g->why);
      continue;
    }
    undo_resume(e, b, g->made[i]);
  }
}

/* Give a group its events' ids. */
static void number_events(engine *e, struct group *g, size_t nevents) {
  g->first_event = e->next_event;
  g->nevents = nevents;
  e->next_event += nevents;
  for (size_t i = 0; i < nevents; i++) idmap_put(e->events, g->first_event + i, g);
}

/* A new group of one owner's buffers. */
static struct group *group_new(struct op *op, struct session *s, enum kind kind) {
  struct group *g = calloc(1, sizeof *g);
  if (!g) return NULL;
  g->s = s;
  g->op = op;
  g->kind = kind;
  list_init(&g->link);
  return g;
}

/* Add a buffer id to a group. */
static int group_add(struct group *g, uint64_t id, bool made) {
  if (g->nids == g->cap) {
    size_t cap = g->cap ? 2 * g->cap : 16;
    uint64_t *ids = realloc(g->ids, cap * sizeof *ids);
    if (ids) g->ids = ids;
    bool *failed = ids ? realloc(g->failed, cap * sizeof *failed) : NULL;
    if (failed) g->failed = failed;
    bool *m = failed ? realloc(g->made, cap * sizeof *m) : NULL;
    if (!m) return -1;
    g->made = m;
    g->cap = cap;
  }
  g->failed[g->nids] = false;
  g->made[g->nids] = made;
  g->ids[g->nids++] = id;
  return 0;
}

/* Send a group its Unmap event (one for all its buffers). */
static void send_unmap(engine *e, struct group *g) {
  if (!(g->ends = calloc(1, sizeof *g->ends))) return;
  g->ends[0] = g->nids;
  number_events(e, g, 1);
  Gpumem__Wire__UnmapEvent ev = GPUMEM__WIRE__UNMAP_EVENT__INIT;
  ev.buffer_ids = g->ids;
  ev.n_buffer_ids = g->nids;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = g->first_event;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_UNMAP;
  env.unmap = &ev;
  session_send(g->s, &env, NULL, 0);
}

/* Send one owner its Remap events with the fds exported for them, at most
 * FRAME_MAX_FDS fds per frame. Returns -1 if the session ended (g is gone). */
static int send_remap(engine *e, struct group *g) {
  size_t nevents = 0;
  for (size_t i = 0, fds = 0; i < g->nids; i++) {
    size_t k = registry_find(e->reg, g->ids[i])->nchunks;
    if (i == 0 || fds + k > FRAME_MAX_FDS) {
      nevents++;
      fds = 0;
    }
    fds += k;
  }
  if (!(g->ends = calloc(nevents + 1, sizeof *g->ends))) return 0;
  number_events(e, g, nevents);
  Gpumem__Wire__RemapEntry ent[FRAME_MAX_FDS], *entp[FRAME_MAX_FDS];
  size_t i = 0, fd_at = 0;
  for (size_t ev_i = 0; ev_i < nevents; ev_i++) {
    size_t nent = 0, nfds = 0, first_fd = fd_at;
    while (i < g->nids) {
      struct buffer *b = registry_find(e->reg, g->ids[i]);
      size_t k = b->ipc ? 0 : b->nchunks;
      if (nent > 0 && nfds + k > FRAME_MAX_FDS) break;
      gpumem__wire__remap_entry__init(&ent[nent]);
      ent[nent].buffer_id = b->id;
      ent[nent].chunk_sizes = b->chunk_sizes;
      ent[nent].n_chunk_sizes = b->nchunks;
      entp[nent] = &ent[nent];
      nent++;
      nfds += k;
      i++;
    }
    g->ends[ev_i] = i;
    fd_at += nfds;
    Gpumem__Wire__RemapEvent rm = GPUMEM__WIRE__REMAP_EVENT__INIT;
    rm.entries = entp;
    rm.n_entries = nent;
    wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
    env.id = g->first_event + ev_i;
    env.fd_count = (uint32_t)nfds;
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_REMAP;
    env.remap = &rm;
    int fds[FRAME_MAX_FDS];
    memcpy(fds, g->fds + first_fd, nfds * sizeof *fds);
    for (size_t k = first_fd; k < fd_at; k++) g->fds[k] = -1; /* session_send owns them */
    if (session_send(g->s, &env, fds, nfds) < 0) return -1;
  }
  return 0;
}

/* True if an operation without own covers the buffers of session s. */
static bool session_selected(const struct op *op, const struct session *s) {
  if (s->role != GPUMEM__WIRE__ROLE__ROLE_WORKER) return false;
  bool pid_ok = op->nscope_pids == 0;
  for (size_t i = 0; i < op->nscope_pids && !pid_ok; i++)
    pid_ok = s->pid > 0 && op->scope_pids[i] == (uint32_t)s->pid;
  return pid_ok && strncmp(s->name, op->prefix, strlen(op->prefix)) == 0;
}

/* True if the operation covers buffer b: its device and its owner. */
static bool selected(const struct op *op, const struct buffer *b) {
  if (!(op->devmask & (1ull << b->device))) return false;
  return op->own ? b->owner == op->self : session_selected(op, b->owner);
}

/* True if the operation covers every session (no scope). */
static bool unscoped(const struct op *op) {
  return !op->own && op->nscope_pids == 0 && !op->prefix[0];
}

/* Name the tags of an operation that names none: every tag there is now
 * (for a worker's own operation, those its session has buffers in, so
 * that it costs what the worker holds, not what the node holds). */
static bool name_all_tags(engine *e, struct op *op) {
  struct list *tags = registry_tags(e->reg), *p;
  size_t most = op->own ? (op->self ? op->self->nbuffers : 0) : registry_tag_count(e->reg);
  char **names = calloc(most + 1, sizeof *names);
  idmap *seen = op->own ? idmap_create() : NULL;
  if (!names || (op->own && !seen)) {
    free(names);
    idmap_destroy(seen);
    return false;
  }
  free(op->tags);
  op->tags = names;
  bool ok = true;
  if (op->own) {
    for (p = op->self ? op->self->buffers.next : NULL; ok && p && p != &op->self->buffers;
         p = p->next) {
      struct tag *t = list_entry(p, struct buffer, owner_link)->tag;
      if (idmap_get(seen, t->seq)) continue;
      ok = idmap_put(seen, t->seq, t) == 0 && (op->tags[op->ntags++] = strdup(t->name));
    }
  } else {
    for (p = tags->next; ok && p != tags; p = p->next)
      ok = (op->tags[op->ntags++] = strdup(list_entry(p, struct tag, link)->name)) != NULL;
  }
  idmap_destroy(seen);
  return ok;
}

/* True if session s has a buffer in tag t. */
static bool has_buffer_in(const struct session *s, const struct tag *t) {
  for (const struct list *p = t->buffers.next; p != &t->buffers; p = p->next)
    if (list_entry(p, struct buffer, tag_link)->owner == s) return true;
  return false;
}

/* Describe a scope by pid and name ("with pid 12 or 34 named 'engine-*'"). */
static void scope_words(const struct op *op, char *buf, size_t len) {
  int at = 0;
  for (size_t i = 0; i < op->nscope_pids && at < (int)len; i++)
    at += snprintf(buf + at, len - (size_t)at, "%s%u", i ? " or " : "with pid ",
                   op->scope_pids[i]);
  if (op->prefix[0] && at < (int)len)
    snprintf(buf + at, len - (size_t)at, "%snamed '%s*'", at ? " " : "", op->prefix);
}

/* What the operation names must exist: every tag (a typo is NOT_FOUND),
 * some session its scope selects, and with own, a buffer of the requester
 * in every tag named. */
static bool names_exist(engine *e, struct op *op) {
  if (op->all_tags && !name_all_tags(e, op)) {
    fail(op, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    return false;
  }
  for (size_t t = 0; t < op->ntags; t++) {
    struct tag *tag = registry_tag(e->reg, op->tags[t]);
    if (!tag && op->own) { /* one answer whether or not another uid has the tag */
      fail(op, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, "this session has no buffers in tag '%s'",
           op->tags[t]);
      return false;
    }
    if (!tag && grace_active(e->grace)) {
      fail(op, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND,
           "no tag '%s' yet: the re-registration grace runs %.1f s more, and allocations in "
           "new tags wait for it to end (%zu waiting)",
           op->tags[t], (double)grace_left_ms(e->grace) / 1e3, grace_waiting(e->grace));
      return false;
    }
    if (!tag) {
      fail(op, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, "no tag '%s'", op->tags[t]);
      return false;
    }
    if (op->own && !op->all_tags && (!op->self || !has_buffer_in(op->self, tag))) {
      fail(op, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, "this session has no buffers in tag '%s'",
           op->tags[t]);
      return false;
    }
  }
  if (op->own || unscoped(op)) return true;
  for (struct list *p = e->sessions->next; p != e->sessions; p = p->next) {
    const struct session *s = list_entry(p, struct session, link);
    if (!s->closed && session_selected(op, s)) return true;
  }
  char words[WIRE_NAME_MAX + 128];
  scope_words(op, words, sizeof words);
  fail(op, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, "no worker session %s", words);
  return false;
}

/* Read the driver's free memory and the daemon's own figure for every
 * selected device, to compare with at the end. */
static void snapshot(engine *e, struct op *op) {
  for (unsigned d = 0; d < op->ndev; d++) {
    if (!(op->devmask & (1ull << d))) continue;
    struct gpudev_mem m;
    if (gpudev_mem_detail(e->gpu, d, &m) == 0) op->dev[d].free_before = m.free;
    op->dev[d].managed_before = registry_managed(e->reg, d);
  }
}

/* A buffer that an earlier operation still waits on: it holds its memory
 * until its owner's late ack. */
static void held_in_transit(struct op *op, const struct buffer *b) {
  hold(op, b);
  op->dev[b->device].touched = true;
}

/* Say which owners missed an earlier ack, and what they still hold. */
static void fail_in_transit(struct op *op, const char *what) {
  char bytes[32], pids[96] = "";
  int len = 0;
  for (size_t i = 0; i < op->npids && len < (int)sizeof pids; i++)
    len += snprintf(pids + len, sizeof pids - (size_t)len, " %u", op->pids[i]);
  fail(op, GPUMEM__WIRE__ERROR_CODE__CLIENT_TIMEOUT,
       "%s: pid%s has not acknowledged an earlier pause or resume; %llu buffers (%s) are "
       "still held",
       what, pids, (unsigned long long)op->held_buffers,
       size_format(op->held_bytes, bytes, sizeof bytes));
}

/* Phase one of a pause: mark buffers and ask their owners to unmap. */
static void start_pause(engine *e, struct op *op) {
  if (!names_exist(e, op)) return;
  snapshot(e, op);
  idmap *by_session = idmap_create();
  for (size_t t = 0; t < op->ntags && by_session; t++) {
    struct tag *tag = registry_tag(e->reg, op->tags[t]);
    if (unscoped(op)) tag->paused_devices |= op->devmask; /* fully paused there */
    struct list *p, *n;
    list_for_each_safe(p, n, &tag->buffers) {
      struct buffer *b = list_entry(p, struct buffer, tag_link);
      if (!selected(op, b)) continue;
      if (b->flags & BUF_FLAG_IPC_LEGACY) {
        op->skipped++;
        continue;
      }
      op->dev[b->device].touched = true;
      if (b->state == BUF_PAUSING || b->state == BUF_RESUMING) {
        held_in_transit(op, b);
        continue;
      }
      if (b->state == BUF_PAUSED) {
        if (b->has_memory) { /* kept by an earlier failure: try again */
          stats_op_cover(op->rec, b->size);
          bool held;
          owner_holds(e, &b, 1, &held);
          release(e, op, b, held);
        }
        continue;
      }
      struct group *g = idmap_get(by_session, b->owner->id);
      if (!g && (g = group_new(op, b->owner, K_UNMAP))) {
        if (idmap_put(by_session, b->owner->id, g) < 0) {
          free(g);
          g = NULL;
        } else {
          list_append(&op->groups, &g->link);
          op->pending++;
        }
      }
      if (!g || group_add(g, b->id, false) < 0) {
        fail(op, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
        continue;
      }
      stats_op_cover(op->rec, b->size);
      registry_set_state(e->reg, b, BUF_PAUSING);
    }
  }
  if (!by_session) fail(op, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  idmap_destroy(by_session);
  if (op->held_buffers && !op->fault.code) fail_in_transit(op, "pause");
  struct list *p, *n;
  list_for_each_safe(p, n, &op->groups) send_unmap(e, list_entry(p, struct group, link));
}

/* Release what a resume made before it sent anything. */
static void undo_made(engine *e, struct buffer **bufs, const bool *made, size_t n) {
  for (size_t j = 0; j < n; j++)
    if (made[j]) registry_memory_release(e->reg, bufs[j]);
}

/* Export every chunk of the group's buffers into g->fds. */
static wire_code export_group(engine *e, struct group *g, struct fault *f) {
  size_t total = 0;
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = registry_find(e->reg, g->ids[i]);
    total += b->ipc ? 0 : b->nchunks;
  }
  if (!(g->fds = malloc((total + 1) * sizeof *g->fds)))
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = registry_find(e->reg, g->ids[i]);
    wire_code rc = registry_export(e->reg, b, g->fds + g->nfds, f);
    if (rc) return rc;
    g->nfds += b->ipc ? 0 : b->nchunks;
  }
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Collect the PAUSED buffers a resume selects; false (with the failure
 * recorded) if any is still in an earlier operation's transition. */
static bool collect_paused(engine *e, struct op *op, struct buffer ***out, size_t *n) {
  size_t cap = 0;
  for (size_t t = 0; t < op->ntags; t++) {
    struct tag *tag = registry_tag(e->reg, op->tags[t]);
    struct list *p;
    for (p = tag->buffers.next; p != &tag->buffers; p = p->next) {
      struct buffer *b = list_entry(p, struct buffer, tag_link);
      if (!selected(op, b)) continue;
      if (b->state == BUF_PAUSING || b->state == BUF_RESUMING) held_in_transit(op, b);
      if (b->state != BUF_PAUSED) continue;
      if (*n == cap) {
        cap = cap ? cap * 2 : 64;
        struct buffer **nb = realloc(*out, cap * sizeof *nb);
        if (!nb) {
          fail(op, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
          return false;
        }
        *out = nb;
      }
      (*out)[(*n)++] = b;
    }
  }
  if (op->held_buffers) {
    fail_in_transit(op, "resume refused, nothing changed");
    return false;
  }
  return true;
}

/* Create memory for every buffer that has none, or for none of them. */
static bool make_memory(engine *e, struct op *op, struct buffer **bufs, bool *made, size_t n) {
  for (size_t i = 0; i < n; i++) {
    if (bufs[i]->has_memory) continue;
    if (!registry_memory_create(e->reg, bufs[i], &op->fault)) {
      made[i] = true;
      continue;
    }
    uint64_t needed = 0;
    for (size_t j = 0; j < n; j++)
      if (bufs[j]->device == bufs[i]->device && (!bufs[j]->has_memory || made[j]))
        needed += bufs[j]->size;
    undo_made(e, bufs, made, n);
    size_t len = strlen(op->fault.text);
    snprintf(op->fault.text + len, sizeof op->fault.text - len, "; nothing resumed");
    if (op->fault.code == GPUMEM__WIRE__ERROR_CODE__OUT_OF_MEMORY) {
      struct gpudev_mem m = {0};
      gpudev_mem_detail(e->gpu, bufs[i]->device, &m);
      op->fault.bytes_free = m.free;
      op->fault.bytes_needed = needed;
      snprintf(op->fault.text, sizeof op->fault.text,
               "device %u: resume needs %llu bytes, %llu free; nothing resumed", bufs[i]->device,
               (unsigned long long)needed, (unsigned long long)m.free);
    }
    return false;
  }
  return true;
}

/* Resume: memory, contents and fds for every selected buffer, or none. */
static void start_resume(engine *e, struct op *op) {
  size_t n = 0;
  struct buffer **bufs = NULL;
  bool *made = NULL;
  idmap *by_session = NULL;
  if (!names_exist(e, op) || !collect_paused(e, op, &bufs, &n)) goto out;
  for (size_t i = 0; i < n; i++) stats_op_cover(op->rec, bufs[i]->size);
  snapshot(e, op);
  if (!(made = calloc(n + 1, sizeof *made)) || !(by_session = idmap_create())) {
    fail(op, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    goto out;
  }
  if (!make_memory(e, op, bufs, made, n)) goto out;
  struct fault f = {0};
  for (size_t i = 0; i < n && !f.code; i++) {
    op->dev[bufs[i]->device].touched = true;
    if (bufs[i]->backup_valid && !registry_restore(e->reg, bufs[i], &f)) {
      op->backup_bytes += bufs[i]->size;
      stats_op_progress(op->rec, 0, bufs[i]->size);
    }
  }
  for (size_t i = 0; i < n && !f.code; i++) {
    struct group *g = idmap_get(by_session, bufs[i]->owner->id);
    if (!g && (g = group_new(op, bufs[i]->owner, K_REMAP))) {
      list_append(&op->groups, &g->link);
      op->pending++;
      if (idmap_put(by_session, bufs[i]->owner->id, g) < 0) g = NULL;
    }
    if (!g || group_add(g, bufs[i]->id, made[i]) < 0)
      fault_set(&f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  }
  struct list *p, *x;
  list_for_each_safe(p, x, &op->groups) {
    if (f.code) break;
    export_group(e, list_entry(p, struct group, link), &f);
  }
  if (f.code) {
    /* Nothing was sent: free the groups and what was made. */
    list_for_each_safe(p, x, &op->groups) group_free(e, list_entry(p, struct group, link));
    op->pending = 0;
    undo_made(e, bufs, made, n);
    op->backup_bytes = 0;
    fail(op, f.code, "%s; nothing resumed", f.text);
    goto out;
  }
  for (size_t i = 0; i < n; i++) registry_set_state(e->reg, bufs[i], BUF_RESUMING);
  list_for_each_safe(p, x, &op->groups) send_remap(e, list_entry(p, struct group, link));
out:
  idmap_destroy(by_session);
  free(bufs);
  free(made);
}

/* A resume that every owner acknowledged: its buffers are ACTIVE and its
 * tags no longer fully paused on its devices (until then, and after a
 * resume that failed, new buffers there still start paused). A scoped
 * resume ends that only where it made a buffer ACTIVE. */
static void commit_resume(engine *e, struct op *op) {
  for (size_t t = 0; unscoped(op) && t < op->ntags; t++) {
    struct tag *tag = registry_tag(e->reg, op->tags[t]);
    if (tag) tag->paused_devices &= ~op->devmask;
  }
  struct list *p;
  for (p = op->groups.next; p != &op->groups; p = p->next) {
    struct group *g = list_entry(p, struct group, link);
    for (size_t i = 0; i < g->nids; i++) {
      struct buffer *b = registry_find(e->reg, g->ids[i]);
      if (!b || b->state != BUF_RESUMING) continue;
      registry_set_state(e->reg, b, BUF_ACTIVE);
      b->tag->paused_devices &= ~(1ull << b->device);
      stats_bytes(e->stats, true, b->size);
      count(op, b);
    }
  }
  /* A tag left with no buffers and paused nowhere is forgotten: its name
   * is free again, for any uid. */
  for (size_t t = 0; t < op->ntags; t++) {
    struct tag *tag = registry_tag(e->reg, op->tags[t]);
    if (tag) registry_prune(e->reg, tag);
  }
}

/* Undo a remap group whose owner answered: buffers it could not map are
 * PAUSED again at once; those it mapped go into a rollback Unmap. Returns
 * the rollback group (already sent), or NULL if none was needed. */
static struct group *roll_back(engine *e, struct op *op, struct group *g) {
  struct group *rb = group_new(op, g->s, K_ROLLBACK);
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = registry_find(e->reg, g->ids[i]);
    if (!b || b->state != BUF_RESUMING) continue;
    if (g->failed[i] || !rb || group_add(rb, b->id, g->made[i]) < 0) undo_resume(e, b, g->made[i]);
  }
  if (!rb || rb->nids == 0) {
    free(rb ? rb->ids : NULL);
    free(rb ? rb->failed : NULL);
    free(rb ? rb->made : NULL);
    free(rb);
    return NULL;
  }
  list_append(op ? &op->groups : &e->stragglers, &rb->link);
  send_unmap(e, rb);
  return rb;
}

/* A failed resume: have every owner that mapped unmap again. Returns true
 * if the operation now waits for those acks. */
static bool start_rollback(engine *e, struct op *op) {
  op->rolling_back = true;
  struct list *p, *x;
  list_for_each_safe(p, x, &op->groups) {
    struct group *g = list_entry(p, struct group, link);
    if (g->kind == K_REMAP && roll_back(e, op, g)) op->pending++;
  }
  return op->pending > 0;
}

/* Compare what the operation did on each device it touched with the
 * driver's figures; fill checks (ndev entries) and fail on a shortfall or
 * on more residual memory than the controller allows. */
static size_t check_devices(engine *e, struct op *op, Gpumem__Wire__DeviceCheck *checks) {
  size_t n = 0;
  uint64_t gran = gpudev_granularity(e->gpu);
  for (unsigned d = 0; d < op->ndev; d++) {
    struct devfig *df = &op->dev[d];
    if (!df->touched) continue;
    Gpumem__Wire__DeviceCheck *c = &checks[n++];
    gpumem__wire__device_check__init(c);
    c->device = d;
    c->released = df->released;
    c->free_before = df->free_before;
    struct gpudev_mem m = {0};
    gpudev_mem_detail(e->gpu, d, &m);
    c->free_after = m.free;
    /* The driver's free memory should move by what the daemon's own
     * holdings moved (other requests may run during the operation). */
    uint64_t managed = registry_managed(e->reg, d);
    if (!op->resume && df->managed_before > managed) {
      uint64_t expect = df->managed_before - managed;
      uint64_t rise = m.free > df->free_before ? m.free - df->free_before : 0;
      uint64_t slack = df->nbuf * gran + ENGINE_CHECK_SLACK;
      if (expect > rise + slack) {
        c->shortfall = expect - rise;
        char a[32], b[32], s[32];
        log_error("device %u: released %s, the driver shows %s more free", d,
                  size_format(expect, a, sizeof a), size_format(rise, b, sizeof b));
        fail(op, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED,
             "device %u: released %s, but the driver shows only %s more free: %s not returned",
             d, size_format(expect, a, sizeof a), size_format(rise, b, sizeof b),
             size_format(c->shortfall, s, sizeof s));
      }
    }
    struct report_residual r;
    c->residual_known = report_residual(e->gpu, d, &r) == 0;
    c->residual = r.bytes;
    if (op->resume || !op->max_residual) continue;
    char a[32], b[32];
    if (!c->residual_known)
      fail(op, GPUMEM__WIRE__ERROR_CODE__RESIDUAL_EXCEEDED,
           "device %u: the driver gives no per-process figures, so --max-residual cannot be "
           "checked",
           d);
    else if (r.bytes > op->max_residual && !op->by_controller) {
      /* A worker is not told which process it is: it may be another uid's. */
      fail(op, GPUMEM__WIRE__ERROR_CODE__RESIDUAL_EXCEEDED,
           "device %u still holds %s outside gpumemd, more than %s", d,
           size_format(r.bytes, a, sizeof a), size_format(op->max_residual, b, sizeof b));
    } else if (r.bytes > op->max_residual) {
      char top[32];
      note_pid(op, r.top_pid);
      fail(op, GPUMEM__WIRE__ERROR_CODE__RESIDUAL_EXCEEDED,
           "device %u still holds %s outside gpumemd, more than %s (largest: pid %d (%s) "
           "holds %s)",
           d, size_format(r.bytes, a, sizeof a), size_format(op->max_residual, b, sizeof b),
           r.top_pid, r.top_name, size_format(r.top_bytes, top, sizeof top));
    }
  }
  return n;
}

/* Answer the controller (if still there) with the figures or the fault,
 * and count the operation as it ended. */
static void reply(engine *e, struct op *op) {
  uint64_t now = uv_hrtime(), us = (now - op->t0) / 1000, copied, copy_us;
  Gpumem__Wire__DeviceCheck *checks = calloc(op->ndev + 1, sizeof *checks);
  Gpumem__Wire__DeviceCheck **checkp = calloc(op->ndev + 1, sizeof *checkp);
  size_t nchecks = checks && checkp ? check_devices(e, op, checks) : 0;
  stats_op_end(e->stats, op->rec, op->fault.code, op->bytes, op->backup_bytes, us);
  op->rec = NULL;
  if (op->ctl) stats_error(e->stats, op->fault.code);
  for (size_t i = 0; i < nchecks; i++) checkp[i] = &checks[i];
  if (!op->resume) {
    e->nlast = nchecks < GPUMEM_MAX_DEVICES ? nchecks : GPUMEM_MAX_DEVICES;
    for (size_t i = 0; i < e->nlast; i++) {
      e->last[i] = checks[i];
      e->lastp[i] = &e->last[i];
    }
  }
  registry_copy_totals(e->reg, !op->resume, &copied, &copy_us);
  copied -= op->copied0;
  copy_us -= op->copy_us0;
  if (copied) {
    registry_note_last(e->reg, !op->resume, copied, copy_us);
    log_info("%s copied %llu bytes in %llu us: %.1f GB/s", op->resume ? "restore" : "backup",
             (unsigned long long)copied, (unsigned long long)copy_us,
             copy_us ? (double)copied / (double)copy_us / 1e3 : 0.0);
  }
  log_info("%s %s%s: %llu buffers, %llu bytes, %llu backed up, %llu skipped, %llu us "
           "(%llu us to send the events, %llu us for the owners)%s%s",
           op->resume ? "resume" : "pause", op->all_tags ? "every tag" : op->tags[0],
           !op->all_tags && op->ntags > 1 ? ",..." : "",
           (unsigned long long)op->buffers, (unsigned long long)op->bytes,
           (unsigned long long)op->backup_bytes, (unsigned long long)op->skipped,
           (unsigned long long)us, (unsigned long long)(op->t_sent - op->t0) / 1000,
           (unsigned long long)(now - op->t_sent) / 1000, op->fault.code ? ": " : "",
           op->fault.text);
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = op->req_id;
  Gpumem__Wire__Error err = GPUMEM__WIRE__ERROR__INIT;
  Gpumem__Wire__OpReply r = GPUMEM__WIRE__OP_REPLY__INIT;
  Gpumem__Wire__TagDeviceBytes *td = calloc(op->ndetail + 1, sizeof *td);
  Gpumem__Wire__TagDeviceBytes **tdp = calloc(op->ndetail + 1, sizeof *tdp);
  if (op->fault.code) {
    err.code = op->fault.code;
    wire_text_clean(op->fault.text); /* a worker's words cut mid-character */
    err.message = op->fault.text;
    err.bytes_needed = op->fault.bytes_needed;
    err.bytes_free = op->fault.bytes_free;
    err.pids = op->pids;
    err.n_pids = op->npids;
    err.buffers_held = op->held_buffers;
    err.bytes_held = op->held_bytes;
    err.checks = checkp;
    err.n_checks = nchecks;
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ERROR;
    env.error = &err;
  } else {
    r.buffers = op->buffers;
    r.bytes = op->bytes;
    r.backup_bytes = op->backup_bytes;
    r.skipped = op->skipped;
    r.elapsed_us = us;
    r.backup_us = copy_us;
    for (size_t i = 0; td && tdp && i < op->ndetail; i++) {
      gpumem__wire__tag_device_bytes__init(&td[i]);
      td[i].tag = op->detail[i].tag;
      td[i].device = op->detail[i].device;
      td[i].buffers = op->detail[i].buffers;
      td[i].bytes = op->detail[i].bytes;
      tdp[i] = &td[i];
      r.n_detail = i + 1;
    }
    r.detail = tdp;
    r.checks = checkp;
    r.n_checks = nchecks;
    r.devices = report_devices(e->reg, e->gpu, &r.n_devices);
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY;
    env.op_reply = &r;
  }
  if (op->ctl) session_send(op->ctl, &env, NULL, 0);
  report_devices_free(r.devices);
  free(td);
  free(tdp);
  free(checks);
  free(checkp);
}

/* Finish the current operation if nobody is left to wait for; a failed
 * resume first rolls back what owners mapped. */
static void check_done(engine *e) {
  struct op *op = e->current;
  if (e->busy || !op || op->pending) return;
  if (op->resume && !op->rolling_back) {
    if (op->fault.code) {
      if (start_rollback(e, op)) {
        uv_timer_stop(&e->timer);
        run_queue(e); /* restarts the timer for the rollback */
        return;
      }
    } else {
      commit_resume(e, op);
    }
  }
  uv_timer_stop(&e->timer);
  e->current = NULL;
  reply(e, op);
  op_free(e, op);
  run_queue(e);
}

/* Under the kill policy, a straggler is killed through the pidfd its
 * session pinned at connect, and its buffers go with its session when it
 * dies. One that cannot be signalled (pid 0: another pid namespace; not
 * pinned; the process that connected is gone) has its session ended here
 * instead, as if it had died. What happened goes into what; true when the
 * session was ended (its buffers are freed, not held). */
static bool kill_straggler(struct session *s, char *what, size_t len) {
  if (s->doomed || s->closed) {
    snprintf(what, len, "session ended");
    return true;
  }
  int rc = peer_signal(s->pidfd, SIGKILL);
  if (rc == 0) {
    log_warn("killing pid %d: no ack in time", (int)s->pid);
    snprintf(what, len, "killed");
    return false;
  }
  const char *why = s->pid <= 0    ? "pid not visible here"
                    : s->pidfd < 0 ? "not pinned"
                    : rc == -ESRCH ? "process gone"
                                   : strerror(-rc);
  snprintf(what, len, "not signalled, %s: session ended", why);
  log_warn("pid %d not signalled (%s): no ack in time; session %llu ended, its buffers freed",
           (int)s->pid, why, (unsigned long long)s->id);
  struct fault f = {.code = GPUMEM__WIRE__ERROR_CODE__CLIENT_TIMEOUT};
  snprintf(f.text, sizeof f.text, "no ack in time: session ended (--timeout-policy kill)");
  session_send_error(s, 0, &f);
  session_end(s);
  return true;
}

/* Owners that did not ack in time: report their pids, keep their buffers
 * in transition (held) for their late acks, and stop waiting; under the
 * kill policy, kill them or end their sessions. */
static void on_timeout(uv_timer_t *t) {
  engine *e = t->data;
  struct op *op = e->current;
  if (!op) return;
  size_t nstraggle = 0;
  bool kill_them = e->cfg->timeout_policy == TIMEOUT_KILL;
  char pids[200] = "", bytes[32], freed[96] = "";
  int len = 0;
  uint64_t ended_buffers = 0, ended_bytes = 0;
  struct list *p, *n;
  list_for_each_safe(p, n, &op->groups) {
    struct group *g = list_entry(p, struct group, link);
    if (g->done) continue;
    char what[80] = "";
    bool ended = kill_them && kill_straggler(g->s, what, sizeof what);
    if (len < (int)sizeof pids)
      len += snprintf(pids + len, sizeof pids - (size_t)len, " %d%s%s%s", (int)g->s->pid,
                      what[0] ? " (" : "", what, what[0] ? ")" : "");
    for (size_t i = 0; i < g->nids; i++) {
      struct buffer *b = registry_find(e->reg, g->ids[i]);
      if (b && !ended) hold(op, b);
      if (b && ended) {
        ended_buffers++;
        ended_bytes += b->size;
      }
    }
    note_pid(op, g->s->pid);
    g->op = NULL;
    list_remove(&g->link);
    list_append(&e->stragglers, &g->link);
    nstraggle++;
  }
  op->pending = 0;
  if (ended_buffers)
    snprintf(freed, sizeof freed, "; %llu buffers (%s) freed with their sessions",
             (unsigned long long)ended_buffers, size_format(ended_bytes, bytes, sizeof bytes));
  char earlier[sizeof op->fault.text] = "";
  if (op->fault.code) snprintf(earlier, sizeof earlier, "; before that: %.200s", op->fault.text);
  op->fault.code = 0; /* the timeout leads, an earlier failure follows */
  fail(op, GPUMEM__WIRE__ERROR_CODE__CLIENT_TIMEOUT,
       "no ack within %u ms from pid%s; %llu buffers (%s) held until they answer%s%s%.*s",
       op->timeout_ms, pids, (unsigned long long)op->held_buffers,
       size_format(op->held_bytes, bytes, sizeof bytes), freed,
       op->resume && !op->rolling_back ? "; nothing resumed" : "", 120, earlier);
  log_warn("%s: %zu owners did not answer in time", op->resume ? "resume" : "pause", nstraggle);
  check_done(e);
}

/* Start queued operations until one has to wait for owners. */
static void run_queue(engine *e) {
  struct op *op = e->current;
  if (op && op->pending) {
    /* A rollback just started: wait for it as long again. */
    uv_update_time(e->loop);
    uv_timer_start(&e->timer, on_timeout, op->timeout_ms, 0);
    return;
  }
  while (!e->current && !list_empty(&e->queue)) {
    op = list_entry(e->queue.next, struct op, link);
    list_remove(&op->link);
    e->current = op;
    op->t0 = uv_hrtime();
    op->rec = stats_op_begin(e->stats, op->resume, op->tags, op->all_tags ? 0 : op->ntags,
                             op->pid, op->uid);
    registry_copy_totals(e->reg, !op->resume, &op->copied0, &op->copy_us0);
    e->busy = true;
    if (op->resume)
      start_resume(e, op);
    else
      start_pause(e, op);
    e->busy = false;
    op->t_sent = uv_hrtime();
    /* Owners get the whole timeout from now: restoring backups before the
     * events went out may have taken a while since the loop last looked
     * at the clock. */
    uv_update_time(e->loop);
    if (op->pending) uv_timer_start(&e->timer, on_timeout, op->timeout_ms, 0);
    check_done(e);
  }
}

/* The driver's figures of the last pause. */
Gpumem__Wire__DeviceCheck *const *engine_last_checks(const engine *e, size_t *n) {
  *n = e->nlast;
  return e->lastp;
}

/* Tell a session that its ack was wrong, without ending it. */
static void refuse_ack(struct session *s, const char *fmt, ...) {
  struct fault f = {.code = GPUMEM__WIRE__ERROR_CODE__NOT_FOUND};
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(f.text, sizeof f.text, fmt, ap);
  va_end(ap);
  log_warn("session %llu (pid %d): %s", (unsigned long long)s->id, (int)s->pid, f.text);
  session_send_error(s, 0, &f);
}

/* A late ack of a group whose operation stopped waiting. */
static void settle_straggler(engine *e, struct group *g) {
  log_info("late ack from pid %d: its buffers are settled", (int)g->s->pid);
  if (g->kind == K_UNMAP)
    finish_unmap(e, g);
  else if (g->kind == K_ROLLBACK)
    finish_rollback(e, g);
  else
    roll_back(e, NULL, g); /* its resume failed: undo what it mapped */
  group_free(e, g);
}

/* A worker acknowledged an event. */
void engine_ack(engine *e, struct session *s, uint64_t event_id,
                const Gpumem__Wire__EventAck *ack) {
  struct group *g = idmap_get(e->events, event_id);
  if (!g || g->s != s) {
    refuse_ack(s, "ack for event %llu, which this session has not been sent or has acked",
               (unsigned long long)event_id);
    return;
  }
  idmap_del(e->events, event_id);
  size_t k = (size_t)(event_id - g->first_event);
  size_t from = k ? g->ends[k - 1] : 0, to = g->ends[k];
  bool bad = ack->code != GPUMEM__WIRE__ERROR_CODE__OK || ack->n_failed_ids;
  for (size_t i = from; bad && ack->n_failed_ids == 0 && i < to; i++) g->failed[i] = true;
  size_t strangers = 0;
  uint64_t stranger = 0;
  for (size_t j = 0; j < ack->n_failed_ids; j++) {
    size_t i = from;
    while (i < to && g->ids[i] != ack->failed_ids[j]) i++;
    if (i < to) {
      g->failed[i] = true;
    } else if (strangers++ == 0) {
      stranger = ack->failed_ids[j];
    }
  }
  if (strangers) /* one error for the ack, however many ids it got wrong */
    refuse_ack(s, "ack of event %llu names %zu buffers the event did not carry (buffer %llu, ...)",
               (unsigned long long)event_id, strangers, (unsigned long long)stranger);
  if (bad && !g->why[0])
    snprintf(g->why, sizeof g->why, "%s", ack->message[0] ? ack->message : wire_code_name(ack->code));
  if (bad)
    log_warn("pid %d: %s failed: %s", (int)s->pid, g->kind == K_REMAP ? "remap" : "unmap",
             g->why);
  /* A resume's progress: what the owner mapped again. */
  for (size_t i = from; g->op && g->kind == K_REMAP && i < to; i++) {
    const struct buffer *b = registry_find(e->reg, g->ids[i]);
    if (b && !g->failed[i]) stats_op_progress(g->op->rec, b->size, 0);
  }
  if (++g->acked < g->nevents) return;
  if (!g->op) {
    settle_straggler(e, g);
    return;
  }
  struct op *op = g->op;
  g->done = true;
  op->pending--;
  if (g->kind == K_UNMAP) {
    finish_unmap(e, g);
  } else if (g->kind == K_ROLLBACK) {
    finish_rollback(e, g);
  } else {
    for (size_t i = 0; i < g->nids; i++)
      if (g->failed[i]) {
        note_pid(op, s->pid);
        fail(op, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
             "pid %d could not map buffer %llu: %s; nothing resumed", (int)s->pid,
             (unsigned long long)g->ids[i], g->why);
      }
  }
  check_done(e);
}

/* A session is ending: stop waiting for it and never answer it. */
void engine_forget(engine *e, struct session *s) {
  struct list *p, *n;
  list_for_each_safe(p, n, &e->queue) {
    struct op *op = list_entry(p, struct op, link);
    if (op->ctl == s) op->ctl = NULL;
    if (op->self == s) op->self = NULL;
  }
  list_for_each_safe(p, n, &e->stragglers) {
    struct group *g = list_entry(p, struct group, link);
    if (g->s == s) group_free(e, g);
  }
  struct op *op = e->current;
  if (!op) return;
  if (op->ctl == s) op->ctl = NULL;
  if (op->self == s) op->self = NULL;
  list_for_each_safe(p, n, &op->groups) {
    struct group *g = list_entry(p, struct group, link);
    if (g->s != s) continue;
    if (!g->done) op->pending--;
    group_free(e, g);
  }
  check_done(e);
}
