/* The plan of one re-registration. A buffer is left out (and stays
 * mapped, unmanaged) when it is legacy IPC memory of the daemon that went
 * away, is on a device the new daemon does not manage, is partly mapped
 * after a failed unmap, has more chunks than a frame carries, or cannot
 * be exported again; a buffer no longer the caller's is left out silently
 * (its free is settled by the connection's end). */
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "adopt.h"
#include "buffer.h"
#include "common/frame.h"
#include "gpumem.h"

/* One AdoptRequest: a run of the plan's buffers, and its fds. */
struct batch {
  size_t first, n; /* of the plan's buffers */
  Gpumem__Wire__AdoptRequest req;
  wire_env env;
  int fds[FRAME_MAX_FDS];
  size_t nfds, bytes;
  bool taken; /* the fds went with the request */
};

struct adopt {
  gpumem_buffer **bufs;           /* the buffers re-registered, in request order */
  Gpumem__Wire__AdoptBuffer *abs; /* and their wire form */
  Gpumem__Wire__AdoptBuffer **abp;
  uint8_t (*secrets)[WIRE_SECRET_SIZE]; /* each buffer's, for its AdoptBuffer */
  size_t n;
  struct batch **batches;
  size_t nbatches;
  size_t adopted, skipped;
  char words[320];
};

/* Note a buffer left out; the first one's words are kept. */
__attribute__((format(printf, 2, 3))) static void skip(adopt *a, const char *fmt, ...) {
  if (a->skipped++ == 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->words, sizeof a->words, fmt, ap);
    va_end(ap);
  }
}

/* Why a buffer cannot be re-registered with the daemon whose device map
 * is map (NULL: it can), its device there in *dev. */
static const char *unfit(gpumem_buffer *b, const int *map, int *dev) {
  const uint64_t *sizes;
  *dev = hello_node_device(map, gpumem_buffer_device(b));
  if (buffer_ipc(b)) return " is legacy IPC memory of the daemon that went away";
  if (*dev < 0) return ": its device is not one gpumemd manages";
  if (buffer_partial(b)) return " is partly mapped after a failed unmap";
  if (buffer_chunks(b, &sizes) > FRAME_MAX_FDS) return " has more chunks than one frame carries";
  return NULL;
}

/* Add a buffer to the last request, or to a new one when that one is
 * full; takes its nf fds. False when out of memory (nothing taken). */
static bool add(adopt *a, gpumem_buffer *b, int dev, const int *fds, size_t nf) {
  const uint64_t *sizes;
  Gpumem__Wire__AdoptBuffer *ab = &a->abs[a->n];
  gpumem__wire__adopt_buffer__init(ab);
  ab->tag = (char *)gpumem_buffer_tag(b);
  ab->name = (char *)gpumem_buffer_name(b);
  ab->device = (uint32_t)dev;
  ab->size = gpumem_buffer_size(b);
  ab->flags = gpumem_buffer_flags(b);
  ab->n_chunk_sizes = buffer_chunks(b, &sizes);
  ab->chunk_sizes = (uint64_t *)sizes;
  ab->paused = nf == 0;
  ab->generation = gpumem_buffer_generation(b);
  ab->old_id = gpumem_buffer_id(b);
  ab->secret.len = buffer_secret(b, a->secrets[a->n]);
  ab->secret.data = a->secrets[a->n];
  size_t sz = gpumem__wire__adopt_buffer__get_packed_size(ab) + 16;
  struct batch *t = a->nbatches ? a->batches[a->nbatches - 1] : NULL;
  if (!t || t->nfds + nf > FRAME_MAX_FDS || t->bytes + sz > WIRE_MAX_REQUEST - 256) {
    struct batch **more = realloc(a->batches, (a->nbatches + 1) * sizeof *more);
    if (more) a->batches = more;
    if (!more || !(t = calloc(1, sizeof *t))) return false;
    t->first = a->n;
    a->batches[a->nbatches++] = t;
  }
  a->bufs[a->n] = b;
  a->abp[a->n] = ab;
  a->n++;
  t->n++;
  if (nf) memcpy(t->fds + t->nfds, fds, nf * sizeof *fds);
  t->nfds += nf;
  t->bytes += sz;
  return true;
}

