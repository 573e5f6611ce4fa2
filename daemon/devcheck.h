/* The driver's word on an operation: each device's free memory and the
 * daemon's own holdings, read before a pause or resume and compared with
 * what the driver says after it, so that a pause that did not really give
 * memory back fails (NOT_RELEASED) and a device that still holds too much
 * outside gpumemd is said (RESIDUAL_EXCEEDED). */
#ifndef GPUMEMD_DEVCHECK_H
#define GPUMEMD_DEVCHECK_H

#include <stdbool.h>
#include <stdint.h>

#include "common/limits.h"
#include "gpu/gpudev.h"
#include "outcome.h"
#include "registry.h"

/* What the driver's free memory may miss beyond one granularity a buffer. */
#define DEVCHECK_SLACK (16ull << 20)

/* One device during an operation: what the daemon did there, and the
 * driver's figures to compare it with. */
struct devfig {
  bool touched;
  uint64_t released, nbuf; /* released (pause) or taken (resume) */
  uint64_t free_before, managed_before;
};

/* Read the driver's free memory and the daemon's own figure for every
 * device d < ndev in devmask into dev[d]. */
void devcheck_before(registry *reg, gpudev *g, uint64_t devmask, struct devfig *dev, unsigned ndev);

/* What a pause or resume must meet after it ends. */
struct devcheck_rules {
  bool resume;           /* only a pause must show its memory free */
  uint64_t max_residual; /* a pause: at most this outside gpumemd (0: any) */
  bool by_controller;    /* a controller is told which process holds it */
  uint32_t exit_wait_ms; /* waited for ended owners to leave the driver */
  const uint32_t *exit_listed; /* those still listed after it (exit_nlisted) */
  size_t exit_nlisted;
  uint64_t checked_ns; /* per-process figures read at or after this (uv_hrtime) */
};

/* Compare what the operation did on each device it touched (dev[d]) with
 * the driver's figures now: one entry of checks (room for ndev) per
 * device touched, and a failure into o for memory not returned or more
 * residual than the rules allow. Returns the number of checks. */
size_t devcheck_after(registry *reg, gpudev *g, const struct devfig *dev, unsigned ndev,
                      const struct devcheck_rules *rules, struct outcome *o,
                      Gpumem__Wire__DeviceCheck *checks);

/* The figures of the last pause that finished, kept for status. */
struct devcheck_last {
  Gpumem__Wire__DeviceCheck checks[GPUMEM_MAX_DEVICES];
  Gpumem__Wire__DeviceCheck *ptrs[GPUMEM_MAX_DEVICES];
  uint32_t exit_listed[8]; /* the first pids still listed after the wait */
  size_t n;
};

/* Keep a copy of n checks (at most GPUMEM_MAX_DEVICES) as the last ones. */
void devcheck_keep(struct devcheck_last *last, const Gpumem__Wire__DeviceCheck *checks, size_t n);

#endif
