/* The hand-written wrappers: the functions that create, finalize or destroy communicators, answer
 * from the record, hold registrations, or manage groups. gen_wrappers.py lists each one with the
 * reason it needs care; everything else is generated. */
#define _GNU_SOURCE
#include "cs.h"

#include <stdlib.h>
#include <string.h>

/* ---- records ------------------------------------------------------------------------------------ */

static uint64_t fnv1a(const void* p, size_t n, uint64_t h) {
  const unsigned char* b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

static uint64_t mix64(uint64_t x) {  /* splitmix64's finalizer */
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* Copies the application's config (it may free it, and its strings, after the call). A config
 * from an older or newer nccl.h is copied by its own size, up to CS_CONFIG_MAX bytes. */
static void config_copy(struct cs_config* d, const ncclConfig_t* src) {
  memset(d, 0, sizeof *d);
  if (!src) return;
  size_t n = src->size;
  if (n == 0) n = sizeof(ncclConfig_t);
  if (n > CS_CONFIG_MAX) n = CS_CONFIG_MAX;
  d->present = 1;
  memcpy(d->bytes, src, n);
  ncclConfig_t* c = (ncclConfig_t*)d->bytes;
  c->size = n;
  if (n >= offsetof(ncclConfig_t, netName) + sizeof(char*) && c->netName) c->netName = d->net_name = strdup(c->netName);
  if (n >= offsetof(ncclConfig_t, commName) + sizeof(char*) && c->commName)
    c->commName = d->comm_name = strdup(c->commName);
}

static void config_free(struct cs_config* c) {
  free(c->net_name);
  free(c->comm_name);
  memset(c, 0, sizeof *c);
}

/* Takes a free table entry for a communicator being created (lock held). NULL when full. */
static struct cs_vcomm* vcomm_reserve(void) {
  for (int i = 0; i < CS_MAX_COMMS; i++) {
    struct cs_vcomm* v = &cs_vc[i];
    if (!v->live && !v->reserved) {
      v->reserved = 1;
      return v;
    }
  }
  return NULL;
}

static void vcomm_unreserve(struct cs_vcomm* v) {
  if (!v) return;
  cs_lock();
  v->reserved = 0;
  cs_unlock();
}

static int comm_device(ncclComm_t rc) {
  int d = -1;
  if (cs_real.ncclCommCuDevice && cs_real.ncclCommCuDevice(rc, &d) != ncclSuccess) d = -1;
  return d >= 0 ? d : cs_get_device();
}

/* Fills a reserved entry for a new real communicator and publishes its slot. */
static ncclComm_t vcomm_record(struct cs_vcomm* v, ncclComm_t rc, int rank, int nranks, uint64_t ident,
                               const ncclConfig_t* config, struct cs_vcomm* parent, int color, int key) {
  static uint32_t next_vid;
  int device = comm_device(rc);
  cs_lock();
  struct cs_ctl_comm* slot = v->slot;
  memset(v, 0, sizeof *v);
  v->slot = slot;
  v->real = rc;
  v->rank = rank;
  v->nranks = nranks;
  v->ident = ident;
  v->device = device;
  v->rebuild = parent ? CS_REBUILD_SPLIT : CS_REBUILD_ID;
  v->parent_vid = parent ? parent->vid : 0;
  v->color = color;
  v->key = key;
  config_copy(&v->config, config);
  if (config && config->blocking == 0) v->flags |= CS_CF_NONBLOCKING;
  v->vid = ++next_vid;
  __atomic_store_n(&v->live, 1, __ATOMIC_RELEASE);
  cs_slot_publish(v);
  cs_unlock();
  return (ncclComm_t)v;
}

/* A communicator that can no longer be a split parent (finalized or destroyed): its split
 * history goes, and its children become communicators rebuilt from their own fresh ids. */
static void orphan_children(struct cs_vcomm* v) {
  int j = 0;
  for (int i = 0; i < CS_MAX_SPLITS && cs_splits[i].used; i++) {
    if (cs_splits[i].parent == (int)(v - cs_vc) && cs_splits[i].parent_vid == v->vid) {
      config_free(&cs_splits[i].config);
      continue;
    }
    cs_splits[j++] = cs_splits[i];
  }
  for (int i = j; i < CS_MAX_SPLITS && cs_splits[i].used; i++) memset(&cs_splits[i], 0, sizeof cs_splits[i]);
  for (int i = 0; i < CS_MAX_COMMS; i++) {
    struct cs_vcomm* c = &cs_vc[i];
    if (c->live && c->parent_vid == v->vid && c->rebuild == CS_REBUILD_SPLIT) {
      c->rebuild = CS_REBUILD_ID;
      __atomic_store_n(&c->slot->rebuild, CS_REBUILD_ID, __ATOMIC_RELEASE);
    }
  }
}

/* The application destroyed a communicator (lock held). */
static void vcomm_free(struct cs_vcomm* v) {
  orphan_children(v);
  for (int i = 0; i < CS_MAX_SPLITS && cs_splits[i].used; i++)
    if (cs_splits[i].child == (int)(v - cs_vc) && cs_splits[i].child_vid == v->vid) cs_splits[i].child = -1;
  for (int i = 0; i < CS_MAX_REGS; i++)
    if (cs_regs[i].used && cs_regs[i].comm == (int)(v - cs_vc)) memset(&cs_regs[i], 0, sizeof cs_regs[i]);
  __atomic_store_n(&v->slot->state, CS_SLOT_FREE, __ATOMIC_RELEASE);
  __atomic_store_n(&v->live, 0, __ATOMIC_RELEASE);
  config_free(&v->config);
  v->real = NULL;
}

/* ---- creation ----------------------------------------------------------------------------------- */

enum create_kind { CREATE_RANK, CREATE_RANK_CONFIG, CREATE_SCALABLE };

struct create_args {
  enum create_kind kind;
  int nranks, rank, nid;
  ncclUniqueId* ids;
  ncclConfig_t* config;
};

static ncclResult_t create_real(const struct create_args* a, ncclComm_t* rc) {
  switch (a->kind) {
    case CREATE_RANK:
      return cs_real.ncclCommInitRank ? cs_real.ncclCommInitRank(rc, a->nranks, a->ids[0], a->rank)
                                      : cs_missing("ncclCommInitRank");
    case CREATE_RANK_CONFIG:
      return cs_real.ncclCommInitRankConfig
                 ? cs_real.ncclCommInitRankConfig(rc, a->nranks, a->ids[0], a->rank, a->config)
                 : cs_missing("ncclCommInitRankConfig");
    default:
      return cs_real.ncclCommInitRankScalable
                 ? cs_real.ncclCommInitRankScalable(rc, a->nranks, a->rank, a->nid, a->ids, a->config)
                 : cs_missing("ncclCommInitRankScalable");
  }
}

static ncclResult_t create(ncclComm_t* comm, const struct create_args* a) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t none;
  ncclResult_t r = cs_enter(t, CS_K_MGMT, NULL, 0, &none);
  if (r != ncclSuccess || !comm || !a->ids || a->nid < 1) {
    cs_leave(t);
    return r != ncclSuccess ? r : ncclInvalidArgument;
  }
  cs_lock();
  struct cs_vcomm* v = vcomm_reserve();
  cs_unlock();
  ncclComm_t rc = NULL;
  r = create_real(a, &rc);
  if ((r == ncclSuccess || r == ncclInProgress) && rc) {
    uint64_t ident = fnv1a(a->ids, sizeof(ncclUniqueId) * (size_t)a->nid, 0xcbf29ce484222325ull);
    ident = mix64(ident ^ (uint64_t)a->nranks);
    if (v) {
      rc = vcomm_record(v, rc, a->rank, a->nranks, ident, a->config, NULL, 0, 0);
    } else {
      cs_log("more than %d communicators: this one is not tracked (snapshots refused)", CS_MAX_COMMS);
      cs_set_flag(CS_F_TOO_MANY_COMMS | CS_F_UNTRACKED_COMM);
    }
  } else {
    vcomm_unreserve(v);
  }
  *comm = rc;
  cs_leave(t);
  return r;
}

/* creates a virtual handle; records rank, size and id for rebuild */
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  struct create_args a = {CREATE_RANK, nranks, rank, 1, &commId, NULL};
  return create(comm, &a);
}

