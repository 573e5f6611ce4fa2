/* Probe: can a process that imported a VMM allocation export it again (for
 * a daemon that restarted), directly or through cuMemRetainAllocationHandle;
 * can a process with no context import; what NVML attributes to whom. */
#include <cuda.h>
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fdpass.h"

typedef struct {
  unsigned pid;
  unsigned long long used;
  unsigned gi, ci;
} nvml_process;

static void nvml_list(const char *when) {
  void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
  int (*init)(void) = (int (*)(void))dlsym(lib, "nvmlInit_v2");
  int (*get)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(lib, "nvmlDeviceGetHandleByIndex_v2");
  int (*procs)(void *, unsigned *, nvml_process *) =
      (int (*)(void *, unsigned *, nvml_process *))dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3");
  void *d;
  nvml_process p[32];
  unsigned n = 32;
  init();
  get(0, &d);
  int rc = procs(d, &n, p);
  printf("nvml %s (rc %d):", when, rc);
  for (unsigned i = 0; i < n; i++) printf(" pid %u %llu MiB;", p[i].pid, p[i].used >> 20);
  printf("\n");
  fflush(stdout);
}

static const char *name(CUresult r) {
  const char *s = "?";
  cuGetErrorName(r, &s);
  return s;
}

int main(void) {
  setvbuf(stdout, NULL, _IONBF, 0);
  int sv[2], sv2[2];
  socketpair(AF_UNIX, SOCK_STREAM, 0, sv);
  socketpair(AF_UNIX, SOCK_STREAM, 0, sv2);
  size_t size = 1ull << 30;
  if (fork() == 0) { /* the worker: import, map, export again */
    int fd = recv_fd(sv[1]);
    cuInit(0);
    CUdevice dev;
    CUcontext ctx;
    cuDeviceGet(&dev, 0);
    cuDevicePrimaryCtxRetain(&ctx, dev);
    cuCtxSetCurrent(ctx);
    CUmemGenericAllocationHandle h, h2;
    CUresult r = cuMemImportFromShareableHandle(&h, (void *)(long)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    printf("worker import: %s\n", name(r));
    close(fd);
    CUdeviceptr va;
    cuMemAddressReserve(&va, size, 0, 0, 0);
    r = cuMemMap(va, size, 0, h, 0);
    CUmemAccessDesc a = {{CU_MEM_LOCATION_TYPE_DEVICE, 0}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    cuMemSetAccess(va, size, &a, 1);
    printf("worker map: %s\n", name(r));
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    r = cuMemGetAllocationPropertiesFromHandle(&p, h);
    printf("worker props of imported: %s, handle types %d, location %d/%d\n", name(r),
           (int)p.requestedHandleTypes, (int)p.location.type, p.location.id);
    int out = -1;
    r = cuMemExportToShareableHandle(&out, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    printf("worker export of imported handle: %s fd %d\n", name(r), out);
    if (r != CUDA_SUCCESS) {
      r = cuMemRetainAllocationHandle(&h2, (void *)va);
      printf("worker retain from va: %s (same handle %d)\n", name(r), h2 == h);
      r = cuMemExportToShareableHandle(&out, h2, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      printf("worker export of retained handle: %s fd %d\n", name(r), out);
      memset(&p, 0, sizeof p);
      cuMemGetAllocationPropertiesFromHandle(&p, h2);
      printf("worker props of retained: handle types %d\n", (int)p.requestedHandleTypes);
    }
    send_fd(sv[1], out);
    char c;
    if (read(sv[1], &c, 1) != 1) return 1;
    cuMemUnmap(va, size);
    cuMemRelease(h);
    _exit(0);
  }
  if (fork() == 0) { /* a new daemon: import with no context */
    int fd = recv_fd(sv2[1]);
    cuInit(0);
    CUmemGenericAllocationHandle h;
    CUresult r = cuMemImportFromShareableHandle(&h, (void *)(long)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    printf("no-context import: %s\n", name(r));
    CUmemGenericAllocationHandle again;
    int dup_fd = dup(fd);
    r = cuMemImportFromShareableHandle(&again, (void *)(long)dup_fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    printf("second import of the same allocation: %s, same handle %d\n", name(r), again == h);
    if (r == CUDA_SUCCESS) printf("release of the second: %s\n", name(cuMemRelease(again)));

    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    r = cuMemGetAllocationPropertiesFromHandle(&p, h);
    printf("no-context props: %s, location %d\n", name(r), p.location.id);
    int out = -1;
    r = cuMemExportToShareableHandle(&out, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    printf("no-context export of imported: %s\n", name(r));
    fflush(stdout);
    char c;
    if (read(sv2[1], &c, 1) != 1) return 1;
    cuMemRelease(h);
    _exit(0);
  }
  cuInit(0);
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  CUmemGenericAllocationHandle h;
  printf("daemon create: %s\n", name(cuMemCreate(&h, size, &p, 0)));
  int fd, fd2;
  cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  cuMemExportToShareableHandle(&fd2, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  send_fd(sv[0], fd);
  send_fd(sv2[0], fd2);
  close(fd);
  close(fd2);
  int back = recv_fd(sv[0]);
  printf("daemon got back fd %d\n", back);
  fflush(stdout);
  usleep(300000);
  nvml_list("daemon and worker alive, new daemon imported");
  cuMemRelease(h);
  usleep(300000);
  nvml_list("daemon released its handle");
  if (write(sv[0], "q", 1) != 1 || write(sv2[0], "q", 1) != 1) return 1;
  wait(NULL);
  wait(NULL);
  return 0;
}
