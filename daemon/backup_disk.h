/* Backups kept in files: the daemon's --backup-dir. A buffer with
 * FLAG_BACKUP_DISK has its backup written to a file of its own once a
 * pause has it in host memory, which is then let go of; its resume reads
 * the file back first. The files are the daemon's alone: made unlinked
 * (O_TMPFILE, or a name removed as soon as it is made), mode 0600, in a
 * directory judged as the socket's is (safedir.h), so that a crash leaves
 * nothing behind and a start removes what an older daemon's crash could
 * have left. The I/O is direct where the filesystem takes it (the page
 * cache would hold what the tier exists to free), queued deeply through
 * io_uring (liburing) where the build and the kernel have it, with plain
 * reads and writes otherwise. */
#ifndef GPUMEMD_BACKUP_DISK_H
#define GPUMEMD_BACKUP_DISK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct backup_disk backup_disk;

/* One backup's transfer: in, host memory of size bytes (page aligned) and,
 * for a read, its file; out, for a write, its new file (-1 on failure),
 * and rc (0, or a negative errno with why). */
struct backup_disk_item {
  void *host;
  uint64_t size;
  int fd;
  int rc;
  char why[240];
};

/* Open the backup directory at path: judged safe (owned by root or the
 * daemon's uid, writable by no one else, the same for every directory on
 * the way), on a filesystem that is not read-only; files an older daemon
 * left there are removed. NULL with why when it cannot serve. */
backup_disk *backup_disk_open(const char *path, char *why, size_t whylen);

/* Close the directory (the files are their holders' to close). */
void backup_disk_close(backup_disk *d);

/* The path it was opened with. */
const char *backup_disk_path(const backup_disk *d);

/* Bytes its filesystem has free for the daemon now (0 when unknown). */
uint64_t backup_disk_free(const backup_disk *d);

/* Whether need more bytes of backups can go there now: still safe, still
 * there, writable, with the room: 0, or a negative errno with why. */
int backup_disk_check(const backup_disk *d, uint64_t need, char *why, size_t whylen);

/* Write each item's host memory to a new file, all of them queued
 * together; each item says how it went. Blocks: run it off the loop. */
void backup_disk_write(backup_disk *d, struct backup_disk_item *items, size_t n);

/* Read each item's file into its host memory, as backup_disk_write. */
void backup_disk_read(backup_disk *d, struct backup_disk_item *items, size_t n);

/* A new descriptor of backup file fd, read only, for an owner to read
 * its paused backup from (the file stays the daemon's: it cannot write
 * or link it). Returns it, or a negative errno with why. */
int backup_disk_reader(int fd, char *why, size_t whylen);

/* How transfers are made, for the log and status: "io_uring" or
 * "pread/pwrite", and whether direct. */
const char *backup_disk_engine(const backup_disk *d);

#endif
