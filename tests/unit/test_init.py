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


def test_bad_usage() -> None:
    res = subprocess.run([str(INIT), "-n", "0", "--", "true"], capture_output=True, text=True, check=False)
    assert res.returncode == 2 and "usage" in res.stderr
