/* Whose gpumemd gpumemctl talks to: before it trusts an answer it checks
 * that root, the uid named with --socket-owner, or the user running
 * gpumemctl owns the socket file
 * and answers on it (the peer credentials of the connection, which no
 * file swapped into the socket's directory can fake). */
#ifndef GPUMEM_CTL_OWNER_H
#define GPUMEM_CTL_OWNER_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "gpumem.h"

/* A user name or a decimal uid into *uid; 0 or -1 when it is neither. */
int owner_parse(const char *s, uid_t *uid);

/* 0 when the socket file at path is owned by root or want; else -1 with
 * the reason in why. Said before connecting: a mismatch sends nothing. */
int owner_check_file(const char *path, uid_t want, char *why, size_t len);

/* 0 when the process that listens on c's connection runs as root or want
 * (SO_PEERCRED: under socket activation that is the service manager,
 * root); else -1 with the reason in why. */
int owner_check_peer(const gpumem_client *c, const char *path, uid_t want, char *why,
                     size_t len);

/* owner_connect's answer when a daemon answers that is not to be trusted. */
#define OWNER_UNTRUSTED 1

/* Connect the way every gpumemctl connection does (one that never
 * reconnects and loads no GPU driver; a controller, else a plain session
 * where fallback allows: status needs no rights), as name, and go on only
 * when root or want owns the socket file at path and answers on it. 0; a
 * GPUMEM_E_* (gpumem_last_error() says why); or OWNER_UNTRUSTED with the
 * reason in why and no connection. */
int owner_connect(const char *path, const char *name, uid_t want, bool fallback,
                  gpumem_client **c, char *why, size_t len);

#endif
