/* Device memory the interceptor can move itself: the fast path (docs/interceptor.md, "The fast path").
 *
 * With CRYOSLEEP_DEVMEM=1, cudaMalloc calls of at least CS_DEVMEM_MIN bytes (PyTorch's caching allocator
 * asks for 2 MiB and larger segments) are served with the CUDA virtual memory API instead: an address
 * range reserved with cuMemAddressReserve, physical memory from cuMemCreate mapped into it. The pointer
 * the application gets is the start of the range, and the range stays reserved for as long as the
 * application holds it, so the physical memory behind it can be copied out, released and later replaced
 * at the same address (the fast path's capture), which cudaMalloc memory cannot. cudaFree of such a
 * pointer synchronizes the device (as cudaFree does) and gives everything back. Smaller requests, and
 * any request when the driver's VMM calls are missing or fail, go to the real cudaMalloc.
 *
 * libcuda is opened by name (every process that calls cudaMalloc has it loaded already); the runtime's
 * calls are found with RTLD_NEXT, as cudaipc.c finds its calls.
 *
 * The capture, run by the control thread on the agent's commands (control.c):
 *   PREPARE  (job running) the staging file, <CRYOSLEEP_DEVMEM_DIR>/<control file name>.devmem on tmpfs,
 *            grown to hold all of it: fallocated (no first-touch cost later), mapped MAP_SHARED (CRIU
 *            records such a mapping by reference: it is not copied into the image) and pinned with
 *            cuMemHostRegister, once; later snapshots reuse it.
 *   OFFLOAD  (quiesced) the runtime gate closes: work-issuing runtime calls (kernel launches, copies,
 *            memsets, graph launches, cudaMalloc/cudaFree) wait. Then every thread of the process that is
 *            not held at a gate must be idle (no CPU time over a few ms), the devices are synchronized, the
 *            memory is copied into the staging file at DMA speed, and the threads must still have been idle
 *            meanwhile: work issued through paths this library does not see (cuBLAS, Triton) cannot have
 *            raced the copy. Only then is the physical memory released (the address ranges stay reserved).
 *            Any failure leaves the memory mapped and the gate open: the agent takes the plain path.
 *   RELOAD   new physical memory mapped at the same addresses, the staging copied back, the gate opened. */
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cs.h"

#define CS_DEVMEM_MIN (1u << 20)
#define CUDA_ERROR_INITIALIZATION 3

typedef uint64_t CUdeviceptr;
typedef uint64_t CUmemHandle;
typedef int CUresult;

struct cu_loc {
  int type; /* 1: device */
  int id;
};
struct cu_prop { /* CUmemAllocationProp */
  int type;      /* 1: pinned */
  int handle_types;
  struct cu_loc location;
  void* win32;
  unsigned char compression, rdma;
  unsigned short usage;
  unsigned char reserved[4];
};
struct cu_access {
  struct cu_loc location;
  int flags; /* 3: read-write */
};

static struct {
  CUresult (*granularity)(size_t*, const struct cu_prop*, int);
  CUresult (*reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*addr_free)(CUdeviceptr, size_t);
  CUresult (*create)(CUmemHandle*, size_t, const struct cu_prop*, unsigned long long);
  CUresult (*release)(CUmemHandle);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const struct cu_access*, size_t);
  CUresult (*ctx_device)(int*);
  CUresult (*ctx_current)(void**);
  CUresult (*ctx_sync)(void);
  CUresult (*ctx_set)(void*);
  CUresult (*primary)(void**, int);
  CUresult (*host_register)(void*, size_t, unsigned);
  CUresult (*host_unregister)(void*);
  CUresult (*d2h)(void*, CUdeviceptr, size_t);
  CUresult (*h2d)(CUdeviceptr, const void*, size_t);
  cudaError_t (*rt_malloc)(void**, size_t);
  cudaError_t (*rt_free)(void*);
  int ready; /* 1 loaded, -1 unavailable or disabled */
} cu;

struct cs_dm {
  CUdeviceptr va;
  size_t size; /* rounded up to the granularity */
  CUmemHandle handle;
  int device;
  int slab;         /* a chunk of slab.c's: its allocations are freed there, not here */
  size_t stage_off; /* where OFFLOAD put it in the staging file */
};

struct cs_seg { /* one mapping of the staging file: [off, off + size), pinned in pieces of `piece` bytes */
  char* host;
  size_t off, size, piece;
};
#define DM_SEGS 64
static struct cs_seg dm_seg[DM_SEGS];
static int dm_nseg;
static size_t dm_stage; /* staging file bytes mapped and pinned */
static int dm_out;      /* 1 between OFFLOAD and RELOAD */
static int dm_gate;     /* 1: gated runtime calls wait (from OFFLOAD until RELOAD) */

