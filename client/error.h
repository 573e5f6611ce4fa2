/* The library's errors: the words of each thread's last failure, and the
 * one table that maps the daemon's codes to GPUMEM_E_* codes (error.c). */
#ifndef GPUMEM_CLIENT_ERROR_H
#define GPUMEM_CLIENT_ERROR_H

#include "common/wire.h"

/* Record words for the calling thread's last failure and return err. */
int error_set(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The library's code for a code the daemon sent (GPUMEM_E_PROTOCOL for
 * one this library does not know). */
int error_from_wire(wire_code code);

#endif
