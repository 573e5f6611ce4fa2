/* What went wrong in the GPU layer, in words: a call that fails records
 * it for its thread, and the caller reads it for its own message. Every
 * backend of both halves records through here. */
#ifndef GPUMEM_GPU_ERROR_H
#define GPUMEM_GPU_ERROR_H

/* Record what went wrong on this thread (for gpu_error) and return err. */
int gpu_fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* What the backend last reported on this thread, in words. */
const char *gpu_error(void);

#endif
