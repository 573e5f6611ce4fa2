/* Directories the daemon keeps things in (its socket, its backup files):
 * trusted only when nobody but root and the daemon's own uid can change
 * them or any directory on the way to them. */
#ifndef GPUMEMD_SAFEDIR_H
#define GPUMEMD_SAFEDIR_H

#include <stddef.h>

/* Resolve dir from / as the kernel would, one name at a time, following
 * links, and judge every directory a name is looked up in and the one
 * reached: each owned by root or the daemon's uid; the last writable by no
 * one else, one above it only when sticky (/tmp). what names the directory
 * in errors ("socket directory"), keeps what another user could replace
 * ("the socket"). Returns an O_PATH descriptor of the directory reached,
 * or a negative errno with err filled. */
int safedir_open(const char *what, const char *dir, const char *keeps, char *err, size_t errlen);

/* Judge an open directory's owner and mode again (it may have changed
 * since safedir_open): 0, or -EPERM with err filled as safedir_open does. */
int safedir_recheck(int fd, const char *what, const char *dir, const char *keeps, char *err,
                    size_t errlen);

#endif
