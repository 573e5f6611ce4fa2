/* Backups on disk (GPUMEM_BACKUP_DISK, protocol 1.9): with --backup-dir,
 * a pause writes such a buffer's backup to a file of the daemon's own
 * and lets go of its host memory; the resume reads it back first; the
 * owner reads a paused one from its file (1.10). The
 * files are never visible in the directory (a crash leaves nothing), a
 * directory the daemon cannot trust or write is refused, and a pause
 * whose writes cannot happen says so with the contents whole. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/wire.h"
#include "gpumem.h"
#include "harness.h"
#include "procfd.h"
#include "scenario.h"

static struct daemon d;
static char dir[128]; /* the backup directory of the test */

/* Make a fresh backup directory (mode 0700, ours). */
static void make_dir(void) {
  snprintf(dir, sizeof dir, "%s/gpumem-backups.XXXXXX",
           getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  ck_assert_ptr_nonnull(mkdtemp(dir));
}

/* Stop the daemon, then remove the directory and what is in it. */
static void teardown(void) {
  harness_daemon_teardown(&d);
  if (dir[0]) {
    char cmd[320];
    snprintf(cmd, sizeof cmd, "chmod 700 %s 2>/dev/null; rm -rf %s", dir, dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
  }
  dir[0] = '\0';
}

/* Start the daemon with --backup-dir dir; with env set (NAME=VALUE, or
 * NULL) under the test shim libfake_kernel.so, which shows it the disk
 * that says. */
static void start_with(const char *env, const char *a1, const char *a2) {
  const char *asan = getenv("ASAN_OPTIONS");
  char *saved = asan ? strdup(asan) : NULL;
  if (env) {
    char opts[1024], name[64];
    snprintf(opts, sizeof opts, "%s%sverify_asan_link_order=0", asan ? asan : "",
             asan ? ":" : "");
    setenv("ASAN_OPTIONS", opts, 1);
    const char *eq = strchr(env, '=');
    snprintf(name, sizeof name, "%.*s", (int)(eq - env), env);
    setenv(name, eq + 1, 1);
    setenv("LD_PRELOAD", harness_built("tests/libfake_kernel.so"), 1);
  }
  daemon_start(&d, "--backup-dir", dir, a1, a2, NULL);
  if (env) {
    char name[64];
    snprintf(name, sizeof name, "%.*s", (int)(strchr(env, '=') - env), env);
    unsetenv(name);
    unsetenv("LD_PRELOAD");
    if (saved) setenv("ASAN_OPTIONS", saved, 1);
    else unsetenv("ASAN_OPTIONS");
  }
  free(saved);
}

/* What the daemon holds open in the backup directory. */
struct held {
  int files;
  uint64_t bytes;  /* their sizes */
  uint64_t blocks; /* bytes the filesystem gave them */
  pid_t pid;
};

/* Count one of the daemon's fds if it is a file in dir (proc_fd_each). */
static void count_file(int fd, const char *target, void *arg) {
  struct held *h = arg;
  if (strncmp(target, dir, strlen(dir)) != 0 || target[strlen(dir)] != '/') return;
  char link[64];
  snprintf(link, sizeof link, "/proc/%d/fd/%d", (int)h->pid, fd);
  struct stat st;
  if (stat(link, &st) < 0 || !S_ISREG(st.st_mode)) return;
  h->files++;
  h->bytes += (uint64_t)st.st_size;
  h->blocks += (uint64_t)st.st_blocks * 512;
}

/* The files the daemon holds in dir, from /proc. */
static struct held held_files(void) {
  struct held h = {.pid = d.pid};
  ck_assert_int_ge(proc_fd_each(d.pid, count_file, &h), 0);
  return h;
}

/* Names in dir (none: the files are never linked there). */
static int names_in_dir(void) {
  DIR *dp = opendir(dir);
  ck_assert_ptr_nonnull(dp);
  int n = 0;
  for (struct dirent *e; (e = readdir(dp));)
    n += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0;
  closedir(dp);
  return n;
}

/* The last word of buffer b. */
static uint32_t last_word(gpumem_client *w, gpumem_buffer *b, uint64_t size) {
  uint32_t v = 0;
  ck_assert_int_eq(gpumem_buffer_read(w, b, size - sizeof v, &v, sizeof v), 0);
  return v;
}

/* Connect a worker and a controller. */
static void connect_both(gpumem_client **w, gpumem_client **ctl) {
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, w), 0);
  ck_assert_int_eq(gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, 0, ctl), 0);
}

