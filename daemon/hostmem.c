#include "hostmem.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/log.h"

/* Who the job's memory goes to; read and written on the loop thread only. */
enum fate { FATE_DONE, FATE_TAKEN, FATE_DROPPED };

struct hostmem_job {
  uv_work_t req;
  gpudev *gpu;
  unsigned dev;
  uint64_t size;
  void *host; /* the reserved range (NULL until reserved), pieces made from the start */
  hostmem_done done;
  void *ctx, *arg;
  enum fate fate;
  pthread_mutex_t mu; /* guards what both threads touch below */
  pthread_cond_t cv;
  uint64_t made; /* bytes made from the start */
  bool busy;     /* the pool thread is making a piece */
  bool stop;     /* the pool thread makes no further piece */
  int rc;        /* a piece that failed on the pool thread */
  char why[256];
};

/* The end of the piece that starts at off. */
static uint64_t piece_end(uint64_t size, uint64_t off) {
  return size - off < GPUDEV_BACKUP_PIECE ? size : off + GPUDEV_BACKUP_PIECE;
}

/* Make the pieces of a reserved backup from byte from on, here; on failure
 * free all of it and say why. */
static int make_pieces(gpudev *g, unsigned dev, void *host, uint64_t size, uint64_t from, char *why,
                       size_t whylen) {
  for (uint64_t off = from; off < size; off = piece_end(size, off)) {
    int rc = gpudev_backup_make(g, dev, host, size, off, false);
    if (rc < 0) {
      snprintf(why, whylen, "%s", gpu_error());
      gpudev_backup_release(g, dev, host, size, off);
      return rc;
    }
  }
  return 0;
}

/* On a pool thread: reserve the range (here, not on the loop: an mmap
 * waits for the process's mmap lock, which other jobs' faulting holds),
 * then make the pieces one by one until all are made, one fails, or the
 * loop says stop; a waiting taker hears of each step. */
static void work(uv_work_t *req) {
  hostmem_job *job = req->data;
  pthread_mutex_lock(&job->mu);
  if (!job->stop) {
    void *host = NULL;
    job->busy = true;
    pthread_mutex_unlock(&job->mu);
    int rc = gpudev_backup_reserve(job->gpu, job->dev, job->size, &host);
    pthread_mutex_lock(&job->mu);
    job->busy = false;
    job->host = rc < 0 ? NULL : host;
    if (rc < 0) {
      job->rc = rc;
      snprintf(job->why, sizeof job->why, "%s", gpu_error());
    }
    pthread_cond_broadcast(&job->cv);
  }
  while (job->host && !job->stop && job->rc == 0 && job->made < job->size) {
    uint64_t off = job->made;
    job->busy = true;
    pthread_mutex_unlock(&job->mu);
    int rc = gpudev_backup_make(job->gpu, job->dev, job->host, job->size, off, true);
    pthread_mutex_lock(&job->mu);
    job->busy = false;
    if (rc < 0) {
      job->rc = rc;
      snprintf(job->why, sizeof job->why, "%s", gpu_error());
    } else {
      job->made = piece_end(job->size, off);
    }
    pthread_cond_broadcast(&job->cv);
  }
  pthread_mutex_unlock(&job->mu);
}

/* Free a job (its memory is someone else's or gone). */
static void job_destroy(hostmem_job *job) {
  pthread_cond_destroy(&job->cv);
  pthread_mutex_destroy(&job->mu);
  free(job);
}

/* Back on the loop: hand the memory over, or free what nobody wants. */
static void after_work(uv_work_t *req, int status) {
  hostmem_job *job = req->data;
  bool whole = status == 0 && job->host && job->rc == 0 && job->made == job->size;
  if (job->fate == FATE_DONE && whole) {
    job->done(job->ctx, job->arg, job->host, "");
  } else if (job->fate != FATE_TAKEN) {
    if (job->host) gpudev_backup_release(job->gpu, job->dev, job->host, job->size, job->made);
    if (job->fate == FATE_DONE)
      job->done(job->ctx, job->arg, NULL, status == UV_ECANCELED ? "cancelled" : job->why);
  }
  job_destroy(job);
}

/* Queue reserving the memory and making its pieces on the thread pool. */
hostmem_job *hostmem_start(uv_loop_t *loop, gpudev *g, unsigned dev, uint64_t size,
                           hostmem_done done, void *ctx, void *arg, char *why, size_t whylen) {
  hostmem_job *job = calloc(1, sizeof *job);
  if (!job) {
    snprintf(why, whylen, "out of memory");
    return NULL;
  }
  job->req.data = job;
  job->gpu = g;
  job->dev = dev;
  job->size = size;
  job->done = done;
  job->ctx = ctx;
  job->arg = arg;
  pthread_mutex_init(&job->mu, NULL);
  pthread_cond_init(&job->cv, NULL);
  int rc = uv_queue_work(loop, &job->req, work, after_work);
  if (rc < 0) {
    snprintf(why, whylen, "%s", uv_strerror(rc));
    job_destroy(job);
    return NULL;
  }
  return job;
}

/* Reserve backup memory and make all of it here. */
int hostmem_make(gpudev *g, unsigned dev, uint64_t size, void **host, char *why, size_t whylen) {
  int rc = gpudev_backup_reserve(g, dev, size, host);
  if (rc < 0) {
    snprintf(why, whylen, "%s", gpu_error());
    return rc;
  }
  return make_pieces(g, dev, *host, size, 0, why, whylen);
}

/* Take the job's memory now: stop the pool thread after the step it is
 * taking, then make what is left here (all of it, range and pieces, if the
 * pool never reserved it). */
int hostmem_take(hostmem_job *job, void **host, char *why, size_t whylen) {
  unsigned long long size = (unsigned long long)job->size;
  uint64_t from = 0;
  void *reserved = NULL;
  job->fate = FATE_TAKEN;
  if (uv_cancel((uv_req_t *)&job->req) == 0) {
    log_debug("backup memory of %llu bytes was still queued: made on the pause path", size);
    return hostmem_make(job->gpu, job->dev, job->size, host, why, whylen);
  } else {
    uint64_t t0 = uv_hrtime();
    pthread_mutex_lock(&job->mu);
    job->stop = true;
    bool waited = job->busy;
    while (job->busy) pthread_cond_wait(&job->cv, &job->mu);
    from = job->made;
    reserved = job->host;
    pthread_mutex_unlock(&job->mu);
    if (!reserved) /* never reserved there (stopped first, or it failed) */
      return hostmem_make(job->gpu, job->dev, job->size, host, why, whylen);
    log_debug("backup memory of %llu bytes: %llu made in the background, %llu on the pause "
              "path (%.1f ms waited for a piece being made)",
              size, (unsigned long long)from, (unsigned long long)(job->size - from),
              waited ? (double)(uv_hrtime() - t0) / 1e6 : 0.0);
  }
  int rc = make_pieces(job->gpu, job->dev, reserved, job->size, from, why, whylen);
  if (rc == 0) *host = reserved;
  return rc;
}

/* Give a job up: cancel it if it has not started, else stop it after the
 * piece it is making; after_work frees what was made. */
void hostmem_drop(hostmem_job *job) {
  job->fate = FATE_DROPPED;
  pthread_mutex_lock(&job->mu);
  job->stop = true;
  pthread_mutex_unlock(&job->mu);
  uv_cancel((uv_req_t *)&job->req);
}


/* Free backup memory all of whose pieces are made. */
void hostmem_free(gpudev *g, unsigned dev, void *host, uint64_t size) {
  gpudev_backup_release(g, dev, host, size, size);
}
