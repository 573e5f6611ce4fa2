/* libgpumem_preload.so: serve an unmodified program's device allocations
 * from gpumemd, by LD_PRELOAD.
 *
 * It defines cudaMalloc, cudaFree, cudaMallocAsync and cudaFreeAsync, and
 * the same four hip* names, in front of the vendor runtime. Allocations go
 * to the process's default client (connected on the first one; see
 * gpumem_default_client) with gpumem_torch_alloc's tag and flags: the
 * thread's tag, else $GPUMEM_DEFAULT_TAG and $GPUMEM_DEFAULT_FLAGS, else
 * "default", on the runtime's current device. Pausing that tag then
 * releases the memory; the addresses stay valid across the resume.
 *
 * - An allocation the daemon refuses (or no daemon) returns the runtime's
 *   out-of-memory error (2 on both) and leaves *ptr alone; nothing aborts.
 * - A size of 0, and a free of a pointer not served here (made before the
 *   library was loaded, or by a call it does not catch), go to the real
 *   runtime, found with dlsym(RTLD_NEXT): no vendor library is linked.
 * - A free waits for the device (cudaFree does too), an async free for its
 *   stream, before the memory can be handed out again.
 * - Not caught: cudaMallocManaged, cudaMallocHost, cudaHostAlloc,
 *   cudaMallocPitch, cudaMalloc3D, cudaMallocArray, memory pools
 *   (cudaMallocFromPoolAsync), their hip twins, the driver API (cuMemAlloc,
 *   cuMemCreate: PyTorch's expandable segments), NCCL's own buffers, and
 *   programs that link the runtime statically. Those stay outside the
 *   daemon, where `gpumemctl status` shows them as unmanaged.
 * - GPUMEM_PRELOAD_DEBUG=1 logs each call served to stderr. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/idmap.h"
#include "gpumem.h"

/* Error codes that CUDA and HIP number alike. */
enum {
  RT_SUCCESS = 0,
  RT_INVALID_VALUE = 1,
  RT_OUT_OF_MEMORY = 2,
  RT_NOT_SUPPORTED = 801,
};

/* The runtime calls this library needs from the real runtime. */
enum {
  REAL_MALLOC,
  REAL_FREE,
  REAL_MALLOC_ASYNC,
  REAL_FREE_ASYNC,
  REAL_GET_DEVICE,
  REAL_STREAM_SYNC,
  REAL_DEVICE_SYNC,
  REAL_COUNT,
};

/* One vendor runtime: its names and, once looked up, its functions. */
struct runtime {
  const char *vendor;
  const char *names[REAL_COUNT];
  void *fns[REAL_COUNT];
};

static struct runtime cuda_rt = {
    "cuda",
    {"cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cudaGetDevice",
     "cudaStreamSynchronize", "cudaDeviceSynchronize"},
    {0}};
static struct runtime hip_rt = {
    "hip",
    {"hipMalloc", "hipFree", "hipMallocAsync", "hipFreeAsync", "hipGetDevice",
     "hipStreamSynchronize", "hipDeviceSynchronize"},
    {0}};

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef int (*malloc_async_fn)(void **, size_t, void *);
typedef int (*free_async_fn)(void *, void *);
typedef int (*get_device_fn)(int *);
typedef int (*stream_sync_fn)(void *);
typedef int (*device_sync_fn)(void);

/* The addresses served here, so that frees of others go to the runtime. */
static pthread_mutex_t ours_mu = PTHREAD_MUTEX_INITIALIZER;
static idmap *ours;

/* Log a served call when GPUMEM_PRELOAD_DEBUG is set. */
__attribute__((format(printf, 1, 2))) static void debug(const char *fmt, ...) {
  static int on = -1;
  if (on < 0) {
    const char *v = getenv("GPUMEM_PRELOAD_DEBUG");
    on = v && *v && *v != '0';
  }
  if (!on) return;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "gpumem_preload: ");
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

/* The real runtime's function, looked up once; NULL if it has none. */
static void *real(struct runtime *rt, int which) {
  void *f = __atomic_load_n(&rt->fns[which], __ATOMIC_ACQUIRE);
  if (!f) {
    f = dlsym(RTLD_NEXT, rt->names[which]);
    __atomic_store_n(&rt->fns[which], f, __ATOMIC_RELEASE);
  }
  return f;
}

/* The runtime's current device (0 when it cannot say). */
static int current_device(struct runtime *rt) {
  get_device_fn get = (get_device_fn)real(rt, REAL_GET_DEVICE);
  int dev = 0;
  if (!get || get(&dev) != RT_SUCCESS) dev = 0;
  return dev;
}

/* Remember an address served here. */
static bool ours_add(void *p) {
  pthread_mutex_lock(&ours_mu);
  if (!ours) ours = idmap_create();
  bool ok = ours && idmap_put(ours, (uint64_t)(uintptr_t)p, p) == 0;
  pthread_mutex_unlock(&ours_mu);
  return ok;
}

/* Forget an address if it was served here; true if it was. */
static bool ours_take(void *p) {
  pthread_mutex_lock(&ours_mu);
  bool was = ours && p && idmap_get(ours, (uint64_t)(uintptr_t)p);
  if (was) idmap_del(ours, (uint64_t)(uintptr_t)p);
  pthread_mutex_unlock(&ours_mu);
  return was;
}

