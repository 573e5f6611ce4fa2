#include "report.h"

#include <stdlib.h>

#define REPORT_BUS_ID_LEN 32

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
    gpu_mem_info(g, i, &d[i].free, &d[i].total);
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

/* A tag's state: in transition if any buffer is, else paused if marked. */
static buffer_state tag_state(const struct tag *t, uint64_t *paused_buffers,
                              uint64_t *paused_bytes, uint64_t *backup_bytes,
                              uint64_t *buffers, uint64_t *bytes) {
  buffer_state st = t->paused_devices ? BUF_PAUSED : BUF_ACTIVE;
  const struct list *p;
  for (p = t->buffers.next; p != &t->buffers; p = p->next) {
    const struct buffer *b = list_entry(p, struct buffer, tag_link);
    (*buffers)++;
    *bytes += b->size;
    if (b->state == BUF_PAUSED) {
      (*paused_buffers)++;
      if (!b->has_memory) *paused_bytes += b->size;
    }
    if (b->backup_valid) *backup_bytes += b->size;
    if (b->state == BUF_PAUSING || b->state == BUF_RESUMING) st = b->state;
  }
  return st;
}

/* Send s the status of every device, tag and session. */
void report_status(struct session *s, uint64_t req_id, registry *reg, gpu *g,
                   struct list *sessions) {
  Gpumem__Wire__StatusReply r = GPUMEM__WIRE__STATUS_REPLY__INIT;
  r.backend = (char *)gpu_name(g);
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
    session_send_error(s, req_id, &f);
    goto out;
  }
  size_t i = 0;
  for (p = registry_tags(reg)->next; p != registry_tags(reg); p = p->next, i++) {
    struct tag *t = list_entry(p, struct tag, link);
    Gpumem__Wire__TagInfo *ti = &tags[i];
    gpumem__wire__tag_info__init(ti);
    ti->name = t->name;
    ti->state = tag_state(t, &ti->paused_buffers, &ti->paused_bytes,
                          &ti->backup_bytes, &ti->buffers, &ti->bytes);
    tagp[i] = ti;
  }
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
    sesp[i] = si;
  }
  r.sessions = sesp;
  r.n_sessions = nsessions;
  registry_backup_budget(reg, &r.backup_reserved, &r.backup_limit);
  registry_last(reg, true, &r.last_backup_bytes, &r.last_backup_us);
  registry_last(reg, false, &r.last_restore_bytes, &r.last_restore_us);
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = req_id;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY;
  env.status_reply = &r;
  session_send(s, &env, NULL, 0);
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
