/* The registry over the host backend: rounding, chunks, capacity, paused
 * tags, memory release and backups. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/registry.h"
#include "harness.h"

#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x
#define MiB (1ull << 20)

static gpudev *g;
static registry *reg;
static struct owner owner;

/* The test's one owner, as uid uid for the next allocation. */
static struct owner *as(uint32_t uid) {
  owner.uid = uid;
  return &owner;
}
static struct fault f;

/* A registry call answered want, with words in the fault's text. */
static void refused(wire_code got, wire_code want, const char *words) {
  ck_assert_int_eq(got, want);
  ck_assert_ptr_nonnull(strstr(f.text, words));
}

static void setup(void) {
  harness_fd_setup();
  struct gpudev_options o = {.backend = "host", .host_devices = 2, .host_device_size = 64 * MiB};
  char err[128];
  ck_assert_int_eq(gpudev_open(&o, &g, err, sizeof err), 0);
  struct registry_options ro = {.chunk_size = 16 * MiB, .backup_limit = 32 * MiB,
                                .verify_backups = true};
  reg = registry_create(g, &ro);
  owner = (struct owner){0};
  list_init(&owner.buffers);
  memset(&f, 0, sizeof f);
}

static void teardown(void) {
  registry_destroy(reg);
  gpudev_close(g);
  harness_fd_teardown();
}

START_TEST(sizes_round_up_and_split_into_chunks) {
  struct buffer *b;
  ck_assert_int_eq(registry_alloc(reg, as(0), "kv", 0, 1, 0, &b, &f), CODE(OK));
  ck_assert_uint_eq(b->size, 2 * MiB);
  ck_assert_uint_eq(b->nchunks, 1);
  struct buffer *c;
  ck_assert_int_eq(registry_alloc(reg, as(0), "kv", 0, 33 * MiB, 0, &c, &f), CODE(OK));
  ck_assert_uint_eq(c->size, 34 * MiB);
  ck_assert_uint_eq(c->nchunks, 3);
  ck_assert_uint_eq(c->chunk_sizes[2], 2 * MiB);
  ck_assert_uint_eq(registry_managed(reg, 0), 36 * MiB);
  ck_assert_uint_ne(b->id, c->id);
  ck_assert_ptr_eq(registry_find(reg, c->id), c);
  uint64_t id = b->id;
  registry_free(reg, b);
  ck_assert_ptr_null(registry_find(reg, id));
  ck_assert_uint_eq(registry_managed(reg, 0), 34 * MiB);
}
END_TEST

START_TEST(bad_requests_change_nothing) {
  struct buffer *b;
  refused(registry_alloc(reg, as(0), "kv", 2, MiB, 0, &b, &f), CODE(INVALID_ARGUMENT),
          "device 2 out of range");
  ck_assert_int_eq(registry_alloc(reg, as(0), "kv", 0, 65 * MiB, 0, &b, &f),
                   CODE(INVALID_ARGUMENT));
  ck_assert_int_eq(registry_alloc(reg, as(0), "kv", 0, UINT64_MAX, 0, &b, &f),
                   CODE(INVALID_ARGUMENT));
  ck_assert_uint_eq(registry_count(reg), 0);
  ck_assert_uint_eq(registry_managed(reg, 0), 0);
  ck_assert(list_empty(&owner.buffers));
}
END_TEST

START_TEST(capacity_is_enforced_per_device) {
  struct buffer *b, *c;
  ck_assert_int_eq(registry_alloc(reg, as(0), "kv", 0, 48 * MiB, 0, &b, &f), CODE(OK));
  ck_assert_int_eq(registry_alloc(reg, as(0), "kv", 0, 32 * MiB, 0, &c, &f),
                   CODE(OUT_OF_MEMORY));
  ck_assert_uint_eq(f.bytes_needed, 32 * MiB);
  ck_assert_uint_eq(f.bytes_free, 16 * MiB);
  ck_assert_uint_eq(registry_managed(reg, 0), 48 * MiB); /* the failed one left nothing */
  ck_assert_int_eq(registry_alloc(reg, as(0), "kv", 1, 32 * MiB, 0, &c, &f), CODE(OK));
}
END_TEST

