#include "ctxrelease.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
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

/* What a job does. */
enum job_kind {
  JOB_RELEASE, /* a pause's release */
  JOB_RESTORE, /* a resume's restore, before its remaps */
  JOB_FORGET,  /* the restore of a process whose last session ended */
};

/* Who collects a job that finished. */
enum job_collector {
  BY_BATCH,  /* the pause or resume it belongs to (at the loop's next turn) */
  BY_WAITER, /* the daemon's stop, waiting for it on the loop's thread */
  LATE,      /* nobody waits: its result is applied when it comes */
  ANY,       /* (jobs_wait only: every job, whoever collects it) */
};

/* One process's release or restore, on a thread of its own. The thread
 * touches nothing of it after it sets finished, under the lock. */
struct job {
  struct list link; /* ctxrelease.jobs, until collected */
  ctxrelease *c;
  pid_t pid;
  enum job_kind kind;
  enum job_collector by;
  bool finished; /* under c->lock */
  int rc;
  uint64_t moved, us;
  char why[200];
};

struct ctxrelease {
  gpudev *gpu;
  struct list *owners;
  const struct outbox *out;
  uint32_t lock_ms, limit_ms;
  char journal[PATH_MAX];
  struct list jobs;     /* started and not collected */
  pthread_mutex_t lock; /* job.finished, closed */
  pthread_cond_t cond;  /* a job finished */
  bool closed;          /* no more wake-ups: the loop's handles are closing */
  bool leak;            /* jobs still in the driver at the stop: never freed */
  uv_async_t wake;      /* a job finished */
  uv_timer_t timer;     /* the pause's bound on its releases */
  int open_handles;
  struct {              /* the pause whose releases (or resume whose restores) run */
    bool active;
    size_t left;
    struct outcome *o;
    struct fault *f; /* a resume's: its first failed restore */
    ctxrelease_done done;
    void *arg;
  } batch;
};

static void on_wake(uv_async_t *h);

/* Job threads inside a backend call, process-wide (the backend must
 * outlive them: ctxrelease_in_driver). */
static atomic_int in_driver;

/* Create the releaser. */
ctxrelease *ctxrelease_create(uv_loop_t *loop, gpudev *g, struct list *owners,
                              const struct outbox *out, const char *journal_path,
                              uint32_t lock_ms, uint32_t limit_ms) {
  ctxrelease *c = calloc(1, sizeof *c);
  pthread_condattr_t ca;
  if (!c || pthread_condattr_init(&ca)) {
    free(c);
    return NULL;
  }
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  int rc = pthread_cond_init(&c->cond, &ca);
  pthread_condattr_destroy(&ca);
  if (rc || pthread_mutex_init(&c->lock, NULL)) {
    if (!rc) pthread_cond_destroy(&c->cond);
    free(c);
    return NULL;
  }
  c->gpu = g;
  c->owners = owners;
  c->out = out;
  c->lock_ms = lock_ms;
  c->limit_ms = limit_ms ? limit_ms : 1;
  list_init(&c->jobs);
  snprintf(c->journal, sizeof c->journal, "%s", journal_path ? journal_path : "");
  uv_async_init(loop, &c->wake, on_wake);
  uv_timer_init(loop, &c->timer);
  c->wake.data = c->timer.data = c;
  c->open_handles = 2;
  return c;
}

/* Microseconds of the monotonic clock. */
static uint64_t now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000 + (uint64_t)t.tv_nsec / 1000;
}

/* Run one job (on its thread), then say it finished. */
static void *job_run(void *arg) {
  struct job *j = arg;
  ctxrelease *c = j->c;
  uint64_t t0 = now_us(), moved = 0;
  int rc = j->kind == JOB_RELEASE ? gpudev_process_release(c->gpu, j->pid, c->lock_ms, &moved)
                                  : gpudev_process_restore(c->gpu, j->pid);
  atomic_fetch_sub(&in_driver, 1);
  pthread_mutex_lock(&c->lock);
  j->rc = rc;
  j->moved = moved;
  j->us = now_us() - t0;
  if (rc < 0) snprintf(j->why, sizeof j->why, "%s", *gpu_error() ? gpu_error() : strerror(-rc));
  j->finished = true;
  pthread_cond_broadcast(&c->cond);
  if (!c->closed) uv_async_send(&c->wake);
  pthread_mutex_unlock(&c->lock);
  return NULL;
}

