/* The buffer registry: every managed buffer, its tag, owner, state and the
 * physical chunks behind it, with the per-device accounting. */
#ifndef GPUMEMD_REGISTRY_H
#define GPUMEMD_REGISTRY_H

#include <stdbool.h>
#include <stdint.h>

#include "common/list.h"
#include "common/wire.h"
#include "fault.h"
#include "gpu/gpudev.h"
#include "hostmem.h"
#include "owner.h"
#include "tenant.h"

typedef Gpumem__Wire__BufferState buffer_state;
#define BUF_ACTIVE GPUMEM__WIRE__BUFFER_STATE__ACTIVE
#define BUF_PAUSING GPUMEM__WIRE__BUFFER_STATE__PAUSING
#define BUF_PAUSED GPUMEM__WIRE__BUFFER_STATE__PAUSED
#define BUF_RESUMING GPUMEM__WIRE__BUFFER_STATE__RESUMING

#define BUF_FLAG_BACKUP GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP
#define BUF_FLAG_IPC_LEGACY GPUMEM__WIRE__BUFFER_FLAG__FLAG_IPC_LEGACY
#define BUF_FLAG_ALLOW_PAUSED GPUMEM__WIRE__BUFFER_FLAG__FLAG_ALLOW_PAUSED
#define BUF_FLAG_BACKUP_RELEASE GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_RELEASE
#define BUF_FLAG_BACKUP_PAGEABLE GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_PAGEABLE
#define BUF_FLAG_BACKUP_DISK GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_DISK
#define BUF_FLAG_PERSIST GPUMEM__WIRE__BUFFER_FLAG__FLAG_PERSIST


/* A tag: a name and its buffers, with counts per state kept by the
 * registry. Its state is derived from them (registry_tag_state). It
 * belongs to the uid whose buffer created it: only that uid's buffers
 * join it, unless a controller shared it. */
struct tag {
  char name[WIRE_TAG_MAX + 1];
  uint64_t seq;    /* creation order: the registry's list is in it */
  uint32_t uid;    /* the owner, when owned */
  bool owned;      /* false: made shared before any buffer joined */
  bool shared;     /* every uid's buffers may join (kept while empty) */
  struct tag *hash_next; /* next tag in its hash bucket */
  struct list buffers;     /* struct buffer.tag_link */
  uint64_t paused_devices; /* bit d: fully paused on device d (a pause of
                              every session's buffers there, and no resume
                              since made one ACTIVE); new buffers there
                              start PAUSED or are refused */
  uint64_t count[4], bytes[4]; /* pausable buffers per buffer_state */
  uint64_t ipc_buffers;        /* IPC_LEGACY buffers: never pause */
  uint64_t generation;         /* resumes that gave its buffers new memory */
  uint64_t generation_round;   /* the registry's round that last added one */
  uint64_t expected;           /* buffers of the journal not re-registered yet:
                                  kept while there are */
  struct list link;        /* registry's tags */
};

/* A tag's state as status shows it. */
struct tag_view {
  buffer_state state; /* PAUSING/RESUMING while any buffer is in transition;
                         PAUSED when any is paused (or none exist and the
                         tag is paused); else ACTIVE */
  bool mixed;         /* ACTIVE and PAUSED buffers both exist */
  uint64_t transit_buffers, transit_bytes;
};

/* A buffer: rounded size, split into chunks; the chunks' handles exist
 * while the daemon holds memory for it (has_memory). */