/* creates a virtual handle; records rank, size, id and config for rebuild */
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config) {
  struct create_args a = {CREATE_RANK_CONFIG, nranks, rank, 1, &commId, config};
  return create(comm, &a);
}

/* creates a virtual handle; rebuilt from one fresh id */
ncclResult_t ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId, ncclUniqueId* commIds,
                                      ncclConfig_t* config) {
  struct create_args a = {CREATE_SCALABLE, nranks, myrank, nId, commIds, config};
  return create(newcomm, &a);
}

/* gated: it opens a listening socket, which must not appear while quiesced */
ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t none;
  ncclResult_t r = cs_enter(t, CS_K_MGMT, NULL, 0, &none);
  if (r == ncclSuccess) r = cs_real.ncclGetUniqueId ? cs_real.ncclGetUniqueId(uniqueId) : cs_missing("ncclGetUniqueId");
  cs_leave(t);
  return r;
}

/* several devices in one process: passed through untracked, flagged */
ncclResult_t ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t none;
  ncclResult_t r = cs_enter(t, CS_K_MGMT, NULL, 0, &none);
  if (r == ncclSuccess) r = cs_real.ncclCommInitAll ? cs_real.ncclCommInitAll(comm, ndev, devlist) : cs_missing("ncclCommInitAll");
  if (r == ncclSuccess) cs_set_flag(CS_F_INIT_ALL | CS_F_UNTRACKED_COMM);
  cs_leave(t);
  return r;
}

