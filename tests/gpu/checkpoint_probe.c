/* Probe: facts about the CUDA driver's checkpoint API (cuCheckpointProcess*)
 * and host-NUMA VMM memory on a real GPU, judged by NVML, one line a fact:
 *   F1 a checkpointer locks+checkpoints a worker (1 GiB) and exits; can another
 *      process (the fact's parent, only cuInit) restore+unlock it?
 *   F2 can a plain pthread inside the checkpointed worker restore+unlock itself?
 *   F3 lock/checkpoint of a pid without CUDA, with only cuInit, and a dead pid.
 *   F4 Lock(timeoutMs=1000, then 0) while the worker is in a 5 s synchronize.
 *   F5 a checkpointed worker SIGKILLed: does NVML still list it, GetState?
 *   F6 host-NUMA cuMemCreate with no context, fd passed to a process with a
 *      context, mapped and timed against cuMemHostAlloc; the creator retains
 *      the primary context itself (timed) and maps it too.
 *   F7 checkpoint/restore of a worker that maps imported host-NUMA memory;
 *   F8 the same with host-NUMA memory the worker created itself.
 *   F9 the same after the worker copied 1 GiB into imported host-NUMA memory
 *      (the owner's half of a backup, timed) and unmapped and released it;
 *   F10 the same, unmapped but the imported handle kept.
 * Each fact runs in its own forked process group with a watchdog; processes
 * step each other along over socket pairs (no sleeps as synchronization).
 * Build and run on the GPU machine:
 *   cc -std=c11 -D_GNU_SOURCE -O2 -Wall -Wextra -pthread -I/usr/local/cuda/include \
 *     tests/gpu/checkpoint_probe.c -o /tmp/checkpoint_probe \
 *     -L/usr/local/cuda/lib64/stubs -lcuda -ldl && /tmp/checkpoint_probe [FACT]
 */
#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fdpass.h"

#define MiB (1ull << 20)
#define GiB (1ull << 30)
#define WATCHDOG_MS 30000

static const char *F = "--"; /* the fact being measured, prefixes every line */
static CUdevice dev;
static size_t host_n; /* the size host_create rounded 1 GiB to */

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* One line on stdout in one write, so processes do not interleave. */
static void say(const char *fmt, ...) {
  char b[1200];
  int n = snprintf(b, sizeof b, "%s [pid %d] ", F, (int)getpid());
  va_list ap;
  va_start(ap, fmt);
  n += vsnprintf(b + n, sizeof b - n - 1, fmt, ap);
  va_end(ap);
  if (n > (int)sizeof b - 2) n = sizeof b - 2;
  b[n++] = '\n';
  if (write(1, b, n) < 0) return;
}

static const char *en(CUresult r) {
  const char *s = NULL;
  return cuGetErrorName(r, &s) == CUDA_SUCCESS && s ? s : "?";
}

/* A pid's checkpoint state, or the error GetState gave (rotating buffers). */
static const char *state(pid_t p) {
  static const char *names[] = {"RUNNING", "LOCKED", "CHECKPOINTED", "FAILED"};
  static char buf[4][48];
  static int k;
  char *b = buf[k++ & 3];
  CUprocessState s;
  CUresult r = cuCheckpointProcessGetState(p, &s);
  snprintf(b, 48, "%s", r ? en(r) : (unsigned)s < 4 ? names[s] : "?");
  return b;
}

/* ---- NVML, dlopened: the per-process list and the device's used memory ---- */
typedef struct { unsigned pid; unsigned long long used; unsigned gi, ci; } nv_proc;
typedef struct { unsigned long long total, free, used; } nv_mem;
static void *nv_dev;
static int (*nv_procs)(void *, unsigned *, nv_proc *);
static int (*nv_meminfo)(void *, nv_mem *);

static void nv_init(void) {
  void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  if (!lib) { say("NVML: %s", dlerror()); return; }
  int (*init)(void) = (int (*)(void))dlsym(lib, "nvmlInit_v2");
  int (*get)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
  nv_procs = (int (*)(void *, unsigned *, nv_proc *))dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3");
  nv_meminfo = (int (*)(void *, nv_mem *))dlsym(lib, "nvmlDeviceGetMemoryInfo");
  if (!init || !get || init() || get(0, &nv_dev)) { nv_dev = NULL; say("NVML: init failed"); }
}

