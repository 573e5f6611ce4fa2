/* libgpumem: the client library of gpumemd, the per-node GPU memory daemon.
 *
 * Workers (inference engines) connect as GPUMEM_ROLE_WORKER and allocate
 * tagged buffers; each buffer's pointer stays valid across pause and
 * resume. While a buffer is paused its memory is given back to the device
 * and touching it faults, as on a GPU. Orchestrators connect as
 * GPUMEM_ROLE_CONTROLLER and pause and resume tags for the whole node.
 *
 * Every function is thread-safe. Functions that can fail return 0 (or a
 * count) on success and a negative GPUMEM_E_* code on failure; the library
 * never exits the process. After a failure gpumem_last_error() gives the
 * daemon's (or the library's) words for it on the calling thread. */
#ifndef GPUMEM_H
#define GPUMEM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define GPUMEM_EXPORT __attribute__((visibility("default")))
#else
#define GPUMEM_EXPORT
#endif

/* Error codes. Codes -1..-12 and -17..-19 are the daemon's; -13..-16 are
 * local. */
enum gpumem_error {
  GPUMEM_OK = 0,
  GPUMEM_E_INVALID = -1,        /* a bad argument */
  GPUMEM_E_PROTOCOL = -2,       /* a malformed message on the socket */
  GPUMEM_E_VERSION = -3,        /* client and daemon speak different majors */
  GPUMEM_E_PERMISSION = -4,     /* not allowed for this uid or role */
  GPUMEM_E_NOT_FOUND = -5,      /* no such buffer in this session */
  GPUMEM_E_OUT_OF_MEMORY = -6,  /* the device has not enough free memory */
  GPUMEM_E_TAG_PAUSED = -7,     /* the tag is paused; see GPUMEM_ALLOW_PAUSED */
  GPUMEM_E_CLIENT_TIMEOUT = -8, /* workers did not answer in time (pids) */
  GPUMEM_E_LIMIT = -9,          /* a per-uid or per-session limit */
  GPUMEM_E_WRONG_STATE = -10,   /* the buffer is being paused or resumed */
  GPUMEM_E_BACKEND = -11,       /* the GPU driver failed */
  GPUMEM_E_INTERNAL = -12,      /* the daemon failed */
  GPUMEM_E_CONNECT = -13,       /* cannot reach the daemon */
  GPUMEM_E_DISCONNECTED = -14,  /* the connection is gone */
  GPUMEM_E_NOMEM = -15,         /* out of memory in this process */
  GPUMEM_E_MAP = -16,           /* importing or mapping memory here failed */
  GPUMEM_E_NOT_RELEASED = -17,  /* memory an operation should have freed is held */
  GPUMEM_E_RESIDUAL = -18,      /* a device holds more than allowed outside gpumemd */
  GPUMEM_E_SHUTTING_DOWN = -19, /* the daemon is going away */
};

/* Session roles. */
enum gpumem_role {
  GPUMEM_ROLE_WORKER = 1,
  GPUMEM_ROLE_CONTROLLER = 2,
};

/* Buffer states. */
enum gpumem_state {
  GPUMEM_ACTIVE = 0,
  GPUMEM_PAUSING = 1,
  GPUMEM_PAUSED = 2,
  GPUMEM_RESUMING = 3,
};

/* Buffer flags for gpumem_alloc. */
enum gpumem_flag {
  GPUMEM_BACKUP = 1,       /* contents survive a pause */
  GPUMEM_IPC_LEGACY = 2,   /* never paused (legacy IPC handle on GPUs) */
  GPUMEM_ALLOW_PAUSED = 4, /* allowed in a paused tag; then starts paused */
};

/* Flags for gpumem_connect. */
enum gpumem_connect_flag {
  /* No background thread: the application calls gpumem_dispatch when
   * gpumem_fd is readable, and daemon events wait until it does. */
  GPUMEM_CONNECT_NO_THREAD = 1,
  /* When the daemon goes away, do not reconnect: calls fail with
   * GPUMEM_E_DISCONNECTED from then on and buffers stay mapped, unmanaged,
   * until freed. */
  GPUMEM_CONNECT_NO_RECONNECT = 2,
};

/* The default socket path, used when neither an argument nor the
 * GPUMEM_SOCKET environment variable names one. */
#define GPUMEM_DEFAULT_SOCKET "/run/gpumemd/gpumemd.sock"

typedef struct gpumem_client gpumem_client;
typedef struct gpumem_buffer gpumem_buffer;

