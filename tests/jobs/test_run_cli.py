"""`cryosleep run` in the foreground, as a drop-in for torchrun: output prefixed by rank, torchrun's
environment, the job's exit code, a job record afterwards."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.jobs.harness import Harness, workload


def run_fg(h: Harness, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cryosleep.cli.main", "run", *args], capture_output=True,
                          text=True, env=h.env, timeout=120, check=False)


def test_foreground_run_streams_ranks_and_returns_the_exit_code(h: Harness) -> None:
    ok = run_fg(h, "--nproc-per-node", "2", "--master-port", "29411", "--name", "fg", str(workload("exit_code")),
                "0")
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert "[rank0]: hello from rank 0 of 2 (local 0)" in lines
    assert "[rank1]: hello from rank 1 of 2 (local 1)" in lines
    assert "[rank1]: libuv 0 master 127.0.0.1:29411" in lines
    assert h.state("fg") == "exited"

    bad = run_fg(h, "--nproc-per-node", "2", "--name", "fg", str(workload("exit_code")), "3")
    assert bad.returncode == 1  # as torchrun: the worker's own code is in the report and the job's record
    assert "failed with exit code 3" in bad.stderr and "rank 1: exit 3" in bad.stderr
    assert "rank      : 1 (local_rank: 1)" in bad.stderr and "exitcode  : 3" in bad.stderr
    jobs = json.loads(h.cli("jobs", "--json").stdout)
    assert [(j["job"], j["state"], j["exit_code"]) for j in jobs] == [("fg", "failed", 3)]
    assert h.job("fg").rank_log(1).read_text().startswith("hello from rank 1")


def test_a_second_job_with_the_same_name_is_refused(h: Harness) -> None:
    h.run("twice", workload("ddp_basic"), ["--steps", "30", "--step-sleep", "0.05"])
    res = run_fg(h, "--json", "--name", "twice", str(workload("exit_code")), "0")
    assert res.returncode == 2 and "already running" in res.stdout
    assert h.wait_end("twice") == 0


@pytest.mark.parametrize(("sig", "listed"), [(signal.SIGUSR2, "SIGTERM,SIGUSR2"), (signal.SIGINT, "SIGTERM")])
def test_signals_reach_the_workers_as_under_torchrun(h: Harness, sig: signal.Signals, listed: str) -> None:
    """--signals-to-handle: the agent passes the signal itself on to the workers, as torchrun does."""
    name = f"sig-{sig.name.lower()}"
    p = subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "run", "--signals-to-handle", listed,
                          "--name", name, str(workload("signals"))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=h.env)
    try:
        end = time.monotonic() + 120
        log = h.job(name).rank_log(0)
        while not (log.exists() and log.read_text().startswith("ready")):
            assert p.poll() is None and time.monotonic() < end, p.communicate()
            time.sleep(0.05)
        p.send_signal(sig)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert f"[rank0]: ready {listed}" in out and f"[rank0]: got {sig.name}" in out
