"""Who may ask the coordinator what: credentials, their scopes, bounded bodies, failed-attempt limits, the audit log
and TLS. Pure decisions (``authenticate``, ``authorize``, ``check_body``, ``Limiter.admit`` with the clock passed
in); ``Gate`` puts them in the order the HTTP service applies them to every request, before it routes:

1. the peer's failed attempts (``Limiter``): too many, 429 whatever is sent;
2. the credential (``Credentials.authenticate``): none or unknown, 401 (unknown paths too; only
   ``GET /v1/health`` is open);
3. the body's declared size: over ``max_body``, 413 before a byte of it is read;
4. the route, and whether this principal may use it on this job (``authorize``): 403 otherwise;
5. the body's fields, typed per route (``check_body``): 400 otherwise.

Credentials (``docs/security.md``, "The coordinator"):

* **admin**: everything (draining a host, ``coordinator drain``, is for admins only).
* **tenant**: the jobs whose names match the tenant's patterns, their snapshots and restores (queued ones too);
  lists show only them.
* **bootstrap**: registers an agent (of its tenant's jobs when it has one) and joins restore boards; the answer to
  a registration carries an **agent** credential that acts only for that job and node (its polls and results, its
  own job's status and snapshots, the boards).
* **host**: a host daemon (``cryosleep host serve``): its own orders, registering the agents it restores.
* **relay**: a relay (``cryosleep coordinator relay``, coordinator/relay.py): nothing but the batched poll
  (``POST /v1/relays/poll``), in which every carried agent's own credential is verified (``Credentials.carried``):
  a relay acts for no agent whose credential it was not given.

Agent credentials are not stored: each is the job, node and board namespace under an HMAC with the coordinator's
secret, so they stay valid across a coordinator restart and a stolen one names the one node it speaks for.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import hmac
import json
import math
import os
import re
import ssl
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote

from cryosleep.errors import CryosleepError, Forbidden, ProtocolError, TlsError, Unauthorized, UsageError

__all__ = ["Admission", "Audit", "Credentials", "Gate", "Limiter", "Principal", "authorize", "check_body",
           "client_context", "server_context"]

MAX_BODY = 4 << 20
"""The largest request body read (a registration's facts, a poll's results: kilobytes)."""
AGENT_PREFIX = "csa1."
ROLES = ("admin", "tenant", "bootstrap", "agent", "host", "relay")


@dataclass(frozen=True)
class Principal:
    """Who a request comes from (``name`` is what the audit log says)."""

    role: str
    name: str
    tenant: str | None = None
    """A tenant's client, a tenant's bootstrap, an agent registered with one: the tenant whose jobs it may touch."""
    job: str | None = None
    """An agent: the one job it acts for."""
    node: int | None = None
    """An agent: the one node of that job."""
    host: str | None = None
    """A host daemon: its name."""

    @property
    def agent_id(self) -> str | None:
        return f"{self.job}@{self.node}" if self.role == "agent" else None


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _b64(b: bytes) -> str:
    return base64.urlsafe_b64encode(b).decode().rstrip("=")


def _unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


@dataclass
class Credentials:
    """The coordinator's credentials: tokens (by their SHA-256) to principals, the tenants' job patterns, and
    the secret agent credentials are made with."""

    by_digest: dict[str, Principal]
    tenants: dict[str, tuple[str, ...]]
    secret: bytes

    @classmethod
    def single(cls, token: str) -> Credentials:
        """The one shared token of ``--token-file``: an admin (agents registering with it still get scoped
        credentials)."""
        return cls({_digest(token): Principal("admin", "admin")}, {},
                   hmac.new(hashlib.sha256(token.encode()).digest(), b"agent-credentials", "sha256").digest())

    @classmethod
    def parse(cls, doc: Any, where: str = "the credentials") -> Credentials:
        """``{"admin": [TOKEN...], "tenants": {NAME: {"tokens": [...], "jobs": [GLOB...]}},
        "bootstrap": [{"token", "tenant"?}...], "hosts": {NAME: TOKEN}, "relays": {NAME: TOKEN}, "secret"?}``; a
        token may be given as
        ``sha256:HEX`` instead of itself."""

        def bad(why: str) -> UsageError:
            return UsageError(f"{where} are malformed", why, "see docs/security.md for the credentials file's form")

        if not isinstance(doc, dict):
            raise bad("expected a JSON object")
        unknown = set(doc) - {"admin", "tenants", "bootstrap", "hosts", "relays", "secret"}
        if unknown:
            raise bad(f"unknown key(s) {sorted(unknown)}")
        by: dict[str, Principal] = {}

        def add(token: Any, p: Principal) -> None:
            if not isinstance(token, str):
                raise bad(f"a token of {p.name} is not a string")
            if token.startswith("sha256:"):
                d = token[7:].lower()
                if not re.fullmatch(r"[0-9a-f]{64}", d):
                    raise bad(f"a token digest of {p.name} is not 64 hex digits")
            elif len(token) < 16:
                raise bad(f"a token of {p.name} has {len(token)} characters: use at least 16 random ones")
            else:
                d = _digest(token)
            if d in by:
                raise bad(f"one token is given to both {by[d].name} and {p.name}")
            by[d] = p

        def strings(v: Any, what: str) -> list[str]:
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise bad(f"{what} must be a list of strings")
            return list(v)

        for t in strings(doc.get("admin", []), "admin"):
            add(t, Principal("admin", "admin"))
        tenants: dict[str, tuple[str, ...]] = {}
        tdoc = doc.get("tenants", {})
        if not isinstance(tdoc, dict):
            raise bad("tenants must be an object {NAME: {tokens, jobs}}")
        for name, t in tdoc.items():
            if not isinstance(t, dict) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
                raise bad(f"tenant {name!r}: expected a name of letters, digits, _.- and {{tokens, jobs}}")
            tenants[name] = tuple(strings(t.get("jobs", []), f"tenant {name}'s jobs"))
            if not tenants[name]:
                raise bad(f"tenant {name} has no job patterns (e.g. \"jobs\": [\"{name}-*\"])")
            for tok in strings(t.get("tokens", []), f"tenant {name}'s tokens"):
                add(tok, Principal("tenant", f"tenant:{name}", tenant=name))
        boots = doc.get("bootstrap", [])
        if not isinstance(boots, list):
            raise bad("bootstrap must be a list of {token, tenant?}")
        for i, b in enumerate(boots):
            if not isinstance(b, dict):
                raise bad(f"bootstrap[{i}] must be an object {{token, tenant?}}")
            tenant = b.get("tenant")
            if tenant is not None and tenant not in tenants:
                raise bad(f"bootstrap[{i}] names tenant {tenant!r}, which is not under tenants")
            add(b.get("token"), Principal("bootstrap", f"bootstrap:{tenant or '*'}", tenant=tenant))
        hosts = doc.get("hosts", {})
        if not isinstance(hosts, dict):
            raise bad("hosts must be an object {NAME: TOKEN}")
        for name, tok in hosts.items():
            add(tok, Principal("host", f"host:{name}", host=str(name)))
        relays = doc.get("relays", {})
        if not isinstance(relays, dict):
            raise bad("relays must be an object {NAME: TOKEN}")
        for name, tok in relays.items():
            add(tok, Principal("relay", f"relay:{name}"))
        if not by:
            raise bad("no credential is given")
        secret = doc.get("secret")
        if secret is not None and (not isinstance(secret, str) or len(secret) < 16):
            raise bad("secret must be a string of at least 16 characters")
        key = (secret or json.dumps(sorted(by), separators=(",", ":"))).encode()
        return cls(by, tenants, hmac.new(hashlib.sha256(key).digest(), b"agent-credentials", "sha256").digest())

    @classmethod
    def load(cls, path: Path | str) -> Credentials:
        p = Path(path)
        try:
            st = p.stat()
            text = p.read_text()
        except OSError as e:
            raise UsageError(f"the credentials file {p} cannot be read", str(e),
                             "create it (docs/security.md) and pass --credentials F") from e
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise UsageError(f"the credentials file {p} is readable by others", f"mode {stat.filemode(st.st_mode)}",
                             f"chmod 600 {p}")
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise UsageError(f"the credentials file {p} is not JSON", str(e), "see docs/security.md") from e
        return cls.parse(doc, f"the credentials in {p}")

    # ---- the decisions -----------------------------------------------------------------------------------------

    def tenant_of(self, job: str) -> str | None:
        """The tenant whose patterns match ``job`` (the first in the file), if any."""
        for name, globs in self.tenants.items():
            if any(fnmatch.fnmatchcase(job, g) for g in globs):
                return name
        return None

    def issue(self, job: str, node: int, ns: str | None) -> str:
        """The agent credential for ``job``'s node ``node``; ``ns``: the board namespace (its registrar's tenant)."""
        claims = _b64(json.dumps({"j": job, "n": node, "t": ns}, separators=(",", ":")).encode())
        mac = hmac.new(self.secret, claims.encode(), "sha256").digest()
        return f"{AGENT_PREFIX}{claims}.{_b64(mac)}"

    def authenticate(self, header: str) -> Principal | None:
        """The principal of an ``Authorization: Bearer ...`` header, or None."""
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > 4096:
            return None
        if token.startswith(AGENT_PREFIX):
            claims, _, mac = token[len(AGENT_PREFIX):].partition(".")
            want = hmac.new(self.secret, claims.encode(), "sha256").digest()
            try:
                if not hmac.compare_digest(_unb64(mac), want):
                    return None
                c = json.loads(_unb64(claims))
                job, node, ns = str(c["j"]), int(c["n"]), c["t"]
            except (ValueError, KeyError, TypeError):
                return None
            return Principal("agent", f"agent:{job}@{node}", tenant=ns if isinstance(ns, str) else None, job=job,
                             node=node)
        return self.by_digest.get(_digest(token))

    def carried(self, credential: Any, agent: Any) -> str | None:
        """None when ``credential`` is agent ``agent``'s own (what a relay must carry with each of its agents'
        polls), else why not."""
        p = self.authenticate(f"Bearer {credential}") if isinstance(credential, str) else None
        if p is None or p.role != "agent":
            return "its credential is not an agent credential this coordinator issued"
        return None if p.agent_id == agent else f"it carries the credential of agent {p.agent_id}, not {agent}"


# ---- authorization ---------------------------------------------------------------------------------------------

AGENT_ROUTES = frozenset({"register", "poll", "results", "leave", "job", "job_snapshots", "trigger", "snapshot",
                          "rendezvous"})
TENANT_ROUTES = frozenset({"jobs", "job", "job_snapshots", "trigger", "snapshots", "snapshot", "rendezvous",
                           "place", "placement", "enqueue", "queued", "queue"})
HOST_ROUTES = frozenset({"register", "rendezvous", "hosts", "host_poll", "order"})


@dataclass(frozen=True)
class Lookup:
    """What ``authorize`` needs to know of the coordinator's state: a job's tenant, a snapshot's or a
    placement's job (None: unknown)."""

    tenant_of: Callable[[str], str | None]
    snapshot_job: Callable[[str], str | None]
    placement_job: Callable[[str], str | None]
    order_host: Callable[[str], str | None] = lambda _oid: None

    @classmethod
    def of(cls, coordinator: Any, creds: Credentials) -> Lookup:
        """From a ``core.Coordinator``'s catalog and placements."""

        def snapshot_job(sid: str) -> str | None:
            try:
                return str(coordinator.catalog.snapshot(sid)["job"])
            except CryosleepError:
                return None

        def placement_job(pid: str) -> str | None:
            try:
                return snapshot_job(str(coordinator.placements.status(pid)["snapshot"]))
            except CryosleepError:
                return None

        def order_host(oid: str) -> str | None:
            o = coordinator.placements.orders.get(oid)
            return str(o.host) if o is not None else None

        return cls(creds.tenant_of, snapshot_job, placement_job, order_host)


