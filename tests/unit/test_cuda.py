"""The CUDA checkpoint glue that runs without a GPU: structure layouts, UUID maps, thread settling."""

from __future__ import annotations

import ctypes
import os
import threading
import time

import pytest

from cryosleep.capture import cuda
from cryosleep.capture.restore import gpu_pairs
from cryosleep.errors import CryosleepError, NotEligible
from cryosleep.store.manifest import GpuDevice

A = "GPU-497f9be6-753d-e541-65dd-c97e2d4802b7"
B = "GPU-79b08128-4675-45e8-224f-609369039980"


def test_structures_match_the_driver_abi() -> None:
    assert ctypes.sizeof(cuda.LockArgs) == 64
    assert ctypes.sizeof(cuda.RestoreArgs) == 64
    assert ctypes.sizeof(cuda.GpuPair) == 32
    assert cuda.parse_uuid(A).hex() == "497f9be6753de54165ddc97e2d4802b7"
    with pytest.raises(CryosleepError, match="not a GPU UUID"):
        cuda.parse_uuid("GPU-1234")


def test_gpu_map_by_position_swap_and_refusals() -> None:
    captured = [GpuDevice(0, A, "NVIDIA H200"), GpuDevice(1, B, "NVIDIA H200")]
    here = [cuda.Gpu(0, cuda.parse_uuid(A), "NVIDIA H200"), cuda.Gpu(1, cuda.parse_uuid(B), "NVIDIA H200")]
    assert gpu_pairs(captured, here, None) == []  # the same GPUs: no map
    swapped = gpu_pairs(captured, here, [1, 0])
    assert swapped == [(cuda.parse_uuid(A), cuda.parse_uuid(B)), (cuda.parse_uuid(B), cuda.parse_uuid(A))]
    with pytest.raises(NotEligible, match="permutation"):
        gpu_pairs(captured, here, [0, 0])
    with pytest.raises(NotEligible, match="number of GPUs"):
        gpu_pairs(captured, here[:1], None)
    other = [cuda.Gpu(0, cuda.parse_uuid(A), "NVIDIA H100"), cuda.Gpu(1, cuda.parse_uuid(B), "NVIDIA H100")]
    with pytest.raises(NotEligible, match="model differs"):
        gpu_pairs(captured, other, None)


def test_settle_threads_waits_for_exiting_threads() -> None:
    assert cuda.settle_threads([os.getpid()], quiet_s=0.02)

    def churn() -> None:
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            t = threading.Thread(target=time.sleep, args=(0.01,))
            t.start()
            t.join()

    worker = threading.Thread(target=churn)
    worker.start()
    start = time.monotonic()
    assert cuda.settle_threads([os.getpid()], quiet_s=0.05)
    assert time.monotonic() - start >= 0.3  # it waited for the churn to end
    worker.join()


def test_the_refusals_seen_on_the_h200_get_their_own_hint() -> None:
    assert "managed memory" in cuda._hint("cuCheckpointProcessCheckpoint", cuda.CUDA_ERROR_NOT_SUPPORTED)
    assert "CUDA IPC" in cuda._hint("cuCheckpointProcessRestore", cuda.CUDA_ERROR_INVALID_VALUE)
    assert "cryosleep check" in cuda._hint("cuCheckpointProcessLock", 2)
