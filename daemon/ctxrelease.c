#include "ctxrelease.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "common/procstat.h"
#include "common/size.h"
#include "group.h"

struct ctxrelease {
  gpudev *gpu;
  struct list *owners;
  const struct outbox *out;
  uint32_t lock_ms;
  char journal[PATH_MAX];
};

/* One process's release or restore, run on a thread of its own. */
struct job {
  gpudev *gpu;
  pid_t pid;
  bool restore;
  uint32_t lock_ms;
  int rc;
  uint64_t moved, us;
  char why[200];
  pthread_t thread;
};

/* Create the releaser. */
ctxrelease *ctxrelease_create(gpudev *g, struct list *owners, const struct outbox *out,
                              const char *journal_path, uint32_t lock_ms) {
  ctxrelease *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->gpu = g;
  c->owners = owners;
  c->out = out;
  c->lock_ms = lock_ms;
  snprintf(c->journal, sizeof c->journal, "%s", journal_path ? journal_path : "");
  return c;
}

/* Microseconds of the monotonic clock. */
static uint64_t now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000 + (uint64_t)t.tv_nsec / 1000;
}

/* Run one job (on its thread). */
static void *job_run(void *arg) {
  struct job *j = arg;
  uint64_t t0 = now_us();
  j->rc = j->restore ? gpudev_process_restore(j->gpu, j->pid)
                     : gpudev_process_release(j->gpu, j->pid, j->lock_ms, &j->moved);
  if (j->rc < 0) snprintf(j->why, sizeof j->why, "%s", gpu_error());
  j->us = now_us() - t0;
  return NULL;
}

/* Run n jobs at once, one thread each (inline where no thread can be
 * made), and wait for all of them. */
static void jobs_run(struct job *v, size_t n) {
  bool *threaded = calloc(n + 1, sizeof *threaded);
  for (size_t i = 0; i < n; i++) {
    if (threaded && pthread_create(&v[i].thread, NULL, job_run, &v[i]) == 0)
      threaded[i] = true;
    else
      job_run(&v[i]);
  }
  for (size_t i = 0; i < n; i++)
    if (threaded && threaded[i]) pthread_join(v[i].thread, NULL);
  free(threaded);
}

/* The start time of pid, 0 if it is gone. */
static unsigned long long start_time(pid_t pid) {
  struct procstat st;
  return procstat_read((int)pid, &st) == 0 ? st.start_time : 0;
}

/* Write the released processes (pid and start time, one per line) to
 * the journal, or remove it when there are none. */
static void journal_write(ctxrelease *c) {
  if (!c->journal[0]) return;
  char tmp[PATH_MAX + 8];
  snprintf(tmp, sizeof tmp, "%s.new", c->journal);
  FILE *f = NULL;
  for (struct list *p = c->owners->next; p != c->owners; p = p->next) {
    const struct owner *o = list_entry(p, struct owner, link);
    if (!o->released) continue;
    int fd = f ? -1 : open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (!f && (fd < 0 || !(f = fdopen(fd, "w")))) {
      log_error("context release: cannot write %s: %s", tmp, strerror(errno));
      if (fd >= 0) close(fd);
      return;
    }
    fprintf(f, "%d %llu\n", (int)o->pid, start_time(o->pid));
  }
  if (!f) {
    unlink(c->journal);
    return;
  }
  if (fclose(f) != 0 || rename(tmp, c->journal) != 0)
    log_error("context release: cannot write %s: %s", c->journal, strerror(errno));
}

/* Whether o's process is the one its session pinned (an outbox that
 * cannot tell, a test's, says yes). */
static int pinned(ctxrelease *c, struct owner *o) {
  return c->out->pinned ? c->out->pinned(c->out->ctx, o) : 0;
}

/* Mark every session of pid released (with moved bytes) or not. */
static void mark(ctxrelease *c, pid_t pid, bool released, uint64_t moved) {
  for (struct list *p = c->owners->next; p != c->owners; p = p->next) {
    struct owner *o = list_entry(p, struct owner, link);
    if (o->pid != pid) continue;
    o->released = released;
    o->moved = released ? moved : 0;
  }
}

/* A session of pid that is released, or NULL. */
static struct owner *released_session(ctxrelease *c, pid_t pid) {
  for (struct list *p = c->owners->next; p != c->owners; p = p->next) {
    struct owner *o = list_entry(p, struct owner, link);
    if (o->pid == pid && o->released) return o;
  }
  return NULL;
}

/* True if pid lives in the daemon's pid namespace. */
static bool same_pid_namespace(pid_t pid) {
  char p[64];
  struct stat mine, theirs;
  snprintf(p, sizeof p, "/proc/%d/ns/pid", (int)pid);
  return stat("/proc/self/ns/pid", &mine) == 0 && stat(p, &theirs) == 0 &&
         mine.st_dev == theirs.st_dev && mine.st_ino == theirs.st_ino;
}

