"""Fault injection with real components: a real coordinator, real node agents, real CRIU, real gloo DDP.

A job of two nodes on this host (one rank each, on the job network), snapshotted by the coordinator. Node 1's
agent is made to stall at one step of a snapshot (``fault-stall``, agent/coordinated.py); meanwhile the test
kills the coordinator (and starts it again on the same address), node 1's agent, or node 1's rank. Whatever
happens, the job either continues unharmed, or (a stop snapshot past its point of no return) stays suspended
in a verified snapshot, or ends as a whole with its last verified snapshot intact; never half-dead, never a
snapshot listed valid that does not restore: every outcome is checked by running or restoring the job to its
end and comparing its losses with an uninterrupted run. docs/reliability.md has the table.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cryosleep.cut.driver import HOLD_GRACE_S
from tests.conftest import require_criu
from tests.jobs.coordinated import Coordinator, alive, wait_for
from tests.jobs.harness import Harness, free_port, reference, workload
from tests.pgserver import PgServer

pytestmark = pytest.mark.slow

ARGS = ["--steps", "5000", "--step-sleep", "0.03"]  # longer than any test here: each ends it once checked
REF_STEPS = 2000  # the losses are compared with an uninterrupted run's, step by step, up to this many
STALL_S = 4
SNAPSHOT_S = 120  # a faulted snapshot's deadline (the coordinator's default)
ROLLBACK_S = 90  # more than the coordinator's --rollback-timeout (tests/jobs/coordinated.py FAST)
JOB = "rel"
NODES = (f"{JOB}.node0", f"{JOB}.node1")


@pytest.fixture(scope="module", autouse=True)
def uninterrupted() -> dict[int, list[str]]:
    """The uninterrupted run's losses, computed once, before any job of this module loads the machine."""
    return reference(workload("ddp_basic"), ["--steps", str(REF_STEPS)], nproc=2)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.extended)])
def coord(cryo_home: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Coordinator]:
    """A real coordinator on each engine: its embedded SQLite catalog (the default suite), and the server engine,
    a database of its own on the session's PostgreSQL server (the extended tier: each case is a real job)."""
    require_criu()
    db = request.getfixturevalue("pg").database() if request.param == "postgresql" else None
    c = Coordinator(tmp_path, db=db)
    yield c
    c.stop()


class Job:
    def __init__(self, h: Harness, coord: Coordinator) -> None:
        self.h = h
        self.coord = coord
        self.env = coord.env(h.env)

    def start(self) -> None:
        port = str(free_port())
        for n in (0, 1):
            self.h.cli_json("run", "--detach", "--name", JOB, "--nnodes", "2", "--node-rank", str(n),
                            "--nproc-per-node", "1", "--master-port", port, "--run-id", f"{JOB}-{port}", "--net",
                            "job", "--coordinator", self.coord.url, str(workload("ddp_basic")), *ARGS, env=self.env)
        self.h.wait_step(NODES[0], 5)  # rank 0's log; rank 1 steps with it

    def restore(self, sid: str) -> None:
        with ThreadPoolExecutor(2) as pool:  # each node's restore waits at the coordinator's barrier for the other
            list(pool.map(lambda n: self.h.cli_json("restore", "--detach", "--node-rank", str(n), "--coordinator",
                                                    self.coord.url, sid, env=self.env), (0, 1)))

    def agent_pid(self, node: int) -> int:
        return self.h.job(NODES[node]).read()[1].agent_pid

    def worker_pids(self, node: int) -> list[int]:
        return self.h.pids(NODES[node])[1:]

    def stall(self, op: str) -> None:
        (self.h.job(NODES[1]).path / "fault-stall").write_text(f"{op} {STALL_S}")

    def stalled(self, op: str) -> bool:
        return (self.h.job(NODES[1]).path / f"stalled-{op}").exists()

    def rank_done(self, node: int) -> bool:
        log = self.h.job(NODES[node]).rank_log(node)
        return log.exists() and f"done rank {node}" in log.read_text()

    def steps(self, node: int) -> int:
        got = self.h.losses(NODES[node], node)
        return int(got[-1].split()[0]) if got else -1

    def assert_identical(self, more: int = 30) -> None:
        """Both ranks train on for ``more`` steps; every step so far has the loss of an uninterrupted run."""
        target = max(self.steps(0), self.steps(1)) + more
        wait_for(lambda: min(self.steps(0), self.steps(1)) >= target, 120, f"both ranks at step {target}")
        ref = reference(workload("ddp_basic"), ["--steps", str(REF_STEPS)], nproc=2)
        for r in (0, 1):
            got = self.h.losses(NODES[r], r)
            assert len(got) <= REF_STEPS, "raise REF_STEPS"
            n = len(got)
            assert got == ref[r][:n], f"rank {r}: first difference at step " + str(
                next(i for i, (x, y) in enumerate(zip(got, ref[r], strict=False)) if x != y))

    def kill_everything(self) -> None:
        for name in NODES:
            if self.h.job(name).exists():
                self.h.kill_all(name)


