"""The three ways a dump's CRIU or agent dying at an unscripted moment used to harm a job (issue 22), each with a
real job, real CRIU and real gloo DDP: the agent SIGKILLed while CRIU dumps (its network lock stayed on the
host and hung the restore), CRIU SIGKILLed mid-dump (the job was resumed under the lock and died), CRIU
SIGKILLed at its start (a helper it forked stayed stopped, holding the dump's wait for 600 s); and CRIU and the
agent out of the OOM killer's way, the job keeping its own oom_score_adj and limits. bench/chaos.py puts the same
victims (and more) through random moments."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cryosleep.capture import criu
from cryosleep.core import oom
from tests.conftest import require_criu
from tests.jobs.coordinated import wait_for
from tests.jobs.harness import (
    Harness,
    criu_dumps,
    criu_restores,
    in_post_dump,
    lock_tables,
    reference,
    tables_of,
    workload,
)

pytestmark = pytest.mark.slow

SCRIPT = workload("ddp_basic")
ARGS = ["--steps", "300", "--step-sleep", "0.05"]


def store() -> Path:
    return Path(os.environ["CRYOSLEEP_STORE"])


def assert_identical(h: Harness, name: str) -> None:
    ref = reference(SCRIPT, ARGS)
    for r in (0, 1):
        assert h.losses(name, r) == ref[r], f"rank {r} differs from the uninterrupted run"


def hanging_snapshot(h: Harness, name: str, *extra: str) -> subprocess.Popen[str]:
    """A snapshot whose post-dump hook hangs (the tree frozen under CRIU's lock, its sockets in repair mode)."""
    env = dict(h.env, CRYOSLEEP_FAULT="capture-hang")
    return subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "snapshot", "--json", name, "--timeout",
                             "300", *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def dump_log() -> Path:
    return next((store() / ".staging").glob("*/nodes/0/dump.log"))


def criu_group_left(pgid: int) -> list[int]:
    """Processes still in CRIU's process group (what it forked)."""
    left = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid:
                    left.append(int(d))
            except ProcessLookupError:
                pass
    return left


@pytest.mark.parametrize("mode", ["keep-running", "stop"])
def test_agent_killed_mid_dump_leaves_no_lock_and_the_last_snapshot_restores(h: Harness, mode: str) -> None:
    name = f"akill-{mode}"
    h.run(name, SCRIPT, ARGS)
    h.wait_step(name, 5, timeout=300)
    last = h.snapshot(name)["snapshot"]  # the last verified snapshot
    snap = hanging_snapshot(h, name, *(["--stop"] if mode == "stop" else []))
    wait_for(lambda: in_post_dump(store()), 300, "the dump's post-dump hook")
    log = dump_log()
    rid = criu.run_id(log)
    assert tables_of(log), f"CRIU run {rid} holds no network lock on the host: the test would prove nothing"
    agent = h.job(name).read()[1].agent_pid
    os.kill(agent, signal.SIGKILL)
    snap.communicate(timeout=120)
    # its watchdog kills the sandbox, ends CRIU, removes the lock table and the staging
    wait_for(lambda: h.state(name) == "lost" and not h.pids(name), 60, "the sandbox's end")
    wait_for(lambda: not [t for t in lock_tables() if rid and t.split()[1][5:] in rid], 60, "the lock's removal")
    wait_for(lambda: not criu_dumps(store()), 60, "the end of the dead agent's CRIU")
    wait_for(lambda: not any((store() / ".staging").iterdir()), 60, "the staging's removal")
    h.restore(last)
    assert h.wait_end(name, timeout=600) == 0
    assert_identical(h, name)


def test_criu_killed_mid_dump_leaves_the_job_running(h: Harness) -> None:
    # The ranks train on without a pause (no --hold-at): whatever each was doing when CRIU froze it (a rank is
    # often inside a gloo collective, reading its socket), the kernel puts it back in the group stop the agent
    # put it in before the dump the moment CRIU dies, not back to a read on a socket still in TCP repair mode
    # (EPERM: how both ranks were lost before); the agent undoes the repair mode and the lock, then continues
    # them, and both ranks train on over the very connections CRIU had locked.
    name = "ckill"
    h.run(name, SCRIPT, ARGS)
    h.wait_step(name, 5, timeout=300)
    snap = hanging_snapshot(h, name)
    wait_for(lambda: in_post_dump(store()), 300, "the dump's post-dump hook")
    log = dump_log()
    assert tables_of(log)
    (pid,) = criu_dumps(store())  # CRIU itself, not its hook
    os.kill(pid, signal.SIGKILL)
    out, _ = snap.communicate(timeout=120)
    err = json.loads(out)
    assert err["error"] == "capture_failed" and "CRIU was killed (SIGKILL)" in err["what"], err
    assert "goes on running" in err["why"] and "exited" not in err["what"], err
    assert h.state(name) == "running"
    assert not tables_of(log) and not criu_group_left(pid), "the killed CRIU left its lock or its helpers"
    at = len(h.losses(name))
    assert h.snapshot(name)["mode"] == "keep-running"  # the next snapshot starts at once and succeeds
    assert h.wait_end(name, timeout=600) == 0
    assert len(h.losses(name)) > at
    assert_identical(h, name)


def test_criu_killed_at_its_start_the_next_snapshot_starts_at_once(h: Harness) -> None:
    name = "cstart"
    h.run(name, SCRIPT, ARGS)
    h.wait_step(name, 5, timeout=300)
    snap = subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "snapshot", "--json", name],
                            env=h.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    end = time.monotonic() + 300
    while not (found := criu_dumps(store())):  # polled tightly: the window is tens of milliseconds
        assert time.monotonic() < end, "CRIU did not start"
        time.sleep(0.002)
    time.sleep(0.04)  # within its first 30-50 ms, while it probes the kernel with helpers it forks and stops
    pid = found[0]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    out, _ = snap.communicate(timeout=120)
    assert time.monotonic() - t0 < 60, "the dump waited on a helper of the killed CRIU"
    assert json.loads(out)["error"] == "capture_failed", out
    assert not criu_group_left(pid), "a helper the killed CRIU forked is still there"
    assert h.state(name) == "running"
    t0 = time.monotonic()
    assert h.snapshot(name)["mode"] == "keep-running"
    assert time.monotonic() - t0 < 120
    assert h.wait_end(name, timeout=600) == 0
    assert_identical(h, name)


