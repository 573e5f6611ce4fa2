/* A stand-in for the HIP runtime (libamdhip64) on a machine without an
 * AMD GPU, so that tests run the HIP backend (gpu/hip_*.c) and real
 * workers against it. It has exactly the calls the backend resolves, with
 * the types of the HIP headers it is built against; device memory is host
 * memory. It is never shipped.
 *
 * - A physical allocation (hipMemCreate, hipMalloc) is a committed memfd
 *   sealed at its size, named fake-hip-<universe>:<device>:<bytes>. An
 *   export is a dup of it, an import a handle over a dup of the fd handed
 *   over; a reservation is PROT_NONE memory, a mapping maps the memfd
 *   there MAP_SHARED, access is an mprotect, an unmap puts PROT_NONE back.
 * - Device memory in use is what the kernel says is still alive: the
 *   memfds of the universe that any process holds by fd or maps (every
 *   /proc/PID/fd and /proc/PID/maps this process may read), each counted
 *   once. So memory comes free only once every process let go of it, and
 *   a process that dies gives its memory back, as on a GPU.
 * - The universe is the directory FAKE_HIP_DIR (required; made if
 *   missing): processes given the same one share devices, and its lock
 *   file makes allocations check the device size one at a time.
 *   FAKE_HIP_DEVICES (default 1) devices of FAKE_HIP_DEVICE_BYTES each
 *   (default 4G; suffix K, M or G), granularity 2 MiB, PCI bus ids
 *   0000:<16 + device, in hex>:00.0.
 * - Copies are memcpy under one lock; streams complete at once.
 * - A legacy IPC handle names the creator's pid and fd: the opener reopens
 *   /proc/PID/fd/N, which needs the right to read the creator's /proc.
 * - Strict: a call takes only the arguments the backend passes (others are
 *   hipErrorInvalidValue and friends, never a crash). Stricter than HIP
 *   where that catches a backend bug: every call but hipInit and
 *   hipGetErrorName needs hipInit first; hipMemAddressReserve takes no
 *   address hint; hipMemSetAccess covers whole mappings of the device it
 *   names; hipMemUnmap one whole mapping; hipMemAddressFree a whole range
 *   with nothing mapped; imported handles do not export (as on CUDA); an
 *   asynchronous copy's host memory is pageable or lies in one pinned
 *   range (one that straddles two registrations is slow on a GPU);
 *   hipIpcGetMemHandle takes the start of a hipMalloc allocation, and a
 *   process cannot open its own handle.
 * - Not modeled: device memory is CPU-visible here, copies are done at
 *   once and in order, a forked child shares the mappings, memory is free
 *   the moment the last process lets go (a driver may lag), and there is
 *   no ROCm SMI (no per-process figures). */
#define __HIP_PLATFORM_AMD__
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#pragma GCC visibility push(default)
#include <hip/hip_runtime_api.h>
#include <hip/hip_version.h>
#pragma GCC visibility pop

/* The allocation property's handle-type field, named as the headers do. */
#if HIP_VERSION_MAJOR >= 7
#define HANDLE_TYPES(p) ((p)->requestedHandleTypes)
#else
#define HANDLE_TYPES(p) ((p)->requestedHandleType)
#endif

#define GRANULARITY (2ull << 20)
#define MAX_DEVICES 64
#define FIRST_BUS 0x10
#define DEFAULT_DEVICE_BYTES (4ull << 30)

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; /* everything below */
static atomic_bool initialized;
static struct {
  int ndev;
  uint64_t device_bytes;
  char dir[PATH_MAX];
  char prefix[64]; /* "fake-hip-<universe>:", the start of every memfd's name */
} rt;
static _Thread_local int current; /* the thread's device */

/* A range of this process's memory the runtime knows. */
enum kind { RESERVED, MAPPED, DEVICE_MALLOC, IPC_OPENED, HOST_MALLOC, HOST_REGISTERED };
struct region {
  struct region *next;
  enum kind kind;
  uintptr_t va;
  uint64_t size;
  int dev;
  int fd;      /* DEVICE_MALLOC: its memfd, which IPC handles name */
  bool access; /* MAPPED: read-write */
};
static struct region *regions;

/* A created or imported allocation: its own fd of the memfd. */
struct ihipMemGenericAllocationHandle {
  struct ihipMemGenericAllocationHandle *next;
  int fd, dev;
  uint64_t size;
  bool imported;
};
static struct ihipMemGenericAllocationHandle *handles;

/* A stream: nothing to it, copies complete at once. */
struct ihipStream_t {
  struct ihipStream_t *next;
};
static struct ihipStream_t *streams;

/* What a legacy IPC handle carries (the rest of its 64 bytes are zero). */
struct ipc_handle {
  char magic[8];
  uint64_t ino, size;
  int32_t pid, fd, dev;
};
_Static_assert(sizeof(struct ipc_handle) <= sizeof(hipIpcMemHandle_t), "fits an IPC handle");
static const char ipc_magic[8] = "fakehip";

/* Say why the runtime cannot start (the daemon's log shows it). */
static hipError_t complain(const char *what) {
  fprintf(stderr, "fake libamdhip64: %s\n", what);
  return hipErrorNoDevice;
}

/* A number from the environment with an optional K, M or G: def when
 * unset, false when it is not one. */
