/* The driver gate: the fast path's runtime gate (devmem.c) extended to work submitted through the CUDA
 * driver API, which is how cuBLAS (its statically linked runtime), Triton and the runtime itself launch.
 *
 * Those libraries find the driver's functions in one of three ways, and each is answered here when the fast
 * path is on (CRYOSLEEP_DEVMEM=1; otherwise everything below passes straight through):
 *   - dlsym(handle_of_libcuda, "cuLaunchKernel") or dlsym(..., "cuGetProcAddress_v2"): this library defines
 *     dlsym, calls the real one, and hands back a gated wrapper for the submission calls (a lookup with
 *     RTLD_NEXT is passed on by a tail call, so that the real dlsym still sees its true caller);
 *   - cuGetProcAddress[_v2] (how the runtime, static or dynamic, gets every driver function): wrapped, and
 *     the pointers it returns for submission calls are replaced by gated wrappers;
 *   - a direct link against libcuda.so.1: the submission calls are exported from here too, so such a
 *     library's references bind to the gated versions.
 * A wrapper is a generic forwarder of eleven integer-class arguments (every gated call takes at most eleven,
 * none of them floating point or a large struct by value): on x86-64 and aarch64 the unused ones are
 * harmless garbage to the callee. Each distinct real function gets its own wrapper slot; if the slots run
 * out, the function is left ungated and the fast path refuses (cs_drv_complete). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cs.h"

typedef void* (*cs_dlsym_fn)(void*, const char*);
typedef int (*drv_fn)(long, long, long, long, long, long, long, long, long, long, long);

static cs_dlsym_fn real_dlsym;
static int drv_on = -1;     /* the fast path is on in this process */
static int drv_full;        /* a submission call was left ungated (no slot left) */

static cs_dlsym_fn dlsym_next(void) {
  cs_dlsym_fn f = __atomic_load_n(&real_dlsym, __ATOMIC_ACQUIRE);
  if (!f) {
    f = (cs_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!f) f = (cs_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    __atomic_store_n(&real_dlsym, f, __ATOMIC_RELEASE);
  }
  return f;
}

void* cs_real_dlsym(void* handle, const char* name) {
  cs_dlsym_fn f = dlsym_next();
  return f ? f(handle, name) : NULL;
}

static int drv_enabled(void) {
  int on = __atomic_load_n(&drv_on, __ATOMIC_RELAXED);
  if (on < 0) {
    const char* e = getenv("CRYOSLEEP_DEVMEM");
    on = e && strcmp(e, "1") == 0;
    __atomic_store_n(&drv_on, on, __ATOMIC_RELAXED);
  }
  return on;
}

int cs_drv_complete(void) { return !__atomic_load_n(&drv_full, __ATOMIC_ACQUIRE); }

/* Submission calls by base name (a lookup's _v2/_v3 and _ptds/_ptsz suffixes are stripped first). */
static const char* const gated[] = {
    "cuLaunch", "cuLaunchGrid", "cuLaunchGridAsync", "cuLaunchKernel", "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernelMultiDevice", "cuGraphLaunch",
    "cuMemcpy", "cuMemcpyAsync", "cuMemcpyPeer", "cuMemcpyPeerAsync", "cuMemcpyHtoD", "cuMemcpyDtoH",
    "cuMemcpyDtoD", "cuMemcpyHtoDAsync", "cuMemcpyDtoHAsync", "cuMemcpyDtoDAsync", "cuMemcpyDtoA",
    "cuMemcpyAtoD", "cuMemcpyHtoA", "cuMemcpyAtoH", "cuMemcpyAtoA", "cuMemcpyHtoAAsync", "cuMemcpyAtoHAsync",
    "cuMemcpy2D", "cuMemcpy2DUnaligned", "cuMemcpy2DAsync", "cuMemcpy3D", "cuMemcpy3DAsync", "cuMemcpy3DPeer",
    "cuMemcpy3DPeerAsync", "cuMemcpyBatchAsync", "cuMemcpy3DBatchAsync", "cuMemsetD8", "cuMemsetD16",
    "cuMemsetD32", "cuMemsetD2D8", "cuMemsetD2D16", "cuMemsetD2D32", "cuMemsetD8Async", "cuMemsetD16Async",
    "cuMemsetD32Async", "cuMemsetD2D8Async", "cuMemsetD2D16Async", "cuMemsetD2D32Async",
    "cuStreamWriteValue32", "cuStreamWriteValue64", "cuStreamBatchMemOp", "cuMemPrefetchAsync",
};

/* The base name of a driver call (into base, 96 bytes): 0, or -1 when it is none. */
static int base_name(const char* name, char* base) {
  size_t n = strlen(name);
  if (n >= 96 || name[0] != 'c' || name[1] != 'u') return -1;
  memcpy(base, name, n + 1);
  static const char* const sfx[] = {"_ptds", "_ptsz", "_v2", "_v3"};
  for (int again = 1; again;) {
    again = 0;
    for (size_t i = 0; i < sizeof sfx / sizeof *sfx; i++) {
      size_t k = strlen(sfx[i]);
      if (n > k && strcmp(base + n - k, sfx[i]) == 0) {
        n -= k;
        base[n] = 0;
        again = 1;
      }
    }
  }
  return 0;
}

static int is_gated(const char* base) {
  for (size_t i = 0; i < sizeof gated / sizeof *gated; i++)
    if (strcmp(base, gated[i]) == 0) return 1;
  return 0;
}

/* ---- wrapper slots ---- */
#define DRV_SLOTS 160
static void* drv_real[DRV_SLOTS];
static int drv_used;

#define DRV_W(i)                                                                                              \
  static int drv_w##i(long a0, long a1, long a2, long a3, long a4, long a5, long a6, long a7, long a8, long a9, \
                      long a10) {                                                                           \
    struct cs_tslot* t = cs_dm_enter();                                                                     \
    int r = ((drv_fn)drv_real[i])(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10);                             \
    cs_dm_leave(t);                                                                                         \
    return r;                                                                                               \
  }
