/* What the daemon said when the session began (its HelloReply): its
 * backend, opened here for mapping with the first greeting, the
 * allocation granularity, its protocol minor, and its devices in this
 * process's numbering. A restarted daemon's greeting replaces it. */
#ifndef GPUMEM_CLIENT_HELLO_H
#define GPUMEM_CLIENT_HELLO_H

#include <stdbool.h>
#include <stdint.h>

#include "common/wire.h"
#include "gpu/gpuva.h"

typedef struct hello hello;

/* Make an empty greeting; with maps_nothing (GPUMEM_CONNECT_NODE_DEVICES)
 * no backend is ever opened and devices keep the daemon's numbers. NULL
 * when out of memory. */
hello *hello_create(bool maps_nothing);

/* Free a greeting and close its backend. */
void hello_destroy(hello *h);

/* Whether a connection of role with GPUMEM_CONNECT_* flags copies its
 * BACKUP buffers itself (keep: and keeps their backup memory mapped
 * between pauses, which a process whose context may be released must
 * not: the driver cannot restore one that imports host-NUMA memory). */
bool hello_copies_backups(int role, unsigned flags, bool *keep);

/* Fill a Hello for a session of role with GPUMEM_CONNECT_* flags under
 * name (borrowed): its opt-in to context release, and whether it copies
 * (and keeps) its backups (protocol 1.7). */
void hello_request(Gpumem__Wire__Hello *msg, int role, const char *name, unsigned flags);

/* Take a HelloReply: the first opens the backend it names; a later one
 * must name the same backend when buffers are mapped here. Returns 0 or
 * a code (error_set's words). */
int hello_apply(hello *h, const Gpumem__Wire__HelloReply *r, bool first);

/* The backend that maps memory here, or NULL (none yet, or none wanted). */
gpuva *hello_gpu(hello *h);

/* The daemon's protocol minor version. */
unsigned hello_minor(hello *h);

/* Copy the daemon -> this process device map (-1: not visible) into
 * map[GPUMEM_MAX_DEVICES]; returns how many devices this process sees. */
unsigned hello_local_map(hello *h, int *map);

/* This process's number of the daemon's device node in map, or -1. */
int hello_local_device(const int *map, uint32_t node);

/* The daemon's number of this process's device local in map, or -1. */
int hello_node_device(const int *map, int local);

#endif