/* Paused, the backup is a file the daemon holds (its whole size given by
 * the filesystem, no name in the directory) and no host memory or
 * reservation; resumed, the contents are back and the file is gone. */
START_TEST(a_disk_backup_is_a_file_only_while_paused) {
  make_dir();
  start_with(NULL, NULL, NULL);
  gpumem_client *w = NULL, *ctl = NULL;
  connect_both(&w, &ctl);
  const uint64_t size = 8 * MiB;
  gpumem_buffer *b = NULL;
  ck_assert_msg(gpumem_alloc(w, "weights", 0, size, GPUMEM_BACKUP | GPUMEM_BACKUP_DISK, &b) == 0,
                "%s", gpumem_last_error());
  ck_assert_uint_eq(gpumem_buffer_flags(b) & GPUMEM_BACKUP_RELEASE, GPUMEM_BACKUP_RELEASE);
  uint64_t memfd0 = memfd_bytes(&d.pid, 1);
  for (uint32_t round = 0; round < 3; round++) {
    ck_assert_int_eq(gpumem_buffer_fill32(w, b, 0, size, 0xd15c0 + round), 0);
    ck_assert_msg(client_op(ctl, "weights", false) == 0, "%s", gpumem_last_error());
    struct gpumem_tag_status t = client_tag(ctl, "weights");
    ck_assert_uint_eq(t.backup_disk_bytes, size);
    ck_assert_uint_eq(t.backup_bytes, size);
    ck_assert_uint_eq(t.backup_pinned_bytes, 0);
    ck_assert_uint_eq(t.backup_reserved_bytes, 0);
    struct held h = held_files();
    ck_assert_int_eq(h.files, 1);
    ck_assert_uint_eq(h.bytes, size);
    ck_assert_uint_ge(h.blocks, size);
    ck_assert_int_eq(names_in_dir(), 0);
    /* Neither the device memory nor the backup's: the daemon's memfds
     * hold less than before the pause. */
    ck_assert_uint_lt(memfd_bytes(&d.pid, 1), memfd0);
    pid_t me = getpid(); /* and this worker keeps no mapping of the backup */
    ck_assert_uint_eq(memfd_bytes(&me, 1), 0);
    struct gpumem_status *s = NULL;
    ck_assert_int_eq(gpumem_status(ctl, &s), 0);
    ck_assert_str_eq(s->backup_dir, dir);
    ck_assert_uint_eq(s->backup_disk_bytes, size);
    ck_assert_uint_gt(s->backup_disk_free, 0);
    gpumem_status_free(s);
    ck_assert_msg(client_op(ctl, "weights", true) == 0, "%s", gpumem_last_error());
    ck_assert_uint_eq(last_word(w, b, size), 0xd15c0 + round);
    t = client_tag(ctl, "weights");
    ck_assert_uint_eq(t.backup_disk_bytes, 0);
    ck_assert_uint_eq(t.backup_pinned_bytes, 0);
    ck_assert_int_eq(held_files().files, 0);
  }
  ck_assert_int_eq(gpumem_free(w, b), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* A buffer freed (its session ended) while its backup is on disk takes
 * its file with it. */
START_TEST(a_session_that_ends_takes_its_files) {
  make_dir();
  start_with(NULL, NULL, NULL);
  gpumem_client *w = NULL, *ctl = NULL;
  connect_both(&w, &ctl);
  gpumem_buffer *b[3] = {0};
  for (int i = 0; i < 3; i++)
    ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 2 * MiB, GPUMEM_BACKUP | GPUMEM_BACKUP_DISK,
                                  &b[i]), 0);
  ck_assert_msg(client_op(ctl, "weights", false) == 0, "%s", gpumem_last_error());
  ck_assert_int_eq(held_files().files, 3);
  gpumem_disconnect(w);
  for (int tries = 0; tries < 200 && held_files().files; tries++) {
    /* The daemon frees the session's buffers as it reads the hang-up:
     * a status after it has is answered after them. */
    struct gpumem_status *s = NULL;
    ck_assert_int_eq(gpumem_status(ctl, &s), 0);
    gpumem_status_free(s);
  }
  ck_assert_int_eq(held_files().files, 0);
  gpumem_disconnect(ctl);
}
END_TEST

