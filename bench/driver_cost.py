"""The CUDA driver's fixed cost: cuCheckpointProcessCheckpoint/Restore of a released context (issue 17).

    sudo PYTHONPATH=src:. python3 bench/driver_cost.py [--cycles 5] [--caller fresh,persistent,retained]
        [--loading lazy,eager] [--ctx bare,torch] [--mem-mb 0,1024] [--stand-in] [--json]

After the fast path's offload a worker's context holds almost no device memory, yet lock + checkpoint +
restore + unlock took 3.3-4.4 s per snapshot on the H200s (docs/benchmarks.md). This runs the four calls on a
small target process for every combination of what might explain it, and prints one table row per variant
(median seconds per call over ``--cycles``):

  caller    who calls the checkpoint API: ``fresh`` a new process per cycle (cuInit each time, timed apart),
            ``persistent`` this process (cuInit once), ``retained`` this process holding every GPU's primary
            context retained (as an agent that kept the driver warm would)
  loading   the target's CUDA_MODULE_LOADING: ``lazy`` (CUDA's default) or ``eager`` (every kernel of every
            loaded module on the GPU at start: a larger context)
  ctx       ``bare`` (a primary context, nothing loaded) or ``torch`` (PyTorch imported, a matmul run: cuBLAS's
            and PyTorch's modules loaded; needs torch with CUDA, skipped otherwise)
  mem-mb    device memory the target still holds at the checkpoint (0: released, as the fast path leaves it)

``--stand-in`` runs it on the CPU stand-in driver (tests/native/fakecuda), so that the script is known to work
on a machine without a GPU: THOSE NUMBERS MEAN NOTHING (the stand-in moves nothing; it only keeps each
process's checkpoint state), and the table says so.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryosleep.capture import cuda

CALLS = ("lock", "checkpoint", "restore", "unlock")

TARGET = r"""
import ctypes, sys, time
ctx_kind, mem_mb = sys.argv[1], int(sys.argv[2])
if ctx_kind == "torch":
    import torch
    a = torch.randn(1024, 1024, device="cuda")
    (a @ a).sum().item()
    del a
    torch.cuda.empty_cache()
cu = ctypes.CDLL("libcuda.so.1")
assert cu.cuInit(0) == 0
ctx = ctypes.c_void_p()
assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0 and cu.cuCtxSetCurrent(ctx) == 0
ptr = ctypes.c_uint64()
if mem_mb:
    assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mem_mb << 20)) == 0
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""

CALLER = r"""
import json, sys, time
from cryosleep.capture import cuda
pid = int(sys.argv[1])
t0 = time.perf_counter()
drv = cuda.driver()
out = {"init": time.perf_counter() - t0}
for name, call in (("lock", lambda: drv.lock(pid, 10.0)), ("checkpoint", lambda: drv.checkpoint(pid)),
                   ("restore", lambda: drv.restore(pid)), ("unlock", lambda: drv.unlock(pid))):
    t = time.perf_counter()
    call()
    out[name] = time.perf_counter() - t
print(json.dumps(out))
"""


def cycle_here(drv: cuda.CudaDriver, pid: int) -> dict[str, float]:
    out: dict[str, float] = {}
    calls: list[tuple[str, Callable[[], None]]] = [
        ("lock", lambda: drv.lock(pid, 10.0)), ("checkpoint", lambda: drv.checkpoint(pid)),
        ("restore", lambda: drv.restore(pid)), ("unlock", lambda: drv.unlock(pid))]
    for name, call in calls:
        t = time.perf_counter()
        call()
        out[name] = time.perf_counter() - t
    return out


def torch_cuda() -> bool:
    res = subprocess.run([sys.executable, "-c", "import torch; assert torch.cuda.is_available()"],
                         capture_output=True, check=False)
    return res.returncode == 0


def run_variant(drv: cuda.CudaDriver, env: dict[str, str], caller: str, loading: str, ctx: str, mem_mb: int,
                cycles: int) -> dict[str, Any]:
    tenv = dict(env, CUDA_MODULE_LOADING=loading.upper())
    target = subprocess.Popen([sys.executable, "-c", TARGET, ctx, str(mem_mb)], env=tenv, text=True,
                              stdout=subprocess.PIPE)
    try:
        assert target.stdout is not None
        if target.stdout.readline().strip() != "ready":
            raise SystemExit(f"the target ({ctx}, {mem_mb} MiB, {loading}) did not start")
        rows: list[dict[str, float]] = []
        for _ in range(cycles):
            if caller == "fresh":
                res = subprocess.run([sys.executable, "-c", CALLER, str(target.pid)], env=env, capture_output=True,
                                     text=True, check=True)
                rows.append(json.loads(res.stdout))
            else:
                rows.append(cycle_here(drv, target.pid))
            time.sleep(0.2)
    finally:
        target.kill()
        target.wait()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return {"caller": caller, "loading": loading, "ctx": ctx, "mem_mb": mem_mb, "cycles": cycles,
            **{k: round(v, 4) for k, v in med.items()}, "total": round(sum(med[k] for k in CALLS), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--caller", default="fresh,persistent,retained")
    p.add_argument("--loading", default="lazy,eager")
    p.add_argument("--ctx", default="bare,torch")
    p.add_argument("--mem-mb", default="0,1024")
    p.add_argument("--stand-in", action="store_true", help="the CPU stand-in driver: the numbers mean nothing")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    env = dict(os.environ)
    if a.stand_in:
        from tests.native.fakecuda.build import build

        fake = Path(tempfile.mkdtemp(prefix="cryosleep-fakecuda-"))
        lib, _ = build(fake)
        env.update(LD_LIBRARY_PATH=os.pathsep.join([str(fake), env.get("LD_LIBRARY_PATH", "")]),
                   FAKECUDA_STATE_DIR=str(fake))
        os.environ["FAKECUDA_STATE_DIR"] = str(fake)  # this process's calls, for the persistent callers
        drv = cuda.CudaDriver(ctypes.CDLL(str(lib)))
    else:
        drv = cuda.driver()
    ctxs = [c for c in a.ctx.split(",") if c]
    if "torch" in ctxs and (a.stand_in or not torch_cuda()):
        print("ctx torch skipped: " + ("the stand-in has no PyTorch kernels" if a.stand_in else
                                       "no PyTorch with CUDA here"), file=sys.stderr)
        ctxs.remove("torch")
    rows = []
    for caller, loading, ctx, mem in itertools.product(a.caller.split(","), a.loading.split(","), ctxs,
                                                       [int(x) for x in a.mem_mb.split(",")]):
        if caller == "retained":
            for g in drv.gpus():  # every GPU's primary context held by this process from here on
                dev, ctx_p = ctypes.c_int(), ctypes.c_void_p()
                drv.lib.cuDeviceGet(ctypes.byref(dev), g.index)
                drv.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx_p), dev)
        rows.append(run_variant(drv, env, caller, loading, ctx, mem, a.cycles))
    banner = ("STAND-IN DRIVER (tests/native/fakecuda): these numbers mean nothing; they show the script runs"
              if a.stand_in else f"CUDA driver {drv.version()}, {', '.join(g.name for g in drv.gpus())}")
    if a.json:
        print(json.dumps({"driver": banner, "stand_in": a.stand_in, "rows": rows}))
        return
    print(banner)
    cols = ["caller", "loading", "ctx", "mem_mb", *(["init"] if any("init" in r for r in rows) else []), *CALLS,
            "total"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in cols))


if __name__ == "__main__":
    main()
