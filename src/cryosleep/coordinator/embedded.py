"""The coordinator embedded in a one-node job's agent: the snapshot sequence of ``machine.py`` run in-process
against the node's own operations (a ``client.NodeBackend``, the same object a coordinator's commands reach over
HTTP), with no hub and no catalog. One-node and multi-node snapshots therefore run one phase list with one
rollback; only the transport differs. A node's own error is reported as it is (with its details: the checks
that refused, the ranks short of the cut), not wrapped as "node 0 failed at OP".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from cryosleep.coordinator.client import NodeBackend
from cryosleep.coordinator.machine import (
    PHASE_OF,
    Args,
    MachineConfig,
    NodeFailure,
    Outcome,
    SnapshotSequence,
    new_snapshot_id,
)
from cryosleep.coordinator.protocol import Command, Mode, Op
from cryosleep.errors import CaptureFailed, CryosleepError

# A round of the drain in which no new targets were written waits this long for the ranks to move: in-process,
# a round costs nothing but this wait (across nodes, each round is a poll away: machine.MachineConfig).
REPORT_WAIT_S = 0.002


class MemoryJournal:
    """What the embedded run records (``machine.Journal``): the snapshot's row, in memory, for its caller."""

    def __init__(self, sid: str, job: str, mode: Mode) -> None:
        self.row: dict[str, Any] = {"id": sid, "job": job, "mode": str(mode), "state": "preparing", "phases": {}}
        self.nodes: dict[int, dict[str, Any]] = {}
        self.events: list[tuple[str, str]] = []

    def update_snapshot(self, sid: str, *, state: str | None = None, reason: str | None = None,
                        phases: dict[str, float] | None = None, error: dict[str, Any] | None = None,
                        at_cut: bool | None = None, finished: bool = False) -> None:
        for k, v in (("state", state), ("reason", reason), ("phases", phases), ("error", error), ("at_cut", at_cut)):
            if v is not None:
                self.row[k] = v

    def update_node(self, sid: str, node_rank: int, *, state: str | None = None,
                    phases: dict[str, float] | None = None, image: dict[str, Any] | None = None) -> None:
        node = self.nodes.setdefault(node_rank, {})
        for k, v in (("state", state), ("phases", phases), ("image", image)):
            if v is not None:
                node[k] = v

    def mark_verified(self, sid: str, job: str, *, ponr: bool, phases: dict[str, float]) -> None:
        self.row.update(state="verified", phases=phases)

    def set_job_state(self, name: str, state: str, last_snapshot: str | None = None) -> None:
        pass  # the agent's own record says how the job is

    def event(self, kind: str, message: str, *, job: str | None = None, snapshot: str | None = None,
              node_rank: int | None = None) -> None:
        self.events.append((kind, message))

    def snapshot(self, sid: str) -> dict[str, Any]:
        return dict(self.row)


class EmbeddedRun(SnapshotSequence):
    """One snapshot (or rehearsal) of a one-node job, in the agent's process: ``take()`` runs the sequence and
    raises the node's error once the rollback has run."""

    holds_network = False  # one node: no frame can cross to a node captured at another moment
    verify_kept = False  # a keep-running image is not re-read here (an upload verifies it in the remote store)

    def __init__(self, node: NodeBackend, *, job: str, mode: Mode, timeout_s: float, rehearsal: bool = False,
                 log: Callable[[str], None] | None = None) -> None:
        sid = new_snapshot_id(job)
        self.journal = MemoryJournal(sid, job, mode)
        super().__init__(self.journal, sid=sid, job=job, mode=mode, timeout_s=timeout_s, nodes={0: job},
                         cfg=MachineConfig(report_wait_s=REPORT_WAIT_S, rebuild_retries=1), log=log)
        self.node = node
        self.rehearsal = rehearsal

    def gather(self, op: Op, args: Args, deadline: float, *,
               tolerant: bool = False, nodes: list[int] | None = None) -> Outcome[Any]:
        self.step += 1
        out: Outcome[Any] = Outcome()
        for n in list(self.nodes) if nodes is None else nodes:
            cmd = Command(id=f"{self.sid}.{self.step}.{op}", snapshot=self.sid, job=self.job, op=op,
                          budget_s=max(0.0, deadline - time.monotonic()),
                          deadline=time.time() + max(0.0, deadline - time.monotonic()),
                          args=args(n) if callable(args) else args)
            fn: Callable[[Command], Mapping[str, Any]] = getattr(self.node, str(op))
            start = time.monotonic()
            try:
                out.ok[n] = fn(cmd)
            except CryosleepError as e:
                out.failed.append(NodeFailure(n, f"{op}: {e.what}" + (f": {e.why}" if e.why else ""), e))
            except Exception as e:  # a bug in a step: reported, and rolled back like any failure
                err = CaptureFailed(f"the snapshot failed: {type(e).__name__}: {e}",
                                    "the job was resumed and goes on running", "see the agent's log")
                out.failed.append(NodeFailure(n, f"{op}: {err.what}", err))
            finally:
                phase = PHASE_OF[op]
                np = self.node_phases.setdefault(n, {})
                np[phase] = round(np.get(phase, 0.0) + time.monotonic() - start, 6)
        if out.failed and not tolerant:
            first = out.failed[0]
            assert first.error is not None
            raise first.error
        return out

    def lost(self, node: int) -> bool:
        return False  # the node is this process

    def still_the_job(self) -> bool:
        return True

    def take(self) -> dict[str, Any]:
        """Runs the sequence; returns its row, or raises why it failed (after the rollback resumed the job)."""
        row = self.run()
        if self.error is not None:
            raise self.error
        return row
