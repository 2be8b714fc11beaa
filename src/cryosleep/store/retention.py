"""Which snapshots to keep: pure functions of the snapshots, a policy and the time (passed in).

Rules, per job, in this order (the first that applies decides, and its reason is given):

1. ``protected``: a snapshot a suspended job lives in (its latest stop snapshot) is always kept;
2. ``keep_last``: the N newest are kept;
3. ``max_age``: anything older than this is removed;
4. ``keep_every``: when set, a snapshot whose sequence number is a multiple of K is kept and the others
   are removed. Sequence numbers (1, 2, 3... per job, in the order snapshots were stored) never change,
   so applying the policy again never thins what it kept before;
5. otherwise the snapshot is kept, unless ``keep_last`` is the only rule: then it is removed (``gc
   --keep-last 3`` keeps each job's 3 newest and removes the rest).

With no rule set at all, everything is kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Policy", "RetentionDecision", "SnapshotInfo", "decide", "parse_age"]


@dataclass(frozen=True)
class SnapshotInfo:
    id: str
    job: str
    created_at: float
    seq: int
    protected: bool = False  # e.g. the stop snapshot a suspended job needs to come back


@dataclass(frozen=True)
class Policy:
    keep_last: int | None = None
    """Always keep this many of a job's newest snapshots."""
    keep_every: int | None = None
    """Keep a snapshot when its sequence number is a multiple of this; remove the others (beyond keep_last)."""
    max_age: float | None = None
    """Remove snapshots older than this many seconds (beyond keep_last)."""

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "max_age"):
            v = getattr(self, name)
            if v is not None and v < (1 if name == "keep_every" else 0):
                raise ValueError(f"{name} must be {'>= 1' if name == 'keep_every' else '>= 0'}, not {v}")

    @property
    def empty(self) -> bool:
        return self.keep_last is None and self.keep_every is None and self.max_age is None


@dataclass(frozen=True)
class RetentionDecision:
    snapshot: SnapshotInfo
    keep: bool
    reason: str


def decide(snapshots: Sequence[SnapshotInfo], policy: Policy, now: float) -> list[RetentionDecision]:
    """One decision per snapshot, in the order given."""
    by_job: dict[str, list[SnapshotInfo]] = {}
    for s in snapshots:
        by_job.setdefault(s.job, []).append(s)
    newest: set[str] = set()
    if policy.keep_last:
        for items in by_job.values():
            items.sort(key=lambda s: (s.created_at, s.seq), reverse=True)
            newest.update(s.id for s in items[: policy.keep_last])
    out = []
    for s in snapshots:
        if s.protected:
            out.append(RetentionDecision(s, True, "protected: a suspended job needs it to come back"))
        elif policy.empty:
            out.append(RetentionDecision(s, True, "no retention rule set"))
        elif s.id in newest:
            out.append(RetentionDecision(s, True, f"among the {policy.keep_last} newest of job {s.job}"))
        elif policy.max_age is not None and now - s.created_at > policy.max_age:
            out.append(RetentionDecision(s, False, f"older than the maximum age ({_age(now - s.created_at)} > "
                                          f"{_age(policy.max_age)})"))
        elif policy.keep_every is not None:
            if s.seq > 0 and s.seq % policy.keep_every == 0:
                out.append(RetentionDecision(s, True, f"every {policy.keep_every}th (sequence {s.seq})"))
            else:
                out.append(RetentionDecision(s, False, f"not every {policy.keep_every}th (sequence {s.seq}) and "
                                                       "not among the newest"))
        elif policy.max_age is None and policy.keep_last is not None:  # a count alone: the rest goes
            out.append(RetentionDecision(s, False, f"not among the {policy.keep_last} newest of job {s.job}"))
        else:
            out.append(RetentionDecision(s, True, "within the maximum age" if policy.max_age is not None else "kept"))
    return out


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def parse_age(text: str) -> float:
    """Seconds in "90", "90s", "15m", "12h", "7d", "2w"."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:  # "nan", "inf", "-1d", "1e308w" are no ages
        raise ValueError(f"not an age: {text!r} (write e.g. 90s, 15m, 12h, 7d, 2w)")
    return value
