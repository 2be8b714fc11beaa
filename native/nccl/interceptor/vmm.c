/* Device memory the application maps itself, and what the fast path leaves to the driver
 * (docs/interceptor.md, "The fast path", "Memory the application maps itself").
 *
 * PyTorch's expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) and NCCL's buffers
 * (NCCL_CUMEM_ENABLE, the default) take physical memory with cuMemCreate and map it into address ranges they
 * reserve. With the fast path on (CRYOSLEEP_DEVMEM=1) the handle the application gets from cuMemCreate is a
 * virtual one (VM_TAG | index): the interceptor keeps the driver's handle behind it, so that OFFLOAD can copy
 * the memory out through the application's own mapping, unmap and release it, and RELOAD can create new
 * physical memory, map it at the same addresses with the same access and copy it back, while the value the
 * application holds stays valid. The calls that take or give a handle are wrapped (found by dlsym,
 * cuGetProcAddress or a direct link, as drvgate.c finds the submission calls) and gated like them.
 *
 * Left to the driver's checkpoint, each with its reason published in the control block (CS_LEFT_*):
 * a handle exported to another process (cuMemExportToShareableHandle: the peer's mapping would lose it),
 * one not mapped whole at offset 0 (no single range to copy it through), one not mapped at all, a mapping of
 * a handle made elsewhere (imported from another process), cudaMallocAsync pool memory (the driver's pool owns
 * those addresses: they cannot be released and mapped again from outside it) and cudaMalloc under 1 MiB
 * when slab.c's chunks are off or full (served by cudaMalloc: a VMM allocation each would take a 2 MiB granule). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cs.h"

typedef uint64_t CUdeviceptr;
typedef int CUresult;

#define VM_TAG 0xc500000000000000ull
#define VM_TAG_MASK 0xff00000000000000ull
#define VM_HANDLES 8192
#define VM_MAPS 16384
#define VM_ACC 8
#define VM_PROP 32 /* sizeof(CUmemAllocationProp) */
#define VM_DESC 12 /* sizeof(CUmemAccessDesc) */
#define CU_INVALID_VALUE 1
#define CU_OUT_OF_MEMORY 2

struct vm_handle {
  uint64_t real; /* the driver's handle; 0 while OFFLOAD has it released */
  size_t size;
  unsigned char prop[VM_PROP];
  int device;
  int refs; /* the application's references: cuMemCreate 1, each cuMemRetainAllocationHandle +1, release -1 */
  int maps; /* live mappings of it */
  int exported;
  int moved; /* released by the last OFFLOAD, to come back at RELOAD */
  size_t stage_off;
};

struct vm_map {
  CUdeviceptr va;
  size_t size, off;
  int h; /* index into vm_h, or -1: a handle this library did not create (imported) */
  int nacc;
  unsigned char acc[VM_ACC][VM_DESC]; /* the access last set on it, replayed at RELOAD */
};

static struct vm_handle vm_h[VM_HANDLES];
static int vm_nh; /* 1 + the highest index used */
static struct vm_map vm_m[VM_MAPS];
static int vm_nm;
static pthread_mutex_t vm_lock = PTHREAD_MUTEX_INITIALIZER;

static struct {
  CUresult (*create)(uint64_t*, size_t, const void*, unsigned long long);
  CUresult (*release)(uint64_t);
  CUresult (*map)(CUdeviceptr, size_t, size_t, uint64_t, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const void*, size_t);
  CUresult (*retain)(uint64_t*, void*);
  CUresult (*props)(void*, uint64_t);
  CUresult (*export_)(void*, uint64_t, int, unsigned long long);
} vr;

static int vm_on(void) {
  static int on = -1;
  if (on < 0) {
    const char* e = getenv("CRYOSLEEP_DEVMEM");
    on = e && strcmp(e, "1") == 0;
  }
  return on;
}

static void* vm_real(const char* name) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  return h ? cs_real_dlsym(h, name) : NULL;
}

#define VM_RESOLVE(field, name) \
  if (!vr.field) *(void**)&vr.field = vm_real(name); \
  if (!vr.field) return 3 /* CUDA_ERROR_NOT_INITIALIZED */;

static int vm_index(uint64_t h) {
  if ((h & VM_TAG_MASK) != VM_TAG) return -1;
  uint64_t i = (h & ~VM_TAG_MASK) - 1;
  return i < (uint64_t)vm_nh && vm_h[i].refs + vm_h[i].maps > 0 ? (int)i : -1;
}

