/* Controller calls: pause and resume (with their whole answers) and the
 * sharing of tags, with every device number turned into the daemon's on
 * the way out and into the caller's on the way back. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"
#include "error.h"
#include "results.h"

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
  if (resume && o->release_context)
    return error_set(GPUMEM_E_INVALID, "release_context applies to pause only");
  if (!resume && o->wait_ms) return error_set(GPUMEM_E_INVALID, "wait_ms applies to resume only");
  if (o->wait_ms > WIRE_MAX_WAIT_MS)
    return error_set(GPUMEM_E_INVALID, "wait_ms %u: at most %d", o->wait_ms, WIRE_MAX_WAIT_MS);
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

/* Set the fields that a PauseRequest and a ResumeRequest share (two message
 * types with the same names: C fills both alike only through a macro). */
#define OP_REQUEST_SET(m, tg, ntg, dv, ndv, op)                                         \
  do {                                                                                  \
    (m).tags = (char **)(tg);                                                           \
    (m).n_tags = (ntg);                                                                 \
    (m).devices = (dv);                                                                 \
    (m).n_devices = (ndv);                                                              \
    (m).timeout_ms = (op).timeout_ms;                                                   \
    (m).pids = (uint32_t *)(op).pids;                                                   \
    (m).n_pids = (op).npids;                                                            \
    (m).session_prefix = (char *)((op).session_prefix ? (op).session_prefix : "");      \
    (m).own = (op).scope == GPUMEM_SCOPE_OWN;                                           \
  } while (0)

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
  wire_env req;
  if (resume) {
    OP_REQUEST_SET(r, tags, ntags, devs, ndevices, o);
    r.wait_ms = o.wait_ms;
    if (o.wait_ms && hello_minor(c->hello) < 10) /* an older daemon would fail at once */
      return error_set(GPUMEM_E_VERSION, "wait_ms needs gpumemd 1.10 or later (it speaks 1.%u)",
                       hello_minor(c->hello));
    req = wire_envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_RESUME, &r);
  } else {
    OP_REQUEST_SET(p, tags, ntags, devs, ndevices, o);
    p.max_residual = o.max_residual;
    p.release_context = o.release_context != 0;
    unsigned minor = hello_minor(c->hello);
    if (p.release_context && minor < 6) /* an older daemon would pause and release nothing */
      return error_set(GPUMEM_E_VERSION,
                       "release_context needs gpumemd 1.6 or later (it speaks 1.%u)", minor);
    req = wire_envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_PAUSE, &p);
  }
  /* The daemon may wait this long for owners before it answers. */
  reply->extra_ms = (o.timeout_ms && o.timeout_ms < GPUMEM_OWNER_TIMEOUT_MAX_MS
                        ? o.timeout_ms
                        : GPUMEM_OWNER_TIMEOUT_MAX_MS) +
                   o.wait_ms;
  rc = conn_call(c->conn, &req, reply);
  const wire_env *env = reply->reply;
  if (rc == 0 && env->body_case != GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY)
    rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered with something else");
  return rc;
}

/* Copy an OpReply's per tag and device figures into r; false when out of
 * memory. */
static bool copy_details(const int *map, struct gpumem_op_report *r,
                         const Gpumem__Wire__OpReply *o) {
  if (!o->n_detail) return true;
  if (!(r->details = calloc(o->n_detail, sizeof *r->details))) return false;
  for (size_t i = 0; i < o->n_detail; i++) {
    const Gpumem__Wire__TagDeviceBytes *t = o->detail[i];
    struct gpumem_op_detail *d = results_sized(sizeof *d);
    if (!d) return false;
    r->details[r->ndetails++] = d;
    d->device = hello_local_device(map, t->device);
    d->node_device = t->device;
    d->buffers = t->buffers;
    d->bytes = t->bytes;
    if (!(d->tag = results_text(t->tag))) return false;
  }
  return true;
}

/* Copy the releases of an answer into r; false when out of memory. */
static bool copy_releases(struct gpumem_op_report *r, Gpumem__Wire__ProcessRelease *const *v,
                          size_t n) {
  if (!n) return true;
  if (!(r->releases = calloc(n, sizeof *r->releases))) return false;
  for (size_t i = 0; i < n; i++) {
    struct gpumem_process_release *x = results_sized(sizeof *x);
    if (!x) return false;
    r->releases[r->nreleases++] = x;
    x->pid = v[i]->pid;
    x->released = v[i]->released;
    x->moved_to_host = v[i]->moved_to_host;
    x->elapsed_us = v[i]->elapsed_us;
    if (!(x->why = results_text(v[i]->why))) return false;
  }
  return true;
}

/* Turn a pause or resume answer into a report; NULL when out of memory. */
static struct gpumem_op_report *report_new(gpumem_client *c, const wire_env *env, int rc) {
  struct gpumem_op_report *r = results_sized(sizeof *r);
  if (!r) return NULL;
  int map[GPUMEM_MAX_DEVICES];
  hello_local_map(c->hello, map);
  r->error = rc;
  bool ok;
  if (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) {
    const Gpumem__Wire__Error *e = env->error;
    r->code = wire_code_name(e->code);
    r->message = results_text(e->message);
    r->bytes_needed = e->bytes_needed;
    r->bytes_free = e->bytes_free;
    r->waited_us = e->waited_us;
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
    ok = ok && results_checks(map, &r->checks, &r->nchecks, e->checks, e->n_checks) &&
         copy_releases(r, e->releases, e->n_releases) &&
         results_processes(map, &r->processes, &r->nprocesses, e->processes, e->n_processes);
  } else {
    const Gpumem__Wire__OpReply *o = env->op_reply;
    r->code = wire_code_name(GPUMEM__WIRE__ERROR_CODE__OK);
    r->message = results_text("");
    r->buffers = o->buffers;
    r->bytes = o->bytes;
    r->backup_bytes = o->backup_bytes;
    r->skipped = o->skipped;
    r->elapsed_us = o->elapsed_us;
    r->backup_us = o->backup_us;
    r->waited_us = o->waited_us;
    ok = r->message && results_checks(map, &r->checks, &r->nchecks, o->checks, o->n_checks) &&
         copy_details(map, r, o) && copy_releases(r, o->releases, o->n_releases) &&
         results_processes(map, &r->processes, &r->nprocesses, o->processes, o->n_processes);
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
  results_free_array((void **)r->checks, r->nchecks);
  for (size_t i = 0; r->details && i < r->ndetails; i++) free((char *)r->details[i]->tag);
  results_free_array((void **)r->details, r->ndetails);
  for (size_t i = 0; r->releases && i < r->nreleases; i++) free((char *)r->releases[i]->why);
  results_free_array((void **)r->releases, r->nreleases);
  results_free_processes(r->processes, r->nprocesses);
  free(r);
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
  wire_env req = wire_envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_SHARE, &q);
  struct call reply = {0};
  int rc = conn_call(c->conn, &req, &reply);
  if (rc == 0 && reply.reply->body_case != GPUMEM__WIRE__ENVELOPE__BODY_SHARE_REPLY)
    rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered with something else");
  conn_call_done(&reply);
  return rc;
}
