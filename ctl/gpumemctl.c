/* gpumemctl: look at and drive gpumemd. Exit status: 0 done, 1 the
 * operation failed (the daemon's words on stderr), 2 usage error. */
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "common/size.h"
#include "common/wire.h"
#include "gpumem.h"

#define VSTR_(x) #x
#define VSTR(x) VSTR_(x)
/* This tool's version: that of the header it was built with. */
#define GPUMEM_CTL_VERSION \
  VSTR(GPUMEM_VERSION_MAJOR) "." VSTR(GPUMEM_VERSION_MINOR) "." VSTR(GPUMEM_VERSION_PATCH)

#define MAX_PIDS WIRE_MAX_PIDS /* the daemon takes no more in one operation */
#define METRICS_REQUEST_MS 10000 /* metrics' request timeout: below its unit's start timeout */

/* Print the usage text. */
static void usage(FILE *out) {
  fprintf(out,
          "usage: gpumemctl [--socket PATH] [--json] COMMAND [ARGS]\n"
          "       gpumemctl [--socket PATH] [--json] --version\n"
          "commands:\n"
          "  status                    devices, tags, sessions and memory held outside gpumemd\n"
          "  list                      every buffer\n"
          "  metrics                   the status in Prometheus text format\n"
          "  pause TAG... | --all      unmap and free the tags' memory on the node\n"
          "  resume TAG... | --all     take it again (all or nothing)\n"
          "  share TAG...              let every uid's buffers join these tags\n"
          "  unshare TAG...            only the owner's again (buffers in them stay)\n"
          "  drop NAME                 free a persistent buffer no process holds\n"
          "  top                       a live view of devices, tags, memory held outside\n"
          "                            gpumemd and the last pauses and resumes (q quits)\n"
          "options:\n"
          "  --socket PATH             daemon socket (default $GPUMEM_SOCKET or %s)\n"
          "  --socket-owner USER       also trust a daemon running as USER (a name or uid;\n"
          "                            default $GPUMEM_SOCKET_OWNER, else root only): the\n"
          "                            socket must be owned by and answered by root or USER\n"
          "  --json                    machine-readable output\n"
          "  --request-timeout DURATION\n"
          "                            how long each request waits for the daemon's\n"
          "                            answer (default 10s for metrics, else 30s)\n"
          "  --all                     pause/resume: every tag (instead of naming tags)\n"
          "  --device N                pause/resume: only device N (repeatable)\n"
          "  --pid PID                 pause/resume: only the sessions of PID (repeatable)\n"
          "  --session-prefix NAME     pause/resume: only sessions whose name starts with NAME\n"
          "  --timeout DURATION        pause/resume: ack timeout per worker (500ms, 10s,\n"
          "                            2m; a plain number is seconds)\n"
          "  --wait DURATION           resume: wait up to DURATION (at most 10m) for room\n"
          "                            on the devices instead of failing at once\n"
          "  --max-residual SIZE       pause: fail when a device still holds more than\n"
          "                            SIZE outside gpumemd after the release\n"
          "  --release-context         pause: then release the device state (context and\n"
          "                            all) of each worker process that opted in and\n"
          "                            maps nothing of ours; the resume restores it\n"
          "  --uid USER                drop: whose buffer (a name or uid; default yours)\n"
          "  --interval DURATION       top: refresh every DURATION (default 1s)\n"
          "  --unmanaged-warn SIZE     status: flag devices with more unmanaged memory\n"
          "                            than this (default 1G)\n"
          "  --version                 this tool's, the library's and the daemon's versions\n"
          "Under --json every failure prints {\"error\":{\"code\",\"message\",\"pids\"}} on\n"
          "stdout as well; the exit status is kept.\n",
          GPUMEM_DEFAULT_SOCKET);
}

#include "ctl/metrics.h"
#include "ctl/owner.h"
#include "ctl/progress.h"
#include "ctl/text.h"
#include "ctl/view.h"
#include "ctl/top.h"

/* Room for a name of up to 255 bytes, each escaped as \xNN. */
#define NAME_BUF 1024

/* Print a JSON error object on stdout: {"error":{"code","message","pids"}}. */
static void json_error(const char *code, const char *message, const uint32_t *pids,
                       size_t npids) {
  printf("{\"error\":{\"code\":");
  json_str(code);
  printf(",\"message\":");
  json_str(message);
  printf(",\"pids\":[");
  for (size_t i = 0; i < npids; i++) printf("%s%u", i ? "," : "", pids[i]);
  printf("]}}\n");
}

/* Under --json: also say failures on stdout as JSON. */
static bool json_mode;

/* Report a failure: words on stderr (escaped: they may carry the daemon's
 * or a worker's text, which must not forge lines on a terminal), and under
 * --json one error object on stdout; returns the exit status given. */
static int fail(int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail(int status, const char *code, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  char shown[4 * sizeof msg];
  fprintf(stderr, "gpumemctl: %s\n", printable(msg, shown, sizeof shown));
  if (json_mode) json_error(code, msg, NULL, 0);
  return status;
}

/* The word for a session role. */
static const char *role_name(int role) {
  return role == GPUMEM_ROLE_WORKER ? "worker" : role == GPUMEM_ROLE_CONTROLLER ? "controller" : "none";
}

/* Print a bool for JSON. */
static const char *json_bool(int v) { return v ? "true" : "false"; }

/* The driver's figures per device, as JSON array elements. */
static void json_checks(struct gpumem_device_check *const *v, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const struct gpumem_device_check *k = v[i];
    printf("%s{\"device\":%d,\"node_device\":%u,\"released\":%llu,\"free_before\":%llu,"
           "\"free_after\":%llu,\"shortfall\":%llu,\"residual\":%llu,\"residual_known\":%s,"
           "\"exit_wait_ms\":%u,\"exit_listed\":%u,\"exit_listed_pid\":%u,\"used_after\":%llu}",
           i ? "," : "", k->device, k->node_device, (unsigned long long)k->released,
           (unsigned long long)k->free_before, (unsigned long long)k->free_after,
           (unsigned long long)k->shortfall, (unsigned long long)k->residual,
           json_bool(k->residual_known), (unsigned)k->exit_wait_ms, (unsigned)k->exit_listed,
           (unsigned)k->exit_listed_pid, (unsigned long long)k->used_after);
  }
}

