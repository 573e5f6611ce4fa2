/* The views of the daemon: status and list, gathered from its pages,
 * with every device number turned into the caller's. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"
#include "error.h"
#include "results.h"

/* Pages a walk may take, and walks a view that keeps changing gets. */
#define WALK_MAX_PAGES (1u << 20)
#define WALK_TRIES 3
/* A walk found the view changed under it (its totals moved): walk again
 * (neither a count nor a GPUMEM_E_* code). */
#define WALK_CHANGED INT_MIN

/* One walk of pages of one kind (tags, sessions, buffers): the total its
 * first page announced (from 1.10), the items and pages so far. */
struct walk {
  const char *what;
  bool totals; /* the daemon announces them */
  bool started;
  uint64_t total, got;
  size_t pages;
};

/* Take one page of n items, with the daemon's total and the cursor after
 * it (0: the last): 0, WALK_CHANGED when the view changed since the first
 * page, or GPUMEM_E_PROTOCOL with words for pages that would not end (an
 * empty page with a cursor, more items than announced, too many pages). */
static int walk_page(struct walk *w, size_t n, uint64_t total, uint64_t cursor) {
  if (w->totals && w->started && total != w->total) return WALK_CHANGED;
  if (!w->started) w->total = total;
  w->started = true;
  w->got += n;
  if (++w->pages > WALK_MAX_PAGES)
    return error_set(GPUMEM_E_PROTOCOL, "gpumemd's %s pages do not end (%u pages)", w->what,
                     WALK_MAX_PAGES);
  if (cursor && n == 0)
    return error_set(GPUMEM_E_PROTOCOL, "gpumemd sent an empty page of %s and a cursor",
                     w->what);
  if (!w->totals) return 0;
  if (w->got > w->total)
    return error_set(GPUMEM_E_PROTOCOL, "gpumemd sent more %s (%llu) than the %llu it announced",
                     w->what, (unsigned long long)w->got, (unsigned long long)w->total);
  if (!cursor && w->got != w->total) return WALK_CHANGED; /* some came or went meanwhile */
  return 0;
}

/* Send a request and check the reply's kind. */
static int call_for(gpumem_client *c, wire_env *req, Gpumem__Wire__Envelope__BodyCase want,
                    struct call *reply) {
  memset(reply, 0, sizeof *reply);
  int rc = conn_call(c->conn, req, reply);
  if (rc == 0 && reply->reply->body_case != want)
    rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered with something else");
  if (rc < 0) conn_call_done(reply);
  return rc;
}

/* Ask for the page of the status at these cursors. */
static int status_page(gpumem_client *c, uint64_t tag_cursor, uint64_t session_cursor,
                       struct call *reply) {
  Gpumem__Wire__StatusRequest sr = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  sr.tag_cursor = tag_cursor;
  sr.session_cursor = session_cursor;
  wire_env req = wire_envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_STATUS, &sr);
  return call_for(c, &req, GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY, reply);
}

/* Ask for the page of the list after a buffer id. */
static int list_page(gpumem_client *c, uint64_t after, struct call *reply) {
  Gpumem__Wire__ListRequest lr = GPUMEM__WIRE__LIST_REQUEST__INIT;
  lr.after = after;
  wire_env req = wire_envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_LIST, &lr);
  return call_for(c, &req, GPUMEM__WIRE__ENVELOPE__BODY_LIST_REPLY, reply);
}

/* Make room for n more pointers after *len in *v; false when out of
 * memory. The array keeps a NULL after its last element. */
static bool grow(void ***v, size_t len, size_t n) {
  void **more = realloc(*v, (len + n + 1) * sizeof *more);
  if (!more) return false;
  memset(more + len, 0, (n + 1) * sizeof *more);
  *v = more;
  return true;
}