/* A tag with no buffers, as a pause on device 0 leaves it. */
static struct tag *paused_tag(const char *name) {
  struct buffer *b;
  ck_assert_int_eq(registry_alloc(reg, as(0), name, 1, MiB, 0, &b, &f), CODE(OK));
  struct tag *t = b->tag;
  t->paused_devices = 1;
  registry_free(reg, b);
  ck_assert_ptr_eq(registry_tag(reg, name), t);
  return t;
}

START_TEST(paused_tag_refuses_unless_asked) {
  paused_tag("kv");
  struct buffer *b;
  ck_assert_int_eq(registry_alloc(reg, as(0), "kv", 0, MiB, 0, &b, &f), CODE(TAG_PAUSED));
  ck_assert_int_eq(registry_alloc(reg, as(0), "kv", 1, MiB, 0, &b, &f), CODE(OK));
  ck_assert_int_eq(b->state, BUF_ACTIVE);
  ck_assert_int_eq(registry_alloc(reg, as(0), "kv", 0, MiB, BUF_FLAG_ALLOW_PAUSED, &b, &f),
                   CODE(OK));
  ck_assert_int_eq(b->state, BUF_PAUSED);
  ck_assert(!b->has_memory);
  ck_assert_uint_eq(registry_managed(reg, 0), 0);
}
END_TEST

/* A backup holds the bytes while the memory is gone, and goes back in. */
START_TEST(backup_and_restore_keep_contents) {
  struct buffer *b;
  ck_assert_int_eq(registry_alloc(reg, as(0), "w", 0, 20 * MiB, BUF_FLAG_BACKUP, &b, &f),
                   CODE(OK));
  char *pattern = malloc(b->size);
  for (size_t i = 0; i < b->size; i++) pattern[i] = (char)(i * 13);
  ck_assert_int_eq(gpudev_chunks_copy(g, 0, b->handles, b->chunk_sizes, b->nchunks, pattern, false), 0);
  ck_assert(registry_move(reg, b, BUF_EV_PAUSE) && registry_move(reg, b, BUF_EV_UNMAPPED));
  ck_assert_int_eq(registry_backup(reg, b, &f), CODE(OK));
  ck_assert_uint_eq(registry_backup_bytes(reg), b->size);
  void *store = b->backup;
  registry_memory_release(reg, b);
  ck_assert_uint_eq(registry_managed(reg, 0), 0);
  ck_assert_int_eq(registry_memory_create(reg, b, &f), CODE(OK));
  ck_assert_int_eq(registry_restore(reg, b, &f), CODE(OK));
  /* The backup stays valid until the buffer is ACTIVE (a resume may roll back). */
  ck_assert(registry_move(reg, b, BUF_EV_RESUME));
  ck_assert_uint_eq(registry_backup_bytes(reg), b->size);
  ck_assert(registry_move(reg, b, BUF_EV_COMMIT));
  ck_assert_uint_eq(registry_backup_bytes(reg), 0);
  char *back = malloc(b->size);
  ck_assert_int_eq(gpudev_chunks_copy(g, 0, b->handles, b->chunk_sizes, b->nchunks, back, true), 0);
  ck_assert(memcmp(back, pattern, b->size) == 0);
  /* The next pause reuses the same host memory. */
  ck_assert_int_eq(registry_backup(reg, b, &f), CODE(OK));
  ck_assert_ptr_eq(b->backup, store);
  uint64_t bytes, us;
  registry_copy_totals(reg, true, &bytes, &us);
  ck_assert_uint_eq(bytes, 2 * b->size);
  free(pattern);
  free(back);
}
END_TEST

START_TEST(memory_create_is_all_or_nothing) {
  struct buffer *a, *b;
  ck_assert_int_eq(registry_alloc(reg, as(0), "kv", 0, 40 * MiB, 0, &a, &f), CODE(OK));
  registry_memory_release(reg, a);
  ck_assert_int_eq(registry_alloc(reg, as(0), "other", 0, 30 * MiB, 0, &b, &f), CODE(OK));
  /* 34 MiB free, 40 needed: three 16 MiB chunks would fit two. */
  ck_assert_int_eq(registry_memory_create(reg, a, &f), CODE(OUT_OF_MEMORY));
  ck_assert(!a->has_memory);
  ck_assert_uint_eq(registry_managed(reg, 0), 30 * MiB);
  uint64_t free_b, total;
  gpudev_mem_info(g, 0, &free_b, &total);
  ck_assert_uint_eq(free_b, 34 * MiB);
}
END_TEST

