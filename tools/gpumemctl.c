/* gpumemctl: look at and drive gpumemd. Exit status: 0 done, 1 the
 * operation failed (the daemon's words on stderr), 2 usage error. */
#include <errno.h>
#include <getopt.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/size.h"
#include "gpumem.h"

#define MAX_DEVICES 64

static void usage(FILE *out) {
  fprintf(out,
          "usage: gpumemctl [--socket PATH] [--json] COMMAND [ARGS]\n"
          "commands:\n"
          "  status                    devices, tags and sessions\n"
          "  list                      every buffer\n"
          "  metrics                   the status in Prometheus text format\n"
          "  pause TAG...              unmap and free the tags' memory on the node\n"
          "  resume TAG...             take it again (all or nothing)\n"
          "options:\n"
          "  --socket PATH             daemon socket (default $GPUMEM_SOCKET or %s)\n"
          "  --json                    machine-readable output\n"
          "  --device N                pause/resume: only device N (repeatable)\n"
          "  --timeout MS              pause/resume: ack timeout per worker\n"
          "  --unmanaged-warn SIZE     status: flag devices with more unmanaged memory\n"
          "                            than this (default 1G)\n",
          GPUMEM_DEFAULT_SOCKET);
}

/* Print s as a JSON string. */
static void json_str(const char *s) {
  putchar('"');
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\') printf("\\%c", ch);
    else if (ch < 0x20) printf("\\u%04x", ch);
    else putchar(ch);
  }
  putchar('"');
}

static const char *role_name(int role) {
  return role == GPUMEM_ROLE_WORKER ? "worker" : role == GPUMEM_ROLE_CONTROLLER ? "controller" : "none";
}

static void print_status_json(const struct gpumem_status *s) {
  printf("{\"backend\":");
  json_str(s->backend);
  printf(",\"granularity\":%llu,\"devices\":[", (unsigned long long)s->granularity);
  for (size_t i = 0; i < s->ndevices; i++) {
    const struct gpumem_device_status *d = &s->devices[i];
    printf("%s{\"index\":%u,\"total\":%llu,\"free\":%llu,\"managed\":%llu,\"unmanaged\":%llu,"
           "\"daemon_context\":%s,\"bus_id\":",
           i ? "," : "", d->index, (unsigned long long)d->total, (unsigned long long)d->free,
           (unsigned long long)d->managed, (unsigned long long)d->unmanaged,
           d->daemon_context ? "true" : "false");
    json_str(d->bus_id);
    printf("}");
  }
  printf("],\"tags\":[");
  for (size_t i = 0; i < s->ntags; i++) {
    const struct gpumem_tag_status *t = &s->tags[i];
    printf("%s{\"name\":", i ? "," : "");
    json_str(t->name);
    printf(",\"state\":\"%s\",\"buffers\":%llu,\"bytes\":%llu,\"paused_buffers\":%llu,"
           "\"paused_bytes\":%llu,\"backup_bytes\":%llu}",
           gpumem_state_name(t->state), (unsigned long long)t->buffers,
           (unsigned long long)t->bytes, (unsigned long long)t->paused_buffers,
           (unsigned long long)t->paused_bytes, (unsigned long long)t->backup_bytes);
  }
  printf("],\"sessions\":[");
  for (size_t i = 0; i < s->nsessions; i++) {
    const struct gpumem_session_status *x = &s->sessions[i];
    printf("%s{\"id\":%llu,\"pid\":%u,\"uid\":%u,\"name\":", i ? "," : "",
           (unsigned long long)x->id, x->pid, x->uid);
    json_str(x->name);
    printf(",\"role\":\"%s\",\"buffers\":%llu,\"bytes\":%llu}", role_name(x->role),
           (unsigned long long)x->buffers, (unsigned long long)x->bytes);
  }
  printf("],\"backups\":{\"reserved\":%llu,\"limit\":%llu,\"last_backup_bytes\":%llu,"
         "\"last_backup_us\":%llu,\"last_restore_bytes\":%llu,\"last_restore_us\":%llu}}\n",
         (unsigned long long)s->backup_reserved, (unsigned long long)s->backup_limit,
         (unsigned long long)s->last_backup_bytes, (unsigned long long)s->last_backup_us,
         (unsigned long long)s->last_restore_bytes, (unsigned long long)s->last_restore_us);
}

/* Memory in use on a device that gpumemd does not manage is what leaks
 * look like (an allocation made outside the daemon): say so loudly. */
