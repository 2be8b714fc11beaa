"""The NCCL interceptor's control block, read and written from Python: the agent's side of the file.

docs/interceptor.md is the contract and ``native/nccl/interceptor/ctl_block.h`` its C form; this module
follows both (tests/unit/test_interceptor_block.py compiles the header and compares every offset). A
block is a file of ``BLOCK_SIZE`` bytes that the worker's interceptor maps ``MAP_SHARED``; the agent maps
the same file. Aligned 4- and 8-byte fields are read and written with single loads and stores (through
ctypes on the mapping), never as slice copies, so that neither side sees a torn value.

This module only reads and writes fields. The decisions (targets of the cut) are in ``cryosleep.cut``;
the sequence of commands (drain, quiesce, rebuild) is ``cryosleep.cut.driver``.
"""

from __future__ import annotations

import ctypes
import enum
import mmap
import os
import struct
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from cryosleep.core import users
from cryosleep.errors import InterceptorError

__all__ = [
    "BLOCK_SIZE",
    "FLAG_REASONS",
    "MAX_COMMS",
    "MAX_PEERS",
    "Cmd",
    "CommSlot",
    "ControlBlock",
    "Rebuild",
    "SlotState",
    "State",
    "WaitKind",
    "attach_published",
    "flag_reasons",
]

MAGIC = int.from_bytes(b"CRYONCCL", "little")
VERSION = 1
HEADER_SIZE, SLOT_SIZE, MAX_COMMS, MAX_PEERS = 4096, 2560, 64, 64
BLOCK_SIZE = HEADER_SIZE + MAX_COMMS * SLOT_SIZE  # 167936
UID_SIZE = 128


class Cmd(enum.IntEnum):
    """The command word's low 32 bits (written by the agent)."""

    RUN = 1
    HOLD = 2
    QUIESCE = 3
    REBUILD = 4
    PREPARE = 5  # the fast path: grow the pinned staging file to the device memory (job running)
    OFFLOAD = 6  # the fast path, when QUIESCED: device memory copied into the staging file and released
    RELOAD = 7  # the fast path: device memory back at its addresses (REBUILD and RUN imply it)


class State(enum.IntEnum):
    """The state word's low 32 bits (written by the interceptor)."""

    INIT = 0
    RUNNING = 1
    HOLDING = 2
    QUIESCING = 3
    QUIESCED = 4
    REBUILDING = 5
    ERROR = 6
    PREPARED = 7
    OFFLOADED = 8


class SlotState(enum.IntEnum):
    FREE = 0
    LIVE = 1
    FINALIZED = 2


class Rebuild(enum.IntEnum):
    """How REBUILD re-creates a communicator."""

    FROM_ID = 1  # from a fresh unique id that the agent relays from the member of rank 0
    SPLIT = 2  # replayed as a split of its parent: nothing for the agent to do


class WaitKind(enum.IntEnum):
    """What a thread held on a communicator waits to issue (slot ``waiting_kind``)."""

    NONE = 0
    COLL = 1
    SEND = 2
    RECV = 3


# The header's `flags` bits: features that make a snapshot unsafe (docs/interceptor.md, "Check").
FLAG_REASONS: dict[int, str] = {
    0x001: "ncclCommInitAll was used: one process drives several devices, which is not rebuilt",
    0x002: "ncclCommShrink was used: shrunk communicators are not replayed",
    0x004: "ncclCommWindowRegister was used: symmetric windows are not re-registered",
    0x008: "more than 64 live communicators: some are not tracked",
    0x010: "ncclSend/ncclRecv with a peer >= 64: not counted, so no cut can be computed",
    0x020: "more than 1024 buffer registrations: the excess would not be re-registered",
    0x040: "more than 256 communicator splits: they cannot all be replayed",
    0x080: "the interceptor could not find the real NCCL library",
    0x100: "a communicator exists that the interceptor does not track",
    0x200: "GPU memory of another process is open (CUDA IPC, e.g. CUDA tensors shared through "
           "torch.multiprocessing): the driver checkpoints such a process but cannot restore it",
}

# Slot `flags` bits (informational).
COMM_NONBLOCKING, COMM_REGISTERED, COMM_PEERS_CAPPED = 0x1, 0x2, 0x4