/* Allocate from the daemon on the current device. */
static int serve_malloc(struct runtime *rt, void **ptr, size_t size) {
  if (!ptr) return RT_INVALID_VALUE;
  int dev = current_device(rt);
  void *p = gpumem_torch_alloc(size, dev, NULL);
  if (p && !ours_add(p)) {
    gpumem_torch_free(p, size, dev, NULL);
    p = NULL;
  }
  if (!p) {
    debug("%sMalloc(%zu) on device %d refused: %s", rt->vendor, size, dev,
          gpumem_last_error());
    return RT_OUT_OF_MEMORY;
  }
  debug("%sMalloc(%zu) on device %d: %p", rt->vendor, size, dev, p);
  *ptr = p;
  return RT_SUCCESS;
}

/* Give an address served here back to the pool. */
static int serve_free(struct runtime *rt, void *p) {
  gpumem_client *c = gpumem_default_client();
  int rc = c ? gpumem_free_ptr(c, p) : GPUMEM_E_NOT_FOUND;
  debug("%sFree(%p): %s", rt->vendor, p, rc ? gpumem_last_error() : "ok");
  return rc ? RT_INVALID_VALUE : RT_SUCCESS;
}

/* cudaMalloc and hipMalloc. */
static int do_malloc(struct runtime *rt, void **ptr, size_t size) {
  if (size == 0) {
    malloc_fn f = (malloc_fn)real(rt, REAL_MALLOC);
    return f ? f(ptr, size) : RT_NOT_SUPPORTED;
  }
  return serve_malloc(rt, ptr, size);
}

/* cudaFree and hipFree: like the runtime, wait for the device first. */
static int do_free(struct runtime *rt, void *p) {
  if (!ours_take(p)) {
    free_fn f = (free_fn)real(rt, REAL_FREE);
    return f ? f(p) : RT_NOT_SUPPORTED;
  }
  device_sync_fn sync = (device_sync_fn)real(rt, REAL_DEVICE_SYNC);
  if (sync) sync();
  return serve_free(rt, p);
}

/* cudaMallocAsync and hipMallocAsync: the memory is usable on every stream
 * at once. */
static int do_malloc_async(struct runtime *rt, void **ptr, size_t size, void *stream) {
  if (size == 0) {
    malloc_async_fn f = (malloc_async_fn)real(rt, REAL_MALLOC_ASYNC);
    return f ? f(ptr, size, stream) : RT_NOT_SUPPORTED;
  }
  return serve_malloc(rt, ptr, size);
}

/* cudaFreeAsync and hipFreeAsync: wait for the stream, then free. */
static int do_free_async(struct runtime *rt, void *p, void *stream) {
  if (!ours_take(p)) {
    free_async_fn f = (free_async_fn)real(rt, REAL_FREE_ASYNC);
    return f ? f(p, stream) : RT_NOT_SUPPORTED;
  }
  stream_sync_fn sync = (stream_sync_fn)real(rt, REAL_STREAM_SYNC);
  if (sync) sync(stream);
  return serve_free(rt, p);
}

/* cudaMalloc, served by gpumemd. */
GPUMEM_EXPORT int cudaMalloc(void **ptr, size_t size);
int cudaMalloc(void **ptr, size_t size) { return do_malloc(&cuda_rt, ptr, size); }

/* cudaFree: gpumemd's memory here, the rest to the runtime. */
GPUMEM_EXPORT int cudaFree(void *p);
int cudaFree(void *p) { return do_free(&cuda_rt, p); }

/* cudaMallocAsync, served by gpumemd. */
GPUMEM_EXPORT int cudaMallocAsync(void **ptr, size_t size, void *stream);
int cudaMallocAsync(void **ptr, size_t size, void *stream) {
  return do_malloc_async(&cuda_rt, ptr, size, stream);
}

/* cudaFreeAsync: gpumemd's memory after the stream, the rest to the runtime. */
GPUMEM_EXPORT int cudaFreeAsync(void *p, void *stream);
int cudaFreeAsync(void *p, void *stream) { return do_free_async(&cuda_rt, p, stream); }

/* hipMalloc, served by gpumemd. */
GPUMEM_EXPORT int hipMalloc(void **ptr, size_t size);
int hipMalloc(void **ptr, size_t size) { return do_malloc(&hip_rt, ptr, size); }

/* hipFree: gpumemd's memory here, the rest to the runtime. */
GPUMEM_EXPORT int hipFree(void *p);
int hipFree(void *p) { return do_free(&hip_rt, p); }

/* hipMallocAsync, served by gpumemd. */
GPUMEM_EXPORT int hipMallocAsync(void **ptr, size_t size, void *stream);
int hipMallocAsync(void **ptr, size_t size, void *stream) {
  return do_malloc_async(&hip_rt, ptr, size, stream);
}

/* hipFreeAsync: gpumemd's memory after the stream, the rest to the runtime. */
GPUMEM_EXPORT int hipFreeAsync(void *p, void *stream);
int hipFreeAsync(void *p, void *stream) { return do_free_async(&hip_rt, p, stream); }
