/* libgpumem: the client library of gpumemd, the per-node GPU memory daemon.
 *
 * Workers (inference engines) connect as GPUMEM_ROLE_WORKER and allocate
 * tagged buffers; each buffer's pointer stays valid across pause and
 * resume. While a buffer is paused its memory is given back to the device
 * and touching it faults, as on a GPU. Orchestrators connect as
 * GPUMEM_ROLE_CONTROLLER and pause and resume tags for the whole node (or
 * for some sessions); a worker may pause and resume its own buffers.
 *
 * Devices: every device number in this API, in arguments and in results,
 * is the calling process's own (the CUDA/HIP runtime's numbering, as
 * CUDA_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES make it). Results also give
 * node_device, the daemon's number, for display; a device this process
 * cannot see has device -1. A client connected with
 * GPUMEM_CONNECT_NODE_DEVICES loads no GPU driver and uses the daemon's
 * numbers instead (device == node_device).
 *
 * Errors: functions that can fail return 0 (or a count) on success and a
 * negative GPUMEM_E_* code on failure; the daemon's errors arrive as the
 * same codes (gpumem_error_name gives the daemon's name for one). After a
 * failure gpumem_last_error() gives the daemon's (or the library's) words
 * on the calling thread. The library never exits the process.
 *
 * Threads: every function may be called from any thread at any time, with
 * two rules: a buffer must not be freed while another thread still uses
 * it, and hooks (which run on the thread that dispatches the daemon's
 * events) must not call functions that talk to the daemon (those fail
 * there with GPUMEM_E_INVALID). Reads, writes and fills of a buffer that
 * is being paused either finish before its memory is unmapped or fail
 * with GPUMEM_E_WRONG_STATE. No call waits for ever: a request the daemon
 * does not answer within the client's request timeout
 * (gpumem_set_request_timeout) fails with GPUMEM_E_TIMEOUT.
 *
 * Structs the library fills (status, lists, reports) start with their
 * size and may grow at the end; their arrays are arrays of pointers, so
 * elements may grow too. Structs the caller fills (options) start with a
 * size the caller sets, so older callers keep working. */
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

/* The version of this header; gpumem_version() gives the library's. The
 * major changes only with incompatible changes of this API. */
#define GPUMEM_VERSION_MAJOR 1
#define GPUMEM_VERSION_MINOR 12
#define GPUMEM_VERSION_PATCH 0
#define GPUMEM_VERSION \
  (GPUMEM_VERSION_MAJOR * 10000 + GPUMEM_VERSION_MINOR * 100 + GPUMEM_VERSION_PATCH)

/* The library's version, as GPUMEM_VERSION computes it (11200 for 1.12.0). */
GPUMEM_EXPORT int gpumem_version(void);

/* The library's version as text ("1.5.0"). */
GPUMEM_EXPORT const char *gpumem_version_string(void);

/* Error codes. Codes -1..-12 and -17..-19 are the daemon's; the others are
 * this library's. */
