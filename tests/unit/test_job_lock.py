"""A job's lock between two agents: a run or restore waits for an agent that is only ending (its job's processes
gone, as after a stop snapshot), and is refused at once by one whose job runs. Real processes hold the lock."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cryosleep.core.job import JobDir, JobSpec, JobState
from cryosleep.errors import UsageError

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


@pytest.fixture
def job(tmp_path: Path) -> JobDir:
    return JobDir("train", tmp_path)


@contextmanager
def hold(job: JobDir, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """Another agent: holds the job's lock for ``seconds``, then exits (the lock goes with it); killed on leaving
    the block at the latest."""
    job.path.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(job.lock_file), str(seconds)], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "locked\n"
        yield p
    finally:
        p.kill()
        p.wait()


@pytest.fixture
def init() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "600"])
    yield p
    p.kill()
    p.wait()


def record(job: JobDir, init_pid: int, state: str = "running", ending: bool = False) -> None:
    spec = JobSpec(name="train", program=["python3", "t.py"], cwd="/", env={}, nproc_per_node=1)
    job.write(spec, JobState(state=state, init_pid=init_pid, ending_since=time.time() if ending else None))


def gone_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_running_job_is_refused_at_once(job: JobDir, init: subprocess.Popen[bytes]) -> None:
    record(job, init.pid)
    with hold(job, 30):
        assert not job.agent_ending()
        start = time.monotonic()
        with pytest.raises(UsageError, match="already running"):
            job.take_lock(wait_ending=10)
        assert time.monotonic() - start < 1


def test_an_agent_that_is_ending_is_waited_for(job: JobDir) -> None:
    """Its record says running, its job's init is gone: the lock is taken once that agent exits (1 s)."""
    record(job, gone_pid())
    waits: list[float] = []
    with hold(job, 1.0) as holder:
        assert job.agent_ending()
        start = time.monotonic()
        fd = job.take_lock(wait_ending=20, on_wait=lambda: waits.append(time.monotonic()))
        assert 0.5 < time.monotonic() - start < 10
        assert holder.wait(5) == 0
    assert len(waits) == 1  # told once, as the wait began
    assert job.agent_alive()  # ours now
    os.close(fd)
    assert not job.agent_alive()


def test_an_agent_that_ended_its_job_is_waited_for_while_the_processes_still_exit(
        job: JobDir, init: subprocess.Popen[bytes]) -> None:
    """A stop snapshot's agent records ``ending_since`` as it kills the job: the sandbox's init is still there
    while the kernel tears down its workers (seconds for a GPU job's memory), and the lock is waited for."""
    record(job, init.pid, ending=True)
    with hold(job, 1.0):
        assert job.agent_ending()
        fd = job.take_lock(wait_ending=20)
        os.close(fd)


def test_an_agent_that_never_ends_is_refused_after_the_wait(job: JobDir) -> None:
    record(job, gone_pid())
    with hold(job, 30):
        start = time.monotonic()
        with pytest.raises(UsageError, match="still ending") as e:
            job.take_lock(wait_ending=0.5)
        assert 0.4 < time.monotonic() - start < 5
        assert "cryosleep jobs" in e.value.hint


def test_an_ended_record_is_not_an_ending_agent(job: JobDir) -> None:
    """A job suspended, exited or never started (no init yet) is not 'ending': whoever holds its lock is refused
    at once (a second restore of one snapshot, or a run still starting)."""
    for state, pid, ending in (("suspended", gone_pid(), True), ("exited", gone_pid(), False), ("starting", 0, False)):
        record(job, pid, state, ending)
        assert not job.agent_ending(), state


def test_a_migrations_restore_waits_for_a_running_holder(job: JobDir, init: subprocess.Popen[bytes]) -> None:
    """A live migration's node restored where the job directory is shared with its old host: the old incarnation,
    running, holds the lock until the coordinator ends it; ``wait_held`` waits for it, and only so long."""
    record(job, init.pid)
    with hold(job, 1.0):
        start = time.monotonic()
        fd = job.take_lock(wait_held=20)
        assert 0.5 < time.monotonic() - start < 10
        os.close(fd)
    with hold(job, 30):
        start = time.monotonic()
        with pytest.raises(UsageError, match="already running"):
            job.take_lock(wait_held=0.5)
        assert 0.4 < time.monotonic() - start < 5


LOOK = """
import sys, time
from pathlib import Path
from cryosleep.core.job import JobDir
job = JobDir(sys.argv[1], Path(sys.argv[2]))
end = time.monotonic() + float(sys.argv[3])
looks = alive = 0
while time.monotonic() < end:
    looks += 1
    alive += job.agent_alive()
print(looks, alive, flush=True)
"""


def lookers(job: JobDir, n: int, seconds: float) -> list[subprocess.Popen[str]]:
    """``n`` processes that ask ``agent_alive`` as fast as they can for ``seconds`` (as `cryosleep jobs`, `run`'s
    wait and a test's check do at once), each printing how often it asked and how often it was told yes."""
    return [subprocess.Popen([sys.executable, "-c", LOOK, job.name, str(job.path.parent), str(seconds)],
                             stdout=subprocess.PIPE, text=True) for _ in range(n)]


def answers(procs: list[subprocess.Popen[str]]) -> list[tuple[int, int]]:
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=60)
        looks, alive = map(int, stdout.split())
        out.append((looks, alive))
    return out


def test_looks_at_once_never_see_an_agent_that_is_gone(job: JobDir, init: subprocess.Popen[bytes]) -> None:
    """The CI failure: a job whose agent was killed read as running because another process looked at the same
    moment (each look took the lock exclusively). Looks are shared now: none sees another as the agent; a
    claim taken while they look gets the lock (it rides out their moments), and with an agent holding it every
    look says so."""
    record(job, init.pid)
    job.path.mkdir(parents=True, exist_ok=True)
    job.lock_file.touch()
    procs = lookers(job, 3, 3.0)
    time.sleep(0.5)
    claims = 0
    while procs[0].poll() is None:
        fd = job.try_lock()
        assert fd is not None, "a look was taken for an agent by a claim"
        os.close(fd)
        claims += 1
        assert job.read()[1].state == "lost"
    got = answers(procs)
    assert all(looks > 100 for looks, _ in got), got
    assert claims > 10
    # while claims hold it for a moment, a look may see them; without claims, none may see anything
    procs = lookers(job, 3, 2.0)
    got = answers(procs)
    assert all(looks > 100 and alive == 0 for looks, alive in got), got
    with hold(job, 30):
        got = answers(lookers(job, 2, 1.0))
        assert all(looks > 100 and alive == looks for looks, alive in got), got
