"""`cryosleep coordinator serve`: the catalog, the agents' connections and the snapshot machines behind one
HTTP API (coordinator/httpserver.py: HTTP/1.1 keep-alive on one asyncio event loop; the agents' long polls are
held on the loop, the routes that touch the catalog or may wait run in a thread pool).

Every agent's poll is a request, so the per-request cost bounds a snapshot of thousands of nodes
(docs/benchmarks.md).


Every request but ``GET /v1/health`` carries ``Authorization: Bearer CREDENTIAL``, checked before it is routed
with its body's size and its scope (``security.Gate``: 401, 413, 403, 429); HTTPS with a ``tls`` context.
Errors are the project's JSON form (``{"error": kind, "what", "why", "hint"}``) with a matching status.

Agents::

    POST /v1/agents/register              {job, nnodes, node_rank, ranks, hostname, address, incarnation,
                                           facts, spec}   -> {agent_id, poll_wait_s, protocol}
    POST /v1/agents/{agent}/poll          {incarnation, wait_s, results?}  -> {commands: [...]}  (long poll)
    POST /v1/agents/{agent}/results       {incarnation, results: [...]}    -> {accepted}
    POST /v1/agents/{agent}/leave         {incarnation, reason}            -> {left}  (its job ended there)

Relays (coordinator/relay.py: a relay holds its agents' polls and carries them here in one request)::

    POST /v1/relays/poll                  {wait_s, relay?, agents: [{agent, credential, incarnation, results?}]}
                                          -> {answers: {agent: {status, body}}}  (long poll; the agents not
                                          answered are still waiting: the relay carries them again; entries
                                          with poll: false are results posted on their own, answered at once)

Clients::

    GET  /metrics                          the coordinator's Prometheus metrics (text format; coordinator/metrics.py)
    GET  /v1/jobs                          the jobs, with their nodes' liveness
    GET  /v1/jobs/{job}                    one job: nodes, agents, the snapshot in progress
    POST /v1/jobs/{job}/snapshots          {mode: keep-running|stop, timeout_s, request_id?, wait?, precopy?}
    GET  /v1/jobs/{job}/snapshots          its snapshots (?valid=1: verified only)
    GET  /v1/snapshots                     all snapshots (?job=, ?valid=1)
    GET  /v1/snapshots/{id}                detail: per-node images and phase times, events
    POST /v1/snapshots/{id}/queue          {priority?, timeout_s?, cancel?}: restored once hosts are free (queue.py)
    GET  /v1/snapshots/{id}/queue          its queue entry (?wait_s=&seen=: once it changed)
    GET  /v1/queue                         every entry, in the order they are served, with why each waits
    POST /v1/hosts/{host}/drain            {deadline_s?}: every job with a node there moved off it (drain.py)
    POST /v1/hosts/{host}/undrain          the host takes nodes again
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cryosleep.coordinator import httpserver, security
from cryosleep.coordinator.catalog import Catalog
from cryosleep.coordinator.core import Coordinator, ServiceConfig
from cryosleep.coordinator.group import GROUP
from cryosleep.coordinator.metrics import CONTENT_TYPE_LATEST
from cryosleep.coordinator.protocol import PROTOCOL_VERSION, Result
from cryosleep.coordinator.shared import Lease
from cryosleep.errors import CryosleepError, Forbidden, NotFound, UsageError

__all__ = ["Coordinator", "Server", "ServiceConfig", "parse_listen", "read_token", "shutdown", "start"]

GATHER_S = 0.002
"""A relay's batch, woken by one of its agents' commands, waits this long for the rest of the round's (2 ms: the
commands of one round are queued under one lock acquisition, so they are nearly always all there at once)."""
ROUND: dict[str, Any] = {}  # an agent answered by a round (``group``), not in ``answers``
LEASE_TTL_S = 10.0  # a standby takes over at most this long after the active coordinator died


def read_token(path: Path | str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise UsageError(f"the token file {path} cannot be read", str(e),
                         "create it (e.g. `head -c 32 /dev/urandom | base64 > F; chmod 600 F`) and pass --token-file F"
                         ) from e
    if len(token) < 16:
        raise UsageError(f"the token in {path} is too short", f"{len(token)} characters",
                         "use at least 16 random characters")
    return token


# ---- HTTP ----------------------------------------------------------------------------------------------------

STATUS = {"not_found": 404, "usage": 400, "protocol": 400, "unauthorized": 401, "forbidden": 403, "busy": 409,
          "not_eligible": 409}
Route = tuple[str, re.Pattern[str], str]
ROUTES: list[Route] = [
    ("GET", re.compile(r"^/v1/health$"), "health"),
    ("GET", re.compile(r"^/metrics$"), "metrics"),
    ("POST", re.compile(r"^/v1/agents/register$"), "register"),
    ("POST", re.compile(r"^/v1/agents/(?P<agent>[^/]+)/poll$"), "poll"),
    ("POST", re.compile(r"^/v1/agents/(?P<agent>[^/]+)/results$"), "results"),
    ("POST", re.compile(r"^/v1/agents/(?P<agent>[^/]+)/leave$"), "leave"),
    ("POST", re.compile(r"^/v1/relays/poll$"), "relay_poll"),
    ("GET", re.compile(r"^/v1/jobs$"), "jobs"),
    ("GET", re.compile(r"^/v1/jobs/(?P<job>[^/]+)$"), "job"),
    ("GET", re.compile(r"^/v1/jobs/(?P<job>[^/]+)/snapshots$"), "job_snapshots"),
    ("POST", re.compile(r"^/v1/jobs/(?P<job>[^/]+)/snapshots$"), "trigger"),
    ("GET", re.compile(r"^/v1/snapshots$"), "snapshots"),
    ("GET", re.compile(r"^/v1/snapshots/(?P<sid>[^/]+)$"), "snapshot"),
    ("POST", re.compile(r"^/v1/snapshots/(?P<sid>[^/]+)/restore$"), "rendezvous"),
    ("POST", re.compile(r"^/v1/snapshots/(?P<sid>[^/]+)/place$"), "place"),
    ("POST", re.compile(r"^/v1/snapshots/(?P<sid>[^/]+)/queue$"), "enqueue"),
    ("GET", re.compile(r"^/v1/snapshots/(?P<sid>[^/]+)/queue$"), "queued"),
    ("GET", re.compile(r"^/v1/queue$"), "queue"),
    ("GET", re.compile(r"^/v1/placements/(?P<pid>[^/]+)$"), "placement"),
    ("GET", re.compile(r"^/v1/hosts$"), "hosts"),
    ("POST", re.compile(r"^/v1/hosts/(?P<host>[^/]+)/poll$"), "host_poll"),
    ("POST", re.compile(r"^/v1/orders/(?P<oid>[^/]+)$"), "order"),
    ("POST", re.compile(r"^/v1/hosts/(?P<host>[^/]+)/drain$"), "drain"),
    ("POST", re.compile(r"^/v1/hosts/(?P<host>[^/]+)/undrain$"), "undrain"),
]


class Server(httpserver.Server):
    """The coordinator's HTTP server (coordinator/httpserver.py: one event loop for every connection)."""

    def __init__(self, addr: tuple[str, int], coordinator: Coordinator, gate: security.Gate,
                 tls: ssl.SSLContext | None = None) -> None:
        self.coordinator = coordinator
        self.gate = gate
        self.lease: Lease | None = None
        super().__init__(addr, Api(self), tls, max_buffer=gate.max_body)


