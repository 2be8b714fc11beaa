"""cryosleep-init --net-ns: the sandbox gets its own network namespace, and starts no worker before the
agent has set it up (one byte on --wait-fd); without that byte it ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cryosleep import paths
from cryosleep.agent.agent import become_subreaper
from tests.conftest import wait_exit

INIT = paths.native_dir() / "cryosleep-init"
CODE = ("import os, socket, sys\n"
        "print(os.readlink('/proc/self/ns/net'), sorted(n for _, n in socket.if_nameindex()), sys.argv[1:])\n")


@pytest.fixture(autouse=True)
def _root() -> None:
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root")
    become_subreaper()


def spawn(tmp_path: Path, *extra: str) -> tuple[int, int]:
    r, w = os.pipe()
    try:
        res = subprocess.run([str(INIT), "--spawn", "--net-ns", "--wait-fd", str(r), "-n", "1", "-l", str(tmp_path),
                              "--", sys.executable, "-c", CODE, *extra], capture_output=True, text=True, check=True,
                             pass_fds=(r,), timeout=30)
    finally:
        os.close(r)
    return int(res.stdout), w


def test_workers_wait_for_the_agent_then_run_in_their_own_network_namespace(tmp_path: Path) -> None:
    init, w = spawn(tmp_path, "--wait-fd", "x")  # the program's own arguments pass through untouched
    try:
        time.sleep(0.5)
        assert not (tmp_path / "rank-0.log").exists()  # nothing runs before the byte
        assert os.readlink(f"/proc/{init}/ns/net") != os.readlink("/proc/self/ns/net")
        os.write(w, b"1")
    finally:
        os.close(w)
    assert wait_exit(init) == 0
    ns, ifaces, argv = (tmp_path / "rank-0.log").read_text().split(" ", 2)
    assert ns != os.readlink("/proc/self/ns/net") and ifaces == "['lo']" and argv.strip() == "['--wait-fd', 'x']"


def test_without_the_agents_byte_the_sandbox_ends(tmp_path: Path) -> None:
    init, w = spawn(tmp_path)
    os.close(w)  # the agent failed: no byte, the pipe closes
    assert wait_exit(init) == 127
    assert not (tmp_path / "rank-0.log").exists()


def test_wait_fd_only_goes_with_a_network_namespace(tmp_path: Path) -> None:
    res = subprocess.run([str(INIT), "--spawn", "--wait-fd", "5", "-n", "1", "-l", str(tmp_path), "--", "true"],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 2 and "usage" in res.stderr
