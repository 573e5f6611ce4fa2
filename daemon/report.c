#include "report.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpumem.h"
#include "server.h"

#define VSTR_(x) #x
#define VSTR(x) VSTR_(x)
/* The daemon's version as text, from the same macros as the library's. */
#define DAEMON_VERSION \
  VSTR(GPUMEM_VERSION_MAJOR) "." VSTR(GPUMEM_VERSION_MINOR) "." VSTR(GPUMEM_VERSION_PATCH)

#define REPORT_BUS_ID_LEN 32
#define REPORT_MAX_PROCESSES 256

/* Fill info for every device. */
Gpumem__Wire__DeviceInfo **report_devices(registry *reg, gpu *g, size_t *n) {
  unsigned ndev = gpu_device_count(g);
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
    struct gpu_mem m = {0};
    gpu_mem_detail(g, i, &m);
    d[i].total = m.total;
    d[i].free = m.free;
    d[i].reserved = m.reserved;
    d[i].managed = registry_managed(reg, i);
    char *bus = (char *)(d + ndev + 1) + (size_t)i * REPORT_BUS_ID_LEN;
    if (gpu_bus_id(g, i, bus, REPORT_BUS_ID_LEN) < 0) bus[0] = '\0';
    d[i].bus_id = bus;
    d[i].daemon_context = gpu_holding(g, i);
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

/* A tag's figures for status, its state derived by the registry. */
static void tag_info(Gpumem__Wire__TagInfo *ti, const struct tag *t) {
  gpumem__wire__tag_info__init(ti);
  ti->name = (char *)t->name;
  struct tag_view v = registry_tag_state(t);
  ti->state = v.state;
  ti->mixed = v.mixed;
  ti->transit_buffers = v.transit_buffers;
  ti->transit_bytes = v.transit_bytes;
  const struct list *p;
  for (p = t->buffers.next; p != &t->buffers; p = p->next) {
    const struct buffer *b = list_entry(p, struct buffer, tag_link);
    ti->buffers++;
    ti->bytes += b->size;
    if (b->state == BUF_PAUSED) {
      ti->paused_buffers++;
      if (!b->has_memory) ti->paused_bytes += b->size;
    }
    if (b->backup_valid) ti->backup_bytes += b->size;
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
int report_residual(gpu *g, unsigned dev, struct report_residual *r) {
  memset(r, 0, sizeof *r);
  struct gpu_process procs[REPORT_MAX_PROCESSES];
  size_t n = 0;
  int rc = gpu_processes(g, dev, procs, REPORT_MAX_PROCESSES, &n);
  if (rc < 0) return rc;
  if (n > REPORT_MAX_PROCESSES) n = REPORT_MAX_PROCESSES;
  for (size_t i = 0; i < n; i++) {
    if (procs[i].pid == getpid()) continue;
    if (procs[i].used == GPU_USED_UNKNOWN) return -ENODATA; /* named, not measured */
    r->bytes += procs[i].used;
    if (procs[i].used > r->top_bytes) {
      r->top_bytes = procs[i].used;
      r->top_pid = procs[i].pid;
    }
  }
  if (r->top_pid) comm_of(r->top_pid, r->top_name, sizeof r->top_name);
  return 0;
}

/* The processes on every device with their memory outside the daemon;
 * returns the count (into *out, malloc'd), or -1 where the driver gives no
 * per-process figures (then *out may still hold what was found). */
static long processes_of(gpu *g, struct list *sessions, Gpumem__Wire__ProcessMemory **out,
                         char (**names)[WIRE_NAME_MAX + 1]) {
  unsigned ndev = gpu_device_count(g);
  size_t n = 0, cap = 0;
  bool known = false, unmeasured = false;
  *out = NULL;
  *names = NULL;
  for (unsigned d = 0; d < ndev; d++) {
    struct gpu_process procs[REPORT_MAX_PROCESSES];
    size_t k = 0;
    if (gpu_processes(g, d, procs, REPORT_MAX_PROCESSES, &k) < 0) continue;
    known = true;
    for (size_t i = 0; i < k && i < REPORT_MAX_PROCESSES; i++)
      if (procs[i].used == GPU_USED_UNKNOWN) unmeasured = true;
    if (k > REPORT_MAX_PROCESSES) k = REPORT_MAX_PROCESSES;
    for (size_t i = 0; i < k; i++) {
      if (procs[i].pid == getpid() || procs[i].used == 0 || procs[i].used == GPU_USED_UNKNOWN)
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
        struct session *x = list_entry(p, struct session, link);
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

/* Send s the status of every device, tag and session. */
void report_status(struct session *s, uint64_t req_id, registry *reg, gpu *g,
                   struct list *sessions, Gpumem__Wire__DeviceCheck *const *last_checks,
                   size_t nlast, stats *st) {
  Gpumem__Wire__StatusReply r = GPUMEM__WIRE__STATUS_REPLY__INIT;
  r.backend = (char *)gpu_name(g);
  r.version = (char *)DAEMON_VERSION;
  r.granularity = gpu_granularity(g);
  r.devices = report_devices(reg, g, &r.n_devices);
  size_t ntags = 0, nsessions = 0;
  struct list *p;
  for (p = registry_tags(reg)->next; p != registry_tags(reg); p = p->next) ntags++;
  for (p = sessions->next; p != sessions; p = p->next) nsessions++;
  Gpumem__Wire__TagInfo *tags = calloc(ntags + 1, sizeof *tags);
  Gpumem__Wire__TagInfo **tagp = calloc(ntags + 1, sizeof *tagp);
  Gpumem__Wire__SessionInfo *ses = calloc(nsessions + 1, sizeof *ses);
  Gpumem__Wire__SessionInfo **sesp = calloc(nsessions + 1, sizeof *sesp);
  if (!r.devices || !tags || !tagp || !ses || !sesp) {
    struct fault f = {.code = GPUMEM__WIRE__ERROR_CODE__INTERNAL};
    fault_set(&f, f.code, "out of host memory");
    stats_error(st, f.code);
    session_send_error(s, req_id, &f);
    goto out;
  }
  size_t i = 0;
  for (p = registry_tags(reg)->next; p != registry_tags(reg); p = p->next, i++) {
    tag_info(&tags[i], list_entry(p, struct tag, link));
    tagp[i] = &tags[i];
  }
  Gpumem__Wire__ProcessMemory *procs;
  char(*names)[WIRE_NAME_MAX + 1];
  long nprocs = processes_of(g, sessions, &procs, &names);
  Gpumem__Wire__ProcessMemory **procp = calloc(nprocs > 0 ? (size_t)nprocs + 1 : 1, sizeof *procp);
  r.processes_known = nprocs >= 0;
  for (long k = 0; procp && k < nprocs; k++) {
    procs[k].name = names[k];
    procp[k] = &procs[k];
    r.n_processes = (size_t)k + 1;
  }
  r.processes = procp;
  r.tags = tagp;
  r.n_tags = ntags;
  i = 0;
  for (p = sessions->next; p != sessions; p = p->next, i++) {
    struct session *x = list_entry(p, struct session, link);
    Gpumem__Wire__SessionInfo *si = &ses[i];
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
    si->residual_known = r.processes_known;
    for (size_t k = 0; k < r.n_processes; k++)
      if (procs[k].session_id == x->id) si->residual += procs[k].residual;
    sesp[i] = si;
  }
  r.sessions = sesp;
  r.n_sessions = nsessions;
  r.last_pause_checks = (Gpumem__Wire__DeviceCheck **)last_checks;
  r.n_last_pause_checks = nlast;
  registry_backup_budget(reg, &r.backup_reserved, &r.backup_limit);
  r.backup_ready = registry_backup_ready(reg);
  registry_last(reg, true, &r.last_backup_bytes, &r.last_backup_us);
  registry_last(reg, false, &r.last_restore_bytes, &r.last_restore_us);
  struct stats_view *figures = stats_fill(st, &r);
  server_fill_status(s->server, &r);
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = req_id;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY;
  env.status_reply = &r;
  session_send(s, &env, NULL, 0);
  stats_view_free(figures);
  free(procs);
  free(names);
  free(procp);
out:
  report_devices_free(r.devices);
  free(tags);
  free(tagp);
  free(ses);
  free(sesp);
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
}

/* Send s the buffers it may see. */
void report_list(struct session *s, uint64_t req_id, registry *reg) {
  bool all = s->role == GPUMEM__WIRE__ROLE__ROLE_CONTROLLER;
  size_t n = all ? registry_count(reg) : s->nbuffers;
  Gpumem__Wire__BufferInfo *bi = calloc(n + 1, sizeof *bi);
  Gpumem__Wire__BufferInfo **bip = calloc(n + 1, sizeof *bip);
  if (!bi || !bip) {
    struct fault f;
    fault_set(&f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    session_send_error(s, req_id, &f);
    free(bi);
    free(bip);
    return;
  }
  size_t i = 0;
  struct list *p, *q;
  if (all) {
    for (p = registry_tags(reg)->next; p != registry_tags(reg); p = p->next) {
      struct tag *t = list_entry(p, struct tag, link);
      for (q = t->buffers.next; q != &t->buffers && i < n; q = q->next, i++) {
        buffer_info(&bi[i], list_entry(q, struct buffer, tag_link));
        bip[i] = &bi[i];
      }
    }
  } else {
    for (q = s->buffers.next; q != &s->buffers && i < n; q = q->next, i++) {
      buffer_info(&bi[i], list_entry(q, struct buffer, owner_link));
      bip[i] = &bi[i];
    }
  }
  Gpumem__Wire__ListReply r = GPUMEM__WIRE__LIST_REPLY__INIT;
  r.buffers = bip;
  r.n_buffers = i;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = req_id;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_LIST_REPLY;
  env.list_reply = &r;
  session_send(s, &env, NULL, 0);
  free(bi);
  free(bip);
}
