/* The journal file (daemon/journal.c) with the registry that fills it:
 * what a daemon wrote comes back to the next, cut at any byte it still
 * reads every record that is whole, and a file it did not write (another
 * format, boot, backend, owner or mode, a changed byte) is put aside. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "daemon/journal.h"
#include "daemon/registry.h"
#include "harness.h"

#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x
#define MiB (1ull << 20)

static gpudev *g;
static registry *reg;
static struct owner owner;
static struct fault f;
static char dir[64], path[128];
static const struct journal_identity who = {"host", 2};

static void setup(void) {
  harness_fd_setup();
  struct gpudev_options o = {.backend = "host", .host_devices = 2, .host_device_size = 64 * MiB};
  char err[128];
  ck_assert_int_eq(gpudev_open(&o, &g, err, sizeof err), 0);
  struct registry_options ro = {.chunk_size = 16 * MiB, .backup_limit = 32 * MiB};
  reg = registry_create(g, &ro);
  owner = (struct owner){.uid = 1000};
  list_init(&owner.buffers);
  memset(&f, 0, sizeof f);
  snprintf(dir, sizeof dir, "/tmp/check_journal.XXXXXX");
  ck_assert_ptr_nonnull(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/j", dir);
}

static void teardown(void) {
  registry_destroy(reg);
  gpudev_close(g);
  char cmd[160];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  ck_assert_int_eq(system(cmd), 0);
  harness_fd_teardown();
}

/* Open the journal at path, which must succeed. */
static journal *open_journal(void) {
  char err[256] = "";
  journal *j = journal_open(path, &who, err, sizeof err);
  ck_assert_msg(j, "%s", err);
  return j;
}

/* The file's bytes (static; *len of them). */
static const uint8_t *file_bytes(const char *p, size_t *len) {
  static uint8_t data[1 << 20];
  int fd = open(p, O_RDONLY);
  ck_assert_int_ge(fd, 0);
  ssize_t n = read(fd, data, sizeof data);
  ck_assert_int_ge(n, 0);
  close(fd);
  *len = (size_t)n;
  return data;
}

/* Write len bytes as the file at path, mode 0600. */
static void put_file(const uint8_t *data, size_t len) {
  unlink(path);
  int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
  ck_assert_int_ge(fd, 0);
  ck_assert_int_eq(write(fd, data, len), (ssize_t)len);
  close(fd);
}

/* What a journal found, which must be want; its words. */
static const char *found_is(journal *j, enum journal_found want) {
  const char *why;
  ck_assert_int_eq(journal_found(j, &why), want);
  return why;
}

/* A registry's worth of tags and buffers, written: a paused one among
 * them, a freed one, a shared tag. */
static void write_some(journal *j, struct buffer **kept) {
  char err[256];
  ck_assert_int_eq(journal_rewrite(j, registry_journal_fill, reg, err, sizeof err), 0);
  registry_set_journal(reg, j);
  struct buffer *a, *b, *c;
  ck_assert_int_eq(registry_alloc(reg, &owner, "kv", 0, 4 * MiB, 0, &a, &f), CODE(OK));
  ck_assert_int_eq(registry_alloc(reg, &owner, "kv", 1, 2 * MiB, BUF_FLAG_BACKUP, &b, &f),
                   CODE(OK));
  ck_assert_int_eq(registry_alloc(reg, &owner, "w", 0, 2 * MiB, 0, &c, &f), CODE(OK));
  struct tag *t;
  ck_assert_int_eq(registry_share(reg, "open", true, &t, &f), CODE(OK));
  registry_free(reg, c);
  ck_assert(registry_move(reg, a, BUF_EV_PAUSE));
  registry_memory_release(reg, a);
  ck_assert(registry_move(reg, a, BUF_EV_UNMAPPED));
  registry_mark_paused(reg, a->tag, 1, true);
  ck_assert_int_eq(journal_flush(j), 0);
  kept[0] = a;
  kept[1] = b;
}