static pthread_mutex_t dm_lock = PTHREAD_MUTEX_INITIALIZER;
static struct cs_dm* dm;
static size_t dm_n, dm_cap;
static size_t dm_bytes; /* mapped bytes served through VMM */

static void* sym(void* h, const char* name) {
  void* p = cs_real_dlsym(h, name); /* never a gated wrapper: the control thread copies while the gate is closed */
  if (!p) cs_log("devmem: %s missing from libcuda: device memory stays with cudaMalloc", name);
  return p;
}

static void dm_load(void) {
  pthread_mutex_lock(&dm_lock);
  if (cu.ready) goto out;
  *(void**)&cu.rt_malloc = dlsym(RTLD_NEXT, "cudaMalloc");
  *(void**)&cu.rt_free = dlsym(RTLD_NEXT, "cudaFree");
  const char* on = getenv("CRYOSLEEP_DEVMEM");
  void* h = on && strcmp(on, "1") == 0 ? dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL) : NULL;
  if (!h) {
    cu.ready = -1;
    goto out;
  }
  int ok = 1;
#define S(field, name) ok &= (*(void**)&cu.field = sym(h, name)) != NULL
  S(granularity, "cuMemGetAllocationGranularity");
  S(reserve, "cuMemAddressReserve");
  S(addr_free, "cuMemAddressFree");
  S(create, "cuMemCreate");
  S(release, "cuMemRelease");
  S(map, "cuMemMap");
  S(unmap, "cuMemUnmap");
  S(set_access, "cuMemSetAccess");
  S(ctx_device, "cuCtxGetDevice");
  S(ctx_current, "cuCtxGetCurrent");
  S(ctx_sync, "cuCtxSynchronize");
  S(ctx_set, "cuCtxSetCurrent");
  S(primary, "cuDevicePrimaryCtxRetain");
  S(host_register, "cuMemHostRegister_v2");
  S(host_unregister, "cuMemHostUnregister");
  S(d2h, "cuMemcpyDtoH_v2");
  S(h2d, "cuMemcpyHtoD_v2");
#undef S
  cu.ready = ok ? 1 : -1;
  if (ok && cs_ctl) __atomic_store_n(&cs_ctl->devmem_on, 1, __ATOMIC_RELAXED);
out:
  pthread_mutex_unlock(&dm_lock);
}

static void dm_failed(const char* call, CUresult rc) {
  static int said;
  if (!said++) cs_log("devmem: %s failed (CUDA error %d): this allocation, and any other that fails so, "
                      "stays with cudaMalloc (the driver's slower checkpoint copies it)", call, rc);
}

/* The calling thread's device (its context made current by the runtime if it has none yet). */
static int dm_current_device(int* device) {
  void* ctx = NULL;
  CUresult rc;
  if (cu.ctx_current(&ctx) != 0 || !ctx) {
    cu.rt_free(NULL); /* the runtime makes its primary context current */
    if ((rc = cu.ctx_current(&ctx)) != 0 || !ctx) return dm_failed("cuCtxGetCurrent", rc), -1;
  }
  if ((rc = cu.ctx_device(device)) != 0) return dm_failed("cuCtxGetDevice", rc), -1;
  return 0;
}

/* Reserve, create, map, grant access. 0 on success; on failure nothing is left behind. */
static int dm_map_new(struct cs_dm* d, size_t want) {
  CUresult rc;
  if (dm_current_device(&d->device) != 0) return -1;
  struct cu_prop prop = {.type = 1, .location = {1, d->device}};
  size_t gran = 0;
  if ((rc = cu.granularity(&gran, &prop, 1)) != 0 || !gran) return dm_failed("cuMemGetAllocationGranularity", rc), -1;
  d->size = (want + gran - 1) / gran * gran;
  if ((rc = cu.reserve(&d->va, d->size, gran, 0, 0)) != 0) return dm_failed("cuMemAddressReserve", rc), -1;
  if ((rc = cu.create(&d->handle, d->size, &prop, 0)) != 0) {
    if (rc != 2 /* out of memory: cudaMalloc says so itself */) dm_failed("cuMemCreate", rc);
    goto unreserve;
  }
  if ((rc = cu.map(d->va, d->size, 0, d->handle, 0)) != 0) {
    dm_failed("cuMemMap", rc);
    goto release;
  }
  struct cu_access acc = {{1, d->device}, 3};
  if ((rc = cu.set_access(d->va, d->size, &acc, 1)) != 0) {
    dm_failed("cuMemSetAccess", rc);
    goto unmap;
  }
  return 0;
unmap:
  cu.unmap(d->va, d->size);
release:
  cu.release(d->handle);
unreserve:
  cu.addr_free(d->va, d->size);
  return -1;
}

