"""The Prometheus text exposition, written by hand: its format, and scraping it over HTTP."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import pytest

from cryosleep import metrics
from cryosleep.metrics import MetricsServer, Registry

# One sample line of the text format: name, optional {labels}, value.
SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? '
                    r"(-?[0-9.e+-]+|\+Inf|-Inf|NaN)$")


def check_format(text: str) -> dict[str, float]:
    """Every line is a HELP, a TYPE or a sample; returns the samples."""
    out: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind in ("counter", "gauge", "histogram") and name not in typed
            typed.add(name)
            continue
        assert SAMPLE.match(line), f"not a sample line: {line!r}"
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    assert text.endswith("\n")
    return out


def test_snapshot_metrics_histograms_and_ages() -> None:
    now = [1000.0]
    r = Registry(clock=lambda: now[0])
    metrics.record_snapshot("exp", mode="keep-running", phases={"dump": 0.7, "checksum": 0.2}, pause_s=0.75,
                            image_bytes=123456, trigger="periodic", registry=r)
    metrics.record_snapshot("exp", mode="stop", phases={"dump": 3.0, "verify": 0.3}, pause_s=3.5,
                            image_bytes=200000, trigger="sigterm", registry=r)
    metrics.record_failure("exp", "capture_failed", registry=r)
    metrics.record_failure("exp", "capture_failed", registry=r)
    metrics.record_upload("exp", 1000, 2.0, registry=r)
    metrics.record_dedup("exp", 300, 100, registry=r)
    metrics.record_decision("exp", "sigterm", "snapshot", registry=r)
    now[0] = 1042.5
    s = check_format(r.render())
    assert s['cryosleep_snapshot_phase_seconds{job="exp",mode="keep-running",phase="dump"}'] == 0.7
    assert s['cryosleep_snapshot_pause_seconds{job="exp",mode="stop"}'] == 3.5
    assert s['cryosleep_snapshot_image_bytes{job="exp",mode="keep-running"}'] == 123456
    assert s['cryosleep_snapshots_total{job="exp",mode="stop",trigger="sigterm"}'] == 1
    assert s['cryosleep_snapshot_failures_total{job="exp",kind="capture_failed"}'] == 2
    assert s['cryosleep_last_snapshot_age_seconds{job="exp"}'] == 42.5
    assert s['cryosleep_last_verified_snapshot_age_seconds{job="exp"}'] == 42.5  # the stop snapshot
    assert s['cryosleep_upload_rate_bytes_per_second{job="exp"}'] == 500
    assert s['cryosleep_dedup_ratio{job="exp"}'] == 3
    assert s['cryosleep_trigger_decisions_total{action="snapshot",job="exp",trigger="sigterm"}'] == 1
    # The dump histogram: 0.7 and 3.0, cumulative buckets
    h = 'cryosleep_snapshot_phase_duration_seconds'
    assert s[f'{h}_bucket{{job="exp",phase="dump",le="0.5"}}'] == 0
    assert s[f'{h}_bucket{{job="exp",phase="dump",le="1"}}'] == 1
    assert s[f'{h}_bucket{{job="exp",phase="dump",le="5"}}'] == 2
    assert s[f'{h}_bucket{{job="exp",phase="dump",le="+Inf"}}'] == 2
    assert s[f'{h}_sum{{job="exp",phase="dump"}}'] == pytest.approx(3.7)
    assert s[f'{h}_count{{job="exp",phase="dump"}}'] == 2


def test_label_values_are_escaped_and_counters_named_total() -> None:
    r = Registry()
    r.set("x_gauge", "h", 1, job='a"b\\c\nd')
    assert 'x_gauge{job="a\\"b\\\\c\\nd"} 1' in r.render()
    with pytest.raises(ValueError):
        r.inc("x_count", "h")


def test_scrape_over_http_and_404() -> None:
    r = Registry()
    metrics.record_failure("j", "busy", registry=r)
    srv = MetricsServer("127.0.0.1", 0, registry=r)
    srv.start()
    try:
        url = f"http://127.0.0.1:{srv.address[1]}"
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body = resp.read().decode()
        assert check_format(body)['cryosleep_snapshot_failures_total{job="j",kind="busy"}'] == 1
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/other", timeout=5)
        assert e.value.code == 404
    finally:
        srv.close()
