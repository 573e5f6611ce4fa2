/* Probe: how long 64 x 1 GiB cuMemCreate takes right after releasing the
 * same amount, with and without a current context, and with mapping. */
#include <cuda.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#define N 64
static double ms(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e3+t.tv_nsec/1e6;}
int main(int argc, char **argv){
  int with_ctx = argc > 1 && argv[1][0]=='1';
  int do_map = argc > 2 && argv[2][0]=='1';
  cuInit(0);
  CUdevice d; cuDeviceGet(&d,0); CUcontext c=0;
  if (with_ctx || do_map) { cuDevicePrimaryCtxRetain(&c,d); cuCtxSetCurrent(c); }
  CUmemAllocationProp p; memset(&p,0,sizeof p); p.type=CU_MEM_ALLOCATION_TYPE_PINNED; p.requestedHandleTypes=CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; p.location.type=CU_MEM_LOCATION_TYPE_DEVICE; p.location.id=0;
  CUmemGenericAllocationHandle h[N]; CUdeviceptr va=0; size_t sz=1ull<<30;
  if (do_map) cuMemAddressReserve(&va, N*sz, 0, 0, 0);
  CUmemAccessDesc a; memset(&a,0,sizeof a); a.location.type=CU_MEM_LOCATION_TYPE_DEVICE; a.location.id=0; a.flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  for (int r=0;r<5;r++){
    double t0=ms(); for(int i=0;i<N;i++) cuMemCreate(&h[i],sz,&p,0); double t1=ms();
    if (do_map){ for(int i=0;i<N;i++) cuMemMap(va+i*sz,sz,0,h[i],0); cuMemSetAccess(va,N*sz,&a,1);} double t2=ms();
    if (do_map){ for(int i=0;i<N;i++) cuMemUnmap(va+i*sz,sz);} double t3=ms();
    for(int i=0;i<N;i++) cuMemRelease(h[i]); double t4=ms();
    printf("ctx=%d map=%d round %d: create %.1f ms, map+access %.1f, unmap %.1f, release %.1f\n", with_ctx, do_map, r, t1-t0, t2-t1, t3-t2, t4-t3);
  }
  return 0;
}
