/* Allocating and freeing buffers at the daemon. The loop makes and maps
 * an allocation's buffer when its reply arrives (before it reads the next
 * frame, so that an Unmap right behind the reply finds it); here the
 * caller's side checks the arguments and gives back what was made at the
 * daemon but could not be made here. */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "alloc.h"
#include "buffer.h"
#include "client.h"
#include "error.h"

/* Ask the daemon to free buffer b (the loop forgets it when the daemon
 * says it is freed), or, with b NULL, the daemon's buffer id. */
static int send_free(gpumem_client *c, gpumem_buffer *b, uint64_t id) {
  Gpumem__Wire__FreeRequest fr = GPUMEM__WIRE__FREE_REQUEST__INIT;
  fr.buffer_id = id;
  wire_env req = wire_envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_FREE, &fr);
  struct call call = {.freeing = b};
  int rc = conn_call(c->conn, &req, &call);
  conn_call_done(&call);
  return rc;
}

/* Send an AllocRequest or AttachRequest and make its buffer from the
 * reply (spec says how); a buffer made at the daemon but not here is
 * given back. */
static int call_for_buffer(gpumem_client *c, wire_env *req, const struct buffer_spec *spec,
                           unsigned extra_ms, gpumem_buffer **out) {
  struct call call = {.alloc = spec, .extra_ms = extra_ms};
  int rc = conn_call(c->conn, req, &call);
  if (rc == 0 && call.reply->body_case != GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY)
    rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered with something else than a buffer");
  gpumem_buffer *b = call.built;
  uint64_t id = rc == 0 ? call.reply->alloc_reply->buffer_id : 0;
  conn_call_done(&call);
  if (rc < 0 || (call.built_rc == 0 && b)) {
    if (rc == 0) *out = b;
    return rc;
  }
  /* Made at the daemon but not here (b, if made at all, is doomed): give
   * it back. A free that times out is finished by the library; one the
   * daemon refuses (a pause has the buffer) is sent again until it goes
   * through. */
  int freed = send_free(c, b, id);
  if (b && (freed == 0 || freed == GPUMEM_E_NOT_FOUND || freed == GPUMEM_E_DISCONNECTED)) {
    buffers_remove(c->buffers, b);
    buffer_destroy(b);
  } else if (b && freed != GPUMEM_E_TIMEOUT) {
    alloc_give_up(c, b);
  }
  return error_set(call.built_rc ? call.built_rc : GPUMEM_E_NOMEM, "%s", call.built_words);
}

/* Refuse persistent buffers with a daemon older than 1.12. */
static int need_persistent(gpumem_client *c) {
  unsigned minor = hello_minor(c->hello);
  if (minor >= 12) return 0;
  return error_set(GPUMEM_E_VERSION,
                   "persistent buffers need gpumemd 1.12 or later (it speaks 1.%u)", minor);
}

/* Refuse a persistent buffer's name that is not valid. */
static int check_name(const char *name) {
  if (name && wire_tag_valid(name)) return 0;
  return error_set(GPUMEM_E_INVALID, "invalid name: 1-%d characters of [A-Za-z0-9_.-]",
                   WIRE_TAG_MAX);
}

