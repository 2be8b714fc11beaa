/* A stand-in for the CUDA runtime calls the fast path's tests make (cudaMalloc, cudaFree, cudaMemcpy,
 * cudaLaunchKernel), over host memory. The interceptor, preloaded, wraps them as it wraps the real
 * runtime's. A "kernel" is a host function run by cudaLaunchKernel, so that a workload reaches its "device
 * memory" only through launches and copies, as on a GPU. Built as libfakecudart.so by build.py. */
#include <stdlib.h>
#include <string.h>

struct dim3 {
  unsigned x, y, z;
};
static long launches;

int cudaMalloc(void** p, size_t n) {
  *p = malloc(n);
  return *p ? 0 : 2;
}
int cudaFree(void* p) {
  free(p);
  return 0;
}
int cudaMemcpy(void* dst, const void* src, size_t n, int kind) {
  (void)kind;
  memcpy(dst, src, n);
  return 0;
}
int cudaLaunchKernel(const void* f, struct dim3 g, struct dim3 b, void** a, size_t m, void* s) {
  (void)g, (void)b, (void)m, (void)s;
  launches++;
  if (f) ((void (*)(void**))f)(a);
  return 0;
}
long fake_launches(void) { return launches; }
