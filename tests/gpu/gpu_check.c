/* GPU checks for the CUDA backend, judged by the driver's own figure of
 * free memory (cuMemGetInfo in this process), not by the daemon's. Each
 * check prints PASS or FAIL with its figures; the exit status is the
 * number of failures.
 *
 * usage: gpu_check BIN_DIR SOCKET  (gpumemd --backend cuda already serving) */
#include <cuda.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "gpumem.h"

#define MiB (1ull << 20)
#define GiB (1ull << 30)

static const char *bin, *sock;
static gpumem_client *ctl;

static double gib(uint64_t b) { return (double)b / (double)GiB; }

/* The figures of a pause's or resume's report that these checks print. */
struct op_sum {
  uint64_t buffers, bytes, backup_bytes, skipped, elapsed_us, backup_us;
};

/* Pause or resume one tag on the node, keeping the report's figures. */
static int op_tag(bool resume, const char *tag, struct op_sum *r) {
  struct gpumem_op_report *rep = NULL;
  int rc = resume ? gpumem_resume(ctl, &tag, 1, NULL, 0, NULL, &rep)
                  : gpumem_pause(ctl, &tag, 1, NULL, 0, NULL, &rep);
  memset(r, 0, sizeof *r);
  if (rep) {
    r->buffers = rep->buffers;
    r->bytes = rep->bytes;
    r->backup_bytes = rep->backup_bytes;
    r->skipped = rep->skipped;
    r->elapsed_us = rep->elapsed_us;
    r->backup_us = rep->backup_us;
  }
  gpumem_op_report_free(rep);
  return rc;
}

static int pause_tag(const char *tag, struct op_sum *r) { return op_tag(false, tag, r); }

static int resume_tag(const char *tag, struct op_sum *r) { return op_tag(true, tag, r); }

