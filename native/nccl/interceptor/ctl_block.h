/* The control block shared by the interceptor (in a worker) and the agent: a file mapped
 * MAP_SHARED by both (path from CRYOSLEEP_NCCL_CTL). docs/interceptor.md is the contract; this
 * header is its C form, and the offsets below are checked at compile time so the two agree.
 *
 * All integers are little-endian and naturally aligned. "I" marks fields only the interceptor
 * writes, "A" fields only the agent writes; "I/A" is explained where it appears. */
#ifndef CRYOSLEEP_CTL_BLOCK_H
#define CRYOSLEEP_CTL_BLOCK_H

#include <stddef.h>
#include <stdint.h>

#define CS_CTL_MAGIC 0x4c43434e4f595243ull  /* the bytes "CRYONCCL" */
#define CS_CTL_VERSION 1
#define CS_MAX_COMMS 64                     /* communicator slots */
#define CS_MAX_PEERS 64                     /* send/recv counted for peers 0..63 of a communicator */
#define CS_HEADER_SIZE 4096
#define CS_SLOT_SIZE 2560
#define CS_BLOCK_SIZE (CS_HEADER_SIZE + CS_MAX_COMMS * CS_SLOT_SIZE)  /* 167936 bytes */

/* The command word (A): low 32 bits a command, high 32 bits its generation. */
enum cs_cmd {
  CS_CMD_RUN = 1, CS_CMD_HOLD = 2, CS_CMD_QUIESCE = 3, CS_CMD_REBUILD = 4,
  CS_CMD_PREPARE = 5,  /* fast path: grow the pinned staging file to hold the device memory (job running) */
  CS_CMD_OFFLOAD = 6,  /* fast path, when QUIESCED: copy device memory out, release it */
  CS_CMD_RELOAD = 7    /* fast path: device memory back at the same addresses (REBUILD and RUN imply it) */
};

/* The state word (I): low 32 bits a state, high 32 bits the generation of the command it answers. */
enum cs_state {
  CS_ST_INIT = 0,        /* block being initialized */
  CS_ST_RUNNING = 1,     /* real communicators live, gate open */
  CS_ST_HOLDING = 2,     /* HOLD seen: calls beyond the targets are held */
  CS_ST_QUIESCING = 3,   /* waiting for threads to leave NCCL, then destroying communicators */
  CS_ST_QUIESCED = 4,    /* no real communicator exists; every gated call is held */
  CS_ST_REBUILDING = 5,  /* re-creating communicators */
  CS_ST_ERROR = 6,       /* the command failed; error[] says why (see the doc for what is left) */
  CS_ST_PREPARED = 7,    /* PREPARE done: stage_bytes >= devmem_bytes */
  CS_ST_OFFLOADED = 8    /* OFFLOAD done: device memory is in the staging file, released on the GPU */
};

/* Features the agent's check refuses to snapshot (flags, sticky: once set they stay; except
 * CS_F_CUDA_IPC, which is set only while a CUDA IPC import is open). */
enum cs_flag {
  CS_F_INIT_ALL = 1u << 0,       /* ncclCommInitAll: several devices in one process */
  CS_F_SHRINK = 1u << 1,         /* ncclCommShrink: not replayed */
  CS_F_WINDOW = 1u << 2,         /* ncclCommWindowRegister: symmetric windows are not re-registered */
  CS_F_TOO_MANY_COMMS = 1u << 3, /* more than CS_MAX_COMMS live communicators: some are not tracked */
  CS_F_PEERS_CAPPED = 1u << 4,   /* send/recv with a peer >= CS_MAX_PEERS: not counted */
  CS_F_TOO_MANY_REGS = 1u << 5,  /* buffer registrations beyond the table: not re-registered */
  CS_F_TOO_MANY_SPLITS = 1u << 6,/* split history beyond the table: not replayable */
  CS_F_NO_REAL_NCCL = 1u << 7,   /* the real NCCL could not be resolved */
  CS_F_UNTRACKED_COMM = 1u << 8, /* a communicator created outside the table (InitAll, Shrink, overflow) */
  CS_F_CUDA_IPC = 1u << 9        /* another process's GPU memory is open here (cudaIpcOpenMemHandle) */
};

