"""The fast path's device memory, driven through a real control block (docs/interceptor.md, "The fast path").

CI has no GPU, so the CUDA driver's VMM calls and three runtime calls are stand-ins over host memory
(tests/native/fakecuda: "device memory" is a memfd mapped into a reserved range; the only double, for the
GPU); the worker is a real process with the interceptor preloaded and the stand-in NCCL, and the agent's side
is the real cut driver. On a GPU machine tests/gpu/test_gpu_nccl.py runs the same path on H200s."""

from __future__ import annotations

import hashlib
import os
import queue
import re
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ctl import drain
from fakecuda.build import build
from nccl_jobs import INTERCEPTOR, STANDIN, WORKLOADS

from cryosleep.core.interceptor import ControlBlock, State
from cryosleep.cut.driver import Driver

SIZE = 4 << 20  # above the 1 MiB from which cudaMalloc is served by the interceptor

WORKER = """
import ctypes, hashlib, sys, threading
from ncclbind import Nccl
nccl = Nccl()                                       # NCCL loaded, as libtorch_cuda loads it
if sys.argv[3] == "nccl":
    comm = nccl.init(1, nccl.unique_id(), 0)        # a communicator: the control block is published
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)   # the process's "libcudart"
lib = ctypes.CDLL(None)                             # global scope: the preloaded interceptor comes first
n = int(sys.argv[2])
p = ctypes.c_void_p()
assert lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(n)) == 0
buf = (ctypes.c_ubyte * n).from_address(p.value)
for i in range(0, n, 512):
    buf[i] = (i // 512) % 251
drv = ctypes.CDLL("libcuda.so.1")                   # the driver, as cuBLAS or Triton reach it (dlsym)
class D3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]
spinning = []
said = threading.Lock()
def out(*words):                                    # one whole line per write: threads answer concurrently
    with said:
        sys.stdout.write(" ".join(str(w) for w in words) + "\\n")
        sys.stdout.flush()
def launch():
    rc = lib.cudaLaunchKernel(None, D3(1, 1, 1), D3(1, 1, 1), None, ctypes.c_size_t(0), None)
    out("launched", rc)
def drvlaunch():
    rc = drv.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
    out("drvlaunched", rc)
def gpalaunch():
    # cuGetProcAddress_v2 looked up in the global scope finds the interceptor's own export first
    gpa = lib.cuGetProcAddress_v2
    fn = ctypes.c_void_p()
    rc = gpa(b"cuLaunchKernel", ctypes.byref(fn), 12000, ctypes.c_ulonglong(0), None)
    launch = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3)(fn.value)
    out("gpalaunched", rc, launch(None, 1, 1, 1, 1, 1, 1, 0, None, None, None))
def spin(name):
    if name:  # the thread's name as the kernel shows it (/proc/self/task/TID/comm)
        ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
    while spinning:
        pass
out("ready", hex(p.value), hashlib.sha256(bytes(buf)).hexdigest())
for line in sys.stdin:
    cmd = line.split()[0]
    if cmd == "digest":
        out("digest", hashlib.sha256(bytes(buf)).hexdigest())
    elif cmd == "launch":
        threading.Thread(target=launch).start()
    elif cmd == "gpalaunch":
        threading.Thread(target=gpalaunch).start()
    elif cmd == "drvlaunch":
        threading.Thread(target=drvlaunch).start()
    elif cmd == "spin":
        spinning.append(1)
        threading.Thread(target=spin, args=(line[len("spin"):].strip(),)).start()
        out("spinning")
    elif cmd == "unspin":
        spinning.clear()
        out("unspun")
    elif cmd == "free":
        out("freed", lib.cudaFree(p))
    elif cmd == "pinned":
        out("pinned", drv.fakecuda_registered())
"""


_BUILT: list[tuple[Path, Path]] = []


def built_once() -> tuple[Path, Path]:
    """The CUDA stand-ins, compiled once per test session (every worker of it loads the same two files)."""
    if not _BUILT:
        _BUILT.append(build(Path(tempfile.mkdtemp(prefix="cryosleep-fakecuda-"))))
    return _BUILT[0]


