"""The cut's rules over per-node aggregates: what ``decide`` needs from a node's ranks, summed up on the node.

A drain across 2,048 nodes used to ship every rank's control-block view to the coordinator each round and
decode them there. Every rule of the cut (``rules.py``'s docstring) reads the views only through maxima,
flags and small sets, so each node folds its ranks' views into one ``NodeSummary`` (``summarize``), the
coordinator folds the nodes' summaries into one (``combine``: associative and order-independent), and
``decide_nodes`` applies the rules to it. ``rules.decide(views)`` is the same thing over one summary of every
view: there is one implementation of the rules, this one.

What a summary holds, per communicator (``CommSummary``), and why it is enough:

* **Maxima**: the largest ``seq`` and, per (sender, receiver), the largest count: ``max_targets`` is the max
  over members, and a max of maxima is the max.
* **Held short of the cut**: for the node's stuck ranks (``views.is_stuck``, a per-rank test) the largest
  count at which a held thread waits, per communicator (collectives) and per pair, with the lowest job rank
  waiting there (for the reason's words). The rule of ``raise_for_stuck`` (a held call at ``count >= target``
  raises the target to ``count + 1``) gives ``max(count) + 1`` whenever ``max(count) >= target``, in whatever
  order the held ranks are visited; and since the target is the maximum over every member's counters, a raise
  happens exactly where a held count equals the target. Only the maximum is needed
  (tests/unit/test_cut_summary.py checks both).
* **Written targets**: whether each slot already holds what the new targets would write on it
  (``slot_targets``). The summary keeps the collective targets written (a set), and per pair the nonzero
  targets written with how many slot sides hold each; the members (comm rank, per-peer list length) tell how
  many slot sides see a pair at all, so a side that holds 0 is counted too. Nothing of the coordinator's memory
  of what it wrote is needed: the slots themselves say it.
* **What ``cut_problems`` reads**: sizes (``nranks``) reported, the comm ranks held (a multiset), the job ranks
  holding it, those finalized, the rebuild kinds of live slots; per rank, live user reduction operators.
* Per node: ranks summed up, counted calls (DONE's message), unsettled and stuck job ranks, and at most
  ``LAG_LINES`` lines on why the lowest unsettled ranks are not settled (combined, the ``LAG_SHOWN`` lowest):
  a round does not carry a string per rank.

The decisions (action, targets, stuck and unsettled ranks) are those of the rules over the union of the views;
the reasons' words differ only in that long lists of ranks are cut short (``few``), the laggards shown are
the lowest-ranked few, a raise names the lowest job rank held there, and the raises are listed by communicator.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from cryosleep.core.interceptor import SlotState, WaitKind
from cryosleep.cut.views import (
    Action,
    CommTarget,
    Decision,
    Pair,
    RankView,
    Targets,
    comm_label,
    is_stuck,
    laggard_text,
)

LAG_LINES = 2  # lines on laggards per node summary
LAG_SHOWN = 6  # ... and in a combined one (the coordinator's reason)
FEW = 16  # ranks listed in a reason before "and N more"

Held = tuple[int, int]  # (count at which a held thread waits, lowest job rank waiting there)


@dataclass(frozen=True)
class CommSummary:
    """One communicator, over the summarized ranks that hold a slot of it."""

    sizes: frozenset[int]
    """The ``nranks`` its slots report."""
    coll: int = 0
    """The largest collective count (``seq``)."""
    pairs: Mapping[Pair, int] = field(default_factory=dict)
    """(sender, receiver) -> the largest of the sender's sends and the receiver's receives (nonzero only)."""
    held_coll: Held | None = None
    """A stuck rank's held thread waits to issue a collective: the largest ``seq`` there (and its rank)."""
    held_pairs: Mapping[Pair, Held] = field(default_factory=dict)
    """... a send or receive of this pair: the largest count there."""
    members: tuple[tuple[int, int], ...] = ()
    """(comm rank, per-peer list length) of every slot, sorted."""
    holders: tuple[int, ...] = ()
    """The job rank of every slot, sorted."""
    finalized: tuple[int, ...] = ()
    """The job rank of every finalized slot, sorted."""
    kinds: frozenset[int] = frozenset()
    """The rebuild kinds of its live slots."""
    written_coll: frozenset[int] = frozenset()
    """The collective targets written on its slots."""
    written_pairs: Mapping[Pair, Mapping[int, int]] = field(default_factory=dict)
    """(sender, receiver) -> {nonzero target written: how many slot sides (sender's send, receiver's recv) hold
    it}."""

    @property
    def nranks(self) -> int:
        return min(self.sizes)


