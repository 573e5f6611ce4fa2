/* Failover: an engine process holds SIZE bytes of persistent weights; a
 * standby process of the same uid waits for them (gpumem_attach_wait);
 * the engine is killed with SIGKILL. Timed: from the kill to the standby
 * holding the weights mapped. Against, in the same run, what a standby
 * without gpumemd does: allocate and fill the same bytes from host memory
 * (an engine's CPU copy of its weights) and from a file (its checkpoint,
 * dropped from the page cache first). The contents are checked after each
 * failover, outside the timing.
 *
 *     build/bench/bench_failover [--backend host|cuda] [--size SIZE] build/bin
 */
#include <fcntl.h>
#include <getopt.h>
#include <pthread.h>
#include <stdbool.h>

#include "bench.h"
#include "gpumem.h"

#define ROUNDS 5
#define SEED 0xfa11ba11u
#define STEP (64ull << 20) /* bytes per copy from host memory or the file */

static void die(const char *what) {
  fprintf(stderr, "bench_failover: %s: %s\n", what, gpumem_last_error());
  exit(1);
}

/* The engine, in its own process: fill the weights, say so, and hold them
 * until killed. */
static void engine(const char *sock, uint64_t size, int ready) {
  gpumem_client *c;
  gpumem_buffer *b;
  if (gpumem_connect(sock, "engine", GPUMEM_ROLE_WORKER, 0, &c) < 0 ||
      gpumem_alloc_persistent(c, "failover-weights", "weights", 0, size, 0, &b) < 0 ||
      gpumem_buffer_fill32(c, b, 0, size, SEED) < 0) {
    fprintf(stderr, "bench_failover: engine: %s\n", gpumem_last_error());
    _exit(1);
  }
  char x = 1;
  if (write(ready, &x, 1) != 1) _exit(1);
  for (;;) pause();
}

/* The standby's waiting attach, on a thread of its own. */
struct standby {
  gpumem_client *c;
  gpumem_buffer *b;
  int rc;
  uint64_t done_ns;
};

static void *standby_wait(void *arg) {
  struct standby *s = arg;
  s->rc = gpumem_attach_wait(s->c, "failover-weights", 60000, &s->b);
  s->done_ns = bench_ns();
  return NULL;
}

/* Whether the buffer holds the engine's words, at its start and end. */
static bool intact(gpumem_client *c, gpumem_buffer *b, uint64_t size) {
  uint32_t v[1024];
  for (int at = 0; at < 2; at++) {
    uint64_t off = at ? size - sizeof v : 0;
    if (gpumem_buffer_read(c, b, off, v, sizeof v) < 0) die("read");
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
      if (v[i] != SEED) return false;
  }
  return true;
}

/* One failover: ms from the engine's death to the standby's attach. */
static double failover(const char *sock, gpumem_client *standby, uint64_t size) {
  int p[2];
  if (pipe(p) < 0) exit(1);
  pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    engine(sock, size, p[1]);
  }
  close(p[1]);
  char x;
  if (read(p[0], &x, 1) != 1) {
    fprintf(stderr, "bench_failover: the engine did not start\n");
    exit(1);
  }
  close(p[0]);
  struct standby s = {.c = standby};
  pthread_t t;
  pthread_create(&t, NULL, standby_wait, &s);
  uint64_t t0 = bench_ns();
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  pthread_join(t, NULL);
  if (s.rc < 0) die("attach");
  double ms = (double)(s.done_ns - t0) / 1e6;
  if (!intact(standby, s.b, size)) {
    fprintf(stderr, "bench_failover: the standby's weights are not the engine's\n");
    exit(1);
  }
  if (gpumem_free(standby, s.b) < 0 || gpumem_drop(standby, "failover-weights", 0, NULL) < 0)
    die("drop");
  return ms;
}

/* ms to allocate size bytes and fill them from src (host memory) or from
 * fd (a file, its pages dropped first), STEP bytes at a time. */
