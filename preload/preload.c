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
 * - Each pointer remembers the client and the device it was allocated
 *   with: its free goes to that client (a later gpumem_set_default_client
 *   changes only where new allocations go) and waits for that device,
 *   switching to it and back when it is not the current one.
 * - A size of 0, and a free of a pointer not served here (made before the
 *   library was loaded, or by a call it does not catch), go to the real
 *   runtime. No vendor library is linked or loaded here: the runtime is
 *   the next definition (dlsym RTLD_NEXT), else a runtime the program has
 *   loaded already, even with RTLD_LOCAL (libcudart.so.13/.12/.11.0/.11,
 *   libamdhip64.so.7/.6/.5, then any loaded object that defines the call);
 *   a library found that way stays loaded. With no runtime at all a size
 *   of 0 succeeds with NULL and a free of NULL succeeds, as the runtime
 *   would; other frees of pointers not served here fail with 801.
 * - A free waits for the device (cudaFree does too), an async free for its
 *   stream, before the memory can be handed out again.
 * - CUDA graphs: while the stream of cudaFreeAsync is being captured
 *   (cudaStreamIsCapturing, when the runtime has it), waiting for it is not
 *   allowed, so the free is deferred: the memory goes back at the next
 *   cudaFree, or cudaMallocAsync or cudaFreeAsync on a stream that is not
 *   capturing, after waiting for its device there. A graph that allocates
 *   and frees inside its capture therefore must not be replayed after that
 *   (the memory may have been handed out again): keep such memory outside
 *   the capture, as PyTorch's graph pools do. cudaMallocAsync during a
 *   capture is served at once, and the graph holds that address: it stays
 *   the same across pause and resume, so a graph replayed after a resume
 *   finds its memory where it was (with its contents only under BACKUP).
 * - A forked child forgets what the parent allocated here (those frees go
 *   to the runtime) and connects its own client on its first allocation.
 * - Not caught: cudaMallocManaged, cudaMallocHost, cudaHostAlloc,
 *   cudaMallocPitch, cudaMalloc3D, cudaMallocArray, memory pools
 *   (cudaMallocFromPoolAsync), their hip twins, the driver API (cuMemAlloc,
 *   cuMemCreate: PyTorch's expandable segments), NCCL's own buffers, and
 *   programs that link the runtime statically. Those stay outside the
 *   daemon, where `gpumemctl status` shows them as unmanaged.
 * - GPUMEM_PRELOAD_DEBUG=1 logs each call served to stderr. */
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
  REAL_SET_DEVICE,
  REAL_STREAM_SYNC,
  REAL_DEVICE_SYNC,
  REAL_STREAM_CAPTURING,
  REAL_COUNT,
};

/* One vendor runtime: its names, the libraries it may be loaded as, and,
 * once looked up, its functions (and when a lookup last found nothing). */
struct runtime {
  const char *vendor;
  const char *names[REAL_COUNT];
  const char *libs[6];
  void *fns[REAL_COUNT];
  unsigned long long missed[REAL_COUNT]; /* the loader's count of loads then */
};

static struct runtime cuda_rt = {
    "cuda",
    {"cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cudaGetDevice",
     "cudaSetDevice", "cudaStreamSynchronize", "cudaDeviceSynchronize",
     "cudaStreamIsCapturing"},
    {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so.11",
     "libcudart.so", NULL},
    {0},
    {0}};
static struct runtime hip_rt = {
    "hip",
    {"hipMalloc", "hipFree", "hipMallocAsync", "hipFreeAsync", "hipGetDevice", "hipSetDevice",
     "hipStreamSynchronize", "hipDeviceSynchronize", "hipStreamIsCapturing"},
    {"libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5", "libamdhip64.so", NULL},
    {0},
    {0}};

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef int (*malloc_async_fn)(void **, size_t, void *);
typedef int (*free_async_fn)(void *, void *);
typedef int (*get_device_fn)(int *);
typedef int (*set_device_fn)(int);
typedef int (*stream_sync_fn)(void *);
typedef int (*device_sync_fn)(void);
typedef int (*stream_capturing_fn)(void *, int *);