/* MiB NVML attributes to pid: -1 when not listed, -2 when NVML failed. */
static long nv_pid(pid_t pid) {
  nv_proc p[64];
  unsigned n = 64;
  if (!nv_dev || !nv_procs || nv_procs(nv_dev, &n, p)) return -2;
  for (unsigned i = 0; i < n; i++)
    if ((pid_t)p[i].pid == pid) return (long)(p[i].used / MiB);
  return -1;
}

static long nv_used(void) {
  nv_mem m;
  if (!nv_dev || !nv_meminfo || nv_meminfo(nv_dev, &m)) return -2;
  return (long)(m.used / MiB);
}

/* The pid's figure once it stops moving (releases land late): 20 ms polls, 1 s at most. */
static long nv_pid_settled(pid_t pid) {
  long prev = nv_pid(pid);
  for (int i = 0; i < 50; i++) {
    usleep(20000);
    long v = nv_pid(pid);
    if (v == prev) return v;
    prev = v;
  }
  return prev;
}

static void nv_list(const char *when) {
  nv_proc p[64];
  unsigned n = 64;
  char b[600] = "";
  int rc = nv_dev && nv_procs ? nv_procs(nv_dev, &n, p) : -2, o = 0;
  for (unsigned i = 0; !rc && i < n && o < 500; i++)
    o += snprintf(b + o, sizeof b - o, " %u:%llu", p[i].pid, p[i].used / MiB);
  say("NVML processes %s (rc %d, pid:MiB):%s", when, rc, b);
}

/* ---- processes and the messages between them ---- */
static void put(int fd, char c) {
  if (write(fd, &c, 1) != 1) say("put '%c': %s", c, strerror(errno));
}

/* The next byte from fd, or -1 on time-out or end. */
static int get(int fd, int ms) {
  struct pollfd p = {fd, POLLIN, 0};
  char c;
  if (poll(&p, 1, ms) != 1) return -1;
  return read(fd, &c, 1) == 1 ? c : -1;
}

/* Pass an fd and the size of what it holds (fdpass.h, then the size). */
static void send_sized_fd(int sock, int fd, size_t size) {
  send_fd(sock, fd);
  if (write(sock, &size, sizeof size) != (ssize_t)sizeof size) say("write: %s", strerror(errno));
}

/* Receive what send_sized_fd sent: the fd (-1 if none), the size in *size. */
static int recv_sized_fd(int sock, size_t *size) {
  int fd = recv_fd(sock);
  if (read(sock, size, sizeof *size) != (ssize_t)sizeof *size) *size = 0;
  return fd;
}

/* Fork a child running fn(its socket end, arg); *sock is our end. */
static pid_t child(int *sock, void (*fn)(int, long), long arg) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) return -1;
  pid_t p = fork();
  if (p == 0) {
    close(sv[0]);
    fn(sv[1], arg);
    _exit(0);
  }
  close(sv[1]);
  *sock = sv[0];
  return p;
}

/* ---- CUDA pieces ---- */
static void ctx_up(void) {
  CUcontext c = NULL;
  CUresult r = cuInit(0);
  if (!r) r = cuDeviceGet(&dev, 0);
  if (!r) r = cuDevicePrimaryCtxRetain(&c, dev);
  if (!r) r = cuCtxSetCurrent(c);
  if (r) say("context: %s", en(r));
}

static uint32_t *pattern(size_t bytes, uint32_t seed) {
  uint32_t *b = malloc(bytes);
  for (size_t i = 0; b && i < bytes / 4; i++) b[i] = (uint32_t)i * 2654435761u ^ seed;
  return b;
}

/* Copy bytes at d back and count the words that differ from the pattern. */
static void check_pattern(const char *who, CUdeviceptr d, size_t bytes, uint32_t seed) {
  uint32_t *b = calloc(1, bytes);
  double t0 = now_ms();
  CUresult r = cuMemcpyDtoH(b, d, bytes);
  double t1 = now_ms();
  size_t bad = 0;
  for (size_t i = 0; i < bytes / 4; i++) bad += b[i] != ((uint32_t)i * 2654435761u ^ seed);
  say("%s: check cuMemcpyDtoH %zu MiB %s %.1f ms, %zu of %zu words wrong", who, bytes / MiB, en(r),
      t1 - t0, r ? bytes / 4 : bad, bytes / 4);
  free(b);
}

