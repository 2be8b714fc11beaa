/* Stand-in NCCL: communicators, their progress threads and task queues, stream keys, errors. */
#define _GNU_SOURCE
#include "sn.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define SN_API __attribute__((visibility("default")))

static __thread char sn_lasterr[256];

ncclResult_t sn_fail(ncclResult_t r, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(sn_lasterr, sizeof sn_lasterr, fmt, ap);
  va_end(ap);
  return r;
}

double sn_timeout_s(void) {
  const char* env = getenv("STANDIN_NCCL_TIMEOUT_S");
  double t = env ? atof(env) : 0.0;
  return t > 0 ? t : 600.0;
}

int sn_comm_valid(const struct ncclComm* c) { return c && c->magic == SN_COMM_MAGIC; }

/* ---- stream keys ------------------------------------------------------------------------------
 * A cudaStream_t is only a key here. Per key: tasks issued and completed (tickets: a task starts
 * when every earlier task on its streams has completed, as on a GPU stream), and the first error
 * one of them met since the last synchronize. */

#define SN_MAX_STREAMS 1024
static struct { void* key; uint64_t issued, done; ncclResult_t err; int used; } sn_streams[SN_MAX_STREAMS];
static pthread_mutex_t sn_smu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sn_scv = PTHREAD_COND_INITIALIZER;

static int stream_find(void* key, int create) {
  int free_slot = -1;
  for (int i = 0; i < SN_MAX_STREAMS; i++) {
    if (sn_streams[i].used && sn_streams[i].key == key) return i;
    if (free_slot < 0 && (!sn_streams[i].used || (sn_streams[i].issued == sn_streams[i].done && !sn_streams[i].err)))
      free_slot = i;
  }
  if (!create || free_slot < 0) return -1;
  sn_streams[free_slot].used = 1;
  sn_streams[free_slot].key = key;
  sn_streams[free_slot].issued = sn_streams[free_slot].done = 0;
  sn_streams[free_slot].err = ncclSuccess;
  return free_slot;
}

/* Takes the task's places on its streams (a full table only loses ordering for the overflow). */
static void streams_issue(struct sn_task* t) {
  pthread_mutex_lock(&sn_smu);
  for (int k = 0; k < t->nstreams; k++) {
    int i = stream_find(t->streams[k], 1);
    t->tickets[k] = i < 0 ? 0 : ++sn_streams[i].issued;
  }
  pthread_mutex_unlock(&sn_smu);
}

/* Waits until every earlier task on the task's streams is done (or the communicator aborts). */
static void streams_wait(struct ncclComm* c, struct sn_task* t) {
  pthread_mutex_lock(&sn_smu);
  for (int k = 0; k < t->nstreams; k++) {
    for (;;) {
      int i = stream_find(t->streams[k], 0);
      if (i < 0 || !t->tickets[k] || sn_streams[i].done + 1 >= t->tickets[k] ||
          __atomic_load_n(&c->aborting, __ATOMIC_ACQUIRE))
        break;
      pthread_cond_wait(&sn_scv, &sn_smu);
    }
  }
  pthread_mutex_unlock(&sn_smu);
}

static void streams_complete(struct sn_task* t, ncclResult_t err) {
  pthread_mutex_lock(&sn_smu);
  for (int k = 0; k < t->nstreams; k++) {
    int i = stream_find(t->streams[k], 0);
    if (i < 0 || !t->tickets[k]) continue;
    if (sn_streams[i].done < t->tickets[k]) sn_streams[i].done = t->tickets[k];
    if (err && !sn_streams[i].err) sn_streams[i].err = err;
  }
  pthread_cond_broadcast(&sn_scv);
  pthread_mutex_unlock(&sn_smu);
}

/* What tests call where PyTorch would call cudaStreamSynchronize: waits until every operation
 * enqueued with this stream key is done; returns (and clears) the first error among them. */
SN_API int standinStreamSynchronize(void* stream) {
  ncclResult_t r = ncclSuccess;
  pthread_mutex_lock(&sn_smu);
  for (int i; (i = stream_find(stream, 0)) >= 0;) {
    if (sn_streams[i].done < sn_streams[i].issued) {
      pthread_cond_wait(&sn_scv, &sn_smu);
      continue;
    }
    r = sn_streams[i].err;
    sn_streams[i].err = ncclSuccess;
    break;
  }
  pthread_mutex_unlock(&sn_smu);
  return (int)r;
}

