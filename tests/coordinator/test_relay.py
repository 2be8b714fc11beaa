"""Relays (coordinator/relay.py): the batched poll's rules at the coordinator (who may carry whose polls, bad
input), snapshots whose agents' polls all go through relays, and agents that fall back to the coordinator when
their relay dies in the middle of a round, and go back to it once it is there again."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cryosleep.coordinator import group, relay, security, service
from cryosleep.coordinator.client import CoordinatorClient, Failover, Http
from cryosleep.coordinator.protocol import Op, Result, drain_answer, summary_to_json
from cryosleep.cut.summary import decide_nodes, summarize
from cryosleep.cut.views import RankView
from cryosleep.errors import Forbidden, ProtocolError, UsageError
from tests.coordinator.helpers import FAST, listening, serving, wait_for
from tests.coordinator.sim import SimCluster, SimFaults
from tests.coordinator.simloop import LoopAgents
from tests.unit.test_cut_summary import _same, _split, job

ADMIN, RELAY, BOOT = (f"{n}-{'x' * 20}" for n in ("admin", "relay-1", "boot"))


@contextmanager
def scoped(tmp: Path) -> Iterator[service.Server]:
    creds = security.Credentials.parse({"admin": [ADMIN], "bootstrap": [{"token": BOOT}],
                                        "relays": {"r1": RELAY}})
    srv, _ = service.start("127.0.0.1:0", str(tmp / "catalog.db"), creds, FAST, log=lambda _m: None)
    try:
        yield srv
    finally:
        service.shutdown(srv)
        srv.coordinator.catalog.close()


def register(url: str, node: int, nnodes: int = 2) -> tuple[str, str]:
    res = Http(url, BOOT).call("POST", "/v1/agents/register", {"job": "rj", "nnodes": nnodes, "node_rank": node,
                                                                "incarnation": f"inc{node}", "ranks": [node]})
    return str(res["agent_id"]), str(res["credential"])


def batch(url: str, token: str, agents: Any, wait_s: float = 0.0) -> dict[str, Any]:
    return Http(url, token).call("POST", "/v1/relays/poll", {"wait_s": wait_s, "agents": agents})


def test_the_batched_poll_carries_only_polls_whose_agents_credentials_it_carries(tmp_path: Path) -> None:
    with scoped(tmp_path) as srv:
        a0, c0 = register(srv.url, 0)
        a1, c1 = register(srv.url, 1)
        assert batch(srv.url, RELAY, [{"agent": a0, "credential": c0, "incarnation": "inc0"}])["answers"] == {}
        srv.coordinator.hub.send(a0, "cmd-1", "snap", "rj", Op.RUN, {}, time.monotonic() + 30)
        got = batch(srv.url, RELAY, [{"agent": a0, "credential": c0, "incarnation": "inc0"},
                                     {"agent": a1, "credential": c1, "incarnation": "inc1"}], wait_s=5)
        assert list(got["answers"]) == [a0]  # agent 1 had nothing: still waiting, not answered
        assert got["answers"][a0]["status"] == 200
        assert [c["id"] for c in got["answers"][a0]["body"]["commands"]] == ["cmd-1"]
        # a result riding on a carried poll reaches the hub
        res = {"id": "cmd-1", "snapshot": "snap", "op": "run", "ok": True, "data": {}, "elapsed_s": 0.0}
        batch(srv.url, RELAY, [{"agent": a0, "credential": c0, "incarnation": "inc0", "results": [res]}])
        assert srv.coordinator.hub.result(a0, "cmd-1") is not None
        # results posted on their own, carried: recorded, answered at once with the results route's answer
        srv.coordinator.hub.send(a1, "cmd-2", "snap", "rj", Op.RUN, {}, time.monotonic() + 30)
        res2 = {**res, "id": "cmd-2"}
        got = batch(srv.url, RELAY, [{"agent": a1, "credential": c1, "incarnation": "inc1", "results": [res2],
                                      "poll": False}], wait_s=5)
        assert got["answers"] == {a1: {"status": 200, "body": {"accepted": 1}}}
        assert srv.coordinator.hub.result(a1, "cmd-2") is not None
        # another agent's credential, a made-up one, none: that agent's poll refused, the others' carried
        got = batch(srv.url, RELAY, [{"agent": a1, "credential": c0, "incarnation": "inc1"},
                                     {"agent": a0, "credential": "csa1.forged.mac", "incarnation": "inc0"},
                                     {"agent": "rj@5", "incarnation": "x"}])["answers"]
        assert {k: v["status"] for k, v in got.items()} == {a1: 403, a0: 403, "rj@5": 403}
        assert "credential of agent rj@0, not rj@1" in got[a1]["body"]["why"]
        # a wrong incarnation: register again, as a direct poll is told
        got = batch(srv.url, RELAY, [{"agent": a1, "credential": c1, "incarnation": "old"}])["answers"]
        assert got[a1]["status"] == 404 and got[a1]["body"]["details"]["reregister"]
        # an agent's credential cannot use the relay route; a relay's can do nothing else
        with pytest.raises(Forbidden, match="the coordinator refused"):
            batch(srv.url, c0, [{"agent": a0, "credential": c0, "incarnation": "inc0"}])
        for method, path, body in [("POST", f"/v1/agents/{a0}/poll", {"incarnation": "inc0", "wait_s": 0}),
                                   ("GET", "/v1/jobs", None), ("POST", "/v1/agents/register",
                                                                {"job": "rj", "nnodes": 2, "node_rank": 0,
                                                                 "incarnation": "z"})]:
            with pytest.raises(Forbidden, match="a relay credential may not use this endpoint"):
                Http(srv.url, RELAY).call(method, path, body)
        # bad input: clear errors
        with pytest.raises(ProtocolError, match="lacks agents"):
            Http(srv.url, RELAY).call("POST", "/v1/relays/poll", {"wait_s": 0})
        with pytest.raises(UsageError, match="agents is malformed"):
            batch(srv.url, RELAY, {"agent": a0})
        with pytest.raises(UsageError, match=r"agents\[0\] is malformed"):
            batch(srv.url, RELAY, ["rj@0"])
        with pytest.raises(UsageError, match=r"agents\[0\]\.incarnation is malformed"):
            batch(srv.url, RELAY, [{"agent": a0, "credential": c0, "incarnation": 3}])
        with pytest.raises(UsageError, match=r"agents\[0\]\.results are malformed"):
            batch(srv.url, RELAY, [{"agent": a0, "credential": c0, "incarnation": "inc0", "results": [1]}])


def requests(srv: service.Server, route: str) -> float:
    return sum(s.value for fam in srv.coordinator.metrics.requests.collect() for s in fam.samples
               if s.name.endswith("_total") and s.labels["route"] == route)


def gauge(g: Any) -> float:
    return float(next(s.value for fam in g.collect() for s in fam.samples))


def test_snapshots_through_relays_take_no_direct_poll(tmp_path: Path) -> None:
    with serving(tmp_path) as env:
        relays = [relay.start(("127.0.0.1", 0), env.url, env.token) for _ in range(2)]
        groups = zip(relays, (range(0, 2), range(2, 4)), strict=True)
        parts = [LoopAgents(f"{r.url},{env.url}", env.token, tmp_path / "store", job="rel", nnodes=4, nproc=2,
                            seed=2, only=only, wait_s=2.0) for r, only in groups]
        try:
            for p in parts:
                p.start(timeout=30)
            m = env.coordinator.metrics
            wait_for(lambda: gauge(m.relays_connected) == 2, what="two relays connected")
            client = env.client()
            for stop in (False, True):
                s = client.snapshot("rel", stop=stop, timeout_s=30)
                assert s["state"] == "verified", s
            assert requests(env.srv, "poll") == requests(env.srv, "results") == 0  # every poll and result carried
            assert requests(env.srv, "relay_poll") > 0
            assert all(r.batches > 0 for r in relays)
            text = m.render().decode()
            assert f'cryosleep_coordinator_relay_agents{{relay="admin {relays[0].url}"}}' in text
            for p in parts:
                for a in p.agents:
                    ops = [op for _, op in a.node.ops]
                    assert ops.count("capture") == 2 and ops.count("stop") == 1, ops
        finally:
            for p in parts:
                p.close()
            for r in relays:
                r.stop()


def launch_relay(tmp: Path, upstream: str, listen: str = "127.0.0.1:0") -> tuple[subprocess.Popen[str], str]:
    (tmp / "relay-token").write_text((tmp / "token").read_text())
    p = subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "coordinator", "relay", "--upstream", upstream,
                          "--listen", listen, "--token-file", str(tmp / "relay-token"), "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env={**os.environ, "CRYOSLEEP_HOME": str(tmp / "home")})
    try:
        return p, listening(p)
    except BaseException:
        p.kill()
        p.wait(10)
        raise


def test_a_relay_killed_mid_round_costs_a_redelivery_and_agents_come_back(tmp_path: Path) -> None:
    """The real agent's runner (client.AgentRunner) through a relay process: killed while the capture round is
    out, its agents poll the coordinator directly and the snapshot completes; the event-loop agents go back to
    a relay started again on the same address."""
    with serving(tmp_path) as env:
        proc, url = launch_relay(tmp_path, env.url)
        faults = {0: SimFaults(delay={"capture": 1.5})}
        cluster = SimCluster(f"{url},{env.url}", env.token, tmp_path / "store", job="kill", nnodes=3, nproc=2,
                             faults=faults, wait_s=2.0).start()
        try:
            client = env.client()
            assert client.snapshot("kill", timeout_s=30)["state"] == "verified"
            assert requests(env.srv, "poll") == 0
            s = client.snapshot("kill", timeout_s=30, wait=False)
            wait_for(lambda: any(op == "capture" for _, op in cluster.nodes[0].ops[-3:]), what="the capture round")
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            t = time.monotonic()
            done = env.coordinator.wait_snapshot(s["id"], 60)
            assert done["state"] == "verified", done
            assert time.monotonic() - t < 20
            assert requests(env.srv, "poll") > 0  # the agents went to the coordinator directly
        finally:
            cluster.close()
            if proc.poll() is None:
                proc.kill()
        # the event-loop agents: back to the relay once it listens again (after back_after_s on the coordinator)
        proc, url = launch_relay(tmp_path, env.url)
        port = url.rsplit(":", 1)[1]
        agents = LoopAgents(f"{url},{env.url}", env.token, tmp_path / "store", job="back", nnodes=2, nproc=2,
                            wait_s=2.0, back_after_s=1.0)
        try:
            agents.start(timeout=30)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            wait_for(lambda: all(a.failover.at == 1 for a in agents.agents), what="the agents on the coordinator")
            proc, url2 = launch_relay(tmp_path, env.url, f"127.0.0.1:{port}")
            assert url2 == url
            wait_for(lambda: all(a.failover.at == 0 for a in agents.agents), timeout=30, what="back on the relay")
            assert env.client().snapshot("back", timeout_s=30)["state"] == "verified"
        finally:
            agents.close()
            proc.kill()
            proc.wait(10)


def test_http_falls_back_to_the_next_url_and_back() -> None:
    now = [0.0]
    f = Failover(["a", "b"], back_after_s=10.0, clock=lambda: now[0])
    assert f.order() == [0, 1]
    assert f.worked(1) and f.order() == [1, 0]
    now[0] = 10.0
    assert f.order() == [0, 1]  # the first again after back_after_s


def test_http_with_a_dead_relay_reaches_the_coordinator(tmp_path: Path) -> None:
    with serving(tmp_path) as env:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        c = CoordinatorClient(f"{dead},{env.url}", env.token)
        assert c.jobs() == []
        assert c.http.failover.at == 1


def test_an_agent_gone_behind_a_relay_is_lost_as_soon_as_without_one(tmp_path: Path) -> None:
    """Its batch ends when its connection to the relay closes (the others are carried again at once), so the
    coordinator counts it lost ``lost_after_s`` later, not after the batch's whole wait."""
    cfg = service.ServiceConfig(poll_wait_s=20.0, lost_after_s=1.0, rollback_s=15.0, redeliver_s=0.5)
    with serving(tmp_path, cfg) as env:
        r = relay.start(("127.0.0.1", 0), env.url, env.token)
        cluster = SimCluster(f"{r.url},{env.url}", env.token, tmp_path / "store", job="gone", nnodes=3, nproc=1,
                             wait_s=20.0).start()
        try:
            hub = env.coordinator.hub
            wait_for(lambda: all(hub.line(f"gone@{n}").polling for n in range(3)), what="all three carried")
            cluster.runners[1].halt()
            t = time.monotonic()
            wait_for(lambda: not hub.alive("gone@1", 1.0), timeout=10, what="node 1 lost")
            assert time.monotonic() - t < 5
            assert hub.alive("gone@0", 1.0) and hub.alive("gone@2", 1.0)
            wait_for(lambda: all(hub.line(f"gone@{n}").polling for n in (0, 2)), what="the others carried again")
        finally:
            cluster.close()
            r.stop()