static bool env_number(const char *name, uint64_t def, uint64_t *out) {
  const char *s = getenv(name);
  if (!s || !*s) {
    *out = def;
    return true;
  }
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  int shift = *end == 'K' ? 10 : *end == 'M' ? 20 : *end == 'G' ? 30 : 0;
  if (shift) end++;
  if (errno || end == s || *end || v > (UINT64_MAX >> shift)) return false;
  *out = (uint64_t)v << shift;
  return true;
}

/* FNV-1a of a string, to name a universe. */
static uint64_t hash(const char *s, uint64_t h) {
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return h;
}

/* Read the environment and make the universe's directory. */
static hipError_t setup(void) {
  const char *dir = getenv("FAKE_HIP_DIR");
  uint64_t ndev, bytes;
  if (!dir || !*dir) return complain("FAKE_HIP_DIR is not set");
  if (!env_number("FAKE_HIP_DEVICES", 1, &ndev) || ndev < 1 || ndev > MAX_DEVICES)
    return complain("FAKE_HIP_DEVICES must be 1..64");
  if (!env_number("FAKE_HIP_DEVICE_BYTES", DEFAULT_DEVICE_BYTES, &bytes) || !bytes ||
      bytes % GRANULARITY)
    return complain("FAKE_HIP_DEVICE_BYTES must be a multiple of 2M");
  struct stat st;
  if ((mkdir(dir, 0755) < 0 && errno != EEXIST) || !realpath(dir, rt.dir) ||
      stat(rt.dir, &st) < 0 || !S_ISDIR(st.st_mode))
    return complain("FAKE_HIP_DIR is not a directory that can be made");
  char id[64];
  snprintf(id, sizeof id, ":%llx:%llx", (unsigned long long)st.st_dev,
           (unsigned long long)st.st_ino);
  snprintf(rt.prefix, sizeof rt.prefix, "fake-hip-%016llx:",
           (unsigned long long)hash(id, hash(rt.dir, 0xcbf29ce484222325ull)));
  rt.ndev = (int)ndev;
  rt.device_bytes = bytes;
  atomic_store(&initialized, true);
  return hipSuccess;
}

/* Start the runtime (once; flags must be 0). */
hipError_t hipInit(unsigned int flags) {
  if (flags != 0) return hipErrorInvalidValue;
  pthread_mutex_lock(&mu);
  hipError_t rc = atomic_load(&initialized) ? hipSuccess : setup();
  pthread_mutex_unlock(&mu);
  return rc;
}

/* Whether hipInit has run. */
static bool ready(void) { return atomic_load(&initialized); }

/* The name of a status. */
const char *hipGetErrorName(hipError_t rc) {
  static const struct {
    hipError_t rc;
    const char *name;
  } names[] = {
      {hipSuccess, "hipSuccess"},
      {hipErrorInvalidValue, "hipErrorInvalidValue"},
      {hipErrorOutOfMemory, "hipErrorOutOfMemory"},
      {hipErrorNotInitialized, "hipErrorNotInitialized"},
      {hipErrorNoDevice, "hipErrorNoDevice"},
      {hipErrorInvalidDevice, "hipErrorInvalidDevice"},
      {hipErrorInvalidHandle, "hipErrorInvalidHandle"},
      {hipErrorNotSupported, "hipErrorNotSupported"},
      {hipErrorHostMemoryAlreadyRegistered, "hipErrorHostMemoryAlreadyRegistered"},
      {hipErrorHostMemoryNotRegistered, "hipErrorHostMemoryNotRegistered"},
      {hipErrorUnknown, "hipErrorUnknown"},
  };
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (names[i].rc == rc) return names[i].name;
  return "hipErrorUnknown";
}

/* --- device memory in use, as the kernel sees it --- */

/* The memfds of the universe seen in one count, each once, and their
 * bytes per device. */
struct tally {
  ino_t *seen;
  size_t n, cap;
  uint64_t used[MAX_DEVICES];
};

/* The device and size in a memfd's path ("/memfd:fake-hip-...:D:S
 * (deleted)"), if it is memory of this universe. */
static bool ours(const char *path, int *dev, uint64_t *size) {
  static const char memfd[] = "/memfd:";
  size_t n = strlen(rt.prefix);
  if (strncmp(path, memfd, sizeof memfd - 1) || strncmp(path + sizeof memfd - 1, rt.prefix, n))
    return false;
  unsigned d;
  unsigned long long s;
  if (sscanf(path + sizeof memfd - 1 + n, "%u:%llu", &d, &s) != 2 || d >= MAX_DEVICES)
    return false;
  *dev = (int)d;
  *size = s;
  return true;
}

/* Count the memfd at path with inode ino, unless counted already. */
static void tally_add(struct tally *t, const char *path, ino_t ino) {
  int dev;
  uint64_t size;
  if (!ours(path, &dev, &size)) return;
  for (size_t i = 0; i < t->n; i++)
    if (t->seen[i] == ino) return;
  if (t->n == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 64;
    ino_t *v = realloc(t->seen, cap * sizeof *v);
    if (!v) return;
    t->seen = v;
    t->cap = cap;
  }
  t->seen[t->n++] = ino;
  t->used[dev] += size;
}

/* Count the memfds process pid holds by fd (each memfd's inode asked of
 * the kernel only where its name is the universe's). */