/* records parent, color, key, config for replay (NOCOLOR calls too: replay is collective).
 * Counted as a collective of the parent (every member calls it, in the same order): a member held at
 * a split that others already entered is then short of the parent's target and let through, instead
 * of leaving them blocked inside the real split until the snapshot's deadline. */
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t rp;
  ncclResult_t r = cs_enter(t, CS_K_COLL, comm, 0, &rp);
  if (r != ncclSuccess || !newcomm) {
    cs_leave(t);
    return r != ncclSuccess ? r : ncclInvalidArgument;
  }
  struct cs_vcomm* pv = cs_vcomm_of(comm);
  struct cs_vcomm* v = NULL;
  if (pv && color != NCCL_SPLIT_NOCOLOR) {
    cs_lock();
    v = vcomm_reserve();
    cs_unlock();
  }
  ncclComm_t rc = NULL;
  r = cs_real.ncclCommSplit ? cs_real.ncclCommSplit(rp, color, key, &rc, config) : cs_missing("ncclCommSplit");
  if (rc && r == ncclInProgress) r = cs_wait_async(rc, r);  /* the child's rank is needed now */
  if (r == ncclSuccess && pv) {
    int nth = pv->nsplits++, rank = -1, nranks = -1;
    uint64_t ident = mix64(pv->ident ^ ((uint64_t)(uint32_t)nth << 32) ^ (uint32_t)color);
    if (rc && v && cs_real.ncclCommUserRank(rc, &rank) == ncclSuccess && cs_real.ncclCommCount(rc, &nranks) == ncclSuccess) {
      rc = vcomm_record(v, rc, rank, nranks, ident, config, pv, color, key);
      v = NULL;
    } else if (rc) {
      cs_set_flag(CS_F_TOO_MANY_COMMS | CS_F_UNTRACKED_COMM);
    }
    cs_lock();
    int i = 0;
    while (i < CS_MAX_SPLITS && cs_splits[i].used) i++;
    if (i < CS_MAX_SPLITS) {
      struct cs_split* s = &cs_splits[i];
      struct cs_vcomm* child = cs_vcomm_of(rc);
      s->used = 1;
      s->parent = (int)(pv - cs_vc);
      s->parent_vid = pv->vid;
      s->child = child ? (int)(child - cs_vc) : -1;
      s->child_vid = child ? child->vid : 0;
      s->color = color;
      s->key = key;
      config_copy(&s->config, config);
    } else {
      cs_set_flag(CS_F_TOO_MANY_SPLITS);
    }
    cs_unlock();
  }
  vcomm_unreserve(v);
  *newcomm = rc;
  cs_leave(t);
  return r;
}

