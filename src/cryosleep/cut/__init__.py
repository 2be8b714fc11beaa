"""The consistent cut across a job's ranks: pure decisions (``rules``) and a node's side of them (``driver``).

``rules.decide`` takes every rank's counters (and the clock) and returns targets plus a reason; it does no I/O.
``rules.to_cut`` is the drain's rounds, with the I/O handed in. The rules themselves are ``summary``'s, over
per-node aggregates of the counters (``summarize`` on each node, ``combine`` and ``decide_nodes`` where the
snapshot sequence runs the drain over every node); ``views`` holds the types they share.
``driver`` reads and writes a node's control blocks: hold, one round's targets, quiesce, rebuild, run.
"""

from cryosleep.cut.rules import (
    Action,
    CommTarget,
    Decision,
    IdRoute,
    RankView,
    Targets,
    cut_problems,
    decide,
    max_targets,
    raise_for_stuck,
    relay_plan,
    slot_targets,
    stuck_ranks,
    to_cut,
)
from cryosleep.cut.summary import NodeSummary, combine, decide_nodes, summarize

__all__ = [
    "Action",
    "CommTarget",
    "Decision",
    "IdRoute",
    "NodeSummary",
    "RankView",
    "Targets",
    "combine",
    "cut_problems",
    "decide",
    "decide_nodes",
    "max_targets",
    "raise_for_stuck",
    "relay_plan",
    "slot_targets",
    "stuck_ranks",
    "summarize",
    "to_cut",
]
