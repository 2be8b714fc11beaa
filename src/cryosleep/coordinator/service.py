"""`cryosleep coordinator serve`: the catalog, the agents' connections and the snapshot machines behind one
HTTP API (standard library ``ThreadingHTTPServer``, HTTP/1.1 keep-alive, one thread per connection).

Every request but ``GET /v1/health`` carries ``Authorization: Bearer CREDENTIAL``, checked before it is routed
with its body's size and its scope (``security.Gate``: 401, 413, 403, 429); HTTPS with a ``tls`` context.
Errors are the project's JSON form (``{"error": kind, "what", "why", "hint"}``) with a matching status.

Agents::

    POST /v1/agents/register              {job, nnodes, node_rank, ranks, hostname, address, incarnation,
                                           facts, spec}   -> {agent_id, poll_wait_s, protocol}
    POST /v1/agents/{agent}/poll          {incarnation, wait_s, results?}  -> {commands: [...]}  (long poll)
    POST /v1/agents/{agent}/results       {incarnation, results: [...]}    -> {accepted}

Clients::

    GET  /v1/jobs                          the jobs, with their nodes' liveness
    GET  /v1/jobs/{job}                    one job: nodes, agents, the snapshot in progress
    POST /v1/jobs/{job}/snapshots          {mode: keep-running|stop, timeout_s, request_id?, wait?}
    GET  /v1/jobs/{job}/snapshots          its snapshots (?valid=1: verified only)
    GET  /v1/snapshots                     all snapshots (?job=, ?valid=1)
    GET  /v1/snapshots/{id}                detail: per-node images and phase times, events
"""

from __future__ import annotations

import json
import re
import select
import socket
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cryosleep.coordinator import security
from cryosleep.coordinator.catalog import Catalog
from cryosleep.coordinator.core import Coordinator, ServiceConfig
from cryosleep.coordinator.protocol import PROTOCOL_VERSION
from cryosleep.errors import CryosleepError, NotFound, UsageError

