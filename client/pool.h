/* Sub-allocation: gpumem_malloc carves allocations out of larger daemon
 * buffers ("slabs"), kept per tag, device and BACKUP flag. A slab is an
 * ordinary buffer of its tag, so pausing the tag releases it whole. */
#ifndef GPUMEM_CLIENT_POOL_H
#define GPUMEM_CLIENT_POOL_H

#include "gpumem.h"

struct client_pool;

/* Free a client's pool bookkeeping (gpumem_disconnect calls it). Slab
 * buffers are not touched here: they are in the client's buffer list and
 * go with the client's other buffers, before or after this call. */
void client_pool_destroy(gpumem_client *c);

#endif