enum gpumem_error {
  GPUMEM_OK = 0,
  GPUMEM_E_INVALID = -1,        /* a bad argument */
  GPUMEM_E_PROTOCOL = -2,       /* a malformed message on the socket */
  GPUMEM_E_VERSION = -3,        /* client and daemon speak different majors */
  GPUMEM_E_PERMISSION = -4,     /* not allowed for this uid or role */
  GPUMEM_E_NOT_FOUND = -5,      /* no such buffer, tag or session */
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
  GPUMEM_E_TIMEOUT = -20,       /* the daemon did not answer within the request timeout */
  GPUMEM_E_RELEASE_REFUSED = -21, /* paused, but a context release was refused (1.6) */
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

/* Buffer flags for gpumem_alloc and gpumem_malloc. */
enum gpumem_flag {
  GPUMEM_BACKUP = 1,       /* contents survive a pause */
  GPUMEM_IPC_LEGACY = 2,   /* never paused (legacy IPC handle on GPUs); gpumem_alloc only */
  GPUMEM_ALLOW_PAUSED = 4, /* allowed in a paused tag; then starts paused */
  GPUMEM_BACKUP_RELEASE = 8, /* with GPUMEM_BACKUP: its host memory is let go of after each
                              * resume and made (and counted) again at the next pause
                              * (gpumemd 1.8) */
  GPUMEM_BACKUP_PAGEABLE = 16, /* with GPUMEM_BACKUP: the backup is pageable host memory,
                                * outside --backup-limit, copied by the daemon (1.8) */
  GPUMEM_BACKUP_DISK = 32, /* with GPUMEM_BACKUP: while paused the backup is in a file of
                            * the daemon's --backup-dir, host memory only while a pause or
                            * resume runs; implies GPUMEM_BACKUP_RELEASE (1.9) */
  GPUMEM_PERSIST = 64,     /* a named buffer the daemon keeps when this process frees it
                            * or ends; gpumem_alloc_persistent sets it (1.12) */
};

/* Flags for gpumem_connect. */
enum gpumem_connect_flag {
  /* No background thread: the application calls gpumem_dispatch when
   * gpumem_fd is readable, and daemon events wait until it does (a
   * request made meanwhile dispatches them itself while it waits). */
  GPUMEM_CONNECT_NO_THREAD = 1,
  /* When the daemon goes away, do not reconnect: calls fail with
   * GPUMEM_E_DISCONNECTED from then on and buffers stay mapped, unmanaged,
   * until freed. */
  GPUMEM_CONNECT_NO_RECONNECT = 2,
  /* This client maps no memory (status, lists, pause and resume only): it
   * loads no GPU driver, numbers devices as the daemon does (device ==
   * node_device), and its allocations fail with GPUMEM_E_PERMISSION.
   * gpumemctl connects this way. */
  GPUMEM_CONNECT_NODE_DEVICES = 4,
  /* Let a pause that asks for it (gpumem_op_options.release_context)
   * release this process's own device state (its context, CUDA-graph
   * pools, cuBLAS workspaces, PyTorch's cached blocks) to host memory
   * once every buffer of it is paused, and a resume bring it back before
   * its buffers are mapped again (1.6). The environment variable
   * GPUMEM_RELEASE_CONTEXT=1 sets it for every connection of the process
   * (the preload library and Python paths). While released, the
   * process's device calls block until the resume; a released process
   * whose daemon goes away is restored by the daemon that follows. */
  GPUMEM_CONNECT_RELEASE_CONTEXT = 8,
  /* Have the daemon copy this worker's BACKUP buffers to and from host
   * memory itself, in a device context of its own made for the copies,
   * as before 1.7. By default a worker copies them itself, into and out
   * of the daemon's backup memory that the pause and the resume hand it,
   * with its own context, so that the daemon holds none (1.7). The
   * environment variable GPUMEM_DAEMON_COPIES=1 sets it for every
   * connection of the process. */
  GPUMEM_CONNECT_DAEMON_COPIES = 16,
};

/* The default socket path, used when neither an argument nor the
 * GPUMEM_SOCKET environment variable names one. */
#define GPUMEM_DEFAULT_SOCKET "/run/gpumemd/gpumemd.sock"

/* The request timeout of a new client, in milliseconds. */
#define GPUMEM_DEFAULT_REQUEST_TIMEOUT_MS 30000

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

/* Disconnect: unmap and forget every buffer and sub-allocation of this
 * client (the daemon frees them) and free the client. */
GPUMEM_EXPORT void gpumem_disconnect(gpumem_client *c);

/* Set how long a request waits for the daemon's answer before failing with
 * GPUMEM_E_TIMEOUT (ms; 0: GPUMEM_DEFAULT_REQUEST_TIMEOUT_MS). A pause or
 * resume waits this long on top of its own owner timeout. A reply that
 * arrives later is dropped; memory an allocation got by then is given
 * back. The same limit bounds sending: a request that cannot even be
 * sent by then (the daemon has not read what came before it) fails with
 * GPUMEM_E_TIMEOUT, and a daemon that reads nothing for this long while
 * the library has an ack (or another message that is not a request) to
 * send loses the connection, as if it had gone away. */
GPUMEM_EXPORT void gpumem_set_request_timeout(gpumem_client *c, unsigned ms);

/* Keep at least bytes of a device free: each later allocation of this
 * client that takes device memory (gpumem_alloc, and the buffers
 * gpumem_malloc's pool grows by) fails with GPUMEM_E_OUT_OF_MEMORY where
 * it would leave less than that free by the driver's figure, as
 * torch_memory_saver's memory_margin_bytes does; 0 (the default) keeps
 * no margin. A buffer that starts paused takes nothing. With a margin,
 * allocating from a daemon older than 1.7 fails with GPUMEM_E_VERSION
 * (it would ignore the margin). */
GPUMEM_EXPORT void gpumem_set_keep_free(gpumem_client *c, uint64_t bytes);

/* The daemon's backend ("host", "cuda", "hip"). */
GPUMEM_EXPORT const char *gpumem_backend(const gpumem_client *c);

/* The allocation granularity: buffer sizes are rounded up to a multiple. */
GPUMEM_EXPORT uint64_t gpumem_granularity(const gpumem_client *c);

/* The number of the daemon's devices this process can see (devices
 * 0..count-1 in this process's numbering). */
GPUMEM_EXPORT unsigned gpumem_device_count(const gpumem_client *c);

/* Allocate a buffer of at least size bytes tagged tag on device, mapped
 * and ready (or reserved only, when it starts paused). GPUMEM_IPC_LEGACY
 * buffers on GPUs are plain device memory opened from a legacy IPC
 * handle. Each buffer is one daemon allocation: for many small ones use
 * gpumem_malloc. */
GPUMEM_EXPORT int gpumem_alloc(gpumem_client *c, const char *tag, int device,
                               uint64_t size, unsigned flags, gpumem_buffer **out);

/* Free a buffer (active or paused); its pointer becomes invalid. A
 * persistent buffer (gpumem_alloc_persistent) is only let go of by this
 * process: the daemon keeps it, for gpumem_attach, until gpumem_drop. The
 * buffer is gone for the caller even when this fails with
 * GPUMEM_E_TIMEOUT: the library finishes the free. It keeps the buffer
 * (answering pause and resume events for it) until the daemon frees it,
 * sending the free again after a back-off while the daemon refuses it (a
 * pause or resume has the buffer), or until the connection ends (the
 * daemon frees it then). Any other failure (GPUMEM_E_WRONG_STATE while a
 * pause or resume has it, ...) leaves the buffer the caller's, unchanged.
 * A buffer of gpumem_malloc's pool (hooks show them with the buffers of
 * gpumem_alloc) fails with GPUMEM_E_INVALID: free its allocations with
 * gpumem_free_ptr. */
GPUMEM_EXPORT int gpumem_free(gpumem_client *c, gpumem_buffer *b);

/* Allocate a persistent buffer named name (1-63 characters of
 * [A-Za-z0-9_.-], new among this uid's persistent buffers), as
 * gpumem_alloc does with GPUMEM_PERSIST added to flags (not with
 * GPUMEM_IPC_LEGACY). The daemon keeps it, memory and contents, when this
 * process frees it (gpumem_free lets go of it here only) or ends, charged
 * to this uid, and pauses and resumes it with its tag; a process of this
 * uid takes it again with gpumem_attach, and only gpumem_drop (or a
 * controller's) frees it. GPUMEM_E_WRONG_STATE when the name is taken
 * (1.12). */
GPUMEM_EXPORT int gpumem_alloc_persistent(gpumem_client *c, const char *name, const char *tag,
                                          int device, uint64_t size, unsigned flags,
                                          gpumem_buffer **out);

/* Take this uid's persistent buffer named name, which no process holds
 * now: mapped at a new address with the contents it had (or, while its
 * tag is paused, reserved only, mapped at the resume), with its tag,
 * device and flags. GPUMEM_E_NOT_FOUND when this uid has none of that
 * name, GPUMEM_E_WRONG_STATE while a process holds it or a pause or resume
 * has it, GPUMEM_E_INVALID when its device is not one this process sees
 * (1.12). */
GPUMEM_EXPORT int gpumem_attach(gpumem_client *c, const char *name, gpumem_buffer **out);

/* gpumem_attach, but while a process holds the buffer (or a pause or
 * resume has it, or the process that let go of it still maps it), wait up
 * to wait_ms (at most 600000) for it to be let go of, then take it: a
 * standby engine's failover, served the moment the holder frees it or
 * ends. GPUMEM_E_WRONG_STATE when the wait ends first; the call's request
 * timeout is extended by wait_ms (1.12). */
GPUMEM_EXPORT int gpumem_attach_wait(gpumem_client *c, const char *name, unsigned wait_ms,
                                     gpumem_buffer **out);

/* Free the persistent buffer named name that no process holds: this
 * uid's, or for a controller uid's. The device bytes freed into *bytes
 * (may be NULL; 0 for a paused buffer). GPUMEM_E_NOT_FOUND,
 * GPUMEM_E_WRONG_STATE as for gpumem_attach (1.12). */
GPUMEM_EXPORT int gpumem_drop(gpumem_client *c, const char *name, uint32_t uid,
                              uint64_t *bytes);

/* Allocate size bytes (> 0) tagged tag on device and store the address in
 * *ptr, aligned to at least 512 bytes. Small allocations are carved out of
 * larger daemon buffers of the same tag, device and flags (one daemon
 * round trip per such buffer, not per allocation); a pause of the tag
 * releases them like any buffer, and the address stays valid across pause
 * and resume. Flags: GPUMEM_BACKUP, GPUMEM_ALLOW_PAUSED. Memory comes only
 * from a pool buffer that is mapped (not paused, nor being paused) unless
 * flags has GPUMEM_ALLOW_PAUSED, and never from one that the daemon does
 * not know (one a restarted daemon did not re-register; while the library
 * reconnects, mapped ones still serve). Free with gpumem_free_ptr. */
GPUMEM_EXPORT int gpumem_malloc(gpumem_client *c, const char *tag, int device,
                                uint64_t size, unsigned flags, void **ptr);

/* Free the allocation that starts at ptr: one made by gpumem_malloc, or a
 * buffer from gpumem_alloc. The address of a pool buffer frees the
 * allocation that starts there, never the pool buffer. Unknown pointers
 * fail with GPUMEM_E_NOT_FOUND and change nothing. */
GPUMEM_EXPORT int gpumem_free_ptr(gpumem_client *c, void *ptr);

/* Give the daemon back every pooled buffer of this client that holds no
 * allocation of gpumem_malloc; returns the bytes given back. Buffers the
 * daemon does not take (it is away, or a pause has them) stay in the
 * pool: the call fails with the first one's error only when none went
 * back, and otherwise returns the bytes of those that did. */
GPUMEM_EXPORT int64_t gpumem_trim(gpumem_client *c);

/* Sub-allocation figures of a client, for gpumem_pool_stats. */
struct gpumem_pool_stats {
  size_t size;               /* sizeof(struct gpumem_pool_stats): see gpumem_pool_stats */
  uint64_t allocations;      /* live gpumem_malloc allocations */
  uint64_t allocated_bytes;  /* their sizes */
  uint64_t pooled_buffers;   /* daemon buffers they are carved from */
  uint64_t pooled_bytes;     /* the bytes of those buffers */
  uint64_t daemon_allocs;    /* daemon allocations made for pools so far */
};

/* Fill *out with the client's sub-allocation figures: the caller sets
 * out->size to the size of its struct; the library fills what both know
 * and sets out->size to what it filled. */
GPUMEM_EXPORT int gpumem_pool_stats(gpumem_client *c, struct gpumem_pool_stats *out);

/* The buffer's address; the same before and after pause and resume. */
GPUMEM_EXPORT void *gpumem_buffer_ptr(const gpumem_buffer *b);

/* The buffer's size, rounded up to the granularity. */
GPUMEM_EXPORT uint64_t gpumem_buffer_size(const gpumem_buffer *b);

/* The buffer's tag. */
GPUMEM_EXPORT const char *gpumem_buffer_tag(const gpumem_buffer *b);

/* The buffer's device. */
GPUMEM_EXPORT int gpumem_buffer_device(const gpumem_buffer *b);

/* The buffer's id at the daemon (a new one after the buffer was
 * re-registered with a restarted daemon). */
GPUMEM_EXPORT uint64_t gpumem_buffer_id(const gpumem_buffer *b);

/* Its tag's generation when the buffer was last mapped (gpumemd 1.10; 0
 * before): how many resumes had given the tag's buffers new memory. The
 * address stays, the memory behind it is new at every generation: a
 * registration of it made at another one (NCCL user buffers, a captured
 * CUDA graph's) is stale. Read it in a post_remap hook, or compare with
 * gpumem_tag_status's generation. */
GPUMEM_EXPORT uint64_t gpumem_buffer_generation(const gpumem_buffer *b);

/* The generation (gpumem_buffer_generation) of the buffer of c that holds
 * ptr (a gpumem_alloc buffer, or an allocation of gpumem_malloc inside
 * one: a tensor's data pointer) into *generation. GPUMEM_E_NOT_FOUND
 * when no buffer of c holds it. */
GPUMEM_EXPORT int gpumem_generation(gpumem_client *c, const void *ptr, uint64_t *generation);

/* The buffer's flags (GPUMEM_BACKUP, ...). */
GPUMEM_EXPORT unsigned gpumem_buffer_flags(const gpumem_buffer *b);

/* A persistent buffer's name ("" for any other buffer) (1.12). */
GPUMEM_EXPORT const char *gpumem_buffer_name(const gpumem_buffer *b);

/* 1 if memory is mapped behind the pointer now, 0 while paused. */
GPUMEM_EXPORT int gpumem_buffer_mapped(const gpumem_buffer *b);

/* 1 if the daemon knows the buffer now, 0 while reconnecting or when the
 * daemon that came back did not re-register it. */
GPUMEM_EXPORT int gpumem_buffer_registered(const gpumem_buffer *b);

/* Copy len bytes at offset off of a buffer to host memory at dst (with the
 * device's copy engine on GPUs; memcpy on the host backend). Fails with
 * GPUMEM_E_WRONG_STATE while the buffer is paused or being paused. */
GPUMEM_EXPORT int gpumem_buffer_read(gpumem_client *c, gpumem_buffer *b, uint64_t off,
                                     void *dst, uint64_t len);

/* Copy len bytes of host memory at src into a buffer at offset off. */
GPUMEM_EXPORT int gpumem_buffer_write(gpumem_client *c, gpumem_buffer *b, uint64_t off,
                                      const void *src, uint64_t len);

/* Set len bytes at offset off of a buffer to a repeated 32-bit value, on
 * the device; off and len are multiples of 4. Returns when done. */
GPUMEM_EXPORT int gpumem_buffer_fill32(gpumem_client *c, gpumem_buffer *b, uint64_t off,
                                       uint64_t len, uint32_t value);

/* Wait until work on a device has finished. */
GPUMEM_EXPORT int gpumem_sync(gpumem_client *c, int device);

/* A hook run with the buffers of one daemon event. It runs on the thread
 * that dispatches events, with no library lock held, and must not call
 * gpumem functions that talk to the daemon. */
typedef void (*gpumem_hook)(gpumem_client *c, gpumem_buffer *const *bufs,
                            size_t n, void *user);

/* Set the hooks run before buffers are unmapped (default, when NULL: wait
 * for their devices to finish) and after they are mapped again. An event
 * that has started keeps the hooks it started with. */
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
 * lost or restored; like the buffer hooks it runs with no library lock
 * held and must not call gpumem functions that talk to the daemon. */
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

/* What a pause or resume covers, besides its tags and devices. */
enum gpumem_scope {
  GPUMEM_SCOPE_NODE = 0, /* every session's buffers (controllers only) */
  GPUMEM_SCOPE_OWN = 1,  /* this client's own buffers (any role) */
};

/* Options of gpumem_pause and gpumem_resume. Start from
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
  int scope;             /* enum gpumem_scope */
  /* Controllers: only the sessions of these pids (npids 0: any) ... */
  const uint32_t *pids;
  size_t npids;
  /* ... and only sessions whose name starts with this (NULL or "": any). */
  const char *session_prefix;
  /* Pause only (1.6): once the buffers are paused, release the device
   * state of each worker process the pause covers that connected with
   * GPUMEM_CONNECT_RELEASE_CONTEXT and maps nothing of the daemon's (the
   * report's releases say what each moved to host memory). One that may
   * not be released fails the call with GPUMEM_E_RELEASE_REFUSED and the
   * reason, the pause itself done; one whose release did not hold fails
   * it with GPUMEM_E_NOT_RELEASED. */
  int release_context;
  /* Resume only (1.10; 0: none, at most 600000): where a device lacks the
   * room, wait up to this long for it (the trainer's allocator may still
   * be letting go), trying again as the driver's free figure grows,
   * instead of failing with GPUMEM_E_OUT_OF_MEMORY at once; the report's
   * waited_us says how long. Disconnecting ends the wait. Other
   * operations queue behind a waiting resume; a worker's own resume
   * waits no longer than the daemon's --ack-timeout. */
  unsigned wait_ms;
};

