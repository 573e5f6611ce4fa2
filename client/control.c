/* Controller calls and the views of the daemon: pause, resume, status,
 * list. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"

/* Pause or resume; the reply's figures (or error details) go to result. */
static int run_op(gpumem_client *c, bool resume, const char *const *tags, size_t ntags,
                  const unsigned *devices, size_t ndevices, unsigned timeout_ms,
                  struct gpumem_op_result *result) {
  struct gpumem_op_result scratch;
  if (!result) result = &scratch;
  memset(result, 0, sizeof *result);
  if (!tags || ntags == 0) return client_fail(GPUMEM_E_INVALID, "no tags given");
  for (size_t i = 0; i < ntags; i++)
    if (!tags[i] || !wire_tag_valid(tags[i]))
      return client_fail(GPUMEM_E_INVALID, "invalid tag '%s'", tags[i] ? tags[i] : "(null)");
  if (ntags > WIRE_MAX_TAGS || ndevices > WIRE_MAX_DEVICES)
    return client_fail(GPUMEM_E_INVALID, "too many tags or devices");
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
    r.timeout_ms = timeout_ms;
    req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_RESUME;
    req.resume = &r;
  } else {
    p.tags = (char **)tags;
    p.n_tags = ntags;
    p.devices = devs;
    p.n_devices = ndevices;
    p.timeout_ms = timeout_ms;
    req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_PAUSE;
    req.pause = &p;
  }
  struct pending reply;
  int rc = client_call(c, &req, &reply);
  const wire_env *env = reply.env;
  if (rc < 0 && env && env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) {
    const Gpumem__Wire__Error *e = env->error;
    result->bytes_needed = e->bytes_needed;
    result->bytes_free = e->bytes_free;
    for (size_t i = 0; i < e->n_pids && i < 64; i++) result->pids[result->npids++] = e->pids[i];
  } else if (rc == 0 && env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY) {
    const Gpumem__Wire__OpReply *o = env->op_reply;
    result->buffers = o->buffers;
    result->bytes = o->bytes;
    result->backup_bytes = o->backup_bytes;
    result->skipped = o->skipped;
    result->elapsed_us = o->elapsed_us;
    result->backup_us = o->backup_us;
  } else if (rc == 0) {
    rc = client_fail(GPUMEM_E_PROTOCOL, "gpumemd answered with something else");
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

/* Ask for the status of devices, tags and sessions. */
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
  if (!s || !s->devices || !s->tags || !s->sessions) {
    gpumem_status_free(s);
    client_reply_free(&reply);
    return client_fail(GPUMEM_E_NOMEM, "out of memory");
  }
  snprintf(s->backend, sizeof s->backend, "%s", r->backend);
  s->granularity = r->granularity;
  s->ndevices = r->n_devices;
  for (size_t i = 0; i < r->n_devices; i++) {
    const Gpumem__Wire__DeviceInfo *d = r->devices[i];
    struct gpumem_device_status *o = &s->devices[i];
    o->index = d->index;
    o->total = d->total;
    o->free = d->free;
    o->managed = d->managed;
    uint64_t used = d->total > d->free ? d->total - d->free : 0;
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