/* Connect to the daemon at socket_path (NULL: $GPUMEM_SOCKET, else the
 * default), introduce this process by name and role, and start the
 * background thread that answers the daemon's events (unless flags has
 * GPUMEM_CONNECT_NO_THREAD). A daemon that refuses the session (an error
 * it sends before closing, such as GPUMEM_E_LIMIT) makes this fail with
 * its code and words.
 *
 * Daemon restarts: when the connection ends (the daemon exits, crashes or
 * says it is shutting down), every buffer stays mapped at its address and
 * the library reconnects to the same socket path, waiting 10 ms, then
 * twice as long each time up to 1 s, until it succeeds or
 * gpumem_disconnect is called. It then says Hello again and re-registers
 * every buffer with the new daemon (mapped ones hand it their memory,
 * paused ones stay paused), after which buffer ids are the new daemon's.
 * Requests in flight when the connection ended fail with
 * GPUMEM_E_DISCONNECTED and the daemon's words; calls made while
 * reconnecting fail at once with GPUMEM_E_DISCONNECTED ("reconnecting to
 * gpumemd"); nothing waits for the daemon to come back. Controllers
 * reconnect the same way (they own no buffers). Buffers opened from a
 * legacy IPC handle (GPUMEM_IPC_LEGACY on GPU backends) cannot be
 * re-registered: their memory belonged to the daemon that died; they stay
 * readable for as long as the driver keeps that memory, are reported as
 * not re-registered, and should be freed. A buffer the new daemon refuses
 * stays mapped and usable but unmanaged (gpumem_buffer_registered says 0;
 * gpumem_free releases it here only); the next reconnection tries again.
 * GPUMEM_CONNECT_NO_RECONNECT turns all this off. */
GPUMEM_EXPORT int gpumem_connect(const char *socket_path, const char *name,
                                 int role, unsigned flags, gpumem_client **out);

/* Disconnect: unmap and forget every buffer of this client (the daemon
 * frees them) and free the client. */
GPUMEM_EXPORT void gpumem_disconnect(gpumem_client *c);

/* The daemon's backend ("host", "cuda", "hip"). */
GPUMEM_EXPORT const char *gpumem_backend(const gpumem_client *c);

/* The allocation granularity: sizes are rounded up to a multiple. */
GPUMEM_EXPORT uint64_t gpumem_granularity(const gpumem_client *c);

/* The number of devices the daemon manages (the daemon's numbering, as
 * in status and in pause/resume device lists). */
GPUMEM_EXPORT unsigned gpumem_device_count(const gpumem_client *c);

/* Allocate a buffer of at least size bytes tagged tag on device (in this
 * process's numbering, as CUDA_VISIBLE_DEVICES makes it), mapped and ready
 * (or reserved only, when it starts paused). GPUMEM_IPC_LEGACY buffers on
 * GPUs are plain device memory opened from a legacy IPC handle. */
GPUMEM_EXPORT int gpumem_alloc(gpumem_client *c, const char *tag,
                               unsigned device, uint64_t size, unsigned flags,
                               gpumem_buffer **out);

/* Free a buffer (active or paused); its pointer becomes invalid. */
GPUMEM_EXPORT int gpumem_free(gpumem_client *c, gpumem_buffer *b);

/* The buffer's address; the same before and after pause and resume. */
GPUMEM_EXPORT void *gpumem_buffer_ptr(const gpumem_buffer *b);

/* The buffer's size, rounded up to the granularity. */
GPUMEM_EXPORT uint64_t gpumem_buffer_size(const gpumem_buffer *b);

/* The buffer's tag. */
GPUMEM_EXPORT const char *gpumem_buffer_tag(const gpumem_buffer *b);

/* The buffer's device. */
GPUMEM_EXPORT unsigned gpumem_buffer_device(const gpumem_buffer *b);

/* The buffer's id at the daemon (a new one after the buffer was
 * re-registered with a restarted daemon). */
GPUMEM_EXPORT uint64_t gpumem_buffer_id(const gpumem_buffer *b);

/* The buffer's flags (GPUMEM_BACKUP, ...). */
GPUMEM_EXPORT unsigned gpumem_buffer_flags(const gpumem_buffer *b);

/* 1 if memory is mapped behind the pointer now, 0 while paused. */
GPUMEM_EXPORT int gpumem_buffer_mapped(const gpumem_buffer *b);

/* Copy len bytes at offset off of a buffer to host memory at dst (with the
 * device's copy engine on GPUs; memcpy on the host backend). */
