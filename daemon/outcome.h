/* The outcome of a pause or resume: what it did (buffers and bytes, per
 * tag and device), what it could not do (buffers that still hold memory,
 * the owners involved, its first failure), and the reply that says so. */
#ifndef GPUMEMD_OUTCOME_H
#define GPUMEMD_OUTCOME_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "fault.h"
#include "outbox.h"
#include "registry.h"

/* Buffers and bytes an operation finished in one tag on one device. */
struct outcome_detail {
  char tag[WIRE_TAG_MAX + 1];
  unsigned device;
  uint64_t buffers, bytes;
};

/* A worker process whose own device state the operation released (or
 * tried to), or brought back (ctxrelease.h). */
struct outcome_release {
  pid_t pid;
  bool released;  /* its device state is in host memory now */
  bool refused;   /* not tried: why says why (RELEASE_REFUSED) */
  bool failed;    /* tried, and the release did not hold (NOT_RELEASED) */
  uint64_t moved; /* device bytes the driver listed for it before */
  uint64_t us;
  char why[200];  /* not released, or not restored: why ("" when done) */
};

struct outcome {
  uint64_t buffers, bytes, backup_bytes, skipped;
  uint64_t held_buffers, held_bytes; /* still holding memory they should not */
  uint32_t *pids;                    /* owners involved in a failure */
  size_t npids;
  struct outcome_detail *detail;
  size_t ndetail;
  struct outcome_release *releases;
  size_t nreleases;
  struct fault fault; /* the first failure, reported instead of success */
  uint64_t waited_us; /* a resume's wait for room */
  uint64_t checked_ns; /* its driver's figures were read at or after this (uv_hrtime; 0: now) */
};

/* Record the first failure (o may be NULL: nothing is recorded). */
__attribute__((format(printf, 3, 4))) void outcome_fail(struct outcome *o, wire_code code,
                                                        const char *fmt, ...);

/* Name an owner among those a failure involves (once each). */
void outcome_note_pid(struct outcome *o, pid_t pid);

/* Fail with CLIENT_TIMEOUT because buffers the operation covers are still
 * in an earlier operation's transition (held, their owners noted): what
 * ("pause") names what refuses. */
void outcome_fail_in_transit(struct outcome *o, const char *what);

/* Count a buffer that still holds memory the operation should have freed
 * (or, for a resume, memory it could not take back), naming its owner. */
void outcome_hold(struct outcome *o, const struct buffer *b);

/* Count a buffer that finished (o may be NULL). */
void outcome_count(struct outcome *o, const struct buffer *b);

/* Add a process's release (or restore) to the outcome: NULL out of
 * memory, else the entry, zeroed but for its pid. */
struct outcome_release *outcome_add_release(struct outcome *o, pid_t pid);

/* Make the first release that was refused or failed the operation's
 * failure, unless it has one already: called after the driver's figures
 * are judged, so that memory not returned is what a pause reports. */
void outcome_fail_releases(struct outcome *o);

/* Free what the outcome holds. */
void outcome_free(struct outcome *o);

/* Log what an operation (what: "pause" or "resume") of ntags tags (the
 * first named first_tag) did, in us microseconds: sent_us to send the
 * events, owners_us waiting for the owners. */
void outcome_log(const struct outcome *o, const char *what, const char *first_tag, size_t ntags,
                 uint64_t us, uint64_t sent_us, uint64_t owners_us);

/* The backup (a pause's) or restore (a resume's) copies the registry made
 * since its totals (registry_copy_totals) were copied0 bytes in us0:
 * noted as its last of their kind and logged with their rate. Returns
 * the microseconds they took. */
uint64_t outcome_copies(registry *reg, bool resume, uint64_t copied0, uint64_t us0);

/* Send to (through out) the answer to request req_id: the fault, or the
 * figures of a success that took elapsed_us (backup_us of it copying),
 * with the devices' checks and their state now, and for a pause (sessions:
 * the server's struct owner.link list, NULL for a resume) what the driver
 * lists per process on the devices it touched. */
void outcome_reply(struct outcome *o, uint64_t req_id, uint64_t elapsed_us, uint64_t backup_us,
                   Gpumem__Wire__DeviceCheck **checks, size_t nchecks, registry *reg, gpudev *g,
                   const struct outbox *out, struct owner *to, struct list *sessions);

#endif