/* What one daemon wrote, the next finds: its tags (owner, share, paused
 * marks) and its buffers (uid, tag, device, size, flags, state, secret),
 * and not what was freed. */
START_TEST(what_a_daemon_wrote_the_next_finds) {
  journal *j = open_journal();
  found_is(j, JOURNAL_NONE);
  struct buffer *kept[2];
  write_some(j, kept);
  registry_set_journal(reg, NULL);
  journal_close(j);
  struct stat st;
  ck_assert_int_eq(stat(path, &st), 0);
  ck_assert_uint_eq(st.st_mode & 0777, 0600);
  j = open_journal();
  found_is(j, JOURNAL_LOADED);
  ck_assert_uint_eq(journal_expected_count(j), 2);
  for (int i = 0; i < 2; i++) {
    const struct journal_buffer *e = journal_expected(j, kept[i]->id);
    ck_assert_ptr_nonnull(e);
    ck_assert_uint_eq(e->uid, 1000);
    ck_assert_str_eq(e->tag, "kv");
    ck_assert_uint_eq(e->device, kept[i]->device);
    ck_assert_uint_eq(e->size, kept[i]->size);
    ck_assert_uint_eq(e->flags, kept[i]->flags);
    ck_assert_int_eq(e->state, i == 0 ? BUF_PAUSED : BUF_ACTIVE);
    ck_assert_mem_eq(e->secret, kept[i]->secret, WIRE_SECRET_SIZE);
  }
  ck_assert_mem_ne(kept[0]->secret, kept[1]->secret, WIRE_SECRET_SIZE);
  size_t nt;
  const struct journal_tag *tags = journal_tags(j, &nt);
  ck_assert_uint_eq(nt, 2); /* kv and open; w went with its buffer */
  for (size_t i = 0; i < nt; i++) {
    if (strcmp(tags[i].name, "kv") == 0) {
      ck_assert(tags[i].owned && !tags[i].shared);
      ck_assert_uint_eq(tags[i].uid, 1000);
      ck_assert_uint_eq(tags[i].paused_devices, 1);
    } else {
      ck_assert_str_eq(tags[i].name, "open");
      ck_assert(tags[i].shared);
    }
  }
  ck_assert_uint_eq(journal_max_id(j), kept[1]->id + 1); /* the freed one's */
  journal_close(j);
}
END_TEST

/* A daemon that dies while it appends leaves a cut last record: cut at
 * any byte after the header, the journal is read, and finds exactly the
 * buffers whose records are whole. */
START_TEST(a_journal_cut_anywhere_keeps_its_whole_records) {
  journal *j = open_journal();
  char err[256];
  ck_assert_int_eq(journal_rewrite(j, registry_journal_fill, reg, err, sizeof err), 0);
  size_t header;
  file_bytes(path, &header);
  registry_set_journal(reg, j);
  size_t ends[8];
  uint64_t ids[8];
  for (int i = 0; i < 8; i++) {
    struct buffer *b;
    ck_assert_int_eq(registry_alloc(reg, &owner, "kv", 0, 2 * MiB, 0, &b, &f), CODE(OK));
    ids[i] = b->id;
    ck_assert_int_eq(journal_flush(j), 0);
    file_bytes(path, &ends[i]);
  }
  registry_set_journal(reg, NULL);
  journal_close(j);
  size_t len;
  const uint8_t *all = file_bytes(path, &len);
  uint8_t *copy = malloc(len);
  memcpy(copy, all, len);
  for (size_t cut = header; cut <= len; cut++) {
    put_file(copy, cut);
    j = open_journal();
    const char *why = found_is(j, JOURNAL_LOADED);
    size_t whole = 0;
    while (whole < 8 && ends[whole] <= cut) whole++;
    ck_assert_msg(journal_expected_count(j) == whole, "cut at %zu of %zu: %zu found, %zu whole",
                  cut, len, journal_expected_count(j), whole);
    for (size_t i = 0; i < 8; i++)
      ck_assert((journal_expected(j, ids[i]) != NULL) == (i < whole));
    bool at_end = false; /* at a record's end */
    for (size_t at = 8; at <= cut && at + 8 <= len && !at_end;
         at += 8 + (copy[at] | copy[at + 1] << 8 | copy[at + 2] << 16 | (size_t)copy[at + 3] << 24))
      at_end = at == cut;
    at_end |= cut == len;
    ck_assert_msg(at_end == (strstr(why, "cut") == NULL), "cut at %zu: '%s'", cut, why);
    journal_close(j);
  }
  free(copy);
}
END_TEST