/* Copy the status's devices into s; false when out of memory. */
static bool copy_devices(const int *map, struct gpumem_status *s,
                         const Gpumem__Wire__StatusReply *r) {
  if (!(s->devices = calloc(r->n_devices + 1, sizeof *s->devices))) return false;
  for (size_t i = 0; i < r->n_devices; i++) {
    const Gpumem__Wire__DeviceInfo *d = r->devices[i];
    struct gpumem_device_status *o = results_sized(sizeof *o);
    if (!o) return false;
    s->devices[s->ndevices++] = o;
    o->device = hello_local_device(map, d->index);
    o->node_device = d->index;
    o->total = d->total;
    o->free = d->free;
    o->managed = d->managed;
    o->reserved = d->reserved;
    /* The driver's reserve is not a process's memory: leave it out. */
    uint64_t taken = d->free + d->reserved;
    uint64_t used = d->total > taken ? d->total - taken : 0;
    o->unmanaged = used > d->managed ? used - d->managed : 0;
    o->daemon_context = d->daemon_context;
    if (!(o->bus_id = results_text(d->bus_id))) return false;
  }
  return true;
}

/* Add a status page's tags to s; false when out of memory. */
static bool copy_tags(struct gpumem_status *s, const Gpumem__Wire__StatusReply *r) {
  if (!grow((void ***)&s->tags, s->ntags, r->n_tags)) return false;
  for (size_t i = 0; i < r->n_tags; i++) {
    const Gpumem__Wire__TagInfo *t = r->tags[i];
    struct gpumem_tag_status *o = results_sized(sizeof *o);
    if (!o) return false;
    s->tags[s->ntags++] = o;
    o->state = t->state;
    o->buffers = t->buffers;
    o->bytes = t->bytes;
    o->backup_bytes = t->backup_bytes;
    o->paused_buffers = t->paused_buffers;
    o->paused_bytes = t->paused_bytes;
    o->mixed = t->mixed;
    o->transit_buffers = t->transit_buffers;
    o->transit_bytes = t->transit_bytes;
    o->owner_uid = t->owner_uid;
    o->owned = t->owned;
    o->shared = t->shared;
    o->backup_pinned_bytes = t->backup_pinned_bytes;
    o->backup_reserved_bytes = t->backup_reserved_bytes;
    o->backup_pageable_bytes = t->backup_pageable_bytes;
    o->backup_disk_bytes = t->backup_disk_bytes;
    o->generation = t->generation;
    if (!(o->name = results_text(t->name))) return false;
  }
  return true;
}

/* Add a status page's sessions to s; false when out of memory. */
static bool copy_sessions(struct gpumem_status *s, const Gpumem__Wire__StatusReply *r) {
  if (!grow((void ***)&s->sessions, s->nsessions, r->n_sessions)) return false;
  for (size_t i = 0; i < r->n_sessions; i++) {
    const Gpumem__Wire__SessionInfo *x = r->sessions[i];
    struct gpumem_session_status *o = results_sized(sizeof *o);
    if (!o) return false;
    s->sessions[s->nsessions++] = o;
    o->id = x->id;
    o->pid = x->pid;
    o->uid = x->uid;
    o->role = x->role;
    o->buffers = x->buffers;
    o->bytes = x->bytes;
    o->residual = x->residual;
    o->residual_known = x->residual_known;
    o->release_context = x->release_context;
    o->context_released = x->context_released;
    o->moved_to_host = x->moved_to_host;
    if (!(o->name = results_text(x->name))) return false;
  }
  return true;
}

/* Copy the driver's process list into s; false when out of memory. */
static bool copy_processes(const int *map, struct gpumem_status *s,
                           const Gpumem__Wire__StatusReply *r) {
  s->processes_known = r->processes_known;
  return results_processes(map, &s->processes, &s->nprocesses, r->processes, r->n_processes);
}

/* The name of an operation's kind. */
static const char *op_name(bool resume) { return resume ? "resume" : "pause"; }

/* Copy counts into *out (op "" for errors); names are the protocol's own
 * static strings. False when out of memory. */
