"""Eligibility checks on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cryosleep.capture import eligibility

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
    assert names[:6] == ["kernel", "privileges", "capabilities (run, snapshot)", "capabilities (restore)",
                         "pid namespaces", "sandbox init"]
    assert "criu" in names


def test_missing_native_helpers_are_explained(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CRYOSLEEP_NATIVE_DIR", str(tmp_path))
    c = next(c for c in eligibility.system_checks() if c.name == "sandbox init")
    assert not c.ok and "make -C native" in c.detail
    assert os.environ["CRYOSLEEP_NATIVE_DIR"] == str(tmp_path)


H200 = ("NVIDIA H200, GPU-497f9be6-753d-e541-65dd-c97e2d4802b7, 580.159.04, Enabled, [N/A]\n"
        "NVIDIA H200, GPU-79b08128-4675-45e8-224f-609369039980, 580.159.04, Enabled, [N/A]\n")


def test_gpu_report_from_nvidia_smi() -> None:
    checks = {c.name: c for c in eligibility.gpu_checks_from_smi(H200, {})}
    assert checks["gpus"].ok and checks["gpus"].detail == "2 x NVIDIA H200"
    assert checks["driver"].ok and "580.159.04" in checks["driver"].detail
    assert checks["persistence mode"].ok and checks["MIG"].ok and checks["MPS"].ok
    assert checks["NCCL_NVLS_ENABLE"].ok


def test_gpu_report_refuses_what_the_checkpoint_cannot_do() -> None:
    bad = "NVIDIA H100, GPU-1, 535.104.05, Disabled, Enabled\nNVIDIA H200, GPU-2, 535.104.05, Enabled, Disabled\n"
    checks = {c.name: c for c in eligibility.gpu_checks_from_smi(bad, {"NCCL_NVLS_ENABLE": "1",
                                                                        "CUDA_MPS_PIPE_DIRECTORY": "/x"})}
    assert not checks["driver"].ok and "550 or later" in checks["driver"].detail
    assert not checks["gpus"].ok and "mixed models" in checks["gpus"].detail
    assert not checks["persistence mode"].ok and not checks["persistence mode"].fatal
    assert not checks["MIG"].ok and checks["MIG"].fatal
    assert not checks["MPS"].ok and not checks["NCCL_NVLS_ENABLE"].ok
    old_map = eligibility.gpu_checks_from_smi("NVIDIA H200, GPU-1, 560.35.03, Enabled, [N/A]\n", {})
    assert "570 or later" in next(c.detail for c in old_map if c.name == "driver")
    assert eligibility.gpu_checks_from_smi("", {})[0].detail.startswith("none")


PLAIN_MAPS = """\
7f0000000000-7f0000200000 rw-s 00000000 00:05 1033   /dev/nvidia-uvm
7f1000000000-7f1000001000 rw-s 00000000 00:05 1030   /dev/nvidiactl
"""


def test_managed_memory_is_the_uvm_mappings_beyond_the_drivers_own() -> None:
    # the driver's own 2 MiB mapping (every CUDA process, H200 / driver 580) is not managed memory
    assert eligibility.managed_memory_bytes(PLAIN_MAPS) == 0
    managed = PLAIN_MAPS + "7f2000000000-7f2004000000 rw-s 00000000 00:05 1033   /dev/nvidia-uvm\n"
    assert eligibility.managed_memory_bytes(managed) == 64 << 20
    assert eligibility.managed_memory_bytes("") == 0
    # a file merely named like the device, or another device, does not count
    assert eligibility.managed_memory_bytes(
        "7f3000000000-7f3004000000 r--p 00000000 08:01 77   /tmp/dev/nvidia-uvm\n") == 0


def test_a_missing_capability_is_named_and_refused() -> None:
    """core/privileges.py reads the process's effective set; a set with one capability less is named (the job-level
    test, tests/jobs/test_privileges.py, runs a whole snapshot and restore under the exact sets)."""
    if os.geteuid() != 0:
        pytest.skip("dropping a capability from the bounding set needs root")
    probe = ("from cryosleep.core import privileges as p\nprint(p.missing(p.RESTORE))\n"
             "p.require(p.RESTORE, 'restoring')")
    got = subprocess.run(["setpriv", "--bounding-set=-net_admin,-sys_time", "--", sys.executable, "-c", probe],
                         capture_output=True, text=True, check=False)
    assert got.stdout.strip() == "['CAP_NET_ADMIN', 'CAP_SYS_TIME']", got
    assert "NotEligible" in got.stderr and "missing CAP_NET_ADMIN, CAP_SYS_TIME" in got.stderr, got.stderr
