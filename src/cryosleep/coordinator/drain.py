"""Draining a host (``cryosleep coordinator drain HOST``, what a maintenance window or a health signal sends): every
job with a node there is moved off it, and the host takes no node until ``coordinator undrain HOST``.

The decision for each job is pure (``decide``) and carries its reasons: which of its nodes run on the host, and
whether a free host with those nodes' GPUs exists (a spare, found by the placement's own rules, placement.py
``Placements.pick``).

* With a spare, and nodes of the job elsewhere to stay: a live migration (migrate.py): only the nodes on the
  host move, onto the spare, while the others hold at the cut and then run on with the same processes. A
  migration that fails before its point of no return leaves the job running where it was (its rollback); the
  drain then falls back to the next way, and says why.
* Otherwise (no spare, or every node of the job on the host: nothing would hold): the job is stop-snapshotted
  within the drain's deadline (all its nodes, one cut, all or nothing: a failed snapshot leaves the job running
  where it was, and the drain says so) and its snapshot is queued (queue.py), so that it comes back, on its own,
  once free compatible hosts are there.

The decisions are events in the catalog (kind ``drain``; a migration's steps, kind ``migrate``), lines in the
coordinator's log, and the drain's answer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

SUSPEND = "suspend-and-queue"
MIGRATE = "migrate"


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
    outcome: str = "pending"  # then migrated, queued or failed
    migration: str = ""  # the migration's snapshot id, when one was tried
    error: dict[str, Any] | None = None
    nnodes: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def decide(job: str, host: str, nodes: list[int], nnodes: int, spare: list[str], no_spare: str) -> Decision:
    """What to do with ``job``, whose ``nodes`` (of ``nnodes``) run on ``host``: ``spare`` holds the free
    compatible hosts found for them (``no_spare``: why none was, when none was)."""
    where = f"node(s) {', '.join(map(str, nodes))} of {nnodes} run on {host}, which is drained"
    if spare and len(nodes) < nnodes:
        moves = ", ".join(f"node {n} to {h}" for n, h in zip(sorted(nodes), spare, strict=True))
        reasons = [where, f"host(s) {', '.join(spare)} are free with those nodes' GPUs",
                   f"only those nodes move ({moves}), a live migration: the other nodes hold at the cut and run on "
                   "with the same processes"]
        return Decision(job, host, sorted(nodes), MIGRATE, list(spare), reasons, nnodes=nnodes)
    if spare:
        reasons = [where, f"host(s) {', '.join(spare)} are free with those nodes' GPUs",
                   "every node of the job runs there, so none would hold at the cut: the whole job is "
                   "stop-snapshotted and queued, and the queue restores it on the free hosts at once"]
    else:
        reasons = [where, f"no free compatible spare: {no_spare}",
                   "the whole job is stop-snapshotted and queued: it is restored on its own once free hosts with "
                   "its nodes' GPUs are there"]
    return Decision(job, host, sorted(nodes), SUSPEND, list(spare), reasons, nnodes=nnodes)


def fall_back(d: Decision, why: str) -> None:
    """The migration failed before its point of no return (the job runs where it was): suspend and queue it."""
    d.action = SUSPEND
    d.reasons.append(f"the migration {d.migration} failed ({why}); the job still runs where it was, so it is "
                     "stop-snapshotted and queued instead")
