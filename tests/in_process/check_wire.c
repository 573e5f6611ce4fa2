/* Protocol validation at the edge, sizes, and the id map. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/idmap.h"
#include "common/size.h"
#include "common/wire.h"
#include "harness.h"

#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x

static char why[256];

START_TEST(tags_are_short_names_of_a_safe_charset) {
  ck_assert(wire_tag_valid("kv_cache"));
  ck_assert(wire_tag_valid("weights.v2-a"));
  char longest[WIRE_TAG_MAX + 2];
  memset(longest, 'a', sizeof longest);
  longest[WIRE_TAG_MAX] = '\0';
  ck_assert(wire_tag_valid(longest));
  longest[WIRE_TAG_MAX] = 'a';
  longest[WIRE_TAG_MAX + 1] = '\0';
  ck_assert(!wire_tag_valid(longest));
  ck_assert(!wire_tag_valid(""));
  ck_assert(!wire_tag_valid("kv cache"));
  ck_assert(!wire_tag_valid("kv/cache"));
  ck_assert(!wire_tag_valid("ключ"));
}
END_TEST

static wire_code check_alloc(const char *tag, uint64_t size, uint32_t flags) {
  Gpumem__Wire__AllocRequest a = GPUMEM__WIRE__ALLOC_REQUEST__INIT;
  a.tag = (char *)tag;
  a.size = size;
  a.flags = flags;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ALLOC;
  env.alloc = &a;
  return wire_check_request(&env, 0, why, sizeof why);
}

START_TEST(alloc_requests_are_checked) {
  ck_assert_int_eq(check_alloc("kv_cache", 4096, 0), CODE(OK));
  ck_assert_int_eq(check_alloc("", 4096, 0), CODE(INVALID_ARGUMENT));
  ck_assert_int_eq(check_alloc("a b", 4096, 0), CODE(INVALID_ARGUMENT));
  ck_assert_ptr_nonnull(strstr(why, "invalid tag"));
  ck_assert_int_eq(check_alloc("kv", 0, 0), CODE(INVALID_ARGUMENT));
  ck_assert_str_eq(why, "size is zero");
  ck_assert_int_eq(check_alloc("kv", 1, 64), CODE(INVALID_ARGUMENT));
  ck_assert_int_eq(check_alloc("kv", 1, 2 | 1), CODE(INVALID_ARGUMENT));
}
END_TEST

/* A re-registered buffer brings a generation a daemon could have given. */
START_TEST(adopted_generations_are_checked) {
  Gpumem__Wire__AdoptBuffer b = GPUMEM__WIRE__ADOPT_BUFFER__INIT, *bp = &b;
  b.tag = "kv";
  b.size = 2 << 20;
  b.paused = true;
  uint64_t chunk = 2 << 20;
  b.chunk_sizes = &chunk;
  b.n_chunk_sizes = 1;
  b.generation = WIRE_GENERATION_MAX;
  Gpumem__Wire__AdoptRequest a = GPUMEM__WIRE__ADOPT_REQUEST__INIT;
  a.buffers = &bp;
  a.n_buffers = 1;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ADOPT;
  env.adopt = &a;
  ck_assert_msg(wire_check_request(&env, 0, why, sizeof why) == CODE(OK), "%s", why);
  b.generation = UINT64_MAX;
  ck_assert_int_eq(wire_check_request(&env, 0, why, sizeof why), CODE(INVALID_ARGUMENT));
  ck_assert_ptr_nonnull(strstr(why, "generation"));
}
END_TEST