/* Allocate a buffer, named if persistent. */
static int alloc_named(gpumem_client *c, const char *name, const char *tag, int device,
                       uint64_t size, unsigned flags, bool pooled, gpumem_buffer **out) {
  if (!c || !out) return error_set(GPUMEM_E_INVALID, "no client or no place for the buffer");
  if (!tag || !wire_tag_valid(tag))
    return error_set(GPUMEM_E_INVALID, "invalid tag: 1-%d characters of [A-Za-z0-9_.-]",
                     WIRE_TAG_MAX);
  if ((flags & GPUMEM_PERSIST) && !name)
    return error_set(GPUMEM_E_INVALID,
                     "GPUMEM_PERSIST buffers have a name: allocate them with "
                     "gpumem_alloc_persistent");
  int map[GPUMEM_MAX_DEVICES];
  unsigned seen = hello_local_map(c->hello, map);
  int node = hello_node_device(map, device);
  if (node < 0 && conn_live(c->conn))
    return error_set(GPUMEM_E_INVALID,
                     "device %d is not one of the %u gpumemd devices this process sees", device,
                     seen);
  Gpumem__Wire__AllocRequest ar = GPUMEM__WIRE__ALLOC_REQUEST__INIT;
  ar.keep_free = atomic_load(&c->keep_free);
  unsigned minor = hello_minor(c->hello);
  if (ar.keep_free && conn_live(c->conn) && minor < 7) /* an older daemon ignores it */
    return error_set(GPUMEM_E_VERSION,
                     "a margin to keep free (gpumem_set_keep_free) needs gpumemd 1.7 or later "
                     "(it speaks 1.%u)", minor);
  if ((flags & GPUMEM_BACKUP_DISK) && conn_live(c->conn) && minor < 9)
    return error_set(GPUMEM_E_VERSION,
                     "GPUMEM_BACKUP_DISK needs gpumemd 1.9 or later (it speaks 1.%u)", minor);
  if ((flags & GPUMEM_PERSIST) && conn_live(c->conn) && need_persistent(c) < 0)
    return GPUMEM_E_VERSION;
  if (flags & GPUMEM_BACKUP_DISK) flags |= GPUMEM_BACKUP_RELEASE; /* its host memory lets go */
  ar.tag = (char *)tag;
  ar.device = node < 0 ? 0 : (unsigned)node;
  ar.size = size;
  ar.flags = flags;
  ar.name = (char *)(name ? name : "");
  wire_env req = wire_envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_ALLOC, &ar);
  struct buffer_spec spec = {.tag = tag, .device = ar.device, .local = (unsigned)device,
                             .flags = flags, .pooled = pooled, .name = name};
  return call_for_buffer(c, &req, &spec, 0, out);
}

/* Allocate a buffer. */
int alloc_buffer(gpumem_client *c, const char *tag, int device, uint64_t size, unsigned flags,
                 bool pooled, gpumem_buffer **out) {
  return alloc_named(c, NULL, tag, device, size, flags, pooled, out);
}

/* Make a buffer the caller's: found by its address from then on. */
static int publish(gpumem_client *c, gpumem_buffer *b, gpumem_buffer **out) {
  if (buffer_publish(b, &c->addrs) < 0) {
    alloc_discard(c, b);
    return error_set(GPUMEM_E_NOMEM, "out of memory");
  }
  *out = b;
  return 0;
}

/* Allocate a persistent buffer. */
int gpumem_alloc_persistent(gpumem_client *c, const char *name, const char *tag, int device,
                            uint64_t size, unsigned flags, gpumem_buffer **out) {
  if (check_name(name) < 0) return GPUMEM_E_INVALID;
  if (flags & GPUMEM_IPC_LEGACY)
    return error_set(GPUMEM_E_INVALID, "GPUMEM_IPC_LEGACY buffers cannot be persistent");
  gpumem_buffer *b;
  int rc = alloc_named(c, name, tag, device, size, flags | GPUMEM_PERSIST, false, &b);
  return rc < 0 ? rc : publish(c, b, out);
}

/* Take this uid's persistent buffer of that name. */
int gpumem_attach(gpumem_client *c, const char *name, gpumem_buffer **out) {
  return gpumem_attach_wait(c, name, 0, out);
}

