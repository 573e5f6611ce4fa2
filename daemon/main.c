/* gpumemd: the per-node GPU memory daemon. */
#include <errno.h>
#include <getopt.h>
#include <glob.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include <xxhash.h>
#include "common/log.h"
#include "common/size.h"
#include "common/wire.h"
#include "backup_disk.h"
#include "config.h"
#include "ctxrelease.h"
#include "fdbudget.h"
#include "gpu/gpudev.h"
#include "gpumem.h"
#include "fdstore.h"
#include "notify.h"
#include "server.h"

/* Print the command-line help to out. */
static void usage(FILE *out) {
  fprintf(out,
          "usage: gpumemd [options]\n"
          "  --socket PATH             socket to serve (default $GPUMEM_SOCKET or %s)\n"
          "  --socket-group GROUP      group of the socket the daemon binds itself\n"
          "  --socket-mode OCTAL       mode of the socket the daemon binds (default 0660)\n"
          "  --backend NAME            auto, cuda, hip, host (default auto: the GPU present;\n"
          "                            host only on a node without GPU device nodes)\n"
          "  --host-devices N          host backend: simulated devices (default 2)\n"
          "  --host-device-size SIZE   host backend: bytes per device (default 4G)\n"
          "  --host-granularity SIZE   host backend: allocation granularity (default 2M)\n"
          "  --chunk-size SIZE         largest physical chunk (default 1G)\n"
          "  --backup-limit SIZE       host memory for BACKUP buffers (default half of RAM)\n"
          "  --backup-overflow WHAT    a backup past --backup-limit: error (default: refused,\n"
          "                            naming the limit) or pageable (pageable host memory,\n"
          "                            made where the kernel has room; the daemon copies it)\n"
          "  --backup-dir DIR          keep BACKUP_DISK buffers' backups in files here while\n"
          "                            paused (direct I/O; a directory only root and the\n"
          "                            daemon's uid can change; default: none)\n"
          "  --verify-backups          hash backups; fail a resume whose restore differs\n"
          "  --ack-timeout DURATION    wait for workers' acks (default 10s; 500ms, 2s)\n"
          "  --exit-wait DURATION      a pause waits this long for workers that died during\n"
          "                            it to leave the driver before it judges (default 3s)\n"
          "  --lock-timeout DURATION   a context release waits this long for a worker's\n"
          "                            device calls in flight (default 5s)\n"
          "  --release-timeout DURATION  a pause or resume waits this long for the driver to\n"
          "                            release or restore a worker's device state (default 60s)\n"
          "  --adopt-grace DURATION    after start, allocations that would make a new tag\n"
          "                            wait this long, so that workers re-register theirs\n"
          "                            first (default none; the systemd unit sets 3s); with\n"
          "                            a journal, how long its buffers wait for their\n"
          "                            workers instead (default 10s)\n"
          "  --journal PATH            what a daemon restarted on this socket needs to take\n"
          "                            the node back, and to check who re-registers what\n"
          "                            (default $RUNTIME_DIRECTORY/gpumemd.journal under\n"
          "                            systemd, else SOCKET.journal; none: keep none)\n"
          "  --timeout-policy P        report (default) or kill workers that miss it\n"
          "  --controller-uid UID      a uid allowed to pause/resume (root and ours are)\n"
          "  --controller-group GROUP  a group allowed to pause/resume\n"
          "  --max-sessions-per-uid N  (default 4096)\n"
          "  --max-buffers-per-session N (default 1000000)\n"
          "  --max-buffers-per-uid N   the same, over a uid's sessions (default 1000000)\n"
          "  --max-device-bytes-per-uid SIZE  buffers a uid holds on each device, paused\n"
          "                            or not (default 0: no limit)\n"
          "  --max-backup-bytes-per-uid SIZE  host memory a uid's BACKUP buffers reserve\n"
          "                            (default 0: only --backup-limit)\n"
          "  --shared-tag TAG          a tag every uid may join (repeat for more; \"default\"\n"
          "                            always is)\n"
          "  --max-parked-fds-per-session N  fds a frame still arriving may hold (default 253)\n"
          "  --max-parked-fds-per-uid N      the same, over a uid's sessions (default 4096)\n"
          "  --frame-timeout DURATION  a frame begun must end within it (default 10s)\n"
          "  --max-queued-per-session SIZE  replies a session leaves unread (default 4M)\n"
          "  --max-queued-total SIZE   the same, over every session (default 256M)\n"
          "  --log-level LEVEL         error, warn, info (default), debug\n"
          "  --version, --help\n",
          DEFAULT_SOCKET);
}

