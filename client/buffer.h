/* A buffer: a reserved address range on one device and the daemon's
 * chunks mapped into it, with its own lock for what other threads read
 * (its id, whether it is mapped, whether the daemon knows it) and for the
 * copies that an unmap waits for. The struct is private to buffer.c. */
#ifndef GPUMEM_CLIENT_BUFFER_H
#define GPUMEM_CLIENT_BUFFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "addrmap.h"
#include "common/wire.h"
#include "gpu/gpuva.h"
#include "gpumem.h"

/* What an allocation asked for, from which its buffer is made. */
struct buffer_spec {
  const char *tag;
  unsigned device; /* the daemon's number */
  unsigned local;  /* this process's number of the same device */
  unsigned flags;
  bool pooled;     /* a slab of gpumem_malloc's pool */
  const char *name; /* a persistent buffer's; NULL: none */
  bool attach;      /* an Attach: tag, device, local and flags come with the reply */
};

/* Make the buffer of an AllocReply on backend g (NULL: this client maps
 * nothing) and map its chunk fds (taken from fds as they are used; the
 * rest stay the caller's). Returns 0 with *out; on failure the code (and
 * error_set's words), with *out NULL when nothing was made, or a buffer
 * that is made but not mapped (its mapping failed: doomed, for the
 * caller to give back). */
int buffer_create(gpuva *g, const struct buffer_spec *s, const Gpumem__Wire__AllocReply *r,
                  int *fds, gpumem_buffer **out);

/* Unmap what is mapped, free the address range and the buffer; it must be
 * out of its buffers already. Takes it out of the address map. */
void buffer_destroy(gpumem_buffer *b);

/* Unmap each chunk and release its handle, keeping the address range;
 * waits for copies in flight and refuses new ones meanwhile. Returns 0,
 * or a negative errno when a chunk stayed mapped (gpu_error says why). */
int buffer_unmap(gpumem_buffer *b);

/* Backup memory the daemon hands an owner to copy through (protocol
 * 1.7): n pieces, their sizes, one fd each (taken as used), or (kept)
 * the memory it handed before, which the buffer kept mapped. */
struct backup_mem {
  const uint64_t *sizes;
  size_t n;
  int *fds;
  bool kept;
};

/* Copy the buffer's contents into backup memory m, then unmap it as
 * buffer_unmap does; copies are refused from before the copy on, so that
 * nothing written after it is lost. The backup memory stays mapped with
 * the buffer if keep (for the next events to hand by reference), else it
 * is let go of. A failed copy leaves the buffer mapped and usable
 * (GPUMEM_E_* with words), and nothing of the backup kept. */
int buffer_unmap_into(gpumem_buffer *b, const struct backup_mem *m, bool keep);

/* Map the chunks of a Remap entry (n chunk sizes, fds taken as used) at
 * the buffer's address, then copy its contents in from backup memory m
 * (NULL: none; kept as buffer_unmap_into keeps it) before it is usable;
 * fails with GPUMEM_E_WRONG_STATE (words set) when they do not fit it or
 * it is mapped, GPUMEM_E_MAP when mapping fails, and as backup_io_copy
 * does: then nothing stays mapped. */
int buffer_remap(gpumem_buffer *b, const uint64_t *sizes, size_t n, int *fds,
                 const struct backup_mem *m, bool keep);

/* Record the tag generation the daemon gave with the buffer's mapping (a
 * Remap entry's). */
void buffer_set_generation(gpumem_buffer *b, uint64_t generation);

/* Record the secret the daemon gave with the buffer (AllocReply.secret,
 * AdoptReply.secrets); one not WIRE_SECRET_SIZE bytes long is not kept. */
void buffer_set_secret(gpumem_buffer *b, const uint8_t *secret, size_t len);

/* Copy the buffer's secret into out (WIRE_SECRET_SIZE bytes); its length,
 * 0 when the daemon gave none. */
size_t buffer_secret(gpumem_buffer *b, uint8_t *out);

/* Let go of the backup memory the buffer kept mapped (a daemon that came
 * back never refers to it). */
void buffer_drop_backup(gpumem_buffer *b);

/* Read len bytes at off of the backup the paused buffer keeps mapped:
 * copied into dst, or (view not NULL) made readable by the host in place
 * and *view set to them. GPUMEM_E_WRONG_STATE while the buffer is mapped,
 * GPUMEM_E_NOT_FOUND (no words) when no backup is kept here,
 * GPUMEM_E_INVALID past its end, GPUMEM_E_BACKEND when the copy fails. */
int buffer_backup_read(gpumem_buffer *b, uint64_t off, uint64_t len, void *dst,
                       const void **view);

/* How many times the buffer was mapped or unmapped so far. */
uint64_t buffer_epoch(gpumem_buffer *b);

/* Map the n pieces of backup memory (their sizes, one fd each, all taken)
 * that the daemon handed for reading, or files (a disk backup's file, or
 * this process's memfd the daemon copied a pageable backup into: mapped
 * read only, let go of at the next remap), and keep them as the buffer's
 * backup, unless it keeps one already. GPUMEM_E_WRONG_STATE when the
 * buffer was mapped or unmapped since buffer_epoch said epoch (the memory
 * may be stale or let go of), else 0 or backup_io_map's code. */
int buffer_backup_keep(gpumem_buffer *b, const uint64_t *sizes, size_t n, int *fds, bool files,
                       uint64_t epoch);

/* True while the buffer keeps backup memory of the daemon's mapped. */
bool buffer_keeps_backup(const gpumem_buffer *b);

/* Export a mapped buffer's chunks again as fds, one per chunk; on failure
 * none stays open. */
int buffer_export(gpumem_buffer *b, int *fds);

/* Put a gpumem_alloc buffer in the address map as owner's. */
int buffer_publish(gpumem_buffer *b, struct addr_owner *owner);

/* The buffer whose address map entry e is (kind ADDR_BUFFER). */
gpumem_buffer *buffer_of_addr(struct addr_entry *e);

/* Record the daemon's id of the buffer and whether it knows it. */
void buffer_set_known(gpumem_buffer *b, uint64_t id, bool known);

/* Mark a buffer no longer the caller's (its allocation failed here, or
 * the library finishes its free): never re-registered, out of the
 * address map. */
void buffer_doom(gpumem_buffer *b);

/* True once buffer_doom was called. */
bool buffer_doomed(const gpumem_buffer *b);

/* True for a slab of gpumem_malloc's pool. */
bool buffer_pooled(const gpumem_buffer *b);

/* True for legacy IPC memory (opened from a handle, never paused). */
bool buffer_ipc(const gpumem_buffer *b);

/* True when some chunks are mapped and others not (an unmap failed). */
bool buffer_partial(const gpumem_buffer *b);

/* The buffer's chunk sizes and their count. */
size_t buffer_chunks(const gpumem_buffer *b, const uint64_t **sizes);

/* May allocations come from this slab now: the daemon knows it (unless
 * not live: while reconnecting, mapped ones serve), and it is mapped and
 * not being unmapped unless allow_paused. */
bool buffer_usable(const gpumem_buffer *b, bool allow_paused, bool live);

/* The backend that maps the buffer. */
gpuva *buffer_gpu(const gpumem_buffer *b);

#endif
