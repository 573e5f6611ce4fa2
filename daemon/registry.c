#include "registry.h"

#include <errno.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "common/frame.h"
#include <xxhash.h>
#include "common/idmap.h"
#include "common/log.h"
#include "common/size.h"
#include "backup_disk.h"
#include "backup_verify.h"
#include "fdbudget.h"
#include "fdstore.h"
#include "journal.h"
#include "pageable.h"

struct registry {
  gpudev *gpu;
  struct registry_options opt;
  uint64_t next_id;
  uint64_t generation_round; /* registry_new_generation's calls */
  idmap *buffers;
  struct list all;  /* struct buffer.all_link, in id order */
  struct list persistent; /* struct buffer.persist_link: the named ones */
  struct list tags; /* in creation order */
  idmap *tag_hash;  /* name hash | 1 -> first tag of that bucket */
  idmap *tag_seqs;  /* seq -> tag */
  uint64_t next_tag_seq;
  tenants *tenants;
  uint64_t chunks; /* chunk handles held (descriptors, on the host backend) */
  uint64_t managed[GPUMEM_MAX_DEVICES];
  unsigned backup_buffers[GPUMEM_MAX_DEVICES]; /* BACKUP buffers per device */
  bool held[GPUMEM_MAX_DEVICES]; /* a context held for them (registry_let_go) */
  uint64_t backup_bytes;    /* valid backups */
  uint64_t backup_reserved; /* sizes of all BACKUP buffers */
  uint64_t backup_ready;    /* host memory made for them */
  uint64_t disk_bytes;      /* backups in files (BACKUP_DISK) */
  uint64_t copied[2], copy_us[2]; /* [to_host]: backup copy totals */
  uint64_t last_bytes[2], last_us[2]; /* [to_host]: the last operation's */
  bool destroying; /* tags go all at once, not one by one */
  journal *journal; /* told of every change of tags and buffers; NULL: none */
  fdstore *store;   /* keeps the memory of persistent buffers no session holds; NULL: none */
};

/* Create an empty registry over a backend. */
registry *registry_create(gpudev *g, const struct registry_options *opt) {
  registry *r = calloc(1, sizeof *r);
  if (!r) return NULL;
  r->gpu = g;
  r->opt = *opt;
  r->next_id = 1;
  list_init(&r->tags);
  list_init(&r->all);
  list_init(&r->persistent);
  r->buffers = idmap_create();
  r->tag_hash = idmap_create();
  r->tag_seqs = idmap_create();
  r->tenants = tenants_create(&opt->quotas);
  if (!r->buffers || !r->tag_hash || !r->tag_seqs || !r->tenants) {
    idmap_destroy(r->buffers);
    idmap_destroy(r->tag_hash);
    idmap_destroy(r->tag_seqs);
    tenants_destroy(r->tenants);
    free(r);
    return NULL;
  }
  return r;
}

/* Free every buffer, every tag and the registry. */
void registry_destroy(registry *r) {
  if (!r) return;
  r->destroying = true;
  struct list *p, *t, *q, *u;
  list_for_each_safe(p, t, &r->tags) {
    struct tag *tag = list_entry(p, struct tag, link);
    list_for_each_safe(q, u, &tag->buffers)
        registry_free(r, list_entry(q, struct buffer, tag_link));
    free(tag);
  }
  idmap_destroy(r->buffers);
  idmap_destroy(r->tag_hash);
  idmap_destroy(r->tag_seqs);
  tenants_destroy(r->tenants);
  free(r);
}

/* A tag name's key in the hash (never 0). */
static uint64_t tag_key(const char *name) { return XXH3_64bits(name, strlen(name)) | 1; }

/* The tag with this name, or NULL. */
struct tag *registry_tag(registry *r, const char *name) {
  for (struct tag *t = idmap_get(r->tag_hash, tag_key(name)); t; t = t->hash_next)
    if (strcmp(t->name, name) == 0) return t;
  return NULL;
}

/* A tag's journal record as it is now. */
static struct journal_tag tag_record(const struct tag *t) {
  struct journal_tag j = {.uid = t->uid, .owned = t->owned, .shared = t->shared,
                          .paused_devices = t->paused_devices, .generation = t->generation};
  memcpy(j.name, t->name, sizeof j.name);
  return j;
}

/* Tell the journal how a tag is now. */
static void tag_changed(registry *r, const struct tag *t) {
  if (!r->journal) return;
  struct journal_tag j = tag_record(t);
  journal_put_tag(r->journal, &j, false);
}

/* A buffer's journal record as it is now. */
struct journal_buffer registry_buffer_record(const struct buffer *b) {
  struct journal_buffer j = {.id = b->id, .uid = b->uid, .device = b->device, .size = b->size,
                             .flags = b->flags, .state = b->state};
  memcpy(j.tag, b->tag->name, sizeof j.tag);
  memcpy(j.secret, b->secret, sizeof j.secret);
  memcpy(j.name, b->name, sizeof j.name);
  j.kept = b->owner && b->owner->keeper;
  return j;
}

/* Tell the journal how a buffer is now. */
static void buffer_changed(registry *r, const struct buffer *b) {
  if (!r->journal) return;
  struct journal_buffer j = registry_buffer_record(b);
  journal_put_buffer(r->journal, &j);
}

/* A new tag with this name, at the end of the list; NULL when out of
 * memory. */
static struct tag *tag_new(registry *r, const char *name) {
  struct tag *tag = calloc(1, sizeof *tag);
  if (!tag) return NULL;
  strncpy(tag->name, name, WIRE_TAG_MAX);
  uint64_t key = tag_key(name);
  tag->hash_next = idmap_get(r->tag_hash, key);
  if (idmap_put(r->tag_hash, key, tag) < 0) {
    free(tag);
    return NULL;
  }
  tag->seq = ++r->next_tag_seq;
  if (idmap_put(r->tag_seqs, tag->seq, tag) < 0) {
    if (tag->hash_next)
      idmap_put(r->tag_hash, key, tag->hash_next);
    else
      idmap_del(r->tag_hash, key);
    free(tag);
    return NULL;
  }
  list_init(&tag->buffers);
  list_append(&r->tags, &tag->link);
  return tag;
}

/* Take a tag out of the hash and the list, and free it. */
static void tag_delete(registry *r, struct tag *tag) {
  uint64_t key = tag_key(tag->name);
  struct tag *head = idmap_get(r->tag_hash, key);
  if (head == tag) {
    if (tag->hash_next)
      idmap_put(r->tag_hash, key, tag->hash_next); /* replaces: cannot fail */
    else
      idmap_del(r->tag_hash, key);
  } else {
    for (struct tag *t = head; t; t = t->hash_next)
      if (t->hash_next == tag) {
        t->hash_next = tag->hash_next;
        break;
      }
  }
  idmap_del(r->tag_seqs, tag->seq);
  list_remove(&tag->link);
  if (r->journal) {
    struct journal_tag j = tag_record(tag);
    journal_put_tag(r->journal, &j, true);
  }
  free(tag);
}

/* The first tag made after seq: found at once when that tag still
 * exists, else by walking the list. */
struct tag *registry_tag_after(registry *r, uint64_t seq) {
  struct tag *t = seq ? idmap_get(r->tag_seqs, seq) : NULL;
  for (struct list *p = t ? t->link.next : r->tags.next; p != &r->tags; p = p->next) {
    struct tag *x = list_entry(p, struct tag, link);
    if (x->seq > seq) return x;
  }
  return NULL;
}

/* Number of tags. */
size_t registry_tag_count(const registry *r) { return idmap_count(r->tag_seqs); }

/* Whether uid may see the tag. */
bool registry_tag_visible(const struct tag *t, uint32_t uid) {
  return t->shared || (t->owned && t->uid == uid);
}

