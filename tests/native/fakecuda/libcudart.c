/* A stand-in for the CUDA runtime calls the fast path's tests make (cudaMalloc, cudaFree, cudaMemcpy,
 * cudaLaunchKernel, cudaMallocAsync, cudaFreeAsync), over host memory. The interceptor, preloaded, wraps them as it wraps the real
 * runtime's. A "kernel" is a host function, launched through the stand-in driver's cuLaunchKernel (found with
 * cuGetProcAddress, as the real runtime finds it), so that a workload reaches its "device memory" only
 * through launches and copies, as on a GPU. Built as libfakecudart.so by build.py. */
#include <dlfcn.h>
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
/* Launches through the driver, found as a real runtime finds it: dlopen libcuda, dlsym cuGetProcAddress_v2,
 * ask it for "cuGetProcAddress" at the runtime's version (which is the five-argument ABI), and ask that for
 * cuLaunchKernel: each answer must carry its status. */
typedef int (*launch_fn)(const void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);
typedef int (*gpa2_fn)(const char*, void**, int, unsigned long long, int*);
int cudaLaunchKernel(const void* f, struct dim3 g, struct dim3 b, void** a, size_t m, void* s) {
  static launch_fn launch;
  if (!launch) {
    void* h = dlopen("libcuda.so.1", RTLD_NOW);
    gpa2_fn first = h ? (gpa2_fn)dlsym(h, "cuGetProcAddress_v2") : NULL;
    gpa2_fn gpa = NULL;
    int status = -7;
    if (!first || first("cuGetProcAddress", (void**)&gpa, 12000, 0, &status) != 0 || status != 0) return 3;
    status = -7;
    if (gpa("cuLaunchKernel", (void**)&launch, 12000, 0, &status) != 0 || status != 0) return 4;
  }
  launches++;
  return launch(f, g.x, g.y, g.z, b.x, b.y, b.z, (unsigned)m, s, a, NULL);
}
long fake_launches(void) { return launches; }
/* Stream-ordered allocations (cudaMallocAsync): the stand-in pool is host memory, as cudaMalloc's is. */
int cudaMallocAsync(void** p, size_t n, void* stream) {
  (void)stream;
  *p = malloc(n);
  return *p ? 0 : 2;
}
int cudaFreeAsync(void* p, void* stream) {
  (void)stream;
  free(p);
  return 0;
}