static void tally_fds(struct tally *t, int pid) {
  char path[64], target[PATH_MAX];
  snprintf(path, sizeof path, "/proc/%d/fd", pid);
  int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = dfd < 0 ? NULL : fdopendir(dfd);
  if (!d) {
    if (dfd >= 0) close(dfd);
    return;
  }
  for (struct dirent *e; (e = readdir(d));) {
    ssize_t n = readlinkat(dfd, e->d_name, target, sizeof target - 1);
    struct stat st;
    if (n <= 0) continue;
    target[n] = '\0';
    int dev;
    uint64_t size;
    if (ours(target, &dev, &size) && fstatat(dfd, e->d_name, &st, 0) == 0)
      tally_add(t, target, st.st_ino);
  }
  closedir(d);
}

/* Count the memfds process pid maps. */
static void tally_maps(struct tally *t, int pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/maps", pid);
  FILE *f = fopen(path, "re");
  if (!f) return;
  char *line = NULL;
  size_t cap = 0;
  while (getline(&line, &cap, f) > 0) {
    unsigned long long ino;
    int at = 0;
    if (sscanf(line, "%*x-%*x %*s %*x %*x:%*x %llu %n", &ino, &at) < 1 || !at) continue;
    line[strcspn(line, "\n")] = '\0';
    tally_add(t, line + at, (ino_t)ino);
  }
  free(line);
  fclose(f);
}

/* Device memory in use on dev, node-wide: every process's memfds of the
 * universe. */
static uint64_t used_on(int dev) {
  struct tally t = {0};
  DIR *d = opendir("/proc");
  for (struct dirent *e; d && (e = readdir(d));) {
    int pid = atoi(e->d_name);
    if (pid <= 0) continue;
    tally_fds(&t, pid);
    tally_maps(&t, pid);
  }
  if (d) closedir(d);
  free(t.seen);
  return t.used[dev];
}

/* A new sealed, committed memfd of size bytes on dev; -1 with *rc set. */
static int new_memfd(int dev, uint64_t size, hipError_t *rc) {
  char name[128];
  snprintf(name, sizeof name, "%s%d:%llu", rt.prefix, dev, (unsigned long long)size);
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    *rc = hipErrorUnknown;
    return -1;
  }
  if (ftruncate(fd, (off_t)size) < 0 || fallocate(fd, 0, 0, (off_t)size) < 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
    *rc = errno == ENOSPC || errno == ENOMEM ? hipErrorOutOfMemory : hipErrorUnknown;
    close(fd);
    return -1;
  }
  return fd;
}

/* Device memory of size bytes on dev where the device has room, checked
 * and made under the universe's lock; its memfd, or -1 with *rc set. */
static int make_memory(int dev, uint64_t size, hipError_t *rc) {
  char path[PATH_MAX + 8];
  snprintf(path, sizeof path, "%s/lock", rt.dir);
  int lock = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  if (lock < 0 || flock(lock, LOCK_EX) < 0) {
    if (lock >= 0) close(lock);
    *rc = hipErrorUnknown;
    return -1;
  }
  int fd = -1;
  uint64_t used = used_on(dev);
  if (used > rt.device_bytes || size > rt.device_bytes - used)
    *rc = hipErrorOutOfMemory;
  else
    fd = new_memfd(dev, size, rc);
  close(lock);
  return fd;
}

/* The device and size of an fd, if it is a memfd of the universe. */
static bool memfd_of(int fd, int *dev, uint64_t *size) {
  char path[64], target[PATH_MAX];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  ssize_t n = fd < 0 ? -1 : readlink(path, target, sizeof target - 1);
  struct stat st;
  if (n <= 0) return false;
  target[n] = '\0';
  return ours(target, dev, size) && fstat(fd, &st) == 0 && (uint64_t)st.st_size == *size;
}

/* --- this process's regions, handles and streams (under mu) --- */

/* Remember a region; false when out of memory. */
static bool add_region(enum kind kind, uintptr_t va, uint64_t size, int dev, int fd) {
  struct region *r = calloc(1, sizeof *r);
  if (!r) return false;
  *r = (struct region){.next = regions, .kind = kind, .va = va, .size = size, .dev = dev, .fd = fd};
  regions = r;
  return true;
}

/* The region of a kind that starts at va, or NULL. */
static struct region *region_at(enum kind kind, uintptr_t va) {
  for (struct region *r = regions; r; r = r->next)
    if (r->kind == kind && r->va == va) return r;
  return NULL;
}

/* Forget a region. */
static void drop_region(struct region *gone) {
  for (struct region **p = &regions; *p; p = &(*p)->next)
    if (*p == gone) {
      *p = gone->next;
      free(gone);
      return;
    }
}

/* Whether [p, p + n) lies within a region. */
static bool inside(const struct region *r, uintptr_t p, uint64_t n) {
  return p >= r->va && n <= r->size && p - r->va <= r->size - n;
}

/* Whether a region shares a byte with [p, p + n). */
static bool overlaps(const struct region *r, uintptr_t p, uint64_t n) {
  return p < r->va + r->size && r->va < p + n;
}

/* The first region of a kind sharing a byte with [p, p + n), or NULL. */
static struct region *overlapping(enum kind kind, uintptr_t p, uint64_t n) {
  for (struct region *r = regions; r; r = r->next)
    if (r->kind == kind && overlaps(r, p, n)) return r;
  return NULL;
}

/* Whether a region is device memory this process may read and write. */
static bool device_usable(const struct region *r) {
  return (r->kind == MAPPED && r->access) || r->kind == DEVICE_MALLOC || r->kind == IPC_OPENED;
}