/* Whether the configuration shares every tag of this name. */
static bool shared_by_config(const registry *r, const char *name) {
  for (size_t i = 0; i < r->opt.nshared_names; i++)
    if (strcmp(r->opt.shared_names[i], name) == 0) return true;
  return false;
}

/* The tag a buffer of uid joins: found or created (shared when the
 * configuration says so), unless another uid owns it and it is not
 * shared. */
static wire_code join_tag(registry *r, const char *name, uint32_t uid, struct tag **out,
                          struct fault *f) {
  struct tag *tag = registry_tag(r, name);
  if (!tag) {
    if (!(tag = tag_new(r, name)))
      return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    tag->shared = shared_by_config(r, name);
    tag->owned = !tag->shared;
    tag->uid = tag->owned ? uid : 0;
    tag_changed(r, tag);
  } else if (!tag->shared && tag->owned && tag->uid != uid) {
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                     "tag '%s' belongs to uid %u: use another tag, or have a controller "
                     "share it (gpumemctl share %s)",
                     name, tag->uid, name);
  }
  *out = tag; /* an unowned one is claimed by the buffer that joins it (attach) */
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Share a tag with every uid, or make it its owner's alone again. */
wire_code registry_share(registry *r, const char *name, bool shared, struct tag **out,
                         struct fault *f) {
  struct tag *tag = registry_tag(r, name);
  *out = NULL;
  if (shared) {
    if (!tag && !(tag = tag_new(r, name)))
      return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    tag->shared = true;
    tag_changed(r, tag);
    *out = tag;
    return GPUMEM__WIRE__ERROR_CODE__OK;
  }
  if (!tag) return fault_set(f, GPUMEM__WIRE__ERROR_CODE__NOT_FOUND, "no tag '%s'", name);
  if (shared_by_config(r, name))
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT,
                     "tag '%s' is shared by gpumemd's configuration (--shared-tag, or "
                     "\"default\", the tag of allocations that name none)",
                     name);
  if (!tag->owned && !list_empty(&tag->buffers)) {
    /* Shared before any buffer joined, it has no owner: it goes to the
     * uid whose buffers are in it, when there is one. */
    uint32_t uid = list_entry(tag->buffers.next, struct buffer, tag_link)->uid;
    for (struct list *p = tag->buffers.next; p != &tag->buffers; p = p->next)
      if (list_entry(p, struct buffer, tag_link)->uid != uid)
        return fault_set(f, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
                         "tag '%s' has no owner and holds buffers of several uids: it stays "
                         "shared until only one uid's are left",
                         name);
    tag->owned = true;
    tag->uid = uid;
  }
  tag->shared = false;
  tag_changed(r, tag);
  if (list_empty(&tag->buffers) && !tag->paused_devices && !tag->expected) {
    registry_prune(r, tag);
    return GPUMEM__WIRE__ERROR_CODE__OK;
  }
  *out = tag;
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* The list of tags. */
struct list *registry_tags(registry *r) { return &r->tags; }

/* The list of buffers, in id order. */
struct list *registry_buffers(registry *r) { return &r->all; }

/* The first buffer whose id is above after: found at once when the buffer
 * after still exists, else by walking the list. */
struct buffer *registry_buffer_after(registry *r, uint64_t after) {
  struct buffer *b = after ? idmap_get(r->buffers, after) : NULL;
  struct list *p = b ? b->all_link.next : r->all.next;
  for (; p != &r->all; p = p->next) {
    struct buffer *x = list_entry(p, struct buffer, all_link);
    if (x->id > after) return x;
  }
  return NULL;
}

/* What each uid holds, and the quotas. */
tenants *registry_tenants(registry *r) { return r->tenants; }

/* Chunks the backend's descriptors may be, all together: where each is
 * one of the daemon's descriptors, three quarters of its limit, the rest
 * left to connections and the daemon's own (0: no such limit). */
static uint64_t chunk_budget(const registry *r) {
  if (!gpudev_fd_per_chunk(r->gpu)) return 0;
  uint64_t limit = fdbudget_limit();
  return limit == UINT64_MAX ? 0 : limit / 4 * 3;
}

/* Count n more chunks held for uid, if they fit the chunk budget and
 * uid's half of it; else LIMIT_EXCEEDED and nothing counted. */
static wire_code take_chunks(registry *r, uint32_t uid, uint64_t n, struct fault *f) {
  uint64_t budget = chunk_budget(r);
  if (budget && r->chunks + n > budget)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED,
                     "the daemon holds %llu chunks, each one of its descriptors on this backend: "
                     "%llu more would pass %llu, three quarters of its descriptor limit (the "
                     "rest is kept for connections)",
                     (unsigned long long)r->chunks, (unsigned long long)n,
                     (unsigned long long)budget);
  wire_code rc = tenants_take_chunks(r->tenants, uid, n, budget / 2, f);
  if (rc == GPUMEM__WIRE__ERROR_CODE__OK) r->chunks += n;
  return rc;
}

/* Give back what take_chunks counted. */
static void give_chunks(registry *r, uint32_t uid, uint64_t n) {
  r->chunks -= n;
  tenants_give_chunks(r->tenants, uid, n);
}

/* Have the fd store let go of a buffer's chunks. */
static void unstore(registry *r, struct buffer *b) {
  fdstore_remove(r->store, b->stored_as, b->chunk_sizes, b->nchunks);
  b->stored_as = 0;
}

/* Keep a buffer's chunks in the fd store exactly while it is persistent,
 * no session holds it, and it has memory. */
static void store_sync(registry *r, struct buffer *b) {
  bool want = fdstore_enabled(r->store) && b->owner && b->owner->keeper && b->has_memory &&
              !b->ipc && b->nchunks;
  if (!want) {
    if (b->stored_as) unstore(r, b);
    return;
  }
  if (b->stored_as) return;
  int *fds = malloc(b->nchunks * sizeof *fds);
  struct fault f = {0};
  if (!fds || registry_export(r, b, fds, &f)) {
    log_warn("buffer %llu: not kept in systemd's fd store: %s", (unsigned long long)b->id,
             fds ? f.text : "out of host memory");
    free(fds);
    return;
  }
  if (fdstore_put(r->store, b->id, fds, b->chunk_sizes, b->nchunks) == 0) b->stored_as = b->id;
  for (size_t i = 0; i < b->nchunks; i++) close(fds[i]);
  free(fds);
}

/* Keep persistent buffers' chunks in s. */
void registry_set_fdstore(registry *r, fdstore *s) { r->store = s; }

/* A buffer taken back from the fd store is in it still. */
void registry_stored_as(registry *r, struct buffer *b, uint64_t id) {
  (void)r;
  b->stored_as = id;
}