/* Processes as the driver lists them, as JSON array elements. */
static void json_processes(struct gpumem_process_status *const *v, size_t n) {
  for (size_t i = 0; i < n; i++) {
    const struct gpumem_process_status *p = v[i];
    printf("%s{\"pid\":%u,\"device\":%d,\"node_device\":%u,\"used\":%llu,\"managed\":%llu,"
           "\"residual\":%llu,\"session_id\":%llu,\"name\":",
           i ? "," : "", p->pid, p->device, p->node_device, (unsigned long long)p->used,
           (unsigned long long)p->managed, (unsigned long long)p->residual,
           (unsigned long long)p->session_id);
    json_str(p->name ? p->name : "");
    printf("}");
  }
}

/* What the driver shows of each device the operation touched: the bytes
 * released (or taken) next to the change in free memory, the shortfall
 * and what is held outside gpumemd. */
static void print_checks(FILE *out, struct gpumem_device_check *const *v, size_t n,
                         bool resume) {
  char a[32], b[32], c[32], dev[32];
  for (size_t i = 0; i < n; i++) {
    const struct gpumem_device_check *k = v[i];
    bool rose = k->free_after >= k->free_before;
    uint64_t delta = rose ? k->free_after - k->free_before : k->free_before - k->free_after;
    view_device(k->device, k->node_device, dev, sizeof dev);
    fprintf(out, "device %s: %s %s, driver shows %s %s free", dev,
            resume ? "took" : "released", size_format(k->released, a, sizeof a),
            size_format(delta, b, sizeof b), rose ? "more" : "less");
    if (k->residual_known && k->residual)
      fprintf(out, "; %s held outside gpumemd", size_format(k->residual, c, sizeof c));
    if (!resume) fprintf(out, "; %s still used", size_format(k->used_after, c, sizeof c));
    fprintf(out, "\n");
    if (k->exit_wait_ms)
      fprintf(out, "  (judged after waiting %u ms for workers that ended to leave the driver)\n",
              (unsigned)k->exit_wait_ms);
    if (k->exit_listed)
      fprintf(out, "! device %s: %u workers that ended still listed by the driver (pid %u)\n",
              dev, (unsigned)k->exit_listed, (unsigned)k->exit_listed_pid);
    if (k->shortfall)
      fprintf(out, "! device %s: %s released that the driver does not show as free\n", dev,
              size_format(k->shortfall, a, sizeof a));
  }
}


/* One buffer as a JSON object; keys are only ever added. */
static void json_buffer(const struct gpumem_buffer_info *b) {
  printf("{\"id\":%llu,\"session\":%llu,\"pid\":%u,\"tag\":", (unsigned long long)b->id,
         (unsigned long long)b->session_id, b->pid);
  json_str(b->tag);
  printf(",\"device\":%d,\"node_device\":%u,\"size\":%llu,\"flags\":%u,\"state\":\"%s\","
         "\"name\":",
         b->device, b->node_device, (unsigned long long)b->bytes, b->flags,
         gpumem_state_name(b->state));
  json_str(b->name ? b->name : "");
  printf(",\"age_ms\":%llu,\"last_pid\":%u,\"last_name\":", (unsigned long long)b->age_ms,
         b->last_pid);
  json_str(b->last_name ? b->last_name : "");
  printf(",\"idle_ms\":%llu,\"uid\":%u}", (unsigned long long)b->idle_ms, b->uid);
}

/* The status as one JSON object; keys are only ever added. */
static void print_status_json(const struct gpumem_status *s) {
  printf("{\"version\":");
  json_str(s->version ? s->version : "");
  printf(",\"backend\":");
  json_str(s->backend);
  printf(",\"granularity\":%llu,\"devices\":[", (unsigned long long)s->granularity);
  for (size_t i = 0; i < s->ndevices; i++) {
    const struct gpumem_device_status *d = s->devices[i];
    printf("%s{\"index\":%u,\"device\":%d,\"node_device\":%u,\"total\":%llu,\"free\":%llu,"
           "\"managed\":%llu,\"unmanaged\":%llu,\"reserved\":%llu,\"daemon_context\":%s,"
           "\"bus_id\":",
           i ? "," : "", d->node_device, d->device, d->node_device, (unsigned long long)d->total, (unsigned long long)d->free,
           (unsigned long long)d->managed, (unsigned long long)d->unmanaged,
           (unsigned long long)d->reserved, json_bool(d->daemon_context));
    json_str(d->bus_id);
    printf("}");
  }
  printf("],\"tags\":[");
  for (size_t i = 0; i < s->ntags; i++) {
    const struct gpumem_tag_status *t = s->tags[i];
    printf("%s{\"name\":", i ? "," : "");
    json_str(t->name);
    printf(",\"state\":\"%s\",\"buffers\":%llu,\"bytes\":%llu,\"paused_buffers\":%llu,"
           "\"paused_bytes\":%llu,\"backup_bytes\":%llu,\"mixed\":%s,\"transit_buffers\":%llu,"
           "\"transit_bytes\":%llu,\"owner_uid\":%u,\"owned\":%s,\"shared\":%s,"
           "\"backup_pinned_bytes\":%llu,\"backup_reserved_bytes\":%llu,"
           "\"backup_pageable_bytes\":%llu,\"backup_disk_bytes\":%llu,\"generation\":%llu}",
           gpumem_state_name(t->state), (unsigned long long)t->buffers,
           (unsigned long long)t->bytes, (unsigned long long)t->paused_buffers,
           (unsigned long long)t->paused_bytes, (unsigned long long)t->backup_bytes,
           json_bool(t->mixed), (unsigned long long)t->transit_buffers,
           (unsigned long long)t->transit_bytes, t->owner_uid, json_bool(t->owned),
           json_bool(t->shared), (unsigned long long)t->backup_pinned_bytes,
           (unsigned long long)t->backup_reserved_bytes,
           (unsigned long long)t->backup_pageable_bytes,
           (unsigned long long)t->backup_disk_bytes, (unsigned long long)t->generation);
  }
  printf("],\"sessions\":[");
  for (size_t i = 0; i < s->nsessions; i++) {
    const struct gpumem_session_status *x = s->sessions[i];
    printf("%s{\"id\":%llu,\"pid\":%u,\"uid\":%u,\"name\":", i ? "," : "",
           (unsigned long long)x->id, x->pid, x->uid);
    json_str(x->name);
    printf(",\"role\":\"%s\",\"buffers\":%llu,\"bytes\":%llu,\"residual\":%llu,"
           "\"residual_known\":%s,\"release_context\":%s,\"context_released\":%s,"
           "\"moved_to_host\":%llu}",
           role_name(x->role), (unsigned long long)x->buffers, (unsigned long long)x->bytes,
           (unsigned long long)x->residual, json_bool(x->residual_known),
           json_bool(x->release_context), json_bool(x->context_released),
           (unsigned long long)x->moved_to_host);
  }
  printf("],\"processes_known\":%s,\"processes\":[", json_bool(s->processes_known));
  json_processes(s->processes, s->nprocesses);
  printf("],\"tenants\":[");
  for (size_t i = 0; i < s->ntenants; i++) {
    const struct gpumem_tenant_status *t = s->tenants[i];
    printf("%s{\"uid\":%u,\"buffers\":%llu,\"bytes\":%llu,\"backup_bytes\":%llu,"
           "\"device_bytes\":[",
           i ? "," : "", t->uid, (unsigned long long)t->buffers, (unsigned long long)t->bytes,
           (unsigned long long)t->backup_bytes);
    for (size_t d = 0; d < t->ndevice_bytes; d++)
      printf("%s%llu", d ? "," : "", (unsigned long long)t->device_bytes[d]);
    printf("]}");
  }
  printf("],\"quotas\":{\"buffers_per_uid\":%llu,\"device_bytes_per_uid\":%llu,"
         "\"backup_bytes_per_uid\":%llu}",
         (unsigned long long)s->max_buffers_per_uid,
         (unsigned long long)s->max_device_bytes_per_uid,
         (unsigned long long)s->max_backup_bytes_per_uid);
  printf(",\"grace\":{\"left_ms\":%llu,\"waiting\":%llu}",
         (unsigned long long)s->grace_left_ms, (unsigned long long)s->grace_waiting);
  printf(",\"persistent\":[");
  for (size_t i = 0; i < s->npersistent; i++) {
    if (i) printf(",");
    json_buffer(s->persistent[i]);
  }
  printf("],\"total_persistent\":%llu", (unsigned long long)s->total_persistent);
  printf(",\"last_pause_checks\":[");
  json_checks(s->last_pause_checks, s->nlast_pause_checks);
  printf("],\"backups\":{\"reserved\":%llu,\"ready\":%llu,\"limit\":%llu,"
         "\"last_backup_bytes\":%llu,\"last_backup_us\":%llu,\"last_restore_bytes\":%llu,"
         "\"last_restore_us\":%llu,\"disk_bytes\":%llu,\"disk_free\":%llu,\"dir\":",
         (unsigned long long)s->backup_reserved, (unsigned long long)s->backup_ready,
         (unsigned long long)s->backup_limit,
         (unsigned long long)s->last_backup_bytes, (unsigned long long)s->last_backup_us,
         (unsigned long long)s->last_restore_bytes, (unsigned long long)s->last_restore_us,
         (unsigned long long)s->backup_disk_bytes, (unsigned long long)s->backup_disk_free);
  json_str(s->backup_dir);
  printf("}}\n");
}

