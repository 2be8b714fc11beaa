"""The CUDA driver's checkpoint API, called from the agent on the workers' PIDs (as verified: docs/facts.md).

    lock(pid, timeout)      wait for the process's in-flight GPU work, then block its CUDA calls
    checkpoint(pid)         copy its device memory to host memory and release the GPU
    restore(pid, pairs)     bring device memory back, onto other GPUs when ``pairs`` maps old UUID -> new
    unlock(pid)             let its CUDA calls run again
    state(pid)              RUNNING, LOCKED, CHECKPOINTED or FAILED

The order around CRIU that works: lock, checkpoint, CRIU dump, [kill; CRIU restore], restore, unlock.
Every function raises CudaError with the driver's own name for what went wrong.
"""

from __future__ import annotations

import ctypes
import enum
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from cryosleep.core import proctree
from cryosleep.errors import CryosleepError, CudaError


class ProcState(enum.IntEnum):
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class LockArgs(ctypes.Structure):
    """CUcheckpointLockArgs: 64 bytes."""

    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved1", ctypes.c_uint64 * 7)]


class GpuPair(ctypes.Structure):
    """CUcheckpointGpuPair: two 16-byte CUuuid (old, new)."""

    _fields_ = [("oldUuid", ctypes.c_char * 16), ("newUuid", ctypes.c_char * 16)]


class RestoreArgs(ctypes.Structure):
    """CUcheckpointRestoreArgs (CUDA 13.0): 64 bytes."""

    _fields_ = [("gpuPairs", ctypes.POINTER(GpuPair)), ("gpuPairsCount", ctypes.c_uint),
                ("reserved", ctypes.c_char * 44), ("reserved1", ctypes.c_uint64)]


assert ctypes.sizeof(LockArgs) == 64 and ctypes.sizeof(RestoreArgs) == 64 and ctypes.sizeof(GpuPair) == 32


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: bytes  # 16 raw bytes
    name: str

    @property
    def uuid_str(self) -> str:
        h = self.uuid.hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class CudaDriver:
    """libcuda loaded once; cuInit(0) called once (needed before the checkpoint API works on other PIDs)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._check(lib.cuInit(0), "cuInit")

    def _error_text(self, code: int) -> str:
        name = ctypes.c_char_p()
        desc = ctypes.c_char_p()
        self.lib.cuGetErrorName(code, ctypes.byref(name))
        self.lib.cuGetErrorString(code, ctypes.byref(desc))
        n = name.value.decode() if name.value else f"CUDA error {code}"
        d = desc.value.decode() if desc.value else ""
        return f"{n}: {d}" if d else n

    def _check(self, code: int, call: str, pid: int | None = None) -> None:
        if code != 0:
            who = f" for PID {pid}" if pid is not None else ""
            extra = {"threads": thread_table(pid)} if pid is not None else {}
            raise CudaError(f"{call}{who} failed", self._error_text(code), _hint(call, code), code=code, **extra)

    def state(self, pid: int) -> ProcState:
        st = ctypes.c_int(-1)
        self._check(self.lib.cuCheckpointProcessGetState(pid, ctypes.byref(st)), "cuCheckpointProcessGetState",
                    pid)
        return ProcState(st.value)

    def lock(self, pid: int, timeout_s: float) -> None:
        args = LockArgs(timeoutMs=max(1, int(timeout_s * 1000)))
        self._check(self.lib.cuCheckpointProcessLock(pid, ctypes.byref(args)), "cuCheckpointProcessLock", pid)

    def checkpoint(self, pid: int) -> None:
        self._check(self.lib.cuCheckpointProcessCheckpoint(pid, None), "cuCheckpointProcessCheckpoint", pid)

    def restore(self, pid: int, pairs: Sequence[tuple[bytes, bytes]] = ()) -> None:
        if pairs:
            arr = (GpuPair * len(pairs))(*[GpuPair(o, n) for o, n in pairs])
            args = RestoreArgs(gpuPairs=arr, gpuPairsCount=len(pairs))
            code = self.lib.cuCheckpointProcessRestore(pid, ctypes.byref(args))
        else:
            code = self.lib.cuCheckpointProcessRestore(pid, None)
        self._check(code, "cuCheckpointProcessRestore", pid)

    def unlock(self, pid: int) -> None:
        self._check(self.lib.cuCheckpointProcessUnlock(pid, None), "cuCheckpointProcessUnlock", pid)

    def gpus(self) -> list[Gpu]:
        count = ctypes.c_int(0)
        self._check(self.lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        out = []
        for i in range(count.value):
            dev = ctypes.c_int(0)
            self._check(self.lib.cuDeviceGet(ctypes.byref(dev), i), "cuDeviceGet")
            uuid = (ctypes.c_char * 16)()
            self._check(self.lib.cuDeviceGetUuid_v2(ctypes.byref(uuid), dev), "cuDeviceGetUuid_v2")
            name = ctypes.create_string_buffer(256)
            self._check(self.lib.cuDeviceGetName(name, 256, dev), "cuDeviceGetName")
            out.append(Gpu(i, bytes(uuid.raw), name.value.decode(errors="replace")))
        return out

    def version(self) -> int:
        v = ctypes.c_int(0)
        self._check(self.lib.cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
        return v.value


CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_SUPPORTED = 801


def _hint(call: str, code: int) -> str:
    """What to do, for the refusals seen on the H200 machines (docs/gpu-acceptance.md)."""
    if call == "cuCheckpointProcessCheckpoint" and code == CUDA_ERROR_NOT_SUPPORTED:
        return ("the driver cannot checkpoint this process: CUDA managed memory (cudaMallocManaged) or live NCCL "
                "communicators do this; `cryosleep check --job NAME` names what it finds")
    if call == "cuCheckpointProcessRestore" and code == CUDA_ERROR_INVALID_VALUE:
        return ("the driver could not bring this process's GPU memory back: a process that imported another's "
                "GPU memory (CUDA IPC, e.g. CUDA tensors shared through torch.multiprocessing) fails so; such "
                "jobs cannot be captured, and this one must be restored from an earlier snapshot")
    return "see `cryosleep check`: driver version, persistence mode, NCCL/IPC state"


@cache
def driver() -> CudaDriver:
    """The CUDA driver, or CudaError when this machine has none (CI)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise CudaError("the CUDA driver (libcuda.so.1) is not available", str(e),
                        "GPU jobs need the NVIDIA driver on this machine") from e
    if not hasattr(lib, "cuCheckpointProcessLock"):
        raise CudaError("this CUDA driver has no checkpoint API", "cuCheckpointProcessLock is missing",
                        "install an NVIDIA driver >= 550 (570+ for restore onto other GPUs)")
    return CudaDriver(lib)