# Header offsets.
H_MAGIC, H_VERSION, H_BLOCK_SIZE, H_HEADER_SIZE, H_SLOT_SIZE, H_MAX_COMMS, H_MAX_PEERS = 0, 8, 12, 16, 20, 24, 28
H_CMD, H_STATE, H_DEADLINE, H_PID, H_FLAGS = 32, 40, 48, 56, 60
H_HELD, H_BUSY, H_IN_GROUP, H_SLOTS_USED, H_HEARTBEAT = 64, 68, 72, 76, 80
H_PREMUL, H_NCCL_VERSION, H_CONTROL, H_COMMS_LIVE = 88, 92, 96, 100
H_TARGETS_GEN, H_SETTLED_GEN, H_SETTLED, H_ERROR = 104, 108, 112, 256
H_DEVMEM_ON, H_DEVMEM_BYTES, H_STAGE_BYTES, H_OFFLOAD_BYTES, H_DEVMEM_COUNT = 116, 120, 128, 136, 144
H_OFFLOADED, H_OFFLOAD_NS, H_RELOAD_NS, H_STAGE_PATH = 148, 152, 160, 512
H_VMM_BYTES, H_VMM_COUNT, H_LEFT_FLAGS, H_LEFT_VMM_BYTES, H_LEFT_VMM_COUNT = 168, 176, 180, 184, 192
H_ASYNC_COUNT, H_ASYNC_BYTES, H_SMALL_BYTES, H_SMALL_COUNT = 196, 200, 208, 216
H_ARENA_HOW, H_ARENA_PREFAULT_NS, H_ARENA_PIN_NS, H_ARENA_PIECE, H_ARENA_PINS = 220, 224, 232, 240, 248
H_SLAB_COUNT = 252
ERROR_SIZE = STAGE_PATH_SIZE = 256
# Slot offsets.
S_STATE, S_VID, S_IDENT, S_RANK, S_NRANKS, S_PARENT, S_COLOR, S_KEY = 0, 4, 8, 16, 20, 24, 28, 32
S_REBUILD, S_FLAGS, S_DEVICE, S_SEQ, S_COLL_TARGET, S_UID_GEN = 36, 40, 44, 48, 56, 64
S_WAITING, S_WAITING_KIND, S_WAITING_PEER, S_UID = 68, 72, 76, 128
S_SEND, S_RECV, S_SEND_TARGET, S_RECV_TARGET = 512, 1024, 1536, 2048

_U32 = 0xFFFFFFFF


class DevmemPlan(TypedDict, total=False):
    """What a snapshot of a rank takes with the fast path (:meth:`DevMem.plan`: the manifest's record of each
    rank, and `check --job --json`'s)."""

    moved_bytes: int
    """Device memory the interceptor moves itself."""
    served: dict[str, int]
    """What it served through cudaMalloc: bytes, count, small (allocations from its slabs)."""
    mapped: dict[str, int]
    """The application's own cuMemCreate/cuMemMap memory it moves: bytes, count."""
    left: list[dict[str, Any]]
    """Left to the driver's checkpoint, per kind: kind, bytes, count, why."""
    arena: dict[str, Any]
    """The staging arena: its bytes, and how it was made and pinned (:meth:`DevMem.arena`)."""