/* Create every chunk or none (none past the chunk budget). */
wire_code registry_memory_create(registry *r, struct buffer *b, struct fault *f) {
  uint64_t n = b->ipc ? 1 : b->nchunks;
  wire_code room = take_chunks(r, b->uid, n, f);
  if (room) return room;
  for (size_t i = 0; i < b->nchunks; i++) {
    int rc = b->ipc ? gpudev_ipc_alloc(r->gpu, b->device, b->size, &b->handles[0], b->ipc_handle)
                    : gpudev_chunk_create(r->gpu, b->device, b->chunk_sizes[i], &b->handles[i]);
    if (rc < 0) {
      char said[200];
      snprintf(said, sizeof said, "%s", gpu_error());
      while (i-- > 0)
        gpudev_chunk_release(r->gpu, b->device, b->handles[i], b->chunk_sizes[i]);
      give_chunks(r, b->uid, n);
      uint64_t free_b = 0, total = 0;
      gpudev_mem_info(r->gpu, b->device, &free_b, &total);
      f->bytes_needed = b->size;
      f->bytes_free = free_b;
      if (rc == -ENOMEM)
        return fault_set(f, GPUMEM__WIRE__ERROR_CODE__OUT_OF_MEMORY,
                         "device %u: %llu bytes needed, %llu free (%s)", b->device,
                         (unsigned long long)b->size, (unsigned long long)free_b, said);
      return fault_set(f, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR, "device %u: %s", b->device,
                       said);
    }
  }
  /* Whose memory this is outlives the daemon where the backend keeps it;
   * where it cannot (not root, or a VMM driver) nothing is recorded. */
  for (size_t i = 0; i < b->nchunks && !b->ipc; i++)
    gpudev_chunk_set_owner(r->gpu, b->handles[i], b->uid);
  b->has_memory = true;
  r->managed[b->device] += b->size;
  store_sync(r, b); /* a persistent buffer no session holds, resumed */
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Release a buffer's physical memory. */
void registry_memory_release(registry *r, struct buffer *b) {
  if (!b->has_memory) return;
  if (b->stored_as && !r->destroying) unstore(r, b); /* systemd's copies first */
  if (b->ipc)
    gpudev_ipc_free(r->gpu, b->device, b->handles[0], b->size);
  else
    for (size_t i = 0; i < b->nchunks; i++)
      gpudev_chunk_release(r->gpu, b->device, b->handles[i], b->chunk_sizes[i]);
  b->has_memory = false;
  r->managed[b->device] -= b->size;
  give_chunks(r, b->uid, b->ipc ? 1 : b->nchunks);
}

static uint64_t now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static void count_copy(registry *r, bool to_host, uint64_t size, uint64_t us);

/* Copy all chunks of a buffer one way, counting bytes and time. */
static int copy(registry *r, struct buffer *b, void *host, bool to_host) {
  if (!r->held[b->device]) r->held[b->device] = gpudev_hold(r->gpu, b->device) == 0;
  uint64_t t0 = now_us(); /* the copy's time: making a context is not in it */
  int rc = gpudev_chunks_copy(r->gpu, b->device, b->handles, b->chunk_sizes, b->nchunks, host,
                              to_host);
  if (rc == 0) count_copy(r, to_host, b->size, now_us() - t0);
  return rc;
}

/* Let go of every context held for backups (the next copy takes one),
 * and of the device's reach into the backups of paused buffers that no
 * session holds (that reach is the daemon's own device memory, which a
 * pause of them must give back); host_only: of every paused buffer's. */
void registry_let_go(registry *r, bool host_only) {
  struct list *l = host_only ? &r->all : &r->persistent;
  for (struct list *p = l->next; p != l; p = p->next) {
    struct buffer *b = host_only ? list_entry(p, struct buffer, all_link)
                                 : list_entry(p, struct buffer, persist_link);
    if (!host_only && !b->owner->keeper) continue;
    if (b->backup && !b->pageable && b->state == BUF_PAUSED)
      gpudev_backup_host_only(r->gpu, b->device, b->backup);
  }
  for (unsigned d = 0; d < GPUMEM_MAX_DEVICES; d++)
    if (r->held[d]) gpudev_unhold(r->gpu, d);
  memset(r->held, 0, sizeof r->held);
}

/* Give a buffer the host memory for its backup: the thread pool's, taken
 * (waited for) if it is being made, else made now. */
static wire_code get_backup_memory(registry *r, struct buffer *b, struct fault *f) {
  if (b->backup) return GPUMEM__WIRE__ERROR_CODE__OK;
  char why[256] = "";
  int rc;
  if (b->making) {
    rc = hostmem_take(b->making, &b->backup, why, sizeof why);
    b->making = NULL;
  } else if (b->pageable) {
    rc = pageable_make(b->size, &b->backup, why, sizeof why);
  } else {
    rc = hostmem_make(r->gpu, b->device, b->size, &b->backup, why, sizeof why);
  }
  if (rc < 0) {
    b->backup = NULL;
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__OUT_OF_MEMORY,
                     "no host memory for the backup of buffer %llu (%s memory): %s",
                     (unsigned long long)b->id, b->pageable ? "pageable" : "pinned", why);
  }
  if (!b->pageable) r->backup_ready += b->size;
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Copy a buffer's contents to its backup, kept once made. */
wire_code registry_backup(registry *r, struct buffer *b, struct fault *f) {
  wire_code code = get_backup_memory(r, b, f);
  if (code) return code;
  if (copy(r, b, b->backup, true) < 0)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR, "backup of buffer %llu: %s",
                     (unsigned long long)b->id, gpu_error());
  if (r->opt.verify_backups) b->backup_hash = XXH3_64bits(b->backup, b->size);
  b->backup_valid = true;
  r->backup_bytes += b->size;
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Whether b's owner copies it itself now (registry.h). */
bool registry_owner_copies(const registry *r, const struct buffer *b, bool resume) {
  if (!b->owner->copies_backups || !(b->flags & BUF_FLAG_BACKUP) || b->ipc) return false;
  return resume ? b->backup_valid && !r->opt.verify_backups : !b->backup_valid;
}

/* Export b's backup pieces for its owner, making the memory first. */
bool registry_hand_backup(registry *r, struct buffer *b, int *fds, uint64_t *sizes, size_t max,
                          size_t *n, bool *kept) {
  struct fault f = {0};
  *n = 0;
  *kept = b->owner->keeps_backups && b->handed_to == b->owner->id && b->backup;
  if (*kept) return true;
  if (b->pageable) return false; /* the daemon's own memory: it copies */
  if (get_backup_memory(r, b, &f)) {
    log_warn("buffer %llu: %s; the daemon copies it", (unsigned long long)b->id, f.text);
    return false;
  }
  if (gpudev_backup_export(r->gpu, b->device, b->backup, b->size, fds, sizes, max, n) == 0)
    return true; /* kept by the owner once its ack says it copied */
  log_debug("buffer %llu: its backup is not handed to its owner (%s): the daemon copies it",
            (unsigned long long)b->id, gpu_error());
  return false;
}

/* Whether b is a paused BACKUP buffer whose backup holds its contents,
 * in host memory or in its file: OK, or WRONG_STATE saying why not. */
static wire_code backup_readable(const struct buffer *b, struct fault *f) {
  unsigned long long id = (unsigned long long)b->id;
  if (!(b->flags & BUF_FLAG_BACKUP))
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
                     "buffer %llu has no backup (allocated without BACKUP)", id);
  if (b->state != BUF_PAUSED)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
                     "buffer %llu is %s: only a paused buffer's backup holds its contents", id,
                     wire_state_name((int)b->state));
  if (b->spilling)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
                     "the backup of buffer %llu is being written to the daemon's --backup-dir: "
                     "its pause has not ended", id);
  if (!b->backup_valid || (!b->backup && b->disk_fd < 0))
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
                     "buffer %llu is PAUSED with no backup of its contents (it was never "
                     "mapped, or its backup failed)", id);
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Export a paused buffer's valid backup for its owner to read. */
wire_code registry_backup_for_reading(registry *r, struct buffer *b, int *fds, uint64_t *sizes,
                                      size_t max, size_t *n, enum backup_form *form,
                                      struct fault *f) {
  unsigned long long id = (unsigned long long)b->id;
  bool newer = b->owner->minor >= 10; /* takes files, and sends memory */
  *n = 0;
  *form = BACKUP_FORM_MEMORY;
  wire_code rc = backup_readable(b, f);
  if (rc) return rc;
  if (!b->backup) { /* in its file */
    if (!newer)
      return fault_set(f, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
                       "the backup of buffer %llu is in a file of the daemon's --backup-dir, "
                       "which only libgpumem 1.10 or later reads: resume the buffer and read it",
                       id);
    char why[300];
    int fd = backup_disk_reader(b->disk_fd, why, sizeof why);
    if (fd < 0)
      return fault_set(f, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR, "buffer %llu: %s", id, why);
    fds[0] = fd;
    sizes[0] = b->size;
    *n = 1;
    *form = BACKUP_FORM_FILES;
    return GPUMEM__WIRE__ERROR_CODE__OK;
  }
  if (b->pageable) {
    if (!newer)
      return fault_set(f, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
                       "the backup of buffer %llu is the daemon's pageable memory, which only "
                       "libgpumem 1.10 or later reads: resume the buffer and read it", id);
    *form = BACKUP_FORM_SEND_MEMORY;
    return GPUMEM__WIRE__ERROR_CODE__OK;
  }
  if (gpudev_backup_export(r->gpu, b->device, b->backup, b->size, fds, sizes, max, n) < 0)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
                     "the backup of buffer %llu cannot be handed out here (%s): resume the "
                     "buffer and read it", id, gpu_error());
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Copy a paused pageable backup into its owner's memfd. */
wire_code registry_backup_copy_into(registry *r, struct buffer *b, int fd, struct fault *f) {
  (void)r;
  wire_code rc = backup_readable(b, f);
  if (rc) return rc;
  if (!b->backup || !b->pageable)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
                     "the backup of buffer %llu is not the daemon's pageable memory: ask for "
                     "it without memory", (unsigned long long)b->id);
  char why[300];
  if (pageable_copy_into(fd, b->backup, b->size, why, sizeof why) < 0)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT, "buffer %llu: %s",
                     (unsigned long long)b->id, why);
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Hand the backup memory anew next time. */
void registry_backup_unhanded(struct buffer *b) { b->handed_to = 0; }

