"""GPU acceptance on the H200 machines (skipped where there is no GPU, as in CI).

Run there as root, after `cryosleep criu install --bundle ...`:
    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python3 -m pytest -v tests/gpu
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import require_criu
from tests.jobs.harness import Harness, reference

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "cuda_train.py"


def gpu_count() -> int:
    """GPUs on this machine, asked of nvidia-smi: the test process itself stays out of the CUDA driver."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="needs an NVIDIA GPU and libcuda")]


@pytest.fixture
def h(cryo_home: Path) -> Harness:
    require_criu()
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0", "run the GPU tests with NCCL_NVLS_ENABLE=0"
    return Harness(cryo_home)


def identical(h: Harness, name: str, args: list[str], nproc: int) -> None:
    ref = reference(WORKLOAD, args, nproc)
    for r in range(nproc):
        assert h.losses(name, r) == ref[r], f"rank {r} differs from the uninterrupted run"


def test_one_gpu_three_keep_running_then_stop_and_restore(h: Harness) -> None:
    # long enough that the job still trains after three snapshots: each lets it run on while the image is
    # checksummed (about 2 s here, 40 steps)
    args = ["--steps", "300", "--step-sleep", "0.05", "--mem-gib", "1"]
    h.run("gpu1", WORKLOAD, args, nproc=1)
    for step in (15, 20, 25):
        h.wait_step("gpu1", step)
        s = h.snapshot("gpu1")
        assert {"cuda-lock", "cuda-checkpoint", "dump", "cuda-restore", "cuda-unlock"} <= set(s["phases"])
    h.wait_step("gpu1", 30)
    stop = h.snapshot("gpu1", "--stop")
    assert h.wait_end("gpu1") == 75
    r = h.restore(stop["snapshot"])
    assert {"cuda-restore", "cuda-unlock"} <= set(r["phases"])
    assert h.wait_end("gpu1") == 0
    identical(h, "gpu1", args, 1)


@pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")
def test_restore_onto_the_other_gpu(h: Harness) -> None:
    args = ["--steps", "40", "--step-sleep", "0.05"]
    h.run("moved", WORKLOAD, args, nproc=1)
    h.wait_step("moved", 10)
    stop = h.snapshot("moved", "--stop")
    assert h.wait_end("moved") == 75
    h.cli_json("restore", "--detach", "--gpu-map", "1,0", stop["snapshot"])
    h.wait_step("moved", 12)
    # the process now runs on the other GPU: nvidia-smi lists its PID there
    assert h.wait_end("moved") == 0
    identical(h, "moved", args, 1)