/* The addresses served here and their devices (value: device + 1), so
 * that frees of others go to the runtime. */
static pthread_mutex_t ours_mu = PTHREAD_MUTEX_INITIALIZER;
static idmap *ours;

/* A free deferred while its stream was being captured. */
struct deferred {
  void *ptr;
  int device;
  struct runtime *rt;
  struct deferred *next;
};
static pthread_mutex_t deferred_mu = PTHREAD_MUTEX_INITIALIZER;
static struct deferred *deferred; /* read unlocked with atomics */

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

/* True if f is in this library (a lookup must never find our own names). */
static bool is_ours(void *f) {
  static void *base;
  Dl_info me, it;
  void *b = __atomic_load_n(&base, __ATOMIC_RELAXED);
  if (!b && dladdr((void *)is_ours, &me))
    __atomic_store_n(&base, b = me.dli_fbase, __ATOMIC_RELAXED);
  return dladdr(f, &it) && it.dli_fbase == b;
}

/* Record the loader's count of loads from its first object, and stop. */
static int note_adds(struct dl_phdr_info *info, size_t size, void *arg) {
  if (size >= offsetof(struct dl_phdr_info, dlpi_adds) + sizeof info->dlpi_adds)
    *(unsigned long long *)arg = info->dlpi_adds;
  return 1;
}

/* How many objects the loader has loaded so far (1 or more). */
static unsigned long long loads(void) {
  unsigned long long n = 1;
  dl_iterate_phdr(note_adds, &n);
  return n ? n : 1;
}

/* The paths of the loaded objects, for loaded_lookup. */
struct objects {
  char **names;
  size_t n, cap;
};

/* Copy one loaded object's path (dlopen may not be called from here). */
static int note_object(struct dl_phdr_info *info, size_t size, void *arg) {
  (void)size;
  struct objects *o = arg;
  if (!info->dlpi_name || !info->dlpi_name[0]) return 0;
  if (o->n == o->cap) {
    size_t cap = o->cap ? o->cap * 2 : 64;
    char **names = realloc(o->names, cap * sizeof *names);
    if (!names) return 1;
    o->names = names;
    o->cap = cap;
  }
  if ((o->names[o->n] = strdup(info->dlpi_name))) o->n++;
  return 0;
}

/* name in a loaded object (the handle stays open while it is in use). */
static void *in_object(const char *path, const char *name) {
  void *h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
  if (!h) return NULL;
  void *f = dlsym(h, name);
  if (f && !is_ours(f)) return f; /* the handle keeps the library loaded */
  dlclose(h);
  return NULL;
}

/* name in any object loaded already (a runtime loaded with RTLD_LOCAL,
 * under a name we do not know), or NULL. */
static void *loaded_lookup(const char *name) {
  struct objects o = {0};
  dl_iterate_phdr(note_object, &o);
  void *f = NULL;
  for (size_t i = 0; i < o.n; i++) {
    if (!f) f = in_object(o.names[i], name);
    free(o.names[i]);
  }
  free(o.names);
  return f;
}

/* The real runtime's function, looked up once found; a lookup that finds
 * nothing is tried again only after the program has loaded more. */
static void *real(struct runtime *rt, int which) {
  void *f = __atomic_load_n(&rt->fns[which], __ATOMIC_ACQUIRE);
  if (f) return f;
  unsigned long long now = loads();
  if (__atomic_load_n(&rt->missed[which], __ATOMIC_RELAXED) == now) return NULL;
  const char *name = rt->names[which];
  f = dlsym(RTLD_NEXT, name);
  if (f && is_ours(f)) f = NULL;
  for (size_t i = 0; !f && rt->libs[i]; i++) f = in_object(rt->libs[i], name);
  if (!f) f = loaded_lookup(name);
  if (f)
    __atomic_store_n(&rt->fns[which], f, __ATOMIC_RELEASE);
  else
    __atomic_store_n(&rt->missed[which], now, __ATOMIC_RELAXED);
  return f;
}

/* The runtime's current device (0 when it cannot say). */
static int current_device(struct runtime *rt) {
  get_device_fn get = (get_device_fn)real(rt, REAL_GET_DEVICE);
  int dev = 0;
  if (!get || get(&dev) != RT_SUCCESS) dev = 0;
  return dev;
}

