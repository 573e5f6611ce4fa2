/* A buffer: its address range, the chunks mapped into it, and the copies
 * that read and write it. Fields set when the buffer is made never change;
 * the handles of its chunks belong to the thread that maps and unmaps
 * them (the one that handles the daemon's events, or whoever destroys the
 * buffer once nothing else can find it); the rest is under the buffer's
 * own lock. */
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "buffer.h"

#include "backup_io.h"
#include "common/clock.h"
#include "error.h"

struct gpumem_buffer {
  struct addr_entry at; /* in the address map while the caller's (gpumem_alloc) */
  pthread_mutex_t mu;   /* the fields up to copies */
  pthread_cond_t cv;    /* the last copy ended */
  uint64_t id;          /* the daemon's id; meaningful while known */
  bool known;           /* the daemon knows it (not while reconnecting, nor when
                         * the new daemon did not re-register it) */
  bool mapped;          /* every chunk is mapped and accessible */
  bool unmapping;       /* an unmap is taking it: copies are refused */
  bool doomed;          /* no longer the caller's: never re-registered */
  unsigned copies;      /* reads, writes and fills in flight */
  unsigned backup_reads; /* reads of the kept backup in flight */
  bool backup_busy;      /* an event or the caller is changing the kept backup */
  uint64_t epoch;        /* bumped by every map and unmap (buffer_epoch) */
  uint64_t generation;   /* its tag's generation at its last mapping */
  uint8_t secret[WIRE_SECRET_SIZE]; /* what proves it ours to a restarted daemon */
  size_t secret_len;                /* 0: the daemon gave none (before 1.11) */
  gpuva *gpu;
  char tag[WIRE_TAG_MAX + 1];
  char name[WIRE_TAG_MAX + 1]; /* a persistent buffer's; "" otherwise */
  unsigned local; /* this process's device number */
  bool ipc;       /* legacy IPC memory: opened, never paused */
  bool pooled;    /* a slab of gpumem_malloc's pool */
  uint64_t size;
  unsigned flags;
  void *va;
  size_t nchunks;
  uint64_t *chunk_sizes;
  uint64_t *handles; /* of chunk i while held[i] */
  bool *held;        /* chunk i is imported and mapped */
  struct backup_map backup; /* its backup memory, kept mapped (none: all zero);
                             * changed only under backup_begin_change */
};

/* The buffer's id, read under its lock. */
static unsigned long long id_of(const gpumem_buffer *b) {
  return (unsigned long long)gpumem_buffer_id(b);
}

/* Say whether a buffer is mapped. */
static void set_mapped(gpumem_buffer *b, bool mapped) {
  pthread_mutex_lock(&b->mu);
  b->mapped = mapped;
  b->epoch++;
  pthread_mutex_unlock(&b->mu);
}

/* Import and map chunk fds (taken as they are used) at the buffer's
 * address, then allow access once for the whole range, and say it is
 * mapped if publish. On failure nothing stays mapped. */
static int map_chunks(gpumem_buffer *b, int *fds, bool publish) {
  uint64_t off = 0;
  int rc = 0;
  for (size_t i = 0; i < b->nchunks; off += b->chunk_sizes[i++]) {
    int fd = fds[i];
    fds[i] = -1;
    if ((rc = gpuva_import(b->gpu, b->local, fd, b->chunk_sizes[i], &b->handles[i])) < 0) break;
    if ((rc = gpuva_map(b->gpu, b->local, (char *)b->va + off, b->chunk_sizes[i],
                      b->handles[i])) < 0) {
      gpuva_release(b->gpu, b->local, b->handles[i]);
      break;
    }
    b->held[i] = true;
  }
  if (rc == 0) rc = gpuva_set_access(b->gpu, b->local, b->va, b->size);
  if (rc == 0) {
    if (publish) set_mapped(b, true);
    return 0;
  }
  char why[256];
  snprintf(why, sizeof why, "%s", gpu_error());
  buffer_unmap(b);
  return error_set(GPUMEM_E_MAP, "mapping buffer %llu: %s", id_of(b), why);
}

