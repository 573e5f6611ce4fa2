#include "backup_verify.h"

#include <stdlib.h>
#include <xxhash.h>

#include "common/log.h"

/* Read the restored memory back and compare hashes. */
wire_code backup_verify(gpudev *g, const struct buffer *b, struct fault *f) {
  unsigned long long id = (unsigned long long)b->id;
  void *back = malloc(b->size);
  if (!back)
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__INTERNAL, "no host memory to verify buffer %llu",
                     id);
  int rc = gpudev_chunks_copy(g, b->device, b->handles, b->chunk_sizes, b->nchunks, back, true);
  uint64_t h = rc == 0 ? XXH3_64bits(back, b->size) : 0;
  free(back);
  if (rc == 0 && h == b->backup_hash) return GPUMEM__WIRE__ERROR_CODE__OK;
  if (rc < 0) { /* the read-back failed: the driver's words, not a mismatch */
    log_error("restore of buffer %llu not verified: %s", id, gpu_error());
    return fault_set(f, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
                     "restore of buffer %llu not verified: reading it back failed: %s", id,
                     gpu_error());
  }
  log_error("restore of buffer %llu does not match its backup (hash %016llx, backup %016llx)", id,
            (unsigned long long)h, (unsigned long long)b->backup_hash);
  return fault_set(f, GPUMEM__WIRE__ERROR_CODE__BACKEND_ERROR,
                   "restore of buffer %llu does not match its backup", id);
}