def finished(coord: Coordinator, sid: str) -> bool:
    row = coord.detail(sid)
    return row["finished_at"] is not None and row["state"] in ("verified", "failed", "aborted")


def stalled_or_ended(coord: Coordinator, job: Job, op: str, sid: str, timeout_s: float) -> dict[str, Any] | None:
    """Waits until node 1 stalls at ``op`` in snapshot ``sid`` (None), or the snapshot ends before it got there
    (its row; the stall is called off, never left for a later snapshot). Bounded by the snapshot itself: it
    reaches ``op`` or ends by its deadline, ``timeout_s``, plus its rollback's."""
    wait_for(lambda: job.stalled(op) or finished(coord, sid), timeout_s + ROLLBACK_S,
             f"node 1 stalled at {op}, or snapshot {sid} ended")
    if job.stalled(op):
        return None
    (job.h.job(NODES[1]).path / "fault-stall").unlink(missing_ok=True)
    return coord.detail(sid)


def ended_early(row: dict[str, Any], op: str) -> str:
    return f"snapshot {row['id']} ended ({row['state']}) before node 1 reached {op}: {row.get('error')}"


def faulted_snapshot(coord: Coordinator, job: Job, mode: str, op: str, inject: Callable[[], None]) -> dict[str, Any]:
    """A snapshot with node 1 stalled at ``op`` and ``inject`` run meanwhile; its final row.

    Node 1 only stalls once the snapshot reaches ``op``: one that ends before (it failed at an earlier phase)
    never does, so the wait is for either, and such an end is told with its error, not a timeout. Persist and
    stop come after the capture: CRIU may refuse it with a send queue the peer has not acknowledged yet (see
    snapshot_again), and more so on a busy machine, where the ranks stayed frozen longer in the snapshot before
    and TCP's retransmission backed off further meanwhile. Only that refusal is taken again, as there."""
    for wait in (1, 2, 3, 4, 5, 0):
        job.stall(op)
        sid = coord.snapshot(JOB, stop=mode == "stop", wait=False, timeout_s=SNAPSHOT_S)["id"]
        row = stalled_or_ended(coord, job, op, sid, SNAPSHOT_S)
        if row is None:
            break
        why = (row.get("error") or {}).get("why", "")
        assert "libsoccr_save() failed" in why, ended_early(row, op)
        time.sleep(wait)
    else:
        raise AssertionError(f"six snapshots in a row failed before node 1 reached {op}: {row.get('error')}")
    (job.h.job(NODES[1]).path / f"stalled-{op}").unlink()
    inject()
    wait_for(lambda: finished(coord, sid), 90, f"snapshot {sid} finished")
    return coord.detail(sid)


def snapshot_again(coord: Coordinator) -> dict[str, Any]:
    """A keep-running snapshot right after a rolled-back one. CRIU may refuse a TCP socket whose send queue
    holds a partly acknowledged segment (libsoccr "recv failed (N, want M)", CRIU issue 622): the peer was
    frozen a moment ago and TCP has not caught up. That snapshot fails and is rolled back like any other (the
    job goes on); one a few seconds later goes through. Any other failure fails the test."""
    for wait in (1, 2, 3, 4, 5, 0):  # TCP catches up within seconds: up to 15 s of retries (one was not enough)
        row = coord.snapshot(JOB)
        if row["state"] == "verified":
            return row
        assert "libsoccr_save() failed" in row["error"]["why"], row["error"]
        time.sleep(wait)
    raise AssertionError(f"six snapshots in a row failed: {row['error']}")


def restart(coord: Coordinator) -> None:
    coord.kill()
    coord.start()


COORDINATOR_CASES = [("keep-running", "hold"), ("keep-running", "capture"), ("keep-running", "persist"),
                     ("stop", "capture"), ("stop", "persist")]