/* Lock (timeoutMs 5000) and checkpoint pid, with NVML before and after; 0 when checkpointed. */
static int ckpt(pid_t w, const char *who) {
  long m0 = nv_pid(w), u0 = nv_used();
  CUcheckpointLockArgs la;
  memset(&la, 0, sizeof la);
  la.timeoutMs = 5000;
  double t0 = now_ms();
  CUresult rl = cuCheckpointProcessLock(w, &la);
  double t1 = now_ms();
  CUresult rc = rl ? rl : cuCheckpointProcessCheckpoint(w, NULL);
  double t2 = now_ms();
  long m1 = nv_pid(w), m2 = nv_pid_settled(w);
  say("%s: Lock(%d) %s %.1f ms, Checkpoint %s %.1f ms, state %s; worker NVML %ld -> %ld MiB "
      "(settled %ld; -1 = not listed), device used %ld -> %ld MiB",
      who, (int)w, en(rl), t1 - t0, rl ? "skipped" : en(rc), t2 - t1, state(w), m0, m1, m2, u0, nv_used());
  return rl || rc;
}

/* Restore and unlock pid (both tried whatever came before), with NVML after. */
static int restore(pid_t w, const char *who) {
  const char *s0 = state(w);
  double t0 = now_ms();
  CUresult rr = cuCheckpointProcessRestore(w, NULL);
  double t1 = now_ms();
  const char *s1 = state(w);
  CUresult ru = cuCheckpointProcessUnlock(w, NULL);
  double t2 = now_ms();
  long m1 = nv_pid(w), m2 = nv_pid_settled(w);
  say("%s: state %s; Restore %s %.1f ms (state %s), Unlock %s %.1f ms (state %s); worker NVML %ld MiB "
      "(settled %ld), device used %ld MiB",
      who, s0, en(rr), t1 - t0, s1, en(ru), t2 - t1, state(w), m1, m2, nv_used());
  return rr || ru;
}

/* ---- the plain worker: context, 1 GiB cuMemAlloc with a pattern ---- */
static int self_sock, inner[2];

/* F2: a plain pthread of the checkpointed worker restores its own process. */
static void *self_restore(void *arg) {
  (void)arg;
  if (get(self_sock, 60000) != 'r') return NULL;
  pid_t me = getpid();
  say("F2 thread: GetState(self) %s", state(me));
  double t0 = now_ms();
  CUresult rr = cuCheckpointProcessRestore(me, NULL);
  double t1 = now_ms();
  say("F2 thread: Restore(self) %s %.1f ms, state %s", en(rr), t1 - t0, state(me));
  CUresult ru = cuCheckpointProcessUnlock(me, NULL);
  say("F2 thread: Unlock(self) %s %.1f ms, state %s", en(ru), now_ms() - t1, state(me));
  put(self_sock, 'd');
  put(inner[1], 'x');
  return NULL;
}

static void worker(int s, long self) {
  ctx_up();
  CUdeviceptr d = 0;
  CUresult r = cuMemAlloc(&d, GiB);
  uint32_t *b = pattern(GiB, 0xA5A5u);
  if (!r) r = cuMemcpyHtoD(d, b, GiB);
  free(b);
  if (r) { say("worker: alloc/fill %s", en(r)); return; }
  pthread_t t;
  if (self) {
    self_sock = s;
    if (pipe(inner) || pthread_create(&t, NULL, self_restore, NULL)) return;
  }
  put(s, 'R');
  if (self) get(inner[0], 60000); /* the main thread only waits, no CUDA call */
  while (get(s, 60000) == 'c') {
    check_pattern("worker", d, GiB, 0xA5A5u);
    put(s, 'C');
  }
}

static void checkpointer(int s, long w) {
  cuInit(0);
  nv_init();
  nv_list("before lock");
  put(s, ckpt((pid_t)w, "checkpointer (only cuInit)") ? 'F' : 'K');
}

/* Start a worker, have a separate process checkpoint it and exit. */
static pid_t checkpointed_worker(int *ws, long self) {
  int cs, st = 0;
  pid_t w = child(ws, worker, self);
  if (get(*ws, 20000) != 'R') { say("worker not ready"); return -1; }
  pid_t c = child(&cs, checkpointer, w);
  int k = get(cs, 20000);
  waitpid(c, &st, 0);
  say("checkpointer %s, then exited without restoring (wait status %d)", k == 'K' ? "checkpointed" : "FAILED", st);
  return k == 'K' ? w : -1;
}