/* not replayed: passed through untracked, flagged */
ncclResult_t ncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount, ncclComm_t* newcomm,
                            ncclConfig_t* config, int shrinkFlags) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t rc;
  ncclResult_t r = cs_enter(t, CS_K_MGMT, comm, 0, &rc);
  if (r == ncclSuccess)
    r = cs_real.ncclCommShrink ? cs_real.ncclCommShrink(rc, excludeRanksList, excludeRanksCount, newcomm, config, shrinkFlags)
                               : cs_missing("ncclCommShrink");
  if (r == ncclSuccess || r == ncclInProgress) cs_set_flag(CS_F_SHRINK | CS_F_UNTRACKED_COMM);
  cs_leave(t);
  return r;
}

/* ---- the end of communicators ------------------------------------------------------------------- */

/* a finalized communicator is destroyed at quiesce and not rebuilt */
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t rc;
  ncclResult_t r = cs_enter(t, CS_K_MGMT, comm, 0, &rc);
  if (r == ncclSuccess) r = cs_real.ncclCommFinalize ? cs_real.ncclCommFinalize(rc) : cs_missing("ncclCommFinalize");
  struct cs_vcomm* v = cs_vcomm_of(comm);
  if (v && (r == ncclSuccess || r == ncclInProgress)) {
    cs_lock();
    v->finalized = 1;
    orphan_children(v);
    __atomic_store_n(&v->slot->state, CS_SLOT_FINALIZED, __ATOMIC_RELEASE);
    cs_unlock();
  }
  cs_leave(t);
  return r;
}

static ncclResult_t release(ncclComm_t comm, int abort) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t rc;
  ncclResult_t r = cs_enter(t, CS_K_RELEASE, comm, 0, &rc);
  struct cs_vcomm* v = cs_vcomm_of(comm);
  if (r == ncclSuccess && rc) {  /* no real one: quiesce already destroyed this finalized communicator */
    __typeof__(cs_real.ncclCommDestroy) fn = abort ? cs_real.ncclCommAbort : cs_real.ncclCommDestroy;
    r = fn ? fn(rc) : cs_missing(abort ? "ncclCommAbort" : "ncclCommDestroy");
  }
  if (v && (r == ncclSuccess || (abort && v->live))) {
    cs_lock();
    vcomm_free(v);
    cs_unlock();
  }
  cs_leave(t);
  return r;
}

/* frees the virtual handle and its split history */
ncclResult_t ncclCommDestroy(ncclComm_t comm) { return release(comm, 0); }

/* frees the virtual handle and its split history */
ncclResult_t ncclCommAbort(ncclComm_t comm) { return release(comm, 1); }

/* ---- answered from the record ------------------------------------------------------------------- */

static ncclResult_t query(ncclComm_t comm, int* out, int which) {
  struct cs_vcomm* v = cs_vcomm_of(comm);
  if (v) {
    if (!out) return ncclInvalidArgument;
    *out = which == 0 ? v->nranks : which == 1 ? v->rank : v->device;
    return ncclSuccess;
  }
  struct cs_tslot* t = cs_thread();
  cs_enter_ungated(t);
  __typeof__(cs_real.ncclCommCount) fn = which == 0 ? cs_real.ncclCommCount : which == 1 ? cs_real.ncclCommUserRank
                                                                                          : cs_real.ncclCommCuDevice;
  ncclResult_t r = fn ? fn(comm, out) : cs_missing("ncclCommCount/UserRank/CuDevice");
  cs_leave(t);
  return r;
}

