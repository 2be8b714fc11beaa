"""Test data: deterministic bytes, partly compressible, like a memory image."""

from __future__ import annotations

import random
from pathlib import Path


def image_bytes(seed: int, size: int) -> bytes:
    """``size`` bytes: random 64 KiB runs alternating with runs of zeros and of repeated text."""
    rng = random.Random(seed)
    out = bytearray()
    while len(out) < size:
        kind = rng.random()
        n = rng.randrange(16 << 10, 256 << 10)
        if kind < 0.6:
            out += rng.randbytes(n)
        elif kind < 0.8:
            out += bytes(n)
        else:
            out += (b"tensor %d " % rng.randrange(1000)) * (n // 12)
    return bytes(out[:size])


def write(base: Path, rel: str, data: bytes) -> str:
    p = base / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data)
    return rel
