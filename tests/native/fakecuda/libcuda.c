/* A stand-in for the CUDA driver's virtual memory calls over host memory, for the fast path's tests on
 * machines without a GPU (the only double: the GPU). "Device memory" is a memfd mapped MAP_SHARED at an
 * address range reserved PROT_NONE, so unmapping it makes the range fault like an illegal address would,
 * and copies are memcpy. Built as libcuda.so.1 by tests/native/fakecuda/build.py. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef uint64_t CUdeviceptr;
static int registered; /* cuMemHostRegister calls */
static struct { char* p; size_t n; } reg[4096]; /* the pinned ranges, as the driver keeps them */

/* Physical allocations, as the driver keeps them: a handle is a serial number that is never reused (a stale
 * handle is refused, CUDA error 1, as the driver refuses one), its memory a memfd. The memory lives while the
 * handle is unreleased or mapped: cuMemRelease of a mapped handle frees it at its last unmap. */
#define FH 65536
static struct { int fd; size_t size; int released, maps; unsigned char prop[32]; } fh[FH];
static unsigned fh_next = 1;
static long long device_bytes; /* physical memory alive */
static struct { CUdeviceptr va; size_t size; unsigned h; } fm[FH]; /* mappings */
static int fm_n;
static pthread_mutex_t fk = PTHREAD_MUTEX_INITIALIZER;