#define DRV_W10(d) DRV_W(d##0) DRV_W(d##1) DRV_W(d##2) DRV_W(d##3) DRV_W(d##4) \
                   DRV_W(d##5) DRV_W(d##6) DRV_W(d##7) DRV_W(d##8) DRV_W(d##9)
DRV_W(0) DRV_W(1) DRV_W(2) DRV_W(3) DRV_W(4) DRV_W(5) DRV_W(6) DRV_W(7) DRV_W(8) DRV_W(9)
DRV_W10(1) DRV_W10(2) DRV_W10(3) DRV_W10(4) DRV_W10(5) DRV_W10(6) DRV_W10(7) DRV_W10(8) DRV_W10(9)
DRV_W10(10) DRV_W10(11) DRV_W10(12) DRV_W10(13) DRV_W10(14) DRV_W10(15)
#define DRV_P(i) (void*)drv_w##i,
#define DRV_P10(d) DRV_P(d##0) DRV_P(d##1) DRV_P(d##2) DRV_P(d##3) DRV_P(d##4) \
                   DRV_P(d##5) DRV_P(d##6) DRV_P(d##7) DRV_P(d##8) DRV_P(d##9)
static void* const drv_w[DRV_SLOTS] = {
    DRV_P(0) DRV_P(1) DRV_P(2) DRV_P(3) DRV_P(4) DRV_P(5) DRV_P(6) DRV_P(7) DRV_P(8) DRV_P(9)
    DRV_P10(1) DRV_P10(2) DRV_P10(3) DRV_P10(4) DRV_P10(5) DRV_P10(6) DRV_P10(7) DRV_P10(8) DRV_P10(9)
    DRV_P10(10) DRV_P10(11) DRV_P10(12) DRV_P10(13) DRV_P10(14) DRV_P10(15)};

static void* gate_fn(const char* name, void* real) {
  static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
  void* out = real;
  pthread_mutex_lock(&mu);
  int i = 0;
  while (i < drv_used && drv_real[i] != real) i++;
  if (i < drv_used) {
    out = drv_w[i];
  } else if (drv_used < DRV_SLOTS) {
    drv_real[drv_used] = real;
    out = drv_w[drv_used++];
  } else if (!drv_full) {
    __atomic_store_n(&drv_full, 1, __ATOMIC_RELEASE);
    cs_log("devmem: no gate slot left for %s: the fast path is off in this process", name);
  }
  pthread_mutex_unlock(&mu);
  return out;
}

/* ---- cuGetProcAddress ---- */
static int (*real_gpa)(const char*, void**, int, unsigned long long);
static int (*real_gpa2)(const char*, void**, int, unsigned long long, int*);

static void* wrap(const char* name, void* p, int version);

static int gpa(const char* s, void** pfn, int v, unsigned long long f) {
  int r = real_gpa(s, pfn, v, f);
  if (r == 0 && s && pfn && *pfn) *pfn = wrap(s, *pfn, v);
  return r;
}

static int gpa2(const char* s, void** pfn, int v, unsigned long long f, int* status) {
  int r = real_gpa2(s, pfn, v, f, status);
  if (r == 0 && s && pfn && *pfn) *pfn = wrap(s, *pfn, v);
  return r;
}

static void* libcuda(void);
int cuGetProcAddress(const char* s, void** pfn, int v, unsigned long long f);
int cuGetProcAddress_v2(const char* s, void** pfn, int v, unsigned long long f, int* status);

/* The driver's own function behind a pointer that may be this library's (a lookup in the global scope finds
 * our exports first, and so may the driver's own references to itself): never ours, or a wrapper would call
 * itself. Ours maps to the driver's export of the same ABI. NULL while libcuda is not loaded. */
static void* driver_own(void* p) {
  const char* name = NULL;
  if (p == (void*)gpa || p == (void*)cuGetProcAddress) name = "cuGetProcAddress";
  if (p == (void*)gpa2 || p == (void*)cuGetProcAddress_v2) name = "cuGetProcAddress_v2";
  if (!name) return p;
  return libcuda() ? cs_real_dlsym(libcuda(), name) : NULL;
}

/* Which ABI a cuGetProcAddress pointer has. A lookup by symbol name (dlsym, version 0) has the name's: the
 * export "cuGetProcAddress" takes four arguments, "cuGetProcAddress_v2" five. A lookup of the base name
 * through cuGetProcAddress itself gets the newest ABI of the version asked for: from CUDA 12.0 on that is
 * _v2 (the CUDA runtime asks exactly this: "cuGetProcAddress" at its own version), so the pointer is matched
 * against the driver's two exports first and the version decides only when it is neither. */
static int gpa_is_v2(const char* name, void* p, int version) {
  if (strcmp(name, "cuGetProcAddress_v2") == 0) return 1;
  if (version == 0) return 0;
  void* h = libcuda();
  if (h && p == cs_real_dlsym(h, "cuGetProcAddress_v2")) return 1;
  if (h && p == cs_real_dlsym(h, "cuGetProcAddress")) return 0;
  return version >= 12000;
}

static void* ungated(const char* name, void* p) {
  if (!__atomic_exchange_n(&drv_full, 1, __ATOMIC_ACQ_REL))
    cs_log("devmem: a second %s of the driver cannot be wrapped: the fast path is off in this process", name);
  return p;
}

static void* wrap(const char* name, void* p, int version) {
  if (strcmp(name, "cuGetProcAddress") == 0 || strcmp(name, "cuGetProcAddress_v2") == 0) {
    void* real = driver_own(p);
    if (!real) return p; /* libcuda not loaded: p is this library's export, which looks it up when called */
    if (gpa_is_v2(name, real, version)) {
      if (!real_gpa2) *(void**)&real_gpa2 = real;
      return real_gpa2 == real ? (void*)gpa2 : ungated(name, p);
    }
    if (!real_gpa) *(void**)&real_gpa = real;
    return real_gpa == real ? (void*)gpa : ungated(name, p);
  }
  char base[96];
  if (base_name(name, base) != 0) return p;
  void* vm = cs_vmm_wrap(base, p); /* cuMemCreate, cuMemMap, ...: memory the application maps itself */
  if (vm) return vm;
  return is_gated(base) ? gate_fn(name, p) : p;
}

void* dlsym(void* handle, const char* name) {
  if (handle == RTLD_NEXT || !drv_enabled()) return dlsym_next()(handle, name); /* a tail call: see above */
  void* p = cs_real_dlsym(handle, name);
  return p ? wrap(name, p, 0) : p;
}

/* ---- direct links against libcuda.so.1 (exported under the driver's own names) ---- */
static void* libcuda(void) {
  static void* h;
  if (!h) h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  return h;
}

#define DRV_EXPORT(name)                                                                                  \
  int name(long a0, long a1, long a2, long a3, long a4, long a5, long a6, long a7, long a8, long a9,       \
           long a10) {                                                                                    \
    static drv_fn real;                                                                                   \
    if (!real) *(void**)&real = libcuda() ? cs_real_dlsym(libcuda(), #name) : NULL;                       \
    if (!real) return 3; /* CUDA_ERROR_NOT_INITIALIZED: no libcuda in this process */                     \
    struct cs_tslot* t = drv_enabled() ? cs_dm_enter() : NULL;                                            \
    int r = real(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10);                                            \
    if (t) cs_dm_leave(t);                                                                                \
    return r;                                                                                             \
  }
CS_DRV_EXPORTS(DRV_EXPORT)

int cuGetProcAddress(const char* s, void** pfn, int v, unsigned long long f) {
  if (!real_gpa) *(void**)&real_gpa = libcuda() ? cs_real_dlsym(libcuda(), "cuGetProcAddress") : NULL;
  if (!real_gpa) return 3;
  return drv_enabled() ? gpa(s, pfn, v, f) : real_gpa(s, pfn, v, f);
}

int cuGetProcAddress_v2(const char* s, void** pfn, int v, unsigned long long f, int* status) {
  if (!real_gpa2) *(void**)&real_gpa2 = libcuda() ? cs_real_dlsym(libcuda(), "cuGetProcAddress_v2") : NULL;
  if (!real_gpa2) return 3;
  return drv_enabled() ? gpa2(s, pfn, v, f, status) : real_gpa2(s, pfn, v, f, status);
}
