"""The consistent cut across a job's ranks: pure decisions (``rules``) and a node's side of them (``driver``).

``rules.decide`` takes every rank's counters (and the clock) and returns targets plus a reason; it does no I/O.
``rules.to_cut`` is the drain's rounds, with the I/O handed in (the snapshot sequence runs it over every node).
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

__all__ = [
    "Action",
    "CommTarget",
    "Decision",
    "IdRoute",
    "RankView",
    "Targets",
    "cut_problems",
    "decide",
    "max_targets",
    "raise_for_stuck",
    "relay_plan",
    "slot_targets",
    "stuck_ranks",
    "to_cut",
]
