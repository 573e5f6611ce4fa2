#include "report.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "gpumem.h"
#include "backup_disk.h"

#define VSTR_(x) #x
#define VSTR(x) VSTR_(x)
/* The daemon's version as text, from the same macros as the library's. */
#define DAEMON_VERSION \
  VSTR(GPUMEM_VERSION_MAJOR) "." VSTR(GPUMEM_VERSION_MINOR) "." VSTR(GPUMEM_VERSION_PATCH)

#define REPORT_BUS_ID_LEN 32
#define REPORT_MAX_PROCESSES 256

/* Fill info for every device. */
Gpumem__Wire__DeviceInfo **report_devices(registry *reg, gpudev *g, size_t *n) {
  unsigned ndev = gpudev_device_count(g);
  Gpumem__Wire__DeviceInfo **v = calloc(ndev + 1, sizeof *v);
  /* One block: the infos, then a bus id string for each. */
  Gpumem__Wire__DeviceInfo *d = calloc(ndev + 1, sizeof *d + REPORT_BUS_ID_LEN);
  *n = 0;
  if (!v || !d) {
    free(v);
    free(d);
    return NULL;
  }
  v[0] = d; /* so that report_devices_free finds the block when ndev is 0 */
  for (unsigned i = 0; i < ndev; i++) {
    gpumem__wire__device_info__init(&d[i]);
    d[i].index = i;
    struct gpudev_mem m = {0};
    gpudev_mem_detail(g, i, &m);
    d[i].total = m.total;
    d[i].free = m.free;
    d[i].reserved = m.reserved;
    d[i].managed = registry_managed(reg, i);
    char *bus = (char *)(d + ndev + 1) + (size_t)i * REPORT_BUS_ID_LEN;
    if (gpudev_bus_id(g, i, bus, REPORT_BUS_ID_LEN) < 0) bus[0] = '\0';
    d[i].bus_id = bus;
    d[i].daemon_context = gpudev_holding(g, i);
    v[i] = &d[i];
  }
  *n = ndev;
  return v;
}

/* Free what report_devices returned. */
void report_devices_free(Gpumem__Wire__DeviceInfo **v) {
  if (!v) return;
  free(v[0]);
  free(v);
}

/* A tag's figures for status, its state derived by the registry: all its
 * buffers', or (all unset) only those of uid. */
static void tag_info(Gpumem__Wire__TagInfo *ti, const struct tag *t, bool all, uint32_t uid) {
  gpumem__wire__tag_info__init(ti);
  ti->name = (char *)t->name;
  ti->owner_uid = t->uid;
  ti->owned = t->owned;
  ti->shared = t->shared;
  ti->generation = t->generation;
  struct tag_view v = registry_tag_state(t);
  ti->state = v.state;
  ti->mixed = v.mixed;
  uint64_t count[4] = {0}; /* the buffers seen, per state, as the registry counts them */
  const struct list *p;
  for (p = t->buffers.next; p != &t->buffers; p = p->next) {
    const struct buffer *b = list_entry(p, struct buffer, tag_link);
    if (!all && b->uid != uid) continue;
    if (!(b->flags & BUF_FLAG_IPC_LEGACY)) count[b->state]++;
    ti->buffers++;
    ti->bytes += b->size;
    if (b->state == BUF_PAUSED) {
      ti->paused_buffers++;
      if (!b->has_memory) ti->paused_bytes += b->size;
    }
    if (b->state == BUF_PAUSING || b->state == BUF_RESUMING) {
      ti->transit_buffers++;
      ti->transit_bytes += b->size;
    }
    if (b->backup_valid) ti->backup_bytes += b->size;
    if (b->backup && !b->pageable) ti->backup_pinned_bytes += b->size;
    if (b->backup && b->pageable) ti->backup_pageable_bytes += b->size;
    if (b->reserved) ti->backup_reserved_bytes += b->size;
    if (b->disk_fd >= 0) ti->backup_disk_bytes += b->size;
  }
  if (!all && t->shared) { /* the viewer's own buffers' state, not other uids' */
    ti->mixed = count[BUF_ACTIVE] && count[BUF_PAUSED];
    ti->state = registry_state_of(count, t->paused_devices);
  }
}

