"""What the coordinator tests share: a running service with short timeouts, simulated clusters, waiting."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryosleep.coordinator import service
from cryosleep.coordinator.client import CoordinatorClient
from cryosleep.coordinator.sim import SimCluster

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


def wait_for(pred: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def images(store: Path, sid: str) -> list[Path]:
    return sorted((store / sid).glob("node-*.json")) if (store / sid).exists() else []