struct buffer {
  uint64_t id;
  struct owner *owner;
  uint32_t uid;  /* the owner's, kept with the memory where the backend can */
  struct tag *tag;
  unsigned device;
  uint64_t size;
  uint32_t flags;
  buffer_state state; /* set at birth, then only by registry_move */
  size_t nchunks;
  uint64_t *chunk_sizes;
  uint64_t *handles;
  bool has_memory;
  bool ipc;      /* legacy IPC memory (handles[0] is its device pointer) */
  uint8_t secret[WIRE_SECRET_SIZE]; /* what proves it its holder's to a daemon after us */
  uint8_t ipc_handle[GPU_IPC_HANDLE_SIZE];
  void *backup;      /* host memory for its contents (BACKUP), kept once made */
  hostmem_job *making; /* that memory, while the thread pool makes it */
  bool backup_valid; /* the backup holds the contents (paused) */
  uint64_t backup_hash; /* with --verify-backups */
  uint64_t handed_to; /* the session (owner id) that keeps its backup memory mapped; 0: none */
  bool reserved;      /* its backup's room is counted against --backup-limit */
  bool pageable;      /* its backup is pageable memory (pageable.h), not pinned */
  int disk_fd;        /* the file its backup is in (BACKUP_DISK, backup_disk.h); -1: none */
  bool spilling;      /* its backup memory is being written to disk, off the loop */
  char name[WIRE_TAG_MAX + 1]; /* a PERSIST buffer's, unique in its uid's; "" otherwise */
  uint64_t born_ns;   /* when it was made (CLOCK_MONOTONIC) */
  pid_t last_pid;     /* its last holder's process (PERSIST), its session's name: */
  char last_name[WIRE_NAME_MAX + 1];
  uint64_t let_go_ns; /* when that holder let go of it; 0 while a session holds it */
  uint64_t stored_as; /* the id its chunks go by in systemd's fd store (fdstore.h); 0: not there */
  struct list tag_link, owner_link;
  struct list all_link; /* the registry's buffers, in id order */
  struct list persist_link; /* the registry's PERSIST buffers (named), in id order */
  struct list uid_link; /* its uid's buffers (tenants_members), in id order */
};

typedef struct registry registry;

/* How the registry cuts buffers and keeps backups. */
struct registry_options {
  uint64_t chunk_size;   /* largest physical chunk */
  uint64_t backup_limit; /* host memory BACKUP buffers may reserve */
  bool verify_backups;   /* hash backups and check them after restore */
  bool overflow_pageable; /* a backup past backup_limit is pageable memory, not refused */
  bool disk;              /* there is a --backup-dir: BACKUP_DISK buffers are taken */
  struct tenant_limits quotas; /* per uid */
  const char *const *shared_names; /* tags made shared whenever created */
  size_t nshared_names;
  uv_loop_t *loop;       /* makes BACKUP buffers' host memory on its thread
                            pool as they are allocated; NULL: on the first
                            pause. Buffers freed meanwhile leave jobs that
                            end on the loop's next runs. */
};

/* Create an empty registry over a backend. */
registry *registry_create(gpudev *g, const struct registry_options *opt);

/* Free every buffer and the registry. */
void registry_destroy(registry *r);

/* Allocate a buffer for owner (linked into owner->buffers and counted in
 * owner->nbuffers until freed; its uid recorded with the memory where the
 * backend can). A tag another uid
 * owns is PERMISSION_DENIED unless shared; a buffer past a uid's quota is
 * LIMIT_EXCEEDED. A buffer in a tag fully paused on its device starts
 * PAUSED if flags allow it, else TAG_PAUSED; in a partly paused tag (a
 * scoped pause) it starts ACTIVE. Returns OK with *out, or the error code
 * with f filled. */
wire_code registry_alloc(registry *r, struct owner *owner, const char *tag, unsigned device,
                         uint64_t size, uint32_t flags, struct buffer **out, struct fault *f);

/* registry_alloc for a PERSIST buffer named name (NULL or "": none, as
 * registry_alloc), which must be new among its uid's persistent buffers
 * (WRONG_STATE, naming the one there, otherwise). */
wire_code registry_alloc_named(registry *r, struct owner *owner, const char *name,
                               const char *tag, unsigned device, uint64_t size, uint32_t flags,
                               struct buffer **out, struct fault *f);

/* The persistent buffer of uid named name, or NULL. */
struct buffer *registry_persistent(registry *r, uint32_t uid, const char *name);

/* The PERSIST buffers (struct buffer.persist_link), in id order. */
struct list *registry_persistent_list(registry *r);

