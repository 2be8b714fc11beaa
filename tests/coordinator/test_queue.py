"""Restores queued for capacity (coordinator/queue.py) and drained hosts (coordinator/drain.py), over real HTTP with
simulated agents and host daemons' polls; on both engines. A real job drained, queued and restored by real host
daemons: tests/jobs/test_capacity.py."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cryosleep.cli import resuming
from cryosleep.cli.main import main
from cryosleep.coordinator.client import CoordinatorClient
from cryosleep.coordinator.queue import Entry, after_placement, gist, ordered
from cryosleep.core.job import JobSpec
from cryosleep.errors import NotEligible
from tests.coordinator.helpers import Env, serving, wait_for
from tests.coordinator.sim import SimCluster


def suspended(env: Env, job: str = "sim", nnodes: int = 2) -> tuple[SimCluster, dict[str, Any]]:
    """A simulated job stop-snapshotted, its agents gone as a suspended job's go."""
    cl = env.cluster(job=job, nnodes=nnodes, nproc=1)
    s = env.client().snapshot(job, stop=True, timeout_s=20)
    assert s["state"] == "verified", s.get("error")
    for r in cl.runners:
        r.leave(f"suspended in snapshot {s['id']}")
    return cl, s


def entry(c: CoordinatorClient, sid: str, pred: Any, what: str) -> dict[str, Any]:
    got: list[dict[str, Any]] = []

    def ok() -> bool:
        got[:] = [c.queued(sid)]
        return bool(pred(got[0]))

    try:
        wait_for(ok, 30, what)
    except AssertionError as e:
        raise AssertionError(f"{e}; the entry: {got[0] if got else None}") from None
    return got[0]


def done(c: CoordinatorClient, host: str) -> list[dict[str, Any]]:
    """The host daemon's part, simulated: its orders taken and reported restored."""
    orders = c.host_poll(host, {}, 5)
    for o in orders:
        c.order_report(o["id"], "done", result={"job": f"x.node{o['node_rank']}"})
    return orders


def test_the_order_rules_are_priority_then_age_and_a_failed_placement_is_retried_then_fails() -> None:
    es = [Entry("q-1", "s1", "a", 0, 10.0, 60), Entry("q-2", "s2", "b", 5, 20.0, 60),
          Entry("q-3", "s3", "c", 0, 5.0, 60)]
    assert [e.id for e in ordered(es)] == ["q-2", "q-3", "q-1"]
    nodes = [{"node_rank": 0, "host": "a", "state": "done"},
             {"node_rank": 1, "host": "b", "state": "failed", "error": {"what": "CRIU failed", "why": "no space"}}]
    state, reason, n = after_placement(es[0], "failed", nodes, max_attempts=2)
    assert (state, n) == ("waiting", 1) and "node 1 on b: CRIU failed (no space)" in reason
    es[0].attempts = 1
    state, reason, n = after_placement(es[0], "failed", nodes, max_attempts=2)
    assert (state, n) == ("failed", 2) and reason.startswith("2 placements failed")
    assert after_placement(es[0], "done", nodes)[:2] == ("done", "restored: node 0 on a, node 1 on b")
    # time passing is no new reason (no event a second): only a change in substance is
    assert gist("host a has not polled for 75 s") == gist("host a has not polled for 80 s")
    assert gist("host a has not polled for 75 s") != gist("host b has not polled for 75 s")


