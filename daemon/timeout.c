#include "timeout.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "common/size.h"

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

/* Add an owner's pid (and what was done to it) to the tally. */
static void tally_owner(struct timeout_tally *t, pid_t pid, const char *what) {
  t->owners++;
  if (t->len < (int)sizeof t->pids)
    t->len += snprintf(t->pids + t->len, sizeof t->pids - (size_t)t->len, " %d%s%s%s", (int)pid,
                       what[0] ? " (" : "", what, what[0] ? ")" : "");
}

/* Count a group whose owner missed its ack. */
void timeout_tally_group(struct timeout_tally *t, const struct group *g, registry *reg,
                         const struct outbox *out, bool kill, struct outcome *o) {
  char what[80] = "";
  bool ended = kill && timeout_kill(out, g->s, what, sizeof what);
  tally_owner(t, g->s->pid, what);
  for (size_t i = 0; i < g->nids; i++) {
    struct buffer *b = registry_find(reg, g->ids[i]);
    if (b && !ended) outcome_hold(o, b);
    if (b && ended) {
      t->ended_buffers++;
      t->ended_bytes += b->size;
    }
  }
  outcome_note_pid(o, g->s->pid);
}

/* The timeout leads the operation's failure; an earlier one follows. */
void timeout_fail(struct outcome *o, const struct timeout_tally *t, uint32_t timeout_ms,
                  bool nothing_resumed) {
  char bytes[32], freed[96] = "", earlier[sizeof o->fault.text] = "";
  if (t->ended_buffers)
    snprintf(freed, sizeof freed, "; %llu buffers (%s) freed with their sessions",
             (unsigned long long)t->ended_buffers, size_format(t->ended_bytes, bytes, sizeof bytes));
  if (o->fault.code) snprintf(earlier, sizeof earlier, "; before that: %.200s", o->fault.text);
  o->fault.code = 0;
  outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__CLIENT_TIMEOUT,
               "no ack within %u ms from pid%s; %llu buffers (%s) held until they answer%s%s%.*s",
               timeout_ms, t->pids, (unsigned long long)o->held_buffers,
               size_format(o->held_bytes, bytes, sizeof bytes), freed,
               nothing_resumed ? "; nothing resumed" : "", 120, earlier);
}
