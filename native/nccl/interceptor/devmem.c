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

/* Reserve, create, map, grant access. 0 on success; on failure nothing is left behind. */
static int dm_map_new(struct cs_dm* d, size_t want) {
  void* ctx = NULL;
  CUresult rc;
  if (cu.ctx_current(&ctx) != 0 || !ctx) {
    cu.rt_free(NULL); /* the runtime makes its primary context current */
    if ((rc = cu.ctx_current(&ctx)) != 0 || !ctx) return dm_failed("cuCtxGetCurrent", rc), -1;
  }
  if ((rc = cu.ctx_device(&d->device)) != 0) return dm_failed("cuCtxGetDevice", rc), -1;
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
  if (dm_stage) dm_stage_path(cs_ctl->stage_path, sizeof cs_ctl->stage_path);
}

static cudaError_t dm_malloc(void** ptr, size_t size);
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
  if (cu.ready < 0 || size < CS_DEVMEM_MIN || !ptr) return cu.rt_malloc(ptr, size);
  struct cs_dm d = {0};
  if (dm_map_new(&d, size) != 0) return cu.rt_malloc(ptr, size); /* its own error, out of memory included */
  pthread_mutex_lock(&dm_lock);
  if (dm_n == dm_cap) {
    size_t cap = dm_cap ? dm_cap * 2 : 256;
    struct cs_dm* grown = realloc(dm, cap * sizeof *dm);
    if (!grown) {
      pthread_mutex_unlock(&dm_lock);
      cu.unmap(d.va, d.size);
      cu.release(d.handle);
      cu.addr_free(d.va, d.size);
      return cu.rt_malloc(ptr, size);
    }
    dm = grown;
    dm_cap = cap;
  }
  dm[dm_n++] = d;
  dm_bytes += d.size;
  dm_publish_locked();
  static int said;
  if (!said++) cs_log("devmem: cudaMalloc of %zu bytes and more is served with the VMM API (fast path)",
                      (size_t)CS_DEVMEM_MIN);
  pthread_mutex_unlock(&dm_lock);
  /* a worker that never calls NCCL (one rank) still needs its control block for the fast path's commands */
  if (__atomic_load_n(&cs_cmdp, __ATOMIC_ACQUIRE) == &cs_uninit_word) cs_init();
  *ptr = (void*)(uintptr_t)d.va;
  return 0;
}