static bool copy_counts(struct gpumem_counter ***out, size_t *nout,
                        Gpumem__Wire__OpCount *const *v, size_t n, bool errors) {
  if (!(*out = calloc(n + 1, sizeof **out))) return false;
  for (size_t i = 0; i < n; i++) {
    struct gpumem_counter *o = results_sized(sizeof *o);
    if (!o) return false;
    (*out)[(*nout)++] = o;
    o->op = errors ? "" : op_name(v[i]->resume);
    o->name = wire_code_name(v[i]->code);
    o->count = v[i]->count;
  }
  return true;
}

/* Copy the duration histograms into s (as many buckets as both bounds
 * and counts give); false when out of memory. */
static bool copy_histograms(struct gpumem_status *s, const Gpumem__Wire__StatusReply *r) {
  if (!(s->histograms = calloc(r->n_histograms + 1, sizeof *s->histograms))) return false;
  for (size_t i = 0; i < r->n_histograms; i++) {
    const Gpumem__Wire__OpHistogram *h = r->histograms[i];
    struct gpumem_histogram *o = results_sized(sizeof *o);
    if (!o) return false;
    s->histograms[s->nhistograms++] = o;
    size_t n = h->n_le_us < h->n_count ? h->n_le_us : h->n_count;
    uint64_t *le = calloc(n + 1, sizeof *le), *count = calloc(n + 1, sizeof *count);
    o->le_us = le;
    o->count = count;
    if (!le || !count) return false;
    memcpy(le, h->le_us, n * sizeof *le);
    memcpy(count, h->count, n * sizeof *count);
    o->op = op_name(h->resume);
    o->nbuckets = n;
    o->total = h->total;
    o->sum_us = h->sum_us;
  }
  return true;
}

/* Copy the operations running and recently done into s; false when out
 * of memory. */
static bool copy_records(struct gpumem_status *s, const Gpumem__Wire__StatusReply *r) {
  if (!(s->recent_ops = calloc(r->n_recent_ops + 1, sizeof *s->recent_ops))) return false;
  for (size_t i = 0; i < r->n_recent_ops; i++) {
    const Gpumem__Wire__OpRecord *x = r->recent_ops[i];
    struct gpumem_op_record *o = results_sized(sizeof *o);
    if (!o) return false;
    s->recent_ops[s->nrecent_ops++] = o;
    const char **tags = calloc(x->n_tags + 1, sizeof *tags);
    o->tags = tags;
    if (!tags) return false;
    for (; o->ntags < x->n_tags; o->ntags++)
      if (!(tags[o->ntags] = results_text(x->tags[o->ntags]))) return false;
    o->op = op_name(x->resume);
    o->pid = x->pid;
    o->done = x->done;
    o->result = x->done && x->result ? error_from_wire(x->result) : 0;
    o->bytes_done = x->bytes_done;
    o->bytes_total = x->bytes_total;
    o->copied_bytes = x->copied_bytes;
    o->started_ms = x->started_ms;
    o->duration_us = x->duration_us;
  }
  return true;
}

/* Copy what the daemon counted since it started (1.3) into s; an older
 * daemon sends none: empty arrays and zeros. False when out of memory. */
static bool copy_figures(struct gpumem_status *s, const Gpumem__Wire__StatusReply *r) {
  s->uptime_ms = r->uptime_ms;
  s->bytes_released = r->bytes_released;
  s->bytes_restored = r->bytes_restored;
  return copy_counts(&s->op_counts, &s->nop_counts, r->op_counts, r->n_op_counts, false) &&
         copy_counts(&s->error_counts, &s->nerror_counts, r->error_counts, r->n_error_counts,
                     true) &&
         copy_histograms(s, r) && copy_records(s, r);
}