def available() -> bool:
    try:
        driver()
        return True
    except CudaError:
        return False


GPU_DEVICE_PREFIX = "/dev/nvidia"


def gpu_processes(root_pid: int) -> list[int]:
    """The processes of the tree that hold a GPU device open (candidates for the checkpoint API)."""
    out = []
    for pid in proctree.tree(root_pid):
        if any(f.target.startswith(GPU_DEVICE_PREFIX) for f in proctree.open_files(pid)):
            out.append(pid)
    return out


def cuda_processes(root_pid: int) -> list[int]:
    """Processes of the tree with a live CUDA context (a DataLoader worker that inherited the device fds
    without a context is not one: the driver answers it with an error)."""
    drv = driver()
    out = []
    for pid in gpu_processes(root_pid):
        try:
            drv.state(pid)
        except CudaError:
            continue
        out.append(pid)
    return out


def uuid_pairs(old: Sequence[str], new: Sequence[str]) -> list[tuple[bytes, bytes]]:
    """The restore map for a process that saw GPUs ``old`` (UUID strings, in order) and now runs where the
    same positions hold ``new``. Every GPU the process sees must be in the map (a partial map fails with
    "invalid argument": docs/facts.md), so the map is total over ``old`` and a permutation of ``new``."""
    if len(old) != len(new):
        raise CryosleepError("the GPU map does not fit", f"{len(old)} GPUs at capture, {len(new)} here",
                             "restore onto a machine with the same number of GPUs")
    if len(set(new)) != len(new):
        raise CryosleepError("the GPU map names a GPU twice", ", ".join(new), "give every GPU once")
    return [(parse_uuid(o), parse_uuid(n)) for o, n in zip(old, new, strict=True)]


def parse_uuid(text: str) -> bytes:
    h = text.removeprefix("GPU-").replace("-", "")
    if len(h) != 32:
        raise CryosleepError(f"not a GPU UUID: {text!r}", "expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
                             "copy it from `nvidia-smi -L`")
    return bytes.fromhex(h)


