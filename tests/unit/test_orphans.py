"""capture/orphans.py against real processes: CRIU's setup-namespaces action records the init as the watchdog
reads it (a command name with spaces and parentheses included), and :func:`end` ends exactly the marked processes
and the recorded init, never a process that only reuses a recorded PID."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cryosleep.capture import orphans
from cryosleep.core import proctree


@pytest.fixture
def marks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> orphans.Marks:
    monkeypatch.setenv("CRYOSLEEP_HOME", str(tmp_path / "home"))
    return orphans.Marks.new(tmp_path)


def _sleeper(env: dict[str, str] | None = None, name: str | None = None) -> subprocess.Popen[bytes]:
    code = "import time\n"
    if name:  # a command name as a job may set it (prctl PR_SET_NAME)
        code += f"import ctypes; ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\n"
    code += "print('ready', flush=True); time.sleep(300)\n"
    p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **(env or {})}, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


def _record(marks: orphans.Marks, pid: int, action: str = "setup-namespaces") -> None:
    script, env = marks.action()
    res = subprocess.run([script], env={**os.environ, **env, "CRTOOLS_SCRIPT_ACTION": action,
                                        "CRTOOLS_INIT_PID": str(pid)}, capture_output=True, check=False)
    assert res.returncode == 0, res.stderr  # a failing action script would fail CRIU's restore


def test_the_action_records_the_init_at_setup_namespaces_only(marks: orphans.Marks) -> None:
    init = _sleeper(name="a) b (c")
    try:
        _record(marks, init.pid, "pre-restore")
        assert not Path(marks.root_file).exists()
        _record(marks, init.pid)
        assert orphans.recorded_root(marks) == (init.pid, proctree.start_time(init.pid))
    finally:
        init.kill()
        init.wait()
    assert orphans.recorded_root(marks) is None  # gone: nothing to end


def test_the_action_never_fails_the_restore(marks: orphans.Marks) -> None:
    _record(marks, 2**22 + 7)  # no such process: it records nothing and exits 0
    assert not Path(marks.root_file).exists()


def test_end_kills_the_marked_and_the_recorded_init_and_nothing_else(marks: orphans.Marks) -> None:
    _, env = marks.action()
    other = orphans.Marks.new(Path(marks.root_file).parent / "other")
    helper = _sleeper(env)
    init = _sleeper()
    bystander = _sleeper({orphans.MARK_ENV: other.token})  # another restore's
    try:
        _record(marks, init.pid)
        done = orphans.end(marks)
        assert helper.wait(5) < 0 and init.wait(5) < 0
        assert bystander.poll() is None
        assert done == [f"the restored sandbox (init {init.pid}) killed",
                        f"its CRIU restore and what it forked (PIDs {helper.pid}) ended"]
        assert orphans.end(marks) == []  # nothing left
    finally:
        for p in (helper, init, bystander):
            p.kill()
            p.wait()


def test_a_recorded_pid_now_another_process_is_left_alone(marks: orphans.Marks) -> None:
    p = _sleeper()
    try:
        Path(marks.root_file).write_text(f"{p.pid} {int(proctree.start_time(p.pid)) - 1}\n")
        assert orphans.recorded_root(marks) is None
        assert orphans.end(marks) == []
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_marks_round_trip_through_json(marks: orphans.Marks) -> None:
    assert orphans.Marks.from_json(marks.to_json()) == marks
