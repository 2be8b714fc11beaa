"""The cut over per-node summaries (cryosleep/cut/summary.py) decides what the rules over every view decide.

The specification is the rules as they were written over views (tests/unit/cut_reference.py, the code before
the summaries). For random views, and for the simulated programs of test_cut.py caught at random moments of
their drains, split at random into nodes: ``decide_nodes`` over the nodes' summaries gives the reference's
action, targets, stuck ranks and unsettled ranks (the reasons' words may differ: summary.py's docstring says
how). ``combine`` is associative and order-independent, and combining nodes' summaries is summarizing their
views at once (the laggard lines aside: a node keeps fewer).
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cryosleep.core.interceptor import CommSlot, Rebuild, SlotState, WaitKind
from cryosleep.cut.summary import LAG_SHOWN, NodeSummary, combine, decide_nodes, summarize
from cryosleep.cut.views import CommTarget, Decision, RankView, slot_targets
from tests.unit import cut_reference as ref
from tests.unit.test_cut import PROGRAMS

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _split(views: list[RankView], rng: random.Random) -> list[list[RankView]]:
    nodes: list[list[RankView]] = [[] for _ in range(rng.randint(1, max(1, len(views))))]
    for v in views:
        rng.choice(nodes).append(v)
    return [n for n in nodes if n] or [[]]


def _same(got: Decision, want: Decision) -> None:
    assert got.action == want.action, (got.reason, want.reason)
    assert got.targets == want.targets, (got.reason, want.reason)
    assert got.stuck == tuple(sorted(want.stuck))


def _check(now: float, deadline: float, views: list[RankView], floor: dict[int, CommTarget] | None,
           rng: random.Random) -> Decision:
    want = ref.decide(now, deadline, views, floor)
    parts = [summarize(p) for p in _split(views, rng)]
    got = decide_nodes(now, deadline, parts, floor)
    _same(got, want)
    assert got.unsettled == tuple(sorted(v.rank for v in views if not (v.answered and v.settled)))
    # combining is summarizing at once (but for how many laggard lines each keeps)
    assert _no_lag(combine(parts)) == _no_lag(summarize(views))
    return want


def _no_lag(s: NodeSummary) -> NodeSummary:
    return NodeSummary(s.ranks, s.calls, s.comms, s.unsettled, s.stuck, (), s.premul)


# ---- random views ------------------------------------------------------------------------------------------

@st.composite
def job(draw: st.DrawFn) -> tuple[list[RankView], dict[int, CommTarget] | None]:
    """A few ranks in a few communicators, counters near a set of targets ``w`` (written on most slots, the
    floor most of the time), with members missing, sizes disagreeing, finalized slots, held threads."""
    nranks = draw(st.integers(1, 6))
    small = st.integers(0, 4)
    comms: dict[int, list[int]] = {}
    for ident in range(draw(st.integers(0, 3))):
        size = draw(st.integers(1, min(4, nranks)))
        comms[0x100 + ident] = draw(st.lists(st.integers(0, nranks - 1), min_size=size, max_size=size, unique=True))
    w = {ident: CommTarget(draw(small), {k: n for k in [(a, b) for a in range(len(m)) for b in range(len(m))]
                                         if (n := draw(st.sampled_from([0, 0, 0, 1, 2])))})
         for ident, m in comms.items()}
    slots: dict[int, list[CommSlot]] = {r: [] for r in range(nranks)}
    for ident, members in comms.items():
        t = w[ident]
        for me, r in enumerate(members):
            if draw(st.integers(0, 9)) == 0:
                continue  # this member destroyed it (or never created it)
            size = len(members) + (1 if draw(st.integers(0, 19)) == 0 else 0)
            peers = min(size, len(members)) - (1 if size > 1 and draw(st.integers(0, 4)) == 0 else 0)
            want = slot_targets(w, CommSlot(0, 0, 0, ident, me, size, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                            (0,) * peers, (0,) * peers, (0,) * peers, (0,) * peers))
            coll_t, send_t, recv_t = want
            if draw(st.integers(0, 4)) == 0:  # written something else (an older round, a late rank)
                coll_t = draw(small)
                send_t = tuple(draw(st.lists(small, min_size=peers, max_size=peers)))
                recv_t = tuple(draw(st.lists(small, min_size=peers, max_size=peers)))
            below = draw(st.booleans())  # counters at or below the targets (a cut can be reached)

            def count(target: int, below: bool = below) -> int:
                return draw(st.integers(0, target)) if below else draw(small)
            send = tuple(count(t.pairs.get((me, p), 0)) for p in range(peers))
            recv = tuple(count(t.pairs.get((p, me), 0)) for p in range(peers))
            kind = draw(st.sampled_from([WaitKind.NONE, WaitKind.COLL, WaitKind.COLL, WaitKind.SEND, WaitKind.RECV]))
            state = draw(st.sampled_from([SlotState.LIVE] * 8 + [SlotState.FINALIZED]))
            slots[r].append(CommSlot(
                index=len(slots[r]), state=state, vid=1, ident=ident, rank=me, nranks=size, parent_vid=0, color=0,
                key=0, rebuild=draw(st.sampled_from([Rebuild.FROM_ID] * 9 + [Rebuild.SPLIT])), flags=0, device=-1,
                seq=count(t.coll), coll_target=coll_t, uid_gen=0, waiting=int(kind != WaitKind.NONE),
                waiting_kind=kind, waiting_peer=draw(st.integers(-1, peers)), send=send, recv=recv,
                send_target=send_t, recv_target=recv_t))
    views = []
    for r in range(nranks):
        gen = draw(st.integers(1, 2))
        views.append(RankView(rank=r, comms=tuple(slots[r]), held=draw(st.integers(0, 2)),
                              busy=draw(st.sampled_from([0, 0, 0, 1])), in_group=draw(st.sampled_from([0, 0, 0, 1])),
                              targets_gen=2, settled_gen=gen if draw(st.integers(0, 5)) == 0 else 2,
                              settled=draw(st.booleans()), premul_live=draw(st.sampled_from([0] * 9 + [1]))))
    order = draw(st.permutations(views))
    floor = draw(st.sampled_from([w, w, None, {}]))
    return list(order), floor


@SETTINGS
@given(job(), st.randoms(use_true_random=False), st.booleans())
def test_random_views_decide_alike_split_into_nodes(j: tuple[list[RankView], dict[int, CommTarget] | None],
                                                    rng: random.Random, late: bool) -> None:
    views, floor = j
    _check(11.0 if late else 0.0, 10.0, views, floor, rng)


@SETTINGS
@given(job(), job(), job(), st.randoms(use_true_random=False))
def test_combine_is_associative_and_order_independent(a: tuple[list[RankView], object],
                                                      b: tuple[list[RankView], object],
                                                      c: tuple[list[RankView], object], rng: random.Random) -> None:
    sa, sb, sc = summarize(a[0]), summarize(b[0]), summarize(c[0])
    left = combine([combine([sa, sb]), sc])
    assert left == combine([sa, combine([sb, sc])]) == combine([sa, sb, sc])
    parts = [sa, sb, sc]
    rng.shuffle(parts)
    assert combine(parts) == left
    assert len(left.lag) <= LAG_SHOWN


# ---- the simulated programs, at every round of their drains ------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(PROGRAMS)), st.integers(0, 10**6))
def test_simulated_drains_decide_alike_at_every_round(name: str, seed: int) -> None:
    rng = random.Random(seed)
    sim = PROGRAMS[name]()
    sim.run(rng, rng.randint(0, 400))
    sim.hold = True
    sim.write({})
    floor: dict[int, CommTarget] = {}
    for rnd in range(200):
        d = _check(float(rnd), 150.0, sim.views(), floor, rng)
        if d.action.value in ("done", "give-up"):
            break
        if d.action.value == "write":
            sim.write(dict(d.targets))
            floor = dict(d.targets)
        sim.run(rng, rng.randint(0, 12))


# ---- the held-call rule, derived ---------------------------------------------------------------------------

@SETTINGS
@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.integers(0, 6))
def test_held_raise_is_the_largest_held_count_in_any_order(held: list[int], target: int) -> None:
    """raise_for_stuck visits held calls one by one: ``count >= current`` sets ``current = count + 1``. Whatever
    the order, the result is ``max(held) + 1`` when ``max(held) >= target``, else the target; with the target the
    maximum over every member (``max_targets``: ``target >= every count``) that is: a raise exactly where a held
    count equals the target, to target + 1."""
    def visit(order: list[int]) -> int:
        cur = target
        for n in order:
            if n >= cur:
                cur = n + 1
        return cur
    want = max(held) + 1 if max(held) >= target else target
    assert visit(held) == visit(list(reversed(held))) == visit(sorted(held)) == want
    if target >= max(held):
        assert want == (target + 1 if target in held else target)


def test_a_pair_beyond_a_truncated_peer_list_counts_only_the_sides_that_see_it() -> None:
    """Per-peer lists hold ``min(nranks, MAX_PEERS)`` entries: here 2 of 3. Comm rank 0's receive-from-0 count on
    comm rank 2 is a pair (0 -> 2) that rank 0's own slot cannot hold (its send list stops at peer 1): the cut
    is done when rank 2's side holds the target, as the rules over the views say."""
    def slot(me: int, **kw: object) -> CommSlot:
        base: dict[str, object] = dict(index=0, state=SlotState.LIVE, vid=1, ident=7, rank=me, nranks=3,
                                       parent_vid=0, color=0, key=0, rebuild=Rebuild.FROM_ID, flags=0, device=-1,
                                       seq=1, coll_target=1, uid_gen=0, waiting=0, waiting_kind=0, waiting_peer=-1,
                                       send=(0, 0), recv=(0, 0), send_target=(0, 0), recv_target=(0, 0))
        base.update(kw)
        return CommSlot(**base)  # type: ignore[arg-type]
    views = [RankView(r, (s,), settled=True, targets_gen=2, settled_gen=2)
             for r, s in enumerate([slot(0), slot(1), slot(2, recv=(1, 0), recv_target=(1, 0))])]
    floor = {7: CommTarget(1, {(0, 2): 1})}
    want = ref.decide(0.0, 10.0, views, floor)
    assert want.action.value == "done"
    for parts in ([views], [views[:1], views[1:]], [[v] for v in views]):
        _same(decide_nodes(0.0, 10.0, [summarize(p) for p in parts], floor), want)
    # and with rank 2's side not yet written: a write, as the rules say
    stale = [*views[:2], RankView(2, (slot(2, recv=(1, 0)),), settled=True, targets_gen=2, settled_gen=2)]
    assert decide_nodes(0.0, 10.0, [summarize(stale)], floor).action == ref.decide(0.0, 10.0, stale, floor).action
