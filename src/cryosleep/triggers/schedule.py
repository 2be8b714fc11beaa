"""When to snapshot, and what to do when a deadline is near: pure decisions, fed their inputs and the clock.

    parse_duration   "30s", "30m", "1h30m", "2h", "500ms", "1.5" (seconds) -> seconds
    Periodic         the keep-running policy (`--snapshot-every`): due times, skipped while a snapshot runs
    PastSnapshot     what a previous snapshot of the job tells (its phase times, from its manifest)
    estimate_stop    how long a stop snapshot of this job should take, from its previous snapshots
    plan_stop        given a deadline, take the stop snapshot, or end the job on its last complete snapshot,
                     and say why (a TriggerDecision carries its reasons)

Nothing here reads a clock, a file or the network; the agent's trigger runner feeds these functions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cryosleep.errors import UsageError
from cryosleep.timing import whole

__all__ = [
    "Estimate",
    "PastSnapshot",
    "Periodic",
    "TriggerDecision",
    "estimate_stop",
    "parse_duration",
    "plan_stop",
]

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``30s``, ``30m``, ``1h30m``, ``2h``, ``500ms``; a bare number is seconds."""
    s = text.strip().lower()
    try:
        value = float(s)
    except ValueError:
        value = -1.0
        pos = 0
        total = 0.0
        for m in _PART.finditer(s):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _UNITS[m.group(2)]
            pos = m.end()
        if s and pos == len(s):
            value = total
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"invalid duration {text!r}",
                         "a duration is a positive number of seconds, or parts such as 30s, 30m, 1h30m, 2h, 500ms",
                         "write it like 30s, 30m or 1h30m")
    return value


# -- the periodic policy ---------------------------------------------------------------------------


@dataclass
class Periodic:
    """Keep-running snapshots every ``every`` seconds, counted from the end of the job's last snapshot (any
    snapshot, whatever triggered it, resets the clock: the job has a fresh image). A due time that finds a
    snapshot already running is skipped, not queued: that snapshot's end starts the next period."""

    every: float
    next_at: float

    @classmethod
    def starting(cls, every: float, now: float) -> Periodic:
        return cls(every=every, next_at=now + every)

    def decide(self, now: float, busy: bool) -> tuple[str, str]:
        """("wait" | "take" | "skip", reason)."""
        if now < self.next_at:
            return "wait", f"next periodic snapshot due in {self.next_at - now:.1f} s"
        if busy:
            return "skip", "a snapshot is already running; its end starts the next period"
        return "take", f"periodic snapshot due (every {self.every:g} s)"

    def snapshot_ended(self, now: float) -> None:
        self.next_at = now + self.every

    def skipped(self, now: float) -> None:
        # One skip per period: the running snapshot's end resets the clock if it succeeds.
        self.next_at = now + self.every


# -- estimating a stop snapshot ------------------------------------------------------------------

# Phases a keep-running snapshot has that a stop snapshot does not (the job is not brought back).
_KEEP_ONLY = ("cuda-restore", "cuda-unlock", "rebuild")
# Phases whose wait a stop snapshot may skip when a deadline is near: the upload to the remote store ("persist"
# in a stop snapshot's phases; keep-running snapshots upload in the background, outside their phases).
WAITABLE = ("persist", "upload")
SAFETY = 1.25  # the estimate is the slowest recent stop-equivalent time times this
OVERHEAD_S = 0.5  # signalling, planning and the agent's bookkeeping around the capture
END_S = 0.1  # ending the held job (a stop snapshot's last phase), when no stop snapshot measured it


@dataclass(frozen=True)
class PastSnapshot:
    """A previous snapshot of the job, as its manifest records it."""

    id: str
    mode: str  # "keep-running" | "stop"
    created_at: float
    phases: Mapping[str, float]
    pause_s: float = 0.0
    bytes: int = 0
    complete: bool = True  # committed, every file checksummed (and, for a stop snapshot, re-verified)


def stop_equivalent(s: PastSnapshot) -> tuple[float, float]:
    """(seconds a stop snapshot would take judging by ``s``, of which waitable seconds such as the upload)."""
    phases = dict(s.phases)
    waitable = sum(phases.get(p, 0.0) for p in WAITABLE)
    if s.mode == "stop":
        return whole(phases), waitable
    base = whole({k: v for k, v in phases.items() if k not in _KEEP_ONLY})
    # A stop snapshot re-reads and re-hashes its image (verify): about what checksum took.
    return base + phases.get("checksum", 0.0) + END_S, waitable


@dataclass(frozen=True)
class Estimate:
    seconds: float | None  # None: no history to judge from
    fastest: float | None  # the fastest past stop-equivalent time (no safety margin)
    waitable: float  # of ``seconds``, what a stop snapshot may skip waiting for (upload)
    basis: str  # how it was computed, in words

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def estimate_stop(history: Iterable[PastSnapshot], recent: int = 5) -> Estimate:
    """How long a stop snapshot should take, from the job's last ``recent`` complete snapshots: the slowest
    of them, times a safety factor, plus the agent's overhead (images grow; being late costs the job)."""
    past = sorted((s for s in history if s.complete and s.phases), key=lambda s: s.created_at)[-recent:]
    if not past:
        return Estimate(None, None, 0.0, "no previous snapshot of this job to estimate from")
    times = [stop_equivalent(s) for s in past]
    slowest, slowest_wait = max(times, key=lambda t: t[0])
    seconds = slowest * SAFETY + OVERHEAD_S
    basis = (f"slowest of the last {len(past)} snapshot(s) {slowest:.2f} s x {SAFETY} + {OVERHEAD_S} s "
             f"(fastest {min(t[0] for t in times):.2f} s)")
    return Estimate(round(seconds, 3), round(min(t[0] for t in times), 3), round(slowest_wait * SAFETY, 3), basis)


