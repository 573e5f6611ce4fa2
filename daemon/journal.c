#include "journal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/idmap.h"
#include "common/log.h"
#include "gpumem.h"

/* The file's first bytes, then records. */
static const char MAGIC[8] = {'g', 'p', 'u', 'm', 'e', 'm', 'J', '\n'};
/* The format this daemon writes and reads. */
#define JOURNAL_FORMAT 1
/* A record's frame: u32 length, u32 XXH32 of the record. */
#define FRAME_HEAD 8
/* The largest record (a tag or buffer is some 100 bytes). */
#define RECORD_MAX 4096
/* The largest journal read (some 100 bytes a buffer: 10 million). */
#define FILE_MAX (1ull << 30)
/* Rewrite once appends pass this many times the last whole size... */
#define GROWTH 4
/* ...and this many bytes. */
#define GROWTH_MIN (1u << 20)

/* Bytes being gathered for one write. */
struct bytes {
  uint8_t *data;
  size_t len, cap;
  bool failed; /* out of memory once: what it holds is not the whole */
};

struct journal {
  char path[4200];
  int lock_fd;
  int fd; /* the file appended to; -1 before the first rewrite or after a failure */
  struct journal_identity who;
  char boot_id[64];
  char version[32]; /* this daemon's, major.minor.patch */
  enum journal_found found;
  char why[512];
  struct journal_tag *tags; /* found */
  size_t ntags;
  idmap *expected; /* id -> struct journal_buffer *, found and not claimed */
  uint64_t max_id;
  struct bytes out;   /* appended, not yet written */
  uint64_t size;      /* bytes in the file */
  uint64_t whole;     /* of its last rewrite */
  bool broken;        /* a write failed: rewrite before anything else */
  journal_fill_fn fill;
  void *fill_ctx;
};

/* Set the journal's words about what it found. */
__attribute__((format(printf, 2, 3))) static void say(journal *j, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(j->why, sizeof j->why, fmt, ap);
  va_end(ap);
}

/* The kernel's boot id, or "" where it cannot be read. */
static void read_boot_id(char *out, size_t len) {
  out[0] = 0;
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "re");
  if (!f) return;
  if (fgets(out, (int)len, f)) out[strcspn(out, "\n")] = 0;
  fclose(f);
}

/* Append n bytes to b. */
static void bytes_add(struct bytes *b, const void *p, size_t n) {
  if (b->failed) return;
  if (b->len + n > b->cap) {
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + n) cap *= 2;
    uint8_t *d = realloc(b->data, cap);
    if (!d) {
      b->failed = true;
      return;
    }
    b->data = d;
    b->cap = cap;
  }
  memcpy(b->data + b->len, p, n);
  b->len += n;
}

/* Put a little-endian u32. */
static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Read a little-endian u32. */
static uint32_t get_u32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Frame one record into b. */
static void frame_record(struct bytes *b, const Gpumem__Wire__JournalRecord *r) {
  uint8_t buf[FRAME_HEAD + RECORD_MAX];
  size_t n = gpumem__wire__journal_record__get_packed_size(r);
  if (n > RECORD_MAX) { /* a tag name or secret is bounded: never */
    b->failed = true;
    return;
  }
  gpumem__wire__journal_record__pack(r, buf + FRAME_HEAD);
  put_u32(buf, (uint32_t)n);
  put_u32(buf + 4, XXH32(buf + FRAME_HEAD, n, 0));
  bytes_add(b, buf, FRAME_HEAD + n);
}

/* Frame the header record into b. */
static void frame_header(journal *j, struct bytes *b) {
  Gpumem__Wire__JournalHeader h = GPUMEM__WIRE__JOURNAL_HEADER__INIT;
  h.format = JOURNAL_FORMAT;
  h.daemon_version = j->version;
  h.boot_id = j->boot_id;
  h.backend = (char *)j->who.backend;
  h.devices = j->who.devices;
  h.uid = (uint32_t)geteuid();
  Gpumem__Wire__JournalRecord r = GPUMEM__WIRE__JOURNAL_RECORD__INIT;
  r.body_case = GPUMEM__WIRE__JOURNAL_RECORD__BODY_HEADER;
  r.header = &h;
  bytes_add(b, MAGIC, sizeof MAGIC);
  frame_record(b, &r);
}

