/* The interceptor's core: lazy init (real NCCL, control block, control thread), thread slots,
 * publishing into the control block, logging. */
#define _GNU_SOURCE
#include "cs.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct cs_real_table cs_real;
struct cs_ctl* cs_ctl;
uint64_t cs_uninit_word;  /* command 0: never RUN, so the first call takes the slow path and inits */
uint64_t* cs_cmdp = &cs_uninit_word;
int cs_phase = CS_PH_LIVE;
uint64_t cs_released_cmd;
uint64_t cs_state_word;  /* process copy of cs_ctl->state, for re-publishing */
struct cs_vcomm cs_vc[CS_MAX_COMMS];
struct cs_split cs_splits[CS_MAX_SPLITS];
struct cs_reg cs_regs[CS_MAX_REGS];
__thread struct cs_tslot* cs_tl __attribute__((tls_model("initial-exec")));

static pthread_mutex_t cs_mu = PTHREAD_MUTEX_INITIALIZER;  /* the tables; never on the hot path */
static pthread_once_t cs_once = PTHREAD_ONCE_INIT;
static int cs_shared;                                       /* cs_ctl is the agent's file */
static uint32_t cs_flags;
static uint32_t cs_nccl_version;
static char cs_private_block[CS_BLOCK_SIZE] __attribute__((aligned(4096)));  /* no agent: same layout */
static struct cs_tslot cs_tslots[CS_TSLOTS];
static struct cs_tslot* cs_tslot_list;
static struct cs_tslot cs_tslot_overflow;                  /* shared, only if allocation fails */
static pthread_key_t cs_tkey;
static pthread_once_t cs_tkey_once = PTHREAD_ONCE_INIT;

void cs_lock(void) { pthread_mutex_lock(&cs_mu); }
void cs_unlock(void) { pthread_mutex_unlock(&cs_mu); }

void cs_log(const char* fmt, ...) {
  char buf[512];
  int n = snprintf(buf, sizeof buf, "cryosleep-nccl[%d]: ", (int)getpid());
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf + n, sizeof buf - (size_t)n - 1, fmt, ap);
  va_end(ap);
  strcat(buf, "\n");
  if (write(2, buf, strlen(buf)) < 0) { /* nothing else to do with a log line */ }
}

ncclResult_t cs_missing(const char* name) {
  cs_log("%s: not found in the real NCCL library", name);
  return ncclInternalError;
}

double cs_timeout_s(void) {
  const char* env = getenv("CRYOSLEEP_NCCL_TIMEOUT_S");
  double t = env ? atof(env) : 0.0;
  return t > 0 ? t : 300.0;
}

/* Waits while a non-blocking communicator reports ncclInProgress. */
ncclResult_t cs_wait_async(ncclComm_t rc, ncclResult_t r) {
  struct timespec t0, t1, nap = {0, 200 * 1000};
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (r == ncclInProgress && cs_real.ncclCommGetAsyncError) {
    if (cs_real.ncclCommGetAsyncError(rc, &r) != ncclSuccess) return ncclInternalError;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (r == ncclInProgress && (double)(t1.tv_sec - t0.tv_sec) > cs_timeout_s()) return ncclInProgress;
    if (r == ncclInProgress) nanosleep(&nap, NULL);
  }
  return r;
}

void cs_set_flag(uint32_t flag) {
  __atomic_or_fetch(&cs_flags, flag, __ATOMIC_RELAXED);
  if (cs_ctl) __atomic_or_fetch(&cs_ctl->flags, flag, __ATOMIC_RELAXED);
}

void cs_clear_flag(uint32_t flag) {
  __atomic_and_fetch(&cs_flags, ~flag, __ATOMIC_RELAXED);
  if (cs_ctl) __atomic_and_fetch(&cs_ctl->flags, ~flag, __ATOMIC_RELAXED);
}

/* ---- real NCCL ----------------------------------------------------------------------------------
 * RTLD_NEXT finds NCCL when it is in the global scope (linked by libtorch_cuda, or dlopen'ed
 * RTLD_GLOBAL). Otherwise the already loaded libnccl.so.2 is opened by name (or
 * CRYOSLEEP_NCCL_REAL), which finds it whatever scope it was loaded into. */
