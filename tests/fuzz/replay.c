/* A main for a fuzz target built without libFuzzer: feeds it each file
 * named, or each file in each directory named (in name order), once, so
 * that make test replays the corpus with the ordinary compiler. */
#include <dirent.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char current[4096]; /* the file being replayed, for a crash report */

#define REPLAY_TIMEOUT_S 30

/* Name the input that crashed, then die of the same signal. */
static void on_crash(int sig) {
  static const char what[] = "replay: crashed on ";
  if (write(2, what, sizeof what - 1) < 0 || write(2, current, strlen(current)) < 0 ||
      write(2, "\n", 1) < 0) {
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

/* Feed one file to the target; -1 if it cannot be read. */
static int replay_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    perror(path);
    return -1;
  }
  uint8_t *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len == cap) {
      cap = cap ? cap * 2 : 4096;
      uint8_t *nb = realloc(buf, cap);
      if (!nb) {
        free(buf);
        fclose(f);
        return -1;
      }
      buf = nb;
    }
    size_t n = fread(buf + len, 1, cap - len, f);
    if (n == 0) break;
    len += n;
  }
  fclose(f);
  snprintf(current, sizeof current, "%s", path);
  alarm(REPLAY_TIMEOUT_S); /* an input that hangs fails the run, named */
  LLVMFuzzerTestOneInput(buf, len);
  alarm(0);
  free(buf);
  return 0;
}

static int by_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Feed every file of a directory, in name order; the count, or -1. */
static long replay_dir(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) {
    perror(dir);
    return -1;
  }
  char **names = NULL;
  size_t n = 0, cap = 0;
  for (struct dirent *e; (e = readdir(d));) {
    if (e->d_name[0] == '.') continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 64;
      char **nn = realloc(names, cap * sizeof *names);
      if (!nn) break;
      names = nn;
    }
    names[n++] = strdup(e->d_name);
  }
  closedir(d);
  qsort(names, n, sizeof *names, by_name);
  long done = 0;
  for (size_t i = 0; i < n; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, names[i]);
    if (names[i] && replay_file(path) == 0) done++;
    free(names[i]);
  }
  free(names);
  return done;
}

int main(int argc, char **argv) {
  signal(SIGABRT, on_crash);
  signal(SIGSEGV, on_crash);
  signal(SIGBUS, on_crash);
  signal(SIGALRM, on_crash);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  long total = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    long n = stat(argv[i], &st) == 0 && S_ISDIR(st.st_mode) ? replay_dir(argv[i])
                                                           : replay_file(argv[i]) == 0 ? 1 : -1;
    if (n < 0) return 1;
    total += n;
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  const char *name = strrchr(argv[0], '/');
  printf("%s: %ld inputs replayed in %.2f s\n", name ? name + 1 : argv[0], total,
         (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9);
  return 0;
}
