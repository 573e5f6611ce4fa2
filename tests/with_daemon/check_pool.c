/* Sub-allocation (gpumem_malloc and co.) and the default client's entry
 * points, against a real daemon on the host backend: the test process is
 * the worker, a second client in it is the controller. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpumem.h"
#include "harness.h"

#define KiB (1ull << 10)
#define MiB (1ull << 20)

static struct daemon d;

/* Stop the test's daemon and check that no fd leaked. */
static void teardown(void) { harness_daemon_teardown(&d); }

/* Connect in a role (workers with their event thread). */
static gpumem_client *client(int role) {
  gpumem_client *c = NULL;
  ck_assert_int_eq(gpumem_connect(d.socket, role == GPUMEM_ROLE_WORKER ? "w" : "ctl", role,
                                  role == GPUMEM_ROLE_WORKER ? 0 : GPUMEM_CONNECT_NO_THREAD, &c),
                   0);
  return c;
}

/* Start the test's daemon and connect a worker to it. */
static gpumem_client *fresh_worker(void) {
  daemon_start(&d, NULL);
  return client(GPUMEM_ROLE_WORKER);
}

/* fresh_worker, its connection events recorded in e. */
static gpumem_client *fresh_watched_worker(struct conn_events *e) {
  gpumem_client *w = fresh_worker();
  conn_events_watch(e, w);
  return w;
}

/* Free each of n allocations (each free must succeed). */
static void free_each(gpumem_client *w, void *const *p, size_t n) {
  for (size_t k = 0; k < n; k++) ck_assert_int_eq(gpumem_free_ptr(w, p[k]), 0);
}

/* The client's pool figures. */
static struct gpumem_pool_stats stats(gpumem_client *c) {
  struct gpumem_pool_stats s = {.size = sizeof s};
  ck_assert_int_eq(gpumem_pool_stats(c, &s), 0);
  return s;
}

/* The pattern byte at offset i of allocation k. */
static unsigned char pat(size_t k, size_t i) { return (unsigned char)(k * 37 + i * 11 + (i >> 9)); }

/* Write allocation k's pattern over n bytes. */
static void fill(void *p, size_t k, size_t n) {
  unsigned char *b = p;
  for (size_t i = 0; i < n; i++) b[i] = pat(k, i);
}

/* True if n bytes hold allocation k's pattern. */
static bool holds(const void *p, size_t k, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i] != pat(k, i)) return false;
  return true;
}

/* Bytes of the host backend's memory the daemon and this process hold. */
static uint64_t held(void) {
  pid_t pids[2] = {d.pid, getpid()};
  return memfd_bytes(pids, 2);
}

/* A tag in a status, or NULL. */
static const struct gpumem_tag_status *tag_in(const struct gpumem_status *s, const char *name) {
  for (size_t i = 0; i < s->ntags; i++)
    if (!strcmp(s->tags[i]->name, name)) return s->tags[i];
  return NULL;
}

/* Pause or resume one tag for the whole node. */
static int op(gpumem_client *ctl, bool resume, const char *tag, uint64_t *bytes) {
  struct gpumem_op_report *r = NULL;
  int rc = resume ? gpumem_resume(ctl, &tag, 1, NULL, 0, NULL, &r)
                  : gpumem_pause(ctl, &tag, 1, NULL, 0, NULL, &r);
  if (bytes) *bytes = r ? r->bytes : 0;
  gpumem_op_report_free(r);
  return rc;
}

/* Many sizes, odd ones too: every allocation is aligned, none overlaps
 * another (each keeps its own pattern), and they share a few slabs. */
START_TEST(mallocs_are_aligned_and_disjoint) {
  gpumem_client *w = fresh_worker();
  enum { N = 200 };
  static void *p[N];
  static size_t len[N];
  unsigned seed = 7;
  for (size_t k = 0; k < N; k++) {
    seed = seed * 1103515245u + 12345u;
    len[k] = 1 + (seed >> 8) % (2 * MiB);
    ck_assert_int_eq(gpumem_malloc(w, "kv", 0, len[k], 0, &p[k]), 0);
    ck_assert_uint_eq((uintptr_t)p[k] % 512, 0);
    fill(p[k], k, len[k]);
  }
  /* Free every other one, allocate again into the holes. */
  for (size_t k = 0; k < N; k += 2) ck_assert_int_eq(gpumem_free_ptr(w, p[k]), 0);
  for (size_t k = 0; k < N; k += 2) {
    ck_assert_int_eq(gpumem_malloc(w, "kv", 0, len[k], 0, &p[k]), 0);
    fill(p[k], k + N, len[k]);
  }
  for (size_t k = 0; k < N; k++) ck_assert(holds(p[k], k % 2 ? k : k + N, len[k]));
  struct gpumem_pool_stats s = stats(w);
  ck_assert_uint_eq(s.allocations, N);
  ck_assert_uint_le(s.daemon_allocs, 3); /* ~200 MiB in slabs of 64, 128, 256 MiB */
  ck_assert_uint_eq(s.daemon_allocs, s.pooled_buffers);
  uint64_t sum = 0;
  for (size_t k = 0; k < N; k++) sum += (len[k] + 511) / 512 * 512;
  ck_assert_uint_eq(s.allocated_bytes, sum);
  free_each(w, p, N);
  s = stats(w);
  ck_assert_uint_eq(s.allocations, 0);
  ck_assert_uint_eq(s.allocated_bytes, 0);
  ck_assert_uint_eq(s.pooled_buffers, 1); /* one empty slab kept */
  gpumem_disconnect(w);
}
END_TEST