static unsigned fh_index(uint64_t h) { /* the handle's slot, or 0 when it is not a live handle */
  if (h < 16 || (h & 15) || h / 16 >= FH) return 0;
  unsigned i = (unsigned)(h / 16);
  return fh[i].fd > 0 && !fh[i].released ? i : 0;
}
static void fh_maybe_free(unsigned i) {
  if (fh[i].released && !fh[i].maps && fh[i].fd > 0) {
    close(fh[i].fd);
    fh[i].fd = -1;
    device_bytes -= (long long)fh[i].size;
  }
}

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
  (void)f;
  if (!h || !prop || size % (1 << 16)) return 1; /* as the driver: whole granules */
  pthread_mutex_lock(&fk);
  int fd = fh_next < FH ? memfd_create("fake-device-memory", MFD_CLOEXEC) : -1;
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
    if (fd >= 0) close(fd);
    pthread_mutex_unlock(&fk);
    return 2;
  }
  unsigned i = fh_next++;
  fh[i].fd = fd, fh[i].size = size, fh[i].released = 0, fh[i].maps = 0;
  memcpy(fh[i].prop, prop, 32);
  device_bytes += (long long)size;
  *h = (uint64_t)i * 16;
  pthread_mutex_unlock(&fk);
  return 0;
}
int cuMemRelease(uint64_t h) {
  pthread_mutex_lock(&fk);
  unsigned i = fh_index(h);
  if (i) {
    fh[i].released = 1;
    fh_maybe_free(i);
  }
  pthread_mutex_unlock(&fk);
  return i ? 0 : 1;
}
/* Mapped memory is not accessible until cuMemSetAccess grants it, as on a GPU: PROT_NONE until then. */
int cuMemMap(CUdeviceptr va, size_t size, size_t off, uint64_t h, unsigned long long f) {
  (void)f;
  pthread_mutex_lock(&fk);
  unsigned i = fh_index(h);
  int r = !i || off + size > fh[i].size || fm_n == FH ? 1 : 0;
  if (!r && mmap((void*)(uintptr_t)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, fh[i].fd, (off_t)off) == MAP_FAILED)
    r = 1;
  if (!r) {
    fm[fm_n].va = va, fm[fm_n].size = size, fm[fm_n].h = i;
    fm_n++;
    fh[i].maps++;
  }
  pthread_mutex_unlock(&fk);
  return r;
}
int cuMemUnmap(CUdeviceptr va, size_t size) {
  pthread_mutex_lock(&fk);
  void* p = mmap((void*)(uintptr_t)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  for (int k = 0; p != MAP_FAILED && k < fm_n;) {
    if (fm[k].va >= va && fm[k].va + fm[k].size <= va + size) {
      unsigned i = fm[k].h;
      fm[k] = fm[--fm_n];
      fh[i].maps--;
      fh_maybe_free(i);
    } else {
      k++;
    }
  }
  pthread_mutex_unlock(&fk);
  return p == MAP_FAILED ? 1 : 0;
}
int cuMemSetAccess(CUdeviceptr va, size_t size, const void* desc, size_t n) {
  /* CUmemAccessDesc {location {type, id}, flags}: flags 3 read-write, 1 read, 0 none */
  int flags = n ? ((const int*)desc)[2] : 0;
  int prot = flags == 3 ? PROT_READ | PROT_WRITE : flags == 1 ? PROT_READ : PROT_NONE;
  return mprotect((void*)(uintptr_t)va, size, prot) ? 1 : 0;
}
int cuMemRetainAllocationHandle(uint64_t* h, void* addr) {
  CUdeviceptr a = (CUdeviceptr)(uintptr_t)addr;
  pthread_mutex_lock(&fk);
  int r = 1;
  for (int k = 0; k < fm_n && r; k++)
    if (a >= fm[k].va && a < fm[k].va + fm[k].size) *h = (uint64_t)fm[k].h * 16, r = 0;
  pthread_mutex_unlock(&fk);
  return r; /* (the stand-in does not count the extra reference) */
}
int cuMemGetAllocationPropertiesFromHandle(void* prop, uint64_t h) {
  pthread_mutex_lock(&fk);
  unsigned i = fh_index(h);
  if (i) memcpy(prop, fh[i].prop, 32);
  pthread_mutex_unlock(&fk);
  return i ? 0 : 1;
}
int cuMemExportToShareableHandle(void* out, uint64_t h, int type, unsigned long long f) {
  (void)type, (void)f;
  pthread_mutex_lock(&fk);
  unsigned i = fh_index(h);
  if (i) *(int*)out = dup(fh[i].fd);
  pthread_mutex_unlock(&fk);
  return i ? 0 : 1;
}
long long fakecuda_device_bytes(void) { return device_bytes; } /* for the tests: physical memory alive */
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
/* How the staging was pinned, as the tests read it: pages the pin had to fault in itself (not yet present in the
 * page table: /proc/self/pagemap bit 63; a driver pinning such pages faults them under its lock), and bytes of
 * the pinned ranges mapped with huge pages (ShmemPmdMapped in /proc/self/smaps). */
static long long pin_faulted, pin_bytes, pin_huge_kb;
static void pin_record(void* p, size_t n) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  uint64_t e[512];
  for (size_t o = 0; fd >= 0 && o < n; o += page * 512) {
    size_t k = (n - o) / page < 512 ? (n - o + page - 1) / page : 512;
    off_t at = (off_t)(((uintptr_t)p + o) / page * 8);
    if (pread(fd, e, k * 8, at) != (ssize_t)(k * 8)) break;
    for (size_t j = 0; j < k; j++) pin_faulted += !(e[j] >> 63);
  }
  if (fd >= 0) close(fd);
  pin_bytes += (long long)n;
  FILE* f = fopen("/proc/self/smaps", "re");
  char line[256];
  int in = 0;
  while (f && fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
      in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
    } else if (in && strncmp(line, "ShmemPmdMapped:", 15) == 0) {
      pin_huge_kb += atoll(line + 15);
      in = 0;
    }
  }
  if (f) fclose(f);
}
/* "faulted F bytes B huge_kb H": what the tests compare with the control block's arena record */
const char* fakecuda_pin_report(void) {
  static char out[128];
  snprintf(out, sizeof out, "faulted %lld bytes %lld huge_kb %lld", pin_faulted, pin_bytes, pin_huge_kb);
  return out;
}
int cuMemHostRegister_v2(void* p, size_t n, unsigned f) {
  (void)f;
  static int calls;
  const char* fail = getenv("FAKECUDA_FAIL_PIN_AT"); /* that call fails, as out of memory (2) */
  if (fail && atoi(fail) == ++calls) return 2;
  pin_record(p, n);
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
  static const struct { const char* name; void* fn; } known[] = {
      {"cuLaunchKernel", (void*)cuLaunchKernel}, {"cuMemCreate", (void*)cuMemCreate},
      {"cuMemRelease", (void*)cuMemRelease}, {"cuMemMap", (void*)cuMemMap}, {"cuMemUnmap", (void*)cuMemUnmap},
      {"cuMemSetAccess", (void*)cuMemSetAccess}, {"cuMemAddressReserve", (void*)cuMemAddressReserve},
      {"cuMemAddressFree", (void*)cuMemAddressFree},
      {"cuMemGetAllocationGranularity", (void*)cuMemGetAllocationGranularity}};
  for (size_t i = 0; i < sizeof known / sizeof *known; i++)
    if (strcmp(symbol, known[i].name) == 0) *pfn = known[i].fn;
  if (strcmp(symbol, "cuGetProcAddress") == 0)
    *pfn = version >= 12000 ? (void*)cuGetProcAddress_v2 : (void*)cuGetProcAddress;
  if (status) *status = *pfn ? 0 : 1;
  return *pfn ? 0 : 500;
}
int cuGetProcAddress(const char* symbol, void** pfn, int version, unsigned long long flags) {
  return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

/* ---- the checkpoint API, for bench/driver_cost.py on machines without a GPU: a state machine per process
 * (RUNNING 0, LOCKED 1, CHECKPOINTED 2) kept in $FAKECUDA_STATE_DIR/PID (default /tmp). It moves nothing and
 * its times mean nothing; wrong transitions answer CUDA_ERROR_ILLEGAL_STATE (401), a process that is gone
 * CUDA_ERROR_INVALID_VALUE (1). ---- */
static int ck_path(int pid, char* out, size_t n) {
  const char* dir = getenv("FAKECUDA_STATE_DIR");
  return snprintf(out, n, "%s/fakecuda-ckpt-%d", dir && *dir ? dir : "/tmp", pid) < (int)n ? 0 : -1;
}
static int ck_get(int pid) {
  char path[256], buf[8] = "0";
  if (kill(pid, 0) != 0 || ck_path(pid, path, sizeof path) != 0) return -1;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    if (read(fd, buf, 1) != 1) buf[0] = '0';
    close(fd);
  }
  return buf[0] - '0';
}
static int ck_move(int pid, int from, int to) {
  int st = ck_get(pid);
  if (st < 0) return 1;
  if (st != from) return 401;
  char path[256], c = (char)('0' + to);
  if (ck_path(pid, path, sizeof path) != 0) return 1;
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0 || write(fd, &c, 1) != 1) return 1;
  close(fd);
  return 0;
}
int cuInit(unsigned f) { return (int)f; }
int cuDriverGetVersion(int* v) { return *v = 13000, 0; }
int cuDeviceGetCount(int* n) { return *n = 1, 0; }
int cuDeviceGet(int* d, int i) { return *d = i, i == 0 ? 0 : 101; }
int cuDeviceGetName(char* name, int n, int d) { return snprintf(name, (size_t)n, "stand-in GPU %d", d), 0; }
int cuDeviceGetUuid_v2(unsigned char* uuid, int d) {
  for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xf0 + d + i);
  return 0;
}
int cuGetErrorName(int code, const char** s) {
  *s = code == 401 ? "CUDA_ERROR_ILLEGAL_STATE" : code == 1 ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_UNKNOWN";
  return 0;
}
int cuGetErrorString(int code, const char** s) {
  *s = code == 401 ? "the process is not in the state the call needs (stand-in driver)"
                   : "stand-in driver error";
  return 0;
}
int cuCheckpointProcessGetState(int pid, int* st) {
  int s2 = ck_get(pid);
  if (s2 < 0) return 1;
  *st = s2;
  return 0;
}
int cuCheckpointProcessLock(int pid, void* args) { return (void)args, ck_move(pid, 0, 1); }
int cuCheckpointProcessCheckpoint(int pid, void* args) { return (void)args, ck_move(pid, 1, 2); }
int cuCheckpointProcessRestore(int pid, void* args) { return (void)args, ck_move(pid, 2, 1); }
int cuCheckpointProcessUnlock(int pid, void* args) { return (void)args, ck_move(pid, 1, 0); }
int cuMemAlloc_v2(CUdeviceptr* p, size_t n) { /* plain device memory (bench/driver_cost.py's target) */
  void* m = malloc(n ? n : 1);
  if (!m) return 2;
  *p = (CUdeviceptr)(uintptr_t)m;
  return 0;
}
int cuMemFree_v2(CUdeviceptr p) { return free((void*)(uintptr_t)p), 0; }
