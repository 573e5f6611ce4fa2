/* Sub-allocation (gpumem_malloc): allocations carved out of larger daemon
 * buffers ("slabs"), one bucket of them per tag, device and BACKUP flag.
 * A slab is an ordinary buffer of its tag, so pausing the tag releases it
 * whole. */
#ifndef GPUMEM_CLIENT_POOL_H
#define GPUMEM_CLIENT_POOL_H

#include "addrmap.h"

typedef struct pool pool;

/* Make a client's pool, whose allocations go in the address map as
 * owner's; NULL when out of memory. */
pool *pool_create(struct addr_owner *owner);

/* Free a pool's bookkeeping (gpumem_disconnect, once its addresses are
 * out of the map). Slab buffers are not touched here: they are among the
 * client's buffers and go with them. */
void pool_destroy(pool *p);

#endif
