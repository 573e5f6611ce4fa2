/* Buffers: allocation, mapping at a fixed address, and the unmap and
 * remap events that pause and resume them. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client.h"

/* Import and map chunk fds (consumed) at the buffer's address, then allow
 * access once for the whole range. On failure nothing stays mapped. */
static int map_chunks(gpumem_client *c, gpumem_buffer *b, int *fds) {
  size_t i = 0, mapped = 0;
  uint64_t off = 0;
  int rc = 0;
  for (; i < b->nchunks; off += b->chunk_sizes[i++]) {
    int fd = fds[i];
    fds[i] = -1;
    if ((rc = gpu_import(c->gpu, b->local, fd, b->chunk_sizes[i], &b->handles[i])) < 0) break;
    if ((rc = gpu_map(c->gpu, b->local, (char *)b->va + off, b->chunk_sizes[i], b->handles[i])) <
        0) {
      gpu_release(c->gpu, b->local, b->handles[i]);
      break;
    }
    mapped++;
  }
  if (rc == 0) rc = gpu_set_access(c->gpu, b->local, b->va, b->size);
  if (rc == 0) {
    b->mapped = true;
    return 0;
  }
  /* fds not consumed stay in the caller's frame, which closes them. */
  off = 0;
  for (size_t j = 0; j < mapped; off += b->chunk_sizes[j++]) {
    gpu_unmap(c->gpu, b->local, (char *)b->va + off, b->chunk_sizes[j]);
    gpu_release(c->gpu, b->local, b->handles[j]);
  }
  return client_fail(GPUMEM_E_MAP, "mapping buffer %llu: %s", (unsigned long long)b->id,
                     gpu_error());
}

/* Unmap each chunk's mapping separately (one unmap across several breaks
 * address-range release on ROCm) and release the imported handles. */
void client_buffer_unmap(gpumem_client *c, gpumem_buffer *b) {
  if (!b->mapped || b->ipc) return;
  uint64_t off = 0;
  for (size_t i = 0; i < b->nchunks; off += b->chunk_sizes[i++]) {
    gpu_unmap(c->gpu, b->local, (char *)b->va + off, b->chunk_sizes[i]);
    gpu_release(c->gpu, b->local, b->handles[i]);
  }
  b->mapped = false;
}

static void buffer_free_struct(gpumem_buffer *b) {
  free(b->chunk_sizes);
  free(b->handles);
  free(b);
}

/* Forget a buffer completely. */
void client_buffer_destroy(gpumem_client *c, gpumem_buffer *b) {
  pthread_mutex_lock(&c->mu);
  idmap_del(c->buffers, b->id);
  pthread_mutex_unlock(&c->mu);
  if (b->ipc)
    gpu_ipc_close(c->gpu, b->local, b->va);
  else {
    client_buffer_unmap(c, b);
    gpu_va_free(c->gpu, b->local, b->va, b->size);
  }
  buffer_free_struct(b);
}

static int send_free(gpumem_client *c, uint64_t id) {
  Gpumem__Wire__FreeRequest fr = GPUMEM__WIRE__FREE_REQUEST__INIT;
  fr.buffer_id = id;
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_FREE;
  req.free = &fr;
  struct pending reply;
  int rc = client_call(c, &req, &reply);
  client_reply_free(&reply);
  return rc;
}

