"""The consistent cut as pure functions: every rank's counters in, targets and a reason out.

No I/O and no clock: the caller reads the control blocks into ``RankView``s, passes ``now`` and the
deadline, writes what ``decide`` returns, and calls again. ``to_cut`` is that loop, with the I/O handed in
(the snapshot sequence's drain, ``coordinator/machine.py``, over every node's ranks; the node side writes the
targets with ``cryosleep.cut.driver``). The rules are docs/interceptor.md's "Drain to a consistent cut":

* **Maxima.** Per communicator (matched across ranks by ``ident``) the collective target is the largest
  sequence number any member has issued; per ordered pair of members (a, b) the point-to-point target is
  the larger of what a sent to b and what b received from a. A target never goes down during a drain
  (``floor``): a call admitted under a target is part of the cut even if its issuer's slot is gone.
* **Held short of the cut.** A rank still below some target whose threads are all held cannot move on
  its own: each held thread waits at a call that program order puts before what the rank still owes. That
  call is added to the cut (+1 on its communicator, or on its pair), and every member then issues it too.
* **Done** when every rank has settled at the targets (every counter at its target, no thread inside NCCL
  or a group) and the targets computed again from these counters are the ones written: every member of
  every communicator has issued exactly the same calls and nothing can move until the command changes.
* **A cut that cannot be rebuilt** (a communicator some members destroyed or finalized and others did not,
  a user reduction operator alive) is refused rather than quiesced: the job would not survive the rebuild.

Targets only ever name calls some member issued or a held thread is waiting to issue, so none exceeds what
the programs issue; tests/unit/test_cut.py checks that and convergence on simulated programs.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cryosleep.core.interceptor import CommSlot, Rebuild, SlotState, WaitKind

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
    """Ranks whose held threads had a call added to the cut."""


@dataclass(frozen=True)
class IdRoute:
    """REBUILD: copy the fresh unique id of ``ident`` from its rank-0 member to the other members."""

    ident: int
    source: tuple[int, int]
    """(job rank, slot index) of the member of rank 0."""
    dest: tuple[tuple[int, int], ...]
    """(job rank, slot index) of each member that has not received this generation's id yet."""


def comm_name(s: CommSlot) -> str:
    return f"communicator {s.ident:016x} ({s.nranks} ranks)"


def _members(views: Iterable[RankView]) -> dict[int, list[tuple[int, CommSlot]]]:
    out: dict[int, list[tuple[int, CommSlot]]] = {}
    for v in views:
        for s in v.comms:
            out.setdefault(s.ident, []).append((v.rank, s))
    return out


def _merge(a: CommTarget, b: CommTarget) -> CommTarget:
    pairs = dict(a.pairs)
    for k, n in b.pairs.items():
        pairs[k] = max(pairs.get(k, 0), n)
    return CommTarget(max(a.coll, b.coll), pairs)


def max_targets(views: Iterable[RankView], floor: Targets | None = None) -> dict[int, CommTarget]:
    """Per communicator, the maxima over its members' counters (and never below ``floor``)."""
    out: dict[int, CommTarget] = {ident: CommTarget(t.coll, dict(t.pairs)) for ident, t in (floor or {}).items()}
    for ident, members in _members(views).items():
        pairs: dict[Pair, int] = {}
        for _, s in members:
            if any(s.send):  # (most slots count no point-to-point calls: skip their peer lists)
                for p, n in enumerate(s.send):
                    if n:
                        pairs[(s.rank, p)] = max(pairs.get((s.rank, p), 0), n)
            if any(s.recv):
                for p, n in enumerate(s.recv):
                    if n:
                        pairs[(p, s.rank)] = max(pairs.get((p, s.rank), 0), n)
        found = CommTarget(max(s.seq for _, s in members), pairs)
        out[ident] = _merge(out[ident], found) if ident in out else found
    return out


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


def _written(s: CommSlot) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return s.coll_target, s.send_target, s.recv_target


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


def _short(v: RankView) -> bool:
    for s in v.comms:
        if s.seq < s.coll_target:
            return True
        if any(s.send_target) and any(n < t for n, t in zip(s.send, s.send_target, strict=True)):
            return True
        if any(s.recv_target) and any(n < t for n, t in zip(s.recv, s.recv_target, strict=True)):
            return True
    return False


