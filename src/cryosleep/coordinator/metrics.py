"""The coordinator's own Prometheus metrics, served as ``GET /metrics`` (text exposition format, bearer token).

Each ``Coordinator`` has its own registry (a process may run several: the tests do)::

    cryosleep_coordinator_snapshots_in_flight            gauge     snapshots in progress (recoveries included)
    cryosleep_coordinator_snapshots_total{mode,outcome}  counter   finished snapshots: verified, failed
    cryosleep_coordinator_phase_seconds{phase}           histogram a snapshot phase's wall time (drain = the cut)
    cryosleep_coordinator_phase_cpu_seconds_total{phase} counter   the coordinator process's CPU time during it
    cryosleep_coordinator_round_seconds{op}              histogram one command to every node and every answer
    cryosleep_coordinator_agents_registered              gauge     agents known (one line per node agent)
    cryosleep_coordinator_agents_alive                   gauge     of those, alive (a poll open or recent)
    cryosleep_coordinator_polls_open                     gauge     long polls held open now
    cryosleep_coordinator_commands_queued                gauge     commands queued for agents and not yet answered
    cryosleep_coordinator_requests_total{route,code}     counter   HTTP requests by route and status
    cryosleep_coordinator_errors_total{kind}             counter   requests answered with an error, by kind
    cryosleep_coordinator_relays_connected               gauge     relays with a batched poll open now
    cryosleep_coordinator_relay_agents{relay}            gauge     agents a relay's open batched polls carry
    cryosleep_coordinator_relay_results_total{how}       counter   relays' carried results: merged, own, refused
    cryosleep_coordinator_relay_commands_total{how}      counter   agents' commands sent to relays: round, own

The CPU counter is the whole process's (every HTTP thread included) while the phase ran: with one snapshot at a
time it is what that phase cost the coordinator, and the benchmark reads it to report the coordinator's own CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "CoordinatorMetrics"]

_PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "cryosleep_coordinator_"
        self.in_flight = Gauge(p + "snapshots_in_flight", "Snapshots in progress", registry=r)
        self.snapshots = Counter(p + "snapshots", "Finished snapshots by mode and outcome", ["mode", "outcome"],
                                 registry=r)
        self.phase_seconds = Histogram(p + "phase_seconds", "Wall time of a snapshot phase", ["phase"],
                                       buckets=_PHASE_BUCKETS, registry=r)
        self.phase_cpu = Counter(p + "phase_cpu_seconds", "The coordinator process's CPU time during a phase",
                                 ["phase"], registry=r)
        self.round_seconds = Histogram(p + "round_seconds", "One command fanned out to every node, every answer back",
                                       ["op"], buckets=_ROUND_BUCKETS, registry=r)
        self.agents_registered = Gauge(p + "agents_registered", "Node agents registered", registry=r)
        self.agents_alive = Gauge(p + "agents_alive", "Node agents alive (a poll open or recent)", registry=r)
        self.polls_open = Gauge(p + "polls_open", "Long polls held open", registry=r)
        self.commands_queued = Gauge(p + "commands_queued", "Commands queued for agents, not yet answered",
                                     registry=r)
        self.requests = Counter(p + "requests", "HTTP requests by route and status code", ["route", "code"],
                                registry=r)
        self.errors = Counter(p + "errors", "HTTP requests answered with an error, by kind", ["kind"], registry=r)
        self._request_children: dict[tuple[str, int], Any] = {}
        self.relay_agents = Gauge(p + "relay_agents", "Agents carried by a relay's open batched polls", ["relay"],
                                  registry=r)
        self.relays_connected = Gauge(p + "relays_connected", "Relays with a batched poll open", registry=r)
        self._relays: dict[str, list[int]] = {}  # relay -> [batches open, agents they carry]
        self.relay_results = Counter(p + "relay_results", "Agents' results carried by relays: in a merged answer "
                                     "(one for its group, coordinator/group.py), each its own, or in a merged answer "
                                     "refused", ["how"], registry=r)
        self.relay_commands = Counter(p + "relay_commands", "Agents' commands answered to relays: in a round (one "
                                      "command for several agents) or each its own", ["how"], registry=r)
        self.relays_connected.set_function(lambda: float(sum(1 for b, _ in self._relays.values() if b > 0)))

    def relay_batch(self, relay: str, agents: int, delta: int) -> None:
        """A relay's batched poll opened (``delta`` +1) or closed (-1), carrying ``agents`` (on the event loop)."""
        st = self._relays.setdefault(relay, [0, 0])
        st[0] += delta
        st[1] += delta * agents
        self.relay_agents.labels(relay).set(st[1])

    def request(self, route: str, code: int) -> None:
        """One HTTP request answered (the labelled child looked up once per route and code: every poll counts)."""
        key = (route, code)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(route, str(code))
        child.inc()

    def watch_hub(self, stats: Callable[[], tuple[int, int, int, int]]) -> None:
        """``stats()`` -> (registered, alive, polls open, commands queued), read at each scrape."""
        cache: dict[str, tuple[float, tuple[int, int, int, int]]] = {}

        def read(i: int) -> Callable[[], float]:
            def f() -> float:
                now = time.monotonic()
                hit = cache.get("s")
                if hit is None or now - hit[0] > 0.5:  # one hub pass per scrape, not four
                    hit = cache["s"] = (now, stats())
                return float(hit[1][i])
            return f

        self.agents_registered.set_function(read(0))
        self.agents_alive.set_function(read(1))
        self.polls_open.set_function(read(2))
        self.commands_queued.set_function(read(3))

    def phase_progress(self) -> Callable[[str, str, float | None], None]:
        """A ``timing.Phases`` progress callback that records each phase's wall time and the process's CPU."""
        started: dict[str, float] = {}

        def progress(name: str, what: str, elapsed: float | None) -> None:
            if what == "start":
                started[name] = time.process_time()
                return
            cpu0 = started.pop(name, None)
            if cpu0 is not None:
                self.phase_cpu.labels(name).inc(max(0.0, time.process_time() - cpu0))
            if elapsed is not None:
                self.phase_seconds.labels(name).observe(elapsed)
        return progress

    def render(self) -> bytes:
        return generate_latest(self.registry)