/* Allocate a tagged buffer and map it. */
int gpumem_alloc(gpumem_client *c, const char *tag, unsigned device, uint64_t size,
                 unsigned flags, gpumem_buffer **out) {
  if (!tag || !wire_tag_valid(tag))
    return client_fail(GPUMEM_E_INVALID, "invalid tag: 1-%d characters of [A-Za-z0-9_.-]",
                       WIRE_TAG_MAX);
  unsigned index = 0;
  while (index < c->ndevices && index < WIRE_MAX_DEVICES && c->local_of[index] != (int)device)
    index++;
  if (index >= c->ndevices || index >= WIRE_MAX_DEVICES)
    return client_fail(GPUMEM_E_INVALID, "device %u of this process is not one gpumemd manages",
                       device);
  Gpumem__Wire__AllocRequest ar = GPUMEM__WIRE__ALLOC_REQUEST__INIT;
  ar.tag = (char *)tag;
  ar.device = index;
  ar.size = size;
  ar.flags = flags;
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ALLOC;
  req.alloc = &ar;
  struct pending reply;
  int rc = client_call(c, &req, &reply);
  if (rc < 0) {
    client_reply_free(&reply);
    return rc;
  }
  if (reply.env->body_case != GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY) {
    client_reply_free(&reply);
    return client_fail(GPUMEM_E_PROTOCOL, "gpumemd answered alloc with something else");
  }
  const Gpumem__Wire__AllocReply *r = reply.env->alloc_reply;
  gpumem_buffer *b = calloc(1, sizeof *b);
  if (b) {
    b->chunk_sizes = calloc(r->n_chunk_sizes, sizeof *b->chunk_sizes);
    b->handles = calloc(r->n_chunk_sizes, sizeof *b->handles);
  }
  if (!b || !b->chunk_sizes || !b->handles) {
    rc = client_fail(GPUMEM_E_NOMEM, "out of memory");
    goto fail;
  }
  b->id = r->buffer_id;
  snprintf(b->tag, sizeof b->tag, "%s", tag);
  b->device = index;
  b->local = device;
  b->size = r->size;
  b->flags = flags;
  b->nchunks = r->n_chunk_sizes;
  memcpy(b->chunk_sizes, r->chunk_sizes, b->nchunks * sizeof *b->chunk_sizes);
  if (r->ipc_handle.len) {
    b->ipc = true;
    if (gpu_ipc_open(c->gpu, b->local, r->ipc_handle.data, &b->va) < 0) {
      rc = client_fail(GPUMEM_E_MAP, "opening IPC handle: %s", gpu_error());
      goto fail;
    }
    b->mapped = true;
  } else if (gpu_va_reserve(c->gpu, b->local, b->size, &b->va) < 0) {
    rc = client_fail(GPUMEM_E_MAP, "reserving %llu bytes: %s",
                     (unsigned long long)b->size, gpu_error());
    goto fail;
  } else if (r->state == GPUMEM__WIRE__BUFFER_STATE__ACTIVE &&
             (rc = map_chunks(c, b, reply.frame.fds)) < 0) {
    gpu_va_free(c->gpu, b->local, b->va, b->size);
    goto fail;
  }
  pthread_mutex_lock(&c->mu);
  rc = idmap_put(c->buffers, b->id, b);
  pthread_mutex_unlock(&c->mu);
  if (rc < 0) {
    client_buffer_destroy(c, b);
    b = NULL;
    rc = client_fail(GPUMEM_E_NOMEM, "out of memory");
    goto fail;
  }
  client_reply_free(&reply);
  *out = b;
  return 0;
fail:
  if (b) buffer_free_struct(b);
  uint64_t id = r->buffer_id;
  client_reply_free(&reply);
  char words[320];
  snprintf(words, sizeof words, "%s", gpumem_last_error());
  send_free(c, id);
  return client_fail(rc, "%s", words);
}

/* Free a buffer: the daemon first, so that a pause in flight keeps it. */
int gpumem_free(gpumem_client *c, gpumem_buffer *b) {
  if (!b) return client_fail(GPUMEM_E_INVALID, "no buffer");
  int rc = send_free(c, b->id);
  if (rc < 0) return rc;
  client_buffer_destroy(c, b);
  return 0;
}

/* Look up the buffers of an event; unknown ids are skipped. */
static size_t find_buffers(gpumem_client *c, const uint64_t *ids, size_t n,
                           gpumem_buffer **out) {
  size_t k = 0;
  pthread_mutex_lock(&c->mu);
  for (size_t i = 0; i < n; i++) {
    gpumem_buffer *b = idmap_get(c->buffers, ids[i]);
    if (b) out[k++] = b;
  }
  pthread_mutex_unlock(&c->mu);
  return k;
}

static void ack(gpumem_client *c, uint64_t event_id, int failed, const char *words) {
  Gpumem__Wire__EventAck a = GPUMEM__WIRE__EVENT_ACK__INIT;
  a.code = failed ? GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR : GPUMEM__WIRE__ERROR_CODE__OK;
  a.message = (char *)(failed ? words : "");
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = event_id;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ACK;
  env.ack = &a;
  client_send(c, &env);
}

/* The default pre-unmap hook: wait for each device the buffers are on. */
static void sync_devices(gpumem_client *c, gpumem_buffer *const *bufs, size_t n) {
  uint64_t done = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned d = bufs[i]->local;
    if (d < 64 && (done & (1ull << d))) continue;
    if (d < 64) done |= 1ull << d;
    gpu_sync(c->gpu, d);
  }
}

/* Unmap: run the hook, unmap and release, keep the ranges, ack. */
static void on_unmap(gpumem_client *c, const wire_env *env) {
  const Gpumem__Wire__UnmapEvent *ev = env->unmap;
  gpumem_buffer **bufs = calloc(ev->n_buffer_ids + 1, sizeof *bufs);
  size_t n = bufs ? find_buffers(c, ev->buffer_ids, ev->n_buffer_ids, bufs) : 0;
  if (c->pre_unmap)
    c->pre_unmap(c, bufs, n, c->hook_user);
  else
    sync_devices(c, bufs, n);
  for (size_t i = 0; i < n; i++) client_buffer_unmap(c, bufs[i]);
  free(bufs);
  ack(c, env->id, !bufs, "out of memory");
}

