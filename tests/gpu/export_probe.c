#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#define N 64
static CUmemGenericAllocationHandle h[N];
static int fds[N];
static double ms(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e3+t.tv_nsec/1e6;}
static int nthreads;
static void *work(void *a){long k=(long)a;for(int i=k;i<N;i+=nthreads) cuMemExportToShareableHandle(&fds[i],h[i],CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,0);return 0;}
int main(void){
  cuInit(0);
  CUmemAllocationProp p; memset(&p,0,sizeof p); p.type=CU_MEM_ALLOCATION_TYPE_PINNED; p.requestedHandleTypes=CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR; p.location.type=CU_MEM_LOCATION_TYPE_DEVICE; p.location.id=0;
  for (int sz=0; sz<2; sz++){
    size_t size = sz? (1ull<<30) : (2ull<<20);
    for (int t=1;t<=16;t*=2){
      double t0=ms(); for(int i=0;i<N;i++) cuMemCreate(&h[i],size,&p,0); double t1=ms();
      nthreads=t; pthread_t th[16]; for(long k=0;k<t;k++) pthread_create(&th[k],0,work,(void*)k); for(int k=0;k<t;k++) pthread_join(th[k],0);
      double t2=ms();
      CUmemGenericAllocationHandle im[N]; for(int i=0;i<N;i++){cuMemImportFromShareableHandle(&im[i],(void*)(long)fds[i],CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);} double t3=ms();
      for(int i=0;i<N;i++){cuMemRelease(im[i]);close(fds[i]);} double t4=ms();
      for(int i=0;i<N;i++) cuMemRelease(h[i]); double t5=ms();
      printf("size %zu MiB threads %2d: create %.2f ms, export %.2f ms, import %.2f, release-imported %.2f, release %.2f (per chunk export %.3f ms)\n", size>>20, t, t1-t0, t2-t1, t3-t2, t4-t3, t5-t4, (t2-t1)/N);
    }
  }
  return 0;
}