@dataclass(frozen=True)
class NodeSummary:
    """What the cut's rules need from some ranks' views (one node's, or a whole job's once combined)."""

    ranks: int = 0
    """Views summed up."""
    calls: int = 0
    """Counted calls: collectives and sends, every slot."""
    comms: Mapping[int, CommSummary] = field(default_factory=dict)
    unsettled: tuple[int, ...] = ()
    """Job ranks not settled at the targets written on them (or that did not answer them), sorted."""
    stuck: tuple[int, ...] = ()
    """Job ranks below their targets with every thread held, sorted."""
    lag: tuple[tuple[int, str], ...] = ()
    """(job rank, why it has not settled) for the lowest unsettled ranks, at most ``LAG_LINES`` (``LAG_SHOWN``
    once combined)."""
    premul: tuple[tuple[int, int], ...] = ()
    """(job rank, user reduction operators alive) where any are."""


def _max_held(a: Held | None, b: Held | None) -> Held | None:
    """The larger count; at equal counts the lower rank."""
    if a is None or b is None:
        return a if b is None else b
    return a if (a[0], -a[1]) >= (b[0], -b[1]) else b


def _nonzero_pairs(rank: int, send: Sequence[int], recv: Sequence[int]) -> Iterable[tuple[Pair, int]]:
    """A slot's nonzero per-peer counts (or targets) as (sender, receiver) pairs: its sends to p as (rank, p), its
    receives from p as (p, rank). Most slots count no point-to-point calls: their all-zero lists are skipped."""
    if any(send):
        for p, n in enumerate(send):
            if n:
                yield (rank, p), n
    if any(recv):
        for p, n in enumerate(recv):
            if n:
                yield (p, rank), n


class _Comm:
    """A CommSummary being built (mutable)."""

    def __init__(self) -> None:
        self.sizes: set[int] = set()
        self.coll = 0
        self.pairs: dict[Pair, int] = {}
        self.held_coll: Held | None = None
        self.held_pairs: dict[Pair, Held] = {}
        self.members: list[tuple[int, int]] = []
        self.holders: list[int] = []
        self.finalized: list[int] = []
        self.kinds: set[int] = set()
        self.written_coll: set[int] = set()
        self.written_pairs: dict[Pair, Counter[int]] = {}

    def pair(self, k: Pair, n: int) -> None:
        if n > self.pairs.get(k, 0):
            self.pairs[k] = n

    def held(self, k: Pair | None, h: Held) -> None:
        if k is None:
            self.held_coll = _max_held(self.held_coll, h)
        else:
            self.held_pairs[k] = _max_held(self.held_pairs.get(k), h) or h

    def written(self, k: Pair, value: int, sides: int = 1) -> None:
        self.written_pairs.setdefault(k, Counter())[value] += sides

    def add(self, c: CommSummary) -> None:
        self.sizes |= c.sizes
        self.coll = max(self.coll, c.coll)
        for k, n in c.pairs.items():
            self.pair(k, n)
        if c.held_coll is not None:
            self.held(None, c.held_coll)
        for k, h in c.held_pairs.items():
            self.held(k, h)
        self.members += c.members
        self.holders += c.holders
        self.finalized += c.finalized
        self.kinds |= c.kinds
        self.written_coll |= c.written_coll
        for k, vals in c.written_pairs.items():
            for value, sides in vals.items():
                self.written(k, value, sides)

    def done(self) -> CommSummary:
        return CommSummary(frozenset(self.sizes), self.coll, dict(sorted(self.pairs.items())), self.held_coll,
                           dict(sorted(self.held_pairs.items())), tuple(sorted(self.members)),
                           tuple(sorted(self.holders)), tuple(sorted(self.finalized)), frozenset(self.kinds),
                           frozenset(self.written_coll),
                           {k: dict(sorted(v.items())) for k, v in sorted(self.written_pairs.items())})


