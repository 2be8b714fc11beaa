"""Placing a snapshot's nodes on hosts (coordinator/placement.py, `cryosleep host serve`, `restore --nodes`), over
real HTTP. The successful restore of a real job through host daemons is in tests/jobs/test_multinode.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cryosleep.cli.host_cmd import HostDaemon
from cryosleep.cli.main import main
from cryosleep.coordinator import placement
from cryosleep.coordinator.client import CoordinatorClient, underlay_towards
from cryosleep.errors import Busy, NotEligible
from tests.coordinator.helpers import Env


def verified(env: Env, nnodes: int = 2) -> dict[str, Any]:
    env.cluster(nnodes=nnodes, nproc=1)
    s = env.client().snapshot("sim", timeout_s=20)
    assert s["state"] == "verified", s.get("error")
    return s


def test_a_placement_is_refused_with_every_reason_and_nothing_queued(env: Env) -> None:
    s = verified(env)
    c = env.client()
    c.host_poll("hostA", {"underlay": "10.0.0.1"}, 0)
    with pytest.raises(NotEligible) as e:
        c.place(s["id"], ["hostA", "nowhere", "hostA"])
    assert "2 node(s), 3 host(s)" in e.value.why and "no host 'nowhere'" in e.value.why
    assert "coordinator hosts" in e.value.hint
    assert c.hosts()[0]["orders"] == 0 and c.host_poll("hostA", {}, 0) == []


def test_a_host_whose_gpus_differ_from_the_images_is_refused(env: Env) -> None:
    s = verified(env)
    for n in s["nodes"]:  # as a node agent records a GPU job's image: the models of the GPUs it was taken on
        env.coordinator.catalog.update_node(s["id"], n["node_rank"], image={**n["image"], "gpus": ["NVIDIA H200"] * 2})
    c = env.client()
    c.host_poll("big", {"gpus": ["NVIDIA H200"] * 2}, 0)
    c.host_poll("small", {"gpus": ["NVIDIA H200"]}, 0)
    c.host_poll("cpu", {"gpus": []}, 0)
    with pytest.raises(NotEligible) as e:
        c.place(s["id"], ["small", "cpu"])
    assert "node 0's image was taken on 2 GPU(s) (NVIDIA H200), host 'small' has 1 (NVIDIA H200)" in e.value.why
    assert "node 1's image was taken on 2 GPU(s) (NVIDIA H200), host 'cpu' has 0" in e.value.why
    assert c.place(s["id"], ["big", "big"])["state"] == "running"


def test_each_host_gets_its_node_with_the_other_hosts_as_overlay_peers(env: Env) -> None:
    s = verified(env)
    c = env.client()
    c.host_poll("hostA", {"underlay": "10.0.0.1"}, 0)
    c.host_poll("hostB", {"underlay": "10.0.0.2"}, 0)
    st = c.place(s["id"], ["hostB", "hostA"], timeout_s=42)  # swapped
    assert st["state"] == "running" and [(n["node_rank"], n["host"], n["peers"], n["state"]) for n in st["nodes"]] == [
        (0, "hostB", ["10.0.0.1"], "queued"), (1, "hostA", ["10.0.0.2"], "queued")]
    with pytest.raises(Busy, match="being placed already"):
        c.place(s["id"], ["hostA", "hostB"])
    got = c.host_poll("hostA", {"underlay": "10.0.0.1"}, 5)
    assert [(o["node_rank"], o["snapshot"], o["timeout_s"]) for o in got] == [(1, s["id"], 42)]
    assert {h["name"]: h["orders"] for h in c.hosts()} == {"hostA": 1, "hostB": 1}

    # a reader waiting on the placement wakes when a node's state changes
    seen: list[dict[str, Any]] = []
    t = threading.Thread(target=lambda: seen.append(env.client().placement(st["id"], wait_s=20,
                                                                           seen="queued,delivered")))
    t.start()
    time.sleep(0.3)
    c.order_report(got[0]["id"], "running")
    t.join(10)
    assert [n["state"] for n in seen[0]["nodes"]] == ["queued", "running"]
    c.order_report(got[0]["id"], "done", result={"job": "sim.node1"})
    (b,) = c.host_poll("hostB", {}, 5)
    c.order_report(b["id"], "failed", error={"error": "not_eligible", "what": "no GPU here"})
    c.order_report(b["id"], "done")  # a final state stays
    final = c.placement(st["id"])
    assert final["state"] == "failed" and final["nodes"][0]["error"]["what"] == "no GPU here"
    assert final["nodes"][1]["result"] == {"job": "sim.node1"}
    c.place(s["id"], ["hostA", "hostB"])  # once finished, the snapshot may be placed again


def test_auto_picks_live_free_hosts_with_each_nodes_gpus(env: Env) -> None:
    """`restore SNAPSHOT --nodes auto`: the coordinator chooses, node by node, a host that polled recently, has no
    order in progress and the GPUs the node's image was taken on; refused with why when there are not enough."""
    s = verified(env)
    for n in s["nodes"]:
        env.coordinator.catalog.update_node(s["id"], n["node_rank"], image={**n["image"], "gpus": ["NVIDIA H200"]})
    c = env.client()
    c.host_poll("a-cpu", {"gpus": [], "underlay": "10.0.0.1"}, 0)
    c.host_poll("b-h200", {"gpus": ["NVIDIA H200"], "underlay": "10.0.0.2"}, 0)
    c.host_poll("c-stale", {"gpus": ["NVIDIA H200"], "underlay": "10.0.0.3"}, 0)
    env.coordinator.placements.fresh_s = 0.3
    time.sleep(0.4)
    c.host_poll("a-cpu", {}, 0)
    c.host_poll("b-h200", {}, 0)
    with pytest.raises(NotEligible) as e:
        c.place(s["id"], ["auto"])
    assert "node 1 needs a host with 1 GPU(s) (NVIDIA H200)" in e.value.why, e.value.why
    assert "host c-stale has not polled for" in e.value.why and "host a-cpu has 0 GPU(s)" in e.value.why
    assert "taken by the nodes before: b-h200" in e.value.why and "host serve" in e.value.hint
    assert all(h["orders"] == 0 for h in c.hosts())  # nothing was queued
    env.coordinator.placements.fresh_s = placement.HOST_FRESH_S
    c.host_poll("d-h200", {"gpus": ["NVIDIA H200"], "underlay": "10.0.0.4"}, 0)
    st = c.place(s["id"], ["auto"])
    assert [(n["node_rank"], n["host"], n["peers"]) for n in st["nodes"]] == [
        (0, "b-h200", ["10.0.0.3"]), (1, "c-stale", ["10.0.0.2"])]  # c-stale counts again: fresh is 60 s again
    with pytest.raises(NotEligible) as e:  # hosts with an order in progress are not free
        env.coordinator.placements.pick(env.coordinator.catalog.snapshot(s["id"]))
    assert "host b-h200 is restoring another node now" in e.value.why and "taken by the nodes before: d-h200" in (
        e.value.why)


