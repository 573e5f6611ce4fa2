/* Reading what a pause saved: the backup of a paused BACKUP buffer of
 * this client, found by an address inside it (a tensor's data pointer),
 * copied out or read in place, while the buffer stays paused. The
 * backup memory a buffer keeps mapped from its owner's copies serves
 * directly; otherwise the daemon hands the memory for reading
 * (BackupRequest, 1.8), and the buffer keeps it from then on; from 1.10
 * a backup in the daemon's --backup-dir comes as its file, read only, and
 * a pageable one is copied into memory of this process, each kept until
 * the buffer is mapped again. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "buffer.h"
#include "buffers.h"
#include "client.h"
#include "conn.h"
#include "error.h"
#include "hello.h"

/* Memory of this process for the daemon to copy b's backup into: a
 * memfd of b's size, faulted in here so that it is ours (our memory
 * cgroup's). Returns its fd, or a GPUMEM_E_* code with error_set's words. */
static int own_memory(gpumem_buffer *b) {
  uint64_t size = gpumem_buffer_size(b);
  int fd = memfd_create("gpumem-backup-read", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0)
    return error_set(GPUMEM_E_NOMEM, "memory to read the backup of buffer %llu into: %s",
                     (unsigned long long)gpumem_buffer_id(b), strerror(errno));
  int rc = ftruncate(fd, (off_t)size) < 0 ? errno : posix_fallocate(fd, 0, (off_t)size);
  /* Its size for good: a daemon cutting it short would fault its readers. */
  if (!rc && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) < 0) rc = errno;
  if (rc) {
    close(fd);
    return error_set(GPUMEM_E_NOMEM, "%llu bytes to read the backup of buffer %llu into: %s",
                     (unsigned long long)size, (unsigned long long)gpumem_buffer_id(b),
                     strerror(rc));
  }
  return fd;
}

/* Ask the daemon for b's backup (sending memory for it to copy into,
 * fd, where memory is set) and keep what it answers mapped in b; *send
 * says when it asks for memory. */
static int ask(gpumem_client *c, gpumem_buffer *b, int memory, bool *send) {
  Gpumem__Wire__BackupRequest q = GPUMEM__WIRE__BACKUP_REQUEST__INIT;
  q.buffer_id = gpumem_buffer_id(b);
  q.memory = memory >= 0;
  wire_env req = wire_envelope(0, GPUMEM__WIRE__ENVELOPE__BODY_BACKUP, &q);
  struct call call = {0};
  if (memory >= 0) {
    call.send_fds = &memory;
    call.nsend_fds = 1;
    req.fd_count = 1;
  }
  uint64_t epoch = buffer_epoch(b); /* a map or unmap meanwhile makes the answer stale */
  int keep = memory >= 0 ? dup(memory) : -1; /* ours to map once it holds the backup */
  if (memory >= 0 && keep < 0) {
    close(memory);
    return error_set(GPUMEM_E_NOMEM, "reading a backup: %s", strerror(errno));
  }
  int rc = conn_call(c->conn, &req, &call);
  if (rc == 0 && call.reply->body_case != GPUMEM__WIRE__ENVELOPE__BODY_BACKUP_REPLY)
    rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered a backup request with something else");
  if (rc == 0) {
    const Gpumem__Wire__BackupReply *r = call.reply->backup_reply;
    const Gpumem__Wire__BackupMemory *m = r->backup;
    if (m->buffer_id != q.buffer_id)
      rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered with the backup of another buffer");
    else if ((r->send_memory && memory >= 0) || r->copied != (memory >= 0))
      rc = error_set(GPUMEM_E_PROTOCOL, "gpumemd answered a backup request out of turn");
    else if (r->send_memory)
      *send = true;
    else if (r->copied)
      rc = buffer_backup_keep(b, m->piece_sizes, 1, &keep, true, epoch);
    else
      rc = buffer_backup_keep(b, m->piece_sizes, m->n_piece_sizes, call.frame.fds, r->files,
                              epoch);
  }
  if (keep >= 0) close(keep);
  conn_call_done(&call);
  return rc;
}

/* Ask the daemon for b's backup and keep it mapped in b: its host memory
 * or its file, or, where the daemon can only copy it (pageable memory),
 * a copy into memory of this process. */
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
  bool send = false;
  int rc = ask(c, b, -1, &send);
  if (rc < 0 || !send) return rc;
  int memory = own_memory(b);
  return memory < 0 ? memory : ask(c, b, memory, &send);
}

/* Read (into dst) or view the backup bytes at ptr. */
static int backup_at(gpumem_client *c, const void *ptr, uint64_t len, void *dst,
                     const void **view) {
  if (!c || !ptr || (!dst && !view && len))
    return error_set(GPUMEM_E_INVALID, "no client, no address or no place for the bytes");
  uint64_t off = 0;
  gpumem_buffer *b = buffers_holding(c->buffers, ptr, len, &off);
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
