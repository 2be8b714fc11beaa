"""Prometheus metrics of the agent, in the text exposition format (written here with the standard library).

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

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

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

Labels = tuple[tuple[str, str], ...]
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: Labels = ()) -> str:
    items = (*labels, *extra)
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _num(v: float) -> str:
    f = float(v)
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if math.isnan(f):
        return "NaN"
    return str(int(f)) if f.is_integer() and abs(f) < 1e15 else repr(f)


class _Family:
    def __init__(self, name: str, kind: str, help_: str) -> None:
        self.name, self.kind, self.help = name, kind, help_

    def lines(self, now: float) -> list[str]:
        raise NotImplementedError


class _Values(_Family):
    """A counter or gauge: one value per label set."""

    def __init__(self, name: str, kind: str, help_: str) -> None:
        super().__init__(name, kind, help_)
        self.values: dict[Labels, float] = {}

    def lines(self, now: float) -> list[str]:
        return [f"{self.name}{_labels(k)} {_num(v)}" for k, v in sorted(self.values.items())]


class _Age(_Family):
    """A gauge computed when scraped: seconds since a recorded time."""

    def __init__(self, name: str, help_: str) -> None:
        super().__init__(name, "gauge", help_)
        self.since: dict[Labels, float] = {}

    def lines(self, now: float) -> list[str]:
        return [f"{self.name}{_labels(k)} {_num(round(max(0.0, now - t), 3))}" for k, t in sorted(self.since.items())]


class _Histogram(_Family):
    def __init__(self, name: str, help_: str, buckets: Iterable[float]) -> None:
        super().__init__(name, "histogram", help_)
        self.buckets = tuple(sorted(buckets))
        self.series: dict[Labels, tuple[list[int], list[float]]] = {}  # counts per bucket, [sum, count]

    def lines(self, now: float) -> list[str]:
        out = []
        for k, (counts, (total, n)) in sorted(self.series.items()):
            cum = 0
            for b, c in zip(self.buckets, counts, strict=True):
                cum += c
                out.append(f"{self.name}_bucket{_labels(k, (('le', _num(b)),))} {cum}")
            out.append(f"{self.name}_bucket{_labels(k, (('le', '+Inf'),))} {int(n)}")
            out.append(f"{self.name}_sum{_labels(k)} {_num(round(total, 6))}")
            out.append(f"{self.name}_count{_labels(k)} {int(n)}")
        return out


class Registry:
    """Metric families by name; thread-safe; ``render()`` gives the text exposition format (version 0.0.4)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        self.clock = clock

    def _family(self, name: str, make: Callable[[], _Family]) -> _Family:
        fam = self._families.get(name)
        if fam is None:
            fam = self._families[name] = make()
        return fam

    @staticmethod
    def _key(labels: Mapping[str, str]) -> Labels:
        return tuple(sorted((k, str(v)) for k, v in labels.items()))

    def set(self, name: str, help_: str, value: float, **labels: str) -> None:
        with self._lock:
            fam = self._family(name, lambda: _Values(name, "gauge", help_))
            assert isinstance(fam, _Values)
            fam.values[self._key(labels)] = float(value)

    def inc(self, name: str, help_: str, amount: float = 1.0, **labels: str) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"a counter's name ends in _total: {name}")
        with self._lock:
            fam = self._family(name, lambda: _Values(name, "counter", help_))
            assert isinstance(fam, _Values)
            key = self._key(labels)
            fam.values[key] = fam.values.get(key, 0.0) + amount

    def observe(self, name: str, help_: str, value: float, buckets: Iterable[float] = BUCKETS,
                **labels: str) -> None:
        with self._lock:
            fam = self._family(name, lambda: _Histogram(name, help_, buckets))
            assert isinstance(fam, _Histogram)
            counts, agg = fam.series.setdefault(self._key(labels), ([0] * len(fam.buckets), [0.0, 0.0]))
            for i, b in enumerate(fam.buckets):
                if value <= b:
                    counts[i] += 1
                    break
            agg[0] += value
            agg[1] += 1

    def since(self, name: str, help_: str, when: float, **labels: str) -> None:
        with self._lock:
            fam = self._family(name, lambda: _Age(name, help_))
            assert isinstance(fam, _Age)
            fam.since[self._key(labels)] = when

    def value(self, name: str, **labels: str) -> float | None:
        """A counter's or gauge's current value (for tests and summaries)."""
        with self._lock:
            fam = self._families.get(name)
            if isinstance(fam, _Values):
                return fam.values.get(self._key(labels))
            return None

    def render(self) -> str:
        now = self.clock()
        out: list[str] = []
        with self._lock:
            for name in sorted(self._families):
                fam = self._families[name]
                out.append(f"# HELP {name} {fam.help}")
                out.append(f"# TYPE {name} {fam.kind}")
                out.extend(fam.lines(now))
        return "\n".join(out) + "\n"

    def clear(self) -> None:
        with self._lock:
            self._families.clear()


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
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
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
