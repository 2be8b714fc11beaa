"""Cutting image files into chunks: fixed-size, or content-defined (CDC), optionally page-aligned.

Fixed-size cuts at every ``size`` bytes. It costs nothing, and two files share a chunk only where they
share aligned ``size``-byte blocks. That is rarer than it looks in CRIU images: a pages image holds a
process's dumped pages back to back, so the same tensor in two ranks (data-parallel replicas) starts at
offsets that differ by some number of pages, and fixed-size chunks of the two never match.

Content-defined chunking cuts where the content says so, so shifted content is cut the same way. A
byte-at-a-time rolling hash (gear, FastCDC) in Python runs at a few MB/s; this one is vectorised with
numpy. The hash at position ``i`` is the sum (mod 2**32) of a random 32-bit value per byte over the
``WINDOW`` bytes ending at ``i``, computed for a whole block at once from a cumulative sum
(``c[i+1] - c[i+1-WINDOW]``), then multiplied by an odd constant so that its top bits mix every byte; a
position is a *candidate* cut when the top ``bits`` bits are zero. The sequential part, choosing cuts from
candidates under the ``min``/``max`` chunk sizes, runs once per chunk, not per byte. The cuts depend only
on the content, never on how the file was read (block size, offsets).

Page-aligned CDC (``align=4096``) considers only cuts at multiples of 4 KiB and hashes only the window
before each of them: one window per page instead of one per byte, about ten times faster, and exactly as
good on CRIU's pages images, whose content only ever moves by whole pages.

``docs/storage.md`` has what each finds on real CRIU images, and why the default is what it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO, Literal

import numpy as np
import numpy.typing as npt

__all__ = ["DEFAULT", "WINDOW", "ChunkSpec", "chunk_stream", "iter_chunks"]

WINDOW = 48  # bytes in the rolling window
_READ = 4 << 20  # bytes hashed per numpy pass (measured fastest: 16 MiB of uint32 temporaries)
_MULT = np.uint32(0x9E3779B1)  # odd: a bijection on uint32 that spreads every bit upwards
_GEAR: npt.NDArray[np.uint32] = np.random.default_rng(0x43727953).integers(0, 2**32, 256, dtype=np.uint32)


@dataclass(frozen=True)
class ChunkSpec:
    """How a snapshot's files are cut; recorded in its manifest.

    ``method``: "fixed" (cut every ``avg`` bytes) or "cdc" (content-defined: cuts between ``min`` and
    ``max`` bytes apart, at ``avg`` bytes on average).
    """

    method: Literal["fixed", "cdc"] = "fixed"
    avg: int = 4 << 20
    min: int = 0  # cdc only; 0: avg // 4
    max: int = 0  # cdc only; 0: avg * 4
    align: int = 1  # cdc only: cut only at multiples of this (4096: page boundaries, see the module docstring)

    @property
    def lo(self) -> int:
        return self.min or max(1, self.avg // 4)

    @property
    def hi(self) -> int:
        return self.max or self.avg * 4

    @property
    def bits(self) -> int:
        """Candidate density: one (aligned) position in 2**bits, so that min + align * 2**bits is about avg."""
        return max(1, int((self.avg - self.lo) // self.align).bit_length() - 1)

    def to_json(self) -> dict[str, object]:
        if self.method == "fixed":
            return {"method": "fixed", "size": self.avg}
        return {"method": "cdc", "avg": self.avg, "min": self.lo, "max": self.hi, "align": self.align,
                "window": WINDOW, "hash": "gear-sum32"}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> ChunkSpec:
        if d.get("method") == "fixed":
            return cls("fixed", int(str(d["size"])))
        if d.get("method") == "cdc":
            return cls("cdc", int(str(d["avg"])), int(str(d["min"])), int(str(d["max"])), int(str(d.get("align", 1))))
        raise ValueError(f"unknown chunking method {d.get('method')!r}")

    def __post_init__(self) -> None:
        if self.avg <= 0 or (self.method == "cdc" and not 2 * WINDOW <= self.lo <= self.avg <= self.hi):
            raise ValueError(f"invalid chunk sizes: {self} (cdc needs {2 * WINDOW} <= min <= avg <= max)")
        if self.align < 1 or (self.align > 1 and (self.lo % self.align or self.hi % self.align)):
            raise ValueError(f"invalid alignment: {self} (min and max must be multiples of align)")


# Chosen from the measurements in docs/storage.md.
DEFAULT = ChunkSpec("cdc", 1 << 20, align=4096)


def candidates(data: bytes | bytearray | memoryview, bits: int, align: int = 1,
               phase: int = 0) -> npt.NDArray[np.int64]:
    """Positions ``p`` (cut *after* byte ``p - 1``) where the window of WINDOW bytes ending at byte
    ``p - 1`` hashes to a candidate. Only positions with a whole window inside ``data`` are considered, and
    with ``align`` > 1 only those where ``p + phase`` is a multiple of ``align`` (``phase``: the stream
    offset of ``data``), which hashes one window per ``align`` bytes instead of one per byte."""
    arr = np.frombuffer(data, dtype=np.uint8)
    if arr.size < WINDOW:
        return np.empty(0, dtype=np.int64)
    if align > 1:
        first = WINDOW + (-(WINDOW + phase)) % align
        ends = np.arange(first, arr.size + 1, align, dtype=np.int64)
        if ends.size == 0:
            return ends
        windows = arr[ends[:, None] - WINDOW + np.arange(WINDOW, dtype=np.int64)[None, :]]
        h: npt.NDArray[np.uint32] = _GEAR[windows].sum(axis=1, dtype=np.uint32)
        h *= _MULT
        hit: npt.NDArray[np.int64] = ends[h < np.uint32(1 << (32 - bits))]
        return hit
    c = np.empty(arr.size + 1, dtype=np.uint32)
    c[0] = 0
    np.cumsum(_GEAR[arr], dtype=np.uint32, out=c[1:])
    h = c[WINDOW:] - c[:-WINDOW]  # window sums ending at bytes WINDOW-1 .. n-1
    h *= _MULT
    hits = np.flatnonzero(h < np.uint32(1 << (32 - bits)))
    return hits.astype(np.int64) + WINDOW  # byte j = hit + WINDOW - 1; cut after it


def iter_chunks(f: BinaryIO, spec: ChunkSpec, read_size: int = _READ) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of each chunk of the stream ``f``, in order, covering it exactly."""
    if spec.method == "fixed":
        off = 0
        while True:
            block = f.read(spec.avg)
            if not block:
                return
            yield off, block
            off += len(block)
    yield from _cdc(f, spec, read_size)


