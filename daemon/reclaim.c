#include "reclaim.h"

#include <stdlib.h>
#include <string.h>

#include "common/idmap.h"
#include "common/log.h"
#include "common/size.h"

/* Count a buffer the journal expects against its uid's quotas, or take
 * that back, so that its uid's other processes cannot take what it holds
 * while it is away: one over them (quotas lowered since) is logged and
 * not counted. */
static void charge(registry *reg, journal *j, const struct journal_buffer *b, bool on) {
  bool backup = b->flags & GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP;
  if (!on) {
    if (b->charged)
      tenants_credit(registry_tenants(reg), b->uid, b->device, b->size, backup);
    journal_set_charged(j, b->id, false);
    return;
  }
  struct fault f = {0};
  if (tenants_charge(registry_tenants(reg), b->uid, b->device, b->size, backup, &f)) {
    log_warn("journal: buffer %llu of uid %u is not counted against its quotas while it is "
             "away: %s", (unsigned long long)b->id, b->uid, f.text);
    return;
  }
  journal_set_charged(j, b->id, true);
}

/* Take back from the fd store an ACTIVE persistent buffer that no process
 * held, for keeper, as the journal has it (its secret too); false when
 * the store did not pass it back whole (what it passed is let go of). */
static bool from_store(registry *reg, fdstore *store, struct owner *keeper,
                       const struct journal_buffer *e) {
  size_t n = fdstore_chunks(store, e->id);
  if (!n || e->state != GPUMEM__WIRE__BUFFER_STATE__ACTIVE) return false;
  int *fds = malloc(n * sizeof *fds);
  uint64_t *sizes = malloc(n * sizeof *sizes), sum = 0;
  bool ok = fds && sizes && fdstore_take(store, e->id, n, fds, sizes);
  for (size_t k = 0; ok && k < n; k++) sum += sizes[k];
  struct buffer *b = NULL;
  struct fault f = {0};
  if (ok && sum != e->size) {
    fault_set(&f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT,
              "its chunks there add up to %llu bytes", (unsigned long long)sum);
    for (size_t k = 0; k < n; k++) close(fds[k]);
  } else if (ok && registry_adopt(reg, keeper, e->tag, e->device, e->size, e->flags, e->name,
                                  false, sizes, n, fds, e->secret, &b, &f) == 0) {
    registry_stored_as(reg, b, e->id);
    b->let_go_ns = registry_now_ns(); /* no holder since the restart, as far as this daemon saw */
  }
  if (f.code)
    log_warn("journal: persistent buffer '%s' of uid %u: systemd's fd store passed it back, "
             "but it cannot be taken: %s", e->name, e->uid, f.text);
  free(fds);
  free(sizes);
  return b != NULL;
}

/* Bring back the journal's tags and count what each expects. */
bool reclaim_restore(registry *reg, journal *j, fdstore *store, struct owner *keeper) {
  size_t nt, n = journal_expected_count(j);
  const struct journal_tag *tags = journal_tags(j, &nt);
  for (size_t i = 0; i < nt; i++)
    if (!registry_tag_restore(reg, &tags[i])) return false;
  const struct journal_buffer **all = malloc((n + 1) * sizeof *all);
  if (!all) return false;
  n = journal_expected_list(j, all, n);
  for (size_t i = 0; i < n; i++) {
    if (all[i]->kept) { /* its memory had no holder but the daemon before */
      char size[32];
      size_format(all[i]->size, size, sizeof size);
      if (from_store(reg, store, keeper, all[i]))
        log_info("journal: persistent buffer '%s' of uid %u (%s on device %u, tag '%s'), "
                 "held by the daemon before alone, is back from systemd's fd store",
                 all[i]->name, all[i]->uid, size, all[i]->device, all[i]->tag);
      else
        log_warn("journal: persistent buffer '%s' of uid %u (%s on device %u, tag '%s') was "
                 "held by the daemon before alone: its memory and contents went with it",
                 all[i]->name, all[i]->uid, size, all[i]->device, all[i]->tag);
      journal_claim(j, all[i]->id); /* gone from the journal too (back: under a new id) */
      continue;
    }
    struct tag *t = registry_tag(reg, all[i]->tag);
    if (!t) { /* a buffer whose tag record is missing: its uid's */
      struct journal_tag jt = {.uid = all[i]->uid, .owned = true};
      memcpy(jt.name, all[i]->tag, sizeof jt.name);
      t = registry_tag_restore(reg, &jt);
    }
    if (!t) {
      free(all);
      return false;
    }
    registry_expect(reg, t, +1);
    charge(reg, j, all[i], true);
  }
  free(all);
  /* Tags that came back for nothing (no buffer, not shared, not paused)
   * go again. */
  for (size_t i = 0; i < nt; i++) {
    struct tag *t = registry_tag(reg, tags[i].name);
    if (t) registry_prune(reg, t);
  }
  registry_ids_above(reg, journal_max_id(j));
  return true;
}