/* Frame a buffer's record into b. */
static void frame_buffer(struct bytes *b, const struct journal_buffer *x, bool gone) {
  Gpumem__Wire__JournalBuffer m = GPUMEM__WIRE__JOURNAL_BUFFER__INIT;
  m.id = x->id;
  m.gone = gone;
  if (!gone) {
    m.uid = x->uid;
    m.tag = (char *)x->tag;
    m.device = x->device;
    m.size = x->size;
    m.flags = x->flags;
    m.state = x->state;
    m.secret.data = (uint8_t *)x->secret;
    m.secret.len = sizeof x->secret;
    m.name = (char *)x->name;
    m.kept = x->kept;
  }
  Gpumem__Wire__JournalRecord r = GPUMEM__WIRE__JOURNAL_RECORD__INIT;
  r.body_case = GPUMEM__WIRE__JOURNAL_RECORD__BODY_BUFFER;
  r.buffer = &m;
  frame_record(b, &r);
}

/* The tag found under name, or NULL. */
static struct journal_tag *found_tag(journal *j, const char *name) {
  for (size_t i = 0; i < j->ntags; i++)
    if (strcmp(j->tags[i].name, name) == 0) return &j->tags[i];
  return NULL;
}

/* Take one tag record: the last of a name wins; false when out of memory. */
static bool take_tag(journal *j, const Gpumem__Wire__JournalTag *m) {
  struct journal_tag *t = found_tag(j, m->name);
  if (m->gone) {
    if (t) *t = j->tags[--j->ntags];
    return true;
  }
  if (!t) {
    struct journal_tag *more = realloc(j->tags, (j->ntags + 1) * sizeof *more);
    if (!more) return false;
    j->tags = more;
    t = &j->tags[j->ntags++];
  }
  *t = (struct journal_tag){.uid = m->uid, .owned = m->owned, .shared = m->shared,
                            .paused_devices = m->paused_devices, .generation = m->generation};
  snprintf(t->name, sizeof t->name, "%s", m->name);
  return true;
}

/* Take one buffer record: the last of an id wins; false when out of
 * memory. */
static bool take_buffer(journal *j, const Gpumem__Wire__JournalBuffer *m) {
  struct journal_buffer *b = idmap_get(j->expected, m->id);
  if (m->gone) {
    idmap_del(j->expected, m->id);
    free(b);
    return true;
  }
  if (!b) {
    if (!(b = calloc(1, sizeof *b)) || idmap_put(j->expected, m->id, b) < 0) {
      free(b);
      return false;
    }
  }
  *b = (struct journal_buffer){.id = m->id, .uid = m->uid, .device = m->device, .size = m->size,
                               .flags = m->flags, .state = m->state, .kept = m->kept};
  snprintf(b->tag, sizeof b->tag, "%s", m->tag);
  snprintf(b->name, sizeof b->name, "%s", m->name);
  memcpy(b->secret, m->secret.data, sizeof b->secret);
  if (m->id > j->max_id) j->max_id = m->id;
  return true;
}

/* Why a record (the first one or not) is not one this daemon wrote, or
 * NULL: checked once here, at the edge, as a request is. */
