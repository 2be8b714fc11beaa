/* Stand-in NCCL: collectives and point-to-point as tasks, groups, and the reductions.
 *
 * Every collective is an exchange of whole buffers followed by a local step. Reductions always
 * fold the inputs in rank order 0, 1, ..., n-1 (the same on every rank), which makes results
 * bit-deterministic whatever the timing. Simple, O(n) traffic per rank: this is for tests. */
#define _GNU_SOURCE
#include "sn.h"

#include <stdlib.h>
#include <string.h>

#define SN_API __attribute__((visibility("default")))

size_t sn_type_size(ncclDataType_t dt) {
  switch (dt) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;  /* float16, bfloat16, float8: not supported */
  }
}

/* ---- reductions ------------------------------------------------------------------------------ */

/* acc[i] = acc[i] OP in[i]. Integer sums and products wrap (computed on the unsigned type U). */
#define SN_FOLD(T, U)                                                               \
  do {                                                                              \
    T* a = acc;                                                                     \
    const T* b = in;                                                                \
    switch (op) {                                                                   \
      case ncclSum: case ncclAvg: for (size_t i = 0; i < n; i++) a[i] = (T)((U)a[i] + (U)b[i]); break; \
      case ncclProd: for (size_t i = 0; i < n; i++) a[i] = (T)((U)a[i] * (U)b[i]); break;            \
      case ncclMax: for (size_t i = 0; i < n; i++) a[i] = b[i] > a[i] ? b[i] : a[i]; break;          \
      case ncclMin: for (size_t i = 0; i < n; i++) a[i] = b[i] < a[i] ? b[i] : a[i]; break;          \
      default: break;                                                               \
    }                                                                               \
  } while (0)

static void fold(void* acc, const void* in, size_t n, ncclDataType_t dt, ncclRedOp_t op) {
  switch (dt) {
    case ncclInt8: SN_FOLD(int8_t, uint8_t); break;
    case ncclUint8: SN_FOLD(uint8_t, uint8_t); break;
    case ncclInt32: SN_FOLD(int32_t, uint32_t); break;
    case ncclUint32: SN_FOLD(uint32_t, uint32_t); break;
    case ncclInt64: SN_FOLD(int64_t, uint64_t); break;
    case ncclUint64: SN_FOLD(uint64_t, uint64_t); break;
    case ncclFloat32: SN_FOLD(float, float); break;
    case ncclFloat64: SN_FOLD(double, double); break;
    default: break;
  }
}

#define SN_DIV(T)                                     \
  do {                                                \
    T* a = acc;                                       \
    for (size_t i = 0; i < n; i++) a[i] = (T)(a[i] / (T)div); \
  } while (0)

static void divide(void* acc, size_t n, ncclDataType_t dt, int div) {
  switch (dt) {
    case ncclInt8: SN_DIV(int8_t); break;
    case ncclUint8: SN_DIV(uint8_t); break;
    case ncclInt32: SN_DIV(int32_t); break;
    case ncclUint32: SN_DIV(uint32_t); break;
    case ncclInt64: SN_DIV(int64_t); break;
    case ncclUint64: SN_DIV(uint64_t); break;
    case ncclFloat32: SN_DIV(float); break;
    case ncclFloat64: SN_DIV(double); break;
    default: break;
  }
}

/* ---- planning: each sub-operation becomes messages, then a local step ------------------------ */

struct plan {
  struct sn_xfer* x;
  int n, cap;
  struct sn_xfer* self;  /* sends and receives to this rank itself, matched in order */
  int nself, capself;
};

static int add(struct plan* p, int peer, int send, const void* buf, size_t len, int self) {
  struct sn_xfer** v = self ? &p->self : &p->x;
  int *n = self ? &p->nself : &p->n, *cap = self ? &p->capself : &p->cap;
  if (*n == *cap) {
    int ncap = *cap ? *cap * 2 : 16;
    struct sn_xfer* nv = realloc(*v, sizeof **v * (size_t)ncap);
    if (!nv) return -1;
    *v = nv;
    *cap = ncap;
  }
  struct sn_xfer* x = &(*v)[(*n)++];
  memset(x, 0, sizeof *x);
  x->peer = peer;
  x->send = send;
  x->buf = (char*)buf;
  x->len = len;
  return 0;
}

