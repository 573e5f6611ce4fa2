/* Scenes the suites with a daemon share, written once: a raw worker and a
 * raw controller on one daemon, an operation whose owner answers its
 * events, a buffer freed, a scoped request, a pattern in a buffer, a
 * stream of requests never read. Built on the harness's raw peers. */
#ifndef GPUMEM_TEST_SCENARIO_H
#define GPUMEM_TEST_SCENARIO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "harness.h"

#define MiB (1024ull * 1024ull)
#define CODE(x) GPUMEM__WIRE__ERROR_CODE__##x
#define WORKER GPUMEM__WIRE__ROLE__ROLE_WORKER
#define CONTROLLER GPUMEM__WIRE__ROLE__ROLE_CONTROLLER
#define BACKUP GPUMEM__WIRE__BUFFER_FLAG__FLAG_BACKUP

/* Teardown of a suite's daemon: stop it if it runs (the test fails unless
 * it exits 0), then fail the test if fds leaked. */
void scene_stop(struct daemon *d);

/* Connect a raw worker w, then a raw controller c, to d. */
void scene_open(struct peer *w, struct peer *c, const struct daemon *d);

/* Connect a raw worker w and a raw controller c to d, allocate w one
 * buffer b of size bytes of tag on device 0, and have c pause tag: w's
 * event for it, not answered yet. */
wire_env *scene_pausing(struct peer *w, struct peer *c, const struct daemon *d, const char *tag,
                        uint64_t size, struct pbuf *b);

/* Allocate n buffers of one tag, device, size and flags into b[0..n). */
void scene_alloc_n(struct peer *w, const char *tag, unsigned dev, uint64_t size, uint32_t flags,
                   struct pbuf *b, size_t n);

/* A pause or resume of one tag on every device by the controller c: the
 * answer, whose code the test fails unless it is want (free it with
 * wire_env_free). */
wire_env *scene_op(struct peer *c, bool resume, const char *tag, wire_code want);

/* The code of the answer to a pause or resume of one tag on every device
 * by the controller c. */
wire_code scene_op_code(struct peer *c, bool resume, const char *tag);

/* The answer to a pause or resume c sent, once its owner w answered the
 * one event for its n buffers: the reply, whose code the test fails
 * unless it is OK (free it with wire_env_free). */
wire_env *scene_answer(struct peer *c, struct peer *w, struct pbuf *bufs, size_t n);

/* A pause or resume of tag (NULL: every tag) by the controller c, its
 * owner w answering the one event for its n buffers: the reply, whose
 * code the test fails unless it is OK (free it with wire_env_free). */
wire_env *scene_served_reply(struct peer *c, struct peer *w, struct pbuf *bufs, size_t n,
                             bool resume, const char *tag);

/* scene_served_reply, the reply freed. */
void scene_served(struct peer *c, struct peer *w, struct pbuf *bufs, size_t n, bool resume,
                  const char *tag);

/* Answer an event e in hand, its fds in f, for a worker's n buffers:
 * an Unmap closes those it names, a Remap takes their new fds; then f is
 * released, e acked OK and freed. */
void scene_serve_event(struct peer *w, wire_env *e, struct frame *f, struct pbuf *bufs, size_t n);

/* Answer an event e in hand for the one buffer b: unmap it, ack OK, and
 * free e. */
void scene_unmap_ack(struct peer *w, wire_env *e, struct pbuf *b);

/* Cap process pid's fds (soft and hard limit) at those it has open now
 * plus room, the test failing unless every open fd is below the cap; the
 * fds it has open. */
int scene_cap_fds(pid_t pid, int room);

/* Free buffer id on p's session; the reply, of any kind. */
wire_env *scene_free(struct peer *p, uint64_t id);

/* Free buffer id on p's session; the reply's code. */
wire_code scene_free_code(struct peer *p, uint64_t id);

/* Which sessions a pause or resume is for, as a test writes it. */
struct scene_scope {
  bool own;
  const uint32_t *pids;
  size_t npids;
  const char *prefix;
  uint32_t timeout_ms;
};

/* Send a pause or resume of ntags tags (none: every tag) with a scope. */
void scene_send_scoped(struct peer *p, bool resume, const char *const *tags, size_t ntags,
                       const struct scene_scope *sc);

/* Write a pattern derived from seed into the first len bytes of a raw
 * buffer's first chunk. */
void scene_fill(const struct pbuf *b, uint64_t len, uint32_t seed);

/* True if the first len bytes of a raw buffer's first chunk hold the
 * pattern of seed. */
bool scene_holds(const struct pbuf *b, uint64_t len, uint32_t seed);

/* Queue n copies of a request on p, each with the next id, without
 * sending or reading anything; the first push error (0: none; the rest
 * are still pushed). */
int scene_queue(struct peer *p, wire_env *env, int n);

#endif
