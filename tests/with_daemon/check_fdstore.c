/* systemd's fd store keeps the memory of persistent buffers that no
 * process holds through a crash of the daemon: driven for real, with this
 * test as the service manager. It reads the daemon's NOTIFY_SOCKET
 * (FDSTORE=1 keeps the fds it sends under their FDNAME, FDSTOREREMOVE=1
 * closes them, BARRIER=1 closes the fd that comes with it once everything
 * before it is done), and starts the next daemon with the fds it keeps
 * (LISTEN_FDS, LISTEN_FDNAMES, LISTEN_PID), as systemd does. */
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpumem.h"
#include "harness.h"

#define MiB (1ull << 20)
#define SIZE (8 * MiB)
#define STORED_MAX 16

static struct daemon d;

/* The test's fd store, filled by its notify thread. */
static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int sock;
  char path[128];
  bool stop;
  pthread_t thread;
  char names[STORED_MAX][96];
  int fds[STORED_MAX];
  size_t n;
  unsigned barriers, refused;
} sd = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* The value of key= in a notification's lines, into out ("" if none). */
static void field(const char *msg, const char *key, char *out, size_t len) {
  out[0] = '\0';
  size_t k = strlen(key);
  for (const char *l = msg; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
    if (strncmp(l, key, k) == 0 && l[k] == '=') {
      const char *end = strchr(l, '\n');
      size_t n = end ? (size_t)(end - l - k - 1) : strlen(l + k + 1);
      snprintf(out, len, "%.*s", (int)n, l + k + 1);
      return;
    }
}

/* Carry out one notification with the fds it brought. */
static void serve(const char *msg, int *fds, size_t nfds) {
  char name[96], v[16];
  field(msg, "FDNAME", name, sizeof name);
  pthread_mutex_lock(&sd.mu);
  field(msg, "FDSTORE", v, sizeof v);
  if (strcmp(v, "1") == 0) {
    for (size_t i = 0; i < nfds; i++) {
      if (sd.n == STORED_MAX) {
        sd.refused++;
        close(fds[i]);
        continue;
      }
      snprintf(sd.names[sd.n], sizeof sd.names[0], "%s", name);
      sd.fds[sd.n++] = fds[i];
    }
    nfds = 0;
  }
  field(msg, "FDSTOREREMOVE", v, sizeof v);
  for (size_t i = 0; strcmp(v, "1") == 0 && i < sd.n;) {
    if (strcmp(sd.names[i], name) != 0) {
      i++;
      continue;
    }
    close(sd.fds[i]);
    sd.n--;
    memmove(&sd.names[i], &sd.names[i + 1], (sd.n - i) * sizeof sd.names[0]);
    memmove(&sd.fds[i], &sd.fds[i + 1], (sd.n - i) * sizeof sd.fds[0]);
  }
  field(msg, "BARRIER", v, sizeof v);
  if (strcmp(v, "1") == 0) sd.barriers++;
  pthread_cond_broadcast(&sd.cv);
  pthread_mutex_unlock(&sd.mu);
  for (size_t i = 0; i < nfds; i++) close(fds[i]); /* a barrier's: closing it answers */
}

/* The notify thread: read and carry out notifications until stopped. */
static void *notify_thread(void *arg) {
  (void)arg;
  while (!__atomic_load_n(&sd.stop, __ATOMIC_ACQUIRE)) {
    struct pollfd p = {.fd = sd.sock, .events = POLLIN};
    if (poll(&p, 1, 50) != 1) continue;
    char msg[1024];
    union {
      struct cmsghdr h;
      char buf[CMSG_SPACE(sizeof(int) * 16)];
    } ctl;
    struct iovec iov = {msg, sizeof msg - 1};
    struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                       .msg_controllen = sizeof ctl.buf};
    ssize_t n = recvmsg(sd.sock, &m, MSG_CMSG_CLOEXEC);
    if (n < 0) continue;
    msg[n] = '\0';
    int fds[16];
    size_t nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        memcpy(fds + nfds, CMSG_DATA(c), k * sizeof(int));
        nfds += k;
      }
    serve(msg, fds, nfds);
  }
  return NULL;
}