/* Why device memory is left to the driver's checkpoint rather than moved by the fast path (left_flags). */
enum cs_left {
  CS_LEFT_EXPORTED = 1u << 0, /* a cuMemCreate handle exported to another process (cuMemExportToShareableHandle) */
  CS_LEFT_PARTIAL = 1u << 1,  /* a cuMemCreate handle not mapped whole at offset 0 */
  CS_LEFT_UNMAPPED = 1u << 2, /* a cuMemCreate handle not mapped at all */
  CS_LEFT_FOREIGN = 1u << 3,  /* a mapping of a handle created elsewhere (imported from another process) */
  CS_LEFT_POOL = 1u << 4,     /* cudaMallocAsync: the driver's pool owns those addresses */
  CS_LEFT_SMALL = 1u << 5,    /* cudaMalloc under 1 MiB (served by cudaMalloc: the slab off or full) */
  CS_LEFT_NO_ACCESS = 1u << 6 /* a cuMemCreate handle mapped whole, but no access granted on it (cuMemSetAccess) */
};

/* How the staging arena was made (arena_how). */
enum cs_arena {
  CS_ARENA_PREFAULTED = 1u << 0, /* faulted in (MADV_POPULATE_WRITE) before pinning, outside the driver's lock */
  CS_ARENA_HUGE = 1u << 1,       /* madvise(MADV_HUGEPAGE) on it, with tmpfs huge pages enabled (shmem_enabled) */
  CS_ARENA_EARLY = 1u << 2       /* made by the control thread at the first served allocation, ahead of any snapshot */
};

/* Per-communicator flags (slot.flags, I). */
enum cs_comm_flag { CS_CF_NONBLOCKING = 1u << 0, CS_CF_REGISTERED = 1u << 1, CS_CF_PEERS_CAPPED = 1u << 2 };

/* What a thread held on a communicator is waiting to issue (slot.waiting_kind). */
enum cs_wait_kind { CS_WAIT_NONE = 0, CS_WAIT_COLL = 1, CS_WAIT_SEND = 2, CS_WAIT_RECV = 3 };

enum cs_slot_state { CS_SLOT_FREE = 0, CS_SLOT_LIVE = 1, CS_SLOT_FINALIZED = 2 };
enum cs_rebuild { CS_REBUILD_ID = 1, CS_REBUILD_SPLIT = 2 };

struct cs_ctl_comm {            /* one communicator slot: CS_SLOT_SIZE bytes */
  uint32_t state;               /* I  cs_slot_state; LIVE/FINALIZED is written last */
  uint32_t vid;                 /* I  virtual id: 1, 2, ... in creation order, per process */
  uint64_t ident;               /* I  the same on every member: the key to match slots across ranks */
  int32_t rank, nranks;         /* I */
  uint32_t parent_vid;          /* I  0, or the vid of the communicator it was split from */
  int32_t color, key;           /* I  the split's arguments */
  uint32_t rebuild;             /* I  cs_rebuild: how REBUILD re-creates it */
  uint32_t flags;               /* I  cs_comm_flag */
  int32_t device;               /* I  CUDA device, -1 if unknown */
  uint64_t seq;                 /* I  collectives admitted so far */
  uint64_t coll_target;         /* A  HOLD: admit a collective while seq < coll_target */
  uint32_t uid_gen;             /* I/A  generation of uid[]: rank 0 writes its own, the agent the others' */
  uint32_t waiting;             /* I  threads held right now at a collective/send/recv on this communicator */
  uint32_t waiting_kind;        /* I  the latest such call: cs_wait_kind */
  int32_t waiting_peer;         /* I  its peer (send/recv), else -1 */
  uint8_t reserved1[48];
  uint8_t uid[128];             /* I/A  fresh ncclUniqueId for REBUILD (rebuild == CS_REBUILD_ID) */
  uint8_t reserved2[256];
  uint64_t send[CS_MAX_PEERS];  /* I  ncclSend calls admitted, per peer */
  uint64_t recv[CS_MAX_PEERS];  /* I  ncclRecv calls admitted, per peer */
  uint64_t send_target[CS_MAX_PEERS];  /* A  HOLD: admit a send to p while send[p] < send_target[p] */
  uint64_t recv_target[CS_MAX_PEERS];  /* A */
};