/* The handle slot is free again once the application let go of it and nothing maps it; the driver's handle
 * is released then (a mapping keeps physical memory alive, as the driver's own cuMemRelease rule is). */
static void vm_maybe_drop(int i) {
  struct vm_handle* v = &vm_h[i];
  if (v->refs > 0 || v->maps > 0) return;
  if (v->real) vr.release(v->real);
  memset(v, 0, sizeof *v);
}

int cuMemCreate(uint64_t* handle, size_t size, const void* prop, unsigned long long flags) {
  VM_RESOLVE(create, "cuMemCreate")
  if (!vm_on() || !handle || !prop) return vr.create(handle, size, prop, flags);
  cs_dm_touch(); /* the fast path loaded and the control block published, as at a first served cudaMalloc */
  struct cs_tslot* t = cs_dm_enter();
  uint64_t real = 0;
  CUresult r = vr.create(&real, size, prop, flags);
  if (r == 0) {
    pthread_mutex_lock(&vm_lock);
    int i = 0;
    while (i < vm_nh && vm_h[i].refs + vm_h[i].maps > 0) i++;
    if (i == VM_HANDLES) {
      pthread_mutex_unlock(&vm_lock);
      static int said;
      if (!said++) cs_log("devmem: more than %d live cuMemCreate handles: the rest are left to the driver", VM_HANDLES);
      *handle = real;  /* untracked: a mapping of it counts as left to the driver */
    } else {
      if (i == vm_nh) vm_nh++;
      struct vm_handle* v = &vm_h[i];
      memset(v, 0, sizeof *v);
      v->real = real;
      v->size = size;
      memcpy(v->prop, prop, VM_PROP);
      memcpy(&v->device, (const char*)prop + 12, sizeof v->device); /* location.id */
      v->refs = 1;
      *handle = VM_TAG | (uint64_t)(i + 1);
      pthread_mutex_unlock(&vm_lock);
    }
  }
  cs_dm_leave(t);
  cs_vmm_publish();
  return r;
}

int cuMemRelease(uint64_t handle) {
  VM_RESOLVE(release, "cuMemRelease")
  if ((handle & VM_TAG_MASK) != VM_TAG) return vr.release(handle);
  struct cs_tslot* t = cs_dm_enter();
  pthread_mutex_lock(&vm_lock);
  int i = vm_index(handle);
  CUresult r = i < 0 || vm_h[i].refs <= 0 ? CU_INVALID_VALUE : 0;
  if (!r) {
    vm_h[i].refs--;
    vm_maybe_drop(i);
  }
  pthread_mutex_unlock(&vm_lock);
  cs_dm_leave(t);
  cs_vmm_publish();
  return r;
}

int cuMemMap(CUdeviceptr va, size_t size, size_t off, uint64_t handle, unsigned long long flags) {
  VM_RESOLVE(map, "cuMemMap")
  if (!vm_on()) return vr.map(va, size, off, handle, flags);
  struct cs_tslot* t = cs_dm_enter();
  pthread_mutex_lock(&vm_lock);
  int i = vm_index(handle);
  CUresult r = (handle & VM_TAG_MASK) == VM_TAG && (i < 0 || vm_h[i].refs <= 0) ? CU_INVALID_VALUE : 0;
  if (!r && vm_nm == VM_MAPS) r = CU_OUT_OF_MEMORY;
  if (!r) r = vr.map(va, size, off, i < 0 ? handle : vm_h[i].real, flags);
  if (!r) {
    vm_m[vm_nm++] = (struct vm_map){.va = va, .size = size, .off = off, .h = i};
    if (i >= 0) vm_h[i].maps++;
  }
  pthread_mutex_unlock(&vm_lock);
  cs_dm_leave(t);
  cs_vmm_publish();
  return r;
}

int cuMemUnmap(CUdeviceptr va, size_t size) {
  VM_RESOLVE(unmap, "cuMemUnmap")
  if (!vm_on()) return vr.unmap(va, size);
  struct cs_tslot* t = cs_dm_enter();
  pthread_mutex_lock(&vm_lock);
  CUresult r = vr.unmap(va, size);
  for (int k = 0; !r && k < vm_nm;) {
    struct vm_map* m = &vm_m[k];
    if (m->va >= va && m->va + m->size <= va + size) {
      int i = m->h;
      *m = vm_m[--vm_nm];
      if (i >= 0) {
        vm_h[i].maps--;
        vm_maybe_drop(i);
      }
    } else {
      k++;
    }
  }
  pthread_mutex_unlock(&vm_lock);
  cs_dm_leave(t);
  cs_vmm_publish();
  return r;
}

