"""Talking to the coordinator: the client the CLI uses, and the node agent's side of the protocol.

``CoordinatorClient`` (CLI and tools): ``--coordinator URL`` or ``$CRYOSLEEP_COORDINATOR``; the credential
(admin, tenant, bootstrap or host: docs/security.md) from ``--token-file F``, ``$CRYOSLEEP_COORDINATOR_TOKEN_FILE``
or ``$CRYOSLEEP_COORDINATOR_TOKEN``. An ``https://`` URL is verified against ``$CRYOSLEEP_COORDINATOR_CA`` (else
the system's CAs), with the client certificate ``$CRYOSLEEP_COORDINATOR_CERT`` / ``$CRYOSLEEP_COORDINATOR_KEY``
when the coordinator asks for one.

The node agent's side, for the real agent to plug in (docs/coordinator.md, "The node agent's interface"):

* ``NodeBackend``: one method per operation of ``protocol.Op``; each takes the ``Command`` and returns its
  result's ``data`` or raises ``CryosleepError``. The runner calls them; they never see HTTP.
* ``AgentRunner(link, backend, registration)``: registers, long-polls, runs each command on its own thread,
  posts the result, keeps the results by command id (a repeated delivery is answered from there, never run
  twice), re-registers after a coordinator restart, and retries with backoff while the coordinator is away.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote, urlsplit

from cryosleep.coordinator import protocol, security
from cryosleep.coordinator.protocol import Command, Result
from cryosleep.errors import CryosleepError, ProtocolError, Unauthorized, Unreachable, UsageError, from_json

ENV_URL = "CRYOSLEEP_COORDINATOR"
ENV_TOKEN_FILE = "CRYOSLEEP_COORDINATOR_TOKEN_FILE"
ENV_TOKEN = "CRYOSLEEP_COORDINATOR_TOKEN"
ENV_CA = "CRYOSLEEP_COORDINATOR_CA"
ENV_CERT = "CRYOSLEEP_COORDINATOR_CERT"
ENV_KEY = "CRYOSLEEP_COORDINATOR_KEY"
ENV_HOST = "CRYOSLEEP_HOST"
"""This machine's name at the coordinator: the name its host daemon polls under (``host serve --name``) and the
host its node agents say they run on (``coordinator drain HOST`` finds them by it); default: the host name."""


def host_name() -> str:
    return os.environ.get(ENV_HOST) or socket.gethostname()
Token = str | Callable[[], str]
"""A credential, or where to read the current one (an agent's, issued when it registers)."""
CONNECT_S = 5.0  # a host that does not answer a connection attempt: the next URL after this long
BACK_AFTER_S = 10.0  # on a later URL (the relay was away) this long: the first one is tried again
PIGGYBACK_S = 0.05  # a result ready this soon after its command arrived rides on the next poll
KEEP_RESULTS = 4096  # results kept for repeated deliveries (a snapshot of 128 nodes uses a few dozen ids)


def resolve(url: str | None, token_file: str | Path | None) -> tuple[str, str]:
    """The coordinator's URL and token from the options, else the environment."""
    u = url or os.environ.get(ENV_URL)
    if not u:
        raise UsageError("no coordinator given", f"neither --coordinator nor ${ENV_URL} is set",
                         f"pass --coordinator http://HOST:PORT or set {ENV_URL}")
    tf = token_file or os.environ.get(ENV_TOKEN_FILE)
    if tf:
        try:
            return u, Path(tf).read_text().strip()
        except OSError as e:
            raise UsageError(f"the token file {tf} cannot be read", str(e), "check --token-file") from e
    tok = os.environ.get(ENV_TOKEN)
    if not tok:
        raise UsageError("no coordinator token given",
                         f"neither --token-file, ${ENV_TOKEN_FILE} nor ${ENV_TOKEN} is set",
                         "pass --token-file F (the file the coordinator was started with)")
    return u, tok


def split_urls(url: str) -> list[str]:
    """``URL[,URL...]``: where a node's agent reaches the coordinator, in order (its relay first, then the
    coordinator itself: coordinator/relay.py)."""
    return [u.strip() for u in url.split(",") if u.strip()] or [url]


@dataclass
class Failover:
    """Which of several URLs to use: the one that answered last, and after ``back_after_s`` on a later one
    the first again (a relay back after a restart carries its agents again). One rule for the real agent's
    ``Http`` and the benchmark's event-loop agents."""

    urls: list[str]
    back_after_s: float = BACK_AFTER_S
    clock: Callable[[], float] = time.monotonic
    at: int = 0
    since: float = 0.0

    def order(self) -> list[int]:
        """The URLs' indexes in the order to try them now."""
        if self.at and self.clock() - self.since >= self.back_after_s:
            self.at = 0
        n = len(self.urls)
        return [(self.at + k) % n for k in range(n)]

    def worked(self, i: int) -> bool:
        """URL ``i`` answered; True when that is a change."""
        if i == self.at:
            return False
        self.at, self.since = i, self.clock()
        return True


def _nodelay(conn: http.client.HTTPConnection) -> None:
    """Requests are small and answered at once: send each without waiting for the previous one's ACK."""
    sock = conn.sock
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Http:
    """One keep-alive HTTP connection to the coordinator (not shared between threads), JSON in and out.
    ``url`` may list several (``split_urls``: a relay, then the coordinator): a request the one in use does not
    answer (it is unreachable, or a relay says the coordinator is unreachable from it) goes to the next."""

    def __init__(self, url: str, token: Token, timeout: float = 30.0,
                 log: Callable[[str], None] | None = None) -> None:
        urls = split_urls(url)
        for u in urls:
            parts = urlsplit(u)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise UsageError(f"invalid coordinator URL {u!r}", "expected http://HOST:PORT or https://HOST:PORT"
                                 " (several: a relay's, then the coordinator's, separated by commas)",
                                 "e.g. --coordinator https://10.0.0.5:7480")
        self.failover = Failover([u.rstrip("/") for u in urls])
        self.ca = os.environ.get(ENV_CA) or None
        self.tls = security.client_context(self.ca, os.environ.get(ENV_CERT), os.environ.get(ENV_KEY)) \
            if any(u.startswith("https:") for u in urls) else None
        self.token = token
        self.timeout = timeout
        self.log = log or (lambda _m: None)
        self.conn: http.client.HTTPConnection | None = None
        self._use(self.failover.at)

    def _use(self, i: int) -> None:
        parts = urlsplit(self.failover.urls[i])
        self.url = self.failover.urls[i]
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.secure = parts.scheme == "https"

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.secure:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self.tls)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def abort(self) -> None:
        """From another thread: ends a long poll in progress. Half-closing our side tells the coordinator the
        agent has gone (it answers the poll at once), and that answer wakes the thread blocked reading."""
        conn = self.conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             timeout: float | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        token = self.token() if callable(self.token) else self.token
        order = self.failover.order()
        for k, i in enumerate(order):
            if i != self.failover.at or self.url != self.failover.urls[i]:
                self.close()
                self._use(i)
            try:
                status, raw = self.request(method, path, data, f"Bearer {token}", timeout)
                doc = self._doc(status, raw)
            except Unreachable as e:
                if k == len(order) - 1:
                    raise
                self.log(f"{e.what} ({e.why}); trying {self.failover.urls[order[k + 1]]}")
                continue
            if self.failover.worked(i) and i:
                self.log(f"reaching the coordinator through {self.url} for now")
            return doc
        raise AssertionError("unreachable")

    def request(self, method: str, path: str, data: bytes | None, auth: str,
                timeout: float | None = None) -> tuple[int, bytes]:
        """One request as it is (its status and body; a relay forwards with it): Unreachable when the URL in use
        does not answer."""
        headers = {"Authorization": auth, "Content-Type": "application/json"}
        for attempt in (0, 1):  # a kept-alive connection the server closed meanwhile: one fresh try
            if self.conn is None:
                self.conn = self._connection(timeout or self.timeout)
            else:
                self.conn.timeout = timeout or self.timeout
                if self.conn.sock is not None:
                    self.conn.sock.settimeout(timeout or self.timeout)
            try:
                if self.conn.sock is None:
                    self.conn.timeout = min(CONNECT_S, timeout or self.timeout)
                    self.conn.connect()
                    assert self.conn.sock is not None
                    self.conn.sock.settimeout(timeout or self.timeout)
                    _nodelay(self.conn)
                self.conn.request(method, path, body=data, headers=headers)
                resp = self.conn.getresponse()
                raw = resp.read()
                status = resp.status
                break
            except ssl.SSLError as e:  # not a coordinator away: no retry helps
                self.close()
                raise security.tls_failure(self.url, self.ca, e) from e
            except (OSError, http.client.HTTPException) as e:
                self.close()
                if attempt == 1 or isinstance(e, TimeoutError | ConnectionRefusedError):
                    raise Unreachable(f"the coordinator at {self.url} did not answer", f"{type(e).__name__}: {e}",
                                      "check that it runs (`cryosleep coordinator serve`) and the URL") from e
        return status, raw

    def _doc(self, status: int, raw: bytes) -> dict[str, Any]:
        try:
            doc: dict[str, Any] = json.loads(raw) if raw else {}
        except ValueError as e:
            raise ProtocolError(f"the coordinator at {self.url} answered something that is not JSON",
                                raw[:200].decode(errors="replace"), "is this a cryosleep coordinator?") from e
        if status >= 400:
            if "error" in doc:
                raise from_json(doc)
            raise CryosleepError(f"the coordinator answered HTTP {status}", str(doc)[:200], "")
        return doc


