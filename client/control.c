/* Controller calls and the views of the daemon: pause, resume, status,
 * list, with every device number turned into the caller's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"
#include "error.h"

/* A session prefix must be one a session name could start with. */
static int check_prefix(const char *prefix) {
  if (strlen(prefix) > WIRE_NAME_MAX)
    return error_set(GPUMEM_E_INVALID, "session prefix longer than %d bytes", WIRE_NAME_MAX);
  if (!wire_name_valid(prefix))
    return error_set(GPUMEM_E_INVALID,
                       "session prefix is not UTF-8 text without control characters");
  return 0;
}

/* Check a pause's or resume's arguments and options (copied into *o as
 * far as the caller's struct goes) before anything is sent. */
static int op_check(bool resume, const char *const *tags, size_t ntags, const int *devices,
                    size_t ndevices, const struct gpumem_op_options *opts,
                    struct gpumem_op_options *o) {
  if (ntags && !tags) return error_set(GPUMEM_E_INVALID, "no tag list given");
  if (ntags > WIRE_MAX_TAGS)
    return error_set(GPUMEM_E_INVALID, "too many tags (%zu, at most %d)", ntags, WIRE_MAX_TAGS);
  for (size_t i = 0; i < ntags; i++)
    if (!tags[i] || !wire_tag_valid(tags[i]))
      return error_set(GPUMEM_E_INVALID, "invalid tag '%.64s': 1-%d characters of [A-Za-z0-9_.-]",
                         tags[i] ? tags[i] : "(null)", WIRE_TAG_MAX);
  if (ndevices && !devices) return error_set(GPUMEM_E_INVALID, "no device list given");
  if (ndevices > GPUMEM_MAX_DEVICES)
    return error_set(GPUMEM_E_INVALID, "too many devices (%zu, at most %d)", ndevices,
                       GPUMEM_MAX_DEVICES);
  /* Copy what the caller's version of the struct has; the rest stays 0. */
  memset(o, 0, sizeof *o);
  if (opts) {
    if (opts->size < sizeof o->size)
      return error_set(GPUMEM_E_INVALID, "options without their size");
    memcpy(o, opts, opts->size < sizeof *o ? opts->size : sizeof *o);
  }
  o->size = sizeof *o;
  if (resume && o->max_residual)
    return error_set(GPUMEM_E_INVALID, "max_residual applies to pause only");
  if (o->scope != GPUMEM_SCOPE_NODE && o->scope != GPUMEM_SCOPE_OWN)
    return error_set(GPUMEM_E_INVALID, "unknown scope %d", o->scope);
  if (o->npids && !o->pids) return error_set(GPUMEM_E_INVALID, "no pid list given");
  if (o->npids > WIRE_MAX_PIDS)
    return error_set(GPUMEM_E_INVALID, "too many pids (%zu, at most %d)", o->npids,
                       WIRE_MAX_PIDS);
  for (size_t i = 0; i < o->npids; i++)
    if (o->pids[i] == 0) return error_set(GPUMEM_E_INVALID, "pid 0 names no process");
  if (o->session_prefix && !*o->session_prefix) o->session_prefix = NULL;
  if (o->session_prefix && check_prefix(o->session_prefix) < 0) return GPUMEM_E_INVALID;
  if (o->scope == GPUMEM_SCOPE_OWN && (o->npids || o->session_prefix))
    return error_set(GPUMEM_E_INVALID,
                       "scope OWN covers this client's buffers only: no pids or session prefix");
  return 0;
}

/* Turn the caller's device numbers into the daemon's. */
static int op_devices(gpumem_client *c, const int *devices, size_t n, uint32_t *out) {
  int map[GPUMEM_MAX_DEVICES];
  unsigned count = hello_local_map(c->hello, map);
  for (size_t i = 0; i < n; i++) {
    int d = hello_node_device(map, devices[i]);
    if (d < 0)
      return error_set(GPUMEM_E_INVALID,
                         "device %d is not one of the %u gpumemd devices this process sees",
                         devices[i], count);
    out[i] = (uint32_t)d;
  }
  return 0;
}