/* A process's name as the kernel knows it ("?" if gone). */
static void comm_of(int pid, char *buf, size_t len) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/comm", pid);
  FILE *f = fopen(path, "re");
  snprintf(buf, len, "?");
  if (!f) return;
  if (fgets(buf, (int)len, f)) buf[strcspn(buf, "\n")] = '\0';
  fclose(f);
  wire_text_clean(buf); /* any process may name itself any bytes */
}

/* Sum what processes hold on dev outside the daemon. */
int report_residual(gpudev *g, unsigned dev, uint64_t since_ns, struct report_residual *r) {
  memset(r, 0, sizeof *r);
  struct gpudev_process procs[REPORT_MAX_PROCESSES];
  size_t n = 0;
  int rc = gpudev_processes_since(g, dev, since_ns, procs, REPORT_MAX_PROCESSES, &n);
  if (rc < 0) return rc;
  if (n > REPORT_MAX_PROCESSES) n = REPORT_MAX_PROCESSES;
  for (size_t i = 0; i < n; i++) {
    if (procs[i].pid == getpid()) continue;
    if (procs[i].used == GPUDEV_USED_UNKNOWN) return -ENODATA; /* named, not measured */
    r->bytes += procs[i].used;
    if (procs[i].used > r->top_bytes) {
      r->top_bytes = procs[i].used;
      r->top_pid = procs[i].pid;
    }
  }
  if (r->top_pid) comm_of(r->top_pid, r->top_name, sizeof r->top_name);
  return 0;
}

/* The processes on every device with their memory outside the daemon,
 * by figures read at or after since_ns (for a view: those of processes
 * with device memory, gpudev_processes_view); returns the count
 * (into *out, malloc'd), or -1 where the driver gives no per-process
 * figures (then *out may still hold what was found). */
static long processes_of(gpudev *g, bool view, uint64_t since_ns, struct list *sessions,
                         Gpumem__Wire__ProcessMemory **out, char (**names)[WIRE_NAME_MAX + 1]) {
  unsigned ndev = gpudev_device_count(g);
  size_t n = 0, cap = 0;
  bool known = false, unmeasured = false;
  *out = NULL;
  *names = NULL;
  for (unsigned d = 0; d < ndev; d++) {
    struct gpudev_process procs[REPORT_MAX_PROCESSES];
    size_t k = 0;
    int rc = view ? gpudev_processes_view(g, d, since_ns, procs, REPORT_MAX_PROCESSES, &k)
                  : gpudev_processes_since(g, d, since_ns, procs, REPORT_MAX_PROCESSES, &k);
    if (rc < 0) continue;
    known = true;
    for (size_t i = 0; i < k && i < REPORT_MAX_PROCESSES; i++)
      if (procs[i].used == GPUDEV_USED_UNKNOWN) unmeasured = true;
    if (k > REPORT_MAX_PROCESSES) k = REPORT_MAX_PROCESSES;
    for (size_t i = 0; i < k; i++) {
      if (procs[i].pid == getpid() || procs[i].used == 0 || procs[i].used == GPUDEV_USED_UNKNOWN)
        continue;
      if (n == cap) {
        cap = cap ? 2 * cap : 16;
        Gpumem__Wire__ProcessMemory *np = realloc(*out, cap * sizeof *np);
        char(*nn)[WIRE_NAME_MAX + 1] = np ? realloc(*names, cap * sizeof *nn) : NULL;
        if (np) *out = np;
        if (!nn) return (long)n;
        *names = nn;
      }
      Gpumem__Wire__ProcessMemory *pm = &(*out)[n];
      gpumem__wire__process_memory__init(pm);
      pm->pid = (uint32_t)procs[i].pid;
      pm->device = d;
      pm->used = procs[i].used;
      pm->residual = procs[i].used;
      comm_of(procs[i].pid, (*names)[n], sizeof (*names)[n]);
      for (struct list *p = sessions->next; p != sessions; p = p->next) {
        struct owner *x = list_entry(p, struct owner, link);
        if (x->pid != procs[i].pid) continue;
        pm->session_id = x->id;
        if (x->name[0]) snprintf((*names)[n], sizeof (*names)[n], "%s", x->name);
        break;
      }
      n++;
    }
  }
  /* A driver that names processes without figures gives no residual. */
  return known && !unmeasured ? (long)n : -1;
}

