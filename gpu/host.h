/* The host backend's daemon side, shared by its files: the simulated
 * devices (host_dev.c), the chunks the daemon holds, by inode
 * (host_live.c), and what /proc says each process holds (host_proc.c).
 *
 * A chunk is a memfd named gpumem-host-<node>:<d> whose pages are
 * committed with fallocate, so that the memory is really used (Shmem in
 * /proc/meminfo) and really returned when the daemon and every importer
 * have unmapped and closed it. Any memfd of that name is "device memory"
 * of d; the ones the daemon holds are known by inode, so that the
 * kernel's view of each process (/proc/PID/maps and fd) plays the part of
 * the driver's per-process figures. Internal to gpu/. */
#ifndef GPUMEM_GPU_HOST_H
#define GPUMEM_GPU_HOST_H

#include <stdbool.h>
#include <stddef.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/idmap.h"
#include "common/limits.h"
#include "gpu/gpudev.h"

struct host {
  unsigned ndev;
  uint64_t granularity;
  uint64_t capacity;
  uint64_t committed[GPUMEM_MAX_DEVICES];
  char node[40];  /* names the simulated devices: bus id "host-<node>:<d>" */
  idmap *live;    /* inode -> device + 1 of every chunk held */
  dev_t live_dev; /* the filesystem those inodes are on (memfds share one) */
  pthread_mutex_t mu; /* backups (made on the daemon's thread pool too) */
  idmap *backups;     /* host address -> memfd + 1 of every backup */
  struct host_seen *seen; /* what /proc said of each process (host_proc.c) */
};

/* Count a chunk as the daemon's own, by inode, so that scans of /proc can
 * tell it from memory made outside the daemon. 0, or -errno with words
 * through gpu_fail. */
int host_live_add(struct host *h, int fd, unsigned dev);

/* Forget a chunk about to be closed. */
void host_live_del(struct host *h, int fd);

/* True if the file is a chunk the daemon holds. */
bool host_live_has(const struct host *h, dev_t dev, ino_t ino);

/* The device (below ndev) whose memfd path names, by its name alone
 * ("/memfd:gpumem-host-local:3 (deleted)" names 3); -1 if none. */
int host_live_device_of(const struct host *h, const char *path);

/* True if path names a memfd of device dev ("/memfd:gpumem-host-local:0
 * (deleted)" in maps and fd links): the name alone, so 1 is not 10. */
bool host_live_is_device_memfd(const struct host *h, const char *path, unsigned dev);

/* Every process that maps or holds memfds of dev the daemon did not make,
 * and how many bytes of them (the table's processes): read now, read at
 * or after since_ns (CLOCK_MONOTONIC; the table's processes_since: one
 * walk of /proc serves every device of an operation), or for a view begun
 * at since_ns (the table's processes_view: a process with device memory
 * read since or within the last second, one without read again within
 * 10 s, a new one found within 1 s). */
int host_proc_processes(void *state, unsigned dev, struct gpudev_process *out, size_t max,
                        size_t *n);
int host_proc_since(void *state, unsigned dev, uint64_t since_ns, struct gpudev_process *out,
                    size_t max, size_t *n);
int host_proc_view(void *state, unsigned dev, uint64_t since_ns, struct gpudev_process *out,
                   size_t max, size_t *n);

/* Free what host_proc remembers of processes (the backend closing). */
void host_proc_forget(struct host *h);

/* Which chunks pid maps or holds an fd to (the table's chunks_held_by). */
int host_proc_chunks_held_by(void *state, int pid, const uint64_t *handles, size_t n,
                             bool *held);

/* Whether pid maps or holds any device memfd (the table's process_listed). */
int host_proc_listed(void *state, int pid);

/* The stand-in for a release of pid's device state (host_freeze.c): the
 * table's process_release, process_restore and process_released. */
int host_freeze_release(void *state, int pid, uint32_t lock_ms, uint64_t *moved);
int host_freeze_restore(void *state, int pid);
int host_freeze_released(void *state, int pid);

#endif