/* Hand b, a PERSIST buffer, to another owner: the keeper (keeper.h) when
 * its holder lets go of it or ends, or a session that attaches it. Its
 * last holder is remembered (status shows it) and the journal told. */
void registry_hand(registry *r, struct buffer *b, struct owner *to);

/* The process that may map b: its owner's, or, held by the keeper, its
 * last holder's (a process may end its session and keep its mappings). */
pid_t registry_holder_pid(const struct buffer *b);

/* The clock of born_ns and let_go_ns: CLOCK_MONOTONIC, in nanoseconds. */
uint64_t registry_now_ns(void);

/* Re-register a buffer that a worker kept across a daemon restart: the
 * chunk fds (consumed either way; none when paused) become its memory,
 * unless the backend says they belong to another uid. Tags and quotas are
 * checked as for registry_alloc. It keeps secret (WIRE_SECRET_SIZE bytes;
 * NULL: it gets a new one). Returns OK with *out, or the error with
 * nothing changed. */
wire_code registry_adopt(registry *r, struct owner *owner, const char *tag, unsigned device,
                         uint64_t size, uint32_t flags, const char *name, bool paused,
                         const uint64_t *chunk_sizes, size_t nchunks, int *fds,
                         const uint8_t *secret, struct buffer **out, struct fault *f);

/* What happens to a buffer in a pause or resume. With the buffer's state
 * it decides the next one, by the one table of moves (registry.c):
 *   PAUSE         ACTIVE   -> PAUSING   a pause asks its owner to unmap it
 *   UNMAPPED      PAUSING  -> PAUSED    the owner unmapped it
 *   UNMAP_FAILED  PAUSING  -> ACTIVE    the owner could not unmap it
 *                 RESUMING -> ACTIVE    nor, after a failed resume, unmap
 *                                       what it had mapped: it is in use
 *   RESUME        PAUSED   -> RESUMING  a resume sends the owner its memory
 *   COMMIT        RESUMING -> ACTIVE    every owner of the resume mapped
 *   ROLL_BACK     RESUMING -> PAUSED    a failed resume is undone
 * A buffer is born ACTIVE, or PAUSED in a tag marked paused on its device
 * (registry_alloc, registry_adopt), and may be freed only while ACTIVE or
 * PAUSED (registry_can_free). */
typedef enum {
  BUF_EV_PAUSE,
  BUF_EV_UNMAPPED,
  BUF_EV_UNMAP_FAILED,
  BUF_EV_RESUME,
  BUF_EV_COMMIT,
  BUF_EV_ROLL_BACK,
} buffer_event;

/* Move buffer b by event ev: the one place states change, keeping its
 * tag's counts. A buffer that becomes ACTIVE has no valid backup any more;
 * one a resume commits leaves its tag's paused mark on its device. A move
 * the table does not have is a bug: it is logged and nothing changes
 * (returns false). */
bool registry_move(registry *r, struct buffer *b, buffer_event ev);

/* Which of bufs (n of them, PAUSED, with memory, of any owners) their
 * owners' processes still map or hold, into held: as the kernel or driver
 * can tell (none, where it cannot), with one look at each process for all
 * of its buffers, however many sessions hold them. */
void registry_held_by(registry *r, struct buffer **bufs, size_t n, bool *held);

/* Whether b may be freed now: not while a pause or resume has it. */
bool registry_can_free(const struct buffer *b);

/* Mark tag t fully paused on the devices in devmask (a pause of every
 * session's buffers there), or, with paused false, no longer (a resume of
 * every session's buffers there that every owner acked). */
void registry_mark_paused(registry *r, struct tag *t, uint64_t devmask, bool paused);

/* The n buffers of bufs get new memory, a resume's remap: the generation
 * of each of their tags grows by one (once per tag). */
void registry_new_generation(registry *r, struct buffer *const *bufs, size_t n);

/* A buffer re-registered with tag t was last mapped at generation g of
 * the daemon before: t's generation is at least that from now on. */
void registry_generation_seen(registry *r, struct tag *t, uint64_t g);

