/* Passing an fd to another process of a GPU probe over a socket pair, as
 * the daemon hands memory to a client. */
#ifndef GPUMEM_GPU_FDPASS_H
#define GPUMEM_GPU_FDPASS_H

#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

/* Pass an fd over a socket (a bare byte for -1). */
static inline void send_fd(int sock, int fd) {
  char byte = 'f', buf[CMSG_SPACE(sizeof(int))];
  struct iovec io = {&byte, 1};
  struct msghdr msg = {.msg_iov = &io, .msg_iovlen = 1};
  if (fd >= 0) {
    msg.msg_control = buf;
    msg.msg_controllen = sizeof buf;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  if (sendmsg(sock, &msg, 0) != 1) perror("sendmsg");
}

/* Receive an fd passed with send_fd; -1 if none came. */
static inline int recv_fd(int sock) {
  char byte, buf[CMSG_SPACE(sizeof(int))];
  struct iovec io = {&byte, 1};
  struct msghdr msg = {.msg_iov = &io, .msg_iovlen = 1, .msg_control = buf,
                       .msg_controllen = sizeof buf};
  if (recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) != 1) return -1;
  struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
  int fd = -1;
  if (c && c->cmsg_type == SCM_RIGHTS) memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

#endif