/* ---- the runtime gate ----------------------------------------------------------------------------
 * Open: one thread-local store before and after the real call, and one load. Closed: the thread waits,
 * not marked inside, its id in the held set (so the quiet check ignores its polling). */
static void dm_wait_gate(struct cs_tslot* t) {
  long nap_ns = 20 * 1000;
  cs_held_tid(t->owner, 1);
  while (__atomic_load_n(&dm_gate, __ATOMIC_ACQUIRE)) cs_nap_held(&t->rt, &nap_ns);
  cs_held_tid(t->owner, 0);
}

/* Enter a gated call. Calls nest (the runtime's cudaLaunchKernel reaches the driver's cuLaunchKernel, both
 * gated): only the outermost one waits at a closed gate, and the thread counts as inside until it leaves it. */
static inline struct cs_tslot* dm_enter(void) {
  struct cs_tslot* t = cs_thread();
  int depth = __atomic_load_n(&t->rt, __ATOMIC_RELAXED);
  __atomic_store_n(&t->rt, depth + 1, __ATOMIC_RELAXED);
  __atomic_signal_fence(__ATOMIC_SEQ_CST); /* ordered against the control thread by its membarrier */
  if (__builtin_expect(depth == 0 && __atomic_load_n(&dm_gate, __ATOMIC_ACQUIRE), 0)) dm_wait_gate(t);
  return t;
}

static inline void dm_leave(struct cs_tslot* t) {
  __atomic_store_n(&t->rt, __atomic_load_n(&t->rt, __ATOMIC_RELAXED) - 1, __ATOMIC_RELEASE);
}

struct cs_tslot* cs_dm_enter(void) { return dm_enter(); }
void cs_dm_leave(struct cs_tslot* t) { dm_leave(t); }

#define DM_REAL(ret, name, params)                                          \
  static ret(*real) params;                                               \
  if (!real) *(void**)&real = dlsym(RTLD_NEXT, name);                     \
  if (!real) return CUDA_ERROR_INITIALIZATION;

struct cs_dim3 {
  unsigned x, y, z;
};

cudaError_t cudaLaunchKernel(const void* f, struct cs_dim3 g, struct cs_dim3 b, void** a, size_t m, cudaStream_t s) {
  DM_REAL(cudaError_t, "cudaLaunchKernel", (const void*, struct cs_dim3, struct cs_dim3, void**, size_t, cudaStream_t))
  struct cs_tslot* t = dm_enter();
  cudaError_t r = real(f, g, b, a, m, s);
  dm_leave(t);
  return r;
}

cudaError_t cudaLaunchKernelExC(const void* config, const void* f, void** a) {
  DM_REAL(cudaError_t, "cudaLaunchKernelExC", (const void*, const void*, void**))
  struct cs_tslot* t = dm_enter();
  cudaError_t r = real(config, f, a);
  dm_leave(t);
  return r;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t n, int kind) {
  DM_REAL(cudaError_t, "cudaMemcpy", (void*, const void*, size_t, int))
  struct cs_tslot* t = dm_enter();
  cudaError_t r = real(dst, src, n, kind);
  dm_leave(t);
  return r;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, int kind, cudaStream_t s) {
  DM_REAL(cudaError_t, "cudaMemcpyAsync", (void*, const void*, size_t, int, cudaStream_t))
  struct cs_tslot* t = dm_enter();
  cudaError_t r = real(dst, src, n, kind, s);
  dm_leave(t);
  return r;
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dp, const void* src, size_t sp, size_t w, size_t h, int kind,
                              cudaStream_t s) {
  DM_REAL(cudaError_t, "cudaMemcpy2DAsync", (void*, size_t, const void*, size_t, size_t, size_t, int, cudaStream_t))
  struct cs_tslot* t = dm_enter();
  cudaError_t r = real(dst, dp, src, sp, w, h, kind, s);
  dm_leave(t);
  return r;
}

cudaError_t cudaMemset(void* p, int v, size_t n) {
  DM_REAL(cudaError_t, "cudaMemset", (void*, int, size_t))
  struct cs_tslot* t = dm_enter();
  cudaError_t r = real(p, v, n);
  dm_leave(t);
  return r;
}

cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s) {
  DM_REAL(cudaError_t, "cudaMemsetAsync", (void*, int, size_t, cudaStream_t))
  struct cs_tslot* t = dm_enter();
  cudaError_t r = real(p, v, n, s);
  dm_leave(t);
  return r;
}

