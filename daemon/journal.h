/* The daemon's journal: a file in its runtime directory (next to the
 * socket unless --journal says otherwise) saying what a daemon restarted
 * on the same socket must know to take the node back: each tag with its
 * owner, share, paused marks and generation, each buffer with its uid,
 * tag, device, size, flags, state and the secret that only its holder
 * knows. Records are appended, each with its length and an XXH32 of it,
 * one write per turn of the loop and before any reply that hands out a
 * secret: a crash at any point leaves a journal whose last record at
 * most is cut, and a cut record was never answered. The journal is
 * written whole again (to a new file, then renamed over it) at start and
 * once it has grown to several times what it holds. It must outlive the
 * daemon, not the machine (device memory does not outlive a boot, and a
 * journal of another boot is refused): nothing is fsynced. */
#ifndef GPUMEMD_JOURNAL_H
#define GPUMEMD_JOURNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/wire.h"

typedef struct journal journal;

/* A tag as the journal has it. */
struct journal_tag {
  char name[WIRE_TAG_MAX + 1];
  uint32_t uid;
  bool owned, shared;
  uint64_t paused_devices, generation;
};

/* A buffer as the journal has it (state ACTIVE or PAUSED). */
struct journal_buffer {
  uint64_t id;
  uint32_t uid;
  char tag[WIRE_TAG_MAX + 1];
  unsigned device;
  uint64_t size;
  uint32_t flags;
  Gpumem__Wire__BufferState state;
  uint8_t secret[WIRE_SECRET_SIZE];
  char name[WIRE_TAG_MAX + 1]; /* a PERSIST buffer's; "" otherwise */
  bool kept;                   /* held by the daemon alone (no worker holds it) */
  bool charged; /* not the file's: counted against its uid's quotas while expected */
};

/* What the journal is written for: a journal of another backend or
 * another number of devices is not this daemon's to trust. */
struct journal_identity {
  const char *backend;
  unsigned devices;
};

/* What journal_open found at its path. */
enum journal_found {
  JOURNAL_NONE,     /* no file: a first start, or one lost */
  JOURNAL_LOADED,   /* a journal of the daemon before: its tags and buffers */
  JOURNAL_REJECTED, /* a file it will not trust (journal_why), renamed to PATH.rejected */
};

/* Writes everything the journal says now, with journal_put_tag and
 * journal_put_buffer (for journal_rewrite). */
typedef void (*journal_fill_fn)(void *ctx, journal *j);

/* Open the journal at path for a daemon of identity who: take its lock
 * (PATH.lock), read what the daemon before left and judge it (a regular
 * file of the daemon's uid that no one else may read, of this format,
 * boot, backend and device count, every record whole and well formed
 * but a cut last one), renaming a rejected one aside. Nothing is written
 * until journal_rewrite. NULL with err filled when the lock is held by
 * another daemon, or the file cannot be read or put aside. */
journal *journal_open(const char *path, const struct journal_identity *who, char *err,
                      size_t errlen);

/* What journal_open found, and for JOURNAL_REJECTED (or a cut last
 * record: JOURNAL_LOADED) why, in words (empty otherwise). */
enum journal_found journal_found(const journal *j, const char **why);

/* The tags the journal found, n of them in *n. */
const struct journal_tag *journal_tags(const journal *j, size_t *n);

/* The largest buffer id the journal found (0: none). */
uint64_t journal_max_id(const journal *j);

/* The buffer the journal found under id that is not claimed yet, or
 * NULL. */
const struct journal_buffer *journal_expected(const journal *j, uint64_t id);

/* Buffers found and not claimed yet. */
size_t journal_expected_count(const journal *j);

/* Up to max of the buffers found and not claimed yet into out (in no
 * order); how many. */
size_t journal_expected_list(const journal *j, const struct journal_buffer **out, size_t max);

/* The persistent buffer found for uid under name that is not claimed
 * yet, into *out: 1, 0 (none: *out NULL), or -ENOMEM. */
int journal_expected_named(const journal *j, uint32_t uid, const char *name,
                           const struct journal_buffer **out);

/* Say whether the buffer found under id is charged to its uid's quotas. */
void journal_set_charged(journal *j, uint64_t id, bool charged);

/* The buffer found under id was re-registered (under a new id): no longer
 * expected, and gone from the journal. */
void journal_claim(journal *j, uint64_t id);

/* Call fn for each buffer still expected, then expect none. */
void journal_expire(journal *j, void (*fn)(void *ctx, const struct journal_buffer *b),
                    void *ctx);

/* Write the journal whole (the header, what fill writes, the buffers
 * still expected) to a new file and rename it over the old one; fill is
 * kept for the rewrites journal_flush makes. 0, or a negative errno with
 * err filled (the journal is then removed: a daemon after this one would
 * find none rather than a stale one). */
int journal_rewrite(journal *j, journal_fill_fn fill, void *ctx, char *err, size_t errlen);

/* Append a tag's record (gone: it was forgotten). */
void journal_put_tag(journal *j, const struct journal_tag *t, bool gone);

/* Append a buffer's record. */
void journal_put_buffer(journal *j, const struct journal_buffer *b);

/* Append that buffer id was freed. */
void journal_put_gone(journal *j, uint64_t id);

/* Write what was appended since the last flush; written whole again
 * instead when it has grown past four times its last whole size (and
 * 1 MiB), or an earlier write failed. 0, or a negative errno (logged once
 * per failure; the journal is removed until a rewrite succeeds). */
int journal_flush(journal *j);

/* Whether records (or a rewrite) wait for journal_flush. */
bool journal_pending(const journal *j);

/* Bytes in the file now, and of its last whole writing. */
void journal_size(const journal *j, uint64_t *bytes, uint64_t *whole);

/* Flush, release the lock and free; the file stays for the next daemon. */
void journal_close(journal *j);

#endif
