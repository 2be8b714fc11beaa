"""The coordinator's Prometheus metrics (GET /metrics), read back with prometheus_client's own parser."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.coordinator.helpers import Env, wait_for
from tests.coordinator.sim import SimFaults


def scrape(env: Env, token: str | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    req = urllib.request.Request(env.url + "/metrics", headers={"Authorization": f"Bearer {token or env.token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(m: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_snapshots_phases_agents_and_requests(env: Env) -> None:
    c = env.cluster(nnodes=3, nproc=2, faults={1: SimFaults(fail={"capture": "disk full"})})
    p = "cryosleep_coordinator_"
    wait_for(lambda: value(scrape(env), p + "polls_open") == 3, 10, "every agent polling")
    m = scrape(env)
    assert value(m, p + "agents_registered") == 3 and value(m, p + "agents_alive") == 3
    assert value(m, p + "snapshots_in_flight") == 0

    failed = env.client().snapshot("sim", timeout_s=20)
    assert failed["state"] == "failed"
    c.nodes[1].faults.fail.clear()
    ok = env.client().snapshot("sim", timeout_s=20)
    assert ok["state"] == "verified"
    m = scrape(env)
    assert value(m, p + "snapshots_total", mode="keep-running", outcome="failed") == 1
    assert value(m, p + "snapshots_total", mode="keep-running", outcome="verified") == 1
    assert value(m, p + "phase_seconds_count", phase="drain") == 2
    assert value(m, p + "phase_seconds_count", phase="persist") == 1  # the failed one never got there
    assert value(m, p + "phase_seconds_count", phase="rollback") == 1
    assert value(m, p + "phase_cpu_seconds_total", phase="drain") > 0
    assert value(m, p + "round_seconds_count", op="capture") == 2  # one round per snapshot
    assert value(m, p + "round_seconds_count", op="net_hold") == 0  # the capture command holds the network
    assert value(m, p + "requests_total", route="trigger", code="200") == 2
    assert value(m, p + "requests_total", route="poll", code="200") > 10

    # an error is counted by route, status and kind; a scrape without the token is refused
    try:
        urllib.request.urlopen(urllib.request.Request(env.url + "/v1/snapshots/nope",
                                                      headers={"Authorization": f"Bearer {env.token}"}), timeout=30)
        raise AssertionError("an unknown snapshot was found")
    except urllib.error.HTTPError as e:
        assert e.code == 404
    try:
        scrape(env, "not-the-token-at-all")
        raise AssertionError("/metrics answered without the token")
    except urllib.error.HTTPError as e:
        assert e.code == 401
    m = scrape(env)
    assert value(m, p + "requests_total", route="snapshot", code="404") == 1
    assert value(m, p + "errors_total", kind="not_found") == 1
    assert value(m, p + "requests_total", route="metrics", code="401") == 1

    c.runners[2].halt()  # a lost agent: no longer alive once lost_after_s has passed
    wait_for(lambda: value(scrape(env), p + "agents_alive") == 2, 15, "the lost agent counted out")