def _cdc(f: BinaryIO, spec: ChunkSpec, read_size: int) -> Iterator[tuple[int, bytes]]:
    lo, hi, bits = spec.lo, spec.hi, spec.bits
    buf = bytearray()  # the stream's bytes from `base` to `end`
    base = start = end = 0  # `start`: the next chunk's first byte
    cands: list[int] = []  # absolute candidate cut positions not yet passed, ascending
    ci = 0
    eof = False
    while True:
        # Cut every chunk that the data read so far decides.
        while True:
            while ci < len(cands) and cands[ci] < start + lo:
                ci += 1
            if ci < len(cands) and cands[ci] <= start + hi:
                cut = cands[ci]
            elif end - start >= hi:
                cut = start + hi
            elif eof and end > start:
                cut = end
            else:
                break
            yield start, bytes(buf[start - base : cut - base])
            start = cut
        if eof:
            return
        block = f.read(read_size)
        if not block:
            eof = True
            continue
        # Keep WINDOW - 1 bytes of context before `end` where we still have them. Where we do not (the
        # chunk just cut is shorter than the window), the windows we skip would give cuts closer than
        # lo >= 2 * WINDOW to `start`, which are never taken: the cuts stay a function of the content.
        keep = max(0, min(start, end - (WINDOW - 1)) - base)
        del buf[:keep]
        base += keep
        ctx = end - base
        found = candidates(bytes(buf[len(buf) - ctx :]) + block if ctx else block, bits, spec.align, end - ctx)
        cands = cands[ci:] + (found + (end - ctx)).tolist()
        ci = 0
        buf += block
        end += len(block)


def chunk_stream(data: bytes, spec: ChunkSpec) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of ``data``: a convenience for tests and benchmarks."""
    import io

    return [(off, len(b)) for off, b in iter_chunks(io.BytesIO(data), spec)]
