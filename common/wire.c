#include "wire.h"

#include "frame.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* True if tag is 1..WIRE_TAG_MAX characters of [A-Za-z0-9_.-]. */
bool wire_tag_valid(const char *tag) {
  size_t n = 0;
  for (const char *p = tag; *p; p++, n++) {
    char c = *p;
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
              (c >= '0' && c <= '9') || c == '_' || c == '.' || c == '-';
    if (!ok || n >= WIRE_TAG_MAX) return false;
  }
  return n > 0;
}

/* Length of the UTF-8 sequence at p (0 if it is not one: truncated,
 * overlong, a surrogate or past U+10FFFF), its code point in *cp. */
static size_t utf8_next(const unsigned char *p, uint32_t *cp) {
  static const uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
  size_t n = p[0] < 0x80 ? 1 : (p[0] & 0xe0) == 0xc0 ? 2 : (p[0] & 0xf0) == 0xe0 ? 3
           : (p[0] & 0xf8) == 0xf0 ? 4 : 0;
  if (n == 0) return 0;
  uint32_t c = n == 1 ? p[0] : p[0] & (0x7fu >> n);
  for (size_t i = 1; i < n; i++) {
    if ((p[i] & 0xc0) != 0x80) return 0;
    c = c << 6 | (p[i] & 0x3fu);
  }
  if (c < min[n] || c > 0x10ffff || (c >= 0xd800 && c <= 0xdfff)) return 0;
  *cp = c;
  return n;
}

/* True if name is at most WIRE_NAME_MAX bytes of UTF-8 without control
 * characters (C0, DEL or C1), so that it is safe in a log or a terminal. */
bool wire_name_valid(const char *name) { return wire_text_valid(name, WIRE_NAME_MAX); }

/* The character at p: its length (0 if not UTF-8), whether a control. */
size_t wire_char(const char *p, bool *control) {
  uint32_t c = 0;
  size_t n = utf8_next((const unsigned char *)p, &c);
  *control = n != 0 && (c < 0x20 || (c >= 0x7f && c < 0xa0));
  return n;
}

/* True if the character at p is printable UTF-8; its length in *n. */
static bool printable_at(const unsigned char *p, size_t *n) {
  bool control;
  *n = wire_char((const char *)p, &control);
  return *n != 0 && !control;
}

/* True if s is at most max bytes of UTF-8 without control characters. */
bool wire_text_valid(const char *s, size_t max) {
  if (!s || strnlen(s, max + 1) > max) return false;
  size_t n;
  for (const unsigned char *p = (const unsigned char *)s; *p; p += n)
    if (!printable_at(p, &n)) return false;
  return true;
}

/* Make s valid text in place: every byte of a control character or of
 * what is not UTF-8 becomes '?'. */
void wire_text_clean(char *s) {
  size_t n;
  for (unsigned char *p = (unsigned char *)s; *p;) {
    if (printable_at(p, &n)) {
      p += n;
    } else {
      /* A control character is one byte or two (C1: 0xc2 0x80-0x9f). */
      size_t bad = n ? n : 1;
      for (size_t i = 0; i < bad; i++) p[i] = '?';
      p += bad;
    }
  }
}

/* The protocol's name for an error code. */
const char *wire_code_name(wire_code code) {
  const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(
      &gpumem__wire__error_code__descriptor, (int)code);
  return v ? v->name : "UNKNOWN";
}

/* The protocol's name for a buffer state. */
const char *wire_state_name(int state) {
  const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(
      &gpumem__wire__buffer_state__descriptor, state);
  return v ? v->name : "UNKNOWN";
}

/* An envelope of this id carrying msg: the oneof's member for body_case is
 * found through the envelope's descriptor, which also says that msg is of
 * its type. */