/* The state a tag shows for count[st] buffers in each state and its paused
 * mark: PAUSING or RESUMING while any is in transition, PAUSED when any is
 * paused (or none is active and the tag is marked paused somewhere), else
 * ACTIVE. */
buffer_state registry_state_of(const uint64_t count[4], uint64_t paused_devices);

/* A tag's state derived from its buffers. */
struct tag_view registry_tag_state(const struct tag *t);

/* Free a buffer in any state, releasing its memory and backup. */
void registry_free(registry *r, struct buffer *b);

/* The buffer with this id, or NULL. */
struct buffer *registry_find(registry *r, uint64_t id);

/* The tag with this name, or NULL. */
struct tag *registry_tag(registry *r, const char *name);

/* Share a tag with every uid (shared), creating it if new, or make it its
 * owner's alone again: the owner then is the uid whose buffer created it,
 * or, for a tag made shared before any buffer, the one uid whose buffers
 * are in it (WRONG_STATE while several uids' are; buffers already in it
 * stay). Returns OK with *out (NULL: an unshared tag with nothing in it is
 * forgotten), NOT_FOUND for unsharing a tag that does not exist, or
 * INTERNAL. */
wire_code registry_share(registry *r, const char *name, bool shared, struct tag **out,
                         struct fault *f);

/* Whether uid may see the tag: it owns it, or it is shared. */
bool registry_tag_visible(const struct tag *t, uint32_t uid);

/* Forget a tag with no buffers that is neither paused nor shared nor
 * expecting buffers of the journal (it is freed). */
void registry_prune(registry *r, struct tag *tag);

/* The list of tags (struct tag.link), in creation order, for walking. */
struct list *registry_tags(registry *r);

/* The first tag made after the one numbered seq (struct tag.seq), or NULL. */
struct tag *registry_tag_after(registry *r, uint64_t seq);

/* Number of tags. */
size_t registry_tag_count(const registry *r);

/* The list of buffers (struct buffer.all_link), in id order. */
struct list *registry_buffers(registry *r);

/* The first buffer whose id is above after, or NULL. */
struct buffer *registry_buffer_after(registry *r, uint64_t after);

/* What each uid holds, and the quotas. */
tenants *registry_tenants(registry *r);

/* Create physical memory for a buffer that has none. Returns OK, or
 * OUT_OF_MEMORY/BACKEND_ERROR with nothing created. */
wire_code registry_memory_create(registry *r, struct buffer *b, struct fault *f);

/* Release a buffer's physical memory. */
void registry_memory_release(registry *r, struct buffer *b);

/* Copy a buffer's contents to its backup in host memory, made now if the
 * thread pool has not made it (waiting for it if it is being made).
 * Returns OK or an error (then nothing changed). */
wire_code registry_backup(registry *r, struct buffer *b, struct fault *f);

/* Copy a buffer's backup into its (new) memory; with verification, read it
 * back and compare. The backup stays valid until the buffer is ACTIVE, so
 * a resume that rolls back keeps it. */
wire_code registry_restore(registry *r, struct buffer *b, struct fault *f);

/* True if buffer b's owner copies its contents itself on a pause (into
 * its backup) or a resume (out of it): a worker that said so at Hello,
 * with a backup to make (pause) or a valid one (resume: unless backups
 * are verified, which reads the device back in the daemon). The daemon
 * copies for every other owner. */
bool registry_owner_copies(const registry *r, const struct buffer *b, bool resume);

/* Hand b's backup memory (made now if the thread pool has not made it)
 * to its owner: at most max pieces' new fds into fds (the caller's), their
 * sizes into sizes, their count into *n; or, where the owner keeps the
 * memory handed to it before, none, with *kept. False when it cannot be
 * handed (the backend's backups cannot be, more than max pieces, no
 * memory): the daemon copies instead, and why is logged. */
bool registry_hand_backup(registry *r, struct buffer *b, int *fds, uint64_t *sizes, size_t max,
                          size_t *n, bool *kept);

/* How a paused backup is given to its owner to read. */
enum backup_form {
  BACKUP_FORM_MEMORY,      /* pieces of host memory the backend imports */
  BACKUP_FORM_FILES,       /* its file in --backup-dir, read only */
  BACKUP_FORM_SEND_MEMORY, /* none: pageable memory, copied into the owner's */
};

