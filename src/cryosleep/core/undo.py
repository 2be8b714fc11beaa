"""The record of what a sequence did that a failure must undo: one place that undoes, newest first.

A sequence of phases (a restore, a snapshot) pushes, as each phase changes something, how to take that change
back; when a later phase fails, ``undo`` runs exactly those steps in reverse, so that a failure at any phase
undoes what ran and nothing else. A step is given the exception that stopped the sequence (some undo steps tell
others why). A step that fails itself is logged and the others still run: one stuck undo must not leave the rest
in place.
"""

from __future__ import annotations

from collections.abc import Callable

Step = Callable[[BaseException], None]


class UndoLog:
    """What to undo, in the order it was done."""

    def __init__(self, log: Callable[[str], None] | None = None) -> None:
        self._steps: list[tuple[str, Step]] = []
        self._log = log or (lambda _m: None)

    def push(self, what: str, step: Step) -> None:
        """``step`` undoes ``what`` (a short phrase for the log: "remove the veth")."""
        self._steps.append((what, step))

    @property
    def pending(self) -> list[str]:
        """What an undo would do now, newest first."""
        return [what for what, _ in reversed(self._steps)]

    def undo(self, cause: BaseException) -> list[str]:
        """Every step pushed, newest first; returns the problems of the steps that failed (empty: all undone)."""
        problems: list[str] = []
        while self._steps:
            what, step = self._steps.pop()
            try:
                step(cause)
            except Exception as e:  # the others still run
                problems.append(f"{what}: {type(e).__name__}: {e}")
                self._log(f"could not {what} after the failure: {type(e).__name__}: {e}")
        return problems

    def forget(self) -> None:
        """The sequence succeeded: nothing is to be undone any more."""
        self._steps.clear()
