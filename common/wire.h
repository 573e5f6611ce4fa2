/* The wire protocol's constants, limits, framing of envelopes and the one
 * place where messages from a peer are checked. */
#ifndef GPUMEM_WIRE_H
#define GPUMEM_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/limits.h"
#include "proto/gpumemd.pb-c.h"

/* Don't forget to bump these when proto/gpumemd.proto changes. */
#define WIRE_VERSION_MAJOR 1
#define WIRE_VERSION_MINOR 12

#define WIRE_MAX_REQUEST (64 * 1024)        /* client to daemon */
#define WIRE_MAX_REPLY (64 * 1024 * 1024)   /* daemon to client */
#define WIRE_TAG_MAX 63
/* Bytes of the secret a daemon gives with each buffer (AllocReply.secret). */
#define WIRE_SECRET_SIZE 16
#define WIRE_NAME_MAX 127
#define WIRE_MAX_TAGS 64
#define WIRE_MAX_MESSAGE 512
#define WIRE_MAX_PIDS 256 /* pids in a pause or resume scope */
#define WIRE_MAX_WAIT_MS 600000 /* a resume's wait for room (ResumeRequest.wait_ms) */
#define WIRE_GENERATION_MAX (UINT64_C(1) << 62) /* a tag generation a daemon could have given */

typedef Gpumem__Wire__Envelope wire_env;
typedef Gpumem__Wire__ErrorCode wire_code;

/* True if tag is 1..WIRE_TAG_MAX characters of [A-Za-z0-9_.-]. */
bool wire_tag_valid(const char *tag);

/* True if name is at most WIRE_NAME_MAX bytes of UTF-8 without control
 * characters (a session name, or a prefix of one). */
bool wire_name_valid(const char *name);

/* The length of the character at p under the daemon's text check: 0 if
 * p does not start a UTF-8 sequence (truncated, overlong, a surrogate or
 * past U+10FFFF), else its bytes, with *control true for a C0 or C1
 * control character or DEL. */
size_t wire_char(const char *p, bool *control);

/* True if s is at most max bytes of UTF-8 without control characters
 * (safe in a log line, a terminal and a proto3 string). */
bool wire_text_valid(const char *s, size_t max);

/* Make s valid text in place (what the kernel or a driver says of a
 * process, such as its comm): each byte of a control character or of what
 * is not UTF-8 becomes '?'. */
void wire_text_clean(char *s);

/* The protocol's name for an error code ("OUT_OF_MEMORY"). */
const char *wire_code_name(wire_code code);

/* The protocol's name for a buffer state ("ACTIVE"). */
const char *wire_state_name(int state);

/* An envelope of this id whose body is msg, as the oneof case body_case.
 * msg must be of that case's message type: a call that names another is
 * a bug and aborts. */
wire_env wire_envelope(uint64_t id, Gpumem__Wire__Envelope__BodyCase body_case, void *msg);

/* Serialize an envelope. Returns a malloc'd buffer and its length in *len,
 * or NULL when out of memory. */
uint8_t *wire_pack(const wire_env *env, size_t *len);

/* Parse a payload; NULL if it is not a valid Envelope. Free with
 * wire_env_free. */
wire_env *wire_unpack(const uint8_t *data, size_t len);

/* Free an envelope returned by wire_unpack. */
void wire_env_free(wire_env *env);

/* Check a message that a client sent the daemon, with nfds fds attached.
 * Returns OK or the error code to answer with, writing the reason to why. */
wire_code wire_check_request(const wire_env *env, size_t nfds, char *why,
                             size_t whylen);

/* Check a message that the daemon sent a client, with nfds fds attached. */
wire_code wire_check_reply(const wire_env *env, size_t nfds, char *why,
                           size_t whylen);

#endif
