"""The agent's Prometheus metrics (kept by prometheus_client): their names, types, labels and values as
Prometheus's own parser reads them, and scraping them over HTTP."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cryosleep import metrics
from cryosleep.metrics import MetricsServer, Registry

# One sample line of the text format: name, optional {labels}, value.
SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? '
                    r"(-?[0-9.e+-]+|\+Inf|-Inf|NaN)$")


def _le(v: str) -> str:
    f = float(v)
    return v if f == float("inf") else (str(int(f)) if f.is_integer() else repr(f))


def check_format(text: str) -> dict[str, float]:
    """Every line is a HELP, a TYPE or a sample, and Prometheus's parser reads the whole text; returns the
    samples as the parser sees them, keyed ``name{labels}`` (labels sorted, ``le`` last as a number)."""
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
    assert text.endswith("\n")
    out: dict[str, float] = {}
    kinds: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        kinds[fam.name] = fam.type
        for s in fam.samples:
            labels = [f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "le"]
            labels += [f'le="{_le(s.labels["le"])}"'] if "le" in s.labels else []
            out[s.name + ("{" + ",".join(labels) + "}" if labels else "")] = s.value
    assert len(kinds) == len(typed), (kinds, typed)  # every family the parser found was declared once
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
    kinds = {f.name: f.type for f in text_string_to_metric_families(r.render())}
    assert kinds == {
        "cryosleep_snapshot_phase_seconds": "gauge", "cryosleep_snapshot_phase_duration_seconds": "histogram",
        "cryosleep_snapshot_pause_seconds": "gauge", "cryosleep_snapshot_pause_duration_seconds": "histogram",
        "cryosleep_snapshot_image_bytes": "gauge", "cryosleep_snapshots": "counter",
        "cryosleep_last_snapshot_timestamp_seconds": "gauge", "cryosleep_last_snapshot_age_seconds": "gauge",
        "cryosleep_last_verified_snapshot_age_seconds": "gauge", "cryosleep_snapshot_failures": "counter",
        "cryosleep_upload_bytes": "counter", "cryosleep_upload_seconds": "counter",
        "cryosleep_upload_rate_bytes_per_second": "gauge", "cryosleep_dedup_ratio": "gauge",
        "cryosleep_trigger_decisions": "counter",
    }  # the parser names a counter's family without its _total; its samples keep it
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
    assert 'x_gauge{job="a\\"b\\\\c\\nd"} 1.0' in r.render()
    (fam,) = text_string_to_metric_families(r.render())
    assert fam.samples[0].labels == {"job": 'a"b\\c\nd'} and fam.samples[0].value == 1
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