/* Memory in use on a device that gpumemd does not manage is what leaks
 * look like (an allocation made outside the daemon): say so loudly. The
 * figure leaves out the driver's own reserve. */
static void warn_unmanaged(const struct gpumem_status *s, uint64_t threshold) {
  char a[32], b[32], dev[32];
  for (size_t i = 0; i < s->ndevices; i++) {
    const struct gpumem_device_status *d = s->devices[i];
    if (d->unmanaged > threshold)
      printf("\n! device %s: %s in use that gpumemd does not manage (above %s)\n",
             view_device(d->device, d->node_device, dev, sizeof dev),
             size_format(d->unmanaged, a, sizeof a), size_format(threshold, b, sizeof b));
  }
}

#define HOLDERS_SHOWN 5

/* Name the processes holding the most device memory outside gpumemd (the
 * leak an operator hunts), or say that the driver gives no figures. */
static void print_holders(const struct gpumem_status *s, uint64_t threshold) {
  if (!s->processes_known) {
    printf("\nthe driver gives no per-process figures: memory held outside gpumemd "
           "cannot be put to a process\n");
    return;
  }
  const struct gpumem_process_status **v = calloc(s->nprocesses + 1, sizeof *v);
  if (!v) return;
  size_t n = 0;
  for (size_t i = 0; i < s->nprocesses; i++)
    if (s->processes[i]->residual) v[n++] = s->processes[i];
  qsort(v, n, sizeof *v, view_by_residual);
  printf("\n");
  if (n == 0) printf("no process holds device memory outside gpumemd\n");
  char a[32], name[NAME_BUF], dev[32];
  for (size_t i = 0; i < n && i < HOLDERS_SHOWN; i++)
    printf("%spid %u (%s) holds %s on device %s outside gpumemd\n",
           v[i]->residual > threshold ? "! " : "", v[i]->pid,
           v[i]->name && v[i]->name[0] ? printable(v[i]->name, name, sizeof name) : "?",
           size_format(v[i]->residual, a, sizeof a),
           view_device(v[i]->device, v[i]->node_device, dev, sizeof dev));
  if (n > HOLDERS_SHOWN)
    printf("and %zu more (gpumemctl status --json lists them all)\n", n - HOLDERS_SHOWN);
  free(v);
}

/* Tags with buffers in transit or in both states, in words. */
static void print_tag_notes(const struct gpumem_status *s) {
  char a[32], name[NAME_BUF];
  for (size_t i = 0; i < s->ntags; i++) {
    const struct gpumem_tag_status *t = s->tags[i];
    if (t->transit_buffers)
      printf("! %s: %llu buffers (%s) %s: an owner has not answered; their memory is "
             "still held\n",
             printable(t->name, name, sizeof name), (unsigned long long)t->transit_buffers,
             size_format(t->transit_bytes, a, sizeof a), gpumem_state_name(t->state));
    if (t->mixed)
      printf("%s: mixed, %llu of %llu buffers paused\n", printable(t->name, name, sizeof name),
             (unsigned long long)t->paused_buffers, (unsigned long long)t->buffers);
  }
}

/* Who may add buffers to a tag, in words: "shared" or "uid N". */
static const char *tag_owner(const struct gpumem_tag_status *t, char *buf, size_t len) {
  if (t->shared) return "shared";
  snprintf(buf, len, "uid %u", t->owner_uid);
  return buf;
}

