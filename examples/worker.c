/* A minimal gpumemd worker: one tagged buffer that survives pause/resume.
 * Build: cc worker.c $(pkg-config --cflags --libs gpumem) -o worker */
#include <gpumem.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(void) {
  gpumem_client *c;
  gpumem_buffer *kv;
  if (gpumem_connect(NULL, "my-engine", GPUMEM_ROLE_WORKER, 0, &c) < 0 ||
      gpumem_alloc(c, "kv_cache", 0, 64 << 20, 0, &kv) < 0) {
    fprintf(stderr, "gpumem: %s\n", gpumem_last_error());
    return 1;
  }
  /* The pointer stays valid across pause/resume; while the kv_cache tag is
   * paused the memory is gone and touching it faults. */
  memset(gpumem_buffer_ptr(kv), 0, gpumem_buffer_size(kv));
  printf("kv_cache at %p, %llu bytes\n", gpumem_buffer_ptr(kv),
         (unsigned long long)gpumem_buffer_size(kv));
  fflush(stdout); /* seen now, also when stdout is a file or a pipe */
  sleep(60);
  gpumem_free(c, kv);
  gpumem_disconnect(c);
  return 0;
}