/* answered from the record: valid while quiesced */
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) { return query(comm, count, 0); }

/* answered from the record: valid while quiesced */
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) { return query(comm, rank, 1); }

/* answered from the record: valid while quiesced */
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) { return query(comm, device, 2); }

/* The real communicator if it may be used right now by a thread that is never held, else NULL.
 * Called between cs_enter_ungated and cs_leave (see gate.c for why the phase check is safe). */
static ncclComm_t live_real(struct cs_vcomm* v) {
  if (__atomic_load_n(&cs_phase, __ATOMIC_ACQUIRE) != CS_PH_LIVE) return NULL;
  return __atomic_load_n(&v->real, __ATOMIC_ACQUIRE);
}

/* never held (PyTorch's watchdog polls it); answered locally while quiesced */
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  struct cs_tslot* t = cs_thread();
  cs_enter_ungated(t);
  struct cs_vcomm* v = cs_vcomm_of(comm);
  ncclComm_t rc = v ? live_real(v) : comm;
  ncclResult_t r;
  if (v && !rc) {
    r = asyncError ? ncclSuccess : ncclInvalidArgument;
    if (asyncError) *asyncError = ncclSuccess;
  } else {
    r = cs_real.ncclCommGetAsyncError ? cs_real.ncclCommGetAsyncError(rc, asyncError) : cs_missing("ncclCommGetAsyncError");
  }
  cs_leave(t);
  return r;
}

/* never held; its communicator may be quiesced */
const char* ncclGetLastError(ncclComm_t comm) {
  struct cs_tslot* t = cs_thread();
  cs_enter_ungated(t);
  struct cs_vcomm* v = cs_vcomm_of(comm);
  ncclComm_t rc = v ? live_real(v) : comm;
  const char* s = cs_real.ncclGetLastError ? cs_real.ncclGetLastError(rc) : "";
  cs_leave(t);
  return s;
}

/* ---- registrations and operators ---------------------------------------------------------------- */

static struct cs_reg* reg_of(void* handle) {
  uintptr_t off = (uintptr_t)handle - (uintptr_t)cs_regs;
  if (off < sizeof cs_regs && off % sizeof(struct cs_reg) == 0) return (struct cs_reg*)handle;
  return NULL;
}

/* virtual registration handles, re-registered at rebuild */
ncclResult_t ncclCommRegister(const ncclComm_t comm, void* buff, size_t size, void** handle) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t rc;
  ncclResult_t r = cs_enter(t, CS_K_MGMT, comm, 0, &rc);
  void* h = NULL;
  if (r == ncclSuccess) r = cs_real.ncclCommRegister ? cs_real.ncclCommRegister(rc, buff, size, &h) : cs_missing("ncclCommRegister");
  struct cs_vcomm* v = cs_vcomm_of(comm);
  if (r == ncclSuccess && handle) {
    *handle = h;
    if (v) {
      cs_lock();
      for (int i = 0; i < CS_MAX_REGS; i++) {
        struct cs_reg* g = &cs_regs[i];
        if (g->used) continue;
        *g = (struct cs_reg){1, (int)(v - cs_vc), v->vid, buff, size, h};
        *handle = g;
        v->flags |= CS_CF_REGISTERED;
        __atomic_or_fetch(&v->slot->flags, CS_CF_REGISTERED, __ATOMIC_RELAXED);
        break;
      }
      if (*handle == h) cs_set_flag(CS_F_TOO_MANY_REGS);
      cs_unlock();
    }
  }
  cs_leave(t);
  return r;
}