/* Export the backup of b, a paused BACKUP buffer whose backup holds its
 * contents, as at most max pieces (fds, their sizes, *n of them, in the
 * form *form says) for its owner to read; an owner of protocol 1.10 or
 * later is given a disk backup's file and told to send memory for a
 * pageable one. WRONG_STATE when there is no such backup, BACKEND_ERROR
 * where it cannot be given (the backend's backups cannot be exported, as
 * HIP's; an older owner and a file or pageable memory), with words in f. */
wire_code registry_backup_for_reading(registry *r, struct buffer *b, int *fds, uint64_t *sizes,
                                      size_t max, size_t *n, enum backup_form *form,
                                      struct fault *f);

/* Copy the backup of b, paused in pageable memory, into fd, a memfd its
 * owner sent (pageable_copy_into). WRONG_STATE when b's backup is not
 * such memory (or not there), INVALID_ARGUMENT for memory that will not
 * do, with words in f. */
wire_code registry_backup_copy_into(registry *r, struct buffer *b, int fd, struct fault *f);

/* Reserve the backup room of b (a BACKUP_RELEASE buffer, which reserves
 * none while ACTIVE) for a pause that will make its backup; nothing for a
 * buffer that holds its room already. LIMIT_EXCEEDED, naming
 * --backup-limit, when it does not fit. */
wire_code registry_backup_reserve(registry *r, struct buffer *b, struct fault *f);

/* Give back the room registry_backup_reserve took for b when the pause
 * that took it fails before b leaves ACTIVE (nothing where b has no such
 * room, or has backup memory). */
void registry_backup_unreserve(registry *r, struct buffer *b);

/* b, a BACKUP_RELEASE buffer, is ACTIVE again (registry_move calls it
 * for every buffer that becomes ACTIVE): free its backup's host memory,
 * forget that its owner keeps it, and give its room back. */
void registry_backup_let_go(registry *r, struct buffer *b);

/* The owner of b failed an event about it: whatever backup memory it
 * kept is not trusted to be there; the next event hands it again. */
void registry_backup_unhanded(struct buffer *b);

/* The owner copied b's contents into the backup handed to it (its Unmap
 * ack said so, us after it was sent): the backup is valid, counted and,
 * with verification, hashed. */
void registry_backup_copied(registry *r, struct buffer *b, uint64_t us);

/* The owner copied b's backup into its new memory (its Remap ack said so,
 * us after it was sent): counted. */
void registry_restore_copied(registry *r, struct buffer *b, uint64_t us);

/* Bytes and microseconds of backup copies so far, one way. */
void registry_copy_totals(const registry *r, bool to_host, uint64_t *bytes, uint64_t *us);

/* Let go of what backup copies held (a device context on GPUs, taken by
 * an operation's first copy on the device): at every pause's and
 * resume's end, so that the daemon holds no device memory outside its
 * copies. The next copy takes it again (120-160 ms on an H200). Where
 * the backups' host memory lives in the context (HIP's pinned memory),
 * the backend keeps it alive all the same. host_only (a pause that
 * released its workers, for a node that holds nothing): also take the
 * device's access to paused buffers' backups away (32 MiB of device
 * memory for 16 GiB on an H200, by NVML), which the next copy gives back
 * (gpudev_backup_host_only). The backups of paused buffers no session
 * holds lose that access at every call: it is the daemon's own memory. */
void registry_let_go(registry *r, bool host_only);


/* Remember the copy figures of the last operation that copied, one way. */
void registry_note_last(registry *r, bool to_host, uint64_t bytes, uint64_t us);

/* The copy figures of the last operation that copied, one way. */
void registry_last(const registry *r, bool to_host, uint64_t *bytes, uint64_t *us);

/* Host memory reserved by BACKUP buffers, and the limit. */
void registry_backup_budget(const registry *r, uint64_t *reserved, uint64_t *limit);