__all__ = ["Coordinator", "Server", "ServiceConfig", "parse_listen", "read_token", "shutdown", "start"]


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
    ("POST", re.compile(r"^/v1/agents/register$"), "register"),
    ("POST", re.compile(r"^/v1/agents/(?P<agent>[^/]+)/poll$"), "poll"),
    ("POST", re.compile(r"^/v1/agents/(?P<agent>[^/]+)/results$"), "results"),
    ("GET", re.compile(r"^/v1/jobs$"), "jobs"),
    ("GET", re.compile(r"^/v1/jobs/(?P<job>[^/]+)$"), "job"),
    ("GET", re.compile(r"^/v1/jobs/(?P<job>[^/]+)/snapshots$"), "job_snapshots"),
    ("POST", re.compile(r"^/v1/jobs/(?P<job>[^/]+)/snapshots$"), "trigger"),
    ("GET", re.compile(r"^/v1/snapshots$"), "snapshots"),
    ("GET", re.compile(r"^/v1/snapshots/(?P<sid>[^/]+)$"), "snapshot"),
    ("POST", re.compile(r"^/v1/snapshots/(?P<sid>[^/]+)/restore$"), "rendezvous"),
    ("POST", re.compile(r"^/v1/snapshots/(?P<sid>[^/]+)/place$"), "place"),
    ("GET", re.compile(r"^/v1/placements/(?P<pid>[^/]+)$"), "placement"),
    ("GET", re.compile(r"^/v1/hosts$"), "hosts"),
    ("POST", re.compile(r"^/v1/hosts/(?P<host>[^/]+)/poll$"), "host_poll"),
    ("POST", re.compile(r"^/v1/orders/(?P<oid>[^/]+)$"), "order"),
]


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], coordinator: Coordinator, gate: security.Gate,
                 tls: ssl.SSLContext | None = None) -> None:
        self.coordinator = coordinator
        self.gate = gate
        self.tls = tls
        super().__init__(addr, Handler)
        if tls is not None:  # the handshake is each connection's thread's, never the accepting one's
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a failed TLS handshake, a client gone: nothing to answer, nothing to keep

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host!s}:{port}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            self.request.settimeout(30.0)
            self.request.do_handshake()
            self.request.settimeout(None)
        super().setup()
        # a response is written as headers then body: without this, Nagle's algorithm and the client's delayed
        # ACK hold the body back ~40 ms
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per poll would drown the log

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _send(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _gone(self) -> bool:
        """The client closed its connection (a lost agent's long poll): readable with nothing to read."""
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            return bool(r) and socket.socket.recv(self.connection, 1, socket.MSG_PEEK) == b""  # TLS too
        except OSError:
            return True

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        adm = self.server.gate.admit(method, url.path, self.headers, self.client_address[0])  # coordinator/security
        if adm.error is not None:  # refused before routing, its body unread
            self.close_connection = True
            self._send(adm.status, adm.error.to_json(), adm.headers)
            return
        try:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            for m, pattern, name in ROUTES:
                match = pattern.match(url.path)
                if match is None or m != method:
                    continue
                try:
                    body = json.loads(raw) if raw else {}
                except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
                    raise UsageError("the request body is not JSON", str(e), "") from e
                query = parse_qs(url.query)
                self.server.gate.check(adm, body, query)
                result = self._route(name, adm.params, query, body)
                self._send(200, self.server.gate.answer(adm, body, result))
                return
            paths_known = [p for _, p, _ in ROUTES if p.match(url.path)]
            if paths_known:
                raise UsageError(f"{method} is not allowed on {url.path}", "", "see docs/coordinator.md")
            raise NotFound(f"no such endpoint {url.path}", "", "see docs/coordinator.md for the API")
        except CryosleepError as e:
            self._send(STATUS.get(e.kind, 500), e.to_json())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a bug: answer, and keep serving
            err = CryosleepError("the coordinator failed", f"{type(e).__name__}: {e}", "see the coordinator's log")
            self.server.coordinator.log(f"{method} {url.path}: {type(e).__name__}: {e}")
            self._send(500, err.to_json())

    def _route(self, name: str, p: dict[str, str], q: dict[str, list[str]], body: dict[str, Any]) -> Any:
        c = self.server.coordinator
        valid = (q.get("valid") or ["0"])[0] in ("1", "true", "yes")
        if name == "health":
            return {"ok": True, "protocol": PROTOCOL_VERSION}
        if name == "register":
            return c.register(body)
        if name == "poll":
            return c.poll(p["agent"], body, self._gone)
        if name == "results":
            return c.results(p["agent"], body)
        if name == "jobs":
            return {"jobs": c.jobs()}
        if name == "job":
            return c.job_status(p["job"])
        if name == "job_snapshots":
            return {"snapshots": c.snapshots(p["job"], valid)}
        if name == "trigger":
            return c.trigger(p["job"], str(body.get("mode", "keep-running")), body.get("timeout_s"),
                             body.get("request_id"), bool(body.get("wait", False)))
        if name == "rendezvous":
            get = body.get("get") or {}
            return c.board.exchange(p["sid"], body.get("put"), get.get("prefix"), int(get.get("min", 0)),
                                    float(get.get("wait_s", 0.0)))
        if name == "place":
            hosts = body.get("hosts")
            return c.place(p["sid"], list(hosts) if isinstance(hosts, list) else [], body.get("timeout_s"))
        if name == "placement":
            return c.placements.status(p["pid"], float((q.get("wait_s") or ["0"])[0]), (q.get("seen") or [""])[0])
        if name == "hosts":
            return {"hosts": c.placements.list_hosts()}
        if name == "host_poll":
            facts = body.get("facts")
            return c.placements.poll(p["host"], facts if isinstance(facts, dict) else {},
                                     float(body.get("wait_s", 0.0)), self._gone)
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
          log: Callable[[str], None] | None = None, *, tls: ssl.SSLContext | None = None,
          audit: security.Audit | None = None, max_body: int = security.MAX_BODY,
          limiter: security.Limiter | None = None) -> tuple[Server, threading.Thread]:
    """The service in a background thread (tests, the bench); ``serve`` runs it in the foreground. ``token``:
    the one shared token (an admin), or the scoped credentials (coordinator/security.py)."""
    coord = Coordinator(Catalog(db), cfg, log)
    creds = token if isinstance(token, security.Credentials) else security.Credentials.single(token)
    gate = security.Gate(creds, ROUTES, security.Lookup.of(coord, creds), max_body=max_body, limiter=limiter,
                         audit=audit)
    try:
        srv = Server(parse_listen(listen), coord, gate, tls)
    except OSError as e:
        coord.close()
        raise CryosleepError(f"the coordinator cannot listen on {listen}", str(e),
                             "choose another --listen address or port") from e
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, name="http", daemon=True)
    t.start()
    return srv, t


def shutdown(srv: Server) -> None:
    srv.coordinator.close()
    srv.gate.audit.close()
    srv.shutdown()
    srv.server_close()