/* Why a worker session may not be released now ("" if it may). */
static void session_refusal(ctxrelease *c, struct owner *o, char *why, size_t len) {
  if (!o->release_ok) {
    snprintf(why, len,
             "session %llu (%.64s) did not opt in to context release (GPUMEM_RELEASE_CONTEXT=1)",
             (unsigned long long)o->id, o->name);
    return;
  }
  for (struct list *p = o->buffers.next; p != &o->buffers; p = p->next) {
    const struct buffer *b = list_entry(p, struct buffer, owner_link);
    if (b->state == BUF_PAUSED && !b->has_memory) continue;
    snprintf(why, len, "it still maps buffer %llu (tag %s%s)", (unsigned long long)b->id,
             b->tag->name, b->flags & BUF_FLAG_IPC_LEGACY ? ", legacy IPC memory" : "");
    return;
  }
  if (o->nbuffers && !o->nothing_mapped) {
    snprintf(why, len, "session %llu did not say in its last unmap ack that it maps nothing",
             (unsigned long long)o->id);
    return;
  }
  int pin = pinned(c, o);
  if (pin == -EBADF)
    snprintf(why, len, "its process was not pinned at connect");
  else if (pin < 0)
    snprintf(why, len, "it is no longer the process that connected");
}

/* Why process pid may not be released now, by a pause that requester's
 * process asked for ("" if it may). */
static void refusal(ctxrelease *c, pid_t pid, pid_t requester, char *why, size_t len) {
  why[0] = '\0';
  if (pid <= 0 || !same_pid_namespace(pid)) {
    snprintf(why, len, "it is in another pid namespace");
    return;
  }
  if (pid == requester && gpudev_release_stops_process(c->gpu)) {
    snprintf(why, len, "it asked for the pause itself, and the %s backend's release stops the "
             "whole process", gpudev_name(c->gpu));
    return;
  }
  for (struct list *p = c->owners->next; p != c->owners && !why[0]; p = p->next) {
    struct owner *o = list_entry(p, struct owner, link);
    if (o->pid == pid && o->role == GPUMEM__WIRE__ROLE__ROLE_WORKER)
      session_refusal(c, o, why, len);
  }
}

/* Whether owner o has a buffer sc covers. */
static bool covered(const struct owner *o, const struct scope *sc) {
  for (struct list *p = o->buffers.next; p != &o->buffers; p = p->next)
    if (scope_covers(sc, list_entry(p, struct buffer, owner_link))) return true;
  return false;
}

/* Add pid to v (n of them) unless it is there. */
static bool add_pid(pid_t *v, size_t *n, pid_t pid) {
  for (size_t i = 0; i < *n; i++)
    if (v[i] == pid) return false;
  v[(*n)++] = pid;
  return true;
}

/* What a job's outcome means for the operation. */
enum verdict { RELEASE, REFUSAL, RESTORE };

/* Note one job's outcome in o: a refusal (RELEASE_REFUSED, the pause
 * itself done) or a release that did not hold (NOT_RELEASED) becomes the
 * operation's failure once the driver's figures are judged
 * (outcome_fail_releases); a restore's failure is the resume's to report.
 * Returns true if the job did it. */
static bool note(struct outcome *o, const struct job *j, enum verdict v) {
  bool done = !j->why[0];
  struct outcome_release *r = outcome_add_release(o, j->pid);
  if (r) {
    r->released = v == RELEASE && done;
    r->refused = v == REFUSAL;
    r->failed = v == RELEASE && !done;
    r->moved = j->moved;
    r->us = j->us;
    snprintf(r->why, sizeof r->why, "%s", j->why);
  }
  if (!done && v != RESTORE) outcome_note_pid(o, j->pid);
  if (!r && !done) outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  return done;
}

/* Release the covered worker processes that may be released. */
void ctxrelease_pause(ctxrelease *c, const struct scope *sc, pid_t requester,
                      struct outcome *o) {
  size_t cap = 0, n = 0;
  for (struct list *p = c->owners->next; p != c->owners; p = p->next) cap++;
  pid_t *pids = calloc(cap + 1, sizeof *pids);
  struct job *jobs = calloc(cap + 1, sizeof *jobs);
  if (!pids || !jobs) {
    outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory: nothing released");
    goto out;
  }
  for (struct list *p = c->owners->next; p != c->owners; p = p->next) {
    struct owner *w = list_entry(p, struct owner, link);
    if (w->role == GPUMEM__WIRE__ROLE__ROLE_WORKER && covered(w, sc)) add_pid(pids, &n, w->pid);
  }
  size_t njobs = 0;
  for (size_t i = 0; i < n; i++) {
    struct owner *done = released_session(c, pids[i]);
    struct job j = {.gpu = c->gpu, .pid = pids[i], .lock_ms = c->lock_ms};
    if (done) { /* an earlier pause released it */
      struct outcome_release *r = outcome_add_release(o, pids[i]);
      if (r) *r = (struct outcome_release){.pid = pids[i], .released = true, .moved = done->moved};
      continue;
    }
    refusal(c, pids[i], requester, j.why, sizeof j.why);
    if (j.why[0])
      note(o, &j, REFUSAL);
    else
      jobs[njobs++] = j;
  }
  jobs_run(jobs, njobs);
  for (size_t i = 0; i < njobs; i++) {
    char moved[32];
    if (note(o, &jobs[i], jobs[i].rc == -ENOTSUP ? REFUSAL : RELEASE)) {
      mark(c, jobs[i].pid, true, jobs[i].moved);
      log_info("pid %d: device state released, %s moved to host memory, in %llu us",
               (int)jobs[i].pid, size_format(jobs[i].moved, moved, sizeof moved),
               (unsigned long long)jobs[i].us);
    } else if (gpudev_process_released(c->gpu, jobs[i].pid) == 1) {
      /* Still held by the driver: kept, so that a resume, its session's
       * end or the daemon's stop (or the next daemon) restores it. */
      mark(c, jobs[i].pid, true, 0);
      log_error("pid %d: device state not released, and the driver still holds it (restored "
                "at the resume): %s", (int)jobs[i].pid, jobs[i].why);
    } else {
      log_error("pid %d: device state not released: %s", (int)jobs[i].pid, jobs[i].why);
    }
  }
  journal_write(c);
out:
  free(pids);
  free(jobs);
}