# ---- a relay's group as one answer, one command (coordinator/group.py) --------------------------------------

@given(job(), st.integers(0, 2**32))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_merged_summaries_give_the_cut_of_the_nodes_own(case: Any, seed: int) -> None:
    """Nodes' drain answers merged by relays (any grouping, some agents on their own) and read back by the
    coordinator decide the same as the nodes' own summaries."""
    views, floor = case
    rng = random.Random(seed)
    nodes = _split(views, rng)
    answers = {n: {"id": "s.2.hold", "snapshot": "s", "op": "hold", "ok": True, "seconds": 0.1,
                   "data": drain_answer(vs, True)} for n, vs in enumerate(nodes)}
    ranks = {n: [v.rank for v in vs] for n, vs in enumerate(nodes)}
    ok: dict[int, Any] = {}
    order = list(answers)
    rng.shuffle(order)
    while order:  # relays of random sizes
        k = rng.randint(1, len(order))
        part, order = order[:k], order[k:]
        merged, rest = group.merge([(str(n), answers[n]) for n in part])
        for m in merged:
            data = Result.from_json({**m, "seconds": 0.0}).data
            ok.update({int(a): data for a in m["agents"]})
        ok.update({int(a): rs[0]["data"] for a, rs in rest.items()})
    assert set(ok) == set(answers)
    sums = group.summaries(ok, ranks)
    got = decide_nodes(0.0, 1.0, list({id(s): s for s in sums.values()}.values()), floor)
    want = decide_nodes(0.0, 1.0, [summarize(vs) for vs in nodes], floor)
    _same(got, want)
    assert got.unsettled == want.unsettled and got.reason == want.reason