/* The uid a process runs as (its /proc entry's owner), or -1 if gone. */
static long uid_of_pid(uint32_t pid) {
  char path[32];
  struct stat st;
  snprintf(path, sizeof path, "/proc/%u", pid);
  return stat(path, &st) == 0 ? (long)st.st_uid : -1;
}

/* Keep only the processes a viewer of uid may see: its own. */
static size_t own_processes(Gpumem__Wire__ProcessMemory **procp, size_t n, struct list *sessions,
                            uint32_t uid) {
  size_t kept = 0;
  for (size_t k = 0; k < n; k++) {
    long owner = -1;
    for (struct list *p = sessions->next; p != sessions && owner < 0; p = p->next) {
      struct owner *x = list_entry(p, struct owner, link);
      if (x->id == procp[k]->session_id) owner = (long)x->uid;
    }
    if (owner < 0) owner = uid_of_pid(procp[k]->pid);
    if (owner == (long)uid) procp[kept++] = procp[k];
  }
  return kept;
}

/* The processes on the devices in devmask, as a viewer may see them. */
void report_processes(gpudev *g, struct list *sessions, uint64_t devmask, uint64_t since_ns,
                      const struct owner *viewer, struct report_processes *pr) {
  *pr = (struct report_processes){0};
  long n = processes_of(g, false, since_ns, sessions, &pr->v, &pr->names);
  if (n > 0 && (pr->p = calloc((size_t)n + 1, sizeof *pr->p)))
    for (long k = 0; k < n; k++) {
      pr->v[k].name = pr->names[k];
      if (pr->v[k].device < 64 && (devmask & (1ull << pr->v[k].device))) pr->p[pr->n++] = &pr->v[k];
    }
  if (pr->p && viewer && viewer->role != GPUMEM__WIRE__ROLE__ROLE_CONTROLLER)
    pr->n = own_processes(pr->p, pr->n, sessions, (uint32_t)viewer->uid);
}

/* Free the processes. */
void report_processes_free(struct report_processes *pr) {
  free(pr->v);
  free(pr->p);
  free(pr->names);
  *pr = (struct report_processes){0};
}

/* One page of the tags after cursor (by creation order) that the viewer
 * may see, into tags/tagp (room for limit); *n set to the count. Returns
 * the next page's cursor, or 0 when this is the last. */
static uint64_t page_tags(registry *reg, uint64_t cursor, size_t limit,
                          Gpumem__Wire__TagInfo *tags, Gpumem__Wire__TagInfo **tagp, size_t *n,
                          bool all, uint32_t uid) {
  struct list *head = registry_tags(reg);
  struct tag *first = registry_tag_after(reg, cursor);
  uint64_t last = 0;
  *n = 0;
  for (struct list *p = first ? &first->link : head; p != head; p = p->next) {
    struct tag *t = list_entry(p, struct tag, link);
    if (!all && !registry_tag_visible(t, uid)) continue;
    if (*n == limit) return last;
    tag_info(&tags[*n], t, all, uid);
    tagp[*n] = &tags[*n];
    last = t->seq;
    (*n)++;
  }
  return 0;
}

/* The tags the viewer may see, on every page. */
static uint64_t count_tags(registry *reg, bool all, uint32_t uid) {
  struct list *head = registry_tags(reg);
  uint64_t n = 0;
  for (struct list *p = head->next; p != head; p = p->next)
    n += all || registry_tag_visible(list_entry(p, struct tag, link), uid);
  return n;
}