ROUTE_NAMES = frozenset(n for _, _, n in ROUTES)
FAST_ROUTES = frozenset({"health", "poll", "results"})
"""Answered on the event loop: the hub's lock only, never the catalog (the rest run in the server's threads)."""


class Api:
    """The routes behind the security gate, for coordinator/httpserver.py: every request is admitted by the gate
    from its head, before its body is read (401, 429, 413, 411: answered, the connection closed); agents'
    polls are held on the event loop, woken by the hub; the routes that touch the catalog or may wait run in
    the server's thread pool."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.verified: dict[str, str] = {}  # agent credentials carried by relays -> their agents

    def head(self, req: httpserver.Request) -> httpserver.Response | None:
        url = urlsplit(req.target)
        adm = self.server.gate.admit(req.method, url.path, req, req.peer)  # security.py
        if adm.error is not None:  # refused before routing, its body unread
            route = adm.route or next((n for m, p, n in ROUTES if m == req.method and p.match(url.path)), "unknown")
            return self._response(route, adm.status, adm.error.to_json(), adm.headers)
        req.state = adm
        return None

    def handle(self, req: httpserver.Request) -> httpserver.Response | Awaitable[httpserver.Response]:
        adm: security.Admission = req.state
        url = urlsplit(req.target)
        route = adm.route or "unknown"
        try:
            if adm.route not in ROUTE_NAMES:
                paths_known = [p for _, p, _ in ROUTES if p.match(url.path)]
                if paths_known:
                    raise UsageError(f"{req.method} is not allowed on {url.path}", "", "see docs/coordinator.md")
                raise NotFound(f"no such endpoint {url.path}", "", "see docs/coordinator.md for the API")
            try:
                body = json.loads(req.body) if req.body else {}
            except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
                raise UsageError("the request body is not JSON", str(e), "") from e
            query = parse_qs(url.query)
            self.server.gate.check(adm, body, query)
            if route == "poll":
                return self._poll(req, adm, body)
            if route == "relay_poll":
                return self._relay_poll(req, adm, body)
            if route in FAST_ROUTES:
                return self._ok(adm, body, self._route(route, adm.params, query, body, req.conn))
            return self._blocking(req, adm, body, query)
        except Exception as e:
            return self._error(route, req, e)

    def failed(self, req: httpserver.Request, e: BaseException) -> httpserver.Response:
        adm = req.state
        return self._error(adm.route if adm is not None and adm.route else "unknown", req, e)

    # ---- answers ----------------------------------------------------------------------------------------------

    def _response(self, route: str, status: int, body: Any, headers: dict[str, str] | None = None,
                  content_type: str = "application/json") -> httpserver.Response:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        m = self.server.coordinator.metrics
        m.request(route, status)
        if status >= 400:
            m.errors.labels(body.get("error", "error") if isinstance(body, dict) else "error").inc()
        return httpserver.Response(status, data, headers or {}, content_type)

    def _ok(self, adm: security.Admission, body: dict[str, Any], result: Any) -> httpserver.Response:
        if adm.route == "metrics":
            return self._response("metrics", 200, result, content_type=CONTENT_TYPE_LATEST)
        return self._response(adm.route, 200, self.server.gate.answer(adm, body, result))

    def _error(self, route: str, req: httpserver.Request, e: BaseException) -> httpserver.Response:
        if isinstance(e, CryosleepError):
            return self._response(route, STATUS.get(e.kind, 500), e.to_json())
        err = CryosleepError("the coordinator failed", f"{type(e).__name__}: {e}", "see the coordinator's log")
        self.server.coordinator.log(f"{req.method} {urlsplit(req.target).path}: {type(e).__name__}: {e}")
        return self._response(route, 500, err.to_json())

    async def _blocking(self, req: httpserver.Request, adm: security.Admission, body: dict[str, Any],
                        query: dict[str, list[str]]) -> httpserver.Response:
        def run() -> Any:
            if adm.route == "metrics":
                return self.server.coordinator.metrics.render()
            result = self._route(adm.route, adm.params, query, body, req.conn)
            return self.server.gate.answer(adm, body, result)

        result = await self.server.run_blocking(run)
        if adm.route == "metrics":
            return self._response("metrics", 200, result, content_type=CONTENT_TYPE_LATEST)
        return self._response(adm.route, 200, result)

    async def _poll(self, req: httpserver.Request, adm: security.Admission,
                    body: dict[str, Any]) -> httpserver.Response:
        """An agent's long poll, held on the loop: the hub wakes it (a command, a change), or its client goes."""
        c = self.server.coordinator
        agent = adm.params["agent"]
        inc, results, wait = c.poll_args(body)
        wake = self.server.wakeup()
        line = c.hub.poll_open(agent, inc, results, wake)
        if line is None:
            raise c.unknown_agent(agent)
        conn = req.conn
        conn.waiting = wake  # its client closing wakes it
        try:
            end = time.monotonic() + wait
            while True:
                got = c.hub.poll_due(line)
                if got is None:
                    raise c.unknown_agent(agent)
                if got is not False:
                    break
                left = end - time.monotonic()
                if left <= 0 or conn.gone:
                    got = []
                    break
                await wake.wait(min(left, c.hub.redeliver_s))
        finally:
            conn.waiting = None
            c.hub.poll_close(line, wake)
        assert isinstance(got, list)
        return self._ok(adm, body, {"commands": [cmd.to_json() for cmd in got]})

    async def _relay_poll(self, req: httpserver.Request, adm: security.Admission,
                          body: dict[str, Any]) -> httpserver.Response:
        """A relay's batched long poll: every carried agent's credential verified, each counted polling while
        the batch is held (liveness as its own poll), the batch woken by any of its agents' commands and answered,
        ``GATHER_S`` later, with every carried agent's commands then due (a round's 64 agents: one answer, not
        64). Only the agents answered are in ``answers``; the others were still waiting. Entries with ``poll: false``
        are results posted on their own: recorded and answered at once (the relay sends them in batches of
        their own)."""
        c = self.server.coordinator
        answers: dict[str, dict[str, Any]] = {}
        out_rounds: list[dict[str, Any]] = []
        verified: dict[str, str] = {}  # agent -> incarnation: the carried agents whose credentials were verified
        polls: list[tuple[str, str, list[Result]]] = []
        wait = c.cfg.poll_wait_s
        for e in body["agents"]:
            agent = str(e["agent"])
            why = self._carried(str(e.get("credential", "")), agent)
            if why is not None:
                err = Forbidden("the coordinator refused a carried poll", why,
                                "the relay must pass each agent's own credential (docs/security.md)")
                answers[agent] = {"status": 403, "body": err.to_json()}
                continue
            verified[agent] = str(e.get("incarnation", ""))
            if e.get("poll") is False:  # results posted on their own, carried: recorded, answered at once
                try:
                    answers[agent] = {"status": 200, "body": c.results(agent, e)}
                except CryosleepError as err:
                    answers[agent] = {"status": STATUS.get(err.kind, 500), "body": err.to_json()}
                continue
            inc, results, w = c.poll_args({"wait_s": body.get("wait_s", wait), **e})
            polls.append((agent, inc, results))
            wait = min(wait, w)
        grouped = GROUP in (body.get("can") or ())
        own = sum(len(r) for _, _, r in polls) + sum(len(e.get("results") or ()) for e in body["agents"]
                                                      if e.get("poll") is False)
        if own:
            c.metrics.relay_results.labels("own").inc(own)
        if body.get("merged"):
            self._merged(body["merged"], verified)
        wake = self.server.wakeup()
        lines = c.hub.batch_open(polls, wake)
        held = {a: line for a, line in lines.items() if line is not None}
        for a in set(lines) - set(held):
            answers[a] = {"status": 404, "body": c.unknown_agent(a).to_json()}
        name = adm.principal.name if adm.principal is not None else "?"
        if body.get("relay"):  # where it listens: relays sharing one credential told apart in the metrics
            name = f"{name} {str(body['relay'])[:200]}"
        c.metrics.relay_batch(name, len(held), +1)
        conn = req.conn
        conn.waiting = wake
        try:
            end = time.monotonic() + wait
            while held and not answers:
                due, rounds = c.hub.batch_rounds(held) if grouped else (c.hub.batch_due(held), [])
                if due or rounds:
                    if len(due) + sum(len(r[1]) for r in rounds) < len(held):  # the round's other commands may be
                        await asyncio.sleep(GATHER_S)  # a moment behind: gather them
                        rest = {a: line for a, line in held.items() if a not in due}
                        for _, agents in rounds:
                            for a in agents:
                                rest.pop(a, None)
                        more, rounds2 = c.hub.batch_rounds(rest) if grouped else (c.hub.batch_due(rest), [])
                        due.update(more)
                        rounds += rounds2
                    for cmd, agents in rounds:  # one command for several agents: the relay hands out the copies
                        out_rounds.append({"command": cmd.to_json(), "agents": agents})
                        for a in agents:
                            answers[a] = ROUND
                    for a, cmds in due.items():
                        answers[a] = {"status": 404, "body": c.unknown_agent(a).to_json()} if cmds is None else \
                            {"status": 200, "body": {"commands": [cmd.to_json() for cmd in cmds]}}
                    break
                left = end - time.monotonic()
                if left <= 0 or conn.gone:
                    break
                await wake.wait(min(left, c.hub.redeliver_s))
        finally:
            conn.waiting = None
            c.hub.batch_close(held.values(), wake)
            c.metrics.relay_batch(name, len(held), -1)
        in_rounds = [a for a, v in answers.items() if v is ROUND]
        for a in in_rounds:
            del answers[a]
        if in_rounds:
            c.metrics.relay_commands.labels("round").inc(len(in_rounds))
        own = sum(len(v["body"].get("commands") or ()) for v in answers.values() if v["status"] == 200)
        if own:
            c.metrics.relay_commands.labels("own").inc(own)
        doc: dict[str, Any] = {"answers": answers, "can": [GROUP]}
        if out_rounds:
            doc["rounds"] = out_rounds
        return self._ok(adm, body, doc)

    def _merged(self, merged: list[dict[str, Any]], carried: dict[str, str]) -> None:
        """A relay's merged answers (coordinator/group.py), each for agents carried in this batch whose own
        credentials were verified: recorded for all of them at once, or for none (``Hub.put_merged``)."""
        c = self.server.coordinator
        for m in merged:
            agents, seconds = [str(a) for a in m.get("agents") or ()], list(m.get("seconds") or ())
            try:
                if len(seconds) != len(agents) or not agents:
                    raise ValueError(f"{len(agents)} agents and {len(seconds)} seconds")
                foreign = [a for a in agents if a not in carried]
                if foreign:
                    raise ValueError(f"it names agents whose own polls it does not carry: {foreign[:5]}")
                res = Result.from_json({**m, "seconds": 0.0})
                ok = c.hub.put_merged(res, [(a, carried[a], float(s)) for a, s in zip(agents, seconds, strict=True)])
            except (CryosleepError, ValueError, TypeError) as e:
                why = e.why if isinstance(e, CryosleepError) else str(e)
                c.log(f"a relay's merged answer to {str(m.get('id'))[:100]} was refused: {why}")
                c.metrics.relay_results.labels("refused").inc(len(m.get("agents") or ()))
                continue
            if ok:
                c.metrics.relay_results.labels("merged").inc(len(agents))
            else:
                c.metrics.relay_results.labels("refused").inc(len(agents))
                c.log(f"a relay's merged answer to {res.id} for {len(agents)} agent(s) was not taken: one of them "
                      "is not the registered incarnation or had answered already (they get the command again)")

    def _carried(self, credential: str, agent: str) -> str | None:
        """``Credentials.carried``, each credential verified once (its HMAC: the same verdict every time)."""
        seen = self.verified.get(credential)
        if seen == agent:
            return None
        why = self.server.gate.creds.carried(credential, agent)
        if why is None:
            if len(self.verified) > 200_000:
                self.verified.clear()
            self.verified[credential] = agent
        return why

    def _route(self, name: str, p: dict[str, str], q: dict[str, list[str]], body: dict[str, Any],
               conn: httpserver.Connection) -> Any:
        c = self.server.coordinator
        valid = (q.get("valid") or ["0"])[0] in ("1", "true", "yes")
        if name == "health":
            return {"ok": True, "protocol": PROTOCOL_VERSION}
        if name == "register":
            return c.register(body)
        if name == "results":
            return c.results(p["agent"], body)
        if name == "leave":
            return c.leave(p["agent"], body)
        if name == "jobs":
            return {"jobs": c.jobs()}
        if name == "job":
            return c.job_status(p["job"])
        if name == "job_snapshots":
            return {"snapshots": c.snapshots(p["job"], valid)}
        if name == "trigger":
            return c.trigger(p["job"], str(body.get("mode", "keep-running")), body.get("timeout_s"),
                             body.get("request_id"), bool(body.get("wait", False)),
                             precopy=body.get("precopy") is not False)
        if name == "rendezvous":
            get = body.get("get") or {}
            return c.board.exchange(p["sid"], body.get("put"), get.get("prefix"), int(get.get("min", 0)),
                                    float(get.get("wait_s", 0.0)))
        if name == "place":
            hosts = body.get("hosts")
            return c.place(p["sid"], list(hosts) if isinstance(hosts, list) else [], body.get("timeout_s"))
        if name == "enqueue":
            if body.get("cancel"):
                return c.queue.cancel(p["sid"])
            return c.enqueue(p["sid"], int(body.get("priority") or 0), body.get("timeout_s"))
        if name == "queued":
            return c.queue.status(p["sid"], float((q.get("wait_s") or ["0"])[0]), (q.get("seen") or [""])[0])
        if name == "queue":
            return {"entries": c.queue.list()}
        if name == "drain":
            return c.drain(p["host"], body.get("deadline_s"))
        if name == "undrain":
            return c.undrain(p["host"])
        if name == "placement":
            return c.placements.status(p["pid"], float((q.get("wait_s") or ["0"])[0]), (q.get("seen") or [""])[0])
        if name == "hosts":
            return {"hosts": c.placements.list_hosts()}
        if name == "host_poll":
            facts = body.get("facts")
            return c.placements.poll(p["host"], facts if isinstance(facts, dict) else {},
                                     float(body.get("wait_s", 0.0)), lambda: conn.gone)
        if name == "order":
            return c.placements.report(p["oid"], body)
        if name == "snapshots":
            jobs = q.get("job")
            return {"snapshots": c.snapshots(jobs[0] if jobs else None, valid)}
        return c.snapshot(p["sid"])