/* A backup that changes while paused fails the restore loudly. */
START_TEST(verification_catches_a_changed_backup) {
  struct buffer *b;
  ck_assert_int_eq(registry_alloc(reg, as(0), "w", 0, 4 * MiB, BUF_FLAG_BACKUP, &b, &f),
                   CODE(OK));
  ck_assert_int_eq(registry_backup(reg, b, &f), CODE(OK));
  registry_memory_release(reg, b);
  ((char *)b->backup)[12345] ^= 1;
  ck_assert_int_eq(registry_memory_create(reg, b, &f), CODE(OK));
  refused(registry_restore(reg, b, &f), CODE(BACKEND_ERROR), "changed while paused");
}
END_TEST

/* BACKUP buffers reserve host memory at allocation, within the limit. */
START_TEST(backup_limit_is_enforced_at_allocation) {
  struct buffer *a, *b, *c;
  ck_assert_int_eq(registry_alloc(reg, as(0), "w", 0, 20 * MiB, BUF_FLAG_BACKUP, &a, &f),
                   CODE(OK));
  refused(registry_alloc(reg, as(0), "w", 0, 14 * MiB, BUF_FLAG_BACKUP, &b, &f),
          CODE(LIMIT_EXCEEDED), "backup limit");
  ck_assert_int_eq(registry_alloc(reg, as(0), "w", 0, 14 * MiB, 0, &c, &f), CODE(OK));
  uint64_t reserved, limit;
  registry_backup_budget(reg, &reserved, &limit);
  ck_assert_uint_eq(reserved, 20 * MiB);
  ck_assert_uint_eq(limit, 32 * MiB);
  registry_free(reg, a);
  registry_backup_budget(reg, &reserved, &limit);
  ck_assert_uint_eq(reserved, 0);
  ck_assert_int_eq(registry_alloc(reg, as(0), "w", 1, 32 * MiB, BUF_FLAG_BACKUP, &b, &f),
                   CODE(OK));
}
END_TEST

/* A tag lives while it has buffers or is paused: names used once do not
 * pile up in a long-running daemon. */
START_TEST(unused_tags_are_forgotten) {
  struct buffer *b;
  ck_assert_int_eq(registry_alloc(reg, as(0), "once", 0, MiB, 0, &b, &f), CODE(OK));
  ck_assert_ptr_nonnull(registry_tag(reg, "once"));
  registry_free(reg, b);
  ck_assert_ptr_null(registry_tag(reg, "once"));
  ck_assert_int_eq(registry_alloc(reg, as(0), "huge", 0, 40 * MiB, 0, &b, &f), CODE(OK));
  ck_assert_int_eq(registry_alloc(reg, as(0), "nope", 0, 40 * MiB, 0, &b, &f),
                   CODE(OUT_OF_MEMORY));
  ck_assert_ptr_null(registry_tag(reg, "nope"));
  struct tag *t = paused_tag("paused");
  registry_prune(reg, t);
  ck_assert_ptr_eq(registry_tag(reg, "paused"), t);
}
END_TEST

/* A tag is its creator's: another uid's buffers join it only while a
 * controller shares it, and unsharing keeps what joined. */
START_TEST(tags_belong_to_their_creator) {
  struct buffer *a, *b;
  struct tag *t;
  ck_assert_int_eq(registry_alloc(reg, as(1000), "kv", 0, MiB, 0, &a, &f), CODE(OK));
  refused(registry_alloc(reg, as(1001), "kv", 0, MiB, 0, &b, &f), CODE(PERMISSION_DENIED),
          "belongs to uid 1000");
  ck_assert_uint_eq(registry_managed(reg, 0), 2 * MiB); /* the refused one took nothing */
  ck_assert(registry_tag_visible(a->tag, 1000) && !registry_tag_visible(a->tag, 1001));
  ck_assert_int_eq(registry_share(reg, "kv", true, &t, &f), CODE(OK));
  ck_assert_int_eq(registry_alloc(reg, as(1001), "kv", 0, MiB, 0, &b, &f), CODE(OK));
  ck_assert(registry_tag_visible(t, 1001));
  ck_assert_int_eq(registry_share(reg, "kv", false, &t, &f), CODE(OK));
  ck_assert_ptr_eq(t, b->tag);
  ck_assert(t->owned && t->uid == 1000 && !t->shared);
  ck_assert_int_eq(registry_alloc(reg, as(1001), "kv", 0, MiB, 0, &b, &f),
                   CODE(PERMISSION_DENIED));
  ck_assert_int_eq(registry_share(reg, "nothing", false, &t, &f), CODE(NOT_FOUND));
}
END_TEST

