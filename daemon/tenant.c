#include "tenant.h"

#include <stdlib.h>

#include "common/idmap.h"
#include "common/size.h"

struct tenants {
  struct tenant_limits lim;
  idmap *by_uid; /* uid + 1 -> struct tenant */
};

/* An empty table with these quotas. */
tenants *tenants_create(const struct tenant_limits *lim) {
  tenants *t = calloc(1, sizeof *t);
  if (!t) return NULL;
  t->lim = *lim;
  if (!(t->by_uid = idmap_create())) {
    free(t);
    return NULL;
  }
  return t;
}

/* Free the table and every tenant in it. */
void tenants_destroy(tenants *t) {
  if (!t) return;
  size_t n = idmap_count(t->by_uid);
  void **all = calloc(n + 1, sizeof *all);
  if (all) {
    n = idmap_values(t->by_uid, all, n);
    for (size_t i = 0; i < n; i++) free(all[i]);
  }
  free(all);
  idmap_destroy(t->by_uid);
  free(t);
}

/* The quotas. */
const struct tenant_limits *tenants_limits(const tenants *t) { return &t->lim; }

/* What uid holds, or NULL. */
const struct tenant *tenants_find(const tenants *t, uint32_t uid) {
  return idmap_get(t->by_uid, (uint64_t)uid + 1);
}

/* The list the registry links uid's buffers into, or NULL. */
struct list *tenants_members(tenants *t, uint32_t uid) {
  struct tenant *x = idmap_get(t->by_uid, (uint64_t)uid + 1);
  return x ? &x->members : NULL;
}

/* Whether adding n to used passes limit (0: none). */
static bool over(uint64_t used, uint64_t n, uint64_t limit) {
  return limit && (n > limit || used > limit - n);
}

/* Count one buffer for uid, or refuse it naming the quota. */
wire_code tenants_charge(tenants *t, uint32_t uid, unsigned device, uint64_t size, bool backup,
                         struct fault *f) {
  if (device >= GPUMEM_MAX_DEVICES)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT, "device %u out of range",
                     device);
  struct tenant *x = idmap_get(t->by_uid, (uint64_t)uid + 1);
  struct tenant none = {.uid = uid};
  const struct tenant *now = x ? x : &none;
  char a[32], b[32], c[32];
  if (over(now->buffers, 1, t->lim.buffers))
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED,
                     "too many buffers for uid %u: %llu held (limit %llu per uid)", uid,
                     (unsigned long long)now->buffers, (unsigned long long)t->lim.buffers);
  if (over(now->device_bytes[device], size, t->lim.device_bytes))
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED,
                     "device quota: uid %u holds %s on device %u, %s more would pass "
                     "--max-device-bytes-per-uid %s",
                     uid, size_format(now->device_bytes[device], a, sizeof a), device,
                     size_format(size, b, sizeof b), size_format(t->lim.device_bytes, c, sizeof c));
  if (backup && over(now->backup_bytes, size, t->lim.backup_bytes))
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED,
                     "backup quota: uid %u reserves %s of host memory for backups, %s more "
                     "would pass --max-backup-bytes-per-uid %s",
                     uid, size_format(now->backup_bytes, a, sizeof a), size_format(size, b, sizeof b),
                     size_format(t->lim.backup_bytes, c, sizeof c));
  if (!x) {
    if (!(x = calloc(1, sizeof *x)))
      return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    x->uid = uid;
    list_init(&x->members);
    if (idmap_put(t->by_uid, (uint64_t)uid + 1, x) < 0) {
      free(x);
      return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    }
  }
  x->buffers++;
  x->bytes += size;
  x->device_bytes[device] += size;
  if (backup) x->backup_bytes += size;
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Take back what tenants_charge counted; a uid left holding nothing is
 * forgotten. */
void tenants_credit(tenants *t, uint32_t uid, unsigned device, uint64_t size, bool backup) {
  struct tenant *x = idmap_get(t->by_uid, (uint64_t)uid + 1);
  if (!x || device >= GPUMEM_MAX_DEVICES) return;
  x->buffers--;
  x->bytes -= size;
  x->device_bytes[device] -= size;
  if (backup) x->backup_bytes -= size;
  if (x->buffers == 0) {
    idmap_del(t->by_uid, (uint64_t)uid + 1);
    free(x);
  }
}

/* Count n more chunks held by uid, or refuse them. */
wire_code tenants_take_chunks(tenants *t, uint32_t uid, uint64_t n, uint64_t limit,
                              struct fault *f) {
  struct tenant *x = idmap_get(t->by_uid, (uint64_t)uid + 1);
  if (!x) return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "uid %u holds no buffer", uid);
  if (over(x->chunks, n, limit))
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED,
                     "uid %u holds %llu chunks, and each is a descriptor of the daemon on this "
                     "backend: %llu more would pass %llu per uid (half of what chunks may take "
                     "of its descriptor limit)",
                     uid, (unsigned long long)x->chunks, (unsigned long long)n,
                     (unsigned long long)limit);
  x->chunks += n;
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Take back n chunks from uid's count. */
void tenants_give_chunks(tenants *t, uint32_t uid, uint64_t n) {
  struct tenant *x = idmap_get(t->by_uid, (uint64_t)uid + 1);
  if (x) x->chunks -= n;
}

/* Order tenants by uid. */
static int by_uid(const void *a, const void *b) {
  uint32_t x = (*(const struct tenant *const *)a)->uid, y = (*(const struct tenant *const *)b)->uid;
  return x < y ? -1 : x > y;
}

/* Up to max tenants, by uid. */
size_t tenants_list(const tenants *t, const struct tenant **out, size_t max) {
  size_t n = idmap_values(t->by_uid, (void **)out, max);
  qsort(out, n, sizeof *out, by_uid);
  return n;
}

/* Number of uids holding anything. */
size_t tenants_count(const tenants *t) { return idmap_count(t->by_uid); }
