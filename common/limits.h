/* Limits that every part of gpumemd shares, each defined here once. */
#ifndef GPUMEM_LIMITS_H
#define GPUMEM_LIMITS_H

/* Devices on a node: sets of devices travel as 64-bit masks. */
#define GPUMEM_MAX_DEVICES 64

/* The longest a pause or resume waits for the buffers' owners: the daemon
 * caps a request's timeout at it (0 asks for it), and a client waits that
 * long for the answer, beyond its own request timeout. */
#define GPUMEM_OWNER_TIMEOUT_MAX_MS (10u * 60u * 1000u)

#endif