/* What each uid holds, against the quotas. */
static void print_tenants(const struct gpumem_status *s) {
  char a[32], b[32], c[32];
  if (s->max_device_bytes_per_uid) {
    size_format(s->max_device_bytes_per_uid, a, sizeof a);
    strcat(a, " per device");
  }
  printf("\nquotas per uid: %llu buffers; device bytes: %s; backup bytes: %s\n",
         (unsigned long long)s->max_buffers_per_uid, s->max_device_bytes_per_uid ? a : "none",
         s->max_backup_bytes_per_uid ? size_format(s->max_backup_bytes_per_uid, b, sizeof b)
                                     : "none");
  if (!s->ntenants) return;
  printf("%-10s %7s %11s %11s\n", "UID", "BUFFERS", "BYTES", "BACKUP");
  for (size_t i = 0; i < s->ntenants; i++) {
    const struct gpumem_tenant_status *t = s->tenants[i];
    printf("%-10u %7llu %11s %11s\n", t->uid, (unsigned long long)t->buffers,
           size_format(t->bytes, a, sizeof a), size_format(t->backup_bytes, c, sizeof c));
  }
}

/* The status for people. */
/* A duration in milliseconds as people read it: 850 ms, 12.3 s, 4.0 min, 2.5 h. */
static const char *age_format(uint64_t ms, char *buf, size_t len) {
  if (ms < 1000) snprintf(buf, len, "%llu ms", (unsigned long long)ms);
  else if (ms < 60000) snprintf(buf, len, "%.1f s", (double)ms / 1e3);
  else if (ms < 3600000) snprintf(buf, len, "%.1f min", (double)ms / 6e4);
  else snprintf(buf, len, "%.1f h", (double)ms / 3.6e6);
  return buf;
}

/* The persistent buffers: their owners, ages and holders (or last ones). */
static void print_persistent(const struct gpumem_status *s) {
  if (!s->total_persistent) return;
  char a[32], age[32], idle[32], dev[32], uid[16], name[NAME_BUF], tag[NAME_BUF], who[NAME_BUF];
  printf("\n%-20s %-6s %-20s %6s %11s %-9s %10s %s\n", "PERSISTENT", "UID", "TAG", "DEVICE",
         "SIZE", "STATE", "AGE", "HOLDER");
  for (size_t i = 0; i < s->npersistent; i++) {
    const struct gpumem_buffer_info *b = s->persistent[i];
    snprintf(uid, sizeof uid, "%u", b->uid);
    printf("%-20s %-6s %-20s %6s %11s %-9s %10s ", printable(b->name, name, sizeof name), uid,
           printable(b->tag, tag, sizeof tag),
           view_device(b->device, b->node_device, dev, sizeof dev),
           size_format(b->bytes, a, sizeof a), gpumem_state_name(b->state),
           age_format(b->age_ms, age, sizeof age));
    const char *last = b->last_name && b->last_name[0] ? printable(b->last_name, who, sizeof who)
                                                       : "-";
    if (b->pid)
      printf("pid %u (%s)\n", b->pid, last);
    else
      printf("none for %s; last pid %u (%s)\n", age_format(b->idle_ms, idle, sizeof idle),
             b->last_pid, last);
  }
  if (s->total_persistent > s->npersistent)
    printf("... and %llu more: gpumemctl list\n",
           (unsigned long long)(s->total_persistent - s->npersistent));
}

static void print_status(const struct gpumem_status *s, uint64_t threshold) {
  char a[32], b[32], c[32], d[32], e[32], name[NAME_BUF], dev[32];
  printf("gpumemd %s, backend %s, granularity %s\n",
         s->version && s->version[0] ? printable(s->version, name, sizeof name) : "(unknown)",
         printable(s->backend, e, sizeof e), size_format(s->granularity, a, sizeof a));
  if (s->grace_left_ms)
    printf("re-registration grace: %.1f s left; allocations in new tags wait for it "
           "(%llu waiting)\n",
           (double)s->grace_left_ms / 1e3, (unsigned long long)s->grace_waiting);
  printf("\n");
  printf("%-6s %11s %11s %11s %11s %11s\n", "DEVICE", "TOTAL", "FREE", "RESERVED", "MANAGED",
         "UNMANAGED");
  for (size_t i = 0; i < s->ndevices; i++) {
    const struct gpumem_device_status *x = s->devices[i];
    printf("%-6s %11s %11s %11s %11s %11s\n", view_device(x->device, x->node_device, dev, sizeof dev),
           size_format(x->total, a, sizeof a), size_format(x->free, b, sizeof b),
           size_format(x->reserved, c, sizeof c), size_format(x->managed, d, sizeof d),
           size_format(x->unmanaged, e, sizeof e));
  }
  for (size_t i = 0; i < s->ndevices; i++)
    if (s->devices[i]->daemon_context)
      printf("gpumemd holds a context on device %s (for backups or IPC memory)\n",
             view_device(s->devices[i]->device, s->devices[i]->node_device, dev, sizeof dev));
  warn_unmanaged(s, threshold);
  print_holders(s, threshold);
  printf("\nbackups: %s reserved of %s", size_format(s->backup_reserved, a, sizeof a),
         size_format(s->backup_limit, b, sizeof b));
  if (s->last_backup_us)
    printf("; last pause copied %s at %.1f GB/s", size_format(s->last_backup_bytes, c, sizeof c),
           (double)s->last_backup_bytes / (double)s->last_backup_us / 1e3);
  if (s->last_restore_us)
    printf("; last resume copied %s at %.1f GB/s", size_format(s->last_restore_bytes, d, sizeof d),
           (double)s->last_restore_bytes / (double)s->last_restore_us / 1e3);
  printf("\n");
  if (s->backup_dir && s->backup_dir[0]) {
    char where[512];
    printf("disk backups: %s in %s (%s free)\n", size_format(s->backup_disk_bytes, a, sizeof a),
           printable(s->backup_dir, where, sizeof where),
           size_format(s->backup_disk_free, b, sizeof b));
  }
  printf("\n%-20s %-9s %7s %11s %11s %11s %11s %s\n", "TAG", "STATE", "BUFFERS", "BYTES",
         "RELEASED", "BACKUP", "IN TRANSIT", "OWNER");
  for (size_t i = 0; i < s->ntags; i++) {
    const struct gpumem_tag_status *t = s->tags[i];
    printf("%-20s %-9s %7llu %11s %11s %11s %11s %s\n", printable(t->name, name, sizeof name),
           view_tag_state(t),
           (unsigned long long)t->buffers, size_format(t->bytes, a, sizeof a),
           size_format(t->paused_bytes, b, sizeof b), size_format(t->backup_bytes, e, sizeof e),
           size_format(t->transit_bytes, c, sizeof c), tag_owner(t, dev, sizeof dev));
  }
  print_tag_notes(s);
  print_tenants(s);
  if (s->nlast_pause_checks) {
    printf("\nlast pause:\n");
    print_checks(stdout, s->last_pause_checks, s->nlast_pause_checks, false);
  }
  printf("\n%-7s %-8s %-10s %-20s %7s %11s %11s\n", "SESSION", "PID", "ROLE", "NAME", "BUFFERS",
         "BYTES", "OUTSIDE");
  for (size_t i = 0; i < s->nsessions; i++) {
    const struct gpumem_session_status *x = s->sessions[i];
    printf("%-7llu %-8u %-10s %-20s %7llu %11s %11s", (unsigned long long)x->id, x->pid,
           role_name(x->role), x->name[0] ? printable(x->name, name, sizeof name) : "-",
           (unsigned long long)x->buffers, size_format(x->bytes, a, sizeof a),
           x->residual_known ? size_format(x->residual, b, sizeof b) : "unknown");
    if (x->context_released)
      printf("  context released (%s in host memory)", size_format(x->moved_to_host, a, sizeof a));
    printf("\n");
  }
  print_persistent(s);
}

