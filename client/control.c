/* Controller calls and the views of the daemon: pause, resume, status,
 * list. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"

/* Send a pause or resume and wait; the reply (OpReply or Error) stays in
 * *reply for the caller to read and free, also when the call failed. */
static int op_call(gpumem_client *c, bool resume, const char *const *tags, size_t ntags,
                   const unsigned *devices, size_t ndevices,
                   const struct gpumem_op_options *opts, struct pending *reply) {
  memset(reply, 0, sizeof *reply);
  if (!c) return client_fail(GPUMEM_E_INVALID, "no client");
  if (!tags || ntags == 0) return client_fail(GPUMEM_E_INVALID, "no tags given");
  if (ntags > WIRE_MAX_TAGS || ndevices > WIRE_MAX_DEVICES)
    return client_fail(GPUMEM_E_INVALID, "too many tags or devices");
  if (ndevices && !devices) return client_fail(GPUMEM_E_INVALID, "no device list given");
  for (size_t i = 0; i < ntags; i++)
    if (!tags[i] || !wire_tag_valid(tags[i]))
      return client_fail(GPUMEM_E_INVALID, "invalid tag '%s'", tags[i] ? tags[i] : "(null)");
  /* Copy what the caller's version of the struct has; the rest stays 0. */
  struct gpumem_op_options o;
  memset(&o, 0, sizeof o);
  if (opts) {
    if (opts->size < sizeof o.size)
      return client_fail(GPUMEM_E_INVALID, "options without their size");
    memcpy(&o, opts, opts->size < sizeof o ? opts->size : sizeof o);
  }
  if (resume && o.max_residual)
    return client_fail(GPUMEM_E_INVALID, "max_residual applies to pause only");
  uint32_t devs[WIRE_MAX_DEVICES];
  for (size_t i = 0; i < ndevices; i++) devs[i] = devices[i];
  Gpumem__Wire__PauseRequest p = GPUMEM__WIRE__PAUSE_REQUEST__INIT;
  Gpumem__Wire__ResumeRequest r = GPUMEM__WIRE__RESUME_REQUEST__INIT;
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  if (resume) {
    r.tags = (char **)tags;
    r.n_tags = ntags;
    r.devices = devs;
    r.n_devices = ndevices;
    r.timeout_ms = o.timeout_ms;
    req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_RESUME;
    req.resume = &r;
  } else {
    p.tags = (char **)tags;
    p.n_tags = ntags;
    p.devices = devs;
    p.n_devices = ndevices;
    p.timeout_ms = o.timeout_ms;
    p.max_residual = o.max_residual;
    req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_PAUSE;
    req.pause = &p;
  }
  int rc = client_call(c, &req, reply);
  const wire_env *env = reply->env;
  if (rc == 0 && env->body_case != GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY)
    rc = client_fail(GPUMEM_E_PROTOCOL, "gpumemd answered with something else");
  return rc;
}

/* The reply's figures (or error details) in the fixed-size summary. */
static void fill_result(const wire_env *env, struct gpumem_op_result *result) {
  if (!env) return;
  if (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) {
    const Gpumem__Wire__Error *e = env->error;
    result->bytes_needed = e->bytes_needed;
    result->bytes_free = e->bytes_free;
    size_t max = sizeof result->pids / sizeof result->pids[0];
    for (size_t i = 0; i < e->n_pids && i < max; i++) result->pids[result->npids++] = e->pids[i];
  } else if (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY) {
    const Gpumem__Wire__OpReply *o = env->op_reply;
    result->buffers = o->buffers;
    result->bytes = o->bytes;
    result->backup_bytes = o->backup_bytes;
    result->skipped = o->skipped;
    result->elapsed_us = o->elapsed_us;
    result->backup_us = o->backup_us;
  }
}

/* Pause or resume with the fixed-size summary of the answer. */
static int run_op(gpumem_client *c, bool resume, const char *const *tags, size_t ntags,
                  const unsigned *devices, size_t ndevices, unsigned timeout_ms,
                  struct gpumem_op_result *result) {
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.timeout_ms = timeout_ms;
  struct pending reply;
  int rc = op_call(c, resume, tags, ntags, devices, ndevices, &o, &reply);
  if (result) {
    memset(result, 0, sizeof *result);
    fill_result(reply.env, result);
  }
  client_reply_free(&reply);
  return rc;
}

