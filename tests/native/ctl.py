"""Test-side reader/writer of the NCCL interceptor's control block, and a tiny agent.

docs/interceptor.md is the contract; this module follows it and native/nccl/interceptor/ctl_block.h
is its C form. The real agent lives in the package; this one exists so the C side can be tested
on its own.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = int.from_bytes(b"CRYONCCL", "little")
VERSION = 1
HEADER_SIZE, SLOT_SIZE, MAX_COMMS, MAX_PEERS = 4096, 2560, 64, 64
BLOCK_SIZE = HEADER_SIZE + MAX_COMMS * SLOT_SIZE

CMD_RUN, CMD_HOLD, CMD_QUIESCE, CMD_REBUILD = 1, 2, 3, 4
ST_INIT, ST_RUNNING, ST_HOLDING, ST_QUIESCING, ST_QUIESCED, ST_REBUILDING, ST_ERROR = range(7)
STATE_NAMES = ["INIT", "RUNNING", "HOLDING", "QUIESCING", "QUIESCED", "REBUILDING", "ERROR"]
SLOT_LIVE, SLOT_FINALIZED = 1, 2
REBUILD_ID, REBUILD_SPLIT = 1, 2
FLAGS = {
    1 << 0: "ncclCommInitAll", 1 << 1: "ncclCommShrink", 1 << 2: "ncclCommWindowRegister",
    1 << 3: "too many communicators", 1 << 4: "send/recv peer beyond the counted range",
    1 << 5: "too many buffer registrations", 1 << 6: "too many splits", 1 << 7: "real NCCL not found",
    1 << 8: "untracked communicator",
}

# header offsets
H_MAGIC, H_VERSION, H_CMD, H_STATE, H_DEADLINE, H_PID, H_FLAGS = 0, 8, 32, 40, 48, 56, 60
H_HELD, H_BUSY, H_IN_GROUP, H_SLOTS_USED, H_HEARTBEAT = 64, 68, 72, 76, 80
H_PREMUL, H_NCCL_VERSION, H_CONTROL, H_COMMS_LIVE = 88, 92, 96, 100
H_TARGETS_GEN, H_SETTLED_GEN, H_SETTLED, H_ERROR = 104, 108, 112, 256
# slot offsets
S_STATE, S_VID, S_IDENT, S_RANK, S_NRANKS, S_PARENT, S_COLOR, S_KEY = 0, 4, 8, 16, 20, 24, 28, 32
S_REBUILD, S_FLAGS, S_DEVICE, S_SEQ, S_COLL_TARGET, S_UID_GEN, S_UID = 36, 40, 44, 48, 56, 64, 128
S_WAITING, S_WAITING_KIND, S_WAITING_PEER = 68, 72, 76
WAIT_COLL, WAIT_SEND, WAIT_RECV = 1, 2, 3
S_SEND, S_RECV, S_SEND_TARGET, S_RECV_TARGET = 512, 1024, 1536, 2048


class CtlError(RuntimeError):
    pass


# targets[ident] = (collective target, send targets per member rank, recv targets per member rank)
Targets = dict[int, tuple[int, dict[int, list[int]], dict[int, list[int]]]]


@dataclass
class Comm:
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
    send: list[int] = field(default_factory=list)
    recv: list[int] = field(default_factory=list)


class Ctl:
    """One worker's control block, mapped MAP_SHARED like the interceptor maps it."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < BLOCK_SIZE:
                raise CtlError(f"{self.path}: smaller than a control block")
            self.mm = mmap.mmap(fd, BLOCK_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    @classmethod
    def wait(cls, path: Path | str, pid: int | None = None, timeout: float = 10.0) -> Ctl:
        """Waits for the interceptor to create and publish the block (of process `pid`)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ctl = cls(path)
                if ctl.magic_ok and (pid is None or ctl.pid == pid):
                    return ctl
                ctl.close()
            except (FileNotFoundError, CtlError):
                pass
            if time.monotonic() > deadline:
                raise CtlError(f"{path}: no control block published")
            time.sleep(0.01)

    def close(self) -> None:
        self.mm.close()

    # aligned 4- and 8-byte fields are read and written with single loads and stores
    def u32(self, off: int) -> int:
        return int(ctypes.c_uint32.from_buffer(self.mm, off).value)

    def u64(self, off: int) -> int:
        return int(ctypes.c_uint64.from_buffer(self.mm, off).value)

    def i32(self, off: int) -> int:
        return int(ctypes.c_int32.from_buffer(self.mm, off).value)

    def w32(self, off: int, v: int) -> None:
        ctypes.c_uint32.from_buffer(self.mm, off).value = v

    def w64(self, off: int, v: int) -> None:
        ctypes.c_uint64.from_buffer(self.mm, off).value = v

    # header
    @property
    def magic_ok(self) -> bool:
        return self.u64(H_MAGIC) == MAGIC and self.u32(H_VERSION) == VERSION

    @property
    def pid(self) -> int:
        return self.u32(H_PID)

    def state(self) -> tuple[int, int]:
        w = self.u64(H_STATE)
        return w & 0xFFFFFFFF, w >> 32

    def cmd(self) -> tuple[int, int]:
        w = self.u64(H_CMD)
        return w & 0xFFFFFFFF, w >> 32

    def command(self, cmd: int, gen: int) -> None:
        self.w64(H_CMD, cmd | gen << 32)

    def set_hold_deadline(self, seconds_from_now: float | None) -> None:
        self.w64(H_DEADLINE, 0 if seconds_from_now is None else time.monotonic_ns() + int(seconds_from_now * 1e9))

    @property
    def flags(self) -> int:
        return self.u32(H_FLAGS)

    def flag_names(self) -> list[str]:
        return [name for bit, name in FLAGS.items() if self.flags & bit]

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
    def heartbeat(self) -> int:
        return self.u64(H_HEARTBEAT)

    @property
    def comms_live(self) -> bool:
        return self.u32(H_COMMS_LIVE) == 1

    @property
    def control_thread(self) -> bool:
        return self.u32(H_CONTROL) == 1

    @property
    def nccl_version(self) -> int:
        return self.u32(H_NCCL_VERSION)

    @property
    def premul_live(self) -> int:
        return self.u32(H_PREMUL)

    @property
    def error(self) -> str:
        raw = self.mm[H_ERROR:H_ERROR + 256]
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    def settled(self) -> tuple[int, bool]:
        """(the targets_gen it answers, settled)"""
        gen = self.u32(H_SETTLED_GEN)
        return gen, self.u32(H_SETTLED) == 1

    def bump_targets_gen(self) -> int:
        gen = self.u32(H_TARGETS_GEN) + 1
        self.w32(H_TARGETS_GEN, gen)
        return gen

    # slots
    @staticmethod
    def slot_off(index: int) -> int:
        return HEADER_SIZE + index * SLOT_SIZE

    def comms(self) -> list[Comm]:
        out = []
        for i in range(min(self.u32(H_SLOTS_USED), MAX_COMMS)):
            b = self.slot_off(i)
            state = self.u32(b + S_STATE)
            if state not in (SLOT_LIVE, SLOT_FINALIZED):
                continue
            nranks = self.i32(b + S_NRANKS)
            npeers = min(nranks, MAX_PEERS)
            send = list(struct.unpack_from(f"<{npeers}Q", self.mm, b + S_SEND))
            recv = list(struct.unpack_from(f"<{npeers}Q", self.mm, b + S_RECV))
            out.append(Comm(i, state, self.u32(b + S_VID), self.u64(b + S_IDENT), self.i32(b + S_RANK), nranks,
                            self.u32(b + S_PARENT), self.i32(b + S_COLOR), self.i32(b + S_KEY),
                            self.u32(b + S_REBUILD), self.u32(b + S_FLAGS), self.i32(b + S_DEVICE),
                            self.u64(b + S_SEQ), self.u64(b + S_COLL_TARGET), self.u32(b + S_UID_GEN),
                            self.u32(b + S_WAITING), self.u32(b + S_WAITING_KIND), self.i32(b + S_WAITING_PEER),
                            send, recv))
        return out

    def set_targets(self, index: int, coll: int, send: list[int], recv: list[int]) -> None:
        b = self.slot_off(index)
        self.w64(b + S_COLL_TARGET, coll)
        for p, v in enumerate(send[:MAX_PEERS]):
            self.w64(b + S_SEND_TARGET + 8 * p, v)
        for p, v in enumerate(recv[:MAX_PEERS]):
            self.w64(b + S_RECV_TARGET + 8 * p, v)

    def uid(self, index: int) -> tuple[int, bytes]:
        b = self.slot_off(index)
        return self.u32(b + S_UID_GEN), bytes(self.mm[b + S_UID:b + S_UID + 128])

    def put_uid(self, index: int, uid: bytes, gen: int) -> None:
        """The id first, its generation last: a member never reads a half-written id."""
        b = self.slot_off(index)
        self.mm[b + S_UID:b + S_UID + 128] = uid
        self.w32(b + S_UID_GEN, gen)


class Agent:
    """The agent's side of the protocol for one job, in the steps docs/interceptor.md gives."""

    def __init__(self, ctls: list[Ctl], timeout: float = 10.0) -> None:
        self.ctls = ctls
        self.timeout = timeout
        self.gen = max(c.cmd()[1] for c in ctls)

    def command_all(self, cmd: int) -> int:
        self.gen += 1
        for c in self.ctls:
            c.command(cmd, self.gen)
        return self.gen

    def wait_all(self, state: int, gen: int) -> None:
        deadline = time.monotonic() + self.timeout
        for c in self.ctls:
            while c.state() != (state, gen):
                st, g = c.state()
                if st == ST_ERROR and g == gen:
                    raise CtlError(f"pid {c.pid}: {c.error}")
                if time.monotonic() > deadline:
                    want = f"{STATE_NAMES[state]}({gen})"
                    raise CtlError(f"pid {c.pid}: still {STATE_NAMES[st]}({g}), waiting for {want}")
                time.sleep(0.002)

    def set_targets(self, targets: Targets) -> None:
        """targets[ident] = (coll, send[rank] per member, recv[rank] per member); then bumps targets_gen."""
        for c in self.ctls:
            for comm in c.comms():
                coll, send, recv = targets.get(comm.ident, (0, {}, {}))
                zero = [0] * comm.nranks
                c.set_targets(comm.index, coll, send.get(comm.rank, zero), recv.get(comm.rank, zero))

    def cut(self, stuck: list[Ctl] | tuple[Ctl, ...] = ()) -> Targets:
        """Per communicator: the maximum sequence number over its members; per pair of members: the
        maximum of what one sent and the other received. For the ranks in `stuck` (short of their
        targets but held), the call each held thread waits to issue is added to the cut: its
        program order puts that call before the ones it still owes."""
        members: dict[int, list[Comm]] = {}
        waits: list[Comm] = []
        for c in self.ctls:
            for comm in c.comms():
                members.setdefault(comm.ident, []).append(comm)
                if c in stuck and comm.waiting:
                    waits.append(comm)
        out: Targets = {}
        for ident, ms in members.items():
            by_rank = {m.rank: m for m in ms}
            coll = max(m.seq for m in ms)
            send = {m.rank: [0] * m.nranks for m in ms}
            recv = {m.rank: [0] * m.nranks for m in ms}
            for a in ms:
                for b_rank in range(min(a.nranks, MAX_PEERS)):
                    b = by_rank.get(b_rank)
                    if b is None or a.rank >= MAX_PEERS:
                        continue
                    t = max(a.send[b_rank], b.recv[a.rank])
                    send[a.rank][b_rank] = t
                    recv[b_rank][a.rank] = t
            out[ident] = (coll, send, recv)
        for w in waits:
            coll, send, recv = out[w.ident]
            p = w.waiting_peer
            if w.waiting_kind == WAIT_COLL and w.seq >= coll:
                out[w.ident] = (w.seq + 1, send, recv)
            elif w.waiting_kind == WAIT_SEND and 0 <= p < MAX_PEERS and w.send[p] >= send[w.rank][p] and p in recv:
                send[w.rank][p] = recv[p][w.rank] = w.send[p] + 1
            elif w.waiting_kind == WAIT_RECV and 0 <= p < MAX_PEERS and w.recv[p] >= recv[w.rank][p] and p in send:
                recv[w.rank][p] = send[p][w.rank] = w.recv[p] + 1
        return out

    def hold(self, targets: Targets | None = None) -> int:
        """HOLD with the given targets (default: hold everything at its next call)."""
        self.set_targets(targets or {})
        for c in self.ctls:
            c.bump_targets_gen()
        gen = self.command_all(CMD_HOLD)
        self.wait_all(ST_HOLDING, gen)
        return gen

    def drain(self) -> Targets:
        """Raises the targets until every rank has settled exactly at them: a consistent cut."""
        deadline = time.monotonic() + self.timeout
        stuck: list[Ctl] = []
        while True:
            cut = self.cut(stuck)
            self.set_targets(cut)
            gens = [c.bump_targets_gen() for c in self.ctls]
            for c, g in zip(self.ctls, gens, strict=True):
                while c.settled()[0] != g:
                    if time.monotonic() > deadline:
                        raise CtlError(f"pid {c.pid}: control thread does not answer")
                    time.sleep(0.001)
            unsettled = [c for c in self.ctls if not c.settled()[1]]
            if not unsettled and self.cut() == cut:
                return cut
            if time.monotonic() > deadline:
                raise CtlError("the ranks did not reach a consistent cut in time")
            time.sleep(0.005)
            # a rank still short of its targets whose threads are all held cannot move on its own
            stuck = [c for c in unsettled if c.busy == 0 and c.held > 0 and not c.settled()[1]]

    def quiesce(self) -> None:
        self.wait_all(ST_QUIESCED, self.command_all(CMD_QUIESCE))

    def wait_error(self, gen: int) -> list[str]:
        """Waits for ERROR(gen) on every rank; returns their error texts."""
        deadline = time.monotonic() + self.timeout
        for c in self.ctls:
            while c.state() != (ST_ERROR, gen):
                if time.monotonic() > deadline:
                    raise CtlError(f"pid {c.pid}: {STATE_NAMES[c.state()[0]]}({c.state()[1]}), not ERROR({gen})")
                time.sleep(0.002)
        return [c.error for c in self.ctls]

    def rebuild(self) -> None:
        """REBUILD, relaying each communicator's fresh id from its rank 0 to the other members."""
        gen = self.command_all(CMD_REBUILD)
        deadline = time.monotonic() + self.timeout
        pending = True
        while pending:
            pending = False
            members: dict[int, list[tuple[Ctl, Comm]]] = {}
            for c in self.ctls:
                for comm in c.comms():
                    if comm.rebuild == REBUILD_ID and comm.state == SLOT_LIVE:
                        members.setdefault(comm.ident, []).append((c, comm))
            for ms in members.values():
                roots = [(c, m) for c, m in ms if m.rank == 0]
                if not roots or roots[0][0].uid(roots[0][1].index)[0] != gen:
                    pending = True
                    continue
                uid = roots[0][0].uid(roots[0][1].index)[1]
                for c, m in ms:
                    if m.rank != 0 and c.uid(m.index)[0] != gen:
                        c.put_uid(m.index, uid, gen)
            for c in self.ctls:
                st, g = c.state()
                if st == ST_ERROR and g == gen:
                    raise CtlError(f"pid {c.pid}: {c.error}")
            if time.monotonic() > deadline:
                raise CtlError("rebuild: ids not relayed in time")
            if pending:
                time.sleep(0.002)
        self.wait_all(ST_RUNNING, gen)

    def run(self) -> None:
        self.wait_all(ST_RUNNING, self.command_all(CMD_RUN))