/* Whether [p, p + n) is usable device memory end to end (one region or
 * several that follow each other). */
static bool device_range(uintptr_t p, uint64_t n) {
  if (!p || p + n < p) return false;
  while (n > 0) {
    const struct region *r = regions;
    while (r && !(device_usable(r) && p >= r->va && p < r->va + r->size)) r = r->next;
    if (!r) return false;
    uint64_t step = r->va + r->size - p < n ? r->va + r->size - p : n;
    p += step;
    n -= step;
  }
  return true;
}

/* Whether [p, p + n) is host memory: no device range shares a byte. */
static bool host_range(uintptr_t p, uint64_t n) {
  if (!p || p + n < p) return false;
  for (const struct region *r = regions; r; r = r->next)
    if ((r->kind == RESERVED || r->kind == DEVICE_MALLOC || r->kind == IPC_OPENED) &&
        overlaps(r, p, n))
      return false;
  return true;
}

/* Whether [p, p + n) is host memory for an asynchronous copy: pageable,
 * or within one pinned range (one across two registrations, or partly
 * pinned, is not pinned memory to the driver). */
static bool async_host_range(uintptr_t p, uint64_t n) {
  bool pinned = false, in_one = false;
  for (const struct region *r = regions; r; r = r->next) {
    if (r->kind != HOST_MALLOC && r->kind != HOST_REGISTERED) continue;
    pinned |= overlaps(r, p, n);
    in_one |= inside(r, p, n);
  }
  return host_range(p, n) && (in_one || !pinned);
}

/* The handle h if this process has it, or NULL (h is never read first). */
static struct ihipMemGenericAllocationHandle *handle_of(hipMemGenericAllocationHandle_t h) {
  for (struct ihipMemGenericAllocationHandle *k = handles; k; k = k->next)
    if (k == h) return k;
  return NULL;
}

/* A handle over fd (taken), remembered; hipErrorOutOfMemory without room. */
static hipError_t new_handle(int fd, int dev, uint64_t size, bool imported,
                             hipMemGenericAllocationHandle_t *out) {
  struct ihipMemGenericAllocationHandle *h = calloc(1, sizeof *h);
  if (!h) {
    close(fd);
    return hipErrorOutOfMemory;
  }
  *h = (struct ihipMemGenericAllocationHandle){.fd = fd, .dev = dev, .size = size,
                                               .imported = imported};
  pthread_mutex_lock(&mu);
  h->next = handles;
  handles = h;
  pthread_mutex_unlock(&mu);
  *out = h;
  return hipSuccess;
}

/* Whether a stream is the null stream or one of this process's. */
static bool stream_ok(hipStream_t s) {
  for (struct ihipStream_t *k = streams; k && s; k = k->next)
    if (k == s) return true;
  return !s;
}

/* --- devices --- */

/* Number of devices. */
hipError_t hipGetDeviceCount(int *count) {
  if (!ready()) return hipErrorNotInitialized;
  if (!count) return hipErrorInvalidValue;
  *count = rt.ndev;
  return hipSuccess;
}

/* Choose the thread's device. */
hipError_t hipSetDevice(int dev) {
  if (!ready()) return hipErrorNotInitialized;
  if (dev < 0 || dev >= rt.ndev) return hipErrorInvalidDevice;
  current = dev;
  return hipSuccess;
}

/* The thread's device. */
hipError_t hipGetDevice(int *dev) {
  if (!ready()) return hipErrorNotInitialized;
  if (!dev) return hipErrorInvalidValue;
  *dev = current;
  return hipSuccess;
}

/* A device's PCI bus id, "0000:BB:00.0". */
hipError_t hipDeviceGetPCIBusId(char *bus, int len, int dev) {
  if (!ready()) return hipErrorNotInitialized;
  if (dev < 0 || dev >= rt.ndev) return hipErrorInvalidDevice;
  if (!bus || len < 13) return hipErrorInvalidValue;
  snprintf(bus, (size_t)len, "0000:%02x:00.0", FIRST_BUS + dev);
  return hipSuccess;
}

/* The device of a PCI bus id as hipDeviceGetPCIBusId writes it. */
hipError_t hipDeviceGetByPCIBusId(int *dev, const char *bus) {
  if (!ready()) return hipErrorNotInitialized;
  unsigned dom, b, d, f;
  int end = 0;
  if (!dev || !bus || sscanf(bus, "%4x:%2x:%2x.%1x%n", &dom, &b, &d, &f, &end) != 4 ||
      bus[end] || strlen(bus) != 12)
    return hipErrorInvalidValue;
  if (dom || d || f || b < FIRST_BUS || b >= FIRST_BUS + (unsigned)rt.ndev)
    return hipErrorInvalidDevice;
  *dev = (int)(b - FIRST_BUS);
  return hipSuccess;
}

/* Wait for the device: nothing is ever in flight. */
hipError_t hipDeviceSynchronize(void) { return ready() ? hipSuccess : hipErrorNotInitialized; }

/* Free and total bytes of the thread's device, node-wide. */
hipError_t hipMemGetInfo(size_t *free_bytes, size_t *total) {
  if (!ready()) return hipErrorNotInitialized;
  if (!free_bytes || !total) return hipErrorInvalidValue;
  uint64_t used = used_on(current);
  *total = rt.device_bytes;
  *free_bytes = used < rt.device_bytes ? rt.device_bytes - used : 0;
  return hipSuccess;
}

/* --- physical allocations --- */

