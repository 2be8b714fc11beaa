"""A standby coordinator on the same PostgreSQL catalog takes over when the active one dies: it serves only once it
holds the lease, on the same address (what a Kubernetes Service in front of both gives the agents), and finishes
what was in flight by the restart's rules (docs/reliability.md): a snapshot before its point of no return aborted
and every node running again, one past it valid and the job suspended, a restore in progress completed (its
board and its placement's orders are in the catalog)."""

from __future__ import annotations

import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from cryosleep.agent.coordinated import RestoreRendezvous
from cryosleep.coordinator.catalog import Catalog
from cryosleep.coordinator.client import CoordinatorClient
from cryosleep.coordinator.shared import Lease
from tests.coordinator.helpers import images, launch, listening, wait_for
from tests.coordinator.sim import SimCluster, SimFaults
from tests.pgserver import PgServer


def pair(tmp: Path, db: str) -> tuple[subprocess.Popen[str], subprocess.Popen[str], str]:
    """The active coordinator, and a standby on its address, waiting for the lease."""
    active = launch(tmp, "127.0.0.1:0", db)
    url = listening(active)
    standby = launch(tmp, url.rsplit("/", 1)[1], db)
    wait_for(lambda: "standby:" in (tmp / "coordinator.log").read_text(), 30, "the standby waiting for the lease")
    assert standby.poll() is None
    return active, standby, url