def placed_on_a_and_b(env: Env) -> tuple[dict[str, Any], CoordinatorClient, dict[str, Any]]:
    """A verified two-node snapshot placed on hostA and hostB, which polled once: (snapshot, client, placement)."""
    s = verified(env)
    c = env.client()
    c.host_poll("hostA", {"underlay": "10.0.0.1"}, 0)
    c.host_poll("hostB", {"underlay": "10.0.0.2"}, 0)
    return s, c, c.place(s["id"], ["hostA", "hostB"])


def test_a_host_lost_before_its_order_fails_it_and_tells_the_other_nodes_barrier(env: Env) -> None:
    """A host daemon that stops polling before it started its node's restore (killed: chaos two-node rounds,
    seed 300): its order fails once it is lost, saying why, and its node's word at the restore's barrier is that
    failure, so the other node's restore stops at once rather than wait out its timeout; an order its host had
    started stays running (its restore goes on there by itself)."""
    s, c, st = placed_on_a_and_b(env)
    (b,) = c.host_poll("hostB", {}, 5)
    c.order_report(b["id"], "running")
    env.coordinator.placements.lost_s = 0.5
    time.sleep(0.7)  # hostA never polls again; hostB neither, but its order had started
    now = c.placement(st["id"])
    assert [n["state"] for n in now["nodes"]] == ["failed", "running"] and now["state"] == "running"
    err = now["nodes"][0]["error"]
    assert err["what"] == f"host 'hostA' was lost before it started the restore of node 0 of {s['id']}", err
    assert "has not polled for" in err["why"] and "host serve" in err["hint"]
    ready = c.rendezvous(s["id"], prefix="ready/")
    assert list(ready) == ["ready/0"] and ready["ready/0"]["value"]["ok"] is False
    assert ready["ready/0"]["value"]["host"] == "hostA" and "was lost" in ready["ready/0"]["value"]["problems"][0]
    c.order_report(b["id"], "failed", error={"error": "not_eligible", "what": "another node cannot take its image"})
    assert c.placement(st["id"])["state"] == "failed"
    env.coordinator.placements.lost_s = placement.HOST_LOST_S
    c.host_poll("hostA", {}, 0)
    c.place(s["id"], ["hostA", "hostB"])  # the snapshot may be placed again


