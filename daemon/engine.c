/* Pause: every matching ACTIVE buffer becomes PAUSING and its owner gets
 * one Unmap event; as each owner acks, its buffers are backed up (BACKUP)
 * and released and become PAUSED. Resume: memory for every matching
 * PAUSED buffer is created first, all or nothing; backups are restored;
 * owners get Remap events with the new fds; as each acks, its buffers
 * become ACTIVE. An owner that does not ack in time is reported with its
 * pid; its buffers finish when its ack comes late, or go with its session. */
#include "engine.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/frame.h"
#include "common/idmap.h"
#include "common/log.h"
#include "report.h"
#include "session.h"

/* The buffers of one owner in one operation, and the events sent for them. */
struct group {
  struct session *s;
  struct op *op; /* NULL once the operation gave up waiting */
  bool resume;
  uint64_t first_event;
  size_t nevents, acked;
  uint64_t *ids;
  size_t nids, cap;
  struct list link; /* op's groups, or engine's stragglers */
};

struct detail {
  char tag[WIRE_TAG_MAX + 1];
  unsigned device;
  uint64_t buffers, bytes;
};

struct op {
  struct list link;
  bool resume;
  struct session *ctl;
  uint64_t req_id;
  char **tags;
  size_t ntags;
  uint64_t devmask;
  uint32_t timeout_ms;
  uint64_t t0, t_sent; /* start; all events sent (phase one done) */
  struct list groups;
  uint64_t buffers, bytes, backup_bytes, skipped;
  uint64_t copied0, copy_us0; /* the registry's copy totals at the start */
  struct detail *detail;
  size_t ndetail;
  struct fault fault; /* first failure, reported instead of the figures */
};

struct engine {
  uv_loop_t *loop;
  registry *reg;
  gpu *gpu;
  const struct config *cfg;
  struct list queue;
  struct op *current;
  uv_timer_t timer;
  struct list stragglers;
  idmap *events; /* event id -> group */
  uint64_t next_event;
  bool busy; /* inside a step: completion is checked at its end */
};

static void run_queue(engine *e);

/* Create an engine over the registry. */
engine *engine_create(uv_loop_t *loop, registry *reg, gpu *g,
                      const struct config *cfg) {
  engine *e = calloc(1, sizeof *e);
  if (!e || !(e->events = idmap_create())) {
    free(e);
    return NULL;
  }
  e->loop = loop;
  e->reg = reg;
  e->gpu = g;
  e->cfg = cfg;
  e->next_event = 1;
  list_init(&e->queue);
  list_init(&e->stragglers);
  uv_timer_init(loop, &e->timer);
  e->timer.data = e;
  return e;
}

static void group_free(engine *e, struct group *g) {
  for (size_t i = 0; i < g->nevents; i++) idmap_del(e->events, g->first_event + i);
  list_remove(&g->link);
  free(g->ids);
  free(g);
}

static void op_free(engine *e, struct op *op) {
  struct list *p, *t;
  list_for_each_safe(p, t, &op->groups) group_free(e, list_entry(p, struct group, link));
  for (size_t i = 0; i < op->ntags; i++) free(op->tags[i]);
  free(op->tags);
  free(op->detail);
  free(op);
}

static void on_timer_closed(uv_handle_t *h) { free(h->data); }

/* Drop queued operations and free the engine. */
void engine_destroy(engine *e) {
  if (!e) return;
  struct list *p, *t;
  list_for_each_safe(p, t, &e->queue) op_free(e, list_entry(p, struct op, link));
  if (e->current) op_free(e, e->current);
  list_for_each_safe(p, t, &e->stragglers)
      group_free(e, list_entry(p, struct group, link));
  idmap_destroy(e->events);
  uv_close((uv_handle_t *)&e->timer, on_timer_closed);
}

