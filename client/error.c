/* Error codes and words. */
#include <stdarg.h>
#include <stdio.h>

#include "client.h"

static _Thread_local char last_error[320];

/* Record words for this thread's last failure and return err. */
int client_fail(int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return err;
}

/* The words for the calling thread's last failure. */
const char *gpumem_last_error(void) { return last_error; }

/* Daemon codes 1..12 map onto -1..-12; the later ones onto -17 and on,
 * after the library's own. */
int client_code(wire_code code) {
  if (code >= 1 && code <= 12) return -(int)code;
  if (code >= 13 && code <= 15) return -(int)code - 4;
  return GPUMEM_E_PROTOCOL;
}

/* A short description of an error code. */
const char *gpumem_strerror(int err) {
  switch (err) {
  case GPUMEM_OK: return "success";
  case GPUMEM_E_INVALID: return "invalid argument";
  case GPUMEM_E_PROTOCOL: return "protocol error";
  case GPUMEM_E_VERSION: return "protocol version mismatch";
  case GPUMEM_E_PERMISSION: return "permission denied";
  case GPUMEM_E_NOT_FOUND: return "no such buffer, tag or session";
  case GPUMEM_E_OUT_OF_MEMORY: return "out of device memory";
  case GPUMEM_E_TAG_PAUSED: return "tag is paused";
  case GPUMEM_E_CLIENT_TIMEOUT: return "workers did not answer in time";
  case GPUMEM_E_LIMIT: return "limit exceeded";
  case GPUMEM_E_WRONG_STATE: return "buffer is being paused or resumed";
  case GPUMEM_E_BACKEND: return "GPU backend error";
  case GPUMEM_E_INTERNAL: return "daemon internal error";
  case GPUMEM_E_CONNECT: return "cannot connect to gpumemd";
  case GPUMEM_E_DISCONNECTED: return "disconnected from gpumemd";
  case GPUMEM_E_NOMEM: return "out of memory";
  case GPUMEM_E_MAP: return "mapping memory failed";
  case GPUMEM_E_NOT_RELEASED: return "memory was not released";
  case GPUMEM_E_RESIDUAL: return "memory held outside gpumemd above the limit";
  case GPUMEM_E_SHUTTING_DOWN: return "gpumemd is shutting down";
  case GPUMEM_E_TIMEOUT: return "gpumemd did not answer in time";
  default: return "unknown error";
  }
}

/* The daemon's name of an error code; the library's own codes have names
 * in the same style. */
const char *gpumem_error_name(int err) {
  if (err == 0) return "OK";
  if ((err <= -1 && err >= -12) || (err <= -17 && err >= -19)) {
    wire_code code = (wire_code)(err >= -12 ? -err : -err - 4);
    return wire_code_name(code);
  }
  switch (err) {
  case GPUMEM_E_CONNECT: return "CONNECT";
  case GPUMEM_E_DISCONNECTED: return "DISCONNECTED";
  case GPUMEM_E_NOMEM: return "NOMEM";
  case GPUMEM_E_MAP: return "MAP";
  case GPUMEM_E_TIMEOUT: return "TIMEOUT";
  default: return "UNKNOWN";
  }
}

/* The name of a state. */
const char *gpumem_state_name(int state) { return wire_state_name(state); }
