"""Prometheus metrics of the agent, kept and written out by ``prometheus_client`` (text format 0.0.4).

The agent records into ``REGISTRY`` through the functions below and serves it on ``/metrics``
(``cryosleep run --metrics-port N``). Other parts of Cryosleep record what they know through the same
functions; the store's background upload calls ``record_upload`` and ``record_dedup``, and
``record_verified`` once a snapshot is verified where it is stored::

    cryosleep_snapshot_phase_seconds{job,mode,phase}          gauge      the last snapshot's phase durations
    cryosleep_snapshot_phase_duration_seconds{job,phase}      histogram  every snapshot's phase durations
    cryosleep_snapshot_pause_seconds{job,mode}                gauge      how long the last snapshot stopped the job
    cryosleep_snapshot_pause_duration_seconds{job}            histogram
    cryosleep_snapshot_image_bytes{job,mode}                  gauge      the last snapshot's image size
    cryosleep_snapshots_total{job,mode,trigger}               counter
    cryosleep_snapshot_failures_total{job,kind}               counter    by error kind (capture_failed, busy, ...)
    cryosleep_last_snapshot_timestamp_seconds{job}            gauge
    cryosleep_last_snapshot_age_seconds{job}                  gauge      computed when scraped
    cryosleep_last_verified_snapshot_age_seconds{job}         gauge      computed when scraped
    cryosleep_upload_bytes_total{job}, cryosleep_upload_seconds_total{job}  counters
    cryosleep_upload_rate_bytes_per_second{job}               gauge      the last upload's rate
    cryosleep_dedup_ratio{job}                                gauge      logical bytes / bytes stored (last snapshot)
    cryosleep_trigger_decisions_total{job,trigger,action}     counter
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

__all__ = [
    "REGISTRY",
    "MetricsServer",
    "Registry",
    "record_decision",
    "record_dedup",
    "record_failure",
    "record_snapshot",
    "record_snapshot_result",
    "record_upload",
    "record_verified",
]

BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# No ``<name>_created`` series beside each counter and histogram: the exposition stays the metrics above.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # (untyped in the library)


class _Ages(Collector):
    """Gauges computed when scraped: seconds since a recorded time, one family per name."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.lock = threading.Lock()
        self.families: dict[str, tuple[str, tuple[str, ...], dict[tuple[str, ...], float]]] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        now = self.clock()
        with self.lock:
            families = {n: (h, names, dict(since)) for n, (h, names, since) in self.families.items()}
        for name, (help_, names, since) in sorted(families.items()):
            fam = GaugeMetricFamily(name, help_, labels=names)
            for values, when in sorted(since.items()):
                fam.add_metric(list(values), round(max(0.0, now - when), 3))
            yield fam


