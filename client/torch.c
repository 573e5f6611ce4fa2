/* Each thread's current tag, the default client connected on first use,
 * and the entry points of torch.cuda.memory.CUDAPluggableAllocator built
 * on them (the preload library uses the same): each pointer they hand out
 * goes back to the client that made it, which the address map names. */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "addrmap.h"
#include "common/clock.h"
#include "common/wire.h"
#include "default.h"
#include "alloc.h"
#include "error.h"
#include "gpumem.h"

/* How long a failed connection of the default client is remembered
 * before the next call tries again (milliseconds). */
#define RETRY_MS 1000.0

static _Thread_local char thread_tag[WIRE_TAG_MAX + 1];
static _Thread_local unsigned thread_flags;

static pthread_mutex_t connect_mu = PTHREAD_MUTEX_INITIALIZER; /* below, and connecting */
static double retry_at_ms; /* no new attempt before this */
static int failed_code;
static char failed_words[320];

/* In a forked child: its own default client connects at once. */
static void forget_in_child(void) {
  pthread_mutex_init(&connect_mu, NULL);
  retry_at_ms = 0;
  failed_code = 0;
  failed_words[0] = '\0';
}

/* Register the fork handler when the library is loaded. */
__attribute__((constructor)) static void torch_init(void) {
  pthread_atfork(NULL, NULL, forget_in_child);
}

/* Set (or clear, with NULL) the calling thread's tag and flags. */
int gpumem_set_thread_tag(const char *tag, unsigned flags) {
  if (!tag) {
    thread_tag[0] = '\0';
    thread_flags = 0;
    return 0;
  }
  if (!wire_tag_valid(tag))
    return error_set(GPUMEM_E_INVALID, "invalid tag: 1-%d characters of [A-Za-z0-9_.-]",
                     WIRE_TAG_MAX);
  const unsigned backup = GPUMEM_BACKUP | GPUMEM_BACKUP_POLICY;
  if ((flags & ~(backup | GPUMEM_ALLOW_PAUSED)) || ((flags & backup) && !(flags & GPUMEM_BACKUP)))
    return error_set(GPUMEM_E_INVALID,
                     "a thread tag takes only GPUMEM_BACKUP, GPUMEM_BACKUP_RELEASE, "
                     "GPUMEM_BACKUP_PAGEABLE and GPUMEM_BACKUP_DISK (with GPUMEM_BACKUP) and "
                     "GPUMEM_ALLOW_PAUSED");
  snprintf(thread_tag, sizeof thread_tag, "%s", tag);
  thread_flags = flags;
  return 0;
}

/* The calling thread's tag, or NULL. */
const char *gpumem_thread_tag(unsigned *flags) {
  if (flags) *flags = thread_tag[0] ? thread_flags : 0;
  return thread_tag[0] ? thread_tag : NULL;
}

/* The default client: the one set, the one connected here, or a new
 * connection; a failed attempt is repeated at most once per RETRY_MS. */
gpumem_client *gpumem_default_client(void) {
  gpumem_client *c = default_get();
  if (c) return c;
  pthread_mutex_lock(&connect_mu);
  c = default_get();
  if (!c && clock_ms() >= retry_at_ms) {
    const char *name = getenv("GPUMEM_NAME");
    char own[32];
    if (!name || !*name) {
      snprintf(own, sizeof own, "pid-%d", (int)getpid());
      name = own;
    }
    int rc = gpumem_connect(NULL, name, GPUMEM_ROLE_WORKER, 0, &c);
    if (rc < 0) {
      c = NULL;
      failed_code = rc;
      snprintf(failed_words, sizeof failed_words, "%s", gpumem_last_error());
      retry_at_ms = clock_ms() + RETRY_MS;
    } else {
      default_set_connected(c);
    }
  }
  int code = failed_code;
  char words[sizeof failed_words];
  snprintf(words, sizeof words, "%s", failed_words);
  pthread_mutex_unlock(&connect_mu);
  if (!c) error_set(code ? code : GPUMEM_E_CONNECT, "no default gpumem client: %s", words);
  return c;
}

/* torch_memory_saver's reading of a boolean variable: *on is false when it
 * is unset; GPUMEM_E_INVALID for a value that is not 1/true/yes/0/false/no. */
static int env_bool(const char *name, bool *on) {
  static const char *const yes[] = {"1", "true", "TRUE", "yes", "YES"};
  static const char *const no[] = {"0", "false", "FALSE", "no", "NO"};
  const char *v = getenv(name);
  *on = false;
  if (!v) return 0;
  for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++) {
    if (strcmp(v, yes[i]) == 0) {
      *on = true;
      return 0;
    }
    if (strcmp(v, no[i]) == 0) return 0;
  }
  return error_set(GPUMEM_E_INVALID, "%s: '%.32s' is not 1, true, yes, 0, false or no", name, v);
}

