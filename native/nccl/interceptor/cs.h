/* The NCCL interceptor's internals: virtual communicators, per-thread slots, the gate.
 *
 * The application's ncclComm_t is the address of a cs_vcomm in this library's own table, so it
 * stays valid while the real communicator behind it is destroyed (quiesce) and re-created
 * (rebuild). Every wrapper runs cs_enter() ... cs_leave(); with no snapshot requested that is a
 * thread-local store, one load of the command word, the counter update and a final store: no
 * lock, no system call, no allocation. */
#ifndef CRYOSLEEP_CS_H
#define CRYOSLEEP_CS_H

#include <nccl.h>
#include <stdint.h>
#include <time.h>

#include "cs_generated.h"
#include "ctl_block.h"

#define CS_MAX_SPLITS 256   /* split calls remembered for replay */
#define CS_MAX_REGS 1024    /* ncclCommRegister handles */
#define CS_CONFIG_MAX 256   /* bytes of an ncclConfig_t kept for replay */
#define CS_TSLOTS 256       /* static thread slots; more are allocated when needed */

/* Phases of this process's communicators (process-local, written by the control thread). */
enum cs_phase { CS_PH_LIVE = 1, CS_PH_QUIESCING = 2, CS_PH_QUIESCED = 3, CS_PH_REBUILDING = 4 };

/* What a call is, for the gate: counted collective, counted send or receive, or other. */
enum cs_kind {
  CS_K_COLL,     /* collective on a communicator: admitted in HOLD while seq < coll_target */
  CS_K_SEND,     /* admitted while send[peer] < send_target[peer] */
  CS_K_RECV,
  CS_K_MGMT,     /* anything else gated: admitted in HOLD while some counter is below its target */
  CS_K_RELEASE   /* ncclCommDestroy/Abort: like MGMT, but fine on a communicator quiesce destroyed */
};

struct cs_tslot {            /* one per thread that has called NCCL (or a gated CUDA runtime call, devmem.c) */
  int busy;                  /* 1 from cs_enter to cs_leave (0 while held at the gate) */
  int rt;                    /* 1 inside a CUDA runtime call devmem.c gates (0 while held there) */
  int depth;                 /* ncclGroupStart nesting */
  int owner;                 /* thread id, 0 when free */
  struct cs_tslot* next;     /* the list of allocated slots beyond the static ones */
} __attribute__((aligned(64)));

struct cs_config {           /* a copy of the application's ncclConfig_t, strings included */
  int present;
  unsigned char bytes[CS_CONFIG_MAX];
  char* net_name;
  char* comm_name;
};

struct cs_vcomm {
  ncclComm_t real;           /* NULL while quiesced (atomic access) */
  struct cs_ctl_comm* slot;  /* this communicator's slot in the control block */
  int live;                  /* table entry in use */
  int reserved;              /* taken by a creation still in progress */
  int finalized;             /* the application called ncclCommFinalize */
  uint32_t vid;
  uint64_t ident;
  int rank, nranks, device;
  uint32_t parent_vid;
  int color, key;
  int rebuild;               /* cs_rebuild */
  uint32_t flags;
  int nsplits;               /* ncclCommSplit calls on this communicator (derives children's ident) */
  struct cs_config config;
  uint64_t seq;              /* the counters, also mirrored into the slot */
  uint64_t sent[CS_MAX_PEERS], recvd[CS_MAX_PEERS];
};

struct cs_split {            /* one ncclCommSplit call, replayed at rebuild in creation order */
  int used;
  int parent;                /* index in cs_vc */
  uint32_t parent_vid;
  int child;                 /* index in cs_vc, -1 for NOCOLOR or a child destroyed since */
  uint32_t child_vid;
  int color, key;
  struct cs_config config;
};

struct cs_reg {              /* an ncclCommRegister handle: the application holds its address */
  int used;
  int comm;
  uint32_t vid;
  void* buff;
  size_t size;
  void* real;
};

