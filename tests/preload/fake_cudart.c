/* A stand-in vendor runtime for the preload tests (no GPU here): the cuda*
 * and hip* calls that libgpumem_preload.so sits in front of, served from
 * host memory, with counters the test program reads through stub_*
 * entries. It plays libcudart/libamdhip64; it is never shipped. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#define STUB_EXPORT __attribute__((visibility("default")))
#define STUB_MAX 256

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static void *live[STUB_MAX]; /* what this runtime allocated */
static int device, frees, stream_syncs, device_syncs, mallocs;
static int synced_device = -1; /* the current device at the last device sync */
static int capture;            /* 1: every stream is being captured */

/* Allocate from host memory and remember it (0 bytes: success, NULL). */
static int stub_malloc(void **p, size_t size) {
  if (!p) return 1;
  pthread_mutex_lock(&mu);
  mallocs++;
  int rc = 2;
  for (int i = 0; i < STUB_MAX && rc; i++) {
    if (live[i]) continue;
    if (size == 0) {
      *p = NULL;
    } else {
      if (!(live[i] = malloc(size))) break;
      *p = live[i];
    }
    rc = 0;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

/* Free what this runtime allocated; anything else is an invalid value. */
static int stub_free(void *p) {
  pthread_mutex_lock(&mu);
  frees++;
  int rc = p ? 1 : 0;
  for (int i = 0; i < STUB_MAX && p && rc; i++)
    if (live[i] == p) {
      free(p);
      live[i] = NULL;
      rc = 0;
    }
  pthread_mutex_unlock(&mu);
  return rc;
}

/* Count a stream synchronization. */
static int stub_stream_sync(void *stream) {
  (void)stream;
  __atomic_add_fetch(&stream_syncs, 1, __ATOMIC_RELAXED);
  return 0;
}

/* Count a device synchronization, and note which device it waited for. */
static int stub_device_sync(void) {
  __atomic_store_n(&synced_device, __atomic_load_n(&device, __ATOMIC_RELAXED),
                   __ATOMIC_RELAXED);
  __atomic_add_fetch(&device_syncs, 1, __ATOMIC_RELAXED);
  return 0;
}

/* Say whether a stream is being captured (all are while capture is set). */
static int stub_stream_capturing(void *stream, int *status) {
  (void)stream;
  if (!status) return 1;
  *status = __atomic_load_n(&capture, __ATOMIC_RELAXED);
  return 0;
}

/* The current device. */
static int stub_get_device(int *d) {
  if (!d) return 1;
  *d = __atomic_load_n(&device, __ATOMIC_RELAXED);
  return 0;
}

/* Change the current device. */
static int stub_set_device(int d) {
  if (d < 0) return 101; /* invalid device */
  __atomic_store_n(&device, d, __ATOMIC_RELAXED);
  return 0;
}

/* The stand-in's entry points of one runtime, each named with its prefix
 * (cuda, hip): <rt>Malloc, <rt>Free, <rt>MallocAsync, <rt>FreeAsync,
 * <rt>GetDevice, <rt>SetDevice, <rt>StreamSynchronize,
 * <rt>DeviceSynchronize and <rt>StreamIsCapturing, the same for both. */
#define STUB_RUNTIME(rt)                                                       \
  STUB_EXPORT int rt##Malloc(void **p, size_t size);                           \
  int rt##Malloc(void **p, size_t size) { return stub_malloc(p, size); }       \
  STUB_EXPORT int rt##Free(void *p);                                           \
  int rt##Free(void *p) { return stub_free(p); }                               \
  STUB_EXPORT int rt##MallocAsync(void **p, size_t size, void *stream);        \
  int rt##MallocAsync(void **p, size_t size, void *stream) {                   \
    (void)stream;                                                              \
    return stub_malloc(p, size);                                               \
  }                                                                            \
  STUB_EXPORT int rt##FreeAsync(void *p, void *stream);                        \
  int rt##FreeAsync(void *p, void *stream) {                                   \
    (void)stream;                                                              \
    return stub_free(p);                                                       \
  }                                                                            \
  STUB_EXPORT int rt##GetDevice(int *d);                                       \
  int rt##GetDevice(int *d) { return stub_get_device(d); }                     \
  STUB_EXPORT int rt##SetDevice(int d);                                        \
  int rt##SetDevice(int d) { return stub_set_device(d); }                      \
  STUB_EXPORT int rt##StreamSynchronize(void *stream);                         \
  int rt##StreamSynchronize(void *stream) { return stub_stream_sync(stream); } \
  STUB_EXPORT int rt##DeviceSynchronize(void);                                 \
  int rt##DeviceSynchronize(void) { return stub_device_sync(); }               \
  STUB_EXPORT int rt##StreamIsCapturing(void *stream, int *status);            \
  int rt##StreamIsCapturing(void *stream, int *status) {                       \
    return stub_stream_capturing(stream, status);                              \
  }

STUB_RUNTIME(cuda)
STUB_RUNTIME(hip)

/* Memory only this runtime made (as if allocated before the preload). */
STUB_EXPORT void *stub_alloc(size_t size);
void *stub_alloc(size_t size) {
  void *p = NULL;
  return stub_malloc(&p, size) ? NULL : p;
}
/* What reached this runtime: mallocs, frees, stream and device syncs. */
STUB_EXPORT void stub_counts(int *m, int *f, int *ss, int *ds);
void stub_counts(int *m, int *f, int *ss, int *ds) {
  pthread_mutex_lock(&mu);
  *m = mallocs;
  *f = frees;
  *ss = __atomic_load_n(&stream_syncs, __ATOMIC_RELAXED);
  *ds = __atomic_load_n(&device_syncs, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&mu);
}
/* Start (1) or end (0) a graph capture on every stream. */
STUB_EXPORT void stub_set_capture(int on);
void stub_set_capture(int on) { __atomic_store_n(&capture, on, __ATOMIC_RELAXED); }
/* The device the last device sync waited for (-1: none yet). */
STUB_EXPORT int stub_synced_device(void);
int stub_synced_device(void) { return __atomic_load_n(&synced_device, __ATOMIC_RELAXED); }

/* A library of the application that uses the runtime, for a program that
 * loads this one with dlopen(RTLD_LOCAL) (its calls bind to the preload
 * library first): on device 1, a malloc of 0 bytes, one of 1 MiB (kept in
 * *kept), a free of NULL, a free of memory only the runtime made. Writes
 * the return codes as "rc0 A rc1 B rc2 C rc3 D" to out. */
STUB_EXPORT void stub_user_run(char *out, size_t len, void **kept);
void stub_user_run(char *out, size_t len, void **kept) {
  cudaSetDevice(1);
  void *zero = (void *)1, *p = NULL;
  int r0 = cudaMalloc(&zero, 0);
  int r1 = cudaMalloc(&p, 1 << 20);
  int r2 = cudaFree(NULL);
  int r3 = cudaFree(stub_alloc(4096));
  snprintf(out, len, "rc0 %d rc1 %d rc2 %d rc3 %d", r0, r1, r2, r3);
  *kept = p;
}
/* The same library's free (through whatever cudaFree binds to). */
STUB_EXPORT int stub_user_free(void *p);
int stub_user_free(void *p) { return cudaFree(p); }