/* Send a pause or resume and wait; the reply (OpReply or Error) stays in
 * *reply for the caller to read and free, also when the call failed. */
static int op_call(gpumem_client *c, bool resume, const char *const *tags, size_t ntags,
                   const int *devices, size_t ndevices, const struct gpumem_op_options *opts,
                   struct call *reply) {
  memset(reply, 0, sizeof *reply);
  if (!c) return error_set(GPUMEM_E_INVALID, "no client");
  struct gpumem_op_options o;
  int rc = op_check(resume, tags, ntags, devices, ndevices, opts, &o);
  uint32_t devs[GPUMEM_MAX_DEVICES];
  if (rc == 0) rc = op_devices(c, devices, ndevices, devs);
  if (rc < 0) return rc;
  Gpumem__Wire__PauseRequest p = GPUMEM__WIRE__PAUSE_REQUEST__INIT;
  Gpumem__Wire__ResumeRequest r = GPUMEM__WIRE__RESUME_REQUEST__INIT;
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  if (resume) {
    r.tags = (char **)tags;
    r.n_tags = ntags;
    r.devices = devs;
    r.n_devices = ndevices;
    r.timeout_ms = o.timeout_ms;
    r.pids = (uint32_t *)o.pids;
    r.n_pids = o.npids;
    r.session_prefix = (char *)(o.session_prefix ? o.session_prefix : "");
    r.own = o.scope == GPUMEM_SCOPE_OWN;
    req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_RESUME;
    req.resume = &r;
  } else {
    p.tags = (char **)tags;
    p.n_tags = ntags;
    p.devices = devs;
    p.n_devices = ndevices;
    p.timeout_ms = o.timeout_ms;
    p.max_residual = o.max_residual;
    p.pids = (uint32_t *)o.pids;
    p.n_pids = o.npids;
    p.session_prefix = (char *)(o.session_prefix ? o.session_prefix : "");
    p.own = o.scope == GPUMEM_SCOPE_OWN;
    req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_PAUSE;
    req.pause = &p;
  }
  /* The daemon may wait this long for owners before it answers. */
  reply->extra_ms = o.timeout_ms && o.timeout_ms < GPUMEM_OWNER_TIMEOUT_MAX_MS
                       ? o.timeout_ms
                       : GPUMEM_OWNER_TIMEOUT_MAX_MS;
  rc = conn_call(c->conn, &req, reply);
  const wire_env *env = reply->reply;
  if (rc == 0 && env->body_case != GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY)
    rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered with something else");
  return rc;
}

/* A zeroed struct of sz bytes whose first field, its size, is set. */
static void *sized(size_t sz) {
  size_t *p = calloc(1, sz);
  if (p) *p = sz;
  return p;
}

/* A copy of a string from a reply ("" for none). */
static char *dup_text(const char *s) { return strdup(s ? s : ""); }

/* Free an array of n malloc'd elements and the array. */
static void free_array(void **v, size_t n) {
  for (size_t i = 0; v && i < n; i++) free(v[i]);
  free(v);
}

/* Copy the driver's per-device figures into *out (n of them; NULL when n
 * is 0), *nout counting those made; false when out of memory. */
static bool copy_checks(const int *map, struct gpumem_device_check ***out, size_t *nout,
                        Gpumem__Wire__DeviceCheck *const *v, size_t n) {
  *out = NULL;
  *nout = 0;
  if (!n) return true;
  if (!(*out = calloc(n, sizeof **out))) return false;
  for (size_t i = 0; i < n; i++) {
    const Gpumem__Wire__DeviceCheck *d = v[i];
    struct gpumem_device_check *o = sized(sizeof *o);
    if (!o) return false;
    (*out)[(*nout)++] = o;
    o->device = hello_local_device(map, d->device);
    o->node_device = d->device;
    o->released = d->released;
    o->free_before = d->free_before;
    o->free_after = d->free_after;
    o->shortfall = d->shortfall;
    o->residual = d->residual;
    o->residual_known = d->residual_known;
  }
  return true;
}

