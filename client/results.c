/* The structs the library fills for its callers (reports, status,
 * lists): each starts with its size, strings are copies, arrays are
 * arrays of pointers; and the per-device figures that reports and the
 * status share. */
#include <stdlib.h>
#include <string.h>

#include "hello.h"
#include "results.h"

/* A zeroed struct of sz bytes whose first field, its size, is set. */
void *results_sized(size_t sz) {
  size_t *p = calloc(1, sz);
  if (p) *p = sz;
  return p;
}

/* A copy of a string from a reply ("" for none). */
char *results_text(const char *s) { return strdup(s ? s : ""); }

/* Free an array of n malloc'd elements and the array. */
void results_free_array(void **v, size_t n) {
  for (size_t i = 0; v && i < n; i++) free(v[i]);
  free(v);
}

/* Copy the driver's per-device figures into *out (n of them; NULL when n
 * is 0), *nout counting those made; false when out of memory. */
bool results_checks(const int *map, struct gpumem_device_check ***out, size_t *nout,
                    Gpumem__Wire__DeviceCheck *const *v, size_t n) {
  *out = NULL;
  *nout = 0;
  if (!n) return true;
  if (!(*out = calloc(n, sizeof **out))) return false;
  for (size_t i = 0; i < n; i++) {
    const Gpumem__Wire__DeviceCheck *d = v[i];
    struct gpumem_device_check *o = results_sized(sizeof *o);
    if (!o) return false;
    (*out)[(*nout)++] = o;
    o->device = hello_local_device(map, d->device);
    o->node_device = d->device;
    o->released = d->released;
    o->free_before = d->free_before;
    o->free_after = d->free_after;
    o->shortfall = d->shortfall;
    o->residual = d->residual;
    o->residual_known = d->residual_known;
    o->exit_wait_ms = d->exit_wait_ms;
    o->exit_listed = (uint32_t)d->n_exit_listed_pids;
    o->exit_listed_pid = d->n_exit_listed_pids ? d->exit_listed_pids[0] : 0;
    o->used_after = d->used_after;
  }
  return true;
}

/* Copy the per-process figures. */
bool results_processes(const int *map, struct gpumem_process_status ***out, size_t *nout,
                       Gpumem__Wire__ProcessMemory *const *v, size_t n) {
  if (!(*out = calloc(n + 1, sizeof **out))) return false;
  for (size_t i = 0; i < n; i++) {
    const Gpumem__Wire__ProcessMemory *p = v[i];
    struct gpumem_process_status *o = results_sized(sizeof *o);
    if (!o) return false;
    (*out)[(*nout)++] = o;
    o->pid = p->pid;
    o->device = hello_local_device(map, p->device);
    o->node_device = p->device;
    o->used = p->used;
    o->managed = p->managed;
    o->residual = p->residual;
    o->session_id = p->session_id;
    if (!(o->name = results_text(p->name))) return false;
  }
  return true;
}

/* Free the per-process figures and their names. */
void results_free_processes(struct gpumem_process_status **v, size_t n) {
  for (size_t i = 0; v && i < n; i++) free((char *)v[i]->name);
  results_free_array((void **)v, n);
}
