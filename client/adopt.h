/* Re-registration: after the daemon restarted, every buffer this client
 * holds is handed to the new one (mapped ones with their memory, as fds;
 * paused ones stay paused) in as many AdoptRequests as the limits on fds
 * and frame size need, and takes the new daemon's ids. */
#ifndef GPUMEM_CLIENT_ADOPT_H
#define GPUMEM_CLIENT_ADOPT_H

#include <stddef.h>

#include "common/wire.h"
#include "hello.h"
#include "buffers.h"

typedef struct adopt adopt;

/* Plan the re-registration of r's buffers with the daemon of greeting h:
 * export the mapped ones' chunks and group them into requests; what
 * cannot be re-registered is counted as skipped, the first one's words
 * kept. NULL when out of memory. */
adopt *adopt_create(buffers *r, hello *h);

/* Free a plan, closing fds that were not taken. */
void adopt_destroy(adopt *a);

/* The number of requests. */
size_t adopt_count(const adopt *a);

/* Request i, for the caller to number and send, and its fds (taken: the
 * plan does not close them). */
wire_env *adopt_request(adopt *a, size_t i, int **fds, size_t *nfds);

/* Take the daemon's answer to request i: an AdoptReply gives its buffers
 * their new ids in r (-EPROTO when it does not fit them: the connection
 * is wrong), an Error or NULL (why: the words) leaves them unregistered.
 * Returns 0 or -EPROTO. */
int adopt_answer(adopt *a, size_t i, buffers *r, const wire_env *reply, const char *why);

/* Buffers re-registered so far, and those left out (with the first one's
 * words). */
size_t adopt_result(const adopt *a, size_t *skipped, const char **words);

#endif