# -- deciding under a deadline -------------------------------------------------------------------

SNAPSHOT = "snapshot"  # take the stop snapshot (and wait for it to be fully persisted)
SNAPSHOT_NO_UPLOAD_WAIT = "snapshot-no-upload-wait"  # take it, do not wait for the remote upload
USE_LAST = "use-last"  # take no new snapshot: end the job, to be restored from its last complete snapshot


@dataclass
class TriggerDecision:
    """What a trigger led to, and why: one record of ``decisions.jsonl`` (the outcome is added later)."""

    trigger: str  # sigterm | sigusr1 | notice:SOURCE (triggers.notices.SOURCES) | periodic
    mode: str  # stop | keep-running
    action: str  # snapshot | snapshot-no-upload-wait | use-last | skip
    reasons: list[str]
    at: float
    deadline: float | None = None
    remaining_s: float | None = None
    estimate_s: float | None = None
    estimate_basis: str = ""
    timeout_s: float | None = None  # what the snapshot is given (up to the deadline)
    fallback: str | None = None  # the last complete snapshot, if the new one cannot be had
    detail: str = ""  # from the trigger (the notice's text)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if not out["extra"]:
            del out["extra"]
        return out


DEFAULT_TIMEOUT = 600.0  # a stop snapshot with no deadline gets what `cryosleep snapshot` gives
MARGIN_S = 1.0  # left between the snapshot's timeout and the deadline, for ending the agent cleanly


def plan_stop(now: float, deadline: float | None, est: Estimate, fallback: PastSnapshot | None,
              trigger: str, detail: str = "") -> TriggerDecision:
    """Decide how to stop the job before ``deadline`` (absolute, same clock as ``now``; None: no deadline).

    - the estimate fits (or there is no deadline): take the stop snapshot;
    - it fits only without waiting for the upload: take it, skip that wait (the last complete snapshot
      covers the risk);
    - even the fastest previous snapshot would not fit and a complete snapshot of this run exists: take no
      new snapshot, end the job on that one (a snapshot cut off by the deadline saves nothing and the
      training done meanwhile is lost either way);
    - otherwise (no estimate, a tight fit, or nothing to fall back on): try, with the time that is left."""
    d = TriggerDecision(trigger=trigger, mode="stop", action=SNAPSHOT, reasons=[], at=now, deadline=deadline,
                 estimate_s=est.seconds, estimate_basis=est.basis, detail=detail,
                 fallback=fallback.id if fallback else None)
    if deadline is None:
        d.timeout_s = DEFAULT_TIMEOUT
        d.reasons.append("no deadline: take the stop snapshot")
        return d
    left = deadline - now
    d.remaining_s = round(left, 3)
    d.timeout_s = round(max(1.0, left - MARGIN_S), 3)
    age = f"{now - fallback.created_at:.0f} s old" if fallback else ""
    if est.seconds is None:
        d.reasons.append(f"{est.basis}; {left:.1f} s left: take the stop snapshot and see")
        return d
    if est.seconds <= left:
        d.reasons.append(f"estimated {est.seconds:.1f} s fits in the {left:.1f} s left")
        return d
    if est.waitable and est.seconds - est.waitable <= left and fallback is not None:
        d.action = SNAPSHOT_NO_UPLOAD_WAIT
        d.reasons.append(f"estimated {est.seconds:.1f} s does not fit in the {left:.1f} s left, "
                         f"{est.seconds - est.waitable:.1f} s without waiting for the upload does; "
                         f"the last complete snapshot {fallback.id} ({age}) covers the risk")
        return d
    fastest = est.fastest if est.fastest is not None else est.seconds
    if fallback is not None and fastest + OVERHEAD_S > left:
        d.action = USE_LAST
        d.timeout_s = None
        d.reasons.append(f"estimated {est.seconds:.1f} s (fastest ever {fastest:.1f} s) cannot fit in the "
                         f"{left:.1f} s left; end the job on its last complete snapshot {fallback.id} ({age}); "
                         "the training since then is lost either way")
        return d
    if fallback is None:
        d.reasons.append(f"estimated {est.seconds:.1f} s does not fit in the {left:.1f} s left, and this run has "
                         "no complete snapshot to fall back on: try anyway")
    else:
        d.reasons.append(f"estimated {est.seconds:.1f} s does not fit in the {left:.1f} s left but the fastest "
                         f"previous one ({fastest:.1f} s) would: try, falling back on {fallback.id} ({age}) "
                         "if it fails")
    return d


def pick_fallback(history: Sequence[PastSnapshot], *, since: float, restored_from: str | None) -> PastSnapshot | None:
    """The newest complete snapshot of this run of the job: taken since it started (or restored), or the one it
    was restored from. A snapshot of an earlier, unrelated run of the same name is no fallback."""
    ok = [s for s in history if s.complete and (s.created_at >= since or s.id == restored_from)]
    return max(ok, key=lambda s: s.created_at) if ok else None