def summarize(views: Iterable[RankView], lag_lines: int = LAG_LINES) -> NodeSummary:
    """One summary of these ranks' views (a node's, read by its agent)."""
    comms: dict[int, _Comm] = {}
    ranks = calls = 0
    unsettled: list[RankView] = []
    stuck: list[int] = []
    premul: list[tuple[int, int]] = []
    for v in views:
        ranks += 1
        if not (v.answered and v.settled):
            unsettled.append(v)
        held_here = is_stuck(v)
        if held_here:
            stuck.append(v.rank)
        if v.premul_live:
            premul.append((v.rank, v.premul_live))
        for s in v.comms:
            c = comms.get(s.ident)
            if c is None:
                c = comms[s.ident] = _Comm()
            c.sizes.add(s.nranks)
            c.coll = max(c.coll, s.seq)
            calls += s.seq
            calls += sum(s.send)
            for k, n in _nonzero_pairs(s.rank, s.send, s.recv):
                c.pair(k, n)
            c.members.append((s.rank, len(s.send)))
            c.holders.append(v.rank)
            if s.state == SlotState.FINALIZED:
                c.finalized.append(v.rank)
            elif s.state == SlotState.LIVE:
                c.kinds.add(s.rebuild)
            c.written_coll.add(s.coll_target)
            for k, n in _nonzero_pairs(s.rank, s.send_target, s.recv_target):
                c.written(k, n)
            if held_here and s.waiting and s.state == SlotState.LIVE:
                p = s.waiting_peer
                if s.waiting_kind == WaitKind.COLL:
                    c.held(None, (s.seq, v.rank))
                elif s.waiting_kind == WaitKind.SEND and 0 <= p < len(s.send):
                    c.held((s.rank, p), (s.send[p], v.rank))
                elif s.waiting_kind == WaitKind.RECV and 0 <= p < len(s.recv):
                    c.held((p, s.rank), (s.recv[p], v.rank))
    unsettled.sort(key=lambda v: v.rank)
    return NodeSummary(ranks, calls, {i: c.done() for i, c in sorted(comms.items())},
                       tuple(v.rank for v in unsettled), tuple(sorted(stuck)),
                       tuple((v.rank, laggard_text(v)) for v in unsettled[:lag_lines]), tuple(sorted(premul)))


def combine(summaries: Iterable[NodeSummary], lag_lines: int = LAG_SHOWN) -> NodeSummary:
    """One summary of every summarized rank (the nodes' summaries of a job): as if summarized at once, except
    that the ``lag_lines`` lowest-ranked laggard lines of those given are kept. Associative, and the order of
    the summaries does not matter."""
    comms: dict[int, _Comm] = {}
    ranks = calls = 0
    unsettled: list[int] = []
    stuck: list[int] = []
    lag: list[tuple[int, str]] = []
    premul: list[tuple[int, int]] = []
    for s in summaries:
        ranks += s.ranks
        calls += s.calls
        for ident, c in s.comms.items():
            b = comms.get(ident)
            if b is None:
                b = comms[ident] = _Comm()
            b.add(c)
        unsettled += s.unsettled
        stuck += s.stuck
        lag += s.lag
        premul += s.premul
    return NodeSummary(ranks, calls, {i: c.done() for i, c in sorted(comms.items())}, tuple(sorted(unsettled)),
                       tuple(sorted(stuck)), tuple(sorted(lag)[:lag_lines]), tuple(sorted(premul)))


def few(xs: Sequence[int], n: int = FEW) -> str:
    """A list of ranks for a reason: as Python prints it, cut short after ``n``."""
    if len(xs) <= n:
        return str(list(xs))
    return str(list(xs[:n]))[:-1] + f", ... and {len(xs) - n} more]"


