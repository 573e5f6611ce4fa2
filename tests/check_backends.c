/* The vendor backends from a machine without their GPUs: they fail
 * cleanly, and no binary depends on a vendor runtime. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"

/* Run a command; its exit status, and its output in out. */
static int run(const char *cmd, char *out, size_t len) {
  FILE *p = popen(cmd, "r");
  ck_assert_ptr_nonnull(p);
  size_t n = fread(out, 1, len - 1, p);
  out[n] = '\0';
  int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* With no AMD GPU, --backend hip says so and exits within seconds. */
START_TEST(hip_backend_without_a_device_fails_cleanly) {
  char cmd[600], out[4096];
  snprintf(cmd, sizeof cmd, "timeout 10 %s --backend hip --socket /tmp/gpumemd-hip-test.sock 2>&1",
           harness_bin("gpumemd"));
  double t0 = now_ms();
  int rc = run(cmd, out, sizeof out);
  if (strstr(out, "unknown backend") && getenv("GPUMEM_NO_HIP_OK")) return; /* no HIP headers */
  ck_assert_int_eq(rc, 1);
  ck_assert_double_lt(now_ms() - t0, 10000);
  ck_assert_msg(strstr(out, "no HIP") != NULL, "output: %s", out);
}
END_TEST

/* Without the CUDA driver, --backend cuda says so, and auto falls back. */
START_TEST(cuda_backend_without_a_driver_fails_cleanly) {
  char cmd[600], out[4096];
  snprintf(cmd, sizeof cmd, "ls /dev/nvidia0 >/dev/null 2>&1 || timeout 10 %s --backend cuda "
           "--socket /tmp/gpumemd-cuda-test.sock 2>&1", harness_bin("gpumemd"));
  int rc = run(cmd, out, sizeof out);
  if (strstr(out, "unknown backend")) return; /* built without cuda.h */
  if (rc == 0 && !out[0]) return;             /* a GPU machine: nothing to see */
  ck_assert_int_eq(rc, 1);
  ck_assert_msg(strstr(out, "CUDA") != NULL, "output: %s", out);
}
END_TEST

/* A node of one vendor needs nothing of the other: no vendor runtime in
 * any binary's dependencies. */
START_TEST(no_binary_links_a_vendor_runtime) {
  const char *files[] = {"gpumemd", "gpumemctl", "gpumem-worker", "../lib/libgpumem.so"};
  for (size_t i = 0; i < 4; i++) {
    char cmd[600], out[8192];
    snprintf(cmd, sizeof cmd, "ldd %s", harness_bin(files[i]));
    ck_assert_int_eq(run(cmd, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "libc.so") != NULL, "ldd said: %s", out);
    ck_assert_msg(!strstr(out, "amdhip") && !strstr(out, "libcuda") && !strstr(out, "nvidia"),
                  "%s depends on a vendor runtime: %s", files[i], out);
  }
}
END_TEST

int main(void) {
  return HARNESS_RUN("backends", 30, NULL, NULL,
                     hip_backend_without_a_device_fails_cleanly,
                     cuda_backend_without_a_driver_fails_cleanly,
                     no_binary_links_a_vendor_runtime);
}
