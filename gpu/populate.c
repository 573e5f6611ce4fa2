/* Faulting host memory in without holding the process's mmap lock long. */
#include "populate.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>

#include "error.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* Memory is faulted in this much at a time (see gpu_populate). */
#define POPULATE_STEP (2ull << 20)

/* Fault in and write memory a step at a time. Faulting in holds the
 * process's mmap lock (for reading) throughout one call, and an mmap or
 * munmap of another thread waits for it: on an H200 host faulting in ran
 * at about 3 GB/s, so 64 MiB at once held the daemon loop's next mmap
 * (the next BACKUP buffer's range) up for 20-30 ms; 2 MiB holds it up for
 * well under a millisecond. Each step is written once too: on the
 * development VM the first write to memory just faulted in ran at 0.3-0.5
 * GB/s and the next at 15 GB/s, a cost that belongs here and not in a
 * pause. */
int gpu_populate(void *p, uint64_t len) {
  for (uint64_t off = 0; off < len; off += POPULATE_STEP) {
    uint64_t n = len - off < POPULATE_STEP ? len - off : POPULATE_STEP;
    if (madvise((char *)p + off, n, MADV_POPULATE_WRITE) < 0 && errno != EINVAL)
      /* EINVAL: before Linux 5.14; the memset faults it in */
      return gpu_fail(-ENOMEM, "backup memory of %llu bytes: %s", (unsigned long long)len,
                      strerror(errno));
    memset((char *)p + off, 0, n);
  }
  return 0;
}