/* Share or unshare each tag, going on past a failure: one line per tag
 * (failures on stderr), or under --json one object,
 * {"tags":[{"tag","shared","error"}...],"error"} ("shared" null for a tag
 * that failed) with the first failure as "error" (null when none); exit 0 when every tag was done, 3 when some
 * were, 1 when none. */
static int run_share(gpumem_client *c, bool shared, char **tags, size_t n, bool json) {
  char name[NAME_BUF], shown[4 * 1024];
  size_t done = 0;
  char first_code[32] = "", first_msg[1024] = "";
  if (json) printf("{\"tags\":[");
  for (size_t i = 0; i < n; i++) {
    int err = gpumem_share(c, tags[i], shared);
    char msg[1024] = "";
    if (err < 0) {
      snprintf(msg, sizeof msg, "%s %s failed: %s", shared ? "share" : "unshare",
               printable(tags[i], name, sizeof name), gpumem_last_error());
      if (!first_code[0]) {
        snprintf(first_code, sizeof first_code, "%s", gpumem_error_name(err));
        snprintf(first_msg, sizeof first_msg, "%s", msg);
      }
      fprintf(stderr, "gpumemctl: %s\n", printable(msg, shown, sizeof shown));
    } else {
      done++;
    }
    if (json) {
      printf("%s{\"tag\":", i ? "," : "");
      json_str(tags[i]);
      printf(",\"shared\":%s,\"error\":", err < 0 ? "null" : json_bool(shared));
      if (err < 0) {
        printf("{\"code\":");
        json_str(gpumem_error_name(err));
        printf(",\"message\":");
        json_str(msg);
        printf("}");
      } else {
        printf("null");
      }
      printf("}");
    } else if (err == 0) {
      printf("%s: %s\n", printable(tags[i], name, sizeof name),
             shared ? "shared: every uid's buffers may join it"
                    : "no longer shared: only its owner's buffers may join it");
    }
  }
  if (json) {
    printf("],\"error\":");
    if (first_code[0]) {
      printf("{\"code\":");
      json_str(first_code);
      printf(",\"message\":");
      json_str(first_msg);
      printf(",\"pids\":[]}");
    } else {
      printf("null");
    }
    printf("}\n");
  }
  return done == n ? 0 : done ? 3 : 1;
}

/* Free a persistent buffer no process holds: one line, or under --json
 * {"name","uid","bytes"} (an error object on failure). */
static int run_drop(gpumem_client *c, const char *name, uint32_t uid, bool json) {
  char shown[NAME_BUF], a[32];
  uint64_t bytes = 0;
  int err = gpumem_drop(c, name, uid, &bytes);
  if (err < 0)
    return fail(1, gpumem_error_name(err), "drop %s failed: %s",
                printable(name, shown, sizeof shown), gpumem_last_error());
  if (json) {
    printf("{\"name\":");
    json_str(name);
    printf(",\"uid\":%u,\"bytes\":%llu}\n", uid, (unsigned long long)bytes);
  } else {
    printf("%s of uid %u: dropped, %s of device memory freed\n",
           printable(name, shown, sizeof shown), uid, size_format(bytes, a, sizeof a));
  }
  return 0;
}

/* The buffers, as a table or JSON. */
static void print_list(const struct gpumem_list *l, bool json) {
  char a[32], dev[32], name[NAME_BUF], pname[NAME_BUF];
  if (json) printf("[");
  else printf("%-8s %-8s %-20s %6s %11s %-9s %s\n", "BUFFER", "PID", "TAG", "DEVICE", "SIZE",
              "STATE", "FLAGS");
  for (size_t i = 0; i < l->nbuffers; i++) {
    const struct gpumem_buffer_info *b = l->buffers[i];
    if (json) {
      if (i) printf(",");
      json_buffer(b);
    } else {
      bool persist = b->flags & GPUMEM_PERSIST;
      printf("%-8llu %-8u %-20s %6s %11s %-9s %s%s%s%s%s\n", (unsigned long long)b->id, b->pid,
             printable(b->tag, name, sizeof name), view_device(b->device, b->node_device, dev, sizeof dev),
             size_format(b->bytes, a, sizeof a), gpumem_state_name(b->state),
             b->flags & GPUMEM_BACKUP ? "backup " : "",
             b->flags & GPUMEM_IPC_LEGACY ? "ipc-legacy " : "",
             persist ? "persistent:" : "",
             persist ? printable(b->name ? b->name : "", pname, sizeof pname) : "",
             b->flags ? "" : "-");
    }
  }
  if (json) printf("]\n");
}

/* What each process the driver lists still holds after a pause. */
static void print_still_held(FILE *out, const struct gpumem_op_report *r) {
  char a[32], dev[32], name[NAME_BUF];
  for (size_t i = 0; i < r->nprocesses; i++) {
    const struct gpumem_process_status *p = r->processes[i];
    view_device(p->device, p->node_device, dev, sizeof dev);
    fprintf(out, "pid %u (%s) still holds %s on device %s\n", p->pid,
            p->name && p->name[0] ? printable(p->name, name, sizeof name) : "-",
            size_format(p->used, a, sizeof a), dev);
  }
}

