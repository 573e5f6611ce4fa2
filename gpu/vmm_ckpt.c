/* The VMM backends' release of another process's device state, over the
 * driver's checkpoint calls (CUDA 12.8 on; HIP has none): lock the
 * process's device calls with a time limit, checkpoint it, and believe it
 * only when the management library then lists the process holding
 * nothing (a process that still mapped memory imported from the daemon
 * "succeeds" and keeps everything, measured on an H200); a restore brings
 * the state back and unlocks. */
#include <errno.h>
#include <stdlib.h>

#include "error.h"
#include "vmm_dev.h"
#include "vmm_dev_ckpt.h"

/* The device bytes the library lists for pid over every device, and
 * whether it lists it at all. */
static int listed_bytes(struct vmm_dev *x, int pid, uint64_t *bytes, bool *listed) {
  *bytes = 0;
  *listed = false;
  for (int d = 0; d < x->m.ndev; d++) {
    struct gpudev_process *list = NULL;
    size_t n = 0;
    int rc = x->v->processes(d, &list, &n);
    if (rc < 0) return rc;
    for (size_t i = 0; i < n; i++) {
      if (list[i].pid != pid) continue;
      *listed = true;
      if (list[i].used != GPUDEV_USED_UNKNOWN) *bytes += list[i].used;
    }
    free(list);
  }
  return 0;
}

/* The vendor's words for a checkpoint call that failed. */
static int ckpt_fail(struct vmm_dev *x, int err, int st, const char *call, int pid) {
  return gpu_fail(err, "%s%s(%d): %s", x->m.v->prefix, call, pid, x->m.v->error_name(st));
}

/* Where pid stands, or -ENOTSUP without the calls. */
static int ckpt_state(struct vmm_dev *x, int pid, enum vmm_ckpt_state *s) {
  if (!x->v->ckpt_state)
    return gpu_fail(-ENOTSUP, "the %s driver has no checkpoint calls", x->m.v->name);
  int st = x->v->ckpt_state(pid, s);
  if (st == -ENOTSUP)
    return gpu_fail(-ENOTSUP, "the %s driver has no checkpoint calls", x->m.v->name);
  return st ? ckpt_fail(x, -EIO, st, "CheckpointProcessGetState", pid) : 0;
}

/* Lock, checkpoint and check pid; undo what did not hold. */
int vmm_process_release(void *state, int pid, uint32_t lock_ms, uint64_t *moved) {
  struct vmm_dev *x = state;
  enum vmm_ckpt_state s;
  int rc = ckpt_state(x, pid, &s);
  if (rc < 0) return rc;
  if (s != VMM_CKPT_RUNNING)
    return gpu_fail(-EBUSY, "pid %d is not running under the driver (checkpoint state %d)", pid,
                    (int)s);
  bool listed;
  if ((rc = listed_bytes(x, pid, moved, &listed)) < 0) return rc;
  int st = x->v->ckpt_lock(pid, lock_ms ? lock_ms : 1);
  if (st) return ckpt_fail(x, -EBUSY, st, "CheckpointProcessLock", pid);
  if ((st = x->v->ckpt_checkpoint(pid))) {
    rc = ckpt_fail(x, -EIO, st, "CheckpointProcessCheckpoint", pid);
    x->v->ckpt_unlock(pid);
    return rc;
  }
  uint64_t left;
  /* Released means gone from the list: a figure of 0 (or none, where the
   * library gives no figures) for a process still listed is not enough. */
  if ((rc = listed_bytes(x, pid, &left, &listed)) == 0 && !listed) return 0;
  /* The driver said yes and kept the memory: undo it where it lets us. */
  int rst = x->v->ckpt_restore(pid), ust = rst ? 0 : x->v->ckpt_unlock(pid);
  if (rc < 0) return rc;
  return gpu_fail(-EBUSY,
                  "pid %d: the checkpoint returned success, but the driver still lists it "
                  "holding %llu bytes; %s",
                  pid, (unsigned long long)left,
                  rst   ? "the restore failed too"
                  : ust ? "restored, but the unlock failed"
                        : "restored");
}

/* Restore and unlock pid, from whatever step a release reached. */
int vmm_process_restore(void *state, int pid) {
  struct vmm_dev *x = state;
  enum vmm_ckpt_state s;
  int rc = ckpt_state(x, pid, &s);
  if (rc < 0) return rc;
  int st;
  if (s == VMM_CKPT_CHECKPOINTED && (st = x->v->ckpt_restore(pid)))
    return ckpt_fail(x, -EIO, st, "CheckpointProcessRestore", pid);
  if (s == VMM_CKPT_FAILED)
    return gpu_fail(-EIO, "pid %d: the driver says its checkpoint failed for good", pid);
  if (s != VMM_CKPT_RUNNING && (st = x->v->ckpt_unlock(pid)))
    return ckpt_fail(x, -EIO, st, "CheckpointProcessUnlock", pid);
  return 0;
}

/* Whether pid's state is released or its calls held. */
int vmm_process_released(void *state, int pid) {
  enum vmm_ckpt_state s;
  int rc = ckpt_state(state, pid, &s);
  return rc < 0 ? rc : s != VMM_CKPT_RUNNING;
}