/* Start being the service manager: the notify socket and its thread. */
static void sd_start(void) {
  snprintf(sd.path, sizeof sd.path, "%s/notify", d.dir);
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  memcpy(addr.sun_path, sd.path, strlen(sd.path) + 1);
  sd.sock = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ck_assert_int_ge(sd.sock, 0);
  ck_assert_int_eq(bind(sd.sock, (struct sockaddr *)&addr, sizeof addr), 0);
  int on = 1; /* as systemd: it is told who sends */
  setsockopt(sd.sock, SOL_SOCKET, SO_PASSCRED, &on, sizeof on);
  sd.n = sd.barriers = sd.refused = 0;
  sd.stop = false;
  ck_assert_int_eq(pthread_create(&sd.thread, NULL, notify_thread, NULL), 0);
}

/* Stop, closing what the store holds. */
static void sd_stop(void) {
  __atomic_store_n(&sd.stop, true, __ATOMIC_RELEASE);
  pthread_join(sd.thread, NULL);
  close(sd.sock);
  for (size_t i = 0; i < sd.n; i++) close(sd.fds[i]);
  sd.n = 0;
}

/* How many fds the store holds. */
static size_t stored(void) {
  pthread_mutex_lock(&sd.mu);
  size_t n = sd.n;
  pthread_mutex_unlock(&sd.mu);
  return n;
}

/* Wait until the store holds n fds. */
static bool await_stored(size_t n) {
  struct timespec end;
  clock_gettime(CLOCK_REALTIME, &end);
  end.tv_sec += (time_t)(harness_patience_ms(2000) / 1000);
  pthread_mutex_lock(&sd.mu);
  int rc = 0;
  while (sd.n != n && rc == 0) rc = pthread_cond_timedwait(&sd.cv, &sd.mu, &end);
  bool ok = sd.n == n;
  pthread_mutex_unlock(&sd.mu);
  return ok;
}

/* Start gpumemd as systemd would: NOTIFY_SOCKET, and the fds the store
 * holds passed from fd 3 on with their names. */
static pid_t spawn_managed(void) {
  const char *argv[] = {harness_bin("gpumemd"), "--socket", d.socket, "--backend", "host",
                        "--host-devices", "1", "--log-level", "debug", NULL};
  pthread_mutex_lock(&sd.mu);
  size_t n = sd.n;
  int fds[STORED_MAX];
  char names[STORED_MAX * 97] = "";
  for (size_t i = 0; i < n; i++) {
    fds[i] = sd.fds[i];
    if (i) strcat(names, ":");
    strcat(names, sd.names[i]);
  }
  pthread_mutex_unlock(&sd.mu);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid > 0) return pid;
  int log = open(d.log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (log < 0 || dup2(log, 1) < 0 || dup2(log, 2) < 0) _exit(126);
  /* Out of the way of fd 3 on, then into place. */
  int high[STORED_MAX];
  for (size_t i = 0; i < n; i++)
    if ((high[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 100)) < 0) _exit(126);
  for (size_t i = 0; i < n; i++)
    if (dup2(high[i], 3 + (int)i) < 0) _exit(126);
  char buf[32];
  setenv("NOTIFY_SOCKET", sd.path, 1);
  if (n) {
    snprintf(buf, sizeof buf, "%zu", n);
    setenv("LISTEN_FDS", buf, 1);
    setenv("LISTEN_FDNAMES", names, 1);
    snprintf(buf, sizeof buf, "%d", (int)getpid());
    setenv("LISTEN_PID", buf, 1);
  }
  execv(argv[0], (char *const *)argv);
  _exit(127);
}

