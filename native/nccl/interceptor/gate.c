/* The gate's slow path: taken when the command word is not RUN (or before init, or when the
 * communicator is quiesced). A call is admitted when the communicators are live and the command
 * is RUN, or HOLD with the call within its target; otherwise the thread waits here, polling, not
 * marked busy, counted in `held`. After a REBUILD the threads wait for the agent's RUN, which it
 * writes once every rank has rebuilt: no rank runs ahead on a communicator a peer failed to rebuild.
 *
 * Why the busy flag is enough: a thread stores busy=1, then loads the command word and the phase;
 * the control thread stores the phase, runs membarrier() (a barrier on every thread of the
 * process), then reads every busy flag, then every group depth. Either the control thread sees
 * busy=1 (and waits), or the thread's later loads see the new phase and the thread holds. */
#define _GNU_SOURCE
#include "cs.h"

#include <time.h>

void cs_peer_capped(struct cs_vcomm* v) {
  if (!(v->flags & CS_CF_PEERS_CAPPED)) {
    v->flags |= CS_CF_PEERS_CAPPED;
    __atomic_or_fetch(&v->slot->flags, CS_CF_PEERS_CAPPED, __ATOMIC_RELAXED);
    cs_set_flag(CS_F_PEERS_CAPPED);
  }
}

/* Every counter of every live communicator has reached its target (exact: equals it). */
int cs_at_cut(int exact) {
  for (int i = 0; i < CS_MAX_COMMS; i++) {
    struct cs_vcomm* v = &cs_vc[i];
    if (!__atomic_load_n(&v->live, __ATOMIC_ACQUIRE)) continue;
    struct cs_ctl_comm* s = v->slot;
    uint64_t seq = __atomic_load_n(&s->seq, __ATOMIC_RELAXED), t = __atomic_load_n(&s->coll_target, __ATOMIC_RELAXED);
    if (seq < t || (exact && seq != t)) return 0;
    int np = v->nranks < CS_MAX_PEERS ? v->nranks : CS_MAX_PEERS;
    for (int p = 0; p < np; p++) {
      uint64_t a = __atomic_load_n(&s->send[p], __ATOMIC_RELAXED), at = __atomic_load_n(&s->send_target[p], __ATOMIC_RELAXED);
      uint64_t b = __atomic_load_n(&s->recv[p], __ATOMIC_RELAXED), bt = __atomic_load_n(&s->recv_target[p], __ATOMIC_RELAXED);
      if (a < at || b < bt || (exact && (a != at || b != bt))) return 0;
    }
  }
  return 1;
}

static int cs_admissible(enum cs_kind kind, struct cs_vcomm* v, int peer) {
  if (v && kind == CS_K_COLL) return v->seq < __atomic_load_n(&v->slot->coll_target, __ATOMIC_RELAXED);
  if (v && (unsigned)peer < CS_MAX_PEERS && kind == CS_K_SEND)
    return v->sent[peer] < __atomic_load_n(&v->slot->send_target[peer], __ATOMIC_RELAXED);
  if (v && (unsigned)peer < CS_MAX_PEERS && kind == CS_K_RECV)
    return v->recvd[peer] < __atomic_load_n(&v->slot->recv_target[peer], __ATOMIC_RELAXED);
  /* group starts, communicator management, untracked communicators: let the thread go on while
   * this process is still short of the cut, hold it once everything has reached it */
  return !cs_at_cut(0);
}

ncclResult_t cs_gate(struct cs_tslot* t, enum cs_kind kind, struct cs_vcomm* v, int peer) {
  if (__atomic_load_n(&cs_cmdp, __ATOMIC_ACQUIRE) == &cs_uninit_word) cs_init();
  if (__atomic_load_n(&t->depth, __ATOMIC_RELAXED) == 0) {  /* inside a group: never held */
    int held = 0;
    long nap_ns = 20 * 1000;
    uint32_t wkind = !v ? CS_WAIT_NONE : kind == CS_K_COLL ? CS_WAIT_COLL : kind == CS_K_SEND ? CS_WAIT_SEND
                   : kind == CS_K_RECV ? CS_WAIT_RECV : CS_WAIT_NONE;
    for (;;) {
      uint64_t w = __atomic_load_n(cs_cmdp, __ATOMIC_ACQUIRE);
      if (__atomic_load_n(&cs_phase, __ATOMIC_ACQUIRE) == CS_PH_LIVE) {
        uint32_t c = (uint32_t)w;
        /* not REBUILD: threads wait for the agent's RUN (all ranks rebuilt). PREPARE is sent while the job runs
         * (before a drain, or ahead of any snapshot) and is answered without another command after it: it holds
         * nothing (holding here kept a job stalled from a PREPARE ahead until the next snapshot's HOLD) */
        if (c == CS_CMD_RUN || c == CS_CMD_PREPARE) break;
        if (c == CS_CMD_HOLD &&
            (__atomic_load_n(&cs_released_cmd, __ATOMIC_ACQUIRE) == w || cs_admissible(kind, v, peer)))
          break;
      }
      if (!held) {  /* tell the agent what this thread waits to issue: it may raise that target */
        held = 1;
        if (wkind != CS_WAIT_NONE) {
          __atomic_store_n(&v->slot->waiting_kind, wkind, __ATOMIC_RELAXED);
          __atomic_store_n(&v->slot->waiting_peer, kind == CS_K_COLL ? -1 : peer, __ATOMIC_RELAXED);
          __atomic_add_fetch(&v->slot->waiting, 1, __ATOMIC_RELEASE);
        }
        __atomic_add_fetch(&cs_ctl->held, 1, __ATOMIC_RELEASE);
        cs_held_tid(t->owner, 1);
      }
      cs_nap_held(&t->busy, &nap_ns);
    }
    if (held) {
      if (wkind != CS_WAIT_NONE) __atomic_sub_fetch(&v->slot->waiting, 1, __ATOMIC_RELEASE);
      __atomic_sub_fetch(&cs_ctl->held, 1, __ATOMIC_RELEASE);
      cs_held_tid(t->owner, 0);
    }
  }
  if (v && !__atomic_load_n(&v->real, __ATOMIC_ACQUIRE) && kind != CS_K_RELEASE) {
    cs_log("communicator %u was finalized: call refused", v->vid);
    return ncclInvalidUsage;
  }
  return ncclSuccess;
}
