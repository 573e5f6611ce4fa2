/* Backups end to end: contents, limits, verification, a pause that cannot
 * back up, and what status, metrics and gpumemctl say. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpumem.h"
#include "harness.h"

#define MiB (1ull << 20)

static struct daemon d;

static void setup(void) { harness_fd_setup(); }

static void teardown(void) {
  if (d.pid) ck_assert_int_eq(daemon_stop(&d), 0);
  harness_fd_teardown();
}

static gpumem_client *controller(void) {
  gpumem_client *c = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, "test", GPUMEM_ROLE_CONTROLLER,
                                  GPUMEM_CONNECT_NO_THREAD, &c), 0);
  return c;
}

/* Run gpumemctl with arguments; its exit status and output. */
static int ctl(char *out, size_t len, const char *args) {
  char cmd[512];
  snprintf(cmd, sizeof cmd, "%s --socket %s %s 2>&1", harness_bin("gpumemctl"), d.socket, args);
  FILE *p = popen(cmd, "r");
  size_t n = fread(out, 1, len - 1, p);
  out[n] = '\0';
  int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* With --verify-backups every restore is read back and compared; status
 * and metrics show the backups and the copy bandwidth. */
START_TEST(verified_backups_survive_and_are_reported) {
  daemon_start(&d, "--verify-backups", NULL);
  struct worker w;
  worker_start(&w, &d, "--tag", "weights", "--size", "40M", "--count", "2", "--backup", NULL);
  char out[8192];
  ck_assert_int_eq(ctl(out, sizeof out, "pause --json weights"), 0);
  ck_assert_msg(strstr(out, "\"backup_bytes\":83886080"), "%s", out);
  ck_assert_int_eq(ctl(out, sizeof out, "status --json"), 0);
  ck_assert_msg(strstr(out, "\"backup_bytes\":83886080"), "%s", out);
  ck_assert_msg(strstr(out, "\"last_backup_bytes\":83886080"), "%s", out);
  ck_assert_int_eq(ctl(out, sizeof out, "metrics"), 0);
  ck_assert_msg(strstr(out, "gpumem_tag_backup_bytes{tag=\"weights\"} 83886080"), "%s", out);
  ck_assert_msg(strstr(out, "# TYPE gpumem_device_free_bytes gauge"), "%s", out);
  ck_assert_int_eq(ctl(out, sizeof out, "resume weights"), 0);
  ck_assert(worker_wait_for(&w, "contents kept", 2, 5000));
  ck_assert_int_eq(ctl(out, sizeof out, "status"), 0);
  ck_assert_msg(strstr(out, "last pause copied 80.0 MiB at") && strstr(out, "last resume copied"),
                "%s", out);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

START_TEST(backup_limit_refuses_at_allocation) {
  daemon_start(&d, "--backup-limit", "64M", NULL);
  gpumem_client *w;
  ck_assert_int_eq(gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, 0, &w), 0);
  gpumem_buffer *a, *b;
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 48 * MiB, GPUMEM_BACKUP, &a), 0);
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 32 * MiB, GPUMEM_BACKUP, &b), GPUMEM_E_LIMIT);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "--backup-limit"));
  ck_assert_int_eq(gpumem_alloc(w, "kv", 0, 32 * MiB, 0, &b), 0);
  ck_assert_int_eq(gpumem_free(w, a), 0);
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 64 * MiB, GPUMEM_BACKUP, &a), 0);
  gpumem_disconnect(w);
}
END_TEST

/* Without host memory for a backup, the buffer keeps its device memory
 * and its contents, and the pause says so. */
START_TEST(pause_without_room_for_a_backup_releases_nothing_of_it) {
  daemon_start(&d, NULL);
  struct worker w;
  worker_start(&w, &d, "--tag", "weights", "--size", "256M", "--backup", NULL);
  /* Leave the daemon no address space for a 256 MiB backup. */
  char path[64], line[256];
  snprintf(path, sizeof path, "/proc/%d/status", (int)d.pid);
  FILE *f = fopen(path, "r");
  unsigned long long vm_kb = 0;
  while (fgets(line, sizeof line, f)) sscanf(line, "VmSize: %llu kB", &vm_kb);
  fclose(f);
  struct rlimit old, lim;
  ck_assert_int_eq(prlimit(d.pid, RLIMIT_AS, NULL, &old), 0);
  lim.rlim_cur = (vm_kb + 64 * 1024) * 1024; /* the soft limit only: it can go back up */
  lim.rlim_max = old.rlim_max;
  ck_assert_int_eq(prlimit(d.pid, RLIMIT_AS, &lim, NULL), 0);
  gpumem_client *c = controller();
  const char *tag = "weights";
  ck_assert_int_eq(gpumem_pause(c, &tag, 1, NULL, 0, NULL, NULL), GPUMEM_E_OUT_OF_MEMORY);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "no host memory for the backup"));
  struct gpumem_status *s;
  ck_assert_int_eq(gpumem_status(c, &s), 0);
  ck_assert_uint_eq(s->devices[0]->managed, 256 * MiB);
  ck_assert_uint_eq(s->tags[0]->paused_bytes, 0);
  gpumem_status_free(s);
  ck_assert_int_eq(prlimit(d.pid, RLIMIT_AS, &old, NULL), 0);
  /* The buffer comes back with its contents: its memory never left. */
  struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
  o.timeout_ms = 60000;
  ck_assert_int_eq(gpumem_resume(c, &tag, 1, NULL, 0, &o, NULL), 0);
  ck_assert(worker_wait_for(&w, "contents kept", 1, 5000));
  gpumem_disconnect(c);
  ck_assert_int_eq(worker_stop(&w, SIGTERM), 0);
}
END_TEST

