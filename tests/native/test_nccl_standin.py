"""The CPU stand-in NCCL: results, determinism, asynchrony and errors, in real multi-process jobs."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

import pytest
from collectives import ALL_OPS, ALL_TYPES, f32, inputs
from nccl_jobs import run
from ncclbind import AVG, FLOAT32, FLOAT64, INT8, INT32, INT64, MAX, PROD, SUM, UINT8, UINT32, UINT64

BITS = {INT8: 8, UINT8: 8, INT32: 32, UINT32: 32, INT64: 64, UINT64: 64}
SIGNED = {INT8, INT32, INT64}


def wrap(v: int, dt: int) -> int:
    bits = BITS[dt]
    v &= (1 << bits) - 1
    return v - (1 << bits) if dt in SIGNED and v >= 1 << (bits - 1) else v


def fold(a: Any, b: Any, dt: int, op: int) -> Any:
    """One step of the stand-in's rank-order reduction, with C's arithmetic for the type."""
    if op in (SUM, AVG):
        r = a + b
    elif op == PROD:
        r = a * b
    elif op == MAX:
        r = b if b > a else a
    else:
        r = b if b < a else a
    if dt == FLOAT32:
        return f32(r)
    return r if dt == FLOAT64 else wrap(r, dt)


def reduce_ranks(blocks: list[list[Any]], dt: int, op: int) -> list[Any]:
    acc = list(blocks[0])
    for blk in blocks[1:]:
        acc = [fold(a, b, dt, op) for a, b in zip(acc, blk, strict=True)]
    if op == AVG:
        n = len(blocks)
        if dt == FLOAT64:
            acc = [a / n for a in acc]
        elif dt == FLOAT32:
            acc = [f32(a / n) for a in acc]
        else:
            acc = [wrap(int(a / n), dt) for a in acc]  # C division truncates toward zero
    return acc


def by_rank(out: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = [o[-1] for o in out]
    assert [r["rank"] for r in rows] == list(range(len(rows)))
    return rows


@pytest.mark.parametrize("nranks", [2, 4])
def test_allreduce_every_type_and_op(tmp_path: Path, nranks: int) -> None:
    rows = by_rank(run("collectives.py", nranks, tmp_path, ["allreduce", "{rank}", "{nranks}", "{dir}"]))
    for dt in ALL_TYPES:
        for op in ALL_OPS:
            want = reduce_ranks([inputs(r, 33, dt, salt=op) for r in range(nranks)], dt, op)
            for row in rows:
                assert row[f"{dt}/{op}"] == want, (dt, op, row["rank"])
    inplace = reduce_ranks([inputs(r, 10, FLOAT64, salt=7) for r in range(nranks)], FLOAT64, SUM)
    assert all(row["inplace"] == inplace for row in rows)
    assert all(row["version"] == 22809 and row["count"] == nranks for row in rows)
    assert [row["user_rank"] for row in rows] == list(range(nranks))


def test_allreduce_is_bit_deterministic(tmp_path: Path) -> None:
    """Floating-point sums are folded in rank order: the same bits on every rank, every call, every
    run, and the bits a rank-order sum gives."""
    runs = [by_rank(run("collectives.py", 4, tmp_path / str(i), ["determinism", "{rank}", "4", "{dir}"]))
            for i in range(2)]
    digests = {d for rows in runs for row in rows for d in row[str(FLOAT64)] + row[str(FLOAT32)]}
    assert len(digests) == 2  # one for float64, one for float32
    blocks = [inputs(r, 100_000, FLOAT64, salt=11) for r in range(4)]
    acc = blocks[0]
    for blk in blocks[1:]:
        acc = [a + b for a, b in zip(acc, blk, strict=True)]
    want = hashlib.sha256(struct.pack(f"{len(acc)}d", *acc)).hexdigest()[:16]
    assert runs[0][0][str(FLOAT64)][0] == want


@pytest.mark.parametrize("nranks", [2, 4])
def test_broadcast_reduce_gather_scatter_p2p(tmp_path: Path, nranks: int) -> None:
    rows = by_rank(run("collectives.py", nranks, tmp_path, ["others", "{rank}", "{nranks}", "{dir}"]))
    n = 6
    for rank, row in enumerate(rows):
        assert row["broadcast"] == inputs(nranks - 1, n, INT64)
        if rank == 1 % nranks:
            assert row["reduce"] == reduce_ranks([inputs(r, n, INT64) for r in range(nranks)], INT64, MAX)
        assert row["allgather"] == [v for r in range(nranks) for v in inputs(r, n, INT64)]
        blocks = [inputs(r, n * nranks, FLOAT64)[rank * n:(rank + 1) * n] for r in range(nranks)]
        assert row["reducescatter"] == reduce_ranks(blocks, FLOAT64, SUM)
        mine = slice(rank * n, (rank + 1) * n)
        assert row["alltoall"] == [v for r in range(nranks) for v in inputs(r, n * nranks, INT32)[mine]]
        assert row["ring"] == inputs((rank - 1) % nranks, n, INT64)
        peer = rank ^ 1
        assert row["bigpair"] == [peer + 1, peer + 1, 0, 200 + peer]


def test_split_with_nocolor(tmp_path: Path) -> None:
    rows = by_rank(run("collectives.py", 4, tmp_path, ["split", "{rank}", "4", "{dir}"]))
    # colors: rank 0 -> 0, rank 1 -> 1, rank 2 -> 0, rank 3 -> NOCOLOR; keys -rank order them downwards
    assert rows[3]["null"] is True
    assert (rows[0]["sub_rank"], rows[0]["sub_count"], rows[0]["members"]) == (1, 2, [2, 0])
    assert (rows[2]["sub_rank"], rows[2]["sub_count"], rows[2]["members"]) == (0, 2, [2, 0])
    assert (rows[1]["sub_rank"], rows[1]["sub_count"], rows[1]["members"]) == (0, 1, [1])
    assert all(row["parent_sum"] == 4 for row in rows)


def test_calls_enqueue_and_synchronize_waits(tmp_path: Path) -> None:
    """The last rank joins 0.5 s late: the others' calls return at once, the data moves later."""
    rows = by_rank(run("collectives.py", 3, tmp_path, ["async", "{rank}", "3", "{dir}"]))
    for row in rows[:2]:
        assert row["enqueue_s"] < 0.2
        assert row["untouched"] is True
        assert row["sync_s"] >= 0.3
    want = [sum(inputs(r, 1000, FLOAT64, salt=k)[0] for r in range(3)) for k in range(8)]
    for row in rows:
        assert row["first"] == pytest.approx(want, rel=0, abs=1e-12)
        assert row["results"] == rows[0]["results"]


def test_vanished_peer_gives_remote_error(tmp_path: Path) -> None:
    out = run("collectives.py", 3, tmp_path, ["peer_dies", "{rank}", "3", "{dir}"],
              env={"STANDIN_NCCL_TIMEOUT_S": "5"})
    for rows in out[:2]:
        row = rows[-1]
        assert row["code"] == 6 and row["async"] == 6  # ncclRemoteError, from sync and from the comm
        assert "connection to peer" in row["text"] or "no progress" in row["text"]
        assert row["seconds"] < 5.5


def test_invalid_arguments_are_returned_not_fatal(tmp_path: Path) -> None:
    rows = by_rank(run("collectives.py", 2, tmp_path, ["bad_args", "{rank}", "2", "{dir}"]))
    for row in rows:
        assert (row["float16"], row["bad_op"], row["bad_root"], row["init_all"]) == (4, 4, 4, 5)
        assert "ncclCommInitAll" in row["last_error"]
