"""The same launch line resumes (agent/resume.py): real jobs, real CRIU, losses compared with an uninterrupted run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cryosleep.triggers import decisions
from tests.jobs.harness import Harness, assert_identical, workload

pytestmark = pytest.mark.slow

ARGS = ["--steps", "40", "--step-sleep", "0.05"]
SCRIPT = workload("ddp_basic")


def line(*extra: str, args: list[str] = ARGS) -> list[str]:
    """The job's launch line, as a batch script or a pod would repeat it."""
    return ["run", "--json", "--detach", "--name", "rs", "--nproc-per-node", "2", *extra, str(SCRIPT), *args]


def suspend(h: Harness, *extra: str) -> str:
    h.cli(*line(*extra))
    h.wait_step("rs", 10)
    sid: str = h.snapshot("rs", "--stop")["snapshot"]
    assert h.wait_end("rs") == 75 and h.state("rs") == "suspended"
    return sid


def launches(h: Harness) -> list[dict[str, object]]:
    return [d for d in decisions.load(decisions.path_for(h.job("rs").path)) if d.get("trigger") == "launch"]


def test_the_same_line_resumes_a_suspended_job_and_refuses_another_command(h: Harness) -> None:
    sid = suspend(h)
    # another command of the same job: refused, naming the snapshot; nothing starts
    other = h.cli(*line(args=["--steps", "41", "--step-sleep", "0.05"]), check=False)
    assert other.returncode != 0
    err = json.loads(other.stdout)
    assert err["error"] == "not_eligible" and sid in err["what"] and "41" in err["why"] and "--fresh" in err["hint"]
    assert h.state("rs") == "suspended"
    # two launches of the same line at once (a pod and its replacement): exactly one resumes it
    procs = [subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", *line()], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=h.env) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes[0] == 0 and codes[1] != 0, outs
    won = json.loads(next(o for o, _ in outs if '"resumed": true' in o))
    lost = json.loads(next(o for o, _ in outs if '"error"' in o))
    assert won["snapshot"] == sid and "already running" in lost["what"]
    assert h.wait_end("rs") == 0
    assert_identical(h, "rs", SCRIPT, ARGS, [0, 1])
    got = launches(h)
    assert [d["action"] for d in got] == ["fresh", "refuse", "restore"], got
    assert got[2]["snapshot"] == sid and "suspended in snapshot" in str(got[2]["reasons"])
    # it ended: the same line now starts anew
    h.cli(*line())
    assert launches(h)[-1]["action"] == "fresh"
    assert h.wait_end("rs") == 0


def test_fresh_starts_anew_and_leaves_the_snapshot(h: Harness) -> None:
    sid = suspend(h)
    res = h.cli(*line("--fresh"))
    assert json.loads(res.stdout)["restored_from"] is None
    assert h.wait_end("rs") == 0
    assert_identical(h, "rs", SCRIPT, ARGS, [0, 1])  # from step 0: a fresh run's log starts over
    assert launches(h)[-1]["action"] == "fresh"
    assert sid in [s["snapshot"] for s in h.ls()]


def test_resume_latest_after_everything_was_killed(h: Harness) -> None:
    h.cli(*line())
    h.wait_step("rs", 8)
    kept = h.snapshot("rs")["snapshot"]
    h.wait_step("rs", 14)
    h.kill_all("rs")
    assert h.state("rs") == "lost"
    res = h.cli(*line("--resume", "latest"))
    assert json.loads(res.stdout)["snapshot"] == kept
    assert h.wait_end("rs") == 0
    assert_identical(h, "rs", SCRIPT, ARGS, [0, 1])
    assert launches(h)[-1]["action"] == "restore" and "--resume latest" in str(launches(h)[-1]["reasons"])


def test_a_new_machine_with_only_the_store_resumes(h: Harness, tmp_path: Path) -> None:
    chunks = tmp_path / "chunks"
    sid = suspend(h, "--store", str(chunks))
    # another machine: nothing of the job's record or the local store, the chunk store alone (same paths: the
    # restored workers' logs come back where they were)
    shutil.rmtree(h.job("rs").path)
    shutil.rmtree(h.env["CRYOSLEEP_STORE"])
    res = h.cli(*line("--store", str(chunks)))
    out = json.loads(res.stdout)
    assert out["snapshot"] == sid and out["resumed"] is True
    assert h.wait_end("rs") == 0
    assert_identical(h, "rs", SCRIPT, ARGS, [0, 1])
    deadline = time.monotonic() + 30  # the record says it ended, so a third machine would start anew
    while time.monotonic() < deadline:
        rec = json.loads((chunks / "cas" / "jobs" / "rs.json").read_text())
        if rec["state"] == "ended":
            break
        time.sleep(0.1)
    assert rec["state"] == "ended", rec


def test_the_kubelet_signal_sequence_ends_suspended_and_the_replacement_pod_resumes(h: Harness) -> None:
    """A pod's container contract: SIGTERM to the agent (the container's PID 1 runs `cryosleep run` in the
    foreground), SIGKILL once terminationGracePeriodSeconds have passed; then the Job's next pod runs the same
    command. Reproduced here without a container runtime: the same signals, at the same times."""
    grace_period = 120.0  # generous: the test is of the sequence, not of the snapshot's speed on a loaded machine
    cmd = [sys.executable, "-m", "cryosleep.cli.main", "run", "--name", "rs", "--nproc-per-node", "2", "--grace",
           "100s", str(SCRIPT), *ARGS]
    err = (h.home / "pod.err").open("w")
    pod = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, env=h.env)
    deadline = time.monotonic() + 120
    while not h.job("rs").exists():  # the agent records the job as it starts it
        assert pod.poll() is None and time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)
    h.wait_step("rs", 10)
    pod.send_signal(15)  # the kubelet: SIGTERM (no preStop hook)
    try:
        code = pod.wait(timeout=grace_period)
    except subprocess.TimeoutExpired:
        pod.kill()  # the kubelet: SIGKILL at the end of the grace period
        raise AssertionError("the agent was still running at the end of the pod's grace period") from None
    assert code == 75, (h.home / "pod.err").read_text()[-3000:]
    assert h.state("rs") == "suspended"
    replacement = subprocess.run(cmd, capture_output=True, text=True, env=h.env, timeout=300, check=False)
    assert replacement.returncode == 0, replacement.stderr[-3000:]
    assert "resuming from snapshot" in replacement.stderr
    assert_identical(h, "rs", SCRIPT, ARGS, [0, 1])


