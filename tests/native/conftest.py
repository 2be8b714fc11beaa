"""The native NCCL tests: the CPU stand-in NCCL and the interceptor, in real multi-process jobs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE / "workloads"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import nccl_jobs  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def native_build() -> None:
    """Builds native/nccl once per session (fetching nccl.h the first time)."""
    nccl_jobs.build()
