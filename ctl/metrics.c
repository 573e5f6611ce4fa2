/* gpumemctl metrics: the status in the Prometheus text format. */
#include "ctl/metrics.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "ctl/text.h"

/* A Prometheus label value, escaped as the text format wants; other
 * control characters and bytes that are not UTF-8 become U+FFFD. */
static void label_value(const char *s) {
  for (const unsigned char *p = (const unsigned char *)s; *p;) {
    bool esc;
    size_t n = text_char(p, &esc);
    if (*p == '\\' || *p == '"') printf("\\%c", *p);
    else if (*p == '\n') printf("\\n");
    else if (esc) fputs("\xef\xbf\xbd", stdout);
    else fwrite(p, 1, n, stdout);
    p += n;
  }
}

/* One Prometheus metric family's header. */
static void metric(const char *name, const char *type, const char *help) {
  printf("# HELP gpumem_%s %s\n# TYPE gpumem_%s %s\n", name, help, name, type);
}

/* The off of the tag family whose figure is whether the tag is paused. */
#define TAG_PAUSED SIZE_MAX

/* A duration in microseconds as Prometheus seconds. */
static double seconds(uint64_t us) { return (double)us / 1e6; }

/* The duration histograms, cumulative, with +Inf for the last bound. */
static void durations(const struct gpumem_status *s) {
  metric("operation_duration_seconds", "histogram",
         "How long pauses and resumes took, since gpumemd started.");
  for (size_t i = 0; i < s->nhistograms; i++) {
    const struct gpumem_histogram *h = s->histograms[i];
    bool inf = false;
    for (size_t b = 0; b < h->nbuckets; b++) {
      printf("gpumem_operation_duration_seconds_bucket{op=\"");
      label_value(h->op);
      if (h->le_us[b] == UINT64_MAX) {
        printf("\",le=\"+Inf\"} %llu\n", (unsigned long long)h->count[b]);
        inf = true;
      } else {
        printf("\",le=\"%g\"} %llu\n", seconds(h->le_us[b]), (unsigned long long)h->count[b]);
      }
    }
    if (!inf) { /* the format wants +Inf: every operation */
      printf("gpumem_operation_duration_seconds_bucket{op=\"");
      label_value(h->op);
      printf("\",le=\"+Inf\"} %llu\n", (unsigned long long)h->total);
    }
    printf("gpumem_operation_duration_seconds_sum{op=\"");
    label_value(h->op);
    printf("\"} %.6f\n", seconds(h->sum_us));
    printf("gpumem_operation_duration_seconds_count{op=\"");
    label_value(h->op);
    printf("\"} %llu\n", (unsigned long long)h->total);
  }
}

/* What the daemon did since it started: counters only grow while it
 * lives (a restart starts them again, which Prometheus's rate() takes). */
static void operations(const struct gpumem_status *s) {
  metric("uptime_seconds", "gauge", "Seconds since gpumemd started.");
  printf("gpumem_uptime_seconds %.3f\n", (double)s->uptime_ms / 1e3);
  metric("grace_left_seconds", "gauge",
         "Seconds the re-registration grace (--adopt-grace) still runs (0: over).");
  printf("gpumem_grace_left_seconds %.3f\n", (double)s->grace_left_ms / 1e3);
  metric("grace_waiting", "gauge", "Allocations in new tags waiting for the grace to end.");
  printf("gpumem_grace_waiting %llu\n", (unsigned long long)s->grace_waiting);
  metric("operations_total", "counter",
         "Pauses and resumes that ended, by result (OK or the error's name).");
  for (size_t i = 0; i < s->nop_counts; i++) {
    printf("gpumem_operations_total{op=\"");
    label_value(s->op_counts[i]->op);
    printf("\",result=\"");
    label_value(s->op_counts[i]->name);
    printf("\"} %llu\n", (unsigned long long)s->op_counts[i]->count);
  }
  size_t running = 0;
  for (size_t i = 0; i < s->nrecent_ops; i++) running += !s->recent_ops[i]->done;
  metric("operations_running", "gauge", "Pauses and resumes running now.");
  printf("gpumem_operations_running %zu\n", running);
  metric("released_bytes_total", "counter", "Device memory pauses gave back to the devices.");
  printf("gpumem_released_bytes_total %llu\n", (unsigned long long)s->bytes_released);
  metric("restored_bytes_total", "counter", "Device memory resumes took again for their owners.");
  printf("gpumem_restored_bytes_total %llu\n", (unsigned long long)s->bytes_restored);
  durations(s);
  metric("errors_total", "counter", "Errors gpumemd answered to any request, by code.");
  for (size_t i = 0; i < s->nerror_counts; i++) {
    printf("gpumem_errors_total{code=\"");
    label_value(s->error_counts[i]->name);
    printf("\"} %llu\n", (unsigned long long)s->error_counts[i]->count);
  }
}

