"""A real coordinator (HTTP on 127.0.0.1) with short timeouts, and simulated node agents; every test that takes
the catalog (``env``, ``db``) runs once on each engine: SQLite in tmp_path, and a database of its own on one real
PostgreSQL server per session (``pg``, tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import pgserver
from tests.coordinator.helpers import Env, serving

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
    with serving(tmp_path, db=db) as e:
        yield e
