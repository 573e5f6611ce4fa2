/* The process's default client: the one the application set, else the
 * one connected on first use (torch.c). A client being disconnected is
 * forgotten here; a forked child forgets both. */
#ifndef GPUMEM_CLIENT_DEFAULT_H
#define GPUMEM_CLIENT_DEFAULT_H

#include "gpumem.h"

/* The default client now (the one set, else the one connected here), or
 * NULL. */
gpumem_client *default_get(void);

/* Remember the client connected here on first use. */
void default_set_connected(gpumem_client *c);

/* Forget a client that is being disconnected, as the default and as the
 * one connected here. */
void default_forget(gpumem_client *c);

#endif