/* Copy an OpReply's per tag and device figures into r; false when out of
 * memory. */
static bool copy_details(const int *map, struct gpumem_op_report *r,
                         const Gpumem__Wire__OpReply *o) {
  if (!o->n_detail) return true;
  if (!(r->details = calloc(o->n_detail, sizeof *r->details))) return false;
  for (size_t i = 0; i < o->n_detail; i++) {
    const Gpumem__Wire__TagDeviceBytes *t = o->detail[i];
    struct gpumem_op_detail *d = sized(sizeof *d);
    if (!d) return false;
    r->details[r->ndetails++] = d;
    d->device = hello_local_device(map, t->device);
    d->node_device = t->device;
    d->buffers = t->buffers;
    d->bytes = t->bytes;
    if (!(d->tag = dup_text(t->tag))) return false;
  }
  return true;
}

/* Turn a pause or resume answer into a report; NULL when out of memory. */
static struct gpumem_op_report *report_new(gpumem_client *c, const wire_env *env, int rc) {
  struct gpumem_op_report *r = sized(sizeof *r);
  if (!r) return NULL;
  int map[GPUMEM_MAX_DEVICES];
  hello_local_map(c->hello, map);
  r->error = rc;
  bool ok;
  if (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) {
    const Gpumem__Wire__Error *e = env->error;
    r->code = wire_code_name(e->code);
    r->message = dup_text(e->message);
    r->bytes_needed = e->bytes_needed;
    r->bytes_free = e->bytes_free;
    r->buffers_held = e->buffers_held;
    r->bytes_held = e->bytes_held;
    ok = r->message != NULL;
    if (ok && e->n_pids) {
      r->pids = calloc(e->n_pids, sizeof *r->pids);
      if (r->pids) {
        r->npids = e->n_pids;
        memcpy(r->pids, e->pids, e->n_pids * sizeof *r->pids);
      }
      ok = r->pids != NULL;
    }
    ok = ok && copy_checks(map, &r->checks, &r->nchecks, e->checks, e->n_checks);
  } else {
    const Gpumem__Wire__OpReply *o = env->op_reply;
    r->code = wire_code_name(GPUMEM__WIRE__ERROR_CODE__OK);
    r->message = dup_text("");
    r->buffers = o->buffers;
    r->bytes = o->bytes;
    r->backup_bytes = o->backup_bytes;
    r->skipped = o->skipped;
    r->elapsed_us = o->elapsed_us;
    r->backup_us = o->backup_us;
    ok = r->message && copy_checks(map, &r->checks, &r->nchecks, o->checks, o->n_checks) &&
         copy_details(map, r, o);
  }
  if (!ok) {
    gpumem_op_report_free(r);
    return NULL;
  }
  return r;
}

/* Pause or resume, the whole answer going to *report. */
static int run_op(gpumem_client *c, bool resume, const char *const *tags, size_t ntags,
                  const int *devices, size_t ndevices, const struct gpumem_op_options *opts,
                  struct gpumem_op_report **report) {
  if (report) *report = NULL;
  struct call reply;
  int rc = op_call(c, resume, tags, ntags, devices, ndevices, opts, &reply);
  const wire_env *env = reply.reply;
  bool answered = env && (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR ||
                          env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY);
  if (report && answered) {
    char words[320];
    snprintf(words, sizeof words, "%s", gpumem_last_error());
    *report = report_new(c, env, rc);
    /* The operation happened either way: say so rather than hide it. */
    if (!*report)
      rc = error_set(GPUMEM_E_NOMEM, "out of memory for the report of a %s that %s",
                       resume ? "resume" : "pause", rc == 0 ? "succeeded" : "failed");
    else
      error_set(rc, "%s", words);
  }
  conn_call_done(&reply);
  return rc;
}

