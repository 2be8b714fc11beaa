"""The consistent cut across a job's ranks: pure decisions (``rules``) and the agent's drive loop (``driver``).

``rules.decide`` takes every rank's counters (and the clock) and returns targets plus a reason; it does no I/O.
``driver`` reads and writes the interceptors' control blocks and runs drain, quiesce and rebuild with it.
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
]