/* Free the struct of a buffer (nothing mapped or reserved any more). */
static void free_struct(gpumem_buffer *b) {
  pthread_mutex_destroy(&b->mu);
  pthread_cond_destroy(&b->cv);
  free(b->chunk_sizes);
  free(b->handles);
  free(b->held);
  free(b);
}

/* Make and map the buffer of an AllocReply. */
int buffer_create(gpuva *g, const struct buffer_spec *s, const Gpumem__Wire__AllocReply *r,
                  int *fds, gpumem_buffer **out) {
  *out = NULL;
  if (!g)
    return error_set(GPUMEM_E_PERMISSION,
                     "this client maps no memory (GPUMEM_CONNECT_NODE_DEVICES)");
  gpumem_buffer *b = calloc(1, sizeof *b);
  if (!b) return error_set(GPUMEM_E_NOMEM, "out of memory");
  pthread_mutex_init(&b->mu, NULL);
  clock_cond_init(&b->cv);
  b->chunk_sizes = calloc(r->n_chunk_sizes + 1, sizeof *b->chunk_sizes);
  b->handles = calloc(r->n_chunk_sizes + 1, sizeof *b->handles);
  b->held = calloc(r->n_chunk_sizes + 1, sizeof *b->held);
  if (!b->chunk_sizes || !b->handles || !b->held) {
    free_struct(b);
    return error_set(GPUMEM_E_NOMEM, "out of memory");
  }
  b->id = r->buffer_id;
  b->gpu = g;
  snprintf(b->tag, sizeof b->tag, "%s", s->tag);
  snprintf(b->name, sizeof b->name, "%s", s->name ? s->name : "");
  b->local = s->local;
  b->size = r->size;
  b->flags = s->flags;
  b->pooled = s->pooled;
  b->nchunks = r->n_chunk_sizes;
  b->generation = r->generation;
  buffer_set_secret(b, r->secret.data, r->secret.len);
  memcpy(b->chunk_sizes, r->chunk_sizes, b->nchunks * sizeof *b->chunk_sizes);
  if (r->ipc_handle.len) {
    b->ipc = true;
    if (gpuva_ipc_open(g, b->local, r->ipc_handle.data, &b->va) < 0) {
      int rc = error_set(GPUMEM_E_MAP, "opening IPC handle: %s", gpu_error());
      free_struct(b);
      return rc;
    }
    b->mapped = true; /* no other thread has it yet */
  } else if (gpuva_reserve(g, b->local, b->size, &b->va) < 0) {
    int rc = error_set(GPUMEM_E_MAP, "reserving %llu bytes: %s", (unsigned long long)b->size,
                       gpu_error());
    free_struct(b);
    return rc;
  }
  *out = b;
  if (r->state != GPUMEM__WIRE__BUFFER_STATE__ACTIVE || b->ipc) return 0;
  int rc = map_chunks(b, fds, true);
  if (rc < 0) b->doomed = true; /* no other thread has it yet */
  return rc;
}

/* Unmap each chunk's mapping separately (one unmap across several breaks
 * address-range release on ROCm) and release its imported handle. A
 * chunk that does not unmap keeps its handle and stays held. */
int buffer_unmap(gpumem_buffer *b) {
  if (b->ipc) return 0;
  pthread_mutex_lock(&b->mu);
  b->unmapping = true;
  while (b->copies) pthread_cond_wait(&b->cv, &b->mu);
  pthread_mutex_unlock(&b->mu);
  uint64_t off = 0;
  int rc = 0;
  for (size_t i = 0; i < b->nchunks; off += b->chunk_sizes[i++]) {
    if (!b->held[i]) continue;
    int r = gpuva_unmap(b->gpu, b->local, (char *)b->va + off, b->chunk_sizes[i]);
    if (r < 0) {
      if (rc == 0) rc = r;
      continue;
    }
    gpuva_release(b->gpu, b->local, b->handles[i]);
    b->held[i] = false;
  }
  pthread_mutex_lock(&b->mu);
  b->mapped = false;
  b->unmapping = false;
  b->epoch++;
  pthread_mutex_unlock(&b->mu);
  return rc;
}

