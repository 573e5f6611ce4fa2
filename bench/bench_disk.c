/* Disk backups (gpumemd --backup-dir, GPUMEM_BACKUP_DISK): how fast the
 * daemon writes and reads them, against dd with direct I/O of the same
 * size into the same directory, in the same run.
 *
 * The write and read figures are the daemon's disk steps, as its log
 * times them: a pause's writes of its backups (from host memory to their
 * files), a resume's reads (host memory made, and the files read into it,
 * the two overlapped). The pauses and resumes themselves are reported
 * against the same buffers keeping their backups in host memory
 * (GPUMEM_BACKUP_RELEASE, the same daemon).
 *
 *   bench_disk [--backend host|cuda] [--size SIZE] [--buffers N]
 *              [--rounds N] [--dir DIR] [BINDIR]
 *
 * DIR (default: a new directory under /var/tmp) must be on the disk to
 * measure: not tmpfs, which takes no direct I/O. */
#include <getopt.h>
#include <stdbool.h>
#include <fcntl.h>
#include <sys/stat.h>

#include "bench.h"
#include "common/size.h"
#include "gpumem.h"

#define MAX_BUFFERS 256

static void die(const char *what, const char *why) {
  fprintf(stderr, "bench_disk: %s: %s\n", what, why);
  exit(1);
}

/* Seconds a shell command takes; exits if it fails. */
static double timed(const char *cmd) {
  uint64_t t0 = bench_ns();
  if (system(cmd) != 0) die("command failed", cmd);
  return (double)(bench_ns() - t0) / 1e9;
}

/* dd's direct-I/O write and read of size bytes in dir, in GiB/s. */
static void dd_baseline(const char *dir, uint64_t size, double *w, double *r) {
  char cmd[1024], file[600];
  snprintf(file, sizeof file, "%s/dd.bin", dir);
  unsigned long long count = size / (8ull << 20);
  snprintf(cmd, sizeof cmd,
           "dd if=/dev/zero of=%s bs=8M count=%llu oflag=direct status=none", file, count);
  *w = (double)size / timed(cmd) / (1 << 30);
  snprintf(cmd, sizeof cmd, "dd if=%s of=/dev/null bs=8M iflag=direct status=none", file);
  *r = (double)size / timed(cmd) / (1 << 30);
  unlink(file);
}

/* The median of the seconds the daemon's log (at path) gives after each
 * line holding marker, the first (the warm-up) left out. */
static double logged_median(const char *path, const char *marker) {
  FILE *f = fopen(path, "r");
  if (!f) die("log", path);
  char line[1024];
  double v[32];
  size_t n = 0;
  while (fgets(line, sizeof line, f) && n < 32) {
    const char *at = strstr(line, marker), *in = at ? strstr(at, " in ") : NULL;
    if (in) v[n++] = atof(in + 4);
  }
  fclose(f);
  if (n < 2) die("log", "the daemon's log has no disk step");
  return bench_median(v + 1, n - 1);
}

/* Milliseconds of one pause or resume of tag. */
static double op_ms(gpumem_client *c, const char *tag, bool resume) {
  struct gpumem_op_report *rep = NULL;
  uint64_t t0 = bench_ns();
  int rc = resume ? gpumem_resume(c, &tag, 1, NULL, 0, NULL, &rep)
                  : gpumem_pause(c, &tag, 1, NULL, 0, NULL, &rep);
  double ms = (double)(bench_ns() - t0) / 1e6;
  gpumem_op_report_free(rep);
  if (rc < 0) die(resume ? "resume" : "pause", gpumem_last_error());
  return ms;
}

/* Median pause and resume milliseconds of n buffers of each bytes in a
 * tag of their own with flags, over rounds (after one warm-up); the
 * contents are checked after every resume. */
static void pause_resume(gpumem_client *w, gpumem_client *c, const char *tag, unsigned flags,
                         unsigned n, uint64_t each, unsigned rounds, double *pause,
                         double *resume) {
  gpumem_buffer *b[MAX_BUFFERS];
  for (unsigned i = 0; i < n; i++)
    if (gpumem_alloc(w, tag, 0, each, flags, &b[i]) < 0 ||
        gpumem_buffer_fill32(w, b[i], 0, each, 0xd15c0000u + i) < 0)
      die("alloc", gpumem_last_error());
  double p[16], r[16];
  for (unsigned k = 0; k <= rounds; k++) {
    double pm = op_ms(c, tag, false), rm = op_ms(c, tag, true);
    if (k > 0) {
      p[k - 1] = pm;
      r[k - 1] = rm;
    }
    for (unsigned i = 0; i < n; i++) {
      uint32_t v = 0;
      if (gpumem_buffer_read(w, b[i], each - sizeof v, &v, sizeof v) < 0 ||
          v != 0xd15c0000u + i)
        die("check", "a buffer's contents did not come back");
    }
  }
  for (unsigned i = 0; i < n; i++) gpumem_free(w, b[i]);
  *pause = bench_median(p, rounds);
  *resume = bench_median(r, rounds);
}