extern struct cs_real_table cs_real;
extern struct cs_ctl* cs_ctl;
extern uint64_t* cs_cmdp;               /* &cs_ctl->cmd, or a word that reads "not initialized" */
extern uint64_t cs_uninit_word;
extern int cs_phase;
extern uint64_t cs_released_cmd;
extern uint64_t cs_state_word;        /* a HOLD command whose deadline passed: admit everything */
extern struct cs_vcomm cs_vc[CS_MAX_COMMS];
extern struct cs_split cs_splits[CS_MAX_SPLITS];
extern struct cs_reg cs_regs[CS_MAX_REGS];
extern __thread struct cs_tslot* cs_tl __attribute__((tls_model("initial-exec")));

/* core.c */
void cs_init(void);
struct cs_tslot* cs_thread_claim(void);
void cs_scan_threads(int* busy, int* in_group);
int cs_scan_rt(void);
void cs_held_tid(int tid, int held);
int cs_is_held_tid(int tid);
void cs_log(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
ncclResult_t cs_missing(const char* name);
void cs_set_flag(uint32_t flag);
void cs_clear_flag(uint32_t flag);
void cs_slot_publish(struct cs_vcomm* v);
void cs_publish_all(uint64_t last_cmd);
double cs_timeout_s(void);
ncclResult_t cs_wait_async(ncclComm_t rc, ncclResult_t r);
void cs_lock(void);
void cs_unlock(void);

/* gate.c */
ncclResult_t cs_gate(struct cs_tslot* t, enum cs_kind kind, struct cs_vcomm* v, int peer);
int cs_at_cut(int exact);
void cs_peer_capped(struct cs_vcomm* v);

/* devmem.c: the fast path's device memory (the control thread runs these); drvgate.c: the driver gate */
struct cs_tslot* cs_dm_enter(void);
void cs_dm_leave(struct cs_tslot* t);
void* cs_real_dlsym(void* handle, const char* name);
int cs_drv_complete(void);
int cs_dm_prepare(char* err, size_t n);
int cs_dm_offload(char* err, size_t n);
int cs_dm_reload(char* err, size_t n);
int cs_dm_offloaded(void);
void cs_dm_publish(void);
int cs_dm_ctx(int device);
int cs_dm_sync(int device);
int cs_dm_copy(uint64_t va, size_t off, size_t len, int out);
void cs_dm_touch(void);
int cs_dm_serve(size_t size, uint64_t* va, int slab);

/* slab.c: cudaMalloc under 1 MiB served from chunks that cs_dm_serve made (moved with the rest) */
void* cs_slab_malloc(size_t n, int device);
int cs_slab_owns(void* p);
int cs_slab_free(void* p);
void cs_dm_early(void);

/* vmm.c: memory the application maps itself (cuMemCreate/cuMemMap), and what is left to the driver */
void* cs_vmm_wrap(const char* base, void* real);
size_t cs_vmm_movable(void);
int cs_vmm_device(void);
void cs_vmm_publish(void);
int cs_vmm_copy_out(size_t* off);
int cs_vmm_release(void);
int cs_vmm_reload(char* err, size_t n);
void cs_left_add(void* p, size_t n, int kind); /* kind 0: cudaMallocAsync, 1: cudaMalloc under 1 MiB */
void cs_left_remove(void* p);
void cs_left_publish(void);

/* threads.c: which threads ran (OFFLOAD copies only while the others are idle) */
#define CS_THREADS 1024
struct cs_thr {
  int tid;
  int runnable;
  unsigned long long ns;
};
int cs_thr_sample(struct cs_thr* out, int self);
int cs_thr_ran(const struct cs_thr* before, int nb, const struct cs_thr* after, int na, long long* ran_ns);
void cs_thr_desc(int tid, long long ran_ns, const char* when, char* out, size_t n);
int cs_thr_wait_quiet(struct cs_thr* a, int* na, struct cs_thr* b, int self, char* err, size_t n);

/* control.c */
void cs_fence_all(void);
void cs_control_start(void);
void cs_set_device(int device);
int cs_get_device(void);


static inline struct cs_tslot* cs_thread(void) {
  struct cs_tslot* t = cs_tl;
  if (__builtin_expect(t == NULL, 0)) t = cs_thread_claim();
  return t;
}

static inline struct cs_vcomm* cs_vcomm_of(ncclComm_t c) {
  uintptr_t off = (uintptr_t)c - (uintptr_t)cs_vc;
  if (off < sizeof cs_vc && off % sizeof(struct cs_vcomm) == 0) return (struct cs_vcomm*)c;
  return NULL;  /* NULL, or a real handle the table could not hold: passed through as is */
}

static inline void cs_count(struct cs_vcomm* v, enum cs_kind kind, int peer) {
  if (kind == CS_K_COLL) {
    __atomic_store_n(&v->slot->seq, ++v->seq, __ATOMIC_RELAXED);
  } else if (kind == CS_K_SEND || kind == CS_K_RECV) {
    if ((unsigned)peer >= CS_MAX_PEERS) {
      cs_peer_capped(v);
    } else if (kind == CS_K_SEND) {
      __atomic_store_n(&v->slot->send[peer], ++v->sent[peer], __ATOMIC_RELAXED);
    } else {
      __atomic_store_n(&v->slot->recv[peer], ++v->recvd[peer], __ATOMIC_RELAXED);
    }
  }
}

/* Marks the thread inside NCCL, passes the gate, counts the call and translates the handle.
 * The busy store is ordered before the command load by the control thread's membarrier (an
 * asymmetric fence), so this side needs only a compiler barrier. */
static inline ncclResult_t cs_enter(struct cs_tslot* t, enum cs_kind kind, ncclComm_t comm, int peer,
                                    ncclComm_t* real) {
  __atomic_store_n(&t->busy, 1, __ATOMIC_RELAXED);
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  struct cs_vcomm* v = cs_vcomm_of(comm);
  uint64_t w = __atomic_load_n(__atomic_load_n(&cs_cmdp, __ATOMIC_ACQUIRE), __ATOMIC_ACQUIRE);  /* plain loads on x86 */
  ncclComm_t rc = v ? __atomic_load_n(&v->real, __ATOMIC_RELAXED) : comm;
  if (__builtin_expect((uint32_t)w != CS_CMD_RUN || (v && !rc), 0)) {
    ncclResult_t r = cs_gate(t, kind, v, peer);
    if (r != ncclSuccess) return r;
    rc = v ? __atomic_load_n(&v->real, __ATOMIC_ACQUIRE) : comm;
  }
  if (v) cs_count(v, kind, peer);
  *real = rc;
  return ncclSuccess;
}

/* For calls that are never held: marks the thread inside NCCL and makes sure init has run. */
static inline void cs_enter_ungated(struct cs_tslot* t) {
  __atomic_store_n(&t->busy, 1, __ATOMIC_RELAXED);
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
  if (__builtin_expect(__atomic_load_n(&cs_cmdp, __ATOMIC_ACQUIRE) == &cs_uninit_word, 0)) cs_init();
}

static inline void cs_leave(struct cs_tslot* t) { __atomic_store_n(&t->busy, 0, __ATOMIC_RELEASE); }

/* One poll of a thread held at a gate: not marked inside (``*inside`` = 0) while it naps, the nap
 * doubling from the caller's start up to 1 ms; marked inside again before it looks at the gate. */
static inline void cs_nap_held(int* inside, long* nap_ns) {
  __atomic_store_n(inside, 0, __ATOMIC_RELEASE);
  struct timespec ts = {0, *nap_ns};
  nanosleep(&ts, NULL);
  if (*nap_ns < 1000 * 1000) *nap_ns *= 2;
  __atomic_store_n(inside, 1, __ATOMIC_RELAXED);
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

#endif
