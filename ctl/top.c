/* gpumemctl top: curses on the main thread, the status from a watch
 * thread (ctl/watch.h) that wakes it through a pipe. The main thread
 * sleeps in poll on the terminal and that pipe, so keys, resizes and
 * signals are answered at once even while a request to a hung daemon
 * waits for its timeout. */
#include "ctl/top.h"

#include <stdio.h>
#include <unistd.h>

#ifndef HAVE_NCURSES

/* Without curses there is no view to show. */
int top_run(const char *socket_path, uid_t owner, uint64_t interval_ms) {
  (void)socket_path;
  (void)owner;
  (void)interval_ms;
  fprintf(stderr, "gpumemctl: top: built without curses (install libncurses-dev and "
                  "rebuild); use status\n");
  return 2;
}

#else

#include <curses.h>
#include <errno.h>
#include <fcntl.h>
#include <langinfo.h>
#include <locale.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <term.h>
#include <time.h>
#include <wchar.h>

#include "common/size.h"
#include "ctl/text.h"
#include "ctl/view.h"
#include "ctl/watch.h"
#include "gpumem.h"

/* Room for a name of up to 255 bytes, each escaped as \xNN. */
#define NAME_BUF 1024
/* Processes listed as holding memory outside gpumemd, at most. */
#define HOLDERS_SHOWN 5
#define GIB (1024.0 * 1024.0 * 1024.0)

/* Color pairs. */
enum { P_MANAGED = 1, P_UNMANAGED, P_PAUSED, P_TRANSIT, P_ACTIVE, P_ALERT };

/* What the watch thread hands over, and what the screen shows. */
struct top {
  const char *socket_shown; /* the socket, for the header */
  uint64_t interval_ms;
  int wake[2];              /* the watch writes a byte to wake[1] per answer */
  pthread_mutex_t mu;       /* guards the three fields below */
  bool fresh;               /* an answer came since the main thread looked */
  struct gpumem_status *next;
  int next_err;
  char next_why[512];
  /* The main thread's own: */
  struct gpumem_status *s; /* the last status (NULL: none yet, or not answering) */
  int err;                 /* < 0: the daemon did not answer the last time */
  char why[512];
  time_t answered;         /* when the last status came (0: never) */
  size_t tag_first;        /* the first tag shown, by name (PgDn, PgUp, Home, End) */
  size_t tag_rows;         /* how many the last screen showed */
};

/* Set by SIGINT, SIGTERM and SIGHUP: quit at the next turn of the loop. */
static volatile sig_atomic_t quit_signal;

/* Whether the terminal takes UTF-8 (else names are shown in ASCII). */
static bool utf8_term;

/* Note a quitting signal; poll then returns EINTR. */
static void on_quit_signal(int sig) { quit_signal = sig; }

/* The watch's callback (its thread): keep the newest answer, wake the
 * main thread. */
static void top_receive(void *user, struct gpumem_status *s, int err, const char *why) {
  struct top *t = user;
  pthread_mutex_lock(&t->mu);
  gpumem_status_free(t->next);
  t->next = s;
  t->next_err = err;
  snprintf(t->next_why, sizeof t->next_why, "%s", why);
  t->fresh = true;
  pthread_mutex_unlock(&t->mu);
  ssize_t n = write(t->wake[1], "", 1); /* a full pipe already wakes it */
  (void)n;
}

/* Take the newest answer, if one came; true when the screen must change. */
static bool top_take(struct top *t) {
  pthread_mutex_lock(&t->mu);
  bool fresh = t->fresh;
  if (fresh) {
    gpumem_status_free(t->s);
    t->s = t->next;
    t->next = NULL;
    t->err = t->next_err;
    snprintf(t->why, sizeof t->why, "%s", t->next_why);
    t->fresh = false;
    if (t->s) t->answered = time(NULL);
  }
  pthread_mutex_unlock(&t->mu);
  return fresh;
}

/* A name fit for this terminal: escaped (ctl/text.h), and where the
 * terminal does not take UTF-8, with every byte above ASCII as \xNN. */