/* Count one copy of size bytes, one way, that took us. */
static void count_copy(registry *r, bool to_host, uint64_t size, uint64_t us) {
  r->copied[to_host] += size;
  r->copy_us[to_host] += us;
}

/* The owner copied through the memory handed to it: it keeps that memory
 * now if it said it would. */
static void handed(struct buffer *b) {
  /* Not a backup going to disk: the owner lets go of it (a mapping would
   * keep the memory the disk tier frees). */
  bool keeps = b->owner->keeps_backups && !(b->flags & BUF_FLAG_BACKUP_DISK);
  b->handed_to = keeps ? b->owner->id : 0;
}

/* The owner filled b's backup. */
void registry_backup_copied(registry *r, struct buffer *b, uint64_t us) {
  handed(b);
  if (r->opt.verify_backups) b->backup_hash = XXH3_64bits(b->backup, b->size);
  b->backup_valid = true;
  r->backup_bytes += b->size;
  count_copy(r, true, b->size, us);
}

/* The owner restored b from its backup. */
void registry_restore_copied(registry *r, struct buffer *b, uint64_t us) {
  handed(b);
  count_copy(r, false, b->size, us);
}

/* The thread pool made a buffer's backup memory (or could not: a pause
 * then tries once more). */
static void backup_made(void *ctx, void *arg, void *host, const char *why) {
  registry *r = ctx;
  struct buffer *b = arg;
  b->making = NULL;
  if (!host) {
    log_warn("buffer %llu: no host memory for its backup yet (%s); a pause will try again",
             (unsigned long long)b->id, why);
    return;
  }
  b->backup = host;
  r->backup_ready += b->size;
}

/* Have the thread pool make a new BACKUP buffer's host memory, so that
 * its first pause finds it made (not one whose pauses make it). */
static void start_backup_memory(registry *r, struct buffer *b) {
  if (!(b->flags & BUF_FLAG_BACKUP) || (b->flags & BUF_FLAG_BACKUP_RELEASE) || b->pageable ||
      b->ipc || !r->opt.loop)
    return;
  char why[256] = "";
  b->making = hostmem_start(r->opt.loop, r->gpu, b->device, b->size, backup_made, r, b, why,
                            sizeof why);
  if (!b->making)
    log_warn("buffer %llu: cannot queue its backup memory (%s); its first pause makes it",
             (unsigned long long)b->id, why);
}

/* Free backup memory of size bytes, pinned for dev or pageable. */
static void free_host(registry *r, unsigned dev, void *host, uint64_t size, bool pageable) {
  if (pageable) pageable_free(host, size);
  else hostmem_free(r->gpu, dev, host, size);
}

/* Free a buffer's backup memory (unless a disk write holds it: it frees
 * it), or give up the job making it; close its file. */
static void drop_backup(registry *r, struct buffer *b) {
  if (b->making) hostmem_drop(b->making);
  b->making = NULL;
  if (b->backup_valid && b->backup) r->backup_bytes -= b->size;
  b->backup_valid = false;
  if (b->backup && !b->pageable) r->backup_ready -= b->size;
  if (b->backup && !b->spilling) free_host(r, b->device, b->backup, b->size, b->pageable);
  b->backup = NULL;
  b->spilling = false;
  if (b->disk_fd >= 0) {
    close(b->disk_fd);
    r->disk_bytes -= b->size;
  }
  b->disk_fd = -1;
}

static wire_code reserve_now(registry *r, struct buffer *b, struct fault *f);
static void unreserve_backup(registry *r, struct buffer *b);

/* Reserve the backup room of a BACKUP_RELEASE buffer for a pause. */
wire_code registry_backup_reserve(registry *r, struct buffer *b, struct fault *f) {
  return reserve_now(r, b, f);
}

/* Give back the room a pause reserved for a BACKUP_RELEASE buffer that
 * it never took from ACTIVE. */
void registry_backup_unreserve(registry *r, struct buffer *b) {
  if (!(b->flags & BUF_FLAG_BACKUP_RELEASE) || b->backup) return;
  unreserve_backup(r, b);
  b->pageable = false;
}

/* A BACKUP_RELEASE buffer is ACTIVE again: let go of its backup. */
void registry_backup_let_go(registry *r, struct buffer *b) {
  if (!(b->flags & BUF_FLAG_BACKUP_RELEASE)) return;
  /* Its file emptied first: an owner that read the backup from it and
   * kept the file open past the remap keeps no disk space. No read of it
   * runs now: the resume that made b ACTIVE read it already. */
  if (b->disk_fd >= 0 && ftruncate(b->disk_fd, 0) < 0)
    log_debug("buffer %llu: emptying its backup file: %s", (unsigned long long)b->id,
              strerror(errno));
  drop_backup(r, b);
  b->handed_to = 0; /* its owner let go of its mapping too */
  unreserve_backup(r, b);
  b->pageable = false; /* the next pause chooses again (unless the buffer asked) */
}

/* Hand a pause's disk writer b's backup memory (registry.h). */
void *registry_disk_take(registry *r, struct buffer *b) {
  (void)r;
  b->spilling = true;
  return b->backup;
}

/* A disk write of a backup ended (registry.h). */
bool registry_disk_written(registry *r, uint64_t id, void *host, uint64_t size, unsigned dev,
                           bool pageable, int fd) {
  struct buffer *b = registry_find(r, id);
  if (!b || !b->spilling || b->backup != host) { /* freed meanwhile: its memory is ours */
    free_host(r, dev, host, size, pageable);
    if (fd >= 0) close(fd);
    return false;
  }
  b->spilling = false;
  if (fd < 0) return false;
  b->disk_fd = fd;
  r->disk_bytes += b->size;
  registry_disk_unload(r, b); /* valid still, in the file alone now */
  return true;
}

/* A resume read a backup back from its file (registry.h). */
bool registry_disk_loaded(registry *r, uint64_t id, void *host, uint64_t size, unsigned dev,
                          bool pageable) {
  struct buffer *b = registry_find(r, id);
  if (!b || !registry_on_disk(b)) { /* freed, or moved on, meanwhile */
    free_host(r, dev, host, size, pageable);
    if (b) registry_backup_unreserve(r, b);
    return false;
  }
  b->backup = host;
  if (!b->pageable) r->backup_ready += b->size;
  r->backup_bytes += b->size;
  return true;
}