/* Without --backup-dir a disk backup is refused at the allocation, naming
 * the option; the wire's BACKUP_DISK without BACKUP is refused too. */
START_TEST(a_disk_backup_needs_a_backup_dir) {
  daemon_start(&d, NULL);
  gpumem_client *w = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  gpumem_buffer *b = NULL;
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 2 * MiB, GPUMEM_BACKUP | GPUMEM_BACKUP_DISK, &b),
                   GPUMEM_E_INVALID);
  ck_assert_msg(strstr(gpumem_last_error(), "no --backup-dir"), "%s", gpumem_last_error());
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 2 * MiB, GPUMEM_BACKUP_DISK, &b),
                   GPUMEM_E_INVALID);
  struct gpumem_status *s = NULL;
  ck_assert_int_eq(gpumem_status(w, &s), 0);
  ck_assert_str_eq(s->backup_dir, "");
  gpumem_status_free(s);
  gpumem_disconnect(w);
}
END_TEST

/* The daemon does not start on a backup directory that is missing, that
 * others can write, or on a read-only filesystem; each says why. */
START_TEST(a_backup_dir_it_cannot_trust_stops_the_start) {
  make_dir();
  struct {
    const char *env, *dir_mode, *words;
  } cases[] = {
      {NULL, "missing", "No such file or directory"},
      {NULL, "0777", "is not safe: it is writable by every user (mode 0777)"},
      {NULL, "0770", "is not safe: it is writable by its group"},
      {"GPUMEM_TEST_STATVFS=ro", "0700", "is on a read-only filesystem"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char path[160];
    snprintf(path, sizeof path, "%s/%s", dir,
             strcmp(cases[i].dir_mode, "missing") == 0 ? "none" : "d");
    if (strcmp(cases[i].dir_mode, "missing") != 0) {
      ck_assert_int_eq(mkdir(path, 0700), 0);
      ck_assert_int_eq(chmod(path, (mode_t)strtol(cases[i].dir_mode, NULL, 8)), 0);
    }
    daemon_paths(&d, "gpumemd-test");
    if (cases[i].env) {
      setenv("GPUMEM_TEST_STATVFS", "ro", 1);
      setenv("LD_PRELOAD", harness_built("tests/libfake_kernel.so"), 1);
      setenv("ASAN_OPTIONS", "verify_asan_link_order=0:detect_leaks=0", 1);
    }
    const char *extra[] = {"--backup-dir", path, NULL};
    pid_t pid = daemon_spawn(d.socket, d.log, extra);
    if (cases[i].env) {
      unsetenv("GPUMEM_TEST_STATVFS");
      unsetenv("LD_PRELOAD");
      unsetenv("ASAN_OPTIONS");
    }
    int status = 0;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 1, "case %zu: status %d", i,
                  status);
    ck_assert_msg(daemon_log_count(&d, cases[i].words) == 1, "case %zu: no '%s' in %s", i,
                  cases[i].words, d.log);
    ck_assert_msg(daemon_log_count(&d, "backup directory") >= 1, "case %zu", i);
    daemon_stop(&d);
    rmdir(path);
  }
}
END_TEST