def _criu_seen(find: Callable[[], list[int]], proc: subprocess.Popen[str]) -> tuple[int, str]:
    """CRIU's oom_score_adj and open-files limit, read the moment it runs (not its shell wrapper before exec)."""
    end = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < end:
        for pid in find():
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() not in ("sh", "dash"):  # CRIU (or its loader)
                    limits = Path(f"/proc/{pid}/limits").read_text()
                    return oom.read(pid), next(ln for ln in limits.splitlines() if ln.startswith("Max open files"))
            except OSError:
                continue
        time.sleep(0.002)
    raise AssertionError("CRIU was not seen running")


def _criu_run_checked(h: Harness, lowest: int, find: Callable[[], list[int]], *args: str) -> Any:
    """``cryosleep ARGS --json``, its CRIU seen at the lowest oom_score_adj granted and with none of the ranks'
    limits; its answer."""
    proc = subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", args[0], "--json", *args[1:]], env=h.env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    adj, nofile = _criu_seen(find, proc)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert adj == lowest and " 200 " not in nofile, (adj, nofile)
    return json.loads(out)


def test_criu_and_the_agent_out_of_the_oom_killers_way_the_job_keeps_its_own(cryo_home: Path) -> None:
    # The job started as a best-effort container's is (oom_score_adj 500 for all it starts), its ranks with an
    # open-files limit of their own: the agent, its watchdog and CRIU (dump and restore) take the lowest value the
    # kernel grants (-1000; 0 on kernels that refuse negative values) and none of the ranks' limits; the ranks
    # keep theirs, across the restore too.
    require_criu()
    granted = subprocess.run(["/bin/sh", "-c", "echo -1000 > /proc/self/oom_score_adj"], capture_output=True,
                             check=False).returncode == 0
    lowest = oom.PROTECTED if granted else 0
    h = Harness(cryo_home, prefix=["/bin/sh", "-c", 'echo 500 > /proc/self/oom_score_adj && exec "$@"', "job"])
    name = "oom"
    h.run(name, SCRIPT, ARGS)
    h.wait_step(name, 5, timeout=300)
    st = h.job(name).read()[1]
    ranks = [p for p in h.pids(name) if p != st.init_pid]
    for p in ranks:
        resource.prlimit(p, resource.RLIMIT_NOFILE, (200, 200))
    assert {oom.read(p) for p in h.pids(name)} == {500}
    watchdogs = [p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
                 if b"cryosleep.agent.watchdog" in Path(f"/proc/{p}/cmdline").read_bytes()
                 and str(st.init_pid).encode() in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert watchdogs and {oom.read(st.agent_pid), *map(oom.read, watchdogs)} == {lowest}
    out = _criu_run_checked(h, lowest, lambda: criu_dumps(store()), "snapshot", "--stop", name)
    assert h.wait_end(name, timeout=300) == 75
    _criu_run_checked(h, lowest, lambda: criu_restores(store()), "restore", "--detach", out["snapshot"])
    st = h.job(name).read()[1]
    ranks = [p for p in h.pids(name) if p != st.init_pid]
    assert {oom.read(p) for p in h.pids(name)} == {500}, "the restored job lost its own oom_score_adj"
    assert {resource.prlimit(p, resource.RLIMIT_NOFILE) for p in ranks} == {(200, 200)}, "the ranks lost their limit"
    assert oom.read(st.agent_pid) == lowest
    assert h.wait_end(name, timeout=600) == 0
    assert_identical(h, name)