GPUMEM_EXPORT int gpumem_buffer_read(gpumem_client *c, gpumem_buffer *b, uint64_t off,
                                     void *dst, uint64_t len);

/* Copy len bytes of host memory at src into a buffer at offset off. */
GPUMEM_EXPORT int gpumem_buffer_write(gpumem_client *c, gpumem_buffer *b, uint64_t off,
                                      const void *src, uint64_t len);

/* Set len bytes at offset off of a buffer to a repeated 32-bit value, on
 * the device; off and len are multiples of 4. Returns when done. */
GPUMEM_EXPORT int gpumem_buffer_fill32(gpumem_client *c, gpumem_buffer *b, uint64_t off,
                                       uint64_t len, uint32_t value);

/* Wait until work on a device (this process's numbering) has finished. */
GPUMEM_EXPORT int gpumem_sync(gpumem_client *c, unsigned device);

/* A hook run with the buffers of one daemon event. It runs on the thread
 * that dispatches events and must not call gpumem functions that talk to
 * the daemon. */
typedef void (*gpumem_hook)(gpumem_client *c, gpumem_buffer *const *bufs,
                            size_t n, void *user);

/* Set the hooks run before buffers are unmapped (default, when NULL: wait
 * for their devices to finish) and after they are mapped again. */
GPUMEM_EXPORT void gpumem_set_hooks(gpumem_client *c, gpumem_hook pre_unmap,
                                    gpumem_hook post_remap, void *user);

/* The connection's fd, for GPUMEM_CONNECT_NO_THREAD clients to poll. It
 * changes when the library reconnects, and is -1 while reconnecting: read
 * it again after each gpumem_dispatch. */
GPUMEM_EXPORT int gpumem_fd(const gpumem_client *c);

/* Handle the daemon's events (GPUMEM_CONNECT_NO_THREAD clients), waiting
 * up to timeout_ms (-1: until one arrives, 0: not at all). Returns the
 * number of events handled. When the connection ends it returns
 * GPUMEM_E_DISCONNECTED; while reconnecting, each call makes the next
 * attempt once its back-off has passed (waiting at most timeout_ms for
 * it) and returns 0 once connected again and buffers are re-registered,
 * GPUMEM_E_DISCONNECTED while not. */
GPUMEM_EXPORT int gpumem_dispatch(gpumem_client *c, int timeout_ms);

/* 1 if the daemon knows the buffer now, 0 while reconnecting or when the
 * daemon that came back did not re-register it. */
GPUMEM_EXPORT int gpumem_buffer_registered(const gpumem_buffer *b);

/* Connection events, for gpumem_set_connection_hook. */
enum gpumem_conn_event {
  /* The connection ended; code and words say why (the daemon's
   * GPUMEM_E_SHUTTING_DOWN, or GPUMEM_E_DISCONNECTED). Buffers stay
   * mapped; the library reconnects unless told not to. */
  GPUMEM_CONN_LOST = 1,
  /* Connected again: count buffers were re-registered; code is 0, or the
   * error of those that were not (words name them). */
  GPUMEM_CONN_RESTORED = 2,
};

/* A hook run on the thread that reads the socket when the connection is
 * lost or restored; like the buffer hooks it must not call gpumem
 * functions that talk to the daemon. */
typedef void (*gpumem_conn_hook)(gpumem_client *c, int event, int code, const char *words,
                                 size_t count, void *user);

/* Set the connection hook (NULL: none). */
GPUMEM_EXPORT void gpumem_set_connection_hook(gpumem_client *c, gpumem_conn_hook hook,
                                              void *user);

/* The daemon's last error sent outside any request (a session limit, a
 * protocol error before it closed the connection, SHUTTING_DOWN): copies
 * its code name and words ("LIMIT_EXCEEDED: too many sessions for this
 * uid") to buf and returns its (negative) code, or 0 when there was
 * none. */
GPUMEM_EXPORT int gpumem_daemon_error(gpumem_client *c, char *buf, size_t len);

/* What a pause or resume did: the fixed-size summary filled by gpumem_pause
 * and gpumem_resume. gpumem_pause_ex and gpumem_resume_ex give the whole
 * answer (per-device checks, every pid) in a struct gpumem_op_report. */
struct gpumem_op_result {
  uint64_t buffers;      /* buffers paused or resumed */
  uint64_t bytes;        /* bytes released or taken again */
  uint64_t backup_bytes; /* bytes backed up or restored */
  uint64_t skipped;      /* buffers that never pause */
  uint64_t elapsed_us;
  uint64_t backup_us;    /* of which copying contents to or from host memory */
  uint64_t bytes_needed, bytes_free; /* GPUMEM_E_OUT_OF_MEMORY */
  unsigned npids;                    /* GPUMEM_E_CLIENT_TIMEOUT */
  uint32_t pids[64];
};

