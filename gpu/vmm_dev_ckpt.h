/* The VMM backends' release of another process's device state
 * (vmm_ckpt.c): the table's process_release, process_restore and
 * process_released over the vendor's checkpoint calls. Internal to gpu/. */
#ifndef GPUMEM_GPU_VMM_DEV_CKPT_H
#define GPUMEM_GPU_VMM_DEV_CKPT_H

#include <stdint.h>

int vmm_process_release(void *state, int pid, uint32_t lock_ms, uint64_t *moved);
int vmm_process_restore(void *state, int pid);
int vmm_process_released(void *state, int pid);

#endif