/* What a pause released (or a resume restored) of each worker process. */
static void print_releases(FILE *out, const struct gpumem_op_report *r, bool resume) {
  char a[32], words[4 * NAME_BUF];
  for (size_t i = 0; i < r->nreleases; i++) {
    const struct gpumem_process_release *x = r->releases[i];
    if (x->why[0])
      fprintf(out, "! pid %u: device state not %s: %s\n", x->pid,
              resume ? "restored" : "released", printable(x->why, words, sizeof words));
    else if (resume)
      fprintf(out, "pid %u: device state restored in %.1f ms\n", x->pid,
              (double)x->elapsed_us / 1000);
    else
      fprintf(out, "pid %u: device state released, %s moved to host memory, in %.1f ms\n",
              x->pid, size_format(x->moved_to_host, a, sizeof a), (double)x->elapsed_us / 1000);
  }
}

/* A pause's or resume's answer as one JSON object on stdout ("error" is
 * null on success); keys are only ever added. */
static void print_op_json(const struct gpumem_op_report *r) {
  printf("{\"buffers\":%llu,\"bytes\":%llu,\"backup_bytes\":%llu,\"skipped\":%llu,"
         "\"elapsed_us\":%llu,\"backup_us\":%llu,\"waited_us\":%llu,\"checks\":[",
         (unsigned long long)r->buffers, (unsigned long long)r->bytes,
         (unsigned long long)r->backup_bytes, (unsigned long long)r->skipped,
         (unsigned long long)r->elapsed_us, (unsigned long long)r->backup_us,
         (unsigned long long)r->waited_us);
  json_checks(r->checks, r->nchecks);
  printf("],\"details\":[");
  for (size_t i = 0; i < r->ndetails; i++) {
    const struct gpumem_op_detail *t = r->details[i];
    printf("%s{\"tag\":", i ? "," : "");
    json_str(t->tag);
    printf(",\"device\":%d,\"node_device\":%u,\"buffers\":%llu,\"bytes\":%llu}", t->device,
           t->node_device, (unsigned long long)t->buffers, (unsigned long long)t->bytes);
  }
  printf("],\"releases\":[");
  for (size_t i = 0; i < r->nreleases; i++) {
    const struct gpumem_process_release *x = r->releases[i];
    printf("%s{\"pid\":%u,\"released\":%s,\"moved_to_host\":%llu,\"elapsed_us\":%llu,"
           "\"why\":",
           i ? "," : "", x->pid, json_bool(x->released), (unsigned long long)x->moved_to_host,
           (unsigned long long)x->elapsed_us);
    json_str(x->why);
    printf("}");
  }
  printf("],\"processes\":[");
  json_processes(r->processes, r->nprocesses);
  printf("],\"error\":");
  if (r->error == 0) {
    printf("null}\n");
    return;
  }
  printf("{\"code\":");
  json_str(r->code);
  printf(",\"message\":");
  json_str(r->message);
  printf(",\"pids\":[");
  for (size_t i = 0; i < r->npids; i++) printf("%s%u", i ? "," : "", r->pids[i]);
  printf("],\"buffers_held\":%llu,\"bytes_held\":%llu,\"bytes_needed\":%llu,\"bytes_free\":%llu}}\n",
         (unsigned long long)r->buffers_held, (unsigned long long)r->bytes_held,
         (unsigned long long)r->bytes_needed, (unsigned long long)r->bytes_free);
}

/* Pause or resume; 0 done, 1 failed (with the daemon's code, words, the
 * pids and bytes held on stderr). On a terminal, a progress line on
 * stderr while it runs (ctl/progress.h). */
static int run_op(gpumem_client *c, const char *socket_path, uid_t owner, bool resume, char **tags,
                  size_t ntags, const int *devs, size_t ndevs,
                  const struct gpumem_op_options *opts, bool json) {
  const char *verb = resume ? "resume" : "pause";
  struct gpumem_op_report *r = NULL;
  progress *p = json ? NULL : progress_start(socket_path, owner, resume, tags, ntags);
  int rc = resume ? gpumem_resume(c, (const char *const *)tags, ntags, devs, ndevs, opts, &r)
                  : gpumem_pause(c, (const char *const *)tags, ntags, devs, ndevs, opts, &r);
  progress_stop(p);
  char a[32], b[32], code[NAME_BUF], words[4 * NAME_BUF];
  if (r && json) print_op_json(r);
  if (rc < 0) {
    /* The daemon's words (and a worker's, within them) are escaped. */
    if (r)
      fprintf(stderr, "gpumemctl: %s failed: %s: %s\n", verb,
              printable(r->code, code, sizeof code), printable(r->message, words, sizeof words));
    else
      fail(1, gpumem_error_name(rc), "%s failed: %s", verb, gpumem_last_error());
    if (r && (r->buffers_held || r->bytes_held || r->npids)) {
      fprintf(stderr, "gpumemctl: %llu buffers, %s still held", (unsigned long long)r->buffers_held,
              size_format(r->bytes_held, a, sizeof a));
      for (size_t i = 0; i < r->npids; i++)
        fprintf(stderr, "%s%u", i ? ", " : (r->npids > 1 ? " by pids " : " by pid "), r->pids[i]);
      fprintf(stderr, "\n");
    }
    if (r && !json) print_checks(stderr, r->checks, r->nchecks, resume);
    if (r && !json) print_still_held(stderr, r);
    if (r && !json) print_releases(stderr, r, resume);
    gpumem_op_report_free(r);
    return 1;
  }
  if (!json) {
    printf("%s %llu buffers, %s (%s backed up), %llu skipped, in %.3f ms\n",
           resume ? "resumed" : "paused", (unsigned long long)r->buffers,
           size_format(r->bytes, a, sizeof a), size_format(r->backup_bytes, b, sizeof b),
           (unsigned long long)r->skipped, (double)r->elapsed_us / 1000);
    if (r->waited_us)
      printf("waited %.3f ms for room on the devices\n", (double)r->waited_us / 1000);
    print_checks(stdout, r->checks, r->nchecks, resume);
    print_still_held(stdout, r);
    print_releases(stdout, r, resume);
  }
  gpumem_op_report_free(r);
  return 0;
}

/* Print this tool's, the library's and, when one answers that is trusted,
 * the daemon's versions; 0 even when none does (it is then said). */
