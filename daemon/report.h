/* Status and list replies: what the daemon manages, and what it does not. */
#ifndef GPUMEMD_REPORT_H
#define GPUMEMD_REPORT_H

#include "common/list.h"
#include "registry.h"
#include "outbox.h"
#include "owner.h"
#include "stats.h"

/* Tags and sessions in one status reply, at most. */
#define REPORT_STATUS_PAGE 4096
/* Buffers in one list reply, at most. */
#define REPORT_LIST_PAGE 16384

/* The daemon's own figures, which the server keeps: the fds it may use and
 * uses, fds parked in frames still arriving, replies queued unread,
 * connections refused, and the re-registration grace. */
struct report_own {
  uint64_t fd_limit, fds_open, fds_parked, queued_bytes, connections_refused;
  uint64_t grace_left_ms, grace_waiting;
  const struct backup_disk *disk; /* --backup-dir, NULL: none */
};

/* Send s (through out) one page (req's cursors and limit) of the status of
 * every device, tag and session (sessions: the server's list of struct
 * owner.link), with the last pause's checks, what the daemon did since it started
 * (st, which also counts a failure to answer) and its own figures (own).
 * A controller sees every tag, session, process, tenant and operation; any
 * other session only its own uid's, and the tags it owns or that are
 * shared (a shared tag's figures then count only its uid's buffers). */
void report_status(const struct outbox *out, struct owner *s, uint64_t req_id,
                   const Gpumem__Wire__StatusRequest *req, registry *reg, gpudev *g,
                   struct list *sessions,
                   Gpumem__Wire__DeviceCheck *const *last_checks, size_t nlast, stats *st,
                   const struct report_own *own);

/* Send s (through out) one page (req's cursor and limit) of the buffers it
 * may see, in id order: its uid's, or all for a controller. */
void report_list(const struct outbox *out, struct owner *s, uint64_t req_id,
                 const Gpumem__Wire__ListRequest *req, registry *reg);

/* Send s (through out) the state of a tag after a share (NULL: it is gone). */
void report_share(const struct outbox *out, struct owner *s, uint64_t req_id, const struct tag *t);

/* Fill info for every device; returns an array of pointers into one block
 * (free with report_devices_free), *n set to the count. */
Gpumem__Wire__DeviceInfo **report_devices(registry *reg, gpudev *g, size_t *n);

/* Device memory held outside the daemon on one device, by the driver's
 * per-process figures (the daemon's own process left out). */
struct report_residual {
  uint64_t bytes;     /* all processes */
  int top_pid;        /* the largest holder */
  char top_name[64];  /* its comm */
  uint64_t top_bytes;
};

/* Sum what processes hold on dev outside the daemon, by figures read at
 * or after since_ns (uv_hrtime). Returns 0, or a negative errno where the
 * driver gives no per-process figures. */
int report_residual(gpudev *g, unsigned dev, uint64_t since_ns, struct report_residual *r);

/* Free what report_devices returned. */
void report_devices_free(Gpumem__Wire__DeviceInfo **v);

/* The processes the driver lists on the devices in devmask, with what
 * each holds there, as status gives them (sessions: struct owner.link);
 * only viewer's uid's processes unless it is a controller. */
struct report_processes {
  Gpumem__Wire__ProcessMemory *v, **p;
  char (*names)[WIRE_NAME_MAX + 1];
  size_t n;
};

/* Fill pr by figures read at or after since_ns (empty where the driver
 * lists none, or out of memory). */
void report_processes(gpudev *g, struct list *sessions, uint64_t devmask, uint64_t since_ns,
                      const struct owner *viewer, struct report_processes *pr);

/* Free what report_processes filled. */
void report_processes_free(struct report_processes *pr);

#endif
