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
  uint32_t ack_timeout_ms;
  enum timeout_policy timeout_policy;
  unsigned max_sessions_per_uid;
  unsigned max_buffers_per_session;
  uid_t controller_uid; /* (uid_t)-1: none beyond root and our own uid */
  gid_t controller_gid; /* (gid_t)-1: none */
  gid_t socket_gid;     /* (gid_t)-1: keep the daemon's group */
  mode_t socket_mode;   /* for a socket the daemon binds itself */
  int listen_fd;        /* -1, or a socket passed by systemd: never unlinked */
};

#endif