/* The device of the properties the backend creates chunks with (pinned,
 * POSIX fd, on a device), or -1 for any others. */
static int prop_device(const hipMemAllocationProp *p) {
  if (!p || p->type != hipMemAllocationTypePinned ||
      HANDLE_TYPES(p) != hipMemHandleTypePosixFileDescriptor ||
      p->location.type != hipMemLocationTypeDevice || p->location.id < 0 ||
      p->location.id >= rt.ndev || p->win32HandleMetaData)
    return -1;
  return p->location.id;
}

/* The granularity of such allocations, minimum and recommended alike. */
hipError_t hipMemGetAllocationGranularity(size_t *granularity, const hipMemAllocationProp *prop,
                                          hipMemAllocationGranularity_flags option) {
  if (!ready()) return hipErrorNotInitialized;
  if (!granularity || prop_device(prop) < 0 ||
      (option != hipMemAllocationGranularityMinimum &&
       option != hipMemAllocationGranularityRecommended))
    return hipErrorInvalidValue;
  *granularity = GRANULARITY;
  return hipSuccess;
}

/* A physical allocation: a memfd where the device has room. */
hipError_t hipMemCreate(hipMemGenericAllocationHandle_t *handle, size_t size,
                        const hipMemAllocationProp *prop, unsigned long long flags) {
  if (!ready()) return hipErrorNotInitialized;
  int dev = prop_device(prop);
  if (!handle || dev < 0 || flags || !size || size % GRANULARITY) return hipErrorInvalidValue;
  hipError_t rc;
  int fd = make_memory(dev, size, &rc);
  return fd < 0 ? rc : new_handle(fd, dev, size, false, handle);
}

/* Let go of a handle; mappings keep the memory until they go. */
hipError_t hipMemRelease(hipMemGenericAllocationHandle_t handle) {
  if (!ready()) return hipErrorNotInitialized;
  pthread_mutex_lock(&mu);
  struct ihipMemGenericAllocationHandle **p = &handles;
  while (*p && *p != handle) p = &(*p)->next;
  struct ihipMemGenericAllocationHandle *h = *p;
  if (h) *p = h->next;
  pthread_mutex_unlock(&mu);
  if (!h) return hipErrorInvalidValue;
  close(h->fd);
  free(h);
  return hipSuccess;
}

/* A created allocation as a new POSIX fd (into the int at out). */
hipError_t hipMemExportToShareableHandle(void *out, hipMemGenericAllocationHandle_t handle,
                                         hipMemAllocationHandleType type,
                                         unsigned long long flags) {
  if (!ready()) return hipErrorNotInitialized;
  if (!out || type != hipMemHandleTypePosixFileDescriptor || flags) return hipErrorInvalidValue;
  pthread_mutex_lock(&mu);
  struct ihipMemGenericAllocationHandle *h = handle_of(handle);
  hipError_t rc = hipSuccess;
  int fd = -1;
  if (!h)
    rc = hipErrorInvalidValue;
  else if (h->imported)
    rc = hipErrorNotSupported;
  else if ((fd = fcntl(h->fd, F_DUPFD_CLOEXEC, 0)) < 0)
    rc = hipErrorUnknown;
  pthread_mutex_unlock(&mu);
  if (rc == hipSuccess) *(int *)out = fd;
  return rc;
}

/* A handle over an exported fd, which stays the caller's (a pointer to
 * it before HIP 7.1, the fd itself from 7.1). */
hipError_t hipMemImportFromShareableHandle(hipMemGenericAllocationHandle_t *handle, void *os,
                                           hipMemAllocationHandleType type) {
  if (!ready()) return hipErrorNotInitialized;
  if (!handle || type != hipMemHandleTypePosixFileDescriptor) return hipErrorInvalidValue;
#if HIP_VERSION_MAJOR > 7 || (HIP_VERSION_MAJOR == 7 && HIP_VERSION_MINOR >= 1)
  intptr_t given = (intptr_t)os;
  int fd = given >= 0 && given <= INT_MAX ? (int)given : -1;
#else
  int fd = os ? *(const int *)os : -1;
#endif
  int dev;
  uint64_t size;
  if (!memfd_of(fd, &dev, &size)) return hipErrorInvalidValue;
  int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  return mine < 0 ? hipErrorUnknown : new_handle(mine, dev, size, true, handle);
}

/* The properties of a handle's allocation. */
hipError_t hipMemGetAllocationPropertiesFromHandle(hipMemAllocationProp *prop,
                                                   hipMemGenericAllocationHandle_t handle) {
  if (!ready()) return hipErrorNotInitialized;
  if (!prop) return hipErrorInvalidValue;
  pthread_mutex_lock(&mu);
  struct ihipMemGenericAllocationHandle *h = handle_of(handle);
  if (h) {
    memset(prop, 0, sizeof *prop);
    prop->type = hipMemAllocationTypePinned;
    HANDLE_TYPES(prop) = hipMemHandleTypePosixFileDescriptor;
    prop->location.type = hipMemLocationTypeDevice;
    prop->location.id = h->dev;
  }
  pthread_mutex_unlock(&mu);
  return h ? hipSuccess : hipErrorInvalidValue;
}

/* --- address ranges and mappings --- */

/* Reserve an address range: PROT_NONE memory aligned as asked (at least
 * to the granularity). No address hint, no flags. */