/* Pause tags on the node. */
int gpumem_pause(gpumem_client *c, const char *const *tags, size_t ntags,
                 const unsigned *devices, size_t ndevices, unsigned timeout_ms,
                 struct gpumem_op_result *result) {
  return run_op(c, false, tags, ntags, devices, ndevices, timeout_ms, result);
}

/* Resume tags on the node, all or nothing. */
int gpumem_resume(gpumem_client *c, const char *const *tags, size_t ntags,
                  const unsigned *devices, size_t ndevices, unsigned timeout_ms,
                  struct gpumem_op_result *result) {
  return run_op(c, true, tags, ntags, devices, ndevices, timeout_ms, result);
}

/* Copy the driver's per-device figures into *out (n of them, malloc'd;
 * NULL when n is 0); false when out of memory. */
static bool copy_checks(struct gpumem_device_check **out, Gpumem__Wire__DeviceCheck *const *v,
                        size_t n) {
  *out = NULL;
  if (!n) return true;
  if (!(*out = calloc(n, sizeof **out))) return false;
  for (size_t i = 0; i < n; i++) {
    const Gpumem__Wire__DeviceCheck *d = v[i];
    struct gpumem_device_check *o = &(*out)[i];
    o->device = d->device;
    o->released = d->released;
    o->free_before = d->free_before;
    o->free_after = d->free_after;
    o->shortfall = d->shortfall;
    o->residual = d->residual;
    o->residual_known = d->residual_known;
  }
  return true;
}

/* Turn a pause or resume answer into a report; NULL when out of memory. */
static struct gpumem_op_report *report_new(const wire_env *env, int rc) {
  struct gpumem_op_report *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  r->error = rc;
  r->code = wire_code_name(GPUMEM__WIRE__ERROR_CODE__OK);
  bool ok = true;
  if (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) {
    const Gpumem__Wire__Error *e = env->error;
    r->code = wire_code_name(e->code);
    r->message = strdup(e->message ? e->message : "");
    r->bytes_needed = e->bytes_needed;
    r->bytes_free = e->bytes_free;
    r->buffers_held = e->buffers_held;
    r->bytes_held = e->bytes_held;
    if (e->n_pids) {
      r->pids = calloc(e->n_pids, sizeof *r->pids);
      if (r->pids) {
        r->npids = e->n_pids;
        memcpy(r->pids, e->pids, e->n_pids * sizeof *r->pids);
      }
      ok = r->pids != NULL;
    }
    ok = ok && r->message && copy_checks(&r->checks, e->checks, e->n_checks);
    r->nchecks = r->checks ? e->n_checks : 0;
  } else {
    const Gpumem__Wire__OpReply *o = env->op_reply;
    r->message = strdup("");
    r->buffers = o->buffers;
    r->bytes = o->bytes;
    r->backup_bytes = o->backup_bytes;
    r->skipped = o->skipped;
    r->elapsed_us = o->elapsed_us;
    r->backup_us = o->backup_us;
    ok = r->message && copy_checks(&r->checks, o->checks, o->n_checks);
    r->nchecks = r->checks ? o->n_checks : 0;
    if (ok && o->n_detail) {
      r->details = calloc(o->n_detail, sizeof *r->details);
      ok = r->details != NULL;
      for (size_t i = 0; ok && i < o->n_detail; i++) {
        const Gpumem__Wire__TagDeviceBytes *t = o->detail[i];
        struct gpumem_op_detail *d = &r->details[r->ndetails++];
        d->tag = strdup(t->tag ? t->tag : "");
        d->device = t->device;
        d->buffers = t->buffers;
        d->bytes = t->bytes;
        ok = d->tag != NULL;
      }
    }
  }
  if (!ok) {
    gpumem_op_report_free(r);
    return NULL;
  }
  return r;
}

/* Pause or resume with options, the whole answer going to *report. */
static int run_op_ex(gpumem_client *c, bool resume, const char *const *tags, size_t ntags,
                     const unsigned *devices, size_t ndevices,
                     const struct gpumem_op_options *opts, struct gpumem_op_report **report) {
  if (report) *report = NULL;
  struct pending reply;
  int rc = op_call(c, resume, tags, ntags, devices, ndevices, opts, &reply);
  const wire_env *env = reply.env;
  bool answered = env && (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR ||
                          env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY);
  if (report && answered) {
    *report = report_new(env, rc);
    /* The operation happened either way: say so rather than hide it. */
    if (!*report)
      rc = client_fail(GPUMEM_E_NOMEM, "out of memory for the report of a %s that %s",
                       resume ? "resume" : "pause", rc == 0 ? "succeeded" : "failed");
  }
  client_reply_free(&reply);
  return rc;
}