/* A failed resume's read-back backup goes back to its file alone. */
void registry_disk_unload(registry *r, struct buffer *b) {
  if (!b->backup_valid || b->disk_fd < 0 || !b->backup || b->spilling) return;
  r->backup_bytes -= b->size;
  if (!b->pageable) r->backup_ready -= b->size;
  free_host(r, b->device, b->backup, b->size, b->pageable);
  b->backup = NULL;
  b->handed_to = 0;
  unreserve_backup(r, b);
  b->pageable = false; /* the resume chooses again (unless the buffer asked) */
}

/* Whether b's backup is only in its file. */
bool registry_on_disk(const struct buffer *b) {
  return b->backup_valid && b->disk_fd >= 0 && !b->backup && !b->spilling;
}

/* Bytes of backups held in files. */
uint64_t registry_disk_bytes(const registry *r) { return r->disk_bytes; }

/* Copy a buffer's backup into its memory, checking it when asked. */
wire_code registry_restore(registry *r, struct buffer *b, struct fault *f) {
  if (!b->backup_valid) return GPUMEM__WIRE__ERROR_CODE__OK;
  unsigned long long id = (unsigned long long)b->id;
  if (r->opt.verify_backups && XXH3_64bits(b->backup, b->size) != b->backup_hash)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
                     "backup of buffer %llu changed while paused", id);
  if (copy(r, b, b->backup, false) < 0)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR, "restore of buffer %llu: %s",
                     id, gpu_error());
  return r->opt.verify_backups ? backup_verify(r->gpu, b, f) : GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Bytes and microseconds of backup copies so far, one way. */
void registry_copy_totals(const registry *r, bool to_host, uint64_t *bytes, uint64_t *us) {
  *bytes = r->copied[to_host];
  *us = r->copy_us[to_host];
}

/* Remember the copy figures of the last operation that copied. */
void registry_note_last(registry *r, bool to_host, uint64_t bytes, uint64_t us) {
  r->last_bytes[to_host] = bytes;
  r->last_us[to_host] = us;
}

/* The copy figures of the last operation that copied. */
void registry_last(const registry *r, bool to_host, uint64_t *bytes, uint64_t *us) {
  *bytes = r->last_bytes[to_host];
  *us = r->last_us[to_host];
}

/* Host memory reserved by BACKUP buffers, and the limit. */
void registry_backup_budget(const registry *r, uint64_t *reserved, uint64_t *limit) {
  *reserved = r->backup_reserved;
  *limit = r->opt.backup_limit;
}

/* Host memory already made for BACKUP buffers. */
uint64_t registry_backup_ready(const registry *r) { return r->backup_ready; }

/* Check the request against the backend, round it, and cut it into chunks. */
static wire_code plan_chunks(registry *r, struct buffer *b, uint64_t size,
                             struct fault *f) {
  unsigned ndev = gpudev_device_count(r->gpu);
  if (b->device >= ndev)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT,
                     "device %u out of range (%u devices)", b->device, ndev);
  uint64_t free_b = 0, total = 0;
  gpudev_mem_info(r->gpu, b->device, &free_b, &total);
  uint64_t rounded = size_round_up(size, gpudev_granularity(r->gpu));
  if (rounded == 0 || rounded > total)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT,
                     "size %llu is larger than device %u (%llu bytes)",
                     (unsigned long long)size, b->device,
                     (unsigned long long)total);
  /* Legacy IPC memory is one plain allocation; on the host backend it is
   * shared memory like any other and simply never pauses. */
  b->ipc = (b->flags & BUF_FLAG_IPC_LEGACY) && gpudev_has_ipc(r->gpu);
  uint64_t n = b->ipc ? 1 : (rounded + r->opt.chunk_size - 1) / r->opt.chunk_size;
  if (n > FRAME_MAX_FDS)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT,
                     "size %llu needs %llu chunks, at most %d: raise --chunk-size",
                     (unsigned long long)size, (unsigned long long)n, FRAME_MAX_FDS);
  b->size = rounded;
  b->nchunks = (size_t)n;
  b->chunk_sizes = calloc(n, sizeof *b->chunk_sizes);
  b->handles = calloc(n, sizeof *b->handles);
  if (!b->chunk_sizes || !b->handles)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  uint64_t cs = r->opt.chunk_size;
  for (uint64_t i = 0, left = rounded; i < n; i++, left -= cs)
    b->chunk_sizes[i] = left < cs || b->ipc ? left : cs;
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

static void buffer_destroy(struct buffer *b) {
  free(b->chunk_sizes);
  free(b->handles);
  free(b);
}

/* Reserve backup room for a BACKUP buffer now (the context its copies
 * need is taken by the first copy and let go of at the operation's end). */
static wire_code reserve_now(registry *r, struct buffer *b, struct fault *f) {
  if (!(b->flags & BUF_FLAG_BACKUP) || b->reserved || b->pageable)
    return GPUMEM__WIRE__ERROR_CODE__OK;
  /* Pageable memory is outside the pinned budget: the kernel bounds it. */
  bool fits = b->size <= r->opt.backup_limit - r->backup_reserved;
  if ((b->flags & BUF_FLAG_BACKUP_PAGEABLE) || (!fits && r->opt.overflow_pageable)) {
    b->pageable = true;
    return GPUMEM__WIRE__ERROR_CODE__OK;
  }
  if (!fits)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__LIMIT_EXCEEDED,
                     "backup limit: %llu bytes of backups reserved, %llu more would pass "
                     "--backup-limit %llu",
                     (unsigned long long)r->backup_reserved, (unsigned long long)b->size,
                     (unsigned long long)r->opt.backup_limit);
  /* Where the backend's memory is descriptors, the backup is one too. */
  wire_code rc = gpudev_fd_per_chunk(r->gpu) ? take_chunks(r, b->uid, 1, f)
                                             : GPUMEM__WIRE__ERROR_CODE__OK;
  if (rc && r->opt.overflow_pageable) { /* pageable memory is no descriptor */
    *f = (struct fault){0};
    b->pageable = true;
    return GPUMEM__WIRE__ERROR_CODE__OK;
  }
  if (rc) return rc;
  r->backup_buffers[b->device]++;
  r->backup_reserved += b->size;
  b->reserved = true;
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Reserve a new buffer's backup room, unless its backup lets go after
 * each resume (BACKUP_RELEASE: its pauses reserve it). */
static wire_code reserve_backup(registry *r, struct buffer *b, struct fault *f) {
  if (b->flags & BUF_FLAG_BACKUP_RELEASE) return GPUMEM__WIRE__ERROR_CODE__OK;
  return reserve_now(r, b, f);
}

/* Give back what reserve_now took. */
static void unreserve_backup(registry *r, struct buffer *b) {
  if (!b->reserved) return;
  b->reserved = false;
  if (gpudev_fd_per_chunk(r->gpu)) give_chunks(r, b->uid, 1);
  r->backup_reserved -= b->size;
  if (--r->backup_buffers[b->device] == 0 && r->held[b->device]) {
    gpudev_unhold(r->gpu, b->device);
    r->held[b->device] = false;
  }
}

static void tally(struct buffer *b, int sign);

/* Count a new buffer against its uid's quotas. */
static wire_code charge(registry *r, struct buffer *b, struct fault *f) {
  return tenants_charge(r->tenants, b->uid, b->device, b->size, b->flags & BUF_FLAG_BACKUP, f);
}

/* Take back what charge counted. */
static void uncharge(registry *r, struct buffer *b) {
  tenants_credit(r->tenants, b->uid, b->device, b->size, b->flags & BUF_FLAG_BACKUP);
}

