"""Fixtures of the store tests: a real S3 server (Ceph's radosgw, installed by `make setup`) on loopback,
started and stopped here, and one fresh backend per test, local or S3."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cryosleep.errors import CryosleepError
from cryosleep.store.backend import Backend, LocalBackend
from cryosleep.store.s3 import S3Backend
from tools.s3serve import S3Server, locate

# Resolved before any test moves CRYOSLEEP_HOME: the gateway that `make setup` installed.
try:
    RADOSGW = locate()
except CryosleepError as _e:  # reported by the fixture that needs it
    RADOSGW = None
    RADOSGW_ERROR = str(_e)


def require_radosgw() -> Path:
    """The S3 tests need the loopback server; in CI `make setup` installs it, so a lack is a failure."""
    if RADOSGW is None:
        pytest.fail(f"the S3 test server is not installed ({RADOSGW_ERROR}); run `make s3server`")
    return RADOSGW


def settings_of(srv: S3Server) -> dict[str, str]:
    return {"access_key_id": srv.access_key, "secret_access_key": srv.secret_key, "endpoint": srv.endpoint,
            "region": "us-east-1"}


@pytest.fixture(scope="session")
def s3server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    srv = S3Server(tmp_path_factory.mktemp("radosgw") / "data", prefix=require_radosgw())
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[[], S3Server]]:
    """A server of the test's own (to kill and restart); stopped at the end."""
    made: list[S3Server] = []

    def make() -> S3Server:
        srv = S3Server(tmp_path / f"radosgw{len(made)}", prefix=require_radosgw())
        made.append(srv)
        return srv.start()

    try:
        yield make
    finally:
        for srv in made:
            srv.stop()


def new_bucket(srv: S3Server) -> str:
    name = f"t-{secrets.token_hex(6)}"
    srv.create_bucket(name)
    return name


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "local":
        return LocalBackend(tmp_path / "store" / "cas")
    srv: S3Server = request.getfixturevalue("s3server")
    return S3Backend(new_bucket(srv), "prefix/x", settings=settings_of(srv), retries=1)


@pytest.fixture(autouse=True)
def _no_key_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No key or AWS setting of the machine leaks into a test."""
    for var in list(os.environ):
        if var.startswith(("CRYOSLEEP_KEY", "CRYOSLEEP_SIGN_KEY", "AWS_")) or var == "CRYOSLEEP_S3_ENDPOINT":
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CRYOSLEEP_HOME", str(tmp_path / "home"))