/* Copy what each uid holds into s; false when out of memory. */
static bool copy_tenants(struct gpumem_status *s, const Gpumem__Wire__StatusReply *r) {
  s->max_buffers_per_uid = r->max_buffers_per_uid;
  s->max_device_bytes_per_uid = r->max_device_bytes_per_uid;
  s->max_backup_bytes_per_uid = r->max_backup_bytes_per_uid;
  if (!(s->tenants = calloc(r->n_tenants + 1, sizeof *s->tenants))) return false;
  for (size_t i = 0; i < r->n_tenants; i++) {
    const Gpumem__Wire__TenantInfo *t = r->tenants[i];
    struct gpumem_tenant_status *o = results_sized(sizeof *o);
    if (!o) return false;
    s->tenants[s->ntenants++] = o;
    o->uid = t->uid;
    o->buffers = t->buffers;
    o->bytes = t->bytes;
    o->backup_bytes = t->backup_bytes;
    uint64_t *bytes = calloc(t->n_device_bytes + 1, sizeof *bytes);
    if (!bytes) return false;
    memcpy(bytes, t->device_bytes, t->n_device_bytes * sizeof *bytes);
    o->device_bytes = bytes;
    o->ndevice_bytes = t->n_device_bytes;
  }
  return true;
}

/* Gather the pages after the first: their tags and sessions. */
static int status_rest(gpumem_client *c, struct gpumem_status *s, uint64_t next_tag,
                       uint64_t next_session, struct walk *tags, struct walk *sessions) {
  while (next_tag || next_session) {
    struct call reply;
    /* A cursor past every id asks for nothing more of a list that ended. */
    int rc = status_page(c, next_tag ? next_tag : UINT64_MAX,
                         next_session ? next_session : UINT64_MAX, &reply);
    if (rc < 0) return rc;
    const Gpumem__Wire__StatusReply *r = reply.reply->status_reply;
    bool ok = copy_tags(s, r) && copy_sessions(s, r);
    bool stuck = (next_tag && r->next_tag && r->next_tag <= next_tag) ||
                 (next_session && r->next_session && r->next_session <= next_session);
    if (next_tag && rc == 0) rc = walk_page(tags, r->n_tags, r->total_tags, r->next_tag);
    if (next_session && rc == 0)
      rc = walk_page(sessions, r->n_sessions, r->total_sessions, r->next_session);
    next_tag = next_tag ? r->next_tag : 0;
    next_session = next_session ? r->next_session : 0;
    conn_call_done(&reply);
    if (!ok) return error_set(GPUMEM_E_NOMEM, "out of memory");
    if (rc) return rc;
    if (stuck) return error_set(GPUMEM_E_PROTOCOL, "gpumemd's status pages do not advance");
  }
  return 0;
}

/* One walk of the status pages (status_walk's result, or WALK_CHANGED). */
/* Free one buffer of a list or status and its strings. */
static void free_buffer(struct gpumem_buffer_info *o) {
  if (!o) return;
  free((char *)o->tag);
  free((char *)o->name);
  free((char *)o->last_name);
  free(o);
}

/* Free the n buffers of a list or status, and their array. */
static void free_buffers(struct gpumem_buffer_info **v, size_t n) {
  for (size_t i = 0; v && i < n; i++) free_buffer(v[i]);
  free(v);
}

/* A buffer of a list or a status, or NULL when out of memory. */
static struct gpumem_buffer_info *copy_buffer(const int *map, const Gpumem__Wire__BufferInfo *b) {
  struct gpumem_buffer_info *o = results_sized(sizeof *o);
  if (!o) return NULL;
  o->id = b->id;
  o->session_id = b->session_id;
  o->pid = b->pid;
  o->device = hello_local_device(map, b->device);
  o->node_device = b->device;
  o->bytes = b->size;
  o->flags = b->flags;
  o->state = b->state;
  o->age_ms = b->age_ms;
  o->last_pid = b->last_pid;
  o->idle_ms = b->idle_ms;
  o->uid = b->uid;
  if (!(o->tag = results_text(b->tag)) || !(o->name = results_text(b->name)) ||
      !(o->last_name = results_text(b->last_name))) {
    free_buffer(o);
    return NULL;
  }
  return o;
}

/* Add a list page's buffers to l; false when out of memory. */
static bool copy_buffers(const int *map, struct gpumem_list *l, const Gpumem__Wire__ListReply *r) {
  if (!grow((void ***)&l->buffers, l->nbuffers, r->n_buffers)) return false;
  for (size_t i = 0; i < r->n_buffers; i++) {
    struct gpumem_buffer_info *o = copy_buffer(map, r->buffers[i]);
    if (!o) return false;
    l->buffers[l->nbuffers++] = o;
  }
  return true;
}

