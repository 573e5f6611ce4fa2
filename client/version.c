/* The library's version. */
#include "gpumem.h"

#define STR_(x) #x
#define STR(x) STR_(x)

/* The library's version as one number. */
int gpumem_version(void) { return GPUMEM_VERSION; }

/* The library's version as text. */
const char *gpumem_version_string(void) {
  return STR(GPUMEM_VERSION_MAJOR) "." STR(GPUMEM_VERSION_MINOR) "." STR(GPUMEM_VERSION_PATCH);
}