def stop(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait(20)


@pytest.mark.parametrize("mode", ["keep-running", "stop"])
def test_a_standby_takes_over_a_snapshot_in_flight(tmp_path: Path, pg: PgServer, mode: str) -> None:
    db = pg.database()
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    active, standby, url = pair(tmp_path, db)
    hang = "capture" if mode == "keep-running" else "stop"  # before the point of no return, or past it
    c = SimCluster(url, token, tmp_path / "store", nnodes=3, nproc=2, seed=3, spread=6, wait_s=2,
                   faults={1: SimFaults(hang={hang})}).start()
    try:
        client = CoordinatorClient(url, token)
        s = client.snapshot("sim", stop=mode == "stop", timeout_s=60, wait=False)
        first = "capture" if mode == "keep-running" else "stop"
        wait_for(lambda: first in c.nodes[1].ops_of(s["id"]), 20, f"node 1 at {first}")
        holder = Lease(Catalog(db), 1.0).current()
        assert holder is not None and holder["address"] == url
        active.send_signal(signal.SIGKILL)
        active.wait(10)
        assert listening(standby) == url  # the standby serves now, where the agents already look
        row = client.snapshot_detail(s["id"])
        assert any(e["kind"] == "recover" for e in row["events"])
        assert Lease(Catalog(db), 1.0).current()["holder"] != holder["holder"]  # type: ignore[index]
        if mode == "keep-running":
            wait_for(lambda: client.snapshot_detail(s["id"])["state"] == "aborted", 30, "recovery finished")
            c.nodes[1].release.set()
            wait_for(c.all_running, 20, "every node running again")
            for n in c.nodes:
                assert "abort" in n.ops_of(s["id"]) and n.ops_of(s["id"])[-3:] == ["resume", "relay", "run"]
            assert images(tmp_path / "store", s["id"]) == []
            assert client.snapshots("sim", valid_only=True) == []
            c.nodes[1].faults.hang.clear()
            wait_for(lambda: client.job("sim")["snapshot_in_progress"] is None, 30, "the recovery's run ended")
            again = client.snapshot("sim", timeout_s=30)  # through the coordinator that took over
            assert again["state"] == "verified", again.get("error")
        else:
            c.nodes[1].release.set()  # the dead one's stop; the standby tells every node to stop again
            wait_for(lambda: client.snapshot_detail(s["id"])["finished_at"] is not None, 30, "recovery finished")
            row = client.snapshot_detail(s["id"])
            assert row["state"] == "verified" and row["valid"], row["state"]
            assert client.job("sim")["state"] == "suspended"
            assert len(images(tmp_path / "store", s["id"])) == 3
    finally:
        c.close()
        stop(active, standby)


def test_a_restore_in_progress_completes_across_a_takeover(tmp_path: Path, pg: PgServer) -> None:
    """A snapshot placed on two hosts (their host daemons' side played by the test), its nodes restoring: both
    passed the restore's barrier and node 0 posted its communicator's fresh id, when the active coordinator dies.
    Node 1 posts and reads its ids from the standby (node 0's id only ever reached the dead one), node 0's wait
    goes on there, the hosts report their orders done to it, and the placement ends done."""
    db = pg.database()
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    active, standby, url = pair(tmp_path, db)
    c = SimCluster(url, token, tmp_path / "store", nnodes=2, nproc=1, seed=3, wait_s=2).start()
    try:
        client = CoordinatorClient(url, token)
        snap = client.snapshot("sim", timeout_s=30)
        assert snap["state"] == "verified", snap.get("error")
        sid = str(snap["id"])
        for h in ("h0", "h1"):
            client.host_poll(h, {"gpus": []}, 0)
        pid = str(client.place(sid, ["h0", "h1"])["id"])
        orders = {h: client.host_poll(h, {}, 0) for h in ("h0", "h1")}
        assert [[o["node_rank"] for o in orders[h]] for h in ("h0", "h1")] == [[0], [1]]
        for h in ("h0", "h1"):
            client.order_report(str(orders[h][0]["id"]), "running")
        nodes = [RestoreRendezvous(CoordinatorClient(url, token), sid, r, 2, 60) for r in (0, 1)]
        for n in nodes:
            n.announce()
        passed: list[BaseException | None] = []
        t = threading.Thread(target=lambda: passed.append(_barrier(nodes[0])), daemon=True)
        t.start()
        nodes[1].barrier(3)
        t.join(20)
        assert passed == [None] and nodes[0].attempt == nodes[1].attempt != ""
        gen = nodes[0].generation()
        got0: list[dict[int, bytes]] = []
        t = threading.Thread(target=lambda: got0.append(nodes[0].exchange(gen, {1: b"\x01" * 8}, [2],
                                                                             time.monotonic() + 60)), daemon=True)
        t.start()
        wait_for(lambda: any("/uid/" in k for k in client.rendezvous(sid, prefix=f"attempt/{nodes[0].attempt}/")),
                 20, "node 0's id on the board")
        active.send_signal(signal.SIGKILL)
        active.wait(10)
        got1 = nodes[1].exchange(gen, {2: b"\x02" * 8}, [1], time.monotonic() + 60)  # waits for the standby
        assert got1 == {1: b"\x01" * 8}
        t.join(30)
        assert got0 == [{2: b"\x02" * 8}]
        assert listening(standby) == url
        for h in ("h0", "h1"):  # what each host's restore answered, to the coordinator that took over
            client.order_report(str(orders[h][0]["id"]), "done", result={"node_rank": orders[h][0]["node_rank"]})
        st = client.placement(pid)
        assert st["state"] == "done" and [n["state"] for n in st["nodes"]] == ["done", "done"], st
    finally:
        c.close()
        stop(active, standby)


def _barrier(rv: RestoreRendezvous) -> BaseException | None:
    try:
        rv.barrier(3)
        return None
    except BaseException as e:
        return e


def test_the_lease_is_taken_only_once_it_ran_out_and_its_loss_stops_the_holder(pg: PgServer) -> None:
    """Two coordinators on two hosts (their holder names say so): the second takes the lease only once the first
    stopped renewing it and it ran out on the server's clock; the first, unable to renew, is told it lost it."""
    db = pg.database()
    first = Lease(Catalog(db), 1.5, holder="host-a:1:1:x")
    second = Lease(Catalog(db), 1.5, holder="host-b:1:1:y")
    assert first.try_take() and not second.try_take()
    lost: list[str] = []
    first.keep(lost.append)
    time.sleep(2.5)  # renewed meanwhile: still the first's
    assert not second.try_take() and lost == []
    first.catalog.db.close()  # the first's engine unreachable from its host: no renewal any more
    start = time.monotonic()
    wait_for(lambda: bool(lost), 10, "the first told it lost the lease")
    assert "ran out" in lost[0] and time.monotonic() - start < 3
    wait_for(second.try_take, 10, "the second holding the lease")
    assert second.current()["holder"] == "host-b:1:1:y"  # type: ignore[index]
    second.release()
    assert Lease(Catalog(db), 1.5).try_take()  # released: taken at once


def test_a_standby_keeps_the_restore_queue_and_the_drained_hosts(tmp_path: Path, pg: PgServer) -> None:
    """Queued restores (coordinator/queue.py) and drained hosts are in the catalog: the standby that takes over from
    a SIGKILLed coordinator serves them in the same order and places them once hosts poll it."""
    db = pg.database()
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    active, standby, url = pair(tmp_path, db)
    client = CoordinatorClient(url, token)
    snaps = {}
    try:
        for job in ("low", "high"):
            c = SimCluster(url, token, tmp_path / "store", job=job, nnodes=1, nproc=1, wait_s=2).start()
            s = client.snapshot(job, stop=True, timeout_s=30)
            assert s["state"] == "verified", s.get("error")
            for r in c.runners:
                r.leave("suspended")
            c.close()
            snaps[job] = s["id"]
        client.enqueue(snaps["low"])
        client.enqueue(snaps["high"], priority=2)
        client.host_poll("old-host", {}, 0)
        client.drain("old-host", deadline_s=10)  # no job runs there: drained, nothing moved
        before = [(e["id"], e["job"]) for e in client.queue()]
        assert [j for _, j in before] == ["high", "low"]
        active.send_signal(signal.SIGKILL)
        active.wait(10)
        wait_for(lambda: "listening on" in (tmp_path / "coordinator.log").read_text().split("standby:")[-1], 60,
                 "the standby serving")
        client.close()
        client = CoordinatorClient(url, token)
        wait_for(lambda: _answers(client), 30, "the standby answering")
        assert [(e["id"], e["job"], e["state"]) for e in client.queue()] == [(i, j, "waiting") for i, j in before]
        assert [h["drained"] is not None for h in client.hosts()] == [True]
        client.host_poll("new-host", {}, 0)
        wait_for(lambda: client.queued(snaps["high"])["state"] == "placing", 30, "the first entry placed")
        (order,) = client.host_poll("new-host", {}, 5)
        assert order["snapshot"] == snaps["high"] and client.queued(snaps["low"])["state"] == "waiting"
    finally:
        client.close()
        stop(active, standby)


def _answers(c: CoordinatorClient) -> bool:
    try:
        c.health()
        return True
    except Exception:
        return False
