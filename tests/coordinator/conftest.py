"""A real coordinator (HTTP on 127.0.0.1, SQLite in tmp_path) with short timeouts, and simulated node agents."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryosleep.coordinator import service
from tests.coordinator.helpers import FAST, Env


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    srv, _ = service.start("127.0.0.1:0", tmp_path / "catalog.db", token, FAST, log=lambda _m: None)
    e = Env(tmp_path, token, srv)
    yield e
    for c in e.clusters:
        c.close()
    service.shutdown(srv)
    srv.coordinator.catalog.close()