#define GPUMEM_OP_OPTIONS_INIT {sizeof(struct gpumem_op_options), 0, 0, 0, NULL, 0, NULL, 0, 0}

/* What the driver shows of one device after a pause or resume. */
struct gpumem_device_check {
  size_t size;
  int device;           /* this process's number, -1 if it cannot see it */
  unsigned node_device; /* the daemon's number */
  uint64_t released;    /* bytes the daemon released (pause) or took (resume) */
  uint64_t free_before; /* the driver's free memory before the operation */
  uint64_t free_after;  /* and after it */
  uint64_t shortfall;   /* released bytes the driver does not show as free */
  uint64_t residual;    /* bytes processes hold on the device outside gpumemd */
  int residual_known;   /* 1 where the driver gives per-process figures */
  /* A pause whose owners' sessions ended during it waited this long for
   * those processes to leave the driver's list before it read the figures
   * above (gpumemd --exit-wait bounds it); exit_listed of them were still
   * listed when it stopped waiting, the first being exit_listed_pid. */
  uint32_t exit_wait_ms;
  uint32_t exit_listed;
  uint32_t exit_listed_pid;
  /* What the driver shows used after the operation, its reserve left out
   * (total - free - reserved): what a paused device still holds (1.6). */
  uint64_t used_after;
};