/* Bad arguments fail with INVALID and leave no pool or buffer behind. */
START_TEST(bad_mallocs_are_refused) {
  gpumem_client *w = fresh_worker();
  void *p = (void *)&p;
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, 0, 0, &p), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, 4096, GPUMEM_IPC_LEGACY, &p), GPUMEM_E_INVALID);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "GPUMEM_BACKUP"));
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, 4096, 64, &p), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_malloc(w, "kv cache", 0, 4096, 0, &p), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_malloc(w, NULL, 0, 4096, 0, &p), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_malloc(w, "kv", -1, 4096, 0, &p), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 9, 4096, 0, &p), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, UINT64_MAX, 0, &p), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, 4096, 0, NULL), GPUMEM_E_INVALID);
  ck_assert_ptr_eq(p, (void *)&p);
  /* More than the device has: the daemon's answer, nothing kept. */
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, 5ull << 30, 0, &p), GPUMEM_E_INVALID);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "larger than device"));
  struct gpumem_pool_stats s = stats(w);
  ck_assert_uint_eq(s.pooled_buffers + s.allocations + s.daemon_allocs, 0);
  struct gpumem_pool_stats small = {.size = 0};
  ck_assert_int_eq(gpumem_pool_stats(w, &small), GPUMEM_E_INVALID);
  struct gpumem_list *l;
  ck_assert_int_eq(gpumem_list(w, &l), 0);
  ck_assert_uint_eq(l->nbuffers, 0);
  gpumem_list_free(l);
  gpumem_disconnect(w);
}
END_TEST

/* Pointers that are not an allocation's start fail with NOT_FOUND and
 * free nothing: unknown ones, a second free, an inside pointer, the base
 * of a slab; a gpumem_alloc buffer's start frees the buffer. */
START_TEST(free_ptr_frees_only_what_starts_there) {
  gpumem_client *w = fresh_worker();
  void *a, *b;
  ck_assert_int_eq(gpumem_free_ptr(w, &a), GPUMEM_E_NOT_FOUND); /* before any pool */
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, MiB, 0, &a), 0);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, MiB, 0, &b), 0);
  ck_assert_int_eq(gpumem_free_ptr(w, &a), GPUMEM_E_NOT_FOUND);
  ck_assert_int_eq(gpumem_free_ptr(w, NULL), GPUMEM_E_NOT_FOUND);
  ck_assert_int_eq(gpumem_free_ptr(w, (char *)b + 512), GPUMEM_E_NOT_FOUND);
  ck_assert_int_eq(gpumem_free_ptr(w, a), 0);
  ck_assert_int_eq(gpumem_free_ptr(w, a), GPUMEM_E_NOT_FOUND);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "no allocation starts at"));
  /* a was at the slab's start: the slab is not the caller's to free. */
  ck_assert_int_eq(gpumem_free_ptr(w, a), GPUMEM_E_NOT_FOUND);
  struct gpumem_pool_stats s = stats(w);
  ck_assert_uint_eq(s.allocations, 1);
  ck_assert_uint_eq(s.pooled_buffers, 1);
  gpumem_buffer *buf;
  ck_assert_int_eq(gpumem_alloc(w, "weights", 0, 4 * MiB, 0, &buf), 0);
  ck_assert_int_eq(gpumem_free_ptr(w, gpumem_buffer_ptr(buf)), 0);
  struct gpumem_list *l;
  ck_assert_int_eq(gpumem_list(w, &l), 1); /* the slab alone */
  ck_assert_str_eq(l->buffers[0]->tag, "kv");
  gpumem_list_free(l);
  ck_assert_int_eq(gpumem_free_ptr(w, b), 0);
  gpumem_disconnect(w);
}
END_TEST

/* A pause of the tag from a controller releases every pooled byte (the
 * kernel's figure drops to 0), BACKUP contents and addresses survive the
 * resume, and a paused tag gives memory only to ALLOW_PAUSED. */