static const char *shown(const char *name, char *buf, size_t len) {
  char tmp[NAME_BUF];
  const char *p = printable(name ? name : "", utf8_term ? buf : tmp, utf8_term ? len : sizeof tmp);
  if (utf8_term) return p;
  size_t o = 0;
  for (const unsigned char *c = (const unsigned char *)tmp; *c && o + 5 <= len; c++)
    o += (size_t)(*c < 0x80 ? snprintf(buf + o, len - o, "%c", *c)
                            : snprintf(buf + o, len - o, "\\x%02x", *c));
  buf[o] = '\0';
  return buf;
}

/* The columns the text takes, up to max; *bytes gets the bytes that fit. */
static int text_cols(const char *s, int max, size_t *bytes) {
  mbstate_t st;
  memset(&st, 0, sizeof st);
  size_t len = strlen(s), o = 0;
  int cols = 0;
  while (o < len) {
    wchar_t wc;
    size_t n = 1;
    int w = 1;
    if (utf8_term && (unsigned char)s[o] >= 0x80) {
      n = mbrtowc(&wc, s + o, len - o, &st);
      if (n == (size_t)-1 || n == (size_t)-2 || n == 0) {
        n = 1;
        memset(&st, 0, sizeof st);
      } else {
        w = wcwidth(wc);
        if (w < 0) w = 1;
      }
    }
    if (cols + w > max) break;
    cols += w;
    o += n;
  }
  *bytes = o;
  return cols;
}

/* Draw text at row y from column *x in a cell of w columns (w < 0: the
 * text's own width), cut to the cell and to the screen, left-aligned or
 * right-aligned; *x moves past the cell and one space. */
static void cell(int y, int *x, const char *text, int w, bool right, attr_t attr) {
  if (y >= LINES || *x >= COLS) return;
  int room = COLS - *x;
  size_t bytes;
  int cols = text_cols(text, w < 0 ? room : (w < room ? w : room), &bytes);
  int width = w < 0 ? cols : w;
  int at = *x + (right && cols < width ? width - cols : 0);
  if (at < COLS) {
    attron(attr);
    mvaddnstr(y, at, text, (int)bytes);
    attroff(attr);
  }
  *x += width + 1;
}

/* A row of one text from column x, in attr. */
static void line(int y, int x, const char *text, attr_t attr) { cell(y, &x, text, -1, false, attr); }

/* A color pair's attribute, or none on a terminal without colors. */
static attr_t color(int pair) { return has_colors() ? COLOR_PAIR(pair) : A_NORMAL; }

/* Bytes as GiB with two decimals: the bars' unit. */
static const char *gib(uint64_t bytes, char *buf, size_t len) {
  snprintf(buf, len, "%.2f GiB", (double)bytes / GIB);
  return buf;
}

/* A duration as people read it: 430 ms, 2.3 s, 4m05s. */
static const char *took_text(uint64_t us, char *buf, size_t len) {
  if (us < 1000000) snprintf(buf, len, "%.0f ms", (double)us / 1e3);
  else if (us < 60000000) snprintf(buf, len, "%.1f s", (double)us / 1e6);
  else snprintf(buf, len, "%llum%02llus", (unsigned long long)(us / 60000000),
                (unsigned long long)(us / 1000000 % 60));
  return buf;
}

/* The first line: which daemon, since when, and the time. */
static void draw_header(const struct top *t) {
  char head[NAME_BUF * 2], v[NAME_BUF], sock[NAME_BUF], be[64], up[64] = "", now[32];
  time_t tn = time(NULL);
  struct tm tm;
  strftime(now, sizeof now, "%H:%M:%S", localtime_r(&tn, &tm));
  const struct gpumem_status *s = t->s;
  if (s && s->uptime_ms) {
    uint64_t m = s->uptime_ms / 60000;
    if (m >= 60) snprintf(up, sizeof up, ", up %lluh%02llum", (unsigned long long)(m / 60),
                          (unsigned long long)(m % 60));
    else snprintf(up, sizeof up, ", up %llum%02llus", (unsigned long long)m,
                  (unsigned long long)(s->uptime_ms / 1000 % 60));
  }
  if (s)
    snprintf(head, sizeof head, "gpumemd %s at %s, backend %s%s", s->version && s->version[0]
             ? shown(s->version, v, sizeof v) : "(version unknown)",
             shown(t->socket_shown, sock, sizeof sock), shown(s->backend, be, sizeof be), up);
  else
    snprintf(head, sizeof head, "gpumemd at %s", shown(t->socket_shown, sock, sizeof sock));
  line(0, 0, head, A_BOLD);
  char right[64];
  snprintf(right, sizeof right, "%s  q quits", now);
  size_t b;
  int w = text_cols(right, COLS, &b);
  if (COLS - w > text_cols(head, COLS, &b) + 1) line(0, COLS - w, right, A_NORMAL);
}