/* Buffers and bytes an operation moved for one tag on one device. */
struct gpumem_op_detail {
  size_t size;
  const char *tag;
  int device;
  unsigned node_device;
  uint64_t buffers, bytes;
};

/* A worker process whose device state a pause released (or tried to), or
 * a resume brought back (1.6). */
struct gpumem_process_release {
  size_t size;
  uint32_t pid;
  int released;           /* 1: its device state is in host memory now */
  uint64_t moved_to_host; /* device bytes the driver listed for it before */
  uint64_t elapsed_us;
  const char *why;        /* not released (or not restored): why; "" when done */
};

/* The whole answer to a pause or resume, success or failure; allocated by
 * the library, freed with gpumem_op_report_free. */
struct gpumem_op_report {
  size_t size;
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
  struct gpumem_device_check **checks; /* devices touched, as the driver saw them */
  size_t ndetails;
  struct gpumem_op_detail **details;   /* per tag and device (success) */
  size_t nreleases;
  struct gpumem_process_release **releases; /* context releases and restores (1.6) */
  /* A pause: each process the driver lists on the devices it touched and
   * what it still holds there, as gpumem_status gives them (a worker's
   * own processes only) (1.6). */
  size_t nprocesses;
  struct gpumem_process_status **processes;
  uint64_t waited_us; /* a resume: how long it waited for room (wait_ms; 1.10) */
};