static void warn_unmanaged(const struct gpumem_status *s, uint64_t threshold) {
  char a[32], b[32];
  for (size_t i = 0; i < s->ndevices; i++)
    if (s->devices[i].unmanaged > threshold)
      printf("\n! device %u: %s in use that gpumemd does not manage (above %s)\n",
             s->devices[i].index, size_format(s->devices[i].unmanaged, a, sizeof a),
             size_format(threshold, b, sizeof b));
}

static void print_status(const struct gpumem_status *s, uint64_t threshold) {
  char a[32], b[32], c[32], d[32], e[32];
  printf("backend %s, granularity %s\n\n", s->backend, size_format(s->granularity, a, sizeof a));
  printf("%-6s %11s %11s %11s %11s\n", "DEVICE", "TOTAL", "FREE", "MANAGED", "UNMANAGED");
  for (size_t i = 0; i < s->ndevices; i++) {
    const struct gpumem_device_status *x = &s->devices[i];
    printf("%-6u %11s %11s %11s %11s\n", x->index, size_format(x->total, a, sizeof a),
           size_format(x->free, b, sizeof b), size_format(x->managed, c, sizeof c),
           size_format(x->unmanaged, d, sizeof d));
  }
  for (size_t i = 0; i < s->ndevices; i++)
    if (s->devices[i].daemon_context)
      printf("gpumemd holds a context on device %u (for backups or IPC memory)\n",
             s->devices[i].index);
  warn_unmanaged(s, threshold);
  printf("\nbackups: %s reserved of %s", size_format(s->backup_reserved, a, sizeof a),
         size_format(s->backup_limit, b, sizeof b));
  if (s->last_backup_us)
    printf("; last pause copied %s at %.1f GB/s", size_format(s->last_backup_bytes, c, sizeof c),
           (double)s->last_backup_bytes / (double)s->last_backup_us / 1e3);
  if (s->last_restore_us)
    printf("; last resume copied %s at %.1f GB/s", size_format(s->last_restore_bytes, d, sizeof d),
           (double)s->last_restore_bytes / (double)s->last_restore_us / 1e3);
  printf("\n");
  printf("\n%-20s %-9s %7s %11s %11s %11s\n", "TAG", "STATE", "BUFFERS", "BYTES", "RELEASED",
         "BACKUP");
  for (size_t i = 0; i < s->ntags; i++) {
    const struct gpumem_tag_status *t = &s->tags[i];
    printf("%-20s %-9s %7llu %11s %11s %11s\n", t->name, gpumem_state_name(t->state),
           (unsigned long long)t->buffers, size_format(t->bytes, a, sizeof a),
           size_format(t->paused_bytes, b, sizeof b), size_format(t->backup_bytes, e, sizeof e));
  }
  printf("\n%-7s %-8s %-10s %-20s %7s %11s\n", "SESSION", "PID", "ROLE", "NAME", "BUFFERS",
         "BYTES");
  for (size_t i = 0; i < s->nsessions; i++) {
    const struct gpumem_session_status *x = &s->sessions[i];
    printf("%-7llu %-8u %-10s %-20s %7llu %11s\n", (unsigned long long)x->id, x->pid,
           role_name(x->role), x->name[0] ? x->name : "-", (unsigned long long)x->buffers,
           size_format(x->bytes, a, sizeof a));
  }
}

/* One Prometheus metric family's header. */
static void metric(const char *name, const char *type, const char *help) {
  printf("# HELP gpumem_%s %s\n# TYPE gpumem_%s %s\n", name, help, name, type);
}

/* The status in the Prometheus text format, for node_exporter's textfile
 * collector. */
