/* Reading what a pause saved: the backup of a paused BACKUP buffer of
 * this client, found by an address inside it (a tensor's data pointer),
 * copied out or read in place, while the buffer stays paused. The
 * backup memory a buffer keeps mapped from its owner's copies serves
 * directly; otherwise the daemon hands the memory for reading
 * (BackupRequest, 1.8), and the buffer keeps it from then on. */
#include <stdint.h>
#include <stdlib.h>

#include "buffer.h"
#include "buffers.h"
#include "client.h"
#include "conn.h"
#include "error.h"
#include "hello.h"

/* The buffer of c that holds [ptr, ptr + len), and ptr's offset in it. */
static gpumem_buffer *holder(gpumem_client *c, const void *ptr, uint64_t len, uint64_t *off) {
  size_t n = 0;
  gpumem_buffer **all = buffers_list(c->buffers, &n);
  gpumem_buffer *found = NULL;
  uintptr_t p = (uintptr_t)ptr;
  for (size_t i = 0; i < n && !found; i++) {
    uintptr_t va = (uintptr_t)gpumem_buffer_ptr(all[i]);
    uint64_t size = gpumem_buffer_size(all[i]);
    if (va && p >= va && p - va < size && len <= size - (p - va)) {
      found = all[i];
      *off = p - va;
    }
  }
  free(all);
  return found;
}

/* Ask the daemon for b's backup memory and keep it mapped in b. */
static int fetch(gpumem_client *c, gpumem_buffer *b) {
  unsigned minor = hello_minor(c->hello);
  if (minor < 8)
    return error_set(GPUMEM_E_VERSION,
                     "reading a backup the daemon keeps needs gpumemd 1.8 or later (it speaks "
                     "1.%u)", minor);
  if (!gpumem_buffer_registered(b))
    return error_set(GPUMEM_E_DISCONNECTED,
                     "buffer %llu is not registered with the daemon now (it is reconnecting)",
                     (unsigned long long)gpumem_buffer_id(b));
  Gpumem__Wire__BackupRequest q = GPUMEM__WIRE__BACKUP_REQUEST__INIT;
  q.buffer_id = gpumem_buffer_id(b);
  wire_env req = wire_envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_BACKUP, &q);
  struct call call = {0};
  uint64_t epoch = buffer_epoch(b); /* a map or unmap meanwhile makes the answer stale */
  int rc = conn_call(c->conn, &req, &call);
  if (rc == 0 && call.reply->body_case != GPUMEM__WIRE__ENVELOPE__BODY_BACKUP_REPLY)
    rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered a backup request with something else");
  if (rc == 0) {
    const Gpumem__Wire__BackupMemory *m = call.reply->backup_reply->backup;
    if (m->buffer_id != q.buffer_id)
      rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered with the backup of another buffer");
    else
      rc = buffer_backup_keep(b, m->piece_sizes, m->n_piece_sizes, call.frame.fds, epoch);
  }
  conn_call_done(&call);
  return rc;
}

/* Read (into dst) or view the backup bytes at ptr. */
static int backup_at(gpumem_client *c, const void *ptr, uint64_t len, void *dst,
                     const void **view) {
  if (!c || !ptr || (!dst && !view && len))
    return error_set(GPUMEM_E_INVALID, "no client, no address or no place for the bytes");
  uint64_t off = 0;
  gpumem_buffer *b = holder(c, ptr, len, &off);
  if (!b)
    return error_set(GPUMEM_E_NOT_FOUND,
                     "no buffer of this client holds %llu bytes at %p",
                     (unsigned long long)len, ptr);
  if (!(gpumem_buffer_flags(b) & GPUMEM_BACKUP))
    return error_set(GPUMEM_E_WRONG_STATE,
                     "buffer %llu has no backup (allocated without GPUMEM_BACKUP)",
                     (unsigned long long)gpumem_buffer_id(b));
  int rc = buffer_backup_read(b, off, len, dst, view);
  if (rc != GPUMEM_E_NOT_FOUND) return rc;
  if ((rc = fetch(c, b)) < 0) return rc;
  return buffer_backup_read(b, off, len, dst, view);
}

/* Copy bytes of a paused buffer's backup to host memory. */
int gpumem_backup_read(gpumem_client *c, const void *ptr, uint64_t len, void *dst) {
  return backup_at(c, ptr, len, dst, NULL);
}

/* Where bytes of a paused buffer's backup can be read in place. */
int gpumem_backup_view(gpumem_client *c, const void *ptr, uint64_t len, const void **host) {
  if (!host) return error_set(GPUMEM_E_INVALID, "no place for the view");
  return backup_at(c, ptr, len, NULL, host);
}