/* Remap: import the new chunks at the old addresses, run the hook, ack. */
static void on_remap(gpumem_client *c, const wire_env *env, struct frame *f) {
  const Gpumem__Wire__RemapEvent *ev = env->remap;
  gpumem_buffer **bufs = calloc(ev->n_entries + 1, sizeof *bufs);
  size_t n = 0, fd_at = 0;
  int failed = !bufs;
  char words[320] = "out of memory";
  for (size_t i = 0; bufs && i < ev->n_entries; i++) {
    const Gpumem__Wire__RemapEntry *e = ev->entries[i];
    int *fds = f->fds + fd_at;
    fd_at += e->n_chunk_sizes;
    gpumem_buffer *b = NULL;
    find_buffers(c, &e->buffer_id, 1, &b);
    bool fits = b && !b->mapped && b->nchunks == e->n_chunk_sizes;
    for (size_t k = 0; fits && k < b->nchunks; k++)
      fits = b->chunk_sizes[k] == e->chunk_sizes[k];
    if (!fits) {
      snprintf(words, sizeof words, "remap of buffer %llu does not fit it",
               (unsigned long long)e->buffer_id);
      failed = 1;
      continue; /* its fds are closed with the frame */
    }
    if (map_chunks(c, b, fds) < 0) {
      snprintf(words, sizeof words, "%s", gpumem_last_error());
      failed = 1;
      continue;
    }
    bufs[n++] = b;
  }
  if (c->post_remap && n) c->post_remap(c, bufs, n, c->hook_user);
  free(bufs);
  ack(c, env->id, failed, words);
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

/* Check that [off, off+len) is inside a mapped buffer. */
static int check_range(const gpumem_buffer *b, uint64_t off, uint64_t len) {
  if (off > b->size || len > b->size - off)
    return client_fail(GPUMEM_E_INVALID, "range %llu+%llu outside a %llu-byte buffer",
                       (unsigned long long)off, (unsigned long long)len,
                       (unsigned long long)b->size);
  if (!b->mapped) return client_fail(GPUMEM_E_WRONG_STATE, "buffer %llu is paused",
                                     (unsigned long long)b->id);
  return 0;
}

/* Copy from a buffer to host memory with the device's copy engine. */
int gpumem_buffer_read(gpumem_client *c, gpumem_buffer *b, uint64_t off, void *dst, uint64_t len) {
  int rc = check_range(b, off, len);
  if (rc == 0 && gpu_copy_from(c->gpu, b->local, dst, (char *)b->va + off, len) < 0)
    rc = client_fail(GPUMEM_E_BACKEND, "%s", gpu_error());
  return rc;
}

/* Copy host memory into a buffer. */
int gpumem_buffer_write(gpumem_client *c, gpumem_buffer *b, uint64_t off, const void *src,
                        uint64_t len) {
  int rc = check_range(b, off, len);
  if (rc == 0 && gpu_copy_to(c->gpu, b->local, (char *)b->va + off, src, len) < 0)
    rc = client_fail(GPUMEM_E_BACKEND, "%s", gpu_error());
  return rc;
}

/* Fill part of a buffer with a 32-bit value on the device. */
int gpumem_buffer_fill32(gpumem_client *c, gpumem_buffer *b, uint64_t off, uint64_t len,
                         uint32_t value) {
  if (off % 4 || len % 4) return client_fail(GPUMEM_E_INVALID, "offset and length must be multiples of 4");
  int rc = check_range(b, off, len);
  if (rc == 0 && gpu_fill32(c->gpu, b->local, (char *)b->va + off, len, value) < 0)
    rc = client_fail(GPUMEM_E_BACKEND, "%s", gpu_error());
  return rc;
}

/* Wait until a device has finished its work. */
int gpumem_sync(gpumem_client *c, unsigned device) {
  if (gpu_sync(c->gpu, device) < 0) return client_fail(GPUMEM_E_BACKEND, "%s", gpu_error());
  return 0;
}

/* Accessors. */
void *gpumem_buffer_ptr(const gpumem_buffer *b) { return b->va; }
uint64_t gpumem_buffer_size(const gpumem_buffer *b) { return b->size; }
const char *gpumem_buffer_tag(const gpumem_buffer *b) { return b->tag; }
unsigned gpumem_buffer_device(const gpumem_buffer *b) { return b->local; }
uint64_t gpumem_buffer_id(const gpumem_buffer *b) { return b->id; }
unsigned gpumem_buffer_flags(const gpumem_buffer *b) { return b->flags; }
int gpumem_buffer_mapped(const gpumem_buffer *b) { return b->mapped; }
