#include "procstat.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

/* Parse /proc/PID/stat after the name, which may hold any byte. */
int procstat_read(int pid, struct procstat *s) {
  char p[64], buf[1024];
  snprintf(p, sizeof p, "/proc/%d/stat", pid);
  FILE *f = fopen(p, "re");
  if (!f) return -ENOENT;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *at = strrchr(buf, ')');
  /* state ppid pgrp session tty tpgid flags ... (19 more) starttime */
  if (!at || sscanf(at + 2,
                    "%c %*d %*d %*d %*d %*d %lu %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d "
                    "%llu",
                    &s->state, &s->flags, &s->start_time) != 3)
    return -ENOENT;
  return 0;
}
