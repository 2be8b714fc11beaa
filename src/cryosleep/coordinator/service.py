"""`cryosleep coordinator serve`: the catalog, the agents' connections and the snapshot machines behind one
HTTP API (standard library ``ThreadingHTTPServer``, HTTP/1.1 keep-alive, one thread per connection).

Every agent's poll is a request, so the per-request cost bounds a snapshot of thousands of nodes
(docs/benchmarks.md): the handler reads the request line and headers itself (the standard library parses
headers with the ``email`` package, about half of a request's CPU) and writes each response with one send.


Every request but ``GET /v1/health`` carries ``Authorization: Bearer CREDENTIAL``, checked before it is routed
with its body's size and its scope (``security.Gate``: 401, 413, 403, 429); HTTPS with a ``tls`` context.
Errors are the project's JSON form (``{"error": kind, "what", "why", "hint"}``) with a matching status.

Agents::

    POST /v1/agents/register              {job, nnodes, node_rank, ranks, hostname, address, incarnation,
                                           facts, spec}   -> {agent_id, poll_wait_s, protocol}
    POST /v1/agents/{agent}/poll          {incarnation, wait_s, results?}  -> {commands: [...]}  (long poll)
    POST /v1/agents/{agent}/results       {incarnation, results: [...]}    -> {accepted}
    POST /v1/agents/{agent}/leave         {incarnation, reason}            -> {left}  (its job ended there)

Clients::

    GET  /metrics                          the coordinator's Prometheus metrics (text format; coordinator/metrics.py)
    GET  /v1/jobs                          the jobs, with their nodes' liveness
    GET  /v1/jobs/{job}                    one job: nodes, agents, the snapshot in progress
    POST /v1/jobs/{job}/snapshots          {mode: keep-running|stop, timeout_s, request_id?, wait?}
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

import email.utils
import http
import json
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from cryosleep.coordinator import security
from cryosleep.coordinator.catalog import Catalog
from cryosleep.coordinator.core import Coordinator, ServiceConfig
from cryosleep.coordinator.metrics import CONTENT_TYPE_LATEST
from cryosleep.coordinator.protocol import PROTOCOL_VERSION
from cryosleep.coordinator.shared import Lease
from cryosleep.errors import CryosleepError, NotFound, UsageError

__all__ = ["Coordinator", "Server", "ServiceConfig", "parse_listen", "read_token", "shutdown", "start"]

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


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], coordinator: Coordinator, gate: security.Gate,
                 tls: ssl.SSLContext | None = None) -> None:
        self.coordinator = coordinator
        self.gate = gate
        self.tls = tls
        self.lease: Lease | None = None
        super().__init__(addr, Handler)
        if tls is not None:  # the handshake is each connection's thread's, never the accepting one's
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a failed TLS handshake, a client gone: nothing to answer, nothing to keep

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"{'https' if self.tls else 'http'}://{host!s}:{port}"


_PHRASES = {int(st): st.phrase for st in http.HTTPStatus}
_date: list[Any] = [0, ""]


def _http_date() -> str:
    now = int(time.time())
    if _date[0] != now:
        _date[:] = [now, email.utils.formatdate(now, usegmt=True)]
    return str(_date[1])


class _Lower:
    """The handler's headers (names in lower case) as the gate asks for them (any case)."""

    def __init__(self, hdrs: dict[str, str]) -> None:
        self.hdrs = hdrs

    def get(self, name: str, default: None = None) -> str | None:
        return self.hdrs.get(name.lower(), default)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server
    hdrs: dict[str, str]
    """The request's headers, names in lower case."""
    raw_requestline: bytes  # set by BaseHTTPRequestHandler.handle_one_request

    def parse_request(self) -> bool:
        """The request line and headers, read plainly; anything unusual goes to the standard library's parser."""
        line = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        parts = line.split()
        if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
            ok = super().parse_request()
            self.hdrs = {k.lower(): v for k, v in self.headers.items()} if ok else {}
            return ok and self._length_given()
        self.requestline = line
        self.command, self.path, self.request_version = parts
        hdrs: dict[str, str] = {}
        while True:
            raw = self.rfile.readline(65537)
            if len(raw) > 65536 or len(hdrs) > 100:
                self.send_error(431, "Request header fields too large")
                return False
            if raw in (b"\r\n", b"\n", b""):
                break
            name, sep, value = str(raw, "iso-8859-1").partition(":")
            if not sep or not name.strip():
                self.send_error(400, "Bad request header", repr(raw[:80]))
                return False
            hdrs[name.strip().lower()] = value.strip()
        self.hdrs = hdrs
        conn = hdrs.get("connection", "").lower()
        self.close_connection = conn == "close" or (self.request_version == "HTTP/1.0" and conn != "keep-alive")
        if not self._length_given():
            return False
        if hdrs.get("expect", "").lower() == "100-continue":
            return self.handle_expect_100()
        return True

    def _length_given(self) -> bool:
        """A body comes with Content-Length. A chunked one (no client of ours sends it) is refused with 411 and
        the connection closed: reading on, its chunks would be taken for the next request."""
        if "transfer-encoding" not in self.hdrs:
            return True
        self.send_error(411, "Length Required", "send the body with Content-Length (chunked bodies are not read)")
        return False

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

    route = "unknown"

    def _send(self, status: int, body: Any, headers: dict[str, str] | None = None,
              content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        m = self.server.coordinator.metrics
        m.request(self.route, status)
        if status >= 400:
            m.errors.labels(body.get("error", "error") if isinstance(body, dict) else "error").inc()
        head = [f"HTTP/1.1 {status} {_PHRASES.get(status, '')}", "Server: cryosleep", f"Date: {_http_date()}",
                f"Content-Type: {content_type}", f"Content-Length: {len(data)}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data)  # one send, not two

    def _gone(self) -> bool:
        """The client closed its connection (a lost agent's long poll): readable with nothing to read."""
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            return bool(r) and socket.socket.recv(self.connection, 1, socket.MSG_PEEK) == b""  # TLS too
        except OSError:
            return True

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        adm = self.server.gate.admit(method, url.path, _Lower(self.hdrs), self.client_address[0])  # security.py
        if adm.error is not None:  # refused before routing, its body unread
            self.route = adm.route or next((n for m, p, n in ROUTES if m == method and p.match(url.path)), "unknown")
            self.close_connection = True
            self._send(adm.status, adm.error.to_json(), adm.headers)
            return
        try:
            n = int(self.hdrs.get("content-length") or 0)
            raw = self.rfile.read(n) if n else b""
            self.route = "unknown"
            for m, pattern, name in ROUTES:
                match = pattern.match(url.path)
                if match is None or m != method:
                    continue
                self.route = name
                try:
                    body = json.loads(raw) if raw else {}
                except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
                    raise UsageError("the request body is not JSON", str(e), "") from e
                query = parse_qs(url.query)
                self.server.gate.check(adm, body, query)
                if name == "metrics":
                    self._send(200, self.server.coordinator.metrics.render(), content_type=CONTENT_TYPE_LATEST)
                    return
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
                             body.get("request_id"), bool(body.get("wait", False)))
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
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, name="http", daemon=True)
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
