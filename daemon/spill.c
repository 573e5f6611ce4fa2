#include "spill.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* A read: make every item's memory, then read them all; all or none. */
static void load(spill *s) {
  s->ok = true;
  for (size_t i = 0; i < s->n && s->ok; i++) {
    struct spill_item *it = &s->items[i];
    it->io.rc = 0;
    int rc = it->pageable ? pageable_make(it->io.size, &it->io.host, it->io.why, sizeof it->io.why)
                          : hostmem_make(s->gpu, it->dev, it->io.size, &it->io.host, it->io.why,
                                         sizeof it->io.why);
    if (rc < 0) {
      it->io.host = NULL;
      it->io.rc = rc;
      s->ok = false;
    }
  }
  if (s->ok) {
    /* One call for all, so that their requests share the queue. */
    struct backup_disk_item *io = calloc(s->n + 1, sizeof *io);
    if (!io) {
      s->ok = false;
      snprintf(s->items[0].io.why, sizeof s->items[0].io.why, "out of host memory");
      s->items[0].io.rc = -ENOMEM;
    } else {
      for (size_t i = 0; i < s->n; i++) io[i] = s->items[i].io;
      backup_disk_read(s->disk, io, s->n);
      for (size_t i = 0; i < s->n; i++) {
        s->items[i].io = io[i];
        if (io[i].rc) s->ok = false;
      }
      free(io);
    }
  }
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
static void on_closed(uv_handle_t *h) { free(h->data); }

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
