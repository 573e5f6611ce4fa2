/* The pause engine: when each state move happens. The registry decides
 * whether it may (registry_move's table); sessions are reached only
 * through the outbox (outbox.h); scope.c, group.c, event.c, outcome.c,
 * devcheck.c and timeout.c hold the pieces this file puts together.
 *
 * Pause: every matching ACTIVE buffer becomes PAUSING and its owner gets
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
 * its buffers there ACTIVE: the tag's paused mark (registry_mark_paused). Only
 * then are new buffers there refused (TAG_PAUSED) or started PAUSED
 * (ALLOW_PAUSED). A scoped pause leaves the mark alone, so that sessions
 * outside the scope go on allocating; the tag's state, derived from its
 * buffers, shows it paused and mixed. */
#include "engine.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/idmap.h"
#include "common/log.h"
#include "common/size.h"
#include "ctxrelease.h"
#include "devcheck.h"
#include "event.h"
#include "exitwait.h"
#include "grace.h"
#include "group.h"
#include "timeout.h"
#include "outbox.h"
#include "outcome.h"
#include "pageable.h"
#include "resume_memory.h"
#include "scope.h"
#include "spill.h"
#include "stats.h"

struct op {
  struct list link;
  bool resume;
  bool rolling_back;
  struct owner *ctl;
  uint64_t req_id;
  uint32_t pid;          /* the requester's, for the record */
  uint32_t uid;
  bool by_controller;    /* else a worker's pause or resume of its own */
  struct stats_op *rec;  /* the record while it runs */
  struct scope scope;    /* the tags, devices and sessions it covers */
  uint32_t timeout_ms;
  uint64_t max_residual;
  bool release_context; /* release workers' device state once paused (ctxrelease.h) */
  uint64_t t0, t_sent; /* start; all events sent (phase one done) */
  uint64_t t_disk;     /* its disk step's start */
  struct list groups;
  size_t pending; /* groups not done */
  uint64_t copied0, copy_us0; /* the registry's copy totals at the start */
  struct devfig *dev;         /* per device: what it did, the driver's figures */
  unsigned ndev;
  /* A pause's step once its owners answered: its releases (ctxrelease.h),
   * then the wait for its owners that ended (exitwait.h). */
  enum { EXITS_UNASKED, EXITS_RELEASING, EXITS_RELEASED, EXITS_WAITING, EXITS_DONE } exits;
  /* A resume whose released owners are being restored (ctxrelease.h)
   * before its remaps: its buffers by id (a session may end meanwhile),
   * the memory it made for them, and the restores' first failure. */
  bool restoring;
  uint64_t *restore_ids;
  bool *restore_made;
  struct buffer **restore_bufs; /* room for them, found again after */
  size_t nrestore;
  struct fault restore_fault;
  /* Its disk step (spill.h): a pause writes its BACKUP_DISK buffers'
   * backups (disk_ids: those it released) once its owners answered; a
   * resume reads theirs back before anything else. */
  enum { DISK_NONE, DISK_RUNNING, DISK_DONE } disk;
  uint64_t *disk_ids;
  size_t ndisk, capdisk;
  spill *spill;
  struct outcome outcome;     /* what it did and could not do, its failure */
  /* A resume that may wait for room (wait_ns, 0: not): waiting while its
   * memory could not be made, since wait_t0, retried by the wait timer. */
  uint64_t wait_ns, wait_t0;
  unsigned wait_dev; /* the device it lacked room on, wait_need bytes */
  uint64_t wait_need;
  bool waiting, covered; /* covered: stats has its bytes already */
};

struct engine {
  uv_loop_t *loop;
  registry *reg;
  gpudev *gpu;
  const struct config *cfg;
  stats *stats;
  struct list *owners; /* the server's (struct owner.link), for scopes */
  const struct outbox *out;
  const grace *grace;    /* the server's, for what a missing tag may mean */
  struct list queue;
  struct op *current;
  uv_timer_t timer;
  uv_timer_t wait_timer; /* a resume waiting for room tries again */
  uv_check_t check;     /* at the turn's end: settles its acks (on_check) */
  uv_idle_t idle;       /* keeps the loop from blocking while acks wait */
  uv_check_t judge;     /* a timeout is judged here, after the turn read the sockets */
  uv_idle_t judge_idle; /* and the turn polls without blocking meanwhile */
  bool stopping;        /* engine_destroy runs */
  uint64_t timer_gen;   /* bumped by every start and stop of the timer */
  uint64_t judge_gen;   /* the timer_gen of the timeout being judged */
  int open_handles;     /* the timer, the checks and the idles, until closed */
  struct list unmapped; /* acked Unmap groups (struct group.unmapped) */
  struct list stragglers;
  idmap *events; /* event id -> group */
  struct devcheck_last last; /* the last pause's checks */
  exitwait *exits;           /* the current pause's owners that ended */
  ctxrelease *ctx;           /* workers' device state released by pauses */
  uint64_t next_event;
  bool busy; /* inside a step: completion is checked at its end */
};

static void run_queue(engine *e);
static void check_done(engine *e);

/* Create an engine over the registry and the server's owners. */
engine *engine_create(uv_loop_t *loop, registry *reg, gpudev *g, const struct config *cfg,
                      struct list *owners, const struct outbox *out, stats *st) {
  engine *e = calloc(1, sizeof *e);
  if (!e || !(e->events = idmap_create()) || !(e->exits = exitwait_create(loop, g)) ||
      !(e->ctx = ctxrelease_create(loop, g, owners, out, cfg->release_journal,
                                   cfg->lock_timeout_ms, cfg->release_timeout_ms))) {
    if (e) idmap_destroy(e->events);
    if (e) exitwait_destroy(e->exits);
    free(e);
    return NULL;
  }
  e->loop = loop;
  e->reg = reg;
  e->gpu = g;
  e->cfg = cfg;
  e->stats = st;
  e->owners = owners;
  e->out = out;
  e->next_event = 1;
  list_init(&e->queue);
  list_init(&e->stragglers);
  list_init(&e->unmapped);
  uv_timer_init(loop, &e->timer);
  uv_timer_init(loop, &e->wait_timer);
  uv_check_init(loop, &e->check);
  uv_idle_init(loop, &e->idle);
  uv_check_init(loop, &e->judge);
  uv_idle_init(loop, &e->judge_idle);
  e->timer.data = e->check.data = e->idle.data = e->judge.data = e->judge_idle.data = e;
  e->wait_timer.data = e;
  e->open_handles = 6;
  return e;
}

/* Forget a group's events that were not acked, close unsent fds, free it. */
static void op_free(engine *e, struct op *op) {
  struct list *p, *t;
  list_for_each_safe(p, t, &op->groups) group_free(list_entry(p, struct group, link), e->events);
  scope_free(&op->scope);
  outcome_free(&op->outcome);
  free(op->dev);
  free(op->restore_ids);
  free(op->restore_made);
  free(op->restore_bufs);
  free(op->disk_ids);
  free(op);
}

/* Queue an Error for o through the outbox. */
static void say_error(engine *e, struct owner *o, uint64_t id, const struct fault *f) {
  e->out->send_error(e->out->ctx, o, id, f);
}

/* Answer a controller's request with a fault and nothing else. */
static void answer_fault(engine *e, struct owner *ctl, uint64_t req_id, wire_code code,
                         const char *text) {
  struct fault f = {0};
  fault_set(&f, code, "%s", text);
  stats_error(e->stats, code);
  say_error(e, ctl, req_id, &f);
}

/* Free the engine once its last handle is closed. */
static void on_handle_closed(uv_handle_t *h) {
  engine *e = h->data;
  if (--e->open_handles == 0) free(e);
}

/* Know the server's re-registration grace (NULL once it is gone). */
void engine_set_grace(engine *e, const grace *g) { e->grace = g; }