@pytest.mark.extended  # five kills and restarts, a minute; the extended tier (CI runs it after the default suite)
def test_coordinator_killed_at_each_phase(coord: Coordinator, cryo_home: Path) -> None:
    """The coordinator SIGKILLed while node 1 is at each step, and started again on the same address: before the
    point of no return the snapshot is aborted (never valid) and the job goes on, unharmed and snapshottable;
    past it (a stop snapshot's stop) the snapshot is valid and the job suspended in it, and restores."""
    h = Harness(cryo_home)
    job = Job(h, coord)
    job.start()
    try:
        for mode, op in COORDINATOR_CASES:
            row = faulted_snapshot(coord, job, mode, op, lambda: restart(coord))
            assert row["state"] == "aborted" and not row["valid"], (mode, op, row["state"])
            assert row["id"] not in coord.valid(JOB)
            assert any(e["kind"] == "recover" for e in row["events"])
            wait_for(lambda: coord.job_state(JOB) == "running", 30, "every node of the job alive")
            assert h.state(NODES[0]) == h.state(NODES[1]) == "running"
            snapshot_again(coord)  # the rollback left the job consistent: it snapshots again
            # no node image is left of the aborted snapshot: the store holds exactly the valid ones' images
            images = {n["image"]["ref"] for sid in coord.valid(JOB) for n in coord.detail(sid)["nodes"]}
            assert {s["snapshot"] for s in h.ls()} == images, (mode, op)
        job.assert_identical()
        row = faulted_snapshot(coord, job, "stop", "stop", lambda: restart(coord))
        assert row["state"] == "verified" and row["valid"] and row["id"] in coord.valid(JOB)
        assert h.wait_end(NODES[0], 60) == 75 and h.wait_end(NODES[1], 60) == 75
        assert coord.job(JOB)["state"] == "suspended"
        job.restore(row["id"])
        job.assert_identical()
    finally:
        job.kill_everything()


CASES = [
    # fault, mode, the operation node 1 stalls at (the phase), outcome
    ("agent", "keep-running", "hold", "continues"),
    ("agent", "stop", "persist", "ends"),
    ("rank", "keep-running", "hold", "ends"),
    ("rank", "stop", "capture", "ends"),
]


@pytest.mark.parametrize(("fault", "mode", "op", "outcome"), CASES, ids=[f"{f}-{m}-{o}" for f, m, o, _ in CASES])
def test_node_fault_during_a_snapshot(coord: Coordinator, cryo_home: Path, fault: str, mode: str, op: str,
                                      outcome: str) -> None:
    """Node 1's agent or its rank SIGKILLed while node 1 is at a step of a snapshot."""
    h = Harness(cryo_home)
    job = Job(h, coord)
    job.start()
    try:
        base = coord.snapshot(JOB)  # the last verified snapshot before the fault
        assert base["state"] == "verified", base.get("error")
        victim = job.agent_pid(1) if fault == "agent" else job.worker_pids(1)[0]
        row = faulted_snapshot(coord, job, mode, op, lambda: os.kill(victim, signal.SIGKILL))
        sid = row["id"]
        assert row["state"] == "failed" and not row["valid"], row["state"]
        assert sid not in coord.valid(JOB) and base["id"] in coord.valid(JOB)
        if outcome == "continues":
            # before the cut node 1's rank was only held: without its agent it trains on, and so does the job
            job.assert_identical()
            return
        # the job ended as a whole (no part of it left frozen, held or deaf); the last verified snapshot is
        # intact, and restores
        for node in (0, 1):
            pids = [job.agent_pid(node), *h.pids(NODES[node])]
            wait_for(lambda pids=pids: not any(alive(p) for p in pids), 60, f"node {node}'s processes ended")
        # node 1's watchdog (agent fault) or its init (rank fault) ended its part, and the coordinator ended
        # node 0's, rather than leave node 0's rank waiting on a peer that is gone
        assert any(e["kind"] == "ended" for e in row["events"]), [e["message"] for e in row["events"]]
        if fault == "agent":
            assert "ended by the coordinator" in h.job(NODES[0]).read()[1].detail
        job.restore(base["id"])
        job.assert_identical()
    finally:
        job.kill_everything()


def test_a_snapshot_its_coordinator_never_finishes_is_abandoned_after_its_deadline(
        coord: Coordinator, cryo_home: Path, request: pytest.FixtureRequest) -> None:
    """The coordinator dies with its catalog (a fresh one takes its address): the nodes are still in a snapshot
    nobody will finish. Before the cut that holds nothing once its deadline (and the HOLD grace) passed: the
    next snapshot rolls it back on each node and goes ahead."""
    h = Harness(cryo_home)
    job = Job(h, coord)
    job.start()
    try:
        job.stall("hold")
        asked = time.monotonic()
        sid = coord.snapshot(JOB, wait=False, timeout_s=3)["id"]
        early = stalled_or_ended(coord, job, "hold", sid, 3)
        assert early is None, ended_early(early, "hold")
        coord.kill()
        if coord.db.startswith("postgresql"):  # and everything it knew: a new one on an empty catalog
            coord.db = request.getfixturevalue("pg").database()
        else:
            Path(coord.db).unlink()
        coord.start()
        wait_for(lambda: coord.job_state(JOB) == "running", 30, "the agents registered with the new coordinator")
        busy = coord.snapshot(JOB)
        # refused while the old snapshot may still hold the ranks; on a busy machine the new coordinator can take
        # longer to start than its deadline and the HOLD grace, and then the nodes roll it back at once
        if busy["state"] != "verified" or time.monotonic() - asked < 3 + HOLD_GRACE_S:
            assert busy["state"] == "failed" and sid in busy["error"]["why"], busy.get("error")
        wait_for(lambda: coord.snapshot(JOB)["state"] == "verified", 30, "a snapshot once the old one is stale")
        assert "abandoned" in h.job(NODES[0]).agent_log.read_text()
        job.assert_identical()
    finally:
        job.kill_everything()


