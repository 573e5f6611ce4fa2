/* An owner: a connected client as the registry and the engine see it, its
 * identity and the buffers it owns (a controller owns none). A session
 * (session.h) holds one; nothing below the server knows more of it. */
#ifndef GPUMEMD_OWNER_H
#define GPUMEMD_OWNER_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/list.h"
#include "common/wire.h"

struct owner {
  uint64_t id; /* the session's, unique for the daemon's life */
  pid_t pid;   /* from the socket's credentials */
  uid_t uid;
  Gpumem__Wire__Role role; /* ROLE_UNSPECIFIED until Hello */
  uint32_t minor;          /* the protocol minor version it speaks (Hello) */
  char name[WIRE_NAME_MAX + 1];
  struct list buffers; /* struct buffer.owner_link */
  size_t nbuffers;
  bool closed;      /* its session has ended: nothing more is sent to it */
  bool release_ok;     /* opted in to context release at Hello */
  bool copies_backups; /* copies its BACKUP buffers to and from backup memory itself */
  bool keeps_backups;  /* and keeps the backup memory handed to it mapped */
  bool nothing_mapped; /* its last Unmap ack said it maps nothing of ours */
  bool released;       /* its process's device state is released (ctxrelease.h) */
  uint64_t moved;      /* device bytes that release moved to host memory */
  bool keeper;         /* the daemon itself, holding persistent buffers no
                          session holds (keeper.h): no process, no session */
  struct list link; /* the server's owners, one per session, in id order */
};

#endif