/* Wait for a device: the current one directly, another by making it
 * current for the wait and switching back. */
static void sync_device(struct runtime *rt, int dev) {
  device_sync_fn sync = (device_sync_fn)real(rt, REAL_DEVICE_SYNC);
  if (!sync) return;
  int cur = current_device(rt);
  set_device_fn set = (set_device_fn)real(rt, REAL_SET_DEVICE);
  if (cur != dev && set && set(dev) == RT_SUCCESS) {
    sync();
    set(cur);
  } else {
    sync();
  }
}

/* True if the stream is being captured into a graph (or the runtime
 * says that asking is not allowed now, as it does while capturing). */
static bool capturing(struct runtime *rt, void *stream) {
  stream_capturing_fn f = (stream_capturing_fn)real(rt, REAL_STREAM_CAPTURING);
  int status = 0;
  return f && (f(stream, &status) != RT_SUCCESS || status != 0);
}

/* Remember an address served here on device dev. */
static bool ours_add(void *p, int dev) {
  pthread_mutex_lock(&ours_mu);
  if (!ours) ours = idmap_create();
  bool ok = ours && idmap_put(ours, (uint64_t)(uintptr_t)p, (void *)(uintptr_t)(dev + 1)) == 0;
  pthread_mutex_unlock(&ours_mu);
  return ok;
}

/* Forget an address if it was served here; true if it was, with its
 * device in *dev. */
static bool ours_take(void *p, int *dev) {
  pthread_mutex_lock(&ours_mu);
  uintptr_t v = ours && p ? (uintptr_t)idmap_get(ours, (uint64_t)(uintptr_t)p) : 0;
  if (v) idmap_del(ours, (uint64_t)(uintptr_t)p);
  pthread_mutex_unlock(&ours_mu);
  *dev = v ? (int)(v - 1) : 0;
  return v != 0;
}

/* In a forked child: what the parent allocated here is not the child's
 * to free (those frees go to the runtime); the maps are leaked knowingly,
 * as libgpumem forgets the parent's client. */
static void forget_in_child(void) {
  pthread_mutex_init(&ours_mu, NULL);
  pthread_mutex_init(&deferred_mu, NULL);
  ours = NULL;
  deferred = NULL;
}

/* Register the fork handler when the library is loaded. */
__attribute__((constructor)) static void preload_init(void) {
  pthread_atfork(NULL, NULL, forget_in_child);
}

