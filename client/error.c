/* Error codes and words. */
#include <stdarg.h>
#include <stdio.h>

#include "error.h"
#include "gpumem.h"

static _Thread_local char last_error[320];

/* Record words for this thread's last failure and return err. */
int error_set(int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return err;
}

/* The words for the calling thread's last failure. */
const char *gpumem_last_error(void) { return last_error; }

/* Every error of the library, once: its GPUMEM_E_* code (gpumem.h), the
 * daemon's code it stands for (0: one of the library's own, which then
 * has a name of its own in the daemon's style), and its words. The wire
 * mapping, gpumem_strerror and gpumem_error_name all read this table;
 * tests/python checks it against the header and the Python package. */
struct client_error {
  int code;
  wire_code wire;       /* 0: one of the library's own */
  const char *own_name; /* the name of one of the library's own */
  const char *words;
};

#define W(name) GPUMEM__WIRE__ERROR_CODE__##name
static const struct client_error errors[] = {
    {GPUMEM_E_INVALID, W(INVALID_ARGUMENT), NULL, "invalid argument"},
    {GPUMEM_E_PROTOCOL, W(PROTOCOL_ERROR), NULL, "protocol error"},
    {GPUMEM_E_VERSION, W(VERSION_MISMATCH), NULL, "protocol version mismatch"},
    {GPUMEM_E_PERMISSION, W(PERMISSION_DENIED), NULL, "permission denied"},
    {GPUMEM_E_NOT_FOUND, W(NOT_FOUND), NULL, "no such buffer, tag or session"},
    {GPUMEM_E_OUT_OF_MEMORY, W(OUT_OF_MEMORY), NULL, "out of device memory"},
    {GPUMEM_E_TAG_PAUSED, W(TAG_PAUSED), NULL, "tag is paused"},
    {GPUMEM_E_CLIENT_TIMEOUT, W(CLIENT_TIMEOUT), NULL, "workers did not answer in time"},
    {GPUMEM_E_LIMIT, W(LIMIT_EXCEEDED), NULL, "limit exceeded"},
    {GPUMEM_E_WRONG_STATE, W(WRONG_STATE), NULL, "buffer is being paused or resumed"},
    {GPUMEM_E_BACKEND, W(BACKEND_ERROR), NULL, "GPU backend error"},
    {GPUMEM_E_INTERNAL, W(INTERNAL), NULL, "daemon internal error"},
    {GPUMEM_E_CONNECT, 0, "CONNECT", "cannot connect to gpumemd"},
    {GPUMEM_E_DISCONNECTED, 0, "DISCONNECTED", "disconnected from gpumemd"},
    {GPUMEM_E_NOMEM, 0, "NOMEM", "out of memory"},
    {GPUMEM_E_MAP, 0, "MAP", "mapping memory failed"},
    {GPUMEM_E_NOT_RELEASED, W(NOT_RELEASED), NULL, "memory was not released"},
    {GPUMEM_E_RESIDUAL, W(RESIDUAL_EXCEEDED), NULL,
     "memory held outside gpumemd above the limit"},
    {GPUMEM_E_SHUTTING_DOWN, W(SHUTTING_DOWN), NULL, "gpumemd is shutting down"},
    {GPUMEM_E_TIMEOUT, 0, "TIMEOUT", "gpumemd did not answer in time"},
    {GPUMEM_E_RELEASE_REFUSED, W(RELEASE_REFUSED), NULL, "context release refused"},
};
#undef W

/* The table's entry for a GPUMEM_E_* code; NULL for none. */
static const struct client_error *error_of(int err) {
  for (size_t i = 0; i < sizeof errors / sizeof errors[0]; i++)
    if (errors[i].code == err) return &errors[i];
  return NULL;
}

/* The library's code for a code the daemon sent; PROTOCOL for one it
 * does not know (a newer daemon's). */
int error_from_wire(wire_code code) {
  for (size_t i = 0; code && i < sizeof errors / sizeof errors[0]; i++)
    if (errors[i].wire == code) return errors[i].code;
  return GPUMEM_E_PROTOCOL;
}

/* A short description of an error code. */
const char *gpumem_strerror(int err) {
  const struct client_error *e = error_of(err);
  return err == GPUMEM_OK ? "success" : e ? e->words : "unknown error";
}

/* The daemon's name of an error code; the library's own codes have names
 * in the same style. */
const char *gpumem_error_name(int err) {
  const struct client_error *e = error_of(err);
  if (err == GPUMEM_OK) return "OK";
  if (!e) return "UNKNOWN";
  return e->wire ? wire_code_name(e->wire) : e->own_name;
}

/* The name of a state. */
const char *gpumem_state_name(int state) { return wire_state_name(state); }