def stuck_ranks(views: Iterable[RankView]) -> list[int]:
    """Ranks below their targets whose threads are all held: nothing inside NCCL or a group, some held.

    (A thread computing outside NCCL is not seen; if it would have issued what the rank owes, the call
    added for the held thread is still one every member issues, so the cut only grows by it.)"""
    return [v.rank for v in views
            if v.answered and not v.settled and v.busy == 0 and v.in_group == 0 and v.held > 0 and _short(v)]


def raise_for_stuck(views: Iterable[RankView], targets: Targets,
                    stuck: Collection[int]) -> tuple[dict[int, CommTarget], list[str]]:
    """Adds, for every rank in ``stuck``, the call each of its held threads waits to issue.

    A collective at ``seq >= coll_target`` raises its communicator's target to ``seq + 1``; a send to p at
    ``send[p] >= send_target[p]`` raises the pair (this rank -> p) to ``send[p] + 1``; a receive likewise.
    Returns the new targets and what was raised, in words."""
    out: dict[int, CommTarget] = {ident: CommTarget(t.coll, dict(t.pairs)) for ident, t in targets.items()}
    notes: list[str] = []
    for v in views:
        if v.rank not in stuck:
            continue
        for s in v.comms:
            if s.waiting == 0 or s.state != SlotState.LIVE:
                continue
            t = out.get(s.ident, CommTarget())
            coll, pairs = t.coll, dict(t.pairs)
            p = s.waiting_peer
            if s.waiting_kind == WaitKind.COLL and s.seq >= coll:
                coll = s.seq + 1
                notes.append(f"rank {v.rank} is held at collective {coll} of {comm_name(s)}")
            elif s.waiting_kind == WaitKind.SEND and 0 <= p < len(s.send) and s.send[p] >= pairs.get((s.rank, p), 0):
                pairs[(s.rank, p)] = s.send[p] + 1
                notes.append(f"rank {v.rank} is held at send {s.send[p] + 1} to its rank {p} of {comm_name(s)}")
            elif s.waiting_kind == WaitKind.RECV and 0 <= p < len(s.recv) and s.recv[p] >= pairs.get((p, s.rank), 0):
                pairs[(p, s.rank)] = s.recv[p] + 1
                notes.append(f"rank {v.rank} is held at receive {s.recv[p] + 1} from its rank {p} of {comm_name(s)}")
            else:
                continue
            out[s.ident] = CommTarget(coll, pairs)
    return out, notes


def cut_problems(views: Sequence[RankView]) -> list[str]:
    """Why a settled cut cannot be quiesced and rebuilt (empty: it can)."""
    out: list[str] = []
    for _, members in sorted(_members(views).items()):
        slots = [s for _, s in members]
        name = comm_name(slots[0])
        sizes = {s.nranks for s in slots}
        if len(sizes) > 1:
            out.append(f"{name}: its members disagree on its size ({sorted(sizes)})")
            continue
        n = slots[0].nranks
        have = sorted(s.rank for s in slots)
        if have != list(range(n)):
            holders = sorted(r for r, _ in members)
            out.append(f"{name}: only job ranks {holders} hold it (its ranks {have} of 0..{n - 1}); the others "
                       "destroyed it or have not created it, so it could not be rebuilt")
        finalized = sorted(r for r, s in members if s.state == SlotState.FINALIZED)
        if finalized and len(finalized) != len(members):
            live = sorted(r for r, s in members if s.state != SlotState.FINALIZED)
            out.append(f"{name}: finalized by job ranks {finalized} but not yet by {live}, so it could not be rebuilt")
        kinds = {s.rebuild for s in slots if s.state == SlotState.LIVE}
        if len(kinds) > 1:
            out.append(f"{name}: rebuilt from an id on some members and replayed as a split on others (its split "
                       "parent was ended on some ranks only)")
    for v in views:
        if v.premul_live:
            out.append(f"rank {v.rank}: {v.premul_live} user reduction operator(s) (ncclRedOpCreatePreMulSum) "
                       "are alive and would not survive the rebuild")
    return out


def laggards(views: Sequence[RankView]) -> str:
    """The ranks that have not settled, and why, in words."""
    parts: list[str] = []
    for v in views:
        if v.answered and v.settled:
            continue
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
        elif not v.busy and _short(v):
            why.append("no thread held: it is computing, or blocked outside NCCL")
        parts.append(f"rank {v.rank}: " + ", ".join(why or ["not settled"]))
    return "; ".join(parts) or "every rank settled, but the targets kept changing"