static double reload(gpumem_client *c, uint64_t size, const uint8_t *src, int fd, uint8_t *buf) {
  if (fd >= 0 && (fdatasync(fd) < 0 || posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0))
    perror("bench_failover: dropping the file's pages");
  uint64_t t0 = bench_ns();
  gpumem_buffer *b;
  if (gpumem_alloc(c, "reload", 0, size, 0, &b) < 0) die("alloc");
  for (uint64_t off = 0; off < size; off += STEP) {
    uint64_t n = size - off < STEP ? size - off : STEP;
    const uint8_t *from = src ? src + off : buf;
    if (!src && pread(fd, buf, n, (off_t)off) != (ssize_t)n) {
      perror("bench_failover: read");
      exit(1);
    }
    if (gpumem_buffer_write(c, b, off, from, n) < 0) die("write");
  }
  double ms = (double)(bench_ns() - t0) / 1e6;
  if (gpumem_free(c, b) < 0) die("free");
  return ms;
}

int main(int argc, char **argv) {
  const char *backend = "host";
  uint64_t size = 1ull << 30;
  static const struct option opts[] = {{"backend", required_argument, 0, 'b'},
                                       {"size", required_argument, 0, 's'},
                                       {0, 0, 0, 0}};
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    if (ch == 'b') backend = optarg;
    else if (ch == 's') size = strtoull(optarg, NULL, 10) << (strchr(optarg, 'G') ? 30 : 20);
    else return 2;
  }
  const char *bin = optind < argc ? argv[optind] : "build/bin";
  char sockdir[] = "/tmp/gpumemd-bench-failover.XXXXXX", sock[100];
  bench_sockdir(sockdir, sock, sizeof sock);
  const char *host[] = {"--backend", "host", "--host-devices", "1", "--host-device-size", "8G",
                        "--journal", "none", NULL};
  const char *gpu[] = {"--backend", backend, "--journal", "none", NULL};
  pid_t d = bench_daemon(bin, sock, strcmp(backend, "host") == 0 ? host : gpu);
  gpumem_client *standby;
  if (gpumem_connect(sock, "standby", GPUMEM_ROLE_WORKER, 0, &standby) < 0) die("connect");
  /* The weights as the baselines have them: in host memory, and in a file. */
  uint8_t *src = malloc(size), *buf = malloc(STEP);
  char file[160];
  snprintf(file, sizeof file, "%s/weights", sockdir);
  int fd = open(file, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (!src || !buf || fd < 0) {
    perror("bench_failover");
    return 1;
  }
  for (uint64_t i = 0; i < size / 4; i++) ((uint32_t *)src)[i] = SEED;
  for (uint64_t off = 0; off < size; off += STEP)
    if (pwrite(fd, src + off, size - off < STEP ? size - off : STEP, (off_t)off) < 0) {
      perror("bench_failover: write");
      return 1;
    }
  double f[ROUNDS], h[ROUNDS], r[ROUNDS];
  for (int k = 0; k < ROUNDS; k++) { /* interleaved: the machine's state is shared */
    f[k] = failover(sock, standby, size);
    h[k] = reload(standby, size, src, -1, NULL);
    r[k] = reload(standby, size, NULL, fd, buf);
  }
  double fm = bench_median(f, ROUNDS), hm = bench_median(h, ROUNDS), rm = bench_median(r, ROUNDS);
  char name[96];
  snprintf(name, sizeof name, "failover_attach_%lluMiB_vs_host_reload",
           (unsigned long long)(size >> 20));
  bench_report(name, fm, "ms", hm);
  snprintf(name, sizeof name, "failover_attach_%lluMiB_vs_file_reload",
           (unsigned long long)(size >> 20));
  bench_report(name, fm, "ms", rm);
  gpumem_disconnect(standby);
  close(fd);
  unlink(file);
  free(src);
  free(buf);
  bench_daemon_stop(d);
  rmdir(sockdir);
  return 0;
}
