"""GPU acceptance for NCCL jobs on a 2-GPU machine (skipped with fewer GPUs, as in CI).

Run there as root: NCCL_NVLS_ENABLE=0 PYTHONPATH=src:. python3 -m pytest -v tests/gpu/test_gpu_nccl.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import require_criu
from tests.gpu.test_gpu_cycle import WORKLOAD, gpu_count, identical
from tests.jobs.harness import Harness

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")]


@pytest.fixture
def h(cryo_home: Path) -> Harness:
    require_criu()
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0", "run the GPU tests with NCCL_NVLS_ENABLE=0"
    return Harness(cryo_home)


@pytest.mark.parametrize("extra", [[], ["--async-groups"]], ids=["ddp", "two-groups-async"])
def test_two_rank_nccl_three_keep_running_stop_restore(h: Harness, extra: list[str]) -> None:
    args = ["--steps", "300", "--step-sleep", "0.05", *extra]  # outlasts the snapshots (see test_gpu_cycle)
    name = "nccl" + ("async" if extra else "")
    h.run(name, WORKLOAD, args, nproc=2)
    for step in (10, 15, 20):
        h.wait_step(name, step)
        s = h.snapshot(name)
        assert {"drain", "quiesce", "cuda-checkpoint", "dump", "rebuild"} <= set(s["phases"]), s["phases"]
    h.wait_step(name, 25)
    stop = h.snapshot(name, "--stop")
    assert h.wait_end(name) == 75
    h.restore(stop["snapshot"])
    assert h.wait_end(name) == 0
    identical(h, name, args, 2)


def test_two_rank_restore_with_ranks_swapped_across_gpus(h: Harness) -> None:
    args = ["--steps", "40", "--step-sleep", "0.05"]
    h.run("swap", WORKLOAD, args, nproc=2)
    h.wait_step("swap", 10)
    stop = h.snapshot("swap", "--stop")
    assert h.wait_end("swap") == 75
    h.cli_json("restore", "--detach", "--gpu-map", "1,0", stop["snapshot"])
    assert h.wait_end("swap") == 0
    identical(h, "swap", args, 2)