def decide(now: float, deadline: float, views: Sequence[RankView], floor: Targets | None = None) -> Decision:
    """One round of the drain: what to do, given every rank's counters, the time and the targets last written
    (``floor``). Pure: the same inputs always give the same decision."""
    if not views:
        return Decision(Action.DONE, {}, "no rank has NCCL communicators")
    stuck = stuck_ranks(views)
    targets, raised = raise_for_stuck(views, max_targets(views, floor), stuck)
    stale = [(v.rank, s) for v in views for s in v.comms if slot_targets(targets, s) != _written(s)]
    unsettled = [v.rank for v in views if not (v.answered and v.settled)]
    if not unsettled and not stale:
        problems = cut_problems(views)
        if problems:
            return Decision(Action.GIVE_UP, targets, "the ranks settled at a cut that cannot be rebuilt: "
                            + "; ".join(problems))
        idents = {s.ident for v in views for s in v.comms}
        calls = sum(s.seq for v in views for s in v.comms) + sum(sum(s.send) for v in views for s in v.comms)
        return Decision(Action.DONE, targets, f"every rank settled at the cut: {len(views)} rank(s), "
                        f"{len(idents)} communicator(s), {calls} counted calls")
    if now >= deadline:
        problems = cut_problems(views) if not unsettled else []
        return Decision(Action.GIVE_UP, targets, "not at a consistent cut by the deadline: "
                        + laggards(views) + (" (" + "; ".join(problems) + ")" if problems else ""))
    if stale:
        comms = sorted({s.ident for _, s in stale})
        why = "; ".join(raised) if raised else f"new maxima on {len(comms)} communicator(s)"
        return Decision(Action.WRITE, targets, why, tuple(stuck))
    return Decision(Action.WAIT, targets, "waiting for " + ", ".join(f"rank {r}" for r in unsettled))


Ask = Callable[[int, Targets | None], Sequence[RankView]]
"""One round of a drain carried out: ``ask(round, targets)`` writes ``targets`` on every rank and returns their
fresh views once they answered (or a bounded wait ran out); ``ask(round, None)`` waits a little for the ranks
to move on toward the targets already written, and returns their fresh views."""


def to_cut(views: Sequence[RankView], ask: Ask, deadline: float,
           now: Callable[[], float]) -> tuple[Decision, Sequence[RankView], int]:
    """The drain's rounds: ``decide`` on the views, ``ask`` for the next round, until the decision is DONE or
    GIVE_UP. Returns that decision, the views it was made on, and how many rounds were asked. The targets
    written last are the next decision's ``floor`` (a target never goes down during a drain)."""
    floor: dict[int, CommTarget] = {}
    rounds = 0
    while True:
        d = decide(now(), deadline, views, floor)
        if d.action in (Action.DONE, Action.GIVE_UP):
            return d, views, rounds
        rounds += 1
        if d.action is Action.WRITE:
            floor = d.targets
            views = ask(rounds, d.targets)
        else:
            views = ask(rounds, None)


def relay_plan(views: Sequence[tuple[int, Sequence[CommSlot]]], gen: int) -> tuple[list[IdRoute], list[int]]:
    """REBUILD: the id copies that can be made now, and the communicators whose rank-0 member has not yet
    published this generation's id. ``views`` is (job rank, its slots) per rank."""
    members: dict[int, list[tuple[int, CommSlot]]] = {}
    for rank, slots in views:
        for s in slots:
            if s.state == SlotState.LIVE and s.rebuild == Rebuild.FROM_ID:
                members.setdefault(s.ident, []).append((rank, s))
    relays: list[IdRoute] = []
    pending: list[int] = []
    for ident, ms in sorted(members.items()):
        roots = [(r, s) for r, s in ms if s.rank == 0]
        if not roots or roots[0][1].uid_gen != gen:
            pending.append(ident)
            continue
        dest = tuple((r, s.index) for r, s in ms if s.rank != 0 and s.uid_gen != gen)
        if dest:
            relays.append(IdRoute(ident, (roots[0][0], roots[0][1].index), dest))
    return relays, pending