def test_nodes_at_the_cut_whose_coordinator_never_comes_back_end_on_their_own(coord: Coordinator, cryo_home: Path
                                                                              ) -> None:
    """The coordinator dies for good while both nodes' ranks are at the cut (node 1 stalled at capture). Nobody
    will finish or roll the snapshot back; the ranks cannot run again on their own. Once the snapshot's deadline
    and the fence grace have passed, each node ends its workers (nothing left frozen or holding its GPUs), and the
    last verified snapshot restores under a new coordinator."""
    h = Harness(cryo_home)
    job = Job(h, coord)
    job.env["CRYOSLEEP_FENCE_GRACE_S"] = "1"
    job.start()
    try:
        base = coord.snapshot(JOB)
        assert base["state"] == "verified", base.get("error")
        job.stall("capture")
        sid = coord.snapshot(JOB, wait=False, timeout_s=6)["id"]
        early = stalled_or_ended(coord, job, "capture", sid, 6)
        assert early is None, ended_early(early, "capture")
        coord.kill()
        for node in (0, 1):
            pids = [job.agent_pid(node), *h.pids(NODES[node])]
            wait_for(lambda pids=pids: not any(alive(p) for p in pids), 60, f"node {node}'s processes ended")
            assert "ended on its own" in h.job(NODES[node]).read()[1].detail
        coord.start()
        assert base["id"] in coord.valid(JOB)
        # restored while the new coordinator recovers the dead one's snapshot: the recovery leaves the restored
        # nodes (other agent incarnations) alone
        job.restore(base["id"])
        job.assert_identical()
        assert coord.job(JOB)["state"] == "running"
    finally:
        job.kill_everything()


@pytest.mark.extended
def test_a_standby_on_postgresql_takes_over_mid_snapshot_and_mid_restore(cryo_home: Path, tmp_path: Path,
                                                                         pg: PgServer) -> None:
    """The catalog on a real PostgreSQL server, a standby coordinator waiting on the same address. The active one
    is SIGKILLed while node 1 captures a keep-running snapshot (aborted, the job goes on, snapshots again), then
    past a stop snapshot's point of no return (valid, the job suspended in it), then while node 0's restore waits
    at the barrier for node 1's: the restore completes through the standby, and the job trains on identically."""
    require_criu()
    coord = Coordinator(tmp_path, db=pg.database())
    h = Harness(cryo_home)
    job = Job(h, coord)

    def take_over() -> None:
        coord.kill()
        coord.took_over()
        coord.standby()  # the next standby, for the next fault

    try:
        coord.standby()
        job.start()
        row = faulted_snapshot(coord, job, "keep-running", "capture", take_over)
        assert row["state"] == "aborted" and not row["valid"], row["state"]
        assert any(e["kind"] == "recover" for e in row["events"])
        wait_for(lambda: coord.job_state(JOB) == "running", 30, "every node of the job alive")
        snapshot_again(coord)
        job.assert_identical()
        row = faulted_snapshot(coord, job, "stop", "stop", take_over)
        assert row["state"] == "verified" and row["valid"], row["state"]
        assert h.wait_end(NODES[0], 60) == 75 and h.wait_end(NODES[1], 60) == 75
        assert coord.job(JOB)["state"] == "suspended"
        sid = str(row["id"])
        with ThreadPoolExecutor(2) as pool:
            def restore(n: int) -> Any:
                return h.cli_json("restore", "--detach", "--node-rank", str(n), "--coordinator", coord.url, sid,
                                  env=job.env)
            first = pool.submit(restore, 0)
            wait_for(lambda: bool(coord.client().rendezvous(sid, prefix="ready/0")) or first.done(), 120,
                     "node 0's restore at the barrier")
            assert not first.done(), first.result()
            take_over()
            second = pool.submit(restore, 1)
            first.result(), second.result()
        wait_for(lambda: coord.job_state(JOB) == "running", 60, "the restored job's nodes registered")
        job.assert_identical()
    finally:
        job.kill_everything()
        coord.stop()
