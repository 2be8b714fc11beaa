"""An agent whose job ended says so as it goes (``AgentRunner.leave``, ``POST /v1/agents/{agent}/leave``): a
snapshot asked then is refused, or fails, at once and says why, instead of waiting ``lost_after_s`` for a poll
and calling the agent lost. (A two-node job that ended just before its stop snapshot was reported as "its
agent was lost (no poll for 3.0 s)" on both nodes: tests/jobs/test_multinode.py checks the real agents.)

The coordinator here counts an agent lost only after 30 s, so that an answer within a few seconds can only
come from the agent's own word."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryosleep.coordinator import service
from cryosleep.errors import NotEligible
from tests.coordinator.helpers import FAST, Env, serving, wait_for
from tests.coordinator.sim import SimFaults

SLOW_LOSS = service.ServiceConfig(poll_wait_s=FAST.poll_wait_s, lost_after_s=30.0, rollback_s=FAST.rollback_s,
                                  redeliver_s=FAST.redeliver_s, default_timeout_s=FAST.default_timeout_s)
ENDED = "its job ended on this node (exit code 0)"


@pytest.fixture
def patient(tmp_path: Path) -> Iterator[Env]:
    with serving(tmp_path, SLOW_LOSS) as e:
        yield e


def test_a_snapshot_of_a_job_whose_agent_left_is_refused_with_the_reason(patient: Env) -> None:
    c = patient.cluster(nnodes=2, nproc=2)
    c.runners[1].leave(ENDED)
    nodes = patient.client().job("sim")["nodes"]
    assert [(n["alive"], n["left"]) for n in nodes] == [(True, None), (False, ENDED)], nodes
    t = time.monotonic()
    with pytest.raises(NotEligible) as e:
        patient.client().snapshot("sim", timeout_s=20)
    assert time.monotonic() - t < 10
    assert f"node 1: {ENDED}" in e.value.why, e.value.why


def test_an_agent_leaving_during_a_snapshot_fails_it_at_once(patient: Env) -> None:
    c = patient.cluster(nnodes=2, nproc=2, faults={1: SimFaults(delay={"prepare": 5.0})})
    t = time.monotonic()
    s = patient.client().snapshot("sim", timeout_s=60, wait=False)
    wait_for(lambda: any(cmd.op == "prepare" for cmd in c.runners[1].received), 10, "node 1 to get prepare")
    c.runners[1].leave(ENDED)
    done = patient.coordinator.wait_snapshot(str(s["id"]), 60)
    assert done["state"] == "failed", done
    assert time.monotonic() - t < 20, "the agent's word, not lost_after_s (30 s), must end the snapshot"
    assert f"node 1: prepare: its agent left: {ENDED}" in done["error"]["why"], done["error"]
    # the other node was rolled back and runs on
    wait_for(c.nodes[0].running, 10, "node 0 running again")
    assert "abort" in c.nodes[0].ops_of(str(s["id"]))
