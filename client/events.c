/* Unmap and Remap events. Every event is answered truthfully: an id this
 * client does not hold is NOT_FOUND, a buffer that does not fit is
 * WRONG_STATE, one the driver would not unmap or map is BACKEND_ERROR,
 * and each is named in the ack; the worst code wins. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buffer.h"
#include "client.h"
#include "error.h"
#include "events.h"

struct events {
  gpumem_client *client; /* handed to the hooks */
  buffers *buffers;
  pthread_mutex_t mu;    /* the hooks */
  gpumem_hook pre_unmap, post_remap;
  void *user;
  bool keep_backups; /* keep backup memory mapped between events (events_keep_backups) */
};

/* Make an event handler. */
events *events_create(gpumem_client *c, buffers *r) {
  events *e = calloc(1, sizeof *e);
  if (!e) return NULL;
  e->client = c;
  e->buffers = r;
  pthread_mutex_init(&e->mu, NULL);
  return e;
}

/* Keep the backup memory handed to buffers mapped between events. */
void events_keep_backups(events *e, bool keep) { e->keep_backups = keep; }

/* Free an event handler. */
void events_destroy(events *e) {
  if (!e) return;
  pthread_mutex_destroy(&e->mu);
  free(e);
}

/* The failures of one event, for its ack. */
struct failures {
  uint64_t *ids;
  size_t n;
  wire_code code;
  char words[320];
};

/* Note that buffer id failed with code; the worst code wins the ack
 * (driver failures over state mismatches over unknown ids). */
__attribute__((format(printf, 4, 5))) static void failed(struct failures *fl, uint64_t id,
                                                         wire_code code, const char *fmt,
                                                         ...) {
  static const wire_code rank[] = {GPUMEM__WIRE__ERROR_CODE__OK,
                                   GPUMEM__WIRE__ERROR_CODE__NOT_FOUND,
                                   GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
                                   GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR};
  int have = 0, want = 0;
  for (int i = 0; i < 4; i++) {
    if (rank[i] == fl->code) have = i;
    if (rank[i] == code) want = i;
  }
  if (want > have) fl->code = code;
  if (fl->ids) fl->ids[fl->n++] = id;
  size_t l = strlen(fl->words);
  if (l + 4 < sizeof fl->words) {
    va_list ap;
    va_start(ap, fmt);
    if (l) l += (size_t)snprintf(fl->words + l, sizeof fl->words - l, "; ");
    if (l < sizeof fl->words) vsnprintf(fl->words + l, sizeof fl->words - l, fmt, ap);
    va_end(ap);
  }
}

/* Out of memory: no ids are listed, so every buffer of the event failed. */
static void out_of_memory(struct failures *fl) {
  free(fl->ids);
  fl->ids = NULL;
  fl->n = 0;
  failed(fl, 0, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR, "out of memory");
}

/* The packed ack of an event: OK, or the code, words and ids of what
 * failed, and whether this process's client maps nothing now. */
static uint8_t *ack(uint64_t event_id, const struct failures *fl, bool none_mapped, size_t *len) {
  Gpumem__Wire__EventAck a = GPUMEM__WIRE__EVENT_ACK__INIT;
  a.nothing_mapped = none_mapped;
  a.code = fl->code;
  a.message = (char *)(fl->code ? fl->words : "");
  a.failed_ids = fl->ids;
  a.n_failed_ids = fl->code ? fl->n : 0;
  wire_env env = wire_envelope(event_id, GPUMEM__WIRE__ENVELOPE__BODY_ACK, &a);
  return wire_pack(&env, len);
}

/* The hooks to run now: an event that has started keeps them. */
static void hooks(events *e, gpumem_hook *pre, gpumem_hook *post, void **user) {
  pthread_mutex_lock(&e->mu);
  *pre = e->pre_unmap;
  *post = e->post_remap;
  *user = e->user;
  pthread_mutex_unlock(&e->mu);
}

/* The default pre-unmap hook: wait for each device the buffers are on. */
static void sync_devices(gpumem_buffer *const *bufs, size_t n) {
  uint64_t done = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned d = (unsigned)gpumem_buffer_device(bufs[i]);
    if (d < 64 && (done & (1ull << d))) continue;
    if (d < 64) done |= 1ull << d;
    gpuva_sync(buffer_gpu(bufs[i]), d);
  }
}

/* The backup memory an Unmap hands buffer id (its fds from *fd_at of the
 * frame's), or NULL. */
static const Gpumem__Wire__BackupMemory *backup_of(const Gpumem__Wire__UnmapEvent *ev,
                                                   uint64_t id, size_t *fd_at) {
  *fd_at = 0;
  for (size_t i = 0; i < ev->n_backups; i++) {
    if (ev->backups[i]->buffer_id == id) return ev->backups[i];
    *fd_at += ev->backups[i]->n_piece_sizes;
  }
  return NULL;
}

/* Unmap: run the hook, copy what the event hands backup memory for into
 * it, unmap and release, keep the ranges. A buffer whose copy failed
 * stays mapped (its contents are not safe anywhere else). */
