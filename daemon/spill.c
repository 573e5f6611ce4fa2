#include "spill.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "hostmem.h"
#include "pageable.h"

struct spill {
  uv_async_t wake; /* the thread ended */
  pthread_t thread;
  backup_disk *disk;
  gpudev *gpu;
  struct spill_item *items;
  size_t n;
  bool load;
  bool ok;
  bool finished; /* done has run */
  pthread_mutex_t mu; /* a read's maker and reader: */
  pthread_cond_t cv;
  size_t made; /* items whose memory was made (or not) */
  spill_done done;
  void *arg;
};

/* Free an item's made memory. */
static void unmake(spill *s, struct spill_item *it) {
  if (!it->io.host) return;
  if (it->pageable) pageable_free(it->io.host, it->io.size);
  else hostmem_free(s->gpu, it->dev, it->io.host, it->io.size);
  it->io.host = NULL;
}

/* A read's maker: the memory of each item in order, made ahead of the
 * reads (pinning takes about as long per GiB as the disk's reads on the
 * H200, so the two overlap); stops at the first failure. */
static void *make_ahead(void *arg) {
  spill *s = arg;
  for (size_t i = 0; i < s->n; i++) {
    struct spill_item *it = &s->items[i];
    int rc = it->pageable ? pageable_make(it->io.size, &it->io.host, it->io.why, sizeof it->io.why)
                          : hostmem_make(s->gpu, it->dev, it->io.size, &it->io.host, it->io.why,
                                         sizeof it->io.why);
    pthread_mutex_lock(&s->mu);
    if (rc < 0) {
      it->io.host = NULL;
      it->io.rc = rc;
      s->ok = false;
    }
    s->made = i + 1;
    bool stop = !s->ok;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    if (stop) break;
  }
  pthread_mutex_lock(&s->mu);
  s->made = s->n; /* nothing more comes */
  pthread_cond_signal(&s->cv);
  pthread_mutex_unlock(&s->mu);
  return NULL;
}

/* A read: each item's file into its memory as soon as the maker has
 * made it; all or none. */
static void load(spill *s) {
  uint64_t t0 = uv_hrtime();
  s->ok = true;
  pthread_t maker;
  bool ahead = pthread_create(&maker, NULL, make_ahead, s) == 0;
  if (!ahead) make_ahead(s);
  for (size_t i = 0; i < s->n; i++) {
    pthread_mutex_lock(&s->mu);
    while (s->made <= i) pthread_cond_wait(&s->cv, &s->mu);
    bool go = s->ok;
    pthread_mutex_unlock(&s->mu);
    if (!go) break;
    struct spill_item *it = &s->items[i];
    backup_disk_read(s->disk, &it->io, 1);
    if (it->io.rc) {
      pthread_mutex_lock(&s->mu);
      s->ok = false; /* the maker stops too */
      pthread_mutex_unlock(&s->mu);
      break;
    }
  }
  if (ahead) pthread_join(maker, NULL);
  log_debug("disk step: %zu backups made and read in %.3f s", s->n,
            (double)(uv_hrtime() - t0) / 1e9);
  if (!s->ok)
    for (size_t i = 0; i < s->n; i++) unmake(s, &s->items[i]);
}

/* A write: every item to its new file. */
static void store(spill *s) {
  struct backup_disk_item *io = calloc(s->n + 1, sizeof *io);
  s->ok = io != NULL;
  for (size_t i = 0; io && i < s->n; i++) io[i] = s->items[i].io;
  if (io) backup_disk_write(s->disk, io, s->n);
  for (size_t i = 0; i < s->n; i++) {
    if (io) s->items[i].io = io[i];
    else {
      s->items[i].io.fd = -1;
      s->items[i].io.rc = -ENOMEM;
      snprintf(s->items[i].io.why, sizeof s->items[i].io.why, "out of host memory");
    }
    if (s->items[i].io.rc) s->ok = false;
  }
  free(io);
}

/* The thread: the step, then a word to the loop. */
static void *run(void *arg) {
  spill *s = arg;
  if (s->load) load(s);
  else store(s);
  uv_async_send(&s->wake);
  return NULL;
}

/* Free the step once its handle is closed. */
static void on_closed(uv_handle_t *h) {
  spill *s = h->data;
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  free(s);
}

/* Join the thread, run done once, close. */
static void end(spill *s) {
  if (s->finished) return;
  s->finished = true;
  pthread_join(s->thread, NULL);
  s->done(s->arg, s->items, s->n, s->ok);
  uv_close((uv_handle_t *)&s->wake, on_closed);
}

/* The loop's side of the thread's word. */
static void on_wake(uv_async_t *a) { end(a->data); }

/* Start the step (spill.h). */
spill *spill_start(uv_loop_t *loop, backup_disk *d, gpudev *g, struct spill_item *items,
                   size_t n, bool load_, spill_done done, void *arg, char *why, size_t whylen) {
  spill *s = calloc(1, sizeof *s);
  if (!s) {
    snprintf(why, whylen, "out of host memory");
    return NULL;
  }
  *s = (struct spill){.disk = d, .gpu = g, .items = items, .n = n, .load = load_, .done = done,
                      .arg = arg};
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  s->wake.data = s;
  if (uv_async_init(loop, &s->wake, on_wake) < 0) {
    snprintf(why, whylen, "no loop handle for the disk step");
    free(s);
    return NULL;
  }
  int rc = pthread_create(&s->thread, NULL, run, s);
  if (rc) {
    snprintf(why, whylen, "no thread for the disk step: %s", strerror(rc));
    uv_close((uv_handle_t *)&s->wake, on_closed);
    return NULL;
  }
  return s;
}

/* Wait for the step and end it now (spill.h). */
void spill_finish(spill *s) { end(s); }