/* Pause buffers within a scope, with the whole answer. */
int gpumem_pause(gpumem_client *c, const char *const *tags, size_t ntags, const int *devices,
                 size_t ndevices, const struct gpumem_op_options *opts,
                 struct gpumem_op_report **report) {
  return run_op(c, false, tags, ntags, devices, ndevices, opts, report);
}

/* Resume buffers within a scope, all or nothing, with the whole answer. */
int gpumem_resume(gpumem_client *c, const char *const *tags, size_t ntags, const int *devices,
                  size_t ndevices, const struct gpumem_op_options *opts,
                  struct gpumem_op_report **report) {
  return run_op(c, true, tags, ntags, devices, ndevices, opts, report);
}

/* Free a report and everything it points to. */
void gpumem_op_report_free(struct gpumem_op_report *r) {
  if (!r) return;
  free((char *)r->message);
  free(r->pids);
  free_array((void **)r->checks, r->nchecks);
  for (size_t i = 0; r->details && i < r->ndetails; i++) free((char *)r->details[i]->tag);
  free_array((void **)r->details, r->ndetails);
  free(r);
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
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_STATUS;
  req.status = &sr;
  return call_for(c, &req, GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY, reply);
}

/* Ask for the page of the list after a buffer id. */
static int list_page(gpumem_client *c, uint64_t after, struct call *reply) {
  Gpumem__Wire__ListRequest lr = GPUMEM__WIRE__LIST_REQUEST__INIT;
  lr.after = after;
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_LIST;
  req.list = &lr;
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
    struct gpumem_device_status *o = sized(sizeof *o);
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
    if (!(o->bus_id = dup_text(d->bus_id))) return false;
  }
  return true;
}

/* Add a status page's tags to s; false when out of memory. */
static bool copy_tags(struct gpumem_status *s, const Gpumem__Wire__StatusReply *r) {
  if (!grow((void ***)&s->tags, s->ntags, r->n_tags)) return false;
  for (size_t i = 0; i < r->n_tags; i++) {
    const Gpumem__Wire__TagInfo *t = r->tags[i];
    struct gpumem_tag_status *o = sized(sizeof *o);
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
    if (!(o->name = dup_text(t->name))) return false;
  }
  return true;
}

/* Add a status page's sessions to s; false when out of memory. */
static bool copy_sessions(struct gpumem_status *s, const Gpumem__Wire__StatusReply *r) {
  if (!grow((void ***)&s->sessions, s->nsessions, r->n_sessions)) return false;
  for (size_t i = 0; i < r->n_sessions; i++) {
    const Gpumem__Wire__SessionInfo *x = r->sessions[i];
    struct gpumem_session_status *o = sized(sizeof *o);
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
    if (!(o->name = dup_text(x->name))) return false;
  }
  return true;
}

/* Copy the driver's process list into s; false when out of memory. */
static bool copy_processes(const int *map, struct gpumem_status *s,
                           const Gpumem__Wire__StatusReply *r) {
  s->processes_known = r->processes_known;
  if (!(s->processes = calloc(r->n_processes + 1, sizeof *s->processes))) return false;
  for (size_t i = 0; i < r->n_processes; i++) {
    const Gpumem__Wire__ProcessMemory *p = r->processes[i];
    struct gpumem_process_status *o = sized(sizeof *o);
    if (!o) return false;
    s->processes[s->nprocesses++] = o;
    o->pid = p->pid;
    o->device = hello_local_device(map, p->device);
    o->node_device = p->device;
    o->used = p->used;
    o->managed = p->managed;
    o->residual = p->residual;
    o->session_id = p->session_id;
    if (!(o->name = dup_text(p->name))) return false;
  }
  return true;
}

