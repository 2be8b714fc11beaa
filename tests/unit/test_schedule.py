"""Durations, the periodic policy, the stop-time estimate and the deadline planner (pure functions)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cryosleep.cli.main import parse
from cryosleep.cli.triggers import trigger_config
from cryosleep.errors import UsageError
from cryosleep.triggers import decisions
from cryosleep.triggers.schedule import (
    SNAPSHOT,
    SNAPSHOT_NO_UPLOAD_WAIT,
    USE_LAST,
    Estimate,
    PastSnapshot,
    Periodic,
    estimate_stop,
    parse_duration,
    pick_fallback,
    plan_stop,
    stop_equivalent,
)


@pytest.mark.parametrize(("text", "seconds"), [
    ("30s", 30), ("30m", 1800), ("1h30m", 5400), ("2h", 7200), ("500ms", 0.5), ("1.5", 1.5), ("45", 45),
    ("1d", 86400), (" 2m30s ", 150), ("1h0m5s", 3605),
])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-5", "30x", "m30", "1h 30m", "h", "30s5", "nan", "inf", "1e999"])
def test_parse_duration_refuses_with_a_hint(text: str) -> None:
    with pytest.raises(UsageError) as e:
        parse_duration(text)
    assert e.value.hint and repr(text) in e.value.what


def test_periodic_waits_takes_and_skips_while_busy() -> None:
    p = Periodic.starting(60.0, now=1000.0)
    assert p.decide(1059.0, busy=False)[0] == "wait"
    assert p.decide(1060.0, busy=False)[0] == "take"
    action, reason = p.decide(1060.0, busy=True)
    assert action == "skip" and "already running" in reason
    p.skipped(1060.0)
    assert p.decide(1061.0, busy=False)[0] == "wait"  # one skip per period, not one per tick
    assert p.decide(1120.0, busy=False)[0] == "take"
    p.snapshot_ended(1065.0)  # any snapshot resets the clock
    assert p.decide(1124.0, busy=False)[0] == "wait"
    assert p.decide(1125.0, busy=False)[0] == "take"


def snap(sid: str, at: float, mode: str = "keep-running", complete: bool = True, **phases: float) -> PastSnapshot:
    return PastSnapshot(id=sid, mode=mode, created_at=at, phases={k.replace("_", "-"): v for k, v in phases.items()},
                        complete=complete)


def test_stop_equivalent_of_keep_running_and_stop_snapshots() -> None:
    keep = snap("k", 1, preflight=0.1, dump=1.0, rebuild=0.5, cuda_restore=0.2, checksum=0.4, commit=0.05)
    # no rebuild / cuda-restore in a stop; a verify about as long as the checksum; the end
    assert stop_equivalent(keep)[0] == pytest.approx(0.1 + 1.0 + 0.4 + 0.05 + 0.4 + 0.1)
    stop = snap("s", 2, mode="stop", preflight=0.1, dump=1.0, checksum=0.4, commit=0.05, verify=0.4, end=0.02)
    assert stop_equivalent(stop)[0] == pytest.approx(1.97)
    up = snap("u", 3, mode="stop", dump=1.0, persist=3.0)
    assert stop_equivalent(up) == (4.0, 3.0)
    # the pre-dump's freeze is a part of its precopy phase (timing.PARTS): counted once, in the phase
    pre = snap("p", 4, mode="stop", precopy=2.0, precopy_freeze=0.3, dump=1.0)
    assert stop_equivalent(pre)[0] == pytest.approx(3.0)
    pre_keep = snap("q", 5, precopy=2.0, precopy_freeze=0.3, dump=1.0, checksum=0.4)
    assert stop_equivalent(pre_keep)[0] == pytest.approx(2.0 + 1.0 + 0.4 + 0.4 + 0.1)


def test_estimate_uses_recent_complete_snapshots_with_a_margin() -> None:
    assert estimate_stop([]).seconds is None
    hist = [snap(f"s{i}", i, mode="stop", dump=d) for i, d in enumerate([9.0, 1.0, 2.0, 1.5, 1.0, 1.2])]
    hist.append(snap("broken", 10, mode="stop", complete=False, dump=50.0))
    e = estimate_stop(hist, recent=5)
    assert e.seconds == pytest.approx(2.0 * 1.25 + 0.5)  # the 9 s one is older than the last five
    assert e.fastest == pytest.approx(1.0)
    assert "last 5" in e.basis


def test_plan_fits_no_deadline_and_no_history() -> None:
    est = Estimate(10.0, 6.0, 0.0, "x")
    d = plan_stop(100.0, 130.0, est, None, "sigterm")
    assert d.action == SNAPSHOT and d.remaining_s == 30.0 and d.timeout_s == 29.0 and "fits" in d.reasons[0]
    d = plan_stop(100.0, None, est, None, "sigusr1")
    assert d.action == SNAPSHOT and d.timeout_s == 600.0 and d.deadline is None
    d = plan_stop(100.0, 105.0, Estimate(None, None, 0.0, "no previous snapshot"), None, "notice:gce")
    assert d.action == SNAPSHOT and "no previous snapshot" in d.reasons[0]


def test_plan_falls_back_on_the_last_complete_snapshot_when_nothing_can_fit() -> None:
    last = snap("exp-1", 50.0)
    est = Estimate(20.0, 12.0, 0.0, "x")
    d = plan_stop(100.0, 105.0, est, last, "notice:aws")
    assert d.action == USE_LAST and d.fallback == "exp-1" and d.timeout_s is None
    assert "50 s old" in d.reasons[0]
    # Without anything to fall back on: try anyway, and say so.
    d = plan_stop(100.0, 105.0, est, None, "notice:aws")
    assert d.action == SNAPSHOT and "no complete snapshot" in d.reasons[0] and d.timeout_s == 4.0
    # Tight but possible (the fastest previous one would fit): try, naming the fallback.
    d = plan_stop(100.0, 115.0, est, last, "sigterm")
    assert d.action == SNAPSHOT and "falling back on exp-1" in d.reasons[0]


def test_plan_skips_the_upload_wait_when_only_that_does_not_fit() -> None:
    est = Estimate(30.0, 20.0, 15.0, "x")
    last = snap("exp-1", 90.0)
    d = plan_stop(100.0, 120.0, est, last, "sigterm")
    assert d.action == SNAPSHOT_NO_UPLOAD_WAIT and "without waiting for the upload" in d.reasons[0]
    d = plan_stop(100.0, 120.0, est, None, "sigterm")  # no fallback: wait for it, the only copy must be safe
    assert d.action == SNAPSHOT


def test_fallback_is_of_this_run_only() -> None:
    hist = [snap("old-run", 10.0), snap("restored-from", 20.0, mode="stop"), snap("after", 40.0),
            snap("half", 45.0, complete=False)]
    assert pick_fallback(hist, since=30.0, restored_from=None) is not None
    assert pick_fallback(hist, since=30.0, restored_from=None).id == "after"  # type: ignore[union-attr]
    assert pick_fallback(hist[:2], since=30.0, restored_from="restored-from").id == "restored-from"  # type: ignore[union-attr]
    assert pick_fallback(hist[:2], since=30.0, restored_from=None) is None


def test_decision_log_merges_outcomes_and_survives_a_cut_line(tmp_path: Path) -> None:
    p = decisions.path_for(tmp_path)
    decisions.append(p, {"event": "decided", "id": "1-1", "at": 1.0, "trigger": "sigterm", "action": "snapshot"})
    decisions.append(p, {"event": "decided", "id": "1-2", "at": 2.0, "trigger": "periodic", "action": "snapshot"})
    decisions.append(p, {"event": "outcome", "id": "1-1", "at": 3.0, "outcome": "suspended", "snapshot": "s"})
    with open(p, "a") as f:
        f.write('{"event": "outcome", "id": "1-2", "at"')  # the agent died mid-write
    recs = decisions.load(p)
    assert [(r["id"], r["outcome"]) for r in recs] == [("1-1", "suspended"), ("1-2", "unknown")]
    assert recs[0]["snapshot"] == "s" and recs[0]["ended_at"] == 3.0 and recs[0]["at"] == 1.0
    assert decisions.load(tmp_path / "none.jsonl") == []


def run_args(*argv: str) -> argparse.Namespace:
    return parse(["run", *argv, "train.py"])


def test_trigger_options_parse_and_refuse() -> None:
    cfg = trigger_config(run_args("--snapshot-every", "30m", "--grace", "30s", "--notices", "aws,gce,aws",
                                  "--notice-url", "aws=http://127.0.0.1:1234", "--metrics-port", "9400"))
    assert cfg.every == 1800 and cfg.grace == 30 and cfg.notices == ["aws", "gce"]
    assert cfg.notice_urls == {"aws": "http://127.0.0.1:1234"} and cfg.metrics_port == 9400
    assert trigger_config(run_args()).notices == [] and trigger_config(run_args()).grace is None
    assert trigger_config(run_args("--notices", "auto")).notices == ["auto"]
    for bad in (["--notices", "aws,oracle"], ["--notice-url", "aws:http://x"], ["--notice-url", "ibm=http://x"],
                ["--grace", "soon"], ["--metrics-port", "70000"]):
        with pytest.raises(UsageError):
            trigger_config(run_args(*bad))
