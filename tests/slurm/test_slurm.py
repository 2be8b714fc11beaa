"""Slurm for real (tests.slurm.cluster.py: munged, slurmctld and slurmd on this host): a batch script whose last
line is ``exec cryosleep run ...`` is stopped into a snapshot at Slurm's signal, requeued (or not) as the decision
log says, and the same script resumes it: the losses match an uninterrupted run bit for bit, and the resumed run
was restored from the stop snapshot (not started anew: a fresh run would print the same losses).

    time limit   --time with --signal=B:USR1@N: SIGUSR1 -> stop snapshot -> Cryosleep runs `scontrol requeue`
    preemption   a job of the high partition needs the node (PreemptMode=REQUEUE): after GraceTime, SIGTERM to
                 every process of the job, SIGKILL after KillWait: a stop snapshot within KillWait (the workers
                 shielded); Slurm requeues it; it resumes once the preemptor is done
    scancel      SIGTERM to every process of the job, then SIGKILL after KillWait: with --grace a stop snapshot
                 (the workers are shielded from Slurm's SIGTERM), not requeued; a new sbatch resumes it
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cryosleep
from tests.conftest import require_criu
from tests.jobs.harness import Harness, reference, workload
from tests.slurm.cluster import ACTIVE, SlurmCluster, installed

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

SCRIPT = workload("ddp_basic")
SRC = Path(cryosleep.__file__).resolve().parents[1]  # the tree under test
BIN = Path(sys.executable).parent  # the virtualenv's cryosleep
LONG = ["--steps", "400", "--step-sleep", "0.15"]  # a minute or more: Slurm's signals come up to 40 s late
SHORT = ["--steps", "60", "--step-sleep", "0.1"]
# KillWait, and --grace under it (generous: a stop snapshot of this job took 23 s on a loaded 2-core machine)
KILL_WAIT_S = 60


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    missing = installed()
    if missing:
        pytest.fail(f"Slurm is not installed ({missing} missing): run `make slurm`")
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), kill_wait=KILL_WAIT_S, grace_time=5)
    c.start()
    yield c
    c.stop()
    assert not c.step_pids(), "a job step outlived the cluster"


@pytest.fixture
def h(cryo_home: Path, cluster: SlurmCluster) -> Iterator[Harness]:
    require_criu()
    yield Harness(cryo_home)
    cluster.cancel_all()
    cluster.wait(lambda: not cluster.jobs(ACTIVE), 120, "the test's jobs to end")


def batch_script(tmp_path: Path, name: str, args: list[str], grace: str = "50s") -> Path:
    """The user's batch script: the environment, then `exec cryosleep run` (the agent is the batch step)."""
    p = tmp_path / f"{name}.sbatch"
    p.write_text("#!/bin/bash\n"
                 f"export PATH={BIN}:$PATH PYTHONPATH={SRC}\n"
                 f"exec cryosleep run --grace {grace} --nproc-per-node 2 --name {name} {SCRIPT} {' '.join(args)}\n")
    return p


def submit(c: SlurmCluster, tmp_path: Path, script: Path, *flags: str) -> int:
    return c.sbatch("--chdir", str(tmp_path), "-o", str(tmp_path / "%x-%j.out"), "--open-mode=append",
                    "-J", script.stem, "-c", c.cpus, *flags, str(script))


def wait_step(h: Harness, name: str, step: int) -> None:
    """The batch job's agent has started the job (Slurm starts it when it likes) and it reached ``step``."""
    end = time.monotonic() + 240
    while not h.job(name).spec_file.exists():
        assert time.monotonic() < end, f"job {name} did not start in 240 s"
        time.sleep(0.2)
    h.wait_step(name, step, timeout=240)


def decisions(h: Harness, name: str) -> list[dict[str, Any]]:
    out = h.cli_json("decisions", name, check=False)  # the job may not have started yet
    return out if isinstance(out, list) else []


