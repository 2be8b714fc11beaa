"""Builds the CUDA stand-ins for the fast path's tests: DIR/libcuda.so.1 (found by dlopen through
LD_LIBRARY_PATH=DIR) and DIR/libfakecudart.so (loaded by the workload)."""

from __future__ import annotations

import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    cuda, cudart = out / "libcuda.so.1", out / "libfakecudart.so"
    for src, lib in ((HERE / "libcuda.c", cuda), (HERE / "libcudart.c", cudart)):
        subprocess.run(["cc", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", str(lib), str(src),
                        "-ldl"], check=True)
    return cuda, cudart