START_TEST(pause_needs_valid_tags) {
  Gpumem__Wire__PauseRequest p = GPUMEM__WIRE__PAUSE_REQUEST__INIT;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_PAUSE;
  env.pause = &p;
  ck_assert_int_eq(wire_check_request(&env, 0, why, sizeof why), CODE(OK)); /* every tag */
  char *tags[WIRE_MAX_TAGS + 1];
  for (int i = 0; i <= WIRE_MAX_TAGS; i++) tags[i] = "kv";
  p.tags = tags;
  p.n_tags = WIRE_MAX_TAGS + 1;
  ck_assert_int_eq(wire_check_request(&env, 0, why, sizeof why), CODE(INVALID_ARGUMENT));
  p.n_tags = 2;
  tags[1] = "bad tag";
  ck_assert_int_eq(wire_check_request(&env, 0, why, sizeof why), CODE(INVALID_ARGUMENT));
  tags[1] = "weights";
  ck_assert_int_eq(wire_check_request(&env, 0, why, sizeof why), CODE(OK));
}
END_TEST

START_TEST(clients_send_requests_without_fds) {
  Gpumem__Wire__StatusRequest s = GPUMEM__WIRE__STATUS_REQUEST__INIT;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_STATUS;
  env.status = &s;
  ck_assert_int_eq(wire_check_request(&env, 0, why, sizeof why), CODE(OK));
  ck_assert_int_eq(wire_check_request(&env, 1, why, sizeof why), CODE(PROTOCOL_ERROR));
  env.fd_count = 1;
  ck_assert_int_eq(wire_check_request(&env, 1, why, sizeof why), CODE(PROTOCOL_ERROR));
  Gpumem__Wire__UnmapEvent u = GPUMEM__WIRE__UNMAP_EVENT__INIT;
  env.fd_count = 0;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_UNMAP;
  env.unmap = &u;
  ck_assert_int_eq(wire_check_request(&env, 0, why, sizeof why), CODE(PROTOCOL_ERROR));
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY__NOT_SET;
  ck_assert_int_eq(wire_check_request(&env, 0, why, sizeof why), CODE(PROTOCOL_ERROR));
}
END_TEST

START_TEST(hello_needs_a_known_role) {
  Gpumem__Wire__Hello h = GPUMEM__WIRE__HELLO__INIT;
  h.name = "x";
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_HELLO;
  env.hello = &h;
  ck_assert_int_eq(wire_check_request(&env, 0, why, sizeof why), CODE(INVALID_ARGUMENT));
  h.role = 7;
  ck_assert_int_eq(wire_check_request(&env, 0, why, sizeof why), CODE(INVALID_ARGUMENT));
  h.role = GPUMEM__WIRE__ROLE__ROLE_WORKER;
  ck_assert_int_eq(wire_check_request(&env, 0, why, sizeof why), CODE(OK));
}
END_TEST

/* A remap must bring exactly one fd per chunk. */
START_TEST(replies_bring_the_fds_they_declare) {
  uint64_t sizes[2] = {2 << 20, 2 << 20};
  Gpumem__Wire__RemapEntry e = GPUMEM__WIRE__REMAP_ENTRY__INIT, *ep = &e;
  e.buffer_id = 1;
  e.chunk_sizes = sizes;
  e.n_chunk_sizes = 2;
  Gpumem__Wire__RemapEvent r = GPUMEM__WIRE__REMAP_EVENT__INIT;
  r.entries = &ep;
  r.n_entries = 1;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_REMAP;
  env.remap = &r;
  env.fd_count = 2;
  ck_assert_int_eq(wire_check_reply(&env, 2, why, sizeof why), CODE(OK));
  ck_assert_int_eq(wire_check_reply(&env, 1, why, sizeof why), CODE(PROTOCOL_ERROR));
  env.fd_count = 1;
  ck_assert_int_eq(wire_check_reply(&env, 1, why, sizeof why), CODE(PROTOCOL_ERROR));
}
END_TEST

