/* What the daemon has done since it started, for status and metrics:
 * pauses and resumes counted by result, the device bytes they released
 * and gave back, their durations, the errors answered to any request, and
 * a record of each operation running now and of the last ones done.
 * Figures only grow while the daemon lives. */
#ifndef GPUMEMD_STATS_H
#define GPUMEMD_STATS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/wire.h"

/* How many finished operations the record keeps. */
#define STATS_RECENT 16

typedef struct stats stats;
struct stats_op;
struct stats_view;

/* Start counting now; NULL when out of memory. */
stats *stats_create(void);

/* Free the figures and every record. */
void stats_destroy(stats *st);

/* A pause or resume of tags (none: every tag), asked for by pid of uid, starts
 * running: its record is in flight until stats_op_end. NULL when out of
 * memory; the stats_op verbs take NULL and do nothing. */
struct stats_op *stats_op_begin(stats *st, bool resume, char *const *tags, size_t ntags,
                                uint32_t pid, uint32_t uid);

/* The operation covers bytes more of device memory. */
void stats_op_cover(struct stats_op *r, uint64_t bytes);

/* bytes more of the operation's device memory were released (pause) or
 * remapped by their owners (resume), and copied more bytes backed up or
 * restored. */
void stats_op_progress(struct stats_op *r, uint64_t bytes, uint64_t copied);

/* The operation ended with result after duration_us, having released or
 * given back bytes and copied copied (what happened, which replaces the
 * progress): it is counted and joins the finished records (r is stats'
 * own from here on). */
void stats_op_end(stats *st, struct stats_op *r, wire_code result, uint64_t bytes,
                  uint64_t copied, uint64_t duration_us);

/* Device bytes released by a pause (also when an owner's late ack
 * releases them) or given back by a resume. */
void stats_bytes(stats *st, bool resume, uint64_t bytes);

/* An error was answered to a request. */
void stats_error(stats *st, wire_code code);

/* Fill the figures into a status reply (its 1.3 fields), with the records
 * of the operations uid asked for (or of all: all set). What they point
 * to lives in the returned view, freed with stats_view_free after the
 * reply is sent; NULL (and the fields left empty but for the plain
 * numbers) when out of memory. */
struct stats_view *stats_fill(const stats *st, Gpumem__Wire__StatusReply *r, bool all,
                              uint32_t uid);

/* Free what stats_fill made (NULL is fine). */
void stats_view_free(struct stats_view *v);

#endif
