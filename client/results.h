/* Helpers for the structs the library fills for its callers (results.c). */
#ifndef GPUMEM_CLIENT_RESULTS_H
#define GPUMEM_CLIENT_RESULTS_H

#include <stdbool.h>
#include <stddef.h>

#include "common/wire.h"
#include "gpumem.h"

/* A zeroed struct of sz bytes whose first field, its size, is set; NULL
 * when out of memory. */
void *results_sized(size_t sz);

/* A copy of a string from a reply ("" for none); NULL when out of memory. */
char *results_text(const char *s);

/* Free an array of n malloc'd elements and the array. */
void results_free_array(void **v, size_t n);

/* Copy the driver's per-device figures into *out (n of them; NULL when n
 * is 0), device numbers through map (hello_local_map's), *nout counting
 * those made; false when out of memory. */
bool results_checks(const int *map, struct gpumem_device_check ***out, size_t *nout,
                    Gpumem__Wire__DeviceCheck *const *v, size_t n);

/* Copy the driver's per-process figures into *out (n of them; map turns
 * the daemon's device numbers into this process's), *nout counting those
 * made; false when out of memory. */
bool results_processes(const int *map, struct gpumem_process_status ***out, size_t *nout,
                       Gpumem__Wire__ProcessMemory *const *v, size_t n);

/* Free what results_processes made. */
void results_free_processes(struct gpumem_process_status **v, size_t n);

#endif