/* The device's memory as one bar: managed (#), unmanaged (%), the
 * driver's reserve (:) and free (.), each cell for total / width bytes. */
static void draw_bar(int y, int x, int w, const struct gpumem_device_status *d) {
  const struct {
    uint64_t bytes;
    char c;
    attr_t attr;
  } seg[] = {{d->managed, '#', color(P_MANAGED) | A_BOLD},
             {d->unmanaged, '%', color(P_UNMANAGED) | A_BOLD},
             {d->reserved, ':', A_DIM},
             {d->free, '.', A_NORMAL}};
  double sum = 0;
  int at = 0;
  for (size_t i = 0; i < sizeof seg / sizeof seg[0]; i++) {
    sum += (double)seg[i].bytes;
    int end = d->total ? (int)(sum / (double)d->total * w + 0.5) : 0;
    if (end > w || i + 1 == sizeof seg / sizeof seg[0]) end = w;
    attron(seg[i].attr);
    for (; at < end && x + at < COLS; at++) mvaddch(y, x + at, (chtype)seg[i].c);
    attroff(seg[i].attr);
  }
}

/* Two rows per device: the bar with the total, then the figures. */
static int draw_devices(int y, const struct gpumem_status *s) {
  int label = 0;
  char dev[48], lab[64], a[32], b[32], c[32], d4[32];
  for (size_t i = 0; i < s->ndevices; i++) {
    size_t n;
    snprintf(lab, sizeof lab, "device %s",
             view_device(s->devices[i]->device, s->devices[i]->node_device, dev, sizeof dev));
    int w = text_cols(lab, 40, &n);
    if (w > label) label = w;
  }
  for (size_t i = 0; i < s->ndevices; i++, y += 2) {
    const struct gpumem_device_status *d = s->devices[i];
    int x = 0;
    snprintf(lab, sizeof lab, "device %s", view_device(d->device, d->node_device, dev, sizeof dev));
    cell(y, &x, lab, label, false, A_BOLD);
    int bar = COLS - x - 2 - 11;
    if (bar < 10) bar = 10;
    line(y, x, "[", A_NORMAL);
    draw_bar(y, x + 1, bar, d);
    x += bar + 1;
    line(y, x, "]", A_NORMAL);
    x += 2;
    cell(y, &x, gib(d->total, a, sizeof a), 10, true, A_NORMAL);
    x = label + 1;
    cell(y + 1, &x, "# managed", -1, false, color(P_MANAGED) | A_BOLD);
    cell(y + 1, &x, gib(d->managed, a, sizeof a), -1, false, A_NORMAL);
    x++;
    cell(y + 1, &x, "% unmanaged", -1, false, color(P_UNMANAGED) | A_BOLD);
    cell(y + 1, &x, gib(d->unmanaged, b, sizeof b), -1, false, A_NORMAL);
    x++;
    cell(y + 1, &x, ". free", -1, false, A_BOLD);
    cell(y + 1, &x, gib(d->free, c, sizeof c), -1, false, A_NORMAL);
    if (d->reserved) {
      x++;
      cell(y + 1, &x, ": reserved", -1, false, A_DIM);
      cell(y + 1, &x, gib(d->reserved, d4, sizeof d4), -1, false, A_NORMAL);
    }
    if (d->daemon_context) cell(y + 1, &x, "(gpumemd holds a context)", -1, false, A_DIM);
  }
  return y;
}

/* A tag's state as people read it: mixed when neither ACTIVE nor PAUSED
 * covers its buffers and none is in transit; and its color. */
static const char *tag_state(const struct gpumem_tag_status *t, attr_t *attr) {
  *attr = !t->transit_buffers && t->mixed ? color(P_ALERT)
          : t->state == GPUMEM_PAUSED     ? color(P_PAUSED) | A_BOLD
          : t->state == GPUMEM_ACTIVE     ? color(P_ACTIVE)
                                          : color(P_TRANSIT) | A_BOLD;
  return view_tag_state(t);
}