class Worker:
    def __init__(self, tmp: Path, nccl: bool = True, env: dict[str, str] | None = None, script: str = WORKER) -> None:
        cuda, cudart = built_once()
        fake = cuda.parent
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "worker.py").write_text(textwrap.dedent(script))
        (tmp / "devmem").mkdir()
        self.ctl = tmp / "rank-0.ctl"
        env = dict(os.environ, LD_PRELOAD=str(INTERCEPTOR), STANDIN_NCCL_LIB=str(STANDIN),
                   CRYOSLEEP_NCCL_CTL=str(self.ctl), CRYOSLEEP_DEVMEM="1", CRYOSLEEP_DEVMEM_DIR=str(tmp / "devmem"),
                   LD_LIBRARY_PATH=str(fake),
                   PYTHONPATH=os.pathsep.join([str(WORKLOADS), os.environ.get("PYTHONPATH", "")]), **(env or {}))
        self.proc = subprocess.Popen([sys.executable, str(tmp / "worker.py"), str(cudart), str(SIZE),
                                      "nccl" if nccl else "-"], env=env,
                                     text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.line(30).split()
        assert ready[0] == "ready", ready
        self.va, self.digest = int(ready[1], 16), ready[2]
        self.block = ControlBlock.wait(self.ctl, pid=self.proc.pid)
        self.driver = Driver({0: self.block})

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def line(self, timeout: float = 10) -> str:
        return self.lines.get(timeout=timeout)

    def say(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def ask(self, cmd: str) -> str:
        self.say(cmd)
        return self.line()

    def quiesce(self) -> None:
        deadline = time.monotonic() + 30
        self.driver.hold(deadline)
        drain(self.driver, deadline)
        self.driver.quiesce(deadline)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.block.close()
        self.proc.kill()
        self.proc.wait()

    def protection(self) -> str:
        """The permissions of the mapping that holds the allocation's first byte."""
        for row in Path(f"/proc/{self.proc.pid}/maps").read_text().splitlines():
            lo, hi = (int(x, 16) for x in row.split()[0].split("-"))
            if lo <= self.va < hi:
                return row.split()[1]
        return "unmapped"


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Worker]:
    with Worker(tmp_path) as w:
        yield w


def test_offload_releases_the_memory_and_reload_brings_it_back_at_the_same_address(worker: Worker) -> None:
    dm = worker.block.devmem
    assert dm.on and dm.count == 1 and dm.bytes >= SIZE and dm.stage_bytes == 0 and not dm.offloaded
    assert worker.driver.fast_ranks() == [0]
    assert worker.driver.prepare([0], time.monotonic() + 30) == {}  # while the job runs
    dm = worker.block.devmem
    assert dm.stage_bytes >= dm.bytes and Path(dm.stage_path).parent.name == "devmem"
    assert os.path.getsize(dm.stage_path) == dm.stage_bytes
    worker.quiesce()
    assert worker.driver.offload([0], time.monotonic() + 30) == {}
    dm = worker.block.devmem
    assert worker.block.state()[0] == State.OFFLOADED and dm.offloaded and dm.offload_bytes == dm.bytes
    with open(dm.stage_path, "rb") as f:  # the staging file holds the memory, byte for byte
        assert hashlib.sha256(f.read(SIZE)).hexdigest() == worker.digest
    assert worker.protection() == "---p"  # released: the range is reserved, nothing behind it
    worker.say("launch")  # the runtime gate holds work while the memory is out
    with pytest.raises(queue.Empty):
        worker.line(0.5)
    worker.driver.reload([0], time.monotonic() + 30)
    assert worker.line() == "launched 0"  # and lets it go once it is back
    assert worker.block.state()[0] == State.QUIESCED and not worker.block.devmem.offloaded
    assert worker.protection() == "rw-s"
    assert worker.ask("digest") == f"digest {worker.digest}"  # same address, same bytes
    worker.driver.resume()
    assert worker.block.state()[0] == State.RUNNING
    # a second capture reuses the staging file (prepared once)
    assert worker.driver.prepare([0], time.monotonic() + 30) == {}
    assert worker.block.devmem.stage_bytes == dm.stage_bytes
    assert worker.ask("free") == "freed 0"
    assert worker.block.devmem.bytes == 0 and worker.protection() == "unmapped"


@pytest.mark.parametrize("piece,calls", [("", 1), ("0", 1), ("1048576", 64), ("1000000", 67)])
def test_the_staging_file_is_pinned_whole_or_in_pieces(tmp_path: Path, piece: str, calls: int) -> None:
    """PREPARE pins the staging file (64 MiB here: 4 MiB + 1/8, in 64 MiB steps) in pieces of CRYOSLEEP_PIN_PIECE
    bytes (rounded up to whole pages: 1000000 -> 245 pages, 67 pieces, the last a short one; by default 256 MiB,
    so one piece here; 0: in one call), so that the process's other CUDA calls get a turn in between. The offload
    and reload split their copies where one piece ends and the next begins (the fake driver, like the real one,
    refuses a copy across two registrations), and the memory comes back whole."""
    with Worker(tmp_path, env={"CRYOSLEEP_PIN_PIECE": piece}) as w:
        assert w.driver.prepare([0], time.monotonic() + 30) == {}
        assert w.block.devmem.stage_bytes == 64 << 20
        assert w.ask("pinned") == f"pinned {calls}"
        w.quiesce()
        assert w.driver.offload([0], time.monotonic() + 30) == {}
        w.driver.reload([0], time.monotonic() + 30)
        assert w.ask("digest") == f"digest {w.digest}"


def test_a_piece_that_cannot_be_pinned_leaves_nothing_pinned(tmp_path: Path) -> None:
    """The 10th of 64 pieces fails (out of memory): PREPARE answers with the error, the nine pinned before it are
    unpinned, and no staging size is published (a snapshot takes the plain path for the rank)."""
    with Worker(tmp_path, env={"CRYOSLEEP_PIN_PIECE": "1048576", "FAKECUDA_FAIL_PIN_AT": "10"}) as w:
        failed = w.driver.prepare([0], time.monotonic() + 30)
        assert "pinning" in failed[0] and "CUDA error 2" in failed[0], failed
        assert w.ask("pinned") == "pinned 0" and w.block.devmem.stage_bytes == 0


def test_work_submitted_through_the_driver_waits_while_the_memory_is_out(worker: Worker) -> None:
    """cuBLAS and Triton launch through the driver API, not the runtime: the lookup (dlsym on libcuda, or
    cuGetProcAddress) hands them gated wrappers, so their work waits for RELOAD too."""
    worker.say("drvlaunch")
    assert worker.line() == "drvlaunched 0"  # gate open: straight through
    worker.say("gpalaunch")
    assert worker.line() == "gpalaunched 0 0"
    assert worker.driver.prepare([0], time.monotonic() + 30) == {}
    worker.quiesce()
    assert worker.driver.offload([0], time.monotonic() + 30) == {}
    worker.say("drvlaunch")
    worker.say("launch")  # the runtime's launch reaches the driver through cuGetProcAddress: gated twice, nested
    worker.say("gpalaunch")  # a pointer from cuGetProcAddress, itself found in the global scope
    with pytest.raises(queue.Empty):
        worker.line(0.5)
    worker.driver.reload([0], time.monotonic() + 30)
    got = sorted(worker.line() for _ in range(3))
    assert got == ["drvlaunched 0", "gpalaunched 0 0", "launched 0"]
    worker.driver.resume()


def test_a_thread_that_keeps_running_sends_the_rank_to_the_plain_path_untouched(worker: Worker) -> None:
    assert worker.driver.prepare([0], time.monotonic() + 30) == {}
    assert worker.ask("spin") == "spinning"  # a thread the gates never see, computing
    worker.quiesce()
    refused = worker.driver.offload([0], time.monotonic() + 30)
    assert "kept running while the job was held" in refused[0], refused
    assert re.search(r"\(python[\d.]*, state R, in syscall running, .* us of CPU in 3 ms\)", refused[0]), refused
    assert worker.block.state()[0] == State.QUIESCED and not worker.block.devmem.offloaded  # back for the plain path
    assert worker.protection() == "rw-s"
    assert worker.ask("unspin") == "unspun"
    assert worker.ask("digest") == f"digest {worker.digest}"
    worker.driver.resume()
    assert worker.block.state()[0] == State.RUNNING


def test_rebuild_brings_offloaded_memory_back_first(worker: Worker) -> None:
    """The rollback path: a capture that fails after OFFLOAD resumes with REBUILD, which reloads first."""
    assert worker.driver.prepare([0], time.monotonic() + 30) == {}
    worker.quiesce()
    assert worker.driver.offload([0], time.monotonic() + 30) == {}
    assert worker.protection() == "---p"
    worker.driver.resume()
    assert worker.block.state()[0] == State.RUNNING and not worker.block.devmem.offloaded
    assert worker.ask("digest") == f"digest {worker.digest}"


def test_a_worker_that_never_calls_nccl_gets_its_block_from_its_first_served_allocation(tmp_path: Path) -> None:
    """One-rank jobs: no communicator, yet the fast path's commands need the control block."""
    with Worker(tmp_path, nccl=False) as w:
        assert w.block.devmem.on and w.block.comms() == []
        assert w.driver.prepare([0], time.monotonic() + 30) == {}
        w.quiesce()  # nothing to drain or destroy
        assert w.driver.offload([0], time.monotonic() + 30) == {}
        assert w.protection() == "---p"
        w.driver.reload([0], time.monotonic() + 30)
        assert w.ask("digest") == f"digest {w.digest}"
        w.driver.resume()
        assert w.block.state()[0] == State.RUNNING


def test_nccls_ras_thread_may_run_during_the_copy(worker: Worker) -> None:
    """NCCL's RAS thread outlives the communicators and wakes from poll now and then; it submits no GPU work.
    On an H200 it ran during each of three copies of 24 GiB and the rank took the plain path: it is exempt by the
    name NCCL gives it (NCCL_SET_THREAD_NAME=1, set by `cryosleep run --fast-path`)."""
    assert worker.driver.prepare([0], time.monotonic() + 30) == {}
    assert worker.ask("spin NCCL RAS") == "spinning"
    worker.quiesce()
    assert worker.driver.offload([0], time.monotonic() + 30) == {}
    assert worker.block.devmem.offloaded and worker.protection() == "---p"
    worker.driver.reload([0], time.monotonic() + 30)
    assert worker.ask("unspin") == "unspun"
    assert worker.ask("digest") == f"digest {worker.digest}"
    worker.driver.resume()