/* Allocate from the daemon on the current device. */
static int serve_malloc(struct runtime *rt, void **ptr, size_t size) {
  if (!ptr) return RT_INVALID_VALUE;
  int dev = current_device(rt);
  void *p = gpumem_torch_alloc(size, dev, NULL);
  if (p && !ours_add(p, dev)) {
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

/* Give an address served here back, to the client that allocated it. */
static int serve_free(struct runtime *rt, void *p, int dev) {
  gpumem_torch_free(p, 0, dev, NULL);
  debug("%sFree(%p) on device %d", rt->vendor, p, dev);
  return RT_SUCCESS;
}

/* Free what was deferred during graph captures: wait for each device
 * once, then give the memory back. Called where no capture can be
 * harmed by the wait. */
static void drain_deferred(void) {
  if (!__atomic_load_n(&deferred, __ATOMIC_ACQUIRE)) return;
  pthread_mutex_lock(&deferred_mu);
  struct deferred *list = deferred;
  __atomic_store_n(&deferred, NULL, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&deferred_mu);
  for (struct deferred *d = list; d; d = d->next) {
    bool waited = false;
    for (struct deferred *e = list; e != d && !waited; e = e->next)
      waited = e->rt == d->rt && e->device == d->device;
    if (!waited) sync_device(d->rt, d->device);
  }
  while (list) {
    struct deferred *next = list->next;
    serve_free(list->rt, list->ptr, list->device);
    free(list);
    list = next;
  }
}

/* Keep a free for drain_deferred; false when out of memory. */
static bool defer(struct runtime *rt, void *p, int dev) {
  struct deferred *d = malloc(sizeof *d);
  if (!d) return false;
  *d = (struct deferred){p, dev, rt, NULL};
  pthread_mutex_lock(&deferred_mu);
  d->next = deferred;
  __atomic_store_n(&deferred, d, __ATOMIC_RELEASE);
  pthread_mutex_unlock(&deferred_mu);
  return true;
}

/* cudaMalloc and hipMalloc (which may run during a capture: nothing
 * deferred is freed here). */
static int do_malloc(struct runtime *rt, void **ptr, size_t size) {
  if (size == 0) {
    malloc_fn f = (malloc_fn)real(rt, REAL_MALLOC);
    if (f) return f(ptr, size);
    if (!ptr) return RT_INVALID_VALUE;
    *ptr = NULL;
    return RT_SUCCESS;
  }
  return serve_malloc(rt, ptr, size);
}

/* cudaFree and hipFree: like the runtime, wait for the device first (the
 * pointer's device). */
static int do_free(struct runtime *rt, void *p) {
  drain_deferred();
  int dev;
  if (!ours_take(p, &dev)) {
    free_fn f = (free_fn)real(rt, REAL_FREE);
    return f ? f(p) : p ? RT_NOT_SUPPORTED : RT_SUCCESS;
  }
  sync_device(rt, dev);
  return serve_free(rt, p, dev);
}

/* cudaMallocAsync and hipMallocAsync: the memory is usable on every stream
 * at once. */
static int do_malloc_async(struct runtime *rt, void **ptr, size_t size, void *stream) {
  if (!capturing(rt, stream)) drain_deferred();
  if (size == 0) {
    malloc_async_fn f = (malloc_async_fn)real(rt, REAL_MALLOC_ASYNC);
    if (f) return f(ptr, size, stream);
    if (!ptr) return RT_INVALID_VALUE;
    *ptr = NULL;
    return RT_SUCCESS;
  }
  return serve_malloc(rt, ptr, size);
}

/* cudaFreeAsync and hipFreeAsync: wait for the stream, then free; while
 * the stream is being captured, defer the free. */
static int do_free_async(struct runtime *rt, void *p, void *stream) {
  int dev;
  if (!ours_take(p, &dev)) {
    free_async_fn f = (free_async_fn)real(rt, REAL_FREE_ASYNC);
    return f ? f(p, stream) : p ? RT_NOT_SUPPORTED : RT_SUCCESS;
  }
  if (capturing(rt, stream)) {
    if (!defer(rt, p, dev)) {
      ours_add(p, dev);
      return RT_OUT_OF_MEMORY;
    }
    debug("%sFreeAsync(%p) during a graph capture: deferred", rt->vendor, p);
    return RT_SUCCESS;
  }
  drain_deferred();
  stream_sync_fn sync = (stream_sync_fn)real(rt, REAL_STREAM_SYNC);
  if (sync) sync(stream);
  return serve_free(rt, p, dev);
}

/* The entry points of one runtime (prefix rt: cuda, hip; its state st):
 * <rt>Malloc and <rt>MallocAsync served by gpumemd; <rt>Free here for
 * gpumemd's memory, and <rt>FreeAsync after the stream, the rest to the
 * runtime. */
#define PRELOAD_RUNTIME(rt, st)                                                 \
  GPUMEM_EXPORT int rt##Malloc(void **ptr, size_t size);                        \
  int rt##Malloc(void **ptr, size_t size) { return do_malloc(&st, ptr, size); } \
  GPUMEM_EXPORT int rt##Free(void *p);                                          \
  int rt##Free(void *p) { return do_free(&st, p); }                             \
  GPUMEM_EXPORT int rt##MallocAsync(void **ptr, size_t size, void *stream);     \
  int rt##MallocAsync(void **ptr, size_t size, void *stream) {                  \
    return do_malloc_async(&st, ptr, size, stream);                             \
  }                                                                             \
  GPUMEM_EXPORT int rt##FreeAsync(void *p, void *stream);                       \
  int rt##FreeAsync(void *p, void *stream) { return do_free_async(&st, p, stream); }

PRELOAD_RUNTIME(cuda, cuda_rt)
PRELOAD_RUNTIME(hip, hip_rt)