/* Parse "10s", "500ms", "2" (seconds) into milliseconds. */
static int parse_duration(const char *s, uint32_t *ms) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || v < 0) return -1;
  if (strcmp(end, "ms") == 0) v /= 1000;
  else if (*end && strcmp(end, "s") != 0) return -1;
  if (v * 1000 > UINT32_MAX || v * 1000 < 1) return -1;
  *ms = (uint32_t)(v * 1000);
  return 0;
}

/* Parse a decimal number no larger than max. */
static int parse_uint(const char *s, unsigned long max, unsigned long *out) {
  char *end;
  errno = 0;
  unsigned long v = strtoul(s, &end, 10);
  if (errno || *end || end == s || v > max) return -1;
  *out = v;
  return 0;
}

/* Parse the value of option c when it is one of those that set a count
 * (1 to a largest), a size or a duration in cfg. Returns 1 when it was and
 * its value is good, -1 when the value is bad, 0 for another option. */
static int parse_value_option(int c, const char *arg, struct config *cfg) {
  const struct {
    int opt;
    unsigned long max;
    unsigned *to;
  } counts[] = {
      {'n', 64, &cfg->host_devices},
      {'S', 1000000, &cfg->max_sessions_per_uid},
      {'B', 100000000, &cfg->max_buffers_per_session},
      {'A', 100000000, &cfg->max_buffers_per_uid},
      {'P', 1000000, &cfg->max_parked_fds_per_session},
      {'U', 100000000, &cfg->max_parked_fds_per_uid},
  };
  const struct {
    int opt;
    bool nonzero;
    uint64_t *to;
  } sizes[] = {
      {'z', false, &cfg->host_device_size},
      {'k', false, &cfg->backup_limit},
      {'G', false, &cfg->host_granularity},
      {'D', false, &cfg->max_device_bytes_per_uid},
      {'K', false, &cfg->max_backup_bytes_per_uid},
      {'Q', true, &cfg->max_queued_per_session},
      {'T', true, &cfg->max_queued_total},
  };
  const struct {
    int opt;
    uint32_t *to;
  } durations[] = {
      {'t', &cfg->ack_timeout_ms},
      {'X', &cfg->exit_wait_ms},
      {'L', &cfg->lock_timeout_ms},
      {'R', &cfg->release_timeout_ms},
      {'a', &cfg->adopt_grace_ms},
      {'F', &cfg->frame_timeout_ms},
  };
  unsigned long v;
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
    if (counts[i].opt != c) continue;
    if (parse_uint(arg, counts[i].max, &v) || v == 0) return -1;
    *counts[i].to = (unsigned)v;
    return 1;
  }
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
    if (sizes[i].opt == c)
      return size_parse(arg, sizes[i].to) || (sizes[i].nonzero && *sizes[i].to == 0) ? -1 : 1;
  for (size_t i = 0; i < sizeof durations / sizeof durations[0]; i++)
    if (durations[i].opt == c) return parse_duration(arg, durations[i].to) ? -1 : 1;
  return 0;
}

/* Report a bad option value; returns the usage exit status. */
static int die_usage(const char *opt, const char *val) {
  fprintf(stderr, "gpumemd: invalid value for --%s: '%s'\n", opt, val);
  return 2;
}