START_TEST(pause_releases_pooled_memory_and_resume_keeps_it) {
  daemon_start(&d, NULL);
  gpumem_client *w = client(GPUMEM_ROLE_WORKER), *ctl = client(GPUMEM_ROLE_CONTROLLER);
  enum { N = 40 };
  void *p[N];
  size_t len[N];
  for (size_t k = 0; k < N; k++) {
    len[k] = (k + 1) * 97 * KiB;
    ck_assert_int_eq(gpumem_malloc(w, "weights", 0, len[k], GPUMEM_BACKUP, &p[k]), 0);
    fill(p[k], k, len[k]);
  }
  struct gpumem_pool_stats s = stats(w);
  ck_assert_uint_eq(held(), s.pooled_bytes);
  uint64_t bytes;
  ck_assert_int_eq(op(ctl, false, "weights", &bytes), 0);
  ck_assert_uint_eq(bytes, s.pooled_bytes);
  ck_assert_uint_eq(held(), 0);
  struct gpumem_status *st;
  ck_assert_int_eq(gpumem_status(ctl, &st), 0);
  ck_assert_uint_eq(tag_in(st, "weights")->paused_bytes, s.pooled_bytes);
  gpumem_status_free(st);
  void *q;
  ck_assert_int_eq(gpumem_malloc(w, "weights", 0, MiB, GPUMEM_BACKUP, &q), GPUMEM_E_TAG_PAUSED);
  ck_assert_int_eq(gpumem_malloc(w, "weights", 0, MiB, GPUMEM_BACKUP | GPUMEM_ALLOW_PAUSED, &q),
                   0);
  ck_assert_uint_eq(held(), 0);
  ck_assert_int_eq(op(ctl, true, "weights", &bytes), 0);
  ck_assert_uint_eq(bytes, s.pooled_bytes);
  ck_assert_uint_eq(held(), s.pooled_bytes);
  for (size_t k = 0; k < N; k++) ck_assert_msg(holds(p[k], k, len[k]), "allocation %zu", k);
  fill(q, N, MiB);
  free_each(w, p, N);
  ck_assert(holds(q, N, MiB));
  ck_assert_int_eq(gpumem_free_ptr(w, q), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* Freeing keeps one empty slab per pool (the larger); trim gives it back
 * and the daemon's memory drops with it. */
START_TEST(trim_gives_empty_slabs_back) {
  gpumem_client *w = fresh_worker();
  void *p[3];
  for (int k = 0; k < 3; k++) ck_assert_int_eq(gpumem_malloc(w, "kv", 0, 40 * MiB, 0, &p[k]), 0);
  struct gpumem_pool_stats s = stats(w);
  ck_assert_uint_eq(s.pooled_buffers, 2); /* 64 MiB, then 128 MiB */
  ck_assert_uint_eq(s.pooled_bytes, 192 * MiB);
  ck_assert_uint_eq(s.daemon_allocs, 2);
  ck_assert_uint_eq(held(), 192 * MiB);
  free_each(w, p, 3);
  s = stats(w);
  ck_assert_uint_eq(s.pooled_buffers, 1);
  ck_assert_uint_eq(s.pooled_bytes, 128 * MiB);
  ck_assert_uint_eq(held(), 128 * MiB);
  ck_assert_int_eq(gpumem_trim(w), 128 * MiB);
  ck_assert_uint_eq(stats(w).pooled_bytes, 0);
  ck_assert_uint_eq(held(), 0);
  ck_assert_int_eq(gpumem_trim(w), 0);
  /* The pool grows on from where it was. */
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, MiB, 0, &p[0]), 0);
  ck_assert_uint_eq(stats(w).pooled_bytes, 256 * MiB);
  ck_assert_int_eq(gpumem_trim(w), 0); /* not empty */
  ck_assert_int_eq(gpumem_free_ptr(w, p[0]), 0);
  gpumem_disconnect(w);
}
END_TEST

/* A device without room for the next slab still serves a request that
 * fits: the slab shrinks to it; beyond that, the daemon's OUT_OF_MEMORY. */
START_TEST(slab_shrinks_to_fit_a_full_device) {
  daemon_start(&d, "--host-device-size", "96M", NULL);
  gpumem_client *w = client(GPUMEM_ROLE_WORKER);
  void *a, *b, *c = (void *)&c;
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, 40 * MiB, 0, &a), 0);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, 30 * MiB, 0, &b), 0);
  struct gpumem_pool_stats s = stats(w);
  ck_assert_uint_eq(s.pooled_buffers, 2);
  ck_assert_uint_eq(s.pooled_bytes, 94 * MiB); /* 64 MiB, then 30 MiB, not 128 MiB */
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, 30 * MiB, 0, &c), GPUMEM_E_OUT_OF_MEMORY);
  ck_assert_ptr_eq(c, (void *)&c);
  ck_assert_uint_eq(stats(w).daemon_allocs, 2);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, 20 * MiB, 0, &c), 0); /* the first slab's rest */
  ck_assert_uint_eq(stats(w).daemon_allocs, 2);
  free_each(w, (void *[]){a, b, c}, 3);
  gpumem_disconnect(w);
}
END_TEST