def authorize(p: Principal, route: str, params: Mapping[str, str], body_job: str | None,
              look: Lookup) -> str | None:
    """None when ``p`` may use ``route`` with these path parameters (``body_job``: a registration's job), else
    why not."""
    if p.role == "admin" or route == "health":
        return None
    allowed = {"agent": AGENT_ROUTES, "tenant": TENANT_ROUTES, "host": HOST_ROUTES,
               "bootstrap": frozenset({"register", "rendezvous"}), "relay": frozenset({"relay_poll"})
               }.get(p.role, frozenset())
    if route not in allowed:
        return f"a {p.role} credential may not use this endpoint"
    if route == "rendezvous":
        return None  # boards are namespaced by the credential's tenant (Admission.params)
    if route in ("poll", "results", "leave"):  # agents only (and admins)
        ok = params.get("agent") == p.agent_id
        return None if ok else f"it is the credential of agent {p.agent_id}, not {params.get('agent')}"
    job: str | None = None
    if route == "register":
        job = body_job
    elif "job" in params:
        job = params["job"]
    elif route in ("snapshot", "place", "enqueue", "queued"):
        job = look.snapshot_job(params["sid"])
        if job is None:
            return f"snapshot {params['sid']} is not in the catalog"
    elif route == "placement":
        job = look.placement_job(params["pid"])
        if job is None:
            return f"placement {params['pid']} is unknown"
    elif route == "host_poll":
        return None if params["host"] == p.host else f"it is the credential of host {p.host}, not {params['host']}"
    elif route == "order":
        host = look.order_host(params["oid"])
        return None if host in (None, p.host) else f"order {params['oid']} is host {host}'s, not {p.host}'s"
    if job is None:
        return None  # lists (filtered in the answer), hosts, orders
    if p.role == "agent":
        return None if job == p.job else f"it is the agent credential of job {p.job!r}, not {job!r}"
    if p.role == "host":
        return None
    if p.tenant is not None and look.tenant_of(job) != p.tenant:
        return f"job {job!r} is not one of tenant {p.tenant}'s jobs"
    if p.role == "tenant" and p.tenant is None:
        return "a tenant credential without a tenant"
    return None