static void print_metrics(const struct gpumem_status *s) {
  static const struct {
    const char *name, *help;
    size_t off;
  } dev[] = {
      {"device_total_bytes", "Device memory in total.", offsetof(struct gpumem_device_status, total)},
      {"device_free_bytes", "Device memory free, as the driver says.", offsetof(struct gpumem_device_status, free)},
      {"device_managed_bytes", "Device memory gpumemd holds for its buffers.", offsetof(struct gpumem_device_status, managed)},
      {"device_unmanaged_bytes", "Device memory in use that gpumemd does not manage.", offsetof(struct gpumem_device_status, unmanaged)},
  };
  for (size_t k = 0; k < sizeof dev / sizeof dev[0]; k++) {
    metric(dev[k].name, "gauge", dev[k].help);
    for (size_t i = 0; i < s->ndevices; i++)
      printf("gpumem_%s{device=\"%u\"} %llu\n", dev[k].name, s->devices[i].index,
             *(const unsigned long long *)((const char *)&s->devices[i] + dev[k].off));
  }
  metric("tag_bytes", "gauge", "Bytes of a tag's buffers.");
  for (size_t i = 0; i < s->ntags; i++)
    printf("gpumem_tag_bytes{tag=\"%s\",state=\"%s\"} %llu\n", s->tags[i].name,
           gpumem_state_name(s->tags[i].state), (unsigned long long)s->tags[i].bytes);
  metric("tag_buffers", "gauge", "Buffers of a tag.");
  for (size_t i = 0; i < s->ntags; i++)
    printf("gpumem_tag_buffers{tag=\"%s\"} %llu\n", s->tags[i].name,
           (unsigned long long)s->tags[i].buffers);
  metric("tag_released_bytes", "gauge", "Bytes of a tag given back to the devices while paused.");
  for (size_t i = 0; i < s->ntags; i++)
    printf("gpumem_tag_released_bytes{tag=\"%s\"} %llu\n", s->tags[i].name,
           (unsigned long long)s->tags[i].paused_bytes);
  metric("tag_backup_bytes", "gauge", "Bytes of a tag held as backups in host memory.");
  for (size_t i = 0; i < s->ntags; i++)
    printf("gpumem_tag_backup_bytes{tag=\"%s\"} %llu\n", s->tags[i].name,
           (unsigned long long)s->tags[i].backup_bytes);
  metric("sessions", "gauge", "Connected sessions.");
  printf("gpumem_sessions %zu\n", s->nsessions);
  metric("backup_reserved_bytes", "gauge", "Host memory reserved by BACKUP buffers.");
  printf("gpumem_backup_reserved_bytes %llu\n", (unsigned long long)s->backup_reserved);
  metric("backup_limit_bytes", "gauge", "The --backup-limit.");
  printf("gpumem_backup_limit_bytes %llu\n", (unsigned long long)s->backup_limit);
  metric("last_copy_bytes_per_second", "gauge", "Bandwidth of the last backup and restore.");
  printf("gpumem_last_copy_bytes_per_second{direction=\"backup\"} %.0f\n",
         s->last_backup_us ? (double)s->last_backup_bytes * 1e6 / (double)s->last_backup_us : 0.0);
  printf("gpumem_last_copy_bytes_per_second{direction=\"restore\"} %.0f\n",
         s->last_restore_us ? (double)s->last_restore_bytes * 1e6 / (double)s->last_restore_us : 0.0);
}

static void print_list(const struct gpumem_buffer_info *v, int n, bool json) {
  char a[32];
  if (json) printf("[");
  else printf("%-8s %-8s %-20s %6s %11s %-9s %s\n", "BUFFER", "PID", "TAG", "DEVICE", "SIZE",
              "STATE", "FLAGS");
  for (int i = 0; i < n; i++) {
    const struct gpumem_buffer_info *b = &v[i];
    if (json) {
      printf("%s{\"id\":%llu,\"session\":%llu,\"pid\":%u,\"tag\":", i ? "," : "",
             (unsigned long long)b->id, (unsigned long long)b->session_id, b->pid);
      json_str(b->tag);
      printf(",\"device\":%u,\"size\":%llu,\"flags\":%u,\"state\":\"%s\"}", b->device,
             (unsigned long long)b->size, b->flags, gpumem_state_name(b->state));
    } else {
      printf("%-8llu %-8u %-20s %6u %11s %-9s %s%s%s\n", (unsigned long long)b->id, b->pid,
             b->tag, b->device, size_format(b->size, a, sizeof a), gpumem_state_name(b->state),
             b->flags & GPUMEM_BACKUP ? "backup " : "",
             b->flags & GPUMEM_IPC_LEGACY ? "ipc-legacy " : "",
             b->flags ? "" : "-");
    }
  }
  if (json) printf("]\n");
}

static int run_op(gpumem_client *c, bool resume, char **tags, size_t ntags,
                  const unsigned *devs, size_t ndevs, unsigned timeout, bool json) {
  struct gpumem_op_result r;
  int rc = resume ? gpumem_resume(c, (const char *const *)tags, ntags, devs, ndevs, timeout, &r)
                  : gpumem_pause(c, (const char *const *)tags, ntags, devs, ndevs, timeout, &r);
  if (rc < 0) {
    fprintf(stderr, "gpumemctl: %s failed: %s\n", resume ? "resume" : "pause",
            gpumem_last_error());
    return 1;
  }
  char a[32], b[32];
  if (json)
    printf("{\"buffers\":%llu,\"bytes\":%llu,\"backup_bytes\":%llu,\"skipped\":%llu,"
           "\"elapsed_us\":%llu,\"backup_us\":%llu}\n",
           (unsigned long long)r.buffers, (unsigned long long)r.bytes,
           (unsigned long long)r.backup_bytes, (unsigned long long)r.skipped,
           (unsigned long long)r.elapsed_us, (unsigned long long)r.backup_us);
  else
    printf("%s %llu buffers, %s (%s backed up), %llu skipped, in %.3f ms\n",
           resume ? "resumed" : "paused", (unsigned long long)r.buffers,
           size_format(r.bytes, a, sizeof a), size_format(r.backup_bytes, b, sizeof b),
           (unsigned long long)r.skipped, (double)r.elapsed_us / 1000);
  return 0;
}