/* While the daemon is away, a free that empties a slab keeps the slab
 * (the daemon cannot take it); the new daemon adopts every slab, the
 * allocations stay usable, and trim then gives the empty ones back. */
START_TEST(slabs_survive_a_daemon_restart) {
  struct conn_events e;
  gpumem_client *w = fresh_watched_worker(&e);
  void *p[3];
  for (int k = 0; k < 3; k++) {
    ck_assert_int_eq(gpumem_malloc(w, "kv", 0, 40 * MiB, 0, &p[k]), 0);
    fill(p[k], k, 40 * MiB);
  }
  ck_assert_int_eq(gpumem_free_ptr(w, p[0]), 0); /* the 64 MiB slab: empty, kept */
  kill(d.pid, SIGKILL);
  waitpid(d.pid, NULL, 0);
  ck_assert(conn_events_wait(&e, 1, 0));
  /* Empties the 128 MiB slab: the smaller empty one would go back, but
   * there is no daemon to take it. */
  ck_assert_int_eq(gpumem_free_ptr(w, p[1]), 0);
  ck_assert_int_eq(gpumem_free_ptr(w, p[2]), 0);
  struct gpumem_pool_stats s = stats(w);
  ck_assert_uint_eq(s.allocations, 0);
  ck_assert_uint_eq(s.pooled_buffers, 2);
  ck_assert_int_eq(gpumem_trim(w), GPUMEM_E_DISCONNECTED);
  ck_assert_uint_eq(stats(w).pooled_buffers, 2);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, 40 * MiB, 0, &p[0]), 0); /* from a kept slab */
  ck_assert_uint_eq(stats(w).daemon_allocs, 2);
  fill(p[0], 9, 40 * MiB);
  d.pid = daemon_spawn(d.socket, d.log, NULL);
  ck_assert(conn_events_wait(&e, 0, 1));
  ck_assert_uint_eq(e.count, 2);
  ck_assert(holds(p[0], 9, 40 * MiB));
  pid_t dp = d.pid;
  ck_assert_uint_eq(memfd_bytes(&dp, 1), 192 * MiB);
  ck_assert_int_eq(gpumem_trim(w), 128 * MiB); /* p[0] is in the 64 MiB one (best fit) */
  ck_assert_uint_eq(memfd_bytes(&dp, 1), 64 * MiB);
  ck_assert_int_eq(gpumem_free_ptr(w, p[0]), 0);
  ck_assert_int_eq(gpumem_trim(w), 64 * MiB);
  ck_assert_uint_eq(memfd_bytes(&dp, 1), 0);
  gpumem_disconnect(w);
}
END_TEST

/* Pools are per tag, device and BACKUP flag: each is its own buffer. */
START_TEST(pools_split_by_tag_device_and_backup) {
  gpumem_client *w = fresh_worker();
  void *p[4];
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, MiB, 0, &p[0]), 0);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 1, MiB, 0, &p[1]), 0);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, MiB, GPUMEM_BACKUP, &p[2]), 0);
  ck_assert_int_eq(gpumem_malloc(w, "act", 0, MiB, 0, &p[3]), 0);
  struct gpumem_list *l;
  ck_assert_int_eq(gpumem_list(w, &l), 4);
  int backups = 0, dev1 = 0, act = 0;
  for (size_t i = 0; i < l->nbuffers; i++) {
    backups += (l->buffers[i]->flags & GPUMEM_BACKUP) != 0;
    dev1 += l->buffers[i]->device == 1;
    act += !strcmp(l->buffers[i]->tag, "act");
  }
  ck_assert_int_eq(backups, 1);
  ck_assert_int_eq(dev1, 1);
  ck_assert_int_eq(act, 1);
  gpumem_list_free(l);
  free_each(w, p, 4);
  gpumem_disconnect(w);
}
END_TEST

/* One churning thread's client, number and verdict. */
struct churn {
  gpumem_client *w;
  unsigned id;
  bool ok;
};