/* Refuse copies from now on, once those in flight ended (or allow them
 * again). */
static void set_unmapping(gpumem_buffer *b, bool unmapping) {
  pthread_mutex_lock(&b->mu);
  b->unmapping = unmapping;
  while (unmapping && b->copies) pthread_cond_wait(&b->cv, &b->mu);
  pthread_mutex_unlock(&b->mu);
}

/* One copy between the buffer and backup map m. */
static int copy_with(gpumem_buffer *b, const struct backup_map *m, bool to_backup) {
  return backup_io_copy(b->gpu, b->local, b->va, b->size, gpumem_buffer_id(b), m, to_backup);
}

/* Wait until no read of the kept backup is in flight and hold new ones
 * off: the kept backup may change until backup_end_change. */
static void backup_begin_change(gpumem_buffer *b) {
  pthread_mutex_lock(&b->mu);
  while (b->backup_busy || b->backup_reads) pthread_cond_wait(&b->cv, &b->mu);
  b->backup_busy = true;
  pthread_mutex_unlock(&b->mu);
}

/* Let reads of the kept backup in again. */
static void backup_end_change(gpumem_buffer *b) {
  pthread_mutex_lock(&b->mu);
  b->backup_busy = false;
  pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

static int backup_through_locked(gpumem_buffer *b, const struct backup_mem *m, bool to_backup,
                                 bool keep);

/* Copy between the buffer and backup memory m: the map kept, or m's
 * pieces mapped now (then kept if keep, else let go of). A failure keeps
 * nothing. */
static int backup_through(gpumem_buffer *b, const struct backup_mem *m, bool to_backup,
                          bool keep) {
  backup_begin_change(b);
  int rc = backup_through_locked(b, m, to_backup, keep);
  backup_end_change(b);
  return rc;
}

/* backup_through, with the kept backup held for change. */
static int backup_through_locked(gpumem_buffer *b, const struct backup_mem *m, bool to_backup,
                                 bool keep) {
  int rc;
  if (m->kept) {
    rc = b->backup.va ? copy_with(b, &b->backup, to_backup)
                      : error_set(GPUMEM_E_PROTOCOL,
                                  "buffer %llu: the daemon says its backup memory was kept "
                                  "here, and none is", id_of(b));
    if (rc < 0 || !keep) backup_io_unmap(b->gpu, b->local, &b->backup);
    return rc;
  }
  backup_io_unmap(b->gpu, b->local, &b->backup); /* memory handed anew replaces it */
  struct backup_map fresh;
  if ((rc = backup_io_map(b->gpu, b->local, m->sizes, m->n, m->fds, &fresh)) < 0) return rc;
  rc = copy_with(b, &fresh, to_backup);
  if (rc == 0 && keep)
    b->backup = fresh;
  else
    backup_io_unmap(b->gpu, b->local, &fresh);
  return rc;
}

/* Copy into backup memory with copies refused, then unmap. */
int buffer_unmap_into(gpumem_buffer *b, const struct backup_mem *m, bool keep) {
  set_unmapping(b, true);
  if (!gpumem_buffer_mapped(b) || buffer_partial(b)) { /* nothing to copy from */
    set_unmapping(b, false);
    for (size_t i = 0; i < m->n; i++)
      if (m->fds[i] >= 0) {
        close(m->fds[i]);
        m->fds[i] = -1;
      }
    return error_set(GPUMEM_E_WRONG_STATE, "buffer %llu is not mapped: nothing to back up",
                     id_of(b));
  }
  int rc = backup_through(b, m, true, keep);
  if (rc < 0) {
    set_unmapping(b, false);
    return rc;
  }
  if (buffer_unmap(b) < 0)
    return error_set(GPUMEM_E_MAP, "buffer %llu stays mapped: %s", id_of(b), gpu_error());
  return 0;
}

/* Map a Remap entry's chunks, if they fit the buffer, and copy its backup
 * in before anyone may use it. */
int buffer_remap(gpumem_buffer *b, const uint64_t *sizes, size_t n, int *fds,
                 const struct backup_mem *m, bool keep) {
  pthread_mutex_lock(&b->mu);
  bool mapped = b->mapped;
  pthread_mutex_unlock(&b->mu);
  bool fits = !b->ipc && !mapped && b->nchunks == n;
  for (size_t k = 0; fits && k < n; k++) fits = b->chunk_sizes[k] == sizes[k] && !b->held[k];
  if (!fits)
    return error_set(GPUMEM_E_WRONG_STATE, "remap of buffer %llu does not fit it (%s)", id_of(b),
                     mapped ? "it is mapped" : "other chunks");
  int rc = map_chunks(b, fds, !m);
  /* A map kept for reading: the daemon lets the memory go, or it is a
   * file or a copy, true only while the buffer was paused. */
  if (rc == 0 && !m && ((b->flags & GPUMEM_BACKUP_RELEASE) || b->backup.files))
    buffer_drop_backup(b);
  if (rc < 0 || !m) return rc;
  if ((rc = backup_through(b, m, false, keep)) < 0) {
    buffer_unmap(b);
    return rc;
  }
  set_mapped(b, true);
  return 0;
}

/* Export a mapped buffer's imported handles again as fds. */
int buffer_export(gpumem_buffer *b, int *fds) {
  for (size_t i = 0; i < b->nchunks; i++) {
    int rc = gpuva_export(b->gpu, b->local, b->handles[i], &fds[i]);
    if (rc < 0) {
      while (i > 0) close(fds[--i]);
      return error_set(GPUMEM_E_BACKEND, "exporting buffer %llu again: %s", id_of(b),
                       gpu_error());
    }
  }
  return 0;
}

/* Let go of the kept backup memory. */
void buffer_drop_backup(gpumem_buffer *b) {
  backup_begin_change(b);
  backup_io_unmap(b->gpu, b->local, &b->backup);
  backup_end_change(b);
}

/* Start a read of the kept backup of a paused buffer: 0 with reads of the
 * kept map safe until backup_read_end, or why not. */
static int backup_read_begin(gpumem_buffer *b, uint64_t off, uint64_t len) {
  pthread_mutex_lock(&b->mu);
  while (b->backup_busy) pthread_cond_wait(&b->cv, &b->mu);
  int rc = 0;
  if (b->mapped || b->unmapping)
    rc = error_set(GPUMEM_E_WRONG_STATE,
                   "buffer %llu is mapped: its memory holds the contents, not its backup",
                   (unsigned long long)b->id);
  else if (!b->backup.va)
    rc = GPUMEM_E_NOT_FOUND; /* none kept here: the caller asks the daemon */
  else if (off > b->size || len > b->size - off)
    rc = error_set(GPUMEM_E_INVALID, "%llu bytes at %llu pass the end of buffer %llu",
                   (unsigned long long)len, (unsigned long long)off, (unsigned long long)b->id);
  else
    b->backup_reads++;
  pthread_mutex_unlock(&b->mu);
  return rc;
}

/* End a read that backup_read_begin started. */
static void backup_read_end(gpumem_buffer *b) {
  pthread_mutex_lock(&b->mu);
  if (--b->backup_reads == 0) pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
}

/* Copy or view len bytes at off of the kept backup. */
int buffer_backup_read(gpumem_buffer *b, uint64_t off, uint64_t len, void *dst,
                       const void **view) {
  int rc = backup_read_begin(b, off, len);
  if (rc < 0) return rc;
  void *at = (char *)b->backup.va + off;
  if (b->backup.files) { /* host memory already, read only */
    if (view)
      *view = at;
    else if (len)
      memcpy(dst, at, len);
  } else if (view) {
    if (gpuva_host_view(b->gpu, b->local, b->backup.va, b->backup.total) < 0)
      rc = error_set(GPUMEM_E_BACKEND, "buffer %llu: its backup cannot be read in place: %s",
                     id_of(b), gpu_error());
    else
      *view = at;
  } else if (len && gpuva_copy_from(b->gpu, b->local, dst, at, len) < 0) {
    rc = error_set(GPUMEM_E_BACKEND, "reading the backup of buffer %llu: %s", id_of(b),
                   gpu_error());
  }
  backup_read_end(b);
  return rc;
}

/* How many times the buffer was mapped or unmapped so far. */
uint64_t buffer_epoch(gpumem_buffer *b) {
  pthread_mutex_lock(&b->mu);
  uint64_t epoch = b->epoch;
  pthread_mutex_unlock(&b->mu);
  return epoch;
}

/* Keep backup memory the daemon handed for reading, unless some is kept
 * or the buffer moved since the request. */
int buffer_backup_keep(gpumem_buffer *b, const uint64_t *sizes, size_t n, int *fds,
                       bool files, uint64_t epoch) {
  backup_begin_change(b);
  pthread_mutex_lock(&b->mu);
  bool moved = b->epoch != epoch || b->mapped || b->unmapping;
  pthread_mutex_unlock(&b->mu);
  int rc = 0;
  if (moved) {
    rc = error_set(GPUMEM_E_WRONG_STATE,
                   "buffer %llu was resumed or paused again while its backup was asked for",
                   id_of(b));
  } else if (!b->backup.va) {
    rc = files ? backup_io_map_files(sizes, n, fds, &b->backup)
               : backup_io_map(b->gpu, b->local, sizes, n, fds, &b->backup);
    if (rc == 0 && b->backup.total < b->size) {
      backup_io_unmap(b->gpu, b->local, &b->backup);
      rc = error_set(GPUMEM_E_PROTOCOL,
                     "gpumemd handed %llu bytes of backup for the %llu of buffer %llu",
                     (unsigned long long)b->backup.total, (unsigned long long)b->size, id_of(b));
    }
  }
  backup_end_change(b);
  for (size_t i = 0; i < n; i++)
    if (fds[i] >= 0) {
      close(fds[i]);
      fds[i] = -1;
    }
  return rc;
}

/* Whether backup memory is kept mapped. */
bool buffer_keeps_backup(const gpumem_buffer *b) { return b->backup.va != NULL; }

/* Forget a buffer completely. */
void buffer_destroy(gpumem_buffer *b) {
  addrmap_remove(&b->at);
  if (b->ipc) {
    gpuva_ipc_close(b->gpu, b->local, b->va);
  } else {
    buffer_unmap(b);
    /* Whatever would not unmap goes with the range; let go of its handle. */
    for (size_t i = 0; i < b->nchunks; i++)
      if (b->held[i]) gpuva_release(b->gpu, b->local, b->handles[i]);
    if (b->va) gpuva_free(b->gpu, b->local, b->va, b->size);
    buffer_drop_backup(b);
  }
  free_struct(b);
}

/* Put a buffer in the address map. */
int buffer_publish(gpumem_buffer *b, struct addr_owner *owner) {
  return addrmap_put(b->va, &b->at, owner, ADDR_BUFFER);
}

/* The buffer that holds an address map entry. */
gpumem_buffer *buffer_of_addr(struct addr_entry *e) {
  return (gpumem_buffer *)((char *)e - offsetof(gpumem_buffer, at));
}

/* Record the daemon's id and whether it knows the buffer. */
void buffer_set_known(gpumem_buffer *b, uint64_t id, bool known) {
  pthread_mutex_lock(&b->mu);
  b->id = id;
  b->known = known;
  pthread_mutex_unlock(&b->mu);
}

/* Mark a buffer no longer the caller's. */
void buffer_doom(gpumem_buffer *b) {
  pthread_mutex_lock(&b->mu);
  b->doomed = true;
  pthread_mutex_unlock(&b->mu);
  addrmap_remove(&b->at);
}

/* What of a buffer its lock guards and its readers ask of it. */
struct buffer_now {
  uint64_t id, generation;
  bool mapped, unmapping, known, doomed;
};

/* Read what b's lock guards, at once, under it. */
static struct buffer_now buffer_now(const gpumem_buffer *b) {
  gpumem_buffer *m = (gpumem_buffer *)b;
  pthread_mutex_lock(&m->mu);
  struct buffer_now n = {.id = m->id, .generation = m->generation, .mapped = m->mapped,
                         .unmapping = m->unmapping, .known = m->known, .doomed = m->doomed};
  pthread_mutex_unlock(&m->mu);
  return n;
}

/* True once the buffer is no longer the caller's. */
bool buffer_doomed(const gpumem_buffer *b) { return buffer_now(b).doomed; }

/* True for a slab of the pool. */
bool buffer_pooled(const gpumem_buffer *b) { return b->pooled; }

/* True for legacy IPC memory. */
bool buffer_ipc(const gpumem_buffer *b) { return b->ipc; }

/* True when only some chunks are mapped. */
bool buffer_partial(const gpumem_buffer *b) {
  bool mapped = gpumem_buffer_mapped(b);
  for (size_t i = 0; i < b->nchunks; i++)
    if (b->held[i] != mapped) return true;
  return false;
}

/* The chunk sizes. */
size_t buffer_chunks(const gpumem_buffer *b, const uint64_t **sizes) {
  *sizes = b->chunk_sizes;
  return b->nchunks;
}

/* May allocations come from this slab now. */
bool buffer_usable(const gpumem_buffer *b, bool allow_paused, bool live) {
  struct buffer_now n = buffer_now(b);
  return (!live || n.known) && (allow_paused || (n.mapped && !n.unmapping));
}

/* The backend that maps the buffer. */
gpuva *buffer_gpu(const gpumem_buffer *b) { return b->gpu; }

/* Start a copy into or out of [off, off+len) of a buffer: refused unless
 * the range is inside it and it is mapped and not being unmapped; an
 * unmap waits for the copy to end (copy_end). */
static int copy_begin(gpumem_client *c, gpumem_buffer *b, uint64_t off, uint64_t len) {
  if (!c || !b) return error_set(GPUMEM_E_INVALID, "no client or no buffer");
  if (off > b->size || len > b->size - off)
    return error_set(GPUMEM_E_INVALID, "range %llu+%llu outside a %llu-byte buffer",
                     (unsigned long long)off, (unsigned long long)len,
                     (unsigned long long)b->size);
  pthread_mutex_lock(&b->mu);
  bool mapped = b->mapped, unmapping = b->unmapping;
  unsigned long long id = (unsigned long long)b->id;
  if (mapped && !unmapping) b->copies++;
  pthread_mutex_unlock(&b->mu);
  if (!mapped || unmapping)
    return error_set(GPUMEM_E_WRONG_STATE, "buffer %llu is %s", id,
                     unmapping ? "being paused" : "paused");
  return 0;
}

/* End a copy begun with copy_begin, waking an unmap that waits for it; the
 * backend's result for the copy (negative: it failed) becomes the call's. */
static int copy_end(gpumem_buffer *b, int gpu_rc) {
  int rc = gpu_rc < 0 ? error_set(GPUMEM_E_BACKEND, "%s", gpu_error()) : 0;
  pthread_mutex_lock(&b->mu);
  if (--b->copies == 0 && b->unmapping) pthread_cond_broadcast(&b->cv);
  pthread_mutex_unlock(&b->mu);
  return rc;
}

/* Copy from a buffer to host memory with the device's copy engine. */
int gpumem_buffer_read(gpumem_client *c, gpumem_buffer *b, uint64_t off, void *dst, uint64_t len) {
  int rc = copy_begin(c, b, off, len);
  if (rc < 0) return rc;
  return copy_end(b, gpuva_copy_from(b->gpu, b->local, dst, (char *)b->va + off, len));
}

/* Copy host memory into a buffer. */
int gpumem_buffer_write(gpumem_client *c, gpumem_buffer *b, uint64_t off, const void *src,
                        uint64_t len) {
  int rc = copy_begin(c, b, off, len);
  if (rc < 0) return rc;
  return copy_end(b, gpuva_copy_to(b->gpu, b->local, (char *)b->va + off, src, len));
}

/* Fill part of a buffer with a 32-bit value on the device. */
int gpumem_buffer_fill32(gpumem_client *c, gpumem_buffer *b, uint64_t off, uint64_t len,
                         uint32_t value) {
  if (off % 4 || len % 4)
    return error_set(GPUMEM_E_INVALID, "offset and length must be multiples of 4");
  int rc = copy_begin(c, b, off, len);
  if (rc < 0) return rc;
  return copy_end(b, gpuva_fill32(b->gpu, b->local, (char *)b->va + off, len, value));
}

/* The buffer's address. */
void *gpumem_buffer_ptr(const gpumem_buffer *b) { return b->va; }

/* The buffer's size. */
uint64_t gpumem_buffer_size(const gpumem_buffer *b) { return b->size; }

/* The buffer's tag. */
const char *gpumem_buffer_tag(const gpumem_buffer *b) { return b->tag; }

/* The buffer's device, in this process's numbering. */
int gpumem_buffer_device(const gpumem_buffer *b) { return (int)b->local; }

/* The buffer's flags. */
unsigned gpumem_buffer_flags(const gpumem_buffer *b) { return b->flags; }

/* The buffer's name, if persistent. */
const char *gpumem_buffer_name(const gpumem_buffer *b) { return b->name; }

/* Its tag's generation when the buffer was last mapped. */
uint64_t gpumem_buffer_generation(const gpumem_buffer *b) { return buffer_now(b).generation; }

/* Record the generation of a mapping. */
void buffer_set_generation(gpumem_buffer *b, uint64_t generation) {
  pthread_mutex_lock(&b->mu);
  b->generation = generation;
  pthread_mutex_unlock(&b->mu);
}

/* Record the secret the daemon gave with the buffer (one of another size
 * than WIRE_SECRET_SIZE is not kept). */
void buffer_set_secret(gpumem_buffer *b, const uint8_t *secret, size_t len) {
  pthread_mutex_lock(&b->mu);
  b->secret_len = len == WIRE_SECRET_SIZE ? len : 0;
  if (b->secret_len) memcpy(b->secret, secret, len);
  pthread_mutex_unlock(&b->mu);
}

/* Copy the buffer's secret into out (WIRE_SECRET_SIZE bytes); its length
 * (0: none). */
size_t buffer_secret(gpumem_buffer *b, uint8_t *out) {
  pthread_mutex_lock(&b->mu);
  size_t n = b->secret_len;
  memcpy(out, b->secret, n);
  pthread_mutex_unlock(&b->mu);
  return n;
}

/* The buffer's id at the daemon (renumbered by a reconnection). */
uint64_t gpumem_buffer_id(const gpumem_buffer *b) { return buffer_now(b).id; }

/* 1 if memory is mapped behind the pointer now. */
int gpumem_buffer_mapped(const gpumem_buffer *b) { return buffer_now(b).mapped; }

/* 1 if the daemon knows the buffer now. */
int gpumem_buffer_registered(const gpumem_buffer *b) { return buffer_now(b).known; }