/* Start a job on a thread of its own (inline where none can be made);
 * NULL out of host memory. */
static struct job *job_start(ctxrelease *c, pid_t pid, enum job_kind kind,
                             enum job_collector by) {
  struct job *j = calloc(1, sizeof *j);
  if (!j) return NULL;
  *j = (struct job){.c = c, .pid = pid, .kind = kind, .by = by};
  list_append(&c->jobs, &j->link);
  atomic_fetch_add(&in_driver, 1);
  pthread_attr_t a;
  pthread_t t;
  bool threaded = pthread_attr_init(&a) == 0;
  if (threaded) {
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    threaded = pthread_create(&t, &a, job_run, j) == 0;
    pthread_attr_destroy(&a);
  }
  if (!threaded) job_run(j);
  return j;
}

/* Whether j has finished. */
static bool job_finished(ctxrelease *c, struct job *j) {
  pthread_mutex_lock(&c->lock);
  bool f = j->finished;
  pthread_mutex_unlock(&c->lock);
  return f;
}

/* Whether every job collected by `by` (every job: ANY) has finished
 * (under the lock). */
static bool all_finished(ctxrelease *c, enum job_collector by) {
  for (struct list *p = c->jobs.next; p != &c->jobs; p = p->next) {
    const struct job *j = list_entry(p, struct job, link);
    if ((by == ANY || j->by == by) && !j->finished) return false;
  }
  return true;
}

/* Wait, at most until the monotonic time end_us, for the jobs collected
 * by `by` (ANY: all) to finish; true if they all did. */
static bool jobs_wait(ctxrelease *c, enum job_collector by, uint64_t end_us) {
  struct timespec ts = {.tv_sec = (time_t)(end_us / 1000000),
                        .tv_nsec = (long)(end_us % 1000000) * 1000};
  pthread_mutex_lock(&c->lock);
  bool all;
  while (!(all = all_finished(c, by)) && pthread_cond_timedwait(&c->cond, &c->lock, &ts) == 0) {
  }
  all = all || all_finished(c, by);
  pthread_mutex_unlock(&c->lock);
  return all;
}

/* The job of pid that has not been collected, or NULL. */
static struct job *inflight(ctxrelease *c, pid_t pid) {
  for (struct list *p = c->jobs.next; p != &c->jobs; p = p->next) {
    struct job *j = list_entry(p, struct job, link);
    if (j->pid == pid) return j;
  }
  return NULL;
}

/* What the operation that waited for j says when it gave no answer in
 * time (into said); j's result is applied when it comes (LATE). */