static const char *record_wrong(const journal *j, const Gpumem__Wire__JournalRecord *r,
                                bool first, char *why, size_t len) {
  if (first != (r->body_case == GPUMEM__WIRE__JOURNAL_RECORD__BODY_HEADER))
    return first ? "it does not begin with a header" : "a second header";
  if (r->body_case == GPUMEM__WIRE__JOURNAL_RECORD__BODY_HEADER) {
    const Gpumem__Wire__JournalHeader *h = r->header;
    if (h->format != JOURNAL_FORMAT)
      snprintf(why, len, "it is of format %u (written by gpumemd %.40s); this daemon reads %d",
               h->format, h->daemon_version, JOURNAL_FORMAT);
    else if (strcmp(h->boot_id, j->boot_id) != 0)
      snprintf(why, len, "it was written before the machine started again (boot %.40s): "
               "the memory it describes is gone", h->boot_id);
    else if (strcmp(h->backend, j->who.backend) != 0 || h->devices != j->who.devices)
      snprintf(why, len, "it was written for backend %.20s with %u devices, not %s with %u",
               h->backend, h->devices, j->who.backend, j->who.devices);
    else if (h->uid != (uint32_t)geteuid())
      snprintf(why, len, "it was written by a daemon of uid %u, not %u", h->uid,
               (unsigned)geteuid());
    else
      return NULL;
    return why;
  }
  if (r->body_case == GPUMEM__WIRE__JOURNAL_RECORD__BODY_TAG) {
    const Gpumem__Wire__JournalTag *t = r->tag;
    if (!wire_tag_valid(t->name)) return "a tag record with a name no tag has";
    if (j->who.devices < 64 && (t->paused_devices >> j->who.devices))
      return "a tag paused on devices there are not";
    return NULL;
  }
  if (r->body_case == GPUMEM__WIRE__JOURNAL_RECORD__BODY_BUFFER) {
    const Gpumem__Wire__JournalBuffer *b = r->buffer;
    if (b->id == 0) return "a buffer record of id 0";
    if (b->gone) return NULL;
    if (!wire_tag_valid(b->tag)) return "a buffer record with a tag name no tag has";
    if (b->device >= j->who.devices) return "a buffer record of a device there is not";
    if (b->size == 0) return "a buffer record of 0 bytes";
    if (b->secret.len != WIRE_SECRET_SIZE) return "a buffer record without its secret";
    if (b->state != GPUMEM__WIRE__BUFFER_STATE__ACTIVE &&
        b->state != GPUMEM__WIRE__BUFFER_STATE__PAUSED)
      return "a buffer record in a state that is not kept";
    return NULL;
  }
  return "a record of a kind this daemon does not write";
}

/* Read the records of data (len bytes): 0, or -EINVAL with the journal's
 * words saying why it is not trusted. A cut last record is dropped. */
static int parse(journal *j, const uint8_t *data, size_t len) {
  char why[256];
  if (len < sizeof MAGIC || memcmp(data, MAGIC, sizeof MAGIC) != 0) {
    say(j, "it is not a gpumemd journal (no magic)");
    return -EINVAL;
  }
  size_t at = sizeof MAGIC;
  for (size_t k = 0; at < len; k++) {
    if (len - at < FRAME_HEAD || len - at - FRAME_HEAD < get_u32(data + at)) {
      if (k == 0) break; /* no header: judged below */
      say(j, "its last record was cut (%zu bytes; a daemon that died while writing it, "
             "before answering it): dropped", len - at);
      return 0;
    }
    uint32_t n = get_u32(data + at);
    const uint8_t *rec = data + at + FRAME_HEAD;
    Gpumem__Wire__JournalRecord *r = NULL;
    const char *wrong;
    if (n > RECORD_MAX || XXH32(rec, n, 0) != get_u32(data + at + 4))
      wrong = "a record's checksum does not match";
    else if (!(r = gpumem__wire__journal_record__unpack(NULL, n, rec)))
      wrong = "a record does not decode";
    else
      wrong = record_wrong(j, r, k == 0, why, sizeof why);
    bool ok = !wrong;
    if (ok && r->body_case == GPUMEM__WIRE__JOURNAL_RECORD__BODY_TAG) ok = take_tag(j, r->tag);
    if (ok && r->body_case == GPUMEM__WIRE__JOURNAL_RECORD__BODY_BUFFER)
      ok = take_buffer(j, r->buffer);
    if (!wrong && !ok) wrong = "out of memory reading it";
    if (r) gpumem__wire__journal_record__free_unpacked(r, NULL);
    if (wrong) {
      say(j, "%s (record %zu, byte %zu)", wrong, k, at);
      return -EINVAL;
    }
    at += FRAME_HEAD + n;
  }
  if (at == sizeof MAGIC) {
    say(j, "it has no header");
    return -EINVAL;
  }
  return 0;
}