int main(int argc, char **argv) {
  const char *backend = "host", *bin = "build/bin", *dir_arg = NULL;
  uint64_t size = 1ull << 30;
  unsigned nbuf = 8, rounds = 3;
  static const struct option opts[] = {{"backend", required_argument, 0, 'b'},
                                       {"size", required_argument, 0, 's'},
                                       {"buffers", required_argument, 0, 'n'},
                                       {"rounds", required_argument, 0, 'r'},
                                       {"dir", required_argument, 0, 'd'},
                                       {0, 0, 0, 0}};
  int ch;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    if (ch == 'b') backend = optarg;
    else if (ch == 's' && size_parse(optarg, &size) == 0) continue;
    else if (ch == 'n') nbuf = (unsigned)atoi(optarg);
    else if (ch == 'r') rounds = (unsigned)atoi(optarg);
    else if (ch == 'd') dir_arg = optarg;
    else die("usage", "[--backend B] [--size SIZE] [--buffers N] [--rounds N] [--dir DIR] [BINDIR]");
  }
  if (optind < argc) bin = argv[optind];
  if (!nbuf || nbuf > MAX_BUFFERS || !rounds || rounds > 16) die("usage", "1-256 buffers, 1-16 rounds");
  uint64_t each = size / nbuf / (2ull << 20) * (2ull << 20);
  if (!each) die("usage", "each buffer needs 2 MiB at least");
  size = each * nbuf;
  char dir[512];
  snprintf(dir, sizeof dir, "%s/gpumemd-bench-disk.XXXXXX", dir_arg ? dir_arg : "/var/tmp");
  if (!mkdtemp(dir)) die("mkdtemp", dir);
  double ddw, ddr;
  dd_baseline(dir, size, &ddw, &ddr);

  char sockdir[] = "/tmp/gpumemd-bench-disk-sock.XXXXXX", sock[64], devsize[32], limit[32];
  bench_sockdir(sockdir, sock, sizeof sock);
  snprintf(devsize, sizeof devsize, "%llu", (unsigned long long)(size + (64ull << 20)));
  snprintf(limit, sizeof limit, "%llu", (unsigned long long)size);
  const char *extra[] = {"--backend", backend, "--host-devices", "1", "--host-device-size",
                         devsize, "--backup-limit", limit, "--backup-dir", dir,
                         "--log-level", "info", NULL}; /* its disk steps' figures */
  char log[600];
  snprintf(log, sizeof log, "%s/gpumemd.log", sockdir);
  int saved = dup(2), logfd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (logfd < 0 || saved < 0) die("log", log);
  dup2(logfd, 2); /* the daemon's log, for its disk steps' figures */
  pid_t d = bench_daemon(bin, sock, extra);
  dup2(saved, 2);
  close(saved);
  close(logfd);
  gpumem_client *w, *c;
  if (gpumem_connect(sock, "bench-worker", GPUMEM_ROLE_WORKER, 0, &w) < 0 ||
      gpumem_connect(sock, "bench", GPUMEM_ROLE_CONTROLLER, GPUMEM_CONNECT_NO_THREAD, &c) < 0)
    die("connect", gpumem_last_error());
  double mp, mr, dp, dr;
  pause_resume(w, c, "in_memory", GPUMEM_BACKUP | GPUMEM_BACKUP_RELEASE, nbuf, each, rounds,
               &mp, &mr);
  pause_resume(w, c, "on_disk", GPUMEM_BACKUP | GPUMEM_BACKUP_DISK, nbuf, each, rounds, &dp,
               &dr);
  gpumem_disconnect(w);
  gpumem_disconnect(c);
  bench_daemon_stop(d);
  double ws = logged_median(log, "bytes of backups written to"),
         rs = logged_median(log, "backups read back from");
  unlink(log);
  rmdir(sockdir);
  rmdir(dir);
  double gib = (double)size / (1 << 30);
  printf("%.2f GiB in %u buffers, backend %s, %u rounds (medians); dd bs=8M direct\n", gib,
         nbuf, backend, rounds);
  bench_report("disk_write_gibps", gib / ws, "GiB/s", ddw);
  bench_report("disk_read_gibps", gib / rs, "GiB/s", ddr);
  bench_report("disk_pause_ms", dp, "ms", mp);
  bench_report("disk_resume_ms", dr, "ms", mr);
  return 0;
}
