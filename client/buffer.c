/* Buffers: allocation, mapping at a fixed address, and the unmap and
 * remap events that pause and resume them. */
#include <errno.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client.h"

/* Say whether a buffer is mapped, for the threads that copy (under mu)
 * and for gpumem_buffer_mapped (atomic). */
static void set_mapped(gpumem_client *c, gpumem_buffer *b, bool mapped) {
  pthread_mutex_lock(&c->mu);
  __atomic_store_n(&b->mapped, mapped, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&c->mu);
}

/* Import and map chunk fds (consumed) at the buffer's address, then allow
 * access once for the whole range. On failure nothing stays mapped. */
static int map_chunks(gpumem_client *c, gpumem_buffer *b, int *fds) {
  uint64_t off = 0;
  int rc = 0;
  for (size_t i = 0; i < b->nchunks; off += b->chunk_sizes[i++]) {
    int fd = fds[i];
    fds[i] = -1;
    if ((rc = gpu_import(c->gpu, b->local, fd, b->chunk_sizes[i], &b->handles[i])) < 0) break;
    if ((rc = gpu_map(c->gpu, b->local, (char *)b->va + off, b->chunk_sizes[i], b->handles[i])) <
        0) {
      gpu_release(c->gpu, b->local, b->handles[i]);
      break;
    }
    b->held[i] = true;
  }
  if (rc == 0) rc = gpu_set_access(c->gpu, b->local, b->va, b->size);
  if (rc == 0) {
    set_mapped(c, b, true);
    return 0;
  }
  /* fds not consumed stay in the caller's frame, which closes them. */
  char why[256];
  snprintf(why, sizeof why, "%s", gpu_error());
  client_buffer_unmap(c, b);
  return error_set(GPUMEM_E_MAP, "mapping buffer %llu: %s", (unsigned long long)b->id, why);
}

/* Unmap each chunk's mapping separately (one unmap across several breaks
 * address-range release on ROCm) and release the imported handles. A
 * chunk that does not unmap keeps its handle and stays held. */