static void fact1(void) {
  int ws;
  pid_t w = checkpointed_worker(&ws, 0);
  if (w < 0) return;
  cuInit(0);
  nv_init();
  say("parent (only cuInit, not the checkpointer): GetState(worker) %s", state(w));
  restore(w, "parent");
  put(ws, 'c');
  if (get(ws, 10000) != 'C') say("worker: no check result in 10 s (hung?)");
}

static void fact2(void) {
  int ws;
  pid_t w = checkpointed_worker(&ws, 1);
  if (w < 0) return;
  put(ws, 'r');
  double t0 = now_ms();
  int d = get(ws, 10000);
  cuInit(0);
  nv_init();
  if (d != 'd') {
    say("self-restore BLOCKED: no answer in %.0f ms; state from outside %s, worker NVML %ld MiB; killing it",
        now_ms() - t0, state(w), nv_pid(w));
    kill(w, SIGKILL);
    return;
  }
  say("self-restore returned after %.1f ms; state from outside %s, worker NVML %ld MiB (settled %ld)",
      now_ms() - t0, state(w), nv_pid(w), nv_pid_settled(w));
  put(ws, 'c');
  if (get(ws, 10000) != 'C') say("worker: no check result in 10 s (hung?)");
}

/* ---- F3: pids that never used CUDA, that only called cuInit, that do not exist ---- */
static void idle(int s, long cuda) {
  if (cuda) cuInit(0);
  put(s, 'R');
  get(s, 60000);
}

static void probe_pid(const char *what, pid_t p) {
  CUcheckpointLockArgs la;
  memset(&la, 0, sizeof la);
  la.timeoutMs = 1000;
  const char *s0 = state(p);
  double t0 = now_ms();
  CUresult rl = cuCheckpointProcessLock(p, &la);
  double t1 = now_ms();
  CUresult rc = cuCheckpointProcessCheckpoint(p, NULL);
  const char *s1 = state(p);
  CUresult rr = cuCheckpointProcessRestore(p, NULL);
  CUresult ru = cuCheckpointProcessUnlock(p, NULL);
  say("%s pid %d: GetState %s; Lock(1000) %s %.1f ms; Checkpoint %s (state %s); Restore %s; Unlock %s; "
      "GetState %s", what, (int)p, s0, en(rl), t1 - t0, en(rc), s1, en(rr), en(ru), state(p));
}

static void fact3(void) {
  int as, bs;
  pid_t a = child(&as, idle, 0), b = child(&bs, idle, 1);
  pid_t dead = fork();
  if (dead == 0) _exit(0);
  waitpid(dead, NULL, 0);
  if (get(as, 10000) != 'R' || get(bs, 10000) != 'R') { say("children not ready"); return; }
  cuInit(0);
  probe_pid("plain child (no CUDA)", a);
  probe_pid("child with only cuInit", b);
  say("dead pid %d: kill(pid, 0) %s", (int)dead, kill(dead, 0) ? strerror(errno) : "succeeded");
  probe_pid("dead pid", dead);
}

/* ---- F4: Lock while the worker is inside a 5 s cuStreamSynchronize ---- */
static int hsock;
static void CUDA_CB slow_host(void *p) {
  (void)p;
  put(hsock, 'B');
  sleep(5); /* the long operation the worker synchronizes on */
}

static void busy_worker(int s, long unused) {
  (void)unused;
  ctx_up();
  hsock = s;
  CUdeviceptr d = 0;
  uint32_t *b = pattern(64 * MiB, 0x4444u);
  CUresult r = cuMemAlloc(&d, 64 * MiB);
  if (!r) r = cuMemcpyHtoD(d, b, 64 * MiB);
  free(b);
  put(s, r ? 'F' : 'R');
  for (int c; (c = get(s, 60000)) == 'g' || c == 'c';) {
    if (c == 'c') {
      check_pattern("worker afterwards", d, 64 * MiB, 0x4444u);
      put(s, 'C');
      continue;
    }
    double t0 = now_ms();
    r = cuLaunchHostFunc(NULL, slow_host, NULL);
    if (!r) r = cuStreamSynchronize(NULL);
    say("worker: cuLaunchHostFunc(sleep 5 s) + cuStreamSynchronize %s %.1f ms", en(r), now_ms() - t0);
    put(s, 'S');
  }
}

