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

/* cudaMalloc of the stand-in. */
STUB_EXPORT int cudaMalloc(void **p, size_t size);
int cudaMalloc(void **p, size_t size) { return stub_malloc(p, size); }
/* cudaFree of the stand-in. */
STUB_EXPORT int cudaFree(void *p);
int cudaFree(void *p) { return stub_free(p); }
/* cudaMallocAsync of the stand-in. */
STUB_EXPORT int cudaMallocAsync(void **p, size_t size, void *stream);
int cudaMallocAsync(void **p, size_t size, void *stream) {
  (void)stream;
  return stub_malloc(p, size);
}
/* cudaFreeAsync of the stand-in. */
STUB_EXPORT int cudaFreeAsync(void *p, void *stream);
int cudaFreeAsync(void *p, void *stream) {
  (void)stream;
  return stub_free(p);
}
/* cudaGetDevice of the stand-in. */
STUB_EXPORT int cudaGetDevice(int *d);
int cudaGetDevice(int *d) { return stub_get_device(d); }
/* cudaSetDevice of the stand-in. */
STUB_EXPORT int cudaSetDevice(int d);
int cudaSetDevice(int d) { return stub_set_device(d); }
/* cudaStreamSynchronize of the stand-in. */
STUB_EXPORT int cudaStreamSynchronize(void *stream);
int cudaStreamSynchronize(void *stream) { return stub_stream_sync(stream); }
/* cudaDeviceSynchronize of the stand-in. */
STUB_EXPORT int cudaDeviceSynchronize(void);
int cudaDeviceSynchronize(void) { return stub_device_sync(); }

/* cudaStreamIsCapturing of the stand-in. */
STUB_EXPORT int cudaStreamIsCapturing(void *stream, int *status);
int cudaStreamIsCapturing(void *stream, int *status) {
  return stub_stream_capturing(stream, status);
}

/* hipMalloc of the stand-in. */
STUB_EXPORT int hipMalloc(void **p, size_t size);
int hipMalloc(void **p, size_t size) { return stub_malloc(p, size); }
/* hipFree of the stand-in. */
STUB_EXPORT int hipFree(void *p);
int hipFree(void *p) { return stub_free(p); }
/* hipMallocAsync of the stand-in. */
STUB_EXPORT int hipMallocAsync(void **p, size_t size, void *stream);
int hipMallocAsync(void **p, size_t size, void *stream) {
  (void)stream;
  return stub_malloc(p, size);
}
/* hipFreeAsync of the stand-in. */
STUB_EXPORT int hipFreeAsync(void *p, void *stream);
int hipFreeAsync(void *p, void *stream) {
  (void)stream;
  return stub_free(p);
}
/* hipGetDevice of the stand-in. */
STUB_EXPORT int hipGetDevice(int *d);
int hipGetDevice(int *d) { return stub_get_device(d); }
/* hipSetDevice of the stand-in. */
STUB_EXPORT int hipSetDevice(int d);
int hipSetDevice(int d) { return stub_set_device(d); }
/* hipStreamSynchronize of the stand-in. */
STUB_EXPORT int hipStreamSynchronize(void *stream);
int hipStreamSynchronize(void *stream) { return stub_stream_sync(stream); }
/* hipDeviceSynchronize of the stand-in. */
STUB_EXPORT int hipDeviceSynchronize(void);
int hipDeviceSynchronize(void) { return stub_device_sync(); }

/* hipStreamIsCapturing of the stand-in. */
STUB_EXPORT int hipStreamIsCapturing(void *stream, int *status);
int hipStreamIsCapturing(void *stream, int *status) {
  return stub_stream_capturing(stream, status);
}

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