/* A tag shared before any buffer joins stays while empty; unshared, it
 * goes to the one uid whose buffers are in it (refused while several
 * uids' are), or away when it is empty. */
START_TEST(shared_tags_outlive_their_buffers) {
  struct tag *t;
  struct buffer *b, *c;
  ck_assert_int_eq(registry_share(reg, "common", true, &t, &f), CODE(OK));
  ck_assert(!t->owned && t->shared);
  ck_assert_int_eq(registry_alloc(reg, as(7), "common", 0, MiB, 0, &b, &f), CODE(OK));
  ck_assert_int_eq(registry_alloc(reg, as(8), "common", 0, MiB, 0, &c, &f), CODE(OK));
  registry_free(reg, b);
  registry_free(reg, c);
  ck_assert_ptr_eq(registry_tag(reg, "common"), t);
  ck_assert_int_eq(registry_alloc(reg, as(8), "common", 0, MiB, 0, &c, &f), CODE(OK));
  ck_assert_int_eq(registry_alloc(reg, as(7), "common", 0, MiB, 0, &b, &f), CODE(OK));
  refused(registry_share(reg, "common", false, &t, &f), CODE(WRONG_STATE), "several uids");
  ck_assert(t == NULL && registry_tag(reg, "common")->shared);
  registry_free(reg, b);
  ck_assert_int_eq(registry_share(reg, "common", false, &t, &f), CODE(OK));
  ck_assert(t->owned && t->uid == 8 && !t->shared);
  registry_free(reg, c);
  ck_assert_ptr_null(registry_tag(reg, "common"));
  /* An unowned tag that stays (paused) is claimed only by a buffer that
   * joins it, not by one that is refused. */
  ck_assert_int_eq(registry_share(reg, "held", true, &t, &f), CODE(OK));
  t->paused_devices = 1;
  ck_assert_int_eq(registry_share(reg, "held", false, &t, &f), CODE(OK));
  ck_assert(t && !t->owned && !t->shared);
  ck_assert_int_eq(registry_alloc(reg, as(9), "held", 0, MiB, 0, &b, &f),
                   CODE(TAG_PAUSED));
  ck_assert(!t->owned);
  ck_assert_int_eq(
      registry_alloc(reg, as(8), "held", 0, MiB, BUF_FLAG_ALLOW_PAUSED, &b, &f),
      CODE(OK));
  ck_assert(t->owned && t->uid == 8);
  registry_free(reg, b);
  ck_assert_int_eq(registry_share(reg, "gone", true, &t, &f), CODE(OK));
  ck_assert_int_eq(registry_share(reg, "gone", false, &t, &f), CODE(OK));
  ck_assert_ptr_null(t);
  ck_assert_ptr_null(registry_tag(reg, "gone"));
}
END_TEST

/* Each uid's buffers, device bytes (paused ones too) and backup room are
 * counted and capped; freeing gives the room back. */