static void fact4(void) {
  int ws;
  pid_t w = child(&ws, busy_worker, 0);
  if (get(ws, 20000) != 'R') { say("worker not ready"); return; }
  cuInit(0);
  unsigned timeouts[2] = {1000, 0};
  for (int i = 0; i < 2; i++) {
    put(ws, 'g');
    if (get(ws, 5000) != 'B') { say("host function did not start"); return; }
    CUcheckpointLockArgs la;
    memset(&la, 0, sizeof la);
    la.timeoutMs = timeouts[i];
    double t0 = now_ms();
    CUresult rl = cuCheckpointProcessLock(w, &la);
    double t1 = now_ms();
    const char *s1 = state(w);
    CUresult ru = rl ? CUDA_SUCCESS : cuCheckpointProcessUnlock(w, NULL);
    say("Lock(timeoutMs=%u) as the 5 s host func starts: %s after %.1f ms, state %s; unlock %s; state %s",
        timeouts[i], en(rl), t1 - t0, s1, rl ? "not needed" : en(ru), state(w));
    if (get(ws, 10000) != 'S') { say("worker's synchronize did not end in 10 s"); return; }
  }
  put(ws, 'c');
  if (get(ws, 10000) != 'C') say("worker: no check result in 10 s (hung?)");
  say("final state %s", state(w));
}

/* ---- F5: a checkpointed worker SIGKILLed ---- */
static void fact5(void) {
  int ws;
  pid_t w = child(&ws, worker, 0);
  if (get(ws, 20000) != 'R') { say("worker not ready"); return; }
  cuInit(0);
  nv_init();
  if (ckpt(w, "parent")) return;
  double t0 = now_ms();
  kill(w, SIGKILL);
  waitpid(w, NULL, 0);
  double t1 = now_ms();
  CUresult rr = cuCheckpointProcessRestore(w, NULL);
  say("SIGKILLed, reaped in %.1f ms: NVML lists worker %ld MiB (-1 = not listed), device used %ld MiB; "
      "GetState %s; Restore %s", t1 - t0, nv_pid(w), nv_used(), state(w), en(rr));
  usleep(1000000); /* observation a second later, not synchronization */
  say("1 s later: NVML worker %ld MiB, device used %ld MiB, GetState %s", nv_pid(w), nv_used(), state(w));
}

/* ---- F6/F7: host-NUMA VMM memory ---- */
/* In a process with only cuInit: create 1 GiB (rounded) on the device's host
 * NUMA node, export it and send the fd (and size) on x; returns the handle. */