/* The status's persistent buffers; false when out of memory. */
static bool copy_persistent(const int *map, struct gpumem_status *s,
                            const Gpumem__Wire__StatusReply *r) {
  s->total_persistent = r->total_persistent;
  if (!grow((void ***)&s->persistent, 0, r->n_persistent)) return false;
  for (size_t i = 0; i < r->n_persistent; i++)
    if (!(s->persistent[s->npersistent++] = copy_buffer(map, r->persistent[i]))) {
      s->npersistent--;
      return false;
    }
  return true;
}

static int status_walk(gpumem_client *c, struct gpumem_status **out);

/* Ask for the status of devices, tags, sessions and processes: walked
 * again while the view changes under the walk, a few times at most. */
int gpumem_status(gpumem_client *c, struct gpumem_status **out) {
  if (!c || !out) return error_set(GPUMEM_E_INVALID, "no client or no place for the status");
  for (int i = 0; i < WALK_TRIES; i++) {
    int rc = status_walk(c, out);
    if (rc != WALK_CHANGED) return rc;
  }
  return error_set(GPUMEM_E_WRONG_STATE,
                   "gpumemd's tags or sessions changed during each of %d walks of the status "
                   "pages", WALK_TRIES);
}

/* One walk of the status pages. */
static int status_walk(gpumem_client *c, struct gpumem_status **out) {
  struct call reply;
  int rc = status_page(c, 0, 0, &reply);
  if (rc < 0) return rc;
  const Gpumem__Wire__StatusReply *r = reply.reply->status_reply;
  int map[GPUMEM_MAX_DEVICES];
  hello_local_map(c->hello, map);
  struct gpumem_status *s = results_sized(sizeof *s);
  if (!s || !(s->backend = results_text(r->backend)) ||
      !(s->version = results_text(r->version)) || !(s->backup_dir = results_text(r->backup_dir)) || !copy_devices(map, s, r) ||
      !copy_tags(s, r) || !copy_sessions(s, r) || !copy_processes(map, s, r) ||
      !results_checks(map, &s->last_pause_checks, &s->nlast_pause_checks, r->last_pause_checks,
                   r->n_last_pause_checks) ||
      !copy_figures(s, r) || !copy_tenants(s, r) || !copy_persistent(map, s, r)) {
    gpumem_status_free(s);
    conn_call_done(&reply);
    return error_set(GPUMEM_E_NOMEM, "out of memory");
  }
  uint64_t next_tag = r->next_tag, next_session = r->next_session;
  bool totals = hello_minor(c->hello) >= 10;
  struct walk tags = {.what = "tags", .totals = totals};
  struct walk sessions = {.what = "sessions", .totals = totals};
  rc = walk_page(&tags, r->n_tags, r->total_tags, r->next_tag);
  if (rc == 0) rc = walk_page(&sessions, r->n_sessions, r->total_sessions, r->next_session);
  s->granularity = r->granularity;
  s->backup_reserved = r->backup_reserved;
  s->backup_limit = r->backup_limit;
  s->backup_ready = r->backup_ready;
  s->last_backup_bytes = r->last_backup_bytes;
  s->last_backup_us = r->last_backup_us;
  s->last_restore_bytes = r->last_restore_bytes;
  s->last_restore_us = r->last_restore_us;
  s->fd_limit = r->fd_limit;
  s->fds_open = r->fds_open;
  s->fds_parked = r->fds_parked;
  s->queued_bytes = r->queued_bytes;
  s->connections_refused = r->connections_refused;
  s->grace_left_ms = r->grace_left_ms;
  s->grace_waiting = r->grace_waiting;
  s->backup_disk_bytes = r->backup_disk_bytes;
  s->backup_disk_free = r->backup_disk_free;
  conn_call_done(&reply);
  if (rc == 0) rc = status_rest(c, s, next_tag, next_session, &tags, &sessions);
  if (rc) {
    gpumem_status_free(s);
    return rc;
  }
  *out = s;
  return 0;
}