/* Pause the buffers of tags on devices (NULL/0: all) on the whole node;
 * waits for every owner, at most timeout_ms each (0: the daemon's
 * default). Pausing a paused tag succeeds and changes nothing. */
GPUMEM_EXPORT int gpumem_pause(gpumem_client *c, const char *const *tags,
                               size_t ntags, const unsigned *devices,
                               size_t ndevices, unsigned timeout_ms,
                               struct gpumem_op_result *result);

/* Resume paused tags, all or nothing: with too little device memory
 * nothing changes and GPUMEM_E_OUT_OF_MEMORY says how much is needed. */
GPUMEM_EXPORT int gpumem_resume(gpumem_client *c, const char *const *tags,
                                size_t ntags, const unsigned *devices,
                                size_t ndevices, unsigned timeout_ms,
                                struct gpumem_op_result *result);

/* Options of gpumem_pause_ex and gpumem_resume_ex. Start from
 * GPUMEM_OP_OPTIONS_INIT (or zero it and set size): size lets the struct
 * grow without breaking callers built against an older header. */
struct gpumem_op_options {
  size_t size;           /* sizeof(struct gpumem_op_options) */
  unsigned timeout_ms;   /* per owner; 0: the daemon's --ack-timeout */
  /* Pause only (0: no limit): after the release, fail with the daemon's
   * RESIDUAL_EXCEEDED when a device the pause touched still holds more
   * than this many bytes outside gpumemd (by the driver's per-process
   * figures). The buffers stay paused; the report says how much is held. */
  uint64_t max_residual;
};

#define GPUMEM_OP_OPTIONS_INIT {sizeof(struct gpumem_op_options), 0, 0}

/* What the driver shows of one device after a pause or resume. */
struct gpumem_device_check {
  unsigned device;
  uint64_t released;    /* bytes the daemon released (pause) or took (resume) */
  uint64_t free_before; /* the driver's free memory before the operation */
  uint64_t free_after;  /* and after it */
  uint64_t shortfall;   /* released bytes the driver does not show as free */
  uint64_t residual;    /* bytes processes hold on the device outside gpumemd */
  int residual_known;   /* 1 where the driver gives per-process figures */
};

/* Buffers and bytes an operation moved for one tag on one device. */
struct gpumem_op_detail {
  const char *tag;
  unsigned device;
  uint64_t buffers, bytes;
};

/* The whole answer to a pause or resume, success or failure; allocated by
 * the library, freed with gpumem_op_report_free. Fields may be added at
 * the end. */
struct gpumem_op_report {
  int error;           /* 0, or the (negative) code the call returned */
  const char *code;    /* the daemon's name for it: "OK", "NOT_RELEASED", ... */
  const char *message; /* the daemon's words ("" on success) */
  uint64_t buffers;      /* buffers paused or resumed */
  uint64_t bytes;        /* bytes released or taken again */
  uint64_t backup_bytes; /* bytes backed up or restored */
  uint64_t skipped;      /* buffers that never pause */
  uint64_t elapsed_us;
  uint64_t backup_us;    /* of which copying contents to or from host memory */
  uint64_t bytes_needed, bytes_free; /* OUT_OF_MEMORY */
  /* NOT_RELEASED, CLIENT_TIMEOUT, ...: buffers that still hold memory they
   * should not (an owner that failed or did not answer), and their bytes. */
  uint64_t buffers_held, bytes_held;
  size_t npids;
  uint32_t *pids; /* the owners involved in a failure */
  size_t nchecks;
  struct gpumem_device_check *checks; /* devices touched, as the driver saw them */
  size_t ndetails;
  struct gpumem_op_detail *details;   /* per tag and device (success) */
};

/* Pause like gpumem_pause, with options (NULL: defaults). *report (when
 * report is not NULL) receives the whole answer whenever the daemon gave
 * one, on success and on failure; it is NULL when the call failed before
 * that (bad arguments, no connection). */
GPUMEM_EXPORT int gpumem_pause_ex(gpumem_client *c, const char *const *tags,
                                  size_t ntags, const unsigned *devices,
                                  size_t ndevices,
                                  const struct gpumem_op_options *opts,
                                  struct gpumem_op_report **report);

/* Resume like gpumem_resume, with options (NULL: defaults; max_residual
 * must be 0) and the whole answer in *report as for gpumem_pause_ex. */
