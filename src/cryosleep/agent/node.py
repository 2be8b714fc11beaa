"""The node agent as the parts it runs see it: a small typed interface instead of its private fields.

``coordinated.py`` (the node's backend for the coordinator) is given an object of this shape, which
:class:`cryosleep.agent.agent.Agent` is; the interface keeps the backend from importing the agent module
back (the agent imports the backend to connect it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from cryosleep.capture import snapshot as capture_snapshot
from cryosleep.core.job import JobDir, JobSpec, JobState
from cryosleep.store import persist as store_persist
from cryosleep.store.local import LocalStore


class NodeAgent(Protocol):
    """What a coordinated node's backend uses of the agent that supervises the node's workers."""

    @property
    def spec(self) -> JobSpec: ...
    @property
    def state(self) -> JobState: ...
    @property
    def job(self) -> JobDir: ...
    @property
    def runtime(self) -> dict[str, Any]: ...
    @property
    def snap_lock(self) -> threading.Lock: ...
    @property
    def persister(self) -> store_persist.Persister | None: ...
    @property
    def stopping(self) -> bool: ...

    def end_job(self, detail: str) -> None:
        """End the job's workers now; the job is recorded failed with ``detail``."""

    def arm(self, reason: str | None) -> None:
        """Arm (the job dies with the agent) or disarm (``None``) the watchdog."""

    def job_alive(self) -> bool: ...

    def learns_peers(self) -> bool:
        """The job network's overlay peers follow the coordinator's board (coordinated.NetPeers)."""

    def save_state(self) -> None:
        """Write the job's record (its state) to the job directory."""

    def log_line(self, msg: str) -> None: ...

    def capture_target(self, stop: bool, send: Callable[[dict[str, Any]], None], *, persist: bool = True,
                       store: LocalStore | None = None) -> capture_snapshot.Target:
        """The running sandbox as a snapshot sees it."""