int main(int argc, char **argv) {
  const char *socket_path = NULL;
  bool json = false;
  unsigned devs[MAX_DEVICES];
  size_t ndevs = 0;
  unsigned long timeout = 0;
  uint64_t threshold = 1ull << 30;
  static const struct option opts[] = {
      {"socket", required_argument, 0, 's'}, {"json", no_argument, 0, 'j'},
      {"device", required_argument, 0, 'd'}, {"timeout", required_argument, 0, 't'},
      {"unmanaged-warn", required_argument, 0, 'u'},
      {"help", no_argument, 0, 'h'},         {0, 0, 0, 0},
  };
  int ch;
  char *end;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (ch) {
    case 's': socket_path = optarg; break;
    case 'j': json = true; break;
    case 'd': {
      errno = 0;
      unsigned long v = strtoul(optarg, &end, 10);
      if (errno || *end || end == optarg || v >= MAX_DEVICES || ndevs == MAX_DEVICES) {
        fprintf(stderr, "gpumemctl: invalid device '%s'\n", optarg);
        return 2;
      }
      devs[ndevs++] = (unsigned)v;
      break;
    }
    case 't':
      errno = 0;
      timeout = strtoul(optarg, &end, 10);
      if (errno || *end || end == optarg || timeout > 86400000) {
        fprintf(stderr, "gpumemctl: invalid timeout '%s' (milliseconds)\n", optarg);
        return 2;
      }
      break;
    case 'u':
      if (size_parse(optarg, &threshold)) {
        fprintf(stderr, "gpumemctl: invalid size '%s'\n", optarg);
        return 2;
      }
      break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (optind >= argc) {
    usage(stderr);
    return 2;
  }
  const char *cmd = argv[optind++];
  char **args = argv + optind;
  size_t nargs = (size_t)(argc - optind);
  bool is_op = strcmp(cmd, "pause") == 0 || strcmp(cmd, "resume") == 0;
  bool is_view = strcmp(cmd, "status") == 0 || strcmp(cmd, "list") == 0 ||
                 strcmp(cmd, "metrics") == 0;
  if (!is_op && !is_view) {
    fprintf(stderr, "gpumemctl: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
  }
  if (is_op && nargs == 0) {
    fprintf(stderr, "gpumemctl: %s needs at least one tag\n", cmd);
    return 2;
  }
  if (is_view && nargs) {
    fprintf(stderr, "gpumemctl: %s takes no arguments\n", cmd);
    return 2;
  }
  /* Looking needs no permission: without a controller's rights, status
   * comes through a plain session (list then shows only its own buffers:
   * none). */
  gpumem_client *c;
  int rc = gpumem_connect(socket_path, "gpumemctl", GPUMEM_ROLE_CONTROLLER,
                          GPUMEM_CONNECT_NO_THREAD, &c);
  if (rc == GPUMEM_E_PERMISSION && is_view)
    rc = gpumem_connect(socket_path, "gpumemctl", GPUMEM_ROLE_WORKER, GPUMEM_CONNECT_NO_THREAD, &c);
  if (rc < 0) {
    fprintf(stderr, "gpumemctl: %s\n", gpumem_last_error());
    return 1;
  }
  rc = 0;
  if (is_op) {
    rc = run_op(c, strcmp(cmd, "resume") == 0, args, nargs, devs, ndevs, (unsigned)timeout, json);
  } else if (strcmp(cmd, "status") == 0 || strcmp(cmd, "metrics") == 0) {
    struct gpumem_status *s;
    if (gpumem_status(c, &s) < 0) {
      fprintf(stderr, "gpumemctl: %s failed: %s\n", cmd, gpumem_last_error());
      rc = 1;
    } else {
      if (strcmp(cmd, "metrics") == 0) print_metrics(s);
      else if (json) print_status_json(s);
      else print_status(s, threshold);
      gpumem_status_free(s);
    }
  } else {
    struct gpumem_buffer_info *v;
    int n = gpumem_list(c, &v);
    if (n < 0) {
      fprintf(stderr, "gpumemctl: list failed: %s\n", gpumem_last_error());
      rc = 1;
    } else {
      print_list(v, n, json);
      gpumem_list_free(v);
    }
  }
  gpumem_disconnect(c);
  return rc;
}