/* The rows a list may take from y: what is left of the screen less
 * `after` rows kept for the sections below; at least one. */
static size_t list_room(int y, int after) {
  int room = LINES - y - after;
  return room < 1 ? 1 : (size_t)room;
}

/* "and N more" in place of a list's last row when it does not fit; the
 * rows to draw of n. */
static size_t fit_list(int y, size_t n, size_t room, const char *what) {
  if (n <= room) return n;
  char more[96];
  snprintf(more, sizeof more, "... and %zu more %s", n - (room - 1), what);
  line(y + (int)room - 1, 0, more, A_DIM);
  return room - 1;
}

/* Order tags by name, so that rows keep their places between refreshes. */
static int by_name(const void *x, const void *y) {
  const struct gpumem_tag_status *a = *(const struct gpumem_tag_status *const *)x;
  const struct gpumem_tag_status *b = *(const struct gpumem_tag_status *const *)y;
  return strcmp(a->name, b->name);
}

/* Whether top looks through a controller session, which sees every tag
 * (without a controller's rights it sees only its own uid's). */
static bool sees_every_tag(const struct gpumem_status *s) {
  for (size_t i = 0; i < s->nsessions; i++)
    if (s->sessions[i]->pid == (uint32_t)getpid()) return s->sessions[i]->role == GPUMEM_ROLE_CONTROLLER;
  return true;
}

/* A column of a table: its title, width and whether it is right-aligned. */
struct column {
  const char *title;
  int width;
  bool right;
};

/* A table's header of n columns on line y, bold and reversed. */
static void header(int y, const struct column *cols, size_t n) {
  int x = 0;
  for (size_t i = 0; i < n; i++)
    cell(y, &x, cols[i].title, cols[i].width, cols[i].right, A_BOLD | A_REVERSE);
}

/* The tags, by name, from the *first'th (kept within the list; the rows
 * shown into *rows): state, bytes, paused, backed up and in transit.
 * Where they do not all fit, the last row says which are shown and how
 * to page through them. */
static int draw_tags(int y, const struct gpumem_status *s, int after, size_t *first,
                     size_t *rows) {
  static const struct column cols[] = {{"TAG", 20, false},   {"STATE", 9, false},
                                       {"BYTES", 10, true},  {"PAUSED", 10, true},
                                       {"BACKUP", 10, true}, {"IN TRANSIT", 10, true}};
  char a[32], b[32], c[32], d[32], name[NAME_BUF];
  header(y++, cols, sizeof cols / sizeof cols[0]);
  *rows = 0;
  if (s->ntags == 0) {
    line(y, 0,
         sees_every_tag(s) ? "no tags: no buffer is allocated"
                           : "no tags of yours (without a controller's rights top shows only your uid's)",
         A_DIM);
    return y + 1;
  }
  const struct gpumem_tag_status **v = malloc(s->ntags * sizeof *v);
  if (!v) return y;
  memcpy(v, s->tags, s->ntags * sizeof *v);
  qsort(v, s->ntags, sizeof *v, by_name);
  size_t room = list_room(y, after), n = s->ntags <= room ? s->ntags : room - 1;
  if (*first > s->ntags - n) *first = s->ntags - n;
  for (size_t i = *first; i < *first + n; i++, y++) {
    const struct gpumem_tag_status *t = v[i];
    attr_t attr;
    const char *state = tag_state(t, &attr);
    int x = 0;
    cell(y, &x, shown(t->name, name, sizeof name), 20, false, A_NORMAL);
    cell(y, &x, state, 9, false, attr);
    cell(y, &x, size_format(t->bytes, a, sizeof a), 10, true, A_NORMAL);
    cell(y, &x, size_format(t->paused_bytes, b, sizeof b), 10, true, A_NORMAL);
    cell(y, &x, size_format(t->backup_bytes, c, sizeof c), 10, true, A_NORMAL);
    cell(y, &x, size_format(t->transit_bytes, d, sizeof d), 10, true,
         t->transit_bytes ? color(P_TRANSIT) | A_BOLD : A_NORMAL);
  }
  free(v);
  if (n < s->ntags) { /* after the rows: a cut cell of the last does not overwrite it */
    char shown_rows[128];
    if (n) snprintf(shown_rows, sizeof shown_rows, "tags %zu-%zu of %zu (PgDn, PgUp, Home, End)",
                    *first + 1, *first + n, s->ntags);
    else snprintf(shown_rows, sizeof shown_rows, "%zu tags (no room to show them)", s->ntags);
    line(y, 0, shown_rows, A_DIM);
  }
  *rows = n;
  return y + (n < s->ntags ? 1 : 0);
}