/* Pause the buffers of tags (ntags 0: every tag) on devices (ndevices 0:
 * every device) within the scope of opts (NULL: defaults, the whole node);
 * waits for every owner, at most opts->timeout_ms each. Pausing what is
 * paused succeeds and changes nothing. *report (when report is not NULL)
 * receives the whole answer whenever the daemon gave one, on success and
 * on failure; it is NULL when the call failed before that (bad arguments,
 * no connection). Returns 0 or a negative code. */
GPUMEM_EXPORT int gpumem_pause(gpumem_client *c, const char *const *tags, size_t ntags,
                               const int *devices, size_t ndevices,
                               const struct gpumem_op_options *opts,
                               struct gpumem_op_report **report);

/* Resume paused buffers like gpumem_pause selects them (max_residual must
 * be 0), all or nothing: with too little device memory nothing changes
 * and GPUMEM_E_OUT_OF_MEMORY says how much is needed. */
GPUMEM_EXPORT int gpumem_resume(gpumem_client *c, const char *const *tags, size_t ntags,
                                const int *devices, size_t ndevices,
                                const struct gpumem_op_options *opts,
                                struct gpumem_op_report **report);

/* Free a report (NULL is fine). */
GPUMEM_EXPORT void gpumem_op_report_free(struct gpumem_op_report *r);

/* Share a tag with every uid (shared 1), creating it if it does not exist,
 * or make it its owner's alone again (shared 0; buffers already in it
 * stay). A tag belongs to the uid whose buffer created it: another uid's
 * allocations in it get GPUMEM_E_PERMISSION until it is shared. Needs a
 * controller (1.4). Returns 0 or a negative code. */
