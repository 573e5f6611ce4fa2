/* gpumemctl metrics: the daemon's status in the Prometheus text format. */
#ifndef GPUMEM_CTL_METRICS_H
#define GPUMEM_CTL_METRICS_H

#include "gpumem.h"

/* Print the status on stdout in the Prometheus text format, for
 * node_exporter's textfile collector: the daemon's figures now, and the
 * counters and durations of what it did since it started. Worker
 * sessions are counted without this process's own (gpumemctl looks
 * through a worker session when it may not be a controller). */
void metrics_print(const struct gpumem_status *s);

/* Print only gpumem_up 0, for when the daemon does not answer. */
void metrics_print_down(void);

#endif