/* Answer every operation with SHUTTING_DOWN and free the engine. */
void engine_destroy(engine *e) {
  if (!e) return;
  e->stopping = true;
  if (e->current && e->current->spill) spill_finish(e->current->spill); /* its files settle */
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
    stats_op_end(e->stats, op->rec, GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN, op->outcome.bytes,
                 op->outcome.backup_bytes, (uv_hrtime() - op->t0) / 1000);
    if (op->ctl)
      answer_fault(e, op->ctl, op->req_id, GPUMEM__WIRE__ERROR_CODE__SHUTTING_DOWN, why);
    op_free(e, e->current);
  }
  list_for_each_safe(p, t, &e->stragglers)
      group_free(list_entry(p, struct group, link), e->events);
  idmap_destroy(e->events);
  exitwait_destroy(e->exits);
  ctxrelease_destroy(e->ctx);
  uv_close((uv_handle_t *)&e->timer, on_handle_closed);
  uv_close((uv_handle_t *)&e->wait_timer, on_handle_closed);
  uv_close((uv_handle_t *)&e->check, on_handle_closed);
  uv_close((uv_handle_t *)&e->idle, on_handle_closed);
  uv_close((uv_handle_t *)&e->judge, on_handle_closed);
  uv_close((uv_handle_t *)&e->judge_idle, on_handle_closed);
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
void engine_submit(engine *e, struct owner *ctl, uint64_t req_id, bool resume,
                   char **tags, size_t ntags, uint64_t devmask,
                   uint32_t timeout_ms, uint64_t max_residual, uint32_t wait_ms,
                   bool release_context, const struct scope_spec *scope) {
  engine_settle(e); /* what acks read before it released is released for it */
  struct op *op = calloc(1, sizeof *op);
  unsigned ndev = gpudev_device_count(e->gpu);
  if (op) op->dev = calloc(ndev + 1, sizeof *op->dev);
  bool nomem = !op || !op->dev ||
               !scope_init(&op->scope, tags, ntags, devmask, ndev, ctl, scope);
  if (nomem) {
    if (op) op_free(e, op);
    answer_fault(e, ctl, req_id, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    return;
  }
  list_init(&op->groups);
  op->pid = ctl->pid > 0 ? (uint32_t)ctl->pid : 0;
  op->uid = (uint32_t)ctl->uid;
  op->resume = resume;
  op->ctl = ctl;
  op->req_id = req_id;
  op->ndev = ndev;
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
  op->release_context = release_context && !resume;
  if (resume && wait_ms) {
    if (!op->by_controller && wait_ms > e->cfg->ack_timeout_ms) wait_ms = e->cfg->ack_timeout_ms;
    op->wait_ns = (uint64_t)wait_ms * 1000000;
  }
  enqueue(e, op);
  run_queue(e);
}

/* Record the first failure of an operation (none for a straggler's). */
#define fail(op, ...) outcome_fail((op) ? &(op)->outcome : NULL, __VA_ARGS__)

/* Count a buffer that still holds memory the operation should have freed
 * (or, for a resume, memory it could not take back). */
static void hold(struct op *op, const struct buffer *b) {
  if (op) outcome_hold(&op->outcome, b);
}

/* Count a buffer that finished into the operation's figures. */
static void count(struct op *op, const struct buffer *b) {
  if (!op) return;
  outcome_count(&op->outcome, b);
  if (b->device < op->ndev) {
    op->dev[b->device].released += b->size;
    op->dev[b->device].nbuf++;
  }
}

/* Remember b, released with its backup in host memory, for the pause's
 * disk step; a straggler's (no operation) keeps it in host memory. */
static void note_disk(struct op *op, const struct buffer *b) {
  unsigned long long id = (unsigned long long)b->id;
  if (!op) {
    log_warn("buffer %llu: paused by a late ack, its backup stays in host memory (a pause "
             "writes backups to disk only for the owners that answered it)", id);
    return;
  }
  if (op->ndisk == op->capdisk) {
    size_t cap = op->capdisk ? op->capdisk * 2 : 16;
    uint64_t *ids = realloc(op->disk_ids, cap * sizeof *ids);
    if (!ids) {
      fail(op, GPUMEM__WIRE__ERROR_CODE__INTERNAL,
           "out of host memory: the backup of buffer %llu stays in host memory", id);
      return;
    }
    op->disk_ids = ids;
    op->capdisk = cap;
  }
  op->disk_ids[op->ndisk++] = b->id;
}

/* A PAUSED buffer that still has memory: back it up (unless its owner
 * did: copied_us since the Unmap went out, else 0) and release it, unless
 * its owner still maps it or its backup fails (then it keeps its memory,
 * is counted as held, and the operation fails). */
static void release(engine *e, struct op *op, struct buffer *b, bool still_held,
                    uint64_t copied_us) {
  unsigned long long id = (unsigned long long)b->id;
  if (still_held) {
    int pid = (int)registry_holder_pid(b);
    const char *said = b->owner->keeper ? "let go of" : "acknowledged the unmap of";
    log_error("pid %d %s buffer %llu but still maps it", pid, said, id);
    hold(op, b);
    fail(op, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED, "pid %d %s buffer %llu but still maps it",
         pid, said, id);
    return;
  }
  uint64_t copied = 0;
  if (copied_us) {
    registry_backup_copied(e->reg, b, copied_us);
    copied = b->size;
    if (op) op->outcome.backup_bytes += b->size;
  } else if ((b->flags & BUF_FLAG_BACKUP) && !b->backup_valid) {
    struct fault f = {0};
    if (registry_backup(e->reg, b, &f)) {
      log_error("pause: %s; buffer %llu keeps its memory", f.text, id);
      hold(op, b);
      fail(op, f.code, "%s; buffer %llu keeps its memory", f.text, id);
      return;
    }
    copied = b->size;
    if (op) op->outcome.backup_bytes += b->size;
  }
  registry_memory_release(e->reg, b);
  /* Counted as it happens, also for a straggler's late ack (no op). */
  stats_bytes(e->stats, false, b->size);
  if (op) stats_op_progress(op->rec, b->size, copied);
  count(op, b);
  if (b->flags & BUF_FLAG_BACKUP_DISK) note_disk(op, b);
}

/* The group's i-th buffer, which its owner's answer is about, while it is
 * still in state (NULL when it is gone or has moved on). One that the
 * owner could not unmap (g->failed[i]) is ACTIVE again and held. */
static struct buffer *answered(engine *e, struct group *g, size_t i, buffer_state state) {
  struct buffer *b = registry_find(e->reg, g->ids[i]);
  if (!b || b->state != state) return NULL;
  if (g->failed[i]) {
    registry_move(e->reg, b, BUF_EV_UNMAP_FAILED);
    hold(g->op, b);
  }
  return b;
}

/* The group's i-th buffer, if its owner says it unmapped it and it is PAUSING. */
static struct buffer *said_unmapped(engine *e, struct group *g, size_t i) {
  struct buffer *b = registry_find(e->reg, g->ids[i]);
  return b && b->state == BUF_PAUSING && !g->failed[i] ? b : NULL;
}

/* The processes with an Unmap of the operation not yet acked in full
 * (pid -> non-NULL); NULL when there is none or no room to say. */
static idmap *pids_unacked(struct op *op) {
  idmap *m = NULL;
  struct list *p, *t;
  list_for_each_safe(p, t, &op->groups) {
    struct group *g = list_entry(p, struct group, link);
    if (g->kind != GROUP_UNMAP || g->done || g->acked >= g->nevents || g->s->keeper) continue;
    if (!m && !(m = idmap_create())) return NULL;
    if (idmap_put(m, g->s->pid, g) < 0) {
      idmap_destroy(m);
      return NULL;
    }
  }
  return m;
}

/* Whether the daemon copies a backup of the group's buffers once they
 * are unmapped (their owner copies none of them itself). */
static bool copies_here(engine *e, const struct group *g) {
  for (size_t i = 0; i < g->nids; i++) {
    const struct buffer *b = said_unmapped(e, (struct group *)g, i);
    if (b && (b->flags & BUF_FLAG_BACKUP) && !b->backup_valid && !group_owner_copies(g, i))
      return true;
  }
  return false;
}

/* Whether an acked group waits for its process's other Unmaps in the
 * operation (unacked: pids_unacked's), so that the process is read once;
 * one whose backups the daemon copies does not wait (the copies start at
 * once, while the others are still unmapping). */
static bool settles_later(engine *e, const idmap *unacked, const struct group *g) {
  return unacked && g->op && idmap_get(unacked, g->s->pid) && !copies_here(e, g);
}

/* Settle the Unmap acks read since the last settling, in the order they
 * came: what an owner unmapped is released, what it could not unmap is
 * ACTIVE again. Whether each owner's process still holds what it says it
 * unmapped is asked with one look at each process for all of its buffers;
 * unless all is set (a timeout, or a request about to look at them), an
 * operation's acks from a process wait until all of that process's are in,
 * so that it is read once per operation (a process holding a thousand
 * sessions, not once per turn of their acks). Out of host memory for that,
 * unmapped buffers are PAUSED and keep their memory, counted as held (a
 * later pause releases them). */
static void settle_unmapped(engine *e, bool all) {
  size_t total = 0, n = 0;
  struct list *p, *t;
  idmap *unacked = !all && e->current ? pids_unacked(e->current) : NULL;
  list_for_each_safe(p, t, &e->unmapped) total += list_entry(p, struct group, unmapped)->nids;
  struct buffer **bufs = calloc(total + 1, sizeof *bufs);
  bool *held = calloc(total + 1, sizeof *held);
  list_for_each_safe(p, t, &e->unmapped) {
    struct group *g = list_entry(p, struct group, unmapped);
    g->later = settles_later(e, unacked, g);
    for (size_t i = 0; bufs && !g->later && i < g->nids; i++)
      if ((bufs[n] = said_unmapped(e, g, i))) n++;
  }
  if (bufs && held) registry_held_by(e->reg, bufs, n, held);
  n = 0;
  list_for_each_safe(p, t, &e->unmapped) {
    struct group *g = list_entry(p, struct group, unmapped);
    if (g->later) continue;
    list_remove(&g->unmapped);
    if (!g->op) log_info("late ack from pid %d: its buffers are settled", (int)g->s->pid);
    for (size_t i = 0; i < g->nids; i++) {
      bool checked = said_unmapped(e, g, i) != NULL;
      struct buffer *b = answered(e, g, i, BUF_PAUSING);
      if (!b) continue;
      if (g->failed[i]) {
        registry_backup_unhanded(b);
        fail(g->op, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED,
             "pid %d could not unmap buffer %llu: %s", (int)g->s->pid, (unsigned long long)b->id,
             g->why);
        continue;
      }
      registry_move(e->reg, b, BUF_EV_UNMAPPED);
      if (bufs && held && checked)
        release(e, g->op, b, held[n++],
                group_owner_copies(g, i) ? group_copy_us(g, b->size) : 0);
      else
        hold(g->op, b);
    }
    if (!bufs || !held)
      fail(g->op, GPUMEM__WIRE__ERROR_CODE__INTERNAL,
           "out of host memory; buffers keep their memory");
    if (g->op) {
      g->done = true;
      g->op->pending--;
    } else {
      group_free(g, e->events);
    }
  }
  free(bufs);
  free(held);
  idmap_destroy(unacked);
  if (!e->current) registry_let_go(e->reg, false); /* late acks' copies: no context after */
}

/* The turn's end (or the loop about to wait while acks wait): settle
 * them, then see if the operation is done. */
static void on_check(uv_check_t *h) {
  engine *e = h->data;
  uv_check_stop(&e->check);
  uv_idle_stop(&e->idle);
  settle_unmapped(e, false);
  check_done(e);
}
static void on_idle(uv_idle_t *h) { on_check(&((engine *)h->data)->check); }

/* Settle the acks waiting at this turn's end. */
static void settle_soon(engine *e) {
  uv_check_start(&e->check, on_check);
  uv_idle_start(&e->idle, on_idle);
}

/* Settle the acks read so far, before anything looks at their buffers. */
void engine_settle(engine *e) {
  if (e && !list_empty(&e->unmapped)) settle_unmapped(e, true);
}

/* A buffer a failed resume had mapped is unmapped again: release what the
 * resume made, and it is PAUSED as before. */
static void undo_resume(engine *e, struct buffer *b, bool made) {
  if (made) registry_memory_release(e->reg, b);
  registry_move(e->reg, b, BUF_EV_ROLL_BACK);
}

/* An owner answered a rollback Unmap. */
static void finish_rollback(engine *e, struct group *g) {
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = answered(e, g, i, BUF_RESUMING);
    if (!b) continue;
    if (g->failed[i]) {
      /* The owner keeps it mapped: it is in use, whatever the resume said. */
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

/* The operation's group of owner o's buffers (by_owner: the groups by
 * owner id), made and waited for if new; NULL when out of memory. */
static struct group *group_of(struct op *op, idmap *by_owner, struct owner *o,
                              enum group_kind kind) {
  struct group *g = idmap_get(by_owner, o->id);
  if (g) return g;
  if (!(g = group_new(op, o, kind))) return NULL;
  if (idmap_put(by_owner, o->id, g) < 0) {
    free(g);
    return NULL;
  }
  list_append(&op->groups, &g->link);
  op->pending++;
  return g;
}

/* Send a group its Unmap event (one for all its buffers), a pause's with
 * the backup memory its owner copies into. */
static void send_unmap(engine *e, struct group *g) {
  if (!(g->ends = calloc(1, sizeof *g->ends))) return;
  g->ends[0] = g->nids;
  if (g->kind == GROUP_UNMAP) group_hand_backups(g, e->reg);
  group_number(g, e->events, &e->next_event, 1);
  g->sent_ns = uv_hrtime();
  event_send_unmap(e->out, g);
}

/* Send one owner its Remap events with the fds exported for them. Returns
 * -1 if the session ended (g is gone). */
static int send_remap(engine *e, struct group *g) {
  size_t nevents = event_remap_count(e->reg, g);
  if (!(g->ends = calloc(nevents + 1, sizeof *g->ends))) return 0;
  group_number(g, e->events, &e->next_event, nevents);
  g->sent_ns = uv_hrtime();
  return event_send_remap(e->out, e->reg, g);
}

/* True if the operation covers every session (no scope). */
static bool unscoped(const struct op *op) { return scope_is_all(&op->scope); }

/* A buffer that an earlier operation still waits on: it holds its memory
 * until its owner's late ack. */
static void held_in_transit(struct op *op, const struct buffer *b) {
  hold(op, b);
  op->dev[b->device].touched = true;
}

/* Whether a pause would take b from ACTIVE (start_pause's choice). */
static bool pauses(const struct op *op, const struct buffer *b) {
  return scope_covers(&op->scope, b) && !(b->flags & BUF_FLAG_IPC_LEGACY) &&
         b->state == BUF_ACTIVE;
}

/* Call fn on every buffer the pause would take from ACTIVE, until it
 * returns false; false then. */
static bool each_pausing(engine *e, struct op *op, bool (*fn)(engine *, struct buffer *, void *),
                         void *arg) {
  for (size_t t = 0; t < op->scope.ntags; t++) {
    struct tag *tag = registry_tag(e->reg, op->scope.tags[t]);
    struct list *p;
    for (p = tag ? tag->buffers.next : NULL; tag && p != &tag->buffers; p = p->next) {
      struct buffer *b = list_entry(p, struct buffer, tag_link);
      if (pauses(op, b) && !fn(e, b, arg)) return false;
    }
  }
  return true;
}

/* Reserve the backup room of b, if it lets go (each_pausing). */
static bool reserve_one(engine *e, struct buffer *b, void *arg) {
  return !(b->flags & BUF_FLAG_BACKUP_RELEASE) || !registry_backup_reserve(e->reg, b, arg);
}

/* Give back what reserve_one took (each_pausing). */
static bool unreserve_one(engine *e, struct buffer *b, void *arg) {
  (void)arg;
  registry_backup_unreserve(e->reg, b);
  return true;
}

/* Add up the backups the pause will write to disk (each_pausing). */
static bool disk_need(engine *e, struct buffer *b, void *arg) {
  (void)e;
  if (b->flags & BUF_FLAG_BACKUP_DISK) *(uint64_t *)arg += b->size;
  return true;
}

/* Whether the backup directory takes what the pause will write: else the
 * pause fails before it changes anything. */
static bool disk_fits(engine *e, struct op *op) {
  uint64_t need = 0;
  each_pausing(e, op, disk_need, &need);
  if (!need) return true;
  char why[512];
  if (!e->cfg->backup_disk)
    snprintf(why, sizeof why, "this gpumemd has no --backup-dir");
  else if (backup_disk_check(e->cfg->backup_disk, need, why, sizeof why) == 0)
    return true;
  fail(op, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
       "the pause's disk backups (%llu bytes) cannot be written: %s: nothing was paused",
       (unsigned long long)need, why);
  return false;
}

/* Add up the pageable backups the pause will make (each_pausing). */
static bool pageable_need(engine *e, struct buffer *b, void *arg) {
  (void)e;
  if ((b->flags & BUF_FLAG_BACKUP) && b->pageable && !b->backup) *(uint64_t *)arg += b->size;
  return true;
}

/* Before a pause unmaps anything: reserve the backups its BACKUP_RELEASE
 * buffers will make (bytes against --backup-limit, descriptors where the
 * backend's backups are ones), and see that the kernel has room for the
 * pageable ones, or fail the pause, changing nothing. */
static bool backups_fit(engine *e, struct op *op) {
  struct fault f = {0};
  uint64_t need = 0, room = 0;
  if (each_pausing(e, op, reserve_one, &f)) {
    each_pausing(e, op, pageable_need, &need);
    if (!need || need <= (room = pageable_room(NULL, NULL))) return true;
    fault_set(&f, GPUMEM__WIRE__ERROR_CODE__OUT_OF_MEMORY,
              "%llu bytes of pageable backups, and the kernel says %llu bytes are available "
              "(MemAvailable, the memory cgroups' headroom)",
              (unsigned long long)need, (unsigned long long)room);
  }
  each_pausing(e, op, unreserve_one, NULL);
  uint64_t reserved = 0, limit = 0;
  registry_backup_budget(e->reg, &reserved, &limit);
  fail(op, f.code,
       "the pause's backups do not fit (%s); --backup-limit %llu has %llu left (%llu "
       "reserved): nothing was paused; raise the limit, or free or resume backed-up buffers",
       f.text, (unsigned long long)limit, (unsigned long long)(limit - reserved),
       (unsigned long long)reserved);
  return false;
}

/* Phase one of a pause: mark buffers and ask their owners to unmap. */
static void start_pause(engine *e, struct op *op) {
  if (!scope_resolve(&op->scope, e->reg, e->owners, e->grace, &op->outcome)) return;
  if (!disk_fits(e, op) || !backups_fit(e, op)) return;
  devcheck_before(e->reg, e->gpu, op->scope.devmask, op->dev, op->ndev);
  idmap *by_session = idmap_create();
  for (size_t t = 0; t < op->scope.ntags && by_session; t++) {
    struct tag *tag = registry_tag(e->reg, op->scope.tags[t]);
    if (unscoped(op)) registry_mark_paused(e->reg, tag, op->scope.devmask, true);
    struct list *p, *n;
    list_for_each_safe(p, n, &tag->buffers) {
      struct buffer *b = list_entry(p, struct buffer, tag_link);
      if (!scope_covers(&op->scope, b)) continue;
      if (b->flags & BUF_FLAG_IPC_LEGACY) {
        op->outcome.skipped++;
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
          registry_held_by(e->reg, &b, 1, &held);
          release(e, op, b, held, 0);
        }
        continue;
      }
      struct group *g = group_of(op, by_session, b->owner, GROUP_UNMAP);
      if (!g || group_add(g, b->id, false) < 0) {
        registry_backup_unreserve(e->reg, b); /* backups_fit reserved it */
        fail(op, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
        continue;
      }
      stats_op_cover(op->rec, b->size);
      registry_move(e->reg, b, BUF_EV_PAUSE);
    }
  }
  if (!by_session) {
    each_pausing(e, op, unreserve_one, NULL); /* backups_fit's reservations */
    fail(op, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  }
  idmap_destroy(by_session);
  if (op->outcome.held_buffers && !op->outcome.fault.code)
    outcome_fail_in_transit(&op->outcome, "pause");
  struct list *p, *n;
  list_for_each_safe(p, n, &op->groups) send_unmap(e, list_entry(p, struct group, link));
}

/* Collect the PAUSED buffers a resume selects; false (with the failure
 * recorded) if any is still in an earlier operation's transition. */
static bool collect_paused(engine *e, struct op *op, struct buffer ***out, size_t *n) {
  size_t cap = 0;
  for (size_t t = 0; t < op->scope.ntags; t++) {
    struct tag *tag = registry_tag(e->reg, op->scope.tags[t]);
    if (!tag) continue; /* gone with its last buffer since the scope was resolved */
    struct list *p;
    for (p = tag->buffers.next; p != &tag->buffers; p = p->next) {
      struct buffer *b = list_entry(p, struct buffer, tag_link);
      if (!scope_covers(&op->scope, b)) continue;
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
  if (op->outcome.held_buffers) {
    outcome_fail_in_transit(&op->outcome, "resume refused, nothing changed");
    return false;
  }
  return true;
}

/* A resume's last step before its owners: with no failure f, send each
 * group its remaps; else (nothing was sent) free the groups, put the
 * buffers back to PAUSED and release the memory it made. */
static void remap_or_undo(engine *e, struct op *op, struct buffer **bufs, const bool *made,
                          size_t n, const struct fault *f) {
  struct list *p, *x;
  if (!f->code) {
    registry_new_generation(e->reg, bufs, n);
    list_for_each_safe(p, x, &op->groups) send_remap(e, list_entry(p, struct group, link));
    return;
  }
  list_for_each_safe(p, x, &op->groups) group_free(list_entry(p, struct group, link), e->events);
  op->pending = 0;
  for (size_t i = 0; i < n; i++)
    if (bufs[i]->state == BUF_RESUMING) registry_move(e->reg, bufs[i], BUF_EV_ROLL_BACK);
  resume_memory_undo(e->reg, bufs, made, n);
  op->outcome.backup_bytes = 0;
  fail(op, f->code, "%s; nothing resumed", f->text);
}

static void on_restored(void *arg);
static void on_timeout(uv_timer_t *t);

/* Start the operation's timer: its owners have timeout_ms from now. */
static void timer_start(engine *e, struct op *op) {
  e->timer_gen++;
  uv_timer_start(&e->timer, on_timeout, op->timeout_ms, 0);
}

/* Stop the timer (and any timeout not judged yet). */
static void timer_stop(engine *e) {
  e->timer_gen++;
  uv_timer_stop(&e->timer);
}

static void resume_collected(engine *e, struct op *op);
static void first_phase(engine *e, struct op *op);

/* The resume's disk reads ended: every backup is in host memory again,
 * and the resume goes on; or none is (the failure recorded), and it ends
 * with nothing resumed. */
static void on_disk_read(void *arg, struct spill_item *items, size_t n, bool ok) {
  engine *e = arg;
  struct op *op = e->current;
  const struct spill_item *bad = NULL;
  for (size_t i = 0; i < n; i++) {
    struct spill_item *it = &items[i];
    if (it->io.rc && !bad) bad = it;
    close(it->io.fd);
    if (ok && registry_disk_loaded(e->reg, it->id, it->io.host, it->io.size, it->dev,
                                   it->pageable))
      note_disk(op, registry_find(e->reg, it->id)); /* let go of again if it fails */
    else if (!ok && registry_find(e->reg, it->id)) /* the read made nothing left */
      registry_backup_unreserve(e->reg, registry_find(e->reg, it->id));
  }
  log_info("resume: %zu backups read back from %s in %.3f s%s", n,
           backup_disk_path(e->cfg->backup_disk), (double)(uv_hrtime() - op->t_disk) / 1e9,
           ok ? "" : " (failed)");
  if (!ok)
    fail(op, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
         "the backup of buffer %llu could not be read back from %s (%s); nothing resumed",
         bad ? (unsigned long long)bad->id : 0ull, backup_disk_path(e->cfg->backup_disk),
         bad ? bad->io.why : "out of host memory");
  free(items);
  op->spill = NULL;
  op->disk = DISK_DONE;
  if (e->stopping) return;
  if (ok) first_phase(e, op); /* the rest of the resume */
  else check_done(e);
}

/* Before a resume hands anything out: read back the backups that are only
 * on disk, into host memory reserved and made for them. True when the
 * resume waits for that (or failed doing it, the failure recorded, with
 * nothing changed); false when no backup is on disk. */
static bool start_disk_reads(engine *e, struct op *op, struct buffer **bufs, size_t n) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++) k += registry_on_disk(bufs[i]);
  if (!k) return false;
  op->disk = DISK_DONE;
  struct spill_item *items = calloc(k + 1, sizeof *items);
  struct fault f = {0};
  size_t m = 0;
  if (!items) fault_set(&f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  for (size_t i = 0; !f.code && i < n; i++) {
    struct buffer *b = bufs[i];
    if (!registry_on_disk(b) || registry_backup_reserve(e->reg, b, &f)) continue;
    /* The read's own descriptor: the buffer may be freed (its file
     * closed, the number reused) while the thread reads. */
    int fd = fcntl(b->disk_fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) {
      registry_backup_unreserve(e->reg, b);
      fault_set(&f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "no descriptor to read buffer %llu's "
                "backup with: %s", (unsigned long long)b->id, strerror(errno));
      break;
    }
    items[m++] = (struct spill_item){.id = b->id, .dev = b->device, .pageable = b->pageable,
                                     .io = {.size = b->size, .fd = fd}};
  }
  char why[256] = "";
  if (!f.code && !(op->spill = spill_start(e->loop, e->cfg->backup_disk, e->gpu, items, m, true,
                                           on_disk_read, e, why, sizeof why)))
    fault_set(&f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "%s", why);
  if (!f.code) {
    op->disk = DISK_RUNNING;
    op->t_disk = uv_hrtime();
    return true;
  }
  for (size_t i = 0; i < m; i++) {
    struct buffer *b = registry_find(e->reg, items[i].id);
    if (b) registry_backup_unreserve(e->reg, b);
    close(items[i].io.fd);
  }
  free(items);
  fail(op, f.code, "%s; nothing resumed", f.text);
  return true;
}

/* Resume: memory, contents and fds for every selected buffer, or none;
 * backups on disk are read back first. */
static void start_resume(engine *e, struct op *op) {
  size_t n = 0;
  struct buffer **bufs = NULL;
  if (!scope_resolve(&op->scope, e->reg, e->owners, e->grace, &op->outcome)) return;
  if (collect_paused(e, op, &bufs, &n) && !start_disk_reads(e, op, bufs, n))
    resume_collected(e, op);
  free(bufs);
}

/* How long a resume waiting for room waits before it tries again: a
 * tenth of what it waited so far, 5 to 200 ms. */
static uint64_t wait_step_ms(const struct op *op) {
  uint64_t step = (uv_hrtime() - op->wait_t0) / 10000000;
  return step < 5 ? 5 : step > 200 ? 200 : step;
}

static void on_wait(uv_timer_t *t);

/* Look again for room after the next step, or when the wait runs out
 * (waited so far). */
static void wait_again(engine *e, struct op *op, uint64_t waited) {
  uint64_t left_ms = (op->wait_ns - waited + 999999) / 1000000, step = wait_step_ms(op);
  uv_timer_start(&e->wait_timer, on_wait, step < left_ms ? step : left_ms, 0);
}

/* The resume's memory could not be made: where it lacked room and may
 * wait, wait (its failure forgotten for now) and try again later; else
 * the failure stands, saying how long it waited. */
static void wait_for_room(engine *e, struct op *op) {
  struct fault *f = &op->outcome.fault;
  uint64_t now = uv_hrtime();
  if (op->wait_ns && !op->wait_t0) op->wait_t0 = now;
  bool room = f->code == GPUMEM__WIRE__ERROR_CODE__OUT_OF_MEMORY;
  uint64_t waited = op->wait_t0 ? now - op->wait_t0 : 0;
  if (op->wait_t0) op->outcome.waited_us = waited / 1000;
  if (room && op->ctl && waited < op->wait_ns) {
    if (!op->waiting)
      log_info("resume: %s; waiting up to %llu ms for room", f->text,
               (unsigned long long)((op->wait_ns - waited) / 1000000));
    op->waiting = true;
    op->wait_dev = f->device;
    op->wait_need = f->bytes_needed;
    memset(f, 0, sizeof *f);
    wait_again(e, op, waited);
    return;
  }
  op->waiting = false;
  if (room && op->wait_t0) {
    size_t len = strlen(f->text);
    snprintf(f->text + len, sizeof f->text - len, " (after waiting %llu ms for room%s)",
             (unsigned long long)(waited / 1000000), op->ctl ? "" : "; its requester went away");
  }
}

/* A resume waiting for room tries again, where the device it lacked shows
 * the room now (or the wait is over, or its requester gone). */
static void on_wait(uv_timer_t *t) {
  engine *e = t->data;
  struct op *op = e->current;
  if (!op || !op->waiting) return;
  uint64_t waited = uv_hrtime() - op->wait_t0;
  struct gpudev_mem m = {0};
  bool room = gpudev_mem_detail(e->gpu, op->wait_dev, &m) < 0 || m.free >= op->wait_need;
  if (!room && op->ctl && waited < op->wait_ns) {
    wait_again(e, op, waited);
    return;
  }
  op->waiting = false;
  if (!room) { /* the wait is over, or nobody waits for the answer */
    resume_memory_short(&op->outcome.fault, e->gpu, op->wait_dev, op->wait_need);
    wait_for_room(e, op);
    check_done(e);
    return;
  }
  first_phase(e, op);
}

/* The resume's buffers, found again (a session may have ended while
 * their backups were read back, or while it waited for room), each with
 * its backup in host memory. */
static void resume_collected(engine *e, struct op *op) {
  size_t n = 0;
  struct buffer **bufs = NULL;
  bool *made = NULL;
  idmap *by_session = NULL;
  if (!collect_paused(e, op, &bufs, &n)) goto out;
  for (size_t i = 0; i < n && !op->covered; i++) stats_op_cover(op->rec, bufs[i]->size);
  op->covered = true;
  devcheck_before(e->reg, e->gpu, op->scope.devmask, op->dev, op->ndev);
  if (!(made = calloc(n + 1, sizeof *made)) || !(by_session = idmap_create())) {
    fail(op, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    goto out;
  }
  if (!resume_memory_make(e->reg, e->gpu, bufs, made, n, &op->outcome.fault)) {
    wait_for_room(e, op);
    goto out;
  }
  if (op->wait_t0) op->outcome.waited_us = (uv_hrtime() - op->wait_t0) / 1000;
  struct fault f = {0};
  for (size_t i = 0; i < n && !f.code; i++) {
    op->dev[bufs[i]->device].touched = true;
    if (!bufs[i]->backup_valid) continue;
    /* Where the owner copies it in, group_export hands it the backup. */
    if (registry_owner_copies(e->reg, bufs[i], true) || !registry_restore(e->reg, bufs[i], &f)) {
      op->outcome.backup_bytes += bufs[i]->size;
      stats_op_progress(op->rec, 0, bufs[i]->size);
    }
  }
  for (size_t i = 0; i < n && !f.code; i++) {
    struct group *g = group_of(op, by_session, bufs[i]->owner, GROUP_REMAP);
    if (!g || group_add(g, bufs[i]->id, made[i]) < 0)
      fault_set(&f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  }
  struct list *p, *x;
  list_for_each_safe(p, x, &op->groups) {
    if (f.code) break;
    group_export(list_entry(p, struct group, link), e->reg, &f);
  }
  /* RESUMING from here: no owner frees them while its restores run. */
  for (size_t i = 0; i < n && !f.code; i++) registry_move(e->reg, bufs[i], BUF_EV_RESUME);
  if (!f.code && (!(op->restore_ids = calloc(n + 1, sizeof *op->restore_ids)) ||
                  !(op->restore_bufs = calloc(n + 1, sizeof *op->restore_bufs))))
    fault_set(&f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  if (!f.code && ctxrelease_resume(e->ctx, &op->groups, &op->outcome, &f, &op->restore_fault,
                                   on_restored, e)) { /* the remaps wait for the restores */
    if (f.code) op->restore_fault = f;
    for (size_t i = 0; i < n; i++) op->restore_ids[i] = bufs[i]->id;
    op->restore_made = made;
    op->nrestore = n;
    op->restoring = true;
    made = NULL;
    goto out;
  }
  remap_or_undo(e, op, bufs, made, n, &f);
out:
  idmap_destroy(by_session);
  free(bufs);
  free(made);
}

/* The resume's restores have ended: remap, or undo on their failure, the
 * buffers still there. */
static void on_restored(void *arg) {
  engine *e = arg;
  struct op *op = e->current;
  struct buffer **bufs = op->restore_bufs;
  size_t n = 0;
  op->restoring = false;
  for (size_t i = 0; i < op->nrestore; i++) {
    struct buffer *b = registry_find(e->reg, op->restore_ids[i]);
    if (!b) continue; /* its session ended meanwhile: freed with it */
    op->restore_made[n] = op->restore_made[i];
    bufs[n++] = b;
  }
  e->busy = true; /* nothing finishes the operation under the sends */
  remap_or_undo(e, op, bufs, op->restore_made, n, &op->restore_fault);
  e->busy = false;
  op->t_sent = uv_hrtime();
  uv_update_time(e->loop);
  if (op->pending) timer_start(e, op);
  check_done(e);
}

/* A resume that every owner acknowledged: its buffers are ACTIVE and its
 * tags no longer fully paused on its devices (until then, and after a
 * resume that failed, new buffers there still start paused). A scoped
 * resume ends that only where it made a buffer ACTIVE. */
static void commit_resume(engine *e, struct op *op) {
  for (size_t t = 0; unscoped(op) && t < op->scope.ntags; t++) {
    struct tag *tag = registry_tag(e->reg, op->scope.tags[t]);
    if (tag) registry_mark_paused(e->reg, tag, op->scope.devmask, false);
  }
  struct list *p;
  for (p = op->groups.next; p != &op->groups; p = p->next) {
    struct group *g = list_entry(p, struct group, link);
    for (size_t i = 0; i < g->nids; i++) {
      struct buffer *b = registry_find(e->reg, g->ids[i]);
      if (!b || b->state != BUF_RESUMING) continue;
      /* Counted before the move: an ACTIVE BACKUP_RELEASE buffer lets go. */
      if (group_owner_copies(g, i)) registry_restore_copied(e->reg, b, group_copy_us(g, b->size));
      registry_move(e->reg, b, BUF_EV_COMMIT);
      stats_bytes(e->stats, true, b->size);
      count(op, b);
    }
  }
  /* A tag left with no buffers and paused nowhere is forgotten: its name
   * is free again, for any uid. */
  for (size_t t = 0; t < op->scope.ntags; t++) {
    struct tag *tag = registry_tag(e->reg, op->scope.tags[t]);
    if (tag) registry_prune(e->reg, tag);
  }
}

/* Undo a remap group whose owner answered: buffers it could not map are
 * PAUSED again at once; those it mapped go into a rollback Unmap. Returns
 * the rollback group (already sent), or NULL if none was needed. */
static struct group *roll_back(engine *e, struct op *op, struct group *g) {
  struct group *rb = group_new(op, g->s, GROUP_ROLLBACK);
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = registry_find(e->reg, g->ids[i]);
    if (!b || b->state != BUF_RESUMING) continue;
    if (g->failed[i]) registry_backup_unhanded(b);
    if (g->failed[i] || !rb || group_add(rb, b->id, g->made[i]) < 0) undo_resume(e, b, g->made[i]);
  }
  if (!rb || rb->nids == 0) {
    if (rb) group_free(rb, e->events);
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
    if (g->kind == GROUP_REMAP && roll_back(e, op, g)) op->pending++;
  }
  return op->pending > 0;
}

/* Answer the controller (if still there) with the figures or the fault,
 * and count the operation as it ended. */
static void reply(engine *e, struct op *op) {
  registry_let_go(e->reg, op->release_context); /* before the driver's figures */
  uint64_t now = uv_hrtime(), us = (now - op->t0) / 1000;
  Gpumem__Wire__DeviceCheck *checks = calloc(op->ndev + 1, sizeof *checks);
  Gpumem__Wire__DeviceCheck **checkp = calloc(op->ndev + 1, sizeof *checkp);
  uint32_t listed[8];
  struct devcheck_rules rules = {.resume = op->resume, .max_residual = op->max_residual,
                                 .by_controller = op->by_controller, .exit_listed = listed,
                                 .checked_ns = now};
  op->outcome.checked_ns = now; /* the reply's processes: the same reading */
  rules.exit_nlisted = exitwait_result(e->exits, &rules.exit_wait_ms, listed, 8);
  size_t nchecks =
      checks && checkp ? devcheck_after(e->reg, e->gpu, op->dev, op->ndev, &rules, &op->outcome,
                                        checks)
                       : 0;
  outcome_fail_releases(&op->outcome); /* after the driver's figures, which come first */
  stats_op_end(e->stats, op->rec, op->outcome.fault.code, op->outcome.bytes,
               op->outcome.backup_bytes, us);
  op->rec = NULL;
  if (op->ctl) stats_error(e->stats, op->outcome.fault.code);
  for (size_t i = 0; i < nchecks; i++) checkp[i] = &checks[i];
  if (!op->resume) devcheck_keep(&e->last, checks, nchecks);
  uint64_t copy_us = outcome_copies(e->reg, op->resume, op->copied0, op->copy_us0);
  outcome_log(&op->outcome, op->resume ? "resume" : "pause",
              op->scope.all_tags ? "every tag" : op->scope.tags[0],
              op->scope.all_tags ? 1 : op->scope.ntags, us,
              (op->t_sent - op->t0) / 1000, (now - op->t_sent) / 1000);
  registry_journal_flush(e->reg); /* what the reply says happened is journaled */
  if (op->ctl)
    outcome_reply(&op->outcome, op->req_id, us, copy_us, checkp, nchecks, e->reg, e->gpu, e->out,
                  op->ctl, op->resume ? NULL : e->owners);
  free(checks);
  free(checkp);
}

/* Whether a session of pid is still open. */
/* The pause's disk writes ended: each backup is in its file now, or (its
 * write failed, the failure recorded) still in host memory. */
static void on_disk_written(void *arg, struct spill_item *items, size_t n, bool ok) {
  engine *e = arg;
  struct op *op = e->current;
  uint64_t bytes = 0;
  (void)ok;
  for (size_t i = 0; i < n; i++) {
    struct spill_item *it = &items[i];
    if (registry_disk_written(e->reg, it->id, it->io.host, it->io.size, it->dev, it->pageable,
                              it->io.fd))
      bytes += it->io.size;
    else if (it->io.rc)
      fail(op, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
           "the backup of buffer %llu was not written to %s (%s); it stays in host memory",
           (unsigned long long)it->id, backup_disk_path(e->cfg->backup_disk), it->io.why);
  }
  double s_ = (double)(uv_hrtime() - op->t_disk) / 1e9;
  log_info("pause: %llu bytes of backups written to %s in %.3f s (%.2f GiB/s, %s)",
           (unsigned long long)bytes, backup_disk_path(e->cfg->backup_disk), s_,
           s_ > 0 ? (double)bytes / s_ / (1 << 30) : 0.0, backup_disk_engine(e->cfg->backup_disk));
  free(items);
  op->spill = NULL;
  op->disk = DISK_DONE;
  if (!e->stopping) check_done(e);
}

/* Start the pause's disk writes: true while they run (check_done waits),
 * false when there was nothing to write or they could not start (the
 * backups stay in host memory, the failure recorded). */
static bool start_disk_writes(engine *e, struct op *op) {
  op->disk = DISK_DONE;
  struct spill_item *items = calloc(op->ndisk + 1, sizeof *items);
  size_t n = 0;
  for (size_t i = 0; items && i < op->ndisk; i++) {
    struct buffer *b = registry_find(e->reg, op->disk_ids[i]);
    if (!b || b->state != BUF_PAUSED || !b->backup_valid || !b->backup || b->spilling ||
        b->disk_fd >= 0)
      continue;
    items[n++] = (struct spill_item){.id = b->id, .dev = b->device, .pageable = b->pageable,
                                     .io = {.size = b->size, .fd = -1}};
    items[n - 1].io.host = registry_disk_take(e->reg, b);
  }
  char why[256] = "out of host memory";
  spill *sp = n && e->cfg->backup_disk
                  ? spill_start(e->loop, e->cfg->backup_disk, e->gpu, items, n, false,
                                on_disk_written, e, why, sizeof why)
                  : NULL;
  if (sp) {
    op->spill = sp;
    op->disk = DISK_RUNNING;
    op->t_disk = uv_hrtime();
    return true;
  }
  for (size_t i = 0; i < n; i++)
    registry_disk_written(e->reg, items[i].id, items[i].io.host, items[i].io.size, items[i].dev,
                          items[i].pageable, -1);
  if (n || !items)
    fail(op, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "%s: backups stay in host memory", why);
  free(items);
  return false;
}

static bool has_session(void *arg, int pid) {
  engine *e = arg;
  for (struct list *p = e->owners->next; p != e->owners; p = p->next)
    if (list_entry(p, struct owner, link)->pid == pid) return true;
  return false;
}

/* The pause's releases have ended: go on to its exit wait. */
static void on_released(void *arg) {
  engine *e = arg;
  e->current->exits = EXITS_RELEASED;
  check_done(e);
}

/* The pause's owners that ended have left the driver, or it waited long
 * enough: judge it now. */
static void on_exits_gone(void *arg) {
  engine *e = arg;
  e->current->exits = EXITS_DONE;
  check_done(e);
}

/* A resume is over: the backups it read back from disk for buffers that
 * are still PAUSED (it failed) go back to being only in their files. */
static void unload_disk(engine *e, struct op *op) {
  for (size_t i = 0; i < op->ndisk; i++) {
    struct buffer *b = registry_find(e->reg, op->disk_ids[i]);
    if (b && b->state == BUF_PAUSED) registry_disk_unload(e->reg, b);
  }
}

/* Finish the current operation if nobody is left to wait for; a failed
 * resume first rolls back what owners mapped; a pause first waits for
 * its owners that ended to leave the driver (exitwait.h). */
static void check_done(engine *e) {
  struct op *op = e->current;
  if (e->busy || !op || op->restoring || op->waiting || op->pending || op->disk == DISK_RUNNING ||
      op->exits == EXITS_WAITING || op->exits == EXITS_RELEASING)
    return;
  if (op->resume && !op->rolling_back) {
    if (op->outcome.fault.code) {
      if (start_rollback(e, op)) {
        timer_stop(e);
        run_queue(e); /* restarts the timer for the rollback */
        return;
      }
    } else {
      commit_resume(e, op);
    }
  }
  timer_stop(e);
  if (!op->resume && op->disk == DISK_NONE && op->ndisk && start_disk_writes(e, op)) return;
  if (!op->resume && op->exits == EXITS_UNASKED) { /* once: its owners have answered */
    op->exits = EXITS_RELEASING;
    if (op->release_context && !op->outcome.fault.code && /* only if nothing failed */
        ctxrelease_pause(e->ctx, &op->scope, op->pid, &op->outcome, on_released, e))
      return;
    op->exits = EXITS_RELEASED;
  }
  if (!op->resume && op->exits == EXITS_RELEASED) {
    op->exits = EXITS_DONE;
    if (exitwait_start(e->exits, e->cfg->exit_wait_ms, has_session, on_exits_gone, e)) {
      op->exits = EXITS_WAITING;
      return;
    }
  }
  if (op->resume) unload_disk(e, op);
  e->current = NULL;
  reply(e, op);
  op_free(e, op);
  run_queue(e);
}

/* Owners that did not ack in time: report their pids, keep their buffers
 * in transition (held) for their late acks, and stop waiting; under the
 * kill policy, kill them or end their sessions. */
/* Nothing: an active idle handle only keeps the turn's poll from
 * blocking. */
static void on_judge_idle(uv_idle_t *h) { (void)h; }

static void judge(engine *e);

/* After the turn that found the time out: judge, unless the timer was
 * started or stopped since (the operation ended, or a rollback began). */
static void on_judge(uv_check_t *h) {
  engine *e = h->data;
  uv_check_stop(&e->judge);
  uv_idle_stop(&e->judge_idle);
  if (e->judge_gen == e->timer_gen) judge(e);
}

/* The owners' time ran out. Judge them after this turn has read what the
 * sockets hold: an ack that came while the loop was busy (the daemon
 * copying a backup, say) still counts as in time. */
static void on_timeout(uv_timer_t *t) {
  engine *e = t->data;
  e->judge_gen = e->timer_gen;
  uv_idle_start(&e->judge_idle, on_judge_idle);
  uv_check_start(&e->judge, on_judge);
}

/* Answer one event of op that the keeper (persistent buffers no session
 * holds) has not answered, as it would; false when there is none. Its
 * answers come on the loop's next turn (keeper.h), but one that could not
 * be queued (out of memory) would otherwise be waited for for ever. */
static bool answer_for_keeper(engine *e, struct op *op) {
  for (struct list *p = op->groups.next; p != &op->groups; p = p->next) {
    struct group *g = list_entry(p, struct group, link);
    if (!g->s->keeper || g->done) continue;
    for (size_t k = 0; k < g->nevents; k++) {
      uint64_t id = g->first_event + k;
      if (idmap_get(e->events, id) != g) continue;
      Gpumem__Wire__EventAck ack = GPUMEM__WIRE__EVENT_ACK__INIT;
      ack.nothing_mapped = true;
      engine_ack(e, g->s, id, &ack);
      return true;
    }
  }
  return false;
}

/* Judge the owners that did not answer the current operation in time. */
static void judge(engine *e) {
  struct op *op = e->current;
  if (!op || op->restoring) return; /* nothing sent yet: the timer starts after */
  uint64_t gen = e->timer_gen; /* bumped if those answers end it, or start a rollback */
  while (e->current == op && e->timer_gen == gen && answer_for_keeper(e, op)) {
  }
  if (e->current != op || e->timer_gen != gen) return;
  settle_unmapped(e, true); /* acks read before the judgment count as answers */
  bool kill_them = e->cfg->timeout_policy == TIMEOUT_KILL;
  struct timeout_tally tally = {0};
  struct list *p, *n;
  list_for_each_safe(p, n, &op->groups) {
    struct group *g = list_entry(p, struct group, link);
    if (g->done) continue;
    timeout_tally_group(&tally, g, e->reg, e->out, kill_them, &op->outcome);
    g->op = NULL;
    list_remove(&g->link);
    list_append(&e->stragglers, &g->link);
  }
  op->pending = 0;
  if (tally.owners) {
    timeout_fail(&op->outcome, &tally, op->timeout_ms, op->resume && !op->rolling_back);
    log_warn("%s: %zu owners did not answer in time", op->resume ? "resume" : "pause",
             tally.owners);
  }
  check_done(e);
}

/* Start queued operations until one has to wait for owners. */
static void run_queue(engine *e) {
  struct op *op = e->current;
  if (op && op->restoring) return; /* its remaps, and then its timer, come after */
  if (op && op->pending) {
    /* A rollback just started: wait for it as long again. */
    uv_update_time(e->loop);
    timer_start(e, op);
    return;
  }
  while (!e->current && !list_empty(&e->queue)) {
    op = list_entry(e->queue.next, struct op, link);
    list_remove(&op->link);
    e->current = op;
    exitwait_clear(e->exits);
    op->t0 = uv_hrtime();
    op->rec = stats_op_begin(e->stats, op->resume, op->scope.tags,
                             op->scope.all_tags ? 0 : op->scope.ntags,
                             op->pid, op->uid);
    registry_copy_totals(e->reg, !op->resume, &op->copied0, &op->copy_us0);
    first_phase(e, op);
  }
}

/* Run an operation's first phase (a resume's after its disk reads, if it
 * had any, and again after each wait for room), then start its owners'
 * clock. */
static void first_phase(engine *e, struct op *op) {
  e->busy = true;
  if (op->resume && (op->disk == DISK_DONE || op->wait_t0)) /* read back, or waited */
    resume_collected(e, op);
  else if (op->resume)
    start_resume(e, op);
  else
    start_pause(e, op);
  e->busy = false;
  op->t_sent = uv_hrtime();
  /* Owners get the whole timeout from now: restoring backups before the
   * events went out may have taken a while since the loop last looked
   * at the clock. */
  uv_update_time(e->loop);
  if (op->pending && !op->restoring) timer_start(e, op);
  check_done(e);
}

/* The driver's figures of the last pause. */
Gpumem__Wire__DeviceCheck *const *engine_last_checks(const engine *e, size_t *n) {
  *n = e->last.n;
  return e->last.ptrs;
}

/* Tell a session that its ack was wrong, without ending it. */
__attribute__((format(printf, 3, 4))) static void refuse_ack(engine *e, struct owner *s,
                                                             const char *fmt, ...) {
  struct fault f = {.code = GPUMEM__WIRE__ERROR_CODE__NOT_FOUND};
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(f.text, sizeof f.text, fmt, ap);
  va_end(ap);
  log_warn("session %llu (pid %d): %s", (unsigned long long)s->id, (int)s->pid, f.text);
  say_error(e, s, 0, &f);
}

/* A worker acknowledged an event. */
void engine_ack(engine *e, struct owner *s, uint64_t event_id,
                const Gpumem__Wire__EventAck *ack) {
  struct group *g = idmap_get(e->events, event_id);
  if (!g || g->s != s) {
    refuse_ack(e, s, "ack for event %llu, which this session has not been sent or has acked",
               (unsigned long long)event_id);
    return;
  }
  idmap_del(e->events, event_id);
  size_t k = (size_t)(event_id - g->first_event);
  size_t from = k ? g->ends[k - 1] : 0, to = g->ends[k];
  uint64_t stranger = 0;
  size_t strangers = group_note_ack(g, from, to, ack, &stranger);
  s->nothing_mapped = g->kind != GROUP_REMAP && ack->nothing_mapped;
  if (strangers) /* one error for the ack, however many ids it got wrong */
    refuse_ack(e, s, "ack of event %llu names %zu buffers the event did not carry (buffer %llu, ...)",
               (unsigned long long)event_id, strangers, (unsigned long long)stranger);
  /* A resume's progress: what the owner mapped again. */
  for (size_t i = from; g->op && g->kind == GROUP_REMAP && i < to; i++) {
    const struct buffer *b = registry_find(e->reg, g->ids[i]);
    if (b && !g->failed[i]) stats_op_progress(g->op->rec, b->size, 0);
  }
  if (++g->acked < g->nevents) return;
  if (g->kind == GROUP_UNMAP) { /* released at the turn's end, with the turn's other acks */
    list_append(&e->unmapped, &g->unmapped);
    settle_soon(e);
    return;
  }
  if (!g->op) { /* a late ack of a group whose operation stopped waiting */
    log_info("late ack from pid %d: its buffers are settled", (int)g->s->pid);
    if (g->kind == GROUP_ROLLBACK)
      finish_rollback(e, g);
    else
      roll_back(e, NULL, g); /* its resume failed: undo what it mapped */
    group_free(g, e->events);
    return;
  }
  struct op *op = g->op;
  g->done = true;
  op->pending--;
  if (g->kind == GROUP_ROLLBACK) {
    finish_rollback(e, g);
  } else {
    group_fail_remaps(g, &op->outcome);
  }
  check_done(e);
}

/* Whether a process is released. */
bool engine_released(const engine *e, pid_t pid) { return ctxrelease_holds(e->ctx, pid); }

/* Group g's owner s ended while g had buffers in a transition, and its
 * persistent ones went to the keeper (the rest are freed): what g was
 * doing with them cannot finish. One being paused stays ACTIVE (s never
 * said it unmapped it), one being resumed is PAUSED again with its backup
 * (s may not have mapped or filled it); either fails the operation. */
static void orphan_transit(engine *e, struct group *g, const struct owner *s) {
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = registry_find(e->reg, g->ids[i]);
    if (!b || b->owner == s) continue;
    unsigned long long id = (unsigned long long)b->id;
    if (b->state == BUF_PAUSING) {
      registry_move(e->reg, b, BUF_EV_UNMAP_FAILED);
      registry_backup_unhanded(b);
      hold(g->op, b);
      fail(g->op, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED,
           "pid %d ended its session before it unmapped persistent buffer %llu: the daemon "
           "keeps it, ACTIVE; pause again", (int)s->pid, id);
    } else if (b->state == BUF_RESUMING) {
      bool held = false; /* the new memory, which s's process may have mapped */
      if (g->made[i]) registry_held_by(e->reg, &b, 1, &held);
      if (held) { /* PAUSED, keeping that memory (counted held) until a pause releases it */
        registry_move(e->reg, b, BUF_EV_ROLL_BACK);
        hold(g->op, b);
        fail(g->op, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED,
             "pid %d ended its session during the resume of persistent buffer %llu and still "
             "maps its new memory: the daemon keeps it PAUSED with its backup and that memory; "
             "a pause releases it once pid %d unmaps it", (int)s->pid, id, (int)s->pid);
        continue;
      }
      undo_resume(e, b, g->made[i]);
      fail(g->op, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
           "pid %d ended its session during the resume of persistent buffer %llu: the daemon "
           "keeps it, PAUSED with its backup; resume again", (int)s->pid, id);
    }
  }
}

/* A session is ending: stop waiting for it and never answer it. */
void engine_forget(engine *e, struct owner *s) {
  ctxrelease_forget(e->ctx, s);
  struct list *p, *n;
  list_for_each_safe(p, n, &e->queue) {
    struct op *op = list_entry(p, struct op, link);
    if (op->ctl == s) op->ctl = NULL;
    if (op->scope.self == s) op->scope.self = NULL;
  }
  list_for_each_safe(p, n, &e->stragglers) {
    struct group *g = list_entry(p, struct group, link);
    if (g->s != s) continue;
    orphan_transit(e, g, s);
    group_free(g, e->events);
  }
  struct op *op = e->current;
  if (!op) return;
  if (op->ctl == s && op->waiting) uv_timer_start(&e->wait_timer, on_wait, 0, 0); /* ends now */
  if (op->ctl == s) op->ctl = NULL;
  if (op->scope.self == s) op->scope.self = NULL;
  list_for_each_safe(p, n, &op->groups) {
    struct group *g = list_entry(p, struct group, link);
    if (g->s != s) continue;
    if (!g->done) op->pending--;
    if (!g->done && !op->resume) exitwait_note(e->exits, (int)s->pid);
    orphan_transit(e, g, s);
    group_free(g, e->events);
  }
  if (!list_empty(&e->unmapped)) settle_unmapped(e, false); /* those that waited for its acks */
  check_done(e);
}