static void task_free(struct sn_task* t) {
  free(t->subs);
  free(t->streams);
  free(t->tickets);
  free(t);
}

/* ---- progress thread and queue -------------------------------------------------------------- */

static void* progress_main(void* arg) {
  struct ncclComm* c = arg;
  pthread_mutex_lock(&c->mu);
  for (;;) {
    while (!c->head && !c->stopping && !c->aborting) pthread_cond_wait(&c->cv, &c->mu);
    struct sn_task* t = c->head;
    if (!t) break;
    pthread_mutex_unlock(&c->mu);
    streams_wait(c, t);
    pthread_mutex_lock(&c->mu);
    ncclResult_t r = c->err;
    int aborting = c->aborting;
    pthread_mutex_unlock(&c->mu);
    if (aborting && !r) r = sn_fail(ncclRemoteError, "communicator aborted");
    if (!r) r = sn_run_task(c, t);
    pthread_mutex_lock(&c->mu);
    if (r && !c->err) {
      c->err = r;
      snprintf(c->errmsg, sizeof c->errmsg, "%s", sn_lasterr);
    }
    c->head = t->next;
    if (!c->head) c->tail = NULL;
    c->completed++;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    streams_complete(t, r);
    task_free(t);
    pthread_mutex_lock(&c->mu);
  }
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

ncclResult_t sn_comm_start(struct ncclComm* c) {
  sigset_t all, old;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);  /* the application's signal handlers never run here */
  int rc = pthread_create(&c->thread, NULL, progress_main, c);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (rc != 0) return sn_fail(ncclSystemError, "cannot start the progress thread: %s", strerror(rc));
  pthread_setname_np(c->thread, "standin-nccl");
  c->magic = SN_COMM_MAGIC;
  return ncclSuccess;
}

ncclResult_t sn_enqueue(struct ncclComm* c, struct sn_sub* subs, int nsub, uint64_t* seqno) {
  struct sn_task* t = calloc(1, sizeof *t);
  if (t) {
    t->subs = malloc(sizeof *subs * (size_t)nsub);
    t->streams = malloc(sizeof(void*) * (size_t)nsub);
    t->tickets = calloc((size_t)nsub, sizeof(uint64_t));
  }
  if (!t || !t->subs || !t->streams || !t->tickets) {
    if (t) task_free(t);
    return sn_fail(ncclSystemError, "out of memory");
  }
  memcpy(t->subs, subs, sizeof *subs * (size_t)nsub);
  t->nsub = nsub;
  for (int i = 0; i < nsub; i++) {
    int seen = 0;
    for (int k = 0; k < t->nstreams; k++) seen |= t->streams[k] == subs[i].stream;
    if (!seen) t->streams[t->nstreams++] = subs[i].stream;
  }
  pthread_mutex_lock(&c->mu);
  ncclResult_t r = c->err;
  if (r) {
    sn_fail(r, "%s", c->errmsg);
    pthread_mutex_unlock(&c->mu);
    task_free(t);
    return r;
  }
  streams_issue(t);  /* under c->mu: tickets follow this communicator's queue order */
  t->seqno = ++c->enqueued;
  if (c->tail) c->tail->next = t;
  else c->head = t;
  c->tail = t;
  if (seqno) *seqno = t->seqno;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  return ncclSuccess;
}

ncclResult_t sn_wait(struct ncclComm* c, uint64_t seqno) {
  pthread_mutex_lock(&c->mu);
  while (c->completed < seqno) pthread_cond_wait(&c->cv, &c->mu);
  ncclResult_t r = c->err;
  if (r) sn_fail(r, "%s", c->errmsg);
  pthread_mutex_unlock(&c->mu);
  return r;
}

SN_API int standinCommSynchronize(ncclComm_t comm) {
  if (!sn_comm_valid(comm)) return (int)sn_fail(ncclInvalidArgument, "invalid communicator");
  pthread_mutex_lock(&comm->mu);
  uint64_t last = comm->enqueued;
  pthread_mutex_unlock(&comm->mu);
  return (int)sn_wait(comm, last);
}

static void comm_free(struct ncclComm* c) {
  for (int r = 0; c->fds && r < c->nranks; r++)
    if (c->fds[r] >= 0) close(c->fds[r]);
  free(c->fds);
  c->magic = 0;
  free(c);
}