/* Rewrite a header field of a journal whose only record is its header:
 * the file the daemon would find. */
static void put_header(uint32_t format, const char *boot, const char *backend,
                       uint32_t devices) {
  Gpumem__Wire__JournalHeader h = GPUMEM__WIRE__JOURNAL_HEADER__INIT;
  h.format = format;
  h.daemon_version = "9.9.9";
  h.boot_id = (char *)boot;
  h.backend = (char *)backend;
  h.devices = devices;
  h.uid = (uint32_t)geteuid();
  Gpumem__Wire__JournalRecord r = GPUMEM__WIRE__JOURNAL_RECORD__INIT;
  r.body_case = GPUMEM__WIRE__JOURNAL_RECORD__BODY_HEADER;
  r.header = &h;
  uint8_t buf[512];
  memcpy(buf, "gpumemJ\n", 8);
  size_t n = gpumem__wire__journal_record__pack(&r, buf + 16);
  for (int i = 0; i < 4; i++) {
    buf[8 + i] = (uint8_t)(n >> (8 * i));
    buf[12 + i] = (uint8_t)(XXH32(buf + 16, n, 0) >> (8 * i));
  }
  put_file(buf, 16 + n);
}

/* The kernel's boot id. */
static const char *boot_id(void) {
  static char id[64];
  FILE *fp = fopen("/proc/sys/kernel/random/boot_id", "r");
  ck_assert_ptr_nonnull(fp);
  ck_assert_ptr_nonnull(fgets(id, sizeof id, fp));
  fclose(fp);
  id[strcspn(id, "\n")] = 0;
  return id;
}

/* The journal at path is put aside (PATH.rejected, with the same bytes)
 * and found rejected with words that hold words. */
static void rejected_for(const char *words) {
  size_t before_len;
  const uint8_t *b = file_bytes(path, &before_len);
  uint8_t *before = malloc(before_len + 1);
  memcpy(before, b, before_len);
  journal *j = open_journal();
  const char *why = found_is(j, JOURNAL_REJECTED);
  ck_assert_msg(strstr(why, words), "'%s' does not say '%s'", why, words);
  ck_assert_uint_eq(journal_expected_count(j), 0);
  journal_close(j);
  ck_assert_int_eq(access(path, F_OK), -1);
  char aside[160];
  snprintf(aside, sizeof aside, "%s.rejected", path);
  size_t len;
  const uint8_t *kept = file_bytes(aside, &len);
  ck_assert_uint_eq(len, before_len);
  ck_assert_mem_eq(kept, before, len);
  free(before);
  unlink(aside);
}

/* What the daemon did not write is not trusted, and not lost: another
 * format, boot, backend or device count; a changed byte; a file of
 * another owner or that others may read; one that is no journal. */
