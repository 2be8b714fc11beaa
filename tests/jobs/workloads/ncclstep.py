"""Shared by the NCCL job workloads: ranks from the launcher's environment (cryosleep run or torchrun), NCCL
through ctypes (tests/native/workloads/ncclbind.py; the CPU stand-in in CI), unique ids exchanged through
files, and one line per step, ``step N digest HEX``, the SHA-256 of the state (identical bit for bit to an
uninterrupted run, or the test fails).

Every workload takes ``--steps N --step-sleep S --dir DIR`` (DIR: where rank 0 of each communicator
created from an id publishes it), ``--stall RANK:STEP:SECONDS`` (that rank computes that long before the
NCCL calls of that step: a rank that does not reach a cut in time), ``--linger FILE`` (after the last
step, wait for FILE before ending: the job stays up for a test) and, where used, ``--extra-comms K``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "native" / "workloads"))

from ncclbind import FLOAT64, SUM, Nccl, addr, buffer, exchange_id, zeros

__all__ = ["FLOAT64", "SUM", "Job", "addr", "buffer", "init_values", "mix", "zeros"]


class Job:
    def __init__(self, extra: list[tuple[str, dict[str, Any]]] | None = None) -> None:
        p = argparse.ArgumentParser()
        p.add_argument("--steps", type=int, default=30)
        p.add_argument("--step-sleep", type=float, default=0.0)
        p.add_argument("--dir", type=Path, required=True)
        p.add_argument("--stall", default="", help="RANK:STEP:SECONDS")
        p.add_argument("--linger", type=Path, default=None, help="after the last step, wait for this file")
        p.add_argument("--extra-comms", type=int, default=0, help="split the world this many more times")
        for name, kw in extra or []:
            p.add_argument(name, **kw)
        self.args = p.parse_args()
        self.rank = int(os.environ["RANK"])
        self.nranks = int(os.environ["WORLD_SIZE"])
        # MASTER_PORT differs between runs (the reference and the job may share --dir)
        self.run = os.environ.get("MASTER_PORT", "0")
        self.nc = Nccl()
        self.stall = tuple(int(x) if i < 2 else float(x) for i, x in enumerate(self.args.stall.split(":"))) \
            if self.args.stall else None

    def comm(self, name: str, ranks: list[int] | None = None) -> int:
        """A communicator from a fresh unique id over ``ranks`` (default: all), created by its members."""
        ranks = ranks if ranks is not None else list(range(self.nranks))
        me = ranks.index(self.rank)
        self.args.dir.mkdir(parents=True, exist_ok=True)
        uid = exchange_id(self.nc, self.args.dir / f"uid-{name}-{self.run}", me)
        return self.nc.init(len(ranks), uid, me)

    def split(self, parent: int, color: int, key: int) -> int | None:
        return self.nc.split(parent, color, key)

    def call(self, name: str, *args: Any, comm: int | None = None) -> None:
        self.nc.check(name, *args, comm=comm)

    def allreduce(self, src: Any, dst: Any, comm: int, stream: int, op: int = SUM) -> None:
        self.call("ncclAllReduce", addr(src), addr(dst), len(src), FLOAT64, op, comm, stream, comm=comm)

    def broadcast(self, buf: Any, root: int, comm: int, stream: int) -> None:
        self.call("ncclBroadcast", addr(buf), addr(buf), len(buf), FLOAT64, root, comm, stream, comm=comm)

    def send(self, buf: Any, peer: int, comm: int, stream: int) -> None:
        self.call("ncclSend", addr(buf), len(buf), FLOAT64, peer, comm, stream, comm=comm)

    def recv(self, buf: Any, peer: int, comm: int, stream: int) -> None:
        self.call("ncclRecv", addr(buf), len(buf), FLOAT64, peer, comm, stream, comm=comm)

    def group(self) -> Any:
        job = self

        class _Group:
            def __enter__(self) -> None:
                job.call("ncclGroupStart")

            def __exit__(self, *exc: object) -> None:
                job.call("ncclGroupEnd")

        return _Group()

    def sync(self, *streams: int) -> None:
        for s in streams:
            self.nc.stream_sync(s)

    def before_step(self, step: int) -> None:
        """The configured stall, if it is this rank's and this step's."""
        if self.stall and self.stall[0] == self.rank and self.stall[1] == step:
            print(f"stalling at step {step}", flush=True)
            time.sleep(self.stall[2])

    def report(self, step: int, *bufs: Any) -> None:
        h = hashlib.sha256()
        for b in bufs:
            h.update(bytes(b))
        print(f"step {step} digest {h.hexdigest()[:16]}", flush=True)
        if self.args.step_sleep:
            time.sleep(self.args.step_sleep)

    def extra_comms(self, world: int) -> list[int]:
        """``--extra-comms`` splits of the world, kept alive and unused (more than 64 is refused)."""
        out = []
        for _ in range(self.args.extra_comms):
            c = self.split(world, 0, self.rank)
            assert c is not None
            out.append(c)
        return out

    def finish(self, *comms: int | None) -> None:
        if self.args.linger is not None:
            while not self.args.linger.exists():
                time.sleep(0.05)
        for c in comms:
            if c is not None:
                self.call("ncclCommFinalize", c, comm=c)
                self.call("ncclCommDestroy", c, comm=c)
        print(f"done rank {self.rank}", flush=True)


def init_values(rank: int, n: int, salt: int = 0) -> list[float]:
    return [((rank + 1) * (i + 3) + salt) % 17 / 7.0 for i in range(n)]


def mix(a: Any, b: Any, k: float) -> None:
    """a := (a + k*b) mod 1000, element-wise, in place (deterministic float arithmetic)."""
    for i in range(len(a)):
        a[i] = (a[i] + k * b[i]) % 1000.0