/* One thread's mallocs and frees, each allocation checked before its free. */
static void *churn(void *arg) {
  struct churn *t = arg;
  enum { LIVE = 16, OPS = 1500 };
  void *p[LIVE] = {0};
  size_t len[LIVE] = {0}, key[LIVE] = {0};
  unsigned seed = t->id * 7919 + 1;
  t->ok = true;
  for (size_t op = 0; op < OPS && t->ok; op++) {
    seed = seed * 1103515245u + 12345u;
    size_t i = (seed >> 8) % LIVE;
    if (p[i]) {
      t->ok = holds(p[i], key[i], len[i]) && gpumem_free_ptr(t->w, p[i]) == 0;
      p[i] = NULL;
    } else {
      len[i] = 512 + (seed >> 4) % (512 * KiB);
      key[i] = t->id * 100000 + op;
      t->ok = gpumem_malloc(t->w, "kv", 0, len[i], 0, &p[i]) == 0;
      if (t->ok) fill(p[i], key[i], len[i]);
    }
  }
  for (size_t i = 0; i < LIVE; i++)
    if (p[i] && !(holds(p[i], key[i], len[i]) && gpumem_free_ptr(t->w, p[i]) == 0))
      t->ok = false;
  return NULL;
}

/* Four threads allocating and freeing at once never share memory. */
START_TEST(threads_malloc_and_free_concurrently) {
  gpumem_client *w = fresh_worker();
  pthread_t th[4];
  struct churn t[4];
  for (unsigned i = 0; i < 4; i++) {
    t[i] = (struct churn){.w = w, .id = i};
    ck_assert_int_eq(pthread_create(&th[i], NULL, churn, &t[i]), 0);
  }
  for (unsigned i = 0; i < 4; i++) {
    pthread_join(th[i], NULL);
    ck_assert_msg(t[i].ok, "thread %u: %s", i, gpumem_last_error());
  }
  struct gpumem_pool_stats s = stats(w);
  ck_assert_uint_eq(s.allocations, 0);
  ck_assert_uint_eq(s.allocated_bytes, 0);
  gpumem_disconnect(w);
}
END_TEST

/* Disconnecting with live allocations unmaps them here and the daemon
 * frees their slabs (no fd leaks: the fixture counts). */
START_TEST(disconnect_with_live_allocations_frees_everything) {
  daemon_start(&d, NULL);
  gpumem_client *w = client(GPUMEM_ROLE_WORKER), *ctl = client(GPUMEM_ROLE_CONTROLLER);
  void *p;
  for (int k = 0; k < 50; k++) ck_assert_int_eq(gpumem_malloc(w, "kv", k % 2, 3 * MiB, 0, &p), 0);
  ck_assert_uint_gt(held(), 0);
  gpumem_disconnect(w);
  pid_t self = getpid();
  ck_assert_uint_eq(memfd_bytes(&self, 1), 0);
  /* The daemon frees them when it sees the session end. */
  double end = now_ms() + 5000;
  uint64_t managed = 1;
  while (managed && now_ms() < end) {
    struct gpumem_status *st;
    ck_assert_int_eq(gpumem_status(ctl, &st), 0);
    managed = 0;
    for (size_t i = 0; i < st->ndevices; i++) managed += st->devices[i]->managed;
    gpumem_status_free(st);
  }
  ck_assert_uint_eq(managed, 0);
  ck_assert_uint_eq(held(), 0);
  gpumem_disconnect(ctl);
}
END_TEST

/* The tag another thread sees. */
static void *other_thread_tag(void *arg) {
  (void)arg;
  return (void *)gpumem_thread_tag(NULL);
}

/* The buffers of a list by tag: how many, and how many with BACKUP. */
static int count_tag(gpumem_client *c, const char *tag, int *backup) {
  struct gpumem_list *l;
  ck_assert_int_ge(gpumem_list(c, &l), 0);
  int n = 0;
  *backup = 0;
  for (size_t i = 0; i < l->nbuffers; i++)
    if (!strcmp(l->buffers[i]->tag, tag)) {
      n++;
      *backup += (l->buffers[i]->flags & GPUMEM_BACKUP) != 0;
    }
  gpumem_list_free(l);
  return n;
}

/* The CUDAPluggableAllocator entry points: the thread's tag and flags,
 * else $GPUMEM_DEFAULT_TAG and $GPUMEM_DEFAULT_FLAGS, else "default";
 * tags are per thread. */