static void on_unmap(events *e, const Gpumem__Wire__UnmapEvent *ev, struct frame *f,
                     struct failures *fl) {
  gpumem_buffer **bufs = calloc(ev->n_buffer_ids + 1, sizeof *bufs);
  if (!bufs) {
    out_of_memory(fl);
    return;
  }
  size_t n = 0;
  for (size_t i = 0; i < ev->n_buffer_ids; i++) {
    uint64_t id = ev->buffer_ids[i];
    gpumem_buffer *b = buffers_find(e->buffers, id);
    if (!b)
      failed(fl, id, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, "no buffer %llu in this process",
             (unsigned long long)id);
    else if (buffer_ipc(b))
      failed(fl, id, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
             "buffer %llu is legacy IPC memory and never pauses", (unsigned long long)id);
    else
      bufs[n++] = b;
  }
  gpumem_hook pre, post;
  void *user;
  hooks(e, &pre, &post, &user);
  if (pre)
    pre(e->client, bufs, n, user);
  else
    sync_devices(bufs, n);
  for (size_t i = 0; i < n; i++) {
    size_t fd_at;
    const Gpumem__Wire__BackupMemory *m = backup_of(ev, gpumem_buffer_id(bufs[i]), &fd_at);
    if (m) {
      struct backup_mem mem = {m->piece_sizes, m->n_piece_sizes, f->fds + fd_at, m->kept};
      /* A backup going to disk: a mapping kept here would keep its memory. */
      bool keep = e->keep_backups && !(gpumem_buffer_flags(bufs[i]) & GPUMEM_BACKUP_DISK);
      if (buffer_unmap_into(bufs[i], &mem, keep) < 0)
        failed(fl, gpumem_buffer_id(bufs[i]), GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
               "buffer %llu: %s", (unsigned long long)gpumem_buffer_id(bufs[i]),
               gpumem_last_error());
      continue;
    }
    /* Backup memory kept for reading by a connection that keeps none:
     * this pause writes the backup anew, so reads ask the daemon again
     * (and none is held when the context is to be released). */
    if (!e->keep_backups) buffer_drop_backup(bufs[i]);
    if (buffer_unmap(bufs[i]) < 0)
      failed(fl, gpumem_buffer_id(bufs[i]), GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
             "buffer %llu stays mapped: %s", (unsigned long long)gpumem_buffer_id(bufs[i]),
             gpu_error());
  }
  free(bufs);
}

/* Remap: import the new chunks at the old addresses, copy in the backups
 * the event hands (a buffer whose copy fails is unmapped again: it is
 * named in the ack, and the daemon takes it as not mapped), run the
 * hook. */
static void on_remap(events *e, const Gpumem__Wire__RemapEvent *ev, struct frame *f,
                     struct failures *fl) {
  gpumem_hook pre, post;
  void *user;
  hooks(e, &pre, &post, &user);
  gpumem_buffer **bufs = calloc(ev->n_entries + 1, sizeof *bufs);
  if (!bufs) {
    out_of_memory(fl);
    return;
  }
  size_t n = 0, fd_at = 0;
  for (size_t i = 0; i < ev->n_entries; i++) {
    const Gpumem__Wire__RemapEntry *r = ev->entries[i];
    int *fds = f->fds + fd_at; /* fds not taken are closed with the frame */
    fd_at += r->n_chunk_sizes + r->n_backup_piece_sizes;
    gpumem_buffer *b = buffers_find(e->buffers, r->buffer_id);
    struct backup_mem mem = {r->backup_piece_sizes, r->n_backup_piece_sizes,
                             fds + r->n_chunk_sizes, r->backup_kept};
    bool copy_in = r->n_backup_piece_sizes || r->backup_kept;
    /* A backup that lets go after each resume is not kept past it. */
    bool keep = e->keep_backups && b && !(gpumem_buffer_flags(b) & GPUMEM_BACKUP_RELEASE);
    int rc = b ? buffer_remap(b, r->chunk_sizes, r->n_chunk_sizes, fds, copy_in ? &mem : NULL,
                              keep)
               : 0;
    if (!b)
      failed(fl, r->buffer_id, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND,
             "no buffer %llu in this process", (unsigned long long)r->buffer_id);
    else if (rc < 0)
      failed(fl, r->buffer_id,
             rc == GPUMEM_E_WRONG_STATE ? GPUMEM__WIRE__ERROR_CODE__WRONG_STATE
                                        : GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
             "%s", gpumem_last_error());
    else {
      buffer_set_generation(b, r->generation);
      bufs[n++] = b;
    }
  }
  if (post && n) post(e->client, bufs, n, user);
  free(bufs);
}

/* True if none of the client's buffers is mapped (what an Unmap's ack
 * says, so that the daemon may release the process's context); false
 * when out of memory to tell. */
static bool nothing_mapped(events *e) {
  size_t n = 0, count = buffers_count(e->buffers);
  gpumem_buffer **v = buffers_list(e->buffers, &n);
  bool none = count == 0 || v;
  for (size_t i = 0; v && i < n; i++)
    if (gpumem_buffer_mapped(v[i]) || buffer_keeps_backup(v[i])) none = false;
  free(v);
  return none;
}

/* Handle an event and make its ack. */
uint8_t *events_handle(events *e, const wire_env *env, struct frame *f, size_t *len) {
  bool unmap = env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_UNMAP;
  size_t most = unmap ? env->unmap->n_buffer_ids : env->remap->n_entries;
  struct failures fl = {.ids = calloc(most + 1, sizeof *fl.ids)};
  if (!fl.ids)
    out_of_memory(&fl);
  else if (unmap)
    on_unmap(e, env->unmap, f, &fl);
  else
    on_remap(e, env->remap, f, &fl);
  uint8_t *bytes = ack(env->id, &fl, unmap && !fl.code && nothing_mapped(e), len);
  free(fl.ids);
  return bytes;
}

/* Set the hooks run around unmap and remap. */
void gpumem_set_hooks(gpumem_client *c, gpumem_hook pre_unmap, gpumem_hook post_remap,
                      void *user) {
  events *e = c->events;
  pthread_mutex_lock(&e->mu);
  e->pre_unmap = pre_unmap;
  e->post_remap = post_remap;
  e->user = user;
  pthread_mutex_unlock(&e->mu);
}