/* Plan the re-registration of every buffer. */
adopt *adopt_create(buffers *r, hello *h) {
  size_t n;
  gpumem_buffer **all = buffers_list(r, &n);
  adopt *a = calloc(1, sizeof *a);
  if (a) {
    a->bufs = calloc(n + 1, sizeof *a->bufs);
    a->abs = calloc(n + 1, sizeof *a->abs);
    a->abp = calloc(n + 1, sizeof *a->abp);
    a->secrets = calloc(n + 1, sizeof *a->secrets);
  }
  if (!a || !a->bufs || !a->abs || !a->abp || !a->secrets || (n && !all)) {
    free(all);
    adopt_destroy(a);
    return NULL;
  }
  int map[GPUMEM_MAX_DEVICES];
  hello_local_map(h, map);
  int fds[FRAME_MAX_FDS];
  for (size_t i = 0; i < n; i++) {
    gpumem_buffer *b = all[i];
    buffer_drop_backup(b); /* the daemon that held it is gone */
    if (buffer_doomed(b)) continue;
    unsigned long long id = (unsigned long long)gpumem_buffer_id(b);
    int dev;
    const char *why = unfit(b, map, &dev);
    const uint64_t *sizes;
    size_t nf = gpumem_buffer_mapped(b) ? buffer_chunks(b, &sizes) : 0;
    if (why) {
      skip(a, "buffer %llu%s", id, why);
    } else if (nf && buffer_export(b, fds) < 0) {
      skip(a, "buffer %llu: %.250s", id, gpumem_last_error());
    } else if (!add(a, b, dev, fds, nf)) {
      for (size_t k = 0; k < nf; k++) close(fds[k]);
      skip(a, "out of memory");
    }
  }
  free(all);
  for (size_t i = 0; i < a->nbatches; i++) {
    struct batch *t = a->batches[i];
    gpumem__wire__adopt_request__init(&t->req);
    t->req.buffers = &a->abp[t->first];
    t->req.n_buffers = t->n;
    gpumem__wire__envelope__init(&t->env);
    t->env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ADOPT;
    t->env.adopt = &t->req;
    t->env.fd_count = (uint32_t)t->nfds;
  }
  return a;
}

/* Free a plan. */
void adopt_destroy(adopt *a) {
  if (!a) return;
  for (size_t i = 0; i < a->nbatches; i++) {
    struct batch *t = a->batches[i];
    for (size_t k = 0; !t->taken && k < t->nfds; k++) close(t->fds[k]);
    free(t);
  }
  free(a->batches);
  free(a->bufs);
  free(a->abs);
  free(a->abp);
  free(a->secrets);
  free(a);
}

/* The number of requests. */
size_t adopt_count(const adopt *a) { return a->nbatches; }

/* Request i and its fds. */
wire_env *adopt_request(adopt *a, size_t i, int **fds, size_t *nfds) {
  struct batch *t = a->batches[i];
  t->taken = true;
  *fds = t->fds;
  *nfds = t->nfds;
  return &t->env;
}

/* Take the answer to request i. */
int adopt_answer(adopt *a, size_t i, buffers *r, const wire_env *reply, const char *why) {
  struct batch *t = a->batches[i];
  if (reply && reply->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ADOPT_REPLY) {
    const Gpumem__Wire__AdoptReply *ar = reply->adopt_reply;
    if (ar->n_buffer_ids != t->n || (ar->n_secrets && ar->n_secrets != t->n)) return -EPROTO;
    for (size_t k = 0; k < t->n; k++) {
      gpumem_buffer *b = a->bufs[t->first + k];
      if (ar->buffer_ids[k] == 0 || buffers_know(r, b, ar->buffer_ids[k]) < 0) return -EPROTO;
      if (ar->n_secrets) buffer_set_secret(b, ar->secrets[k].data, ar->secrets[k].len);
    }
    a->adopted += t->n;
    return 0;
  }
  size_t had = a->skipped;
  a->skipped += t->n;
  if (had) return 0;
  if (reply && reply->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR)
    snprintf(a->words, sizeof a->words, "%zu buffers: %s: %s", t->n,
             wire_code_name(reply->error->code), reply->error->message);
  else
    snprintf(a->words, sizeof a->words, "%zu buffers: %s", t->n,
             reply ? "gpumemd answered with something else" : why);
  return 0;
}

/* What the re-registration did. */
size_t adopt_result(const adopt *a, size_t *skipped, const char **words) {
  *skipped = a->skipped;
  *words = a->words;
  return a->adopted;
}