GPUMEM_EXPORT int gpumem_resume_ex(gpumem_client *c, const char *const *tags,
                                   size_t ntags, const unsigned *devices,
                                   size_t ndevices,
                                   const struct gpumem_op_options *opts,
                                   struct gpumem_op_report **report);

/* Free a report (NULL is fine). */
GPUMEM_EXPORT void gpumem_op_report_free(struct gpumem_op_report *r);

/* One device in a status. unmanaged = total - free - reserved - managed
 * (>= 0): memory processes use that gpumemd does not manage, leaving out
 * what the driver keeps for itself. */
struct gpumem_device_status {
  unsigned index;
  uint64_t total, free, managed, unmanaged;
  int daemon_context; /* 1 while gpumemd holds a context here (backups, IPC) */
  char bus_id[32];
  uint64_t reserved;  /* memory the driver keeps for itself (0: not said) */
};

/* One tag in a status. Its state is derived from its buffers: PAUSING or
 * RESUMING while any buffer is in transit (an owner's ack missing; those
 * bytes are still held), PAUSED when every pausable buffer is paused,
 * ACTIVE when none is; mixed is 1 when some are ACTIVE and some PAUSED. */
struct gpumem_tag_status {
  char name[64];
  int state; /* enum gpumem_state */
  uint64_t buffers, bytes, backup_bytes, paused_buffers, paused_bytes;
  int mixed;
  uint64_t transit_buffers, transit_bytes; /* PAUSING or RESUMING */
};

/* One session in a status. */
struct gpumem_session_status {
  uint64_t id;
  uint32_t pid, uid;
  char name[128];
  int role; /* enum gpumem_role */
  uint64_t buffers, bytes;
  uint64_t residual;  /* device memory the process holds outside gpumemd */
  int residual_known; /* 1 where the driver gives per-process figures */
};

/* A process using a device, as the driver lists it. */
struct gpumem_process_status {
  uint32_t pid;
  unsigned device;
  uint64_t used;       /* the driver's figure for the process */
  uint64_t managed;    /* of which gpumemd's buffers (where the driver counts them) */
  uint64_t residual;   /* used - managed: held outside gpumemd */
  uint64_t session_id; /* 0: never connected to gpumemd */
  const char *name;    /* the session's name, or the process's comm */
};

/* The daemon's view of the node. */
struct gpumem_status {
  char backend[32];
  uint64_t granularity;
  size_t ndevices, ntags, nsessions;
  struct gpumem_device_status *devices;
  struct gpumem_tag_status *tags;
  struct gpumem_session_status *sessions;
  uint64_t backup_reserved, backup_limit; /* host memory for BACKUP buffers */
  uint64_t last_backup_bytes, last_backup_us;   /* the last pause that copied */
  uint64_t last_restore_bytes, last_restore_us; /* the last resume that copied */
  /* Every process using a device, per device, from the driver; empty with
   * processes_known 0 where the driver gives no per-process figures. */
  size_t nprocesses;
  struct gpumem_process_status *processes;
  int processes_known;
  /* The last pause, per device it touched: what gpumemd released next to
   * the driver's free memory before and after (none before the first). */
  size_t nlast_pause_checks;
  struct gpumem_device_check *last_pause_checks;
};

/* Ask for the status; free it with gpumem_status_free. */
GPUMEM_EXPORT int gpumem_status(gpumem_client *c, struct gpumem_status **out);

/* Free a status. */
GPUMEM_EXPORT void gpumem_status_free(struct gpumem_status *s);

/* One buffer in a list. */
struct gpumem_buffer_info {
  uint64_t id, session_id;
  uint32_t pid;
  char tag[64];
  unsigned device;
  uint64_t size;
  unsigned flags;
  int state;
};

/* List the buffers this session may see (a controller sees all); free the
 * array with gpumem_list_free. Returns the count. */
GPUMEM_EXPORT int gpumem_list(gpumem_client *c, struct gpumem_buffer_info **out);

/* Free a list. */
GPUMEM_EXPORT void gpumem_list_free(struct gpumem_buffer_info *list);

/* A short description of an error code. */
GPUMEM_EXPORT const char *gpumem_strerror(int err);

/* The words for the calling thread's last failure ("" if none). */
GPUMEM_EXPORT const char *gpumem_last_error(void);

/* The name of a state ("ACTIVE"). */
GPUMEM_EXPORT const char *gpumem_state_name(int state);

#ifdef __cplusplus
}
#endif

#endif