GPUMEM_EXPORT int gpumem_share(gpumem_client *c, const char *tag, int shared);

/* One device in a status. unmanaged = total - free - reserved - managed
 * (>= 0): memory processes use that gpumemd does not manage, leaving out
 * what the driver keeps for itself. */
struct gpumem_device_status {
  size_t size;
  int device;           /* this process's number, -1 if it cannot see it */
  unsigned node_device; /* the daemon's number */
  uint64_t total, free, managed, unmanaged;
  uint64_t reserved;    /* memory the driver keeps for itself (0: not said) */
  int daemon_context;   /* 1 while gpumemd holds a context here (backups, IPC) */
  const char *bus_id;
};

/* One tag in a status. Its state is derived from its buffers: PAUSING or
 * RESUMING while any buffer is in transit (an owner's ack missing; those
 * bytes are still held), PAUSED when every pausable buffer is paused,
 * ACTIVE when none is; mixed is 1 when some are ACTIVE and some PAUSED. */
struct gpumem_tag_status {
  size_t size;
  const char *name;
  int state; /* enum gpumem_state */
  uint64_t buffers, bytes, backup_bytes, paused_buffers, paused_bytes;
  int mixed;
  uint64_t transit_buffers, transit_bytes; /* PAUSING or RESUMING */
  /* Who may add buffers (1.4): the owner's uid alone, or every uid when
   * shared (then a worker's status counts only its own uid's buffers).
   * owned is 0 for a tag a controller shared before any buffer joined. */
  uint32_t owner_uid;
  int owned, shared;
  /* Host memory its backups hold now (pinned on GPUs), and the part of
   * --backup-limit its buffers reserve (1.8). */
  uint64_t backup_pinned_bytes, backup_reserved_bytes;
  uint64_t backup_pageable_bytes; /* pageable host memory its backups hold now (1.8) */
  uint64_t backup_disk_bytes; /* its backups in files of the daemon's --backup-dir (1.9) */
  /* Resumes that gave its buffers new memory (gpumem_buffer_generation;
   * 1.10, 0 from an older daemon). */
  uint64_t generation;
};

/* One session in a status. */
struct gpumem_session_status {
  size_t size;
  uint64_t id;
  uint32_t pid, uid;
  const char *name;
  int role; /* enum gpumem_role */
  uint64_t buffers, bytes;
  uint64_t residual;  /* device memory the process holds outside gpumemd */
  int residual_known; /* 1 where the driver gives per-process figures */
  int release_context;  /* opted in to context release (1.6) */
  int context_released; /* its process's device state is in host memory now */
  uint64_t moved_to_host; /* device bytes that release moved there */
};

/* A process using a device, as the driver lists it. */
struct gpumem_process_status {
  size_t size;
  uint32_t pid;
  int device;           /* this process's number, -1 if it cannot see it */
  unsigned node_device; /* the daemon's number */
  uint64_t used;        /* the driver's figure for the process */
  uint64_t managed;     /* of which gpumemd's buffers (where the driver counts them) */
  uint64_t residual;    /* used - managed: held outside gpumemd */
  uint64_t session_id;  /* 0: never connected to gpumemd */
  const char *name;     /* the session's name, or the process's comm */
};

/* One pause or resume the daemon ran or is running (1.3). */
struct gpumem_op_record {
  size_t size;
  const char *op;       /* "pause" or "resume" */
  size_t ntags;         /* 0: every tag */
  const char **tags;
  uint32_t pid;         /* the process that asked */
  int done;             /* 0 while it runs */
  int result;           /* 0 or a GPUMEM_E_* code, once done */
  /* Device bytes released (pause) or mapped again by their owners
   * (resume) so far; once done, what the operation released or gave back
   * (0 for a resume that failed: it gives nothing back). */
  uint64_t bytes_done;
  uint64_t bytes_total; /* device bytes the operation covers */
  uint64_t copied_bytes;/* bytes backed up or restored */
  uint64_t started_ms;  /* when it started, Unix time in milliseconds */
  uint64_t duration_us; /* how long it took, or has run so far */
};

/* A count kept since the daemon started (1.3): of operations ("pause" or
 * "resume") by result ("OK" or an error name), or of errors answered to
 * any request by error name (op ""). */
struct gpumem_counter {
  size_t size;
  const char *op;
  const char *name;
  uint64_t count;
};

/* Durations of one operation since the daemon started (1.3): count[i]
 * operations took at most le_us[i] microseconds (cumulative; the last
 * bound is UINT64_MAX, "+Inf"). */
struct gpumem_histogram {
  size_t size;
  const char *op; /* "pause" or "resume" */
  size_t nbuckets;
  const uint64_t *le_us;
  const uint64_t *count;
  uint64_t total;  /* operations */
  uint64_t sum_us; /* their durations added */
};

/* What one uid holds (1.4). */
struct gpumem_tenant_status {
  size_t size;
  uint32_t uid;
  uint64_t buffers;
  uint64_t bytes;             /* on every device, paused or not */
  uint64_t backup_bytes;      /* host memory its BACKUP buffers reserve */
  size_t ndevice_bytes;
  const uint64_t *device_bytes; /* by the daemon's device number */
};

