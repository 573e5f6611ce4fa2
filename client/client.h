/* A client (gpumem_client): one connection to the daemon and what it
 * holds, each part its own module. */
#ifndef GPUMEM_CLIENT_CLIENT_H
#define GPUMEM_CLIENT_CLIENT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "addrmap.h"
#include "conn.h"
#include "events.h"
#include "gpumem.h"
#include "hello.h"
#include "pool.h"
#include "buffers.h"

struct gpumem_client {
  conn *conn;               /* the connection and its loop */
  hello *hello;             /* what the daemon said, and the backend */
  buffers *buffers;        /* every buffer, and those the daemon knows by id */
  events *events;           /* the daemon's events and the hooks */
  pool *pool;               /* gpumem_malloc's sub-allocations */
  struct addr_owner addrs;  /* its addresses in the process's address map */
  bool threaded;            /* a background thread drives the connection */
  _Atomic uint64_t keep_free; /* bytes each allocation leaves free (gpumem_set_keep_free) */
  pthread_t thread;
};

#endif