static void job_timed_out(const ctxrelease *c, struct job *j, struct job *said) {
  *said = (struct job){.pid = j->pid, .kind = j->kind, .rc = -ETIMEDOUT,
                       .us = (uint64_t)c->limit_ms * 1000};
  snprintf(said->why, sizeof said->why,
           "the driver has not returned from the %s of pid %d in %u ms (--release-timeout); %s",
           j->kind == JOB_RELEASE ? "release" : "restore", (int)j->pid, (unsigned)c->limit_ms,
           j->kind == JOB_RELEASE ? "it counts as released until the driver says otherwise"
                                  : "it stays released, for a later resume");
  j->by = LATE;
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
  /* The released sessions' pids, then those whose release or restore is
   * still in the driver (their sessions may have ended). */
  struct list *p = c->owners->next, *q = c->jobs.next;
  while (p != c->owners || q != &c->jobs) {
    pid_t pid;
    if (p != c->owners) {
      const struct owner *o = list_entry(p, struct owner, link);
      p = p->next;
      if (!o->released) continue;
      pid = o->pid;
    } else {
      pid = list_entry(q, struct job, link)->pid;
      q = q->next;
    }
    int fd = f ? -1 : open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (!f && (fd < 0 || !(f = fdopen(fd, "w")))) {
      log_error("context release: cannot write %s: %s", tmp, strerror(errno));
      if (fd >= 0) close(fd);
      return;
    }
    fprintf(f, "%d %llu\n", (int)pid, start_time(pid)); /* a pid twice is restored once */
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

/* Whether owner o has a buffer of a tag sc names, on its devices. */
static bool covered(const struct owner *o, const struct scope *sc) {
  for (struct list *p = o->buffers.next; p != &o->buffers; p = p->next) {
    const struct buffer *b = list_entry(p, struct buffer, owner_link);
    if (!scope_covers(sc, b)) continue; /* devices and sessions */
    for (size_t t = 0; t < sc->ntags; t++)
      if (strcmp(sc->tags[t], b->tag->name) == 0) return true;
  }
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
  bool done = j->rc == 0 && !j->why[0];
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

/* Start restoring pid, whose sessions all ended, without waiting. */
static void forget_start(ctxrelease *c, pid_t pid) {
  if (!job_start(c, pid, JOB_FORGET, LATE))
    log_error("pid %d: device state not restored: out of host memory", (int)pid);
}

/* Apply a finished release of pid: keep it released where the driver
 * holds it (restoring it at once if its sessions ended meanwhile). */
static void release_done(ctxrelease *c, const struct job *j, bool late) {
  bool held = j->rc == 0 || gpudev_process_released(c->gpu, j->pid) == 1;
  mark(c, j->pid, held, j->rc == 0 ? j->moved : 0);
  char moved[32];
  if (held && !released_session(c, j->pid)) {
    log_info("pid %d: its sessions ended while it was released: restoring it", (int)j->pid);
    forget_start(c, j->pid);
  } else if (j->rc == 0) {
    log_info("pid %d: device state released%s, %s moved to host memory, in %llu us",
             (int)j->pid, late ? " after its pause answered" : "",
             size_format(j->moved, moved, sizeof moved), (unsigned long long)j->us);
  } else if (held) {
    /* Kept, so that a resume, its session's end or the daemon's stop (or
     * the next daemon) restores it. */
    log_error("pid %d: device state not released, and the driver still holds it (restored "
              "at the resume): %s", (int)j->pid, j->why);
  } else {
    log_error("pid %d: device state not released: %s", (int)j->pid, j->why);
  }
}

/* Apply a finished restore of pid; one that failed for a process the
 * driver still holds and no session keeps released is tried again once
 * (its sessions ended during it: no resume will come). */
static void restore_done(ctxrelease *c, const struct job *j, const char *because) {
  if (j->rc == 0) {
    if (j->kind != JOB_FORGET) mark(c, j->pid, false, 0);
    log_info("pid %d: device state restored (%s) in %llu us", (int)j->pid, because,
             (unsigned long long)j->us);
    return;
  }
  log_error("pid %d: device state not restored (%s): %s", (int)j->pid, because, j->why);
  if (j->kind != JOB_FORGET && !released_session(c, j->pid) &&
      gpudev_process_released(c->gpu, j->pid) == 1)
    forget_start(c, j->pid);
}

/* The pause's releases have all ended, or its bound passed. */
static void batch_end(ctxrelease *c) {
  uv_timer_stop(&c->timer);
  c->batch.active = false;
  journal_write(c);
  c->batch.done(c->batch.arg);
}

/* Note a resume's restore of j in its outcome; its first failure is the
 * resume's. */
static void restore_noted(ctxrelease *c, const struct job *j) {
  if (!note(c->batch.o, j, RESTORE) && !c->batch.f->code)
    fault_set(c->batch.f, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED,
              "pid %d: device state not restored: %s", (int)j->pid, j->why);
  restore_done(c, j, "its resume");
}

/* Collect the jobs that finished and apply their results; with no batch
 * (the daemon stops), a release is only marked, for the stop to restore. */
static bool collect(ctxrelease *c) {
  bool changed = false;
  struct list *p, *n;
  list_for_each_safe(p, n, &c->jobs) {
    struct job *j = list_entry(p, struct job, link);
    if (j->by == BY_WAITER || !job_finished(c, j)) continue;
    list_remove(&j->link);
    if (j->by == BY_BATCH && c->batch.active && j->kind == JOB_RESTORE) {
      restore_noted(c, j);
      c->batch.left--;
    } else if (j->by == BY_BATCH && c->batch.active) {
      note(c->batch.o, j, j->rc == -ENOTSUP ? REFUSAL : RELEASE);
      release_done(c, j, false);
      c->batch.left--;
    } else if (j->kind == JOB_RELEASE && !c->batch.active && c->closed) {
      mark(c, j->pid, j->rc == 0 || gpudev_process_released(c->gpu, j->pid) == 1, j->moved);
    } else if (j->kind == JOB_RELEASE) {
      release_done(c, j, true);
    } else {
      restore_done(c, j, j->kind == JOB_FORGET ? "its last session ended"
                                              : "after its resume answered");
    }
    changed = true;
    free(j);
  }
  return changed;
}

/* A job finished (from the loop). */
static void on_wake(uv_async_t *h) {
  ctxrelease *c = h->data;
  bool changed = collect(c);
  if (c->batch.active && !c->batch.left)
    batch_end(c);
  else if (changed)
    journal_write(c);
}

/* The pause's bound passed: it answers without the releases still in the
 * driver, which count as released until they return. */
static void on_deadline(uv_timer_t *t) {
  ctxrelease *c = t->data;
  collect(c); /* what finished meanwhile counts; the batch ends once, below */
  for (struct list *p = c->jobs.next; p != &c->jobs; p = p->next) {
    struct job *j = list_entry(p, struct job, link), said;
    if (j->by != BY_BATCH) continue;
    bool restore = j->kind == JOB_RESTORE;
    job_timed_out(c, j, &said);
    note(c->batch.o, &said, restore ? RESTORE : RELEASE);
    if (restore && !c->batch.f->code)
      fault_set(c->batch.f, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED, "%s", said.why);
    log_error("pid %d: %s", (int)j->pid, said.why);
  }
  batch_end(c);
}

/* The operation whose n jobs were just started waits for them (done),
 * at most the bound from now. */
static void batch_start(ctxrelease *c, size_t n, struct outcome *o, struct fault *f,
                        ctxrelease_done done, void *arg) {
  c->batch.active = true;
  c->batch.left = n;
  c->batch.o = o;
  c->batch.f = f;
  c->batch.done = done;
  c->batch.arg = arg;
  uv_update_time(c->timer.loop); /* the bound counts from now, not the turn's start */
  uv_timer_start(&c->timer, on_deadline, c->limit_ms, 0);
  journal_write(c);
}

/* Start releasing the covered worker processes that may be released. */
bool ctxrelease_pause(ctxrelease *c, const struct scope *sc, pid_t requester,
                      struct outcome *o, ctxrelease_done done, void *arg) {
  size_t cap = 0, n = 0, started = 0;
  for (struct list *p = c->owners->next; p != c->owners; p = p->next) cap++;
  pid_t *pids = calloc(cap + 1, sizeof *pids);
  if (!pids) {
    outcome_fail(o, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory: nothing released");
    return false;
  }
  for (struct list *p = c->owners->next; p != c->owners; p = p->next) {
    struct owner *w = list_entry(p, struct owner, link);
    if (w->role == GPUMEM__WIRE__ROLE__ROLE_WORKER && covered(w, sc)) add_pid(pids, &n, w->pid);
  }
  for (size_t i = 0; i < n; i++) {
    struct owner *done_before = released_session(c, pids[i]);
    struct job j = {.pid = pids[i]};
    if (inflight(c, pids[i])) {
      snprintf(j.why, sizeof j.why, "the driver has not yet returned from an earlier release "
               "or restore of pid %d", (int)pids[i]);
      note(o, &j, RELEASE);
      continue;
    }
    if (done_before) { /* an earlier pause released it */
      struct outcome_release *r = outcome_add_release(o, pids[i]);
      if (r)
        *r = (struct outcome_release){.pid = pids[i], .released = true,
                                      .moved = done_before->moved};
      continue;
    }
    refusal(c, pids[i], requester, j.why, sizeof j.why);
    if (j.why[0]) {
      note(o, &j, REFUSAL);
      continue;
    }
    mark(c, pids[i], true, 0); /* held from now: no allocation, in the journal */
    if (job_start(c, pids[i], JOB_RELEASE, BY_BATCH)) {
      started++;
      continue;
    }
    mark(c, pids[i], false, 0);
    snprintf(j.why, sizeof j.why, "out of host memory");
    note(o, &j, RELEASE);
  }
  free(pids);
  if (!started) return false;
  batch_start(c, started, o, NULL, done, arg);
  return true;
}

/* Start restoring the released owners of groups. */
bool ctxrelease_resume(ctxrelease *c, struct list *groups, struct outcome *o, struct fault *f,
                       struct fault *later, ctxrelease_done done, void *arg) {
  size_t n = 0;
  for (struct list *p = groups->next; p != groups && !f->code; p = p->next) {
    pid_t pid = list_entry(p, struct group, link)->s->pid;
    struct job *j = inflight(c, pid);
    if (j && j->by == BY_BATCH && j->kind == JOB_RESTORE) continue; /* another session of it */
    if (j)
      fault_set(f, GPUMEM__WIRE__ERROR_CODE__NOT_RELEASED,
                "pid %d: the driver has not yet returned from an earlier release or restore "
                "of it", (int)pid);
    else if (!released_session(c, pid))
      continue;
    else if (job_start(c, pid, JOB_RESTORE, BY_BATCH))
      n++;
    else
      fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  }
  if (!n) return false;
  *later = (struct fault){0};
  batch_start(c, n, o, later, done, arg); /* also where f is set: the started ones end */
  return true;
}

/* Whether a process is released, or its release is under way. */
bool ctxrelease_holds(ctxrelease *c, pid_t pid) {
  return released_session(c, pid) || inflight(c, pid);
}

/* A released session ended. */
void ctxrelease_forget(ctxrelease *c, struct owner *s) {
  if (!s->released) return;
  s->released = false;
  if (released_session(c, s->pid)) return; /* its other sessions keep it released */
  /* A release still in the driver restores it when it returns. */
  if (!inflight(c, s->pid) && pinned(c, s) == 0) forget_start(c, s->pid);
  journal_write(c);
}

/* Free c once the loop has closed both its handles. */
static void on_closed(uv_handle_t *h) {
  ctxrelease *c = h->data;
  if (--c->open_handles || c->leak) return;
  pthread_mutex_destroy(&c->lock);
  pthread_cond_destroy(&c->cond);
  free(c);
}

/* Restore everything still released (waiting for the driver at most the
 * bound), then free. */
void ctxrelease_destroy(ctxrelease *c) {
  if (!c) return;
  uv_timer_stop(&c->timer);
  c->batch.active = false; /* its operation is gone */
  pthread_mutex_lock(&c->lock);
  c->closed = true; /* no more wake-ups */
  pthread_mutex_unlock(&c->lock);
  /* What is still in the driver first (a release may yet hold its
   * process), then the restores, each within the bound. */
  jobs_wait(c, ANY, now_us() + (uint64_t)c->limit_ms * 1000);
  collect(c);
  for (struct list *p = c->owners->next; p != c->owners; p = p->next) {
    struct owner *o = list_entry(p, struct owner, link);
    if (!o->released || inflight(c, o->pid)) continue;
    if (pinned(c, o) != 0)
      mark(c, o->pid, false, 0); /* gone */
    else if (!job_start(c, o->pid, JOB_RESTORE, BY_WAITER))
      log_error("pid %d: device state not restored: out of host memory", (int)o->pid);
  }
  jobs_wait(c, BY_WAITER, now_us() + (uint64_t)c->limit_ms * 1000);
  struct list *p, *x;
  list_for_each_safe(p, x, &c->jobs) {
    struct job *j = list_entry(p, struct job, link);
    if (!job_finished(c, j)) {
      log_error("pid %d: the driver has not returned from its %s: kept for the next gpumemd",
                (int)j->pid, j->kind == JOB_RELEASE ? "release" : "restore");
      c->leak = true; /* its thread still holds c */
      continue;
    }
    list_remove(&j->link);
    if (j->by == BY_WAITER) restore_done(c, j, "gpumemd is stopping");
    free(j);
  }
  bool any = !list_empty(&c->jobs); /* the journal names those still in the driver */
  for (struct list *q = c->owners->next; q != c->owners; q = q->next)
    any |= list_entry(q, struct owner, link)->released;
  if (!any && c->journal[0])
    unlink(c->journal);
  else
    journal_write(c); /* for the next daemon */
  uv_close((uv_handle_t *)&c->wake, on_closed);
  uv_close((uv_handle_t *)&c->timer, on_closed);
}

/* Whether a release or restore of this process is still in the driver. */
bool ctxrelease_in_driver(void) { return atomic_load(&in_driver) > 0; }

/* Restore pid at the daemon's start, before the loop runs; false if it
 * failed. */
static bool restore_at_start(gpudev *g, pid_t pid) {
  if (gpudev_process_restore(g, pid) == 0) {
    log_info("pid %d: device state restored (released by a gpumemd that stopped)", (int)pid);
    return true;
  }
  log_error("pid %d: device state not restored (released by a gpumemd that stopped): %s",
            (int)pid, gpu_error());
  return false;
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
    all &= restore_at_start(g, pid);
  }
  fclose(f);
  if (all) unlink(journal_path); /* else kept: the next start tries again */
}
