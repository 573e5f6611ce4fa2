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
  gpu *gpu;
  unsigned dev;
  uint64_t size;
  hostmem_done done;
  void *ctx, *arg;
  enum fate fate;
  pthread_mutex_t mu; /* guards what the pool thread writes below */
  pthread_cond_t cv;
  bool finished;
  int rc;
  void *host;
  char why[256];
};

/* On a pool thread: make the memory and say so to a waiting taker. */
static void work(uv_work_t *req) {
  hostmem_job *job = req->data;
  void *host = NULL;
  int rc = gpu_backup_alloc(job->gpu, job->dev, job->size, &host);
  pthread_mutex_lock(&job->mu);
  job->rc = rc;
  job->host = rc < 0 ? NULL : host;
  if (rc < 0) snprintf(job->why, sizeof job->why, "%s", gpu_error());
  job->finished = true;
  pthread_cond_broadcast(&job->cv);
  pthread_mutex_unlock(&job->mu);
}

/* Back on the loop: hand the memory over, or free what nobody wants. */
static void after_work(uv_work_t *req, int status) {
  hostmem_job *job = req->data;
  bool made = status == 0 && job->rc == 0;
  if (job->fate == FATE_DONE)
    job->done(job->ctx, job->arg, made ? job->host : NULL,
              status == UV_ECANCELED ? "cancelled" : job->why);
  else if (job->fate == FATE_DROPPED && made)
    gpu_backup_free(job->gpu, job->dev, job->host, job->size);
  pthread_cond_destroy(&job->cv);
  pthread_mutex_destroy(&job->mu);
  free(job);
}

/* Queue making backup memory on the thread pool. */
hostmem_job *hostmem_start(uv_loop_t *loop, gpu *g, unsigned dev, uint64_t size,
                           hostmem_done done, void *ctx, void *arg) {
  hostmem_job *job = calloc(1, sizeof *job);
  if (!job) return NULL;
  job->req.data = job;
  job->gpu = g;
  job->dev = dev;
  job->size = size;
  job->done = done;
  job->ctx = ctx;
  job->arg = arg;
  pthread_mutex_init(&job->mu, NULL);
  pthread_cond_init(&job->cv, NULL);
  if (uv_queue_work(loop, &job->req, work, after_work) < 0) {
    pthread_cond_destroy(&job->cv);
    pthread_mutex_destroy(&job->mu);
    free(job);
    return NULL;
  }
  return job;
}

/* Take the job's memory now: make it here if the job never started, else
 * wait for the pool thread. */
int hostmem_take(hostmem_job *job, void **host, char *why, size_t whylen) {
  unsigned long long size = (unsigned long long)job->size;
  job->fate = FATE_TAKEN;
  if (uv_cancel((uv_req_t *)&job->req) == 0) {
    log_debug("backup memory of %llu bytes was still queued: made on the pause path", size);
    int rc = gpu_backup_alloc(job->gpu, job->dev, job->size, host);
    if (rc < 0) snprintf(why, whylen, "%s", gpu_error());
    return rc;
  }
  uint64_t t0 = uv_hrtime();
  pthread_mutex_lock(&job->mu);
  bool running = !job->finished;
  while (!job->finished) pthread_cond_wait(&job->cv, &job->mu);
  pthread_mutex_unlock(&job->mu);
  if (running)
    log_debug("waited %.1f ms for backup memory of %llu bytes being made",
              (double)(uv_hrtime() - t0) / 1e6, size);
  if (job->rc < 0) {
    snprintf(why, whylen, "%s", job->why);
    return job->rc;
  }
  *host = job->host;
  return 0;
}

/* Give a job up: cancel it if it has not started; what it makes is freed
 * when it finishes. */
void hostmem_drop(hostmem_job *job) {
  job->fate = FATE_DROPPED;
  uv_cancel((uv_req_t *)&job->req);
}