/* A pause whose disk backups cannot be written fails before it unmaps
 * anything: not enough room, the directory removed or made writable by
 * others since the start. The buffers stay mapped with their contents. */
START_TEST(a_pause_that_cannot_write_pauses_nothing) {
  make_dir();
  start_with("GPUMEM_TEST_STATVFS=free=6291456", NULL, NULL); /* 6 MiB free */
  gpumem_client *w = NULL, *ctl = NULL;
  connect_both(&w, &ctl);
  gpumem_buffer *b = NULL;
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 8 * MiB, GPUMEM_BACKUP | GPUMEM_BACKUP_DISK, &b),
                   0);
  ck_assert_int_eq(gpumem_buffer_fill32(w, b, 0, 8 * MiB, 0xf011), 0);
  ck_assert_int_eq(client_op(ctl, "weights", false), GPUMEM_E_BACKEND);
  ck_assert_msg(strstr(gpumem_last_error(), "has 6291456 bytes free, 8388608 needed") &&
                    strstr(gpumem_last_error(), "nothing was paused"),
                "%s", gpumem_last_error());
  ck_assert_int_eq(gpumem_buffer_mapped(b), 1);
  ck_assert_int_eq(client_tag(ctl, "weights").state, GPUMEM_ACTIVE);
  ck_assert_uint_eq(last_word(w, b, 8 * MiB), 0xf011);
  /* The directory made writable by others, then removed. */
  ck_assert_int_eq(chmod(dir, 0777), 0);
  ck_assert_int_eq(client_op(ctl, "weights", false), GPUMEM_E_BACKEND);
  ck_assert_msg(strstr(gpumem_last_error(), "is not safe: it is writable by every user"), "%s",
                gpumem_last_error());
  ck_assert_int_eq(chmod(dir, 0700), 0);
  ck_assert_int_eq(rmdir(dir), 0);
  ck_assert_int_eq(client_op(ctl, "weights", false), GPUMEM_E_BACKEND);
  ck_assert_msg(strstr(gpumem_last_error(), "was removed"), "%s", gpumem_last_error());
  ck_assert_int_eq(gpumem_buffer_mapped(b), 1);
  ck_assert_uint_eq(last_word(w, b, 8 * MiB), 0xf011);
  ck_assert_int_eq(mkdir(dir, 0700), 0); /* for the teardown */
  ck_assert_int_eq(gpumem_free(w, b), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* A write that fails (here a disk that fills: 6 MiB, under the shim, for
 * a 4 MiB and an 8 MiB backup) fails the pause naming the buffer and why;
 * that backup stays in host memory, the other went to disk, and the
 * resume brings both back whole. */
START_TEST(a_write_that_fails_keeps_the_backup_in_host_memory) {
  make_dir();
  start_with("GPUMEM_TEST_DISK_FULL_AFTER=6291456", NULL, NULL);
  gpumem_client *w = NULL, *ctl = NULL;
  connect_both(&w, &ctl);
  gpumem_buffer *small = NULL, *big = NULL;
  const unsigned fl = GPUMEM_BACKUP | GPUMEM_BACKUP_DISK;
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 4 * MiB, fl, &small), 0);
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 8 * MiB, fl, &big), 0);
  ck_assert_int_eq(gpumem_buffer_fill32(w, small, 0, 4 * MiB, 0x5a11), 0);
  ck_assert_int_eq(gpumem_buffer_fill32(w, big, 0, 8 * MiB, 0xb16), 0);
  ck_assert_int_eq(client_op(ctl, "weights", false), GPUMEM_E_BACKEND);
  char want[96];
  snprintf(want, sizeof want, "the backup of buffer %llu was not written",
           (unsigned long long)gpumem_buffer_id(big));
  ck_assert_msg(strstr(gpumem_last_error(), want) &&
                    strstr(gpumem_last_error(), "No space left on device") &&
                    strstr(gpumem_last_error(), "it stays in host memory"),
                "%s", gpumem_last_error());
  struct gpumem_tag_status t = client_tag(ctl, "weights");
  ck_assert_int_eq(t.state, GPUMEM_PAUSED);
  ck_assert_uint_eq(t.backup_disk_bytes, 4 * MiB);
  ck_assert_uint_eq(t.backup_pinned_bytes, 8 * MiB);
  ck_assert_uint_eq(t.backup_bytes, 12 * MiB);
  ck_assert_int_eq(held_files().files, 1);
  ck_assert_msg(client_op(ctl, "weights", true) == 0, "%s", gpumem_last_error());
  ck_assert_uint_eq(last_word(w, small, 4 * MiB), 0x5a11);
  ck_assert_uint_eq(last_word(w, big, 8 * MiB), 0xb16);
  ck_assert_int_eq(held_files().files, 0);
  ck_assert_uint_eq(client_tag(ctl, "weights").backup_pinned_bytes, 0);
  ck_assert_int_eq(gpumem_free(w, small), 0);
  ck_assert_int_eq(gpumem_free(w, big), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* A daemon killed while backups are on disk leaves no file behind, and a
 * start removes the named files an older daemon's crash could leave (not
 * others). */