/* Link a new buffer to its owner, its tag and the registry's list in its
 * first state; a tag no uid owns (and not shared) becomes its uid's. */
static void attach(registry *r, struct buffer *b, struct owner *owner, struct tag *tag,
                   buffer_state st) {
  if (!tag->owned && !tag->shared) {
    tag->owned = true;
    tag->uid = b->uid;
    tag_changed(r, tag);
  }
  b->owner = owner;
  b->tag = tag;
  b->state = st;
  tally(b, +1);
  list_append(&tag->buffers, &b->tag_link);
  list_append(&owner->buffers, &b->owner_link);
  owner->nbuffers++;
  list_append(&r->all, &b->all_link);
  if (b->name[0]) list_append(&r->persistent, &b->persist_link);
  list_append(tenants_members(r->tenants, b->uid), &b->uid_link); /* charged: it exists */
}

/* Give a buffer that has its memory (or starts paused) an id and link it
 * in; out of host memory, let go of its memory, backup room and its
 * uid's count instead. */
static wire_code enter(registry *r, struct buffer *b, struct owner *owner, struct tag *tag,
                       buffer_state st, struct fault *f) {
  b->id = r->next_id++;
  if (idmap_put(r->buffers, b->id, b) < 0) {
    registry_memory_release(r, b);
    unreserve_backup(r, b);
    uncharge(r, b);
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  }
  attach(r, b, owner, tag, st);
  b->born_ns = registry_now_ns();
  if (b->name[0]) {
    b->last_pid = owner->pid;
    snprintf(b->last_name, sizeof b->last_name, "%s", owner->name);
  }
  buffer_changed(r, b);
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Refuse BACKUP_DISK where the daemon has no --backup-dir. */
static wire_code disk_ok(const registry *r, uint32_t flags, struct fault *f) {
  if (!(flags & BUF_FLAG_BACKUP_DISK) || r->opt.disk) return GPUMEM__WIRE__ERROR_CODE__OK;
  return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT,
                   "BACKUP_DISK: this gpumemd has no --backup-dir to keep backups in; start it "
                   "with one, or ask for a backup in host memory");
}

/* Give a buffer a secret of its own, from the kernel's random source. */
static wire_code new_secret(struct buffer *b, struct fault *f) {
  if (getrandom(b->secret, sizeof b->secret, 0) == (ssize_t)sizeof b->secret)
    return GPUMEM__WIRE__ERROR_CODE__OK;
  return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "no random bytes for its secret: %s",
                   strerror(errno));
}

/* The monotonic clock, in nanoseconds. */
uint64_t registry_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Name a new PERSIST buffer, refusing a name its uid has already. */
static wire_code take_name(registry *r, struct buffer *b, const char *name, struct fault *f) {
  if (!name || !name[0]) return GPUMEM__WIRE__ERROR_CODE__OK;
  const struct buffer *was = registry_persistent(r, b->uid, name);
  if (was)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__WRONG_STATE,
                     "uid %u has a persistent buffer '%s' already (buffer %llu): attach it, or "
                     "drop it first",
                     b->uid, name, (unsigned long long)was->id);
  snprintf(b->name, sizeof b->name, "%s", name);
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* The persistent buffer of uid named name: a walk of the named ones. */
struct buffer *registry_persistent(registry *r, uint32_t uid, const char *name) {
  for (struct list *p = r->persistent.next; p != &r->persistent; p = p->next) {
    struct buffer *b = list_entry(p, struct buffer, persist_link);
    if (b->uid == uid && strcmp(b->name, name) == 0) return b;
  }
  return NULL;
}

/* The named buffers. */
struct list *registry_persistent_list(registry *r) { return &r->persistent; }

/* The process that may map b: its owner's, or for a buffer the keeper
 * holds, its last holder's (which may map it still, having ended its
 * session alone). */
pid_t registry_holder_pid(const struct buffer *b) {
  return b->owner->keeper ? b->last_pid : b->owner->pid;
}

/* Move a persistent buffer to another owner, remembering its last holder. */
void registry_hand(registry *r, struct buffer *b, struct owner *to) {
  struct owner *from = b->owner;
  if (!from->keeper) {
    b->last_pid = from->pid;
    snprintf(b->last_name, sizeof b->last_name, "%s", from->name);
  }
  b->let_go_ns = to->keeper ? registry_now_ns() : 0;
  if (!to->keeper) {
    b->last_pid = to->pid;
    snprintf(b->last_name, sizeof b->last_name, "%s", to->name);
  }
  list_remove(&b->owner_link);
  from->nbuffers--;
  list_append(&to->buffers, &b->owner_link);
  to->nbuffers++;
  b->owner = to;
  b->handed_to = 0; /* backup memory handed before was the last holder's */
  buffer_changed(r, b);
  store_sync(r, b);
}

/* Allocate a buffer for owner. */
wire_code registry_alloc(registry *r, struct owner *owner, const char *tagname, unsigned device,
                         uint64_t size, uint32_t flags, struct buffer **out, struct fault *f) {
  return registry_alloc_named(r, owner, NULL, tagname, device, size, flags, out, f);
}

/* Allocate a buffer, named when persistent, for owner. */
wire_code registry_alloc_named(registry *r, struct owner *owner, const char *name,
                               const char *tagname, unsigned device, uint64_t size, uint32_t flags,
                               struct buffer **out, struct fault *f) {
  uint32_t uid = (uint32_t)owner->uid;
  struct buffer *b = calloc(1, sizeof *b);
  if (!b) return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
  b->device = device;
  b->flags = flags;
  b->uid = uid;
  b->disk_fd = -1;
  struct tag *tag = NULL;
  wire_code rc = disk_ok(r, flags, f);
  if (!rc) rc = take_name(r, b, name, f);
  if (!rc) rc = plan_chunks(r, b, size, f);
  if (rc) goto fail;
  if ((rc = join_tag(r, tagname, uid, &tag, f))) goto fail;
  bool paused = tag->paused_devices & (1ull << device);
  if (paused && !(flags & BUF_FLAG_ALLOW_PAUSED)) {
    rc = fault_set(f, GPUMEM__WIRE__ERROR_CODE__TAG_PAUSED,
                   "tag '%s' is paused on device %u", tagname, device);
    goto fail;
  }
  if ((rc = charge(r, b, f))) goto fail;
  if ((rc = reserve_backup(r, b, f))) {
    uncharge(r, b);
    goto fail;
  }
  if (!paused && (rc = registry_memory_create(r, b, f))) {
    unreserve_backup(r, b);
    uncharge(r, b);
    goto fail;
  }
  if ((rc = new_secret(b, f)) ||
      (rc = enter(r, b, owner, tag, paused ? BUF_PAUSED : BUF_ACTIVE, f)))
    goto fail;
  start_backup_memory(r, b);
  *out = b;
  return GPUMEM__WIRE__ERROR_CODE__OK;
fail:
  if (tag) registry_prune(r, tag);
  buffer_destroy(b);
  return rc;
}

/* True unless the backend records another uid than uid for a chunk. A
 * daemon that is not root cannot chown, so its chunks all carry its own
 * uid, which then says nothing. */
static bool owned_by(registry *r, uint64_t handle, uint32_t uid, uint32_t *holder) {
  if (gpudev_chunk_owner(r->gpu, handle, holder) < 0) return true;
  return *holder == uid || (geteuid() != 0 && *holder == (uint32_t)geteuid());
}

/* Re-register a buffer a worker kept across a daemon restart: its tag
 * and quotas first, then its chunks. */