START_TEST(a_journal_not_ours_is_put_aside) {
  put_header(1, boot_id(), "host", 2);
  journal *j = open_journal();
  found_is(j, JOURNAL_LOADED);
  journal_close(j);
  put_header(2, boot_id(), "host", 2);
  rejected_for("format 2 (written by gpumemd 9.9.9); this daemon reads 1");
  put_header(1, "00000000-0000-0000-0000-000000000000", "host", 2);
  rejected_for("before the machine started again");
  put_header(1, boot_id(), "cuda", 2);
  rejected_for("written for backend cuda with 2 devices, not host with 2");
  put_header(1, boot_id(), "host", 8);
  rejected_for("with 8 devices");
  /* A journal a daemon wrote, one byte changed in its last record. */
  struct buffer *kept[2];
  write_some(j = open_journal(), kept);
  registry_set_journal(reg, NULL);
  journal_close(j);
  size_t len;
  const uint8_t *all = file_bytes(path, &len);
  uint8_t *copy = malloc(len);
  memcpy(copy, all, len);
  copy[len - 3] ^= 0x40;
  put_file(copy, len);
  free(copy);
  rejected_for("checksum does not match");
  put_file((const uint8_t *)"hello\n", 6);
  rejected_for("not a gpumemd journal");
  put_header(1, boot_id(), "host", 2);
  ck_assert_int_eq(chmod(path, 0644), 0);
  rejected_for("mode is 0644");
  if (geteuid() == 0) {
    put_header(1, boot_id(), "host", 2);
    ck_assert_int_eq(chown(path, 1000, 1000), 0);
    rejected_for("owned by uid 1000");
  }
  ck_assert_int_eq(symlink("/etc/passwd", path), 0);
  rejected_for("not a regular file");
}
END_TEST

/* One journal, one daemon: a second one's open says who holds it. */
START_TEST(a_journal_is_one_daemons) {
  journal *j = open_journal();
  char err[256] = "";
  ck_assert_ptr_null(journal_open(path, &who, err, sizeof err));
  ck_assert_msg(strstr(err, "another gpumemd holds it"), "%s", err);
  journal_close(j);
  j = open_journal();
  journal_close(j);
}
END_TEST

/* Appends that outgrow the whole journal make it be written whole again:
 * the file stays near what it holds, and says the same. */
START_TEST(a_journal_that_grows_is_written_whole_again) {
  journal *j = open_journal();
  char err[256];
  ck_assert_int_eq(journal_rewrite(j, registry_journal_fill, reg, err, sizeof err), 0);
  registry_set_journal(reg, j);
  struct buffer *keep;
  ck_assert_int_eq(registry_alloc(reg, &owner, "kv", 0, 2 * MiB, 0, &keep, &f), CODE(OK));
  uint64_t most = 0, rewrites = 0, last = 0;
  struct buffer *b;
  ck_assert_int_eq(registry_alloc(reg, &owner, "g", 1, 2 * MiB, 0, &b, &f), CODE(OK));
  registry_mark_paused(reg, b->tag, 2, true); /* what joins it starts paused: no memory */
  registry_free(reg, b);
  for (int i = 0; i < 20000; i++) {
    ck_assert_int_eq(
        registry_alloc(reg, &owner, "g", 1, 2 * MiB, BUF_FLAG_ALLOW_PAUSED, &b, &f), CODE(OK));
    registry_free(reg, b);
    ck_assert_int_eq(journal_flush(j), 0);
    uint64_t size, whole;
    journal_size(j, &size, &whole);
    if (size < last) rewrites++;
    last = size;
    if (size > most) most = size;
  }
  ck_assert_uint_ge(rewrites, 1);
  ck_assert_uint_le(most, (1u << 20) + 4096); /* GROWTH_MIN, and a record */
  registry_set_journal(reg, NULL);
  journal_close(j);
  j = open_journal();
  found_is(j, JOURNAL_LOADED);
  ck_assert_uint_eq(journal_expected_count(j), 1);
  ck_assert_ptr_nonnull(journal_expected(j, keep->id));
  journal_close(j);
}
END_TEST

int main(void) {
  return HARNESS_RUN("journal", 60, setup, teardown,
                     what_a_daemon_wrote_the_next_finds,
                     a_journal_cut_anywhere_keeps_its_whole_records,
                     a_journal_not_ours_is_put_aside,
                     a_journal_is_one_daemons,
                     a_journal_that_grows_is_written_whole_again);
}