int cuMemSetAccess(CUdeviceptr va, size_t size, const void* desc, size_t count) {
  VM_RESOLVE(set_access, "cuMemSetAccess")
  if (!vm_on()) return vr.set_access(va, size, desc, count);
  struct cs_tslot* t = cs_dm_enter();
  CUresult r = vr.set_access(va, size, desc, count);
  pthread_mutex_lock(&vm_lock);
  for (int k = 0; !r && k < vm_nm; k++) {
    struct vm_map* m = &vm_m[k];
    if (m->va < va || m->va + m->size > va + size) continue;
    for (size_t d = 0; d < count; d++) { /* one descriptor per location: a later one replaces an earlier */
      const unsigned char* nd = (const unsigned char*)desc + d * VM_DESC;
      int j = 0;
      while (j < m->nacc && memcmp(m->acc[j], nd, 8) != 0) j++;
      if (j < VM_ACC) {
        memcpy(m->acc[j], nd, VM_DESC);
        if (j == m->nacc) m->nacc++;
      }
    }
  }
  pthread_mutex_unlock(&vm_lock);
  cs_dm_leave(t);
  cs_vmm_publish(); /* a handle without access is left to the driver: it may be moved now */
  return r;
}

int cuMemRetainAllocationHandle(uint64_t* handle, void* addr) {
  VM_RESOLVE(retain, "cuMemRetainAllocationHandle")
  if (!vm_on() || !handle) return vr.retain(handle, addr);
  pthread_mutex_lock(&vm_lock);
  CUdeviceptr a = (CUdeviceptr)(uintptr_t)addr;
  int i = -1;
  for (int k = 0; k < vm_nm && i < 0; k++)
    if (vm_m[k].h >= 0 && a >= vm_m[k].va && a < vm_m[k].va + vm_m[k].size) i = vm_m[k].h;
  if (i >= 0) {
    vm_h[i].refs++;
    *handle = VM_TAG | (uint64_t)(i + 1);
  }
  pthread_mutex_unlock(&vm_lock);
  return i >= 0 ? 0 : vr.retain(handle, addr);
}

int cuMemGetAllocationPropertiesFromHandle(void* prop, uint64_t handle) {
  VM_RESOLVE(props, "cuMemGetAllocationPropertiesFromHandle")
  if ((handle & VM_TAG_MASK) != VM_TAG) return vr.props(prop, handle);
  pthread_mutex_lock(&vm_lock);
  int i = vm_index(handle);
  if (i >= 0 && prop) memcpy(prop, vm_h[i].prop, VM_PROP);
  pthread_mutex_unlock(&vm_lock);
  return i >= 0 && prop ? 0 : CU_INVALID_VALUE;
}

int cuMemExportToShareableHandle(void* out, uint64_t handle, int type, unsigned long long flags) {
  VM_RESOLVE(export_, "cuMemExportToShareableHandle")
  if ((handle & VM_TAG_MASK) != VM_TAG) return vr.export_(out, handle, type, flags);
  pthread_mutex_lock(&vm_lock);
  int i = vm_index(handle);
  CUresult r = i < 0 || !vm_h[i].real ? CU_INVALID_VALUE : vr.export_(out, vm_h[i].real, type, flags);
  if (!r) vm_h[i].exported = 1; /* another process may map it: left to the driver from now on */
  pthread_mutex_unlock(&vm_lock);
  cs_vmm_publish();
  return r;
}

/* The wrapper for a lookup of one of the calls above (base name, suffixes stripped), or NULL. The pointer the
 * lookup found becomes the real one if none is known yet. */
