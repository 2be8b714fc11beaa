"""The cut's rules as they were written over views, before the per-node summaries (cryosleep/cut/summary.py):
kept here, unchanged, as the specification the summaries are checked against (tests/unit/test_cut_summary.py).
Not used by the package."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from cryosleep.core.interceptor import CommSlot, SlotState, WaitKind
from cryosleep.cut.views import Action, CommTarget, Decision, Pair, RankView, Targets, comm_name, slot_targets


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