wire_env wire_envelope(uint64_t id, Gpumem__Wire__Envelope__BodyCase body_case, void *msg) {
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  const ProtobufCFieldDescriptor *f =
      protobuf_c_message_descriptor_get_field(&gpumem__wire__envelope__descriptor,
                                              (unsigned)body_case);
  if (!f || f->descriptor != ((const ProtobufCMessage *)msg)->descriptor) abort();
  env.id = id;
  env.body_case = body_case;
  memcpy((char *)&env + f->offset, &msg, sizeof msg);
  return env;
}

/* Serialize an envelope into a malloc'd buffer. */
uint8_t *wire_pack(const wire_env *env, size_t *len) {
  size_t n = gpumem__wire__envelope__get_packed_size(env);
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf) return NULL;
  *len = gpumem__wire__envelope__pack(env, buf);
  return buf;
}

/* Parse a payload into an envelope. */
wire_env *wire_unpack(const uint8_t *data, size_t len) {
  return gpumem__wire__envelope__unpack(NULL, len, data);
}

/* Free an envelope returned by wire_unpack. */
void wire_env_free(wire_env *env) {
  if (env) gpumem__wire__envelope__free_unpacked(env, NULL);
}

__attribute__((format(printf, 4, 5))) static wire_code
refuse(wire_code code, char *why, size_t whylen, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, whylen, fmt, ap);
  va_end(ap);
  return code;
}

/* Refuse a tag that is not valid, quoting it only if it is printable. */
static wire_code refuse_tag(const char *tag, char *why, size_t whylen) {
  if (!wire_text_valid(tag, WIRE_TAG_MAX + 1)) tag = "(not printable)";
  return refuse(GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT, why, whylen,
                "invalid tag '%.*s': 1-%d characters of [A-Za-z0-9_.-]", WIRE_TAG_MAX + 1, tag,
                WIRE_TAG_MAX);
}

