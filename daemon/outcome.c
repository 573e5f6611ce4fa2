#include "outcome.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <uv.h>

#include "common/log.h"
#include "common/size.h"
#include "report.h"

/* Record the first failure. */
void outcome_fail(struct outcome *o, wire_code code, const char *fmt, ...) {
  if (!o || o->fault.code) return;
  o->fault.code = code;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(o->fault.text, sizeof o->fault.text, fmt, ap);
  va_end(ap);
}

/* Name an owner among those a failure involves. */
void outcome_note_pid(struct outcome *o, pid_t pid) {
  for (size_t i = 0; i < o->npids; i++)
    if (o->pids[i] == (uint32_t)pid) return;
  uint32_t *np = realloc(o->pids, (o->npids + 1) * sizeof *np);
  if (!np) return;
  o->pids = np;
  o->pids[o->npids++] = (uint32_t)pid;
}

/* Say which owners missed an earlier ack, and what they still hold. */
void outcome_fail_in_transit(struct outcome *o, const char *what) {
  char bytes[32], pids[96] = "";
  int len = 0;
  for (size_t i = 0; i < o->npids && len < (int)sizeof pids; i++)
    len += snprintf(pids + len, sizeof pids - (size_t)len, " %u", o->pids[i]);
  outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__CLIENT_TIMEOUT,
               "%s: pid%s has not acknowledged an earlier pause or resume; %llu buffers (%s) are "
               "still held",
               what, pids, (unsigned long long)o->held_buffers,
               size_format(o->held_bytes, bytes, sizeof bytes));
}

/* Count a buffer that still holds memory. */
void outcome_hold(struct outcome *o, const struct buffer *b) {
  if (!o) return;
  o->held_buffers++;
  if (b->has_memory) o->held_bytes += b->size;
  outcome_note_pid(o, registry_holder_pid(b));
}

/* Count a buffer that finished, in the total and in its tag's detail. */
void outcome_count(struct outcome *o, const struct buffer *b) {
  if (!o) return;
  o->buffers++;
  o->bytes += b->size;
  struct outcome_detail *d = NULL;
  for (size_t i = 0; i < o->ndetail && !d; i++)
    if (o->detail[i].device == b->device && strcmp(o->detail[i].tag, b->tag->name) == 0)
      d = &o->detail[i];
  if (!d) {
    struct outcome_detail *nd = realloc(o->detail, (o->ndetail + 1) * sizeof *nd);
    if (!nd) return;
    o->detail = nd;
    d = &nd[o->ndetail++];
    memset(d, 0, sizeof *d);
    snprintf(d->tag, sizeof d->tag, "%s", b->tag->name);
    d->device = b->device;
  }
  d->buffers++;
  d->bytes += b->size;
}

/* Add a release entry. */
struct outcome_release *outcome_add_release(struct outcome *o, pid_t pid) {
  struct outcome_release *v = realloc(o->releases, (o->nreleases + 1) * sizeof *v);
  if (!v) return NULL;
  o->releases = v;
  struct outcome_release *r = &v[o->nreleases++];
  memset(r, 0, sizeof *r);
  r->pid = pid;
  return r;
}

/* The first refused or failed release as the failure. */
void outcome_fail_releases(struct outcome *o) {
  for (size_t i = 0; i < o->nreleases && !o->fault.code; i++) {
    const struct outcome_release *r = &o->releases[i];
    if (r->refused)
      outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__RELEASE_REFUSED,
                   "pid %d: context release refused: %s (its buffers are paused)", (int)r->pid,
                   r->why);
    else if (r->failed)
      outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED,
                   "pid %d: device state not released: %s", (int)r->pid, r->why);
  }
}

/* Free the pids, the detail and the releases. */
void outcome_free(struct outcome *o) {
  free(o->pids);
  free(o->detail);
  free(o->releases);
  o->pids = NULL;
  o->detail = NULL;
  o->releases = NULL;
  o->npids = o->ndetail = o->nreleases = 0;
}

/* The releases as wire messages (v and p: room for n); NULL-free. */
static void wire_releases(const struct outcome *o, Gpumem__Wire__ProcessRelease *v,
                          Gpumem__Wire__ProcessRelease **p) {
  for (size_t i = 0; v && p && i < o->nreleases; i++) {
    const struct outcome_release *x = &o->releases[i];
    gpumem__wire__process_release__init(&v[i]);
    v[i].pid = (uint32_t)x->pid;
    v[i].released = x->released;
    v[i].moved_to_host = x->moved;
    v[i].elapsed_us = x->us;
    v[i].why = (char *)x->why;
    p[i] = &v[i];
  }
}

