/* The owner's half of a backup (client/backup_io.h). */
#include "backup_io.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "error.h"

/* Close the fds not yet closed. */
static void close_all(int *fds, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (fds[i] >= 0) {
      close(fds[i]);
      fds[i] = -1;
    }
}

/* The pieces imported, mapped end to end in a fresh range, access set:
 * each step undone in reverse on a failure. */
int backup_io_map(gpuva *g, unsigned dev, const uint64_t *sizes, size_t n, int *fds,
                  struct backup_map *m) {
  memset(m, 0, sizeof *m);
  uint64_t total = 0;
  for (size_t i = 0; i < n; i++) total += sizes[i]; /* the edge checked: no overflow */
  m->handles = calloc(n + 1, sizeof *m->handles);
  m->sizes = malloc((n + 1) * sizeof *m->sizes);
  size_t imported = 0, mapped = 0;
  int rc = 0;
  if (!m->handles || !m->sizes) rc = error_set(GPUMEM_E_NOMEM, "backup memory: out of memory");
  for (; rc == 0 && imported < n; imported++) {
    int fd = fds[imported];
    fds[imported] = -1;
    if (gpuva_import(g, dev, fd, sizes[imported], &m->handles[imported]) < 0) {
      rc = error_set(GPUMEM_E_MAP, "backup memory: import: %s", gpu_error());
      break;
    }
  }
  if (rc == 0 && gpuva_reserve(g, dev, total, &m->va) < 0) {
    m->va = NULL;
    rc = error_set(GPUMEM_E_MAP, "backup memory: reserve: %s", gpu_error());
  }
  for (uint64_t at = 0; rc == 0 && mapped < n; at += sizes[mapped++])
    if (gpuva_map(g, dev, (char *)m->va + at, sizes[mapped], m->handles[mapped]) < 0) {
      rc = error_set(GPUMEM_E_MAP, "backup memory: map: %s", gpu_error());
      break;
    }
  if (rc == 0 && gpuva_set_access(g, dev, m->va, total) < 0)
    rc = error_set(GPUMEM_E_MAP, "backup memory: access: %s", gpu_error());
  close_all(fds, n); /* those not taken on a failure */
  if (m->sizes) memcpy(m->sizes, sizes, n * sizeof *sizes);
  m->total = total;
  if (rc == 0) {
    m->n = n;
    return 0;
  }
  uint64_t at = 0;
  for (size_t i = 0; i < mapped; at += sizes[i++]) gpuva_unmap(g, dev, (char *)m->va + at, sizes[i]);
  if (m->va) gpuva_free(g, dev, m->va, total);
  for (size_t i = 0; i < imported; i++) gpuva_release(g, dev, m->handles[i]);
  free(m->handles);
  free(m->sizes);
  memset(m, 0, sizeof *m);
  return rc;
}

/* A range reserved, then each file mapped over its part of it. */
int backup_io_map_files(const uint64_t *sizes, size_t n, int *fds, struct backup_map *m) {
  memset(m, 0, sizeof *m);
  uint64_t total = 0;
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    struct stat st;
    if (fstat(fds[i], &st) < 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size < sizes[i])
      rc = error_set(GPUMEM_E_PROTOCOL,
                     "backup file %zu of %zu: not a file of its %llu bytes", i + 1, n,
                     (unsigned long long)sizes[i]);
    total += sizes[i]; /* the edge checked: no overflow */
  }
  m->sizes = malloc((n + 1) * sizeof *m->sizes);
  if (rc == 0 && !m->sizes) rc = error_set(GPUMEM_E_NOMEM, "backup files: out of memory");
  void *va = MAP_FAILED;
  if (rc == 0 && (va = mmap(NULL, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)) ==
                     MAP_FAILED)
    rc = error_set(GPUMEM_E_NOMEM, "backup files: reserving %llu bytes: %s",
                   (unsigned long long)total, strerror(errno));
  uint64_t at = 0;
  for (size_t i = 0; i < n && rc == 0; at += sizes[i++])
    if (mmap((char *)va + at, sizes[i], PROT_READ, MAP_SHARED | MAP_FIXED, fds[i], 0) ==
        MAP_FAILED)
      rc = error_set(GPUMEM_E_MAP, "backup file %zu of %zu: map: %s", i + 1, n,
                     strerror(errno));
  close_all(fds, n);
  if (rc < 0) {
    if (va != MAP_FAILED) munmap(va, total);
    free(m->sizes);
    memset(m, 0, sizeof *m);
    return rc;
  }
  memcpy(m->sizes, sizes, n * sizeof *sizes);
  m->va = va;
  m->total = total;
  m->n = n;
  m->files = true;
  return 0;
}

/* Let go of every piece and the range. */
void backup_io_unmap(gpuva *g, unsigned dev, struct backup_map *m) {
  if (m->files) {
    munmap(m->va, m->total);
    free(m->sizes);
    memset(m, 0, sizeof *m);
    return;
  }
  uint64_t at = 0;
  for (size_t i = 0; i < m->n; at += m->sizes[i++])
    gpuva_unmap(g, dev, (char *)m->va + at, m->sizes[i]);
  if (m->va) gpuva_free(g, dev, m->va, m->total);
  for (size_t i = 0; i < m->n; i++) gpuva_release(g, dev, m->handles[i]);
  free(m->handles);
  free(m->sizes);
  memset(m, 0, sizeof *m);
}

/* One copy between the buffer's memory and the backup map. */
int backup_io_copy(gpuva *g, unsigned dev, void *mem, uint64_t size, uint64_t id,
                   const struct backup_map *m, bool to_backup) {
  if (!m->va || m->total < size)
    return error_set(GPUMEM_E_PROTOCOL, "backup of buffer %llu: %llu bytes of backup memory, "
                     "%llu needed", (unsigned long long)id, (unsigned long long)m->total,
                     (unsigned long long)size);
  if (m->files)
    return error_set(GPUMEM_E_PROTOCOL,
                     "backup of buffer %llu: the backup kept here is a file read while paused, "
                     "not memory to copy through", (unsigned long long)id);
  if ((to_backup ? gpuva_copy_device(g, dev, m->va, mem, size)
                 : gpuva_copy_device(g, dev, mem, m->va, size)) < 0)
    return error_set(GPUMEM_E_BACKEND, "%s of buffer %llu: %s", to_backup ? "backup" : "restore",
                     (unsigned long long)id, gpu_error());
  return 0;
}