/* Forget what was found (a rejected journal's partial reading). */
static void forget_found(journal *j) {
  free(j->tags);
  j->tags = NULL;
  j->ntags = 0;
  journal_expire(j, NULL, NULL);
  j->max_id = 0;
}

/* Read and judge the file at the journal's path: 0 with j->found set, or
 * a negative errno with err filled when it cannot even be read. */
static int load(journal *j, char *err, size_t errlen) {
  int fd = open(j->path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0 && errno == ENOENT) {
    j->found = JOURNAL_NONE;
    return 0;
  }
  struct stat st;
  if (fd < 0 && errno != ELOOP) {
    snprintf(err, errlen, "journal %s: %s", j->path, strerror(errno));
    return -errno;
  }
  uint8_t *data = NULL;
  size_t len = 0;
  j->found = JOURNAL_REJECTED;
  if (fd < 0 || fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
    say(j, "it is not a regular file");
  } else if (st.st_uid != geteuid()) {
    say(j, "it is owned by uid %u, not by this daemon's uid %u", (unsigned)st.st_uid,
        (unsigned)geteuid());
  } else if (st.st_mode & 077) {
    say(j, "its mode is %04o: others could read its secrets or change it",
        (unsigned)(st.st_mode & 07777));
  } else if ((uint64_t)st.st_size > FILE_MAX) {
    say(j, "it is %llu bytes, more than a daemon writes", (unsigned long long)st.st_size);
  } else if (!(data = malloc((size_t)st.st_size + 1))) {
    say(j, "out of memory reading it");
  } else {
    for (ssize_t got = 1; got > 0 && len < (size_t)st.st_size; len += (size_t)got)
      if ((got = read(fd, data + len, (size_t)st.st_size - len)) < 0) {
        got = 0;
        say(j, "reading it: %s", strerror(errno));
        len = SIZE_MAX;
      }
    if (len != SIZE_MAX && parse(j, data, len) == 0) j->found = JOURNAL_LOADED;
  }
  free(data);
  if (fd >= 0) close(fd);
  if (j->found == JOURNAL_LOADED) return 0;
  forget_found(j);
  char aside[sizeof j->path + 16];
  snprintf(aside, sizeof aside, "%s.rejected", j->path);
  if (rename(j->path, aside) < 0) {
    snprintf(err, errlen, "journal %s is not to be trusted (%s) and cannot be put aside: %s",
             j->path, j->why, strerror(errno));
    return -errno;
  }
  return 0;
}