def wait_decision(h: Harness, name: str, trigger: str, timeout: float = 240) -> dict[str, Any]:
    """The job's last decision on ``trigger`` once its outcome is known."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = [d for d in decisions(h, name) if d.get("trigger") == trigger and d.get("outcome") != "unknown"]
        if got:
            return got[-1]
        time.sleep(0.5)
    raise AssertionError(f"no {trigger} decision of job {name} in {timeout:g} s: {decisions(h, name)}")


def assert_stopped(h: Harness, name: str, trigger: str) -> dict[str, Any]:
    d = wait_decision(h, name, trigger)
    assert d["mode"] == "stop" and d["action"] == "snapshot" and d["outcome"] == "suspended", d
    assert d["within_deadline"] is True, d
    assert h.cli_json("verify", d["snapshot"])["ok"]
    return d


def assert_resumed(h: Harness, c: SlurmCluster, jid: int, name: str, sid: str, args: list[str]) -> dict[str, str]:
    """The job's next run restored ``sid`` and ran to the end, identical to an uninterrupted run."""
    job = c.wait_job(jid, lambda j: j["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
                     "to end after its resumed run", timeout=400)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", job
    st = h.job(name).read()[1]
    assert st.state == "exited" and st.restored_from == sid, st  # the batch output (-o) says what the agent did
    ref = reference(SCRIPT, args)
    for r in (0, 1):
        assert h.losses(name, r) == ref[r], f"rank {r} differs from the uninterrupted run"
    return job


def test_time_limit_signal_stops_requeues_and_the_same_script_resumes(cluster: SlurmCluster, h: Harness,
                                                                     tmp_path: Path) -> None:
    script = batch_script(tmp_path, "limit", LONG)
    jid = submit(cluster, tmp_path, script, "--time=2", "--signal=B:USR1@110", "--requeue")
    job = cluster.wait_job(jid, lambda j: j["Restarts"] == "1", "to be requeued", timeout=300)
    # The requeued run gets a fresh time limit, and its warning 10 s in; give it room to finish instead (Slurm holds
    # a requeued job for cred_expire, 10 s here: time enough to change it while it waits).
    cluster.scontrol("update", f"JobId={jid}", "TimeLimit=10")
    assert job["Requeue"] == "1"
    d = assert_stopped(h, "limit", "sigusr1")
    assert d["detail"].startswith("SIGUSR1 received"), d
    s = wait_decision(h, "limit", "slurm")
    assert s["action"] == "requeue" and s["outcome"] == "requeued", s
    assert s["slurm"]["job_id"] == str(jid) and s["slurm"]["requeue"] is True, s
    assert_resumed(h, cluster, jid, "limit", d["snapshot"], LONG)


def test_preemption_stops_within_kill_wait_and_resumes_after_the_preemptor(cluster: SlurmCluster, h: Harness,
                                                                          tmp_path: Path) -> None:
    script = batch_script(tmp_path, "low", LONG)
    jid = submit(cluster, tmp_path, script, "--requeue")
    wait_step(h, "low", 5)
    hi = cluster.sbatch("-p", "high", "-c", cluster.cpus, "-o", str(tmp_path / "high-%j.out"), "--wrap", "sleep 3")
    # GraceTime later (at slurmctld's next periodic pass), SIGTERM to every process of the job, SIGKILL KillWait on
    d = assert_stopped(h, "low", "sigterm")
    assert d["ended_at"] - d["at"] < KILL_WAIT_S, "the stop snapshot did not end before Slurm's SIGKILL"
    s = wait_decision(h, "low", "slurm")
    assert s["action"] == "no-requeue" and s["outcome"] == "not-requeued", s  # Slurm requeues it (PreemptMode)
    high = cluster.wait_job(hi, lambda j: j["JobState"] == "COMPLETED", "the preemptor to complete", timeout=300)
    job = assert_resumed(h, cluster, jid, "low", d["snapshot"], LONG)
    assert job["Restarts"] == "1" and job["StartTime"] >= high["EndTime"], (job, high)


def test_scancel_stops_within_grace_and_a_new_sbatch_resumes(cluster: SlurmCluster, h: Harness,
                                                            tmp_path: Path) -> None:
    script = batch_script(tmp_path, "cancel", SHORT)  # --grace under KillWait
    jid = submit(cluster, tmp_path, script, "--requeue")
    wait_step(h, "cancel", 5)
    cluster.cmd("scancel", str(jid))
    d = assert_stopped(h, "cancel", "sigterm")
    s = wait_decision(h, "cancel", "slurm")
    assert s["action"] == "no-requeue" and s["outcome"] == "not-requeued", s
    job = cluster.wait_job(jid, lambda j: j["JobState"] == "CANCELLED", "to be cancelled")
    assert job["Restarts"] == "0", job
    again = submit(cluster, tmp_path, script)
    assert_resumed(h, cluster, again, "cancel", d["snapshot"], SHORT)


def test_cluster_leaves_nothing_behind(tmp_path: Path) -> None:
    """A cluster of its own: started (node idle) and stopped, no daemon or step left, nothing outside its root."""
    missing = installed()
    if missing:
        pytest.fail(f"Slurm is not installed ({missing} missing): run `make slurm`")
    c = SlurmCluster(tmp_path / "c")
    c.start()
    procs = list(c.procs.values())
    assert c.node_state() == "idle" and len(procs) == 3
    c.stop()
    assert not c.procs and not c.step_pids() and all(p.returncode is not None for p in procs)
    shutil.rmtree(tmp_path / "c")