@dataclass(frozen=True)
class DevMem:
    """A worker's device memory as the fast path sees it (docs/interceptor.md, "The fast path")."""

    on: bool  # cudaMalloc is served with the VMM API
    bytes: int  # device memory served so
    count: int  # in that many allocations
    stage_bytes: int  # the pinned staging file's size (0: not prepared)
    stage_path: str
    offloaded: bool  # the memory is in the staging file now
    offload_bytes: int  # copied out by the last OFFLOAD
    offload_s: float
    reload_s: float
    vmm_bytes: int = 0  # memory the application mapped itself (cuMemCreate/cuMemMap) that the fast path moves
    vmm_count: int = 0
    left_flags: int = 0  # LEFT_*: why some device memory is left to the driver's checkpoint
    left_vmm_bytes: int = 0  # application-mapped memory left to the driver
    left_vmm_count: int = 0
    async_bytes: int = 0  # cudaMallocAsync memory live (left to the driver)
    async_count: int = 0
    small_bytes: int = 0  # cudaMalloc under 1 MiB live (left to the driver)
    small_count: int = 0
    arena_how: int = 0  # ARENA_*: how the staging arena was made and pinned
    arena_prefault_s: float = 0.0
    arena_pin_s: float = 0.0
    arena_piece: int = 0
    arena_pins: int = 0
    slab_count: int = 0  # cudaMalloc under 1 MiB served from shared 2 MiB chunks (among ``count``'s), live

    @property
    def moved_bytes(self) -> int:
        """What the fast path moves itself: the memory it serves and the application's own mappings."""
        return self.bytes + self.vmm_bytes

    def left(self) -> list[tuple[str, int, int, str]]:
        """What is left to the driver's checkpoint: (kind, bytes, allocations, why), one row per kind."""
        out: list[tuple[str, int, int, str]] = []
        if self.left_vmm_count:
            why = "; ".join(text for bit, text in LEFT_REASONS.items() if self.left_flags & bit)
            out.append(("mapped by the application", self.left_vmm_bytes, self.left_vmm_count, why))
        if self.async_count:
            out.append(("cudaMallocAsync", self.async_bytes, self.async_count, LEFT_REASONS[LEFT_POOL]))
        if self.small_count:
            out.append(("cudaMalloc under 1 MiB", self.small_bytes, self.small_count, LEFT_REASONS[LEFT_SMALL]))
        return out

    def plan(self) -> DevmemPlan:
        """What a snapshot of this rank takes (the manifest's record, `check --job --json`'s): moved by the fast
        path, left to the driver's checkpoint with why, and the staging arena."""
        return {"moved_bytes": self.moved_bytes,
                "served": {"bytes": self.bytes, "count": self.count, "small": self.slab_count},
                "mapped": {"bytes": self.vmm_bytes, "count": self.vmm_count},
                "left": [{"kind": k, "bytes": n, "count": c, "why": why} for k, n, c, why in self.left()],
                "arena": {"bytes": self.stage_bytes, **self.arena()}}

    def arena(self) -> dict[str, object]:
        """How the staging arena was made and pinned (the manifest's and `check --job`'s record)."""
        return {"prefaulted": bool(self.arena_how & ARENA_PREFAULTED), "huge_pages": bool(self.arena_how & ARENA_HUGE),
                "early": bool(self.arena_how & ARENA_EARLY), "prefault_s": round(self.arena_prefault_s, 4),
                "pin_s": round(self.arena_pin_s, 4), "piece_bytes": self.arena_piece, "pins": self.arena_pins}


# Why device memory is left to the driver (ctl_block.h, enum cs_left), and how the arena was made (cs_arena).
LEFT_EXPORTED, LEFT_PARTIAL, LEFT_UNMAPPED, LEFT_FOREIGN, LEFT_POOL, LEFT_SMALL, LEFT_NO_ACCESS = 1, 2, 4, 8, 16, 32, 64
LEFT_REASONS = {
    LEFT_EXPORTED: "a handle was exported to another process (cuMemExportToShareableHandle): its peer's mapping "
                   "would lose it",
    LEFT_PARTIAL: "a handle is not mapped whole at offset 0: there is no single range to copy it through",
    LEFT_UNMAPPED: "a handle is not mapped at all",
    LEFT_FOREIGN: "a mapping of a handle created elsewhere (imported from another process)",
    LEFT_NO_ACCESS: "a handle is mapped but no access was granted on it (cuMemSetAccess): nothing may read it",
    LEFT_POOL: "the driver's stream-ordered pool owns these addresses: they cannot be released and mapped again "
               "from outside it",
    LEFT_SMALL: "served by cudaMalloc: the slab's chunks were full or off (CRYOSLEEP_DEVMEM_SMALL=0), and a VMM "
                "allocation each would take a whole 2 MiB granule",
}
ARENA_PREFAULTED, ARENA_HUGE, ARENA_EARLY = 1, 2, 4


def attach_published(ctl: Mapping[int, Path], pids: Collection[int] | None = None) -> dict[int, ControlBlock]:
    """The blocks (job rank -> block) that a worker has published, and (given ``pids``, the sandbox's PIDs
    as seen inside its namespace) whose worker is one of those processes. A rank without a file has not
    called NCCL; a block of a process that is gone is left alone."""
    out: dict[int, ControlBlock] = {}
    for rank, path in sorted(ctl.items()):
        try:
            if os.stat(path).st_size < BLOCK_SIZE:
                continue
            block = ControlBlock(path)
        except (OSError, InterceptorError):
            continue
        if block.published() and (pids is None or block.pid in pids):
            out[rank] = block
        else:
            block.close()
    return out