static void cs_resolve(void) {
  void* h = RTLD_NEXT;
  if (!dlsym(RTLD_NEXT, "ncclGetVersion")) {
    const char* path = getenv("CRYOSLEEP_NCCL_REAL");
    if (!path || !*path) path = "libnccl.so.2";
    h = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) h = dlopen(path, RTLD_LAZY | RTLD_LOCAL);
    if (!h) {
      cs_log("cannot find the real NCCL (%s): every call will fail", dlerror());
      cs_flags |= CS_F_NO_REAL_NCCL;
      return;
    }
  }
#define X(name) cs_real.name = (__typeof__(cs_real.name))dlsym(h, #name);
  CS_REAL_NAMES(X)
#undef X
}

/* ---- the control block -------------------------------------------------------------------------- */

/* Another live process of this PID namespace published the block already: a second process of the same
 * rank that calls NCCL with the same environment (a subprocess, say) must not take over its block. */
static int cs_block_owned_by_other(const void* p) {
  const struct cs_ctl* c = p;
  pid_t owner = (pid_t)__atomic_load_n(&c->pid, __ATOMIC_ACQUIRE);
  if (__atomic_load_n(&c->magic, __ATOMIC_ACQUIRE) != CS_CTL_MAGIC || owner <= 0 || owner == getpid()) return 0;
  return kill(owner, 0) == 0 || errno == EPERM;
}

static void cs_block_open(void) {
  const char* path = getenv("CRYOSLEEP_NCCL_CTL");
  if (path && *path) {
    void* p = MAP_FAILED;
    struct stat st;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0 && fstat(fd, &st) == 0 && (st.st_size >= CS_BLOCK_SIZE || ftruncate(fd, CS_BLOCK_SIZE) == 0))
      p = mmap(NULL, CS_BLOCK_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED)
      cs_log("control block %s unusable (%s): counting only, no snapshot support", path, strerror(errno));
    if (fd >= 0) close(fd);  /* the mapping is all we keep: no descriptor for CRIU to worry about */
    if (p != MAP_FAILED && cs_block_owned_by_other(p)) {
      cs_log("control block %s belongs to live process %u: this process counts only (no snapshot support)",
             path, ((struct cs_ctl*)p)->pid);
      munmap(p, CS_BLOCK_SIZE);
      p = MAP_FAILED;
    }
    if (p != MAP_FAILED) {
      cs_ctl = p;
      cs_shared = 1;
      return;
    }
  }
  cs_ctl = (struct cs_ctl*)cs_private_block;  /* no agent: counting only, same code paths */
}

/* Writes a communicator's record (everything the interceptor owns) into its slot; the slot's
 * state goes last, so the agent never sees a half-written record as live. */
void cs_slot_publish(struct cs_vcomm* v) {
  struct cs_ctl_comm* s = v->slot;
  __atomic_store_n(&s->state, CS_SLOT_FREE, __ATOMIC_RELEASE);
  memset((char*)s + 4, 0, CS_SLOT_SIZE - 4);
  s->vid = v->vid;
  s->ident = v->ident;
  s->rank = v->rank;
  s->nranks = v->nranks;
  s->parent_vid = v->parent_vid;
  s->color = v->color;
  s->key = v->key;
  s->rebuild = (uint32_t)v->rebuild;
  s->flags = v->flags;
  s->device = v->device;
  s->seq = v->seq;
  memcpy(s->send, v->sent, sizeof s->send);
  memcpy(s->recv, v->recvd, sizeof s->recv);
  __atomic_store_n(&s->state, v->finalized ? CS_SLOT_FINALIZED : CS_SLOT_LIVE, __ATOMIC_RELEASE);
  uint32_t used = (uint32_t)(v - cs_vc) + 1;
  if (cs_ctl->slots_used < used) __atomic_store_n(&cs_ctl->slots_used, used, __ATOMIC_RELEASE);
}

/* (Re)writes the whole block from process memory: at init, and when the control thread finds
 * the block blank (a restore that recreated the file instead of bringing it back). A command
 * word already there is kept; a blank one becomes `last_cmd`, the last command handled, so that
 * nothing is handled twice. */