/* Stops the progress thread: after the queue drains (stop) or at once, failing what is left
 * (abort). The thread must have been started. */
static void comm_stop(struct ncclComm* c, int abort) {
  pthread_mutex_lock(&c->mu);
  if (abort) {
    c->aborting = 1;
    for (int r = 0; r < c->nranks; r++)
      if (c->fds[r] >= 0) shutdown(c->fds[r], SHUT_RDWR);
  }
  c->stopping = 1;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  if (abort) {  /* it may be waiting for another communicator's task on a shared stream */
    pthread_mutex_lock(&sn_smu);
    pthread_cond_broadcast(&sn_scv);
    pthread_mutex_unlock(&sn_smu);
  }
  pthread_join(c->thread, NULL);
}

/* ---- API: versions, ids, communicators -------------------------------------------------------- */

SN_API ncclResult_t ncclGetVersion(int* version) {
  if (!version) return sn_fail(ncclInvalidArgument, "version is NULL");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

SN_API ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return sn_fail(ncclInvalidArgument, "uniqueId is NULL");
  return sn_make_id(id);
}

static ncclResult_t check_config(const ncclConfig_t* config) {
  if (config && config->magic != 0xcafebeef)
    return sn_fail(ncclInvalidArgument, "config not initialized with NCCL_CONFIG_INITIALIZER");
  return ncclSuccess;
}

SN_API ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                           ncclConfig_t* config) {
  if (!comm) return sn_fail(ncclInvalidArgument, "comm is NULL");
  *comm = NULL;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return sn_fail(ncclInvalidArgument, "rank %d out of range for %d ranks", rank, nranks);
  ncclResult_t r = check_config(config);
  if (r) return r;
  struct ncclComm* c = calloc(1, sizeof *c);
  if (!c) return sn_fail(ncclSystemError, "out of memory");
  c->rank = rank;
  c->nranks = nranks;
  c->ip = sn_local_ip();
  r = sn_join(c, &id);
  if (!r) r = sn_comm_start(c);
  if (r) {
    comm_free(c);
    return r;
  }
  *comm = c;
  return ncclSuccess;
}

SN_API ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, NULL);
}

SN_API ncclResult_t ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist) {
  (void)comm, (void)ndev, (void)devlist;
  return sn_fail(ncclInvalidUsage, "the stand-in does not support single-process cliques (ncclCommInitAll)");
}

struct split_rec { int32_t color, key; struct sn_addr addr; };

static uint64_t mix64(uint64_t x) {  /* splitmix64's finalizer */
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* Collective over the parent: the (color, key, listening address) of every rank is all-gathered
 * through the parent's queue, then each color connects its own mesh. */
SN_API ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  static char split_stream;  /* a stream key of its own, so no application stream waits on it */
  if (!sn_comm_valid(comm)) return sn_fail(ncclInvalidArgument, "invalid communicator");
  if (!newcomm) return sn_fail(ncclInvalidArgument, "newcomm is NULL");
  if (color < 0 && color != NCCL_SPLIT_NOCOLOR) return sn_fail(ncclInvalidArgument, "invalid color %d", color);
  *newcomm = NULL;
  ncclResult_t r = check_config(config);
  if (r) return r;
  struct split_rec mine = {.color = color, .key = key}, *all = calloc((size_t)comm->nranks, sizeof mine);
  if (!all) return sn_fail(ncclSystemError, "out of memory");
  int lfd = -1;
  if (color != NCCL_SPLIT_NOCOLOR && (lfd = sn_listen(comm->ip, &mine.addr)) < 0) {
    r = sn_fail(ncclSystemError, "cannot listen: %s", strerror(errno));
    mine.color = NCCL_SPLIT_NOCOLOR;  /* still take part, or the other ranks would hang */
  }
  struct sn_sub sub = {.type = SN_ALLGATHER, .sbuf = &mine, .rbuf = all, .count = sizeof mine,
                       .dt = ncclUint8, .stream = &split_stream};
  uint64_t seq = 0;
  uint64_t tag = mix64(comm->tag ^ ((uint64_t)comm->nsplits++ << 32) ^ (uint32_t)color);
  ncclResult_t r2 = sn_enqueue(comm, &sub, 1, &seq);
  if (!r2) r2 = sn_wait(comm, seq);
  if (r || r2 || color == NCCL_SPLIT_NOCOLOR) {
    if (lfd >= 0) close(lfd);
    free(all);
    return r ? r : r2;
  }
  /* members of my color, ordered by (key, parent rank) */
  int n = 0, me = 0;
  int* order = malloc(sizeof(int) * (size_t)comm->nranks);
  struct sn_addr* addrs = malloc(sizeof *addrs * (size_t)comm->nranks);
  struct ncclComm* c = calloc(1, sizeof *c);
  if (!order || !addrs || !c) {
    r = sn_fail(ncclSystemError, "out of memory");
    goto out;
  }
  for (int p = 0; p < comm->nranks; p++) {
    if (all[p].color != color) continue;
    int i = n++;
    while (i > 0 && all[order[i - 1]].key > all[p].key) {
      order[i] = order[i - 1];
      i--;
    }
    order[i] = p;
  }
  for (int i = 0; i < n; i++) {
    addrs[i] = all[order[i]].addr;
    if (order[i] == comm->rank) me = i;
  }
  c->rank = me;
  c->nranks = n;
  c->ip = comm->ip;
  c->tag = tag;
  r = sn_mesh(c, addrs, lfd);
  if (!r) r = sn_comm_start(c);
  if (!r) {
    *newcomm = c;
    c = NULL;
  }
out:
  if (c) comm_free(c);
  close(lfd);
  free(order);
  free(addrs);
  free(all);
  return r;
}