#define MSG(peer, send, buf, len) \
  do { if (add(p, peer, send, buf, len, 0)) return -1; } while (0)

/* Input block of rank r for a reduction: own data from sbuf, the others' from scratch. */
static const char* input(const struct sn_sub* s, int me, int r, size_t bytes, size_t own_off) {
  return r == me ? (const char*)s->sbuf + own_off : s->scratch + (size_t)r * bytes;
}

static int plan_sub(struct plan* p, struct sn_sub* s, int me, int n) {
  size_t es = sn_type_size(s->dt), B = s->count * es;
  const char* sb = s->sbuf;
  char* rb = s->rbuf;
  s->scratch = NULL;
  switch (s->type) {
    case SN_ALLREDUCE: case SN_REDUCESCATTER: case SN_REDUCE: case SN_ALLTOALL:
      /* peers' blocks, plus one accumulator block */
      if (!(s->scratch = malloc(B * (size_t)(n + 1) + 1))) return -1;
      break;
    default:
      break;
  }
  switch (s->type) {
    case SN_ALLREDUCE:
      for (int q = 0; q < n; q++) {
        if (q == me) continue;
        MSG(q, 1, sb, B);
        MSG(q, 0, s->scratch + (size_t)q * B, B);
      }
      break;
    case SN_REDUCE:
      if (me != s->root) MSG(s->root, 1, sb, B);
      else
        for (int q = 0; q < n; q++)
          if (q != me) MSG(q, 0, s->scratch + (size_t)q * B, B);
      break;
    case SN_BROADCAST:
      if (me != s->root) MSG(s->root, 0, rb, B);
      else
        for (int q = 0; q < n; q++)
          if (q != me) MSG(q, 1, sb, B);
      break;
    case SN_ALLGATHER:
      for (int q = 0; q < n; q++) {
        if (q == me) continue;
        MSG(q, 1, sb, B);
        MSG(q, 0, rb + (size_t)q * B, B);
      }
      break;
    case SN_REDUCESCATTER: case SN_ALLTOALL:
      for (int q = 0; q < n; q++) {
        if (q == me) continue;
        MSG(q, 1, sb + (size_t)q * B, B);
        MSG(q, 0, s->scratch + (size_t)q * B, B);
      }
      break;
    case SN_GATHER:
      if (me != s->root) MSG(s->root, 1, sb, B);
      else
        for (int q = 0; q < n; q++)
          if (q != me) MSG(q, 0, rb + (size_t)q * B, B);
      break;
    case SN_SCATTER:
      if (me != s->root) MSG(s->root, 0, rb, B);
      else
        for (int q = 0; q < n; q++)
          if (q != me) MSG(q, 1, sb + (size_t)q * B, B);
      break;
    case SN_SEND: case SN_RECV:
      if (add(p, s->root, s->type == SN_SEND, s->type == SN_SEND ? sb : rb, B, s->root == me)) return -1;
      break;
  }
  return 0;
}

static void reduce_to(struct sn_sub* s, int me, int n, size_t B, size_t own_off, char* out) {
  char* acc = s->scratch + (size_t)n * B;
  memcpy(acc, input(s, me, 0, B, own_off), B);
  for (int r = 1; r < n; r++) fold(acc, input(s, me, r, B, own_off), s->count, s->dt, s->op);
  if (s->op == ncclAvg) divide(acc, s->count, s->dt, n);
  memcpy(out, acc, B);
}