/* The name of an operation's kind. */
static const char *op_name(bool resume) { return resume ? "resume" : "pause"; }

/* Copy counts into *out (op "" for errors); names are the protocol's own
 * static strings. False when out of memory. */
static bool copy_counts(struct gpumem_counter ***out, size_t *nout,
                        Gpumem__Wire__OpCount *const *v, size_t n, bool errors) {
  if (!(*out = calloc(n + 1, sizeof **out))) return false;
  for (size_t i = 0; i < n; i++) {
    struct gpumem_counter *o = sized(sizeof *o);
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
    struct gpumem_histogram *o = sized(sizeof *o);
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
    struct gpumem_op_record *o = sized(sizeof *o);
    if (!o) return false;
    s->recent_ops[s->nrecent_ops++] = o;
    const char **tags = calloc(x->n_tags + 1, sizeof *tags);
    o->tags = tags;
    if (!tags) return false;
    for (; o->ntags < x->n_tags; o->ntags++)
      if (!(tags[o->ntags] = dup_text(x->tags[o->ntags]))) return false;
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
    struct gpumem_tenant_status *o = sized(sizeof *o);
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
                       uint64_t next_session) {
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
    next_tag = next_tag ? r->next_tag : 0;
    next_session = next_session ? r->next_session : 0;
    conn_call_done(&reply);
    if (!ok) return error_set(GPUMEM_E_NOMEM, "out of memory");
    if (stuck) return error_set(GPUMEM_E_PROTOCOL, "gpumemd's status pages do not advance");
  }
  return 0;
}

