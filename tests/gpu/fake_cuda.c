/* A stand-in for libcuda, for a dry run of gpu_faults without a GPU, on the
 * host backend: free memory = 16 GiB - Shmem; cuMemAlloc = a committed memfd
 * named like the host backend's device 0 (GPU_FAULTS_FAKE_SOCK: the socket), so
 * that the daemon counts it as held outside. Build and run:
 *   cc -shared -fPIC -std=c11 -I. -I$CUDA_HOME/include tests/gpu/fake_cuda.c \
 *     -lxxhash -o /tmp/fake/libcuda.so
 *   cc ... tests/gpu/gpu_faults.c -L/tmp/fake -lcuda -Wl,-rpath,/tmp/fake
 *   GPU_FAULTS_BACKEND=host GPU_FAULTS_UNIT_MB=64 GPU_FAULTS_FAKE_SOCK=S \
 *     gpu_faults build/bin S LOG */
#define _GNU_SOURCE
#include <cuda.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>
CUresult cuInit(unsigned f) { (void)f; return 0; }
CUresult cuDeviceGet(CUdevice *d, int o) { (void)o; *d = 0; return 0; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { (void)d; *c = (CUcontext)1; return 0; }
CUresult cuCtxSetCurrent(CUcontext c) { (void)c; return 0; }
CUresult cuCtxSynchronize(void) { return 0; }
CUresult cuMemGetInfo_v2(size_t *f, size_t *t) {
  FILE *m = fopen("/proc/meminfo", "r");
  char line[256];
  unsigned long long kb = 0;
  while (m && fgets(line, sizeof line, m))
    if (sscanf(line, "Shmem: %llu kB", &kb) == 1) break;
  if (m) fclose(m);
  *t = 16ull << 30;
  *f = *t - kb * 1024;
  return 0;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  const char *sock = getenv("GPU_FAULTS_FAKE_SOCK");
  char name[128];
  snprintf(name, sizeof name, "gpumem-host-%016llx:0",
           (unsigned long long)XXH3_64bits(sock, strlen(sock)));
  int fd = memfd_create(name, 0);
  if (fd < 0 || fallocate(fd, 0, 0, (off_t)n) < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  void *a = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (a == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  *p = (CUdeviceptr)a;
  return 0;
}
CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) { memset((void *)p, v, n); return 0; }
CUresult cuMemFree_v2(CUdeviceptr p) { (void)p; return 0; }
