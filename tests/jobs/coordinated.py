"""A real coordinator (`cryosleep coordinator serve`, a subprocess) and the nodes of a real job registered with it.

Shared by tests/jobs/test_reliability.py (two nodes on this host) and tests/jobs/test_multinode.py (two
simulated hosts).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cryosleep.coordinator.client import CoordinatorClient
from cryosleep.errors import CryosleepError

FAST = ["--poll-wait", "2", "--lost-after", "3", "--rollback-timeout", "60"]


class Coordinator:
    """`cryosleep coordinator serve` on ``listen``; ``kill()`` and ``start()`` again on the same address, or a
    ``standby()`` on the same catalog and address that serves once it ``took_over()``."""

    def __init__(self, tmp: Path, listen: str = "127.0.0.1:0", prefix: tuple[str, ...] = (),
                 db: str | None = None) -> None:
        self.tmp = tmp
        self.db = db or str(tmp / "catalog.db")  # an SQLite file, or a PostgreSQL URL
        self.waiting: subprocess.Popen[str] | None = None  # a standby
        self.token = secrets.token_hex(16)
        self.token_file = tmp / "coordinator.token"
        self.token_file.write_text(self.token)
        self.prefix = prefix  # e.g. nsenter into a simulated host's network namespace
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.start(listen)

    def _launch(self, listen: str) -> subprocess.Popen[str]:
        with open(self.tmp / "coordinator.log", "a") as log:
            return subprocess.Popen([*self.prefix, sys.executable, "-m", "cryosleep.cli.main", "coordinator",
                                     "serve", "--listen", listen, "--db", self.db,
                                     "--token-file", str(self.token_file), "--json", *FAST],
                                    stdout=subprocess.PIPE, stderr=log, text=True)

    def start(self, listen: str | None = None) -> None:
        self.proc = self._launch(listen or self.url.rsplit("/", 1)[1])
        self._listening()

    def standby(self) -> None:
        """A second coordinator on the same catalog and address, waiting for the lease."""
        log = self.tmp / "coordinator.log"
        said = log.read_text().count("standby:")
        self.waiting = self._launch(self.url.rsplit("/", 1)[1])
        wait_for(lambda: log.read_text().count("standby:") > said, 60, "the standby waiting for the lease")

    def took_over(self) -> None:
        """The standby serves now (after the active one died): it is this coordinator from here on."""
        assert self.waiting is not None
        self.proc, self.waiting = self.waiting, None
        url = self.url
        self._listening()
        assert self.url == url

    def _listening(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        doc = ""
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the coordinator did not start: {(self.tmp / 'coordinator.log').read_text()}")
            doc += line
            try:
                self.url = str(json.loads(doc)["listening"])
                return
            except ValueError:
                continue

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.waiting is not None and self.waiting.poll() is None:
            self.waiting.terminate()
            self.waiting.wait(30)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self, url: str | None = None) -> CoordinatorClient:
        return CoordinatorClient(url or self.url, self.token)

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """A CLI's environment that finds this coordinator."""
        return {**base, "CRYOSLEEP_COORDINATOR_TOKEN_FILE": str(self.token_file)}

    def _ask(self, fn: Callable[[CoordinatorClient], Any]) -> Any:
        c = self.client()
        try:
            return fn(c)
        finally:
            c.close()

    def snapshot(self, job: str, *, stop: bool = False, wait: bool = True, timeout_s: float = 120) -> dict[str, Any]:
        out: dict[str, Any] = self._ask(lambda c: c.snapshot(job, stop=stop, wait=wait, timeout_s=timeout_s))
        return out

    def detail(self, sid: str) -> dict[str, Any]:
        out: dict[str, Any] = self._ask(lambda c: c.snapshot_detail(sid))
        return out

    def job(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = self._ask(lambda c: c.job(name))
        return out

    def job_state(self, name: str) -> str:
        """The job's state at the coordinator; "" while it does not know the job (no agent registered yet)."""
        try:
            return str(self.job(name)["state"])
        except CryosleepError:
            return ""

    def valid(self, job: str) -> list[str]:
        return [s["id"] for s in self._ask(lambda c: c.snapshots(job, valid_only=True))]


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
