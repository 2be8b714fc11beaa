/* The control thread: watches the command word and carries out HOLD, QUIESCE and REBUILD itself,
 * so that a snapshot works whether or not an application thread is inside NCCL. It talks to the
 * agent only through the control block (a shared file mapping): no socket, no descriptor. */
#define _GNU_SOURCE
#include "cs.h"

#include <dlfcn.h>
#include <linux/membarrier.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void nap_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  nanosleep(&ts, NULL);
}

static void set_state(uint32_t st, uint32_t gen) {
  uint64_t w = st | (uint64_t)gen << 32;
  cs_state_word = w;
  __atomic_store_n(&cs_ctl->state, w, __ATOMIC_RELEASE);
}

static void set_live(int phase) {
  __atomic_store_n(&cs_ctl->comms_live, phase == CS_PH_LIVE, __ATOMIC_RELAXED);
  __atomic_store_n(&cs_phase, phase, __ATOMIC_SEQ_CST);
}

/* ERROR(gen) with the reason; the text is written before the state. */
static void set_error(uint32_t gen, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_error(uint32_t gen, const char* fmt, ...) {
  char buf[sizeof cs_ctl->error];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  memcpy(cs_ctl->error, buf, sizeof buf);
  cs_log("%s", buf);
  set_state(CS_ST_ERROR, gen);
}

/* A full memory barrier on every thread of this process (see gate.c). */
void cs_fence_all(void) {
  static int warned;
  if (syscall(__NR_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0 &&
      syscall(__NR_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0)
    return;
  if (syscall(__NR_membarrier, MEMBARRIER_CMD_GLOBAL, 0, 0) == 0) return;
  if (!warned++) cs_log("membarrier unavailable: relying on a 20 ms pause");
  nap_us(20000);
}

/* ---- CUDA devices: the control thread creates communicators, so it must be on their device ---- */

static void* cs_cudart(const char* name) {
  static const char* libs[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"};
  void* p = dlsym(RTLD_DEFAULT, name);
  for (size_t i = 0; !p && i < sizeof libs / sizeof *libs; i++) {
    void* h = dlopen(libs[i], RTLD_LAZY | RTLD_NOLOAD);
    if (h) p = dlsym(h, name);
  }
  return p;
}

int cs_get_device(void) {
  int (*get)(int*) = (int (*)(int*))cs_cudart("cudaGetDevice");
  int d = -1;
  return get && get(&d) == 0 ? d : -1;
}

void cs_set_device(int device) {
  static int (*set)(int);
  static int looked;
  if (device < 0) return;
  if (!looked) {
    set = (int (*)(int))cs_cudart("cudaSetDevice");
    looked = 1;
  }
  if (set && set(device) != 0) cs_log("cudaSetDevice(%d) failed", device);
}

/* ---- quiesce --------------------------------------------------------------------------------- */

/* Flush, then destroy (abort if that fails). Returns 0, or -1 if even abort failed. */
static int cs_destroy_real(struct cs_vcomm* v) {
  ncclComm_t rc = v->real;
  if (!rc) return 0;
  cs_set_device(v->device);
  for (int i = 0; i < CS_MAX_REGS; i++) {
    struct cs_reg* g = &cs_regs[i];
    if (g->used && g->comm == (int)(v - cs_vc) && g->real) {
      if (cs_real.ncclCommDeregister) cs_real.ncclCommDeregister(rc, g->real);
      g->real = NULL;
    }
  }
  ncclResult_t r = ncclSuccess;
  if (!v->finalized && cs_real.ncclCommFinalize) r = cs_wait_async(rc, cs_real.ncclCommFinalize(rc));
  if (r == ncclSuccess) r = cs_real.ncclCommDestroy(rc);
  __atomic_store_n(&v->real, NULL, __ATOMIC_RELEASE);
  if (r == ncclSuccess) return 0;
  cs_log("communicator %u: flush/destroy failed (%d), aborting it", v->vid, (int)r);
  return cs_real.ncclCommAbort && cs_real.ncclCommAbort(rc) == ncclSuccess ? 0 : -1;
}

static int cmp_vid_desc(const void* a, const void* b) {
  const struct cs_vcomm *x = *(struct cs_vcomm* const*)a, *y = *(struct cs_vcomm* const*)b;
  return x->vid < y->vid ? 1 : x->vid > y->vid ? -1 : 0;
}

/* Describes the first counter that is not at its target. */
static void cs_describe_cut(char* buf, size_t n) {
  snprintf(buf, n, "counters moved");
  for (int i = 0; i < CS_MAX_COMMS; i++) {
    struct cs_vcomm* v = &cs_vc[i];
    if (!v->live) continue;
    struct cs_ctl_comm* s = v->slot;
    if (s->seq != s->coll_target) {
      snprintf(buf, n, "comm vid %u: seq %llu, target %llu", v->vid, (unsigned long long)s->seq,
               (unsigned long long)s->coll_target);
      return;
    }
    for (int p = 0; p < CS_MAX_PEERS && p < v->nranks; p++)
      if (s->send[p] != s->send_target[p] || s->recv[p] != s->recv_target[p]) {
        snprintf(buf, n, "comm vid %u peer %d: send %llu/%llu, recv %llu/%llu", v->vid, p,
                 (unsigned long long)s->send[p], (unsigned long long)s->send_target[p],
                 (unsigned long long)s->recv[p], (unsigned long long)s->recv_target[p]);
        return;
      }
  }
}

static void cs_quiesce(uint32_t gen, uint64_t prev) {
  if ((uint32_t)prev != CS_CMD_HOLD || cs_released_cmd == prev) {
    set_error(gen, "QUIESCE refused: it must follow a HOLD still in force");
    return;
  }
  set_state(CS_ST_QUIESCING, gen);
  set_live(CS_PH_QUIESCING);
  cs_fence_all();
  uint64_t deadline = now_ns() + (uint64_t)(cs_timeout_s() * 1e9);
  int busy = 0, in_group = 0;
  for (;;) {  /* wait for every thread to leave NCCL and its groups */
    cs_scan_threads(&busy, &in_group);
    if (!busy && !in_group) break;
    if (now_ns() > deadline) {
      set_live(CS_PH_LIVE);
      set_error(gen, "QUIESCE: %d thread(s) still inside NCCL and %d inside a group after %.0f s", busy, in_group,
                cs_timeout_s());
      return;
    }
    nap_us(100);
  }
  if (!cs_at_cut(1)) {  /* never destroy at an inconsistent cut: the peers would wait forever */
    char why[160];
    cs_describe_cut(why, sizeof why);
    set_live(CS_PH_LIVE);
    set_error(gen, "QUIESCE refused: not at the HOLD targets (%s)", why);
    return;
  }
  struct cs_vcomm* order[CS_MAX_COMMS];
  int n = 0, failed = 0;
  for (int i = 0; i < CS_MAX_COMMS; i++)
    if (cs_vc[i].live && cs_vc[i].real) order[n++] = &cs_vc[i];
  qsort(order, (size_t)n, sizeof *order, cmp_vid_desc);  /* children before parents */
  for (int i = 0; i < n; i++) failed += cs_destroy_real(order[i]) != 0;
  set_live(CS_PH_QUIESCED);
  if (failed) set_error(gen, "QUIESCE: %d communicator(s) could not be destroyed nor aborted", failed);
  else set_state(CS_ST_QUIESCED, gen);
}

/* ---- rebuild --------------------------------------------------------------------------------- */

static ncclConfig_t* cs_config_ptr(struct cs_config* c) { return c->present ? (ncclConfig_t*)c->bytes : NULL; }

static int cmp_ident(const void* a, const void* b) {
  const struct cs_vcomm *x = *(struct cs_vcomm* const*)a, *y = *(struct cs_vcomm* const*)b;
  if (x->ident != y->ident) return x->ident < y->ident ? -1 : 1;
  return x->vid < y->vid ? -1 : x->vid > y->vid ? 1 : 0;
}

/* Waits for the agent to put this generation's id into the slot. 0, or an error text. */
static const char* cs_wait_uid(struct cs_ctl_comm* s, uint32_t gen, uint64_t cmd) {
  uint64_t deadline = now_ns() + (uint64_t)(cs_timeout_s() * 1e9);
  while (__atomic_load_n(&s->uid_gen, __ATOMIC_ACQUIRE) != gen) {
    if (__atomic_load_n(&cs_ctl->cmd, __ATOMIC_ACQUIRE) != cmd) return "the agent replaced the REBUILD command";
    if (now_ns() > deadline) return "no unique id from the agent in time";
    nap_us(200);
  }
  return NULL;
}

/* Test-only fault injection: CRYOSLEEP_NCCL_FAULT=rebuild-once@RANK makes the first REBUILD of the worker
 * with that RANK fail after every communicator was re-created (a late failure: its peers succeed). */
static int cs_fault_rebuild(void) {
  static int fired;
  const char* f = getenv("CRYOSLEEP_NCCL_FAULT");
  const char* rank = getenv("RANK");
  if (fired || !f || strncmp(f, "rebuild-once@", 13) != 0 || !rank || strcmp(f + 13, rank) != 0) return 0;
  fired = 1;
  return 1;
}

static void cs_rebuild(uint32_t gen, uint64_t cmd) {
  char why[200] = "";
  set_state(CS_ST_REBUILDING, gen);
  set_live(CS_PH_REBUILDING);
  struct cs_vcomm* ids[CS_MAX_COMMS];
  int nid = 0;
  for (int i = 0; i < CS_MAX_COMMS; i++) {
    struct cs_vcomm* v = &cs_vc[i];
    if (!v->live || v->finalized) continue;
    if (v->rebuild == CS_REBUILD_ID) ids[nid++] = v;
    if (v->rebuild != CS_REBUILD_ID || v->rank != 0) continue;
    /* rank 0 of each communicator makes its fresh id; the agent copies it to the other members */
    ncclUniqueId uid;
    cs_set_device(v->device);
    ncclResult_t r = cs_real.ncclGetUniqueId(&uid);
    if (r != ncclSuccess) {
      snprintf(why, sizeof why, "ncclGetUniqueId for comm vid %u failed (%d)", v->vid, (int)r);
      goto fail;
    }
    memcpy(v->slot->uid, &uid, sizeof uid);
    __atomic_store_n(&v->slot->uid_gen, gen, __ATOMIC_RELEASE);
  }
  /* communicators from ids, in ident order: the same order on every rank, so no init waits on a
   * rank busy with another */
  qsort(ids, (size_t)nid, sizeof *ids, cmp_ident);
  for (int i = 0; i < nid; i++) {
    struct cs_vcomm* v = ids[i];
    const char* e = cs_wait_uid(v->slot, gen, cmd);
    if (e) {
      snprintf(why, sizeof why, "comm vid %u: %s", v->vid, e);
      goto fail;
    }
    ncclUniqueId uid;
    ncclComm_t rc = NULL;
    memcpy(&uid, v->slot->uid, sizeof uid);
    cs_set_device(v->device);
    ncclResult_t r = cs_real.ncclCommInitRankConfig
                         ? cs_real.ncclCommInitRankConfig(&rc, v->nranks, uid, v->rank, cs_config_ptr(&v->config))
                         : cs_real.ncclCommInitRank(&rc, v->nranks, uid, v->rank);
    r = rc ? cs_wait_async(rc, r) : r;
    if (r != ncclSuccess || !rc) {
      snprintf(why, sizeof why, "comm vid %u: ncclCommInitRank failed (%d)", v->vid, (int)r);
      if (rc) cs_real.ncclCommAbort(rc);
      goto fail;
    }
    __atomic_store_n(&v->real, rc, __ATOMIC_RELEASE);
  }
  /* splits, replayed in creation order on their rebuilt parents */
  for (int i = 0; i < CS_MAX_SPLITS && cs_splits[i].used; i++) {
    struct cs_split* s = &cs_splits[i];
    struct cs_vcomm* p = &cs_vc[s->parent];
    ncclComm_t rc = NULL;
    cs_set_device(p->device);
    ncclResult_t r = cs_real.ncclCommSplit(p->real, s->color, s->key, &rc, cs_config_ptr(&s->config));
    r = rc ? cs_wait_async(rc, r) : r;
    if (r != ncclSuccess) {
      snprintf(why, sizeof why, "replaying split %d of comm vid %u failed (%d)", i, p->vid, (int)r);
      if (rc) cs_real.ncclCommAbort(rc);
      goto fail;
    }
    struct cs_vcomm* c = s->child >= 0 ? &cs_vc[s->child] : NULL;
    if (c && c->live && c->vid == s->child_vid && !c->finalized) __atomic_store_n(&c->real, rc, __ATOMIC_RELEASE);
    else if (rc) cs_real.ncclCommDestroy(rc);  /* destroyed by the application since: replayed for the others */
  }
  for (int i = 0; i < CS_MAX_REGS; i++) {
    struct cs_reg* g = &cs_regs[i];
    if (!g->used || !cs_vc[g->comm].real) continue;
    ncclResult_t r = cs_real.ncclCommRegister(cs_vc[g->comm].real, g->buff, g->size, &g->real);
    if (r != ncclSuccess) {
      snprintf(why, sizeof why, "re-registering a buffer of comm vid %u failed (%d)", g->vid, (int)r);
      goto fail;
    }
  }
  if (cs_fault_rebuild()) {
    snprintf(why, sizeof why, "injected failure (CRYOSLEEP_NCCL_FAULT)");
    goto fail;
  }
  set_live(CS_PH_LIVE);
  set_state(CS_ST_RUNNING, gen);
  return;
fail:
  for (int i = 0; i < CS_MAX_COMMS; i++) {  /* back to quiesced, so that REBUILD can be retried */
    struct cs_vcomm* v = &cs_vc[i];
    ncclComm_t rc = v->real;
    if (!rc) continue;
    __atomic_store_n(&v->real, NULL, __ATOMIC_RELEASE);
    cs_set_device(v->device);
    cs_real.ncclCommAbort(rc);
  }
  for (int i = 0; i < CS_MAX_REGS; i++) cs_regs[i].real = NULL;
  set_live(CS_PH_QUIESCED);
  set_error(gen, "REBUILD: %s", why);
}

/* ---- the loop -------------------------------------------------------------------------------- */

/* Device memory still offloaded (fast path) comes back before anything may run again. */
static int cs_reload_first(uint32_t gen) {
  char why[sizeof cs_ctl->error];
  if (!cs_dm_offloaded() || cs_dm_reload(why, sizeof why) == 0) return 0;
  set_error(gen, "%s", why);
  return -1;
}

static void cs_handle(uint64_t w, uint64_t prev) {
  uint32_t c = (uint32_t)w, gen = (uint32_t)(w >> 32);
  int live = __atomic_load_n(&cs_phase, __ATOMIC_ACQUIRE) == CS_PH_LIVE;
  char why[sizeof cs_ctl->error];
  switch (c) {
    case CS_CMD_RUN:
      if (cs_reload_first(gen)) break;
      if (live) set_state(CS_ST_RUNNING, gen);
      else set_error(gen, "RUN while quiesced: send REBUILD first");
      break;
    case CS_CMD_PREPARE:
      if (cs_dm_prepare(why, sizeof why) == 0) set_state(CS_ST_PREPARED, gen);
      else set_error(gen, "%s", why);
      break;
    case CS_CMD_OFFLOAD:
      if (live) set_error(gen, "OFFLOAD refused: QUIESCE first");
      else if (cs_dm_offload(why, sizeof why) == 0) set_state(CS_ST_OFFLOADED, gen);
      else set_error(gen, "%s", why);
      break;
    case CS_CMD_RELOAD:
      if (cs_dm_reload(why, sizeof why) == 0) set_state(live ? CS_ST_RUNNING : CS_ST_QUIESCED, gen);
      else set_error(gen, "%s", why);
      break;
    case CS_CMD_HOLD:
      if (!live) {
        set_error(gen, "HOLD while quiesced: send REBUILD first");
        break;
      }
      cs_fence_all();  /* from here on, every thread entering NCCL sees HOLD */
      set_state(CS_ST_HOLDING, gen);
      break;
    case CS_CMD_QUIESCE:
      if (live) cs_quiesce(gen, prev);
      else set_state(CS_ST_QUIESCED, gen);
      break;
    case CS_CMD_REBUILD:
      if (cs_reload_first(gen)) break;
      if (live) set_state(CS_ST_RUNNING, gen);
      else cs_rebuild(gen, w);
      break;
    default:
      set_error(gen, "unknown command %u: every gated call is held", c);
  }
}

/* In HOLD: publish whether this process has settled at the targets (stable until they change). */
static void cs_publish_settled(void) {
  uint32_t tg = __atomic_load_n(&cs_ctl->targets_gen, __ATOMIC_ACQUIRE);
  int busy = 1, in_group = 1, at = 0;
  for (int tries = 0; tries < 3 && (busy || in_group); tries++) cs_scan_threads(&busy, &in_group);
  at = cs_at_cut(0);
  __atomic_store_n(&cs_ctl->settled, (uint32_t)(!busy && !in_group && at), __ATOMIC_RELAXED);
  __atomic_store_n(&cs_ctl->settled_gen, tg, __ATOMIC_RELEASE);
}

static void* cs_control_main(void* arg) {
  (void)arg;
  uint64_t last = CS_CMD_RUN;  /* what init published: a command written before this line runs is still seen */
  for (;;) {
    if (__atomic_load_n(&cs_ctl->magic, __ATOMIC_ACQUIRE) != CS_CTL_MAGIC) {
      cs_log("control block was blank: publishing it again");
      cs_publish_all(last);
    }
    __atomic_add_fetch(&cs_ctl->heartbeat, 1, __ATOMIC_RELAXED);
    int busy, in_group;
    cs_scan_threads(&busy, &in_group);
    __atomic_store_n(&cs_ctl->busy, (uint32_t)busy, __ATOMIC_RELAXED);
    __atomic_store_n(&cs_ctl->in_group, (uint32_t)in_group, __ATOMIC_RELAXED);
    uint64_t w = __atomic_load_n(&cs_ctl->cmd, __ATOMIC_ACQUIRE);
    if (w != last && w != 0) {  /* 0: a blank word (a file being blanked or recreated), never a command */
      cs_handle(w, last);
      last = w;
    }
    if ((uint32_t)w == CS_CMD_HOLD) {
      uint64_t dl = __atomic_load_n(&cs_ctl->hold_deadline_ns, __ATOMIC_RELAXED);
      if (dl && now_ns() > dl && cs_released_cmd != w) {
        __atomic_store_n(&cs_released_cmd, w, __ATOMIC_RELEASE);
        set_error((uint32_t)(w >> 32), "HOLD deadline passed: the gate is open again");
      }
      cs_publish_settled();
    }
    if ((uint32_t)w == CS_CMD_RUN) cs_dm_early(); /* CRYOSLEEP_ARENA_BYTES: the arena made once, ahead */
    nap_us((uint32_t)w == CS_CMD_RUN ? 5000 : 1000);
  }
  return NULL;
}

void cs_control_start(void) {
  pthread_t th;
  pthread_attr_t attr;
  sigset_t all, old;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);  /* the application's signal handlers never run here */
  int rc = pthread_create(&th, &attr, cs_control_main, NULL);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_attr_destroy(&attr);
  if (rc != 0) {
    cs_log("cannot start the control thread (%s): no snapshot support", strerror(rc));
    __atomic_store_n(&cs_ctl->control_thread, 0, __ATOMIC_RELAXED);
    return;
  }
  pthread_setname_np(th, "cryosleep-ctl");
}
