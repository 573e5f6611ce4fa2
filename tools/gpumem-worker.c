/* gpumem-worker: a real worker. It allocates tagged buffers, fills each
 * with a pattern derived from its offset, and after every resume verifies
 * them: BACKUP buffers must hold their pattern, others must be writable
 * and readable again. It runs until SIGTERM or SIGINT and exits 0 only if
 * every verification passed. */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/size.h"
#include "gpumem.h"

static atomic_uint passed, failed;

/* Held while the program touches buffer memory; the pre-unmap hook takes
 * it, so memory is never unmapped under a running fill (as a GPU program
 * synchronizes its streams before a pause). */
static pthread_mutex_t use_mu = PTHREAD_MUTEX_INITIALIZER;

/* Every buffer, with the key of its pattern (its allocation number: ids
 * change when a restarted daemon re-registers buffers) and whether the
 * pattern was written (those allocated paused are not yet). Appended by
 * the main thread under use_mu, read by hooks under it. */
static struct mine {
  gpumem_buffer *b;
  uint64_t key;
  bool filled;
} *mine;
static size_t nmine;

/* The entry of a buffer, or NULL. */
static struct mine *find_mine(const gpumem_buffer *b) {
  for (size_t i = 0; i < nmine; i++)
    if (mine[i].b == b) return &mine[i];
  return NULL;
}

/* Remember a new buffer. */
static struct mine *add_mine(gpumem_buffer *b) {
  struct mine *v = realloc(mine, (nmine + 1) * sizeof *v);
  if (!v) return NULL;
  mine = v;
  mine[nmine] = (struct mine){b, nmine + 1, false};
  return &mine[nmine++];
}

#define BLOCK (1u << 20)
#define READ_PIECE (16u << 20)

/* The 32-bit value of every word in block blk of buffer k: distinct per
 * offset and per buffer. */
static uint32_t pattern(uint64_t k, uint64_t blk) {
  uint64_t x = (k << 32 | blk) * 0x9E3779B97F4A7C15ull;
  return (uint32_t)(x >> 32) ^ 0x5A5A5A5Au;
}

/* Fill a buffer with its pattern (keyed by k), on the device. */
static int fill(gpumem_client *c, gpumem_buffer *b, uint64_t k) {
  uint64_t size = gpumem_buffer_size(b);
  for (uint64_t off = 0; off < size; off += BLOCK) {
    uint64_t len = size - off < BLOCK ? size - off : BLOCK;
    if (gpumem_buffer_fill32(c, b, off, len, pattern(k, off / BLOCK)) < 0) return -1;
  }
  return 0;
}

/* Read the buffer back; the offset of the first word that differs from
 * the pattern, or -1 when all match (-2 when it could not be read). */
static long long check(gpumem_client *c, gpumem_buffer *b, uint64_t k) {
  static uint32_t piece[READ_PIECE / 4];
  uint64_t size = gpumem_buffer_size(b);
  for (uint64_t off = 0; off < size; off += READ_PIECE) {
    uint64_t len = size - off < READ_PIECE ? size - off : READ_PIECE;
    if (gpumem_buffer_read(c, b, off, piece, len) < 0) return -2;
    for (uint64_t i = 0; i < len / 4; i++)
      if (piece[i] != pattern(k, (off + i * 4) / BLOCK)) return (long long)(off + i * 4);
  }
  return -1;
}

/* Before a pause: wait for any fill in progress, then say so. */
static void on_unmap(gpumem_client *c, gpumem_buffer *const *bufs, size_t n, void *user) {
  (void)c;
  (void)user;
  pthread_mutex_lock(&use_mu);
  pthread_mutex_unlock(&use_mu);
  for (size_t i = 0; i < n; i++)
    printf("paused buffer %llu tag=%s ptr=%p\n", (unsigned long long)gpumem_buffer_id(bufs[i]),
           gpumem_buffer_tag(bufs[i]), gpumem_buffer_ptr(bufs[i]));
}

/* After a resume: verify backups, or prove the memory is usable again. */
static void on_remap(gpumem_client *c, gpumem_buffer *const *bufs, size_t n, void *user) {
  (void)user;
  pthread_mutex_lock(&use_mu);
  for (size_t i = 0; i < n; i++) {
    gpumem_buffer *b = bufs[i];
    unsigned long long id = (unsigned long long)gpumem_buffer_id(b);
    printf("resumed buffer %llu tag=%s ptr=%p\n", id, gpumem_buffer_tag(b), gpumem_buffer_ptr(b));
    struct mine *m = find_mine(b);
    if (!m) continue; /* allocated and paused before alloc returned */
    bool backup = gpumem_buffer_flags(b) & GPUMEM_BACKUP;
    if (!backup || !m->filled) {
      fill(c, b, m->key);
      m->filled = true;
      backup = false;
    }
    long long bad = check(c, b, m->key);
    if (bad != -1) {
      atomic_fetch_add(&failed, 1);
      if (bad == -2)
        printf("FAILED buffer %llu: cannot read it after resume: %s\n", id, gpumem_last_error());
      else
        printf("FAILED buffer %llu: byte %lld differs after resume\n", id, bad);
    } else {
      atomic_fetch_add(&passed, 1);
      printf("verified buffer %llu: %s\n", id, backup ? "contents kept" : "writable and readable");
    }
  }
  pthread_mutex_unlock(&use_mu);
}

/* The daemon went away or came back: say so, and after a re-registration
 * check that every mapped buffer kept its contents (the memory never left
 * this process). */