def test_a_merged_answer_that_names_ranks_of_other_nodes_is_refused() -> None:
    views = [RankView(rank=r, comms=()) for r in range(4)]
    data = {"summary": summary_to_json(summarize(views))}  # the ranks of nodes 0-3, said to be nodes 0 and 1's
    with pytest.raises(ProtocolError, match=r"counts 4 rank\(s\) of their 2"):
        group.summaries({0: data, 1: data}, {0: [0], 1: [1], 2: [2], 3: [3]})
    group.summaries({0: data, 1: data}, {0: [0, 1], 1: [2, 3]})  # theirs: taken


def test_a_relay_merges_and_takes_rounds_only_from_a_coordinator_that_can(tmp_path: Path) -> None:
    """Negotiated: a merged answer carried only to a coordinator that said ``can: [group]``; and an old relay
    (no ``can``) gets every agent's commands one by one, as before."""
    with scoped(tmp_path) as srv:
        a0, c0 = register(srv.url, 0)
        a1, c1 = register(srv.url, 1)
        hub = srv.coordinator.hub
        carried = [{"agent": a0, "credential": c0, "incarnation": "inc0"},
                   {"agent": a1, "credential": c1, "incarnation": "inc1"}]
        hub.send_round("c1", "snap", "rj", Op.RUN, {a0: {}, a1: {}}, time.monotonic() + 30)
        got = batch(srv.url, RELAY, carried, wait_s=5)  # an old relay: one command per agent
        assert "rounds" not in got and sorted(got["answers"]) == sorted([a0, a1])
        assert got["can"] == ["group"]
        args: dict[str, Any] = {}
        hub.send_round("c2", "snap", "rj", Op.RUN, dict.fromkeys((a0, a1), args), time.monotonic() + 30)
        got = Http(srv.url, RELAY).call("POST", "/v1/relays/poll", {"wait_s": 5, "agents": carried,
                                                                    "can": ["group"]})
        assert got["answers"] == {} and [r["agents"] for r in got["rounds"]] == [[a0, a1]]
        assert got["rounds"][0]["command"]["id"] == "c2"
        # the merged answer: for both at once; one naming an agent it does not carry is refused
        m = {"id": "c2", "snapshot": "snap", "op": "run", "ok": True, "data": {}, "agents": [a0, a1],
             "seconds": [0.1, 0.2]}
        Http(srv.url, RELAY).call("POST", "/v1/relays/poll", {"wait_s": 0, "agents": carried[:1], "merged": [m]})
        assert hub.result(a0, "c2") is None and hub.result(a1, "c2") is None
        Http(srv.url, RELAY).call("POST", "/v1/relays/poll", {"wait_s": 0, "agents": carried, "merged": [m]})
        assert hub.result(a0, "c2") is not None and hub.result(a1, "c2").seconds == 0.2  # type: ignore[union-attr]
    # the relay: nothing merged before the coordinator said it can
    r = relay.Relay(("127.0.0.1", 0), "http://127.0.0.1:9", RELAY)
    try:
        res = {"id": "x", "snapshot": "s", "op": "run", "ok": True, "data": {}}
        assert r._merge([("a", res), ("b", res)]) == ([], {"a": [res], "b": [res]})
        r.grouping = True
        merged, rest = r._merge([("a", res), ("b", res)])
        assert [m["agents"] for m in merged] == [["a", "b"]] and rest == {}
    finally:
        r.stop()