static void finish_sub(struct sn_sub* s, int me, int n) {
  size_t B = s->count * sn_type_size(s->dt);
  const char* sb = s->sbuf;
  char* rb = s->rbuf;
  switch (s->type) {
    case SN_ALLREDUCE: reduce_to(s, me, n, B, 0, rb); break;
    case SN_REDUCE: if (me == s->root) reduce_to(s, me, n, B, 0, rb); break;
    case SN_REDUCESCATTER: reduce_to(s, me, n, B, (size_t)me * B, rb); break;
    case SN_BROADCAST: if (me == s->root && rb != sb) memmove(rb, sb, B); break;
    case SN_ALLGATHER: case SN_GATHER:
      if ((s->type == SN_ALLGATHER || me == s->root) && rb + (size_t)me * B != sb) memmove(rb + (size_t)me * B, sb, B);
      break;
    case SN_SCATTER: if (me == s->root && rb != sb + (size_t)me * B) memmove(rb, sb + (size_t)me * B, B); break;
    case SN_ALLTOALL:  /* received into scratch, since the buffers may be the same */
      memmove(rb + (size_t)me * B, sb + (size_t)me * B, B);
      for (int q = 0; q < n; q++)
        if (q != me) memcpy(rb + (size_t)q * B, s->scratch + (size_t)q * B, B);
      break;
    case SN_SEND: case SN_RECV: break;
  }
}

ncclResult_t sn_run_task(struct ncclComm* c, struct sn_task* t) {
  struct plan p = {0};
  ncclResult_t r = ncclSuccess;
  int i;
  for (i = 0; i < t->nsub && r == ncclSuccess; i++)
    if (plan_sub(&p, &t->subs[i], c->rank, c->nranks)) r = sn_fail(ncclSystemError, "out of memory");
  if (r == ncclSuccess) r = sn_xfer_run(c, p.x, p.n);
  if (r == ncclSuccess) {  /* a group's sends to itself feed its receives from itself, in order */
    int recvd = 0;
    for (int k = 0; k < p.nself && r == ncclSuccess; k++) {
      if (!p.self[k].send) continue;
      while (recvd < p.nself && p.self[recvd].send) recvd++;
      if (recvd >= p.nself || p.self[recvd].len != p.self[k].len)
        r = sn_fail(ncclInvalidUsage, "rank %d: unmatched send/recv to itself", c->rank);
      else
        memcpy(p.self[recvd++].buf, p.self[k].buf, p.self[k].len);
    }
    for (int k = recvd; k < p.nself && r == ncclSuccess; k++)
      if (!p.self[k].send) r = sn_fail(ncclInvalidUsage, "rank %d: unmatched recv from itself", c->rank);
  }
  for (int k = 0; k < t->nsub; k++) {
    if (r == ncclSuccess) finish_sub(&t->subs[k], c->rank, c->nranks);
    free(t->subs[k].scratch);
  }
  free(p.x);
  free(p.self);
  return r;
}

/* ---- groups ------------------------------------------------------------------------------------ */

static __thread int sn_depth;
static __thread struct pend { struct ncclComm* c; struct sn_sub s; } *sn_pend;
static __thread int sn_npend, sn_cappend;

SN_API ncclResult_t ncclGroupStart(void) {
  sn_depth++;
  return ncclSuccess;
}

/* Issues the group's operations: one task per communicator, so that the send/recv pairs of a
 * group progress together. */
SN_API ncclResult_t ncclGroupEnd(void) {
  if (sn_depth <= 0) return sn_fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--sn_depth > 0) return ncclSuccess;
  ncclResult_t r = ncclSuccess;
  struct sn_sub* subs = malloc(sizeof *subs * (size_t)(sn_npend ? sn_npend : 1));
  if (!subs) r = sn_fail(ncclSystemError, "out of memory");
  for (int i = 0; i < sn_npend && subs; i++) {
    struct ncclComm* c = sn_pend[i].c;
    if (!c) continue;
    int n = 0;
    for (int j = i; j < sn_npend; j++)
      if (sn_pend[j].c == c) {
        subs[n++] = sn_pend[j].s;
        sn_pend[j].c = NULL;
      }
    ncclResult_t e = sn_enqueue(c, subs, n, NULL);
    if (e && !r) r = e;
  }
  free(subs);
  sn_npend = 0;
  return r;
}