class CoordinatorClient:
    """What the CLI asks the coordinator."""

    def __init__(self, url: str, token: Token, timeout: float = 30.0) -> None:
        self.http = Http(url, token, timeout)

    def close(self) -> None:
        self.http.close()

    def health(self) -> dict[str, Any]:
        return self.http.call("GET", "/v1/health")

    def jobs(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.http.call("GET", "/v1/jobs")["jobs"]
        return out

    def job(self, name: str) -> dict[str, Any]:
        return self.http.call("GET", f"/v1/jobs/{quote(name, safe='')}")

    def snapshot(self, job: str, *, stop: bool = False, timeout_s: float | None = None, wait: bool = True,
                 request_id: str | None = None, precopy: bool = True) -> dict[str, Any]:
        """Triggers a snapshot (with a request id, so that a retried call never starts a second one); ``precopy``
        False: every node dumps plain, its memory copied inside the pause (docs/precopy.md)."""
        body: dict[str, Any] = {"mode": "stop" if stop else "keep-running", "wait": wait,
                                "request_id": request_id or uuid.uuid4().hex}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if not precopy:  # sent only when off: a coordinator of before takes the default
            body["precopy"] = False
        limit = (timeout_s or 600.0) + 300.0 if wait else None
        return self.http.call("POST", f"/v1/jobs/{quote(job, safe='')}/snapshots", body, timeout=limit)

    def snapshots(self, job: str | None = None, valid_only: bool = False) -> list[dict[str, Any]]:
        q = "?valid=1" if valid_only else ""
        path = f"/v1/jobs/{quote(job, safe='')}/snapshots{q}" if job else f"/v1/snapshots{q}"
        out: list[dict[str, Any]] = self.http.call("GET", path)["snapshots"]
        return out

    def snapshot_detail(self, sid: str) -> dict[str, Any]:
        return self.http.call("GET", f"/v1/snapshots/{quote(sid, safe='')}")

    def place(self, sid: str, hosts: list[str], timeout_s: float | None = None) -> dict[str, Any]:
        """Node I of snapshot ``sid`` on ``hosts[I]``, each restored by its host daemon (coordinator/placement.py)."""
        body: dict[str, Any] = {"hosts": hosts}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        return self.http.call("POST", f"/v1/snapshots/{quote(sid, safe='')}/place", body)

    def placement(self, pid: str, wait_s: float = 0.0, seen: str = "") -> dict[str, Any]:
        """A placement's state; with ``wait_s``, once it changed from ``seen`` (its last ``version``)."""
        return self.http.call("GET", f"/v1/placements/{quote(pid, safe='')}?wait_s={wait_s:g}&seen={quote(seen)}",
                              timeout=wait_s + 30)

    def hosts(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.http.call("GET", "/v1/hosts")["hosts"]
        return out

    def host_poll(self, name: str, facts: dict[str, Any], wait_s: float) -> list[dict[str, Any]]:
        """A host daemon's poll: its orders (waiting up to ``wait_s`` for one)."""
        out: list[dict[str, Any]] = self.http.call("POST", f"/v1/hosts/{quote(name, safe='')}/poll",
                                                   {"facts": facts, "wait_s": wait_s}, timeout=wait_s + 30)["orders"]
        return out

    def order_report(self, oid: str, state: str, *, result: dict[str, Any] | None = None,
                     error: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.http.call("POST", f"/v1/orders/{quote(oid, safe='')}",
                              {"state": state, "result": result, "error": error})

    def enqueue(self, sid: str, *, priority: int = 0, timeout_s: float | None = None) -> dict[str, Any]:
        """Snapshot ``sid`` queued for a restore on free compatible hosts (coordinator/queue.py): its entry (the
        one already waiting for it, if any)."""
        body: dict[str, Any] = {"priority": priority}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        return self.http.call("POST", f"/v1/snapshots/{quote(sid, safe='')}/queue", body)

    def unqueue(self, sid: str) -> dict[str, Any]:
        return self.http.call("POST", f"/v1/snapshots/{quote(sid, safe='')}/queue", {"cancel": True})

    def queued(self, sid: str, wait_s: float = 0.0, seen: str = "") -> dict[str, Any]:
        """Snapshot ``sid``'s newest queue entry; with ``wait_s``, once it changed from ``seen`` (its ``version``)."""
        return self.http.call("GET", f"/v1/snapshots/{quote(sid, safe='')}/queue?wait_s={wait_s:g}&seen={quote(seen)}",
                              timeout=wait_s + 30)

    def queue(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.http.call("GET", "/v1/queue")["entries"]
        return out

    def drain(self, host: str, deadline_s: float | None = None) -> dict[str, Any]:
        """Every job with a node on ``host`` moved off it (coordinator/drain.py); waits for the decisions' outcome."""
        body: dict[str, Any] = {} if deadline_s is None else {"deadline_s": deadline_s}
        # a migration (its phases past the point of no return bounded on their own), then maybe its fallback's stop
        return self.http.call("POST", f"/v1/hosts/{quote(host, safe='')}/drain", body,
                              timeout=(deadline_s or 600.0) * 3 + 300.0)

    def undrain(self, host: str) -> dict[str, Any]:
        return self.http.call("POST", f"/v1/hosts/{quote(host, safe='')}/undrain", {})

    def rendezvous(self, sid: str, put: dict[str, Any] | None = None, prefix: str | None = None,
                   min_keys: int = 0, wait_s: float = 0.0) -> dict[str, dict[str, Any]]:
        """The restore's board (coordinator/rendezvous.py): posts ``put``, returns the keys under ``prefix``
        ({key: {"value", "age_s"}}), waiting up to ``wait_s`` for ``min_keys`` of them."""
        body: dict[str, Any] = {"put": put or {}}
        if prefix is not None:
            body["get"] = {"prefix": prefix, "min": min_keys, "wait_s": wait_s}
        out: dict[str, dict[str, Any]] = self.http.call("POST", f"/v1/snapshots/{quote(sid, safe='')}/restore",
                                                         body, timeout=wait_s + 30)["items"]
        return out


# ---- the node agent's side ---------------------------------------------------------------------------------


def underlay_towards(url: str) -> str:
    """The local address the route to the coordinator at ``url`` leaves from (no packet is sent): the address
    the other hosts of a job reach this one at, for the job network's overlay."""
    parts = urlsplit(split_urls(url)[-1])  # the coordinator's own, after any relay's
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((parts.hostname or "127.0.0.1", parts.port or 80))
            return str(s.getsockname()[0])
        except OSError as e:
            raise UsageError(f"no route from this host to the coordinator at {url}", str(e),
                             "check the URL, or give this host's address (--underlay, or --net-peers)") from e


class NodeBackend(Protocol):
    """What a node agent does for each operation (docs/coordinator.md has each one's contract). Each returns
    its result's data, or raises CryosleepError; each must be safe to call again for the same snapshot."""

    def prepare(self, cmd: Command) -> protocol.PrepareData: ...
    def hold(self, cmd: Command) -> protocol.DrainData: ...
    def report(self, cmd: Command) -> protocol.DrainData: ...
    def targets(self, cmd: Command) -> protocol.DrainData: ...
    def quiesce(self, cmd: Command) -> protocol.QuiesceData: ...
    def net_hold(self, cmd: Command) -> protocol.NoData: ...
    def capture(self, cmd: Command) -> protocol.PhasesData: ...
    def net_release(self, cmd: Command) -> protocol.NoData: ...
    def resume(self, cmd: Command) -> protocol.ResumeData: ...
    def relay(self, cmd: Command) -> protocol.NoData: ...
    def run(self, cmd: Command) -> protocol.NoData: ...
    def persist(self, cmd: Command) -> protocol.PersistData: ...
    def stop(self, cmd: Command) -> protocol.StopData: ...
    def abort(self, cmd: Command) -> protocol.AbortData: ...
    def end(self, cmd: Command) -> protocol.NoData: ...
    def net_peers(self, cmd: Command) -> protocol.NetPeersData: ...
    def finish(self, cmd: Command) -> protocol.FinishData: ...

    def watch(self) -> None:
        """Called after every poll, answered or not (a node may act on its own when its coordinator is gone)."""


@dataclass
class Registration:
    job: str
    nnodes: int
    node_rank: int
    ranks: list[int]
    hostname: str = ""
    address: str = ""
    facts: dict[str, Any] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)
    incarnation: str = field(default_factory=lambda: uuid.uuid4().hex)

    def to_json(self) -> dict[str, Any]:
        return {"job": self.job, "nnodes": self.nnodes, "node_rank": self.node_rank, "ranks": self.ranks,
                "hostname": self.hostname, "address": self.address, "facts": self.facts, "spec": self.spec,
                "incarnation": self.incarnation}


def execute(backend: NodeBackend, cmd: Command) -> Result:
    """Runs one command on the backend: its result, or its failure (a bug in the backend still answers)."""
    fn: Callable[[Command], Mapping[str, Any]] = getattr(backend, str(cmd.op))
    start = time.monotonic()
    try:
        return Result.success(cmd, fn(cmd), time.monotonic() - start)
    except CryosleepError as e:
        return Result.failure(cmd, e, time.monotonic() - start)
    except Exception as e:
        return Result.failure(cmd, CryosleepError(f"the node agent failed at {cmd.op}", f"{type(e).__name__}: {e}",
                                                  "see the node agent's log"), time.monotonic() - start)


class AgentRunner:
    """The agent's loop: register, long-poll, run commands, post results. ``start()`` runs it on a thread."""

    def __init__(self, url: str, token: str, backend: NodeBackend, reg: Registration, *, wait_s: float = 20.0,
                 log: Callable[[str], None] | None = None) -> None:
        self.url = url
        self.token = token
        self.backend = backend
        self.reg = reg
        self.wait_s = wait_s
        self.log = log or (lambda _m: None)
        self.poll_http = Http(url, self.credential, log=self.log)
        self.post_http = Http(url, self.credential, log=self.log)
        self.post_lock = threading.Lock()
        self.agent_id: str | None = None
        self.issued: str | None = None  # the agent credential the registration answered with
        self.done: dict[str, Result] = {}  # command id -> its result (kept for repeated deliveries)
        self.running: set[str] = set()
        self.lock = threading.Lock()
        self.ready = threading.Condition(self.lock)
        self.claimable: set[str] = set()
        self.claimed: dict[str, Result] = {}
        self._halt = threading.Event()
        self.thread: threading.Thread | None = None
        self.received: list[Command] = []  # every delivery, repeats included (tests look at it)
        self.carry: list[Result] = []  # results answered quickly enough to ride on the next poll
        self.posting = 0  # results being posted

    def start(self) -> AgentRunner:
        self.thread = threading.Thread(target=self.loop, name=f"agent-{self.reg.job}@{self.reg.node_rank}",
                                       daemon=True)
        self.thread.start()
        return self

    def halt(self) -> None:
        """Stops polling at once and drops the connections (to the coordinator, the agent is lost)."""
        self._halt.set()
        self.poll_http.abort()
        self.post_http.abort()

    def leave(self, reason: str, timeout: float = 5.0) -> None:
        """Tells the coordinator this agent goes (its job ended on this node), then halts: a snapshot asked
        meanwhile fails at once with ``reason``, not after ``lost_after_s`` without a poll. Bounded, best effort
        (a coordinator that is away counts the agent lost as before). Call ``flush`` first."""
        self._halt.set()  # no new poll, no registration again
        agent_id = self.agent_id
        if agent_id is not None:
            try:
                with self.post_lock:
                    self.post_http.call("POST", f"/v1/agents/{quote(agent_id, safe='')}/leave",
                                        {"incarnation": self.reg.incarnation, "reason": reason}, timeout=timeout)
            except CryosleepError as e:
                self.log(f"coordinator: could not say this agent leaves ({e.what}: {e.why})")
        self.halt()

    def flush(self, timeout: float) -> bool:
        """Waits (bounded) until every command started has finished and its result was delivered: before the
        agent exits after a stop. Returns False when something was still outstanding."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if not self.running and not self.claimed and not self.claimable and not self.carry \
                        and not self.posting:
                    return True
            time.sleep(0.02)
        return False

    def join(self, timeout: float | None = None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def credential(self) -> str:
        """What this node presents: the agent credential once registered (it acts only for this job and node),
        the bootstrap one before."""
        return self.issued or self.token

    def register(self) -> None:
        self.issued = None
        res = self.poll_http.call("POST", "/v1/agents/register", self.reg.to_json())
        cred = res.get("credential")
        self.issued = cred if isinstance(cred, str) else None
        self.agent_id = str(res["agent_id"])
        self.wait_s = min(self.wait_s, float(res.get("poll_wait_s", self.wait_s)))

    def loop(self) -> None:
        backoff = 0.05
        while not self._halt.is_set():
            try:
                if self.agent_id is None:
                    self.register()
                assert self.agent_id is not None
                body: dict[str, Any] = {"incarnation": self.reg.incarnation, "wait_s": self.wait_s}
                if self.carry:
                    body["results"] = [r.to_json() for r in self.carry]
                res = self.poll_http.call("POST", f"/v1/agents/{quote(self.agent_id, safe='')}/poll", body,
                                          timeout=self.wait_s + 30)
                self.carry = []
                backoff = 0.05
                started = [self.dispatch(Command.from_json(c)) for c in res.get("commands") or ()]
                self.carry = self._collect([c for c in started if c is not None])
            except CryosleepError as e:
                if self._halt.is_set():
                    return
                if e.details.get("reregister") or (isinstance(e, Unauthorized) and self.issued):
                    self.agent_id = None  # the coordinator restarted (or changed its secret): register again
                    self.carry = []  # their commands are delivered again, and answered from ``done``
                    continue
                self.log(f"coordinator: {e.what} ({e.why}); retrying in {backoff:.2f} s")
                self._halt.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                try:
                    self.backend.watch()
                except Exception as e:  # a bug there must not stop the polls
                    self.log(f"node watch failed: {type(e).__name__}: {e}")

    def _collect(self, ids: list[str]) -> list[Result]:
        """Waits up to PIGGYBACK_S for the commands just started; the results ready by then go with the next poll
        (one request per command instead of two), the others are posted by their threads when done."""
        if not ids:
            return []
        end = time.monotonic() + PIGGYBACK_S
        with self.lock:
            while any(i not in self.claimed for i in ids):
                left = end - time.monotonic()
                if left <= 0:
                    break
                self.ready.wait(left)
            self.claimable.difference_update(ids)
            return [self.claimed.pop(i) for i in ids if i in self.claimed]

    def dispatch(self, cmd: Command) -> str | None:
        """Starts a delivered command on its own thread (returns its id), or answers a repeated one (None)."""
        with self.lock:
            self.received.append(cmd)
            if cmd.id in self.running:
                return None  # still running it: the result will come
            done = self.done.get(cmd.id)
            if done is None:
                self.running.add(cmd.id)
                self.claimable.add(cmd.id)  # ``_collect`` takes its result if it is ready soon enough
        if done is not None:
            self.post(done)  # a repeat: the same answer, never a second execution
            return None
        threading.Thread(target=self._execute, args=(cmd,), daemon=True).start()
        return cmd.id

    def _execute(self, cmd: Command) -> None:
        res = execute(self.backend, cmd)
        with self.lock:
            self.running.discard(cmd.id)
            self.done[cmd.id] = res
            while len(self.done) > KEEP_RESULTS:
                del self.done[next(iter(self.done))]
            if cmd.id in self.claimable:
                self.claimed[cmd.id] = res
                self.ready.notify_all()
                return
        self.post(res)

    def post(self, res: Result) -> None:
        with self.lock:
            self.posting += 1
        try:
            self._post(res)
        finally:
            with self.lock:
                self.posting -= 1

    def _post(self, res: Result) -> None:
        for delay in (0.05, 0.2, 1.0, 2.0, 0):
            if self._halt.is_set() or self.agent_id is None:
                return  # the next delivery of the command is answered from ``done``
            try:
                with self.post_lock:
                    self.post_http.call("POST", f"/v1/agents/{quote(self.agent_id, safe='')}/results",
                                        {"incarnation": self.reg.incarnation, "results": [res.to_json()]})
                return
            except CryosleepError as e:
                if e.details.get("reregister"):
                    return
                self.log(f"result of {res.id} not delivered: {e.what}")
                time.sleep(delay)
