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