hipError_t hipMemAddressReserve(void **ptr, size_t size, size_t alignment, void *addr,
                                unsigned long long flags) {
  if (!ready()) return hipErrorNotInitialized;
  size_t align = alignment > GRANULARITY ? alignment : GRANULARITY;
  if (!ptr || !size || size % GRANULARITY || addr || flags || (alignment & (alignment - 1)) ||
      size > SIZE_MAX - align)
    return hipErrorInvalidValue;
  size_t len = size + align;
  char *p = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return hipErrorOutOfMemory;
  char *at = (char *)(((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1));
  if (at > p) munmap(p, (size_t)(at - p));
  if (at + size < p + len) munmap(at + size, (size_t)(p + len - (at + size)));
  pthread_mutex_lock(&mu);
  bool kept = add_region(RESERVED, (uintptr_t)at, size, -1, -1);
  pthread_mutex_unlock(&mu);
  if (!kept) {
    munmap(at, size);
    return hipErrorOutOfMemory;
  }
  *ptr = at;
  return hipSuccess;
}

/* Free a whole reserved range, nothing mapped in it any more. */
hipError_t hipMemAddressFree(void *ptr, size_t size) {
  if (!ready()) return hipErrorNotInitialized;
  pthread_mutex_lock(&mu);
  struct region *r = region_at(RESERVED, (uintptr_t)ptr);
  bool ok = r && r->size == size && !overlapping(MAPPED, r->va, r->size);
  if (ok) {
    munmap(ptr, size);
    drop_region(r);
  }
  pthread_mutex_unlock(&mu);
  return ok ? hipSuccess : hipErrorInvalidValue;
}

/* Map an allocation (its first size bytes) at ptr, inside one reserved
 * range and over nothing mapped, with no access yet. */
hipError_t hipMemMap(void *ptr, size_t size, size_t offset, hipMemGenericAllocationHandle_t handle,
                     unsigned long long flags) {
  if (!ready()) return hipErrorNotInitialized;
  uintptr_t p = (uintptr_t)ptr;
  if (offset || flags || !size || size % GRANULARITY || p % GRANULARITY)
    return hipErrorInvalidValue;
  pthread_mutex_lock(&mu);
  struct ihipMemGenericAllocationHandle *h = handle_of(handle);
  struct region *in = regions;
  while (in && !(in->kind == RESERVED && inside(in, p, size))) in = in->next;
  hipError_t rc = h && size <= h->size && in && !overlapping(MAPPED, p, size)
                      ? hipSuccess
                      : hipErrorInvalidValue;
  if (rc == hipSuccess &&
      mmap(ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, 0) == MAP_FAILED)
    rc = hipErrorOutOfMemory;
  if (rc == hipSuccess && !add_region(MAPPED, p, size, h->dev, -1)) {
    mmap(ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    rc = hipErrorOutOfMemory;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

/* The mapping of dev that starts at p and ends by end, or NULL. */
static struct region *mapping_within(uintptr_t p, uintptr_t end, int dev) {
  struct region *m = region_at(MAPPED, p);
  return m && m->dev == dev && m->size <= end - p ? m : NULL;
}

/* Read-write access from the device that owns them to whole mappings
 * that follow each other from ptr for size bytes. */
hipError_t hipMemSetAccess(void *ptr, size_t size, const hipMemAccessDesc *desc, size_t count) {
  if (!ready()) return hipErrorNotInitialized;
  uintptr_t p = (uintptr_t)ptr, end = p + size;
  if (count != 1 || !desc || desc->location.type != hipMemLocationTypeDevice ||
      desc->location.id < 0 || desc->location.id >= rt.ndev ||
      desc->flags != hipMemAccessFlagsProtReadWrite || !size || end < p)
    return hipErrorInvalidValue;
  pthread_mutex_lock(&mu);
  uintptr_t at = p;
  for (struct region *m; at < end && (m = mapping_within(at, end, desc->location.id));)
    at += m->size;
  bool ok = at == end;
  for (struct region *m; ok && p < end && (m = region_at(MAPPED, p)); p += m->size) {
    ok = mprotect((void *)m->va, m->size, PROT_READ | PROT_WRITE) == 0;
    m->access = ok;
  }
  pthread_mutex_unlock(&mu);
  return ok ? hipSuccess : hipErrorInvalidValue;
}

/* Unmap one whole mapping; the range stays reserved. */
hipError_t hipMemUnmap(void *ptr, size_t size) {
  if (!ready()) return hipErrorNotInitialized;
  pthread_mutex_lock(&mu);
  struct region *m = region_at(MAPPED, (uintptr_t)ptr);
  bool ok = m && m->size == size &&
            mmap(ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                 -1, 0) != MAP_FAILED;
  if (ok) drop_region(m);
  pthread_mutex_unlock(&mu);
  return ok ? hipSuccess : hipErrorInvalidValue;
}

/* --- plain device memory and legacy IPC --- */

/* Device memory on the thread's device, mapped here (its memfd kept for
 * IPC handles); 0 bytes give NULL. */
hipError_t hipMalloc(void **ptr, size_t size) {
  if (!ready()) return hipErrorNotInitialized;
  if (!ptr) return hipErrorInvalidValue;
  *ptr = NULL;
  if (!size) return hipSuccess;
  if (size > SIZE_MAX - GRANULARITY) return hipErrorOutOfMemory;
  uint64_t len = (size + GRANULARITY - 1) / GRANULARITY * GRANULARITY;
  int dev = current;
  hipError_t rc;
  int fd = make_memory(dev, len, &rc);
  if (fd < 0) return rc;
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  pthread_mutex_lock(&mu);
  bool kept = p != MAP_FAILED && add_region(DEVICE_MALLOC, (uintptr_t)p, len, dev, fd);
  pthread_mutex_unlock(&mu);
  if (!kept) {
    if (p != MAP_FAILED) munmap(p, len);
    close(fd);
    return hipErrorOutOfMemory;
  }
  *ptr = p;
  return hipSuccess;
}

/* Free memory from hipMalloc (NULL: nothing). */
hipError_t hipFree(void *ptr) {
  if (!ready()) return hipErrorNotInitialized;
  if (!ptr) return hipSuccess;
  pthread_mutex_lock(&mu);
  struct region *r = region_at(DEVICE_MALLOC, (uintptr_t)ptr);
  if (r) {
    munmap(ptr, r->size);
    close(r->fd);
    drop_region(r);
  }
  pthread_mutex_unlock(&mu);
  return r ? hipSuccess : hipErrorInvalidValue;
}

/* A legacy IPC handle of a hipMalloc allocation (its start). */
hipError_t hipIpcGetMemHandle(hipIpcMemHandle_t *handle, void *ptr) {
  if (!ready()) return hipErrorNotInitialized;
  if (!handle) return hipErrorInvalidValue;
  pthread_mutex_lock(&mu);
  struct region *r = region_at(DEVICE_MALLOC, (uintptr_t)ptr);
  struct stat st;
  bool ok = r && fstat(r->fd, &st) == 0;
  struct ipc_handle h = {.size = ok ? r->size : 0, .ino = ok ? st.st_ino : 0,
                         .pid = (int32_t)getpid(), .fd = ok ? r->fd : -1,
                         .dev = ok ? r->dev : -1};
  pthread_mutex_unlock(&mu);
  if (!ok) return hipErrorInvalidValue;
  memcpy(h.magic, ipc_magic, sizeof h.magic);
  memset(handle, 0, sizeof *handle);
  memcpy(handle, &h, sizeof h);
  return hipSuccess;
}

/* Map another process's IPC memory here, through its /proc fd. */
hipError_t hipIpcOpenMemHandle(void **ptr, hipIpcMemHandle_t handle, unsigned int flags) {
  if (!ready()) return hipErrorNotInitialized;
  struct ipc_handle h;
  memcpy(&h, &handle, sizeof h);
  if (!ptr || flags != hipIpcMemLazyEnablePeerAccess ||
      memcmp(h.magic, ipc_magic, sizeof h.magic) || h.pid == getpid())
    return hipErrorInvalidValue;
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)h.pid, (int)h.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC), dev;
  uint64_t size;
  struct stat st;
  bool ok = fd >= 0 && memfd_of(fd, &dev, &size) && fstat(fd, &st) == 0 && st.st_ino == h.ino &&
            size == h.size && dev == h.dev;
  void *p = ok ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (fd >= 0) close(fd);
  if (p == MAP_FAILED) return hipErrorInvalidValue;
  pthread_mutex_lock(&mu);
  bool kept = add_region(IPC_OPENED, (uintptr_t)p, size, dev, -1);
  pthread_mutex_unlock(&mu);
  if (!kept) {
    munmap(p, size);
    return hipErrorOutOfMemory;
  }
  *ptr = p;
  return hipSuccess;
}

/* Unmap memory opened with hipIpcOpenMemHandle. */
hipError_t hipIpcCloseMemHandle(void *ptr) {
  if (!ready()) return hipErrorNotInitialized;
  pthread_mutex_lock(&mu);
  struct region *r = region_at(IPC_OPENED, (uintptr_t)ptr);
  if (r) {
    munmap(ptr, r->size);
    drop_region(r);
  }
  pthread_mutex_unlock(&mu);
  return r ? hipSuccess : hipErrorInvalidValue;
}

/* --- pinned host memory --- */

/* Pinned host memory (flags: portable or none); 0 bytes give NULL. */
hipError_t hipHostMalloc(void **ptr, size_t size, unsigned int flags) {
  if (!ready()) return hipErrorNotInitialized;
  if (!ptr || (flags & ~(unsigned)hipHostMallocPortable)) return hipErrorInvalidValue;
  *ptr = NULL;
  if (!size) return hipSuccess;
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return hipErrorOutOfMemory;
  pthread_mutex_lock(&mu);
  bool kept = add_region(HOST_MALLOC, (uintptr_t)p, size, -1, -1);
  pthread_mutex_unlock(&mu);
  if (!kept) {
    munmap(p, size);
    return hipErrorOutOfMemory;
  }
  *ptr = p;
  return hipSuccess;
}

/* Free memory from hipHostMalloc (NULL: nothing). */
hipError_t hipHostFree(void *ptr) {
  if (!ready()) return hipErrorNotInitialized;
  if (!ptr) return hipSuccess;
  pthread_mutex_lock(&mu);
  struct region *r = region_at(HOST_MALLOC, (uintptr_t)ptr);
  if (r) {
    munmap(ptr, r->size);
    drop_region(r);
  }
  pthread_mutex_unlock(&mu);
  return r ? hipSuccess : hipErrorInvalidValue;
}

/* Pin host memory (flags: portable or none), none of it pinned already. */
hipError_t hipHostRegister(void *ptr, size_t size, unsigned int flags) {
  if (!ready()) return hipErrorNotInitialized;
  uintptr_t p = (uintptr_t)ptr;
  if (!size || (flags & ~(unsigned)hipHostRegisterPortable)) return hipErrorInvalidValue;
  pthread_mutex_lock(&mu);
  hipError_t rc = hipSuccess;
  if (!host_range(p, size))
    rc = hipErrorInvalidValue;
  else if (overlapping(HOST_MALLOC, p, size) || overlapping(HOST_REGISTERED, p, size))
    rc = hipErrorHostMemoryAlreadyRegistered;
  else if (!add_region(HOST_REGISTERED, p, size, -1, -1))
    rc = hipErrorOutOfMemory;
  pthread_mutex_unlock(&mu);
  return rc;
}

/* Unpin a range pinned by hipHostRegister, by its start. */
hipError_t hipHostUnregister(void *ptr) {
  if (!ready()) return hipErrorNotInitialized;
  pthread_mutex_lock(&mu);
  struct region *r = region_at(HOST_REGISTERED, (uintptr_t)ptr);
  if (r) drop_region(r);
  pthread_mutex_unlock(&mu);
  return r ? hipSuccess : hipErrorHostMemoryNotRegistered;
}

/* --- streams and copies --- */

/* A stream (flags: default or non-blocking). */
hipError_t hipStreamCreateWithFlags(hipStream_t *stream, unsigned int flags) {
  if (!ready()) return hipErrorNotInitialized;
  if (!stream || (flags != hipStreamDefault && flags != hipStreamNonBlocking))
    return hipErrorInvalidValue;
  struct ihipStream_t *s = calloc(1, sizeof *s);
  if (!s) return hipErrorOutOfMemory;
  pthread_mutex_lock(&mu);
  s->next = streams;
  streams = s;
  pthread_mutex_unlock(&mu);
  *stream = s;
  return hipSuccess;
}

/* Destroy a stream of this process. */
hipError_t hipStreamDestroy(hipStream_t stream) {
  if (!ready()) return hipErrorNotInitialized;
  pthread_mutex_lock(&mu);
  struct ihipStream_t **p = &streams;
  while (*p && *p != stream) p = &(*p)->next;
  struct ihipStream_t *s = *p;
  if (s) *p = s->next;
  pthread_mutex_unlock(&mu);
  free(s);
  return s ? hipSuccess : hipErrorInvalidHandle;
}

/* Wait for a stream: its copies are done already. */
hipError_t hipStreamSynchronize(hipStream_t stream) {
  if (!ready()) return hipErrorNotInitialized;
  pthread_mutex_lock(&mu);
  bool ok = stream_ok(stream);
  pthread_mutex_unlock(&mu);
  return ok ? hipSuccess : hipErrorInvalidHandle;
}

/* Copy n bytes under the lock, so that no unmap pulls either side away
 * meanwhile, where dst and src are what the copy says they are (device:
 * usable device memory; host: host memory, for an asynchronous copy
 * pageable or in one pinned range) and the stream is known. */
static hipError_t copy(void *dst, bool dst_device, const void *src, bool src_device, size_t n,
                       bool async, hipStream_t stream) {
  if (!ready()) return hipErrorNotInitialized;
  uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
  pthread_mutex_lock(&mu);
  bool ok = (!async || stream_ok(stream)) &&
            (dst_device ? device_range(d, n) : async ? async_host_range(d, n) : host_range(d, n)) &&
            (src_device ? device_range(s, n) : async ? async_host_range(s, n) : host_range(s, n));
  if (ok && n) memcpy(dst, src, n);
  pthread_mutex_unlock(&mu);
  return ok ? hipSuccess : hipErrorInvalidValue;
}

/* Copy device memory to host memory (done before it returns). */
hipError_t hipMemcpyDtoHAsync(void *dst, hipDeviceptr_t src, size_t n, hipStream_t stream) {
  return copy(dst, false, src, true, n, true, stream);
}

/* Copy host memory to device memory (done before it returns). */
hipError_t hipMemcpyHtoDAsync(hipDeviceptr_t dst, void *src, size_t n, hipStream_t stream) {
  return copy(dst, true, src, false, n, true, stream);
}

/* Copy device memory to host memory. */
hipError_t hipMemcpyDtoH(void *dst, hipDeviceptr_t src, size_t n) {
  return copy(dst, false, src, true, n, false, NULL);
}

/* Copy host memory to device memory. */
hipError_t hipMemcpyHtoD(hipDeviceptr_t dst, void *src, size_t n) {
  return copy(dst, true, src, false, n, false, NULL);
}

/* Copy device memory to device memory. */
hipError_t hipMemcpyDtoD(hipDeviceptr_t dst, hipDeviceptr_t src, size_t n) {
  return copy(dst, true, src, true, n, false, NULL);
}

/* Set count 32-bit words of device memory. */
hipError_t hipMemsetD32(hipDeviceptr_t dst, int value, size_t count) {
  if (!ready()) return hipErrorNotInitialized;
  uintptr_t d = (uintptr_t)dst;
  if (d % 4 || count > SIZE_MAX / 4) return hipErrorInvalidValue;
  pthread_mutex_lock(&mu);
  bool ok = device_range(d, count * 4);
  for (size_t i = 0; ok && i < count; i++) ((int32_t *)dst)[i] = value;
  pthread_mutex_unlock(&mu);
  return ok ? hipSuccess : hipErrorInvalidValue;
}
