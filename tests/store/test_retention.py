"""Retention decisions: pure functions of the snapshots, the policy and the time."""

from __future__ import annotations

import pytest

from cryosleep.store.retention import Policy, SnapshotInfo, decide, parse_age

DAY = 86400.0
NOW = 100 * DAY


def snaps(n: int, job: str = "job", every: float = DAY) -> list[SnapshotInfo]:
    return [SnapshotInfo(f"{job}-{i}", job, NOW - (n - i) * every, i) for i in range(1, n + 1)]


def kept(decisions: list) -> list[str]:  # type: ignore[type-arg]
    return [d.snapshot.id for d in decisions if d.keep]


def test_no_rule_keeps_everything() -> None:
    ds = decide(snaps(3), Policy(), NOW)
    assert all(d.keep for d in ds) and ds[0].reason == "no retention rule set"


def test_keep_last() -> None:
    ds = decide(snaps(5), Policy(keep_last=2, max_age=0), NOW)
    assert kept(ds) == ["job-4", "job-5"]
    assert ds[0].reason.startswith("older than the maximum age")
    assert ds[4].reason == "among the 2 newest of job job"


def test_keep_last_alone_removes_the_rest() -> None:
    ds = decide(snaps(5), Policy(keep_last=2), NOW)  # `gc --keep-last 2`: each job's 2 newest, nothing else
    assert kept(ds) == ["job-4", "job-5"] and ds[0].reason == "not among the 2 newest of job job"


def test_max_age() -> None:
    ds = decide(snaps(10), Policy(max_age=3.5 * DAY), NOW)
    assert kept(ds) == ["job-7", "job-8", "job-9", "job-10"]
    assert ds[0].reason == "older than the maximum age (9.0d > 3.5d)"


def test_keep_every_kth_is_stable_when_applied_again() -> None:
    policy = Policy(keep_every=3, keep_last=1)
    first = kept(decide(snaps(10), policy, NOW))
    assert first == ["job-3", "job-6", "job-9", "job-10"]
    survivors = [s for s in snaps(10) if s.id in first] + [SnapshotInfo("job-11", "job", NOW, 11),
                                                            SnapshotInfo("job-12", "job", NOW + 1, 12)]
    again = kept(decide(survivors, policy, NOW + 2))
    assert again == ["job-3", "job-6", "job-9", "job-12"]  # nothing kept before is thinned out


def test_rules_per_job_and_protection() -> None:
    items = snaps(3, "a") + snaps(3, "b")
    items[0] = SnapshotInfo("a-1", "a", items[0].created_at, 1, protected=True)
    ds = decide(items, Policy(keep_last=1, max_age=0), NOW)
    assert kept(ds) == ["a-1", "a-3", "b-3"]
    assert ds[0].reason.startswith("protected")


def test_decisions_come_with_reasons_in_input_order() -> None:
    items = list(reversed(snaps(4)))
    ds = decide(items, Policy(keep_every=2), NOW)
    assert [d.snapshot.id for d in ds] == [s.id for s in items]
    assert [d.keep for d in ds] == [True, False, True, False]
    assert all(d.reason for d in ds)


def test_parse_age_and_policy_validation() -> None:
    assert parse_age("90") == 90 and parse_age("15m") == 900 and parse_age("7d") == 7 * DAY
    with pytest.raises(ValueError, match="not an age"):
        parse_age("soon")
    with pytest.raises(ValueError):
        Policy(keep_every=0)