/* Whether the node has device nodes of a vendor: /dev/nvidia0... for cuda,
 * /dev/kfd for hip. */
static bool has_device_nodes(const char *vendor) {
  if (strcmp(vendor, "hip") == 0) return access("/dev/kfd", F_OK) == 0;
  glob_t gl;
  bool found = glob("/dev/nvidia[0-9]*", 0, NULL, &gl) == 0 && gl.gl_pathc > 0;
  globfree(&gl);
  return found;
}

/* Print the version and the backends built in. */
static void print_version(void) {
  char built[256];
  gpudev_describe_builtin(built, sizeof built);
  printf("gpumemd %d.%d.%d (protocol %d.%d)\nbackends: %s\n", GPUMEM_VERSION_MAJOR,
         GPUMEM_VERSION_MINOR, GPUMEM_VERSION_PATCH, WIRE_VERSION_MAJOR, WIRE_VERSION_MINOR, built);
}

/* Open the configured backend; "auto" takes the vendor whose GPU device
 * nodes are present and fails with its driver's error, host only when the
 * node has no GPU device nodes at all. */
static int open_backend(struct config *cfg, gpudev **g) {
  /* The host backend's devices belong to this socket: a daemon restarted
   * on it finds its memory again, one on another socket has its own. */
  char node[17];
  snprintf(node, sizeof node, "%016llx",
           (unsigned long long)XXH3_64bits(cfg->socket_path, strlen(cfg->socket_path)));
  struct gpudev_options o = {.backend = cfg->backend,
                             .host_devices = cfg->host_devices,
                             .host_device_size = cfg->host_device_size,
                             .host_granularity = cfg->host_granularity,
                             .host_node = node};
  char err[256] = "", why[600] = "";
  if (strcmp(cfg->backend, "auto") == 0) {
    static const char *const vendors[] = {"cuda", "hip"};
    bool any = false;
    for (size_t i = 0; i < 2; i++) {
      if (!has_device_nodes(vendors[i])) continue;
      any = true;
      o.backend = vendors[i];
      if (gpudev_open(&o, g, err, sizeof err) == 0) {
        cfg->backend = vendors[i];
        log_info("backend auto: %s (%u devices)", vendors[i], gpudev_device_count(*g));
        return 0;
      }
      size_t len = strlen(why);
      snprintf(why + len, sizeof why - len, "%s%s: %s", len ? "; " : "", vendors[i], err);
    }
    if (any) {
      log_error("backend auto: GPU device nodes are present but no driver opened: %s", why);
      return -1;
    }
    cfg->backend = o.backend = "host";
    log_info("backend auto: host (no /dev/nvidia0... or /dev/kfd on this node)");
  }
  if (gpudev_open(&o, g, err, sizeof err) < 0) {
    log_error("backend %s: %s", cfg->backend, err);
    return -1;
  }
  return 0;
}

/* Nothing: the work that starts the thread pool. */
static void no_work(uv_work_t *req) { (void)req; }

/* Start libuv's thread pool now, with SIGTERM and SIGINT blocked: its
 * threads keep that mask, so that only the loop's thread takes them. Else,
 * once the daemon stops catching them (server_destroy closes its signal
 * handles and libuv restores the default action), one that comes while it
 * frees its memory or exits is taken by a pool thread and kills it. */
static void start_thread_pool(uv_loop_t *loop) {
  static uv_work_t req;
  int rc = uv_queue_work(loop, &req, no_work, NULL);
  if (rc < 0) log_warn("thread pool: %s", uv_strerror(rc));
}