wire_code registry_adopt(registry *r, struct owner *owner, const char *tagname, unsigned device,
                         uint64_t size, uint32_t flags, const char *name, bool paused,
                         const uint64_t *chunk_sizes, size_t nchunks, int *fds,
                         const uint8_t *secret, struct buffer **out, struct fault *f) {
  uint32_t uid = (uint32_t)owner->uid;
  size_t nfds = paused ? 0 : nchunks, took = 0;
  struct buffer *b = calloc(1, sizeof *b);
  struct tag *tag = NULL;
  wire_code rc = GPUMEM__WIRE__ERROR_CODE__OK;
  if (!b || !(b->chunk_sizes = calloc(nchunks + 1, sizeof *b->chunk_sizes)) ||
      !(b->handles = calloc(nchunks + 1, sizeof *b->handles))) {
    rc = fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "out of host memory");
    goto fail;
  }
  b->device = device;
  b->uid = uid;
  b->disk_fd = -1;
  b->flags = flags & ~(uint32_t)BUF_FLAG_ALLOW_PAUSED;
  b->size = size;
  b->nchunks = nchunks;
  memcpy(b->chunk_sizes, chunk_sizes, nchunks * sizeof *chunk_sizes);
  /* The tag's paused mark is a controller's: a worker's re-registered
   * paused buffer shows as paused (the tag's state says so) without it. */
  if ((rc = disk_ok(r, flags, f)) || (rc = take_name(r, b, name, f)) ||
      (rc = join_tag(r, tagname, uid, &tag, f)))
    goto fail;
  if ((rc = charge(r, b, f))) goto fail;
  if ((rc = reserve_backup(r, b, f))) {
    uncharge(r, b);
    goto fail;
  }
  if ((rc = take_chunks(r, uid, nfds, f))) {
    unreserve_backup(r, b);
    uncharge(r, b);
    goto fail;
  }
  for (; took < nfds; took++) {
    int fd = fds[took];
    fds[took] = -1;
    if (gpudev_chunk_adopt(r->gpu, device, fd, chunk_sizes[took], &b->handles[took]) < 0) {
      rc = fault_set(f, GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT,
                     "chunk %zu of a '%s' buffer: %s", took, tagname, gpu_error());
      break;
    }
    uint32_t holder;
    if (!owned_by(r, b->handles[took], uid, &holder)) {
      rc = fault_set(f, GPUMEM__WIRE__ERROR_CODE__PERMISSION_DENIED,
                     "chunk %zu of a '%s' buffer belongs to uid %u", took, tagname, holder);
      took++; /* adopted: let go of it with the others */
      break;
    }
  }
  if (rc) {
    for (size_t i = 0; i < took; i++)
      gpudev_chunk_release(r->gpu, device, b->handles[i], chunk_sizes[i]);
    give_chunks(r, uid, nfds);
    unreserve_backup(r, b);
    uncharge(r, b);
    goto fail;
  }
  if (secret)
    memcpy(b->secret, secret, sizeof b->secret);
  else if ((rc = new_secret(b, f))) {
    for (size_t i = 0; i < took; i++)
      gpudev_chunk_release(r->gpu, device, b->handles[i], chunk_sizes[i]);
    give_chunks(r, uid, nfds);
    unreserve_backup(r, b);
    uncharge(r, b);
    goto fail;
  }
  if (!paused) {
    b->has_memory = true;
    r->managed[device] += size;
  }
  if ((rc = enter(r, b, owner, tag, paused ? BUF_PAUSED : BUF_ACTIVE, f))) goto fail;
  start_backup_memory(r, b);
  *out = b;
  return GPUMEM__WIRE__ERROR_CODE__OK;
fail:
  for (size_t i = 0; i < nfds; i++)
    if (fds[i] >= 0) {
      close(fds[i]);
      fds[i] = -1;
    }
  if (tag) registry_prune(r, tag);
  if (b) buffer_destroy(b);
  return rc;
}

/* Count a buffer in or out of its tag's per-state figures. */
static void tally(struct buffer *b, int sign) {
  struct tag *t = b->tag;
  if (b->flags & BUF_FLAG_IPC_LEGACY) {
    t->ipc_buffers += (uint64_t)(int64_t)sign;
    return;
  }
  t->count[b->state] += (uint64_t)(int64_t)sign;
  t->bytes[b->state] += (uint64_t)((int64_t)sign * (int64_t)b->size);
}

/* The moves: the state each event takes a buffer to from each state; -1
 * where the event does not apply (see buffer_event in registry.h). */
static const int moves[][4] = {
    /*                    ACTIVE       PAUSING      PAUSED        RESUMING */
    [BUF_EV_PAUSE] =        {BUF_PAUSING, -1,          -1,           -1},
    [BUF_EV_UNMAPPED] =     {-1,          BUF_PAUSED,  -1,           -1},
    [BUF_EV_UNMAP_FAILED] = {-1,          BUF_ACTIVE,  -1,           BUF_ACTIVE},
    [BUF_EV_RESUME] =       {-1,          -1,          BUF_RESUMING, -1},
    [BUF_EV_COMMIT] =       {-1,          -1,          -1,           BUF_ACTIVE},
    [BUF_EV_ROLL_BACK] =    {-1,          -1,          -1,           BUF_PAUSED},
};

/* Move a buffer by an event, keeping the tag's counts. */
bool registry_move(registry *r, struct buffer *b, buffer_event ev) {
  int st = (unsigned)ev < sizeof moves / sizeof moves[0] && (unsigned)b->state < 4
               ? moves[ev][b->state]
               : -1;
  if (st < 0) {
    log_error("buffer %llu: no move from %s by event %d", (unsigned long long)b->id,
              wire_state_name(b->state), (int)ev);
    return false;
  }
  tally(b, -1);
  b->state = (buffer_state)st;
  tally(b, +1);
  if (st == BUF_ACTIVE && b->backup_valid) {
    b->backup_valid = false;
    if (b->backup) r->backup_bytes -= b->size;
  }
  /* A backup that lets go goes whenever the buffer is ACTIVE again: after
   * the resume that restored it, or a pause or rollback it never made. */
  if (st == BUF_ACTIVE) registry_backup_let_go(r, b);
  /* Rolled back, its owner let go of such a backup as it copied it in:
   * the next resume hands it anew. */
  if (ev == BUF_EV_ROLL_BACK && (b->flags & BUF_FLAG_BACKUP_RELEASE)) b->handed_to = 0;
  if (ev == BUF_EV_COMMIT && (b->tag->paused_devices & (1ull << b->device))) {
    b->tag->paused_devices &= ~(1ull << b->device);
    tag_changed(r, b->tag);
  }
  if (st == BUF_ACTIVE || st == BUF_PAUSED) buffer_changed(r, b);
  return true;
}

/* Which of n buffers, all of one process, it still holds: one look. */
static void held_by_one(registry *r, struct buffer **bufs, size_t n, bool *held) {
  size_t total = 0;
  for (size_t i = 0; i < n; i++) total += bufs[i]->ipc ? 0 : bufs[i]->nchunks;
  uint64_t *handles = malloc((total + 1) * sizeof *handles);
  bool *chunk_held = calloc(total + 1, sizeof *chunk_held);
  size_t k = 0;
  for (size_t i = 0; handles && i < n; i++)
    for (size_t c = 0; !bufs[i]->ipc && c < bufs[i]->nchunks; c++)
      handles[k++] = bufs[i]->handles[c];
  if (handles && chunk_held && total &&
      registry_holder_pid(bufs[0]) > 0 &&
      gpudev_chunks_held_by(r->gpu, (int)registry_holder_pid(bufs[0]), handles, total,
                            chunk_held) > 0) {
    k = 0;
    for (size_t i = 0; i < n; i++)
      for (size_t c = 0; !bufs[i]->ipc && c < bufs[i]->nchunks; c++) held[i] |= chunk_held[k++];
  }
  free(handles);
  free(chunk_held);
}

/* A buffer and where the caller has it, to be ordered by pid. */
struct placed {
  struct buffer *b;
  size_t at;
};

