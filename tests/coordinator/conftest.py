"""A real coordinator (HTTP on 127.0.0.1, SQLite in tmp_path) with short timeouts, and simulated node agents."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.coordinator.helpers import Env, serving


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    with serving(tmp_path) as e:
        yield e
