"""Shared fixtures: every test gets its own Cryosleep home and store; CRIU comes from `make setup`."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryosleep import paths
from cryosleep.capture import criu_install
from tests import pgserver

# Resolved once, before any test moves CRYOSLEEP_HOME: the CRIU that `make setup` installed.
REAL_CRIU_ROOT = str(paths.criu_root())


@pytest.fixture
def cryo_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("CRYOSLEEP_HOME", str(home))
    monkeypatch.setenv("CRYOSLEEP_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("CRYOSLEEP_CRIU_ROOT", REAL_CRIU_ROOT)
    monkeypatch.delenv("CRYOSLEEP_CRIU", raising=False)
    monkeypatch.delenv("CRYOSLEEP_FAULT", raising=False)
    criu_install.reset_cache()
    yield home
    criu_install.reset_cache()
    # The test's snapshots go with it: a checkout under /tmp stages its virtualenv's libraries into every image
    # (files under /tmp may change), and a whole run's images would otherwise fill the disk before pytest's
    # own cleanup of old runs. The job directories and logs stay, for a failure's post-mortem.
    shutil.rmtree(tmp_path / "store", ignore_errors=True)


@pytest.fixture(scope="session")
def pg() -> Iterator[pgserver.PgServer]:
    """One real PostgreSQL server for the session (tests/pgserver.py); ``pg.database()`` a fresh database."""
    missing = pgserver.installed()
    if missing:  # `make setup` installs it: in CI a lack is a failure
        pytest.fail(f"the PostgreSQL tests need {missing}")
    server = pgserver.PgServer().start()
    yield server
    server.stop()


def require_criu() -> None:
    """Job tests need root and CRIU; in CI both are there (`make setup`), so a lack is a failure."""
    if os.geteuid() != 0:
        pytest.fail("job-level tests need root (CRIU dumps and restores processes)")
    try:
        criu_install.locate(refresh=True)
    except Exception as e:  # pragma: no cover - environment problem
        pytest.fail(f"CRIU is not available ({e}); run `make setup`")


def wait_exit(pid: int, timeout: float = 30) -> int:
    """Reap our child ``pid`` (polling, so a hang fails the test) and return its exit code."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    raise AssertionError(f"process {pid} did not exit in {timeout} s")