static CUmemGenericAllocationHandle host_create(int x, int verbose) {
  CUmemGenericAllocationHandle h = 0;
  int numa = -1, vmm = -1, fd = -1;
  cuInit(0);
  cuDeviceGet(&dev, 0);
  cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, dev);
  cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev);
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  p.location.id = numa < 0 ? 0 : numa;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gmin = 0, grec = 0;
  CUresult rg = cuMemGetAllocationGranularity(&gmin, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  cuMemGetAllocationGranularity(&grec, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  size_t g = grec ? grec : gmin ? gmin : 2 * MiB, n = (GiB + g - 1) / g * g;
  long u0 = nv_used();
  double t0 = now_ms();
  CUresult rc = cuMemCreate(&h, n, &p, 0);
  double t1 = now_ms();
  CUresult re = rc ? rc : cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (verbose)
    say("creator (only cuInit, no context): HOST_NUMA_ID %d, HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED %d; "
        "granularity %s min %zu KiB, recommended %zu KiB; cuMemCreate HOST_NUMA %zu MiB %s %.1f ms; export fd %s; "
        "device used %ld -> %ld MiB; creator in NVML %ld", numa, vmm, en(rg), gmin >> 10, grec >> 10, n / MiB,
        en(rc), t1 - t0, en(re), u0, nv_used(), nv_pid(getpid()));
  if (x >= 0) send_sized_fd(x, fd, n);
  if (fd >= 0) close(fd);
  host_n = n;
  return rc ? 0 : h;
}

/* Map h (n bytes) into this process's context, grant access, and time 1 GiB
 * copies with device memory (best of 3); also with cuMemHostAlloc if pinned. */
static void map_and_time(const char *who, CUmemGenericAllocationHandle h, size_t n, int pinned) {
  CUdeviceptr va = 0, d = 0;
  CUresult r = cuMemAddressReserve(&va, n, 0, 0, 0);
  if (!r) r = cuMemMap(va, n, 0, h, 0);
  CUmemAccessDesc a, ah;
  memset(&a, 0, sizeof a);
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = 0;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ah = a;
  ah.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  CUresult ra = r ? r : cuMemSetAccess(va, n, &a, 1);
  CUresult rh = r ? r : cuMemSetAccess(va, n, &ah, 1);
  say("%s: reserve+map %s, device access %s, host access %s", who, en(r), en(ra), en(rh));
  if (r || ra) return;
  r = cuMemAlloc(&d, GiB);
  if (!r) r = cuMemsetD32(d, 0xC0FFEE11u, GiB / 4);
  cuCtxSynchronize();
  double to = 1e9, from = 1e9, t;
  CUresult r1 = r, r2 = r;
  for (int i = 0; !r && i < 3; i++) {
    t = now_ms();
    r1 = cuMemcpy(va, d, GiB);
    cuCtxSynchronize();
    if (now_ms() - t < to) to = now_ms() - t;
    t = now_ms();
    r2 = cuMemcpy(d, va, GiB);
    cuCtxSynchronize();
    if (now_ms() - t < from) from = now_ms() - t;
  }
  uint32_t tail[1024] = {0};
  CUresult rt = cuMemcpyDtoH(tail, va + GiB - sizeof tail, sizeof tail);
  say("%s: 1 GiB best of 3: device->hostNUMA %s %.1f ms (%.1f GiB/s), hostNUMA->device %s %.1f ms (%.1f GiB/s); "
      "last word via DtoH %s 0x%08x (want 0xc0ffee11)", who, en(r1), to, 1e3 / to, en(r2), from, 1e3 / from,
      en(rt), tail[1023]);
  if (!rh) say("%s: first word read by the CPU through the mapping 0x%08x", who, *(volatile uint32_t *)va);
  if (pinned) {
    void *p = NULL;
    t = now_ms();
    CUresult rp = cuMemHostAlloc(&p, GiB, 0);
    double talloc = now_ms() - t, dh = 1e9, hd = 1e9;
    for (int i = 0; !rp && i < 3; i++) {
      t = now_ms();
      r1 = cuMemcpyDtoH(p, d, GiB);
      if (now_ms() - t < dh) dh = now_ms() - t;
      t = now_ms();
      r2 = cuMemcpyHtoD(d, p, GiB);
      if (now_ms() - t < hd) hd = now_ms() - t;
    }
    say("%s: cuMemHostAlloc 1 GiB %s %.1f ms; best of 3: DtoH %s %.1f ms (%.1f GiB/s), HtoD %s %.1f ms (%.1f GiB/s)",
        who, en(rp), talloc, en(r1), dh, 1e3 / dh, en(r2), hd, 1e3 / hd);
    if (!rp) cuMemFreeHost(p);
  }
  cuMemFree(d);
  cuMemUnmap(va, n);
  cuMemAddressFree(va, n);
}

static void creator6(int s, long x) {
  nv_init();
  CUmemGenericAllocationHandle h = host_create((int)x, 1);
  if (get(s, 20000) != 'g' || !h) return;
  pid_t me = getpid();
  CUcontext c = NULL;
  double t0 = now_ms();
  CUresult r = cuDevicePrimaryCtxRetain(&c, dev);
  double t1 = now_ms();
  if (!r) r = cuCtxSetCurrent(c);
  say("creator: first cuDevicePrimaryCtxRetain %.1f ms, then cuCtxSetCurrent %s %.1f ms; creator in NVML %ld MiB",
      t1 - t0, en(r), now_ms() - t1, nv_pid_settled(me));
  if (!r) map_and_time("creator, own handle", h, host_n, 0);
  t0 = now_ms();
  CUresult rr = cuDevicePrimaryCtxRelease(dev);
  t1 = now_ms();
  long after = nv_pid_settled(me);
  double t2 = now_ms();
  CUresult r3 = cuDevicePrimaryCtxRetain(&c, dev);
  double t3 = now_ms();
  cuDevicePrimaryCtxRelease(dev);
  say("creator: cuDevicePrimaryCtxRelease %s %.1f ms, creator in NVML after %ld; second retain %s %.1f ms",
      en(rr), t1 - t0, after, en(r3), t3 - t2);
  put(s, 'D');
}

static CUresult import_fd(int x, CUmemGenericAllocationHandle *h, size_t *n) {
  int fd = recv_sized_fd(x, n);
  CUresult r = fd < 0 ? CUDA_ERROR_INVALID_HANDLE
                      : cuMemImportFromShareableHandle(h, (void *)(intptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (fd >= 0) close(fd);
  return r;
}

static void user6(int s, long x) {
  ctx_up();
  CUmemGenericAllocationHandle h = 0;
  size_t n = 0;
  CUresult r = import_fd((int)x, &h, &n);
  say("user (own context): import fd of %zu MiB %s", n / MiB, en(r));
  if (!r) map_and_time("user, imported", h, n, 1);
  put(s, 'D');
}

static void fact6(void) {
  int x[2], as, bs;
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, x)) return;
  child(&as, creator6, x[0]);
  child(&bs, user6, x[1]);
  if (get(bs, 20000) != 'D') say("user: no result in 20 s");
  put(as, 'g');
  if (get(as, 20000) != 'D') say("creator: no result in 20 s");
}

static void creator7(int s, long x) {
  put(s, host_create((int)x, 0) ? 'R' : 'F');
  get(s, 60000); /* holds the memory until the fact ends */
}

/* How a worker holds its host-NUMA memory when it is checkpointed. */
enum hold { HOLD_OWN_MAPPED, HOLD_IMPORTED_MAPPED, HOLD_IMPORTED_RELEASED, HOLD_IMPORTED_KEPT };

/* A worker with host-NUMA memory (pattern), imported from x or (x < 0)
 * created here, and 1 GiB of cuMemAlloc; with HOLD_IMPORTED_RELEASED
 * or HOLD_IMPORTED_KEPT it copies from device memory into the host-NUMA
 * memory (timed: what an owner copying its own backup would pay), then
 * unmaps it (and releases the handle: RELEASED). */
static void worker7(int s, long x) {
  enum hold how = (enum hold)(x >> 16);
  int xs = (int)(x & 0xffff) == 0xffff ? -1 : (int)(x & 0xffff);
  ctx_up();
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr va = 0, d = 0;
  size_t n = 0;
  CUresult ri = CUDA_ERROR_UNKNOWN;
  if (xs >= 0) ri = import_fd(xs, &h, &n);
  else if ((h = host_create(-1, 0)) != 0) ri = CUDA_SUCCESS, n = host_n;
  double t0 = now_ms();
  CUresult rm = ri;
  if (!ri) rm = cuMemAddressReserve(&va, n, 0, 0, 0);
  if (!rm) rm = cuMemMap(va, n, 0, h, 0);
  CUmemAccessDesc a;
  memset(&a, 0, sizeof a);
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult ra = rm ? rm : cuMemSetAccess(va, n, &a, 1);
  double t_map = now_ms() - t0;
  uint32_t *b = pattern(GiB, 0x7777u);
  CUresult rf = ra ? ra : cuMemAlloc(&d, GiB);
  if (!rf) rf = cuMemcpyHtoD(d, b, GiB);
  free(b);
  if (!rf && how <= HOLD_IMPORTED_MAPPED) rf = cuMemcpyDtoD(va, d, GiB);
  if (!rf && how >= HOLD_IMPORTED_RELEASED) {
    cuCtxSynchronize();
    t0 = now_ms();
    rf = cuMemcpyDtoD(va, d, GiB);
    cuCtxSynchronize();
    double t_copy = now_ms() - t0;
    t0 = now_ms();
    CUresult ru = cuMemUnmap(va, n);
    if (!ru) ru = cuMemAddressFree(va, n);
    if (!ru && how == HOLD_IMPORTED_RELEASED) ru = cuMemRelease(h);
    double t_unmap = now_ms() - t0;
    say("worker: owner's copy of 1 GiB into imported host-NUMA memory: map+access %.1f ms, "
        "copy %s %.1f ms (%.1f GiB/s), unmap%s %s %.1f ms", t_map, en(rf), t_copy, 1e3 / t_copy,
        how == HOLD_IMPORTED_RELEASED ? "+release" : " (handle kept)", en(ru), t_unmap);
    if (!rf) rf = ru;
  }
  say("worker: %s %s, map %s, device access %s, fill 1 GiB host-NUMA + 1 GiB cuMemAlloc %s%s",
      xs >= 0 ? "import" : "own cuMemCreate", en(ri), en(rm), en(ra), en(rf),
      how >= HOLD_IMPORTED_RELEASED ? " (host-NUMA no longer mapped)" : "");
  put(s, rf ? 'F' : 'R');
  if (get(s, 60000) != 'c') return;
  if (how <= HOLD_IMPORTED_MAPPED) check_pattern("worker host-NUMA", va, GiB, 0x7777u);
  check_pattern("worker cuMemAlloc", d, GiB, 0x7777u);
  put(s, 'C');
}

static void host_numa_checkpoint(enum hold how) {
  int x[2], cs = -1, ws;
  int imported = how != HOLD_OWN_MAPPED;
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, x)) return;
  if (imported) child(&cs, creator7, x[0]);
  pid_t w = child(&ws, worker7, ((long)how << 16) | (imported ? x[1] : 0xffff));
  if ((imported && get(cs, 20000) != 'R') || get(ws, 20000) != 'R') { say("creator or worker not ready"); return; }
  cuInit(0);
  nv_init();
  ckpt(w, "parent");
  restore(w, "parent");
  put(ws, 'c');
  if (get(ws, 6000) == 'C') return;
  say("worker: no check result in 6 s (hung at its next CUDA call?); state %s", state(w));
  double t0 = now_ms();
  kill(w, SIGKILL);
  waitpid(w, NULL, 0);
  say("worker SIGKILLed, reaped in %.1f ms: NVML worker %ld MiB, device used %ld MiB", now_ms() - t0, nv_pid(w), nv_used());
  usleep(1000000); /* observation a second later, not synchronization */
  say("1 s later: device used %ld MiB", nv_used());
}

