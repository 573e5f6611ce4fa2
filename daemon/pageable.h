/* Pageable host memory for backups that do not fit the pinned budget
 * (--backup-overflow pageable, or a buffer that asks: torch_memory_saver's
 * cpu_backup_backend "mmap"). Such memory is made only where the kernel
 * says there is room for it, so that making it never gets the daemon
 * killed for memory: MemAvailable in /proc/meminfo, and the headroom of
 * every memory cgroup the daemon is in (memory.max less memory.current),
 * must each hold it. The daemon copies such backups itself: they are not
 * memory a worker can be handed. */
#ifndef GPUMEMD_PAGEABLE_H
#define GPUMEMD_PAGEABLE_H

#include <stddef.h>
#include <stdint.h>

/* The bytes of host memory the kernel says could be made now: the least
 * of MemAvailable and the cgroups' headroom (UINT64_MAX where none says;
 * meminfo and cgroup root: the files to read, NULL for the system's). */
uint64_t pageable_room(const char *meminfo, const char *cgroup_root);

/* Make size bytes of pageable memory, faulted in, where pageable_room
 * holds them. Returns 0 with *host, or a negative errno with why
 * (-ENOMEM: no room, saying how much there is). */
int pageable_make(uint64_t size, void **host, char *why, size_t whylen);

/* Free memory from pageable_make. */
void pageable_free(void *host, uint64_t size);

/* Write size bytes at host into fd, memory an owner sent to read its
 * backup into: a memfd (no other file, which could block or fault the
 * daemon), sealed here against shrinking, of at least size bytes, all
 * of them made (faulted in or fallocated by the owner: its memory, not
 * the daemon's), not sealed against writes. Returns 0, or a negative errno with why
 * (-EINVAL: not such memory). Blocks for the copy. */
int pageable_copy_into(int fd, const void *host, uint64_t size, char *why, size_t whylen);

#endif