static uint64_t fnv(const uint8_t *p, size_t n, uint64_t h) {
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

/* Start gpumem-worker with args; wait for "ready" in its output file. */
static pid_t worker(const char *out, const char *const *args) {
  unlink(out); /* a "ready" left by an earlier run must not count */
  pid_t pid = fork();
  if (pid == 0) {
    if (!freopen(out, "w", stdout)) _exit(126);
    const char *argv[24];
    char path[512];
    tool_argv(argv, 23, path, sizeof path, bin, "gpumem-worker", sock, args);
    execv(path, (char *const *)argv);
    _exit(127);
  }
  for (int i = 0; i < 6000; i++) {
    char buf[1 << 14] = "";
    FILE *f = fopen(out, "r");
    if (f) {
      size_t n = fread(buf, 1, sizeof buf - 1, f);
      buf[n] = '\0';
      fclose(f);
    }
    if (strstr(buf, "ready")) return pid;
    if (waitpid(pid, NULL, WNOHANG) == pid) break;
    usleep(10000);
  }
  fprintf(stderr, "worker did not start, see %s\n", out);
  exit(1);
}

static int count_in(const char *file, const char *text) {
  static char buf[1 << 16];
  FILE *f = fopen(file, "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = '\0';
  fclose(f);
  int k = 0;
  for (const char *p = buf; (p = strstr(p, text)); p += strlen(text)) k++;
  return k;
}

static int stop(pid_t pid, int sig) {
  int status;
  kill(pid, sig);
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Memory leaves on pause and comes back on resume; pointers hold. */
static void alloc_pause_resume(gpumem_client *w) {
  const int n = 4;
  const uint64_t size = 2 * GiB;
  gpumem_buffer *b[4];
  void *ptr[4];
  uint64_t f0 = settled_free();
  for (int i = 0; i < n; i++) {
    if (gpumem_alloc(w, "t_basic", 0, size, 0, &b[i]) < 0) {
      check(false, "alloc", "%s", gpumem_last_error());
      return;
    }
    ptr[i] = gpumem_buffer_ptr(b[i]);
  }
  uint64_t f1 = settled_free(), gran = gpumem_granularity(w);
  double drop = gib(f0 - f1);
  check(f0 - f1 >= n * size && f0 - f1 <= n * (size + gran) + 64 * MiB, "alloc takes device memory",
        "free %.3f -> %.3f GiB, dropped %.3f GiB for %d x %.2f GiB", gib(f0), gib(f1), drop, n,
        gib(size));
  struct op_sum r;
  int rc = pause_tag("t_basic", &r);
  uint64_t f2 = settled_free();
  check(rc == 0 && f2 > f1 && f2 - f1 + n * gran >= n * size, "pause gives it back",
        "free %.3f -> %.3f GiB, rose %.3f GiB; daemon: %llu buffers %.3f GiB in %.1f ms", gib(f1),
        gib(f2), gib(f2 - f1), (unsigned long long)r.buffers, gib(r.bytes), r.elapsed_us / 1e3);
  rc = resume_tag("t_basic", &r);
  uint64_t f3 = settled_free();
  check(rc == 0 && f2 > f3 && f2 - f3 + n * gran >= n * size, "resume takes it again",
        "free %.3f -> %.3f GiB, dropped %.3f GiB in %.1f ms", gib(f2), gib(f3), gib(f2 - f3),
        r.elapsed_us / 1e3);
  bool same = true, usable = true;
  for (int i = 0; i < n; i++) {
    same &= gpumem_buffer_ptr(b[i]) == ptr[i];
    uint32_t word = 0;
    usable &= gpumem_buffer_fill32(w, b[i], 0, size, 0xC0FFEE00u + (uint32_t)i) == 0 &&
              gpumem_buffer_read(w, b[i], size - 4, &word, 4) == 0 && word == 0xC0FFEE00u + (uint32_t)i;
  }
  check(same, "pointers survive", "%p .. %p unchanged", ptr[0], ptr[n - 1]);
  check(usable, "memory usable after resume", "cuMemsetD32 and cuMemcpyDtoH through the old pointers%s%s",
        usable ? "" : ": ", usable ? "" : gpumem_last_error());
  for (int i = 0; i < n; i++) gpumem_free(w, b[i]);
  uint64_t f4 = settled_free();
  check(f4 + 64 * MiB >= f0, "free returns everything", "free %.3f GiB (started at %.3f)", gib(f4), gib(f0));
}

/* BACKUP buffers keep every byte. */
static void backup_contents(gpumem_client *w) {
  const uint64_t size = 1 * GiB;
  gpumem_buffer *b;
  if (gpumem_alloc(w, "t_backup", 0, size, GPUMEM_BACKUP, &b) < 0) {
    check(false, "backup alloc", "%s", gpumem_last_error());
    return;
  }
  uint8_t *host = malloc(size);
  srand(7);
  for (uint64_t i = 0; i < size; i += 4) *(uint32_t *)(host + i) = (uint32_t)rand();
  uint64_t h0 = fnv(host, size, 0xcbf29ce484222325ull);
  gpumem_buffer_write(w, b, 0, host, size);
  memset(host, 0, size);
  struct op_sum rp, rr;
  int rc = pause_tag("t_backup", &rp) | resume_tag("t_backup", &rr);
  int rd = gpumem_buffer_read(w, b, 0, host, size);
  uint64_t h1 = fnv(host, size, 0xcbf29ce484222325ull);
  check(rc == 0 && rd == 0 && h0 == h1, "backup keeps contents",
        "hash %016llx before, %016llx after; %.2f GiB backed up in %.1f ms, restored in %.1f ms",
        (unsigned long long)h0, (unsigned long long)h1, gib(rp.backup_bytes), rp.elapsed_us / 1e3,
        rr.elapsed_us / 1e3);
  /* The second time the pinned memory is there already: link speed. */
  memset(host, 0x5a, size);
  gpumem_buffer_write(w, b, 0, host, size);
  rc = pause_tag("t_backup", &rp) | resume_tag("t_backup", &rr);
  rd = gpumem_buffer_read(w, b, 0, host, size);
  bool same = rd == 0;
  for (uint64_t i = 0; same && i < size; i++) same = host[i] == 0x5a;
  check(rc == 0 && same, "second backup at link speed",
        "backup %.1f GB/s, restore %.1f GB/s (verified by the daemon and here)",
        (double)rp.backup_bytes / (double)rp.backup_us / 1e3,
        (double)rr.backup_bytes / (double)rr.backup_us / 1e3);
  struct gpumem_status *s;
  gpumem_status(ctl, &s);
  check(s->devices[0]->daemon_context == 0, "daemon holds a context only during copies",
        "with a BACKUP buffer, after its pause and resume: context %d",
        s->devices[0]->daemon_context);
  gpumem_status_free(s);
  free(host);
  gpumem_free(w, b);
}

/* Four worker processes on one device, all paused and resumed. */
static void four_workers(void) {
  pid_t w[4];
  char out[4][64];
  uint64_t f0 = settled_free();
  for (int i = 0; i < 4; i++) {
    snprintf(out[i], sizeof out[i], "/tmp/gpu_check_w%d.out", i);
    const char *args[] = {"--tag", "t_four", "--size", "1G", "--count", "2", NULL};
    w[i] = worker(out[i], args);
  }
  uint64_t f1 = settled_free();
  struct op_sum r;
  int rc = pause_tag("t_four", &r);
  uint64_t f2 = settled_free();
  int rc2 = resume_tag("t_four", &r);
  uint64_t f3 = settled_free();
  int verified = 0, exits = 0;
  for (int i = 0; i < 4; i++) {
    for (int k = 0; k < 300 && count_in(out[i], "verified") < 2; k++) usleep(10000);
    verified += count_in(out[i], "verified");
  }
  for (int i = 0; i < 4; i++) exits += stop(w[i], SIGTERM);
  check(rc == 0 && rc2 == 0 && f2 - f1 >= 8 * GiB && f2 - f3 >= 8 * GiB && verified == 8 && exits == 0,
        "four workers", "with workers free %.2f GiB (was %.2f), paused %.2f, resumed %.2f; %d/8 verified, exits %d",
        gib(f1), gib(f0), gib(f2), gib(f3), verified, exits);
}

/* A killed worker gives everything back. */
static void killed_worker(void) {
  uint64_t f0 = settled_free();
  const char *args[] = {"--tag", "t_kill", "--size", "4G", "--no-verify", NULL};
  pid_t w = worker("/tmp/gpu_check_kill.out", args);
  uint64_t f1 = settled_free();
  stop(w, SIGKILL);
  uint64_t f2 = settled_free();
  check(f1 + 4 * GiB <= f0 && f2 + 64 * MiB >= f0, "SIGKILLed worker's memory returns",
        "free %.3f -> %.3f with the worker -> %.3f GiB after SIGKILL", gib(f0), gib(f1), gib(f2));
}

/* The motivating scenario: DeepSeek-V4's compress-state pools in the
 * daemon, and 2 GiB allocated outside it that status must show. */
static void scenario(void) {
  const char *args[] = {"--tag", "kv_cache", "--size", "1.87G", "--count", "20", "--no-verify",
                        "--name", "sglang-tp0", NULL};
  pid_t w = worker("/tmp/gpu_check_scenario.out", args);
  CUdeviceptr outside;
  CUresult cr = cuMemAlloc(&outside, 2 * GiB);
  struct gpumem_status *s;
  if (cr != CUDA_SUCCESS || gpumem_status(ctl, &s) < 0) {
    check(false, "scenario", "setup failed: %d %s", cr, gpumem_last_error());
    return;
  }
  uint64_t managed = s->devices[0]->managed, unmanaged = s->devices[0]->unmanaged;
  gpumem_status_free(s);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "%s/gpumemctl --socket %s status", bin, sock);
  fflush(stdout);
  if (system(cmd) != 0) check(false, "gpumemctl status", "failed");
  uint64_t expect = 20 * (((uint64_t)(1.87 * GiB) + 2 * MiB - 1) / (2 * MiB) * (2 * MiB));
  check(managed == expect && unmanaged >= 2 * GiB, "scenario status",
        "managed %.2f GiB (20 x 1.87 GiB = %.2f), unmanaged %.2f GiB (>= 2 GiB allocated outside)",
        gib(managed), gib(expect), gib(unmanaged));
  uint64_t f0 = settled_free();
  struct op_sum r;
  int rc = pause_tag("kv_cache", &r);
  uint64_t f1 = settled_free();
  check(rc == 0 && f1 - f0 >= expect, "scenario pause frees the pools",
        "free %.2f -> %.2f GiB: %.2f GiB freed (>= %.2f) in %.1f ms", gib(f0), gib(f1), gib(f1 - f0),
        gib(expect), r.elapsed_us / 1e3);
  cuMemFree(outside);
  stop(w, SIGTERM);
}

/* Lines of the daemon's log (GPU_CHECK_DAEMON_LOG) that hold text. */
static int log_lines(const char *text) {
  const char *path = getenv("GPU_CHECK_DAEMON_LOG");
  FILE *f = path ? fopen(path, "r") : NULL;
  char *line = NULL;
  size_t cap = 0;
  int k = 0;
  while (f && getline(&line, &cap, f) > 0) k += strstr(line, text) != NULL;
  free(line);
  if (f) fclose(f);
  return k;
}

/* A resume with wait_ms on a thread of its own. */
struct waited {
  int rc;
  uint64_t waited_us;
  double done_ms;
  char words[300];
};

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void *resume_with_wait(void *arg) {
  struct waited *x = arg;
  gpumem_client *c = NULL;
  x->rc = gpumem_connect(sock, "gpu_check-wait", GPUMEM_ROLE_CONTROLLER, 0, &c);
  if (x->rc == 0) {
    struct gpumem_op_options o = GPUMEM_OP_OPTIONS_INIT;
    o.wait_ms = 60000;
    struct gpumem_op_report *rep = NULL;
    const char *tag = "t_wait";
    x->rc = gpumem_resume(c, &tag, 1, NULL, 0, &o, &rep);
    x->waited_us = rep ? rep->waited_us : 0;
    gpumem_op_report_free(rep);
  }
  x->done_ms = now_ms();
  snprintf(x->words, sizeof x->words, "%s", x->rc ? gpumem_last_error() : "");
  if (c) gpumem_disconnect(c);
  return NULL;
}

/* A resume that waits for room (protocol 1.10): paused 8 GiB, memory
 * taken outside gpumemd until less is free, the resume asked with a
 * wait, the memory freed once the daemon says it waits; it then takes
 * its buffers back, usable at their addresses, one generation on. */
static void resume_waits_for_room(gpumem_client *w) {
  const int n = 4;
  const uint64_t size = 2 * GiB;
  gpumem_buffer *b[4];
  for (int i = 0; i < n; i++)
    if (gpumem_alloc(w, "t_wait", 0, size, 0, &b[i]) < 0) {
      check(false, "resume wait", "alloc: %s", gpumem_last_error());
      return;
    }
  struct op_sum r;
  uint64_t g0 = gpumem_buffer_generation(b[0]);
  if (pause_tag("t_wait", &r) < 0) {
    check(false, "resume wait", "pause: %s", gpumem_last_error());
    return;
  }
  uint64_t f0 = settled_free();
  CUdeviceptr outside = 0;
  CUresult cr = cuMemAlloc(&outside, f0 - 4 * GiB);
  uint64_t f1 = settled_free();
  int said = log_lines("waiting up to");
  struct waited x = {0};
  pthread_t t;
  if (cr != CUDA_SUCCESS || pthread_create(&t, NULL, resume_with_wait, &x) != 0) {
    check(false, "resume wait", "setup: cuMemAlloc %d", cr);
    return;
  }
  double t0 = now_ms();
  while (log_lines("waiting up to") == said && now_ms() - t0 < 20000) {
    struct timespec ts = {0, 5000000};
    nanosleep(&ts, NULL);
  }
  bool waits = log_lines("waiting up to") > said;
  double freed = now_ms();
  cuMemFree(outside);
  pthread_join(t, NULL);
  bool usable = true;
  for (int i = 0; i < n; i++) {
    uint32_t word = 0;
    usable &= gpumem_buffer_fill32(w, b[i], 0, size, 0xAB0000u + (uint32_t)i) == 0 &&
              gpumem_buffer_read(w, b[i], size - 4, &word, 4) == 0 && word == 0xAB0000u + (uint32_t)i;
  }
  uint64_t g1 = gpumem_buffer_generation(b[0]);
  check(waits && x.rc == 0 && x.waited_us > 0 && usable && g1 == g0 + 1,
        "a resume waits for room and takes it once freed",
        "%.2f GiB free with 8 GiB paused; waited %.1f ms, done %.1f ms after the free; usable "
        "%d; generation %llu -> %llu%s%s", gib(f1), x.waited_us / 1e3, x.done_ms - freed,
        usable, (unsigned long long)g0, (unsigned long long)g1, x.rc ? ": " : "", x.words);
  for (int i = 0; i < n; i++) gpumem_free(w, b[i]);
}

/* Legacy IPC buffers: plain device memory, usable, never paused. */
static void ipc_legacy(gpumem_client *w) {
  gpumem_buffer *ipc, *vmm;
  if (gpumem_alloc(w, "t_ipc", 0, 256 * MiB, GPUMEM_IPC_LEGACY, &ipc) < 0 ||
      gpumem_alloc(w, "t_ipc", 0, 256 * MiB, 0, &vmm) < 0) {
    check(false, "ipc alloc", "%s", gpumem_last_error());
    return;
  }
  struct op_sum r;
  int rc = pause_tag("t_ipc", &r);
  uint32_t word = 0;
  bool usable = gpumem_buffer_fill32(w, ipc, 0, 256 * MiB, 0xABCDu) == 0 &&
                gpumem_buffer_read(w, ipc, 4096, &word, 4) == 0 && word == 0xABCDu;
  check(rc == 0 && r.skipped == 1 && r.buffers == 1 && usable, "legacy IPC buffer never pauses",
        "pause: %llu paused, %llu skipped; the IPC buffer at %p still works",
        (unsigned long long)r.buffers, (unsigned long long)r.skipped, gpumem_buffer_ptr(ipc));
  resume_tag("t_ipc", &r);
  gpumem_free(w, ipc);
  gpumem_free(w, vmm);
}

/* Driver errors are errors to the request, with the driver's name. */
static void bad_requests(gpumem_client *w) {
  gpumem_buffer *b;
  size_t f, t;
  cuMemGetInfo(&f, &t);
  int rc = gpumem_alloc(w, "t_bad", 0, f + 4 * GiB < t ? f + 4 * GiB : t, 0, &b);
  check(rc == GPUMEM_E_OUT_OF_MEMORY && strstr(gpumem_last_error(), "CUDA_ERROR_OUT_OF_MEMORY"),
        "device out of memory is an error", "%s", gpumem_last_error());
  rc = gpumem_alloc(w, "t_bad", 7, MiB, 0, &b);
  check(rc == GPUMEM_E_INVALID, "device beyond the GPUs is refused", "%s", gpumem_last_error());
  struct gpumem_status *s;
  gpumem_status(ctl, &s);
  check(s->devices[0]->managed == 0, "nothing half-made remains", "managed %llu bytes",
        (unsigned long long)s->devices[0]->managed);
  check(s->devices[0]->daemon_context == 0, "idle daemon holds no context",
        "no BACKUP or IPC buffers: context %d", s->devices[0]->daemon_context);
  gpumem_status_free(s);
}

int main(int argc, char **argv) {
  if (argc != 3) return 2;
  bin = argv[1];
  sock = argv[2];
  setvbuf(stdout, NULL, _IOLBF, 0);
  CUdevice dev;
  CUcontext ctx;
  if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx))
    return 100;
  gpumem_client *w;
  if (gpumem_connect(sock, "gpu_check", GPUMEM_ROLE_WORKER, 0, &w) < 0 ||
      gpumem_connect(sock, "gpu_check-ctl", GPUMEM_ROLE_CONTROLLER, GPUMEM_CONNECT_NO_THREAD, &ctl) < 0) {
    fprintf(stderr, "connect: %s\n", gpumem_last_error());
    return 100;
  }
  printf("backend %s, granularity %llu bytes, %u devices\n", gpumem_backend(w),
         (unsigned long long)gpumem_granularity(w), gpumem_device_count(w));
  alloc_pause_resume(w);
  resume_waits_for_room(w);
  backup_contents(w);
  ipc_legacy(w);
  bad_requests(w);
  four_workers();
  killed_worker();
  scenario();
  gpumem_disconnect(w);
  gpumem_disconnect(ctl);
  printf("%d failures\n", failures);
  return failures;
}
