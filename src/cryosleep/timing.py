"""Phase timing: every phase of a snapshot or restore is timed, and the times are shown."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

Progress = Callable[[str, str, float | None], None]
"""How a snapshot or a restore reports its phases as they go: (phase, "start" | "done" | "failed", seconds)."""

PARTS = {"precopy-freeze": "precopy"}
"""Durations recorded as a part of another phase (name -> that phase): the pre-dump's freeze of the job, inside
its ``precopy`` phase, which the pause counts (capture/snapshot.py). A sum of phases leaves them out."""


def whole(durations: Mapping[str, float]) -> float:
    """The time of these phases together: each part (``PARTS``) is already in its phase."""
    return sum(v for k, v in durations.items() if k not in PARTS)


class Phases:
    """Ordered phase durations in seconds, with an optional progress callback per phase."""

    def __init__(self, progress: Progress | None = None) -> None:
        self.durations: dict[str, float] = {}
        self._progress = progress
        self._open: dict[str, float] = {}  # phases begun and not ended: name -> monotonic start

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._progress:
            self._progress(name, "start", None)
        start = time.monotonic()
        ok = False
        try:
            yield
            ok = True
        finally:
            elapsed = time.monotonic() - start
            self.durations[name] = self.durations.get(name, 0.0) + elapsed
            if self._progress:
                self._progress(name, "done" if ok else "failed", elapsed)

    def begin(self, name: str) -> None:
        """A phase that spans several steps (a drain's rounds, a rebuild's relay), ended by ``end``; a phase
        already begun goes on."""
        if name in self._open:
            return
        if self._progress:
            self._progress(name, "start", None)
        self._open[name] = time.monotonic()

    def end(self, name: str, ok: bool = True) -> None:
        """The phase ``begin`` started is over (nothing if it was not begun)."""
        start = self._open.pop(name, None)
        if start is None:
            return
        elapsed = time.monotonic() - start
        self.durations[name] = self.durations.get(name, 0.0) + elapsed
        if self._progress:
            self._progress(name, "done" if ok else "failed", elapsed)

    def end_all(self, ok: bool = False) -> None:
        """Every phase still begun is over (a failure cut it short)."""
        for name in list(self._open):
            self.end(name, ok)

    def part(self, name: str, seconds: float) -> None:
        """Records ``seconds`` of the phase ``PARTS[name]`` (already timed) as its part ``name``."""
        assert name in PARTS and PARTS[name] in self.durations, name
        self.durations[name] = self.durations.get(name, 0.0) + seconds

    def total(self, names: list[str] | None = None) -> float:
        if names is None:
            return whole(self.durations)
        return sum(self.durations.get(n, 0.0) for n in names)

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 4) for k, v in self.durations.items()}
