"""Eligibility checks on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cryosleep import eligibility

IO_URING = """
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
params = (ctypes.c_char * 120)()
fd = libc.syscall(425, 4, params)  # io_uring_setup
print(fd, flush=True)
time.sleep(60)
"""


def test_io_uring_is_refused_with_the_fix() -> None:
    p = subprocess.Popen([sys.executable, "-c", IO_URING], stdout=subprocess.PIPE, text=True)
    try:
        fd = int(p.stdout.readline()) if p.stdout else -1
        if fd < 0:
            pytest.skip("io_uring is disabled on this kernel")
        checks = eligibility.process_checks(p.pid)
        assert [c.name for c in checks] == ["io_uring"]
        assert "USE_LIBUV=0" in checks[0].detail and not checks[0].ok
    finally:
        p.kill()
        p.wait()


def test_plain_process_is_eligible_and_a_dead_one_is_not(tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        assert eligibility.process_checks(p.pid) == []
    finally:
        p.kill()
        p.wait()
    dead = eligibility.process_checks(p.pid)
    assert len(dead) == 1 and not dead[0].ok and "not running" in dead[0].detail


def test_system_checks_report_every_item(cryo_home: Path) -> None:
    names = [c.name for c in eligibility.system_checks()]
    assert names[:4] == ["kernel", "privileges", "pid namespaces", "sandbox init"]
    assert "criu" in names


def test_missing_native_helpers_are_explained(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CRYOSLEEP_NATIVE_DIR", str(tmp_path))
    c = next(c for c in eligibility.system_checks() if c.name == "sandbox init")
    assert not c.ok and "make -C native" in c.detail
    assert os.environ["CRYOSLEEP_NATIVE_DIR"] == str(tmp_path)
