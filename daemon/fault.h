/* The error a request ends with: a protocol code, words, and the figures
 * some codes carry. */
#ifndef GPUMEMD_FAULT_H
#define GPUMEMD_FAULT_H

#include <stdint.h>

#include "common/wire.h"

struct fault {
  wire_code code;
  char text[256];
  uint64_t bytes_needed, bytes_free; /* OUT_OF_MEMORY */
  unsigned device;                   /* OUT_OF_MEMORY at a resume: the device short */
};

/* Fill a fault and return its code. */
wire_code fault_set(struct fault *f, wire_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Fill err with f's code, words and figures; the words are copied into
 * text (sizeof f->text bytes) and made valid UTF-8 there. */
void fault_to_wire(const struct fault *f, char *text, Gpumem__Wire__Error *err);

#endif
