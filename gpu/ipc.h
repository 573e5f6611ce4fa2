/* Legacy IPC handles (plain device memory shared by a handle's bytes, not
 * by an fd): the daemon's half makes them, the client's half opens them. */
#ifndef GPUMEM_GPU_IPC_H
#define GPUMEM_GPU_IPC_H

/* Size of a legacy IPC handle in bytes (CUDA's and HIP's alike). */
#define GPU_IPC_HANDLE_SIZE 64

#endif