def restore_checked(pid: int, pairs: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """cuCheckpointProcessRestore, judged by the process's state afterwards.

    Seen on an H200 (driver 580): the first restore after boot returned CUDA_ERROR_OPERATING_SYSTEM while
    the process went on computing. So a failure is checked against the state: LOCKED means the device
    memory is back; CHECKPOINTED is retried once; anything else is the error it is.
    """
    drv = driver()
    try:
        drv.restore(pid, pairs)
        return
    except CudaError as first:
        try:
            st = drv.state(pid)
        except CudaError as e:
            first.details["state_after"] = f"{e.what}: {e.why}"
            raise first from None
        first.details["state_after"] = st.name
        if st == ProcState.LOCKED:
            return
        if st != ProcState.CHECKPOINTED:
            raise
    drv.restore(pid, pairs)


def thread_table(pid: int) -> dict[int, str]:
    """``{tid: "name:state"}`` for every thread of ``pid`` (for error reports: which threads were there)."""
    out = {}
    for tid, st in sorted(_threads(pid)):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            name = "?"
        out[tid] = f"{name}:{st}"
    return out


def _threads(pid: int) -> frozenset[tuple[int, str]]:
    out = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return frozenset()
    for tid in tids:
        out.add((int(tid), proctree.state(int(tid))))
    return frozenset(out)


def settle_threads(pids: Sequence[int], quiet_s: float = 0.02, limit_s: float = 5.0) -> bool:
    """Wait until the threads of ``pids`` stop changing (none exiting) for ``quiet_s``.

    Added when CRIU's seize failed on vanishing threads ("Zombies with threads are not supported") on the
    H200 machines. Those threads turned out to be jobs ending during the snapshot (docs/gpu-acceptance.md);
    the driver's calls alone were seen to start or end no thread (bench/cuda_cycle.py). The wait (20 ms when
    nothing moves) stays until a GPU run without it confirms that. Returns False if the threads were still
    changing after ``limit_s`` (the dump then goes ahead and reports what it finds).
    """
    end = time.monotonic() + limit_s
    last: dict[int, frozenset[int]] = {}
    stable_since = time.monotonic()
    while time.monotonic() < end:
        seen = {p: _threads(p) for p in pids}
        now = {p: frozenset(tid for tid, _ in ts) for p, ts in seen.items()}
        exiting = any(st in ("Z", "X") for ts in seen.values() for _, st in ts)
        if now != last or exiting:
            last, stable_since = now, time.monotonic()
        elif time.monotonic() - stable_since >= quiet_s:
            return True
        time.sleep(0.01)
    return False


class GpuSet:
    """The CUDA processes of one sandbox, driven together (in parallel) through the checkpoint API, and
    remembering how far they got so that one rollback can undo exactly that."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.locked = False
        self.checkpointed = False

    def _each(self, fn: Callable[[int], None]) -> None:
        if not self.pids:
            return
        with ThreadPoolExecutor(max_workers=len(self.pids)) as pool:
            errors = [f.exception() for f in [pool.submit(fn, p) for p in self.pids]]
        for e in errors:
            if e is not None:
                raise e

    def lock(self, timeout_s: float) -> None:
        self.locked = True  # a partly locked set is unlocked by the rollback
        self._each(lambda p: driver().lock(p, timeout_s))

    def checkpoint(self) -> None:
        self.checkpointed = True
        self._each(driver().checkpoint)
        settle_threads(self.pids)

    def restore(self, pairs: Sequence[tuple[bytes, bytes]] = ()) -> None:
        self._each(lambda p: restore_checked(p, pairs))
        self.checkpointed = False

    def unlock(self) -> None:
        self._each(driver().unlock)
        self.locked = False

    def rollback(self) -> list[str]:
        """Bring every process back to RUNNING from wherever it is; returns what could not be undone."""
        problems = []
        for pid in self.pids:
            try:
                st = driver().state(pid)
                if st == ProcState.CHECKPOINTED:
                    driver().restore(pid)
                    st = driver().state(pid)
                if st == ProcState.LOCKED:
                    driver().unlock(pid)
            except CryosleepError as e:
                problems.append(f"PID {pid}: {e.what}: {e.why}")
        self.locked = self.checkpointed = False
        return problems
