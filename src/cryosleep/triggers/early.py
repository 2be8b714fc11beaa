"""A SIGUSR1 that comes before the agent listens is kept, not fatal.

SIGUSR1's default action ends a process, and a platform may send it at any moment: Slurm's ``--signal=B:USR1@N``
comes at slurmctld's next periodic check once the time left is under N, which can be a second after a requeued
batch script started, while its agent is still starting or restoring the job. The command line takes SIGUSR1 as
soon as it runs (``hold``); the agent's triggers act on what came (``take``) once the job runs.
"""

from __future__ import annotations

import signal
from types import FrameType

_held: list[int] = []


def _keep(signum: int, frame: FrameType | None) -> None:
    _held.append(signum)


def hold() -> None:
    signal.signal(signal.SIGUSR1, _keep)


def take() -> list[int]:
    """The signals held so far (each once)."""
    out = list(_held)
    _held.clear()
    return out