# ---- bodies ----------------------------------------------------------------------------------------------------

_NUM = (int, float)
BODY_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "register": {"job": (str,), "nnodes": (int,), "node_rank": (int,), "incarnation": (str,), "ranks": (list,),
                 "hostname": (str,), "address": (str,), "facts": (dict,), "spec": (dict,)},
    "poll": {"incarnation": (str,), "wait_s": _NUM, "results": (list,)},
    "results": {"incarnation": (str,), "results": (list,)},
    "relay_poll": {"wait_s": _NUM, "agents": (list,), "relay": (str,), "can": (list,), "merged": (list,)},
    "trigger": {"mode": (str,), "timeout_s": _NUM, "request_id": (str,), "wait": (bool,), "precopy": (bool,)},
    "rendezvous": {"put": (dict,), "get": (dict,)},
    "place": {"hosts": (list,), "timeout_s": _NUM},
    "enqueue": {"priority": (int,), "timeout_s": _NUM, "cancel": (bool,)},
    "drain": {"deadline_s": _NUM},
    "host_poll": {"facts": (dict,), "wait_s": _NUM},
    "order": {"state": (str,), "result": (dict,), "error": (dict,)},
}
NESTED: dict[tuple[str, str], dict[str, tuple[type, ...]]] = {
    ("rendezvous", "get"): {"prefix": (str,), "min": (int,), "wait_s": _NUM},
}
REQUIRED = {"register": ("job", "nnodes", "node_rank", "incarnation"), "relay_poll": ("agents",)}
CARRIED = {"agent": (str,), "credential": (str,), "incarnation": (str,), "results": (list,), "poll": (bool,)}
"""Each poll a relay carries (``relay_poll``'s agents)."""
TYPE_NAMES = {int: "integer", str: "string", bool: "boolean", list: "list", dict: "JSON object"}
NOT_NULL = frozenset({"wait_s", "min"})
"""Fields that may be left out but not given as null (the service reads them as numbers)."""
QUERY_NUMBERS = frozenset({"wait_s"})


