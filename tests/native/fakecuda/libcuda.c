/* A stand-in for the CUDA driver's virtual memory calls over host memory, for the fast path's tests on
 * machines without a GPU (the only double: the GPU). "Device memory" is a memfd mapped MAP_SHARED at an
 * address range reserved PROT_NONE, so unmapping it makes the range fault like an illegal address would,
 * and copies are memcpy. Built as libcuda.so.1 by tests/native/fakecuda/build.py. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef uint64_t CUdeviceptr;
static int registered; /* cuMemHostRegister calls */
static struct { char* p; size_t n; } reg[4096]; /* the pinned ranges, as the driver keeps them */

int cuMemGetAllocationGranularity(size_t* g, const void* prop, int opt) {
  (void)prop, (void)opt;
  *g = 1 << 16;
  return 0;
}
int cuMemAddressReserve(CUdeviceptr* va, size_t size, size_t align, CUdeviceptr addr, unsigned long long f) {
  (void)align, (void)addr, (void)f;
  void* p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return 2;
  *va = (CUdeviceptr)(uintptr_t)p;
  return 0;
}
int cuMemAddressFree(CUdeviceptr va, size_t size) { return munmap((void*)(uintptr_t)va, size) ? 1 : 0; }
int cuMemCreate(uint64_t* h, size_t size, const void* prop, unsigned long long f) {
  (void)prop, (void)f;
  int fd = memfd_create("fake-device-memory", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) return 2;
  *h = (uint64_t)fd + 1;
  return 0;
}
int cuMemRelease(uint64_t h) { return close((int)h - 1) ? 1 : 0; }
int cuMemMap(CUdeviceptr va, size_t size, size_t off, uint64_t h, unsigned long long f) {
  (void)f;
  void* p = mmap((void*)(uintptr_t)va, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, (int)h - 1, (off_t)off);
  return p == MAP_FAILED ? 1 : 0;
}
int cuMemUnmap(CUdeviceptr va, size_t size) {
  void* p = mmap((void*)(uintptr_t)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? 1 : 0;
}
int cuMemSetAccess(CUdeviceptr va, size_t size, const void* desc, size_t n) {
  (void)va, (void)size, (void)desc, (void)n;
  return 0;
}
int cuCtxGetDevice(int* d) {
  *d = 0;
  return 0;
}
int cuCtxGetCurrent(void** c) {
  *c = (void*)&registered;
  return 0;
}
int cuCtxSetCurrent(void* c) {
  (void)c;
  return 0;
}
int cuCtxSynchronize(void) { return 0; }
int cuDevicePrimaryCtxRetain(void** c, int d) {
  (void)d;
  *c = (void*)&registered;
  return 0;
}
int cuMemHostRegister_v2(void* p, size_t n, unsigned f) {
  (void)f;
  static int calls;
  const char* fail = getenv("FAKECUDA_FAIL_PIN_AT"); /* that call fails, as out of memory (2) */
  if (fail && atoi(fail) == ++calls) return 2;
  for (int i = 0; i < 4096; i++)
    if (!reg[i].p) {
      reg[i].p = p, reg[i].n = n;
      registered++;
      return 0;
    }
  return 2;
}
int cuMemHostUnregister(void* p) { /* as the driver: only a registration's start address (else 713) */
  for (int i = 0; i < 4096; i++)
    if (reg[i].p == p) {
      reg[i].p = NULL;
      registered--;
      return 0;
    }
  return 713;
}
int fakecuda_registered(void) { return registered; } /* for the tests: pinned pieces now */
/* As the driver: a copy whose host range starts in a pinned range must end in it too (else invalid value, 1). */
static int host_range_ok(const char* h, size_t n) {
  for (int i = 0; i < 4096; i++)
    if (reg[i].p && h >= reg[i].p && h < reg[i].p + reg[i].n) return h + n <= reg[i].p + reg[i].n;
  return 1;
}
int cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
  if (!host_range_ok(dst, n)) return 1;
  memcpy(dst, (void*)(uintptr_t)src, n);
  return 0;
}
int cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
  if (!host_range_ok(src, n)) return 1;
  memcpy((void*)(uintptr_t)dst, src, n);
  return 0;
}
int cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shmem, void* stream, void** params, void** extra) {
  (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)stream, (void)extra;
  if (f) ((void (*)(void**))f)(params); /* a "kernel" is a host function */
  return 0;
}
/* How a CUDA runtime finds the driver's functions (only those the stand-in runtime asks for). As the real
 * driver does, a lookup of "cuGetProcAddress" gets the newest ABI of the version asked for: from 12.0 on, the
 * five-argument _v2. */
int cuGetProcAddress(const char* symbol, void** pfn, int version, unsigned long long flags);
int cuGetProcAddress_v2(const char* symbol, void** pfn, int version, unsigned long long flags, int* status) {
  (void)flags;
  *pfn = NULL;
  if (strcmp(symbol, "cuLaunchKernel") == 0) *pfn = (void*)cuLaunchKernel;
  if (strcmp(symbol, "cuGetProcAddress") == 0)
    *pfn = version >= 12000 ? (void*)cuGetProcAddress_v2 : (void*)cuGetProcAddress;
  if (status) *status = *pfn ? 0 : 1;
  return *pfn ? 0 : 500;
}
int cuGetProcAddress(const char* symbol, void** pfn, int version, unsigned long long flags) {
  return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
