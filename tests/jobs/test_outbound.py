"""Connections to peers outside the job, with real CRIU and a real HTTP server outside the sandbox: a job that
POSTs a metric per step keeps its connection through a keep-running snapshot, and a restored copy finds its
connection reset, reconnects, and the server keeps receiving; the job's own connections (gloo, TCPStore)
go on as they were. Nothing may hang: every wait has a timeout, and so has the workload's HTTP client."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from cryosleep.net import job_net
from tests.jobs.harness import Harness, workload

pytestmark = pytest.mark.slow

STEPS = 100  # (with 40, a keep-running snapshot at load 8 once cut the job after its last post: nothing to reconnect)


@dataclass
class Sink:
    """A metrics server on the host's loopback, outside every job: (rank, step, client port) per POST."""

    url: str
    port: int
    records: list[tuple[int, int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def got(self) -> list[tuple[int, int, int]]:
        with self.lock:
            return list(self.records)

    def steps(self, rank: int, ports: set[int] | None = None) -> set[int]:
        return {s for r, s, p in self.got() if r == rank and (ports is None or p in ports)}

    def ports(self, rank: int) -> set[int]:
        return {p for r, _, p in self.got() if r == rank}


@pytest.fixture
def sink() -> Iterator[Sink]:
    yield from serve("127.0.0.1")


@pytest.fixture
def sink_any() -> Iterator[Sink]:
    """The same, on every address of the host (reached from a job network through its gateway)."""
    yield from serve("0.0.0.0")


def serve(host: str) -> Iterator[Sink]:
    state: dict[str, Sink] = {}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: one connection per client, as metrics clients use

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            s = state["sink"]
            with s.lock:
                s.records.append((int(body["rank"]), int(body["step"]), self.client_address[1]))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a reset connection is what the test makes happen

    srv = Server((host, 0), Handler)
    port = srv.server_address[1]
    state["sink"] = Sink(f"http://127.0.0.1:{port}/metrics", int(port))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield state["sink"]
    srv.shutdown()
    srv.server_close()


def log_text(h: Harness, name: str, rank: int) -> str:
    return h.job(name).rank_log(rank).read_text()


def reconnects(h: Harness, name: str, rank: int) -> list[str]:
    return [ln for ln in log_text(h, name, rank).splitlines() if "metrics reconnect" in ln]


def assert_outbound_recorded(h: Harness, sid: str, sink: Sink) -> None:
    out = h.cli_json("show", sid)["nodes"][0]["outbound"]
    assert out["policy"] == {"reset": "all", "keep": [], "drain_s": 2.0}
    assert sorted(c["remote"] for c in out["reset"]) == [f"127.0.0.1:{sink.port}"] * 2, out
    assert all(c["reason"] == "the peer is outside the job" for c in out["reset"])
    assert out["internal"] >= 4  # gloo's pair and the TCPStore connections, both ends of each, are the job's
    assert out["kept"] == []


def assert_finished(h: Harness, name: str) -> None:
    for r in (0, 1):
        steps = [int(x.split()[0]) for x in h.losses(name, r)]
        assert steps == list(range(STEPS)), f"rank {r}: {steps}"
        assert f"done rank {r}" in log_text(h, name, r)


def test_stop_restore_resets_outside_connection_and_job_reconnects(h: Harness, sink: Sink) -> None:
    args = ["--url", sink.url, "--steps", str(STEPS), "--step-sleep", "0.1"]
    h.run("metrics", workload("http_metrics"), args)
    h.wait_step("metrics", 8)
    s = h.snapshot("metrics", "--stop")
    assert "outbound" in s["phases"]
    assert h.wait_end("metrics", timeout=120) == 75
    assert_outbound_recorded(h, s["snapshot"], sink)
    before = {r: sink.ports(r) for r in (0, 1)}
    last = {r: max(sink.steps(r)) for r in (0, 1)}
    assert all(len(before[r]) == 1 for r in (0, 1)), before  # one keep-alive connection per rank so far
    assert not reconnects(h, "metrics", 0) and not reconnects(h, "metrics", 1)

    restored = h.restore(s["snapshot"])
    assert "outbound" in restored["phases"]
    assert h.wait_end("metrics", timeout=180) == 0
    report = json.loads((h.job("metrics").path / "restore" / "outbound.json").read_text())
    # the server still held both connections (a stop dump's kill sends nothing): only the reset ends them
    assert len(report["reset"]) == 2 and report["gone"] == [] and report["failed"] == [], report
    assert "hook_problem" not in report
    assert not any(r.get("late") for r in report["reset"])  # reset before the tasks ran, by CRIU's pre-resume
    for r in (0, 1):
        assert reconnects(h, "metrics", r), f"rank {r} never reconnected"
        new_ports = sink.ports(r) - before[r]
        assert new_ports, f"rank {r} sent nothing on a new connection after the restore"
        # the server kept receiving: every step after the snapshot, up to the last, over the new connection
        assert set(range(last[r] + 1, STEPS)) <= sink.steps(r, new_ports), (r, last[r], sorted(sink.steps(r)))
    assert_finished(h, "metrics")


def test_keep_running_leaves_the_connection_and_only_the_restored_copy_reconnects(h: Harness, sink: Sink) -> None:
    args = ["--url", sink.url, "--steps", str(STEPS), "--step-sleep", "0.1"]
    h.run("metricskr", workload("http_metrics"), args)
    h.wait_step("metricskr", 8)
    s = h.snapshot("metricskr")
    assert s["mode"] == "keep-running" and "outbound" in s["phases"]
    at_snapshot = {r: max(sink.steps(r)) for r in (0, 1)}
    assert h.wait_end("metricskr", timeout=120) == 0
    assert_outbound_recorded(h, s["snapshot"], sink)
    for r in (0, 1):  # the running job: the same connection throughout, never a reconnect
        assert not reconnects(h, "metricskr", r), reconnects(h, "metricskr", r)
        assert len(sink.ports(r)) == 1 and sink.steps(r) == set(range(STEPS))
    assert_finished(h, "metricskr")

    first = {r: sink.ports(r) for r in (0, 1)}
    h.restore(s["snapshot"])  # the copy taken at step ~8 runs again, after the job itself ended
    assert h.wait_end("metricskr", timeout=180) == 0
    report = json.loads((h.job("metricskr").path / "restore" / "outbound.json").read_text())
    # The server closed those connections when the job ended: reset by us, or already by the server's
    # answer to CRIU's window probe, before the restored tasks ran; either way never carried on.
    assert len(report["reset"]) + len(report["gone"]) == 2 and report["failed"] == [], report
    for r in (0, 1):
        assert reconnects(h, "metricskr", r), f"rank {r} of the restored copy never reconnected"
        new_ports = sink.ports(r) - first[r]
        assert new_ports and set(range(at_snapshot[r] + 1, STEPS)) <= sink.steps(r, new_ports)
    assert_finished(h, "metricskr")


def test_outbound_reset_none_carries_the_connection_as_criu_restores_it(h: Harness, sink: Sink) -> None:
    args = ["--url", sink.url, "--steps", str(STEPS), "--step-sleep", "0.1"]
    h.cli_json("run", "--detach", "--name", "metricsnone", "--nproc-per-node", "2", "--outbound-reset", "none",
               str(workload("http_metrics")), *args)
    h.wait_step("metricsnone", 8)
    s = h.snapshot("metricsnone", "--stop")
    assert "outbound" not in s["phases"]
    assert h.wait_end("metricsnone", timeout=120) == 75
    out = h.cli_json("show", s["snapshot"])["nodes"][0]["outbound"]
    assert out == {"policy": {"reset": "none", "keep": [], "drain_s": 2.0}}
    h.restore(s["snapshot"])
    assert h.wait_end("metricsnone", timeout=180) == 0
    assert not (h.job("metricsnone").path / "restore" / "outbound.json").exists()
    for r in (0, 1):  # the server still held the connection: CRIU's copy goes on over it, as before
        assert not reconnects(h, "metricsnone", r) and len(sink.ports(r)) == 1 and sink.steps(r) == set(range(STEPS))
    assert_finished(h, "metricsnone")


def test_a_job_network_sandbox_reaches_the_host_through_its_gateway_and_reconnects(h: Harness,
                                                                                    sink_any: Sink) -> None:
    """`--net job`: the sandbox's only way out is its job bridge's gateway (subnet + 1, this host); the
    connection to a server there is outside the job, so a restored copy finds it reset and reconnects."""
    gateway = job_net("outbound-gw", 0, 1).gateway
    url = f"http://{gateway}:{sink_any.port}/metrics"
    h.run("metricsgw", workload("http_metrics"), ["--url", url, "--steps", str(STEPS), "--step-sleep", "0.1"],
          flags=("--net", "job", "--run-id", "outbound-gw"))
    h.wait_step("metricsgw", 8)
    s = h.snapshot("metricsgw", "--stop")
    assert h.wait_end("metricsgw", timeout=120) == 75
    out = h.cli_json("show", s["snapshot"])["nodes"][0]["outbound"]
    assert sorted(c["remote"] for c in out["reset"]) == [f"{gateway}:{sink_any.port}"] * 2, out
    before = {r: sink_any.ports(r) for r in (0, 1)}
    h.restore(s["snapshot"])
    assert h.wait_end("metricsgw", timeout=180) == 0
    for r in (0, 1):
        assert reconnects(h, "metricsgw", r), f"rank {r} never reconnected"
        assert sink_any.ports(r) - before[r], f"rank {r} sent nothing on a new connection after the restore"
    assert_finished(h, "metricsgw")