def _check(fields: Mapping[str, tuple[type, ...]], body: Mapping[str, Any], where: str) -> None:
    for k, types in fields.items():
        v = body.get(k)
        if v is None and (k not in NOT_NULL or k not in body):
            continue
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
        if ok and isinstance(v, float) and not (v == v and abs(v) < 1e12):
            ok = False  # NaN, infinities, absurd durations
        if ok and isinstance(v, int) and not isinstance(v, bool) and abs(v) > 1 << 53:
            ok = False
        if not ok:
            names = "number" if types == _NUM else "/".join(TYPE_NAMES.get(t, t.__name__) for t in types)
            raise UsageError(f"the request's {where}{k} is malformed", f"expected a {names}, got {type(v).__name__}",
                             "see docs/coordinator.md for the API")


def check_body(route: str, body: Any, query: Mapping[str, list[str]] | None = None) -> None:
    """Refuses (UsageError) a body that is not an object, or whose known fields have the wrong types, or a query
    whose numbers are not."""
    for k in QUERY_NUMBERS & set(query or {}):
        try:
            ok = math.isfinite(float((query or {})[k][0]))
        except ValueError:
            ok = False
        if not ok:
            raise UsageError(f"the request's ?{k}= is not a number", f"got {(query or {})[k][0][:40]!r}",
                             "see docs/coordinator.md for the API")
    if not isinstance(body, dict):
        raise UsageError("the request body must be a JSON object", f"got {type(body).__name__}",
                         "see docs/coordinator.md for the API")
    missing = [k for k in REQUIRED.get(route, ()) if k not in body]
    if missing:
        raise ProtocolError(f"a malformed {route}: it lacks {', '.join(missing)}", f"{route} needs them",
                            "the agent and the coordinator speak different protocol versions?")
    _check(BODY_FIELDS.get(route, {}), body, "")
    for (r, k), fields in NESTED.items():
        if r == route and isinstance(body.get(k), dict):
            _check(fields, body[k], f"{k}.")
    if route == "register" and not all(isinstance(x, int) and not isinstance(x, bool) for x in body.get("ranks") or ()):
        raise UsageError("the request's ranks are malformed", "expected a list of integers", "")
    if route in ("poll", "results") and not all(isinstance(r, dict) for r in body.get("results") or ()):
        raise UsageError("the request's results are malformed", "expected a list of objects", "")
    if route == "relay_poll":
        for i, m in enumerate(body.get("merged") or ()):
            if not isinstance(m, dict) or not isinstance(m.get("agents"), list):
                raise UsageError(f"the request's merged[{i}] is malformed", "expected {id, snapshot, op, ok, data, "
                                 "agents, seconds}", "see docs/coordinator.md, \"Relays\"")
        for i, e in enumerate(body["agents"]):
            if not isinstance(e, dict) or not isinstance(e.get("agent"), str):
                raise UsageError(f"the request's agents[{i}] is malformed", "expected {agent, credential, "
                                 "incarnation, results?}", "see docs/coordinator.md, \"Relays\"")
            _check(CARRIED, e, f"agents[{i}].")
            if not all(isinstance(r, dict) for r in e.get("results") or ()):
                raise UsageError(f"the request's agents[{i}].results are malformed", "expected a list of objects",
                                 "")
    if route == "place" and not all(isinstance(h, str) for h in body.get("hosts") or ()):
        raise UsageError("the request's hosts are malformed", "expected a list of host names", "")


