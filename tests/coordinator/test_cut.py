"""The consistent cut across nodes, over real HTTP: ranks behind run on, ranks held short get their call added,
and every member of every communicator is captured at the same count, whichever node it runs on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cryosleep.coordinator.protocol import Command, Op
from cryosleep.errors import CaptureFailed, NotEligible
from tests.coordinator.helpers import Env, images
from tests.coordinator.sim import GLOBAL, SimNode, SimWorld, node_ident


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_cut_converges_across_nodes_with_ranks_behind(env: Env, seed: int) -> None:
    c = env.cluster(nnodes=3, nproc=4, seed=seed, spread=7, call_s=0.001)
    before = {rk.rank: rk.pos for rk in c.world.ranks}
    assert len(set(before.values())) > 1, "the ranks must start at different points"
    s = env.client().snapshot("sim", timeout_s=20)
    assert s["state"] == "verified", s.get("error")
    assert s["valid"]
    cut = c.cut_counters(s["id"])
    assert sorted(cut) == list(range(12))
    g = f"{GLOBAL:016x}"
    assert len({seq[g] for seq in cut.values()}) == 1, f"job-wide communicator split: {cut}"
    for n in range(3):
        local = f"{node_ident(n):016x}"
        assert len({cut[r][local] for r in range(n * 4, n * 4 + 4)}) == 1, f"node {n}'s communicator split"
    # ranks behind ran on to the cut: the cut is past where the most advanced rank stood when it was asked
    assert max(sum(seq.values()) for seq in cut.values()) >= max(before.values())
    # every image is on disk with the checksum the catalog names
    files = images(env.tmp / "store", s["id"])
    assert len(files) == 3
    for n in s["nodes"]:
        assert n["state"] == "verified" and n["image"]["bytes"] > 0
        assert set(n["phases"]) >= {"prepare", "drain", "quiesce", "capture", "resume", "persist"}
    assert set(s["phases"]) >= {"prepare", "drain", "quiesce", "capture", "resume", "persist"}
    assert c.all_running()
    for n in c.nodes:  # the job network held by the capture command, released by the resume command
        assert n.ops_of(s["id"])[-6:] == ["quiesce", "capture", "resume", "relay", "run", "persist"]
    ev = env.client().snapshot_detail(s["id"])["events"]
    assert any(e["kind"] == "cut" and "round" in e["message"] for e in ev)


def test_without_a_job_network_the_capture_holds_none(env: Env) -> None:
    """No node has a job network (its prepare answer says so): the keep-running capture skips net_hold and
    net_release, two rounds fewer; the cut is as consistent."""
    c = env.cluster(nnodes=2, nproc=2, seed=4, net=False)
    s = env.client().snapshot("sim", timeout_s=20)
    assert s["state"] == "verified", s.get("error")
    for n in c.nodes:
        assert n.ops_of(s["id"])[-6:] == ["quiesce", "capture", "resume", "relay", "run", "persist"]
    cut = c.cut_counters(s["id"])
    assert sorted(cut) == [0, 1, 2, 3] and len({seq[f"{GLOBAL:016x}"] for seq in cut.values()}) == 1, cut


@pytest.mark.parametrize("legacy", [frozenset({1}), frozenset({0, 1, 2})])
def test_an_agent_of_before_gets_the_network_rounds_of_before(env: Env, legacy: frozenset[int]) -> None:
    """A node whose prepare answer names no capability (an agent of before, which would ignore capture's
    hold_net and dump with its network up): every node gets net_hold and net_release rounds of their own, as
    before; the simulated agents refuse a keep-running dump without the hold and a release before every dump."""
    c = env.cluster(nnodes=3, nproc=2, seed=6, legacy=legacy)
    s = env.client().snapshot("sim", timeout_s=20)
    assert s["state"] == "verified", s.get("error")
    for n in c.nodes:
        assert n.ops_of(s["id"])[-8:] == ["quiesce", "net_hold", "capture", "net_release", "resume", "relay", "run",
                                          "persist"]
    assert c.all_running() and len({seq[f"{GLOBAL:016x}"] for seq in c.cut_counters(s["id"]).values()}) == 1


def test_cut_is_computed_over_every_rank_of_every_node(env: Env) -> None:
    """Ranks short of the job-wide target while held on their node's communicator: the stuck rule, across nodes."""
    c = env.cluster(nnodes=4, nproc=2, seed=5, spread=9)
    s = env.client().snapshot("sim", timeout_s=20)
    assert s["state"] == "verified", s.get("error")
    cut = c.cut_counters(s["id"])
    assert len({seq[f"{GLOBAL:016x}"] for seq in cut.values()}) == 1
    # and the job keeps going: the next snapshot cuts later
    s2 = env.client().snapshot("sim", timeout_s=20)
    assert s2["state"] == "verified", s2.get("error")
    cut2 = c.cut_counters(s2["id"])
    assert cut2[0][f"{GLOBAL:016x}"] >= cut[0][f"{GLOBAL:016x}"]
    assert [x["id"] for x in env.client().snapshots("sim", valid_only=True)] == [s["id"], s2["id"]]


