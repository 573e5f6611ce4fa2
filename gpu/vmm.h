/* The VMM backends' common ground (CUDA and HIP): the vendor calls both
 * halves make, loaded at run time, and the state both halves keep over
 * them: the devices, the granularity, the device contexts this state
 * holds, and the fds imported handles came from. The daemon's half
 * (gpu/vmm_dev.h) and the client's half (gpu/vmm_va.h) add their own
 * calls; the VMM logic is written once over these tables, so that every
 * test on one vendor exercises the code the other runs. Every vendor call
 * returns the vendor's status: 0 is success. Internal to gpu/. */
#ifndef GPUMEM_GPU_VMM_H
#define GPUMEM_GPU_VMM_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/idmap.h"
#include "common/limits.h"

/* The vendor headers each backend was compiled against ("HIP 6.4.43484"). */
extern const char vmm_cuda_headers[];
extern const char vmm_hip_headers[];

/* A part of a vendor runtime loaded once per process (the runtime itself,
 * or the calls one half resolves in it): the function that loads it, how
 * that ended, 0 or -errno, and why it failed (load fills both). */
struct vmm_once {
  pthread_once_t once;
  void (*load)(void);
  int status;
  char error[256];
};

/* The vendor calls of both halves. */
struct vmm_vendor {
  const char *name;        /* "cuda", "hip" */
  const char *prefix;      /* "cu", "hip": error messages name calls prefix+Name */
  const char *device_word; /* "CUDA", "HIP": for "no CUDA device found" */
  int oom;                 /* the vendor's out-of-memory status */
  /* dlopen the runtime and initialize it; 0, or -errno with err filled. */
  int (*load)(char *err, size_t errlen);
  const char *(*error_name)(int rc);
  int (*device_count)(int *n);
  int (*granularity)(int dev, uint64_t *g);
  int (*release)(uint64_t handle);
  int (*import_fd)(int fd, uint64_t *handle);
  int (*reserve)(uint64_t size, uint64_t align, uint64_t *va);
  int (*address_free)(uint64_t va, uint64_t size);
  int (*map)(uint64_t va, uint64_t size, uint64_t handle);
  int (*unmap)(uint64_t va, uint64_t size);
  int (*set_access)(uint64_t va, uint64_t size, int dev);
  /* Hold (retain) the device's primary context, or let go of it; neither
   * changes what is current on the calling thread. */
  int (*ctx_retain)(int dev);
  int (*ctx_release)(int dev);
  /* Make the retained context of dev current on this thread over what was
   * (CUDA: pushed; HIP: the device chosen, the one before kept in *saved);
   * ctx_leave puts back what was current, context or none. */
  int (*ctx_enter)(int dev, int *saved);
  int (*ctx_leave)(int saved);
};

extern const struct vmm_vendor vmm_cuda;
extern const struct vmm_vendor vmm_hip;

/* Run o's load once per process; o's status every time, with err filled
 * from o's error where it failed. */
int vmm_once_run(struct vmm_once *o, char *err, size_t errlen);

/* Record in o why its load failed: status (-errno) and fmt's words. */
void vmm_once_fail(struct vmm_once *o, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* One half's state over a vendor. */
struct vmm {
  const struct vmm_vendor *v;
  int ndev;
  uint64_t granularity;
  pthread_mutex_t mu;
  unsigned ctx_refs[GPUMEM_MAX_DEVICES]; /* holds on each device's context */
  idmap *kept; /* imported handle -> fd + 1 it came from, under mu */
};

/* Load the vendor runtime and learn its devices and granularity into m.
 * 0, or -errno with err filled. */
int vmm_open(struct vmm *m, const struct vmm_vendor *v, char *err, size_t errlen);

/* A half's state over v: size zeroed bytes that begin with its struct vmm,
 * opened with vmm_open once the runtime and then the half's calls (once)
 * are loaded. 0 with *state set, or -errno with err filled. */
int vmm_open_state(const struct vmm_vendor *v, struct vmm_once *once, size_t size, void **state,
                   char *err, size_t errlen);

/* Let go of every context m still holds and free what it has and the
 * state it begins (from vmm_open_state). */
void vmm_close_state(struct vmm *m);

/* Turn a vendor status into -ENOMEM/-EIO, saying which call failed (its
 * name without the vendor's prefix: "MemMap"). */
int vmm_fail(const struct vmm *m, int st, const char *call);

/* Turn a vendor status into 0, or -ENOMEM/-EIO saying which call failed. */
int vmm_check(const struct vmm *m, int st, const char *call);

/* Hold the device's primary context, counted: retained on the first hold.
 * What is current on the thread does not change. */
int vmm_ctx_ref(struct vmm *m, int dev);

/* Let go of a hold taken with vmm_ctx_ref; the last one releases it. */
void vmm_ctx_unref(struct vmm *m, int dev);

/* True while m holds the device's context. */
bool vmm_ctx_held(struct vmm *m, unsigned dev);

/* Make dev's held context current on this thread over the caller's, which
 * vmm_ctx_leave(saved) puts back. */
int vmm_ctx_enter(struct vmm *m, int dev, int *saved);

/* Put back what was current before vmm_ctx_enter. */
void vmm_ctx_leave(struct vmm *m, int saved);

/* Import fd and keep it with the handle until vmm_release_handle; the fd
 * is consumed either way. Returns the vendor's status, or -ENOMEM. */
int vmm_import_keep(struct vmm *m, int fd, uint64_t *handle);

/* A new fd for a handle, a copy of the one kept with it: 0, -ENOENT where
 * none is kept (the handle was not imported), or -errno. */
int vmm_kept_dup(struct vmm *m, uint64_t handle, int *fd);

/* Release a handle and close the fd kept with it. */
void vmm_release_handle(struct vmm *m, uint64_t handle);

#endif