/* Queue an operation and start it if nothing runs. */
void engine_submit(engine *e, struct session *ctl, uint64_t req_id, bool resume,
                   char **tags, size_t ntags, uint64_t devmask,
                   uint32_t timeout_ms) {
  struct op *op = calloc(1, sizeof *op);
  if (op) op->tags = calloc(ntags, sizeof *op->tags);
  for (size_t i = 0; op && op->tags && i < ntags; i++, op->ntags++)
    if (!(op->tags[op->ntags] = strdup(tags[i]))) break;
  if (!op || !op->tags || op->ntags != ntags) {
    if (op) op_free(e, op);
    struct fault f = {.code = GPUMEM__WIRE__ERROR_CODE__INTERNAL};
    snprintf(f.text, sizeof f.text, "out of host memory");
    session_send_error(ctl, req_id, &f);
    return;
  }
  list_init(&op->groups);
  op->resume = resume;
  op->ctl = ctl;
  op->req_id = req_id;
  op->devmask = devmask ? devmask : ~0ull;
  op->timeout_ms = timeout_ms ? timeout_ms : e->cfg->ack_timeout_ms;
  list_append(&e->queue, &op->link);
  run_queue(e);
}

/* Count a buffer that finished into the operation's figures. */
static void count(struct op *op, const struct buffer *b) {
  op->buffers++;
  op->bytes += b->size;
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

/* An owner unmapped: back up and release its buffers. A buffer whose
 * backup fails keeps its memory (and contents) and is reported. */
static void finish_pause(engine *e, struct group *g) {
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = registry_find(e->reg, g->ids[i]);
    if (!b || b->state != BUF_PAUSING) continue;
    b->state = BUF_PAUSED;
    if (b->flags & BUF_FLAG_BACKUP) {
      struct fault f = {0};
      if (registry_backup(e->reg, b, &f)) {
        log_error("pause: %s; buffer %llu keeps its memory", f.text,
                  (unsigned long long)b->id);
        if (g->op && !g->op->fault.code) g->op->fault = f;
        continue;
      }
      if (g->op) g->op->backup_bytes += b->size;
    }
    registry_memory_release(e->reg, b);
    if (g->op) count(g->op, b);
  }
}

/* An owner remapped: its buffers are usable again. */
static void finish_resume(engine *e, struct group *g) {
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = registry_find(e->reg, g->ids[i]);
    if (!b || b->state != BUF_RESUMING) continue;
    b->state = BUF_ACTIVE;
    if (g->op) count(g->op, b);
  }
}

/* Answer the controller (if still there) with the operation's figures. */
static void reply(engine *e, struct op *op) {
  uint64_t now = uv_hrtime(), us = (now - op->t0) / 1000, copied, copy_us;
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
           op->resume ? "resume" : "pause", op->tags[0], op->ntags > 1 ? ",..." : "",
           (unsigned long long)op->buffers, (unsigned long long)op->bytes,
           (unsigned long long)op->backup_bytes, (unsigned long long)op->skipped,
           (unsigned long long)us, (unsigned long long)(op->t_sent - op->t0) / 1000,
           (unsigned long long)(now - op->t_sent) / 1000, op->fault.code ? ": " : "",
           op->fault.text);
  if (!op->ctl) return;
  if (op->fault.code) {
    session_send_error(op->ctl, op->req_id, &op->fault);
    return;
  }
  Gpumem__Wire__OpReply r = GPUMEM__WIRE__OP_REPLY__INIT;
  r.buffers = op->buffers;
  r.bytes = op->bytes;
  r.backup_bytes = op->backup_bytes;
  r.skipped = op->skipped;
  r.elapsed_us = us;
  r.backup_us = copy_us;
  Gpumem__Wire__TagDeviceBytes *td = calloc(op->ndetail + 1, sizeof *td);
  Gpumem__Wire__TagDeviceBytes **tdp = calloc(op->ndetail + 1, sizeof *tdp);
  if (td && tdp) {
    for (size_t i = 0; i < op->ndetail; i++) {
      gpumem__wire__tag_device_bytes__init(&td[i]);
      td[i].tag = op->detail[i].tag;
      td[i].device = op->detail[i].device;
      td[i].buffers = op->detail[i].buffers;
      td[i].bytes = op->detail[i].bytes;
      tdp[i] = &td[i];
    }
    r.detail = tdp;
    r.n_detail = op->ndetail;
  }
  r.devices = report_devices(e->reg, e->gpu, &r.n_devices);
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = op->req_id;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY;
  env.op_reply = &r;
  session_send(op->ctl, &env, NULL, 0);
  report_devices_free(r.devices);
  free(td);
  free(tdp);
}