/* The figure of a tag that a tag family gives: the uint64_t at off in t,
 * or for TAG_PAUSED 1 when the tag is paused, else 0. */
static unsigned long long tag_figure(const struct gpumem_tag_status *t, size_t off) {
  if (off == TAG_PAUSED) return t->state == GPUMEM_PAUSED;
  uint64_t v;
  memcpy(&v, (const char *)t + off, sizeof v);
  return v;
}

/* The families of one figure per tag. */
static void tags(const struct gpumem_status *s) {
  static const struct {
    const char *name, *help;
    size_t off;
  } fam[] = {
      {"tag_bytes", "Bytes of a tag's buffers.", offsetof(struct gpumem_tag_status, bytes)},
      {"tag_paused", "1 when a tag is paused (its memory given back), else 0.", TAG_PAUSED},
      {"tag_buffers", "Buffers of a tag.", offsetof(struct gpumem_tag_status, buffers)},
      {"tag_released_bytes", "Bytes of a tag given back to the devices while paused.",
       offsetof(struct gpumem_tag_status, paused_bytes)},
      {"tag_backup_bytes", "Bytes of a tag held as backups in host memory.",
       offsetof(struct gpumem_tag_status, backup_bytes)},
      {"tag_transit_bytes", "Bytes of a tag's buffers in transit (an owner's ack missing).",
       offsetof(struct gpumem_tag_status, transit_bytes)},
  };
  for (size_t k = 0; k < sizeof fam / sizeof fam[0]; k++) {
    metric(fam[k].name, "gauge", fam[k].help);
    for (size_t i = 0; i < s->ntags; i++) {
      printf("gpumem_%s{tag=\"", fam[k].name);
      label_value(s->tags[i]->name);
      printf("\"} %llu\n", tag_figure(s->tags[i], fam[k].off));
    }
  }
}

/* The status in the Prometheus text format, for node_exporter's textfile
 * collector. */
