/* Probe: host-to-device and device-to-host bandwidth of 8 GiB between
 * pinned host memory and freshly created VMM chunks, with pieces and
 * streams as gpu/vmm_backup.c uses them, against one plain copy. */
#include <cuda.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#define GiB (1ull << 30)
#define N 8
static double ms(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e3+t.tv_nsec/1e6;}
int main(void){
  cuInit(0); CUdevice d; cuDeviceGet(&d,0); CUcontext c; cuDevicePrimaryCtxRetain(&c,d); cuCtxSetCurrent(c);
  CUmemAllocationProp p; memset(&p,0,sizeof p); p.type=CU_MEM_ALLOCATION_TYPE_PINNED; p.requestedHandleTypes=CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; p.location.type=CU_MEM_LOCATION_TYPE_DEVICE; p.location.id=0;
  CUmemAccessDesc a; memset(&a,0,sizeof a); a.location.type=CU_MEM_LOCATION_TYPE_DEVICE; a.location.id=0; a.flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  void *host; cuMemHostAlloc(&host, N*GiB, CU_MEMHOSTALLOC_PORTABLE); memset(host, 1, N*GiB);
  CUstream s[8]; for(int i=0;i<8;i++) cuStreamCreate(&s[i], CU_STREAM_NON_BLOCKING);
  size_t pieces[] = {16<<20, 64<<20, 256<<20, 1024<<20};
  int streams[] = {1, 2, 4, 8};
  for (int dir=0; dir<2; dir++)
  for (int pi=0; pi<4; pi++) for (int si=0; si<4; si++) {
    CUmemGenericAllocationHandle h[N]; CUdeviceptr va;
    cuMemAddressReserve(&va, N*GiB, 0, 0, 0);
    for(int i=0;i<N;i++){ cuMemCreate(&h[i],GiB,&p,0); cuMemMap(va+i*GiB,GiB,0,h[i],0);} cuMemSetAccess(va,N*GiB,&a,1);
    double t0=ms();
    for (size_t off=0,k=0; off<N*GiB; off+=pieces[pi],k++) {
      if (dir==0) cuMemcpyHtoDAsync(va+off,(char*)host+off,pieces[pi],s[k%streams[si]]);
      else cuMemcpyDtoHAsync((char*)host+off,va+off,pieces[pi],s[k%streams[si]]);
    }
    for(int i=0;i<streams[si];i++) cuStreamSynchronize(s[i]);
    double t1=ms();
    double t2=ms(); if (dir==0) cuMemcpyHtoD(va, host, N*GiB); else cuMemcpyDtoH(host, va, N*GiB); double t3=ms();
    printf("%s piece %4zu MiB streams %d: %.1f GB/s (plain into the same memory after: %.1f GB/s)\n", dir==0?"HtoD":"DtoH", pieces[pi]>>20, streams[si], N*GiB/(t1-t0)/1e6, N*GiB/(t3-t2)/1e6);
    for(int i=0;i<N;i++){ cuMemUnmap(va+i*GiB,GiB); cuMemRelease(h[i]); } cuMemAddressFree(va,N*GiB);
  }
  return 0;
}