static void fact7(void) { host_numa_checkpoint(HOLD_IMPORTED_MAPPED); }
static void fact8(void) { host_numa_checkpoint(HOLD_OWN_MAPPED); }
static void fact9(void) { host_numa_checkpoint(HOLD_IMPORTED_RELEASED); }
static void fact10(void) { host_numa_checkpoint(HOLD_IMPORTED_KEPT); }

/* Run one fact in its own process group; kill the group after WATCHDOG_MS. */
static void run_fact(const char *tag, void (*fn)(void), sigset_t *chld) {
  double t0 = now_ms();
  pid_t p = fork();
  if (p == 0) {
    setpgid(0, 0);
    sigprocmask(SIG_UNBLOCK, chld, NULL);
    F = tag;
    fn();
    _exit(0);
  }
  setpgid(p, p);
  F = tag;
  while (waitpid(p, NULL, WNOHANG) == 0) {
    long left = WATCHDOG_MS - (long)(now_ms() - t0);
    if (left <= 0) {
      kill(-p, SIGKILL);
      waitpid(p, NULL, 0);
      say("WATCHDOG: fact killed after %d s", WATCHDOG_MS / 1000);
      break;
    }
    struct timespec ts = {left / 1000, (left % 1000) * 1000000L};
    sigtimedwait(chld, NULL, &ts);
  }
  kill(-p, SIGKILL); /* whatever the fact left behind */
  say("fact took %.0f ms", now_ms() - t0);
}

int main(int argc, char **argv) {
  static struct { const char *tag; void (*fn)(void); } facts[] = {
      {"F1", fact1}, {"F2", fact2}, {"F3", fact3}, {"F4", fact4}, {"F5", fact5}, {"F6", fact6}, {"F7", fact7},
      {"F8", fact8}, {"F9", fact9}, {"F10", fact10}};
  int only = argc > 1 ? atoi(argv[1]) : 0;
  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  sigprocmask(SIG_BLOCK, &chld, NULL);
  for (int i = 0; i < (int)(sizeof facts / sizeof facts[0]); i++)
    if (!only || only == i + 1) run_fact(facts[i].tag, facts[i].fn, &chld);
  return 0;
}