/* Tags and devices of a pause or resume: every tag valid (none: all). */
static wire_code check_selection(size_t ntags, char **tags, size_t ndevs,
                                 char *why, size_t whylen) {
  if (ntags > WIRE_MAX_TAGS)
    return refuse(GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT, why, whylen,
                  "too many tags (%zu, at most %d)", ntags, WIRE_MAX_TAGS);
  for (size_t i = 0; i < ntags; i++)
    if (!wire_tag_valid(tags[i])) return refuse_tag(tags[i], why, whylen);
  if (ndevs > GPUMEM_MAX_DEVICES)
    return refuse(GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT, why, whylen,
                  "too many devices (%zu)", ndevs);
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Whose buffers a pause or resume covers: the caller's own, or sessions
 * by pid and name prefix, never both. */
static wire_code check_scope(size_t npids, const uint32_t *pids, const char *prefix, bool own,
                             char *why, size_t whylen) {
  const wire_code bad = GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT;
  bool has_prefix = prefix && prefix[0];
  if (own && (npids || has_prefix))
    return refuse(bad, why, whylen,
                  "own covers the caller's buffers only: no pids or session_prefix with it");
  if (npids > WIRE_MAX_PIDS)
    return refuse(bad, why, whylen, "too many pids (%zu, at most %d)", npids, WIRE_MAX_PIDS);
  for (size_t i = 0; i < npids; i++)
    if (pids[i] == 0) return refuse(bad, why, whylen, "pid 0 names no process");
  if (has_prefix && !wire_name_valid(prefix))
    return refuse(bad, why, whylen,
                  "invalid session_prefix: at most %d bytes of UTF-8 without control characters",
                  WIRE_NAME_MAX);
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Flags a client may ask for. */
static bool flags_ok(uint32_t flags) {
  const uint32_t policy = GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_RELEASE |
                          GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_PAGEABLE |
                          GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_DISK;
  if ((flags & policy) && !(flags & GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP))
    return false; /* a policy for a backup there is none of */
  if ((flags & GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_DISK) &&
      !(flags & GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_RELEASE))
    return false; /* a backup on disk lets go of its host memory */
  return !(flags & ~(uint32_t)(GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP |
                               GPUMEM__WIRE__BUFFER_FLAG__FLAG_IPC_LEGACY |
                               GPUMEM__WIRE__BUFFER_FLAG__FLAG_ALLOW_PAUSED |
                               GPUMEM__WIRE__BUFFER_FLAG__FLAG_PERSIST | policy));
}

/* A persistent buffer's name against its flags: one exactly when
 * FLAG_PERSIST, valid, and never with IPC_LEGACY. */
static wire_code check_persist(uint32_t flags, const char *name, const char *what, char *why,
                               size_t whylen) {
  const wire_code bad = GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT;
  bool persist = flags & GPUMEM__WIRE__BUFFER_FLAG__FLAG_PERSIST;
  if (!persist && name && name[0])
    return refuse(bad, why, whylen, "%sa name is for PERSIST buffers only", what);
  if (!persist) return GPUMEM__WIRE__ERROR_CODE__OK;
  if (!name || !wire_tag_valid(name))
    return refuse(bad, why, whylen,
                  "%sa PERSIST buffer needs a name: 1-%d characters of [A-Za-z0-9_.-]", what,
                  WIRE_TAG_MAX);
  if (flags & GPUMEM__WIRE__BUFFER_FLAG__FLAG_IPC_LEGACY)
    return refuse(bad, why, whylen, "%sIPC_LEGACY buffers cannot be PERSIST", what);
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Sizes of pieces (chunks, backup pieces): none zero, adding up without
 * overflow (into *sum); true for none. */
static bool pieces_ok_sum(const uint64_t *sizes, size_t n, uint64_t *sum) {
  *sum = 0;
  for (size_t i = 0; i < n; i++) {
    if (sizes[i] == 0 || *sum + sizes[i] < *sum) return false;
    *sum += sizes[i];
  }
  return true;
}

/* Backup pieces: as pieces_ok_sum. */
static bool pieces_ok(const uint64_t *sizes, size_t n) {
  uint64_t sum;
  return pieces_ok_sum(sizes, n, &sum);
}

/* Chunk sizes: at least one, well formed, adding up to size. */
static bool chunks_ok(const uint64_t *sizes, size_t n, uint64_t size) {
  uint64_t sum;
  return n > 0 && pieces_ok_sum(sizes, n, &sum) && sum == size;
}


/* An Unmap's backups: each of a buffer the event names, once, with at
 * least one well-formed piece or (kept) none; adds their pieces (fds) to
 * *fds. */
static bool unmap_backups_ok(const Gpumem__Wire__UnmapEvent *u, size_t *fds) {
  for (size_t i = 0; i < u->n_backups; i++) {
    const Gpumem__Wire__BackupMemory *m = u->backups[i];
    bool named = false;
    for (size_t k = 0; k < u->n_buffer_ids && !named; k++) named = u->buffer_ids[k] == m->buffer_id;
    for (size_t k = 0; k < i && named; k++) named = u->backups[k]->buffer_id != m->buffer_id;
    if (!named || (m->n_piece_sizes == 0) != m->kept || !pieces_ok(m->piece_sizes, m->n_piece_sizes))
      return false;
    *fds += m->n_piece_sizes;
  }
  return true;
}

/* A re-registration: every buffer well formed, one fd per chunk of each
 * buffer that is not paused. */
static wire_code check_adopt(const Gpumem__Wire__AdoptRequest *a, size_t nfds, char *why,
                             size_t whylen) {
  const wire_code bad = GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT;
  size_t want = 0;
  if (a->n_buffers == 0) return refuse(bad, why, whylen, "adopt names no buffers");
  for (size_t i = 0; i < a->n_buffers; i++) {
    const Gpumem__Wire__AdoptBuffer *b = a->buffers[i];
    if (!wire_tag_valid(b->tag))
      return refuse(bad, why, whylen, "adopt buffer %zu: invalid tag", i);
    if (!flags_ok(b->flags))
      return refuse(bad, why, whylen,
                    "adopt buffer %zu: unknown flags 0x%x (or a backup policy without BACKUP, or BACKUP_DISK without BACKUP_RELEASE)", i,
                    b->flags);
    if ((b->flags & GPUMEM__WIRE__BUFFER_FLAG__FLAG_IPC_LEGACY) &&
        (b->paused || (b->flags & ~(uint32_t)GPUMEM__WIRE__BUFFER_FLAG__FLAG_IPC_LEGACY)))
      return refuse(bad, why, whylen,
                    "adopt buffer %zu: IPC_LEGACY buffers never pause: no BACKUP, "
                    "ALLOW_PAUSED or paused",
                    i);
    if (b->generation > WIRE_GENERATION_MAX)
      return refuse(bad, why, whylen, "adopt buffer %zu: generation %llu is none a daemon gives",
                    i, (unsigned long long)b->generation);
    if (b->n_chunk_sizes > FRAME_MAX_FDS || !chunks_ok(b->chunk_sizes, b->n_chunk_sizes, b->size))
      return refuse(bad, why, whylen, "adopt buffer %zu: chunks do not add up to its size", i);
    char what[40];
    snprintf(what, sizeof what, "adopt buffer %zu: ", i);
    wire_code pc = check_persist(b->flags, b->name, what, why, whylen);
    if (pc) return pc;
    if (b->secret.len && b->secret.len != WIRE_SECRET_SIZE)
      return refuse(bad, why, whylen, "adopt buffer %zu: a secret is %d bytes, not %zu", i,
                    WIRE_SECRET_SIZE, b->secret.len);
    if (!b->paused) want += b->n_chunk_sizes;
  }
  if (want != nfds)
    return refuse(GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR, why, whylen,
                  "adopt needs %zu fds, %zu arrived", want, nfds);
  return GPUMEM__WIRE__ERROR_CODE__OK;
}

/* Check a message that a client sent the daemon. */
wire_code wire_check_request(const wire_env *env, size_t nfds, char *why,
                             size_t whylen) {
  const wire_code bad = GPUMEM__WIRE__ERROR_CODE__INVALID_ARGUMENT;
  if (env->fd_count != nfds)
    return refuse(GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR, why, whylen,
                  "frame declared %u fds, %zu arrived", env->fd_count, nfds);
  bool memory = env->body_case == GPUMEM__WIRE__ENVELOPE__BODY_BACKUP && env->backup->memory;
  if (memory && nfds != 1)
    return refuse(GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR, why, whylen,
                  "a backup request with memory carries one fd (got %zu)", nfds);
  if (nfds && !memory && env->body_case != GPUMEM__WIRE__ENVELOPE__BODY_ADOPT)
    return refuse(GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR, why, whylen,
                  "only adopt and a backup request with memory carry fds (got %zu)", nfds);
  switch (env->body_case) {
  case GPUMEM__WIRE__ENVELOPE__BODY_ADOPT:
    return check_adopt(env->adopt, nfds, why, whylen);
  case GPUMEM__WIRE__ENVELOPE__BODY_HELLO:
    if (env->hello->role != GPUMEM__WIRE__ROLE__ROLE_WORKER &&
        env->hello->role != GPUMEM__WIRE__ROLE__ROLE_CONTROLLER)
      return refuse(bad, why, whylen, "unknown role %d", env->hello->role);
    if (!wire_name_valid(env->hello->name))
      return refuse(bad, why, whylen,
                    "invalid name: at most %d bytes of UTF-8 without control characters",
                    WIRE_NAME_MAX);
    return GPUMEM__WIRE__ERROR_CODE__OK;
  case GPUMEM__WIRE__ENVELOPE__BODY_ALLOC:
    if (!wire_tag_valid(env->alloc->tag)) return refuse_tag(env->alloc->tag, why, whylen);
    if (env->alloc->size == 0) return refuse(bad, why, whylen, "size is zero");
    if (!flags_ok(env->alloc->flags))
      return refuse(bad, why, whylen, "unknown flags 0x%x (or a backup policy without BACKUP, or BACKUP_DISK without BACKUP_RELEASE)",
                    env->alloc->flags);
    if ((env->alloc->flags & GPUMEM__WIRE__BUFFER_FLAG__FLAG_IPC_LEGACY) &&
        (env->alloc->flags & (GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP |
                              GPUMEM__WIRE__BUFFER_FLAG__FLAG_ALLOW_PAUSED)))
      return refuse(bad, why, whylen,
                    "IPC_LEGACY buffers never pause: no BACKUP or ALLOW_PAUSED");
    return check_persist(env->alloc->flags, env->alloc->name, "", why, whylen);
  case GPUMEM__WIRE__ENVELOPE__BODY_ATTACH:
    if (!wire_tag_valid(env->attach->name))
      return refuse(bad, why, whylen, "invalid name: 1-%d characters of [A-Za-z0-9_.-]",
                    WIRE_TAG_MAX);
    return GPUMEM__WIRE__ERROR_CODE__OK;
  case GPUMEM__WIRE__ENVELOPE__BODY_DROP:
    if (!wire_tag_valid(env->drop->name))
      return refuse(bad, why, whylen, "invalid name: 1-%d characters of [A-Za-z0-9_.-]",
                    WIRE_TAG_MAX);
    return GPUMEM__WIRE__ERROR_CODE__OK;
  case GPUMEM__WIRE__ENVELOPE__BODY_SHARE:
    if (!wire_tag_valid(env->share->tag)) return refuse_tag(env->share->tag, why, whylen);
    return GPUMEM__WIRE__ERROR_CODE__OK;
  case GPUMEM__WIRE__ENVELOPE__BODY_FREE:
  case GPUMEM__WIRE__ENVELOPE__BODY_STATUS:
  case GPUMEM__WIRE__ENVELOPE__BODY_LIST:
  case GPUMEM__WIRE__ENVELOPE__BODY_BACKUP:
    return GPUMEM__WIRE__ERROR_CODE__OK;
  case GPUMEM__WIRE__ENVELOPE__BODY_PAUSE: {
    const Gpumem__Wire__PauseRequest *p = env->pause;
    wire_code code = check_selection(p->n_tags, p->tags, p->n_devices, why, whylen);
    return code ? code
                : check_scope(p->n_pids, p->pids, p->session_prefix, p->own, why, whylen);
  }
  case GPUMEM__WIRE__ENVELOPE__BODY_RESUME: {
    const Gpumem__Wire__ResumeRequest *r = env->resume;
    if (r->wait_ms > WIRE_MAX_WAIT_MS)
      return refuse(bad, why, whylen, "wait of %u ms: at most %d", r->wait_ms, WIRE_MAX_WAIT_MS);
    wire_code code = check_selection(r->n_tags, r->tags, r->n_devices, why, whylen);
    return code ? code
                : check_scope(r->n_pids, r->pids, r->session_prefix, r->own, why, whylen);
  }
  case GPUMEM__WIRE__ENVELOPE__BODY_ACK:
    if (!wire_text_valid(env->ack->message, WIRE_MAX_MESSAGE))
      return refuse(bad, why, whylen,
                    "ack message longer than %d bytes, not UTF-8, or with control characters",
                    WIRE_MAX_MESSAGE);
    return GPUMEM__WIRE__ERROR_CODE__OK;
  default:
    return refuse(GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR, why, whylen,
                  "message type %d is not a request", (int)env->body_case);
  }
}

/* Check a message that the daemon sent a client. */
wire_code wire_check_reply(const wire_env *env, size_t nfds, char *why,
                           size_t whylen) {
  const wire_code bad = GPUMEM__WIRE__ERROR_CODE__PROTOCOL_ERROR;
  if (env->fd_count != nfds)
    return refuse(bad, why, whylen, "frame declared %u fds, %zu arrived",
                  env->fd_count, nfds);
  size_t chunks = 0;
  switch (env->body_case) {
  case GPUMEM__WIRE__ENVELOPE__BODY_ALLOC_REPLY: {
    const Gpumem__Wire__AllocReply *a = env->alloc_reply;
    if (!chunks_ok(a->chunk_sizes, a->n_chunk_sizes, a->size))
      return refuse(bad, why, whylen, "chunks do not add up to the size");
    if (a->ipc_handle.len != 0 && a->ipc_handle.len != 64)
      return refuse(bad, why, whylen, "IPC handle of %zu bytes", a->ipc_handle.len);
    if (a->state == GPUMEM__WIRE__BUFFER_STATE__ACTIVE && a->ipc_handle.len == 0)
      chunks = a->n_chunk_sizes;
    if (a->tag[0] && (!wire_tag_valid(a->tag) || !flags_ok(a->flags)))
      return refuse(bad, why, whylen, "an attached buffer's tag or flags are none a daemon gives");
    break;
  }
  case GPUMEM__WIRE__ENVELOPE__BODY_REMAP:
    for (size_t i = 0; i < env->remap->n_entries; i++) {
      const Gpumem__Wire__RemapEntry *r = env->remap->entries[i];
      if (!pieces_ok(r->backup_piece_sizes, r->n_backup_piece_sizes))
        return refuse(bad, why, whylen, "remap entry %zu: a backup piece of no bytes", i);
      if (r->backup_kept && r->n_backup_piece_sizes)
        return refuse(bad, why, whylen, "remap entry %zu: a kept backup with pieces", i);
      chunks += r->n_chunk_sizes + r->n_backup_piece_sizes;
    }
    break;
  case GPUMEM__WIRE__ENVELOPE__BODY_UNMAP:
    if (!unmap_backups_ok(env->unmap, &chunks))
      return refuse(bad, why, whylen,
                    "unmap backups: each must be of a buffer the event names, once, with "
                    "pieces of some bytes or kept");
    break;
  case GPUMEM__WIRE__ENVELOPE__BODY_BACKUP_REPLY: {
    const Gpumem__Wire__BackupReply *r = env->backup_reply;
    const Gpumem__Wire__BackupMemory *m = r->backup;
    if (!m || m->kept || (int)r->files + (int)r->send_memory + (int)r->copied > 1)
      return refuse(bad, why, whylen, "backup reply: no backup, or more than one kind of it");
    if (r->send_memory) {
      if (m->n_piece_sizes)
        return refuse(bad, why, whylen, "backup reply: pieces with send_memory");
      break;
    }
    if (m->n_piece_sizes == 0 || m->n_piece_sizes > FRAME_MAX_FDS ||
        !pieces_ok(m->piece_sizes, m->n_piece_sizes) || (r->copied && m->n_piece_sizes != 1))
      return refuse(bad, why, whylen, "backup reply: no pieces, or a piece of no bytes");
    chunks = r->copied ? 0 : m->n_piece_sizes;
    break;
  }
  case GPUMEM__WIRE__ENVELOPE__BODY_ERROR:
  case GPUMEM__WIRE__ENVELOPE__BODY_HELLO_REPLY:
  case GPUMEM__WIRE__ENVELOPE__BODY_FREE_REPLY:
  case GPUMEM__WIRE__ENVELOPE__BODY_OP_REPLY:
  case GPUMEM__WIRE__ENVELOPE__BODY_STATUS_REPLY:
  case GPUMEM__WIRE__ENVELOPE__BODY_LIST_REPLY:
  case GPUMEM__WIRE__ENVELOPE__BODY_ADOPT_REPLY:
  case GPUMEM__WIRE__ENVELOPE__BODY_SHARE_REPLY:
  case GPUMEM__WIRE__ENVELOPE__BODY_DROP_REPLY:
    break;
  default:
    return refuse(bad, why, whylen, "message type %d is not a reply or event",
                  (int)env->body_case);
  }
  if (chunks != nfds)
    return refuse(bad, why, whylen, "message needs %zu fds, %zu arrived",
                  chunks, nfds);
  return GPUMEM__WIRE__ERROR_CODE__OK;
}
