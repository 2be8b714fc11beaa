/* cudaMalloc under 1 MiB, served by the fast path (docs/interceptor.md, "The fast path"): a VMM allocation each
 * would take a whole 2 MiB granule, so small requests share 2 MiB chunks instead. A chunk is an allocation
 * devmem.c serves (cs_dm_serve, marked slab), so OFFLOAD and RELOAD move it with the rest; it holds slots of one
 * size class (512 B, 1 KiB, ... 1 MiB: a request is rounded up to a power of two), one device's, a bitmap of
 * which are taken. Chunks are kept once made (their slots are reused); a freed slot is reused only after the
 * device finished with it (dm_free synchronizes first, as cudaFree does). CRYOSLEEP_DEVMEM_SMALL=0 turns this
 * off: small requests then go to cudaMalloc and are left to the driver's checkpoint. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cs.h"

#define SL_MIN_SHIFT 9 /* 512 B: cudaMalloc's alignment (256 B) kept */
#define SL_CLASSES 12  /* 512 B .. 1 MiB */
#define SL_CHUNK ((size_t)2 << 20)
#define SL_SLOTS (SL_CHUNK >> SL_MIN_SHIFT)
#define SL_CHUNKS 1024 /* 2 GiB of small allocations; beyond, cudaMalloc */

struct sl_chunk {
  uint64_t va;
  int device, cls;
  uint32_t used, nslots;
  uint64_t bits[SL_SLOTS / 64];
};

static struct sl_chunk sl[SL_CHUNKS];
static int sl_n;
static uint32_t sl_live; /* slots taken, all chunks */
static pthread_mutex_t sl_lock = PTHREAD_MUTEX_INITIALIZER;

static int sl_on(void) {
  static int on = -1;
  if (on < 0) {
    const char* e = getenv("CRYOSLEEP_DEVMEM_SMALL");
    on = !(e && strcmp(e, "0") == 0);
  }
  return on;
}

static void sl_publish_locked(void) {
  if (cs_ctl) __atomic_store_n(&cs_ctl->slab_count, sl_live, __ATOMIC_RELAXED);
}

/* A free slot of chunk c taken: its address, or 0. sl_lock held. */
static uint64_t sl_take(struct sl_chunk* c) {
  if (c->used == c->nslots) return 0;
  for (uint32_t w = 0; w < (c->nslots + 63) / 64; w++) {
    uint64_t free_bits = ~c->bits[w];
    if (w == c->nslots / 64 && c->nslots % 64) free_bits &= (1ull << (c->nslots % 64)) - 1;
    if (!free_bits) continue;
    uint32_t b = (uint32_t)__builtin_ctzll(free_bits);
    c->bits[w] |= 1ull << b;
    c->used++;
    sl_live++;
    sl_publish_locked();
    return c->va + (((uint64_t)w * 64 + b) << (SL_MIN_SHIFT + c->cls));
  }
  return 0;
}

void* cs_slab_malloc(size_t n, int device) {
  if (!sl_on() || n == 0) return NULL;
  int cls = 0;
  while (cls < SL_CLASSES - 1 && ((size_t)1 << (SL_MIN_SHIFT + cls)) < n) cls++;
  if (((size_t)1 << (SL_MIN_SHIFT + cls)) < n) return NULL;
  pthread_mutex_lock(&sl_lock);
  for (int i = 0; i < sl_n; i++) {
    if (sl[i].cls != cls || sl[i].device != device) continue;
    uint64_t p = sl_take(&sl[i]);
    if (p) {
      pthread_mutex_unlock(&sl_lock);
      return (void*)(uintptr_t)p;
    }
  }
  pthread_mutex_unlock(&sl_lock);
  uint64_t va = 0;
  if (sl_n == SL_CHUNKS || cs_dm_serve(SL_CHUNK, &va, 1) != 0) return NULL; /* cudaMalloc, then */
  pthread_mutex_lock(&sl_lock);
  if (sl_n == SL_CHUNKS) { /* filled meanwhile: the chunk stays served, unused (rare) */
    pthread_mutex_unlock(&sl_lock);
    return NULL;
  }
  struct sl_chunk* c = &sl[sl_n++];
  memset(c, 0, sizeof *c);
  c->va = va, c->device = device, c->cls = cls;
  c->nslots = (uint32_t)(SL_CHUNK >> (SL_MIN_SHIFT + cls));
  uint64_t p = sl_take(c);
  pthread_mutex_unlock(&sl_lock);
  return (void*)(uintptr_t)p;
}

/* The chunk that holds p, or -1. sl_lock held. */
static int sl_find(uint64_t p) {
  for (int i = 0; i < sl_n; i++)
    if (p >= sl[i].va && p < sl[i].va + SL_CHUNK) return i;
  return -1;
}

int cs_slab_owns(void* p) {
  pthread_mutex_lock(&sl_lock);
  int i = sl_n ? sl_find((uint64_t)(uintptr_t)p) : -1;
  pthread_mutex_unlock(&sl_lock);
  return i >= 0;
}

/* 0, or -1 when p is not the start of a taken slot (the application's error: cudaFree says invalid value). */
int cs_slab_free(void* p) {
  uint64_t a = (uint64_t)(uintptr_t)p;
  pthread_mutex_lock(&sl_lock);
  int i = sl_find(a), r = -1;
  if (i >= 0) {
    struct sl_chunk* c = &sl[i];
    uint64_t off = a - c->va, slot = off >> (SL_MIN_SHIFT + c->cls);
    if (!(off & ((1ull << (SL_MIN_SHIFT + c->cls)) - 1)) && slot < c->nslots && (c->bits[slot / 64] >> (slot % 64) & 1)) {
      c->bits[slot / 64] &= ~(1ull << (slot % 64));
      c->used--;
      sl_live--;
      sl_publish_locked();
      r = 0;
    }
  }
  pthread_mutex_unlock(&sl_lock);
  return r;
}
