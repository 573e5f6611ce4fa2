/* What a gpumemctl call costs when it loads no GPU driver: a fresh process
 * that connects with GPUMEM_CONNECT_NODE_DEVICES (as gpumemctl does) and
 * asks for the status, against the same process connecting without it,
 * which loads the vendor driver to map the daemon's device numbers to its
 * own (what gpumemctl did before), in the same run.
 *   bench_ctl [--backend host|cuda|hip] BUILD/bin */
#include "bench.h"
#include "gpumem.h"

#include <stdbool.h>

#define RUNS 30

/* The child: connect (with or without the flag), ask the status, exit. */
static int child(const char *sock, bool node) {
  unsigned flags = GPUMEM_CONNECT_NO_THREAD | GPUMEM_CONNECT_NO_RECONNECT |
                   (node ? GPUMEM_CONNECT_NODE_DEVICES : 0);
  gpumem_client *c;
  struct gpumem_status *s;
  if (gpumem_connect(sock, "bench-ctl", GPUMEM_ROLE_CONTROLLER, flags, &c) < 0 ||
      gpumem_status(c, &s) < 0) {
    fprintf(stderr, "bench_ctl: %s\n", gpumem_last_error());
    return 1;
  }
  gpumem_status_free(s);
  gpumem_disconnect(c);
  return 0;
}

/* Milliseconds from fork to exit of one child run of self in a mode. */
static double run_once(const char *self, const char *sock, const char *mode) {
  uint64_t t0 = bench_ns();
  pid_t pid = fork();
  if (pid == 0) {
    execl(self, self, mode, sock, (char *)NULL);
    _exit(127);
  }
  int status;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "bench_ctl: the %s child failed\n", mode);
    exit(1);
  }
  return (double)(bench_ns() - t0) / 1e6;
}

int main(int argc, char **argv) {
  if (argc == 3 && (strcmp(argv[1], "--child-node") == 0 || strcmp(argv[1], "--child-driver") == 0))
    return child(argv[2], strcmp(argv[1], "--child-node") == 0);
  const char *bin = "build/bin", *backend = "host";
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc) backend = argv[++i];
    else bin = argv[i];
  }
  char dir[] = "/tmp/gpumemd-bench-ctl.XXXXXX", sock[64];
  if (!mkdtemp(dir)) return 1;
  snprintf(sock, sizeof sock, "%s/sock", dir);
  const char *extra[] = {"--backend", backend, NULL};
  pid_t d = bench_daemon(bin, sock, extra);
  static double node[RUNS], driver[RUNS];
  /* Interleaved, so that a machine that slows down slows both. */
  for (int i = 0; i < RUNS; i++) {
    driver[i] = run_once("/proc/self/exe", sock, "--child-driver");
    node[i] = run_once("/proc/self/exe", sock, "--child-node");
  }
  bench_daemon_stop(d);
  rmdir(dir);
  char name[96];
  snprintf(name, sizeof name, "gpumemctl-style status, fresh process (%s)", backend);
  bench_report(name, bench_median(node, RUNS), "ms", bench_median(driver, RUNS));
  return 0;
}