SN_API ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (!sn_comm_valid(comm)) return sn_fail(ncclInvalidArgument, "invalid communicator");
  return (ncclResult_t)standinCommSynchronize(comm);
}

SN_API ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  if (!sn_comm_valid(comm)) return sn_fail(ncclInvalidArgument, "invalid communicator");
  comm_stop(comm, 0);
  comm_free(comm);
  return ncclSuccess;
}

SN_API ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  if (!sn_comm_valid(comm)) return sn_fail(ncclInvalidArgument, "invalid communicator");
  comm_stop(comm, 1);
  comm_free(comm);
  return ncclSuccess;
}

SN_API ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (!sn_comm_valid(comm) || !count) return sn_fail(ncclInvalidArgument, "invalid argument");
  *count = comm->nranks;
  return ncclSuccess;
}

SN_API ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (!sn_comm_valid(comm) || !rank) return sn_fail(ncclInvalidArgument, "invalid argument");
  *rank = comm->rank;
  return ncclSuccess;
}

SN_API ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (!sn_comm_valid(comm) || !device) return sn_fail(ncclInvalidArgument, "invalid argument");
  *device = 0;
  return ncclSuccess;
}

SN_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  if (!sn_comm_valid(comm) || !asyncError) return sn_fail(ncclInvalidArgument, "invalid argument");
  pthread_mutex_lock(&comm->mu);
  *asyncError = comm->err;
  pthread_mutex_unlock(&comm->mu);
  return ncclSuccess;
}

SN_API const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

SN_API const char* ncclGetLastError(ncclComm_t comm) {
  if (sn_comm_valid(comm) && comm->err) return comm->errmsg;
  return sn_lasterr;
}

SN_API ncclResult_t ncclCommRegister(const ncclComm_t comm, void* buff, size_t size, void** handle) {
  (void)size;
  if (!sn_comm_valid(comm) || !handle) return sn_fail(ncclInvalidArgument, "invalid argument");
  *handle = buff ? buff : (void*)comm;  /* host memory needs no registration */
  return ncclSuccess;
}

SN_API ncclResult_t ncclCommDeregister(const ncclComm_t comm, void* handle) {
  (void)handle;
  if (!sn_comm_valid(comm)) return sn_fail(ncclInvalidArgument, "invalid communicator");
  return ncclSuccess;
}

SN_API ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
                                             ncclScalarResidence_t residence, ncclComm_t comm) {
  (void)op, (void)scalar, (void)datatype, (void)residence, (void)comm;
  return sn_fail(ncclInvalidUsage, "the stand-in has no user-defined reduction operators");
}

SN_API ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm) {
  (void)op, (void)comm;
  return sn_fail(ncclInvalidUsage, "the stand-in has no user-defined reduction operators");
}