/* Parse the flags, take systemd's socket or bind one, and serve. */
int main(int argc, char **argv) {
  const char *env_socket = getenv("GPUMEM_SOCKET");
  /* "default", the tag of allocations that name none (the preload library,
   * PyTorch's allocator), is every uid's; --shared-tag adds more. */
  static const char *shared_tags[WIRE_MAX_TAGS + 1] = {"default"};
  struct config cfg = {
      .socket_path = env_socket && *env_socket ? env_socket : DEFAULT_SOCKET,
      .backend = "auto",
      .host_devices = 2,
      .host_device_size = 4ull << 30,
      .chunk_size = 1ull << 30,
      .backup_limit = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE) / 2,
      .ack_timeout_ms = 10000,
      .exit_wait_ms = 3000,
      .lock_timeout_ms = 5000,
      .release_timeout_ms = 60000,
      .timeout_policy = TIMEOUT_REPORT,
      .shared_tags = shared_tags,
      .nshared_tags = 1,
      .max_sessions_per_uid = 4096,
      .max_buffers_per_session = 1000000,
      .max_buffers_per_uid = 1000000,
      .max_parked_fds_per_session = 253,
      .max_parked_fds_per_uid = 4096,
      .frame_timeout_ms = 10000,
      .max_queued_per_session = 4ull << 20,
      .max_queued_total = 256ull << 20,
      .controller_uid = (uid_t)-1,
      .controller_gid = (gid_t)-1,
      .socket_gid = (gid_t)-1,
      .socket_mode = 0660,
      .listen_fd = -1,
  };
  static const struct option opts[] = {
      {"socket", required_argument, 0, 's'},
      {"socket-group", required_argument, 0, 'O'},
      {"socket-mode", required_argument, 0, 'M'},
      {"backend", required_argument, 0, 'b'},
      {"host-devices", required_argument, 0, 'n'},
      {"host-device-size", required_argument, 0, 'z'},
      {"host-granularity", required_argument, 0, 'G'},
      {"chunk-size", required_argument, 0, 'c'},
      {"backup-limit", required_argument, 0, 'k'},
      {"verify-backups", no_argument, 0, 'v'},
      {"backup-overflow", required_argument, 0, 'o'},
      {"backup-dir", required_argument, 0, 'W'},
      {"ack-timeout", required_argument, 0, 't'},
      {"exit-wait", required_argument, 0, 'X'},
      {"lock-timeout", required_argument, 0, 'L'},
      {"release-timeout", required_argument, 0, 'R'},
      {"adopt-grace", required_argument, 0, 'a'},
      {"journal", required_argument, 0, 'j'},
      {"timeout-policy", required_argument, 0, 'p'},
      {"controller-uid", required_argument, 0, 'u'},
      {"controller-group", required_argument, 0, 'g'},
      {"max-sessions-per-uid", required_argument, 0, 'S'},
      {"max-buffers-per-session", required_argument, 0, 'B'},
      {"max-buffers-per-uid", required_argument, 0, 'A'},
      {"max-device-bytes-per-uid", required_argument, 0, 'D'},
      {"max-backup-bytes-per-uid", required_argument, 0, 'K'},
      {"shared-tag", required_argument, 0, 'H'},
      {"max-parked-fds-per-session", required_argument, 0, 'P'},
      {"max-parked-fds-per-uid", required_argument, 0, 'U'},
      {"frame-timeout", required_argument, 0, 'F'},
      {"max-queued-per-session", required_argument, 0, 'Q'},
      {"max-queued-total", required_argument, 0, 'T'},
      {"log-level", required_argument, 0, 'l'},
      {"version", no_argument, 0, 'V'},
      {"help", no_argument, 0, 'h'},
      {0, 0, 0, 0},
  };
  int c, idx;
  unsigned long v;
  const char *journal_arg = NULL;
  while ((c = getopt_long(argc, argv, "", opts, &idx)) != -1) {
    const char *name = c == '?' ? "" : opts[idx].name;
    if (c == 'a') cfg.adopt_grace_set = true;
    int value = parse_value_option(c, optarg, &cfg);
    if (value < 0) return die_usage(name, optarg);
    if (value > 0) continue;
    switch (c) {
    case 's': cfg.socket_path = optarg; break;
    case 'j': journal_arg = optarg; break;
    case 'O': {
      struct group *gr = getgrnam(optarg);
      if (gr) cfg.socket_gid = gr->gr_gid;
      else if (parse_uint(optarg, UINT32_MAX - 1, &v) == 0) cfg.socket_gid = (gid_t)v;
      else {
        fprintf(stderr, "gpumemd: --socket-group: no group named '%s'\n", optarg);
        return 2;
      }
      break;
    }
    case 'M': {
      char *end;
      errno = 0;
      v = strtoul(optarg, &end, 8);
      if (errno || *end || end == optarg || v > 07777) return die_usage(name, optarg);
      cfg.socket_mode = (mode_t)v;
      break;
    }
    case 'b': cfg.backend = optarg; break;
    case 'W': cfg.backup_dir = optarg; break;
    case 'v': cfg.verify_backups = true; break;
    case 'o':
      if (strcmp(optarg, "error") == 0) cfg.overflow_pageable = false;
      else if (strcmp(optarg, "pageable") == 0) cfg.overflow_pageable = true;
      else return die_usage(name, optarg);
      break;
    case 'c':
      if (size_parse(optarg, &cfg.chunk_size) || cfg.chunk_size == 0 ||
          (cfg.chunk_size & (cfg.chunk_size - 1)))
        return die_usage(name, optarg);
      break;
    case 'p':
      if (strcmp(optarg, "report") == 0) cfg.timeout_policy = TIMEOUT_REPORT;
      else if (strcmp(optarg, "kill") == 0) cfg.timeout_policy = TIMEOUT_KILL;
      else return die_usage(name, optarg);
      break;
    case 'u':
      if (parse_uint(optarg, UINT32_MAX - 1, &v)) return die_usage(name, optarg);
      cfg.controller_uid = (uid_t)v;
      break;
    case 'g': {
      struct group *gr = getgrnam(optarg);
      if (gr) cfg.controller_gid = gr->gr_gid;
      else if (parse_uint(optarg, UINT32_MAX - 1, &v) == 0) cfg.controller_gid = (gid_t)v;
      else return die_usage(name, optarg);
      break;
    }
    case 'H': {
      if (!wire_tag_valid(optarg)) {
        fprintf(stderr, "gpumemd: --shared-tag: '%s' is not a tag (1-%d of A-Z a-z 0-9 _ . -)\n",
                optarg, WIRE_TAG_MAX);
        return 2;
      }
      if (cfg.nshared_tags == WIRE_MAX_TAGS + 1) {
        fprintf(stderr, "gpumemd: --shared-tag: at most %d\n", WIRE_MAX_TAGS);
        return 2;
      }
      shared_tags[cfg.nshared_tags++] = optarg;
      break;
    }
    case 'l': {
      int lvl = log_level_parse(optarg);
      if (lvl < 0) return die_usage(name, optarg);
      log_set_level((enum log_level)lvl);
      break;
    }
    case 'V': print_version(); return 0;
    case 'h': usage(stdout); return 0;
    default: usage(stderr); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "gpumemd: unexpected argument '%s'\n", argv[optind]);
    usage(stderr);
    return 2;
  }
  /* systemd's environment is checked before anything is created. */
  char err[256] = "";
  static char activated_path[108];
  static fdstore *store; /* static: reachable to the end, whichever way main returns */
  if (!(store = fdstore_create())) {
    log_error("out of memory");
    return 1;
  }
  cfg.fdstore = store;
  cfg.listen_fd =
      activation_take(activated_path, sizeof activated_path, store, err, sizeof err);
  if (cfg.listen_fd == -2 || notify_check(err, sizeof err) < 0) {
    log_error("%s", err);
    if (cfg.listen_fd >= 0) close(cfg.listen_fd);
    return 1;
  }
  if (cfg.listen_fd >= 0 && activated_path[0]) cfg.socket_path = activated_path;
  static char journal[4200], buffers_journal[4200];
  snprintf(journal, sizeof journal, "%s.released", cfg.socket_path);
  cfg.release_journal = journal;
  /* The journal: systemd's runtime directory (RuntimeDirectory=, kept
   * across restarts), else next to the socket, unless told. */
  const char *runtime = getenv("RUNTIME_DIRECTORY");
  if (!journal_arg && runtime && *runtime) {
    snprintf(buffers_journal, sizeof buffers_journal, "%.*s/gpumemd.journal",
             (int)strcspn(runtime, ":"), runtime);
    cfg.journal_path = buffers_journal;
  } else if (!journal_arg) {
    snprintf(buffers_journal, sizeof buffers_journal, "%s.journal", cfg.socket_path);
    cfg.journal_path = buffers_journal;
  } else if (strcmp(journal_arg, "none") != 0) {
    cfg.journal_path = journal_arg;
    cfg.journal_explicit = true;
  }
  signal(SIGPIPE, SIG_IGN);
  /* A backup file past the file size limit fails its write (EFBIG) and the
   * pause says so, instead of the signal killing the daemon. */
  signal(SIGXFSZ, SIG_IGN);
  if (cfg.backup_dir) {
    if (!(cfg.backup_disk = backup_disk_open(cfg.backup_dir, err, sizeof err))) {
      log_error("%s", err);
      if (cfg.listen_fd >= 0) close(cfg.listen_fd);
      return 1;
    }
    log_info("disk backups in %s (%s, %llu bytes free)", cfg.backup_dir,
             backup_disk_engine(cfg.backup_disk),
             (unsigned long long)backup_disk_free(cfg.backup_disk));
  }
  log_info("file descriptors: up to %llu", (unsigned long long)fdbudget_raise());
  gpudev *g;
  if (open_backend(&cfg, &g) < 0) {
    if (cfg.listen_fd >= 0) close(cfg.listen_fd);
    backup_disk_close(cfg.backup_disk);
    return 1;
  }
  uint64_t gran = gpudev_granularity(g);
  if (cfg.chunk_size < gran) cfg.chunk_size = gran;
  uv_loop_t loop;
  uv_loop_init(&loop);
  /* Clients may connect as soon as the socket listens, before the signal
   * handlers are in place: hold SIGTERM and SIGINT until they are, so that
   * a quick stop still shuts down cleanly. */
  sigset_t stop, old_mask;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  sigprocmask(SIG_BLOCK, &stop, &old_mask);
  server *srv = server_create(&loop, &cfg, g, err, sizeof err);
  if (srv) start_thread_pool(&loop);
  sigprocmask(SIG_SETMASK, &old_mask, NULL);
  if (!srv) {
    log_error("%s", err);
    uv_loop_close(&loop);
    gpudev_close(g);
    backup_disk_close(cfg.backup_disk);
    return 1;
  }  /* The socket is ours now: workers a daemon before us left released
   * get their device state back before anything is served. */
  ctxrelease_recover(g, cfg.release_journal);

  bool notify_failed =
      notify_ready(gpudev_name(g), gpudev_device_count(g), cfg.socket_path, err, sizeof err) < 0;
  if (notify_failed) {
    log_error("%s", err);
    raise(SIGTERM);
  }
  int status = server_run(srv);
  if (notify_failed) status = 1;
  server_destroy(srv);
  fdstore_free(store); /* what stays in systemd's store is the next daemon's */
  store = NULL;
  uv_loop_close(&loop);
  backup_disk_close(cfg.backup_disk); /* its files went with their buffers */
  if (ctxrelease_in_driver()) /* a thread is in the driver: its backend stays */
    log_error("a driver call has not returned: the backend is left open at exit");
  else
    gpudev_close(g);
  log_info("stopped");
  return status;
}