def test_a_queued_restore_says_why_it_waits_and_is_placed_once_enough_hosts_poll(
        env: Env, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _, s = suspended(env)
    c = env.client()
    e = c.enqueue(s["id"], timeout_s=42)
    assert e["state"] == "waiting" and e["position"] == 1 and e["job"] == "sim"
    assert c.enqueue(s["id"])["id"] == e["id"]  # a second launch queues it once
    e = entry(c, s["id"], lambda x: "not enough compatible hosts" in x["reason"] or "needs a host" in x["reason"],
              "the reason it waits")
    c.host_poll("hostA", {"underlay": "10.0.0.1"}, 0)
    e = entry(c, s["id"], lambda x: "taken by the nodes before: hostA" in x["reason"], "one host is not enough")
    assert "node 1 needs a host" in e["reason"] and e["state"] == "waiting"
    monkeypatch.setenv("CRYOSLEEP_COORDINATOR", env.url)
    monkeypatch.setenv("CRYOSLEEP_COORDINATOR_TOKEN_FILE", str(env.tmp / "token"))
    assert main(["coordinator", "queue", "--json"]) == 0
    (shown,) = json.loads(capsys.readouterr().out)["entries"]
    assert shown["snapshot"] == s["id"] and shown["state"] == "waiting" and "node 1 needs a host" in shown["reason"]

    c.host_poll("hostB", {"underlay": "10.0.0.2"}, 0)
    e = entry(c, s["id"], lambda x: x["state"] == "placing", "the placement once two hosts poll")
    st = c.placement(e["placement"])
    assert [(n["node_rank"], n["host"], n["peers"], n["timeout_s"]) for n in st["nodes"]] == [
        (0, "hostA", ["10.0.0.2"], 42), (1, "hostB", ["10.0.0.1"], 42)]
    assert len(done(c, "hostA")) == len(done(c, "hostB")) == 1
    e = entry(c, s["id"], lambda x: x["state"] == "done", "the entry done once every node is restored")
    assert e["reason"] == "restored: node 0 on hostA, node 1 on hostB" and e["position"] is None
    kinds = [ev["message"] for ev in env.coordinator.catalog.events(snapshot=s["id"]) if ev["kind"] == "queue"]
    assert any("queued by restore" in m for m in kinds) and any(m.endswith("done: " + e["reason"]) for m in kinds)


def test_entries_are_served_by_priority_then_age_and_a_live_job_waits(env: Env) -> None:
    snaps = {job: suspended(env, job, nnodes=1)[1]["id"] for job in ("a", "b", "c")}
    c = env.client()
    for job, prio in (("a", 0), ("b", 0), ("c", 5)):
        c.enqueue(snaps[job], priority=prio)
        time.sleep(0.01)
    assert [e["job"] for e in c.queue()] == ["c", "a", "b"]
    c.host_poll("solo", {}, 0)
    order = []
    for _ in range(3):  # one host: one job at a time, each restored before the next is placed
        wait_for(lambda: any(x["state"] == "placing" for x in c.queue()), 15, "the next placement")
        e = next(x for x in c.queue() if x["state"] == "placing")
        order.append(e["job"])
        assert [o["snapshot"] for o in done(c, "solo")] == [snaps[e["job"]]]
        wait_for(lambda j=e["job"]: c.queued(snaps[j])["state"] == "done", 15, "the entry done")
    assert order == ["c", "a", "b"]

    # a job that runs (its agents alive) is not restored again: the entry waits, saying so
    env.cluster(job="live", nnodes=1, nproc=1)
    s = c.snapshot("live", timeout_s=20)
    c.enqueue(s["id"])
    e = entry(c, s["id"], lambda x: x["reason"].startswith("job live runs"), "the live job's reason")
    assert e["state"] == "waiting" and "node 0 on sim-0" in e["reason"]
    assert main(["coordinator", "unqueue", s["id"], "--coordinator", env.url, "--token-file",
                 str(env.tmp / "token"), "--json"]) == 0
    assert c.queued(s["id"])["state"] == "cancelled"


def test_the_queue_and_the_drained_hosts_survive_a_restart_in_order(tmp_path: Path, db: str) -> None:
    with serving(tmp_path, db=db) as env:
        first = {job: suspended(env, job, nnodes=1)[1]["id"] for job in ("old", "new")}
        c = env.client()
        ids = [c.enqueue(first["old"])["id"], c.enqueue(first["new"], priority=1)["id"]]
        env.coordinator.placements.drain("gone", "maintenance")
    with serving(tmp_path, db=db) as env:  # a restarted coordinator (or a standby) on the same catalog
        c = env.client()
        assert [(e["id"], e["job"], e["state"]) for e in c.queue()] == [(ids[1], "new", "waiting"),
                                                                        (ids[0], "old", "waiting")]
        c.host_poll("gone", {}, 0)
        e = entry(c, first["new"], lambda x: "is drained (maintenance)" in x["reason"], "the drained host's reason")
        assert e["state"] == "waiting"
        c.host_poll("fresh", {}, 0)
        entry(c, first["new"], lambda x: x["state"] == "placing", "the first entry placed on the fresh host")
        assert c.queued(first["old"])["state"] == "waiting"


def test_a_drained_host_without_a_spare_ends_its_job_suspended_and_queued(env: Env) -> None:
    cl = env.cluster(nnodes=2, nproc=1)  # node I's agent on host sim-I
    c = env.client()
    for h in ("sim-0", "sim-1"):  # the machines the job runs on offer themselves too
        c.host_poll(h, {}, 0)
    out = c.drain("sim-1", deadline_s=20)
    (d,) = out["jobs"]
    assert d["job"] == "sim" and d["nodes"] == [1] and d["action"] == "suspend-and-queue" and d["spare"] == []
    assert d["outcome"] == "queued" and d["entry"], d
    assert "node(s) 1 of 2 run on sim-1" in d["reasons"][0]
    assert "host sim-0 runs node 0 of job sim" in d["reasons"][1] and "host sim-1 is drained" in d["reasons"][1]
    assert env.coordinator.catalog.snapshot(d["snapshot"])["state"] == "verified"
    assert c.job("sim")["state"] == "suspended"
    drains = [ev["message"] for ev in env.coordinator.catalog.events(job="sim") if ev["kind"] == "drain"]
    assert any("suspend-and-queue: node(s) 1 of 2" in m for m in drains) and any("queued" in m for m in drains)
    assert {ev["kind"] for ev in env.coordinator.catalog.events(snapshot=d["snapshot"])} >= {"drain", "queue"}
    with pytest.raises(NotEligible, match="is drained"):
        c.place(d["snapshot"], ["sim-0", "sim-1"])
    with pytest.raises(NotEligible, match="host sim-0 runs node 0 of job sim"):  # its agents have not gone yet
        c.place(d["snapshot"], ["auto"])
    assert [h["drained"] is not None for h in c.hosts()] == [False, True]

    for r in cl.runners:  # the stop's agents go
        r.leave("suspended")
    e = entry(c, d["snapshot"], lambda x: "host sim-1 is drained" in x["reason"], "waiting on the drained host")
    assert e["state"] == "waiting" and e["source"] == "drain sim-1"
    c.host_poll("spare", {}, 0)  # a host appears
    e = entry(c, d["snapshot"], lambda x: x["state"] == "placing", "placed once a host appears")
    assert [(n["node_rank"], n["host"]) for n in c.placement(e["placement"])["nodes"]] == [(0, "sim-0"), (1, "spare")]
    assert c.undrain("sim-1")["was_drained"] and c.hosts()[1]["drained"] is None


def test_a_drain_with_a_spare_migrates_and_falls_back_to_the_queue_when_the_spare_never_restores(
        env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    env.cluster(nnodes=2, nproc=1)
    c = env.client()
    c.host_poll("spare", {"underlay": "10.9.9.9"}, 0)  # polls once, never runs its order: never passes its checks
    assert main(["coordinator", "drain", "sim-0", "--deadline", "5", "--coordinator", env.url, "--token-file",
                 str(env.tmp / "token")]) == 0
    out = capsys.readouterr().out
    assert "job sim (node(s) 0): suspend-and-queue: queued" in out and ", migration sim-" in out, out
    assert "host(s) spare are free with those nodes' GPUs" in out and "only those nodes move (node 0 to spare)" in out
    assert "failed (the restore of node(s) [0] of job 'sim' on the spare did not pass its checks in time" in out
    migration = next(ev for ev in env.coordinator.catalog.events(job="sim") if ev["kind"] == "migrate")["snapshot"]
    row = env.coordinator.catalog.snapshot(migration)
    assert row["mode"] == "migrate" and row["state"] == "failed" and not row["valid"], row
    assert [n["state"] for n in row["nodes"]] == ["resumed", "resumed"]
    assert c.drain("nowhere", deadline_s=5)["jobs"] == []  # a host with no job: drained, nothing moved


def test_a_multi_node_launch_line_of_a_suspended_job_queues_its_snapshot(
        env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`run --nnodes 2 --coordinator URL` again (a requeued batch script): the coordinator's suspended snapshot of
    the job is queued (once, for every node's launch line), another command of it refused, --fresh starts anew."""
    monkeypatch.setenv("CRYOSLEEP_HOME", str(tmp_path / "home"))
    _, s = suspended(env)
    c = env.client()
    spec = JobSpec(name="sim.node1", program=["python", "train.py"], cwd="/", env={}, nproc_per_node=1, nnodes=2,
                   node_rank=1)
    assert resuming.at_coordinator(spec, c, fresh=True, quiet=True) is None
    assert resuming.at_coordinator(spec, c, fresh=False, quiet=True) == s["id"]
    other = JobSpec(**{**spec.__dict__, "nproc_per_node": 4})
    with pytest.raises(NotEligible, match=f"suspended in snapshot {s['id']}") as e:
        resuming.at_coordinator(other, c, fresh=False, quiet=True)
    assert "nproc_per_node: 1 there, 4 here" in e.value.why
    assert resuming.at_coordinator(JobSpec(**{**spec.__dict__, "name": "new.node0", "node_rank": 0}), c, fresh=False,
                                   quiet=True) is None  # a job the coordinator does not know: started anew
    assert c.enqueue(s["id"])["id"] == c.enqueue(s["id"])["id"]  # node 0's and node 1's launch lines: one entry
    log = (tmp_path / "home" / "jobs" / "sim.node1" / "decisions.jsonl").read_text()
    assert '"action": "restore"' in log and '"action": "fresh"' in log and '"action": "refuse"' in log


def test_the_launch_line_waits_for_the_queued_restore_and_says_where_each_node_went(
        env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`cryosleep run --nnodes 2 --node-rank 0 --coordinator URL ...` of the suspended job, in-process: it queues the
    snapshot, waits while no host fits, and exits 0 with each node's host once simulated daemons restored them."""
    if os.geteuid() != 0:
        pytest.skip("cryosleep run needs root")
    monkeypatch.setenv("CRYOSLEEP_HOME", str(tmp_path / "home"))
    _, s = suspended(env)
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    c = env.client()
    threads = []

    def daemons() -> None:  # the hosts appear once the launch waits in the queue
        wait_for(lambda: any(e["snapshot"] == s["id"] for e in c.queue()), 30, "the launch's entry")
        for h in ("hostA", "hostB"):
            c.host_poll(h, {}, 0)
        for h in ("hostA", "hostB"):
            done(c, h)

    threads.append(threading.Thread(target=daemons, daemon=True))
    threads[0].start()
    code = main(["run", "--json", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1", "--net", "job",
                 "--run-id", "sim-run", "--name", "sim", "--coordinator", env.url, "--token-file",
                 str(env.tmp / "token"), str(script)])
    threads[0].join(10)
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["snapshot"] == s["id"] and out["state"] == "done", out
    assert [(n["node_rank"], n["host"], n["state"]) for n in out["nodes"]] == [(0, "hostA", "done"),
                                                                                (1, "hostB", "done")]
    assert c.queued(s["id"])["source"] == "restore"