/* Connect a client in a role. */
static gpumem_client *open_client(const char *name, int role) {
  gpumem_client *c;
  ck_assert_msg(gpumem_connect(d.socket, name, role, 0, &c) == 0, "%s", gpumem_last_error());
  return c;
}

/* The status's persistent buffer named name (id 0 when none). */
static struct gpumem_buffer_info persistent(gpumem_client *c, const char *name) {
  struct gpumem_status *s;
  ck_assert_msg(gpumem_status(c, &s) == 0, "%s", gpumem_last_error());
  struct gpumem_buffer_info out;
  memset(&out, 0, sizeof out);
  for (size_t i = 0; i < s->npersistent; i++)
    if (strcmp(s->persistent[i]->name, name) == 0) out = *s->persistent[i];
  out.name = out.tag = out.last_name = NULL;
  gpumem_status_free(s);
  return out;
}

/* Whether every word of a buffer is seed. */
static bool holds(gpumem_client *c, gpumem_buffer *b, uint32_t seed) {
  uint32_t *v = malloc(SIZE);
  ck_assert_ptr_nonnull(v);
  ck_assert_int_eq(gpumem_buffer_read(c, b, 0, v, SIZE), 0);
  bool same = true;
  for (uint64_t i = 0; i < SIZE / 4 && same; i++) same = v[i] == seed;
  free(v);
  return same;
}

/* A persistent buffer that no process holds lives on in the store when
 * the daemon is killed: the next daemon takes it back (memory and
 * contents, by the kernel's count of its memfds), an engine attaches it,
 * and the store keeps a copy exactly while no process holds it and it has
 * memory: a pause, an attach and a drop each empty it before they answer. */
START_TEST(a_kept_buffer_outlives_a_daemon_crash_in_systemds_store) {
#ifndef HAVE_SYSTEMD
  printf("a_kept_buffer_outlives_a_daemon_crash_in_systemds_store: skipped: no libsystemd\n");
  return;
#endif
  daemon_paths(&d, "gpumemd-fdstore");
  sd_start();
  d.pid = spawn_managed();
  ck_assert(daemon_wait_ready(&d));
  gpumem_client *w = open_client("engine", GPUMEM_ROLE_WORKER);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc_persistent(w, "w0", "weights", 0, SIZE, 0, &b), 0);
  ck_assert_int_eq(gpumem_buffer_fill32(w, b, 0, SIZE, 0xc0ffee01u), 0);
  ck_assert_uint_eq(stored(), 0); /* held: systemd keeps nothing */
  ck_assert_int_eq(gpumem_free(w, b), 0);
  ck_assert(await_stored(1));
  gpumem_disconnect(w);
  kill(d.pid, SIGKILL);
  ck_assert_int_eq(waitpid(d.pid, NULL, 0), d.pid);
  d.pid = spawn_managed();
  ck_assert(daemon_wait_ready(&d));
  ck_assert_int_eq(daemon_log_count(&d, "is back from systemd's fd store"), 1);
  ck_assert_uint_eq(memfd_bytes(&d.pid, 1), SIZE);
  gpumem_client *ctl = open_client("ctl", GPUMEM_ROLE_CONTROLLER);
  struct gpumem_buffer_info p = persistent(ctl, "w0");
  ck_assert_uint_ne(p.id, 0);
  ck_assert_uint_eq(p.pid, 0);
  ck_assert_int_eq(p.state, GPUMEM_ACTIVE);
  ck_assert_uint_eq(stored(), 1); /* still there: no process holds it */
  /* The standby engine is another process: this one holds the store's
   * fds, which a pause would see as this last holder still holding them. */
  int attached[2], go_on[2];
  ck_assert_int_eq(pipe(attached), 0);
  ck_assert_int_eq(pipe(go_on), 0);
  pid_t standby = fork();
  ck_assert_int_ge(standby, 0);
  if (standby == 0) {
    gpumem_client *e;
    char c = 0;
    if (gpumem_connect(d.socket, "engine-2", GPUMEM_ROLE_WORKER, 0, &e) < 0) _exit(10);
    if (gpumem_attach(e, "w0", &b) < 0) _exit(11);
    if (write(attached[1], &c, 1) != 1 || read(go_on[0], &c, 1) != 1) _exit(12);
    if (!holds(e, b, 0xc0ffee01u)) _exit(13);
    if (gpumem_free(e, b) < 0) _exit(14);
    gpumem_disconnect(e);
    _exit(0);
  }
  char c;
  ck_assert_int_eq(read(attached[0], &c, 1), 1);
  ck_assert_uint_eq(stored(), 0); /* let go of before the attach was answered */
  ck_assert_int_eq(write(go_on[1], &c, 1), 1);
  close(attached[0]);
  close(attached[1]);
  close(go_on[0]);
  close(go_on[1]);
  int status;
  ck_assert_int_eq(waitpid(standby, &status, 0), standby);
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "standby: %d", status);
  ck_assert(await_stored(1));
  /* A pause releases it: systemd's copy first, then the daemon's. */
  ck_assert_int_eq(client_op(ctl, "weights", false), 0);
  ck_assert_uint_eq(stored(), 0);
  ck_assert_uint_eq(memfd_bytes(&d.pid, 1), 0);
  ck_assert_int_eq(client_op(ctl, "weights", true), 0);
  ck_assert_uint_eq(stored(), 1);
  uint64_t freed;
  ck_assert_int_eq(gpumem_drop(ctl, "w0", (uint32_t)getuid(), &freed), 0);
  ck_assert_uint_eq(freed, SIZE);
  ck_assert_uint_eq(stored(), 0);
  ck_assert_uint_eq(memfd_bytes(&d.pid, 1), 0);
  ck_assert_uint_eq(sd.refused, 0);
  gpumem_disconnect(ctl);
  ck_assert_int_eq(daemon_stop(&d), 0);
  sd_stop();
}
END_TEST