START_TEST(torch_entry_points_follow_the_thread_tag) {
  gpumem_client *w = fresh_worker();
  gpumem_set_default_client(w);
  ck_assert_ptr_eq(gpumem_default_client(), w);
  ck_assert_ptr_null(gpumem_torch_alloc(0, 0, NULL));
  unsetenv("GPUMEM_DEFAULT_TAG");
  void *a = gpumem_torch_alloc(3 * MiB, 0, NULL);
  ck_assert_ptr_nonnull(a);
  int backup;
  ck_assert_int_eq(count_tag(w, "default", &backup), 1);
  ck_assert_int_eq(gpumem_set_thread_tag("bad tag", 0), GPUMEM_E_INVALID);
  ck_assert_int_eq(gpumem_set_thread_tag("kv", GPUMEM_IPC_LEGACY), GPUMEM_E_INVALID);
  ck_assert_ptr_null(gpumem_thread_tag(NULL));
  ck_assert_int_eq(gpumem_set_thread_tag("kv", GPUMEM_BACKUP), 0);
  unsigned flags;
  ck_assert_str_eq(gpumem_thread_tag(&flags), "kv");
  ck_assert_uint_eq(flags, GPUMEM_BACKUP);
  pthread_t th;
  void *seen = (void *)1;
  ck_assert_int_eq(pthread_create(&th, NULL, other_thread_tag, NULL), 0);
  pthread_join(th, &seen);
  ck_assert_ptr_null(seen);
  void *b = gpumem_torch_alloc(MiB, 1, NULL);
  ck_assert_ptr_nonnull(b);
  ck_assert_int_eq(count_tag(w, "kv", &backup), 1);
  ck_assert_int_eq(backup, 1);
  ck_assert_int_eq(gpumem_set_thread_tag(NULL, 0), 0);
  ck_assert_ptr_null(gpumem_thread_tag(&flags));
  ck_assert_uint_eq(flags, 0);
  setenv("GPUMEM_DEFAULT_TAG", "weights", 1);
  setenv("GPUMEM_DEFAULT_FLAGS", "backup", 1);
  void *c = gpumem_torch_alloc(MiB, 0, NULL);
  ck_assert_ptr_nonnull(c);
  ck_assert_int_eq(count_tag(w, "weights", &backup), 1);
  ck_assert_int_eq(backup, 1);
  setenv("GPUMEM_DEFAULT_FLAGS", "backup,sparkly", 1);
  ck_assert_ptr_null(gpumem_torch_alloc(MiB, 0, NULL));
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "sparkly"));
  unsetenv("GPUMEM_DEFAULT_FLAGS");
  ck_assert_ptr_null(gpumem_torch_alloc(MiB, 7, NULL)); /* no such device */
  gpumem_torch_free(a, 3 * MiB, 0, NULL);
  gpumem_torch_free(b, MiB, 1, NULL);
  gpumem_torch_free(c, MiB, 0, NULL);
  gpumem_torch_free(NULL, 0, 0, NULL);
  ck_assert_uint_eq(stats(w).allocations, 0);
  gpumem_torch_free(c, MiB, 0, NULL); /* a second free changes nothing */
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "no allocation starts at"));
  gpumem_set_default_client(NULL);
  gpumem_disconnect(w);
}
END_TEST

/* In a child process, so that the connection it makes goes with it: the
 * default client connects on first use to $GPUMEM_SOCKET as pid-<pid>,
 * once; with no daemon it answers NULL and says why. Exit status: the
 * number of the first step that failed. */
static int default_client_child(const char *socket) {
  setenv("GPUMEM_SOCKET", "/nonexistent/gpumemd.sock", 1);
  if (gpumem_default_client()) return 1;
  if (!strstr(gpumem_last_error(), "no default gpumem client")) return 2;
  if (gpumem_torch_alloc(MiB, 0, NULL)) return 3;
  setenv("GPUMEM_SOCKET", socket, 1);
  double end = now_ms() + 5000; /* the retry comes after a second */
  gpumem_client *c = NULL;
  while (!c && now_ms() < end) {
    usleep(10000);
    c = gpumem_default_client();
  }
  if (!c || gpumem_default_client() != c) return 4;
  void *p = gpumem_torch_alloc(MiB, 0, NULL);
  if (!p) return 5;
  struct gpumem_list *l;
  char name[32];
  snprintf(name, sizeof name, "pid-%d", (int)getpid());
  struct gpumem_status *st;
  if (gpumem_status(c, &st) < 0) return 6;
  bool named = st->nsessions == 1 && !strcmp(st->sessions[0]->name, name);
  gpumem_status_free(st);
  if (!named) return 7;
  if (gpumem_list(c, &l) != 1 || strcmp(l->buffers[0]->tag, "default")) return 8;
  gpumem_list_free(l);
  gpumem_torch_free(p, MiB, 0, NULL);
  struct gpumem_pool_stats s = {.size = sizeof s};
  return gpumem_pool_stats(c, &s) == 0 && s.allocations == 0 ? 0 : 9;
}

/* The default client connects on first use (in a child process). */
START_TEST(default_client_connects_on_first_use) {
  daemon_start(&d, NULL);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) _exit(default_client_child(d.socket));
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child failed at step %d",
                WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}
END_TEST

/* The buffers hooks were given. */
struct seen {
  pthread_mutex_t mu;
  gpumem_buffer *bufs[8];
  size_t n;
};

/* A pre-unmap hook that remembers its buffers. */
static void remember(gpumem_client *c, gpumem_buffer *const *bufs, size_t n, void *user) {
  (void)c;
  struct seen *s = user;
  pthread_mutex_lock(&s->mu);
  for (size_t i = 0; i < n && s->n < 8; i++) s->bufs[s->n++] = bufs[i];
  pthread_mutex_unlock(&s->mu);
}