static void on_conn(gpumem_client *c, int event, int code, const char *words, size_t count,
                    void *user) {
  bool verify = *(bool *)user;
  (void)code;
  if (event == GPUMEM_CONN_LOST) {
    printf("gpumemd went away: %s\n", words);
    return;
  }
  printf("re-registered %zu buffers with gpumemd%s%s\n", count, code ? "; " : "",
         code ? words : "");
  if (!verify) return;
  pthread_mutex_lock(&use_mu);
  for (size_t i = 0; i < nmine; i++) {
    gpumem_buffer *b = mine[i].b;
    if (!mine[i].filled || !gpumem_buffer_mapped(b)) continue;
    unsigned long long id = (unsigned long long)gpumem_buffer_id(b);
    long long bad = check(c, b, mine[i].key);
    if (bad != -1) {
      atomic_fetch_add(&failed, 1);
      printf("FAILED buffer %llu: %s after the restart\n", id,
             bad == -2 ? "cannot read it" : "contents differ");
    } else {
      atomic_fetch_add(&passed, 1);
      printf("verified buffer %llu: contents kept across the restart\n", id);
    }
  }
  pthread_mutex_unlock(&use_mu);
}

static void usage(FILE *out) {
  fprintf(out, "usage: gpumem-worker [--socket PATH] --tag TAG --size SIZE [--count N]\n"
               "                     [--device D] [--backup] [--name NAME]\n"
               "                     [--no-verify] [--ipc-legacy]\n"
               "  --no-verify   do not fill or check the buffers (benchmarks)\n"
               "  --ipc-legacy  never-paused buffers (legacy IPC handles on GPUs)\n");
}

int main(int argc, char **argv) {
  const char *socket_path = NULL, *tag = NULL, *name = "gpumem-worker";
  uint64_t size = 0;
  unsigned long count = 1, device = 0;
  bool backup = false, verify = true, ipc = false;
  static const struct option opts[] = {
      {"socket", required_argument, 0, 's'}, {"tag", required_argument, 0, 't'},
      {"size", required_argument, 0, 'z'},   {"count", required_argument, 0, 'n'},
      {"device", required_argument, 0, 'd'}, {"backup", no_argument, 0, 'b'},
      {"name", required_argument, 0, 'N'},   {"help", no_argument, 0, 'h'},
      {"no-verify", no_argument, 0, 'V'},    {"ipc-legacy", no_argument, 0, 'I'},
      {0, 0, 0, 0},
  };
  int ch;
  char *end;
  while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
    switch (ch) {
    case 's': socket_path = optarg; break;
    case 't': tag = optarg; break;
    case 'z':
      if (size_parse(optarg, &size) || size == 0) {
        fprintf(stderr, "gpumem-worker: invalid size '%s'\n", optarg);
        return 2;
      }
      break;
    case 'n':
    case 'd': {
      errno = 0;
      unsigned long v = strtoul(optarg, &end, 10);
      if (errno || *end || end == optarg || v > 1000000 || (ch == 'n' && v == 0)) {
        fprintf(stderr, "gpumem-worker: invalid number '%s'\n", optarg);
        return 2;
      }
      if (ch == 'n') count = v;
      else device = v;
      break;
    }
    case 'b': backup = true; break;
    case 'V': verify = false; break;
    case 'I': ipc = true; break;
    case 'N': name = optarg; break;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (!tag || !size || optind < argc) {
    usage(stderr);
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  /* Block the signals in every thread (the library's too) and wait here. */
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, NULL);

  gpumem_client *c;
  if (gpumem_connect(socket_path, name, GPUMEM_ROLE_WORKER, 0, &c) < 0) {
    fprintf(stderr, "gpumem-worker: %s\n", gpumem_last_error());
    return 1;
  }
  if (verify) gpumem_set_hooks(c, on_unmap, on_remap, NULL);
  gpumem_set_connection_hook(c, on_conn, &verify);
  int status = 0;
  for (unsigned long i = 0; i < count; i++) {
    gpumem_buffer *b;
    unsigned flags = ipc ? GPUMEM_IPC_LEGACY : GPUMEM_ALLOW_PAUSED | (backup ? GPUMEM_BACKUP : 0);
    if (gpumem_alloc(c, tag, (int)device, size, flags, &b) < 0) {
      fprintf(stderr, "gpumem-worker: alloc: %s\n", gpumem_last_error());
      status = 1;
      break;
    }
    pthread_mutex_lock(&use_mu);
    struct mine *m = add_mine(b);
    bool mapped = gpumem_buffer_mapped(b);
    if (mapped && verify && m && fill(c, b, m->key) < 0) {
      fprintf(stderr, "gpumem-worker: fill: %s\n", gpumem_last_error());
      status = 1;
    }
    if (mapped && verify && m) m->filled = true;
    pthread_mutex_unlock(&use_mu);
    char s[32];
    printf("allocated buffer %llu tag=%s device=%lu size=%s ptr=%p%s%s\n",
           (unsigned long long)gpumem_buffer_id(b), tag, device,
           size_format(gpumem_buffer_size(b), s, sizeof s), gpumem_buffer_ptr(b),
           backup ? " backup" : "", mapped ? "" : " paused");
  }
  if (status == 0) {
    printf("ready\n");
    int sig;
    sigwait(&stop, &sig);
  }
  gpumem_disconnect(c);
  free(mine);
  unsigned p = atomic_load(&passed), f = atomic_load(&failed);
  printf("exiting: %u verifications passed, %u failed\n", p, f);
  return status ? status : f ? 1 : 0;
}