START_TEST(quotas_are_per_uid) {
  registry_destroy(reg);
  struct registry_options ro = {.chunk_size = 16 * MiB, .backup_limit = 32 * MiB,
                                .quotas = {.buffers = 3, .device_bytes = 8 * MiB,
                                           .backup_bytes = 4 * MiB}};
  reg = registry_create(g, &ro);
  struct buffer *a, *b, *c;
  ck_assert_int_eq(registry_alloc(reg, as(5), "a", 0, 6 * MiB, 0, &a, &f), CODE(OK));
  refused(registry_alloc(reg, as(5), "a", 0, 4 * MiB, 0, &b, &f), CODE(LIMIT_EXCEEDED),
          "--max-device-bytes-per-uid");
  ck_assert_int_eq(registry_alloc(reg, as(6), "b", 0, 8 * MiB, 0, &b, &f), CODE(OK));
  ck_assert_int_eq(registry_alloc(reg, as(5), "a", 1, 4 * MiB, BUF_FLAG_BACKUP, &b, &f),
                   CODE(OK));
  refused(registry_alloc(reg, as(5), "a", 1, 2 * MiB, BUF_FLAG_BACKUP, &c, &f),
          CODE(LIMIT_EXCEEDED), "--max-backup-bytes-per-uid");
  ck_assert_int_eq(registry_alloc(reg, as(5), "a", 1, 2 * MiB, 0, &c, &f), CODE(OK));
  refused(registry_alloc(reg, as(5), "a", 1, 2 * MiB, 0, &c, &f), CODE(LIMIT_EXCEEDED),
          "too many buffers for uid 5");
  const struct tenant *t5 = tenants_find(registry_tenants(reg), 5);
  ck_assert_uint_eq(t5->buffers, 3);
  ck_assert_uint_eq(t5->device_bytes[0], 6 * MiB);
  ck_assert_uint_eq(t5->device_bytes[1], 6 * MiB);
  ck_assert_uint_eq(t5->backup_bytes, 4 * MiB);
  registry_free(reg, a);
  ck_assert_int_eq(registry_alloc(reg, as(5), "a", 0, 8 * MiB, 0, &a, &f), CODE(OK));
  registry_free(reg, a);
  registry_free(reg, b);
  registry_free(reg, c);
  ck_assert_ptr_null(tenants_find(registry_tenants(reg), 5));
  ck_assert_uint_eq(tenants_count(registry_tenants(reg)), 1);
}
END_TEST

/* Buffers are walked in id order from any point, also from an id that
 * is gone; thousands of tags are found by name. */
START_TEST(buffers_page_in_id_order) {
  struct buffer *v[6];
  char name[16];
  for (int i = 0; i < 6; i++) {
    snprintf(name, sizeof name, "t%d", i);
    ck_assert_int_eq(registry_alloc(reg, as(0), name, 0, MiB, 0, &v[i], &f), CODE(OK));
  }
  ck_assert_ptr_eq(registry_buffer_after(reg, 0), v[0]);
  ck_assert_ptr_eq(registry_buffer_after(reg, v[2]->id), v[3]);
  uint64_t gone = v[3]->id;
  registry_free(reg, v[3]);
  ck_assert_ptr_eq(registry_buffer_after(reg, gone), v[4]);
  ck_assert_ptr_eq(registry_buffer_after(reg, v[2]->id), v[4]);
  ck_assert_ptr_null(registry_buffer_after(reg, v[5]->id));
  ck_assert_ptr_null(registry_tag(reg, "t3"));
  ck_assert_ptr_eq(registry_tag(reg, "t4"), v[4]->tag);
  struct tag *t;
  for (int i = 0; i < 5000; i++) {
    snprintf(name, sizeof name, "s%d", i);
    ck_assert_int_eq(registry_share(reg, name, true, &t, &f), CODE(OK));
  }
  ck_assert_str_eq(registry_tag(reg, "s4321")->name, "s4321");
  for (int i = 0; i < 5000; i += 2) {
    snprintf(name, sizeof name, "s%d", i);
    ck_assert_int_eq(registry_share(reg, name, false, &t, &f), CODE(OK));
    ck_assert_ptr_null(registry_tag(reg, name));
  }
  ck_assert_str_eq(registry_tag(reg, "s4321")->name, "s4321");
  ck_assert_ptr_null(registry_tag(reg, "s4320"));
}
END_TEST

int main(void) {
  return HARNESS_RUN("registry", 20, setup, teardown,
                     sizes_round_up_and_split_into_chunks,
                     bad_requests_change_nothing,
                     capacity_is_enforced_per_device,
                     paused_tag_refuses_unless_asked,
                     backup_and_restore_keep_contents,
                     memory_create_is_all_or_nothing,
                     verification_catches_a_changed_backup,
                     backup_limit_is_enforced_at_allocation,
                     unused_tags_are_forgotten,
                     tags_belong_to_their_creator,
                     shared_tags_outlive_their_buffers,
                     quotas_are_per_uid,
                     buffers_page_in_id_order);
}
