"""`cryosleep jobs rm` and `jobs prune` on a really run job: refused while it runs and while it is suspended,
its record removed once it ended (SIGTERM to its agent, as the refusal says), its snapshot untouched, and
restored again after its directory is gone (the restore needs nothing from it). tests/unit/test_job_records.py
has every refusal with the JobDir API."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from tests.jobs.harness import Harness, workload

pytestmark = pytest.mark.slow

ARGS = ["--steps", "5000", "--step-sleep", "0.03"]  # runs until the test ends it


def jobs(h: Harness, *argv: str) -> tuple[int, Any]:
    res = h.cli("jobs", *argv, "--json", check=False)
    return res.returncode, json.loads(res.stdout)


def end(h: Harness, name: str) -> list[str]:
    """Ends the job as the refusal's hint says (SIGTERM to its agent); its losses."""
    got = h.losses(name)
    h.wait_step(name, (int(got[-1].split()[0]) if got else 0) + 5)  # it trains on first
    os.kill(h.job(name).read()[1].agent_pid, signal.SIGTERM)
    h.wait_end(name)
    assert h.state(name) in ("exited", "failed")
    return h.losses(name)


def test_a_real_jobs_record_goes_once_it_ended_and_its_snapshot_stays(h: Harness) -> None:
    h.run("rec", workload("ddp_basic"), ARGS, nproc=1)
    h.wait_step("rec", 5)
    agent = h.job("rec").read()[1].agent_pid
    code, err = jobs(h, "rm", "rec")
    assert code == 1 and err["what"] == f"job 'rec' is running (agent {agent}): its record is kept", err
    assert f"kill {agent}" in err["hint"]
    sid = h.snapshot("rec", "--stop")["snapshot"]
    assert h.wait_end("rec") == 75
    code, err = jobs(h, "rm", "rec")
    assert code == 1 and err["error"] == "not_eligible" and f"cryosleep restore {sid}" in err["hint"], err
    code, out = jobs(h, "prune")
    assert code == 0 and out["removed"] == [] and out["kept"][0]["state"] == "suspended", out

    h.restore(sid)
    first = end(h, "rec")
    code, out = jobs(h, "rm", "rec")
    assert code == 0 and [r["job"] for r in out["removed"]] == ["rec"], out
    assert out["removed"][0]["bytes"] > 0 and not h.job("rec").path.exists()
    assert jobs(h)[1] == []

    assert [s["snapshot"] for s in h.ls()] == [sid]  # the snapshot is untouched, and restores as before
    h.restore(sid)
    again = end(h, "rec")
    n = min(len(first), len(again))
    assert again[:n] == first[:n] and n > 10
    code, out = jobs(h, "prune", "--older-than", "1h")
    assert code == 0 and out["removed"] == [] and "less than --older-than" in out["kept"][0]["why"], out
    code, out = jobs(h, "prune")
    assert code == 0 and [r["job"] for r in out["removed"]] == ["rec"], out