/* The sessions the viewer may see, on every page. */
static uint64_t count_sessions(struct list *sessions, bool all, uint32_t uid) {
  uint64_t n = 0;
  for (struct list *p = sessions->next; p != sessions; p = p->next)
    n += all || list_entry(p, struct owner, link)->uid == (uid_t)uid;
  return n;
}

/* A session's figures for status, with its residual from procs. */
static void session_info(Gpumem__Wire__SessionInfo *si, struct owner *x,
                         Gpumem__Wire__ProcessMemory *const *procp, size_t nprocs, bool known) {
  gpumem__wire__session_info__init(si);
  si->id = x->id;
  si->pid = (uint32_t)x->pid;
  si->uid = (uint32_t)x->uid;
  si->name = x->name;
  si->role = x->role;
  for (struct list *q = x->buffers.next; q != &x->buffers; q = q->next) {
    si->buffers++;
    si->bytes += list_entry(q, struct buffer, owner_link)->size;
  }
  si->residual_known = known;
  si->release_context = x->release_ok;
  si->context_released = x->released;
  si->moved_to_host = x->moved;
  for (size_t k = 0; k < nprocs; k++)
    if (procp[k]->session_id == x->id) si->residual += procp[k]->residual;
}

/* One page of the sessions after cursor (by id) that the viewer may see;
 * as page_tags. */
static uint64_t page_sessions(struct list *sessions, uint64_t cursor, size_t limit,
                              Gpumem__Wire__SessionInfo *ses, Gpumem__Wire__SessionInfo **sesp,
                              size_t *n, bool all, uint32_t uid,
                              Gpumem__Wire__ProcessMemory *const *procp, size_t nprocs,
                              bool known) {
  uint64_t last = 0;
  *n = 0;
  for (struct list *p = sessions->next; p != sessions; p = p->next) {
    struct owner *x = list_entry(p, struct owner, link);
    if (x->id <= cursor || (!all && x->uid != (uid_t)uid)) continue;
    if (*n == limit) return last;
    session_info(&ses[*n], x, procp, nprocs, known);
    sesp[*n] = &ses[*n];
    last = x->id;
    (*n)++;
  }
  return 0;
}

/* The tenants part of a status reply, and what it points to. */
struct tenant_view {
  Gpumem__Wire__TenantInfo *info;
  Gpumem__Wire__TenantInfo **ptr;
  uint64_t *bytes;
};

/* Fill r with what each uid holds (the viewer's alone unless all) and the
 * quotas. Returns 0, or -1 when out of memory. */
static int tenant_view_fill(struct tenant_view *tv, registry *reg, unsigned ndev, bool all,
                            uint32_t uid, Gpumem__Wire__StatusReply *r) {
  tenants *tt = registry_tenants(reg);
  const struct tenant_limits *lim = tenants_limits(tt);
  r->max_buffers_per_uid = lim->buffers;
  r->max_device_bytes_per_uid = lim->device_bytes;
  r->max_backup_bytes_per_uid = lim->backup_bytes;
  if (ndev > GPUMEM_MAX_DEVICES) ndev = GPUMEM_MAX_DEVICES;
  size_t count = tenants_count(tt);
  const struct tenant **list = calloc(count + 1, sizeof *list);
  tv->info = calloc(count + 1, sizeof *tv->info);
  tv->ptr = calloc(count + 1, sizeof *tv->ptr);
  tv->bytes = calloc((count + 1) * (ndev + 1), sizeof *tv->bytes);
  if (!list || !tv->info || !tv->ptr || !tv->bytes) {
    free(list);
    return -1;
  }
  count = tenants_list(tt, list, count);
  size_t n = 0;
  for (size_t i = 0; i < count; i++) {
    const struct tenant *t = list[i];
    if (!all && t->uid != uid) continue;
    Gpumem__Wire__TenantInfo *ti = &tv->info[n];
    gpumem__wire__tenant_info__init(ti);
    ti->uid = t->uid;
    ti->buffers = t->buffers;
    ti->bytes = t->bytes;
    ti->backup_bytes = t->backup_bytes;
    ti->device_bytes = tv->bytes + n * (ndev + 1);
    memcpy(ti->device_bytes, t->device_bytes, ndev * sizeof *ti->device_bytes);
    ti->n_device_bytes = ndev;
    tv->ptr[n++] = ti;
  }
  free(list);
  r->tenants = tv->ptr;
  r->n_tenants = n;
  return 0;
}

