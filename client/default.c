/* The process's default client. One mutex guards both pointers; a forked
 * child starts with neither: the parent's clients (their sockets,
 * threads and pools) are not the child's, and their structs are leaked
 * knowingly. */
#include <pthread.h>

#include "default.h"

static pthread_mutex_t default_mu = PTHREAD_MUTEX_INITIALIZER;
static gpumem_client *chosen;    /* gpumem_set_default_client's */
static gpumem_client *connected; /* the one connected here on first use */

/* In a forked child: forget the parent's clients without touching them. */
static void forget_in_child(void) {
  pthread_mutex_init(&default_mu, NULL);
  chosen = connected = NULL;
}

/* Register the fork handler when the library is loaded. */
__attribute__((constructor)) static void default_init(void) {
  pthread_atfork(NULL, NULL, forget_in_child);
}

/* Make c the default client (NULL: none); a client connected here before
 * stays connected, so that what it allocated stays valid, and is the
 * default again once none is set. */
void gpumem_set_default_client(gpumem_client *c) {
  pthread_mutex_lock(&default_mu);
  chosen = c;
  pthread_mutex_unlock(&default_mu);
}

/* The default client now. */
gpumem_client *default_get(void) {
  pthread_mutex_lock(&default_mu);
  gpumem_client *c = chosen ? chosen : connected;
  pthread_mutex_unlock(&default_mu);
  return c;
}

/* Remember the client connected here. */
void default_set_connected(gpumem_client *c) {
  pthread_mutex_lock(&default_mu);
  connected = c;
  pthread_mutex_unlock(&default_mu);
}

/* Forget a client that is being disconnected. */
void default_forget(gpumem_client *c) {
  pthread_mutex_lock(&default_mu);
  if (connected == c) connected = NULL;
  if (chosen == c) chosen = NULL;
  pthread_mutex_unlock(&default_mu);
}