# ---- failed attempts -------------------------------------------------------------------------------------------


@dataclass
class Limiter:
    """Failed authentications per peer: more than ``burst`` within ``window_s`` and the peer is refused (429,
    nothing checked) until the window has passed since its last failure. Pure: the clock is passed in."""

    burst: int = 20
    window_s: float = 60.0
    failures: dict[str, list[float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def blocked(self, peer: str, now: float) -> float:
        """Seconds until ``peer`` may try again (0: it may now)."""
        with self.lock:
            times = [t for t in self.failures.get(peer, ()) if now - t < self.window_s]
            if times:
                self.failures[peer] = times
            else:
                self.failures.pop(peer, None)
            return self.window_s - (now - times[-1]) if len(times) >= self.burst else 0.0

    def failed(self, peer: str, now: float) -> None:
        with self.lock:
            self.failures.setdefault(peer, []).append(now)
            if len(self.failures) > 100_000:  # a flood of peers: forget the oldest
                self.failures.pop(next(iter(self.failures)))


# ---- the audit log ---------------------------------------------------------------------------------------------

AUDITED = {"register": "register", "trigger": "snapshot", "place": "restore", "rendezvous": "restore",
           "order": "host-order", "enqueue": "queue-restore", "drain": "drain", "undrain": "undrain"}


class Audit:
    """One JSON line per audited request (who, from where, which action on which job or snapshot, the answer)."""

    def __init__(self, path: Path | str | None) -> None:
        self.path = Path(path) if path else None
        self.lock = threading.Lock()
        self.seen_boards: set[tuple[str, str]] = set()
        self.fh = None
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise UsageError(f"the audit log {self.path} cannot be opened", str(e),
                                 "choose another --audit-log or fix its directory") from e
            self.fh = os.fdopen(fd, "a", buffering=1)

    def record(self, entry: dict[str, Any]) -> None:
        if self.path is None:
            return
        line = json.dumps({"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **entry}, default=str)
        with self.lock:
            if self.fh is not None:  # closed: the service is stopping
                self.fh.write(line + "\n")

    def close(self) -> None:
        with self.lock:
            if self.fh is not None:
                self.fh.close()
                self.fh = None


# ---- the gate --------------------------------------------------------------------------------------------------

Routes = list[tuple[str, "re.Pattern[str]", str]]


class Headers(Protocol):
    def get(self, name: str, default: None = None) -> str | None: ...


@dataclass
class Admission:
    """The gate's answer for one request: a refusal (status, error, headers), or the principal and its route."""

    principal: Principal | None = None
    route: str = ""
    params: dict[str, str] = field(default_factory=dict)
    status: int = 0
    error: CryosleepError | None = None
    headers: dict[str, str] = field(default_factory=dict)
    peer: str = ""


def _refuse(status: int, err: CryosleepError, peer: str, headers: dict[str, str] | None = None) -> Admission:
    return Admission(status=status, error=err, headers=headers or {}, peer=peer)


class Gate:
    """Every request passes here before it is routed (``admit``), its body too (``check``), and its answer on
    the way out (``answer``: lists filtered to the tenant, a registration's agent credential, the audit log)."""

    def __init__(self, creds: Credentials, routes: Routes, look: Lookup, *, max_body: int = MAX_BODY,
                 limiter: Limiter | None = None, audit: Audit | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.creds = creds
        self.routes = routes
        self.look = look
        self.max_body = max_body
        self.limiter = limiter or Limiter()
        self.audit = audit or Audit(None)
        self.clock = clock

    def admit(self, method: str, path: str, headers: Headers, peer: str) -> Admission:
        wait = self.limiter.blocked(peer, self.clock())
        if wait > 0:
            return _refuse(429, Unauthorized("the coordinator refuses this address for now",
                                             "too many failed authentications from it",
                                             f"check the credential, then try again in {wait:.0f} s"),
                           peer, {"Retry-After": str(max(1, round(wait)))})
        if method == "GET" and path == "/v1/health":
            return Admission(Principal("anyone", "anyone"), "health", peer=peer)
        given = headers.get("Authorization") or ""
        p = self.creds.authenticate(given)
        if p is None:
            self.limiter.failed(peer, self.clock())
            why = "no bearer token was sent" if not given else "the credential is not one this coordinator issued"
            self.audit.record({"who": None, "peer": peer, "action": "authenticate", "path": path[:200],
                               "status": 401, "reason": why})
            return _refuse(401, Unauthorized("the coordinator refused the request", why,
                                             "pass your credential with --token-file F "
                                             "(or $CRYOSLEEP_COORDINATOR_TOKEN_FILE); docs/security.md"),
                           peer, {"WWW-Authenticate": 'Bearer realm="cryosleep"'})
        if headers.get("Transfer-Encoding"):
            return _refuse(411, UsageError("the request has no length", "chunked bodies are not read",
                                           "send Content-Length"), peer)
        try:
            n = int(headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if n < 0 or n > self.max_body:
            return _refuse(413, UsageError("the request is too large",
                                           f"Content-Length {headers.get('Content-Length')}",
                                           f"send at most {self.max_body} bytes"), peer)
        for m, pattern, name in self.routes:
            match = pattern.match(path)
            if match is None or m != method:
                continue
            params = {k: unquote(v) for k, v in match.groupdict().items()}
            if name == "rendezvous" and p.role != "admin" and p.tenant is not None:
                params["sid"] = f"{p.tenant}/{params['sid']}"  # a tenant's boards are its own
            return Admission(p, name, params, peer=peer)
        return Admission(p, "", {}, peer=peer)  # the service says 404 or 405

    def check(self, adm: Admission, body: Any, query: Mapping[str, list[str]] | None = None) -> None:
        """After the body is parsed: its form, then the principal's right to the route (raises)."""
        check_body(adm.route, body, query)
        p = adm.principal
        assert p is not None
        why = authorize(p, adm.route, adm.params, str(body["job"]) if adm.route == "register" else None, self.look)
        if adm.route == "register" and why is None and p.role == "agent" and int(body["node_rank"]) != p.node:
            why = f"it is the credential of node {p.node}"
        if why is not None:
            self._audit(adm, body, 403, why)
            raise Forbidden("the coordinator refused the request", why,
                            "use the credential of that job's tenant or agent (docs/security.md)")

    def answer(self, adm: Admission, body: dict[str, Any], result: Any) -> Any:
        p = adm.principal
        assert p is not None
        if p.tenant is not None and p.role == "tenant" and isinstance(result, dict):
            if adm.route == "jobs":
                result = {"jobs": [j for j in result["jobs"] if self.look.tenant_of(str(j.get("job"))) == p.tenant]}
            elif adm.route == "queue":
                result = {"entries": [e for e in result["entries"]
                                      if self.look.tenant_of(str(e.get("job"))) == p.tenant]}
            elif adm.route == "snapshots":
                result = {"snapshots": [s for s in result["snapshots"]
                                        if self.look.tenant_of(str(s.get("job"))) == p.tenant]}
        if adm.route == "register" and isinstance(result, dict):
            ns = p.tenant if p.role != "admin" else None
            result = {**result, "credential": self.creds.issue(str(body["job"]), int(body["node_rank"]), ns)}
        self._audit(adm, body, 200, None)
        return result

    def _audit(self, adm: Admission, body: dict[str, Any], status: int, reason: str | None) -> None:
        action = AUDITED.get(adm.route)
        p = adm.principal
        if p is None or (action is None and status == 200):
            return
        if adm.route == "trigger" and body.get("mode") == "stop":
            action = "stop"
        if adm.route == "rendezvous" and status == 200:
            key = (p.name, adm.params.get("sid", ""))
            if key in self.audit.seen_boards or not body.get("put"):
                return  # a restore's barrier polls its board: the first post is what tells who asked
            self.audit.seen_boards.add(key)
        target = {k: v for k, v in adm.params.items() if k in ("job", "sid", "pid", "oid", "host", "agent")}
        if adm.route == "register":
            target = {"job": str(body.get("job")), "node": str(body.get("node_rank"))}
        self.audit.record({"who": p.name, "role": p.role, "peer": adm.peer, "action": action or adm.route,
                           **target, "status": status, "reason": reason})


# ---- TLS -------------------------------------------------------------------------------------------------------


def server_context(cert: Path | str, key: Path | str, client_ca: Path | str | None = None) -> ssl.SSLContext:
    """The coordinator's TLS: its certificate chain and key; with ``client_ca``, every client must present a
    certificate that CA signed (agents' client certificates)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(cert), str(key))
        if client_ca is not None:
            ctx.load_verify_locations(cafile=str(client_ca))
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as e:
        raise UsageError("the coordinator's TLS files cannot be used", f"{cert}, {key}"
                         + (f", {client_ca}" if client_ca else "") + f": {e}",
                         "pass a PEM certificate chain (--tls-cert), its key (--tls-key) and, for client "
                         "certificates, the CA that signs them (--tls-client-ca)") from e
    return ctx


def client_context(ca: Path | str | None, cert: Path | str | None = None,
                   key: Path | str | None = None) -> ssl.SSLContext:
    """A client's TLS: verify the coordinator against ``ca`` (else the system's CAs), present ``cert``/``key``."""
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    try:
        if cert:
            ctx.load_cert_chain(str(cert), str(key) if key else None)
    except (OSError, ssl.SSLError) as e:
        raise UsageError("the client certificate cannot be used", f"{cert}, {key}: {e}",
                         "set $CRYOSLEEP_COORDINATOR_CERT and $CRYOSLEEP_COORDINATOR_KEY to a PEM certificate "
                         "and its key") from e
    return ctx


def tls_failure(url: str, ca: str | None, e: ssl.SSLError) -> TlsError:
    """The clear error for a TLS handshake that failed (a coordinator certificate no CA given signs, a client
    certificate refused)."""
    reason = getattr(e, "verify_message", None) or getattr(e, "reason", None) or str(e)
    if isinstance(e, ssl.SSLCertVerificationError):
        return TlsError(f"the coordinator at {url} presented a certificate this client does not trust",
                        f"{reason} (CA: {ca or 'the system CAs'})",
                        "set $CRYOSLEEP_COORDINATOR_CA to the CA file that signed the coordinator's certificate")
    return TlsError(f"the TLS handshake with the coordinator at {url} failed", str(reason),
                    "if the coordinator asks for client certificates, set $CRYOSLEEP_COORDINATOR_CERT and "
                    "$CRYOSLEEP_COORDINATOR_KEY; check the CA ($CRYOSLEEP_COORDINATOR_CA)")