cudaError_t cudaGraphLaunch(void* exec, cudaStream_t s) {
  DM_REAL(cudaError_t, "cudaGraphLaunch", (void*, cudaStream_t))
  struct cs_tslot* t = dm_enter();
  cudaError_t r = real(exec, s);
  dm_leave(t);
  return r;
}

static int dm_stage_path(char* out, size_t n);

static void dm_publish_locked(void) {
  if (!cs_ctl) return;
  __atomic_store_n(&cs_ctl->devmem_bytes, (uint64_t)dm_bytes, __ATOMIC_RELAXED);
  __atomic_store_n(&cs_ctl->devmem_count, (uint32_t)dm_n, __ATOMIC_RELAXED);
}

void cs_dm_publish(void) {
  if (!cs_ctl) return;
  pthread_mutex_lock(&dm_lock);
  __atomic_store_n(&cs_ctl->devmem_on, cu.ready == 1, __ATOMIC_RELAXED);
  dm_publish_locked();
  __atomic_store_n(&cs_ctl->stage_bytes, (uint64_t)dm_stage, __ATOMIC_RELAXED);
  __atomic_store_n(&cs_ctl->offloaded, (uint32_t)dm_out, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&dm_lock);
  cs_left_publish();
  if (dm_stage) dm_stage_path(cs_ctl->stage_path, sizeof cs_ctl->stage_path);
}

static cudaError_t dm_malloc(void** ptr, size_t size);

/* For memory the application maps itself (vmm.c): the fast path loaded and the control block published, as at
 * a first served cudaMalloc. */
void cs_dm_touch(void) {
  if (!cu.ready) dm_load();
  if (cu.ready == 1 && __atomic_load_n(&cs_cmdp, __ATOMIC_ACQUIRE) == &cs_uninit_word) cs_init();
}
static cudaError_t dm_free(void* ptr);

cudaError_t cudaMalloc(void** ptr, size_t size) {
  struct cs_tslot* t = dm_enter();
  cudaError_t r = dm_malloc(ptr, size);
  dm_leave(t);
  return r;
}

cudaError_t cudaFree(void* ptr) {
  struct cs_tslot* t = dm_enter();
  cudaError_t r = dm_free(ptr);
  dm_leave(t);
  return r;
}

static cudaError_t dm_malloc(void** ptr, size_t size) {
  if (!cu.ready) dm_load();
  if (!cu.rt_malloc) return CUDA_ERROR_INITIALIZATION;
  if (cu.ready < 0 || !ptr) return cu.rt_malloc(ptr, size);
  if (size < CS_DEVMEM_MIN) { /* from a slab of served chunks (slab.c); else left to the driver, counted */
    int dev = -1;
    void* p = dm_current_device(&dev) == 0 ? cs_slab_malloc(size, dev) : NULL;
    if (p) {
      *ptr = p;
      return 0;
    }
    cudaError_t r = cu.rt_malloc(ptr, size);
    if (r == 0) cs_left_add(*ptr, size, 1);
    return r;
  }
  uint64_t va = 0;
  if (cs_dm_serve(size, &va, 0) != 0) return cu.rt_malloc(ptr, size); /* its own error, out of memory included */
  static int said;
  if (!said++) cs_log("devmem: cudaMalloc of %zu bytes and more is served with the VMM API (fast path)",
                      (size_t)CS_DEVMEM_MIN);
  *ptr = (void*)(uintptr_t)va;
  return 0;
}

/* One VMM allocation of at least `size` bytes on the current device, registered for the capture (slab: a chunk
 * of slab.c's). 0, or -1 with nothing left behind. */
int cs_dm_serve(size_t size, uint64_t* va, int slab) {
  struct cs_dm d = {0};
  if (dm_map_new(&d, size) != 0) return -1;
  d.slab = slab;
  pthread_mutex_lock(&dm_lock);
  if (dm_n == dm_cap) {
    size_t cap = dm_cap ? dm_cap * 2 : 256;
    struct cs_dm* grown = realloc(dm, cap * sizeof *dm);
    if (!grown) {
      pthread_mutex_unlock(&dm_lock);
      cu.unmap(d.va, d.size);
      cu.release(d.handle);
      cu.addr_free(d.va, d.size);
      return -1;
    }
    dm = grown;
    dm_cap = cap;
  }
  dm[dm_n++] = d;
  dm_bytes += d.size;
  dm_publish_locked();
  pthread_mutex_unlock(&dm_lock);
  /* a worker that never calls NCCL (one rank) still needs its control block for the fast path's commands */
  if (__atomic_load_n(&cs_cmdp, __ATOMIC_ACQUIRE) == &cs_uninit_word) cs_init();
  *va = d.va;
  return 0;
}