/* The processes holding the most device memory outside gpumemd: the leak
 * an operator hunts. */
static int draw_holders(int y, const struct gpumem_status *s, int after) {
  static const struct column cols[] = {
      {"HELD OUTSIDE GPUMEMD BY", 24, false}, {"PID", 8, true}, {"DEVICE", 10, false},
      {"BYTES", 10, true}};
  header(y++, cols, sizeof cols / sizeof cols[0]);
  if (!s->processes_known) {
    line(y, 0, "unknown: the driver gives no per-process figures", A_DIM);
    return y + 1;
  }
  const struct gpumem_process_status **v = calloc(s->nprocesses + 1, sizeof *v);
  if (!v) return y;
  size_t n = 0;
  for (size_t i = 0; i < s->nprocesses; i++)
    if (s->processes[i]->residual) v[n++] = s->processes[i];
  qsort(v, n, sizeof *v, view_by_residual);
  if (n == 0) line(y++, 0, "none: no process holds device memory outside gpumemd", A_DIM);
  size_t room = list_room(y, after);
  size_t shown_n = fit_list(y, n, room < HOLDERS_SHOWN + 1 ? room : HOLDERS_SHOWN + 1, "processes");
  char a[32], pid[16], dev[48], name[NAME_BUF];
  for (size_t i = 0; i < shown_n; i++, y++) {
    int x = 0;
    snprintf(pid, sizeof pid, "%u", v[i]->pid);
    cell(y, &x, v[i]->name && v[i]->name[0] ? shown(v[i]->name, name, sizeof name) : "?", 24,
         false, A_NORMAL);
    cell(y, &x, pid, 8, true, A_NORMAL);
    cell(y, &x, view_device(v[i]->device, v[i]->node_device, dev, sizeof dev), 10, false, A_NORMAL);
    cell(y, &x, size_format(v[i]->residual, a, sizeof a), 10, true, color(P_UNMANAGED) | A_BOLD);
  }
  free(v);
  return y + (shown_n < n ? 1 : 0);
}

/* An operation's tags in one text ("every tag" for none). */
static const char *op_tags(const struct gpumem_op_record *r, char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  if (r->ntags == 0) snprintf(buf, len, "(every tag)");
  char name[NAME_BUF];
  for (size_t i = 0; i < r->ntags && o + 1 < len; i++)
    o += (size_t)snprintf(buf + o, len - o, "%s%s", i ? " " : "",
                          shown(r->tags[i], name, sizeof name));
  return buf;
}

/* One pause or resume: when, what, how much, how long, how fast, how it
 * ended (or how far it is). */
static void draw_op(int y, const struct gpumem_op_record *r, int tags_w) {
  char when[16] = "", tags[NAME_BUF], bytes[64], a[32], b[32], took[32], rate[32];
  time_t ts = (time_t)(r->started_ms / 1000);
  struct tm tm;
  if (r->started_ms) strftime(when, sizeof when, "%H:%M:%S", localtime_r(&ts, &tm));
  if (!r->done && r->bytes_total)
    snprintf(bytes, sizeof bytes, "%s of %s", size_format(r->bytes_done, a, sizeof a),
             size_format(r->bytes_total, b, sizeof b));
  else
    size_format(r->bytes_done, bytes, sizeof bytes);
  if (r->duration_us)
    snprintf(rate, sizeof rate, "%.2f", (double)r->bytes_done / GIB / ((double)r->duration_us / 1e6));
  else
    snprintf(rate, sizeof rate, "-");
  int x = 0;
  cell(y, &x, when, 8, false, A_NORMAL);
  cell(y, &x, r->op ? r->op : "?", 6, false, A_BOLD);
  cell(y, &x, op_tags(r, tags, sizeof tags), tags_w, false, A_NORMAL);
  cell(y, &x, bytes, 21, true, A_NORMAL);
  cell(y, &x, took_text(r->duration_us, took, sizeof took), 8, true, A_NORMAL);
  cell(y, &x, rate, 6, true, A_NORMAL);
  if (!r->done) cell(y, &x, "running", -1, false, color(P_TRANSIT) | A_BOLD);
  else cell(y, &x, r->result == 0 ? "OK" : gpumem_error_name(r->result), -1, false,
            r->result == 0 ? color(P_ACTIVE) : color(P_ALERT) | A_BOLD);
}

