/* gpumemd's log lines as journald and a person at a terminal read them:
 * the real daemon with stderr on a file that JOURNAL_STREAM names (as
 * systemd passes it) writes syslog priorities and no timestamps; on a
 * pseudo-terminal it writes ISO-8601 times and levels; elsewhere as ever. */
#include <fcntl.h>
#include <poll.h>
#include <regex.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

static struct daemon d;

/* Count fds before each test. */
static void setup(void) { harness_fd_setup(); }

/* Kill a daemon left running, remove its directory, check fds. */
static void teardown(void) {
  if (d.pid > 0) {
    kill(d.pid, SIGKILL);
    waitpid(d.pid, NULL, 0);
    d.pid = 0;
  }
  if (d.dir[0]) {
    char cmd[160];
    snprintf(cmd, sizeof cmd, "rm -rf %s", d.dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", d.dir);
  }
  harness_fd_teardown();
}

/* A fresh directory for d and its socket path. */
static void make_dir(void) { daemon_paths(&d, "gpumemd-log"); }

/* Wait until the daemon answers on its socket (it must not exit). */
static void wait_ready(void) { ck_assert_msg(daemon_wait_ready(&d), "gpumemd did not start"); }

/* Stop the daemon and return its exit status. */
static int stop(void) {
  int status;
  kill(d.pid, SIGTERM);
  ck_assert_int_eq(waitpid(d.pid, &status, 0), d.pid);
  d.pid = 0;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The log file's text (a static buffer). */
static const char *log_text(void) {
  static char buf[1 << 16];
  FILE *f = fopen(d.log, "r");
  ck_assert_ptr_nonnull(f);
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = '\0';
  fclose(f);
  return buf;
}

/* Create the log file and name it in JOURNAL_STREAM ("dev:inode"), or
 * name another inode when wrong. */
static void journal_stream_for_log(bool wrong) {
  int fd = open(d.log, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  ck_assert_int_ge(fd, 0);
  struct stat st;
  ck_assert_int_eq(fstat(fd, &st), 0);
  close(fd);
  char v[64];
  snprintf(v, sizeof v, "%llu:%llu", (unsigned long long)st.st_dev,
           (unsigned long long)st.st_ino + (wrong ? 1 : 0));
  ck_assert_int_eq(setenv("JOURNAL_STREAM", v, 1), 0);
}

/* Start the daemon in a fresh directory with its stderr on the log,
 * which JOURNAL_STREAM names (another file's inode when wrong). */
static void spawn_journal(bool wrong, const char *const *extra) {
  make_dir();
  journal_stream_for_log(wrong);
  d.pid = daemon_spawn(d.socket, d.log, extra);
}

/* Run the daemon once under a journal stream (another file's when
 * wrong) until it answers, stop it (it must exit 0); its log's text. */
static const char *journal_run_log(bool wrong) {
  spawn_journal(wrong, NULL);
  wait_ready();
  ck_assert_int_eq(stop(), 0);
  return log_text();
}

/* Whether every line of text matches the extended regex re; at least one
 * line must be there. */
static bool every_line_matches(const char *text, const char *re) {
  regex_t r;
  ck_assert_int_eq(regcomp(&r, re, REG_EXTENDED | REG_NOSUB), 0);
  char *copy = strdup(text), *save = NULL;
  ck_assert_ptr_nonnull(copy);
  int lines = 0;
  bool ok = true;
  for (char *l = strtok_r(copy, "\r\n", &save); l; l = strtok_r(NULL, "\r\n", &save), lines++)
    if (regexec(&r, l, 0, NULL, 0) != 0) {
      fprintf(stderr, "line does not match %s: %s\n", re, l);
      ok = false;
    }
  free(copy);
  regfree(&r);
  return ok && lines > 0;
}

/* Under journald: "<6>" info, "<7>" debug, no time, no level word. */
START_TEST(journal_lines_carry_syslog_priorities) {
  const char *buf = journal_run_log(false);
  ck_assert_msg(every_line_matches(buf, "^<[3467]>[^<]"), "%s", buf);
  ck_assert_msg(strstr(buf, "<6>") && strstr(buf, "<7>"), "%s", buf);
  ck_assert_msg(!strstr(buf, "gpumemd[") && !strstr(buf, "[info]"), "%s", buf);
}
END_TEST

/* An error is "<3>" under journald. */
START_TEST(journal_errors_are_priority_3) {
  spawn_journal(false, (const char *const[]){"--backend", "no-such-backend", NULL});
  int status;
  ck_assert_int_eq(waitpid(d.pid, &status, 0), d.pid);
  d.pid = 0;
  ck_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0);
  const char *buf = log_text();
  ck_assert_msg(strstr(buf, "<3>backend no-such-backend"), "%s", buf);
}
END_TEST

/* A JOURNAL_STREAM that names another file (stderr redirected after
 * systemd started the shell) leaves the lines as they always were. */
START_TEST(journal_stream_of_another_file_is_ignored) {
  const char *buf = journal_run_log(true);
  ck_assert_msg(every_line_matches(buf, "^gpumemd\\[(error|warn|info|debug)\\]: "), "%s", buf);
}
END_TEST

/* On a terminal: an ISO-8601 time with milliseconds and offset, then the
 * level. */
START_TEST(terminal_lines_carry_time_and_level) {
  make_dir();
  unsetenv("JOURNAL_STREAM");
  int master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  ck_assert_int_ge(master, 0);
  ck_assert_int_eq(grantpt(master), 0);
  ck_assert_int_eq(unlockpt(master), 0);
  char *pts = ptsname(master);
  ck_assert_ptr_nonnull(pts);
  d.pid = daemon_spawn(d.socket, pts, NULL);
  wait_ready();
  ck_assert_int_eq(stop(), 0);
  /* The daemon is gone: everything it wrote waits in the terminal. */
  static char buf[1 << 16];
  size_t n = 0;
  struct pollfd p = {.fd = master, .events = POLLIN};
  while (n + 1 < sizeof buf && poll(&p, 1, 0) == 1 && (p.revents & POLLIN)) {
    ssize_t r = read(master, buf + n, sizeof buf - 1 - n);
    if (r <= 0) break;
    n += (size_t)r;
  }
  buf[n] = '\0';
  close(master);
  ck_assert_msg(every_line_matches(buf, "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}"
                                        "\\.[0-9]{3}[+-][0-9]{2}:[0-9]{2} "
                                        "gpumemd\\[(error|warn|info|debug)\\]: "),
                "%s", buf);
  ck_assert_msg(strstr(buf, "gpumemd[info]: stopped"), "%s", buf);
}
END_TEST

int main(void) {
  return HARNESS_RUN("log", 30, setup, teardown, journal_lines_carry_syslog_priorities,
                     journal_errors_are_priority_3, journal_stream_of_another_file_is_ignored,
                     terminal_lines_carry_time_and_level);
}