static int print_version(const char *socket_path, uid_t owner, bool json) {
  gpumem_client *c = NULL;
  struct gpumem_status *s = NULL;
  char why[600], v[NAME_BUF];
  int rc = owner_connect(socket_path, "gpumemctl", owner, true, &c, why, sizeof why);
  if (rc == 0) rc = gpumem_status(c, &s);
  if (rc < 0) snprintf(why, sizeof why, "%s", gpumem_last_error());
  const char *dv = s && s->version[0] ? s->version : NULL;
  if (json) {
    printf("{\"gpumemctl\":\"%s\",\"libgpumem\":", GPUMEM_CTL_VERSION);
    json_str(gpumem_version_string());
    printf(",\"daemon\":");
    if (dv) json_str(dv);
    else printf("null");
    printf("}\n");
  } else {
    printf("gpumemctl %s\nlibgpumem %s\n", GPUMEM_CTL_VERSION, gpumem_version_string());
    if (dv) printf("gpumemd %s\n", printable(dv, v, sizeof v));
    else if (s) printf("gpumemd: older than 1.2 (does not say its version)\n");
    else printf("gpumemd: %s: %s\n", rc == OWNER_UNTRUSTED ? "not trusted" : "not reachable",
                printable(why, v, sizeof v));
  }
  gpumem_status_free(s);
  if (c) gpumem_disconnect(c);
  return 0;
}