/* The flags of allocations outside any region: $GPUMEM_DEFAULT_FLAGS
 * ("backup", "backup_release", "allow_paused", comma-separated), and
 * backup where torch_memory_saver's TMS_INIT_ENABLE (or
 * GPUMEM_INIT_REGION) and TMS_INIT_ENABLE_CPU_BACKUP both say so (the
 * process starts in a backed-up region), released after each resume where its
 * TMS_RETAIN_CPU_BACKUP is set and false, pageable where its
 * TMS_INIT_CPU_BACKUP_BACKEND is "mmap"; GPUMEM_E_INVALID for a word or
 * value it does not know. */
static int env_flags(unsigned *flags) {
  *flags = 0;
  const char *v = getenv("GPUMEM_DEFAULT_FLAGS");
  while (v && *v) {
    size_t n = strcspn(v, ",");
    if (n == 6 && strncasecmp(v, "backup", n) == 0)
      *flags |= GPUMEM_BACKUP;
    else if (n == 14 && strncasecmp(v, "backup_release", n) == 0)
      *flags |= GPUMEM_BACKUP | GPUMEM_BACKUP_RELEASE;
    else if (n == 15 && strncasecmp(v, "backup_pageable", n) == 0)
      *flags |= GPUMEM_BACKUP | GPUMEM_BACKUP_PAGEABLE;
    else if (n == 11 && strncasecmp(v, "backup_disk", n) == 0)
      *flags |= GPUMEM_BACKUP | GPUMEM_BACKUP_DISK;
    else if (n == 12 && strncasecmp(v, "allow_paused", n) == 0)
      *flags |= GPUMEM_ALLOW_PAUSED;
    else if (n)
      return error_set(GPUMEM_E_INVALID,
                       "GPUMEM_DEFAULT_FLAGS: unknown flag '%.*s' (backup, backup_release, "
                       "backup_pageable, backup_disk, allow_paused)",
                       (int)n, v);
    v += n + (v[n] == ',');
  }
  bool init, backup, retain, disk;
  bool gpumem_init;
  if (env_bool("TMS_INIT_ENABLE", &init) < 0 || env_bool("GPUMEM_INIT_REGION", &gpumem_init) < 0 ||
      env_bool("TMS_INIT_ENABLE_CPU_BACKUP", &backup) < 0 ||
      env_bool("TMS_INIT_ENABLE_DISK_BACKUP", &disk) < 0 ||
      env_bool("TMS_RETAIN_CPU_BACKUP", &retain) < 0)
    return GPUMEM_E_INVALID;
  init = init || gpumem_init;
  if (init && backup) *flags |= GPUMEM_BACKUP;
  /* Set and false: torch_memory_saver's backups that let go (unset: kept). */
  if (init && backup && !retain && getenv("TMS_RETAIN_CPU_BACKUP"))
    *flags |= GPUMEM_BACKUP_RELEASE;
  const char *kind = getenv("TMS_INIT_CPU_BACKUP_BACKEND");
  if (init && backup && kind && strcmp(kind, "mmap") == 0) *flags |= GPUMEM_BACKUP_PAGEABLE;
  /* torch_memory_saver's disk backups: the daemon's --backup-dir keeps them. */
  if (init && disk) *flags |= GPUMEM_BACKUP | GPUMEM_BACKUP_DISK;
  return 0;
}

/* CUDAPluggableAllocator's alloc: the calling thread's tag and flags, else
 * $GPUMEM_DEFAULT_TAG and $GPUMEM_DEFAULT_FLAGS, else "default". */
void *gpumem_torch_alloc(size_t size, int device, void *stream) {
  (void)stream;
  if (size == 0) return NULL;
  unsigned flags;
  const char *tag = gpumem_thread_tag(&flags);
  if (!tag) {
    tag = getenv("GPUMEM_DEFAULT_TAG");
    if (!tag || !*tag) tag = "default";
    if (env_flags(&flags) < 0) return NULL;
  }
  gpumem_client *c = gpumem_default_client();
  void *p = NULL;
  if (!c || gpumem_malloc(c, tag, device, size, flags, &p) < 0) return NULL;
  return p;
}

/* CUDAPluggableAllocator's free: what gpumem_torch_alloc returned, through
 * the client that allocated it (whatever the default is now). */
void gpumem_torch_free(void *ptr, size_t size, int device, void *stream) {
  (void)size;
  (void)device;
  (void)stream;
  if (!ptr) return;
  struct addr_entry *e = addrmap_find(ptr, NULL);
  gpumem_client *c = e ? e->owner->client : default_get();
  if (!c) {
    error_set(GPUMEM_E_NOT_FOUND, "no default gpumem client, so no allocation at %p", ptr);
    return;
  }
  gpumem_free_ptr(c, ptr);
}