void metrics_print(const struct gpumem_status *s) {
  metric("up", "gauge", "1 when gpumemd answered gpumemctl.");
  printf("gpumem_up 1\n");
  static const struct {
    const char *name, *help;
    size_t off;
  } dev[] = {
      {"device_total_bytes", "Device memory in total.", offsetof(struct gpumem_device_status, total)},
      {"device_free_bytes", "Device memory free, as the driver says.", offsetof(struct gpumem_device_status, free)},
      {"device_managed_bytes", "Device memory gpumemd holds for its buffers.", offsetof(struct gpumem_device_status, managed)},
      {"device_unmanaged_bytes", "Device memory in use that gpumemd does not manage (the driver's reserve left out).", offsetof(struct gpumem_device_status, unmanaged)},
      {"device_reserved_bytes", "Device memory the driver keeps for itself.", offsetof(struct gpumem_device_status, reserved)},
  };
  for (size_t k = 0; k < sizeof dev / sizeof dev[0]; k++) {
    metric(dev[k].name, "gauge", dev[k].help);
    for (size_t i = 0; i < s->ndevices; i++)
      printf("gpumem_%s{device=\"%u\"} %llu\n", dev[k].name, s->devices[i]->node_device,
             *(const unsigned long long *)((const char *)s->devices[i] + dev[k].off));
  }
  tags(s);
  /* gpumemctl's own session is left out too: without a controller's
   * rights it looks through a worker session. */
  size_t workers = 0;
  uint32_t self = (uint32_t)getpid();
  for (size_t i = 0; i < s->nsessions; i++)
    if (s->sessions[i]->role == GPUMEM_ROLE_WORKER && s->sessions[i]->pid != self) workers++;
  metric("sessions", "gauge", "Connected worker sessions (controllers and gpumemctl left out).");
  printf("gpumem_sessions %zu\n", workers);
  metric("processes_known", "gauge", "1 where the driver gives per-process figures.");
  printf("gpumem_processes_known %d\n", s->processes_known ? 1 : 0);
  metric("process_residual_bytes", "gauge", "Device memory a process holds outside gpumemd.");
  for (size_t i = 0; i < s->nprocesses; i++) {
    const struct gpumem_process_status *p = s->processes[i];
    printf("gpumem_process_residual_bytes{pid=\"%u\",device=\"%u\",name=\"", p->pid,
           p->node_device);
    label_value(p->name ? p->name : "");
    printf("\"} %llu\n", (unsigned long long)p->residual);
  }
  metric("uid_bytes", "gauge", "Bytes of buffers a uid holds on a device, paused or not.");
  for (size_t i = 0; i < s->ntenants; i++)
    for (size_t d = 0; d < s->tenants[i]->ndevice_bytes; d++)
      printf("gpumem_uid_bytes{uid=\"%u\",device=\"%zu\"} %llu\n", s->tenants[i]->uid, d,
             (unsigned long long)s->tenants[i]->device_bytes[d]);
  metric("uid_buffers", "gauge", "Buffers a uid holds.");
  for (size_t i = 0; i < s->ntenants; i++)
    printf("gpumem_uid_buffers{uid=\"%u\"} %llu\n", s->tenants[i]->uid,
           (unsigned long long)s->tenants[i]->buffers);
  metric("uid_backup_bytes", "gauge", "Host memory a uid's BACKUP buffers reserve.");
  for (size_t i = 0; i < s->ntenants; i++)
    printf("gpumem_uid_backup_bytes{uid=\"%u\"} %llu\n", s->tenants[i]->uid,
           (unsigned long long)s->tenants[i]->backup_bytes);
  metric("uid_quota", "gauge", "Per-uid quotas (0: none).");
  printf("gpumem_uid_quota{kind=\"buffers\"} %llu\n", (unsigned long long)s->max_buffers_per_uid);
  printf("gpumem_uid_quota{kind=\"device_bytes\"} %llu\n",
         (unsigned long long)s->max_device_bytes_per_uid);
  printf("gpumem_uid_quota{kind=\"backup_bytes\"} %llu\n",
         (unsigned long long)s->max_backup_bytes_per_uid);
  metric("backup_reserved_bytes", "gauge", "Host memory reserved by BACKUP buffers.");
  printf("gpumem_backup_reserved_bytes %llu\n", (unsigned long long)s->backup_reserved);
  metric("backup_limit_bytes", "gauge", "The --backup-limit.");
  printf("gpumem_backup_limit_bytes %llu\n", (unsigned long long)s->backup_limit);
  metric("last_copy_bytes_per_second", "gauge", "Bandwidth of the last backup and restore.");
  printf("gpumem_last_copy_bytes_per_second{direction=\"backup\"} %.0f\n",
         s->last_backup_us ? (double)s->last_backup_bytes * 1e6 / (double)s->last_backup_us : 0.0);
  printf("gpumem_last_copy_bytes_per_second{direction=\"restore\"} %.0f\n",
         s->last_restore_us ? (double)s->last_restore_bytes * 1e6 / (double)s->last_restore_us : 0.0);
  operations(s);
}

/* Only gpumem_up 0: what a scrape learns when the daemon does not answer. */
void metrics_print_down(void) {
  metric("up", "gauge", "1 when gpumemd answered gpumemctl.");
  printf("gpumem_up 0\n");
}