/* The daemon's view of the node. A controller sees everything; a worker
 * sees its own uid's sessions, processes and tenant line, and the tags
 * its uid owns or that are shared. */
struct gpumem_status {
  size_t size;
  const char *backend;
  uint64_t granularity;
  size_t ndevices, ntags, nsessions;
  struct gpumem_device_status **devices;
  struct gpumem_tag_status **tags;
  struct gpumem_session_status **sessions;
  uint64_t backup_reserved, backup_limit; /* host memory for BACKUP buffers */
  uint64_t backup_ready; /* of the reserved, host memory already made */
  uint64_t last_backup_bytes, last_backup_us;   /* the last pause that copied */
  uint64_t last_restore_bytes, last_restore_us; /* the last resume that copied */
  /* Every process using a device, per device, from the driver; empty with
   * processes_known 0 where the driver gives no per-process figures. */
  size_t nprocesses;
  struct gpumem_process_status **processes;
  int processes_known;
  /* The last pause, per device it touched: what gpumemd released next to
   * the driver's free memory before and after (none before the first). */
  size_t nlast_pause_checks;
  struct gpumem_device_check **last_pause_checks;
  /* The daemon's version ("1.5.0"); "" from a daemon that does not say. */
  const char *version;
  /* Since the daemon started (1.3; empty and 0 from an older daemon). */
  uint64_t uptime_ms;
  uint64_t bytes_released, bytes_restored; /* by pauses and resumes */
  size_t nop_counts;      /* operations by op and result */
  struct gpumem_counter **op_counts;
  size_t nerror_counts;   /* errors answered, by name (op "") */
  struct gpumem_counter **error_counts;
  size_t nhistograms;     /* one per op */
  struct gpumem_histogram **histograms;
  /* The operations running now, then the last ones done, newest first
   * (at most 16 done). */
  size_t nrecent_ops;
  struct gpumem_op_record **recent_ops;
  /* The daemon's own fds and queues (1.3; 0 from an older daemon): the
   * fds it may hold (its RLIMIT_NOFILE) and holds now, of those the fds
   * parked in requests still arriving, the bytes of replies and events
   * queued for sessions and not yet read, and the connections refused for
   * want of fds since it started. */
  uint64_t fd_limit, fds_open, fds_parked;
  uint64_t queued_bytes;
  uint64_t connections_refused;
  /* What each uid holds, by uid, and the per-uid quotas (0: none) (1.4;
   * empty and 0 from an older daemon). */
  size_t ntenants;
  struct gpumem_tenant_status **tenants;
  uint64_t max_buffers_per_uid, max_device_bytes_per_uid, max_backup_bytes_per_uid;
  /* The re-registration grace after the daemon started (--adopt-grace):
   * the milliseconds it still runs (0: over, or none) and the allocations
   * in new tags that wait for it to end (1.5; 0 from an older daemon). */
  uint64_t grace_left_ms, grace_waiting;
  /* Disk backups (1.9; "" and 0 from an older daemon or one without
   * --backup-dir): the directory, the bytes of backups its files hold,
   * and the bytes its filesystem has free. */
  const char *backup_dir;
  uint64_t backup_disk_bytes, backup_disk_free;
  /* Persistent buffers (1.12; none from an older daemon): at most 256 of
   * them, those no process holds first, and how many there are in all (a
   * worker's: its uid's). */
  size_t npersistent;
  struct gpumem_buffer_info **persistent;
  uint64_t total_persistent;
};

/* Ask for the status; free it with gpumem_status_free. The daemon sends
 * a large status in pages: this gathers them all (each page is the
 * daemon's state when it answered it). Pages that would not end (an
 * empty page with a cursor, more items than the first page announced, a
 * million pages) fail with GPUMEM_E_PROTOCOL; a walk whose totals change
 * is made again, and after three fails with GPUMEM_E_WRONG_STATE (1.10). */
GPUMEM_EXPORT int gpumem_status(gpumem_client *c, struct gpumem_status **out);

/* Free a status (NULL is fine). */
GPUMEM_EXPORT void gpumem_status_free(struct gpumem_status *s);

/* One buffer in a list. */
struct gpumem_buffer_info {
  size_t size;
  uint64_t id, session_id;
  uint32_t pid;
  const char *tag;
  int device;           /* this process's number, -1 if it cannot see it */
  unsigned node_device; /* the daemon's number */
  uint64_t bytes;       /* the buffer's size */
  unsigned flags;
  int state;            /* enum gpumem_state */
  /* A persistent buffer's (1.12; "" and 0 for others): its name, the
   * milliseconds since it was made, its last holder's pid and session
   * name, and the milliseconds since that holder let go of it (0 while a
   * process holds it; session_id and pid are 0 while none does). */
  const char *name;
  uint64_t age_ms;
  uint32_t last_pid;
  const char *last_name;
  uint64_t idle_ms;
  uint32_t uid; /* whose it is (1.12; 0 from an older daemon) */
};