# ---- the rules ---------------------------------------------------------------------------------------------

def maxima(s: NodeSummary, floor: Targets | None = None) -> dict[int, CommTarget]:
    """Per communicator, the maxima over its members' counters (and never below ``floor``)."""
    out: dict[int, CommTarget] = {ident: CommTarget(t.coll, dict(t.pairs)) for ident, t in (floor or {}).items()}
    for ident, c in s.comms.items():
        t = out.get(ident)
        if t is None:
            out[ident] = CommTarget(c.coll, dict(c.pairs))
            continue
        pairs = dict(t.pairs)
        for k, n in c.pairs.items():
            pairs[k] = max(pairs.get(k, 0), n)
        out[ident] = CommTarget(max(t.coll, c.coll), pairs)
    return out


def raise_held(s: NodeSummary, targets: Targets) -> tuple[dict[int, CommTarget], list[str]]:
    """Adds, for the stuck ranks, the call each of their held threads waits to issue: a held count at or above
    a target raises it to that count + 1 (the largest held count decides). Returns the new targets and what
    was raised, in words."""
    out: dict[int, CommTarget] = {ident: CommTarget(t.coll, dict(t.pairs)) for ident, t in targets.items()}
    notes: list[str] = []
    for ident, c in s.comms.items():
        if c.held_coll is None and not c.held_pairs:
            continue
        t = out.get(ident, CommTarget())
        coll, pairs = t.coll, dict(t.pairs)
        name = comm_label(ident, c.nranks)
        if c.held_coll is not None and c.held_coll[0] >= coll:
            coll = c.held_coll[0] + 1
            notes.append(f"rank {c.held_coll[1]} is held at collective {coll} of {name}")
        for (a, b), (n, rank) in c.held_pairs.items():
            if n >= pairs.get((a, b), 0):
                pairs[(a, b)] = n + 1
                notes.append(f"rank {rank} is held at point-to-point call {n + 1} from its rank {a} to its rank {b} "
                             f"of {name}")
        out[ident] = CommTarget(coll, pairs)
    return out, notes


def _sides(c: CommSummary) -> Callable[[Pair], int]:
    """How many slot sides see pair (a, b): a's slots whose peer list reaches b, b's whose list reaches a."""
    lengths: dict[int, list[int]] = {}
    for r, n in c.members:
        lengths.setdefault(r, []).append(n)

    def sides(k: Pair) -> int:
        a, b = k
        return sum(n > b for n in lengths.get(a, ())) + sum(n > a for n in lengths.get(b, ()))
    return sides


def stale(c: CommSummary, t: CommTarget | None) -> bool:
    """Some slot of ``c`` does not hold what ``t`` would write on it (``views.slot_targets``)."""
    if c.written_coll != {t.coll if t is not None else 0}:
        return True
    pairs = t.pairs if t is not None else {}
    if not pairs and not c.written_pairs:
        return False
    sides = _sides(c)
    for k, vals in c.written_pairs.items():
        want = pairs.get(k, 0)
        if not want or vals != {want: sides(k)}:
            return True
    return any(n and k not in c.written_pairs and sides(k) for k, n in pairs.items())


def problems(s: NodeSummary) -> list[str]:
    """Why a settled cut cannot be quiesced and rebuilt (empty: it can)."""
    out: list[str] = []
    for ident, c in sorted(s.comms.items()):
        name = comm_label(ident, c.nranks)
        if len(c.sizes) > 1:
            out.append(f"{name}: its members disagree on its size ({sorted(c.sizes)})")
            continue
        n = c.nranks
        have = [r for r, _ in c.members]
        if have != list(range(n)):
            out.append(f"{name}: only job ranks {few(c.holders)} hold it (its ranks {few(have)} of 0..{n - 1}); the "
                       "others destroyed it or have not created it, so it could not be rebuilt")
        if c.finalized and len(c.finalized) != len(c.holders):
            live = sorted((Counter(c.holders) - Counter(c.finalized)).elements())
            out.append(f"{name}: finalized by job ranks {few(c.finalized)} but not yet by {few(live)}, so it could "
                       "not be rebuilt")
        if len(c.kinds) > 1:
            out.append(f"{name}: rebuilt from an id on some members and replayed as a split on others (its split "
                       "parent was ended on some ranks only)")
    for rank, n in s.premul:
        out.append(f"rank {rank}: {n} user reduction operator(s) (ncclRedOpCreatePreMulSum) are alive and would not "
                   "survive the rebuild")
    return out