static cudaError_t dm_free(void* ptr) {
  if (!cu.ready) dm_load();
  if (!cu.rt_free) return CUDA_ERROR_INITIALIZATION;
  if (cu.ready < 0 || !ptr) return cu.rt_free(ptr);
  if (cs_slab_owns(ptr)) { /* a small allocation: its slot is free once the device is done with it */
    cu.ctx_sync();
    return cs_slab_free(ptr) == 0 ? 0 : 1 /* cudaErrorInvalidValue */;
  }
  struct cs_dm d = {0};
  pthread_mutex_lock(&dm_lock);
  for (size_t i = 0; i < dm_n; i++) {
    if (dm[i].va == (CUdeviceptr)(uintptr_t)ptr && !dm[i].slab) {
      d = dm[i];
      dm[i] = dm[--dm_n];
      dm_bytes -= d.size;
      dm_publish_locked();
      break;
    }
  }
  pthread_mutex_unlock(&dm_lock);
  if (!d.va) {
    cudaError_t r = cu.rt_free(ptr);
    if (r == 0) cs_left_remove(ptr);
    return r;
  }
  cu.ctx_sync(); /* cudaFree waits for the device before memory goes away */
  int bad = cu.unmap(d.va, d.size) != 0;
  bad |= cu.release(d.handle) != 0;
  bad |= cu.addr_free(d.va, d.size) != 0;
  if (bad) cs_log("devmem: freeing %zu bytes at %p failed", d.size, ptr);
  return bad ? 1 /* cudaErrorInvalidValue */ : 0;
}

/* ---- the capture (control thread only) ---------------------------------------------------------- */

static uint64_t dm_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The device's primary context current on this thread (the control thread has none of its own). */
int cs_dm_ctx(int device) {
  static void* ctx[64];
  if (device < 0 || device >= 64) return -1;
  if (!ctx[device] && cu.primary(&ctx[device], device) != 0) return -1;
  return cu.ctx_set(ctx[device]) == 0 ? 0 : -1;
}

/* The device's queued work done (its primary context current on this thread). */
int cs_dm_sync(int device) { return cs_dm_ctx(device) != 0 ? -1 : cu.ctx_sync(); }

static int dm_stage_path(char* out, size_t n) {
  const char* dir = getenv("CRYOSLEEP_DEVMEM_DIR");
  const char* ctl = getenv("CRYOSLEEP_NCCL_CTL");
  if (!dir || !*dir || !ctl || !*ctl) return -1;
  const char* base = strrchr(ctl, '/');
  return snprintf(out, n, "%s/%s.devmem", dir, base ? base + 1 : ctl) < (int)n ? 0 : -1;
}

/* Pins [p, p + len) for the device's context in pieces of CRYOSLEEP_PIN_PIECE bytes (default 256 MiB; 0: one
 * call), a millisecond apart. Pinning holds the driver from the process's other CUDA calls while it runs
 * (24 GiB in one call: 9 s on an H200); in pieces it took less time in all on an H200 (two ranks' 27 GiB each:
 * 14.4 s in 256 MiB pieces, 16.4 s in 1 GiB, 19.6-27.3 s whole; docs/benchmarks.md). Sets *piece_out to the
 * piece size (len when whole): a copy must not cross from one registration into the next (the driver refuses
 * it, CUDA error 1). On failure nothing is left pinned. */
static CUresult dm_pin(char* p, size_t len, size_t* piece_out) {
  const char* env = getenv("CRYOSLEEP_PIN_PIECE");
  size_t piece = env && *env ? (size_t)strtoull(env, NULL, 10) : (size_t)256 << 20;
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  piece = piece && piece < len ? (piece + page - 1) / page * page : len;
  CUresult r = 0;
  size_t off = 0;
  for (; off < len && r == 0; off += piece) {
    if (off) nanosleep(&(struct timespec){0, 1000000}, NULL);
    r = cu.host_register(p + off, len - off < piece ? len - off : piece, 0);
  }
  if (r != 0)
    for (size_t undo = 0; undo + piece < off; undo += piece) cu.host_unregister(p + undo);
  *piece_out = piece;
  return r;
}

/* Tmpfs huge pages are on for an madvise()d mapping (shmem_enabled "always", "within_size", "advise" or "force"). */
static int dm_huge_ok(void) {
  const char* e = getenv("CRYOSLEEP_ARENA_HUGE");
  if (e && strcmp(e, "0") == 0) return 0;
  char buf[128] = "";
  FILE* f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "re");
  if (!f) return 0;
  size_t k = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[k] = 0;
  return strstr(buf, "[always]") || strstr(buf, "[within_size]") || strstr(buf, "[advise]") || strstr(buf, "[force]");
}