@pytest.mark.extended  # two runs of the job, a stop snapshot and a restore: the extended tier (CI runs it)
def test_a_replacement_on_another_machine_waits_for_the_stop_snapshot_then_resumes(h: Harness,
                                                                                    tmp_path: Path) -> None:
    """A pod's replacement on another node starts while the old pod still runs (a Job's default replacement
    policy): it must not run the job beside it. Machine B has its own Cryosleep home and its own host name (a UTS
    namespace of its own); the two share only the store and the platform's signing key."""
    chunks, hold = tmp_path / "chunks", tmp_path / "hold"
    args = [*ARGS, "--hold", str(hold), "--hold-at", "12"]  # machine A's run waits at step 12 for its stop snapshot
    h.env["CRYOSLEEP_SIGN_KEY"] = "5a" * 32
    h.cli(*line("--store", str(chunks), args=args))
    h.wait_step("rs", 10)
    b_home = tmp_path / "b"
    (b_home / "home").mkdir(parents=True)
    b_env = {**h.env, "CRYOSLEEP_HOME": str(b_home / "home"), "CRYOSLEEP_STORE": str(b_home / "store")}
    b_err = b_home / "launch.err"
    with b_err.open("w") as err:
        b = subprocess.Popen(["unshare", "--uts", "sh", "-c", 'hostname machine-b && exec "$@"', "sh", sys.executable,
                              "-m", "cryosleep.cli.main", "run", "--name", "rs", "--nproc-per-node", "2", "--store",
                              str(chunks), "--wait-previous", "240", str(SCRIPT), *args],
                             stdout=subprocess.DEVNULL, stderr=err, env=b_env)
    try:
        deadline = time.monotonic() + 120
        while "waiting up to" not in b_err.read_text():
            assert b.poll() is None, b_err.read_text()[-3000:]
            assert time.monotonic() < deadline, "machine B never said it waits for machine A's run"
            time.sleep(0.2)
        assert "resuming" not in b_err.read_text() and "starting anew" not in b_err.read_text()
        sid = h.snapshot("rs", "--stop")["snapshot"]  # machine A's node is drained: its stop snapshot
        assert h.wait_end("rs") == 75
        hold.touch()
        assert b.wait(timeout=300) == 0, b_err.read_text()[-3000:]
    finally:
        if b.poll() is None:
            b.kill()
    said = b_err.read_text()
    assert f"resuming from snapshot {sid}" in said, said[-3000:]
    assert_identical(h, "rs", SCRIPT, args, [0, 1])
    rec = json.loads((chunks / "cas" / "jobs" / "rs.json").read_text())
    assert rec["state"] == "ended" and rec["host"] == "machine-b", rec


def test_a_run_whose_claim_was_taken_ends_so_that_the_job_runs_once(h: Harness, tmp_path: Path) -> None:
    """Another machine took the job's record (this run's lease lapsed while the store was out of reach, say): at
    its next heartbeat the agent sees it and ends its own run; the taker's record is not written over."""
    chunks = tmp_path / "chunks"
    h.cli(*line("--store", str(chunks), args=["--steps", "100000", "--step-sleep", "0.05"]))
    h.wait_step("rs", 3)
    path = chunks / "cas" / "jobs" / "rs.json"
    ours = json.loads(path.read_text())
    assert ours["state"] == "running" and ours["run"]
    taker = {**ours, "run": "taker", "host": "machine-x", "at": time.time()}
    path.write_text(json.dumps(taker))
    assert h.wait_end("rs", timeout=120) != 0
    assert h.state("rs") == "failed"
    _, st = h.job("rs").read()
    assert "taken by another run (taker on machine-x" in st.detail, st.detail
    assert json.loads(path.read_text())["run"] == "taker"