def test_an_order_whose_host_is_lost_after_it_started_is_done_by_the_restored_agents_word(env: Env) -> None:
    """A host daemon killed after it started its node's restore (chaos two-node rounds, seed 300 again): the
    restore went on there by itself and its agent registered; once the host is lost, that registration is the
    order's result, so the placement ends instead of waiting out its timeout."""
    s, c, st = placed_on_a_and_b(env)
    (a,) = c.host_poll("hostA", {}, 5)
    c.order_report(a["id"], "running")
    (b,) = c.host_poll("hostB", {}, 5)
    c.order_report(b["id"], "running")
    c.order_report(b["id"], "done", result={"job": "sim.node1"})
    image = next(n["image"]["ref"] for n in c.snapshot_detail(s["id"])["nodes"] if n["node_rank"] == 0)
    env.coordinator.register({"job": "sim", "nnodes": 2, "node_rank": 0, "incarnation": "restored",
                              "facts": {"local_job": "sim.node0", "restored_from": image}})
    env.coordinator.placements.lost_s = 0.5
    time.sleep(0.7)
    c.host_poll("hostB", {}, 0)  # hostA's daemon is gone; hostB's polls on
    now = c.placement(st["id"])
    assert now["state"] == "done", now
    got = now["nodes"][0]["result"]
    assert got["job"] == "sim.node0" and got["restored_from"] == image and "hostA" in got["reported_by"], got
    env.coordinator.placements.lost_s = placement.HOST_LOST_S


def test_an_order_the_host_never_confirmed_is_delivered_again(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "REDELIVER_S", 0.3)
    s = verified(env, nnodes=1)
    c = env.client()
    c.host_poll("solo", {}, 0)
    c.place(s["id"], ["solo"])
    (first,) = c.host_poll("solo", {}, 5)
    assert c.host_poll("solo", {}, 0) == []  # delivered, not yet due again
    time.sleep(0.4)
    (again,) = c.host_poll("solo", {}, 5)
    assert again["id"] == first["id"]
    c.order_report(first["id"], "running")
    time.sleep(0.4)
    assert c.host_poll("solo", {}, 0) == []


def test_restore_nodes_through_host_daemons_reports_each_nodes_failure(env: Env, cryo_home: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The whole path with real host daemons running real `cryosleep restore` commands: the simulated cluster's
    images are not real snapshots, so each node's restore fails, and the one command that placed them says which
    node failed on which host and why."""
    s = verified(env)
    monkeypatch.setenv("CRYOSLEEP_COORDINATOR", env.url)
    monkeypatch.setenv("CRYOSLEEP_COORDINATOR_TOKEN_FILE", str(env.tmp / "token"))
    daemons = [HostDaemon(env.url, env.token, name, underlay_towards(env.url), poll_wait=1.0) for name in ("a", "b")]
    threads = [threading.Thread(target=d.serve, daemon=True) for d in daemons]
    for t in threads:
        t.start()
    try:
        while len(env.client().hosts()) < 2:
            time.sleep(0.05)
        assert main(["restore", s["id"], "--nodes", "b,a", "--timeout", "30", "--json"]) == 1
        out = json.loads(capsys.readouterr().out)
        assert out["state"] == "failed" and [(n["node_rank"], n["host"], n["state"]) for n in out["nodes"]] == [
            (0, "b", "failed"), (1, "a", "failed")]
        assert all(n["error"]["error"] and n["error"]["what"] for n in out["nodes"]), out
        assert main(["restore", s["id"], "--nodes", "a,b", "--node-rank", "0", "--json"]) == 2
        assert "--node-rank" in json.loads(capsys.readouterr().out)["what"]
        assert main(["coordinator", "hosts", "--json"]) == 0
        hosts = json.loads(capsys.readouterr().out)
        assert [(h["name"], h["available"], h["orders"]) for h in hosts] == [("a", True, 0), ("b", True, 0)]
        assert hosts[0]["facts"]["underlay"] == "127.0.0.1"
    finally:
        for d in daemons:
            d.shutdown()
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads), "a host daemon did not stop"