void cs_publish_all(uint64_t last_cmd) {
  struct cs_ctl* c = cs_ctl;
  int first = cs_cmdp == &cs_uninit_word;
  uint64_t cmd = first ? last_cmd : __atomic_load_n(&c->cmd, __ATOMIC_ACQUIRE);
  if (!cmd) cmd = last_cmd;
  __atomic_store_n(&c->magic, 0, __ATOMIC_RELEASE);
  memset((char*)c + 8, 0, sizeof *c - 8);
  c->version = CS_CTL_VERSION;
  c->block_size = CS_BLOCK_SIZE;
  c->header_size = CS_HEADER_SIZE;
  c->slot_size = CS_SLOT_SIZE;
  c->max_comms = CS_MAX_COMMS;
  c->max_peers = CS_MAX_PEERS;
  c->cmd = cmd;
  c->state = first ? CS_ST_RUNNING : cs_state_word;
  c->pid = (uint32_t)getpid();
  c->flags = cs_flags;
  c->nccl_version = cs_nccl_version;
  c->control_thread = (uint32_t)cs_shared;
  c->comms_live = cs_phase == CS_PH_LIVE;
  for (int i = 0; i < CS_MAX_COMMS; i++) {
    cs_vc[i].slot = CS_SLOT(c, i);
    if (cs_vc[i].live) cs_slot_publish(&cs_vc[i]);
    else memset(cs_vc[i].slot, 0, CS_SLOT_SIZE);
  }
  cs_state_word = c->state;
  cs_dm_publish();
  __atomic_store_n(&c->magic, CS_CTL_MAGIC, __ATOMIC_RELEASE);
}

/* ---- fork ---------------------------------------------------------------------------------------
 * A forked child (a data loader worker, say) is not part of the snapshot protocol: it gets a
 * private copy of the block, so it can never write into its parent's. */