/* The operations running, then the last ones done, newest first. */
static int draw_ops(int y, const struct gpumem_status *s) {
  int tags_w = COLS - (8 + 6 + 21 + 8 + 6 + 14) - 6;
  if (tags_w < 8) tags_w = 8;
  if (tags_w > 40) tags_w = 40;
  const struct column cols[] = {{"STARTED", 8, false}, {"OP", 6, false},  {"TAGS", tags_w, false},
                                {"BYTES", 21, true},   {"TOOK", 8, true}, {"GiB/s", 6, true},
                                {"RESULT", 14, false}};
  header(y++, cols, sizeof cols / sizeof cols[0]);
  if (s->nrecent_ops == 0) {
    line(y, 0, s->uptime_ms ? "no pause or resume since gpumemd started"
                            : "this gpumemd does not report its pauses and resumes (before 1.3)",
         A_DIM);
    return y + 1;
  }
  size_t n = fit_list(y, s->nrecent_ops, list_room(y, 0), "operations");
  for (size_t i = 0; i < n; i++, y++) draw_op(y, s->recent_ops[i], tags_w);
  return y;
}

/* The whole screen from the last answer, or why there is none. */
static void top_draw(struct top *t) {
  erase();
  draw_header(t);
  char msg[1200], when[32], every[32];
  if (!t->s) {
    if (t->err < 0) {
      snprintf(msg, sizeof msg, "gpumemd not answering: %s", t->why);
      line(2, 0, msg, color(P_ALERT) | A_BOLD);
      struct tm tm;
      if (t->answered) strftime(when, sizeof when, "%H:%M:%S", localtime_r(&t->answered, &tm));
      snprintf(msg, sizeof msg, "retrying every %s; %s%s", took_text(t->interval_ms * 1000,
               every, sizeof every), t->answered ? "last answer at " : "no answer yet",
               t->answered ? when : "");
      line(3, 0, msg, A_NORMAL);
    } else {
      line(2, 0, "asking gpumemd for its status...", A_DIM);
    }
    refresh();
    return;
  }
  const struct gpumem_status *s = t->s;
  int y = draw_devices(2, s) + 1;
  /* Below the tags: holders (header and at least a row), then the
   * operations (the same), each after a blank row. */
  y = draw_tags(y, s, 6, &t->tag_first, &t->tag_rows) + 1;
  y = draw_holders(y, s, 3) + 1;
  draw_ops(y, s);
  refresh();
}

/* Colors where the terminal has them, on its own background. */
static void top_colors(void) {
  if (!has_colors()) return;
  start_color();
  use_default_colors();
  init_pair(P_MANAGED, COLOR_GREEN, -1);
  init_pair(P_UNMANAGED, COLOR_RED, -1);
  init_pair(P_PAUSED, COLOR_YELLOW, -1);
  init_pair(P_TRANSIT, COLOR_MAGENTA, -1);
  init_pair(P_ACTIVE, COLOR_GREEN, -1);
  init_pair(P_ALERT, COLOR_RED, -1);
}

/* Install the quitting signals' handler (no SA_RESTART: poll must wake)
 * before curses starts, so that curses keeps its own off them. */
static void top_signals(struct sigaction *old) {
  static const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_quit_signal;
  sigemptyset(&sa.sa_mask);
  for (size_t i = 0; i < 3; i++) sigaction(sigs[i], &sa, &old[i]);
}

/* Put back the signal handlers that were there before. */
static void top_signals_restore(const struct sigaction *old) {
  static const int sigs[] = {SIGINT, SIGTERM, SIGHUP};
  for (size_t i = 0; i < 3; i++) sigaction(sigs[i], &old[i], NULL);
}

/* Keys waiting: q quits, a resize redraws, PgDn (or space), PgUp, Home
 * and End page through the tags. Returns false to quit. */
