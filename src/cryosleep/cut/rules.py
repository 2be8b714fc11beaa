"""The consistent cut as pure functions: every rank's counters in, targets and a reason out.

No I/O and no clock: the caller reads the control blocks into ``RankView``s, passes ``now`` and the
deadline, writes what ``decide`` returns, and calls again. ``to_cut`` is that loop, with the I/O handed in
(the node side writes the targets with ``cryosleep.cut.driver``). The rules are applied in ``summary.py``, over
per-node aggregates of the views (``summarize``): ``decide`` here is ``summary.decide_nodes`` over one summary
of every view, and the snapshot sequence's drain (``coordinator/machine.py``) runs the same rules over the
summaries its nodes send (``summary.drain``). The rules are docs/interceptor.md's "Drain to a consistent cut":

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

from collections.abc import Callable, Collection, Iterable, Sequence

from cryosleep.core.interceptor import CommSlot, Rebuild, SlotState
from cryosleep.cut import summary
from cryosleep.cut.summary import NodeSummary, summarize
from cryosleep.cut.views import (
    Action,
    CommTarget,
    Decision,
    IdRoute,
    Pair,
    RankView,
    Targets,
    comm_name,
    shortfalls,
    slot_targets,
    zeros,
)

__all__ = ["Action", "Ask", "CommTarget", "Decision", "IdRoute", "Pair", "RankView", "Targets", "comm_name",
           "cut_problems", "decide", "laggards", "max_targets", "raise_for_stuck", "relay_plan", "shortfalls",
           "slot_targets", "stuck_ranks", "to_cut", "zeros"]


def max_targets(views: Iterable[RankView], floor: Targets | None = None) -> dict[int, CommTarget]:
    """Per communicator, the maxima over its members' counters (and never below ``floor``)."""
    return summary.maxima(summarize(views, 0), floor)


def stuck_ranks(views: Iterable[RankView]) -> list[int]:
    """Ranks below their targets whose threads are all held (``views.is_stuck``), sorted."""
    return list(summarize(views, 0).stuck)


def raise_for_stuck(views: Iterable[RankView], targets: Targets,
                    stuck: Collection[int]) -> tuple[dict[int, CommTarget], list[str]]:
    """Adds, for every rank in ``stuck`` (those of ``stuck_ranks``), the call each of its held threads waits to
    issue: a collective at ``seq >= coll_target`` raises its communicator's target to ``seq + 1``; a send to p
    at ``send[p] >= send_target[p]`` raises the pair (this rank -> p) to ``send[p] + 1``; a receive likewise.
    Returns the new targets and what was raised, in words."""
    return summary.raise_held(summarize([v for v in views if v.rank in stuck], 0), targets)


def cut_problems(views: Sequence[RankView]) -> list[str]:
    """Why a settled cut cannot be quiesced and rebuilt (empty: it can)."""
    return summary.problems(summarize(views, 0))


def laggards(views: Sequence[RankView]) -> str:
    """The ranks that have not settled, and why, in words (the lowest-ranked few)."""
    return summary.laggards(summarize(views, summary.LAG_SHOWN))


def decide(now: float, deadline: float, views: Sequence[RankView], floor: Targets | None = None) -> Decision:
    """One round of the drain: what to do, given every rank's counters, the time and the targets last written
    (``floor``). Pure: the same inputs always give the same decision."""
    return summary.decide_nodes(now, deadline, [summarize(views, summary.LAG_SHOWN)], floor)


Ask = Callable[[int, Targets | None], Sequence[RankView]]
"""One round of a drain carried out: ``ask(round, targets)`` writes ``targets`` on every rank and returns their
fresh views once they answered (or a bounded wait ran out); ``ask(round, None)`` waits a little for the ranks
to move on toward the targets already written, and returns their fresh views."""


def to_cut(views: Sequence[RankView], ask: Ask, deadline: float,
           now: Callable[[], float]) -> tuple[Decision, Sequence[RankView], int]:
    """The drain's rounds (``summary.drain``) over views: ``decide`` on the views, ``ask`` for the next round,
    until the decision is DONE or GIVE_UP. Returns that decision, the views it was made on, and how many rounds
    were asked."""
    last = [views]

    def ask_summary(round_: int, targets: Targets | None) -> NodeSummary:
        last[0] = ask(round_, targets)
        return summarize(last[0], summary.LAG_SHOWN)

    d, rounds = summary.drain(summarize(views, summary.LAG_SHOWN), ask_summary, deadline, now)
    return d, last[0], rounds


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
