/* What backups in host-NUMA memory (cuMemCreate with a HOST_NUMA location)
 * would cost the daemon, measured on the GPU machine, each line a fact:
 * which VMM calls need a context, whether a host mapping outlives the
 * context, how long a primary context takes to make and let go of, what
 * copies through such mappings run at against pinned memory, and what a
 * context holds once its stack limit is cut. NVML (nvidia-smi) is the
 * judge of what this process holds.
 *   cc -std=c11 -D_GNU_SOURCE -O2 -I$CUDA_HOME/include tests/gpu/hostnuma_probe.c \
 *     -o hostnuma_probe -L$CUDA_HOME/lib64/stubs -lcuda && ./hostnuma_probe */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define GiB (1ull << 30)

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static const char *err(CUresult rc) {
  const char *s = "?";
  cuGetErrorName(rc, &s);
  return s;
}

/* NVML's figure for this process, through nvidia-smi (-1: not listed). */
static long nvml_self(void) {
  char cmd[160], line[128];
  snprintf(cmd, sizeof cmd,
           "nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits");
  FILE *p = popen(cmd, "r");
  long used = -1;
  while (p && fgets(line, sizeof line, p)) {
    int pid;
    long mib;
    if (sscanf(line, "%d, %ld", &pid, &mib) == 2 && pid == getpid()) used = mib;
  }
  if (p) pclose(p);
  return used;
}

/* Pinned memory of host NUMA node 0 (host) or of device 0, exportable. */
/* The device's memory used, MiB, by NVML (through nvidia-smi; -1: none). */
static long node_used(void) {
  FILE *p = popen("nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits", "r");
  long v = -1;
  if (p && fscanf(p, "%ld", &v) != 1) v = -1;
  if (p) pclose(p);
  return v;
}

static CUmemAllocationProp prop(CUmemLocationType where) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = where;
  p.location.id = 0;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

/* Map handle at a fresh range with read-write access for the host and
 * device 0; the calls' results printed. */
