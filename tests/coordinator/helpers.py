"""What the coordinator tests share: a running service with short timeouts, simulated clusters, waiting."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryosleep.coordinator import service
from cryosleep.coordinator.client import CoordinatorClient
from tests.coordinator.sim import SimCluster

FAST = service.ServiceConfig(poll_wait_s=2.0, lost_after_s=1.0, rollback_s=15.0, redeliver_s=0.5,
                             default_timeout_s=20.0)


@dataclass
class Env:
    tmp: Path
    token: str
    srv: service.Server
    db: str  # the catalog: an SQLite file or a PostgreSQL URL
    clusters: list[SimCluster] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.srv.url

    @property
    def coordinator(self) -> service.Coordinator:
        return self.srv.coordinator

    def client(self, token: str | None = None) -> CoordinatorClient:
        return CoordinatorClient(self.url, token or self.token)

    def cluster(self, **kw: Any) -> SimCluster:
        kw.setdefault("wait_s", FAST.poll_wait_s)
        c = SimCluster(self.url, self.token, self.tmp / "store", **kw).start()
        self.clusters.append(c)
        return c


@contextmanager
def serving(tmp: Path, cfg: service.ServiceConfig = FAST, db: str | None = None) -> Iterator[Env]:
    """A real coordinator on 127.0.0.1 (its catalog ``db``: by default SQLite in ``tmp``), closed with its simulated
    clusters at the end."""
    token = secrets.token_hex(16)
    (tmp / "token").write_text(token)
    db = db or str(tmp / "catalog.db")
    srv, _ = service.start("127.0.0.1:0", db, token, cfg, log=lambda _m: None)
    e = Env(tmp, token, srv, db)
    try:
        yield e
    finally:
        for c in e.clusters:
            c.close()
        service.shutdown(srv)
        srv.coordinator.catalog.close()


def wait_for(pred: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def images(store: Path, sid: str) -> list[Path]:
    return sorted((store / sid).glob("node-*.json")) if (store / sid).exists() else []


def launch(tmp: Path, listen: str, db: str, *extra: str) -> subprocess.Popen[str]:
    """``coordinator serve`` on ``db`` (its stderr in tmp/coordinator.log)."""
    with open(tmp / "coordinator.log", "a") as log:
        return subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "coordinator", "serve", "--listen", listen,
                                 "--db", db, "--token-file", str(tmp / "token"), "--json", "--poll-wait", "2",
                                 "--lost-after", "1", "--rollback-timeout", "15", *extra],
                                stdout=subprocess.PIPE, stderr=log, text=True,
                                env={**os.environ, "CRYOSLEEP_HOME": str(tmp / "home")})


def listening(p: subprocess.Popen[str]) -> str:
    """The URL a coordinator started by ``launch`` serves on, once it does."""
    assert p.stdout is not None
    doc = ""
    while True:
        line = p.stdout.readline()
        if not line:
            raise AssertionError("the coordinator did not start")
        doc += line
        try:
            return str(json.loads(doc)["listening"])
        except ValueError:
            continue
