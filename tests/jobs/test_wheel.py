"""Installed as platforms install: a wheel built by the standard build backend carries the native helpers (sandbox
init, NCCL interceptor, CPU stand-in NCCL) built for this machine; installed into a fresh virtualenv, away from the
source tree, `cryosleep criu install` works from it and its demo passes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REAL_CRIU_ROOT, require_criu

pytestmark = [pytest.mark.slow, pytest.mark.extended]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1200)  # a wheel build, an install and the demo's whole cycle
def test_the_wheel_carries_the_native_helpers_and_runs_the_demo(tmp_path: Path, cryo_home: Path) -> None:
    require_criu()
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheels), str(ROOT)], check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = wheels.glob("cryosleep-*.whl")
    assert wheel.name.endswith("linux_x86_64.whl"), wheel.name  # a platform wheel: it carries machine code
    names = set(zipfile.ZipFile(wheel).namelist())
    for native in ("cryosleep-init", "libcryosleep_nccl.so", "standin/libnccl.so.2"):
        assert f"cryosleep/_native/{native}" in names
    assert "cryosleep/core/criu.lock.json" in names
    assert not any("/tests/" in n or n.startswith("tests/") for n in names)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # The package only from the wheel; its dependencies (PyTorch above all, several GB to install again) from this
    # interpreter's site-packages through a path file, written once the wheel is in (pip would see this checkout's
    # editable install there). Nothing of the source tree on the path: not src/ (PYTHONPATH), nor the repo as cwd.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["CRYOSLEEP_CRIU_ROOT"] = REAL_CRIU_ROOT
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True, text=True, timeout=300, env=env,
                   cwd=tmp_path)
    site = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import cryosleep, sys; print(cryosleep.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, check=False)
    assert where.returncode == 0 and where.stdout.strip().startswith(str(venv)), where.stdout + where.stderr
    cli = str(venv / "bin" / "cryosleep")
    assert os.access(site / "cryosleep" / "_native" / "cryosleep-init", os.X_OK)
    inst = subprocess.run([cli, "criu", "install"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=600, check=False)
    assert inst.returncode == 0, inst.stderr[-2000:]
    demo = subprocess.run([cli, "demo", "--json", "--steps", "30", "--out", str(tmp_path / "demo")],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600, check=False)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert json.loads(demo.stdout)["identical"] is True
