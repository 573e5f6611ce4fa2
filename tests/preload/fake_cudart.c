/* A stand-in vendor runtime for the preload tests (no GPU here): the cuda*
 * and hip* calls that libgpumem_preload.so sits in front of, served from
 * host memory, with counters the test program reads through stub_*
 * entries. It plays libcudart/libamdhip64; it is never shipped. */
#include <pthread.h>
#include <stdlib.h>

#define STUB_EXPORT __attribute__((visibility("default")))
#define STUB_MAX 256

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static void *live[STUB_MAX]; /* what this runtime allocated */
static int device, frees, stream_syncs, device_syncs, mallocs;

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

/* Count a device synchronization. */
static int stub_device_sync(void) {
  __atomic_add_fetch(&device_syncs, 1, __ATOMIC_RELAXED);
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
