"""Draining a host (``cryosleep coordinator drain HOST``, what a maintenance window or a health signal sends): every
job with a node there is moved off it, and the host takes no node until ``coordinator undrain HOST``.

The decision for each job is pure (``decide``) and carries its reasons: which of its nodes run on the host, and
whether a free host with those nodes' GPUs exists (a spare, found by the placement's own rules, placement.py
``Placements.pick``). What follows is the same either way as built: the job is stop-snapshotted within the
drain's deadline (all its nodes, one cut, all or nothing: a failed snapshot leaves the job running where it was,
and the drain says so) and its snapshot is queued (queue.py), so that it comes back, on its own, once free
compatible hosts are there: with a spare, at once. Moving only the drained node while the others hold at the cut
(a live migration) is not built; the decision says so when a spare exists.

The decisions are events in the catalog (kind ``drain``), lines in the coordinator's log, and the drain's answer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SUSPEND = "suspend-and-queue"


@dataclass
class Decision:
    job: str
    host: str
    nodes: list[int]  # the job's nodes on the host
    action: str
    spare: list[str]  # free compatible hosts for those nodes (empty: none)
    reasons: list[str]
    snapshot: str = ""
    entry: str = ""  # its queue entry
    outcome: str = "pending"  # then queued or failed
    error: dict[str, Any] | None = None
    nnodes: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def decide(job: str, host: str, nodes: list[int], nnodes: int, spare: list[str], no_spare: str) -> Decision:
    """What to do with ``job``, whose ``nodes`` (of ``nnodes``) run on ``host``: ``spare`` holds the free
    compatible hosts found for them (``no_spare``: why none was, when none was)."""
    where = f"node(s) {', '.join(map(str, nodes))} of {nnodes} run on {host}, which is drained"
    if spare:
        reasons = [where, f"host(s) {', '.join(spare)} are free with those nodes' GPUs",
                   "moving those nodes alone while the others hold at the cut (a live migration) is not built: the "
                   "whole job is stop-snapshotted and queued, and the queue restores it on free hosts (the spare "
                   "among them) at once"]
    else:
        reasons = [where, f"no free compatible spare: {no_spare}",
                   "the whole job is stop-snapshotted and queued: it is restored on its own once free hosts with "
                   "its nodes' GPUs are there"]
    return Decision(job, host, sorted(nodes), SUSPEND, sorted(spare), reasons, nnodes=nnodes)