/* Free what tenant_view_fill made. */
static void tenant_view_free(struct tenant_view *tv) {
  free(tv->info);
  free(tv->ptr);
  free(tv->bytes);
}

/* Send s one page of the status of every device, tag and session it may
 * see (a worker: its uid's). */
static void buffer_info(Gpumem__Wire__BufferInfo *bi, const struct buffer *b);

/* How many persistent buffers a status shows. */
#define REPORT_PERSISTENT 256

/* At most REPORT_PERSISTENT of the persistent buffers the asker may see
 * (all, or uid's), those no session holds first, into v and vp; their
 * number in all into *total. */
static size_t page_persistent(registry *reg, bool all, uint32_t uid, Gpumem__Wire__BufferInfo *v,
                              Gpumem__Wire__BufferInfo **vp, uint64_t *total) {
  size_t n = 0;
  *total = 0;
  struct list *l = registry_persistent_list(reg);
  for (int pass = 0; pass < 2; pass++)
    for (struct list *p = l->next; p != l; p = p->next) {
      const struct buffer *b = list_entry(p, struct buffer, persist_link);
      if (!all && b->uid != uid) continue;
      if (pass == 0) (*total)++;
      if (b->owner->keeper != (pass == 0) || n == REPORT_PERSISTENT) continue;
      buffer_info(&v[n], b);
      vp[n] = &v[n];
      n++;
    }
  return n;
}

