"""One rank of a small NCCL job that runs one test case and prints its results as JSON.

    collectives.py CASE RANK NRANKS DIR

Inputs are a pure function of (rank, index, salt) (`inputs` below), so the test computes the
expected results itself. Stream keys are plain integers: the stand-in uses them as keys only.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

from ncclbind import (
    AVG,
    FLOAT32,
    FLOAT64,
    INT8,
    INT32,
    INT64,
    MAX,
    MIN,
    NOCOLOR,
    PROD,
    SUM,
    UINT8,
    UINT32,
    UINT64,
    Nccl,
    NcclError,
    addr,
    buffer,
    exchange_id,
    zeros,
)

STREAM = 0x5100
ALL_TYPES = [INT8, UINT8, INT32, UINT32, INT64, UINT64, FLOAT32, FLOAT64]
ALL_OPS = [SUM, PROD, MAX, MIN, AVG]


def f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def inputs(rank: int, n: int, dtype: int, salt: int = 0) -> list[Any]:
    """Small values, so that products of a few ranks stay in range for every type."""
    out: list[Any] = []
    for i in range(n):
        h = (rank * 2654435761 + i * 40503 + salt * 97) % 1000003
        if dtype in (FLOAT32, FLOAT64):
            v = (h % 20011) / 1013.0 - 9.5
            out.append(f32(v) if dtype == FLOAT32 else v)
        elif dtype in (UINT8, UINT32, UINT64):
            out.append(h % 5 + 1)
        else:
            out.append(h % 7 - 3)
    return out


def digest(buf: ctypes.Array[Any]) -> str:
    return hashlib.sha256(bytes(buf)).hexdigest()[:16]


def values(buf: ctypes.Array[Any]) -> list[Any]:
    return list(buf)


def case_allreduce(nc: Nccl, comm: int, rank: int, nranks: int) -> dict[str, Any]:
    out = {}
    for dt in ALL_TYPES:
        for op in ALL_OPS:
            send = buffer(dt, inputs(rank, 33, dt, salt=op))
            recv = zeros(dt, 33)
            nc.check("ncclAllReduce", addr(send), addr(recv), 33, dt, op, comm, STREAM, comm=comm)
            nc.stream_sync(STREAM)
            out[f"{dt}/{op}"] = values(recv)
    # in place
    buf = buffer(FLOAT64, inputs(rank, 10, FLOAT64, salt=7))
    nc.check("ncclAllReduce", addr(buf), addr(buf), 10, FLOAT64, SUM, comm, STREAM, comm=comm)
    nc.stream_sync(STREAM)
    out["inplace"] = values(buf)
    return out


def case_determinism(nc: Nccl, comm: int, rank: int, nranks: int) -> dict[str, Any]:
    n = 100_000
    out: dict[str, Any] = {}
    for dt in (FLOAT32, FLOAT64):
        send = buffer(dt, inputs(rank, n, dt, salt=11))
        recv = zeros(dt, n)
        for _ in range(3):  # the same every time, and the same on every rank
            nc.check("ncclAllReduce", addr(send), addr(recv), n, dt, SUM, comm, STREAM, comm=comm)
            nc.stream_sync(STREAM)
            out.setdefault(str(dt), []).append(digest(recv))
    return out


def case_others(nc: Nccl, comm: int, rank: int, nranks: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    n = 6
    send = buffer(INT64, inputs(rank, n, INT64))
    recv = zeros(INT64, n)
    nc.check("ncclBroadcast", addr(send), addr(recv), n, INT64, nranks - 1, comm, STREAM, comm=comm)
    nc.stream_sync(STREAM)
    out["broadcast"] = values(recv)

    recv = zeros(INT64, n)
    nc.check("ncclReduce", addr(send), addr(recv), n, INT64, MAX, 1 % nranks, comm, STREAM, comm=comm)
    nc.stream_sync(STREAM)
    out["reduce"] = values(recv)

    gathered = zeros(INT64, n * nranks)
    nc.check("ncclAllGather", addr(send), addr(gathered), n, INT64, comm, STREAM, comm=comm)
    nc.stream_sync(STREAM)
    out["allgather"] = values(gathered)

    big = buffer(FLOAT64, inputs(rank, n * nranks, FLOAT64))
    part = zeros(FLOAT64, n)
    nc.check("ncclReduceScatter", addr(big), addr(part), n, FLOAT64, SUM, comm, STREAM, comm=comm)
    nc.stream_sync(STREAM)
    out["reducescatter"] = values(part)

    a2a_in = buffer(INT32, inputs(rank, n * nranks, INT32))
    a2a_out = zeros(INT32, n * nranks)
    nc.check("ncclAlltoAll", addr(a2a_in), addr(a2a_out), n, INT32, comm, STREAM, comm=comm)
    nc.stream_sync(STREAM)
    out["alltoall"] = values(a2a_out)

    # a ring: everyone sends to the right and receives from the left, in one group (no deadlock)
    ring_in = zeros(INT64, n)
    nc.check("ncclGroupStart")
    nc.check("ncclSend", addr(send), n, INT64, (rank + 1) % nranks, comm, STREAM, comm=comm)
    nc.check("ncclRecv", addr(ring_in), n, INT64, (rank - 1) % nranks, comm, STREAM, comm=comm)
    nc.check("ncclGroupEnd")
    nc.stream_sync(STREAM)
    out["ring"] = values(ring_in)

    # big messages both ways at once between pairs: needs concurrent progress
    m = 4 << 20
    if nranks % 2 == 0:
        peer = rank ^ 1
        bsend = (ctypes.c_uint8 * m)()
        ctypes.memset(bsend, rank + 1, 16)
        bsend[m - 1] = 200 + rank
        brecv = (ctypes.c_uint8 * m)()
        nc.check("ncclGroupStart")
        nc.check("ncclSend", addr(bsend), m, UINT8, peer, comm, STREAM, comm=comm)
        nc.check("ncclRecv", addr(brecv), m, UINT8, peer, comm, STREAM, comm=comm)
        nc.check("ncclGroupEnd")
        nc.stream_sync(STREAM)
        out["bigpair"] = [brecv[0], brecv[15], brecv[16], brecv[m - 1]]
    return out


def case_split(nc: Nccl, comm: int, rank: int, nranks: int) -> dict[str, Any]:
    # even and odd ranks, ordered by descending rank; the last rank takes no part
    color = NOCOLOR if rank == nranks - 1 else rank % 2
    sub = nc.split(comm, color, -rank)
    out: dict[str, Any] = {"null": sub is None}
    if sub is not None:
        out["sub_rank"] = nc.query("ncclCommUserRank", sub)
        out["sub_count"] = nc.query("ncclCommCount", sub)
        send = buffer(INT64, [rank])
        gathered = zeros(INT64, out["sub_count"])
        nc.check("ncclAllGather", addr(send), addr(gathered), 1, INT64, sub, STREAM, comm=sub)
        nc.stream_sync(STREAM)
        out["members"] = values(gathered)
    # the parent still works, and so does a split of the split
    one = buffer(INT32, [1])
    total = zeros(INT32, 1)
    nc.check("ncclAllReduce", addr(one), addr(total), 1, INT32, SUM, comm, STREAM, comm=comm)
    nc.stream_sync(STREAM)
    out["parent_sum"] = total[0]
    if sub is not None:
        nc.check("ncclCommDestroy", sub, comm=sub)
    return out


def case_async(nc: Nccl, comm: int, rank: int, nranks: int) -> dict[str, Any]:
    """Calls return before data moves; synchronize waits. The last rank joins late."""
    n = 1000
    bufs = [buffer(FLOAT64, inputs(rank, n, FLOAT64, salt=k)) for k in range(8)]
    outs = [buffer(FLOAT64, [-1.0] * n) for _ in range(8)]
    if rank == nranks - 1:
        time.sleep(0.5)
    t0 = time.monotonic()
    for k in range(8):
        nc.check("ncclAllReduce", addr(bufs[k]), addr(outs[k]), n, FLOAT64, SUM, comm, STREAM + k % 2, comm=comm)
    enqueue_s = time.monotonic() - t0
    untouched = all(o[0] == -1.0 for o in outs)
    nc.stream_sync(STREAM)
    nc.stream_sync(STREAM + 1)
    nc.comm_sync(comm)
    return {"enqueue_s": enqueue_s, "untouched": untouched, "sync_s": time.monotonic() - t0,
            "results": [digest(o) for o in outs], "first": [o[0] for o in outs]}


def case_peer_dies(nc: Nccl, comm: int, rank: int, nranks: int) -> dict[str, Any]:
    if rank == nranks - 1:
        os._exit(0)
    buf = buffer(FLOAT64, [1.0] * 4)
    t0 = time.monotonic()
    code = 0
    try:
        nc.check("ncclAllReduce", addr(buf), addr(buf), 4, FLOAT64, SUM, comm, STREAM, comm=comm)
        nc.stream_sync(STREAM)
    except NcclError as e:
        code = e.code
    err = ctypes.c_int()
    nc.check("ncclCommGetAsyncError", comm, ctypes.byref(err), comm=comm)
    text = nc.lib.ncclGetLastError(comm).decode()
    nc.check("ncclCommAbort", comm)
    return {"code": code, "async": err.value, "text": text, "seconds": time.monotonic() - t0}


def case_bad_args(nc: Nccl, comm: int, rank: int, nranks: int) -> dict[str, Any]:
    buf = buffer(FLOAT64, [1.0])
    return {
        "float16": nc.call("ncclAllReduce", addr(buf), addr(buf), 1, 6, SUM, comm, STREAM),
        "bad_op": nc.call("ncclAllReduce", addr(buf), addr(buf), 1, FLOAT64, 17, comm, STREAM),
        "bad_root": nc.call("ncclBroadcast", addr(buf), addr(buf), 1, FLOAT64, nranks, comm, STREAM),
        "init_all": nc.call("ncclCommInitAll", None, 2, None),
        "last_error": nc.lib.ncclGetLastError(None).decode(),
    }


def case_fork(nc: Nccl, comm: int, rank: int, nranks: int) -> dict[str, Any]:
    """A forked child calling NCCL must not touch its parent's control block."""
    buf = buffer(FLOAT64, [1.0])
    nc.check("ncclAllReduce", addr(buf), addr(buf), 1, FLOAT64, SUM, comm, STREAM, comm=comm)
    nc.stream_sync(STREAM)
    pid = os.fork()
    if pid == 0:
        nc.call("ncclAllReduce", addr(buf), addr(buf), 1, FLOAT64, SUM, comm, STREAM)  # never runs: no thread
        os._exit(0)
    os.waitpid(pid, 0)
    nc.check("ncclAllReduce", addr(buf), addr(buf), 1, FLOAT64, SUM, comm, STREAM, comm=comm)
    nc.stream_sync(STREAM)
    seq = None
    path = os.environ.get("CRYOSLEEP_NCCL_CTL")
    if path:
        with open(path, "rb") as f:
            seq = struct.unpack_from("<Q", f.read(4096 + 64), 4096 + 48)[0]  # slot 0's seq
    return {"seq": seq, "value": buf[0]}


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def main() -> None:
    case, rank, nranks, workdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    nc = Nccl()
    uid = exchange_id(nc, workdir / "uid", rank)
    comm = nc.init(nranks, uid, rank)
    result: dict[str, Any] = {"rank": rank, "version": nc.version(),
                              "count": nc.query("ncclCommCount", comm), "user_rank": nc.query("ncclCommUserRank", comm)}
    result.update(CASES[case](nc, comm, rank, nranks))
    if case != "peer_dies":
        nc.check("ncclCommFinalize", comm, comm=comm)
        nc.check("ncclCommDestroy", comm, comm=comm)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