void* cs_vmm_wrap(const char* base, void* real) {
  static const struct {
    const char* name;
    void* ours;
    void** slot;
  } t[] = {
      {"cuMemCreate", (void*)cuMemCreate, (void**)&vr.create},
      {"cuMemRelease", (void*)cuMemRelease, (void**)&vr.release},
      {"cuMemMap", (void*)cuMemMap, (void**)&vr.map},
      {"cuMemUnmap", (void*)cuMemUnmap, (void**)&vr.unmap},
      {"cuMemSetAccess", (void*)cuMemSetAccess, (void**)&vr.set_access},
      {"cuMemRetainAllocationHandle", (void*)cuMemRetainAllocationHandle, (void**)&vr.retain},
      {"cuMemGetAllocationPropertiesFromHandle", (void*)cuMemGetAllocationPropertiesFromHandle, (void**)&vr.props},
      {"cuMemExportToShareableHandle", (void*)cuMemExportToShareableHandle, (void**)&vr.export_},
  };
  for (size_t k = 0; k < sizeof t / sizeof *t; k++) {
    if (strcmp(base, t[k].name) != 0) continue;
    if (real == t[k].ours) return real;
    if (!__atomic_load_n(t[k].slot, __ATOMIC_ACQUIRE)) __atomic_store_n(t[k].slot, real, __ATOMIC_RELEASE);
    return t[k].ours;
  }
  return NULL;
}

/* ---- OFFLOAD and RELOAD (the control thread, under devmem.c's lock, the gates closed) ---------------- */

/* The mapping a handle can be copied through: the whole handle, at offset 0. */
static struct vm_map* vm_whole(int i) {
  for (int k = 0; k < vm_nm; k++)
    if (vm_m[k].h == i && vm_m[k].off == 0 && vm_m[k].size == vm_h[i].size) return &vm_m[k];
  return NULL;
}

static uint32_t vm_why(int i) {
  struct vm_handle* v = &vm_h[i];
  if (v->exported) return CS_LEFT_EXPORTED;
  if (!v->maps) return CS_LEFT_UNMAPPED;
  struct vm_map* m = vm_whole(i);
  if (!m) return CS_LEFT_PARTIAL;
  return m->nacc ? 0 : CS_LEFT_NO_ACCESS; /* nothing may read it yet: not even the copy */
}

size_t cs_vmm_movable(void) {
  size_t n = 0;
  pthread_mutex_lock(&vm_lock);
  for (int i = 0; i < vm_nh; i++)
    if (vm_h[i].refs + vm_h[i].maps > 0 && !vm_why(i)) n += vm_h[i].size;
  pthread_mutex_unlock(&vm_lock);
  return n;
}

int cs_vmm_device(void) {
  int dev = 0;
  pthread_mutex_lock(&vm_lock);
  for (int i = 0; i < vm_nh; i++)
    if (vm_h[i].refs + vm_h[i].maps > 0) {
      dev = vm_h[i].device;
      break;
    }
  pthread_mutex_unlock(&vm_lock);
  return dev;
}

void cs_vmm_publish(void) {
  if (!cs_ctl) return;
  uint64_t moved = 0, left = 0;
  uint32_t nmoved = 0, nleft = 0, why = 0;
  pthread_mutex_lock(&vm_lock);
  for (int i = 0; i < vm_nh; i++) {
    if (vm_h[i].refs + vm_h[i].maps <= 0) continue;
    uint32_t w = vm_why(i);
    why |= w;
    if (w) left += vm_h[i].size, nleft++;
    else moved += vm_h[i].size, nmoved++;
  }
  for (int k = 0; k < vm_nm; k++)
    if (vm_m[k].h < 0) left += vm_m[k].size, nleft++, why |= CS_LEFT_FOREIGN;
  pthread_mutex_unlock(&vm_lock);
  __atomic_store_n(&cs_ctl->vmm_bytes, moved, __ATOMIC_RELAXED);
  __atomic_store_n(&cs_ctl->vmm_count, nmoved, __ATOMIC_RELAXED);
  __atomic_store_n(&cs_ctl->left_vmm_bytes, left, __ATOMIC_RELAXED);
  __atomic_store_n(&cs_ctl->left_vmm_count, nleft, __ATOMIC_RELAXED);
  uint32_t keep = __atomic_load_n(&cs_ctl->left_flags, __ATOMIC_RELAXED) &
                  ~(uint32_t)(CS_LEFT_EXPORTED | CS_LEFT_UNMAPPED | CS_LEFT_PARTIAL | CS_LEFT_FOREIGN |
                              CS_LEFT_NO_ACCESS);
  __atomic_store_n(&cs_ctl->left_flags, keep | why, __ATOMIC_RELAXED);
}