/* Restore the released owners of groups. */
bool ctxrelease_resume(ctxrelease *c, struct list *groups, struct outcome *o, struct fault *f) {
  size_t cap = 0, n = 0;
  for (struct list *p = groups->next; p != groups; p = p->next) cap++;
  struct job *jobs = calloc(cap + 1, sizeof *jobs);
  pid_t *pids = calloc(cap + 1, sizeof *pids);
  bool ok = jobs && pids;
  for (struct list *p = groups->next; ok && p != groups; p = p->next) {
    struct owner *w = list_entry(p, struct group, link)->s;
    if (released_session(c, w->pid) && add_pid(pids, &n, w->pid))
      jobs[n - 1] = (struct job){.gpu = c->gpu, .pid = w->pid, .restore = true};
  }
  if (!ok) fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  jobs_run(jobs, ok ? n : 0);
  for (size_t i = 0; ok && i < n; i++) {
    if (note(o, &jobs[i], RESTORE)) {
      mark(c, jobs[i].pid, false, 0);
      log_info("pid %d: device state restored in %llu us", (int)jobs[i].pid,
               (unsigned long long)jobs[i].us);
    } else if (!f->code) {
      fault_set(f, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED, "pid %d: device state not restored: %s",
                (int)jobs[i].pid, jobs[i].why);
    }
  }
  if (n) journal_write(c);
  free(jobs);
  free(pids);
  return ok && !f->code;
}

/* Restore one process now, saying why it happens; false if it failed. */
static bool restore_now(ctxrelease *c, pid_t pid, const char *because) {
  struct job j = {.gpu = c->gpu, .pid = pid, .restore = true};
  job_run(&j);
  if (j.rc == 0)
    log_info("pid %d: device state restored (%s)", (int)pid, because);
  else
    log_error("pid %d: device state not restored (%s): %s", (int)pid, because, j.why);
  return j.rc == 0;
}

/* Whether a process is released. */
bool ctxrelease_holds(ctxrelease *c, pid_t pid) { return released_session(c, pid) != NULL; }

/* A released session ended. */
void ctxrelease_forget(ctxrelease *c, struct owner *s) {
  if (!s->released) return;
  s->released = false;
  if (released_session(c, s->pid)) return; /* its other sessions keep it released */
  if (pinned(c, s) == 0) restore_now(c, s->pid, "its last session ended");
  journal_write(c);
}

/* Restore everything still released, then free. */
void ctxrelease_destroy(ctxrelease *c) {
  if (!c) return;
  bool all = true;
  for (struct list *p = c->owners->next; p != c->owners; p = p->next) {
    struct owner *o = list_entry(p, struct owner, link);
    if (o->released && pinned(c, o) == 0 && restore_now(c, o->pid, "gpumemd is stopping"))
      mark(c, o->pid, false, 0);
    else if (o->released && pinned(c, o) != 0)
      mark(c, o->pid, false, 0); /* gone */
    else if (o->released)
      all = false; /* kept in the journal for the next daemon */
  }
  if (all && c->journal[0]) unlink(c->journal);
  else journal_write(c);
  free(c);
}

/* Restore what a daemon that died left released. */
void ctxrelease_recover(gpudev *g, const char *journal_path) {
  int fd = open(journal_path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  struct stat st;
  if (fd < 0) return;
  FILE *f = fstat(fd, &st) == 0 && st.st_uid == geteuid() ? fdopen(fd, "r") : NULL;
  if (!f) { /* not ours: someone else's file is not trusted with pids */
    log_warn("context release: %s is not this user's file: ignored", journal_path);
    close(fd);
    return;
  }
  int pid;
  unsigned long long started;
  bool all = true;
  while (fscanf(f, "%d %llu", &pid, &started) == 2) {
    if (pid <= 0 || start_time(pid) != started) continue; /* gone, or another process now */
    if (gpudev_process_released(g, pid) != 1) continue;
    struct ctxrelease c = {.gpu = g};
    all &= restore_now(&c, pid, "released by a gpumemd that stopped");
  }
  fclose(f);
  if (all) unlink(journal_path); /* else kept: the next start tries again */
}