/* gpumemctl: 0 done, 1 failed with the daemon's words, 2 usage. */
START_TEST(gpumemctl_exit_codes) {
  daemon_start(&d, NULL);
  char out[4096];
  ck_assert_int_eq(ctl(out, sizeof out, ""), 2);
  ck_assert_int_eq(ctl(out, sizeof out, "frobnicate"), 2);
  ck_assert_int_eq(ctl(out, sizeof out, "pause"), 2);
  ck_assert_int_eq(ctl(out, sizeof out, "--device x pause kv"), 2);
  ck_assert_int_eq(ctl(out, sizeof out, "pause 'kv cache'"), 1);
  ck_assert_ptr_nonnull(strstr(out, "invalid tag"));
  ck_assert_int_eq(ctl(out, sizeof out, "--device 9 pause kv"), 1);
  ck_assert_ptr_nonnull(strstr(out, "device 9 is not one of the"));
  ck_assert_int_eq(ctl(out, sizeof out, "pause kv"), 1); /* no such tag: not success */
  ck_assert_ptr_nonnull(strstr(out, "no tag 'kv'"));
  ck_assert_int_eq(ctl(out, sizeof out, "list --json"), 0);
  ck_assert_str_eq(out, "[]\n");
  char cmd[256];
  snprintf(cmd, sizeof cmd, "%s --socket /nonexistent/sock status 2>&1", harness_bin("gpumemctl"));
  FILE *p = popen(cmd, "r");
  size_t n = fread(out, 1, sizeof out - 1, p);
  out[n] = '\0';
  int status = pclose(p);
  ck_assert_int_eq(WEXITSTATUS(status), 1);
  ck_assert_ptr_nonnull(strstr(out, "cannot connect"));
}
END_TEST

/* Run gpumemctl as user nobody; its exit status and output. */
static int ctl_as_nobody(char *out, size_t len, const char *cmd, const char *tag) {
  int fds[2];
  ck_assert_int_eq(pipe(fds), 0);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], 1);
    dup2(fds[1], 2);
    if (setgid(65534) < 0 || setuid(65534) < 0) _exit(99);
    execl(harness_bin("gpumemctl"), "gpumemctl", "--socket", d.socket, cmd, tag, (char *)NULL);
    _exit(98);
  }
  close(fds[1]);
  size_t n = 0;
  ssize_t k;
  while (n < len - 1 && (k = read(fds[0], out + n, len - 1 - n)) > 0) n += (size_t)k;
  out[n] = '\0';
  close(fds[0]);
  int status;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Anyone who may reach the socket may look; only controllers may pause. */
START_TEST(only_controllers_pause_but_anyone_may_look) {
  if (geteuid() != 0) return; /* needs another uid to test with */
  daemon_start(&d, NULL);
  ck_assert_int_eq(chmod(d.dir, 0755), 0);
  ck_assert_int_eq(chmod(d.socket, 0666), 0);
  char out[4096];
  ck_assert_int_eq(ctl_as_nobody(out, sizeof out, "pause", "kv"), 1);
  ck_assert_msg(strstr(out, "PERMISSION_DENIED") && strstr(out, "may not pause"), "%s", out);
  ck_assert_int_eq(ctl_as_nobody(out, sizeof out, "status", NULL), 0);
  ck_assert_msg(strstr(out, "backend host"), "%s", out);
  ck_assert_int_eq(ctl_as_nobody(out, sizeof out, "metrics", NULL), 0);
  ck_assert_msg(strstr(out, "gpumem_sessions 1"), "%s", out);
}
END_TEST

int main(void) {
  return HARNESS_RUN("backup", 60, setup, teardown,
                     verified_backups_survive_and_are_reported,
                     backup_limit_refuses_at_allocation,
                     pause_without_room_for_a_backup_releases_nothing_of_it,
                     gpumemctl_exit_codes,
                     only_controllers_pause_but_anyone_may_look);
}