/* Every call OFFLOAD and RELOAD make, resolved (the application may never have looked some of them up). */
static int vm_resolve_all(void) {
#define R(field, name) \
  if (!vr.field) *(void**)&vr.field = vm_real(name); \
  if (!vr.field) return -1;
  R(create, "cuMemCreate") R(release, "cuMemRelease") R(map, "cuMemMap") R(unmap, "cuMemUnmap")
  R(set_access, "cuMemSetAccess")
#undef R
  return 0;
}

/* Copies every movable handle out through its whole mapping, at *off on in the staging file, each device's
 * queued work done first. */
int cs_vmm_copy_out(size_t* off) {
  pthread_mutex_lock(&vm_lock);
  int r = 0;
  uint64_t synced = 0; /* devices 0..63 synchronized */
  for (int i = 0; i < vm_nh && !r; i++) {
    struct vm_handle* v = &vm_h[i];
    v->moved = 0;
    if (v->refs + v->maps <= 0 || vm_why(i)) continue;
    if (vm_resolve_all() != 0 || v->device < 0 || v->device >= 64) {
      r = -1;
      break;
    }
    if (!(synced >> v->device & 1)) {
      if ((r = cs_dm_sync(v->device)) != 0) break;
      synced |= 1ull << v->device;
    }
    v->stage_off = *off;
    r = cs_dm_copy(vm_whole(i)->va, *off, v->size, 1);
    *off += v->size;
  }
  pthread_mutex_unlock(&vm_lock);
  return r;
}

/* Unmaps every mapping of a movable handle and releases the driver's handle (its addresses stay reserved:
 * they are the application's). 0, or the number of calls that failed. */
int cs_vmm_release(void) {
  int bad = 0;
  pthread_mutex_lock(&vm_lock);
  for (int i = 0; i < vm_nh; i++) {
    struct vm_handle* v = &vm_h[i];
    if (v->refs + v->maps <= 0 || vm_why(i)) continue;
    for (int k = 0; k < vm_nm; k++)
      if (vm_m[k].h == i) bad += vr.unmap(vm_m[k].va, vm_m[k].size) != 0;
    bad += vr.release(v->real) != 0;
    v->real = 0;
    v->moved = 1;
  }
  pthread_mutex_unlock(&vm_lock);
  return bad;
}

/* New physical memory for each released handle, mapped where it was with the access it had, its bytes copied
 * back. A failure leaves the rest to a retried RELOAD (v->real stays 0 for those). */
int cs_vmm_reload(char* err, size_t n) {
  int r = 0, i = 0;
  pthread_mutex_lock(&vm_lock);
  for (; i < vm_nh && !r; i++) {
    if (vm_h[i].moved && !vm_h[i].real && vm_resolve_all() != 0) {
      r = -1;
      break;
    }
    struct vm_handle* v = &vm_h[i];
    if (!v->moved || v->real) continue;
    uint64_t h = 0;
    if ((r = cs_dm_ctx(v->device) != 0 ? -1 : vr.create(&h, v->size, v->prop, 0)) != 0) break;
    int k = 0;
    for (; k < vm_nm && !r; k++) {
      struct vm_map* m = &vm_m[k];
      if (m->h != i) continue;
      if ((r = vr.map(m->va, m->size, m->off, h, 0)) == 0 && m->nacc)
        if ((r = vr.set_access(m->va, m->size, m->acc, (size_t)m->nacc)) != 0) vr.unmap(m->va, m->size);
    }
    if (!r) r = cs_dm_copy(vm_whole(i)->va, v->stage_off, v->size, 0);
    if (r) { /* whatever of it was mapped goes again (unmapping a range not mapped only fails) */
      for (int u = 0; u < vm_nm; u++)
        if (vm_m[u].h == i) vr.unmap(vm_m[u].va, vm_m[u].size);
      vr.release(h);
      break;
    }
    v->real = h;
    v->moved = 0;
  }
  pthread_mutex_unlock(&vm_lock);
  if (r) return snprintf(err, n, "RELOAD: mapped memory handle %d (%zu bytes) could not be brought back (CUDA "
                         "error %d); the staging file still holds it: retry RELOAD", i + 1, vm_h[i].size, r), -1;
  return 0;
}

