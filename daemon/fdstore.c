#include "fdstore.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#endif

#include "common/log.h"

/* A chunk systemd passed back. */
struct found {
  uint64_t id, size;
  size_t k;
  int fd;
};

struct fdstore {
  bool enabled;
  struct found *found;
  size_t nfound, cap;
  bool warned; /* a failed store was logged */
};

/* A store. */
fdstore *fdstore_create(void) {
  fdstore *s = calloc(1, sizeof *s);
  if (!s) return NULL;
#ifdef HAVE_SYSTEMD
  const char *ns = getenv("NOTIFY_SOCKET");
  s->enabled = ns && *ns;
#endif
  return s;
}

/* Whether it stores. */
bool fdstore_enabled(const fdstore *s) { return s && s->enabled; }

/* The name of chunk k of buffer id. */
static void name_of(char *out, size_t len, uint64_t id, size_t k, uint64_t size) {
  snprintf(out, len, "gpumem.%" PRIu64 ".%zu.%" PRIu64, id, k, size);
}

/* Read gpumem.ID.K.SIZE. */
static bool parse_name(const char *name, uint64_t *id, size_t *k, uint64_t *size) {
  char check[96];
  unsigned long long a, c;
  unsigned long b;
  if (sscanf(name, "gpumem.%llu.%lu.%llu", &a, &b, &c) != 3) return false;
  name_of(check, sizeof check, a, b, c);
  if (strcmp(check, name) != 0 || !a || !c) return false; /* canonical only */
  *id = a;
  *k = b;
  *size = c;
  return true;
}

/* Take an fd passed back. */
bool fdstore_found(fdstore *s, const char *name, int fd) {
  struct found f;
  if (!parse_name(name, &f.id, &f.k, &f.size)) return false;
  if (s->nfound == s->cap) {
    size_t cap = s->cap ? 2 * s->cap : 64;
    struct found *more = realloc(s->found, cap * sizeof *more);
    if (!more) {
      close(fd); /* ours, and no room to keep it: its buffer will not come back */
      return true;
    }
    s->found = more;
    s->cap = cap;
  }
  f.fd = fd;
  s->found[s->nfound++] = f;
  return true;
}

#ifdef HAVE_SYSTEMD
/* Send one notification with fds. */
static int notify(const char *state, const int *fds, unsigned n) {
  int rc = sd_pid_notify_with_fds(0, 0, state, fds, n);
  return rc > 0 ? 0 : rc < 0 ? rc : -ENOTCONN;
}
#endif

/* Store copies of a buffer's chunks. */
int fdstore_put(fdstore *s, uint64_t id, const int *fds, const uint64_t *sizes, size_t n) {
  if (!fdstore_enabled(s)) return 0;
#ifdef HAVE_SYSTEMD
  for (size_t k = 0; k < n; k++) {
    char state[160], name[96];
    name_of(name, sizeof name, id, k, sizes[k]);
    snprintf(state, sizeof state, "FDSTORE=1\nFDNAME=%s", name);
    int rc = notify(state, &fds[k], 1);
    if (rc < 0) {
      if (!s->warned)
        log_warn("systemd's fd store: %s: %s (is FileDescriptorStoreMax= set?): persistent "
                 "buffers no process holds do not outlive this daemon",
                 name, strerror(-rc));
      s->warned = true;
      fdstore_remove(s, id, sizes, k);
      return rc;
    }
  }
  return 0;
#else
  (void)id, (void)fds, (void)sizes, (void)n;
  return 0;
#endif
}

/* Have systemd close a buffer's chunks, and wait for it. */
int fdstore_remove(fdstore *s, uint64_t id, const uint64_t *sizes, size_t n) {
  if (!fdstore_enabled(s) || !n) return 0;
#ifdef HAVE_SYSTEMD
  int rc = 0;
  for (size_t k = 0; k < n && !rc; k++) {
    char state[160], name[96];
    name_of(name, sizeof name, id, k, sizes[k]);
    snprintf(state, sizeof state, "FDSTOREREMOVE=1\nFDNAME=%s", name);
    rc = notify(state, NULL, 0);
  }
  /* systemd handles notifications in order: past the barrier, it has
   * closed them. */
  if (!rc) rc = sd_notify_barrier(0, (uint64_t)FDSTORE_BARRIER_MS * 1000);
  if (rc < 0)
    log_error("systemd's fd store: buffer %" PRIu64 ": cannot know that systemd closed its "
              "chunks: %s", id, strerror(-rc));
  return rc < 0 ? rc : 0;
#else
  (void)id, (void)sizes;
  return 0;
#endif
}

/* Chunks of a buffer passed back. */
size_t fdstore_chunks(const fdstore *s, uint64_t id) {
  size_t n = 0;
  for (size_t i = 0; s && i < s->nfound; i++) n += s->found[i].id == id;
  return n;
}

/* Take a buffer's chunks passed back. */
bool fdstore_take(fdstore *s, uint64_t id, size_t n, int *fds, uint64_t *sizes) {
  size_t got = 0;
  if (!s) return false;
  for (size_t i = 0; i < s->nfound; i++)
    if (s->found[i].id == id && s->found[i].k < n) got++;
  if (!n || got != n) return false;
  for (size_t k = 0; k < n; k++) fds[k] = -1;
  for (size_t i = 0; i < s->nfound; i++) {
    struct found *f = &s->found[i];
    if (f->id != id || f->k >= n) continue;
    if (fds[f->k] >= 0) return false; /* one chunk twice: not a whole buffer */
    fds[f->k] = f->fd;
    sizes[f->k] = f->size;
  }
  size_t at = 0; /* the others stay */
  for (size_t i = 0; i < s->nfound; i++)
    if (s->found[i].id != id || s->found[i].k >= n) s->found[at++] = s->found[i];
  s->nfound = at;
  return true;
}

/* Buffers left. */
size_t fdstore_left(const fdstore *s) {
  size_t n = 0;
  for (size_t i = 0; s && i < s->nfound; i++) {
    bool first = true;
    for (size_t j = 0; j < i && first; j++) first = s->found[j].id != s->found[i].id;
    n += first;
  }
  return n;
}

/* Let go of what was not taken, here and in systemd. */
void fdstore_forget_left(fdstore *s) {
  if (!s) return;
  for (size_t i = 0; i < s->nfound; i++) {
    struct found *f = &s->found[i];
    log_warn("systemd's fd store passed back chunk %zu of buffer %" PRIu64 " (%" PRIu64
             " bytes), which no journal names: let go of", f->k, f->id, f->size);
    close(f->fd);
#ifdef HAVE_SYSTEMD
    if (s->enabled) {
      char state[160], name[96];
      name_of(name, sizeof name, f->id, f->k, f->size);
      snprintf(state, sizeof state, "FDSTOREREMOVE=1\nFDNAME=%s", name);
      notify(state, NULL, 0);
    }
#endif
  }
  s->nfound = 0;
}

/* Free the store. */
void fdstore_free(fdstore *s) {
  if (!s) return;
  for (size_t i = 0; i < s->nfound; i++) close(s->found[i].fd);
  free(s->found);
  free(s);
}