/* A remap's backup pieces are fds too, after its chunks', none empty. */
START_TEST(remap_backup_pieces_are_fds_of_some_bytes) {
  uint64_t sizes[1] = {2 << 20}, pieces[2] = {1 << 20, 1 << 20};
  Gpumem__Wire__RemapEntry e = GPUMEM__WIRE__REMAP_ENTRY__INIT, *ep = &e;
  e.buffer_id = 1;
  e.chunk_sizes = sizes;
  e.n_chunk_sizes = 1;
  e.backup_piece_sizes = pieces;
  e.n_backup_piece_sizes = 2;
  Gpumem__Wire__RemapEvent r = GPUMEM__WIRE__REMAP_EVENT__INIT;
  r.entries = &ep;
  r.n_entries = 1;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_REMAP;
  env.remap = &r;
  env.fd_count = 3;
  ck_assert_int_eq(wire_check_reply(&env, 3, why, sizeof why), CODE(OK));
  env.fd_count = 1;
  ck_assert_int_eq(wire_check_reply(&env, 1, why, sizeof why), CODE(PROTOCOL_ERROR));
  env.fd_count = 3;
  pieces[1] = 0;
  ck_assert_int_eq(wire_check_reply(&env, 3, why, sizeof why), CODE(PROTOCOL_ERROR));
  ck_assert_ptr_nonnull(strstr(why, "backup piece of no bytes"));
  pieces[0] = UINT64_MAX;
  pieces[1] = 2;
  ck_assert_int_eq(wire_check_reply(&env, 3, why, sizeof why), CODE(PROTOCOL_ERROR));
  pieces[0] = pieces[1] = 1 << 20;
  e.backup_kept = true; /* kept means no pieces */
  ck_assert_int_eq(wire_check_reply(&env, 3, why, sizeof why), CODE(PROTOCOL_ERROR));
  e.n_backup_piece_sizes = 0;
  env.fd_count = 1;
  ck_assert_int_eq(wire_check_reply(&env, 1, why, sizeof why), CODE(OK));
}
END_TEST

/* An Unmap's backups are of buffers it names, once each, with pieces
 * that are its fds. */
START_TEST(unmap_backups_name_its_buffers_once) {
  uint64_t ids[2] = {7, 8}, pieces[1] = {2 << 20};
  Gpumem__Wire__BackupMemory m[2] = {GPUMEM__WIRE__BACKUP_MEMORY__INIT,
                                     GPUMEM__WIRE__BACKUP_MEMORY__INIT};
  Gpumem__Wire__BackupMemory *mp[2] = {&m[0], &m[1]};
  for (int i = 0; i < 2; i++) {
    m[i].buffer_id = ids[i];
    m[i].piece_sizes = pieces;
    m[i].n_piece_sizes = 1;
  }
  Gpumem__Wire__UnmapEvent u = GPUMEM__WIRE__UNMAP_EVENT__INIT;
  u.buffer_ids = ids;
  u.n_buffer_ids = 2;
  u.backups = mp;
  u.n_backups = 2;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_UNMAP;
  env.unmap = &u;
  env.fd_count = 2;
  ck_assert_int_eq(wire_check_reply(&env, 2, why, sizeof why), CODE(OK));
  env.fd_count = 0; /* fds the event does not declare */
  ck_assert_int_eq(wire_check_reply(&env, 0, why, sizeof why), CODE(PROTOCOL_ERROR));
  env.fd_count = 2;
  m[1].buffer_id = 7; /* the same buffer twice */
  ck_assert_int_eq(wire_check_reply(&env, 2, why, sizeof why), CODE(PROTOCOL_ERROR));
  m[1].buffer_id = 9; /* a buffer the event does not unmap */
  ck_assert_int_eq(wire_check_reply(&env, 2, why, sizeof why), CODE(PROTOCOL_ERROR));
  ck_assert_ptr_nonnull(strstr(why, "unmap backups"));
  m[1].buffer_id = 8;
  m[1].n_piece_sizes = 0; /* a backup of no pieces */
  env.fd_count = 1;
  ck_assert_int_eq(wire_check_reply(&env, 1, why, sizeof why), CODE(PROTOCOL_ERROR));
  m[1].kept = true; /* kept: by reference, no pieces */
  ck_assert_int_eq(wire_check_reply(&env, 1, why, sizeof why), CODE(OK));
  m[1].n_piece_sizes = 1; /* kept, and pieces too */
  env.fd_count = 2;
  ck_assert_int_eq(wire_check_reply(&env, 2, why, sizeof why), CODE(PROTOCOL_ERROR));
}
END_TEST

