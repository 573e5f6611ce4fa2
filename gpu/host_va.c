/* The host backend's client side: a chunk is a memfd (gpu/host.h), its
 * import the fd itself, and a mapping a shared mapping of it in an
 * address range reserved as inaccessible anonymous memory, which is what
 * an unmap puts back, so that touching a paused buffer faults as on VMM. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/limits.h"
#include "error.h"
#include "gpuva_ops.h"

/* The host backend keeps nothing per process on the client side. */
static int host_open(const struct gpuva_ops *self, void **state, char *err, size_t errlen) {
  (void)self;
  (void)err;
  (void)errlen;
  *state = NULL;
  return 0;
}

/* Nothing to free. */
static void host_close(void *state) { (void)state; }

/* A client's device for the daemon's bus id "host-<node>:<d>": d. */
static int host_device_by_bus_id(void *state, const char *bus_id) {
  (void)state;
  const char *colon = strrchr(bus_id, ':');
  char *end;
  if (strncmp(bus_id, "host-", 5) != 0 || !colon || !colon[1]) return -ENODEV;
  unsigned long dev = strtoul(colon + 1, &end, 10);
  if (*end || dev >= GPUMEM_MAX_DEVICES) return -ENODEV;
  return (int)dev;
}

/* What a reserved, unmapped range is: no memory, no access. */
static const int reserve_flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;

/* An inaccessible anonymous range, backed by nothing. */
static int host_reserve(void *state, unsigned dev, uint64_t size, void **va) {
  (void)state;
  (void)dev;
  void *p = mmap(NULL, size, PROT_NONE, reserve_flags, -1, 0);
  if (p == MAP_FAILED) return gpu_fail(-errno, "reserve: %s", strerror(errno));
  *va = p;
  return 0;
}

/* Unmap the whole range. */
static void host_free(void *state, unsigned dev, void *va, uint64_t size) {
  (void)state;
  (void)dev;
  munmap(va, size);
}

/* The fd is the handle, held while mapped and closed by host_release, as
 * an imported handle holds a VMM allocation: so that it can be exported
 * again to a daemon that restarted. */
static int host_import(void *state, unsigned dev, int fd, uint64_t size, uint64_t *handle) {
  (void)state;
  (void)dev;
  struct stat st;
  /* A shorter memfd would fault (SIGBUS) where the mapping passes its end. */
  if (fstat(fd, &st) < 0 || st.st_size < 0 || (uint64_t)st.st_size < size) {
    int err = errno;
    long long have = fstat(fd, &st) == 0 ? (long long)st.st_size : -1;
    close(fd);
    return have < 0 ? gpu_fail(-err, "import: fstat: %s", strerror(err))
                    : gpu_fail(-EINVAL, "import: the memfd has %lld bytes, %llu claimed", have,
                               (unsigned long long)size);
  }
  *handle = (uint64_t)fd;
  return 0;
}

/* Map without access, as cuMemMap does; gpuva_set_access grants it. The
 * handle (fd) stays open either way: gpuva_release closes it. */
static int host_map(void *state, unsigned dev, void *va, uint64_t size, uint64_t handle) {
  (void)state;
  (void)dev;
  void *p = mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, (int)handle, 0);
  if (p == MAP_FAILED) return gpu_fail(-errno, "map: %s", strerror(errno));
  return 0;
}

/* Make a mapping readable and writable. */
static int host_set_access(void *state, unsigned dev, void *va, uint64_t size) {
  (void)state;
  (void)dev;
  if (mprotect(va, size, PROT_READ | PROT_WRITE) < 0)
    return gpu_fail(-errno, "set access: %s", strerror(errno));
  return 0;
}

/* Put an inaccessible anonymous mapping over the range: the pages of the
 * chunk are dropped from this process and touching the range faults. */
static int host_unmap(void *state, unsigned dev, void *va, uint64_t size) {
  (void)state;
  (void)dev;
  void *p = mmap(va, size, PROT_NONE, reserve_flags | MAP_FIXED, -1, 0);
  if (p == MAP_FAILED) return gpu_fail(-errno, "unmap: %s", strerror(errno));
  return 0;
}

/* Close the imported fd; the memory goes once nothing maps it either. */
static void host_release(void *state, unsigned dev, uint64_t handle) {
  (void)state;
  (void)dev;
  close((int)handle);
}

/* An imported chunk again as a new fd, for a daemon that adopts it. */
static int host_export_handle(void *state, unsigned dev, uint64_t handle, int *fd) {
  (void)state;
  (void)dev;
  int d = fcntl((int)handle, F_DUPFD_CLOEXEC, 0);
  if (d < 0) return gpu_fail(-errno, "dup: %s", strerror(errno));
  *fd = d;
  return 0;
}

/* Host memory is coherent: nothing to wait for. */
static int host_sync(void *state, unsigned dev) {
  (void)state;
  (void)dev;
  return 0;
}

/* Host memory is the device memory: a plain copy out. */
static int host_copy_from(void *state, unsigned dev, void *dst, const void *va, uint64_t len) {
  (void)state;
  (void)dev;
  memcpy(dst, va, len);
  return 0;
}

/* A plain copy in. */
static int host_copy_to(void *state, unsigned dev, void *va, const void *src, uint64_t len) {
  (void)state;
  (void)dev;
  memcpy(va, src, len);
  return 0;
}

/* Both are shared mappings here: a plain copy. */
static int host_copy_device(void *state, unsigned dev, void *dst, const void *src, uint64_t len) {
  (void)state;
  (void)dev;
  memcpy(dst, src, len);
  return 0;
}

/* A mapping here is host memory already. */
static int host_host_view(void *state, unsigned dev, void *va, uint64_t size) {
  (void)state;
  (void)dev;
  (void)va;
  (void)size;
  return 0;
}

/* Fill the mapping a word at a time. */
static int host_fill32(void *state, unsigned dev, void *va, uint64_t len, uint32_t value) {
  (void)state;
  (void)dev;
  uint32_t *p = va;
  for (uint64_t i = 0; i < len / 4; i++) p[i] = value;
  return 0;
}

const struct gpuva_ops gpuva_host_ops = {
    .name = "host",
    .open = host_open,
    .close = host_close,
    .device_by_bus_id = host_device_by_bus_id,
    .reserve = host_reserve,
    .free = host_free,
    .import = host_import,
    .map = host_map,
    .set_access = host_set_access,
    .unmap = host_unmap,
    .export_handle = host_export_handle,
    .release = host_release,
    .sync = host_sync,
    .copy_from = host_copy_from,
    .copy_to = host_copy_to,
    .copy_device = host_copy_device,
    .fill32 = host_fill32,
    .host_view = host_host_view,
};