/* Pause tags on the node, with options and the whole answer. */
int gpumem_pause_ex(gpumem_client *c, const char *const *tags, size_t ntags,
                    const unsigned *devices, size_t ndevices,
                    const struct gpumem_op_options *opts, struct gpumem_op_report **report) {
  return run_op_ex(c, false, tags, ntags, devices, ndevices, opts, report);
}

/* Resume tags on the node, with options and the whole answer. */
int gpumem_resume_ex(gpumem_client *c, const char *const *tags, size_t ntags,
                     const unsigned *devices, size_t ndevices,
                     const struct gpumem_op_options *opts, struct gpumem_op_report **report) {
  return run_op_ex(c, true, tags, ntags, devices, ndevices, opts, report);
}

/* Free a report and everything it points to. */
void gpumem_op_report_free(struct gpumem_op_report *r) {
  if (!r) return;
  free((char *)r->message);
  free(r->pids);
  free(r->checks);
  for (size_t i = 0; i < r->ndetails; i++) free((char *)r->details[i].tag);
  free(r->details);
  free(r);
}

/* Send a request with an empty body and check the reply's kind. */
static int simple_call(gpumem_client *c, Gpumem__Wire__Envelope__BodyCase ask,
                       Gpumem__Wire__Envelope__BodyCase want, struct pending *reply) {
  Gpumem__Wire__StatusRequest sr = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  Gpumem__Wire__ListRequest lr = GPUMEM__WIRE__LIST_REQUEST__INIT;
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  req.body_case = ask;
  if (ask == GPUMEM__WIRE__ENVELOPE__BODY_STATUS)
    req.status = &sr;
  else
    req.list = &lr;
  int rc = client_call(c, &req, reply);
  if (rc == 0 && reply->env->body_case != want)
    rc = client_fail(GPUMEM_E_PROTOCOL, "gpumemd answered with something else");
  if (rc < 0) client_reply_free(reply);
  return rc;
}

/* Copy the driver's process list into s; false when out of memory. */
static bool copy_processes(struct gpumem_status *s, const Gpumem__Wire__StatusReply *r) {
  s->processes_known = r->processes_known;
  s->processes = calloc(r->n_processes + 1, sizeof *s->processes);
  if (!s->processes) return false;
  s->nprocesses = r->n_processes;
  for (size_t i = 0; i < r->n_processes; i++) {
    const Gpumem__Wire__ProcessMemory *p = r->processes[i];
    struct gpumem_process_status *o = &s->processes[i];
    o->pid = p->pid;
    o->device = p->device;
    o->used = p->used;
    o->managed = p->managed;
    o->residual = p->residual;
    o->session_id = p->session_id;
    o->name = strdup(p->name ? p->name : "");
    if (!o->name) return false;
  }
  return true;
}

