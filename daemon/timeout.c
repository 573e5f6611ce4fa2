#include "timeout.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"

/* Kill an owner that missed its ack, or end its session. */
bool timeout_kill(const struct outbox *out, struct owner *o, char *what, size_t len) {
  int rc = o->closed ? -ENOENT : out->stop(out->ctx, o);
  if (rc == -ENOENT) {
    snprintf(what, len, "session ended");
    return true;
  }
  if (rc == 0) {
    log_warn("killing pid %d: no ack in time", (int)o->pid);
    snprintf(what, len, "killed");
    return false;
  }
  const char *why = o->pid <= 0    ? "pid not visible here"
                    : rc == -EBADF ? "not pinned"
                    : rc == -ESRCH ? "process gone"
                                   : strerror(-rc);
  snprintf(what, len, "not signalled, %s: session ended", why);
  log_warn("pid %d not signalled (%s): no ack in time; session %llu ended, its buffers freed",
           (int)o->pid, why, (unsigned long long)o->id);
  struct fault f = {.code = GPUMEM__WIRE__ERROR_CODE__CLIENT_TIMEOUT};
  snprintf(f.text, sizeof f.text, "no ack in time: session ended (--timeout-policy kill)");
  out->end(out->ctx, o, &f);
  return true;
}
