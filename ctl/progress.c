/* One rewritten line on stderr while a pause or resume runs. */
#include "ctl/progress.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <time.h>
#include <unistd.h>

#include "common/size.h"
#include "ctl/text.h"
#include "ctl/watch.h"

/* An operation that ends within this shows no line at all. */
#define PROGRESS_DELAY_MS 1000
/* How often the line is rewritten. */
#define PROGRESS_INTERVAL_MS 250

struct progress {
  watch *w;
  char what[512];    /* "pausing kv_cache weights" */
  uint64_t start_ms; /* when the request went out (monotonic) */
  size_t shown;      /* columns of the line on the terminal now (0: none) */
};

/* Milliseconds on the monotonic clock. */
static uint64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

/* Columns of the terminal on stderr (80 when it does not say). */
static size_t term_cols(void) {
  struct winsize ws;
  if (ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 80;
}

/* This process's operation among those the daemon is running, if any:
 * the record of a request made on another connection of the same pid. */
static const struct gpumem_op_record *own_op(const struct gpumem_status *s) {
  uint32_t self = (uint32_t)getpid();
  for (size_t i = 0; s && i < s->nrecent_ops; i++)
    if (s->recent_ops[i]->pid == self && !s->recent_ops[i]->done) return s->recent_ops[i];
  return NULL;
}

/* Put text on the line in place of what was there, cut to the terminal
 * (a line that wrapped could not be rewritten), blanking what is left of
 * a longer one. */
static void progress_put(progress *p, const char *text) {
  size_t n = strlen(text), cols = term_cols() - 1;
  if (n > cols) {
    n = cols; /* bytes, at least as many as columns: names come escaped */
    while (n > 0 && ((unsigned char)text[n] & 0xc0) == 0x80) n--; /* not inside UTF-8 */
  }
  size_t pad = p->shown > n ? p->shown - n : 0;
  fprintf(stderr, "\r%.*s%*s", (int)n, text, (int)pad, "");
  fflush(stderr);
  p->shown = n;
}

/* The watch's callback: rewrite the line with the daemon's figures, or
 * with the time alone when the daemon has no record of the operation (an
 * older daemon) or does not answer. */
static void progress_show(void *user, struct gpumem_status *s, int err, const char *why) {
  (void)err;
  (void)why;
  progress *p = user;
  const struct gpumem_op_record *r = own_op(s);
  double secs = r ? (double)r->duration_us / 1e6 : (double)(mono_ms() - p->start_ms) / 1e3;
  char text[800], a[32], b[32];
  if (r && r->bytes_total)
    snprintf(text, sizeof text, "%s: %s of %s, %.1f s", p->what,
             size_format(r->bytes_done, a, sizeof a), size_format(r->bytes_total, b, sizeof b),
             secs);
  else
    snprintf(text, sizeof text, "%s: %.1f s", p->what, secs);
  progress_put(p, text);
  gpumem_status_free(s);
}

/* Name the operation, then watch from PROGRESS_DELAY_MS on. */
progress *progress_start(const char *socket_path, uid_t owner, bool resume, char *const *tags,
                         size_t ntags) {
  if (!isatty(STDERR_FILENO)) return NULL;
  progress *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->start_ms = mono_ms();
  size_t o = (size_t)snprintf(p->what, sizeof p->what, "%s", resume ? "resuming" : "pausing");
  if (ntags == 0) snprintf(p->what + o, sizeof p->what - o, " every tag");
  for (size_t i = 0; i < ntags && o < sizeof p->what; i++) {
    char name[256];
    o += (size_t)snprintf(p->what + o, sizeof p->what - o, " %s",
                          printable(tags[i], name, sizeof name));
  }
  if (watch_start(socket_path, owner, "gpumemctl", PROGRESS_DELAY_MS, PROGRESS_INTERVAL_MS,
                  progress_show, p, &p->w) < 0) {
    free(p);
    return NULL;
  }
  return p;
}

/* Stop the watch first, so that nothing writes the line after it is
 * cleared. */
void progress_stop(progress *p) {
  if (!p) return;
  watch_stop(p->w);
  if (p->shown) {
    fprintf(stderr, "\r%*s\r", (int)p->shown, "");
    fflush(stderr);
  }
  free(p);
}