START_TEST(a_crash_leaves_no_file_behind) {
  make_dir();
  char stale[200], other[200];
  snprintf(stale, sizeof stale, "%s/gpumemd-backup.1.2", dir);
  snprintf(other, sizeof other, "%s/notes.txt", dir);
  FILE *f = fopen(stale, "w");
  ck_assert_ptr_nonnull(f);
  fclose(f);
  ck_assert_ptr_nonnull(f = fopen(other, "w"));
  fclose(f);
  start_with(NULL, NULL, NULL);
  ck_assert_int_eq(access(stale, F_OK), -1);
  ck_assert_int_eq(access(other, F_OK), 0);
  ck_assert_int_eq(unlink(other), 0);
  gpumem_client *w = NULL, *ctl = NULL;
  connect_both(&w, &ctl);
  gpumem_buffer *b = NULL;
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 4 * MiB, GPUMEM_BACKUP | GPUMEM_BACKUP_DISK, &b),
                   0);
  ck_assert_msg(client_op(ctl, "weights", false) == 0, "%s", gpumem_last_error());
  ck_assert_int_eq(held_files().files, 1);
  kill(d.pid, SIGKILL);
  waitpid(d.pid, NULL, 0);
  d.pid = 0;
  ck_assert_int_eq(names_in_dir(), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* A paused disk backup is read from its file (protocol 1.10): copied
 * and in place, through a read-only mapping of the daemon's file that
 * cannot be made writable and holds no host memory of the daemon's; the
 * mapping goes with the resume (the file with it), and the next pause's
 * backup reads its new contents. */
START_TEST(a_paused_disk_backup_is_read_from_its_file) {
  make_dir();
  start_with(NULL, NULL, NULL);
  gpumem_client *w = NULL, *ctl = NULL;
  connect_both(&w, &ctl);
  const uint64_t size = 8 * MiB, off = MiB + 4096 + 12, len = 3 * MiB;
  gpumem_buffer *b = NULL;
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, size, GPUMEM_BACKUP | GPUMEM_BACKUP_DISK, &b),
                   0);
  uint32_t *got = malloc(len);
  char perms[5];
  for (uint32_t round = 0; round < 2; round++) {
    uint32_t word = 0xf11e0 + round;
    ck_assert_int_eq(gpumem_buffer_fill32(w, b, 0, size, word), 0);
    ck_assert_msg(client_op(ctl, "weights", false) == 0, "%s", gpumem_last_error());
    uint64_t memfd0 = memfd_bytes(&d.pid, 1);
    memset(got, 0, len);
    const char *p = (const char *)gpumem_buffer_ptr(b) + off;
    ck_assert_msg(gpumem_backup_read(w, p, len, got) == 0, "%s", gpumem_last_error());
    for (uint64_t i = 0; i < len / 4; i++) ck_assert_uint_eq(got[i], word);
    const void *view = NULL;
    ck_assert_int_eq(gpumem_backup_view(w, p, len, &view), 0);
    ck_assert_int_eq(memcmp(view, got, len), 0);
    /* The daemon's file itself, read only (shared, and no write access
     * can be had), and no host memory of the daemon's holds it. */
    ck_assert_uint_eq(self_mapped(dir, perms), size);
    ck_assert_str_eq(perms, "r--s");
    void *page = (void *)((uintptr_t)view & ~(uintptr_t)4095);
    ck_assert_int_eq(mprotect(page, 4096, PROT_READ | PROT_WRITE), -1);
    ck_assert_int_eq(errno, EACCES);
    ck_assert_uint_eq(memfd_bytes(&d.pid, 1), memfd0);
    ck_assert_int_eq(held_files().files, 1);
    ck_assert_msg(client_op(ctl, "weights", true) == 0, "%s", gpumem_last_error());
    ck_assert_uint_eq(last_word(w, b, size), word);
    ck_assert_uint_eq(self_mapped(dir, perms), 0); /* so the file is gone for good */
    ck_assert_int_eq(held_files().files, 0);
    uint32_t v;
    ck_assert_int_eq(gpumem_backup_read(w, p, sizeof v, &v), GPUMEM_E_WRONG_STATE);
  }
  free(got);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* A daemon with a backup directory, a raw worker w and controller c, and
 * w's BACKUP_DISK buffer b of size bytes in tag "kv", filled with seed's
 * pattern and paused (its backup in its file). */
