"""A real coordinator (HTTP on 127.0.0.1) with short timeouts, and simulated node agents; every test that takes
the catalog (``env``, ``db``) runs once on each engine: SQLite in tmp_path, and a database of its own on one real
PostgreSQL server per session (``pg``, tests/conftest.py)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryosleep.coordinator import service
from tests import pgserver
from tests.coordinator.helpers import FAST, Env

ENGINES = ("sqlite", "postgresql")


@pytest.fixture(params=ENGINES)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The catalog: an SQLite file, or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        return str(tmp_path / "catalog.db")
    server: pgserver.PgServer = request.getfixturevalue("pg")
    return server.database()


@pytest.fixture
def env(tmp_path: Path, db: str) -> Iterator[Env]:
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    srv, _ = service.start("127.0.0.1:0", db, token, FAST, log=lambda _m: None)
    e = Env(tmp_path, token, srv, db)
    yield e
    for c in e.clusters:
        c.close()
    service.shutdown(srv)
    srv.coordinator.catalog.close()