/* The buffers a session may see (a controller sees all). */
struct gpumem_list {
  size_t size;
  size_t nbuffers;
  struct gpumem_buffer_info **buffers;
};

/* Ask for the list, in id order (gathered from the daemon's pages and
 * checked as gpumem_status's are); free it with gpumem_list_free.
 * Returns the count. */
GPUMEM_EXPORT int gpumem_list(gpumem_client *c, struct gpumem_list **out);

/* Free a list (NULL is fine). */
GPUMEM_EXPORT void gpumem_list_free(struct gpumem_list *l);

/* A short description of an error code ("the tag is paused"). */
GPUMEM_EXPORT const char *gpumem_strerror(int err);

/* The daemon's name of an error code ("TAG_PAUSED"; "OK" for 0,
 * "UNKNOWN" for a code this library does not know). */
GPUMEM_EXPORT const char *gpumem_error_name(int err);

/* The words for the calling thread's last failure ("" if none). */
GPUMEM_EXPORT const char *gpumem_last_error(void);

/* The name of a state ("ACTIVE"). */
GPUMEM_EXPORT const char *gpumem_state_name(int state);

/* Copy len bytes of what the last pause saved of the paused GPUMEM_BACKUP
 * buffer of c that holds [ptr, ptr + len) (a gpumem_alloc buffer, or an
 * allocation of gpumem_malloc inside one) to host memory at dst, while it
 * stays paused: to ship weights elsewhere while the engine sleeps. The
 * backup memory the buffer keeps mapped serves directly; else the daemon
 * hands it (gpumemd 1.8), and the buffer keeps it mapped from then on. A
 * backup in the daemon's --backup-dir is read from its file (mapped read
 * only), and a pageable one is first copied whole into a memfd of this
 * process (gpumemd 1.10); each is kept until the buffer is mapped again.
 * Errors: GPUMEM_E_NOT_FOUND (no buffer of c holds those bytes),
 * GPUMEM_E_WRONG_STATE (the buffer is mapped, or has no backup),
 * GPUMEM_E_BACKEND (the copy failed, or this backend's backups cannot be
 * handed out: HIP's), GPUMEM_E_NOMEM (no memory for the copy),
 * GPUMEM_E_VERSION (an older daemon). */
GPUMEM_EXPORT int gpumem_backup_read(gpumem_client *c, const void *ptr, uint64_t len,
                                     void *dst);

/* As gpumem_backup_read, but no copy: *host is set to the same bytes in
 * the backup's host memory, readable until the buffer is resumed or freed
 * (its next pause writes them again). They must not be written. */
GPUMEM_EXPORT int gpumem_backup_view(gpumem_client *c, const void *ptr, uint64_t len,
                                     const void **host);

/* The current tag of the calling thread: gpumem_torch_alloc and the
 * preload library allocate with it. Set tag NULL to clear it. flags are
 * gpumem_malloc's. Returns 0 or GPUMEM_E_INVALID for a bad tag. */
GPUMEM_EXPORT int gpumem_set_thread_tag(const char *tag, unsigned flags);

/* The calling thread's current tag (NULL if none) and, when flags is not
 * NULL, its flags. */
GPUMEM_EXPORT const char *gpumem_thread_tag(unsigned *flags);

/* Make c the process's default client, used by gpumem_torch_alloc and the
 * preload library for new allocations (NULL: none). Allocations keep the
 * client that made them: gpumem_torch_free and the preload library's
 * frees go to that client whatever the default is by then, so switching
 * the default strands nothing. The caller keeps ownership of c;
 * gpumem_disconnect(c) clears it as the default and forgets the pointers
 * made with it (their frees then change nothing). */
GPUMEM_EXPORT void gpumem_set_default_client(gpumem_client *c);

/* The process's default client: the one set, or else one connected on
 * first use as a worker to $GPUMEM_SOCKET (else the default path) with
 * the name $GPUMEM_NAME (else "pid-<pid>"). NULL when it cannot connect
 * (gpumem_last_error says why). A forked child gets its own: the child
 * forgets the parent's default client (without touching the parent's
 * connection, whose struct it leaks) and the pointers the entry points
 * below handed out, and connects its own on first use. */
GPUMEM_EXPORT gpumem_client *gpumem_default_client(void);

/* The allocation entry point for torch.cuda.memory.CUDAPluggableAllocator:
 * size bytes on device (this process's numbering) from the default
 * client, as gpumem_malloc does, with the calling thread's tag and flags,
 * else $GPUMEM_DEFAULT_TAG (else "default") with the flags that
 * $GPUMEM_DEFAULT_FLAGS names ("backup", "allow_paused", joined by
 * commas). Returns NULL when the daemon refuses (PyTorch then raises its
 * out-of-memory error). stream is unused: the memory is usable on every
 * stream. */
GPUMEM_EXPORT void *gpumem_torch_alloc(size_t size, int device, void *stream);

/* The free entry point for CUDAPluggableAllocator: frees what
 * gpumem_torch_alloc returned, through the client that allocated it. */
GPUMEM_EXPORT void gpumem_torch_free(void *ptr, size_t size, int device, void *stream);

#ifdef __cplusplus
}
#endif

#endif