static cudaError_t dm_free(void* ptr) {
  if (!cu.ready) dm_load();
  if (!cu.rt_free) return CUDA_ERROR_INITIALIZATION;
  if (cu.ready < 0 || !ptr) return cu.rt_free(ptr);
  struct cs_dm d = {0};
  pthread_mutex_lock(&dm_lock);
  for (size_t i = 0; i < dm_n; i++) {
    if (dm[i].va == (CUdeviceptr)(uintptr_t)ptr) {
      d = dm[i];
      dm[i] = dm[--dm_n];
      dm_bytes -= d.size;
      dm_publish_locked();
      break;
    }
  }
  pthread_mutex_unlock(&dm_lock);
  if (!d.va) return cu.rt_free(ptr);
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
static int dm_ctx(int device) {
  static void* ctx[64];
  if (device < 0 || device >= 64) return -1;
  if (!ctx[device] && cu.primary(&ctx[device], device) != 0) return -1;
  return cu.ctx_set(ctx[device]) == 0 ? 0 : -1;
}

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

int cs_dm_prepare(char* err, size_t n) {
  if (cu.ready != 1) return snprintf(err, n, "PREPARE: the fast path is off (CRYOSLEEP_DEVMEM=1 not set, or "
                                     "libcuda lacks the VMM calls)"), -1;
  pthread_mutex_lock(&dm_lock);
  size_t want = dm_bytes, first_dev = dm_n ? (size_t)dm[0].device : 0;
  pthread_mutex_unlock(&dm_lock);
  if (want <= dm_stage) return 0;
  size_t grow = want + want / 8;         /* room for the allocator to grow a little before the next one */
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
  /* pinned for the worker's device only: bench/vmm_probe.py measured the checkpoint so (docs/benchmarks.md) */
  size_t piece = 0;
  CUresult cr = dm_ctx((int)first_dev) != 0 ? -1 : dm_pin(p, grow - dm_stage, &piece);
  if (cr != 0) {
    munmap(p, grow - dm_stage);
    return snprintf(err, n, "PREPARE: pinning %zu bytes of %s failed (CUDA error %d)", grow - dm_stage, path, cr), -1;
  }
  dm_seg[dm_nseg++] = (struct cs_seg){p, dm_stage, grow - dm_stage, piece};
  dm_stage = grow;
  if (cs_ctl) {
    snprintf(cs_ctl->stage_path, sizeof cs_ctl->stage_path, "%s", path);
    __atomic_store_n(&cs_ctl->stage_bytes, (uint64_t)dm_stage, __ATOMIC_RELEASE);
  }
  return 0;
}

/* Copies [off, off + len) of the staging file from (out) or to (in) device address va, one copy per pinned
 * piece it touches. */
static CUresult dm_copy(CUdeviceptr va, size_t off, size_t len, int out) {
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

/* ---- which threads ran: each thread's CPU clock (exact, unlike /proc's tick-updated counters) and
 * whether it is runnable right now ('R' in /proc/self/task/<tid>/stat) ---- */
#define DM_THREADS 1024
struct dm_thr {
  int tid;
  int runnable;
  unsigned long long ns;
};

static int dm_exempt(int tid, int self) {
  if (tid == self || cs_is_held_tid(tid)) return 1;
  char path[64], name[32] = "";
  snprintf(path, sizeof path, "/proc/self/task/%d/comm", tid);
  FILE* f = fopen(path, "re");
  if (f) {
    if (!fgets(name, sizeof name, f)) name[0] = 0;
    name[strcspn(name, "\n")] = 0;
    fclose(f);
  }
  /* the CUDA driver's own threads, PyTorch's NCCL watchdog and heartbeat (they only poll events), and NCCL's
   * RAS thread (it outlives the communicators, which quiesce destroyed, and waits in poll with a timeout; a
   * monitoring thread that submits no GPU work: on an H200 it ran during each of three 24 GiB copies). NCCL
   * names its threads when NCCL_SET_THREAD_NAME=1, which `cryosleep run --fast-path` sets. */
  return strncmp(name, "cuda", 4) == 0 || strncmp(name, "pt_nccl_", 8) == 0 || strcmp(name, "NCCL RAS") == 0;
}

static int dm_runnable(int tid) {
  char path[64], buf[512];
  snprintf(path, sizeof path, "/proc/self/task/%d/stat", tid);
  FILE* f = fopen(path, "re");
  if (!f) return 0;
  size_t k = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[k] = 0;
  const char* close_paren = strrchr(buf, ')'); /* the state follows the name, which may hold anything */
  return close_paren && close_paren[1] == ' ' && close_paren[2] == 'R';
}

static int dm_sample(struct dm_thr* out, int self) {
  int n = 0;
  DIR* d = opendir("/proc/self/task");
  if (!d) return -1;
  struct dirent* e;
  while ((e = readdir(d)) && n < DM_THREADS) {
    int tid = atoi(e->d_name);
    if (tid <= 0 || dm_exempt(tid, self)) continue;
    struct timespec ts;
    clockid_t clk = (clockid_t)((~(unsigned)tid << 3) | 6); /* the thread's CPU clock (CPUCLOCK_SCHED, per thread) */
    if (clock_gettime(clk, &ts) != 0) continue;                /* gone */
    out[n++] = (struct dm_thr){tid, dm_runnable(tid), (unsigned long long)ts.tv_sec * 1000000000ull +
                                                          (unsigned long long)ts.tv_nsec};
  }
  closedir(d);
  return n;
}

/* A thread of `after` that ran since `before` (or is new), or 0; `*ran_ns` its CPU time in between (-1: new). */
static int dm_ran(const struct dm_thr* before, int nb, const struct dm_thr* after, int na, long long* ran_ns) {
  for (int i = 0; i < na; i++) {
    int j = 0;
    while (j < nb && before[j].tid != after[i].tid) j++;
    if (j == nb || after[i].ns != before[j].ns || after[i].runnable) {
      if (ran_ns) *ran_ns = j == nb ? -1 : (long long)(after[i].ns - before[j].ns);
      return after[i].tid;
    }
  }
  return 0;
}

/* "name, state S, in syscall 7, wchan do_poll, 12 us of CPU WHEN": what a refusal says of the thread that ran, so
 * that it can be recognized (NCCL's threads are named when NCCL_SET_THREAD_NAME=1, which `cryosleep run` sets
 * with the fast path). */
static void dm_thread_desc(int tid, long long ran_ns, const char* when, char* out, size_t n) {
  char path[64], name[32] = "", stat[512] = "", sc[64] = "", wchan[64] = "";
  const char* files[] = {"comm", "stat", "syscall", "wchan"};
  char* bufs[] = {name, stat, sc, wchan};
  size_t sizes[] = {sizeof name, sizeof stat, sizeof sc, sizeof wchan};
  for (int i = 0; i < 4; i++) {
    snprintf(path, sizeof path, "/proc/self/task/%d/%s", tid, files[i]);
    FILE* f = fopen(path, "re");
    if (!f) continue;
    size_t k = fread(bufs[i], 1, sizes[i] - 1, f);
    bufs[i][k] = 0;
    bufs[i][strcspn(bufs[i], "\n")] = 0;
    fclose(f);
  }
  const char* cp = strrchr(stat, ')');
  char state = cp && cp[1] == ' ' ? cp[2] : '?';
  sc[strcspn(sc, " ")] = 0; /* the syscall's number (or "running"); its arguments are not needed */
  int k = snprintf(out, n, "%s, state %c, in syscall %s, wchan %s", name, state, sc[0] ? sc : "?",
                   wchan[0] ? wchan : "?");
  if (k > 0 && (size_t)k < n) {
    if (ran_ns >= 0)
      snprintf(out + k, n - (size_t)k, ", %lld us of CPU %s", ran_ns / 1000, when);
    else
      snprintf(out + k, n - (size_t)k, ", started %s", when);
  }
}

static void dm_open_gate(void) { __atomic_store_n(&dm_gate, 0, __ATOMIC_RELEASE); }

int cs_dm_offloaded(void) { return __atomic_load_n(&dm_out, __ATOMIC_ACQUIRE); }

/* Waits until every thread that is not held or exempt shows no CPU time for a few ms (within 1 s). Leaves
 * the sample taken at that moment in `a`. */
static int dm_wait_quiet(struct dm_thr* a, int* na, struct dm_thr* b, int self, char* err, size_t n) {
  uint64_t t0 = dm_now_ns();
  for (;;) {
    *na = dm_sample(a, self);
    struct timespec ts = {0, 3000000};
    nanosleep(&ts, NULL);
    int nb = dm_sample(b, self);
    if (*na < 0 || nb < 0) return snprintf(err, n, "OFFLOAD: /proc/self/task unreadable"), -1;
    long long ran_ns = 0;
    int tid = dm_ran(a, *na, b, nb, &ran_ns);
    if (!tid) {
      memcpy(a, b, (size_t)nb * sizeof *b);
      *na = nb;
      return 0;
    }
    if (dm_now_ns() - t0 > 1000000000ull) {
      char desc[192];
      dm_thread_desc(tid, ran_ns, "in 3 ms", desc, sizeof desc);
      return snprintf(err, n, "OFFLOAD: thread %d (%s) kept running while the job was held: it may issue GPU "
                      "work the interceptor does not see", tid, desc), -1;
    }
  }
}

/* Copies every allocation into the staging file, devices synchronized first. Holds dm_lock. */
static CUresult dm_copy_all(size_t* total) {
  CUresult r = 0;
  int last_dev = -1;
  size_t off = 0;
  for (size_t i = 0; i < dm_n && !r; i++) {
    if (dm[i].device != last_dev) {
      r = dm_ctx(dm[i].device) != 0 ? -1 : cu.ctx_sync(); /* the device's queued work done first */
      last_dev = dm[i].device;
    }
    dm[i].stage_off = off;
    if (!r) r = dm_copy(dm[i].va, off, dm[i].size, 1);
    off += dm[i].size;
  }
  *total = off;
  return r;
}

int cs_dm_offload(char* err, size_t n) {
  static struct dm_thr a[DM_THREADS], b[DM_THREADS];
  if (dm_out) return 0;
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
    if (dm_wait_quiet(a, &na, b, self, err, n) != 0) {
      pthread_mutex_unlock(&dm_lock);
      dm_open_gate();
      return -1;
    }
    c0 = dm_now_ns();
    r = dm_copy_all(&total);
    c1 = dm_now_ns();
    if (r) break;
    int nb = dm_sample(b, self);
    if (!(tid = dm_ran(a, na, b, nb, &ran_ns))) break;
  }
  if (r || tid) {
    char desc[192] = "";
    if (tid) dm_thread_desc(tid, ran_ns, "during the copy", desc, sizeof desc);
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
    if ((r = dm_ctx(d->device) != 0 ? -1 : cu.create(&h, d->size, &prop, 0)) != 0) break;
    if ((r = cu.map(d->va, d->size, 0, h, 0)) != 0) {
      cu.release(h);
      break;
    }
    if ((r = cu.set_access(d->va, d->size, &acc, 1)) == 0) r = dm_copy(d->va, d->stage_off, d->size, 0);
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
  dm_out = 0;
  if (cs_ctl) {
    __atomic_store_n(&cs_ctl->reload_ns, dm_now_ns() - t0, __ATOMIC_RELAXED);
    __atomic_store_n(&cs_ctl->offloaded, 0, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&dm_lock);
  dm_open_gate();
  return 0;
}