/* A BackupReply hands pieces of some bytes, one fd each, never by
 * reference; its request carries no fds. */
START_TEST(backup_replies_hand_pieces) {
  uint64_t pieces[2] = {2 << 20, 1 << 20};
  Gpumem__Wire__BackupMemory m = GPUMEM__WIRE__BACKUP_MEMORY__INIT;
  m.buffer_id = 7;
  m.piece_sizes = pieces;
  m.n_piece_sizes = 2;
  Gpumem__Wire__BackupReply r = GPUMEM__WIRE__BACKUP_REPLY__INIT;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_BACKUP_REPLY;
  env.backup_reply = &r;
  ck_assert_int_eq(wire_check_reply(&env, 0, why, sizeof why), CODE(PROTOCOL_ERROR)); /* none */
  r.backup = &m;
  env.fd_count = 2;
  ck_assert_int_eq(wire_check_reply(&env, 2, why, sizeof why), CODE(OK));
  env.fd_count = 1;
  ck_assert_int_eq(wire_check_reply(&env, 1, why, sizeof why), CODE(PROTOCOL_ERROR));
  env.fd_count = 2;
  m.kept = true;
  ck_assert_int_eq(wire_check_reply(&env, 2, why, sizeof why), CODE(PROTOCOL_ERROR));
  m.kept = false;
  pieces[1] = 0;
  ck_assert_int_eq(wire_check_reply(&env, 2, why, sizeof why), CODE(PROTOCOL_ERROR));
  ck_assert_ptr_nonnull(strstr(why, "backup reply"));
  Gpumem__Wire__BackupRequest q = GPUMEM__WIRE__BACKUP_REQUEST__INIT;
  wire_env req = GPUMEM__WIRE__ENVELOPE__INIT;
  req.body_case = GPUMEM__WIRE__ENVELOPE__BODY_BACKUP;
  req.backup = &q;
  ck_assert_int_eq(wire_check_request(&req, 0, why, sizeof why), CODE(OK));
  req.fd_count = 1;
  ck_assert_int_eq(wire_check_request(&req, 1, why, sizeof why), CODE(PROTOCOL_ERROR));
  /* 1.10: a request with memory carries exactly one fd */
  q.memory = true;
  ck_assert_int_eq(wire_check_request(&req, 1, why, sizeof why), CODE(OK));
  req.fd_count = 0;
  ck_assert_int_eq(wire_check_request(&req, 0, why, sizeof why), CODE(PROTOCOL_ERROR));
  req.fd_count = 2;
  ck_assert_int_eq(wire_check_request(&req, 2, why, sizeof why), CODE(PROTOCOL_ERROR));
}
END_TEST

/* 1.10's backup replies: files carry their fds as pieces do; send_memory
 * carries no pieces and no fds; copied one piece and no fd; one kind at
 * a time. */