def test_agents_behind_grouping_relays_snapshot_and_one_lost_mid_drain_fails_it(tmp_path: Path) -> None:
    cfg = service.ServiceConfig(poll_wait_s=5.0, lost_after_s=1.0, rollback_s=15.0, redeliver_s=0.5)
    with serving(tmp_path, cfg) as env:
        relays = [relay.start(("127.0.0.1", 0), env.url, env.token) for _ in range(2)]
        # the agent runner's own loop (SimCluster): its polls stop when the node dies (LoopAgents' do not)
        parts = [SimCluster(f"{r.url},{env.url}", env.token, tmp_path / "store", job="grp", nnodes=4, nproc=2,
                            seed=3, only=only, wait_s=2.0) for r, only in zip(relays, (range(0, 2), range(2, 4)),
                                                                                strict=True)]
        try:
            for p in parts:
                p.start(timeout=30)
            client = env.client()
            assert client.snapshot("grp", stop=False, timeout_s=30)["state"] == "verified"
            assert all(r.merged > 0 and r.rounds > 0 for r in relays)  # answers merged, commands sent once
            assert requests(env.srv, "poll") == 0  # every poll carried
            m = env.coordinator.metrics  # and the coordinator counts what came merged and went in rounds
            assert m.relay_results.labels("merged")._value.get() > 0
            assert m.relay_commands.labels("round")._value.get() > 0
            parts[1].nodes[1].faults = SimFaults(die="drain")  # node 3, behind the second relay
            s = client.snapshot("grp", stop=False, timeout_s=30)
            assert s["state"] == "failed", s
            assert "node 3" in s["error"]["why"] and "lost" in s["error"]["why"], s["error"]
        finally:
            for p in parts:
                p.close()
            for r in relays:
                r.stop()
