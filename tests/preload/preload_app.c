/* An application for the preload tests: it knows nothing of gpumemd and
 * calls the runtime (tests/preload/fake_cudart.c, linked like libcudart)
 * as a program would. It runs commands from stdin, one reply line each,
 * so that the test decides when it allocates, frees and checks memory:
 *   malloc API SIZE     API: cuda, hip, cuda_async, hip_async -> rc N ptr HEX
 *   free API HEX        -> rc N
 *   stub SIZE           memory only the runtime made -> ptr HEX
 *   counts              what reached the runtime
 *   fill HEX SIZE SEED  / check HEX SIZE SEED: a pattern -> ok | bad OFF
 *   where HEX           the mapping of an address -> memfd | other | none
 *   tag NAME|- FLAGS    gpumem_set_thread_tag, if libgpumem is loaded -> rc N
 *   device N            cudaSetDevice -> rc N
 *   capture 1|0         start or end a graph capture of every stream -> ok
 *   synced              the device the last device sync waited for, and
 *                       the current one -> synced N current M
 *   quit */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SANITIZE_THREAD__)
/* Under TSan: this program reads and writes memory that libgpumem's own
 * thread mapped again at a resume, and it does so only after the test
 * heard that resume answered and then wrote a command to its stdin. That
 * ordering runs through other processes (the worker's ack, the daemon, the
 * test), which TSan cannot see, so it reports the mapping and the read as
 * a race. Only races with a frame in this file are suppressed. */
const char *__tsan_default_suppressions(void);
__attribute__((visibility("default"))) const char *__tsan_default_suppressions(void) {
  return "race:preload_app.c\n";
}
#endif

int cudaMalloc(void **p, size_t size);
int cudaFree(void *p);
int cudaMallocAsync(void **p, size_t size, void *stream);
int cudaFreeAsync(void *p, void *stream);
int cudaSetDevice(int d);
int cudaGetDevice(int *d);
int hipMalloc(void **p, size_t size);
int hipFree(void *p);
int hipMallocAsync(void **p, size_t size, void *stream);
int hipFreeAsync(void *p, void *stream);
void *stub_alloc(size_t size);
void stub_counts(int *m, int *f, int *ss, int *ds);
void stub_set_capture(int on);
int stub_synced_device(void);

#define SENTINEL ((void *)(uintptr_t)0x5a5a)
#define STREAM ((void *)(uintptr_t)0x77)

/* The pattern byte at offset i for seed. */
static unsigned char pattern(size_t i, unsigned seed) {
  return (unsigned char)(seed * 131u + i * 7u + (i >> 12));
}

/* Allocate through one of the runtime's entry points. */
static int do_malloc(const char *api, void **p, size_t size) {
  if (!strcmp(api, "cuda")) return cudaMalloc(p, size);
  if (!strcmp(api, "hip")) return hipMalloc(p, size);
  if (!strcmp(api, "cuda_async")) return cudaMallocAsync(p, size, STREAM);
  if (!strcmp(api, "hip_async")) return hipMallocAsync(p, size, STREAM);
  return -1;
}

/* Free through one of the runtime's entry points. */
static int do_free(const char *api, void *p) {
  if (!strcmp(api, "cuda")) return cudaFree(p);
  if (!strcmp(api, "hip")) return hipFree(p);
  if (!strcmp(api, "cuda_async")) return cudaFreeAsync(p, STREAM);
  if (!strcmp(api, "hip_async")) return hipFreeAsync(p, STREAM);
  return -1;
}

/* What backs an address: a memfd of gpumemd's host backend, other, none. */
static const char *where(uintptr_t a) {
  FILE *f = fopen("/proc/self/maps", "r");
  char line[512];
  const char *what = "none";
  while (f && fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx", &lo, &hi) != 2 || a < lo || a >= hi) continue;
    what = strstr(line, "/memfd:gpumem-host-") ? "memfd" : "other";
    break;
  }
  if (f) fclose(f);
  return what;
}

/* Run one command line; 0 to go on, 1 to stop. */
static int run(char *line) {
  char cmd[32] = "", a[64] = "", b[64] = "", c[64] = "";
  sscanf(line, "%31s %63s %63s %63s", cmd, a, b, c);
  if (!strcmp(cmd, "quit")) return 1;
  if (!strcmp(cmd, "malloc")) {
    void *p = SENTINEL;
    int rc = do_malloc(a, &p, strtoull(b, NULL, 0));
    printf("rc %d ptr %lx\n", rc, (unsigned long)(uintptr_t)p);
  } else if (!strcmp(cmd, "free")) {
    printf("rc %d\n", do_free(a, (void *)(uintptr_t)strtoull(b, NULL, 16)));
  } else if (!strcmp(cmd, "stub")) {
    printf("ptr %lx\n", (unsigned long)(uintptr_t)stub_alloc(strtoull(a, NULL, 0)));
  } else if (!strcmp(cmd, "counts")) {
    int m, f, ss, ds;
    stub_counts(&m, &f, &ss, &ds);
    printf("mallocs %d frees %d stream_syncs %d device_syncs %d\n", m, f, ss, ds);
  } else if (!strcmp(cmd, "fill") || !strcmp(cmd, "check")) {
    unsigned char *p = (unsigned char *)(uintptr_t)strtoull(a, NULL, 16);
    size_t n = strtoull(b, NULL, 0);
    unsigned seed = (unsigned)strtoul(c, NULL, 0);
    size_t bad = n;
    for (size_t i = 0; i < n; i++) {
      if (cmd[0] == 'f')
        p[i] = pattern(i, seed);
      else if (p[i] != pattern(i, seed) && bad == n)
        bad = i;
    }
    if (bad == n)
      printf("ok\n");
    else
      printf("bad %zu\n", bad);
  } else if (!strcmp(cmd, "where")) {
    printf("%s\n", where((uintptr_t)strtoull(a, NULL, 16)));
  } else if (!strcmp(cmd, "tag")) {
    int (*set)(const char *, unsigned) =
        (int (*)(const char *, unsigned))dlsym(RTLD_DEFAULT, "gpumem_set_thread_tag");
    if (set)
      printf("rc %d\n", set(strcmp(a, "-") ? a : NULL, (unsigned)strtoul(b, NULL, 0)));
    else
      printf("rc missing\n");
  } else if (!strcmp(cmd, "device")) {
    printf("rc %d\n", cudaSetDevice(atoi(a)));
  } else if (!strcmp(cmd, "capture")) {
    stub_set_capture(atoi(a));
    printf("ok\n");
  } else if (!strcmp(cmd, "synced")) {
    int cur = -1;
    cudaGetDevice(&cur);
    printf("synced %d current %d\n", stub_synced_device(), cur);
  } else {
    printf("unknown command\n");
  }
  return 0;
}

/* Run commands until quit or the end of input. */
int main(void) {
  char line[512];
  setvbuf(stdout, NULL, _IOLBF, 0);
  while (fgets(line, sizeof line, stdin))
    if (run(line)) break;
  return 0;
}
