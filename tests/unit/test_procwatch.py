"""procwatch.JobExits, the agent's watch on its job's processes between snapshots, and the snapshot's rule on
what it saw (capture/snapshot.py ``settle``): a process of the job killed just before a snapshot makes it wait,
then go on if the job survived it, or refuse if the job ended (chaos seed 1002)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryosleep.capture import snapshot
from cryosleep.core import proctree, procwatch
from cryosleep.core.job import JobSpec
from cryosleep.errors import CaptureFailed, NotEligible
from cryosleep.store.local import LocalStore

ROOT = os.geteuid() == 0


def _tree(tmp_path: Path, script: str) -> subprocess.Popen[str]:
    """A shell standing for a sandbox's init: it runs ``script`` (its children stand for workers, theirs for a
    worker's helpers), gated on FIFOs so that nothing happens before the watch has started."""
    return subprocess.Popen(["sh", "-c", script], cwd=tmp_path, text=True)


def _open(fifo: Path) -> None:
    fd = os.open(fifo, os.O_WRONLY)  # waits for the shell's `read` to open it
    os.write(fd, b"go\n")
    os.close(fd)


def _wait_for(watch: procwatch.JobExits, n: int, timeout: float = 10.0) -> list[procwatch.Exit]:
    deadline = time.monotonic() + timeout
    while len(got := watch.since(0.0)) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


