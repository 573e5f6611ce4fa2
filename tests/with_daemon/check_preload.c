/* libgpumem_preload.so in front of a stand-in vendor runtime
 * (tests/preload/fake_cudart.c): an unmodified program's cudaMalloc and
 * hipMalloc are served by a real daemon on the host backend, its foreign
 * frees reach the runtime, and pausing the default tag releases the
 * memory under it. The program (tests/preload/preload_app.c) runs one
 * command per line, so the test decides when each step happens. */
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpumem.h"
#include "harness.h"

#define MiB (1ull << 20)

extern char **environ;

static struct daemon d;

/* Stop the test's daemon and check that no fd leaked. */
static void teardown(void) { harness_daemon_teardown(&d); }

/* The program under LD_PRELOAD, with pipes to its stdin and stdout. */
struct app {
  pid_t pid;
  FILE *in, *out;
  char reply[256];
};

/* Start the program at path (with argument arg unless NULL) against
 * socket, with extra "NAME=value" settings. */
static void app_startv(struct app *a, const char *path, const char *arg, const char *socket,
                       va_list ap) {
  static char preload[600], sock[600];
  snprintf(preload, sizeof preload, "LD_PRELOAD=%s", harness_built("lib/libgpumem_preload.so"));
  snprintf(sock, sizeof sock, "GPUMEM_SOCKET=%s", socket);
  const char *env[256];
  size_t n = 0;
  for (char **e = environ; *e && n < 200; e++)
    if (strncmp(*e, "GPUMEM_", 7) && strncmp(*e, "LD_PRELOAD=", 11)) env[n++] = *e;
  env[n++] = preload;
  env[n++] = sock;
#if defined(__SANITIZE_ADDRESS__)
  /* The preloaded library comes before the ASan runtime in the list. */
  env[n++] = "ASAN_OPTIONS=verify_asan_link_order=0";
#endif
  for (const char *s; n < 254 && (s = va_arg(ap, const char *));) env[n++] = s;
  env[n] = NULL;
  int to[2], from[2];
  ck_assert_int_eq(pipe2(to, O_CLOEXEC), 0);
  ck_assert_int_eq(pipe2(from, O_CLOEXEC), 0);
  a->pid = fork();
  ck_assert_int_ge(a->pid, 0);
  if (a->pid == 0) {
    dup2(to[0], 0);
    dup2(from[1], 1);
    close_range(3, ~0u, 0);
    char *argv[] = {(char *)path, (char *)(arg ? "--user" : NULL), (char *)arg, NULL};
    execve(path, argv, (char *const *)env);
    _exit(127);
  }
  close(to[0]);
  close(from[1]);
  a->in = fdopen(to[1], "w");
  a->out = fdopen(from[0], "r");
  setvbuf(a->in, NULL, _IOLBF, 0);
}

/* Start the test program (tests/preload/preload_app.c) against socket
 * with extra "NAME=value" settings (NULL-terminated). */
static void app_start(struct app *a, const char *socket, ...) {
  va_list ap;
  va_start(ap, socket);
  app_startv(a, harness_built("tests/preload_app"), NULL, socket, ap);
  va_end(ap);
}

/* Start this suite's own binary in user mode (see user_mode) against
 * socket, with extra "NAME=value" settings (NULL-terminated). */
static void user_start(struct app *a, const char *socket, ...) {
  static char self[512];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  ck_assert_int_gt(n, 0);
  self[n] = '\0';
  va_list ap;
  va_start(ap, socket);
  app_startv(a, self, harness_built("tests/libcudart_stub.so"), socket, ap);
  va_end(ap);
}

/* The next line the program writes, without the newline. */
static const char *app_line(struct app *a) {
  ck_assert_msg(fgets(a->reply, sizeof a->reply, a->out), "the program ended");
  a->reply[strcspn(a->reply, "\n")] = '\0';
  return a->reply;
}

/* Send one command; its reply line, without the newline. */
__attribute__((format(printf, 2, 3))) static const char *app_do(struct app *a, const char *fmt,
                                                               ...) {
  va_list ap;
  va_start(ap, fmt);
  vfprintf(a->in, fmt, ap);
  va_end(ap);
  fputc('\n', a->in);
  fflush(a->in);
  return app_line(a);
}

