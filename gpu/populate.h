/* Host memory made ready before it is needed: faulted in and written once,
 * a small step at a time. The daemon's half makes its backup memory so. */
#ifndef GPUMEM_GPU_POPULATE_H
#define GPUMEM_GPU_POPULATE_H

#include <stdint.h>

/* Fault in len bytes of private anonymous memory at p and write them once,
 * a small step at a time (never long under the process's mmap lock). 0,
 * or a negative errno with words through gpu_fail. */
int gpu_populate(void *p, uint64_t len);

#endif
