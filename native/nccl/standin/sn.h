/* The CPU stand-in NCCL: NCCL's API on host memory over TCP, for tests without a GPU.
 *
 * Every communicator owns a mesh of TCP connections (one per peer) and a progress thread that
 * executes a FIFO of tasks: API calls enqueue and return before any data moves, and
 * standinStreamSynchronize() / standinCommSynchronize() wait. As on a GPU, tasks given the same
 * stream run one after the other in the order they were enqueued, even on different
 * communicators (each task waits for its predecessors on its streams). Reductions run in
 * rank order on every rank, so results are bit-identical whatever the timing. */
#ifndef CRYOSLEEP_STANDIN_H
#define CRYOSLEEP_STANDIN_H

#include <nccl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#define SN_COMM_MAGIC 0x53544e43u  /* "CNTS": a live stand-in communicator */
#define SN_ID_MAGIC "SNCCLID"      /* first bytes of a stand-in ncclUniqueId */

/* Sub-operation types: one NCCL call each. SN_ALLGATHER_RAW is internal (split's exchange). */
enum sn_type {
  SN_ALLREDUCE, SN_REDUCE, SN_BROADCAST, SN_ALLGATHER, SN_REDUCESCATTER,
  SN_ALLTOALL, SN_GATHER, SN_SCATTER, SN_SEND, SN_RECV
};

struct sn_sub {
  enum sn_type type;
  const void* sbuf;
  void* rbuf;
  size_t count;          /* elements: per rank for allgather/reducescatter/alltoall/gather/scatter */
  ncclDataType_t dt;
  ncclRedOp_t op;
  int root;              /* root rank, or the peer of send/recv */
  void* stream;
  char* scratch;         /* allocated when the task runs */
};

/* One message of a task: sent to or received from one peer. Messages to one peer go in the order
 * they were planned; messages to different peers progress together (no deadlock on big buffers). */
struct sn_xfer {
  int peer;
  int send;              /* 1 send, 0 receive */
  char* buf;
  size_t len;
  size_t done;           /* bytes moved, header included */
  unsigned char hdr[16]; /* wire header: magic, length */
};

struct sn_task {
  struct sn_task* next;
  uint64_t seqno;
  int nsub;
  struct sn_sub* subs;
  int nstreams;          /* distinct stream keys of the subs, each with this task's place on it */
  void** streams;
  uint64_t* tickets;
};

struct ncclComm {
  uint32_t magic;
  int rank, nranks;
  int device;
  uint64_t tag;          /* identifies this communicator's connections */
  int* fds;              /* fds[peer], -1 for self */
  int nsplits;           /* ncclCommSplit calls so far (derives the child's tag) */
  struct in_addr ip;     /* address this rank listens on for its meshes */

  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct sn_task *head, *tail;
  uint64_t enqueued, completed;
  int stopping, aborting;
  pthread_t thread;
  ncclResult_t err;      /* sticky asynchronous error */
  char errmsg[256];
};

/* comm.c */
ncclResult_t sn_fail(ncclResult_t r, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
double sn_timeout_s(void);
ncclResult_t sn_comm_start(struct ncclComm* c);
ncclResult_t sn_enqueue(struct ncclComm* c, struct sn_sub* subs, int nsub, uint64_t* seqno);
ncclResult_t sn_wait(struct ncclComm* c, uint64_t seqno);
int sn_comm_valid(const struct ncclComm* c);

/* net.c */
struct sn_addr { uint32_t ip; uint16_t port; uint16_t pad; };  /* network byte order */
struct in_addr sn_local_ip(void);
int sn_listen(struct in_addr ip, struct sn_addr* bound);
ncclResult_t sn_make_id(ncclUniqueId* id);
ncclResult_t sn_join(struct ncclComm* c, const ncclUniqueId* id);
ncclResult_t sn_mesh(struct ncclComm* c, const struct sn_addr* addrs, int listen_fd);
ncclResult_t sn_xfer_run(struct ncclComm* c, struct sn_xfer* x, int n);
uint64_t sn_random64(void);

/* ops.c */
ncclResult_t sn_run_task(struct ncclComm* c, struct sn_task* t);
size_t sn_type_size(ncclDataType_t dt);

#endif