/* The program's counts of calls that reached the runtime must be these. */
static void app_counts(struct app *a, int mallocs, int frees, int stream_syncs,
                       int device_syncs) {
  char want[128];
  snprintf(want, sizeof want, "mallocs %d frees %d stream_syncs %d device_syncs %d", mallocs,
           frees, stream_syncs, device_syncs);
  ck_assert_str_eq(app_do(a, "counts"), want);
}

/* Allocate through api; the return code, and the pointer in *ptr. */
static int app_malloc(struct app *a, const char *api, uint64_t size, unsigned long *ptr) {
  int rc = -100;
  ck_assert_int_eq(sscanf(app_do(a, "malloc %s %llu", api, (unsigned long long)size),
                          "rc %d ptr %lx", &rc, ptr), 2);
  return rc;
}

/* Free through api; the return code. */
static int app_free(struct app *a, const char *api, unsigned long ptr) {
  int rc = -100;
  ck_assert_int_eq(sscanf(app_do(a, "free %s %lx", api, ptr), "rc %d", &rc), 1);
  return rc;
}

/* End the program; its exit status. */
static int app_stop(struct app *a) {
  fprintf(a->in, "quit\n");
  fclose(a->in);
  fclose(a->out);
  int status;
  ck_assert_int_eq(waitpid(a->pid, &status, 0), a->pid);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Bytes of the host backend's memory the daemon and the program hold. */
static uint64_t held(const struct app *a) {
  pid_t pids[2] = {d.pid, a->pid};
  return memfd_bytes(pids, 2);
}

/* A controller session of the test's daemon. */
static gpumem_client *controller(void) {
  gpumem_client *c = NULL;
  ck_assert_int_eq(
      gpumem_connect(d.socket, "ctl", GPUMEM_ROLE_CONTROLLER, GPUMEM_CONNECT_NO_THREAD, &c), 0);
  return c;
}

/* Start the test's daemon; a controller session of it. */
static gpumem_client *fresh_controller(void) {
  daemon_start(&d, NULL);
  return controller();
}

/* Start the test's daemon and the test program against it. */
static void fresh_app(struct app *a) {
  daemon_start(&d, NULL);
  app_start(a, d.socket, NULL);
}

/* The one buffer of a list with this tag and device (the test fails if
 * there is not exactly one); its flags, and its owner in *pid. */
static unsigned only_buffer(gpumem_client *c, const char *tag, int device, uint32_t *pid) {
  struct gpumem_list *l;
  ck_assert_int_ge(gpumem_list(c, &l), 0);
  int n = 0;
  unsigned flags = 0;
  for (size_t i = 0; i < l->nbuffers; i++)
    if (!strcmp(l->buffers[i]->tag, tag) && l->buffers[i]->device == device) {
      n++;
      flags = l->buffers[i]->flags;
      if (pid) *pid = l->buffers[i]->pid;
    }
  gpumem_list_free(l);
  ck_assert_msg(n == 1, "%d buffers of tag %s on device %d", n, tag, device);
  return flags;
}

/* cudaMalloc returns memory mapped from the daemon's memfd, listed under
 * the default tag as the program's; cudaFree waits for the device and
 * gives it back, the runtime never sees either. */
START_TEST(cuda_malloc_is_served_by_the_daemon) {
  gpumem_client *c = fresh_controller();
  struct app a;
  app_start(&a, d.socket, NULL);
  unsigned long p;
  ck_assert_int_eq(app_malloc(&a, "cuda", 8 * MiB + 3, &p), 0);
  ck_assert_str_eq(app_do(&a, "where %lx", p), "memfd");
  ck_assert_str_eq(app_do(&a, "fill %lx %llu 1", p, 8 * MiB + 3), "ok");
  ck_assert_str_eq(app_do(&a, "check %lx %llu 1", p, 8 * MiB + 3), "ok");
  uint32_t pid = 0;
  only_buffer(c, "default", 0, &pid);
  ck_assert_int_eq(pid, a.pid);
  struct gpumem_status *st;
  ck_assert_int_eq(gpumem_status(c, &st), 0);
  char name[32];
  snprintf(name, sizeof name, "pid-%d", (int)a.pid);
  bool named = false;
  for (size_t i = 0; i < st->nsessions; i++) named |= !strcmp(st->sessions[i]->name, name);
  gpumem_status_free(st);
  ck_assert(named);
  ck_assert_int_eq(app_free(&a, "cuda", p), 0);
  app_counts(&a, 0, 0, 0, 1);
  ck_assert_int_eq(app_free(&a, "cuda", p), 1); /* now foreign: the runtime says no */
  ck_assert_int_eq(app_stop(&a), 0);
  gpumem_disconnect(c);
}
END_TEST

/* A controller's pause of the default tag releases the program's memory
 * (the kernel's figure drops to 0); the resume maps it back at the same
 * addresses with its contents (GPUMEM_DEFAULT_FLAGS=backup). */
START_TEST(pause_of_the_default_tag_releases_the_program_memory) {
  gpumem_client *c = fresh_controller();
  struct app a;
  app_start(&a, d.socket, "GPUMEM_DEFAULT_FLAGS=backup", NULL);
  unsigned long p, q;
  ck_assert_int_eq(app_malloc(&a, "cuda", 8 * MiB, &p), 0);
  ck_assert_int_eq(app_malloc(&a, "cuda", 3 * MiB, &q), 0);
  ck_assert_str_eq(app_do(&a, "fill %lx %llu 1", p, 8 * MiB), "ok");
  ck_assert_str_eq(app_do(&a, "fill %lx %llu 2", q, 3 * MiB), "ok");
  ck_assert_uint_eq(only_buffer(c, "default", 0, NULL) & GPUMEM_BACKUP, GPUMEM_BACKUP);
  uint64_t before = held(&a);
  ck_assert_uint_ge(before, 11 * MiB);
  const char *tag = "default";
  struct gpumem_op_report *r;
  ck_assert_int_eq(gpumem_pause(c, &tag, 1, NULL, 0, NULL, &r), 0);
  ck_assert_uint_eq(r->bytes, before);
  gpumem_op_report_free(r);
  ck_assert_uint_eq(held(&a), 0);
  ck_assert_int_eq(gpumem_resume(c, &tag, 1, NULL, 0, NULL, &r), 0);
  gpumem_op_report_free(r);
  ck_assert_uint_eq(held(&a), before);
  ck_assert_str_eq(app_do(&a, "check %lx %llu 1", p, 8 * MiB), "ok");
  ck_assert_str_eq(app_do(&a, "check %lx %llu 2", q, 3 * MiB), "ok");
  ck_assert_int_eq(app_free(&a, "cuda", p), 0);
  ck_assert_int_eq(app_free(&a, "cuda", q), 0);
  ck_assert_int_eq(app_stop(&a), 0);
  gpumem_disconnect(c);
}
END_TEST

/* What the daemon refuses (a full device, or no daemon at all) is the
 * runtime's out-of-memory error, *ptr untouched, and the program goes on. */
START_TEST(refused_allocations_are_out_of_memory) {
  daemon_start(&d, "--host-device-size", "64M", NULL);
  struct app a;
  app_start(&a, d.socket, NULL);
  unsigned long p;
  ck_assert_int_eq(app_malloc(&a, "cuda", 100 * MiB, &p), 2);
  ck_assert_uint_eq(p, 0x5a5a);
  ck_assert_int_eq(app_malloc(&a, "hip", 1 * MiB, &p), 0);
  ck_assert_str_eq(app_do(&a, "where %lx", p), "memfd");
  unsigned long q;
  ck_assert_int_eq(app_malloc(&a, "cuda", 70 * MiB, &q), 2);
  ck_assert_uint_eq(q, 0x5a5a);
  ck_assert_int_eq(app_free(&a, "hip", p), 0);
  ck_assert_int_eq(app_stop(&a), 0);
  char nowhere[128];
  snprintf(nowhere, sizeof nowhere, "%s/none.sock", d.dir);
  app_start(&a, nowhere, NULL);
  ck_assert_int_eq(app_malloc(&a, "cuda", MiB, &p), 2);
  ck_assert_uint_eq(p, 0x5a5a);
  app_counts(&a, 0, 0, 0, 0);
  ck_assert_int_eq(app_stop(&a), 0);
}
END_TEST

/* Frees of memory the runtime made, NULL, and zero-byte allocations go
 * to the runtime, and never connect to the daemon. */
START_TEST(foreign_pointers_and_zero_sizes_reach_the_runtime) {
  gpumem_client *c = fresh_controller();
  struct app a;
  app_start(&a, d.socket, NULL);
  unsigned long p;
  ck_assert_int_eq(sscanf(app_do(&a, "stub 4096"), "ptr %lx", &p), 1);
  ck_assert_uint_ne(p, 0);
  ck_assert_int_eq(app_free(&a, "cuda", p), 0);
  ck_assert_int_eq(app_free(&a, "hip", 0), 0);
  ck_assert_int_eq(app_free(&a, "cuda_async", 0xdead000), 1);
  ck_assert_int_eq(app_malloc(&a, "cuda", 0, &p), 0);
  ck_assert_uint_eq(p, 0);
  ck_assert_int_eq(app_malloc(&a, "hip_async", 0, &p), 0);
  app_counts(&a, 3, 3, 0, 0);
  struct gpumem_status *st;
  ck_assert_int_eq(gpumem_status(c, &st), 0);
  ck_assert_uint_eq(st->nsessions, 1); /* the controller alone */
  gpumem_status_free(st);
  ck_assert_int_eq(app_stop(&a), 0);
  gpumem_disconnect(c);
}
END_TEST

/* The async and hip names are served too; an async free waits for its
 * stream, a plain free for the device. */
START_TEST(async_and_hip_names_are_served) {
  struct app a;
  fresh_app(&a);
  const char *apis[] = {"cuda_async", "hip", "hip_async"};
  for (int i = 0; i < 3; i++) {
    unsigned long p;
    ck_assert_int_eq(app_malloc(&a, apis[i], 2 * MiB, &p), 0);
    ck_assert_str_eq(app_do(&a, "where %lx", p), "memfd");
    ck_assert_int_eq(app_free(&a, apis[i], p), 0);
  }
  app_counts(&a, 0, 0, 2, 1);
  ck_assert_int_eq(app_stop(&a), 0);
}
END_TEST

/* $GPUMEM_DEFAULT_TAG names the tag, a thread tag set through libgpumem
 * overrides it, and the runtime's current device is the device. */
START_TEST(tags_and_devices_route_allocations) {
  gpumem_client *c = fresh_controller();
  struct app a;
  app_start(&a, d.socket, "GPUMEM_DEFAULT_TAG=weights", NULL);
  unsigned long p[4];
  ck_assert_int_eq(app_malloc(&a, "cuda", MiB, &p[0]), 0);
  ck_assert_uint_eq(only_buffer(c, "weights", 0, NULL), 0);
  ck_assert_str_eq(app_do(&a, "tag kv 1"), "rc 0");
  ck_assert_int_eq(app_malloc(&a, "cuda", MiB, &p[1]), 0);
  ck_assert_uint_eq(only_buffer(c, "kv", 0, NULL), GPUMEM_BACKUP);
  ck_assert_str_eq(app_do(&a, "device 1"), "rc 0");
  ck_assert_int_eq(app_malloc(&a, "cuda", MiB, &p[2]), 0);
  only_buffer(c, "kv", 1, NULL);
  ck_assert_str_eq(app_do(&a, "tag - 0"), "rc 0");
  ck_assert_int_eq(app_malloc(&a, "cuda", MiB, &p[3]), 0);
  only_buffer(c, "weights", 1, NULL);
  ck_assert_str_eq(app_do(&a, "tag bad/tag 0"), "rc -1");
  for (int i = 0; i < 4; i++) ck_assert_int_eq(app_free(&a, "cuda", p[i]), 0);
  ck_assert_int_eq(app_stop(&a), 0);
  gpumem_disconnect(c);
}
END_TEST

/* A free waits for the device the pointer was allocated on, switching to
 * it and back when another device is current. */
START_TEST(frees_wait_for_the_pointers_device) {
  struct app a;
  fresh_app(&a);
  ck_assert_str_eq(app_do(&a, "device 1"), "rc 0");
  unsigned long p;
  ck_assert_int_eq(app_malloc(&a, "cuda", MiB, &p), 0);
  ck_assert_str_eq(app_do(&a, "device 0"), "rc 0");
  ck_assert_int_eq(app_free(&a, "cuda", p), 0);
  ck_assert_str_eq(app_do(&a, "synced"), "synced 1 current 0");
  app_counts(&a, 0, 0, 0, 1);
  ck_assert_int_eq(app_stop(&a), 0);
}
END_TEST

/* During a graph capture an async free does not wait for its stream (not
 * allowed then): the memory stays taken until the next allocation on a
 * stream that is not capturing, which waits for the device and frees it
 * (the same address is then handed out again). */
START_TEST(async_frees_during_graph_capture_are_deferred) {
  struct app a;
  fresh_app(&a);
  ck_assert_str_eq(app_do(&a, "capture 1"), "ok");
  unsigned long p, q, r;
  ck_assert_int_eq(app_malloc(&a, "cuda_async", MiB, &p), 0);
  ck_assert_int_eq(app_free(&a, "cuda_async", p), 0);
  app_counts(&a, 0, 0, 0, 0);
  ck_assert_int_eq(app_malloc(&a, "cuda_async", MiB, &q), 0);
  ck_assert_uint_ne(q, p); /* p is not free yet */
  ck_assert_str_eq(app_do(&a, "capture 0"), "ok");
  ck_assert_int_eq(app_malloc(&a, "cuda_async", MiB, &r), 0);
  ck_assert_uint_eq(r, p);
  app_counts(&a, 0, 0, 0, 1);
  ck_assert_int_eq(app_free(&a, "cuda_async", q), 0);
  ck_assert_int_eq(app_free(&a, "cuda_async", r), 0);
  app_counts(&a, 0, 0, 2, 1);
  ck_assert_int_eq(app_stop(&a), 0);
}
END_TEST

/* A runtime the program loaded with dlopen(RTLD_LOCAL), as a library that
 * uses it: dlsym(RTLD_NEXT) cannot see it, the preload library finds it
 * all the same. The current device (1) is the allocation's, a malloc of 0
 * bytes, a free of NULL and a free of the runtime's own memory reach the
 * runtime and succeed. */
START_TEST(runtime_loaded_locally_is_found) {
  gpumem_client *c = fresh_controller();
  struct app a;
  user_start(&a, d.socket, NULL);
  unsigned long p = 0;
  const char *line = app_line(&a);
  ck_assert_int_eq(sscanf(line, "rc0 0 rc1 0 rc2 0 rc3 0 ptr %lx", &p), 1);
  ck_assert_uint_ne(p, 0);
  uint32_t pid = 0;
  only_buffer(c, "default", 1, &pid);
  ck_assert_int_eq(pid, a.pid);
  ck_assert_str_eq(app_do(&a, "free"), "rc 0 mallocs 2 frees 2 device_syncs 1");
  ck_assert_int_eq(app_stop(&a), 0);
  gpumem_disconnect(c);
}
END_TEST

/* User mode, run under the preload library by runtime_loaded_locally_is_found:
 * load the stand-in runtime lib with RTLD_LOCAL and run its "application
 * library" part; print its codes and pointer, then on the next input line
 * free the pointer through it and print the code and what reached the
 * runtime. */
static int user_mode(const char *lib) {
  void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    printf("dlopen: %s\n", dlerror());
    return 1;
  }
  void (*run)(char *, size_t, void **) =
      (void (*)(char *, size_t, void **))dlsym(h, "stub_user_run");
  int (*user_free)(void *) = (int (*)(void *))dlsym(h, "stub_user_free");
  void (*counts)(int *, int *, int *, int *) =
      (void (*)(int *, int *, int *, int *))dlsym(h, "stub_counts");
  if (!run || !user_free || !counts) return 2;
  char out[128];
  void *p = NULL;
  run(out, sizeof out, &p);
  printf("%s ptr %lx\n", out, (unsigned long)(uintptr_t)p);
  fflush(stdout);
  char line[64];
  if (!fgets(line, sizeof line, stdin)) return 3;
  int rc = user_free(p);
  int m, f, ss, ds;
  counts(&m, &f, &ss, &ds);
  printf("rc %d mallocs %d frees %d device_syncs %d\n", rc, m, f, ds);
  fflush(stdout);
  while (fgets(line, sizeof line, stdin)) continue;
  return 0;
}

/* Run the suite (or, with --user LIB, user_mode). */
int main(int argc, char **argv) {
  if (argc == 3 && !strcmp(argv[1], "--user")) return user_mode(argv[2]);
  return HARNESS_RUN("preload", 60, NULL, teardown, cuda_malloc_is_served_by_the_daemon,
                     pause_of_the_default_tag_releases_the_program_memory,
                     refused_allocations_are_out_of_memory,
                     foreign_pointers_and_zero_sizes_reach_the_runtime,
                     async_and_hip_names_are_served, tags_and_devices_route_allocations,
                     frees_wait_for_the_pointers_device,
                     async_frees_during_graph_capture_are_deferred,
                     runtime_loaded_locally_is_found);
}