static ncclResult_t submit(struct ncclComm* c, struct sn_sub* s) {
  if (sn_depth == 0) return sn_enqueue(c, s, 1, NULL);
  if (sn_npend == sn_cappend) {
    int ncap = sn_cappend ? sn_cappend * 2 : 32;
    struct pend* np = realloc(sn_pend, sizeof *np * (size_t)ncap);
    if (!np) return sn_fail(ncclSystemError, "out of memory");
    sn_pend = np;
    sn_cappend = ncap;
  }
  sn_pend[sn_npend].c = c;
  sn_pend[sn_npend].s = *s;
  sn_npend++;
  return ncclSuccess;
}

/* ---- API: collectives and point-to-point ----------------------------------------------------- */

static ncclResult_t check(struct ncclComm* c, ncclDataType_t dt, int use_op, ncclRedOp_t op, int root) {
  if (!sn_comm_valid(c)) return sn_fail(ncclInvalidArgument, "invalid communicator");
  if (sn_type_size(dt) == 0) return sn_fail(ncclInvalidArgument, "datatype %d is not supported by the stand-in", (int)dt);
  if (use_op && ((int)op < 0 || op >= ncclNumOps)) return sn_fail(ncclInvalidArgument, "reduction op %d is not supported", (int)op);
  if (root < 0 || root >= c->nranks) return sn_fail(ncclInvalidArgument, "rank %d out of range", root);
  return ncclSuccess;
}

static ncclResult_t issue(enum sn_type type, const void* sbuf, void* rbuf, size_t count, ncclDataType_t dt,
                          ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  int use_op = type == SN_ALLREDUCE || type == SN_REDUCE || type == SN_REDUCESCATTER;
  ncclResult_t r = check(comm, dt, use_op, op, root);
  if (r) return r;
  struct sn_sub s = {.type = type, .sbuf = sbuf, .rbuf = rbuf, .count = count, .dt = dt, .op = op,
                     .root = root, .stream = stream};
  return submit(comm, &s);
}

SN_API ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                  ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return issue(SN_ALLREDUCE, sendbuff, recvbuff, count, datatype, op, 0, comm, stream);
}

SN_API ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                               ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return issue(SN_REDUCE, sendbuff, recvbuff, count, datatype, op, root, comm, stream);
}

SN_API ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                  int root, ncclComm_t comm, cudaStream_t stream) {
  return issue(SN_BROADCAST, sendbuff, recvbuff, count, datatype, ncclSum, root, comm, stream);
}

SN_API ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                              cudaStream_t stream) {
  return issue(SN_BROADCAST, buff, buff, count, datatype, ncclSum, root, comm, stream);
}

SN_API ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                                  ncclComm_t comm, cudaStream_t stream) {
  return issue(SN_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm, stream);
}

SN_API ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return issue(SN_REDUCESCATTER, sendbuff, recvbuff, recvcount, datatype, op, 0, comm, stream);
}

SN_API ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                 ncclComm_t comm, cudaStream_t stream) {
  return issue(SN_ALLTOALL, sendbuff, recvbuff, count, datatype, ncclSum, 0, comm, stream);
}

SN_API ncclResult_t ncclGather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                               ncclComm_t comm, cudaStream_t stream) {
  return issue(SN_GATHER, sendbuff, recvbuff, count, datatype, ncclSum, root, comm, stream);
}

SN_API ncclResult_t ncclScatter(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                                ncclComm_t comm, cudaStream_t stream) {
  return issue(SN_SCATTER, sendbuff, recvbuff, count, datatype, ncclSum, root, comm, stream);
}

SN_API ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream) {
  return issue(SN_SEND, sendbuff, NULL, count, datatype, ncclSum, peer, comm, stream);
}

SN_API ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream) {
  return issue(SN_RECV, NULL, recvbuff, count, datatype, ncclSum, peer, comm, stream);
}
