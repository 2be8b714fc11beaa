"""All or nothing across nodes: a failure, a hang or a lost agent at any phase rolls every node back, and the
snapshot is never listed valid."""

from __future__ import annotations

import time

import pytest

from tests.coordinator.helpers import FAST, Env, images, wait_for
from tests.coordinator.sim import SimCluster, SimFaults

PHASES = ["prepare", "drain", "quiesce", "capture", "persist"]


def assert_rolled_back(env: Env, c: SimCluster, s: dict[str, object], failing: int) -> None:
    sid = str(s["id"])
    assert s["state"] == "failed" and not s["valid"], s
    assert sid not in [x["id"] for x in env.client().snapshots("sim", valid_only=True)]
    assert images(env.tmp / "store", sid) == [], "a failed snapshot left images behind"
    for n in c.nodes:
        if n.node == failing:
            continue
        ops = n.ops_of(sid)
        assert "abort" in ops, f"node {n.node} was not told to abort: {ops}"
        if s["at_cut"]:
            tail = ops[ops.index("abort"):]
            assert tail[-3:] == ["resume", "relay", "run"], f"node {n.node} was not rebuilt: {ops}"
    wait_for(c.all_running, 10, "every rank running again")
    assert env.client().job("sim")["state"] == "running"
    assert {n["state"] for n in env.client().snapshot_detail(sid)["nodes"]} == {"resumed"}


@pytest.mark.parametrize("mode", ["keep-running", "stop"])
@pytest.mark.parametrize("phase", PHASES)
def test_one_node_fails_at_each_phase(env: Env, phase: str, mode: str) -> None:
    c = env.cluster(nnodes=3, nproc=2, seed=7, faults={1: SimFaults(fail={phase: "disk on fire"})})
    s = env.client().snapshot("sim", stop=mode == "stop", timeout_s=20)
    assert_rolled_back(env, c, s, failing=1)
    err = s["error"]
    assert isinstance(err, dict)
    assert "node 1" in err["what"] and "disk on fire" in err["why"]
    assert s["at_cut"] == (phase in ("quiesce", "capture") or (phase == "persist" and mode == "stop"))
    assert not any(rk.ended for rk in c.world.ranks)
    # the job is not harmed: the next snapshot, without the fault, succeeds
    c.nodes[1].faults.fail.clear()
    again = env.client().snapshot("sim", stop=mode == "stop", timeout_s=20)
    assert again["state"] == "verified", again.get("error")


@pytest.mark.parametrize("phase", ["drain", "capture"])
def test_lost_agent_times_out_and_every_other_node_resumes(env: Env, phase: str) -> None:
    c = env.cluster(nnodes=3, nproc=2, seed=8, faults={2: SimFaults(die=phase)})
    t = time.monotonic()
    s = env.client().snapshot("sim", timeout_s=30)
    took = time.monotonic() - t
    assert s["state"] == "failed"
    assert "lost" in s["error"]["why"], s["error"]
    assert took < 10, f"a lost agent must be noticed after lost_after_s ({FAST.lost_after_s} s), not the deadline"
    for n in c.nodes[:2]:
        assert "abort" in n.ops_of(s["id"])
        assert n.running() or s["at_cut"]  # with the cut reached, node 2's ranks cannot rebuild without it
    st = env.client().job("sim")
    # before the cut a lost agent's ranks were only held (released by their HOLD deadline): the job is "lost"
    # (a node without its agent); after it, quiesced ranks cannot be rebuilt without that node: "damaged"
    assert st["state"] == ("damaged" if s["at_cut"] else "lost")
    assert not next(n for n in st["nodes"] if n["node_rank"] == 2)["alive"]


def test_hang_runs_into_the_one_deadline(env: Env) -> None:
    c = env.cluster(nnodes=2, nproc=2, seed=9, faults={0: SimFaults(hang={"capture"})})
    t = time.monotonic()
    s = env.client().snapshot("sim", timeout_s=2)
    assert time.monotonic() - t < 10
    assert s["state"] == "failed" and "deadline" in s["error"]["why"]
    assert_rolled_back(env, c, s, failing=-1)


