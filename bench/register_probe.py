"""Does pinning a large staging file while NCCL collectives run stall or hang the training (issue 6)?

    sudo NCCL_NVLS_ENABLE=0 python3 bench/register_probe.py --gib 24 --mode whole chunk none

Two processes on GPUs 0 and 1 run an all-reduce + matmul loop over NCCL (10 ms apart). In each process, a side
thread waits 3 s, then makes a --gib GiB MAP_SHARED staging file on /dev/shm (fallocate, mmap), and pins it
with cuMemHostRegister (flags 0, the device's context current) either in one call (--mode whole) or in 1 GiB
calls (--mode chunk), or not at all (--mode none: the loop's own rhythm). The loop runs until the pinning is
done plus 5 s on both ranks (they agree on the step to stop after), or --limit seconds. Each rank prints one
JSON line: steps, steps made while the pinning ran, median and longest gap between steps, how long the
fallocate and the pinning took. A rank still running --limit + 60 s after it started is reported hung, with
its threads' kernel wait channels. Nothing here is part of Cryosleep itself.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import mmap
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

GiB = 1 << 30


def pin(lib: ctypes.CDLL, addr: int, size: int, chunk: int) -> None:
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    off = 0
    while off < size:
        n = min(chunk, size - off)
        rc = lib.cuMemHostRegister_v2(ctypes.c_void_p(addr + off), ctypes.c_size_t(n), 0)
        if rc != 0:
            raise RuntimeError(f"cuMemHostRegister failed: CUDA error {rc}")
        off += n


def side(rank: int, gib: int, mode: str, out: dict[str, Any], done: threading.Event) -> None:
    import torch

    torch.cuda.set_device(rank)
    time.sleep(3)
    path = Path(f"/dev/shm/cryosleep-register-probe-{rank}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        t = time.monotonic()
        os.posix_fallocate(fd, 0, gib * GiB)
        m = mmap.mmap(fd, gib * GiB, mmap.MAP_SHARED)
        out["fallocate_s"] = round(time.monotonic() - t, 2)
        out["pin_start"] = time.monotonic()
        if mode != "none":
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            lib = ctypes.CDLL("libcuda.so.1")
            pin(lib, addr, gib * GiB, gib * GiB if mode == "whole" else GiB)
        out["pin_s"] = round(time.monotonic() - out["pin_start"], 2)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
        done.set()


def worker(rank: int, a: argparse.Namespace, mode: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    x = torch.ones(16 << 20, device=dev)
    w = torch.randn(2048, 2048, device=dev)
    out: dict[str, Any] = {"rank": rank, "mode": mode, "gib": a.gib}
    done = threading.Event()
    threading.Thread(target=side, args=(rank, a.gib, mode, out, done), daemon=True).start()
    times: list[float] = []
    end = time.monotonic() + a.limit
    flag = torch.zeros(1, device=dev)
    while True:
        dist.all_reduce(x)
        (w @ w).sum().item()
        times.append(time.monotonic())
        settled = done.is_set() and times[-1] > out.get("pin_start", 0) + out.get("pin_s", 0) + 5
        over = time.monotonic() > end or settled
        flag.fill_(1.0 if over else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # both ranks stop after the same step
        if flag.item() > 0:
            break
        time.sleep(0.01)
    gaps = sorted(b - c for c, b in itertools.pairwise(times))
    pin_start = out.pop("pin_start", None)
    if pin_start is not None:  # steps made while the pinning ran
        out["steps_while_pinning"] = sum(pin_start <= t <= pin_start + out.get("pin_s", a.limit) for t in times)
    out.update(steps=len(times), median_gap_s=round(gaps[len(gaps) // 2], 4) if gaps else None,
               longest_gap_s=round(gaps[-1], 2) if gaps else None, pinning_done=done.is_set())
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()


def child(a: argparse.Namespace, mode: str) -> int:
    """Both ranks of one mode, in their own processes; a hang is reported with the threads' wait channels."""
    import subprocess

    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--gib", str(a.gib), "--mode", mode,
                               "--limit", str(a.limit), "--port", str(a.port)]) for r in range(2)]
    deadline = time.monotonic() + a.limit + 60
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.5)
    rc = 0
    for p in procs:
        if p.poll() is None:
            rc = 1
            tasks = Path(f"/proc/{p.pid}/task")
            chans = {t.name: (t / "wchan").read_text() for t in tasks.iterdir()} if tasks.exists() else {}
            print(json.dumps({"mode": mode, "hung_pid": p.pid, "wchan": chans}), flush=True)
            p.kill()
        p.wait()
    return rc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=int, default=24)
    p.add_argument("--mode", nargs="+", default=["none", "whole", "chunk"], choices=["none", "whole", "chunk"])
    p.add_argument("--limit", type=float, default=60.0, help="longest a mode runs, seconds")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank >= 0:
        worker(a.rank, a, a.mode[0])
        return
    rc = 0
    for i, mode in enumerate(a.mode):
        a.port += i
        rc |= child(a, mode)
    sys.exit(rc)


if __name__ == "__main__":
    main()
