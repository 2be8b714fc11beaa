"""Least privilege (core/privileges.py, docs/security.md): a real job run, stopped by a snapshot and restored with
only the documented capabilities (root, its bounding set cut down to them by setpriv), continuing bit for bit;
its directory, record, socket and logs readable by their owner only (another user reaches none of them); with
one capability less, `check`, `run` and `restore` each refuse up front and say which one is missing."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cryosleep.core import privileges
from tests.jobs.harness import Harness, assert_identical, workload

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # minutes: the extended tier (CI runs it)

ARGS = ["--steps", "16", "--step-sleep", "0.05"]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]


def bounded(caps: frozenset[str]) -> list[str]:
    """A prefix that runs a command as root with only ``caps`` (the rest dropped from the bounding set)."""
    return ["setpriv", "--bounding-set=-all," + ",".join(f"+{c}" for c in sorted(caps)), "--"]


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_snapshot_and_restore_with_only_the_documented_capabilities(cryo_home: Path, h: Harness,
                                                                    tmp_path: Path) -> None:
    caps = privileges.SNAPSHOT | privileges.RESTORE
    lim = Harness(cryo_home, prefix=bounded(caps))
    hold = tmp_path / "go"
    args = [*ARGS, "--hold", str(hold), "--hold-at", "8"]
    script = workload("ddp_basic")
    lim.run("least", script, args)
    lim.wait_step("least", 2, timeout=600)
    job = lim.job("least")
    _, st = job.read()
    assert privileges.effective(st.agent_pid) == caps  # the agent really runs with only these
    assert _mode(job.path) == 0o700 and _mode(job.spec_file) == 0o600 and _mode(job.socket) == 0o600
    assert _mode(job.logs) == 0o700
    for target in (job.spec_file, job.rank_log(0)):  # another user: neither the record nor the logs
        got = subprocess.run([*NOBODY, "cat", str(target)], capture_output=True, text=True, check=False)
        assert got.returncode != 0 and "Permission denied" in got.stderr, got
    probe = ("import socket,sys; s=socket.socket(socket.AF_UNIX); "
             f"s.connect({str(job.socket)!r}); s.sendall(b'{{\"op\": \"snapshot\"}}\\n'); print(s.recv(99))")
    got = subprocess.run([*NOBODY, sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert got.returncode != 0 and "PermissionError" in got.stderr, got  # nor command its agent
    stop = lim.snapshot("least", "--stop")
    assert lim.wait_end("least") == 75, job.read()[1].detail
    hold.touch()
    lim.restore(stop["snapshot"])
    _, st = job.read()
    assert privileges.effective(st.agent_pid) == caps
    assert lim.wait_end("least") == 0, job.read()[1].detail
    assert_identical(h, "least", script, args, [0, 1])

    # one capability less: refused up front by `check`, `run` and `restore`, naming it; nothing started
    short = Harness(cryo_home, prefix=bounded(caps - {"net_admin"}))
    rows = {c["name"]: c for c in short.cli_json("check", check=False)["checks"]}
    assert not rows["capabilities (restore)"]["ok"] and "CAP_NET_ADMIN" in rows["capabilities (restore)"]["detail"]
    for cmd in (["restore", "--detach", "--json", stop["snapshot"]],
                ["run", "--detach", "--json", "--name", "short", "--nproc-per-node", "1", str(script), *ARGS]):
        got = short.cli(*cmd, check=False)
        assert got.returncode != 0, got
        err = json.loads(got.stdout)
        assert err["error"] == "not_eligible" and "CAP_NET_ADMIN" in err["why"], err
    assert not h.job("short").exists()
    assert not h.job("least").agent_alive()
