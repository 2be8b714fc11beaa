"""Triggers on real jobs (real CRIU, real PyTorch DDP on CPU): SIGTERM with --grace, SIGUSR1, each cloud's
preemption notice from a local server that answers like it, the periodic policy, the deadline fallback, and
the metrics scraped over HTTP. Each stop must suspend the job (exit 75), log its decision, and restore into
a training run identical to an uninterrupted one."""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.clouds import FakeCloud
from tests.jobs.harness import Harness, free_port, reference, workload

pytestmark = pytest.mark.slow

BASIC = ["--steps", "40", "--step-sleep", "0.05"]
SCRIPT = workload("ddp_basic")


def start(h: Harness, name: str, *flags: str, args: list[str] = BASIC) -> dict[str, Any]:
    out: dict[str, Any] = h.cli_json("run", "--detach", "--name", name, "--nproc-per-node", "2", *flags,
                                     str(SCRIPT), *args)
    return out


def agent_pid(h: Harness, name: str) -> int:
    return h.job(name).read()[1].agent_pid


def decisions(h: Harness, name: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = h.cli_json("decisions", name)
    return out


def assert_continues_identically(h: Harness, name: str, sid: str, args: list[str] = BASIC) -> None:
    h.restore(sid)
    assert h.wait_end(name) == 0
    ref = reference(SCRIPT, args)
    for r in (0, 1):
        assert h.losses(name, r) == ref[r], f"rank {r} differs from the uninterrupted run"


def assert_stopped_by(h: Harness, name: str, trigger: str) -> dict[str, Any]:
    """The job ended suspended in a verified stop snapshot, and its one decision says so."""
    assert h.wait_end(name, timeout=120) == 75
    assert h.state(name) == "suspended"
    [d] = [d for d in decisions(h, name) if d["trigger"] == trigger]
    assert d["mode"] == "stop" and d["action"] == "snapshot" and d["outcome"] == "suspended", d
    assert d["reasons"] and d["duration_s"] > 0
    snaps = {s["snapshot"]: s for s in h.ls()}
    assert snaps[d["snapshot"]]["mode"] == "stop"
    assert h.cli_json("verify", d["snapshot"])["ok"]
    assert f"decision {d['id']}: {trigger} -> stop snapshot" in h.job(name).agent_log.read_text()
    return d


def test_sigterm_with_grace_takes_a_stop_snapshot_within_it(h: Harness) -> None:
    start(h, "term", "--grace", "30s")
    h.wait_step("term", 8)
    sent = time.time()
    os.kill(agent_pid(h, "term"), signal.SIGTERM)
    d = assert_stopped_by(h, "term", "sigterm")
    assert d["deadline"] == pytest.approx(sent + 30, abs=2) and d["within_deadline"] is True
    assert d["estimate_s"] is None and "no previous snapshot" in d["reasons"][0]  # the job's first snapshot
    assert_continues_identically(h, "term", d["snapshot"])


def test_sigusr1_takes_a_stop_snapshot(h: Harness) -> None:
    start(h, "usr1")
    h.wait_step("usr1", 6)
    h.snapshot("usr1")  # a keep-running snapshot first: the stop is then estimated from it
    h.wait_step("usr1", 12)
    os.kill(agent_pid(h, "usr1"), signal.SIGUSR1)
    d = assert_stopped_by(h, "usr1", "sigusr1")
    assert d["deadline"] is None and d["estimate_s"] > 0 and d["fallback"]
    assert_continues_identically(h, "usr1", d["snapshot"])


@pytest.fixture
def cloud(request: pytest.FixtureRequest) -> Iterator[FakeCloud]:
    c = FakeCloud(request.param)
    yield c
    c.close()


@pytest.mark.parametrize("cloud", ["aws", pytest.param("gce", marks=pytest.mark.extended),
                                   pytest.param("azure", marks=pytest.mark.extended),
                                   pytest.param("alibaba", marks=pytest.mark.extended)], indirect=True)
def test_preemption_notice_takes_a_stop_snapshot_before_its_deadline(h: Harness, cloud: FakeCloud) -> None:
    name = f"notice-{cloud.kind}"
    start(h, name, "--notices", cloud.kind, "--notice-url", f"{cloud.kind}={cloud.url}", "--notice-interval", "0.2s")
    h.wait_step(name, 8)
    assert cloud.requests, "the agent is not watching the endpoint"  # (GCE: one long poll, held)
    deadline = cloud.notify(lead_s=60)
    d = assert_stopped_by(h, name, f"notice:{cloud.kind}")
    assert d["deadline"] == pytest.approx(deadline, abs=2) and d["within_deadline"] is True
    assert d["remaining_s"] <= 60
    if cloud.kind == "azure":  # the job is safe: the event was approved so the eviction need not wait
        assert cloud.acked == ["evt-1"]
    assert_continues_identically(h, name, d["snapshot"])


def test_snapshot_every_takes_keep_running_snapshots_while_training(h: Harness) -> None:
    args = ["--steps", "100", "--step-sleep", "0.05"]
    start(h, "every", "--snapshot-every", "2s", args=args)
    assert h.wait_end("every", timeout=600) == 0  # a hang guard: on a loaded machine each snapshot takes longer
    taken = [d for d in decisions(h, "every") if d["trigger"] == "periodic" and d["outcome"] == "taken"]
    assert len(taken) >= 2, decisions(h, "every")
    snaps = {s["snapshot"]: s for s in h.ls()}
    assert all(snaps[d["snapshot"]]["mode"] == "keep-running" for d in taken)
    gaps = [b["at"] - a["ended_at"] for a, b in itertools.pairwise(taken)]
    assert all(1.9 <= g <= 3.0 for g in gaps), gaps  # counted from the end of the previous one, not its start
    ref = reference(SCRIPT, args)
    assert h.losses("every", 0) == ref[0] and h.losses("every", 1) == ref[1]  # training undisturbed


def test_deadline_too_short_ends_the_job_on_its_last_snapshot(h: Harness) -> None:
    start(h, "short", "--grace", "0.3s")
    h.wait_step("short", 8)
    last = h.snapshot("short")["snapshot"]
    h.wait_step("short", 14)
    os.kill(agent_pid(h, "short"), signal.SIGTERM)
    assert h.wait_end("short") == 75
    [d] = [d for d in decisions(h, "short") if d["trigger"] == "sigterm"]  # the launch's own decision aside
    assert d["action"] == "use-last" and d["outcome"] == "suspended-in-last" and d["snapshot"] == last, d
    assert "cannot fit" in d["reasons"][0]
    assert [s["snapshot"] for s in h.ls()] == [last]  # no new snapshot was started
    assert_continues_identically(h, "short", last)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_metrics_over_http_after_a_snapshot_and_a_failure(h: Harness) -> None:
    port = free_port()
    start(h, "metered", "--metrics-port", str(port), args=["--steps", "60", "--step-sleep", "0.05"])
    h.wait_step("metered", 6)
    before = scrape(port)
    assert not any(k.startswith("cryosleep_snapshot_phase_seconds") for k in before)
    s = h.snapshot("metered")
    m = scrape(port)
    job = 'job="metered",mode="keep-running"'
    assert m[f'cryosleep_snapshot_phase_seconds{{{job},phase="dump"}}'] == s["phases"]["dump"]
    assert m[f"cryosleep_snapshot_pause_seconds{{{job}}}"] == s["pause_s"] > 0
    assert m[f"cryosleep_snapshot_image_bytes{{{job}}}"] == s["bytes"] > 0
    assert m[f'cryosleep_snapshots_total{{{job},trigger="manual"}}'] == 1
    assert m['cryosleep_snapshot_phase_duration_seconds_count{job="metered",phase="dump"}'] == 1
    assert 0 <= m['cryosleep_last_snapshot_age_seconds{job="metered"}'] < 30
    res = h.cli("snapshot", "--json", "metered", env=dict(h.env, CRYOSLEEP_FAULT="capture-fail"), check=False)
    assert res.returncode != 0
    assert scrape(port)['cryosleep_snapshot_failures_total{job="metered",kind="capture_failed"}'] == 1
    assert h.wait_end("metered") == 0
    assert re.search(r"metrics on http://127\.0\.0\.1:\d+/metrics", h.job("metered").agent_log.read_text())
