/* systemd's file descriptor store (FDSTORE=1), which keeps the memory of
 * persistent buffers that no process holds through a crash or a restart
 * of the daemon. While such a buffer has memory, systemd holds a copy of
 * each of its chunks' fds, named gpumem.ID.K.SIZE (buffer ID's chunk K of
 * SIZE bytes); the next daemon gets them back (LISTEN_FDS, LISTEN_FDNAMES)
 * and takes the buffer back by its journal. Before the daemon lets go of
 * such memory (a pause, a drop, an attach) it has systemd close its
 * copies and waits until it has (a notify barrier), so that memory counted
 * released is released. Not under systemd (no NOTIFY_SOCKET) nothing is
 * stored. */
#ifndef GPUMEMD_FDSTORE_H
#define GPUMEMD_FDSTORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct fdstore fdstore;

/* How long the daemon waits for systemd to close what it asked it to. */
enum { FDSTORE_BARRIER_MS = 5000 };

/* A store, in use where NOTIFY_SOCKET is set and the daemon was built with
 * libsystemd; NULL out of memory. */
fdstore *fdstore_create(void);

/* Whether chunks are stored at all. */
bool fdstore_enabled(const fdstore *s);

/* Take an fd systemd passed back under name: true if it is one of ours
 * (gpumem.ID.K.SIZE), which the store then owns; false otherwise (the
 * caller keeps it). */
bool fdstore_found(fdstore *s, const char *name, int fd);

/* Hand systemd copies of the n chunk fds of buffer id (the caller keeps
 * its own): 0, or a negative errno (nothing stored; logged). */
int fdstore_put(fdstore *s, uint64_t id, const int *fds, const uint64_t *sizes, size_t n);

/* Have systemd close its copies of buffer id's n chunks, and wait until it
 * has: 0, or a negative errno (logged) when that cannot be known. */
int fdstore_remove(fdstore *s, uint64_t id, const uint64_t *sizes, size_t n);

/* How many chunks of buffer id systemd passed back. */
size_t fdstore_chunks(const fdstore *s, uint64_t id);

/* Take the n chunks of buffer id that systemd passed back into fds (the
 * caller owns them) and sizes: true if all n were passed, in full (else
 * nothing is taken). */
bool fdstore_take(fdstore *s, uint64_t id, size_t n, int *fds, uint64_t *sizes);

/* Buffers of which systemd passed back chunks that were not taken. */
size_t fdstore_left(const fdstore *s);

/* Close what was passed back and not taken, and have systemd close its
 * copies too: memory of buffers no journal names. */
void fdstore_forget_left(fdstore *s);

/* Free the store, closing what it still holds (NULL is fine). */
void fdstore_free(fdstore *s);

#endif