/* Faults [p, p + len) in, writable, before the pinning: the page faults then happen here, outside the driver's
 * lock, rather than inside cuMemHostRegister (which would hold the process's other CUDA calls meanwhile). */
static int dm_prefault(char* p, size_t len) {
  const char* e = getenv("CRYOSLEEP_ARENA_PREFAULT");
  if (e && strcmp(e, "0") == 0) return 0;
  if (madvise(p, len, 23 /* MADV_POPULATE_WRITE, Linux 5.14 */) == 0) return 1;
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  for (size_t o = 0; o < len; o += page) ((volatile char*)p)[o] = ((volatile char*)p)[o];
  return 1;
}

/* The staging arena grown to hold `want` bytes (+1/8, in 64 MiB steps): fallocated on tmpfs, mapped MAP_SHARED,
 * huge pages advised where tmpfs has them, faulted in, then pinned once for the device's context. */
static int dm_arena_grow(size_t want, int dev, uint32_t how, char* err, size_t n) {
  if (want <= dm_stage) return 0;
  size_t grow = want + want / 8; /* room for the allocator to grow a little before the next one */
  grow = (grow + (64u << 20) - 1) & ~(size_t)((64u << 20) - 1);
  char path[256];
  if (dm_stage_path(path, sizeof path) != 0)
    return snprintf(err, n, "PREPARE: no staging path (CRYOSLEEP_DEVMEM_DIR and CRYOSLEEP_NCCL_CTL)"), -1;
  if (dm_nseg == DM_SEGS) return snprintf(err, n, "PREPARE: the staging file has %d pieces already", DM_SEGS), -1;
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return snprintf(err, n, "PREPARE: open %s: %s", path, strerror(errno)), -1;
  int rc = ftruncate(fd, (off_t)grow) != 0 ? errno : posix_fallocate(fd, (off_t)dm_stage, (off_t)(grow - dm_stage));
  void* p = rc ? MAP_FAILED : mmap(NULL, grow - dm_stage, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)dm_stage);
  if (p == MAP_FAILED && !rc) rc = errno;
  close(fd);
  if (rc) return snprintf(err, n, "PREPARE: staging %zu bytes in %s: %s", grow, path, strerror(rc)), -1;
  size_t len = grow - dm_stage;
  if (dm_huge_ok() && madvise(p, len, MADV_HUGEPAGE) == 0) how |= CS_ARENA_HUGE;
  uint64_t t0 = dm_now_ns();
  if (dm_prefault(p, len)) how |= CS_ARENA_PREFAULTED;
  uint64_t t1 = dm_now_ns();
  /* pinned for the worker's device only: bench/vmm_probe.py measured the checkpoint so (docs/benchmarks.md) */
  size_t piece = 0;
  CUresult cr = cs_dm_ctx(dev) != 0 ? -1 : dm_pin(p, len, &piece);
  uint64_t t2 = dm_now_ns();
  if (cr != 0) {
    munmap(p, len);
    return snprintf(err, n, "PREPARE: pinning %zu bytes of %s failed (CUDA error %d)", len, path, cr), -1;
  }
  dm_seg[dm_nseg++] = (struct cs_seg){p, dm_stage, len, piece};
  dm_stage = grow;
  if (cs_ctl) {
    snprintf(cs_ctl->stage_path, sizeof cs_ctl->stage_path, "%s", path);
    /* how the last growth was made (a first PREPARE's, unless it grew since), times summed over all */
    __atomic_store_n(&cs_ctl->arena_how, how, __ATOMIC_RELAXED);
    __atomic_fetch_add(&cs_ctl->arena_prefault_ns, t1 - t0, __ATOMIC_RELAXED);
    __atomic_fetch_add(&cs_ctl->arena_pin_ns, t2 - t1, __ATOMIC_RELAXED);
    __atomic_store_n(&cs_ctl->arena_piece, (uint64_t)piece, __ATOMIC_RELAXED);
    __atomic_fetch_add(&cs_ctl->arena_pins, (uint32_t)((len + piece - 1) / piece), __ATOMIC_RELAXED);
    __atomic_store_n(&cs_ctl->stage_bytes, (uint64_t)dm_stage, __ATOMIC_RELEASE);
  }
  return 0;
}

static size_t dm_want(int* dev) {
  pthread_mutex_lock(&dm_lock);
  size_t want = dm_bytes + cs_vmm_movable();
  *dev = dm_n ? dm[0].device : cs_vmm_device();
  pthread_mutex_unlock(&dm_lock);
  return want;
}