/* Host memory already made for BACKUP buffers (ready for a pause). */
uint64_t registry_backup_ready(const registry *r);

/* Bytes of physical memory the daemon holds on a device. */
uint64_t registry_managed(const registry *r, unsigned device);

/* A pause writes b's backup (BACKUP_DISK, valid, in host memory) to disk:
 * its host memory, which is the writer's to read until
 * registry_disk_written, even if b is freed meanwhile. */
void *registry_disk_take(registry *r, struct buffer *b);

/* The write of the backup of buffer id (host, size bytes, pinned for dev
 * or pageable) ended: fd >= 0 is its file, and the buffer's backup is
 * there now, its host memory and reservation let go of; fd < 0: it
 * failed, and the backup stays in host memory. When the buffer is gone
 * or moved on, host and fd are freed. True when the backup is on disk. */
bool registry_disk_written(registry *r, uint64_t id, void *host, uint64_t size, unsigned dev,
                           bool pageable, int fd);

/* Host memory (host, size bytes, pinned for dev or pageable) made and
 * filled from the file of buffer id for a resume, which reserved it:
 * its backup is in host memory again (the file stays until it is
 * ACTIVE). When the buffer is gone or moved on, host is freed (and the
 * reservation given back); false then. */
bool registry_disk_loaded(registry *r, uint64_t id, void *host, uint64_t size, unsigned dev,
                          bool pageable);

/* A resume that read b's backup back failed, b PAUSED still: its backup
 * is only in its file again (host memory and reservation let go of). */
void registry_disk_unload(registry *r, struct buffer *b);

/* Whether b's backup is only on disk (a resume must read it first). */
bool registry_on_disk(const struct buffer *b);

/* Bytes of backups held in files. */
uint64_t registry_disk_bytes(const registry *r);

/* Bytes of backups that hold contents (paused BACKUP buffers). */
uint64_t registry_backup_bytes(const registry *r);

/* Number of buffers. */
size_t registry_count(const registry *r);

struct journal;
struct journal_tag;
struct journal_buffer;

/* A buffer's journal record (journal.h) as it is now. */
struct journal_buffer registry_buffer_record(const struct buffer *b);

struct fdstore;

/* Keep in store s (fdstore.h; NULL: none) a copy of the chunks of each
 * persistent buffer that no session holds while it has memory, and have
 * it let go of them before that memory is released (but not when the
 * registry is destroyed: the next daemon takes them back). */
void registry_set_fdstore(registry *r, struct fdstore *s);

/* Buffer b, made by registry_adopt from chunks that store s passed back
 * under id, is there still. */
void registry_stored_as(registry *r, struct buffer *b, uint64_t id);

/* Tell journal j (journal.h) of every change of tags and buffers from now
 * on: each new buffer (with its secret, made at allocation), each one
 * that is ACTIVE or PAUSED again, each one freed, and each change of a
 * tag's owner, share, paused marks and generation. NULL: none (a daemon
 * shutting down frees buffers that its workers keep for the next one). */
void registry_set_journal(registry *r, struct journal *j);

/* Write what changed to the journal now (none set: nothing), so that what
 * a reply reports as done is what a daemon after this one finds. */
void registry_journal_flush(registry *r);

/* Write every tag and every buffer (in transition: as it was before) to
 * j: a journal_fill_fn for journal_rewrite, ctx the registry. */
void registry_journal_fill(void *ctx, struct journal *j);

/* Make the tag of a journal's record (or set the one of that name so): its
 * owner, share, paused marks and generation. NULL when out of memory. */
struct tag *registry_tag_restore(registry *r, const struct journal_tag *t);

/* One more (delta 1) or one fewer (-1) buffer of the journal that t
 * expects: a tag with none left and nothing else to keep it is
 * forgotten. */
void registry_expect(registry *r, struct tag *t, int delta);

/* Buffers made from now on get ids above id (those of a journal). */
void registry_ids_above(registry *r, uint64_t id);

/* Export every chunk of a buffer as fds (fds[nchunks]). */
wire_code registry_export(registry *r, struct buffer *b, int *fds, struct fault *f);

#endif
