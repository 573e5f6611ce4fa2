/* The owner's half of a backup (client/backup_io.h). */
#include "backup_io.h"

#include <stdlib.h>
#include <unistd.h>

#include "buffer.h"
#include "error.h"

/* The pieces, imported into handles, mapped at va end to end (access
 * set), copied through, and let go of: each step undone in reverse. */
int backup_io_copy(gpumem_buffer *b, const uint64_t *sizes, size_t n, int *fds, bool to_backup) {
  gpuva *g = buffer_gpu(b);
  unsigned dev = (unsigned)gpumem_buffer_device(b);
  unsigned long long id = (unsigned long long)gpumem_buffer_id(b);
  uint64_t size = gpumem_buffer_size(b), total = 0;
  for (size_t i = 0; i < n; i++) total += sizes[i]; /* the edge checked: no overflow */
  uint64_t *handles = calloc(n + 1, sizeof *handles);
  size_t imported = 0, mapped = 0;
  void *va = NULL;
  int rc = 0;
  if (!handles) {
    rc = error_set(GPUMEM_E_NOMEM, "backup of buffer %llu: out of memory", id);
  } else if (total < size) {
    rc = error_set(GPUMEM_E_PROTOCOL, "backup of buffer %llu: %llu bytes of pieces, %llu needed",
                   id, (unsigned long long)total, (unsigned long long)size);
  }
  for (; rc == 0 && imported < n; imported++) {
    int fd = fds[imported];
    fds[imported] = -1;
    if (gpuva_import(g, dev, fd, sizes[imported], &handles[imported]) < 0) break;
  }
  if (rc == 0 && imported < n)
    rc = error_set(GPUMEM_E_MAP, "backup of buffer %llu: import: %s", id, gpu_error());
  if (rc == 0 && gpuva_reserve(g, dev, total, &va) < 0)
    rc = error_set(GPUMEM_E_MAP, "backup of buffer %llu: reserve: %s", id, gpu_error());
  for (uint64_t at = 0; rc == 0 && mapped < n; at += sizes[mapped++])
    if (gpuva_map(g, dev, (char *)va + at, sizes[mapped], handles[mapped]) < 0) {
      rc = error_set(GPUMEM_E_MAP, "backup of buffer %llu: map: %s", id, gpu_error());
      break;
    }
  if (rc == 0 && gpuva_set_access(g, dev, va, total) < 0)
    rc = error_set(GPUMEM_E_MAP, "backup of buffer %llu: access: %s", id, gpu_error());
  void *mem = gpumem_buffer_ptr(b);
  if (rc == 0 && (to_backup ? gpuva_copy_device(g, dev, va, mem, size)
                            : gpuva_copy_device(g, dev, mem, va, size)) < 0)
    rc = error_set(GPUMEM_E_BACKEND, "%s of buffer %llu: %s", to_backup ? "backup" : "restore",
                   id, gpu_error());
  uint64_t off = 0;
  for (size_t i = 0; i < mapped; off += sizes[i++]) gpuva_unmap(g, dev, (char *)va + off, sizes[i]);
  if (va) gpuva_free(g, dev, va, total);
  for (size_t i = 0; i < imported; i++) gpuva_release(g, dev, handles[i]);
  for (size_t i = imported; i < n; i++)
    if (fds[i] >= 0) {
      close(fds[i]);
      fds[i] = -1;
    }
  free(handles);
  return rc;
}