def flag_reasons(flags: int) -> list[str]:
    """The reasons, one per refused feature, that the header's ``flags`` word names."""
    out = [why for bit, why in FLAG_REASONS.items() if flags & bit]
    unknown = flags & ~sum(FLAG_REASONS)
    if unknown:
        out.append(f"unknown interceptor flags {unknown:#x} (a newer interceptor than this agent)")
    return out


def split_word(word: int) -> tuple[int, int]:
    """A command or state word: (low 32 bits, generation)."""
    return word & _U32, word >> 32


@dataclass(frozen=True)
class CommSlot:
    """One communicator slot, as read at one moment. Per-peer lists hold ``min(nranks, MAX_PEERS)`` entries."""

    index: int
    state: int
    vid: int
    ident: int
    rank: int
    nranks: int
    parent_vid: int
    color: int
    key: int
    rebuild: int
    flags: int
    device: int
    seq: int
    coll_target: int
    uid_gen: int
    waiting: int
    waiting_kind: int
    waiting_peer: int
    send: tuple[int, ...]
    recv: tuple[int, ...]
    send_target: tuple[int, ...]
    recv_target: tuple[int, ...]

    @property
    def live(self) -> bool:
        return self.state == SlotState.LIVE


class ControlBlock:
    """One worker's control block, mapped ``MAP_SHARED`` as the interceptor maps it.

    Opening never writes. Nothing may be written before the block is published (``published()``):
    the interceptor initializes the whole block at its first NCCL call and would discard it.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:  # the worker's own file only (workers of their own user write in a directory of theirs)
            fd = users.open_owned(self.path, os.O_RDWR)
        except OSError as e:
            raise InterceptorError(f"cannot open the NCCL control block {self.path}", e.strerror or str(e),
                                   "check that the job runs under `cryosleep run` and that its job directory "
                                   "is intact") from e
        try:
            size = os.fstat(fd).st_size
            if size < BLOCK_SIZE:
                raise InterceptorError(f"the NCCL control block {self.path} is too small",
                                       f"{size} bytes, a block has {BLOCK_SIZE}",
                                       "the worker has not published it yet, or the file is not a control block")
            self.mm = mmap.mmap(fd, BLOCK_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    @classmethod
    def wait(cls, path: Path | str, pid: int | None = None, timeout: float = 10.0) -> ControlBlock:
        """Waits for the interceptor to create and publish the block (of process ``pid``: its own PID)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                block = cls(path)
                if block.published(pid):
                    return block
                block.close()
            except InterceptorError:
                pass
            if time.monotonic() > deadline:
                raise InterceptorError(f"no NCCL control block was published at {path} in {timeout:g} s",
                                       "the worker has not called NCCL yet, or runs without the interceptor",
                                       "see the worker's log")
            time.sleep(0.01)

    def close(self) -> None:
        self.mm.close()

    def __enter__(self) -> ControlBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- single aligned loads and stores -------------------------------------------------------------

    def u32(self, off: int) -> int:
        return int(ctypes.c_uint32.from_buffer(self.mm, off).value)

    def i32(self, off: int) -> int:
        return int(ctypes.c_int32.from_buffer(self.mm, off).value)

    def u64(self, off: int) -> int:
        return int(ctypes.c_uint64.from_buffer(self.mm, off).value)

    def w32(self, off: int, value: int) -> None:
        ctypes.c_uint32.from_buffer(self.mm, off).value = value

    def w64(self, off: int, value: int) -> None:
        ctypes.c_uint64.from_buffer(self.mm, off).value = value

    # ---- header ----------------------------------------------------------------------------------

    @property
    def magic_ok(self) -> bool:
        return self.u64(H_MAGIC) == MAGIC and self.u32(H_VERSION) == VERSION

    def published(self, pid: int | None = None) -> bool:
        """The interceptor has published this block (of process ``pid``, as seen in its PID namespace)."""
        return self.magic_ok and self.u32(H_BLOCK_SIZE) == BLOCK_SIZE and (pid is None or self.pid == pid)

    @property
    def pid(self) -> int:
        return self.u32(H_PID)

    def state(self) -> tuple[int, int]:
        """(state, generation of the command it answers)"""
        return split_word(self.u64(H_STATE))

    def cmd(self) -> tuple[int, int]:
        """(command, generation)"""
        return split_word(self.u64(H_CMD))

    def command(self, cmd: int, gen: int) -> None:
        """Writes the command word (one 8-byte store)."""
        if not 0 <= gen <= _U32:
            raise ValueError(f"generation {gen} out of range")
        self.w64(H_CMD, int(cmd) | gen << 32)

    def set_hold_deadline_ns(self, monotonic_ns: int) -> None:
        """``CLOCK_MONOTONIC`` time at which a HOLD still in force is released (0: never)."""
        self.w64(H_DEADLINE, monotonic_ns)

    def set_hold_deadline(self, seconds_from_now: float | None) -> None:
        self.set_hold_deadline_ns(0 if seconds_from_now is None else time.monotonic_ns() + int(seconds_from_now * 1e9))

    @property
    def flags(self) -> int:
        return self.u32(H_FLAGS)

    def flag_names(self) -> list[str]:
        return flag_reasons(self.flags)

    @property
    def held(self) -> int:
        return self.u32(H_HELD)

    @property
    def busy(self) -> int:
        return self.u32(H_BUSY)

    @property
    def in_group(self) -> int:
        return self.u32(H_IN_GROUP)

    @property
    def slots_used(self) -> int:
        return min(self.u32(H_SLOTS_USED), MAX_COMMS)

    @property
    def heartbeat(self) -> int:
        return self.u64(H_HEARTBEAT)

    @property
    def premul_live(self) -> int:
        return self.u32(H_PREMUL)

    @property
    def nccl_version(self) -> int:
        return self.u32(H_NCCL_VERSION)

    @property
    def control_thread(self) -> bool:
        return self.u32(H_CONTROL) == 1

    @property
    def comms_live(self) -> bool:
        return self.u32(H_COMMS_LIVE) == 1

    @property
    def targets_gen(self) -> int:
        return self.u32(H_TARGETS_GEN)

    def bump_targets_gen(self) -> int:
        """Tells the control thread the targets changed; returns the generation it must answer."""
        gen = (self.u32(H_TARGETS_GEN) + 1) & _U32
        self.w32(H_TARGETS_GEN, gen)
        return gen

    def settled(self) -> tuple[int, bool]:
        """(the targets_gen it was computed against, settled)"""
        gen = self.u32(H_SETTLED_GEN)
        return gen, self.u32(H_SETTLED) == 1

    @property
    def error(self) -> str:
        raw = self.mm[H_ERROR:H_ERROR + ERROR_SIZE]
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    # ---- the fast path's device memory (devmem.c) --------------------------------------------------

    @property
    def devmem(self) -> DevMem:
        raw = self.mm[H_STAGE_PATH:H_STAGE_PATH + STAGE_PATH_SIZE].split(b"\0", 1)[0].decode(errors="replace")
        return DevMem(on=self.u32(H_DEVMEM_ON) == 1, bytes=self.u64(H_DEVMEM_BYTES), count=self.u32(H_DEVMEM_COUNT),
                      stage_bytes=self.u64(H_STAGE_BYTES), stage_path=raw, offloaded=self.u32(H_OFFLOADED) == 1,
                      offload_bytes=self.u64(H_OFFLOAD_BYTES), offload_s=self.u64(H_OFFLOAD_NS) / 1e9,
                      reload_s=self.u64(H_RELOAD_NS) / 1e9, vmm_bytes=self.u64(H_VMM_BYTES),
                      vmm_count=self.u32(H_VMM_COUNT), left_flags=self.u32(H_LEFT_FLAGS),
                      left_vmm_bytes=self.u64(H_LEFT_VMM_BYTES), left_vmm_count=self.u32(H_LEFT_VMM_COUNT),
                      async_bytes=self.u64(H_ASYNC_BYTES), async_count=self.u32(H_ASYNC_COUNT),
                      small_bytes=self.u64(H_SMALL_BYTES), small_count=self.u32(H_SMALL_COUNT),
                      arena_how=self.u32(H_ARENA_HOW), arena_prefault_s=self.u64(H_ARENA_PREFAULT_NS) / 1e9,
                      arena_pin_s=self.u64(H_ARENA_PIN_NS) / 1e9, arena_piece=self.u64(H_ARENA_PIECE),
                      arena_pins=self.u32(H_ARENA_PINS), slab_count=self.u32(H_SLAB_COUNT))

    # ---- slots -------------------------------------------------------------------------------------

    @staticmethod
    def slot_off(index: int) -> int:
        return HEADER_SIZE + index * SLOT_SIZE

    def slot(self, index: int) -> CommSlot:
        b = self.slot_off(index)
        nranks = self.i32(b + S_NRANKS)
        n = max(0, min(nranks, MAX_PEERS))

        def peers(off: int) -> tuple[int, ...]:
            return tuple(struct.unpack_from(f"<{n}Q", self.mm, b + off))

        return CommSlot(
            index=index, state=self.u32(b + S_STATE), vid=self.u32(b + S_VID), ident=self.u64(b + S_IDENT),
            rank=self.i32(b + S_RANK), nranks=nranks, parent_vid=self.u32(b + S_PARENT),
            color=self.i32(b + S_COLOR), key=self.i32(b + S_KEY), rebuild=self.u32(b + S_REBUILD),
            flags=self.u32(b + S_FLAGS), device=self.i32(b + S_DEVICE), seq=self.u64(b + S_SEQ),
            coll_target=self.u64(b + S_COLL_TARGET), uid_gen=self.u32(b + S_UID_GEN),
            waiting=self.u32(b + S_WAITING), waiting_kind=self.u32(b + S_WAITING_KIND),
            waiting_peer=self.i32(b + S_WAITING_PEER), send=peers(S_SEND), recv=peers(S_RECV),
            send_target=peers(S_SEND_TARGET), recv_target=peers(S_RECV_TARGET),
        )

    def comms(self) -> list[CommSlot]:
        """Every slot in use (live or finalized by the application)."""
        out = []
        for i in range(self.slots_used):
            if self.u32(self.slot_off(i) + S_STATE) in (SlotState.LIVE, SlotState.FINALIZED):
                s = self.slot(i)
                if s.state in (SlotState.LIVE, SlotState.FINALIZED):  # re-checked: the slot may have changed
                    out.append(s)
        return out

    def set_targets(self, index: int, coll: int, send: tuple[int, ...] | list[int],
                    recv: tuple[int, ...] | list[int]) -> None:
        """Writes a slot's HOLD targets (each an 8-byte store)."""
        b = self.slot_off(index)
        self.w64(b + S_COLL_TARGET, coll)
        for p, v in enumerate(send[:MAX_PEERS]):
            self.w64(b + S_SEND_TARGET + 8 * p, v)
        for p, v in enumerate(recv[:MAX_PEERS]):
            self.w64(b + S_RECV_TARGET + 8 * p, v)

    def zero_targets(self) -> None:
        """Every slot's targets to 0: a HOLD then stops every thread at its next counted call. (Slots never used
        need nothing: the interceptor zeroes a slot's targets when it publishes a communicator there.)"""
        for i in range(self.slots_used):
            b = self.slot_off(i)
            self.w64(b + S_COLL_TARGET, 0)
            for p in range(MAX_PEERS):
                self.w64(b + S_SEND_TARGET + 8 * p, 0)
                self.w64(b + S_RECV_TARGET + 8 * p, 0)

    def uid(self, index: int) -> tuple[int, bytes]:
        """(uid_gen, the 128 id bytes) of a slot."""
        b = self.slot_off(index)
        return self.u32(b + S_UID_GEN), bytes(self.mm[b + S_UID:b + S_UID + UID_SIZE])

    def put_uid(self, index: int, uid: bytes, gen: int) -> None:
        """The id first, its generation last: a member never uses a half-written id."""
        if len(uid) != UID_SIZE:
            raise ValueError(f"a unique id has {UID_SIZE} bytes, got {len(uid)}")
        b = self.slot_off(index)
        self.mm[b + S_UID:b + S_UID + UID_SIZE] = uid
        self.w32(b + S_UID_GEN, gen)