/* Order placed buffers by their owner's pid. */
static int by_pid(const void *a, const void *b) {
  uint32_t x = (uint32_t)registry_holder_pid(((const struct placed *)a)->b);
  uint32_t y = (uint32_t)registry_holder_pid(((const struct placed *)b)->b);
  return (x > y) - (x < y);
}

/* Which of the buffers their processes still hold: one look per process. */
void registry_held_by(registry *r, struct buffer **bufs, size_t n, bool *held) {
  memset(held, 0, n * sizeof *held);
  struct placed *p = malloc((n + 1) * sizeof *p);
  struct buffer **run = malloc((n + 1) * sizeof *run);
  bool *got = calloc(n + 1, sizeof *got);
  if (!p || !run || !got) { /* no room to sort: one look per buffer */
    for (size_t i = 0; i < n; i++) held_by_one(r, &bufs[i], 1, &held[i]);
    n = 0;
  }
  for (size_t i = 0; i < n; i++) p[i] = (struct placed){bufs[i], i};
  if (n) qsort(p, n, sizeof *p, by_pid);
  for (size_t i = 0, j; i < n; i = j) {
    for (j = i; j < n && registry_holder_pid(p[j].b) == registry_holder_pid(p[i].b); j++)
      run[j - i] = p[j].b;
    held_by_one(r, run, j - i, got + i);
    for (size_t k = i; k < j; k++) held[p[k].at] = got[k];
  }
  free(p);
  free(run);
  free(got);
}

/* Whether a buffer may be freed now. */
bool registry_can_free(const struct buffer *b) {
  return b->state == BUF_ACTIVE || b->state == BUF_PAUSED;
}

/* Set or clear a tag's paused mark on some devices. */
void registry_mark_paused(registry *r, struct tag *t, uint64_t devmask, bool paused) {
  uint64_t was = t->paused_devices;
  if (paused)
    t->paused_devices |= devmask;
  else
    t->paused_devices &= ~devmask;
  if (t->paused_devices != was) tag_changed(r, t);
}

/* One more generation for each tag among bufs'. */
void registry_new_generation(registry *r, struct buffer *const *bufs, size_t n) {
  r->generation_round++;
  for (size_t i = 0; i < n; i++) {
    struct tag *t = bufs[i]->tag;
    if (t->generation_round == r->generation_round) continue;
    t->generation_round = r->generation_round;
    t->generation++;
    tag_changed(r, t);
  }
}

/* Keep a tag's generation from going back. */
void registry_generation_seen(registry *r, struct tag *t, uint64_t g) {
  if (g <= t->generation) return;
  t->generation = g;
  tag_changed(r, t);
}

/* The state a tag shows for these counts and its paused mark. */
buffer_state registry_state_of(const uint64_t count[4], uint64_t paused_devices) {
  if (count[BUF_PAUSING]) return BUF_PAUSING;
  if (count[BUF_RESUMING]) return BUF_RESUMING;
  if (count[BUF_PAUSED] || (!count[BUF_ACTIVE] && paused_devices)) return BUF_PAUSED;
  return BUF_ACTIVE;
}

/* A tag's state derived from its buffers. */
struct tag_view registry_tag_state(const struct tag *t) {
  struct tag_view v = {0};
  v.transit_buffers = t->count[BUF_PAUSING] + t->count[BUF_RESUMING];
  v.transit_bytes = t->bytes[BUF_PAUSING] + t->bytes[BUF_RESUMING];
  v.mixed = t->count[BUF_ACTIVE] && t->count[BUF_PAUSED];
  v.state = registry_state_of(t->count, t->paused_devices);
  return v;
}

/* Free a buffer in any state. */
void registry_free(registry *r, struct buffer *b) {
  tally(b, -1);
  registry_memory_release(r, b);
  drop_backup(r, b);
  unreserve_backup(r, b);
  list_remove(&b->uid_link);
  uncharge(r, b);
  idmap_del(r->buffers, b->id);
  list_remove(&b->tag_link);
  list_remove(&b->owner_link);
  b->owner->nbuffers--;
  list_remove(&b->all_link);
  if (b->name[0]) list_remove(&b->persist_link);
  if (r->journal) journal_put_gone(r->journal, b->id);
  if (!r->destroying) registry_prune(r, b->tag);
  buffer_destroy(b);
}

/* Forget a tag that has no buffers and is neither paused anywhere nor
 * shared by a controller, so that names used once do not pile up (the
 * configuration's shared names are shared again whenever made). */
void registry_prune(registry *r, struct tag *tag) {
  if (!list_empty(&tag->buffers) || tag->paused_devices || tag->expected ||
      (tag->shared && !shared_by_config(r, tag->name)))
    return;
  tag_delete(r, tag);
}

/* The buffer with this id, or NULL. */
struct buffer *registry_find(registry *r, uint64_t id) { return idmap_get(r->buffers, id); }

/* Bytes of physical memory the daemon holds on a device. */
uint64_t registry_managed(const registry *r, unsigned device) {
  return device < GPUMEM_MAX_DEVICES ? r->managed[device] : 0;
}

/* Bytes of backups held in host memory. */
uint64_t registry_backup_bytes(const registry *r) { return r->backup_bytes; }

/* Number of buffers. */
size_t registry_count(const registry *r) { return idmap_count(r->buffers); }

/* Export every chunk of a buffer as fds (none for legacy IPC memory). */
wire_code registry_export(registry *r, struct buffer *b, int *fds, struct fault *f) {
  if (b->ipc) return GPUMEM__WIRE__ERROR_CODE__OK;
  for (size_t i = 0; i < b->nchunks; i++) {
    if (gpudev_chunk_export(r->gpu, b->handles[i], &fds[i]) < 0) {
      while (i-- > 0) close(fds[i]);
      return fault_set(f, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
                       "export of buffer %llu: %s", (unsigned long long)b->id,
                       gpu_error());
    }
  }
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Tell journal j of every change from now on. */
void registry_set_journal(registry *r, journal *j) { r->journal = j; }

/* Flush the journal, if there is one. */
void registry_journal_flush(registry *r) {
  if (r->journal) journal_flush(r->journal);
}

/* Write every tag and buffer to j. */
void registry_journal_fill(void *ctx, journal *j) {
  registry *r = ctx;
  for (struct list *p = r->tags.next; p != &r->tags; p = p->next) {
    struct journal_tag t = tag_record(list_entry(p, struct tag, link));
    journal_put_tag(j, &t, false);
  }
  for (struct list *p = r->all.next; p != &r->all; p = p->next) {
    const struct buffer *b = list_entry(p, struct buffer, all_link);
    if (b->state != BUF_ACTIVE && b->state != BUF_PAUSED) continue; /* as it was before */
    struct journal_buffer x = registry_buffer_record(b);
    journal_put_buffer(j, &x);
  }
}

/* Make a tag as a journal had it. */
struct tag *registry_tag_restore(registry *r, const struct journal_tag *jt) {
  struct tag *t = registry_tag(r, jt->name);
  if (!t && !(t = tag_new(r, jt->name))) return NULL;
  t->uid = jt->uid;
  t->owned = jt->owned;
  t->shared = jt->shared || shared_by_config(r, jt->name);
  t->paused_devices = jt->paused_devices;
  t->generation = jt->generation;
  tag_changed(r, t);
  return t;
}

/* Count a buffer of the journal not back yet in t, or (delta -1) one
 * fewer: the tag is kept while any is expected. */
void registry_expect(registry *r, struct tag *t, int delta) {
  t->expected += (uint64_t)(int64_t)delta;
  if (!t->expected) registry_prune(r, t);
}

/* New buffers get ids above this one. */
void registry_ids_above(registry *r, uint64_t id) {
  if (r->next_id <= id) r->next_id = id + 1;
}