int cs_dm_prepare(char* err, size_t n) {
  if (!cu.ready) dm_load();
  if (cu.ready != 1) return snprintf(err, n, "PREPARE: the fast path is off (CRYOSLEEP_DEVMEM=1 not set, or "
                                     "libcuda lacks the VMM calls)"), -1;
  int dev = 0;
  size_t want = dm_want(&dev);
  return dm_arena_grow(want, dev, 0, err, n);
}

/* CRYOSLEEP_ARENA_BYTES=N: the control thread makes the arena (at least N bytes) once, as soon as the process
 * has device memory served (its device known), ahead of any snapshot. Called from the control thread's loop. */
void cs_dm_early(void) {
  static int done;
  if (done || cu.ready != 1) return;
  const char* e = getenv("CRYOSLEEP_ARENA_BYTES");
  if (!e || !*e) return;
  int dev = 0;
  size_t want = dm_want(&dev), floor = (size_t)strtoull(e, NULL, 10);
  if (!want) return; /* nothing served yet: the device is not known */
  done = 1;
  char why[256];
  int r = dm_arena_grow(want > floor ? want : floor, dev, CS_ARENA_EARLY, why, sizeof why);
  if (r) cs_log("devmem: the early staging arena: %s (a snapshot prepares it instead)", why);
}

/* Copies [off, off + len) of the staging file from (out) or to (in) device address va, one copy per pinned
 * piece it touches. */
int cs_dm_copy(uint64_t va, size_t off, size_t len, int out) {
  for (int i = 0; i < dm_nseg && len; i++) {
    struct cs_seg* g = &dm_seg[i];
    while (len && off < g->off + g->size) {
      size_t in_seg = off - g->off, end = (in_seg / g->piece + 1) * g->piece;
      if (end > g->size) end = g->size;
      size_t k = end - in_seg < len ? end - in_seg : len;
      CUresult r = out ? cu.d2h(g->host + in_seg, va, k) : cu.h2d(va, g->host + in_seg, k);
      if (r != 0) return r;
      va += k;
      off += k;
      len -= k;
    }
  }
  return len ? -1 : 0;
}


static void dm_open_gate(void) { __atomic_store_n(&dm_gate, 0, __ATOMIC_RELEASE); }

int cs_dm_offloaded(void) { return __atomic_load_n(&dm_out, __ATOMIC_ACQUIRE); }
/* Copies every allocation into the staging file, devices synchronized first. Holds dm_lock. */
static CUresult dm_copy_all(size_t* total) {
  CUresult r = 0;
  int last_dev = -1;
  size_t off = 0;
  for (size_t i = 0; i < dm_n && !r; i++) {
    if (dm[i].device != last_dev) {
      r = cs_dm_ctx(dm[i].device) != 0 ? -1 : cu.ctx_sync(); /* the device's queued work done first */
      last_dev = dm[i].device;
    }
    dm[i].stage_off = off;
    if (!r) r = cs_dm_copy(dm[i].va, off, dm[i].size, 1);
    off += dm[i].size;
  }
  *total = off;
  return r;
}

