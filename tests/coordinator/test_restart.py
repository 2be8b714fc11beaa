"""A coordinator killed in the middle of a snapshot: the restarted one finds it in the catalog, marks it aborted
(never valid), and brings every node back to running once the agents have reconnected."""

from __future__ import annotations

import secrets
import signal
import subprocess
from pathlib import Path

import pytest

from cryosleep.coordinator.catalog import Catalog
from cryosleep.coordinator.client import CoordinatorClient
from tests.coordinator.helpers import images, launch, listening, wait_for
from tests.coordinator.sim import SimCluster, SimFaults


def serve(tmp: Path, listen: str, db: str) -> tuple[subprocess.Popen[str], str]:
    p = launch(tmp, listen, db)
    return p, listening(p)


@pytest.mark.parametrize("stage", ["draining", "capturing"])
def test_coordinator_killed_mid_snapshot(tmp_path: Path, db: str, stage: str) -> None:
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    proc, url = serve(tmp_path, "127.0.0.1:0", db)
    fault = "targets" if stage == "draining" else "capture"
    c = SimCluster(url, token, tmp_path / "store", nnodes=3, nproc=2, seed=3, spread=6, wait_s=2,
                   faults={1: SimFaults(hang={fault})}).start()
    try:
        client = CoordinatorClient(url, token)
        s = client.snapshot("sim", timeout_s=60, wait=False)
        wait_for(lambda: client.snapshot_detail(s["id"])["state"] == stage, 20, stage)
        first = "targets" if stage == "draining" else "capture"  # the op the fault hangs
        wait_for(lambda: first in c.nodes[1].ops_of(s["id"]), 20, f"node 1 at {first}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # what the dead coordinator left: a snapshot in progress, not valid
        cat = Catalog(db)
        assert cat.snapshot(s["id"])["state"] == stage
        cat.close()
        proc, url2 = serve(tmp_path, url.rsplit("/", 1)[1], db)  # same address: the agents come back by themselves
        assert url2 == url
        client = CoordinatorClient(url, token)
        row = client.snapshot_detail(s["id"])
        assert row["state"] in ("aborted", "rolling-back", "failed") and not row["valid"]
        assert client.snapshots("sim", valid_only=True) == []
        wait_for(lambda: client.snapshot_detail(s["id"])["state"] == "aborted", 30, "recovery finished")
        c.nodes[1].release.set()  # the hung operation ends (its late answer goes nowhere)
        wait_for(c.all_running, 20, "every node running again")
        for n in c.nodes:
            ops = n.ops_of(s["id"])
            assert "abort" in ops
            if stage == "capturing":
                assert ops[-3:] == ["resume", "relay", "run"], ops
        assert images(tmp_path / "store", s["id"]) == []
        assert any(e["kind"] == "recover" for e in client.snapshot_detail(s["id"])["events"])
        assert client.job("sim")["state"] == "running"
        # and the job can be snapshotted again through the new coordinator
        c.nodes[1].faults.hang.clear()
        wait_for(lambda: client.job("sim")["snapshot_in_progress"] is None, 30, "the recovery's run ended")
        again = client.snapshot("sim", timeout_s=30)
        assert again["state"] == "verified", again.get("error")
    finally:
        c.close()
        proc.terminate()
        proc.wait(10)


def test_sigterm_mid_snapshot_rolls_back_before_exiting(tmp_path: Path, db: str) -> None:
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    proc, url = serve(tmp_path, "127.0.0.1:0", db)
    c = SimCluster(url, token, tmp_path / "store", nnodes=2, nproc=2, seed=3, wait_s=2,
                   faults={1: SimFaults(delay={"capture": 1.5})}).start()
    try:
        client = CoordinatorClient(url, token)
        s = client.snapshot("sim", timeout_s=60, wait=False)
        wait_for(lambda: "capture" in c.nodes[1].ops_of(s["id"]), 20, "node 1 capturing")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        cat = Catalog(db)
        row = cat.snapshot(s["id"])
        row["events"] = cat.events(snapshot=s["id"])
        cat.close()
        assert row["state"] == "failed" and "shutting down" in row["error"]["why"], row
        ops = {n.node: n.ops_of(s["id"]) for n in c.nodes}
        wait_for(c.all_running, 10, f"every node running again ({ops}, {[e['message'] for e in row['events']]})")
        for n in c.nodes:
            assert n.ops_of(s["id"])[-3:] == ["resume", "relay", "run"]
    finally:
        c.close()
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


def test_recovery_never_touches_nodes_restored_since(tmp_path: Path, db: str) -> None:
    """The coordinator dies past the cut of a snapshot; before it comes back, the job's nodes are restored from
    an earlier snapshot (new agent incarnations under the same agent ids). The restarted coordinator's recovery
    of the old snapshot must not send them its abort, rebuild or end: they were never in it."""
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    proc, url = serve(tmp_path, "127.0.0.1:0", db)
    old = SimCluster(url, token, tmp_path / "store", nnodes=2, nproc=2, seed=3, wait_s=2,
                     faults={1: SimFaults(hang={"capture"})}).start()
    new: SimCluster | None = None
    try:
        client = CoordinatorClient(url, token)
        s = client.snapshot("sim", timeout_s=60, wait=False)
        wait_for(lambda: "capture" in old.nodes[1].ops_of(s["id"]), 20, "node 1 past the cut")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        old.close()
        new = SimCluster(url, token, tmp_path / "store2", nnodes=2, nproc=2, seed=3, wait_s=2)
        for r in new.runners:  # they register as soon as the coordinator is back
            r.start()
        proc, _ = serve(tmp_path, url.rsplit("/", 1)[1], db)
        client = CoordinatorClient(url, token)
        wait_for(lambda: client.snapshot_detail(s["id"])["finished_at"] is not None, 30, "recovery finished")
        row = client.snapshot_detail(s["id"])
        assert row["state"] in ("aborted", "failed") and not row["valid"], row["state"]
        assert [n.ops_of(s["id"]) for n in new.nodes] == [[], []]
        assert new.all_running() and client.job("sim")["state"] == "running"
        again = client.snapshot("sim", timeout_s=30)  # the restored job snapshots through the new coordinator
        assert again["state"] == "verified", again.get("error")
    finally:
        if new is not None:
            new.close()
        proc.terminate()
        proc.wait(10)


def test_recovery_past_the_point_of_no_return_when_no_node_comes_back(tmp_path: Path, db: str) -> None:
    """The coordinator dies after a stop snapshot's point of no return, and the nodes are gone too (they stopped
    by themselves, or their hosts went away): the restarted coordinator waits for them a bounded time, never
    sends to agents that did not register, and leaves the snapshot valid and the job suspended in it."""
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    proc, url = serve(tmp_path, "127.0.0.1:0", db)
    c = SimCluster(url, token, tmp_path / "store", nnodes=2, nproc=2, seed=3, wait_s=2,
                   faults={1: SimFaults(hang={"stop"})}).start()
    try:
        client = CoordinatorClient(url, token)
        s = client.snapshot("sim", stop=True, timeout_s=60, wait=False)
        wait_for(lambda: "stop" in c.nodes[1].ops_of(s["id"]), 20, "node 1 told to stop")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        c.close()  # and the nodes are gone
        proc, _ = serve(tmp_path, url.rsplit("/", 1)[1], db)
        client = CoordinatorClient(url, token)
        wait_for(lambda: client.snapshot_detail(s["id"])["finished_at"] is not None, 30, "recovery finished")
        row = client.snapshot_detail(s["id"])
        assert row["state"] == "verified" and row["valid"], row["state"]
        assert client.job("sim")["state"] == "suspended"
        failed = [e["message"] for e in row["events"] if e["kind"] == "stop-failed"]
        assert len(failed) == 2 and all("has not registered" in m for m in failed), failed
    finally:
        proc.terminate()
        proc.wait(10)