/* A pool buffer, as hooks show it, is not the caller's to free:
 * gpumem_free refuses it and the allocations in it live on; its address
 * given to gpumem_free_ptr frees the allocation that starts there, never
 * the pool buffer. */
START_TEST(pool_buffers_refuse_gpumem_free) {
  daemon_start(&d, NULL);
  gpumem_client *w = client(GPUMEM_ROLE_WORKER), *ctl = client(GPUMEM_ROLE_CONTROLLER);
  void *p, *q;
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, MiB, GPUMEM_BACKUP, &p), 0);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, MiB, GPUMEM_BACKUP, &q), 0);
  fill(p, 1, MiB);
  fill(q, 2, MiB);
  struct seen seen = {.mu = PTHREAD_MUTEX_INITIALIZER};
  gpumem_set_hooks(w, remember, NULL, &seen);
  ck_assert_int_eq(op(ctl, false, "kv", NULL), 0);
  ck_assert_int_eq(op(ctl, true, "kv", NULL), 0);
  pthread_mutex_lock(&seen.mu);
  size_t n = seen.n;
  gpumem_buffer *slab = seen.bufs[0];
  pthread_mutex_unlock(&seen.mu);
  ck_assert_uint_eq(n, 1);
  ck_assert_ptr_eq(gpumem_buffer_ptr(slab), p); /* the first allocation starts the slab */
  ck_assert_int_eq(gpumem_free(w, slab), GPUMEM_E_INVALID);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "belongs to the gpumem_malloc pool"));
  ck_assert(gpumem_buffer_mapped(slab));
  ck_assert(holds(p, 1, MiB));
  ck_assert(holds(q, 2, MiB));
  ck_assert_uint_eq(stats(w).allocations, 2);
  ck_assert_int_eq(gpumem_free_ptr(w, gpumem_buffer_ptr(slab)), 0); /* that is p */
  struct gpumem_pool_stats s = stats(w);
  ck_assert_uint_eq(s.allocations, 1);
  ck_assert_uint_eq(s.pooled_buffers, 1);
  ck_assert(holds(q, 2, MiB));
  ck_assert_int_eq(gpumem_free_ptr(w, p), GPUMEM_E_NOT_FOUND);
  ck_assert_uint_eq(stats(w).pooled_buffers, 1);
  ck_assert_int_eq(gpumem_free_ptr(w, q), 0);
  gpumem_disconnect(ctl);
  gpumem_disconnect(w);
}
END_TEST

/* The torch entry points free each pointer through the client that
 * allocated it, whatever the default is by then; disconnecting a client
 * forgets its pointers and its place as the default. */
START_TEST(torch_frees_go_to_the_allocating_client) {
  daemon_start(&d, NULL);
  gpumem_client *a = client(GPUMEM_ROLE_WORKER), *b = client(GPUMEM_ROLE_WORKER);
  unsetenv("GPUMEM_DEFAULT_TAG");
  unsetenv("GPUMEM_DEFAULT_FLAGS");
  gpumem_set_default_client(a);
  void *pa = gpumem_torch_alloc(MiB, 0, NULL);
  ck_assert_ptr_nonnull(pa);
  gpumem_set_default_client(b);
  void *pb = gpumem_torch_alloc(MiB, 0, NULL);
  ck_assert_ptr_nonnull(pb);
  ck_assert_uint_eq(stats(a).allocations, 1);
  ck_assert_uint_eq(stats(b).allocations, 1);
  gpumem_torch_free(pa, MiB, 0, NULL);
  ck_assert_uint_eq(stats(a).allocations, 0);
  ck_assert_uint_eq(stats(b).allocations, 1);
  gpumem_disconnect(b); /* the default, with pb live */
  gpumem_torch_free(pb, MiB, 0, NULL);
  ck_assert_ptr_nonnull(strstr(gpumem_last_error(), "no default gpumem client"));
  ck_assert_uint_eq(stats(a).allocations, 0);
  gpumem_disconnect(a);
}
END_TEST

/* Pool buffers that a restarted daemon did not re-register (their device
 * is gone from it) serve no allocation, even with GPUMEM_ALLOW_PAUSED: a
 * pause could not release them. They stay mapped for the allocations
 * already in them; pools the new daemon took serve as before. */