int cs_dm_offload(char* err, size_t n) {
  static struct cs_thr a[CS_THREADS], b[CS_THREADS];
  if (dm_out) return 0;
  if (!cu.ready) dm_load();
  if (cu.ready != 1) return snprintf(err, n, "OFFLOAD: the fast path is off"), -1;
  if (!cs_drv_complete())
    return snprintf(err, n, "OFFLOAD: some CUDA driver calls of this process could not be gated"), -1;
  __atomic_store_n(&dm_gate, 1, __ATOMIC_RELEASE);
  cs_fence_all(); /* every thread entering a gated call from now on sees the gate */
  int self = gettid(), na = 0;
  uint64_t t0 = dm_now_ns();
  while (cs_scan_rt() > 0) { /* calls already past the gate finish first */
    if (dm_now_ns() - t0 > 2000000000ull) {
      dm_open_gate();
      return snprintf(err, n, "OFFLOAD: a thread stayed inside a CUDA runtime call for 2 s"), -1;
    }
    struct timespec ts = {0, 100000};
    nanosleep(&ts, NULL);
  }
  pthread_mutex_lock(&dm_lock);
  size_t need = 0, total = 0;
  for (size_t i = 0; i < dm_n; i++) need += dm[i].size;
  need += cs_vmm_movable();
  if (need > dm_stage) {
    pthread_mutex_unlock(&dm_lock);
    dm_open_gate();
    return snprintf(err, n, "OFFLOAD: the staging file holds %zu bytes, the device memory is %zu: PREPARE again",
                    dm_stage, need), -1;
  }
  /* A thread that ran during the copy (a sleeping one that woke up, say) may have issued work the copy missed:
   * copy again once it is held or idle; a few tries, then the plain path. */
  uint64_t c0 = 0, c1 = 0;
  int tid = 0;
  long long ran_ns = 0;
  CUresult r = 0;
  for (int attempt = 0; attempt < 3; attempt++) {
    if (cs_thr_wait_quiet(a, &na, b, self, err, n) != 0) {
      pthread_mutex_unlock(&dm_lock);
      dm_open_gate();
      return -1;
    }
    c0 = dm_now_ns();
    r = dm_copy_all(&total);
    if (!r) r = cs_vmm_copy_out(&total); /* then the memory the application mapped itself, after it */
    c1 = dm_now_ns();
    if (r) break;
    int nb = cs_thr_sample(b, self);
    if (!(tid = cs_thr_ran(a, na, b, nb, &ran_ns))) break;
  }
  if (r || tid) {
    char desc[192] = "";
    if (tid) cs_thr_desc(tid, ran_ns, "during the copy", desc, sizeof desc);
    pthread_mutex_unlock(&dm_lock);
    dm_open_gate();
    if (r) return snprintf(err, n, "OFFLOAD: copying device memory out failed (CUDA error %d); nothing was "
                           "released", r), -1;
    return snprintf(err, n, "OFFLOAD: thread %d (%s) ran during each of 3 copies of device memory: no consistent "
                    "copy, nothing was released", tid, desc), -1;
  }
  int bad = 0;
  for (size_t i = 0; i < dm_n; i++) {
    bad |= cu.unmap(dm[i].va, dm[i].size) != 0;
    bad |= cu.release(dm[i].handle) != 0;
    dm[i].handle = 0;
  }
  bad |= cs_vmm_release() != 0;
  dm_out = 1;
  if (cs_ctl) {
    __atomic_store_n(&cs_ctl->offload_bytes, (uint64_t)total, __ATOMIC_RELAXED);
    __atomic_store_n(&cs_ctl->offload_ns, c1 - c0, __ATOMIC_RELAXED);
    __atomic_store_n(&cs_ctl->offloaded, 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&dm_lock);
  if (bad) { /* the memory is in the staging file: bring it back now rather than leave it half released */
    char why[128];
    cs_dm_reload(why, sizeof why);
    return snprintf(err, n, "OFFLOAD: releasing device memory failed; reloaded it (%s)", why), -1;
  }
  return 0;
}

int cs_dm_reload(char* err, size_t n) {
  if (!dm_out) {
    dm_open_gate();
    return 0;
  }
  uint64_t t0 = dm_now_ns();
  pthread_mutex_lock(&dm_lock);
  CUresult r = 0;
  size_t i = 0;
  for (; i < dm_n; i++) {
    struct cs_dm* d = &dm[i];
    if (d->handle) continue; /* brought back by an earlier, interrupted RELOAD */
    struct cu_prop prop = {.type = 1, .location = {1, d->device}};
    struct cu_access acc = {{1, d->device}, 3};
    CUmemHandle h = 0;
    if ((r = cs_dm_ctx(d->device) != 0 ? -1 : cu.create(&h, d->size, &prop, 0)) != 0) break;
    if ((r = cu.map(d->va, d->size, 0, h, 0)) != 0) {
      cu.release(h);
      break;
    }
    if ((r = cu.set_access(d->va, d->size, &acc, 1)) == 0) r = cs_dm_copy(d->va, d->stage_off, d->size, 0);
    if (r) {
      cu.unmap(d->va, d->size);
      cu.release(h);
      break;
    }
    d->handle = h;
  }
  if (r) {
    pthread_mutex_unlock(&dm_lock);
    /* the gate stays closed: the application must not touch memory that is not back */
    return snprintf(err, n, "RELOAD: allocation %zu of %zu (%zu bytes) could not be brought back (CUDA error %d); "
                    "the staging file still holds it: retry RELOAD", i + 1, dm_n, dm[i].size, r), -1;
  }
  if (cs_vmm_reload(err, n) != 0) {
    pthread_mutex_unlock(&dm_lock);
    return -1; /* the gate stays closed, as above */
  }
  dm_out = 0;
  if (cs_ctl) {
    __atomic_store_n(&cs_ctl->reload_ns, dm_now_ns() - t0, __ATOMIC_RELAXED);
    __atomic_store_n(&cs_ctl->offloaded, 0, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&dm_lock);
  dm_open_gate();
  return 0;
}