/* Free a status and every string and element it points to. */
void gpumem_status_free(struct gpumem_status *s) {
  if (!s) return;
  for (size_t i = 0; s->devices && i < s->ndevices; i++) free((char *)s->devices[i]->bus_id);
  results_free_array((void **)s->devices, s->ndevices);
  for (size_t i = 0; s->tags && i < s->ntags; i++) free((char *)s->tags[i]->name);
  results_free_array((void **)s->tags, s->ntags);
  for (size_t i = 0; s->sessions && i < s->nsessions; i++) free((char *)s->sessions[i]->name);
  results_free_array((void **)s->sessions, s->nsessions);
  results_free_processes(s->processes, s->nprocesses);
  results_free_array((void **)s->last_pause_checks, s->nlast_pause_checks);
  results_free_array((void **)s->op_counts, s->nop_counts);
  results_free_array((void **)s->error_counts, s->nerror_counts);
  for (size_t i = 0; s->histograms && i < s->nhistograms; i++) {
    free((uint64_t *)s->histograms[i]->le_us);
    free((uint64_t *)s->histograms[i]->count);
  }
  results_free_array((void **)s->histograms, s->nhistograms);
  for (size_t i = 0; s->recent_ops && i < s->nrecent_ops; i++) {
    for (size_t k = 0; k < s->recent_ops[i]->ntags; k++) free((char *)s->recent_ops[i]->tags[k]);
    free((char **)s->recent_ops[i]->tags);
  }
  results_free_array((void **)s->recent_ops, s->nrecent_ops);
  for (size_t i = 0; s->tenants && i < s->ntenants; i++)
    free((uint64_t *)s->tenants[i]->device_bytes);
  results_free_array((void **)s->tenants, s->ntenants);
  free((char *)s->backend);
  free((char *)s->version);
  free((char *)s->backup_dir);
  free_buffers(s->persistent, s->npersistent);
  free(s);
}

static int list_walk(gpumem_client *c, struct gpumem_list **out);

/* List the buffers this session may see, page after page: walked again
 * while the buffers change under the walk, a few times at most. */
int gpumem_list(gpumem_client *c, struct gpumem_list **out) {
  if (!c || !out) return error_set(GPUMEM_E_INVALID, "no client or no place for the list");
  for (int i = 0; i < WALK_TRIES; i++) {
    int rc = list_walk(c, out);
    if (rc != WALK_CHANGED) return rc;
  }
  return error_set(GPUMEM_E_WRONG_STATE,
                   "gpumemd's buffers changed during each of %d walks of the list pages",
                   WALK_TRIES);
}

/* One walk of the list pages: the count, or WALK_CHANGED, or an error. */
static int list_walk(gpumem_client *c, struct gpumem_list **out) {
  struct walk w = {.what = "buffers", .totals = hello_minor(c->hello) >= 10};
  int map[GPUMEM_MAX_DEVICES];
  hello_local_map(c->hello, map);
  struct gpumem_list *l = results_sized(sizeof *l);
  if (!l) return error_set(GPUMEM_E_NOMEM, "out of memory");
  uint64_t after = 0;
  int rc = 0;
  do {
    struct call reply;
    if ((rc = list_page(c, after, &reply)) < 0) break;
    const Gpumem__Wire__ListReply *r = reply.reply->list_reply;
    bool ok = copy_buffers(map, l, r);
    bool stuck = r->next && r->next <= after;
    after = r->next;
    rc = walk_page(&w, r->n_buffers, r->total, r->next);
    conn_call_done(&reply);
    if (!ok) rc = error_set(GPUMEM_E_NOMEM, "out of memory");
    else if (rc == 0 && stuck)
      rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd's list pages do not advance");
  } while (rc == 0 && after);
  if (rc) {
    gpumem_list_free(l);
    return rc;
  }
  *out = l;
  return (int)l->nbuffers;
}

/* Free a list and its entries. */
void gpumem_list_free(struct gpumem_list *l) {
  if (!l) return;
  free_buffers(l->buffers, l->nbuffers);
  free(l);
}