/* Open the journal: lock, read, judge. */
journal *journal_open(const char *path, const struct journal_identity *who, char *err,
                      size_t errlen) {
  journal *j = calloc(1, sizeof *j);
  if (!j || !(j->expected = idmap_create())) {
    snprintf(err, errlen, "out of memory");
    free(j);
    return NULL;
  }
  j->fd = -1;
  j->who = *who;
  snprintf(j->path, sizeof j->path, "%s", path);
  read_boot_id(j->boot_id, sizeof j->boot_id);
  snprintf(j->version, sizeof j->version, "%d.%d.%d", GPUMEM_VERSION_MAJOR, GPUMEM_VERSION_MINOR,
           GPUMEM_VERSION_PATCH);
  char lock[sizeof j->path + 8];
  snprintf(lock, sizeof lock, "%s.lock", path);
  j->lock_fd = open(lock, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (j->lock_fd < 0 || flock(j->lock_fd, LOCK_EX | LOCK_NB) < 0) {
    snprintf(err, errlen, "journal %s: %s", lock,
             errno == EWOULDBLOCK ? "another gpumemd holds it" : strerror(errno));
    journal_close(j);
    return NULL;
  }
  if (load(j, err, errlen) < 0) {
    journal_close(j);
    return NULL;
  }
  return j;
}

/* What journal_open found. */
enum journal_found journal_found(const journal *j, const char **why) {
  *why = j->why;
  return j->found;
}

/* The tags found. */
const struct journal_tag *journal_tags(const journal *j, size_t *n) {
  *n = j->ntags;
  return j->tags;
}

/* The largest buffer id found. */
uint64_t journal_max_id(const journal *j) { return j->max_id; }

/* A buffer expected under id. */
const struct journal_buffer *journal_expected(const journal *j, uint64_t id) {
  return id ? idmap_get(j->expected, id) : NULL;
}

/* Buffers expected. */
size_t journal_expected_count(const journal *j) { return idmap_count(j->expected); }

/* The buffers expected, into out. */
size_t journal_expected_list(const journal *j, const struct journal_buffer **out, size_t max) {
  return idmap_values(j->expected, (void **)out, max);
}

/* The persistent buffer expected of uid under name. */
int journal_expected_named(const journal *j, uint32_t uid, const char *name,
                           const struct journal_buffer **out) {
  size_t n = idmap_count(j->expected);
  *out = NULL;
  if (!n || !name || !name[0]) return 0;
  const struct journal_buffer **all = malloc(n * sizeof *all);
  if (!all) return -ENOMEM;
  n = idmap_values(j->expected, (void **)all, n);
  for (size_t i = 0; i < n && !*out; i++)
    if (all[i]->uid == uid && strcmp(all[i]->name, name) == 0) *out = all[i];
  free(all);
  return *out != NULL;
}

/* Mark an expected buffer charged or not. */
void journal_set_charged(journal *j, uint64_t id, bool charged) {
  struct journal_buffer *b = idmap_get(j->expected, id);
  if (b) b->charged = charged;
}

/* A buffer expected was re-registered. */
void journal_claim(journal *j, uint64_t id) {
  struct journal_buffer *b = idmap_get(j->expected, id);
  if (!b) return;
  idmap_del(j->expected, id);
  free(b);
  frame_buffer(&j->out, &(struct journal_buffer){.id = id}, true); /* back under a new id */
}

/* Give up on every buffer still expected. */
void journal_expire(journal *j, void (*fn)(void *ctx, const struct journal_buffer *b),
                    void *ctx) {
  size_t n = idmap_count(j->expected);
  struct journal_buffer **all = malloc((n + 1) * sizeof *all);
  if (!all) return; /* they stay expected: the next call tries again */
  n = idmap_values(j->expected, (void **)all, n);
  for (size_t i = 0; i < n; i++) {
    if (fn) fn(ctx, all[i]);
    idmap_del(j->expected, all[i]->id);
    free(all[i]);
  }
  free(all);
}

/* Remove the journal after a failed write: a daemon after this one finds
 * none (and trusts re-registrations as before) rather than a stale one. */
static void fail(journal *j, const char *what, int e) {
  if (!j->broken)
    log_error("journal %s: %s: %s; removed until it can be written again (a daemon started "
              "meanwhile would trust re-registrations as one without a journal does)",
              j->path, what, strerror(e));
  j->broken = true;
  if (j->fd >= 0) close(j->fd);
  j->fd = -1;
  unlink(j->path);
  j->out.len = 0;
  j->out.failed = false;
}

/* Write all of len bytes to fd. */
static int write_all(int fd, const uint8_t *p, size_t len) {
  while (len) {
    ssize_t n = write(fd, p, len);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -errno;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* Write the journal whole. */
int journal_rewrite(journal *j, journal_fill_fn fill, void *ctx, char *err, size_t errlen) {
  j->fill = fill;
  j->fill_ctx = ctx;
  struct bytes all = {0};
  frame_header(j, &all);
  struct bytes pending = j->out; /* what fill writes goes to all */
  j->out = all;
  if (fill) fill(ctx, j);
  size_t n = idmap_count(j->expected);
  struct journal_buffer **exp = malloc((n + 1) * sizeof *exp);
  if (!exp) j->out.failed = true;
  n = exp ? idmap_values(j->expected, (void **)exp, n) : 0;
  for (size_t i = 0; i < n; i++) frame_buffer(&j->out, exp[i], false);
  free(exp);
  all = j->out;
  free(pending.data); /* the whole says it all */
  j->out = (struct bytes){0};
  char tmp[sizeof j->path + 8];
  snprintf(tmp, sizeof tmp, "%s.new", j->path);
  int rc = all.failed ? -ENOMEM : 0, fd = -1;
  if (!rc) {
    unlink(tmp);
    fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) rc = -errno;
  }
  if (!rc) rc = write_all(fd, all.data, all.len);
  if (!rc && rename(tmp, j->path) < 0) rc = -errno;
  free(all.data);
  if (rc) {
    if (fd >= 0) close(fd);
    unlink(tmp);
    snprintf(err, errlen, "writing journal %s: %s", j->path, strerror(-rc));
    fail(j, "writing it whole", -rc);
    return rc;
  }
  if (j->fd >= 0) close(j->fd);
  j->fd = fd;
  j->size = j->whole = all.len;
  if (j->broken) log_info("journal %s: written again", j->path);
  j->broken = false;
  return 0;
}

/* Append a tag's record. */
void journal_put_tag(journal *j, const struct journal_tag *t, bool gone) {
  if (!j) return;
  Gpumem__Wire__JournalTag m = GPUMEM__WIRE__JOURNAL_TAG__INIT;
  m.name = (char *)t->name;
  m.gone = gone;
  if (!gone) {
    m.uid = t->uid;
    m.owned = t->owned;
    m.shared = t->shared;
    m.paused_devices = t->paused_devices;
    m.generation = t->generation;
  }
  Gpumem__Wire__JournalRecord r = GPUMEM__WIRE__JOURNAL_RECORD__INIT;
  r.body_case = GPUMEM__WIRE__JOURNAL_RECORD__BODY_TAG;
  r.tag = &m;
  frame_record(&j->out, &r);
}

/* Append a buffer's record. */
void journal_put_buffer(journal *j, const struct journal_buffer *b) {
  if (j) frame_buffer(&j->out, b, false);
}

/* Append that a buffer was freed. */
void journal_put_gone(journal *j, uint64_t id) {
  if (!j) return;
  struct journal_buffer b = {.id = id};
  frame_buffer(&j->out, &b, true);
}

/* Write what was appended, or the whole when due. */
int journal_flush(journal *j) {
  if (!journal_pending(j)) return 0;
  bool grown = j->size > GROWTH * j->whole && j->size > GROWTH_MIN;
  if (j->broken || j->out.failed || grown || j->fd < 0) {
    char err[256];
    return journal_rewrite(j, j->fill, j->fill_ctx, err, sizeof err);
  }
  int rc = write_all(j->fd, j->out.data, j->out.len);
  if (rc) {
    fail(j, "appending", -rc);
    return rc;
  }
  j->size += j->out.len;
  j->out.len = 0;
  return 0;
}

/* Whether records (or a rewrite) wait. */
bool journal_pending(const journal *j) {
  return j && (j->out.len || j->out.failed || j->broken);
}

/* The file's size now and at its last rewrite. */
void journal_size(const journal *j, uint64_t *bytes, uint64_t *whole) {
  *bytes = j->size;
  *whole = j->whole;
}

/* Flush and let go. */
void journal_close(journal *j) {
  if (!j) return;
  if (j->fd >= 0 || j->broken) journal_flush(j);
  if (j->fd >= 0) close(j->fd);
  if (j->lock_fd >= 0) close(j->lock_fd);
  free(j->out.data);
  forget_found(j);
  idmap_destroy(j->expected);
  free(j);
}