@pytest.fixture(params=["connector", "pidfd"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "connector" and not ROOT:
        pytest.skip("the kernel's process events need CAP_NET_ADMIN")
    if request.param == "pidfd":  # as where the connector cannot be opened
        def refused() -> None:
            raise PermissionError(1, "Operation not permitted")
        monkeypatch.setattr(procwatch, "_subscribe", refused)
    yield request.param


def test_a_killed_descendant_reaped_by_its_parent_is_seen_with_how_it_ended(tmp_path: Path, mode: str) -> None:
    """The seed-1002 shape: a worker's child SIGKILLed and reaped at once by the worker (here a subshell's
    `wait`); a sibling that exits 0 is churn; the worker failing is the job's own."""
    for name in ("kill", "fail", "clean"):
        os.mkfifo(tmp_path / name)
    init = _tree(tmp_path, "( (read _ < clean; exit 0) & sleep 30 & echo $! > victim; wait; "
                           "read _ < fail; exit 3 ) & wait")
    watch = procwatch.JobExits(init.pid).start()
    try:
        assert watch.mode == mode
        deadline = time.monotonic() + 10
        while not (tmp_path / "victim").exists() or not (tmp_path / "victim").read_text().strip():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        victim = int((tmp_path / "victim").read_text())
        time.sleep(procwatch.POLL_S * 2)  # the fallback's refresh has seen the victim
        before = time.monotonic()
        _open(tmp_path / "clean")
        os.kill(victim, signal.SIGKILL)
        time.sleep(procwatch.POLL_S * 2)
        _open(tmp_path / "fail")
        got = _wait_for(watch, 4)
        init.wait(10)
        by_pid = {e.pid: e for e in got}
        assert not os.path.exists(f"/proc/{victim}")  # reaped by its parent, not by us
        assert by_pid[victim].status == 9 and by_pid[victim].role == "" and by_pid[victim].at >= before
        failed = [e for e in got if e.failed]
        assert [e.status for e in failed] == [9, 3 << 8]
        assert failed[-1].role == "worker"
        assert "killed by signal 9" in by_pid[victim].describe(time.monotonic())
        assert watch.since(time.monotonic() + 1) == []
    finally:
        init.kill()
        init.wait()
        watch.close()
    assert watch.mode == "off"


@pytest.mark.skipif(not ROOT, reason="the kernel's process events need CAP_NET_ADMIN")
def test_the_connector_sees_a_process_too_short_lived_for_any_poll(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "go")
    init = _tree(tmp_path, "read _ < go; sh -c 'exit 5'; sleep 30")
    watch = procwatch.JobExits(init.pid).start()
    try:
        assert watch.mode == "connector"
        _open(tmp_path / "go")
        got = _wait_for(watch, 1)
        assert [(e.status, e.role) for e in got] == [(5 << 8, "worker")]
    finally:
        init.kill()
        init.wait()
        watch.close()


def test_the_rule_waits_out_a_recent_kill_then_goes_and_refuses_a_job_that_ended() -> None:
    killed = procwatch.Exit(19, 9, 100.0, "")
    assert snapshot.settle_verdict(100.4, [killed], True) == ("wait", 100.0 + snapshot.SETTLE_S)
    assert snapshot.settle_verdict(100.0 + snapshot.SETTLE_S, [killed], True)[0] == "go"
    assert snapshot.settle_verdict(100.4, [], True) == ("go", 100.4)
    rank = procwatch.Exit(12, 1 << 8, 101.0, "worker")
    assert snapshot.settle_verdict(101.2, [killed, rank], True) == ("ended", 101.2)
    assert snapshot.settle_verdict(101.2, [], False) == ("ended", 101.2)
    assert not procwatch.Exit(20, 0, 100.0, "").failed  # a helper exiting 0 is churn
    assert procwatch.Exit(0, None, 100.0, "").failed  # events lost: maybe a kill


class _Exits:
    """The agent's watch as the snapshot sees it, fed by the test."""

    def __init__(self) -> None:
        self.exits: list[procwatch.Exit] = []

    def since(self, t: float) -> list[procwatch.Exit]:
        return [e for e in self.exits if e.at >= t]


def _capture(tmp_path: Path, init: int, exits: _Exits, deadline_s: float = 60.0) -> snapshot.NodeCapture:
    spec = JobSpec(name="j", program=["x"], cwd="/", env={}, nproc_per_node=1)
    target = snapshot.Target(spec=spec, init_pid=init, exits=exits.since)
    return snapshot.NodeCapture(target, LocalStore(tmp_path / "store"), stop=False,
                                deadline=time.monotonic() + deadline_s)


@pytest.fixture
def short_window(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(snapshot, "SETTLE_S", 0.5)
    return 0.5


def test_a_snapshot_waits_until_the_job_survived_a_kill(tmp_path: Path, short_window: float) -> None:
    init = subprocess.Popen(["sleep", "30"])
    exits = _Exits()
    try:
        killed_at = time.monotonic()
        exits.exits.append(procwatch.Exit(19, 9, killed_at, ""))
        cap = _capture(tmp_path, init.pid, exits)
        cap.settle()
        assert time.monotonic() >= killed_at + short_window
        assert cap.phases.durations["settle"] > 0
    finally:
        init.kill()
        init.wait()


def test_a_snapshot_refuses_a_job_that_fails_while_it_waits(tmp_path: Path, short_window: float) -> None:
    init = subprocess.Popen(["sleep", "30"])
    exits = _Exits()
    try:
        now = time.monotonic()
        exits.exits.append(procwatch.Exit(19, 9, now, ""))
        exits.exits.append(procwatch.Exit(12, 1 << 8, now + 0.2, "worker"))  # its rank raised, a moment later
        with pytest.raises(CaptureFailed) as e:
            _capture(tmp_path, init.pid, exits).settle()
        assert isinstance(e.value, snapshot.JobEnding)
        assert "is failing" in e.value.what and "process 19 killed by signal 9" in e.value.why
        assert "last snapshot is still valid" in e.value.hint
    finally:
        init.kill()
        init.wait()


def test_a_snapshot_whose_deadline_comes_first_is_refused_untouched(tmp_path: Path) -> None:
    init = subprocess.Popen(["sleep", "30"])
    exits = _Exits()
    try:
        exits.exits.append(procwatch.Exit(19, 9, time.monotonic(), ""))
        start = time.monotonic()
        with pytest.raises(NotEligible) as e:
            _capture(tmp_path, init.pid, exits, deadline_s=2.0).settle()
        assert time.monotonic() - start < 1.0  # refused at once, not at the deadline
        assert "just killed" in e.value.what and "deadline comes first" in e.value.why
        assert "not touched" in e.value.hint
    finally:
        init.kill()
        init.wait()


def test_a_helper_killed_long_ago_or_exiting_0_does_not_delay_a_snapshot(tmp_path: Path) -> None:
    init = subprocess.Popen(["sleep", "30"])
    exits = _Exits()
    try:
        now = time.monotonic()
        exits.exits += [procwatch.Exit(19, 9, now - snapshot.SETTLE_S - 1, ""), procwatch.Exit(20, 0, now, "")]
        start = time.monotonic()
        _capture(tmp_path, init.pid, exits).settle()
        assert time.monotonic() - start < 0.5
    finally:
        init.kill()
        init.wait()


def test_probation_keeps_an_image_only_if_the_job_outlives_the_dump(tmp_path: Path, short_window: float) -> None:
    init = subprocess.Popen(["sleep", "30"])
    worker = subprocess.Popen(["sleep", "30"])
    try:
        cap = _capture(tmp_path, init.pid, _Exits())
        cap.watch, cap.own = proctree.Watch([init.pid, worker.pid]), {init.pid, worker.pid}
        cap.dumped_at = time.monotonic()
        cap.probation()  # the job ran on for the window: kept
        assert time.monotonic() >= cap.dumped_at + short_window
        cap.dumped_at = time.monotonic()
        threading.Timer(0.2, worker.kill).start()  # the rank that noticed its dead worker at the dump
        with pytest.raises(snapshot.JobEnding) as e:
            cap.probation()
        assert "failed right after the snapshot" in e.value.what
        assert f"process {worker.pid} killed by signal 9" in e.value.why and "still valid" in e.value.hint
        assert time.monotonic() < cap.dumped_at + short_window + 0.3
        cap.watch.close()
    finally:
        for p in (init, worker):
            p.kill()
            p.wait()