int client_buffer_unmap(gpumem_client *c, gpumem_buffer *b) {
  if (b->ipc) return 0;
  /* Reads, writes and fills in flight finish first; new ones are refused. */
  pthread_mutex_lock(&c->mu);
  __atomic_store_n(&b->unmapping, true, __ATOMIC_RELEASE); /* read unlocked by the pool */
  while (b->copies) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
  uint64_t off = 0;
  int rc = 0;
  for (size_t i = 0; i < b->nchunks; off += b->chunk_sizes[i++]) {
    if (!b->held[i]) continue;
    int r = gpu_unmap(c->gpu, b->local, (char *)b->va + off, b->chunk_sizes[i]);
    if (r < 0) {
      if (rc == 0) rc = r;
      continue;
    }
    gpu_release(c->gpu, b->local, b->handles[i]);
    b->held[i] = false;
  }
  pthread_mutex_lock(&c->mu);
  __atomic_store_n(&b->mapped, false, __ATOMIC_RELEASE);
  __atomic_store_n(&b->unmapping, false, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* Export a mapped buffer's imported handles again as fds, one per chunk. */
int client_buffer_export(gpumem_client *c, gpumem_buffer *b, int *fds) {
  for (size_t i = 0; i < b->nchunks; i++) {
    int rc = gpu_export(c->gpu, b->local, b->handles[i], &fds[i]);
    if (rc < 0) {
      while (i > 0) close(fds[--i]);
      return error_set(GPUMEM_E_BACKEND, "exporting buffer %llu again: %s",
                         (unsigned long long)b->id, gpu_error());
    }
  }
  return 0;
}

/* Free the struct of a buffer (nothing mapped or reserved any more). */
static void buffer_free_struct(gpumem_buffer *b) {
  free(b->chunk_sizes);
  free(b->handles);
  free(b->held);
  free(b);
}

/* The buffer that holds an address map entry. */
gpumem_buffer *buffer_of_addr(struct addr_entry *e) {
  return (gpumem_buffer *)((char *)e - offsetof(gpumem_buffer, at));
}

/* Forget a buffer completely. */
void client_buffer_destroy(gpumem_client *c, gpumem_buffer *b) {
  addrmap_remove(&b->at);
  pthread_mutex_lock(&c->mu);
  client_buffer_forget(c, b);
  pthread_mutex_unlock(&c->mu);
  if (b->ipc) {
    gpu_ipc_close(c->gpu, b->local, b->va);
  } else {
    client_buffer_unmap(c, b);
    /* Whatever would not unmap goes with the range; let go of its handle. */
    for (size_t i = 0; i < b->nchunks; i++)
      if (b->held[i]) gpu_release(c->gpu, b->local, b->handles[i]);
    if (b->va) gpu_va_free(c->gpu, b->local, b->va, b->size);
  }
  buffer_free_struct(b);
}

/* Ask the daemon to free a buffer; with b, the reply's routing forgets it
 * before the next frame is read. */
static int send_free(gpumem_client *c, uint64_t id, gpumem_buffer *b) {
  Gpumem__Wire__FreeRequest fr = GPUMEM__WIRE__FREE_REQUEST__INIT;
  fr.buffer_id = id;
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_FREE;
  req.free = &fr;
  struct pending reply = {0};
  reply.freeing = b;
  int rc = client_call_with(c, &req, &reply);
  client_reply_free(&reply);
  return rc;
}

/* On the routing thread: make the buffer of an AllocReply, map it and
 * register it before the next frame is routed, so that an Unmap right
 * behind the reply finds it. A buffer that fails to map is registered
 * unmapped (and doomed: the caller frees it), so that events for it are
 * still answered truthfully. */
void client_alloc_built(gpumem_client *c, struct alloc_ctx *a, const wire_env *env,
                        struct frame *f) {
  const Gpumem__Wire__AllocReply *r = env->alloc_reply;
  gpumem_buffer *b = calloc(1, sizeof *b);
  if (b) {
    b->chunk_sizes = calloc(r->n_chunk_sizes + 1, sizeof *b->chunk_sizes);
    b->handles = calloc(r->n_chunk_sizes + 1, sizeof *b->handles);
    b->held = calloc(r->n_chunk_sizes + 1, sizeof *b->held);
  }
  if (!b || !b->chunk_sizes || !b->handles || !b->held) {
    if (b) buffer_free_struct(b);
    a->rc = GPUMEM_E_NOMEM;
    snprintf(a->words, sizeof a->words, "out of memory");
    return;
  }
  b->id = r->buffer_id;
  snprintf(b->tag, sizeof b->tag, "%s", a->tag);
  b->device = a->device;
  b->local = a->local;
  b->size = r->size;
  b->flags = a->flags;
  b->pooled = a->pooled;
  b->nchunks = r->n_chunk_sizes;
  memcpy(b->chunk_sizes, r->chunk_sizes, b->nchunks * sizeof *b->chunk_sizes);
  int rc = 0;
  if (!c->gpu) {
    /* Connected with GPUMEM_CONNECT_NODE_DEVICES: no backend to map with. */
    rc = error_set(GPUMEM_E_PERMISSION,
                     "this client maps no memory (GPUMEM_CONNECT_NODE_DEVICES)");
    buffer_free_struct(b);
    b = NULL;
  } else if (r->ipc_handle.len) {
    b->ipc = true;
    if (gpu_ipc_open(c->gpu, b->local, r->ipc_handle.data, &b->va) < 0) {
      rc = error_set(GPUMEM_E_MAP, "opening IPC handle: %s", gpu_error());
      buffer_free_struct(b);
      b = NULL;
    } else {
      b->mapped = true; /* not shared with any thread yet */
    }
  } else if (gpu_va_reserve(c->gpu, b->local, b->size, &b->va) < 0) {
    rc = error_set(GPUMEM_E_MAP, "reserving %llu bytes: %s", (unsigned long long)b->size,
                     gpu_error());
    buffer_free_struct(b);
    b = NULL;
  } else if (r->state == GPUMEM__WIRE__BUFFER_STATE__ACTIVE) {
    rc = map_chunks(c, b, f->fds);
    b->doomed = rc < 0;
  }
  if (rc < 0) {
    a->rc = rc;
    snprintf(a->words, sizeof a->words, "%s", gpumem_last_error());
  }
  if (!b) return;
  pthread_mutex_lock(&c->mu);
  int put = client_buffer_register(c, b);
  pthread_mutex_unlock(&c->mu);
  if (put < 0) {
    client_buffer_destroy(c, b);
    a->rc = GPUMEM_E_NOMEM;
    snprintf(a->words, sizeof a->words, "out of memory");
    return;
  }
  a->buf = b;
}

/* Allocate a tagged buffer (a pool's slab when pooled); the thread that
 * routes the reply maps it. */
int client_alloc(gpumem_client *c, const char *tag, int device, uint64_t size,
                 unsigned flags, bool pooled, gpumem_buffer **out) {
  if (!c || !out) return error_set(GPUMEM_E_INVALID, "no client or no place for the buffer");
  if (!tag || !wire_tag_valid(tag))
    return error_set(GPUMEM_E_INVALID, "invalid tag: 1-%d characters of [A-Za-z0-9_.-]",
                       WIRE_TAG_MAX);
  int map[GPUMEM_MAX_DEVICES];
  unsigned seen = client_local_map(c, map);
  int node = client_node_device(map, device);
  pthread_mutex_lock(&c->mu);
  bool live = c->state == CONN_LIVE;
  pthread_mutex_unlock(&c->mu);
  if (node < 0 && live)
    return error_set(GPUMEM_E_INVALID,
                       "device %d is not one of the %u gpumemd devices this process sees",
                       device, seen);
  unsigned index = node < 0 ? 0 : (unsigned)node;
  Gpumem__Wire__AllocRequest ar = GPUMEM__WIRE__ALLOC_REQUEST__INIT;
  ar.tag = (char *)tag;
  ar.device = index;
  ar.size = size;
  ar.flags = flags;
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ALLOC;
  req.alloc = &ar;
  struct alloc_ctx a = {.tag = tag, .device = index, .local = (unsigned)device, .flags = flags,
                        .pooled = pooled};
  struct pending reply = {0};
  reply.alloc = &a;
  int rc = client_call_with(c, &req, &reply);
  if (rc == 0 && reply.env->body_case != GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY)
    rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered alloc with something else");
  if (rc < 0 || (a.rc == 0 && a.buf)) {
    client_reply_free(&reply);
    if (rc == 0) *out = a.buf;
    return rc;
  }
  /* Made at the daemon but not here: give it back. A free that times out
   * is finished by the library; one the daemon refuses (a pause has the
   * buffer) is sent again until it goes through. */
  uint64_t id = reply.env->alloc_reply->buffer_id;
  client_reply_free(&reply);
  int freed = send_free(c, id, a.buf);
  if (a.buf && (freed == 0 || freed == GPUMEM_E_NOT_FOUND || freed == GPUMEM_E_DISCONNECTED))
    client_buffer_destroy(c, a.buf);
  else if (a.buf && freed != GPUMEM_E_TIMEOUT)
    client_free_later(c, a.buf);
  return error_set(a.rc ? a.rc : GPUMEM_E_NOMEM, "%s", a.words);
}

/* Allocate a tagged buffer, found by its address from then on. */
int gpumem_alloc(gpumem_client *c, const char *tag, int device, uint64_t size,
                 unsigned flags, gpumem_buffer **out) {
  gpumem_buffer *b;
  int rc = client_alloc(c, tag, device, size, flags, false, &b);
  if (rc < 0) return rc;
  if (addrmap_put(b->va, &b->at, &c->addrs, ADDR_BUFFER) < 0) {
    rc = client_free_buffer(c, b);
    if (rc < 0 && rc != GPUMEM_E_TIMEOUT) client_free_later(c, b);
    return error_set(GPUMEM_E_NOMEM, "out of memory");
  }
  *out = b;
  return 0;
}

/* Free a buffer: the daemon first, so that a pause in flight keeps it. A
 * buffer that no daemon knows (one that was not re-registered) is only
 * released here. */
int client_free_buffer(gpumem_client *c, gpumem_buffer *b) {
  pthread_mutex_lock(&c->mu);
  bool orphan = c->state == CONN_LIVE && !b->registered;
  if (orphan) client_buffer_forget(c, b);
  pthread_mutex_unlock(&c->mu);
  if (!orphan) {
    int rc = send_free(c, b->id, b);
    if (rc < 0) return rc;
  }
  client_buffer_destroy(c, b);
  return 0;
}

/* Free a buffer of gpumem_alloc; a pool's slab is the pool's to free. */
int gpumem_free(gpumem_client *c, gpumem_buffer *b) {
  if (!c || !b) return error_set(GPUMEM_E_INVALID, "no client or no buffer");
  if (b->pooled)
    return error_set(GPUMEM_E_INVALID,
                       "buffer %llu belongs to the gpumem_malloc pool: free its allocations "
                       "with gpumem_free_ptr",
                       (unsigned long long)gpumem_buffer_id(b));
  return client_free_buffer(c, b);
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

/* Answer an event: OK, or the code, words and ids of what failed. */
static void ack(gpumem_client *c, uint64_t event_id, const struct failures *fl) {
  Gpumem__Wire__EventAck a = GPUMEM__WIRE__EVENT_ACK__INIT;
  a.code = fl->code;
  a.message = (char *)(fl->code ? fl->words : "");
  a.failed_ids = fl->ids;
  a.n_failed_ids = fl->code ? fl->n : 0;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = event_id;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ACK;
  env.ack = &a;
  client_send(c, &env);
}

/* The registered buffer with this id, or NULL. */
static gpumem_buffer *find_buffer(gpumem_client *c, uint64_t id) {
  pthread_mutex_lock(&c->mu);
  gpumem_buffer *b = idmap_get(c->buffers, id);
  pthread_mutex_unlock(&c->mu);
  return b;
}

/* The default pre-unmap hook: wait for each device the buffers are on. */
static void sync_devices(gpumem_client *c, gpumem_buffer *const *bufs, size_t n) {
  uint64_t done = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned d = bufs[i]->local;
    if (d < 64 && (done & (1ull << d))) continue;
    if (d < 64) done |= 1ull << d;
    if (c->gpu) gpu_sync(c->gpu, d);
  }
}

/* Unmap: run the hook, unmap and release, keep the ranges, ack; every
 * id this client does not hold, and every buffer that stays mapped, is
 * named in the ack. */
static void on_unmap(gpumem_client *c, const wire_env *env) {
  const Gpumem__Wire__UnmapEvent *ev = env->unmap;
  struct failures fl = {.ids = calloc(ev->n_buffer_ids + 1, sizeof *fl.ids)};
  gpumem_buffer **bufs = calloc(ev->n_buffer_ids + 1, sizeof *bufs);
  if (!bufs || !fl.ids) {
    /* No ids listed: every buffer of the event failed. */
    free(fl.ids);
    fl.ids = NULL;
    failed(&fl, 0, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR, "out of memory");
    free(bufs);
    ack(c, env->id, &fl);
    return;
  }
  size_t n = 0;
  for (size_t i = 0; i < ev->n_buffer_ids; i++) {
    uint64_t id = ev->buffer_ids[i];
    gpumem_buffer *b = find_buffer(c, id);
    if (!b)
      failed(&fl, id, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, "no buffer %llu in this process",
             (unsigned long long)id);
    else if (b->ipc)
      failed(&fl, id, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
             "buffer %llu is legacy IPC memory and never pauses", (unsigned long long)id);
    else
      bufs[n++] = b;
  }
  pthread_mutex_lock(&c->mu);
  gpumem_hook hook = c->pre_unmap;
  void *user = c->hook_user;
  pthread_mutex_unlock(&c->mu);
  if (hook)
    hook(c, bufs, n, user);
  else
    sync_devices(c, bufs, n);
  for (size_t i = 0; i < n; i++)
    if (client_buffer_unmap(c, bufs[i]) < 0)
      failed(&fl, bufs[i]->id, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
             "buffer %llu stays mapped: %s", (unsigned long long)bufs[i]->id, gpu_error());
  free(bufs);
  ack(c, env->id, &fl);
  free(fl.ids);
}

/* Remap: import the new chunks at the old addresses, run the hook, ack;
 * entries that do not map are named in the ack. */
static void on_remap(gpumem_client *c, const wire_env *env, struct frame *f) {
  const Gpumem__Wire__RemapEvent *ev = env->remap;
  pthread_mutex_lock(&c->mu);
  gpumem_hook hook = c->post_remap;
  void *user = c->hook_user;
  pthread_mutex_unlock(&c->mu);
  struct failures fl = {.ids = calloc(ev->n_entries + 1, sizeof *fl.ids)};
  gpumem_buffer **bufs = calloc(ev->n_entries + 1, sizeof *bufs);
  if (!bufs || !fl.ids) {
    free(fl.ids);
    fl.ids = NULL;
    failed(&fl, 0, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR, "out of memory");
    free(bufs);
    ack(c, env->id, &fl);
    return;
  }
  size_t n = 0, fd_at = 0;
  for (size_t i = 0; i < ev->n_entries; i++) {
    const Gpumem__Wire__RemapEntry *e = ev->entries[i];
    unsigned long long id = (unsigned long long)e->buffer_id;
    int *fds = f->fds + fd_at;
    fd_at += e->n_chunk_sizes;
    gpumem_buffer *b = find_buffer(c, e->buffer_id);
    bool fits = b && !b->ipc && !b->mapped && b->nchunks == e->n_chunk_sizes;
    for (size_t k = 0; fits && k < b->nchunks; k++)
      fits = b->chunk_sizes[k] == e->chunk_sizes[k] && !b->held[k];
    /* Fds not taken are closed with the frame. */
    if (!b)
      failed(&fl, e->buffer_id, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND,
             "no buffer %llu in this process", id);
    else if (!fits)
      failed(&fl, e->buffer_id, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
             "remap of buffer %llu does not fit it (%s)", id,
             b->mapped ? "it is mapped" : "other chunks");
    else if (map_chunks(c, b, fds) < 0)
      failed(&fl, e->buffer_id, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR, "%s",
             gpumem_last_error());
    else
      bufs[n++] = b;
  }
  if (hook && n) hook(c, bufs, n, user);
  free(bufs);
  ack(c, env->id, &fl);
  free(fl.ids);
}

/* Handle an Unmap or Remap event from the daemon. */
void client_handle_event(gpumem_client *c, const wire_env *env, struct frame *f) {
  if (env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_UNMAP)
    on_unmap(c, env);
  else
    on_remap(c, env, f);
}

/* Set the hooks run around unmap and remap. */
void gpumem_set_hooks(gpumem_client *c, gpumem_hook pre_unmap, gpumem_hook post_remap,
                      void *user) {
  pthread_mutex_lock(&c->mu);
  c->pre_unmap = pre_unmap;
  c->post_remap = post_remap;
  c->hook_user = user;
  pthread_mutex_unlock(&c->mu);
}

/* Start a copy into or out of [off, off+len) of a buffer: refused unless
 * the range is inside it and it is mapped and not being unmapped; an
 * Unmap waits for the copy to end (copy_end). */
static int copy_begin(gpumem_client *c, gpumem_buffer *b, uint64_t off, uint64_t len) {
  if (!c || !b) return error_set(GPUMEM_E_INVALID, "no client or no buffer");
  if (off > b->size || len > b->size - off)
    return error_set(GPUMEM_E_INVALID, "range %llu+%llu outside a %llu-byte buffer",
                       (unsigned long long)off, (unsigned long long)len,
                       (unsigned long long)b->size);
  pthread_mutex_lock(&c->mu);
  bool mapped = b->mapped, unmapping = b->unmapping;
  if (mapped && !unmapping) b->copies++;
  pthread_mutex_unlock(&c->mu);
  if (!mapped || unmapping)
    return error_set(GPUMEM_E_WRONG_STATE, "buffer %llu is %s",
                       (unsigned long long)gpumem_buffer_id(b),
                       unmapping ? "being paused" : "paused");
  return 0;
}

/* End a copy begun with copy_begin, waking an Unmap that waits for it. */
static int copy_end(gpumem_client *c, gpumem_buffer *b, int rc) {
  pthread_mutex_lock(&c->mu);
  if (--b->copies == 0 && b->unmapping) pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  return rc;
}

/* Copy from a buffer to host memory with the device's copy engine. */
int gpumem_buffer_read(gpumem_client *c, gpumem_buffer *b, uint64_t off, void *dst, uint64_t len) {
  int rc = copy_begin(c, b, off, len);
  if (rc < 0) return rc;
  if (gpu_copy_from(c->gpu, b->local, dst, (char *)b->va + off, len) < 0)
    rc = error_set(GPUMEM_E_BACKEND, "%s", gpu_error());
  return copy_end(c, b, rc);
}

/* Copy host memory into a buffer. */
int gpumem_buffer_write(gpumem_client *c, gpumem_buffer *b, uint64_t off, const void *src,
                        uint64_t len) {
  int rc = copy_begin(c, b, off, len);
  if (rc < 0) return rc;
  if (gpu_copy_to(c->gpu, b->local, (char *)b->va + off, src, len) < 0)
    rc = error_set(GPUMEM_E_BACKEND, "%s", gpu_error());
  return copy_end(c, b, rc);
}

/* Fill part of a buffer with a 32-bit value on the device. */
int gpumem_buffer_fill32(gpumem_client *c, gpumem_buffer *b, uint64_t off, uint64_t len,
                         uint32_t value) {
  if (off % 4 || len % 4)
    return error_set(GPUMEM_E_INVALID, "offset and length must be multiples of 4");
  int rc = copy_begin(c, b, off, len);
  if (rc < 0) return rc;
  if (gpu_fill32(c->gpu, b->local, (char *)b->va + off, len, value) < 0)
    rc = error_set(GPUMEM_E_BACKEND, "%s", gpu_error());
  return copy_end(c, b, rc);
}

/* Wait until a device has finished its work. */
int gpumem_sync(gpumem_client *c, int device) {
  int map[GPUMEM_MAX_DEVICES];
  if (!c) return error_set(GPUMEM_E_INVALID, "no client");
  unsigned seen = client_local_map(c, map);
  if (client_node_device(map, device) < 0)
    return error_set(GPUMEM_E_INVALID,
                       "device %d is not one of the %u gpumemd devices this process sees",
                       device, seen);
  if (!c->gpu) return 0; /* it maps nothing: nothing to wait for */
  if (gpu_sync(c->gpu, (unsigned)device) < 0)
    return error_set(GPUMEM_E_BACKEND, "%s", gpu_error());
  return 0;
}

/* Accessors. */
void *gpumem_buffer_ptr(const gpumem_buffer *b) { return b->va; }
uint64_t gpumem_buffer_size(const gpumem_buffer *b) { return b->size; }
const char *gpumem_buffer_tag(const gpumem_buffer *b) { return b->tag; }
int gpumem_buffer_device(const gpumem_buffer *b) { return (int)b->local; }
uint64_t gpumem_buffer_id(const gpumem_buffer *b) {
  return __atomic_load_n(&b->id, __ATOMIC_RELAXED); /* renumbered by a reconnection */
}
unsigned gpumem_buffer_flags(const gpumem_buffer *b) { return b->flags; }
int gpumem_buffer_mapped(const gpumem_buffer *b) {
  return __atomic_load_n(&b->mapped, __ATOMIC_ACQUIRE);
}
int gpumem_buffer_registered(const gpumem_buffer *b) {
  return __atomic_load_n(&b->registered, __ATOMIC_RELAXED);
}
