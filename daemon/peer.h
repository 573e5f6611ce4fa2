/* The process at the other end of a connection, pinned by a pidfd when it
 * connects, so that a signal meant for it never reaches a process that
 * got its pid later. A peer whose pid the daemon cannot see (0: another
 * pid namespace) or that could not be pinned is never signalled. */
#ifndef GPUMEMD_PEER_H
#define GPUMEMD_PEER_H

#include <sys/socket.h>
#include <sys/types.h>

/* Pin the peer of a connected Unix socket whose SO_PEERCRED credentials
 * are cred: by SO_PEERPIDFD where the kernel has it, else by
 * peer_pin_pid. Returns the pidfd (the caller owns it: peer_unpin), or a
 * negative errno: -ESRCH for a pid that is 0 or gone, -EPERM for one now
 * held by another process. */
int peer_pin(int sock, const struct ucred *cred);

/* Pin process cred->pid by pidfd_open, checked against cred: it must be
 * alive with cred's effective uid, the same process before and after the
 * pidfd was opened (start time), and have started before this call. The
 * fallback for kernels without SO_PEERPIDFD; a pidfd or a negative errno. */
int peer_pin_pid(const struct ucred *cred);

/* Send sig to a pinned process with pidfd_send_signal: 0, or a negative
 * errno (-EBADF: nothing pinned, -ESRCH: the process has ended). */
int peer_signal(int pidfd, int sig);

/* Let go of a pin (a negative pidfd is none). */
void peer_unpin(int pidfd);

#endif