/* Whether two secrets are equal, in a time that does not depend on where
 * they differ. */
static bool same_secret(const uint8_t *a, const uint8_t *b) {
  uint8_t d = 0;
  for (size_t i = 0; i < WIRE_SECRET_SIZE; i++) d |= a[i] ^ b[i];
  return d == 0;
}

/* Check one buffer of a re-registration (i of it) against the record e
 * of what it was. */
static wire_code check_record(const struct journal_buffer *e, uint32_t uid,
                              const Gpumem__Wire__AdoptBuffer *a, size_t i, struct fault *f) {
  if (a->secret.len != WIRE_SECRET_SIZE)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                     "adopt buffer %zu: no secret: this daemon takes back only buffers the "
                     "daemon before it journaled, from a holder that proves them its own "
                     "(libgpumem 1.11 or later)",
                     i);
  if (!e || e->uid != uid || !same_secret(e->secret, a->secret.data))
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                     "adopt buffer %zu: buffer %llu is not one the daemon before gave this "
                     "uid with this secret, or it is back already, or its wait ended",
                     i, (unsigned long long)a->old_id);
  uint32_t flags = a->flags & ~(uint32_t)GPUMEM__WIRE__BUFFER_FLAG__FLAG_ALLOW_PAUSED;
  uint32_t was = e->flags & ~(uint32_t)GPUMEM__WIRE__BUFFER_FLAG__FLAG_ALLOW_PAUSED;
  if (strcmp(e->tag, a->tag) != 0 || e->device != a->device || e->size != a->size ||
      flags != was || strcmp(e->name, a->name) != 0) {
    char size[32];
    size_format(e->size, size, sizeof size);
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT,
                     "adopt buffer %zu: buffer %llu was %s on device %u in tag '%s' with flags "
                     "0x%x, name '%s', not %llu bytes on device %u in '%s' with 0x%x, '%s'",
                     i, (unsigned long long)a->old_id, size, e->device, e->tag, was, e->name,
                     (unsigned long long)a->size, a->device, a->tag, flags, a->name);
  }
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* The persistent buffer the daemon kept since pid's session ended that a
 * re-registration (i of it) names, checked; NULL (and f untouched) when
 * it names none. */
static struct buffer *kept_one(registry *reg, uint32_t uid, pid_t pid,
                               const Gpumem__Wire__AdoptBuffer *a, size_t i, struct fault *f) {
  struct buffer *b = a->name[0] ? registry_persistent(reg, uid, a->name) : NULL;
  if (!b || !b->owner->keeper || b->id != a->old_id || b->last_pid != pid) return NULL;
  struct journal_buffer e = registry_buffer_record(b);
  if (check_record(&e, uid, a, i, f)) return NULL;
  bool paused = b->state == BUF_PAUSED;
  if (!registry_can_free(b) || paused != a->paused) {
    fault_set(f, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
              "adopt buffer %zu: persistent buffer '%s' is %s with the daemon since this "
              "process's session ended, not %s as this process has it: attach it again",
              i, b->name, wire_state_name(b->state), a->paused ? "PAUSED" : "ACTIVE");
    return NULL;
  }
  return b;
}