def test_no_snapshot_while_a_node_is_missing(env: Env) -> None:
    from cryosleep.errors import NotEligible

    c = env.cluster(nnodes=2, nproc=2)
    c.runners[1].halt()
    wait_for(lambda: not env.client().job("sim")["nodes"][1]["alive"], 10, "node 1 seen lost")
    with pytest.raises(NotEligible) as e:
        env.client().snapshot("sim", timeout_s=5)
    assert "node(s) [1]" in e.value.why
    assert env.client().snapshots("sim") == []


def test_resume_fails_once_then_the_rollback_rebuilds(env: Env) -> None:
    c = env.cluster(nnodes=3, nproc=2, seed=10, faults={2: SimFaults(fail={"relay": "id lost"}, once=True)})
    s = env.client().snapshot("sim", timeout_s=20)
    assert s["state"] == "failed" and "id lost" in s["error"]["why"]
    assert "rollback_problems" not in (s["error"].get("details") or {})
    for i, n in enumerate(c.nodes):
        ops = n.ops_of(s["id"])
        # the relay round stops at node 2's failure: another node's relay still queued then is cancelled, never
        # run (whether its poll took it first is a race); one taken runs at most once, before or (its thread
        # started late) just after the abort. Node 2 ran its own once. Then the rollback's rebuild everywhere.
        first, rebuild = ops[:-3], ops[-3:]
        assert rebuild == ["resume", "relay", "run"], ops
        assert first.count("abort") == 1 and first.count("resume") == 1, ops
        assert first.count("relay") in ((1,) if i == 2 else (0, 1)), ops
    wait_for(c.all_running, 10, "every rank running again")
    assert env.client().job("sim")["state"] == "running"


def test_a_node_that_cannot_be_rebuilt_ends_the_job_everywhere_and_says_so(env: Env) -> None:
    """Past the cut, a rebuild that fails twice leaves no node able to go on: every node ends its workers
    (never half-dead), the job is damaged, and the hint says to restore the last verified snapshot."""
    c = env.cluster(nnodes=2, nproc=2, seed=11, faults={1: SimFaults(fail={"relay": "id lost"})})
    s = env.client().snapshot("sim", timeout_s=20)
    assert s["state"] == "failed" and not s["valid"]
    problems = s["error"]["details"]["rollback_problems"]
    assert problems and any("id lost" in p for p in problems)
    assert "restore its last verified snapshot" in s["error"]["hint"]
    assert env.client().job("sim")["state"] == "damaged"
    assert not c.all_running()
    assert {n["state"] for n in env.client().snapshot_detail(s["id"])["nodes"]} == {"ended"}
    assert all(rk.ended for rk in c.world.ranks)
    kinds = [e["kind"] for e in env.client().snapshot_detail(s["id"])["events"]]
    assert "rollback-failed" in kinds and "ended" in kinds


@pytest.mark.parametrize(("legacy", "point"), [
    (False, "held"), (False, "capture"), (False, "resume"),
    (True, "net_hold"), (True, "capture"), (True, "net_release"), (True, "resume")])
def test_a_failure_where_the_network_is_held_or_released_rolls_every_node_back(env: Env, legacy: bool,
                                                                               point: str) -> None:
    """Keep-running: the capture command holds each node's job network and then dumps (``held``: failing between
    the two), the resume command releases it and then rebuilds; agents of before get net_hold and net_release
    rounds of their own. A failure at any of them on one node rolls every node back past the cut: every node
    aborts (its network released), all rebuild and run, nothing is listed valid, and the next snapshot is fine."""
    c = env.cluster(nnodes=3, nproc=2, seed=14, legacy=frozenset({0, 1, 2}) if legacy else frozenset(),
                    faults={1: SimFaults(fail={point: "port stuck"}, once=True)})
    s = env.client().snapshot("sim", timeout_s=20)
    assert s["at_cut"] and "port stuck" in s["error"]["why"], s.get("error")
    assert_rolled_back(env, c, s, failing=1)
    assert not any(n.net_held for n in c.nodes)
    assert "rollback_problems" not in (s["error"].get("details") or {})
    ops = c.nodes[1].ops_of(s["id"])
    assert ("net_hold" in ops) == legacy, ops
    again = env.client().snapshot("sim", timeout_s=20)
    assert again["state"] == "verified", again.get("error")