class Registry:
    """Metric families by name, made on first use with the label names they are first given; thread-safe.

    Counters, gauges and histograms are ``prometheus_client``'s own, in a registry of their own (not the
    library's process-wide default); ``render()`` is ``generate_latest`` of it, in text format 0.0.4."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self.clock = clock
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, MetricWrapperBase] = {}
        self._ages = _Ages(clock)
        self.registry.register(self._ages)

    def _metric(self, name: str, make: Callable[[tuple[str, ...]], MetricWrapperBase],
                labels: Mapping[str, str]) -> MetricWrapperBase:
        with self._lock:
            m = self._metrics.get(name)
            if m is None:
                m = self._metrics[name] = make(tuple(sorted(labels)))
        return m.labels(**{k: str(v) for k, v in labels.items()}) if labels else m

    def set(self, name: str, help_: str, value: float, **labels: str) -> None:
        g = self._metric(name, lambda ln: Gauge(name, help_, ln, registry=self.registry), labels)
        assert isinstance(g, Gauge)
        g.set(float(value))

    def inc(self, name: str, help_: str, amount: float = 1.0, **labels: str) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total: {name}")
        c = self._metric(name, lambda ln: Counter(name, help_, ln, registry=self.registry), labels)
        assert isinstance(c, Counter)
        c.inc(amount)

    def observe(self, name: str, help_: str, value: float, buckets: Iterable[float] = BUCKETS,
                **labels: str) -> None:
        h = self._metric(name, lambda ln: Histogram(name, help_, ln, registry=self.registry,
                                                    buckets=tuple(sorted(buckets))), labels)
        assert isinstance(h, Histogram)
        h.observe(value)

    def since(self, name: str, help_: str, when: float, **labels: str) -> None:
        names = tuple(sorted(labels))
        with self._ages.lock:
            fam = self._ages.families.setdefault(name, (help_, names, {}))
            fam[2][tuple(str(labels[k]) for k in fam[1])] = when

    def value(self, name: str, **labels: str) -> float | None:
        """A counter's or gauge's current value (for tests and summaries)."""
        v = self.registry.get_sample_value(name, {k: str(v) for k, v in labels.items()})
        return None if v is None else float(v)

    def render(self) -> str:
        return generate_latest(self.registry).decode()

    def clear(self) -> None:
        with self._lock:
            for m in self._metrics.values():
                self.registry.unregister(m)
            self._metrics.clear()
        with self._ages.lock:
            self._ages.families.clear()


REGISTRY = Registry()


def record_snapshot(job: str, *, mode: str, phases: Mapping[str, float], pause_s: float, image_bytes: int,
                    trigger: str = "manual", at: float | None = None, registry: Registry = REGISTRY) -> None:
    """A snapshot was committed (a stop snapshot: also verified)."""
    r = registry
    when = registry.clock() if at is None else at
    for phase, secs in phases.items():
        r.set("cryosleep_snapshot_phase_seconds", "Duration of each phase of the last snapshot", secs,
              job=job, mode=mode, phase=phase)
        r.observe("cryosleep_snapshot_phase_duration_seconds", "Durations of snapshot phases", secs,
                  job=job, phase=phase)
    r.set("cryosleep_snapshot_pause_seconds", "How long the last snapshot stopped the job", pause_s, job=job, mode=mode)
    r.observe("cryosleep_snapshot_pause_duration_seconds", "How long snapshots stopped the job", pause_s, job=job)
    r.set("cryosleep_snapshot_image_bytes", "Image size of the last snapshot", image_bytes, job=job, mode=mode)
    r.inc("cryosleep_snapshots_total", "Snapshots committed", job=job, mode=mode, trigger=trigger)
    r.set("cryosleep_last_snapshot_timestamp_seconds", "When the last snapshot was committed", when, job=job)
    r.since("cryosleep_last_snapshot_age_seconds", "Seconds since the last committed snapshot", when, job=job)
    if mode == "stop":
        record_verified(job, when, registry=registry)


def record_snapshot_result(job: str, result: Mapping[str, Any], trigger: str = "manual",
                           registry: Registry = REGISTRY) -> None:
    """``record_snapshot`` from the result the agent returns for a snapshot (rehearsals are not snapshots)."""
    if not result.get("snapshot"):
        return
    record_snapshot(job, mode=str(result.get("mode", "")), phases=dict(result.get("phases") or {}),
                    pause_s=float(result.get("pause_s") or 0.0), image_bytes=int(result.get("bytes") or 0),
                    trigger=trigger, registry=registry)


def record_verified(job: str, at: float | None = None, registry: Registry = REGISTRY) -> None:
    """A snapshot of ``job`` was verified where it is stored (a stop snapshot; a finished remote upload)."""
    when = registry.clock() if at is None else at
    registry.since("cryosleep_last_verified_snapshot_age_seconds", "Seconds since the last verified snapshot",
                   when, job=job)


def record_failure(job: str, kind: str, registry: Registry = REGISTRY) -> None:
    """A snapshot failed or was refused; ``kind`` is the error's kind (CryosleepError.kind)."""
    registry.inc("cryosleep_snapshot_failures_total", "Snapshots that failed or were refused, by error kind",
                 job=job, kind=kind)


def record_upload(job: str, nbytes: int, seconds: float, registry: Registry = REGISTRY) -> None:
    """Bytes sent to the remote store for ``job`` and how long that took (one upload, or a part of one)."""
    registry.inc("cryosleep_upload_bytes_total", "Bytes uploaded to the remote store", nbytes, job=job)
    registry.inc("cryosleep_upload_seconds_total", "Seconds spent uploading", seconds, job=job)
    if seconds > 0:
        registry.set("cryosleep_upload_rate_bytes_per_second", "Rate of the last upload", nbytes / seconds, job=job)


def record_dedup(job: str, logical_bytes: int, stored_bytes: int, registry: Registry = REGISTRY) -> None:
    """Deduplication of the last snapshot: its logical size against the new bytes it stored."""
    if stored_bytes > 0:
        registry.set("cryosleep_dedup_ratio", "Logical bytes over bytes stored, last snapshot",
                     logical_bytes / stored_bytes, job=job)


def record_decision(job: str, trigger: str, action: str, registry: Registry = REGISTRY) -> None:
    registry.inc("cryosleep_trigger_decisions_total", "Decisions taken on triggers", job=job, trigger=trigger,
                 action=action)


class MetricsServer:
    """``GET /metrics`` over HTTP (bound to loopback unless told otherwise), in a daemon thread."""

    def __init__(self, addr: str = "127.0.0.1", port: int = 0, registry: Registry = REGISTRY) -> None:
        reg = registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served")
                    return
                body = reg.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # scrapes are not worth a log line
                pass

        self.httpd = ThreadingHTTPServer((addr, port), Handler)
        self.httpd.daemon_threads = True
        self.address = (addr, int(self.httpd.server_address[1]))
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()