/* Take it, waiting up to wait_ms for its holder to let go of it. */
int gpumem_attach_wait(gpumem_client *c, const char *name, unsigned wait_ms,
                       gpumem_buffer **out) {
  if (!c || !out) return error_set(GPUMEM_E_INVALID, "no client or no place for the buffer");
  if (check_name(name) < 0) return GPUMEM_E_INVALID;
  if (wait_ms > WIRE_MAX_WAIT_MS)
    return error_set(GPUMEM_E_INVALID, "wait_ms %u: at most %d", wait_ms, WIRE_MAX_WAIT_MS);
  if (need_persistent(c) < 0) return GPUMEM_E_VERSION;
  Gpumem__Wire__AttachRequest ar = GPUMEM__WIRE__ATTACH_REQUEST__INIT;
  ar.name = (char *)name;
  ar.wait_ms = wait_ms;
  int map[GPUMEM_MAX_DEVICES];
  hello_local_map(c->hello, map);
  for (unsigned i = 0; i < GPUMEM_MAX_DEVICES; i++)
    if (map[i] >= 0) ar.devices |= 1ull << i;
  wire_env req = wire_envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_ATTACH, &ar);
  struct buffer_spec spec = {.name = name, .attach = true};
  gpumem_buffer *b;
  int rc = call_for_buffer(c, &req, &spec, wait_ms, &b);
  return rc < 0 ? rc : publish(c, b, out);
}

/* Free a persistent buffer no process holds. */
int gpumem_drop(gpumem_client *c, const char *name, uint32_t uid, uint64_t *bytes) {
  if (!c) return error_set(GPUMEM_E_INVALID, "no client");
  if (check_name(name) < 0) return GPUMEM_E_INVALID;
  if (need_persistent(c) < 0) return GPUMEM_E_VERSION;
  Gpumem__Wire__DropRequest dr = GPUMEM__WIRE__DROP_REQUEST__INIT;
  dr.name = (char *)name;
  dr.uid = uid;
  wire_env req = wire_envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_DROP, &dr);
  struct call call = {0};
  int rc = conn_call(c->conn, &req, &call);
  if (rc == 0 && call.reply->body_case != GPUMEM__WIRE__ENVELOPE__BODY_DROP_REPLY)
    rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered a drop with something else");
  if (rc == 0 && bytes) *bytes = call.reply->drop_reply->bytes;
  conn_call_done(&call);
  return rc;
}

/* Allocate a tagged buffer, found by its address from then on. */
int gpumem_alloc(gpumem_client *c, const char *tag, int device, uint64_t size,
                 unsigned flags, gpumem_buffer **out) {
  gpumem_buffer *b;
  int rc = alloc_buffer(c, tag, device, size, flags, false, &b);
  return rc < 0 ? rc : publish(c, b, out);
}

/* Free a buffer: the daemon first, so that a pause in flight keeps it. A
 * buffer that no daemon knows (one that was not re-registered) is only
 * released here. */
int alloc_free(gpumem_client *c, gpumem_buffer *b) {
  bool orphan = conn_live(c->conn) && !gpumem_buffer_registered(b);
  if (!orphan) {
    int rc = send_free(c, b, 0);
    if (rc < 0) return rc;
  }
  buffers_remove(c->buffers, b);
  buffer_destroy(b);
  return 0;
}

/* Give up a buffer whose free failed (not by timing out). */
void alloc_give_up(gpumem_client *c, gpumem_buffer *b) { conn_free_later(c->conn, b); }

/* Free a buffer the caller no longer wants, whatever the daemon says. */
int alloc_discard(gpumem_client *c, gpumem_buffer *b) {
  int rc = alloc_free(c, b);
  if (rc < 0 && rc != GPUMEM_E_TIMEOUT) alloc_give_up(c, b);
  return rc;
}

/* Free a buffer of gpumem_alloc; a pool's slab is the pool's to free. */
int gpumem_free(gpumem_client *c, gpumem_buffer *b) {
  if (!c || !b) return error_set(GPUMEM_E_INVALID, "no client or no buffer");
  if (buffer_pooled(b))
    return error_set(GPUMEM_E_INVALID,
                     "buffer %llu belongs to the gpumem_malloc pool: free its allocations "
                     "with gpumem_free_ptr",
                     (unsigned long long)gpumem_buffer_id(b));
  return alloc_free(c, b);
}