struct cs_ctl {                 /* the header: CS_HEADER_SIZE bytes, then the slots */
  uint64_t magic;               /* I  CS_CTL_MAGIC, written last when the block is (re)published */
  uint32_t version;             /* I  CS_CTL_VERSION */
  uint32_t block_size;          /* I  CS_BLOCK_SIZE */
  uint32_t header_size;         /* I  CS_HEADER_SIZE */
  uint32_t slot_size;           /* I  CS_SLOT_SIZE */
  uint32_t max_comms;           /* I  CS_MAX_COMMS */
  uint32_t max_peers;           /* I  CS_MAX_PEERS */
  uint64_t cmd;                 /* A  command | generation << 32 */
  uint64_t state;               /* I  state | generation << 32 */
  uint64_t hold_deadline_ns;    /* A  CLOCK_MONOTONIC ns: a HOLD still in force then is released; 0 never */
  uint32_t pid;                 /* I  getpid() of the worker */
  uint32_t flags;               /* I  cs_flag */
  uint32_t held;                /* I  threads held at the gate right now */
  uint32_t busy;                /* I  threads inside a real NCCL call (refreshed by the control thread) */
  uint32_t in_group;            /* I  threads between their outermost ncclGroupStart and ncclGroupEnd (same) */
  uint32_t slots_used;          /* I  1 + the highest slot index ever used */
  uint64_t heartbeat;           /* I  incremented by the control thread every poll */
  uint32_t premul_live;         /* I  ncclRedOpCreatePreMulSum operators not yet destroyed */
  uint32_t nccl_version;        /* I  the real ncclGetVersion() */
  uint32_t control_thread;      /* I  1 when a control thread serves this block */
  uint32_t comms_live;          /* I  1 while real communicators exist, 0 once quiesced */
  uint32_t targets_gen;         /* A  bumped after each change of the HOLD targets */
  uint32_t settled_gen;         /* I  the targets_gen that `settled` was computed against */
  uint32_t settled;             /* I  HOLD: 1 = every counter >= its target, no thread in NCCL or a group */
  uint32_t devmem_on;           /* I  1: cudaMalloc is served with the VMM API (CRYOSLEEP_DEVMEM=1, devmem.c) */
  uint64_t devmem_bytes;        /* I  device memory served so, now */
  uint64_t stage_bytes;         /* I  size of the pinned staging file prepared */
  uint64_t offload_bytes;       /* I  bytes copied out by the last OFFLOAD */
  uint32_t devmem_count;        /* I  allocations served so, now */
  uint32_t offloaded;           /* I  1 between OFFLOAD and RELOAD: the device memory lives in the staging file */
  uint64_t offload_ns;          /* I  the last OFFLOAD's copy, ns */
  uint64_t reload_ns;           /* I  the last RELOAD's, ns */
  uint64_t vmm_bytes;           /* I  memory the application mapped itself (cuMemCreate) that the fast path moves */
  uint32_t vmm_count;           /* I  in that many handles */
  uint32_t left_flags;          /* I  cs_left: why some device memory is left to the driver's checkpoint */
  uint64_t left_vmm_bytes;      /* I  application-mapped memory left to the driver (exported, imported, ...) */
  uint32_t left_vmm_count;      /* I */
  uint32_t async_count;         /* I  cudaMallocAsync allocations live (left to the driver) */
  uint64_t async_bytes;         /* I */
  uint64_t small_bytes;         /* I  cudaMalloc under 1 MiB live (left to the driver) */
  uint32_t small_count;         /* I */
  uint32_t arena_how;           /* I  cs_arena: how the staging arena was made and pinned */
  uint64_t arena_prefault_ns;   /* I  faulting the arena in before pinning, ns (all PREPAREs) */
  uint64_t arena_pin_ns;        /* I  cuMemHostRegister of it, ns (all PREPAREs) */
  uint64_t arena_piece;         /* I  the pinned pieces' size */
  uint32_t arena_pins;          /* I  cuMemHostRegister calls made */
  uint32_t slab_count;          /* I  cudaMalloc under 1 MiB served from the slab's chunks (moved), live */
  char error[256];              /* I  NUL-terminated: why the last command failed */
  char stage_path[256];         /* I  the staging file (NUL-terminated), once PREPARE made it */
  uint8_t reserved2[CS_HEADER_SIZE - 768];
};