/* translates the virtual registration handle */
ncclResult_t ncclCommDeregister(const ncclComm_t comm, void* handle) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t rc;
  ncclResult_t r = cs_enter(t, CS_K_MGMT, comm, 0, &rc);
  struct cs_reg* g = reg_of(handle);
  if (r == ncclSuccess)
    r = cs_real.ncclCommDeregister ? cs_real.ncclCommDeregister(rc, g ? g->real : handle) : cs_missing("ncclCommDeregister");
  if (r == ncclSuccess && g) {
    cs_lock();
    memset(g, 0, sizeof *g);
    cs_unlock();
  }
  cs_leave(t);
  return r;
}

/* flagged: symmetric windows are not re-registered after rebuild */
ncclResult_t ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t rc;
  ncclResult_t r = cs_enter(t, CS_K_MGMT, comm, 0, &rc);
  if (r == ncclSuccess)
    r = cs_real.ncclCommWindowRegister ? cs_real.ncclCommWindowRegister(rc, buff, size, win, winFlags)
                                       : cs_missing("ncclCommWindowRegister");
  if (r == ncclSuccess) cs_set_flag(CS_F_WINDOW);
  cs_leave(t);
  return r;
}

/* counted: an operator alive at a snapshot is not replayed */
ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
                                      ncclScalarResidence_t residence, ncclComm_t comm) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t rc;
  ncclResult_t r = cs_enter(t, CS_K_MGMT, comm, 0, &rc);
  if (r == ncclSuccess)
    r = cs_real.ncclRedOpCreatePreMulSum ? cs_real.ncclRedOpCreatePreMulSum(op, scalar, datatype, residence, rc)
                                         : cs_missing("ncclRedOpCreatePreMulSum");
  if (r == ncclSuccess) __atomic_add_fetch(&cs_ctl->premul_live, 1, __ATOMIC_RELAXED);
  cs_leave(t);
  return r;
}

/* counted: an operator alive at a snapshot is not replayed */
ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t rc;
  ncclResult_t r = cs_enter(t, CS_K_MGMT, comm, 0, &rc);
  if (r == ncclSuccess) r = cs_real.ncclRedOpDestroy ? cs_real.ncclRedOpDestroy(op, rc) : cs_missing("ncclRedOpDestroy");
  if (r == ncclSuccess && __atomic_load_n(&cs_ctl->premul_live, __ATOMIC_RELAXED) > 0)
    __atomic_sub_fetch(&cs_ctl->premul_live, 1, __ATOMIC_RELAXED);
  cs_leave(t);
  return r;
}

/* ---- groups ------------------------------------------------------------------------------------- */

/* group depth; the gate is checked at the outermost start only */
ncclResult_t ncclGroupStart(void) {
  struct cs_tslot* t = cs_thread();
  ncclComm_t none;
  ncclResult_t r = cs_enter(t, CS_K_MGMT, NULL, 0, &none);  /* cs_gate admits at once when depth > 0 */
  if (r == ncclSuccess) r = cs_real.ncclGroupStart ? cs_real.ncclGroupStart() : cs_missing("ncclGroupStart");
  if (r == ncclSuccess) __atomic_store_n(&t->depth, t->depth + 1, __ATOMIC_RELAXED);
  cs_leave(t);  /* release: the depth is visible before busy drops */
  return r;
}

static ncclResult_t group_end(ncclSimInfo_t* sim) {
  struct cs_tslot* t = cs_thread();
  cs_enter_ungated(t);
  ncclResult_t r;
  if (sim) r = cs_real.ncclGroupSimulateEnd ? cs_real.ncclGroupSimulateEnd(sim) : cs_missing("ncclGroupSimulateEnd");
  else r = cs_real.ncclGroupEnd ? cs_real.ncclGroupEnd() : cs_missing("ncclGroupEnd");
  if (t->depth > 0) __atomic_store_n(&t->depth, t->depth - 1, __ATOMIC_RELAXED);
  cs_leave(t);
  return r;
}

/* group depth; never held (the group is already open) */
ncclResult_t ncclGroupEnd(void) { return group_end(NULL); }

/* ends a group like ncclGroupEnd */
ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t* simInfo) {
  if (!simInfo) return ncclInvalidArgument;
  return group_end(simInfo);
}
