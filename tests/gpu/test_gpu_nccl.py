"""GPU acceptance for NCCL jobs on a 2-GPU machine (skipped with fewer GPUs, as in CI; the expandable segments'
test runs with one rank per GPU there is, from one GPU up).

Run there as root: NCCL_NVLS_ENABLE=0 PYTHONPATH=src:. python3 -m pytest -v tests/gpu/test_gpu_nccl.py
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import require_criu
from tests.gpu.test_gpu_cycle import WORKLOAD, gpu_count, identical
from tests.jobs.harness import Harness, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="needs an NVIDIA GPU and libcuda")]
two_gpus = pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")


@pytest.fixture
def h(cryo_home: Path) -> Harness:
    require_criu()
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0", "run the GPU tests with NCCL_NVLS_ENABLE=0"
    return Harness(cryo_home)


@two_gpus
@pytest.mark.parametrize("extra,fast", [([], False), (["--async-groups"], False), ([], True)],
                         ids=["ddp", "two-groups-async", "ddp-fast-path"])
def test_two_rank_nccl_three_keep_running_stop_restore(h: Harness, tmp_path: Path, extra: list[str],
                                                        fast: bool) -> None:
    linger = tmp_path / "linger"  # the job waits at its end for it: the stop snapshot never meets an ending job
    args = ["--steps", "300", "--step-sleep", "0.05", "--linger", str(linger), *extra]
    name = "nccl" + ("async" if extra else "") + ("fast" if fast else "")
    h.run(name, WORKLOAD, args, nproc=2, flags=("--fast-path",) if fast else ())
    for step in (10, 15, 20):
        h.wait_step(name, step)
        s = h.snapshot(name)
        assert {"drain", "quiesce", "cuda-checkpoint", "dump", "rebuild"} <= set(s["phases"]), s["phases"]
        assert fast == ({"offload", "reload"} <= set(s["phases"])), s  # the fast path moved device memory
        if fast:  # every rank's, none fell back to the plain path
            assert h.cli_json("show", s["snapshot"])["nodes"][0]["gpu"]["fast_path"]["plain"] == {}
    h.wait_step(name, 25)
    stop = h.snapshot(name, "--stop")
    assert fast == ("offload" in stop["phases"]), stop
    assert h.wait_end(name) == 75
    r = h.restore(stop["snapshot"])
    assert fast == ({"devmem", "reload"} <= set(r["phases"])), r
    linger.touch()
    assert h.wait_end(name) == 0
    identical(h, name, args, 2)


def test_fast_path_moves_pytorchs_expandable_segments(h: Harness, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """PyTorch's expandable segments map their memory through the driver's VMM calls themselves (cuMemCreate,
    cuMemMap): the fast path moves that memory too (vmm.c, virtual handles), on every rank, and the job continues
    bit-identically after keep-running and stop + restore snapshots. One rank per GPU, up to 2."""
    nproc = min(2, gpu_count())
    for set_env in (lambda k, v: monkeypatch.setitem(h.env, k, v), monkeypatch.setenv):  # the job's, the reference's
        set_env("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    linger = tmp_path / "linger"
    args = ["--steps", "300", "--step-sleep", "0.05", "--linger", str(linger)]
    h.run("expand", WORKLOAD, args, nproc=nproc, flags=("--fast-path",))
    h.wait_step("expand", 10)
    s = h.snapshot("expand")
    fast = h.cli_json("show", s["snapshot"])["nodes"][0]["gpu"]["fast_path"]
    assert fast["plain"] == {} and sorted(fast["ranks"]) == [str(r) for r in range(nproc)], fast
    assert all(e["plan"]["mapped"]["bytes"] > 0 for e in fast["ranks"].values()), fast  # the segments were moved
    h.wait_step("expand", 20)
    stop = h.snapshot("expand", "--stop")
    assert "offload" in stop["phases"] and h.wait_end("expand") == 75
    h.restore(stop["snapshot"])
    linger.touch()
    assert h.wait_end("expand") == 0
    identical(h, "expand", args, nproc)


@two_gpus
def test_fast_path_holds_a_thread_that_wakes_and_submits_through_cublas(h: Harness, tmp_path: Path) -> None:
    """A thread outside the training loop wakes every 20 ms and multiplies matrices through cuBLAS (the driver API)
    on its own stream: while the fast path has the device memory out, its launches wait at the driver gate and
    go on after RELOAD. Its products never change, the snapshots stay on the fast path, and the training's
    losses equal an uninterrupted run's."""
    args = ["--steps", "300", "--step-sleep", "0.05", "--side-thread", "--linger", str(tmp_path / "linger")]
    h.run("side", WORKLOAD, args, nproc=2, flags=("--fast-path",))
    for step in (10, 15, 20, 25):
        h.wait_step("side", step)
        s = h.snapshot("side")
        assert {"offload", "reload"} <= set(s["phases"]), s
        assert h.cli_json("show", s["snapshot"])["nodes"][0]["gpu"]["fast_path"]["plain"] == {}
    h.wait_step("side", 30)
    stop = h.snapshot("side", "--stop")
    assert h.wait_end("side") == 75
    h.restore(stop["snapshot"])
    (tmp_path / "linger").touch()
    assert h.wait_end("side") == 0
    for r in range(2):
        log = h.job("side").rank_log(r).read_text()
        assert "side mismatch" not in log and "side done" in log, log[-2000:]
    identical(h, "side", args, 2)


@two_gpus
def test_two_rank_restore_with_ranks_swapped_across_gpus(h: Harness) -> None:
    args = ["--steps", "40", "--step-sleep", "0.05"]
    h.run("swap", WORKLOAD, args, nproc=2)
    h.wait_step("swap", 10)
    stop = h.snapshot("swap", "--stop")
    assert h.wait_end("swap") == 75
    h.cli_json("restore", "--detach", "--gpu-map", "1,0", stop["snapshot"])
    assert h.wait_end("swap") == 0
    identical(h, "swap", args, 2)


IPC_WORKLOAD = Path(__file__).parent / "workloads" / "ipc_share.py"


@two_gpus
def test_cuda_ipc_import_refuses_the_snapshot_until_released(h: Harness) -> None:
    """A worker holding a CUDA tensor from another process (torch.multiprocessing): the interceptor's
    cudaIpcOpenMemHandle wrapper flags it, the snapshot is refused before any process is touched, the job
    trains on; once the tensor is released, a snapshot works and the job ends identical to a plain run."""
    args = ["--steps", "200", "--hold-steps", "60"]
    h.run("ipc", IPC_WORKLOAD, args, nproc=2)
    h.wait_step("ipc", 10)
    assert "ipc open 7.0" in h.job("ipc").rank_log(0).read_text()
    res = h.cli("snapshot", "ipc", check=False)
    assert res.returncode != 0 and "CUDA IPC" in res.stdout + res.stderr, res.stdout + res.stderr
    h.wait_step("ipc", 80)
    assert "ipc closed" in h.job("ipc").rank_log(0).read_text()
    h.snapshot("ipc")
    assert h.wait_end("ipc") == 0
    ref = reference(IPC_WORKLOAD, args, 2)
    for r in range(2):
        assert h.losses("ipc", r) == ref[r], f"rank {r} differs from the uninterrupted run"
