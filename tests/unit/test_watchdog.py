"""The agent's watchdog (agent/watchdog.py): real processes, a real SIGKILL of the "agent"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

AGENT = """
import sys, time
from cryosleep.agent.watchdog import Watchdog
w = Watchdog(int(sys.argv[1]), sys.argv[2])
if sys.argv[3] == "arm":
    w.arm("a stop snapshot")
elif sys.argv[3] == "arm-disarm":
    w.arm("a stop snapshot")
    w.disarm()
if len(sys.argv) > 5:  # a snapshot under way: its staging directory
    w.staging(sys.argv[5])
print("ready", w.proc.pid, flush=True)
if sys.argv[4] == "exit":
    w.close()
    sys.exit(0)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if gone(pid):
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize(("mode", "end", "killed"), [("arm", "die", True), ("arm-disarm", "die", False),
                                                     ("none", "die", False), ("arm", "exit", False)])
def test_the_sandbox_dies_with_its_agent_only_while_armed(tmp_path: Path, mode: str, end: str, killed: bool) -> None:
    sandbox = subprocess.Popen(["sleep", "600"])
    log = tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(sandbox.pid), str(log), mode, end],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 p for p in sys.path if p)})
    try:
        assert agent.stdout is not None
        line = agent.stdout.readline().split()
        assert line[0] == "ready", line
        watchdog = int(line[1])
        if end == "die":
            agent.send_signal(signal.SIGKILL)  # no cleanup of any kind: the pipe closes with the process
        agent.wait(10)
        assert wait_gone(watchdog, 10), "the watchdog outlived its agent"
        if killed:
            assert wait_gone(sandbox.pid, 5), "armed: the sandbox must die with its agent"
            assert sandbox.wait(5) == -signal.SIGKILL
            assert "the agent died during a stop snapshot" in log.read_text()
        else:
            time.sleep(0.3)
            assert sandbox.poll() is None, "not armed: the sandbox survives its agent"
            assert not log.exists()
    finally:
        sandbox.kill()
        sandbox.wait()
        if agent.poll() is None:
            agent.kill()


@pytest.mark.parametrize("end", ["die", "exit"])
def test_a_dead_agents_staging_is_removed_whatever_the_moment(tmp_path: Path, end: str) -> None:
    """Unarmed (a snapshot's preflight, before the cut): the sandbox runs on, but the staging directory of the
    snapshot the agent had under way goes with it (the agent's own end leaves that to the agent)."""
    sandbox = subprocess.Popen(["sleep", "600"])
    log = tmp_path / "agent.log"
    staging = tmp_path / "store" / ".staging" / "job-20261202-000000-abcd"
    (staging / "nodes" / "0").mkdir(parents=True)
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(sandbox.pid), str(log), "none", end, str(staging)],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 p for p in sys.path if p)})
    try:
        assert agent.stdout is not None
        watchdog = int(agent.stdout.readline().split()[1])
        if end == "die":
            agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        assert wait_gone(watchdog, 10), "the watchdog outlived its agent"
        assert sandbox.poll() is None, "not armed: the sandbox survives its agent"
        if end == "die":
            assert not staging.exists()
            assert f"its staging directory {staging} removed" in log.read_text()
        else:
            assert staging.is_dir() and not log.exists()
    finally:
        sandbox.kill()
        sandbox.wait()
        if agent.poll() is None:
            agent.kill()


RESTORING = """
import subprocess, sys, time
from pathlib import Path
from cryosleep.agent.watchdog import Watchdog
from cryosleep.capture import orphans
marks = orphans.Marks.new(Path(sys.argv[2]))
w = Watchdog(None, sys.argv[1])
w.arm("a restore")
w.restoring(marks)
_, env = marks.action()
criu = subprocess.Popen(["sleep", "600"], env=env)  # what CRIU forked: its environment marked
init = subprocess.Popen(["sleep", "600"])  # the restored init, a child of this agent
if sys.argv[3] in ("restored", "running"):
    w.restored(init.pid)
if sys.argv[3] == "running":
    w.disarm()
print("ready", w.proc.pid, criu.pid, init.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("moment", "ended"), [("criu", "criu"), ("restored", "both"), ("running", "none")])
def test_a_restoring_agents_death_ends_what_its_restore_started_until_the_job_runs(
        tmp_path: Path, moment: str, ended: str) -> None:
    """While a restore is armed (CRIU running, or done and the job not yet running), a dead agent's watchdog
    ends CRIU's marked processes and the restored init; once disarmed (the job runs), the job survives its agent."""
    log = tmp_path / "agent.log"
    agent = subprocess.Popen([sys.executable, "-c", RESTORING, str(log), str(tmp_path), moment],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 p for p in sys.path if p), "CRYOSLEEP_HOME": str(tmp_path / "home")})
    assert agent.stdout is not None
    _, watchdog, criu, init = (int(x) if x.isdigit() else x for x in agent.stdout.readline().split())
    try:
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        assert wait_gone(watchdog, 15), "the watchdog outlived its agent"
        assert gone(criu) == (ended != "none")
        assert gone(init) == (ended == "both")
        if ended != "none":
            assert "nothing of the restore is left running" in log.read_text()
    finally:
        for p in (criu, init):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