static void paused_on_disk(struct peer *w, struct peer *c, struct pbuf *b, uint64_t size,
                           uint32_t seed) {
  make_dir();
  start_with(NULL, NULL, NULL);
  scene_open(w, c, &d);
  const uint32_t disk = GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP |
                        GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_RELEASE |
                        GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP_DISK;
  peer_alloc(w, "kv", 0, size, disk, b);
  scene_fill(b, size, seed);
  scene_served(c, w, b, 1, false, "kv");
}

/* A peer that asks for its disk backup again and again without reading
 * the answers cannot make the daemon hold a descriptor for each: past a
 * bound the requests are refused, saying why, and the session goes on.
 * The file is emptied once the buffer is ACTIVE again, so that a reader
 * keeping it open keeps no disk space. */
START_TEST(unread_backup_answers_hold_few_descriptors) {
  struct peer w, c;
  struct pbuf b;
  paused_on_disk(&w, &c, &b, 4 * MiB, 3);
  const int asks = 3000;
  Gpumem__Wire__BackupRequest q = GPUMEM__WIRE__BACKUP_REQUEST__INIT;
  q.buffer_id = b.id;
  for (int i = 0; i < asks; i++) {
    wire_env env = wire_envelope(100 + (uint64_t)i, GPUMEM__WIRE__ENVELOPE__BODY_BACKUP, &q);
    peer_put(&w, &env, NULL, 0);
  }
  /* Once the daemon has answered the last one (a status behind them on
   * the controller's socket is answered after), count what it holds. */
  wire_env_free(peer_status(&c));
  int refused = 0, files = 0, kept = -1;
  for (int i = 0; i < asks; i++) {
    struct frame f;
    wire_env *r = peer_get(&w, &f);
    if (i == 0) kept = held_files().files; /* the daemon's own, and the unread answers' */
    if (r->body_case == GPUMEM__WIRE__ENVELOPE__BODY_ERROR) {
      ck_assert_int_eq(r->error->code, CODE(LIMIT_EXCEEDED));
      ck_assert_ptr_nonnull(strstr(r->error->message, "read them first"));
      refused++;
    } else {
      ck_assert(r->backup_reply->files);
      ck_assert_uint_eq(f.nfds, 1);
      if (i == asks - 1 || files == 0) {
        struct pbuf read = {.fds = {f.fds[0]}, .nfds = 1};
        ck_assert(scene_holds(&read, 4 * MiB, 3));
      }
      files++;
    }
    frame_release(&f);
    wire_env_free(r);
  }
  ck_assert_msg(refused > 0, "%d answers with files, none refused", files);
  ck_assert_msg(kept <= 64 + 1, "the daemon held %d files", kept);
  /* Resumed, its file emptied: a reader that kept it holds no disk. */
  wire_env env = wire_envelope(99, GPUMEM__WIRE__ENVELOPE__BODY_BACKUP, &q);
  peer_put(&w, &env, NULL, 0);
  struct frame f;
  wire_env *r = peer_get(&w, &f);
  ck_assert_uint_eq(f.nfds, 1);
  int reader = dup(f.fds[0]);
  frame_release(&f);
  wire_env_free(r);
  peer_op_served(&c, true, "kv", &w, &b, 1);
  ck_assert(scene_holds(&b, 4 * MiB, 3));
  struct stat st;
  ck_assert_int_eq(fstat(reader, &st), 0);
  ck_assert_int_eq(st.st_size, 0);
  ck_assert_int_eq(st.st_blocks, 0);
  close(reader);
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

/* A resume that read the backups back and then failed (its worker could
 * not map the buffer) leaves them only in their files again: no pinned
 * memory, nothing reserved; the next resume reads them again and the
 * contents come back. */
START_TEST(a_failed_resume_lets_go_of_what_it_read) {
  struct peer w, c;
  struct pbuf b;
  paused_on_disk(&w, &c, &b, 8 * MiB, 7);
  peer_op(&c, true, "kv", 0, 0);
  struct frame f;
  wire_env *e = peer_event(&w, &f), *r = NULL;
  frame_release(&f);
  peer_ack(&w, e->id, &b.id, 1, "cannot map it");
  wire_env_free(e);
  ck_assert_int_ne(peer_op_wait(&c, &r), CODE(OK));
  wire_env_free(r);
  wire_env *s = peer_status(&c);
  const Gpumem__Wire__TagInfo *t = peer_tag(s, "kv");
  ck_assert_uint_eq(t->backup_disk_bytes, 8 * MiB);
  ck_assert_uint_eq(t->backup_bytes, 8 * MiB);
  ck_assert_uint_eq(t->backup_pinned_bytes, 0);
  ck_assert_uint_eq(t->backup_reserved_bytes, 0);
  ck_assert_uint_eq(s->status_reply->backup_reserved, 0);
  wire_env_free(s);
  peer_op_served(&c, true, "kv", &w, &b, 1);
  ck_assert(scene_holds(&b, 8 * MiB, 7));
  peer_unmap(&b);
  peer_close(&w);
  peer_close(&c);
}
END_TEST

int main(void) {
  return HARNESS_RUN("backup_disk", 60, NULL, teardown, a_disk_backup_is_a_file_only_while_paused,
                     a_session_that_ends_takes_its_files, a_disk_backup_needs_a_backup_dir,
                     a_backup_dir_it_cannot_trust_stops_the_start,
                     a_pause_that_cannot_write_pauses_nothing,
                     a_write_that_fails_keeps_the_backup_in_host_memory,
                     a_crash_leaves_no_file_behind, a_paused_disk_backup_is_read_from_its_file,
                     unread_backup_answers_hold_few_descriptors,
                     a_failed_resume_lets_go_of_what_it_read);
}