def laggards(s: NodeSummary) -> str:
    """The ranks that have not settled, and why, in words (the lowest-ranked few)."""
    parts = [text for _, text in s.lag]
    shown = {r for r, _ in s.lag}
    rest = [r for r in s.unsettled if r not in shown]
    if rest:
        parts.append(f"and {len(rest)} more rank(s) not settled: {few(rest)}")
    return "; ".join(parts) or "every rank settled, but the targets kept changing"


def decide_nodes(now: float, deadline: float, summaries: Sequence[NodeSummary],
                 floor: Targets | None = None) -> Decision:
    """One round of the drain over the nodes' summaries: what to do, given the time and the targets last
    written (``floor``). Pure: the same inputs always give the same decision."""
    s = summaries[0] if len(summaries) == 1 else combine(summaries)
    if not s.ranks:
        return Decision(Action.DONE, {}, "no rank has NCCL communicators")
    targets, raised = raise_held(s, maxima(s, floor))
    stale_comms = [i for i, c in s.comms.items() if stale(c, targets.get(i))]
    unsettled = s.unsettled
    if not unsettled and not stale_comms:
        found = problems(s)
        if found:
            return Decision(Action.GIVE_UP, targets, "the ranks settled at a cut that cannot be rebuilt: "
                            + "; ".join(found), (), unsettled)
        return Decision(Action.DONE, targets, f"every rank settled at the cut: {s.ranks} rank(s), "
                        f"{len(s.comms)} communicator(s), {s.calls} counted calls", (), unsettled)
    if now >= deadline:
        found = problems(s) if not unsettled else []
        return Decision(Action.GIVE_UP, targets, "not at a consistent cut by the deadline: " + laggards(s)
                        + (" (" + "; ".join(found) + ")" if found else ""), (), unsettled)
    if stale_comms:
        why = "; ".join(raised) if raised else f"new maxima on {len(stale_comms)} communicator(s)"
        return Decision(Action.WRITE, targets, why, s.stuck, unsettled)
    shown = ", ".join(f"rank {r}" for r in unsettled[:FEW])
    more = f" and {len(unsettled) - FEW} more" if len(unsettled) > FEW else ""
    return Decision(Action.WAIT, targets, "waiting for " + shown + more, (), unsettled)


AskNodes = Callable[[int, Targets | None], NodeSummary]
"""One round of a drain carried out: ``ask(round, targets)`` writes ``targets`` on every rank and returns the
summary of their fresh views once they answered (or a bounded wait ran out); ``ask(round, None)`` waits a little
for the ranks to move on toward the targets already written, and returns the summary of their fresh views."""


def drain(first: NodeSummary, ask: AskNodes, deadline: float,
          now: Callable[[], float]) -> tuple[Decision, int]:
    """The drain's rounds: ``decide_nodes`` on the summary, ``ask`` for the next round, until the decision is
    DONE or GIVE_UP. Returns that decision and how many rounds were asked. The targets written last are the next
    decision's ``floor`` (a target never goes down during a drain)."""
    floor: dict[int, CommTarget] = {}
    s = first
    rounds = 0
    while True:
        d = decide_nodes(now(), deadline, [s], floor)
        if d.action in (Action.DONE, Action.GIVE_UP):
            return d, rounds
        rounds += 1
        if d.action is Action.WRITE:
            floor = d.targets
            s = ask(rounds, d.targets)
        else:
            s = ask(rounds, None)