START_TEST(slabs_a_restarted_daemon_did_not_take_serve_nothing) {
  struct conn_events e;
  gpumem_client *w = fresh_watched_worker(&e);
  void *p0, *p1, *q;
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, MiB, 0, &p0), 0);
  ck_assert_int_eq(gpumem_malloc(w, "kv", 1, MiB, 0, &p1), 0);
  fill(p1, 1, MiB);
  kill(d.pid, SIGKILL);
  waitpid(d.pid, NULL, 0);
  ck_assert(conn_events_wait(&e, 1, 0));
  const char *one_device[] = {"--host-devices", "1", NULL};
  d.pid = daemon_spawn(d.socket, d.log, one_device);
  ck_assert(conn_events_wait(&e, 0, 1));
  ck_assert_uint_eq(e.count, 1);
  ck_assert_int_ne(gpumem_malloc(w, "kv", 1, MiB, 0, &q), 0);
  ck_assert_int_ne(gpumem_malloc(w, "kv", 1, MiB, GPUMEM_ALLOW_PAUSED, &q), 0);
  ck_assert(holds(p1, 1, MiB));
  ck_assert_int_eq(gpumem_malloc(w, "kv", 0, MiB, 0, &q), 0);
  ck_assert_uint_eq(stats(w).daemon_allocs, 2);
  free_each(w, (void *[]){q, p0, p1}, 3);
  gpumem_disconnect(w);
}
END_TEST

/* In a forked child of a process whose default client is parent: the
 * child gets a client of its own, connected to socket as pid-<pid>, and
 * the parent's pointer is not freed through the parent's client. Exit
 * status: the number of the first step that failed. */
static int forked_child(gpumem_client *parent, void *parents, const char *socket) {
  setenv("GPUMEM_SOCKET", socket, 1);
  gpumem_client *c = gpumem_default_client();
  if (!c) return 1;
  if (c == parent) return 2;
  void *p = gpumem_torch_alloc(MiB, 0, NULL);
  if (!p) return 3;
  struct gpumem_status *st;
  if (gpumem_status(c, &st) < 0) return 4;
  char name[32];
  snprintf(name, sizeof name, "pid-%d", (int)getpid());
  bool mine = false;
  for (size_t i = 0; i < st->nsessions; i++) mine |= !strcmp(st->sessions[i]->name, name);
  gpumem_status_free(st);
  if (!mine) return 5;
  gpumem_torch_free(parents, MiB, 0, NULL); /* not this process's: changes nothing */
  gpumem_torch_free(p, MiB, 0, NULL);
  struct gpumem_pool_stats s = {.size = sizeof s};
  if (gpumem_pool_stats(c, &s) < 0 || s.allocations != 0) return 6;
  gpumem_disconnect(c);
  return 0;
}

/* A forked child forgets the parent's default client and connects its
 * own; the parent's connection and allocations are untouched. (The
 * parent's client has no thread: TSan forbids threads in a child forked
 * from a threaded process.) */
START_TEST(forked_child_gets_its_own_default_client) {
  daemon_start(&d, NULL);
  gpumem_client *w = NULL;
  ck_assert_int_eq(
      gpumem_connect(d.socket, "w", GPUMEM_ROLE_WORKER, GPUMEM_CONNECT_NO_THREAD, &w), 0);
  unsetenv("GPUMEM_DEFAULT_TAG");
  unsetenv("GPUMEM_DEFAULT_FLAGS");
  gpumem_set_default_client(w);
  void *p = gpumem_torch_alloc(MiB, 0, NULL);
  ck_assert_ptr_nonnull(p);
  fill(p, 5, MiB);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) _exit(forked_child(w, p, d.socket));
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child failed at step %d",
                WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  ck_assert_ptr_eq(gpumem_default_client(), w);
  ck_assert(holds(p, 5, MiB));
  ck_assert_uint_eq(stats(w).allocations, 1);
  void *q = gpumem_torch_alloc(MiB, 0, NULL);
  ck_assert_ptr_nonnull(q);
  gpumem_torch_free(q, MiB, 0, NULL);
  gpumem_torch_free(p, MiB, 0, NULL);
  ck_assert_uint_eq(stats(w).allocations, 0);
  gpumem_set_default_client(NULL);
  gpumem_disconnect(w);
}
END_TEST

/* Run the suite. */
int main(void) {
  return HARNESS_RUN("pool", 60, NULL, teardown, mallocs_are_aligned_and_disjoint,
                     bad_mallocs_are_refused, free_ptr_frees_only_what_starts_there,
                     pause_releases_pooled_memory_and_resume_keeps_it,
                     trim_gives_empty_slabs_back, slab_shrinks_to_fit_a_full_device,
                     slabs_survive_a_daemon_restart,
                     pools_split_by_tag_device_and_backup,
                     threads_malloc_and_free_concurrently,
                     disconnect_with_live_allocations_frees_everything,
                     torch_entry_points_follow_the_thread_tag,
                     default_client_connects_on_first_use, pool_buffers_refuse_gpumem_free,
                     torch_frees_go_to_the_allocating_client,
                     slabs_a_restarted_daemon_did_not_take_serve_nothing,
                     forked_child_gets_its_own_default_client);
}