START_TEST(backup_replies_of_files_and_copies) {
  uint64_t pieces[2] = {2 << 20, 1 << 20};
  Gpumem__Wire__BackupMemory m = GPUMEM__WIRE__BACKUP_MEMORY__INIT;
  m.buffer_id = 7;
  m.piece_sizes = pieces;
  m.n_piece_sizes = 1;
  Gpumem__Wire__BackupReply r = GPUMEM__WIRE__BACKUP_REPLY__INIT;
  r.backup = &m;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_BACKUP_REPLY;
  env.backup_reply = &r;
  r.files = true;
  env.fd_count = 1;
  ck_assert_int_eq(wire_check_reply(&env, 1, why, sizeof why), CODE(OK));
  env.fd_count = 0;
  ck_assert_int_eq(wire_check_reply(&env, 0, why, sizeof why), CODE(PROTOCOL_ERROR));
  r.files = false;
  r.copied = true;
  ck_assert_int_eq(wire_check_reply(&env, 0, why, sizeof why), CODE(OK));
  env.fd_count = 1;
  ck_assert_int_eq(wire_check_reply(&env, 1, why, sizeof why), CODE(PROTOCOL_ERROR));
  env.fd_count = 0;
  m.n_piece_sizes = 2;
  ck_assert_int_eq(wire_check_reply(&env, 0, why, sizeof why), CODE(PROTOCOL_ERROR));
  r.copied = false;
  r.send_memory = true;
  ck_assert_int_eq(wire_check_reply(&env, 0, why, sizeof why), CODE(PROTOCOL_ERROR)); /* pieces */
  m.n_piece_sizes = 0;
  ck_assert_int_eq(wire_check_reply(&env, 0, why, sizeof why), CODE(OK));
  r.files = true;
  ck_assert_int_eq(wire_check_reply(&env, 0, why, sizeof why), CODE(PROTOCOL_ERROR));
  ck_assert_ptr_nonnull(strstr(why, "more than one kind"));
}
END_TEST

/* Garbage bytes never parse into a message that passes the checks. */
START_TEST(garbage_does_not_parse_or_is_refused) {
  srand(42);
  int parsed = 0, passed = 0;
  for (int i = 0; i < 20000; i++) {
    uint8_t buf[64];
    size_t n = (size_t)(rand() % (int)sizeof buf);
    for (size_t k = 0; k < n; k++) buf[k] = (uint8_t)rand();
    wire_env *env = wire_unpack(buf, n);
    if (env) {
      parsed++;
      passed += wire_check_request(env, 0, why, sizeof why) == CODE(OK);
      passed += wire_check_reply(env, 0, why, sizeof why) == CODE(OK);
      wire_env_free(env);
    }
  }
  fprintf(stderr, "garbage: %d of 20000 parsed, %d passed a check\n", parsed, passed);
  ck_assert_int_eq(passed, 0);
}
END_TEST

START_TEST(envelopes_round_trip) {
  Gpumem__Wire__AllocRequest a = GPUMEM__WIRE__ALLOC_REQUEST__INIT;
  a.tag = "weights";
  a.size = 123456789;
  a.device = 3;
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.id = 77;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_ALLOC;
  env.alloc = &a;
  size_t len;
  uint8_t *bytes = wire_pack(&env, &len);
  wire_env *back = wire_unpack(bytes, len);
  ck_assert_ptr_nonnull(back);
  ck_assert_uint_eq(back->id, 77);
  ck_assert_str_eq(back->alloc->tag, "weights");
  ck_assert_uint_eq(back->alloc->size, 123456789);
  ck_assert_uint_eq(back->alloc->device, 3);
  wire_env_free(back);
  free(bytes);
}
END_TEST

START_TEST(sizes_parse_with_binary_suffixes) {
  uint64_t v;
  ck_assert_int_eq(size_parse("512", &v), 0);
  ck_assert_uint_eq(v, 512);
  ck_assert_int_eq(size_parse("64K", &v), 0);
  ck_assert_uint_eq(v, 64 << 10);
  ck_assert_int_eq(size_parse("2M", &v), 0);
  ck_assert_uint_eq(v, 2 << 20);
  ck_assert_int_eq(size_parse("4G", &v), 0);
  ck_assert_uint_eq(v, 4ull << 30);
  ck_assert_int_eq(size_parse("1.5G", &v), 0);
  ck_assert_uint_eq(v, 3ull << 29);
  ck_assert_int_eq(size_parse("1GiB", &v), 0);
  ck_assert_uint_eq(v, 1ull << 30);
  ck_assert_int_eq(size_parse("1.87g", &v), 0);
  ck_assert_int_eq(size_parse("", &v), -EINVAL);
  ck_assert_int_eq(size_parse("G", &v), -EINVAL);
  ck_assert_int_eq(size_parse("12X", &v), -EINVAL);
  ck_assert_int_eq(size_parse("-1", &v), -EINVAL);
  ck_assert_int_eq(size_parse("1.5", &v), -EINVAL);
  ck_assert_int_eq(size_parse("99999999999999999999", &v), -ERANGE);
  ck_assert_int_eq(size_parse("20000000000T", &v), -ERANGE);
  char buf[32];
  ck_assert_str_eq(size_format(3ull << 29, buf, sizeof buf), "1.50 GiB");
  ck_assert_str_eq(size_format(512, buf, sizeof buf), "512 B");
  ck_assert_uint_eq(size_round_up(1, 2 << 20), 2 << 20);
  ck_assert_uint_eq(size_round_up(UINT64_MAX - 5, 2 << 20), 0);
}
END_TEST

