"""Chaos seed 1002, replayed on purpose: a DataLoader worker SIGKILLed just before a keep-running snapshot is
requested, reaped at once by its rank, which has not raised yet. The snapshot's own watch starts at its preflight
and never saw the worker; the agent's watch between snapshots (core/procwatch.py) did, and the snapshot waits
until the job survived it (capture/snapshot.py ``SETTLE_S``) or refuses it. Judged as the chaos rounds are: no
snapshot listed valid whose restore does not run the job on."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from cryosleep.core import proctree
from tests.jobs.chaos import LOADER_SCRIPT
from tests.jobs.harness import Harness, assert_identical, workload


def _loader_workers(h: Harness, name: str) -> dict[int, list[int]]:
    """rank process -> its DataLoader worker processes (the ranks are the sandbox init's children)."""
    init = h.pids(name)[0]
    return {r: proctree.children(r) for r in proctree.children(init)}


def test_a_dataloader_worker_killed_just_before_a_snapshot_never_leaves_one_listed_valid_that_fails(
        h: Harness, tmp_path: Path) -> None:
    linger = tmp_path / "linger"
    args = ["--steps", "150", "--step-sleep", "0.05", "--workers", "2", "--linger", str(linger)]
    h.run("seed1002", LOADER_SCRIPT, args)
    h.wait_step("seed1002", 5)
    fallback = h.snapshot("seed1002")["snapshot"]
    h.wait_step("seed1002", 10)
    loader = next(w for _r, w in sorted(_loader_workers(h, "seed1002").items()) if w)
    os.kill(loader[0], signal.SIGKILL)  # its rank reaps it at once (its SIGCHLD handler), and raises later
    res = h.cli("snapshot", "seed1002", "--json", check=False)
    answer = res.stdout + res.stderr
    # the job fails by itself: whatever the snapshot answered, it must not list an image of the failing job
    assert h.wait_end("seed1002", timeout=120) not in (0, 75)
    listed = [x["snapshot"] for x in h.ls() if x["job"] == "seed1002" and x["local"]]
    assert res.returncode != 0 and listed == [fallback], f"listed {listed} after: {answer[-2000:]}"
    assert "last snapshot is still valid" in answer, answer[-2000:]
    log = h.job("seed1002").agent_log.read_text()
    assert "snapshot waits" in log and "killed by signal 9" in log, log[-2000:]
    # the one listed restores a job that runs to its end, bit-identical to an uninterrupted run
    h.restore(fallback)
    linger.touch()
    assert h.wait_end("seed1002", timeout=300) == 0
    assert_identical(h, "seed1002", LOADER_SCRIPT, args, [0])


def test_a_job_that_kills_its_own_helper_on_purpose_is_still_snapshotted(h: Harness, tmp_path: Path) -> None:
    """A subprocess timeout (the helper SIGKILLed by its rank, which goes on): the snapshot right after waits until
    the job has outlived the kill, takes its image, keeps it once the job has outlived the dump too, and the image
    restores a job that finishes bit-identically."""
    script = workload("ddp_basic")
    linger = tmp_path / "linger"
    args = ["--steps", "150", "--step-sleep", "0.05", "--helper-timeout-at", "10", "--linger", str(linger)]
    h.run("helper", script, args)
    deadline = time.monotonic() + 120
    while "helper timed out" not in h.job("helper").rank_log(0).read_text():
        assert time.monotonic() < deadline and h.state("helper") == "running"
        time.sleep(0.05)
    s = h.snapshot("helper")
    assert s["phases"]["settle"] > 0 and s["phases"]["probation"] > 0, s["phases"]
    log = h.job("helper").agent_log.read_text()
    assert "snapshot waits" in log and "killed by signal 9" in log, log[-2000:]
    h.kill_all("helper")
    h.wait_end("helper", timeout=60)
    h.restore(s["snapshot"])
    linger.touch()
    assert h.wait_end("helper") == 0
    assert_identical(h, "helper", script, args, [0, 1])
