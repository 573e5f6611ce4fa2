/* Tenants: what each uid holds (buffers, device bytes per device, host
 * memory reserved for backups), checked against the per-uid quotas. */
#ifndef GPUMEMD_TENANT_H
#define GPUMEMD_TENANT_H

#include <stddef.h>
#include <stdint.h>

#include "common/list.h"
#include "common/wire.h"
#include "fault.h"

/* Per-uid quotas; 0 means no limit. */
struct tenant_limits {
  uint64_t buffers;      /* buffers, over all of a uid's sessions */
  uint64_t device_bytes; /* bytes of buffers on each device, in any state */
  uint64_t backup_bytes; /* host memory BACKUP buffers reserve */
  uint64_t chunks;       /* physical chunks held now */
};

/* What one uid holds now. */
struct tenant {
  uint32_t uid;
  uint64_t buffers;
  uint64_t bytes; /* over all devices */
  uint64_t device_bytes[GPUMEM_MAX_DEVICES];
  uint64_t backup_bytes;
  uint64_t chunks;
  struct list members; /* the uid's buffers, linked by the registry */
};

typedef struct tenants tenants;

/* An empty table with these quotas; NULL when out of memory. */
tenants *tenants_create(const struct tenant_limits *lim);

/* Free the table. */
void tenants_destroy(tenants *t);

/* The quotas. */
const struct tenant_limits *tenants_limits(const tenants *t);

/* Count one buffer of size bytes on device (a BACKUP one: backup set) for
 * uid, or answer LIMIT_EXCEEDED in f, naming the quota, with nothing
 * counted. */
wire_code tenants_charge(tenants *t, uint32_t uid, unsigned device, uint64_t size, bool backup,
                         struct fault *f);

/* Take back what tenants_charge counted. */
void tenants_credit(tenants *t, uint32_t uid, unsigned device, uint64_t size, bool backup);

/* Count n more chunks held by uid (which holds a buffer) against limit
 * (0: none; where each chunk is one of the daemon's descriptors, a share
 * of its descriptor limit, which may change), or answer LIMIT_EXCEEDED. */
wire_code tenants_take_chunks(tenants *t, uint32_t uid, uint64_t n, uint64_t limit,
                              struct fault *f);

/* Take back n chunks from uid's count. */
void tenants_give_chunks(tenants *t, uint32_t uid, uint64_t n);

/* What uid holds, or NULL when it holds nothing. */
const struct tenant *tenants_find(const tenants *t, uint32_t uid);

/* The list the registry links uid's buffers into (charged ones: it exists
 * from the first tenants_charge until the last tenants_credit, which
 * finds it empty), or NULL. */
struct list *tenants_members(tenants *t, uint32_t uid);

/* Up to max tenants holding anything, by uid; returns how many. */
size_t tenants_list(const tenants *t, const struct tenant **out, size_t max);

/* Number of uids holding anything. */
size_t tenants_count(const tenants *t);

#endif
