"""cryosleep-init: the sandbox's PID 1 (a real PID namespace, real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cryosleep import paths
from cryosleep.agent.agent import become_subreaper
from cryosleep.core import proctree
from tests.conftest import wait_exit

INIT = paths.native_dir() / "cryosleep-init"


def spawn(tmp_path: Path, n: int, code: str, env: dict[str, str] | None = None) -> int:
    res = subprocess.run([str(INIT), "--spawn", "-n", str(n), "-b", "4", "-l", str(tmp_path), "--",
                          sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, **(env or {})))
    return int(res.stdout)




@pytest.fixture(autouse=True)
def _subreaper() -> None:
    if os.geteuid() != 0:
        pytest.skip("PID namespaces need root")
    become_subreaper()


def test_workers_get_ranks_logs_and_their_own_pid_namespace(tmp_path: Path) -> None:
    code = "import os; print(os.environ['RANK'], os.environ['LOCAL_RANK'], os.getpid(), os.getsid(0))"
    init = spawn(tmp_path, 2, code)
    assert proctree.ns_pid(init) == 1
    assert wait_exit(init) == 0
    for local, rank in enumerate((4, 5)):
        r, lr, pid, sid = (tmp_path / f"rank-{rank}.log").read_text().split()
        assert (int(r), int(lr)) == (rank, local)
        assert int(pid) in (2, 3) and int(sid) == 1  # inside the namespace; init leads the session
        assert (tmp_path / f"rank-{rank}.exit").read_text() == "exit 0\n"


def test_a_failing_worker_ends_the_others_and_sets_the_exit_code(tmp_path: Path) -> None:
    code = ("import os, sys, time\n"
            "if os.environ['LOCAL_RANK'] == '1': sys.exit(7)\n"
            "time.sleep(60)\n")
    init = spawn(tmp_path, 2, code)
    start = time.monotonic()
    assert wait_exit(init) == 7
    assert time.monotonic() - start < 20
    assert (tmp_path / "rank-5.exit").read_text() == "exit 7\n"
    assert (tmp_path / "rank-4.exit").read_text() == "signal 15\n"


def test_sigterm_is_forwarded(tmp_path: Path) -> None:
    init = spawn(tmp_path, 1, "import time; print('up', flush=True); time.sleep(60)")
    for _ in range(200):
        if (tmp_path / "rank-4.log").exists() and "up" in (tmp_path / "rank-4.log").read_text():
            break
        time.sleep(0.02)
    os.kill(init, 15)
    assert wait_exit(init) == 128 + 15


def _pending(pid: int) -> int:
    """The signals pending for ``pid`` (its own and its thread group's), as a mask."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


def test_the_term_shield_drops_a_schedulers_sigterm_and_lets_the_agents_through(tmp_path: Path) -> None:
    """With CRYOSLEEP_TERM_SHIELD=1 (the agent owns SIGTERM), a SIGTERM to every process of the sandbox, as Slurm
    sends it, neither ends a worker nor is forwarded by the init; the agent's marked SIGTERM is, and ends them."""
    code = "import time\nfor i in range(100000):\n    print('tick', i, flush=True); time.sleep(0.05)\n"
    lib = paths.native_dir() / "libcryosleep_nccl.so"
    init = spawn(tmp_path, 1, code, {"CRYOSLEEP_TERM_SHIELD": "1", "LD_PRELOAD": str(lib)})
    log = tmp_path / "rank-4.log"

    def ticks() -> int:
        return log.read_text().count("tick") if log.exists() else 0

    end = time.monotonic() + 60
    while ticks() < 2:
        assert time.monotonic() < end, "the worker did not start"
        time.sleep(0.02)
    [worker] = proctree.children(init)
    for pid in (init, worker):  # Slurm's scancel: SIGTERM to every process it tracks
        os.kill(pid, 15)
    while any(_pending(p) & (1 << 14) for p in (init, worker) if proctree.alive(p)):
        time.sleep(0.01)  # delivered (to the shield's handler, or fatally)
    seen = ticks()
    while ticks() <= seen + 1:  # the worker goes on printing after it
        assert proctree.alive(worker) and time.monotonic() < end, "the scheduler's SIGTERM ended the worker"
        time.sleep(0.02)
    proctree.send_marked(init, 15)  # the agent's: forwarded, and obeyed
    assert wait_exit(init) == 128 + 15
    assert (tmp_path / "rank-4.exit").read_text() == "signal 15\n"


def test_bad_usage() -> None:
    res = subprocess.run([str(INIT), "-n", "0", "--", "true"], capture_output=True, text=True, check=False)
    assert res.returncode == 2 and "usage" in res.stderr