#define CS_SLOT(ctl, i) ((struct cs_ctl_comm*)((char*)(ctl) + CS_HEADER_SIZE + (size_t)(i) * CS_SLOT_SIZE))

_Static_assert(sizeof(struct cs_ctl) == CS_HEADER_SIZE, "header size");
_Static_assert(sizeof(struct cs_ctl_comm) == CS_SLOT_SIZE, "slot size");
_Static_assert(offsetof(struct cs_ctl, cmd) == 32 && offsetof(struct cs_ctl, state) == 40, "cmd/state");
_Static_assert(offsetof(struct cs_ctl, hold_deadline_ns) == 48 && offsetof(struct cs_ctl, pid) == 56, "hdr");
_Static_assert(offsetof(struct cs_ctl, held) == 64 && offsetof(struct cs_ctl, heartbeat) == 80, "hdr2");
_Static_assert(offsetof(struct cs_ctl, premul_live) == 88 && offsetof(struct cs_ctl, error) == 256, "hdr3");
_Static_assert(offsetof(struct cs_ctl, comms_live) == 100 && offsetof(struct cs_ctl, settled) == 112, "hdr4");
_Static_assert(offsetof(struct cs_ctl, devmem_on) == 116 && offsetof(struct cs_ctl, devmem_bytes) == 120 &&
               offsetof(struct cs_ctl, offloaded) == 148 && offsetof(struct cs_ctl, reload_ns) == 160 &&
               offsetof(struct cs_ctl, stage_path) == 512, "devmem");
_Static_assert(offsetof(struct cs_ctl, vmm_bytes) == 168 && offsetof(struct cs_ctl, left_flags) == 180 &&
               offsetof(struct cs_ctl, async_bytes) == 200 && offsetof(struct cs_ctl, small_count) == 216 &&
               offsetof(struct cs_ctl, arena_how) == 220 && offsetof(struct cs_ctl, arena_pins) == 248 && offsetof(struct cs_ctl, slab_count) == 252 &&
               offsetof(struct cs_ctl, error) == 256, "devmem2");
_Static_assert(offsetof(struct cs_ctl_comm, seq) == 48 && offsetof(struct cs_ctl_comm, uid_gen) == 64, "slot");
_Static_assert(offsetof(struct cs_ctl_comm, waiting) == 68 && offsetof(struct cs_ctl_comm, waiting_peer) == 76, "w");
_Static_assert(offsetof(struct cs_ctl_comm, uid) == 128 && offsetof(struct cs_ctl_comm, send) == 512, "slot2");
_Static_assert(offsetof(struct cs_ctl_comm, recv) == 1024 && offsetof(struct cs_ctl_comm, send_target) == 1536,
               "slot3");
_Static_assert(offsetof(struct cs_ctl_comm, recv_target) == 2048, "slot4");

#endif