/* Ask for the status of devices, tags, sessions and processes. */
int gpumem_status(gpumem_client *c, struct gpumem_status **out) {
  struct pending reply;
  int rc = simple_call(c, GPUMEM__WIRE__ENVELOPE__BODY_STATUS,
                       GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY, &reply);
  if (rc < 0) return rc;
  const Gpumem__Wire__StatusReply *r = reply.env->status_reply;
  struct gpumem_status *s = calloc(1, sizeof *s);
  if (s) {
    s->devices = calloc(r->n_devices + 1, sizeof *s->devices);
    s->tags = calloc(r->n_tags + 1, sizeof *s->tags);
    s->sessions = calloc(r->n_sessions + 1, sizeof *s->sessions);
  }
  if (!s || !s->devices || !s->tags || !s->sessions || !copy_processes(s, r) ||
      !copy_checks(&s->last_pause_checks, r->last_pause_checks, r->n_last_pause_checks)) {
    gpumem_status_free(s);
    client_reply_free(&reply);
    return client_fail(GPUMEM_E_NOMEM, "out of memory");
  }
  snprintf(s->backend, sizeof s->backend, "%s", r->backend);
  s->granularity = r->granularity;
  s->ndevices = r->n_devices;
  s->nlast_pause_checks = r->n_last_pause_checks;
  for (size_t i = 0; i < r->n_devices; i++) {
    const Gpumem__Wire__DeviceInfo *d = r->devices[i];
    struct gpumem_device_status *o = &s->devices[i];
    o->index = d->index;
    o->total = d->total;
    o->free = d->free;
    o->managed = d->managed;
    o->reserved = d->reserved;
    /* The driver's reserve is not a process's memory: leave it out. */
    uint64_t taken = d->free + d->reserved;
    uint64_t used = d->total > taken ? d->total - taken : 0;
    o->unmanaged = used > d->managed ? used - d->managed : 0;
    o->daemon_context = d->daemon_context;
    snprintf(o->bus_id, sizeof o->bus_id, "%s", d->bus_id);
  }
  s->backup_reserved = r->backup_reserved;
  s->backup_limit = r->backup_limit;
  s->last_backup_bytes = r->last_backup_bytes;
  s->last_backup_us = r->last_backup_us;
  s->last_restore_bytes = r->last_restore_bytes;
  s->last_restore_us = r->last_restore_us;
  s->ntags = r->n_tags;
  for (size_t i = 0; i < r->n_tags; i++) {
    const Gpumem__Wire__TagInfo *t = r->tags[i];
    struct gpumem_tag_status *o = &s->tags[i];
    snprintf(o->name, sizeof o->name, "%s", t->name);
    o->state = t->state;
    o->buffers = t->buffers;
    o->bytes = t->bytes;
    o->backup_bytes = t->backup_bytes;
    o->paused_buffers = t->paused_buffers;
    o->paused_bytes = t->paused_bytes;
    o->mixed = t->mixed;
    o->transit_buffers = t->transit_buffers;
    o->transit_bytes = t->transit_bytes;
  }
  s->nsessions = r->n_sessions;
  for (size_t i = 0; i < r->n_sessions; i++) {
    const Gpumem__Wire__SessionInfo *x = r->sessions[i];
    struct gpumem_session_status *o = &s->sessions[i];
    o->id = x->id;
    o->pid = x->pid;
    o->uid = x->uid;
    snprintf(o->name, sizeof o->name, "%s", x->name);
    o->role = x->role;
    o->buffers = x->buffers;
    o->bytes = x->bytes;
    o->residual = x->residual;
    o->residual_known = x->residual_known;
  }
  client_reply_free(&reply);
  *out = s;
  return 0;
}

/* Free a status. */
void gpumem_status_free(struct gpumem_status *s) {
  if (!s) return;
  free(s->devices);
  free(s->tags);
  free(s->sessions);
  for (size_t i = 0; s->processes && i < s->nprocesses; i++)
    free((char *)s->processes[i].name);
  free(s->processes);
  free(s->last_pause_checks);
  free(s);
}

/* List the buffers this session may see. */
int gpumem_list(gpumem_client *c, struct gpumem_buffer_info **out) {
  struct pending reply;
  int rc = simple_call(c, GPUMEM__WIRE__ENVELOPE__BODY_LIST,
                       GPUMEM__WIRE__ENVELOPE__BODY_LIST_REPLY, &reply);
  if (rc < 0) return rc;
  const Gpumem__Wire__ListReply *r = reply.env->list_reply;
  struct gpumem_buffer_info *v = calloc(r->n_buffers + 1, sizeof *v);
  if (!v) {
    client_reply_free(&reply);
    return client_fail(GPUMEM_E_NOMEM, "out of memory");
  }
  for (size_t i = 0; i < r->n_buffers; i++) {
    const Gpumem__Wire__BufferInfo *b = r->buffers[i];
    v[i].id = b->id;
    v[i].session_id = b->session_id;
    v[i].pid = b->pid;
    snprintf(v[i].tag, sizeof v[i].tag, "%s", b->tag);
    v[i].device = b->device;
    v[i].size = b->size;
    v[i].flags = b->flags;
    v[i].state = b->state;
  }
  int n = (int)r->n_buffers;
  client_reply_free(&reply);
  *out = v;
  return n;
}

/* Free a list. */
void gpumem_list_free(struct gpumem_buffer_info *list) { free(list); }