/* Ask for the status of devices, tags, sessions and processes. */
int gpumem_status(gpumem_client *c, struct gpumem_status **out) {
  if (!c || !out) return error_set(GPUMEM_E_INVALID, "no client or no place for the status");
  struct call reply;
  int rc = status_page(c, 0, 0, &reply);
  if (rc < 0) return rc;
  const Gpumem__Wire__StatusReply *r = reply.reply->status_reply;
  int map[GPUMEM_MAX_DEVICES];
  hello_local_map(c->hello, map);
  struct gpumem_status *s = sized(sizeof *s);
  if (!s || !(s->backend = dup_text(r->backend)) || !(s->version = dup_text(r->version)) || !copy_devices(map, s, r) ||
      !copy_tags(s, r) || !copy_sessions(s, r) || !copy_processes(map, s, r) ||
      !copy_checks(map, &s->last_pause_checks, &s->nlast_pause_checks, r->last_pause_checks,
                   r->n_last_pause_checks) ||
      !copy_figures(s, r) || !copy_tenants(s, r)) {
    gpumem_status_free(s);
    conn_call_done(&reply);
    return error_set(GPUMEM_E_NOMEM, "out of memory");
  }
  uint64_t next_tag = r->next_tag, next_session = r->next_session;
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
  conn_call_done(&reply);
  if ((rc = status_rest(c, s, next_tag, next_session)) < 0) {
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
  free_array((void **)s->devices, s->ndevices);
  for (size_t i = 0; s->tags && i < s->ntags; i++) free((char *)s->tags[i]->name);
  free_array((void **)s->tags, s->ntags);
  for (size_t i = 0; s->sessions && i < s->nsessions; i++) free((char *)s->sessions[i]->name);
  free_array((void **)s->sessions, s->nsessions);
  for (size_t i = 0; s->processes && i < s->nprocesses; i++)
    free((char *)s->processes[i]->name);
  free_array((void **)s->processes, s->nprocesses);
  free_array((void **)s->last_pause_checks, s->nlast_pause_checks);
  free_array((void **)s->op_counts, s->nop_counts);
  free_array((void **)s->error_counts, s->nerror_counts);
  for (size_t i = 0; s->histograms && i < s->nhistograms; i++) {
    free((uint64_t *)s->histograms[i]->le_us);
    free((uint64_t *)s->histograms[i]->count);
  }
  free_array((void **)s->histograms, s->nhistograms);
  for (size_t i = 0; s->recent_ops && i < s->nrecent_ops; i++) {
    for (size_t k = 0; k < s->recent_ops[i]->ntags; k++) free((char *)s->recent_ops[i]->tags[k]);
    free((char **)s->recent_ops[i]->tags);
  }
  free_array((void **)s->recent_ops, s->nrecent_ops);
  for (size_t i = 0; s->tenants && i < s->ntenants; i++) free((uint64_t *)s->tenants[i]->device_bytes);
  free_array((void **)s->tenants, s->ntenants);
  free((char *)s->backend);
  free((char *)s->version);
  free(s);
}

/* Add a list page's buffers to l; false when out of memory. */
static bool copy_buffers(const int *map, struct gpumem_list *l, const Gpumem__Wire__ListReply *r) {
  if (!grow((void ***)&l->buffers, l->nbuffers, r->n_buffers)) return false;
  for (size_t i = 0; i < r->n_buffers; i++) {
    const Gpumem__Wire__BufferInfo *b = r->buffers[i];
    struct gpumem_buffer_info *o = sized(sizeof *o);
    if (!o) return false;
    l->buffers[l->nbuffers++] = o;
    o->id = b->id;
    o->session_id = b->session_id;
    o->pid = b->pid;
    o->device = hello_local_device(map, b->device);
    o->node_device = b->device;
    o->bytes = b->size;
    o->flags = b->flags;
    o->state = b->state;
    if (!(o->tag = dup_text(b->tag))) return false;
  }
  return true;
}

/* List the buffers this session may see, page after page. */
int gpumem_list(gpumem_client *c, struct gpumem_list **out) {
  if (!c || !out) return error_set(GPUMEM_E_INVALID, "no client or no place for the list");
  int map[GPUMEM_MAX_DEVICES];
  hello_local_map(c->hello, map);
  struct gpumem_list *l = sized(sizeof *l);
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
    conn_call_done(&reply);
    if (!ok) rc = error_set(GPUMEM_E_NOMEM, "out of memory");
    else if (stuck) rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd's list pages do not advance");
  } while (rc == 0 && after);
  if (rc < 0) {
    gpumem_list_free(l);
    return rc;
  }
  *out = l;
  return (int)l->nbuffers;
}

/* Share a tag with every uid, or take that back. */
int gpumem_share(gpumem_client *c, const char *tag, int shared) {
  if (!c || !tag) return error_set(GPUMEM_E_INVALID, "no client or no tag");
  if (!wire_tag_valid(tag))
    return error_set(GPUMEM_E_INVALID, "invalid tag: 1-%d characters of [A-Za-z0-9_.-]",
                       WIRE_TAG_MAX);
  unsigned minor = hello_minor(c->hello);
  if (minor < 4) /* an older daemon would end the session on a message it does not know */
    return error_set(GPUMEM_E_VERSION, "sharing a tag needs gpumemd 1.4 or later (it speaks 1.%u)",
                       minor);
  Gpumem__Wire__ShareRequest q = GPUMEM__WIRE__SHARE_REQUEST__INIT;
  q.tag = (char *)tag;
  q.shared = shared != 0;
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_SHARE;
  req.share = &q;
  struct call reply;
  int rc = call_for(c, &req, GPUMEM__WIRE__ENVELOPE__BODY_SHARE_REPLY, &reply);
  if (rc == 0) conn_call_done(&reply);
  return rc;
}

/* Free a list and its entries. */
void gpumem_list_free(struct gpumem_list *l) {
  if (!l) return;
  for (size_t i = 0; l->buffers && i < l->nbuffers; i++) free((char *)l->buffers[i]->tag);
  free_array((void **)l->buffers, l->nbuffers);
  free(l);
}