/* Chunks the store passes back that no journal names (the journal was
 * removed meanwhile) are let go of, here and in the store, and logged. */
START_TEST(chunks_no_journal_names_are_let_go_of) {
#ifndef HAVE_SYSTEMD
  printf("chunks_no_journal_names_are_let_go_of: skipped: no libsystemd\n");
  return;
#endif
  daemon_paths(&d, "gpumemd-fdstore");
  sd_start();
  d.pid = spawn_managed();
  ck_assert(daemon_wait_ready(&d));
  gpumem_client *w = open_client("engine", GPUMEM_ROLE_WORKER);
  gpumem_buffer *b;
  ck_assert_int_eq(gpumem_alloc_persistent(w, "w0", "weights", 0, SIZE, 0, &b), 0);
  ck_assert_int_eq(gpumem_free(w, b), 0);
  ck_assert(await_stored(1));
  gpumem_disconnect(w);
  kill(d.pid, SIGKILL);
  ck_assert_int_eq(waitpid(d.pid, NULL, 0), d.pid);
  char journal[160];
  snprintf(journal, sizeof journal, "%s.journal", d.socket);
  ck_assert_int_eq(unlink(journal), 0);
  d.pid = spawn_managed();
  ck_assert(daemon_wait_ready(&d));
  ck_assert(await_stored(0));
  ck_assert_int_eq(daemon_log_count(&d, "which no journal names: let go of"), 1);
  ck_assert_uint_eq(memfd_bytes(&d.pid, 1), 0);
  ck_assert_int_eq(daemon_stop(&d), 0);
  sd_stop();
}
END_TEST

static void teardown(void) { harness_daemon_teardown(&d); }

int main(void) {
  return HARNESS_RUN("fdstore", 30, harness_fd_setup, teardown,
                     a_kept_buffer_outlives_a_daemon_crash_in_systemds_store,
                     chunks_no_journal_names_are_let_go_of);
}