/* Log an operation's figures and failure. */
void outcome_log(const struct outcome *o, const char *what, const char *first_tag, size_t ntags,
                 uint64_t us, uint64_t sent_us, uint64_t owners_us) {
  log_info("%s %s%s: %llu buffers, %llu bytes, %llu backed up, %llu skipped, %llu us "
           "(%llu us to send the events, %llu us for the owners)%s%s",
           what, first_tag, ntags > 1 ? ",..." : "", (unsigned long long)o->buffers,
           (unsigned long long)o->bytes, (unsigned long long)o->backup_bytes,
           (unsigned long long)o->skipped, (unsigned long long)us, (unsigned long long)sent_us,
           (unsigned long long)owners_us, o->fault.code ? ": " : "", o->fault.text);
}

/* Send the answer: an Error with the fault, or an OpReply; a pause's
 * (sessions given) with the processes on the devices it touched. */
void outcome_reply(struct outcome *o, uint64_t req_id, uint64_t elapsed_us, uint64_t backup_us,
                   Gpumem__Wire__DeviceCheck **checks, size_t nchecks, registry *reg, gpudev *g,
                   const struct outbox *out, struct owner *to, struct list *sessions) {
  wire_env env;
  char text[sizeof o->fault.text];
  Gpumem__Wire__Error err = GPUMEM__WIRE__ERROR__INIT;
  Gpumem__Wire__OpReply r = GPUMEM__WIRE__OP_REPLY__INIT;
  Gpumem__Wire__TagDeviceBytes *td = calloc(o->ndetail + 1, sizeof *td);
  Gpumem__Wire__TagDeviceBytes **tdp = calloc(o->ndetail + 1, sizeof *tdp);
  Gpumem__Wire__ProcessRelease *rv = calloc(o->nreleases + 1, sizeof *rv);
  Gpumem__Wire__ProcessRelease **rp = calloc(o->nreleases + 1, sizeof *rp);
  size_t nrel = rv && rp ? o->nreleases : 0;
  wire_releases(o, rv, rp);
  uint64_t devmask = 0; /* the devices the operation touched: those checked */
  for (size_t i = 0; i < nchecks; i++)
    devmask |= checks[i]->device < 64 ? 1ull << checks[i]->device : 0;
  struct report_processes pr = {0};
  if (sessions && devmask)
    report_processes(g, sessions, devmask, o->checked_ns ? o->checked_ns : uv_hrtime(), to, &pr);
  if (o->fault.code) {
    fault_to_wire(&o->fault, text, &err);
    err.pids = o->pids;
    err.n_pids = o->npids;
    err.buffers_held = o->held_buffers;
    err.bytes_held = o->held_bytes;
    err.checks = checks;
    err.n_checks = nchecks;
    err.releases = rp;
    err.n_releases = nrel;
    err.processes = pr.p;
    err.waited_us = o->waited_us;
    err.n_processes = pr.n;
    env = wire_envelope(req_id, GPUMEM__WIRE__ENVELOPE__BODY_ERROR, &err);
  } else {
    r.buffers = o->buffers;
    r.bytes = o->bytes;
    r.backup_bytes = o->backup_bytes;
    r.skipped = o->skipped;
    r.elapsed_us = elapsed_us;
    r.backup_us = backup_us;
    r.waited_us = o->waited_us;
    for (size_t i = 0; td && tdp && i < o->ndetail; i++) {
      gpumem__wire__tag_device_bytes__init(&td[i]);
      td[i].tag = o->detail[i].tag;
      td[i].device = o->detail[i].device;
      td[i].buffers = o->detail[i].buffers;
      td[i].bytes = o->detail[i].bytes;
      tdp[i] = &td[i];
      r.n_detail = i + 1;
    }
    r.detail = tdp;
    r.checks = checks;
    r.n_checks = nchecks;
    r.releases = rp;
    r.n_releases = nrel;
    r.processes = pr.p;
    r.n_processes = pr.n;
    r.devices = report_devices(reg, g, &r.n_devices);
    env = wire_envelope(req_id, GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY, &r);
  }
  out->send(out->ctx, to, &env, NULL, 0);
  report_devices_free(r.devices);
  free(td);
  free(tdp);
  free(rv);
  free(rp);
  report_processes_free(&pr);
}

/* Note and log the copies an operation made. */
uint64_t outcome_copies(registry *reg, bool resume, uint64_t copied0, uint64_t us0) {
  uint64_t copied, us;
  registry_copy_totals(reg, !resume, &copied, &us);
  copied -= copied0;
  us -= us0;
  if (copied) {
    registry_note_last(reg, !resume, copied, us);
    log_info("%s copied %llu bytes in %llu us: %.1f GB/s", resume ? "restore" : "backup",
             (unsigned long long)copied, (unsigned long long)us,
             us ? (double)copied / (double)us / 1e3 : 0.0);
  }
  return us;
}
