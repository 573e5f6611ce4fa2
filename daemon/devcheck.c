#include "devcheck.h"

#include <stdio.h>

#include "common/log.h"
#include "common/size.h"
#include "report.h"

/* Take each selected device's figures before the operation. */
void devcheck_before(registry *reg, gpudev *g, uint64_t devmask, struct devfig *dev, unsigned ndev) {
  for (unsigned d = 0; d < ndev; d++) {
    if (!(devmask & (1ull << d))) continue;
    struct gpudev_mem m;
    if (gpudev_mem_detail(g, d, &m) == 0) dev[d].free_before = m.free;
    dev[d].managed_before = registry_managed(reg, d);
  }
}

/* A pause's memory must show up free: the driver's free memory should
 * move by what the daemon's own holdings moved (other requests may run
 * during the operation). */
static void check_released(registry *reg, gpudev *g, unsigned d, const struct devfig *df,
                           const struct gpudev_mem *m, const struct devcheck_rules *rules,
                           struct outcome *o, Gpumem__Wire__DeviceCheck *c) {
  uint64_t managed = registry_managed(reg, d);
  if (df->managed_before <= managed) return;
  uint64_t expect = df->managed_before - managed;
  uint64_t rise = m->free > df->free_before ? m->free - df->free_before : 0;
  uint64_t slack = df->nbuf * gpudev_granularity(g) + DEVCHECK_SLACK;
  if (expect <= rise + slack) return;
  c->shortfall = expect - rise;
  char a[32], b[32], s[32];
  log_error("device %u: released %s, the driver shows %s more free", d,
            size_format(expect, a, sizeof a), size_format(rise, b, sizeof b));
  char waited[96] = "";
  if (rules->exit_nlisted)
    snprintf(waited, sizeof waited, " (pid %d, whose session ended, still listed by the driver "
             "after %u ms)", (int)rules->exit_listed[0], (unsigned)rules->exit_wait_ms);
  else if (rules->exit_wait_ms)
    snprintf(waited, sizeof waited, " (after %u ms waiting for ended owners to leave the driver)",
             (unsigned)rules->exit_wait_ms);
  outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED,
               "device %u: released %s, but the driver shows only %s more free: %s not "
               "returned%s",
               d, size_format(expect, a, sizeof a), size_format(rise, b, sizeof b),
               size_format(c->shortfall, s, sizeof s), waited);
}

/* A pause with a residual limit: what processes hold outside gpumemd. */
static void check_residual(unsigned d, const struct report_residual *r, bool known,
                           const struct devcheck_rules *rules, struct outcome *o) {
  char a[32], b[32];
  if (!known)
    outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__RESIDUAL_EXCEEDED,
                 "device %u: the driver gives no per-process figures, so --max-residual cannot "
                 "be checked",
                 d);
  else if (r->bytes > rules->max_residual && !rules->by_controller)
    /* A worker is not told which process it is: it may be another uid's. */
    outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__RESIDUAL_EXCEEDED,
                 "device %u still holds %s outside gpumemd, more than %s", d,
                 size_format(r->bytes, a, sizeof a), size_format(rules->max_residual, b, sizeof b));
  else if (r->bytes > rules->max_residual) {
    char top[32];
    outcome_note_pid(o, r->top_pid);
    outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__RESIDUAL_EXCEEDED,
                 "device %u still holds %s outside gpumemd, more than %s (largest: pid %d (%s) "
                 "holds %s)",
                 d, size_format(r->bytes, a, sizeof a),
                 size_format(rules->max_residual, b, sizeof b), r->top_pid, r->top_name,
                 size_format(r->top_bytes, top, sizeof top));
  }
}

/* Compare each touched device with the driver's figures. */
size_t devcheck_after(registry *reg, gpudev *g, const struct devfig *dev, unsigned ndev,
                      const struct devcheck_rules *rules, struct outcome *o,
                      Gpumem__Wire__DeviceCheck *checks) {
  size_t n = 0;
  for (unsigned d = 0; d < ndev; d++) {
    const struct devfig *df = &dev[d];
    if (!df->touched) continue;
    Gpumem__Wire__DeviceCheck *c = &checks[n++];
    gpumem__wire__device_check__init(c);
    c->device = d;
    c->released = df->released;
    c->free_before = df->free_before;
    struct gpudev_mem m = {0};
    gpudev_mem_detail(g, d, &m);
    c->free_after = m.free;
    c->used_after = m.total > m.free + m.reserved ? m.total - m.free - m.reserved : 0;
    c->exit_wait_ms = rules->exit_wait_ms;
    c->n_exit_listed_pids = rules->exit_nlisted;
    c->exit_listed_pids = (uint32_t *)rules->exit_listed; /* the wire's own type, not written */
    if (!rules->resume) check_released(reg, g, d, df, &m, rules, o, c);
    struct report_residual r;
    c->residual_known = report_residual(g, d, rules->checked_ns, &r) == 0;
    c->residual = r.bytes;
    if (!rules->resume && rules->max_residual)
      check_residual(d, &r, c->residual_known, rules, o);
  }
  return n;
}

/* Keep the last pause's checks. */
void devcheck_keep(struct devcheck_last *last, const Gpumem__Wire__DeviceCheck *checks, size_t n) {
  last->n = n < GPUMEM_MAX_DEVICES ? n : GPUMEM_MAX_DEVICES;
  for (size_t i = 0; i < last->n; i++) {
    last->checks[i] = checks[i];
    last->ptrs[i] = &last->checks[i];
    size_t k = checks[i].n_exit_listed_pids, room = sizeof last->exit_listed / sizeof(uint32_t);
    last->checks[i].n_exit_listed_pids = k < room ? k : room;
    last->checks[i].exit_listed_pids = last->exit_listed;
    for (size_t j = 0; j < last->checks[i].n_exit_listed_pids; j++)
      last->exit_listed[j] = checks[i].exit_listed_pids[j];
  }
}
