/* The daemon's greeting, and the views of it that the API gives. Device
 * numbers differ between processes (CUDA_VISIBLE_DEVICES) and between
 * daemons: the bus id of each daemon device says which of ours it is. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"
#include "error.h"
#include "hello.h"

struct hello {
  pthread_mutex_t mu;   /* everything below but backend and gpuva */
  bool maps_nothing;
  char backend[32];     /* set by the first greeting, then unchanged */
  gpuva *gpu;             /* likewise */
  uint64_t granularity;
  unsigned minor;
  unsigned ndevices;
  int local_of[GPUMEM_MAX_DEVICES]; /* daemon device -> ours, -1 if not visible */
};

/* Make an empty greeting. */
hello *hello_create(bool maps_nothing) {
  hello *h = calloc(1, sizeof *h);
  if (!h) return NULL;
  pthread_mutex_init(&h->mu, NULL);
  h->maps_nothing = maps_nothing;
  for (size_t i = 0; i < GPUMEM_MAX_DEVICES; i++) h->local_of[i] = -1;
  return h;
}

/* Free a greeting and its backend. */
void hello_destroy(hello *h) {
  if (!h) return;
  gpuva_close(h->gpu);
  pthread_mutex_destroy(&h->mu);
  free(h);
}

/* Whether the connection copies (and keeps) its backups. */
bool hello_copies_backups(int role, unsigned flags, bool *keep) {
  bool copies = role == GPUMEM_ROLE_WORKER &&
                !(flags & (GPUMEM_CONNECT_DAEMON_COPIES | GPUMEM_CONNECT_NODE_DEVICES));
  *keep = copies && !(flags & GPUMEM_CONNECT_RELEASE_CONTEXT);
  return copies;
}

/* Fill a Hello. */
void hello_request(Gpumem__Wire__Hello *msg, int role, const char *name, unsigned flags) {
  bool keep;
  bool copies = hello_copies_backups(role, flags, &keep);
  gpumem__wire__hello__init(msg);
  msg->version_major = WIRE_VERSION_MAJOR;
  msg->version_minor = WIRE_VERSION_MINOR;
  msg->role = (Gpumem__Wire__Role)role;
  msg->name = (char *)name;
  msg->release_context = (flags & GPUMEM_CONNECT_RELEASE_CONTEXT) != 0;
  msg->copies_backups = copies;
  msg->keeps_backups = keep;
}

/* Take a HelloReply. Runs on the thread that greets (the only writer of
 * backend and gpu, which no other thread reads before the first greeting
 * is done). */
int hello_apply(hello *h, const Gpumem__Wire__HelloReply *r, bool first) {
  int rc = 0;
  if (first) {
    snprintf(h->backend, sizeof h->backend, "%s", r->backend);
    char err[256] = "";
    if (!h->maps_nothing && gpuva_open(h->backend, &h->gpu, err, sizeof err) < 0)
      rc = error_set(GPUMEM_E_BACKEND, "backend %s: %s", h->backend, err);
  } else if (h->gpu && strcmp(h->backend, r->backend) != 0) {
    rc = error_set(GPUMEM_E_BACKEND,
                   "gpumemd came back with backend %s; this process maps %s memory",
                   r->backend, h->backend);
  }
  int local_of[GPUMEM_MAX_DEVICES];
  for (size_t i = 0; i < GPUMEM_MAX_DEVICES; i++) local_of[i] = -1;
  for (size_t i = 0; rc == 0 && i < r->n_devices && i < GPUMEM_MAX_DEVICES; i++)
    local_of[i] = h->gpu ? gpuva_device_by_bus_id(h->gpu, r->devices[i]->bus_id) : (int)i;
  pthread_mutex_lock(&h->mu);
  h->granularity = r->granularity;
  h->minor = r->version_minor;
  h->ndevices = (unsigned)r->n_devices;
  memcpy(h->local_of, local_of, sizeof local_of);
  pthread_mutex_unlock(&h->mu);
  return rc;
}

/* The backend that maps memory here. */
gpuva *hello_gpu(hello *h) { return h->gpu; }

/* The daemon's protocol minor. */
unsigned hello_minor(hello *h) {
  pthread_mutex_lock(&h->mu);
  unsigned minor = h->minor;
  pthread_mutex_unlock(&h->mu);
  return minor;
}

/* Copy the device map. */
unsigned hello_local_map(hello *h, int *map) {
  unsigned seen = 0;
  pthread_mutex_lock(&h->mu);
  for (unsigned i = 0; i < GPUMEM_MAX_DEVICES; i++) {
    map[i] = i < h->ndevices ? h->local_of[i] : -1;
    if (map[i] >= 0) seen++;
  }
  pthread_mutex_unlock(&h->mu);
  return seen;
}

/* This process's number of a daemon device. */
int hello_local_device(const int *map, uint32_t node) {
  return node < GPUMEM_MAX_DEVICES ? map[node] : -1;
}

/* The daemon's number of one of this process's devices. */
int hello_node_device(const int *map, int local) {
  for (int i = 0; local >= 0 && i < GPUMEM_MAX_DEVICES; i++)
    if (map[i] == local) return i;
  return -1;
}

/* The daemon's backend. */
const char *gpumem_backend(const gpumem_client *c) { return c->hello->backend; }

/* The allocation granularity (a daemon that came back may say another). */
uint64_t gpumem_granularity(const gpumem_client *c) {
  hello *h = c->hello;
  pthread_mutex_lock(&h->mu);
  uint64_t g = h->granularity;
  pthread_mutex_unlock(&h->mu);
  return g;
}

/* The number of the daemon's devices this process sees. */
unsigned gpumem_device_count(const gpumem_client *c) {
  int map[GPUMEM_MAX_DEVICES];
  return hello_local_map(c->hello, map);
}
