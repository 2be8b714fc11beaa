"""Printing for people (tables, phase summaries) and for tools (one JSON document)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from cryosleep.errors import CryosleepError, NotEligible


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
    sys.stdout.flush()


def emit_error(err: CryosleepError, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(err.to_json(), indent=2) + "\n")
    else:
        sys.stderr.write(f"cryosleep: {err}\n")


def age_arg(text: str) -> float:
    """An argparse type: an age such as 30m, 2h or 7d, in seconds."""
    from cryosleep.store.retention import parse_age

    try:
        return parse_age(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def seconds_arg(text: str) -> float:
    """An argparse type: a positive, finite time such as 600, 90s or 10m, in seconds ("nan", "inf", "-5" refused)."""
    from cryosleep.errors import UsageError
    from cryosleep.triggers.schedule import parse_duration

    try:
        return parse_duration(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(f"{e.what}: {e.why}") from None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def when(ts: float | None) -> str:
    if not ts:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def phase_table(phases: dict[str, float]) -> str:
    return table(["phase", "seconds"], [[k, f"{v:.3f}"] for k, v in phases.items()])


class PhasePrinter:
    """Shows each phase as it starts and ends (on stderr, so stdout stays clean for --json)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, phase: str, status: str, seconds: float | None) -> None:
        if not self.enabled:
            return
        if status == "start":
            sys.stderr.write(f"  {phase} ...\n")
        else:
            sys.stderr.write(f"  {phase} {status} in {seconds or 0:.3f} s\n")
        sys.stderr.flush()

    def event(self, msg: dict[str, Any]) -> None:
        if msg.get("event") == "phase":
            self(str(msg["phase"]), str(msg["status"]), msg.get("seconds"))


def require_root(what: str, need: frozenset[str] = frozenset()) -> None:
    """Refuse up front, with the reason, what CRIU cannot do without root, or without the capabilities ``need``
    (core/privileges.py)."""
    import os

    from cryosleep.core import privileges

    if os.geteuid() != 0:
        raise NotEligible(
            f"{what} needs root",
            "CRIU and the job's sandbox (PID namespaces, ptrace, network locks) need root privileges",
            "run it as root (sudo cryosleep ...)",
        )
    privileges.require(need, what)
