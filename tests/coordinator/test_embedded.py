"""The embedded coordinator: a one-node job's snapshot runs the coordinator's own sequence in-process, against
the node's operations (here the simulated node of ``coordinator/sim.py``; the real one, ``agent/coordinated.py``,
is exercised by every one-node job test under tests/jobs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cryosleep.coordinator.embedded import EmbeddedRun
from cryosleep.coordinator.protocol import Command, Mode
from cryosleep.errors import CaptureFailed
from tests.coordinator.sim import SimFaults, SimNode, SimWorld


class OneNode(SimNode):
    """The simulated node of a one-node job: its keep-running dump needs no job-network hold (the simulated
    node of many refuses one without)."""

    def _capture(self, cmd: Command) -> dict[str, Any]:
        self.net_held = True
        try:
            return super()._capture(cmd)
        finally:
            self.net_held = False


def node(tmp_path: Path, faults: SimFaults | None = None) -> SimNode:
    return OneNode(SimWorld(1, 4, seed=3, spread=4), 0, tmp_path / "store", faults)


def test_one_node_runs_the_sequence_in_process(tmp_path: Path) -> None:
    n = node(tmp_path)
    run = EmbeddedRun(n, job="one", mode=Mode.KEEP_RUNNING, timeout_s=10)
    row = run.take()
    ops = n.ops_of(run.sid)
    assert row["state"] == "verified" and ops[0] == "prepare" and "hold" in ops, ops
    # one node: no network hold around the dump (nothing can cross to a node captured at another moment)
    assert ops[ops.index("quiesce"):] == ["quiesce", "capture", "resume", "relay", "run", "persist"], ops
    assert (tmp_path / "store" / run.sid / "node-0.json").is_file() and n.running()
    assert set(run.phases.durations) == {"prepare", "drain", "quiesce", "capture", "resume", "persist"}


def test_the_node_error_is_raised_as_it_is_after_the_one_rollback(tmp_path: Path) -> None:
    n = node(tmp_path, SimFaults(fail={"capture": "disk full"}))
    run = EmbeddedRun(n, job="one", mode=Mode.STOP, timeout_s=10)
    with pytest.raises(CaptureFailed) as e:
        run.take()
    assert e.value.what == "simulated failure at capture on node 0" and e.value.why == "disk full"
    ops = n.ops_of(run.sid)
    assert ops[-5:] == ["capture", "abort", "resume", "relay", "run"], ops  # past the cut: undo, then rebuild
    assert n.running() and not (tmp_path / "store" / run.sid / "node-0.json").exists()
    assert run.journal.row["state"] == "failed"


def test_a_failed_rebuild_is_retried_once_and_the_snapshot_goes_through(tmp_path: Path) -> None:
    n = node(tmp_path, SimFaults(fail={"relay": "id lost"}, once=True))
    run = EmbeddedRun(n, job="one", mode=Mode.KEEP_RUNNING, timeout_s=10)
    assert run.take()["state"] == "verified"
    ops = n.ops_of(run.sid)
    assert ops.count("resume") == 2 and "abort" not in ops and ops[-1] == "persist", ops


def test_a_rehearsal_captures_nothing(tmp_path: Path) -> None:
    n = node(tmp_path)
    run = EmbeddedRun(n, job="one", mode=Mode.KEEP_RUNNING, timeout_s=10, rehearsal=True)
    assert run.take()["state"] == "rehearsed"
    ops = n.ops_of(run.sid)
    assert "capture" not in ops and "persist" not in ops and ops[-3:] == ["resume", "relay", "run"], ops
    assert run.cut is not None and n.running() and not (tmp_path / "store").exists()