static bool top_keys(struct top *t) {
  int ch;
  while ((ch = getch()) != ERR) {
    if (ch == 'q' || ch == 'Q') return false;
    size_t page = t->tag_rows ? t->tag_rows : 1, was = t->tag_first;
    if ((ch == KEY_NPAGE || ch == ' ') && t->tag_first < SIZE_MAX - page) t->tag_first += page;
    else if (ch == KEY_PPAGE) t->tag_first = t->tag_first > page ? t->tag_first - page : 0;
    else if (ch == KEY_HOME) t->tag_first = 0;
    else if (ch == KEY_END) t->tag_first = SIZE_MAX; /* the drawing keeps it within the list */
    if (t->tag_first != was) top_draw(t);
    if (ch == KEY_RESIZE || ch == 12 /* Ctrl-L */) {
      if (ch == 12) clearok(curscr, TRUE);
      top_draw(t);
    }
  }
  return true;
}

/* Sleep until a key, a signal or an answer, and act on it, until told to
 * quit. */
static void top_loop(struct top *t) {
  for (;;) {
    struct pollfd p[2] = {{.fd = STDIN_FILENO, .events = POLLIN}, {.fd = t->wake[0], .events = POLLIN}};
    int n = poll(p, 2, -1);
    if (quit_signal) return;
    if (n < 0 && errno != EINTR) return;
    if (n > 0 && (p[0].revents & (POLLHUP | POLLERR | POLLNVAL))) return; /* no terminal */
    if (n > 0 && (p[1].revents & POLLIN)) {
      char buf[64];
      while (read(t->wake[0], buf, sizeof buf) > 0) {}
      if (top_take(t)) top_draw(t);
    }
    if (!top_keys(t)) return;
  }
}

/* Check the terminal, start curses and the watch, run until quit, and
 * leave the terminal as it was. */
int top_run(const char *socket_path, uid_t owner, uint64_t interval_ms) {
  if (!isatty(STDIN_FILENO) || !isatty(STDOUT_FILENO)) {
    fprintf(stderr, "gpumemctl: top needs a terminal (its %s is not one); use status or "
                    "status --json\n", isatty(STDIN_FILENO) ? "stdout" : "stdin");
    return 2;
  }
  setlocale(LC_CTYPE, "");
  utf8_term = strcmp(nl_langinfo(CODESET), "UTF-8") == 0;
  struct top t = {.interval_ms = interval_ms, .wake = {-1, -1}};
  t.socket_shown = socket_path && *socket_path ? socket_path : getenv("GPUMEM_SOCKET");
  if (!t.socket_shown || !*t.socket_shown) t.socket_shown = GPUMEM_DEFAULT_SOCKET;
  if (pipe2(t.wake, O_CLOEXEC | O_NONBLOCK) < 0) {
    fprintf(stderr, "gpumemctl: top: pipe: %s\n", strerror(errno));
    return 1;
  }
  /* Ask terminfo first: newterm, failing on a type it does not know,
   * leaks what it made for the screen. */
  int terr = 0;
  bool known = setupterm(NULL, STDOUT_FILENO, &terr) == OK;
  if (known) del_curterm(cur_term);
  struct sigaction old[3];
  top_signals(old);
  SCREEN *scr = known ? newterm(NULL, stdout, stdin) : NULL;
  if (!scr) {
    top_signals_restore(old);
    fprintf(stderr, "gpumemctl: top: cannot drive terminal type '%s'\n",
            getenv("TERM") ? getenv("TERM") : "");
    close(t.wake[0]);
    close(t.wake[1]);
    return 2;
  }
  pthread_mutex_init(&t.mu, NULL);
  set_term(scr);
  cbreak();
  noecho();
  keypad(stdscr, TRUE);
  nodelay(stdscr, TRUE);
  curs_set(0);
  top_colors();
  top_draw(&t);
  watch *w = NULL;
  int rc = watch_start(socket_path, owner, "gpumemctl top", 0, interval_ms, top_receive, &t, &w);
  if (rc == 0) top_loop(&t);
  endwin();
  delscreen(scr);
  top_signals_restore(old);
  watch_stop(w);
  if (rc < 0) fprintf(stderr, "gpumemctl: top: cannot start its thread: %s\n", strerror(-rc));
  gpumem_status_free(t.s);
  gpumem_status_free(t.next);
  close(t.wake[0]);
  close(t.wake[1]);
  pthread_mutex_destroy(&t.mu);
  return rc < 0 ? 1 : 0;
}

#endif