static CUdeviceptr map_rw(CUmemGenericAllocationHandle h, size_t size, const char *what) {
  CUdeviceptr va = 0;
  CUresult r1 = cuMemAddressReserve(&va, size, 0, 0, 0);
  CUresult r2 = r1 ? r1 : cuMemMap(va, size, 0, h, 0);
  CUmemAccessDesc acc[2];
  memset(acc, 0, sizeof acc);
  acc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc[0].location.id = 0;
  acc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  acc[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  acc[1].location.id = 0;
  acc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUresult r3 = r2 ? r2 : cuMemSetAccess(va, size, acc, strcmp(what, "device") == 0 ? 1 : 2);
  printf("map %s: AddressReserve %s, Map %s, SetAccess %s\n", what, err(r1), err(r2), err(r3));
  return r3 ? 0 : va;
}

int main(void) {
  cuInit(0);
  CUdevice dev;
  cuDeviceGet(&dev, 0);
  CUmemAllocationProp hp = prop(CU_MEM_LOCATION_TYPE_HOST_NUMA), dp = prop(CU_MEM_LOCATION_TYPE_DEVICE);
  size_t g = 0;
  cuMemGetAllocationGranularity(&g, &hp, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  printf("host-NUMA granularity %zu KiB\n", g >> 10);
  /* 0. What 16 GiB of host-NUMA memory (1 GiB handles, mapped for the
   * host and written, no context) costs the device. */
  {
    enum { N = 16 };
    CUmemGenericAllocationHandle v[N];
    CUdeviceptr a[N];
    long before = node_used();
    int made = 0;
    for (; made < N && cuMemCreate(&v[made], GiB, &hp, 0) == CUDA_SUCCESS; made++) {
    }
    long created = node_used();
    for (int i = 0; i < made; i++) {
      a[i] = map_rw(v[i], GiB, "host-NUMA, no context");
      if (a[i]) memset((void *)a[i], 1, GiB);
    }
    long mapped = node_used();
    for (int i = 0; i < made; i++) {
      if (a[i]) {
        cuMemUnmap(a[i], GiB);
        cuMemAddressFree(a[i], GiB);
      }
      cuMemRelease(v[i]);
    }
    printf("device memory used for %d GiB of host-NUMA memory, no context: %ld MiB before, "
           "%ld created, %ld mapped and written, %ld released\n",
           made, before, created, mapped, node_used());
  }
  /* 1. No context at all: create, map for the host, write from the CPU. */
  CUmemGenericAllocationHandle hh;
  double t = now_ms();
  CUresult rc = cuMemCreate(&hh, GiB, &hp, 0);
  printf("no context: cuMemCreate host-NUMA 1 GiB %s in %.1f ms\n", err(rc), now_ms() - t);
  CUdeviceptr hva = map_rw(hh, GiB, "host-NUMA, no context");
  if (hva) {
    t = now_ms();
    memset((void *)hva, 0x5a, GiB);
    printf("no context: CPU write of 1 GiB through it in %.1f ms; NVML lists us: %ld MiB\n",
           now_ms() - t, nvml_self());
  }
  /* 2. A context for the copies only. */
  CUcontext ctx;
  t = now_ms();
  rc = cuDevicePrimaryCtxRetain(&ctx, dev);
  cuCtxSetCurrent(ctx);
  printf("primary context retained %s in %.1f ms; NVML lists us: %ld MiB\n", err(rc),
         now_ms() - t, nvml_self());
  if (!hva) hva = map_rw(hh, GiB, "host-NUMA, in a context");
  CUmemGenericAllocationHandle dh;
  cuMemCreate(&dh, GiB, &dp, 0);
  CUdeviceptr dva = map_rw(dh, GiB, "device");
  CUstream s;
  cuStreamCreate(&s, CU_STREAM_NON_BLOCKING);
  void *pinned = NULL;
  t = now_ms();
  rc = cuMemHostAlloc(&pinned, GiB, CU_MEMHOSTALLOC_PORTABLE);
  printf("cuMemHostAlloc 1 GiB %s in %.1f ms\n", err(rc), now_ms() - t);
  for (int round = 0; round < 3 && hva && dva && pinned; round++) {
    double a = now_ms();
    cuMemcpyDtoHAsync((void *)hva, dva, GiB, s);
    cuStreamSynchronize(s);
    double b = now_ms();
    cuMemcpyDtoHAsync(pinned, dva, GiB, s);
    cuStreamSynchronize(s);
    double c = now_ms();
    cuMemcpyHtoDAsync(dva, (void *)hva, GiB, s);
    cuStreamSynchronize(s);
    double d = now_ms();
    cuMemcpyHtoDAsync(dva, pinned, GiB, s);
    cuStreamSynchronize(s);
    double e = now_ms();
    printf("copy 1 GiB: DtoH host-NUMA %.1f ms, pinned %.1f ms; HtoD host-NUMA %.1f ms, "
           "pinned %.1f ms\n", b - a, c - b, d - c, e - d);
  }
  cuMemFreeHost(pinned);
  cuStreamDestroy(s);
  cuMemUnmap(dva, GiB);
  cuMemAddressFree(dva, GiB);
  cuMemRelease(dh);
  /* 3. Let the context go: does the host mapping stay? */
  cuCtxSetCurrent(NULL);
  t = now_ms();
  rc = cuDevicePrimaryCtxRelease(dev);
  printf("primary context released %s in %.1f ms; NVML lists us: %ld MiB\n", err(rc),
         now_ms() - t, nvml_self());
  if (hva) {
    unsigned char *p = (unsigned char *)hva;
    printf("after the release, the host mapping reads %02x %02x (0x5a was written, then a "
           "device copy)\n", p[0], p[GiB - 1]);
    memset(p, 0x33, 4096);
    printf("and takes a CPU write: %02x\n", p[1]);
  }
  t = now_ms();
  rc = cuDevicePrimaryCtxRetain(&ctx, dev);
  cuCtxSetCurrent(ctx);
  printf("primary context retained again %s in %.1f ms\n", err(rc), now_ms() - t);
  /* 4. A context with its stack cut: what it holds. */
  size_t stack = 0;
  cuCtxGetLimit(&stack, CU_LIMIT_STACK_SIZE);
  long before = nvml_self();
  CUresult l1 = cuCtxSetLimit(CU_LIMIT_STACK_SIZE, 0);
  CUresult l2 = cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE, 0);
  CUresult l3 = cuCtxSetLimit(CU_LIMIT_PRINTF_FIFO_SIZE, 0);
  printf("context limits cut (stack %zu -> 0 %s, heap %s, printf %s): NVML %ld -> %ld MiB\n",
         stack, err(l1), err(l2), err(l3), before, nvml_self());
  cuCtxSetCurrent(NULL);
  cuDevicePrimaryCtxRelease(dev);
  if (hva) {
    cuMemUnmap(hva, GiB);
    cuMemAddressFree(hva, GiB);
  }
  cuMemRelease(hh);
  printf("done; NVML lists us: %ld MiB\n", nvml_self());
  return 0;
}