def parse_listen(s: str) -> tuple[str, int]:
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"invalid --listen {s!r}", "expected HOST:PORT", "e.g. --listen 127.0.0.1:7480")
    return host.strip("[]") or "127.0.0.1", int(port)


def start(listen: str, db: Path | str, token: str | security.Credentials, cfg: ServiceConfig | None = None,
          log: Callable[[str], None] | None = None, lease_ttl_s: float = LEASE_TTL_S,
          on_wait: Callable[[dict[str, Any]], None] | None = None,
          on_lost: Callable[[Server, str], None] | None = None, *, tls: ssl.SSLContext | None = None,
          audit: security.Audit | None = None, max_body: int = security.MAX_BODY,
          limiter: security.Limiter | None = None) -> tuple[Server, threading.Thread]:
    """The service in a background thread (tests, the bench); ``serve`` runs it in the foreground. ``token``:
    the one shared token (an admin), or the scoped credentials (coordinator/security.py).

    It serves only while it holds the catalog's lease (coordinator/shared.py): a standby waits here (``on_wait``
    told who holds it) until the active coordinator's lease ran out or was released, then recovers what that one
    left unfinished and only then listens. ``on_lost(server, why)`` once the lease is lost (default: the server
    stops serving)."""
    catalog = Catalog(db)
    lease = Lease(catalog, lease_ttl_s, address=listen, log=log)
    lease.acquire(on_wait)
    coord = Coordinator(catalog, cfg, log)
    creds = token if isinstance(token, security.Credentials) else security.Credentials.single(token)
    gate = security.Gate(creds, ROUTES, security.Lookup.of(coord, creds), max_body=max_body, limiter=limiter,
                         audit=audit)
    try:
        srv = Server(parse_listen(listen), coord, gate, tls)
    except OSError as e:
        coord.close()
        lease.release()
        raise CryosleepError(f"the coordinator cannot listen on {listen}", str(e),
                             "choose another --listen address or port") from e
    srv.lease = lease
    lease.address = srv.url
    lease.try_take()  # renewed now, with the address it serves on (what a standby and an operator read)
    t = threading.Thread(target=srv.serve_forever, name="http", daemon=True)
    t.start()

    def lost(why: str) -> None:
        coord.log(f"stopping: {why}; another coordinator may serve now")
        if on_lost is not None:
            on_lost(srv, why)
        else:
            threading.Thread(target=shutdown, args=(srv,), name="lease-lost", daemon=True).start()

    lease.keep(lost)
    return srv, t


def shutdown(srv: Server) -> None:
    srv.coordinator.close()
    srv.gate.audit.close()
    srv.shutdown()
    srv.server_close()
    if srv.lease is not None:  # after the last answer: a standby takes over at once
        srv.lease.release()