/* Finish the current operation if nobody is left to wait for. */
static void check_done(engine *e) {
  struct op *op = e->current;
  if (e->busy || !op || !list_empty(&op->groups)) return;
  uv_timer_stop(&e->timer);
  e->current = NULL;
  reply(e, op);
  op_free(e, op);
  run_queue(e);
}

/* Find or make the group of a buffer's owner. */
static struct group *group_for(struct op *op, idmap *by_session, struct buffer *b) {
  struct group *g = idmap_get(by_session, b->owner->id);
  if (!g) {
    if (!(g = calloc(1, sizeof *g)) || idmap_put(by_session, b->owner->id, g) < 0) {
      free(g);
      return NULL;
    }
    g->s = b->owner;
    g->op = op;
    g->resume = op->resume;
    list_append(&op->groups, &g->link);
  }
  if (g->nids == g->cap) {
    size_t cap = g->cap ? 2 * g->cap : 16;
    uint64_t *ids = realloc(g->ids, cap * sizeof *ids);
    if (!ids) return NULL;
    g->ids = ids;
    g->cap = cap;
  }
  g->ids[g->nids++] = b->id;
  return g;
}

static bool selected(const struct op *op, const struct buffer *b) {
  return op->devmask & (1ull << b->device);
}

/* Give a group its events' ids. */
static void number_events(engine *e, struct group *g, size_t nevents) {
  g->first_event = e->next_event;
  g->nevents = nevents;
  e->next_event += nevents;
  for (size_t i = 0; i < nevents; i++) idmap_put(e->events, g->first_event + i, g);
}