/* ---- what is left to the driver: cudaMallocAsync and cudaMalloc under 1 MiB, counted by address ---- */
#define AC_SLOTS (1u << 16)
static struct {
  uintptr_t p; /* 0 free, 1 a tombstone */
  size_t n;
  int kind; /* 0 pool (cudaMallocAsync), 1 small cudaMalloc */
} ac[AC_SLOTS];
static uint64_t ac_bytes[2];
static uint32_t ac_count[2];
static pthread_mutex_t ac_lock = PTHREAD_MUTEX_INITIALIZER;

static void ac_publish_locked(void) {
  if (!cs_ctl) return;
  __atomic_store_n(&cs_ctl->async_bytes, ac_bytes[0], __ATOMIC_RELAXED);
  __atomic_store_n(&cs_ctl->async_count, ac_count[0], __ATOMIC_RELAXED);
  __atomic_store_n(&cs_ctl->small_bytes, ac_bytes[1], __ATOMIC_RELAXED);
  __atomic_store_n(&cs_ctl->small_count, ac_count[1], __ATOMIC_RELAXED);
  uint32_t f = __atomic_load_n(&cs_ctl->left_flags, __ATOMIC_RELAXED) & ~(uint32_t)(CS_LEFT_POOL | CS_LEFT_SMALL);
  __atomic_store_n(&cs_ctl->left_flags, f | (ac_count[0] ? CS_LEFT_POOL : 0) | (ac_count[1] ? CS_LEFT_SMALL : 0),
                   __ATOMIC_RELAXED);
}

void cs_left_add(void* p, size_t n, int kind) {
  if (!p) return;
  uintptr_t key = (uintptr_t)p;
  pthread_mutex_lock(&ac_lock);
  for (uint32_t k = 0, s = (uint32_t)(key >> 8) & (AC_SLOTS - 1); k < AC_SLOTS; k++, s = (s + 1) & (AC_SLOTS - 1)) {
    if (ac[s].p > 1) continue;
    ac[s].p = key, ac[s].n = n, ac[s].kind = kind;
    ac_bytes[kind] += n;
    ac_count[kind]++;
    break;
  }
  ac_publish_locked();
  pthread_mutex_unlock(&ac_lock);
}

void cs_left_remove(void* p) {
  if (!p) return;
  uintptr_t key = (uintptr_t)p;
  pthread_mutex_lock(&ac_lock);
  for (uint32_t k = 0, s = (uint32_t)(key >> 8) & (AC_SLOTS - 1); k < AC_SLOTS && ac[s].p; k++,
                s = (s + 1) & (AC_SLOTS - 1)) {
    if (ac[s].p != key) continue;
    ac_bytes[ac[s].kind] -= ac[s].n;
    ac_count[ac[s].kind]--;
    ac[s].p = 1;
    break;
  }
  ac_publish_locked();
  pthread_mutex_unlock(&ac_lock);
}

void cs_left_publish(void) {
  pthread_mutex_lock(&ac_lock);
  ac_publish_locked();
  pthread_mutex_unlock(&ac_lock);
  cs_vmm_publish();
}

#define AC_REAL(ret, name, params)                        \
  static ret(*real) params;                             \
  if (!real) *(void**)&real = dlsym(RTLD_NEXT, name);   \
  if (!real) return 3;

cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t s) {
  AC_REAL(cudaError_t, "cudaMallocAsync", (void**, size_t, cudaStream_t))
  struct cs_tslot* t = cs_dm_enter();
  cudaError_t r = real(p, n, s);
  if (r == 0 && p && vm_on()) cs_left_add(*p, n, 0);
  cs_dm_leave(t);
  return r;
}

cudaError_t cudaMallocFromPoolAsync(void** p, size_t n, void* pool, cudaStream_t s) {
  AC_REAL(cudaError_t, "cudaMallocFromPoolAsync", (void**, size_t, void*, cudaStream_t))
  struct cs_tslot* t = cs_dm_enter();
  cudaError_t r = real(p, n, pool, s);
  if (r == 0 && p && vm_on()) cs_left_add(*p, n, 0);
  cs_dm_leave(t);
  return r;
}

cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  AC_REAL(cudaError_t, "cudaFreeAsync", (void*, cudaStream_t))
  struct cs_tslot* t = cs_dm_enter();
  cudaError_t r = real(p, s);
  if (r == 0 && vm_on()) cs_left_remove(p);
  cs_dm_leave(t);
  return r;
}