static void cs_atfork_child(void) {
  if (cs_shared) {
    void* copy = mmap(NULL, CS_BLOCK_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (copy != MAP_FAILED) {
      memcpy(copy, cs_ctl, CS_BLOCK_SIZE);
      if (mremap(copy, CS_BLOCK_SIZE, CS_BLOCK_SIZE, MREMAP_MAYMOVE | MREMAP_FIXED, cs_ctl) == MAP_FAILED)
        munmap(copy, CS_BLOCK_SIZE);
    }
    cs_shared = 0;
    cs_ctl->cmd = CS_CMD_RUN;
    cs_ctl->control_thread = 0;
  }
  cs_phase = CS_PH_LIVE;
  int me = gettid();
  for (int i = 0; i < CS_TSLOTS; i++)
    if (cs_tslots[i].owner && cs_tslots[i].owner != me) cs_tslots[i].owner = cs_tslots[i].busy = cs_tslots[i].depth = 0;
  for (struct cs_tslot* t = cs_tslot_list; t; t = t->next)
    if (t->owner && t->owner != me) t->owner = t->busy = t->depth = 0;
}

static void cs_init_once(void) {
  cs_resolve();
  cs_block_open();
  int v = 0;
  if (cs_real.ncclGetVersion && cs_real.ncclGetVersion(&v) == ncclSuccess) cs_nccl_version = (uint32_t)v;
  cs_publish_all(CS_CMD_RUN);
  if (cs_shared) {
    pthread_atfork(NULL, NULL, cs_atfork_child);
    cs_control_start();
  }
  __atomic_store_n(&cs_cmdp, &cs_ctl->cmd, __ATOMIC_RELEASE);
}

void cs_init(void) { pthread_once(&cs_once, cs_init_once); }

/* ---- thread slots ------------------------------------------------------------------------------
 * Each thread that calls NCCL owns a slot (claimed at its first call, released when it exits):
 * the control thread scans them to know whether any thread is inside NCCL or inside a group. */

static void cs_tslot_release(void* p) {
  struct cs_tslot* t = p;
  __atomic_store_n(&t->depth, 0, __ATOMIC_RELAXED);
  __atomic_store_n(&t->busy, 0, __ATOMIC_RELAXED);
  if (t != &cs_tslot_overflow) __atomic_store_n(&t->owner, 0, __ATOMIC_RELEASE);
}

static void cs_tkey_make(void) { pthread_key_create(&cs_tkey, cs_tslot_release); }

static int cs_tslot_take(struct cs_tslot* t, int tid) {
  int zero = 0;
  return __atomic_compare_exchange_n(&t->owner, &zero, tid, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
}

struct cs_tslot* cs_thread_claim(void) {
  pthread_once(&cs_tkey_once, cs_tkey_make);
  int tid = gettid();
  struct cs_tslot* t = NULL;
  for (int i = 0; i < CS_TSLOTS && !t; i++)
    if (cs_tslot_take(&cs_tslots[i], tid)) t = &cs_tslots[i];
  for (struct cs_tslot* e = __atomic_load_n(&cs_tslot_list, __ATOMIC_ACQUIRE); e && !t; e = e->next)
    if (cs_tslot_take(e, tid)) t = e;
  if (!t && (t = aligned_alloc(64, sizeof *t)) != NULL) {
    memset(t, 0, sizeof *t);
    t->owner = tid;
    t->next = __atomic_load_n(&cs_tslot_list, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(&cs_tslot_list, &t->next, t, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
    }
  }
  if (!t) {
    cs_log("no memory for a thread slot: threads share one, quiesce may wait longer");
    t = &cs_tslot_overflow;
  }
  pthread_setspecific(cs_tkey, t);
  cs_tl = t;
  return t;
}

/* Threads inside a gated CUDA runtime call (devmem.c), counted like `busy`. */
int cs_scan_rt(void) {
  int n = 0;
  for (int i = 0; i < CS_TSLOTS; i++)
    if (__atomic_load_n(&cs_tslots[i].owner, __ATOMIC_ACQUIRE)) n += __atomic_load_n(&cs_tslots[i].rt, __ATOMIC_ACQUIRE);
  for (struct cs_tslot* t = __atomic_load_n(&cs_tslot_list, __ATOMIC_ACQUIRE); t; t = t->next)
    if (__atomic_load_n(&t->owner, __ATOMIC_ACQUIRE)) n += __atomic_load_n(&t->rt, __ATOMIC_ACQUIRE);
  return n + __atomic_load_n(&cs_tslot_overflow.rt, __ATOMIC_ACQUIRE);
}

/* The threads held at a gate right now, by thread id: the fast path's quiet check does not count
 * their polling as work (devmem.c). */
#define CS_HELD_MAX 512
static int cs_held_tids[CS_HELD_MAX];

void cs_held_tid(int tid, int held) {
  for (int i = 0; i < CS_HELD_MAX; i++) {
    int expect = held ? 0 : tid;
    if (__atomic_compare_exchange_n(&cs_held_tids[i], &expect, held ? tid : 0, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_RELAXED))
      return;
  }
}

int cs_is_held_tid(int tid) {
  for (int i = 0; i < CS_HELD_MAX; i++)
    if (__atomic_load_n(&cs_held_tids[i], __ATOMIC_ACQUIRE) == tid) return 1;
  return 0;
}

void cs_scan_threads(int* busy, int* in_group) {
  int b = 0, g = 0;
  for (int i = 0; i < CS_TSLOTS; i++) {
    if (!__atomic_load_n(&cs_tslots[i].owner, __ATOMIC_ACQUIRE)) continue;
    b += __atomic_load_n(&cs_tslots[i].busy, __ATOMIC_ACQUIRE) != 0;  /* busy first: see gate.c */
    g += __atomic_load_n(&cs_tslots[i].depth, __ATOMIC_ACQUIRE) > 0;
  }
  for (struct cs_tslot* t = __atomic_load_n(&cs_tslot_list, __ATOMIC_ACQUIRE); t; t = t->next) {
    if (!__atomic_load_n(&t->owner, __ATOMIC_ACQUIRE)) continue;
    b += __atomic_load_n(&t->busy, __ATOMIC_ACQUIRE) != 0;
    g += __atomic_load_n(&t->depth, __ATOMIC_ACQUIRE) > 0;
  }
  b += __atomic_load_n(&cs_tslot_overflow.busy, __ATOMIC_ACQUIRE) != 0;
  g += __atomic_load_n(&cs_tslot_overflow.depth, __ATOMIC_ACQUIRE) > 0;
  *busy = b;
  *in_group = g;
}