/* Phase one of a pause: mark buffers and ask their owners to unmap. */
static void start_pause(engine *e, struct op *op) {
  idmap *by_session = idmap_create();
  for (size_t t = 0; t < op->ntags && by_session; t++) {
    struct tag *tag = registry_tag_get(e->reg, op->tags[t]);
    if (!tag) continue;
    tag->paused_devices |= op->devmask;
    struct list *p, *n;
    list_for_each_safe(p, n, &tag->buffers) {
      struct buffer *b = list_entry(p, struct buffer, tag_link);
      if (!selected(op, b)) continue;
      if (b->flags & BUF_FLAG_IPC_LEGACY) {
        op->skipped++;
        continue;
      }
      if (b->state != BUF_ACTIVE) continue;
      if (!group_for(op, by_session, b)) continue;
      b->state = BUF_PAUSING;
    }
  }
  idmap_destroy(by_session);
  struct list *p, *n;
  list_for_each_safe(p, n, &op->groups) {
    struct group *g = list_entry(p, struct group, link);
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
}

/* Send one owner its Remap events, at most FRAME_MAX_FDS fds per frame. */
static void send_remap(engine *e, struct group *g) {
  size_t nevents = 0;
  for (size_t i = 0, fds = 0; i < g->nids; i++) {
    size_t k = registry_find(e->reg, g->ids[i])->nchunks;
    if (i == 0 || fds + k > FRAME_MAX_FDS) {
      nevents++;
      fds = 0;
    }
    fds += k;
  }
  number_events(e, g, nevents);
  int fds[FRAME_MAX_FDS];
  Gpumem__Wire__RemapEntry ent[FRAME_MAX_FDS], *entp[FRAME_MAX_FDS];
  size_t i = 0;
  for (size_t ev_i = 0; ev_i < nevents; ev_i++) {
    size_t nent = 0, nfds = 0;
    while (i < g->nids) {
      struct buffer *b = registry_find(e->reg, g->ids[i]);
      if (nfds + b->nchunks > FRAME_MAX_FDS) break;
      struct fault f;
      if (registry_export(e->reg, b, fds + nfds, &f)) {
        /* The owner will fail to map this buffer and say so in its ack. */
        log_error("resume: %s", f.text);
        i++;
        continue;
      }
      gpumem__wire__remap_entry__init(&ent[nent]);
      ent[nent].buffer_id = b->id;
      ent[nent].chunk_sizes = b->chunk_sizes;
      ent[nent].n_chunk_sizes = b->nchunks;
      entp[nent] = &ent[nent];
      nent++;
      nfds += b->nchunks;
      i++;
    }
    Gpumem__Wire__RemapEvent rm = GPUMEM__WIRE__REMAP_EVENT__INIT;
    rm.entries = entp;
    rm.n_entries = nent;
    wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
    env.id = g->first_event + ev_i;
    env.fd_count = (uint32_t)nfds;
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_REMAP;
    env.remap = &rm;
    if (session_send(g->s, &env, fds, nfds) < 0) return;
  }
}

/* Undo a failed resume's marks: its tags stay paused where they were. */
static void restore_paused(engine *e, struct op *op, const uint64_t *masks) {
  for (size_t t = 0; t < op->ntags; t++) {
    struct tag *tag = registry_tag(e->reg, op->tags[t]);
    if (tag) tag->paused_devices = masks[t];
  }
}

/* Resume: memory for every selected buffer, or for none of them. */
static void start_resume(engine *e, struct op *op) {
  size_t n = 0, cap = 0;
  struct buffer **bufs = NULL;
  bool *made = NULL;
  uint64_t restore_mask[WIRE_MAX_TAGS];
  for (size_t t = 0; t < op->ntags; t++) {
    struct tag *tag = registry_tag(e->reg, op->tags[t]);
    restore_mask[t] = tag ? tag->paused_devices : 0;
  }
  for (size_t t = 0; t < op->ntags; t++) {
    struct tag *tag = registry_tag(e->reg, op->tags[t]);
    if (!tag) continue;
    tag->paused_devices &= ~op->devmask;
    struct list *p, *x;
    list_for_each_safe(p, x, &tag->buffers) {
      struct buffer *b = list_entry(p, struct buffer, tag_link);
      if (!selected(op, b) || b->state != BUF_PAUSED) continue;
      if (n == cap) {
        cap = cap ? cap * 2 : 64;
        struct buffer **nb = realloc(bufs, cap * sizeof *nb);
        if (!nb) goto nomem;
        bufs = nb;
      }
      bufs[n++] = b;
    }
  }
  if (!(made = calloc(n + 1, sizeof *made))) goto nomem;
  for (size_t i = 0; i < n; i++) {
    if (bufs[i]->has_memory) continue;
    if (registry_memory_create(e->reg, bufs[i], &op->fault)) {
      /* All or nothing: give back what this resume made. */
      uint64_t needed = 0;
      for (size_t j = 0; j < n; j++)
        if (bufs[j]->device == bufs[i]->device && (!bufs[j]->has_memory || made[j]))
          needed += bufs[j]->size;
      for (size_t j = 0; j < i; j++)
        if (made[j]) registry_memory_release(e->reg, bufs[j]);
      restore_paused(e, op, restore_mask);
      if (op->fault.code == GPUMEM__WIRE__ERROR_CODE__OUT_OF_MEMORY) {
        gpu_mem_info(e->gpu, bufs[i]->device, &op->fault.bytes_free, &(uint64_t){0});
        op->fault.bytes_needed = needed;
        snprintf(op->fault.text, sizeof op->fault.text,
                 "device %u: resume needs %llu bytes, %llu free; nothing resumed",
                 bufs[i]->device, (unsigned long long)needed,
                 (unsigned long long)op->fault.bytes_free);
      }
      goto out;
    }
    made[i] = true;
  }
  idmap *by_session = idmap_create();
  for (size_t i = 0; i < n && by_session; i++) {
    struct fault f = {0};
    if (bufs[i]->backup_valid) {
      if (registry_restore(e->reg, bufs[i], &f) && !op->fault.code) op->fault = f;
      else op->backup_bytes += bufs[i]->size;
    }
    if (group_for(op, by_session, bufs[i])) bufs[i]->state = BUF_RESUMING;
  }
  idmap_destroy(by_session);
  struct list *p, *x;
  list_for_each_safe(p, x, &op->groups) send_remap(e, list_entry(p, struct group, link));
  goto out;
nomem:
  fault_set(&op->fault, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  restore_paused(e, op, restore_mask);
out:
  for (size_t t = 0; t < op->ntags; t++) {
    struct tag *tag = registry_tag(e->reg, op->tags[t]);
    if (tag) registry_prune(e->reg, tag);
  }
  free(bufs);
  free(made);
}

/* Owners that did not ack in time: report their pids and stop waiting. */
static void on_timeout(uv_timer_t *t) {
  engine *e = t->data;
  struct op *op = e->current;
  if (!op) return;
  struct fault *f = &op->fault;
  f->code = GPUMEM__WIRE__ERROR_CODE__CLIENT_TIMEOUT;
  int len = snprintf(f->text, sizeof f->text, "no ack within %u ms from pid",
                     op->timeout_ms);
  uint32_t pids[64];
  size_t npids = 0;
  struct list *p, *n;
  list_for_each_safe(p, n, &op->groups) {
    struct group *g = list_entry(p, struct group, link);
    if (npids < 64) pids[npids++] = (uint32_t)g->s->pid;
    if (len < (int)sizeof f->text)
      len += snprintf(f->text + len, sizeof f->text - (size_t)len, " %d", (int)g->s->pid);
    g->op = NULL;
    list_remove(&g->link);
    list_append(&e->stragglers, &g->link);
  }
  if (e->cfg->timeout_policy == TIMEOUT_KILL) {
    for (size_t i = 0; i < npids; i++) {
      log_warn("killing pid %u: no ack in time", pids[i]);
      kill((pid_t)pids[i], SIGKILL);
    }
    if (len < (int)sizeof f->text)
      snprintf(f->text + len, sizeof f->text - (size_t)len, " (killed)");
  }
  e->current = NULL;
  if (op->ctl) {
    Gpumem__Wire__Error err = GPUMEM__WIRE__ERROR__INIT;
    err.code = f->code;
    err.message = f->text;
    err.pids = pids;
    err.n_pids = npids;
    wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
    env.id = op->req_id;
    env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ERROR;
    env.error = &err;
    session_send(op->ctl, &env, NULL, 0);
  }
  log_warn("%s: %s", op->resume ? "resume" : "pause", f->text);
  op_free(e, op);
  run_queue(e);
}

/* Start queued operations until one has to wait for owners. */
static void run_queue(engine *e) {
  while (!e->current && !list_empty(&e->queue)) {
    struct op *op = list_entry(e->queue.next, struct op, link);
    list_remove(&op->link);
    e->current = op;
    op->t0 = uv_hrtime();
    registry_copy_totals(e->reg, !op->resume, &op->copied0, &op->copy_us0);
    e->busy = true;
    if (op->resume)
      start_resume(e, op);
    else
      start_pause(e, op);
    e->busy = false;
    op->t_sent = uv_hrtime();
    if (!list_empty(&op->groups))
      uv_timer_start(&e->timer, on_timeout, op->timeout_ms, 0);
    check_done(e);
  }
}

/* A worker acknowledged an event. */
void engine_ack(engine *e, struct session *s, uint64_t event_id,
                const Gpumem__Wire__EventAck *ack) {
  struct group *g = idmap_get(e->events, event_id);
  if (!g || g->s != s) {
    log_debug("session %llu: ack for unknown event %llu", (unsigned long long)s->id,
              (unsigned long long)event_id);
    return;
  }
  idmap_del(e->events, event_id);
  if (ack->code)
    log_warn("pid %d: %s failed: %s", (int)s->pid, g->resume ? "remap" : "unmap",
             ack->message);
  if (++g->acked < g->nevents) return;
  if (g->resume)
    finish_resume(e, g);
  else
    finish_pause(e, g);
  if (!g->op) log_info("late ack from pid %d: its buffers are done", (int)s->pid);
  group_free(e, g);
  check_done(e);
}

/* A session is ending: stop waiting for it and never answer it. */
void engine_forget(engine *e, struct session *s) {
  struct list *p, *n;
  list_for_each_safe(p, n, &e->queue) {
    struct op *op = list_entry(p, struct op, link);
    if (op->ctl == s) op->ctl = NULL;
  }
  list_for_each_safe(p, n, &e->stragglers) {
    struct group *g = list_entry(p, struct group, link);
    if (g->s == s) group_free(e, g);
  }
  struct op *op = e->current;
  if (!op) return;
  if (op->ctl == s) op->ctl = NULL;
  list_for_each_safe(p, n, &op->groups) {
    struct group *g = list_entry(p, struct group, link);
    if (g->s == s) group_free(e, g);
  }
  check_done(e);
}
