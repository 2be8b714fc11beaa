"""What the cut is computed from and what it answers: one rank's counters (``RankView``), the targets
(``CommTarget``), the decision (``Decision``), and the per-slot helpers every layer shares. No rules here: the
rules are ``summary.py``'s (over per-node aggregates) and ``rules.py``'s entry points (over views).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from cryosleep.core.interceptor import CommSlot

Pair = tuple[int, int]  # (sender's rank, receiver's rank), in the communicator


@dataclass(frozen=True)
class CommTarget:
    """The HOLD targets of one communicator, the same on every member."""

    coll: int = 0
    """Collectives every member may have issued."""
    pairs: Mapping[Pair, int] = field(default_factory=dict)
    """(sender, receiver) -> sends the sender may have issued to the receiver, and receives the receiver may
    have issued from the sender. Pairs at 0 are left out."""


Targets = Mapping[int, CommTarget]  # by communicator ident


@dataclass(frozen=True)
class RankView:
    """One rank's control block at one moment."""

    rank: int
    """The job rank whose block this is."""
    comms: tuple[CommSlot, ...]
    """Its communicators (live or finalized), with counters and the targets written on them."""
    held: int = 0
    busy: int = 0
    in_group: int = 0
    targets_gen: int = 0
    settled_gen: int = 0
    settled: bool = False
    """Computed by the interceptor against ``settled_gen``: at or past every target, nothing inside NCCL."""
    premul_live: int = 0

    @property
    def answered(self) -> bool:
        """The interceptor has answered the targets last written (its ``settled`` is about them)."""
        return self.settled_gen == self.targets_gen


class Action(enum.Enum):
    DONE = "done"  # every rank is settled at a consistent, rebuildable cut: quiesce now
    WRITE = "write"  # write these targets on every rank, then wait for the ranks to answer them
    WAIT = "wait"  # the targets stand; some ranks are still running toward them
    GIVE_UP = "give-up"  # the deadline passed, or the cut cannot be rebuilt: open the gates again


@dataclass(frozen=True)
class Decision:
    action: Action
    targets: dict[int, CommTarget]
    reason: str
    stuck: tuple[int, ...] = ()
    """WRITE: the ranks below their targets with every thread held, whose held calls were added where they
    reach the targets (sorted)."""
    unsettled: tuple[int, ...] = ()
    """Ranks not settled at the targets last written (sorted): the ones a GIVE_UP names."""


@dataclass(frozen=True)
class IdRoute:
    """REBUILD: copy the fresh unique id of ``ident`` from its rank-0 member to the other members."""

    ident: int
    source: tuple[int, int]
    """(job rank, slot index) of the member of rank 0."""
    dest: tuple[tuple[int, int], ...]
    """(job rank, slot index) of each member that has not received this generation's id yet."""


def comm_label(ident: int, nranks: int) -> str:
    return f"communicator {ident:016x} ({nranks} ranks)"


def comm_name(s: CommSlot) -> str:
    return comm_label(s.ident, s.nranks)


_ZEROS: dict[int, tuple[int, ...]] = {}


def zeros(n: int) -> tuple[int, ...]:
    """One shared all-zero tuple per length: most per-peer lists are all zero, and comparing a list with the
    very same tuple is one identity check (``decide`` compares every slot of every rank each round)."""
    z = _ZEROS.get(n)
    if z is None:
        z = _ZEROS[n] = (0,) * n
    return z


def slot_targets(targets: Targets, s: CommSlot) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """What to write on one member's slot: (coll_target, send_target[peer], recv_target[peer])."""
    t = targets.get(s.ident)
    n = len(s.send)
    if t is None or not t.pairs:
        return (0 if t is None else t.coll), zeros(n), zeros(n)
    send = tuple(t.pairs.get((s.rank, p), 0) for p in range(n))
    recv = tuple(t.pairs.get((p, s.rank), 0) for p in range(n))
    return t.coll, send, recv


def shortfalls(v: RankView) -> list[str]:
    """Where a rank is below the targets written on its slots, in words."""
    out: list[str] = []
    for s in v.comms:
        if s.seq < s.coll_target:
            out.append(f"{comm_name(s)}: {s.seq} of {s.coll_target} collectives issued")
        for p, (n, t) in enumerate(zip(s.send, s.send_target, strict=True)):
            if n < t:
                out.append(f"{comm_name(s)}: {n} of {t} sends to its rank {p} issued")
        for p, (n, t) in enumerate(zip(s.recv, s.recv_target, strict=True)):
            if n < t:
                out.append(f"{comm_name(s)}: {n} of {t} receives from its rank {p} issued")
    return out


def is_short(v: RankView) -> bool:
    """The rank is below some target written on its slots."""
    for s in v.comms:
        if s.seq < s.coll_target:
            return True
        if any(s.send_target) and any(n < t for n, t in zip(s.send, s.send_target, strict=True)):
            return True
        if any(s.recv_target) and any(n < t for n, t in zip(s.recv, s.recv_target, strict=True)):
            return True
    return False


def is_stuck(v: RankView) -> bool:
    """Below its targets with every thread held: nothing inside NCCL or a group, some held.

    (A thread computing outside NCCL is not seen; if it would have issued what the rank owes, the call
    added for the held thread is still one every member issues, so the cut only grows by it.)"""
    return v.answered and not v.settled and v.busy == 0 and v.in_group == 0 and v.held > 0 and is_short(v)


def laggard_text(v: RankView) -> str:
    """Why a rank that has not settled has not, in words (one line)."""
    why = shortfalls(v)
    if len(why) > 3:
        why = [*why[:3], f"and {len(why) - 3} more"]
    if not v.answered:
        why.append("its interceptor did not answer the last targets (process stopped or gone?)")
    if v.busy:
        why.append(f"{v.busy} thread(s) inside an NCCL call")
    if v.in_group:
        why.append(f"{v.in_group} thread(s) inside an NCCL group")
    if v.held:
        why.append(f"{v.held} thread(s) held at the gate")
    elif not v.busy and is_short(v):
        why.append("no thread held: it is computing, or blocked outside NCCL")
    return f"rank {v.rank}: " + ", ".join(why or ["not settled"])