def test_stop_snapshot_suspends_the_job(env: Env) -> None:
    c = env.cluster(nnodes=2, nproc=3, seed=4)
    s = env.client().snapshot("sim", stop=True, timeout_s=20)
    assert s["state"] == "verified" and s["ponr_at"] and s["finished_at"]
    assert all(rk.ended for rk in c.world.ranks)
    assert env.client().job("sim")["state"] == "suspended"
    for n in c.nodes:
        assert n.ops_of(s["id"])[-1] == "stop"
    body = json.loads((env.tmp / "store" / s["id"] / "node-1.json").read_text())
    assert body["node"] == 1
    with pytest.raises(NotEligible, match="suspended"):
        env.client().snapshot("sim", timeout_s=5)


def test_restored_job_registers_as_running(env: Env) -> None:
    c = env.cluster(nnodes=2, nproc=2, seed=12)
    s = env.client().snapshot("sim", stop=True, timeout_s=20)
    assert env.client().job("sim")["state"] == "suspended"
    c.close()
    env.cluster(nnodes=2, nproc=2, seed=12)  # new agent processes (incarnations): the job came back
    assert env.client().job("sim")["state"] == "running"
    assert env.client().job("sim")["last_snapshot"] == s["id"]


def test_many_nodes(env: Env) -> None:
    """A smaller cousin of bench/coordinator_scale.py, so that a quadratic slip shows in the tests."""
    c = env.cluster(nnodes=32, nproc=4, seed=13, spread=6)
    s = env.client().snapshot("sim", timeout_s=30)
    assert s["state"] == "verified", s.get("error")
    cut = c.cut_counters(s["id"])
    assert len(cut) == 128 and len({seq[f"{GLOBAL:016x}"] for seq in cut.values()}) == 1
    assert sum(s["phases"].values()) < 15


def test_a_simulated_node_refuses_a_release_before_every_node_dumped(tmp_path: Path) -> None:
    """The guard the tests above lean on: a release (resume's release_net) while another node of the job has not
    dumped yet is refused, as a coordinator that released early would have broken the images' agreement."""
    world = SimWorld(2, 1, seed=1)
    a, b = (SimNode(world, n, tmp_path) for n in (0, 1))

    def cmd(op: Op, **args: object) -> Command:
        return Command(f"s.{op}", "s", "sim", op, 5.0, 0.0, args)

    for rk in world.ranks:
        rk.mode, rk.live = "quiesced", False  # at the cut (what quiesce leaves)
    a.capture(cmd(Op.CAPTURE, mode="keep-running", gen=8, hold_net=True))
    assert a.net_held
    with pytest.raises(CaptureFailed, match=r"released before node\(s\) \[1\] dumped"):
        a.resume(cmd(Op.RESUME, gen=16, release_net=True))
    b.capture(cmd(Op.CAPTURE, mode="keep-running", gen=8, hold_net=True))
    a.resume(cmd(Op.RESUME, gen=24, release_net=True))
    assert not a.net_held and b.net_held