START_TEST(idmap_survives_many_puts_and_deletes) {
  idmap *m = idmap_create();
  for (uint64_t i = 1; i <= 100000; i++) ck_assert_int_eq(idmap_put(m, i, (void *)(uintptr_t)i), 0);
  for (uint64_t i = 1; i <= 100000; i += 2) idmap_del(m, i);
  ck_assert_uint_eq(idmap_count(m), 50000);
  for (uint64_t i = 1; i <= 100000; i++)
    ck_assert_ptr_eq(idmap_get(m, i), i % 2 ? NULL : (void *)(uintptr_t)i);
  idmap_destroy(m);
}
END_TEST

/* Session names (and scope prefixes) are UTF-8 without control
 * characters, safe for logs and terminals. */
START_TEST(names_are_utf8_without_control_characters) {
  ck_assert(wire_name_valid(""));
  ck_assert(wire_name_valid("engine-a-0 (rank 3)"));
  ck_assert(wire_name_valid("moteur-\xc3\xa9\xe2\x82\xac\xf0\x9f\x9a\x80"));
  const char *bad[] = {"a\nb", "\x1b[2J", "tab\there", "del\x7f", "c1\xc2\x9b",
                       "\xc3\x28", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    ck_assert_msg(!wire_name_valid(bad[i]), "accepted bad name %zu", i);
  char name[WIRE_NAME_MAX + 2];
  memset(name, 'n', sizeof name - 1);
  name[sizeof name - 1] = '\0';
  ck_assert(!wire_name_valid(name));
  name[WIRE_NAME_MAX] = '\0';
  ck_assert(wire_name_valid(name));
  Gpumem__Wire__Hello h = GPUMEM__WIRE__HELLO__INIT;
  h.role = GPUMEM__WIRE__ROLE__ROLE_WORKER;
  h.name = "\x1b]0;owned\x07";
  wire_env env = GPUMEM__WIRE__ENVELOPE__INIT;
  env.body_case = GPUMEM__WIRE__ENVELOPE__BODY_HELLO;
  env.hello = &h;
  ck_assert_int_eq(wire_check_request(&env, 0, why, sizeof why), CODE(INVALID_ARGUMENT));
  ck_assert_ptr_nonnull(strstr(why, "invalid name"));
}
END_TEST

int main(void) {
  return HARNESS_RUN("wire", 20, NULL, NULL,
                     names_are_utf8_without_control_characters,
                     tags_are_short_names_of_a_safe_charset,
                     alloc_requests_are_checked,
                     pause_needs_valid_tags,
                     clients_send_requests_without_fds,
                     hello_needs_a_known_role,
                     replies_bring_the_fds_they_declare,
                     remap_backup_pieces_are_fds_of_some_bytes,
                     unmap_backups_name_its_buffers_once,
                     backup_replies_hand_pieces, backup_replies_of_files_and_copies,
                     adopted_generations_are_checked,
                     garbage_does_not_parse_or_is_refused,
                     envelopes_round_trip,
                     sizes_parse_with_binary_suffixes,
                     idmap_survives_many_puts_and_deletes);
}
