/* The VMM backends' common state (gpu/vmm.h): devices and granularity
 * from the vendor runtime, counted holds on primary contexts, and the fds
 * imported handles came from. */
#include "vmm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "error.h"

/* Run o's load once per process; its status every time. */
int vmm_once_run(struct vmm_once *o, char *err, size_t errlen) {
  pthread_once(&o->once, o->load);
  if (o->status) snprintf(err, errlen, "%s", o->error);
  return o->status;
}

/* Record why a load failed. */
void vmm_once_fail(struct vmm_once *o, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(o->error, sizeof o->error, fmt, ap);
  va_end(ap);
  o->status = status;
}

/* Free what vmm_open made (contexts already let go of). */
static void vmm_free(struct vmm *m) {
  idmap_destroy(m->kept);
  pthread_mutex_destroy(&m->mu);
}

/* Load the vendor runtime and learn its devices and granularity. */
int vmm_open(struct vmm *m, const struct vmm_vendor *v, char *err, size_t errlen) {
  int rc = v->load(err, errlen);
  if (rc < 0) return rc;
  if (!(m->kept = idmap_create())) return -ENOMEM;
  m->v = v;
  pthread_mutex_init(&m->mu, NULL);
  int n = 0;
  if ((rc = v->device_count(&n)) != 0 || n <= 0) {
    snprintf(err, errlen, "no %s device found%s%s", v->device_word, rc ? ": " : "",
             rc ? v->error_name(rc) : "");
    vmm_free(m);
    return -ENODEV;
  }
  m->ndev = n < GPUMEM_MAX_DEVICES ? n : GPUMEM_MAX_DEVICES;
  /* Granularity with the very properties chunks are created with; every
   * device must agree, and the coarsest wins. */
  for (int d = 0; d < m->ndev; d++) {
    uint64_t g = 0;
    if ((rc = v->granularity(d, &g)) != 0 || g == 0 || (g & (g - 1))) {
      snprintf(err, errlen, "%sMemGetAllocationGranularity on device %d: %s", v->prefix, d,
               rc ? v->error_name(rc) : "not a power of two");
      vmm_free(m);
      return -EIO;
    }
    if (g > m->granularity) m->granularity = g;
  }
  return 0;
}

/* Load the runtime and the half's calls, then a zeroed state opened over
 * the vendor. */
int vmm_open_state(const struct vmm_vendor *v, struct vmm_once *once, size_t size, void **state,
                   char *err, size_t errlen) {
  int rc = v->load(err, errlen);
  if (rc == 0) rc = vmm_once_run(once, err, errlen);
  if (rc < 0) return rc;
  struct vmm *m = calloc(1, size);
  if (!m) return -ENOMEM;
  if ((rc = vmm_open(m, v, err, errlen)) < 0) {
    free(m);
    return rc;
  }
  *state = m;
  return 0;
}

/* Let go of every context still held and free the state. */
void vmm_close_state(struct vmm *m) {
  for (int d = 0; d < GPUMEM_MAX_DEVICES; d++)
    if (m->ctx_refs[d]) m->v->ctx_release(d);
  vmm_free(m);
  free(m);
}

/* Turn a vendor status into -ENOMEM/-EIO, saying which call failed. */
int vmm_fail(const struct vmm *m, int st, const char *call) {
  return gpu_fail(st == m->v->oom ? -ENOMEM : -EIO, "%s%s: %s", m->v->prefix, call,
                  m->v->error_name(st));
}

/* Turn a vendor status into 0, or -ENOMEM/-EIO saying which call failed. */
int vmm_check(const struct vmm *m, int st, const char *call) {
  return st ? vmm_fail(m, st, call) : 0;
}

/* Hold the device's primary context, counted: retained on the first hold. */
int vmm_ctx_ref(struct vmm *m, int dev) {
  if (dev < 0 || dev >= m->ndev) return gpu_fail(-ENODEV, "no device %d", dev);
  pthread_mutex_lock(&m->mu);
  int rc = m->ctx_refs[dev] ? 0 : m->v->ctx_retain(dev);
  if (rc == 0) m->ctx_refs[dev]++;
  pthread_mutex_unlock(&m->mu);
  return rc ? vmm_fail(m, rc, "DevicePrimaryCtxRetain") : 0;
}

/* Let go of a hold; the last one releases the context. */
void vmm_ctx_unref(struct vmm *m, int dev) {
  pthread_mutex_lock(&m->mu);
  if (m->ctx_refs[dev] && --m->ctx_refs[dev] == 0) m->v->ctx_release(dev);
  pthread_mutex_unlock(&m->mu);
}

/* True while the device's context is held. */
bool vmm_ctx_held(struct vmm *m, unsigned dev) {
  pthread_mutex_lock(&m->mu);
  bool held = dev < GPUMEM_MAX_DEVICES && m->ctx_refs[dev] > 0;
  pthread_mutex_unlock(&m->mu);
  return held;
}

/* Make dev's held context current over the caller's. */
int vmm_ctx_enter(struct vmm *m, int dev, int *saved) {
  int st = m->v->ctx_enter(dev, saved);
  return st ? vmm_fail(m, st, "CtxPushCurrent") : 0;
}

/* Put back what was current before vmm_ctx_enter. */
void vmm_ctx_leave(struct vmm *m, int saved) { m->v->ctx_leave(saved); }

/* Keep the fd an allocation was imported from, for as long as the handle:
 * CUDA will not export an imported handle again (CUDA_ERROR_INVALID_VALUE
 * on an H200, driver 580, also through cuMemRetainAllocationHandle), and
 * a daemon that restarted needs an fd. Holding it changes nothing about
 * when memory is freed: the handle holds the allocation just as long. */
static int kept_put(struct vmm *m, uint64_t handle, int fd) {
  pthread_mutex_lock(&m->mu);
  int rc = idmap_put(m->kept, handle, (void *)(uintptr_t)(fd + 1));
  pthread_mutex_unlock(&m->mu);
  return rc;
}

/* The fd kept for a handle (-1 if none), forgotten if take. */
static int kept_get(struct vmm *m, uint64_t handle, bool take) {
  pthread_mutex_lock(&m->mu);
  int fd = (int)(uintptr_t)idmap_get(m->kept, handle) - 1;
  if (take && fd >= 0) idmap_del(m->kept, handle);
  pthread_mutex_unlock(&m->mu);
  return fd;
}

/* Import fd and keep it with the handle; the fd is consumed either way. */
int vmm_import_keep(struct vmm *m, int fd, uint64_t *handle) {
  int st = m->v->import_fd(fd, handle);
  if (st != 0) {
    close(fd);
    return st;
  }
  if (kept_put(m, *handle, fd) < 0) {
    m->v->release(*handle);
    close(fd);
    return -ENOMEM;
  }
  return 0;
}

/* A copy of the fd kept with a handle. */
int vmm_kept_dup(struct vmm *m, uint64_t handle, int *fd) {
  int kept = kept_get(m, handle, false);
  if (kept < 0) return -ENOENT;
  if ((*fd = fcntl(kept, F_DUPFD_CLOEXEC, 0)) < 0) return -errno;
  return 0;
}

/* Release a handle and close the fd kept with it. */
void vmm_release_handle(struct vmm *m, uint64_t handle) {
  int fd = kept_get(m, handle, true);
  m->v->release(handle);
  if (fd >= 0) close(fd);
}