void report_status(const struct outbox *out, struct owner *s, uint64_t req_id,
                   const Gpumem__Wire__StatusRequest *req, registry *reg, gpudev *g,
                   struct list *sessions,
                   Gpumem__Wire__DeviceCheck *const *last_checks, size_t nlast, stats *st,
                   const struct report_own *own) {
  bool all = s->role == GPUMEM__WIRE__ROLE__ROLE_CONTROLLER;
  uint32_t uid = (uint32_t)s->uid;
  size_t limit = req->limit && req->limit < REPORT_STATUS_PAGE ? req->limit : REPORT_STATUS_PAGE;
  if (s->minor < 4) limit = SIZE_MAX; /* a 1.3 client knows no pages: all in one */
  Gpumem__Wire__StatusReply r = GPUMEM__WIRE__STATUS_REPLY__INIT;
  r.backend = (char *)gpudev_name(g);
  r.version = (char *)DAEMON_VERSION;
  r.granularity = gpudev_granularity(g);
  r.devices = report_devices(reg, g, &r.n_devices);
  struct tenant_view tv = {0};
  size_t ntags = registry_tag_count(reg), nsessions = list_count(sessions);
  size_t tag_room = (ntags < limit ? ntags : limit) + 1;
  size_t session_room = (nsessions < limit ? nsessions : limit) + 1;
  Gpumem__Wire__TagInfo *tags = calloc(tag_room, sizeof *tags);
  Gpumem__Wire__TagInfo **tagp = calloc(tag_room, sizeof *tagp);
  Gpumem__Wire__SessionInfo *ses = calloc(session_room, sizeof *ses);
  Gpumem__Wire__SessionInfo **sesp = calloc(session_room, sizeof *sesp);
  Gpumem__Wire__BufferInfo *pers = calloc(REPORT_PERSISTENT, sizeof *pers);
  Gpumem__Wire__BufferInfo **persp = calloc(REPORT_PERSISTENT, sizeof *persp);
  Gpumem__Wire__ProcessMemory *procs = NULL, **procp = NULL;
  char(*names)[WIRE_NAME_MAX + 1] = NULL;
  struct stats_view *figures = NULL;
  long nprocs = processes_of(g, true, uv_hrtime(), sessions, &procs, &names);
  procp = calloc(nprocs > 0 ? (size_t)nprocs + 1 : 1, sizeof *procp);
  if (!r.devices || !tags || !tagp || !ses || !sesp || !procp || !pers || !persp ||
      tenant_view_fill(&tv, reg, gpudev_device_count(g), all, uid, &r) < 0) {
    struct fault f;
    fault_set(&f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    stats_error(st, f.code);
    out->send_error(out->ctx, s, req_id, &f);
    goto out;
  }
  r.processes_known = nprocs >= 0;
  for (long k = 0; k < nprocs; k++) {
    procs[k].name = names[k];
    procp[k] = &procs[k];
  }
  r.processes = procp;
  r.n_processes = nprocs > 0 ? (size_t)nprocs : 0;
  r.total_tags = count_tags(reg, all, uid);
  r.total_sessions = count_sessions(sessions, all, uid);
  r.tags = tagp;
  r.next_tag = page_tags(reg, req->tag_cursor, tag_room - 1, tags, tagp, &r.n_tags, all, uid);
  r.sessions = sesp;
  r.next_session = page_sessions(sessions, req->session_cursor, session_room - 1, ses, sesp,
                                 &r.n_sessions,
                                 all, uid, procp, r.n_processes, r.processes_known);
  if (!all) r.n_processes = own_processes(procp, r.n_processes, sessions, uid);
  if (!req->tag_cursor && !req->session_cursor) { /* the first page */
    r.persistent = persp;
    r.n_persistent = page_persistent(reg, all, uid, pers, persp, &r.total_persistent);
  }
  r.last_pause_checks = (Gpumem__Wire__DeviceCheck **)last_checks;
  r.n_last_pause_checks = nlast;
  registry_backup_budget(reg, &r.backup_reserved, &r.backup_limit);
  r.backup_ready = registry_backup_ready(reg);
  registry_last(reg, true, &r.last_backup_bytes, &r.last_backup_us);
  registry_last(reg, false, &r.last_restore_bytes, &r.last_restore_us);
  figures = stats_fill(st, &r, all, uid);
  r.fd_limit = own->fd_limit;
  r.fds_open = own->fds_open;
  r.fds_parked = own->fds_parked;
  r.queued_bytes = own->queued_bytes;
  r.connections_refused = own->connections_refused;
  r.grace_left_ms = own->grace_left_ms;
  r.grace_waiting = own->grace_waiting;
  if (own->disk) {
    r.backup_dir = (char *)backup_disk_path(own->disk);
    r.backup_disk_free = backup_disk_free(own->disk);
  }
  r.backup_disk_bytes = registry_disk_bytes(reg);
  wire_env env = wire_envelope(req_id, GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY, &r);
  out->send(out->ctx, s, &env, NULL, 0);
out:
  stats_view_free(figures);
  tenant_view_free(&tv);
  free(procs);
  free(names);
  free(procp);
  report_devices_free(r.devices);
  free(tags);
  free(tagp);
  free(ses);
  free(sesp);
  free(pers);
  free(persp);
}

/* Send s the tag a share left, or none when it is gone. */
void report_share(const struct outbox *out, struct owner *s, uint64_t req_id, const struct tag *t) {
  Gpumem__Wire__TagInfo ti;
  Gpumem__Wire__ShareReply r = GPUMEM__WIRE__SHARE_REPLY__INIT;
  if (t) {
    tag_info(&ti, t, true, 0);
    r.tag = &ti;
  }
  wire_env env = wire_envelope(req_id, GPUMEM__WIRE__ENVELOPE__BODY_SHARE_REPLY, &r);
  out->send(out->ctx, s, &env, NULL, 0);
}

/* Describe one buffer. */
static void buffer_info(Gpumem__Wire__BufferInfo *bi, const struct buffer *b) {
  gpumem__wire__buffer_info__init(bi);
  bi->id = b->id;
  bi->session_id = b->owner->id;
  bi->pid = (uint32_t)b->owner->pid;
  bi->tag = (char *)b->tag->name;
  bi->device = b->device;
  bi->size = b->size;
  bi->flags = b->flags;
  bi->state = b->state;
  bi->uid = b->uid;
  if (b->owner->keeper) bi->session_id = bi->pid = 0; /* no session holds it */
  if (b->flags & BUF_FLAG_PERSIST) {
    uint64_t now = registry_now_ns();
    bi->name = (char *)b->name;
    bi->age_ms = (now - b->born_ns) / 1000000;
    bi->last_pid = (uint32_t)b->last_pid;
    bi->last_name = (char *)b->last_name;
    bi->idle_ms = b->let_go_ns ? (now - b->let_go_ns) / 1000000 : 0;
  }
}

/* Send s one page of the buffers it may see (its uid's; a controller's:
 * all), in id order. */
void report_list(const struct outbox *out, struct owner *s, uint64_t req_id,
                 const Gpumem__Wire__ListRequest *req, registry *reg) {
  bool all = s->role == GPUMEM__WIRE__ROLE__ROLE_CONTROLLER;
  size_t limit = req->limit && req->limit < REPORT_LIST_PAGE ? req->limit : REPORT_LIST_PAGE;
  if (s->minor < 4) limit = SIZE_MAX; /* a 1.3 client knows no pages: all in one */
  const struct tenant *me = tenants_find(registry_tenants(reg), (uint32_t)s->uid);
  struct list *mine = me ? tenants_members(registry_tenants(reg), (uint32_t)s->uid) : NULL;
  size_t held = all ? registry_count(reg) : me ? me->buffers : 0;
  size_t cap = held < limit ? held : limit;
  Gpumem__Wire__BufferInfo *bi = calloc(cap + 1, sizeof *bi);
  Gpumem__Wire__BufferInfo **bip = calloc(cap + 1, sizeof *bip);
  if (!bi || !bip) {
    struct fault f;
    fault_set(&f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    out->send_error(out->ctx, s, req_id, &f);
    free(bi);
    free(bip);
    return;
  }
  Gpumem__Wire__ListReply r = GPUMEM__WIRE__LIST_REPLY__INIT;
  size_t i = 0;
  if (all) {
    struct list *head = registry_buffers(reg);
    struct buffer *b = registry_buffer_after(reg, req->after);
    for (struct list *p = b ? &b->all_link : head; p != head; p = p->next) {
      if (i == cap) {
        r.next = bi[i - 1].id;
        break;
      }
      buffer_info(&bi[i], list_entry(p, struct buffer, all_link));
      bip[i] = &bi[i];
      i++;
    }
  } else if (mine) {
    /* Its uid's buffers are in id order too (appended as made): start after
     * the cursor's buffer when it is still there. */
    struct buffer *at = req->after ? registry_find(reg, req->after) : NULL;
    struct list *from = at && at->uid == (uint32_t)s->uid ? &at->uid_link : mine;
    for (struct list *q = from->next; q != mine; q = q->next) {
      struct buffer *b = list_entry(q, struct buffer, uid_link);
      if (b->id <= req->after) continue;
      if (i == cap) {
        r.next = bi[i - 1].id;
        break;
      }
      buffer_info(&bi[i], b);
      bip[i] = &bi[i];
      i++;
    }
  }
  r.buffers = bip;
  r.n_buffers = i;
  r.total = held;
  wire_env env = wire_envelope(req_id, GPUMEM__WIRE__ENVELOPE__BODY_LIST_REPLY, &r);
  out->send(out->ctx, s, &env, NULL, 0);
  free(bi);
  free(bip);
}
