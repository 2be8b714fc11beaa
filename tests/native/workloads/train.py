"""One rank of a small "training" job: a fixed number of steps, each a fixed set of NCCL calls.

    train.py RANK NRANKS DIR STEPS STEP_SLEEP_S

Communicators, in creation order:
  world   from a unique id (ids rebuilt through the agent)
  sub     split of world by rank parity (replayed as a split at rebuild)
  solo    split of world where rank 0 passes NCCL_SPLIT_NOCOLOR (a NOCOLOR replay on rank 0)
  child   split of `temp` (a split of world destroyed right away): an orphan, rebuilt from an id
  (gone)  a split of world destroyed right away: replayed at rebuild, then destroyed again
and one registered buffer on world (re-registered at rebuild, deregistered at the end).
Per step: world allreduce + broadcast, a ring send/recv in one group, sub allreduce(max),
child allgather, solo allreduce. Exactly 2 world collectives and one send and one receive per
step, after the 4 splits of world at set-up (a split counts as a collective of its parent), which
the tests rely on. Prints one JSON line per step with a digest of the state.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
import time
from pathlib import Path

from ncclbind import FLOAT64, INT64, MAX, NOCOLOR, SUM, Nccl, addr, buffer, exchange_id, zeros

N = 64
STREAM = 0x7100


def main() -> None:
    rank, nranks, workdir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    steps, pause = int(sys.argv[4]), float(sys.argv[5])
    nc = Nccl()
    world = nc.init(nranks, exchange_id(nc, workdir / "uid", rank), rank)
    sub = nc.split(world, rank % 2, rank)
    solo = nc.split(world, NOCOLOR if rank == 0 else 0, -rank)
    temp = nc.split(world, 0, rank)
    assert temp is not None
    child = nc.split(temp, rank // 2, rank)
    nc.check("ncclCommDestroy", temp, comm=temp)
    gone = nc.split(world, 0, rank)
    nc.check("ncclCommDestroy", gone, comm=gone)
    assert sub is not None and child is not None

    x = buffer(FLOAT64, [((rank + 1) * (i + 3)) % 17 / 7.0 for i in range(N)])
    y = zeros(FLOAT64, N)
    left = zeros(FLOAT64, N)
    peak = zeros(FLOAT64, N)
    counts = zeros(INT64, nranks)
    mine = buffer(INT64, [0])
    child_n = nc.query("ncclCommCount", child)
    gathered = zeros(INT64, child_n)
    solo_out = zeros(INT64, 1)
    handle = ctypes.c_void_p()
    nc.check("ncclCommRegister", world, addr(x), ctypes.sizeof(x), ctypes.byref(handle), comm=world)
    print(json.dumps({"ready": True}), flush=True)
    for step in range(steps):
        nc.check("ncclAllReduce", addr(x), addr(y), N, FLOAT64, SUM, world, STREAM, comm=world)
        nc.check("ncclBroadcast", addr(y), addr(y), N, FLOAT64, step % nranks, world, STREAM, comm=world)
        nc.check("ncclGroupStart")
        nc.check("ncclSend", addr(y), N, FLOAT64, (rank + 1) % nranks, world, STREAM, comm=world)
        nc.check("ncclRecv", addr(left), N, FLOAT64, (rank - 1) % nranks, world, STREAM, comm=world)
        nc.check("ncclGroupEnd")
        nc.check("ncclAllReduce", addr(left), addr(peak), N, FLOAT64, MAX, sub, STREAM, comm=sub)
        mine[0] = step * 100 + rank
        nc.check("ncclAllGather", addr(mine), addr(gathered), 1, INT64, child, STREAM, comm=child)
        if solo is not None:
            nc.check("ncclAllReduce", addr(mine), addr(solo_out), 1, INT64, SUM, solo, STREAM, comm=solo)
        nc.stream_sync(STREAM)
        for i in range(N):
            x[i] = (y[i] / nranks + peak[i] * 0.25 + left[i] * 0.125) % 1000.0
        counts[step % nranks] += sum(gathered) + solo_out[0]
        digest = hashlib.sha256(bytes(x) + bytes(counts)).hexdigest()[:16]
        print(json.dumps({"step": step, "digest": digest}), flush=True)
        time.sleep(pause)
    nc.check("ncclCommDeregister", world, handle, comm=world)
    for comm in (child, solo, sub, world):
        if comm is not None:
            nc.check("ncclCommFinalize", comm, comm=comm)
            nc.check("ncclCommDestroy", comm, comm=comm)
    print(json.dumps({"done": True, "x0": x[0]}), flush=True)


if __name__ == "__main__":
    main()
