/* The daemon's settings, from its command line. */
#ifndef GPUMEMD_CONFIG_H
#define GPUMEMD_CONFIG_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#define DEFAULT_SOCKET "/run/gpumemd/gpumemd.sock"

enum timeout_policy { TIMEOUT_REPORT, TIMEOUT_KILL };

struct config {
  const char *socket_path;
  const char *backend;
  unsigned host_devices;
  uint64_t host_device_size;
  uint64_t host_granularity;
  uint64_t chunk_size;
  uint64_t backup_limit;
  bool verify_backups;
  bool overflow_pageable; /* --backup-overflow pageable */
  const char *backup_dir;  /* --backup-dir, NULL: none */
  struct backup_disk *backup_disk; /* it, opened by main (backup_disk.h) */
  uint32_t ack_timeout_ms;
  uint32_t exit_wait_ms; /* a pause waits this long for ended owners to leave the driver */
  uint32_t lock_timeout_ms;    /* a context release waits this long for device calls */
  uint32_t release_timeout_ms; /* and this long for the driver's release or restore */
  const char *release_journal; /* the released processes, for a daemon that follows */
  uint32_t adopt_grace_ms; /* new tags wait this long after start (0: not) */
  bool adopt_grace_set;    /* --adopt-grace was given (a journal's default is 10 s) */
  const char *journal_path; /* what a daemon after us must know (journal.h); NULL: none */
  bool journal_explicit;    /* --journal named it: a daemon that cannot keep it fails */
  enum timeout_policy timeout_policy;
  unsigned max_sessions_per_uid;
  unsigned max_buffers_per_session;
  unsigned max_buffers_per_uid; /* over all of a uid's sessions */
  uint64_t max_device_bytes_per_uid; /* on each device, any state; 0: none */
  uint64_t max_backup_bytes_per_uid; /* host memory for backups; 0: none */
  const char **shared_tags;  /* tags every uid may join from the start */
  size_t nshared_tags;
  /* Hostile or broken peers: fds a frame still arriving may hold (per
   * session, and summed over a uid's sessions), how long a frame may take
   * once begun, and the replies and events queued unread (per session and
   * over all sessions) before a session is ended. */
  unsigned max_parked_fds_per_session;
  unsigned max_parked_fds_per_uid;
  uint32_t frame_timeout_ms;
  uint64_t max_queued_per_session;
  uint64_t max_queued_total;
  uid_t controller_uid; /* (uid_t)-1: none beyond root and our own uid */
  gid_t controller_gid; /* (gid_t)-1: none */
  gid_t socket_gid;     /* (gid_t)-1: keep the daemon's group */
  mode_t socket_mode;   /* for a socket the daemon binds itself */
  int listen_fd;        /* -1, or a socket passed by systemd: never unlinked */
  struct fdstore *fdstore; /* systemd's fd store (fdstore.h), and what it passed back */
};

#endif