/* Judge one buffer of a re-registration (i of it). */
static wire_code judge_one(registry *reg, const journal *j, const rejoin *rj, uint32_t uid,
                           pid_t pid, const Gpumem__Wire__AdoptBuffer *a, size_t i,
                           enum reclaim_kind *kind, struct buffer **kept, struct fault *f) {
  *kept = NULL;
  if ((*kept = kept_one(reg, uid, pid, a, i, f))) {
    *kind = RECLAIM_KEPT;
    return GPUMEM__WIRE__ERROR_CODE__OK;
  }
  if (f->code) return f->code;
  const struct journal_buffer *e = rejoin_find(rj, a->old_id, pid);
  if (e) {
    *kind = RECLAIM_REJOIN;
    return check_record(e, uid, a, i, f);
  }
  *kind = j ? RECLAIM_JOURNAL : RECLAIM_NEW;
  return j ? check_record(journal_expected(j, a->old_id), uid, a, i, f)
           : GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Judge every buffer of a re-registration. */
wire_code reclaim_check(registry *reg, const journal *j, const rejoin *rj, uint32_t uid,
                        pid_t pid, const Gpumem__Wire__AdoptRequest *a, enum reclaim_kind *kinds,
                        struct buffer **kept, struct fault *f) {
  idmap *seen = idmap_create();
  if (!seen) return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  wire_code rc = GPUMEM__WIRE__ERROR_CODE__OK;
  for (size_t i = 0; i < a->n_buffers && !rc; i++) {
    const Gpumem__Wire__AdoptBuffer *b = a->buffers[i];
    if ((rc = judge_one(reg, j, rj, uid, pid, b, i, &kinds[i], &kept[i], f))) break;
    if (kinds[i] == RECLAIM_NEW || !b->old_id) continue;
    if (idmap_get(seen, b->old_id))
      rc = fault_set(f, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                     "adopt buffer %zu: buffer %llu is named twice", i,
                     (unsigned long long)b->old_id);
    else if (idmap_put(seen, b->old_id, (void *)b) < 0)
      rc = fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  }
  idmap_destroy(seen);
  return rc;
}

/* Take the journal's charges of a re-registration's buffers off their
 * uid's quotas (their re-registrations charge them anew), or put them
 * back when it failed. */
void reclaim_charge(registry *reg, journal *j, const Gpumem__Wire__AdoptRequest *a,
                    const enum reclaim_kind *kinds, bool on) {
  for (size_t i = 0; i < a->n_buffers; i++) {
    const struct journal_buffer *e = journal_expected(j, a->buffers[i]->old_id);
    if (kinds[i] == RECLAIM_JOURNAL && e && e->charged != on) charge(reg, j, e, on);
  }
}

/* The checked buffers are back. */
void reclaim_claim(registry *reg, journal *j, const Gpumem__Wire__AdoptRequest *a) {
  for (size_t i = 0; i < a->n_buffers; i++) {
    const struct journal_buffer *e = journal_expected(j, a->buffers[i]->old_id);
    if (!e) continue;
    struct tag *t = registry_tag(reg, e->tag);
    journal_claim(j, e->id);
    if (t) registry_expect(reg, t, -1);
  }
}

/* What reclaim_expire needs for each buffer. */
struct expiry {
  registry *reg;
  journal *j;
};

/* Forget one buffer no worker claimed. */
static void expire_one(void *ctx, const struct journal_buffer *b) {
  struct expiry *x = ctx;
  char size[32];
  size_format(b->size, size, sizeof size);
  log_warn("journal: buffer %llu of uid %u (%s on device %u in tag '%s', %s) was not "
           "re-registered within the grace: forgotten",
           (unsigned long long)b->id, b->uid, size, b->device, b->tag,
           b->state == GPUMEM__WIRE__BUFFER_STATE__PAUSED ? "paused" : "active");
  charge(x->reg, x->j, b, false);
  journal_put_gone(x->j, b->id);
  struct tag *t = registry_tag(x->reg, b->tag);
  if (t) registry_expect(x->reg, t, -1);
}

/* Forget what no worker claimed. */
void reclaim_expire(registry *reg, journal *j) {
  size_t n = journal_expected_count(j);
  if (!n) return;
  log_info("journal: the grace is over with %zu buffers of the daemon before not re-registered",
           n);
  struct expiry x = {reg, j};
  journal_expire(j, expire_one, &x);
}
