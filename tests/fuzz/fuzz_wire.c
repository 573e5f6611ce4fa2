/* libFuzzer: any bytes as a message from a client or from the daemon must
 * parse or be refused, and never crash or leak. */
#include <stddef.h>
#include <stdint.h>

#include "common/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char why[256];
  wire_env *env = wire_unpack(data, size);
  if (!env) return 0;
  for (size_t nfds = 0; nfds < 3; nfds++) {
    wire_check_request(env, nfds, why, sizeof why);
    wire_check_reply(env, nfds, why, sizeof why);
  }
  wire_env_free(env);
  return 0;
}