/* Parse the command line, connect, run one command. */
int main(int argc, char **argv) {
  const char *socket_path = NULL;
  bool json = false;
  int devs[GPUMEM_MAX_DEVICES];
  size_t ndevs = 0;
  static uint32_t pids[MAX_PIDS];
  size_t npids = 0;
  const char *prefix = NULL;
  bool all = false;
  uint64_t timeout = 0, wait = 0, request_timeout = 0;
  uint64_t interval = 0;
  bool version = false;
  uint64_t threshold = 1ull << 30;
  uint64_t max_residual = 0;
  bool has_max_residual = false;
  bool release_context = false;
  const char *owner_arg = NULL;
  const char *uid_arg = NULL;
  static const struct option opts[] = {
      {"socket", required_argument, 0, 's'}, {"json", no_argument, 0, 'j'},
      {"device", required_argument, 0, 'd'}, {"timeout", required_argument, 0, 't'},
      {"unmanaged-warn", required_argument, 0, 'u'},
      {"max-residual", required_argument, 0, 'r'},
      {"release-context", no_argument, 0, 'R'},
      {"wait", required_argument, 0, 'w'},
      {"request-timeout", required_argument, 0, 'q'},
      {"pid", required_argument, 0, 'p'},    {"session-prefix", required_argument, 0, 'n'},
      {"all", no_argument, 0, 'a'},          {"help", no_argument, 0, 'h'},
      {"version", no_argument, 0, 'V'},      {"interval", required_argument, 0, 'i'},
      {"socket-owner", required_argument, 0, 'o'},
      {"uid", required_argument, 0, 'U'},
      {0, 0, 0, 0},
  };
  int ch;
  char *end;
  /* --json anywhere before "--" decides how even the first usage error is
   * said. */
  for (int i = 1; i < argc && strcmp(argv[i], "--") != 0; i++)
    if (strcmp(argv[i], "--json") == 0) json_mode = true;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (ch) {
    case 's': socket_path = optarg; break;
    case 'o': owner_arg = optarg; break;
    case 'U': uid_arg = optarg; break;
    case 'j': json = json_mode = true; break;
    case 'd': {
      errno = 0;
      unsigned long v = strtoul(optarg, &end, 10);
      if (errno || *end || end == optarg || v >= GPUMEM_MAX_DEVICES || ndevs == GPUMEM_MAX_DEVICES) {
        return fail(2, "USAGE", "invalid device '%s'", optarg);
      }
      devs[ndevs++] = (int)v;
      break;
    }
    case 'p': {
      errno = 0;
      unsigned long v = strtoul(optarg, &end, 10);
      if (errno || *end || end == optarg || optarg[0] == '-' || v == 0 || v > UINT32_MAX ||
          npids == MAX_PIDS) {
        return fail(2, "USAGE", "invalid pid '%s'", optarg);
      }
      pids[npids++] = (uint32_t)v;
      break;
    }
    case 'n':
      if (!*optarg) return fail(2, "USAGE", "empty session prefix");
      prefix = optarg;
      break;
    case 'a': all = true; break;
    case 't':
      if (duration_parse(optarg, 86400000, &timeout))
        return fail(2, "USAGE", "invalid timeout '%s' (500ms, 10s, 2m; plain numbers are seconds)",
                    optarg);
      break;
    case 'q':
      if (duration_parse(optarg, 3600000, &request_timeout) || request_timeout == 0)
        return fail(2, "USAGE", "invalid request timeout '%s' (500ms, 10s, 2m, at most 1h)",
                    optarg);
      break;
    case 'w':
      if (duration_parse(optarg, 600000, &wait))
        return fail(2, "USAGE", "invalid wait '%s' (500ms, 30s, 2m, at most 10m; plain numbers "
                                "are seconds)", optarg);
      break;
    case 'i':
      if (duration_parse(optarg, 3600000, &interval) || interval < TOP_MIN_INTERVAL_MS)
        return fail(2, "USAGE", "invalid interval '%s' (100ms to 1h: 500ms, 2s, 1m)", optarg);
      break;
    case 'u':
      if (size_parse(optarg, &threshold)) return fail(2, "USAGE", "invalid size '%s'", optarg);
      break;
    case 'r':
      if (size_parse(optarg, &max_residual)) return fail(2, "USAGE", "invalid size '%s'", optarg);
      has_max_residual = true;
      break;
    case 'R': release_context = true; break;
    case 'h': usage(stdout); return 0;
    case 'V': version = true; break;
    default:
      usage(stderr);
      return fail(2, "USAGE", "invalid option (see above)");
    }
  }
  /* Whose daemon to trust: root, and the uid named. */
  uid_t owner = 0;
  const char *env_owner = getenv("GPUMEM_SOCKET_OWNER");
  if (!owner_arg && env_owner && *env_owner) {
    if (owner_parse(env_owner, &owner) < 0)
      return fail(2, "USAGE", "invalid GPUMEM_SOCKET_OWNER '%s' (a user name or uid)", env_owner);
  } else if (owner_arg && owner_parse(owner_arg, &owner) < 0) {
    return fail(2, "USAGE", "invalid --socket-owner '%s' (a user name or uid)", owner_arg);
  }
  /* The path the library would take, so that the checks see the same. */
  if (!socket_path || !*socket_path) socket_path = getenv("GPUMEM_SOCKET");
  if (!socket_path || !*socket_path) socket_path = GPUMEM_DEFAULT_SOCKET;
  if (version) {
    if (optind < argc) return fail(2, "USAGE", "--version takes no command");
    return print_version(socket_path, owner, json);
  }
  if (optind >= argc) {
    usage(stderr);
    return fail(2, "USAGE", "no command given");
  }
  const char *cmd = argv[optind++];
  char **args = argv + optind;
  size_t nargs = (size_t)(argc - optind);
  bool is_op = strcmp(cmd, "pause") == 0 || strcmp(cmd, "resume") == 0;
  bool is_view = strcmp(cmd, "status") == 0 || strcmp(cmd, "list") == 0 ||
                 strcmp(cmd, "metrics") == 0;
  bool is_top = strcmp(cmd, "top") == 0;
  bool is_share = strcmp(cmd, "share") == 0 || strcmp(cmd, "unshare") == 0;
  bool is_drop = strcmp(cmd, "drop") == 0;
  if (!is_op && !is_view && !is_top && !is_share && !is_drop) {
    usage(stderr);
    return fail(2, "USAGE", "unknown command '%s'", cmd);
  }
  /* An empty tag list means every tag: ask for that in words, so that a
   * forgotten argument cannot pause a whole node. */
  if (is_op && nargs == 0 && !all) {
    return fail(2, "USAGE", "%s needs tags, or --all for every tag", cmd);
  }
  if (all && (!is_op || nargs)) {
    return fail(2, "USAGE", "--all is for pause and resume without tags");
  }
  if (!is_op && (npids || prefix || ndevs || timeout)) {
    return fail(2, "USAGE", "--device, --pid, --session-prefix and --timeout are for "
                            "pause and resume");
  }
  if (has_max_residual && strcmp(cmd, "pause") != 0) {
    return fail(2, "USAGE", "--max-residual applies to pause only");
  }
  if (release_context && strcmp(cmd, "pause") != 0) {
    return fail(2, "USAGE", "--release-context applies to pause only");
  }
  if (wait && strcmp(cmd, "resume") != 0) {
    return fail(2, "USAGE", "--wait applies to resume only");
  }
  if ((is_view || is_top) && nargs) {
    return fail(2, "USAGE", "%s takes no arguments", cmd);
  }
  if (is_share && nargs == 0) {
    return fail(2, "USAGE", "%s needs tags", cmd);
  }
  if (interval && !is_top) {
    return fail(2, "USAGE", "--interval is for top");
  }
  if (is_drop && nargs != 1) return fail(2, "USAGE", "drop needs one name");
  if (uid_arg && !is_drop) return fail(2, "USAGE", "--uid is for drop");
  uid_t drop_uid = getuid();
  if (uid_arg && owner_parse(uid_arg, &drop_uid) < 0)
    return fail(2, "USAGE", "invalid --uid '%s' (a user name or uid)", uid_arg);
  /* Looking needs no permission: without a controller's rights, status
   * comes through a plain session (list then shows only its own buffers:
   * none). One command, one connection: if the daemon goes away, say so
   * and stop rather than reconnect. */
  if (is_top && json) return fail(2, "USAGE", "top has no --json: use status --json");
  gpumem_client *c;
  char why[600];
  /* A drop of one's own buffer needs no controller's rights either: a
   * worker session drops its uid's. */
  bool own_drop = is_drop && drop_uid == getuid();
  int rc = owner_connect(socket_path, "gpumemctl", owner, is_view || is_top || own_drop, &c, why,
                         sizeof why);
  if (is_top && rc != OWNER_UNTRUSTED) {
    /* A live view for people: its own connections, kept and made again
     * (ctl/watch.c), each checked like this one. */
    if (c) gpumem_disconnect(c);
    return top_run(socket_path, owner, interval ? interval : TOP_DEFAULT_INTERVAL_MS);
  }
  if (rc != 0) {
    /* A scrape still learns that the daemon is down (JSON mode: the
     * error object alone). */
    if (strcmp(cmd, "metrics") == 0 && !json) {
      metrics_print_down();
    }
    if (rc == OWNER_UNTRUSTED) return fail(1, "UNTRUSTED", "%s", why);
    if (is_drop && rc == GPUMEM_E_PERMISSION)
      return fail(1, gpumem_error_name(rc), "%s (a drop of another uid's buffer needs a "
                  "controller's rights)", gpumem_last_error());
    return fail(1, gpumem_error_name(rc), "%s", gpumem_last_error());
  }
  rc = 0;
  /* A scrape answers well within its unit's start timeout (45 s), also
   * from a daemon that stopped answering after the greeting. */
  if (!request_timeout && strcmp(cmd, "metrics") == 0) request_timeout = METRICS_REQUEST_MS;
  if (request_timeout) gpumem_set_request_timeout(c, (unsigned)request_timeout);
  if (is_op) {
    struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
    o.timeout_ms = (unsigned)timeout;
    /* On the wire 0 means no limit; "--max-residual 0" means nothing may
     * remain, and one byte is the nearest the wire can say to that. */
    o.max_residual = has_max_residual && max_residual == 0 ? 1 : max_residual;
    o.pids = pids;
    o.npids = npids;
    o.session_prefix = prefix;
    o.release_context = release_context;
    o.wait_ms = (unsigned)wait;
    rc = run_op(c, socket_path, owner, strcmp(cmd, "resume") == 0, args, nargs, devs, ndevs, &o, json);
  } else if (is_share) {
    rc = run_share(c, strcmp(cmd, "share") == 0, args, nargs, json);
  } else if (is_drop) {
    rc = run_drop(c, args[0], (uint32_t)drop_uid, json);
  } else if (strcmp(cmd, "status") == 0 || strcmp(cmd, "metrics") == 0) {
    struct gpumem_status *s;
    int err = gpumem_status(c, &s);
    if (err < 0) {
      /* A scrape learns it too: nothing of the last good one stays. */
      if (strcmp(cmd, "metrics") == 0 && !json) metrics_print_down();
      rc = fail(1, gpumem_error_name(err), "%s failed: %s", cmd, gpumem_last_error());
    } else {
      if (strcmp(cmd, "metrics") == 0) metrics_print(s);
      else if (json) print_status_json(s);
      else print_status(s, threshold);
      gpumem_status_free(s);
    }
  } else {
    struct gpumem_list *l;
    int err = gpumem_list(c, &l);
    if (err < 0) {
      rc = fail(1, gpumem_error_name(err), "list failed: %s", gpumem_last_error());
    } else {
      print_list(l, json);
      gpumem_list_free(l);
    }
  }
  gpumem_disconnect(c);
  return rc;
}
