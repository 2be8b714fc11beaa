"""`cryosleep coordinator relay`: a relay between a group of node agents and the coordinator (docs/coordinator.md,
"Relays").

Every agent's long poll is a request the coordinator reads, routes and answers: about 0.5 ms of its CPU each, and
a snapshot is 9-11 rounds of a command to every node (docs/benchmarks.md). A relay, run by the operator next to a
group of nodes, holds its agents' polls itself and carries them to the coordinator in ONE batched long poll
(``POST /v1/relays/poll``: each agent's poll body, the results riding on it and the agent's own credential),
answered with every carried agent's commands then due; so the coordinator answers tens of relays per round instead
of thousands of agents. What a relay keeps is only what is in flight: it is stateless, and one that dies costs
its agents a redelivery (they go to the coordinator directly, the next URL of their list: ``client.Failover``),
never a wrong outcome (commands are delivered at least once and answered from the agents' results kept).

Results an agent posts on their own (a command that took longer than the poll's piggyback) go up together in
one batch (entries with ``poll: false``, answered at once), each post answered once its batch is. Everything
else an agent or a client sends (registration, leave, restore boards, status) is forwarded as it is, its own
credential with it: the coordinator decides as if it came directly.
The relay's own credential (role ``relay``: security.py) may do nothing but the batched poll, in which the
coordinator verifies each carried agent's credential.

Batching: an agent's poll arriving starts a batch ``gather_s`` later at most, at once when every agent the
previous batches answered is back (a round's answers ride together); the agents a batch's answer did not name
are still waiting and go in the next one.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from cryosleep.coordinator import httpserver
from cryosleep.coordinator.client import Http
from cryosleep.coordinator.group import GROUP, expand, merge
from cryosleep.errors import CryosleepError, Unreachable, UsageError

__all__ = ["Relay", "start"]

GATHER_S = 0.25
"""The longest an agent's poll waits at the relay for others to go in the same batch. A round is over only once
every agent answered, so waiting for the agents the last batches answered costs the round nothing; this bounds
the wait for one that is slow or gone (agents that answer together are gathered in far less)."""
AWAY_S = 10.0  # an agent answered this long ago and not back is not waited for (it is gone, or idle)
MARGIN_S = 1.0  # a batch is answered this long before its earliest agent's own poll would end
MAX_BATCH = 512  # agents per batched poll
MAX_BATCH_BYTES = 1 << 20  # the results a batch carries (the coordinator reads at most 4 MiB)
FORWARD_TIMEOUT_S = 3600.0  # a forwarded request that may wait (a trigger's --wait): the client's own bound rules
_AGENT = re.compile(r"^/v1/agents/(?P<agent>[^/]+)/(?P<what>poll|results)$")
EMPTY = b'{"commands": []}'


@dataclass
class Held:
    """One agent's poll held here."""

    agent: str
    credential: str
    incarnation: str
    deadline: float  # monotonic: when its own poll would end
    fut: asyncio.Future[httpserver.Response] | None
    results: list[Any] = field(default_factory=list)  # to carry in the next batch
    in_batch: bool = False
    slot: list[Http] | None = None  # the connection its batch went on (to end the batch when the agent goes)


@dataclass
class Posted:
    """An agent's results posted on their own (not on a poll), carried in the next batch of posts."""

    credential: str
    incarnation: str
    results: list[Any] = field(default_factory=list)
    futs: list[asyncio.Future[httpserver.Response]] = field(default_factory=list)


def _answer(fut: asyncio.Future[httpserver.Response] | None, status: int, body: bytes) -> None:
    if fut is not None and not fut.done():
        fut.set_result(httpserver.Response(status, body))


class Relay:
    """A relay serving on ``listen`` for the coordinator at ``upstream``, with the relay credential ``token``."""

    def __init__(self, listen: tuple[str, int], upstream: str, token: str, *, tls: ssl.SSLContext | None = None,
                 gather_s: float = GATHER_S, log: Callable[[str], None] | None = None) -> None:
        Http(upstream, token)  # the URL checked now, not at the first poll
        self.upstream = upstream
        self.token = token
        self.gather_s = gather_s
        self.log = log or (lambda _m: None)
        self.server = httpserver.Server(listen, _App(self), tls)
        self.held: dict[str, Held] = {}
        self.posts: dict[str, Posted] = {}  # agent -> its results posted since the last batch of posts
        self.away: dict[str, float] = {}  # answered by the last batches, not back yet -> when (monotonic)
        self.kick = asyncio.Event()
        self.free: list[Http] = []  # upstream connections not in use (each used by one thread at a time)
        self.lock = threading.Lock()
        self.batches = 0  # batched polls sent (tests, the benchmark)
        self.grouping = False  # the coordinator takes merged answers and sends rounds (coordinator/group.py)
        self.comms: dict[str, set[str]] = {}  # agent -> the communicators of its last drain summary (hex)
        self.merged = 0  # agents' results carried merged (tests)
        self.rounds = 0  # commands received once for several agents (tests)
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> Relay:
        def pump() -> None:
            task = self.server.loop.create_task(self._pump())
            self.server.tasks.add(task)
            task.add_done_callback(self.server.tasks.discard)

        self.server.loop.call_soon_threadsafe(pump)
        self.thread = threading.Thread(target=self.server.serve_forever, name="relay", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            for h in self.free:
                h.close()
            self.free.clear()

    # ---- upstream ----------------------------------------------------------------------------------------------

    def _upstream(self, method: str, path: str, data: bytes | None, auth: str, timeout: float,
                  slot: list[Http] | None = None) -> tuple[int, bytes]:
        """One request to the coordinator on a pooled connection (in a thread of the server's pool; ``slot``
        is told which)."""
        with self.lock:
            http = self.free.pop() if self.free else Http(self.upstream, self.token)
            if slot is not None:
                slot.append(http)
        try:
            out = http.request(method, path, data, auth, timeout)
        except BaseException:
            http.close()
            raise
        with self.lock:
            self.free.append(http)
        return out

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self.kick.wait()
            self.kick.clear()
            end = loop.time() + self.gather_s
            old = time.monotonic() - AWAY_S
            for agent in [a for a, t in self.away.items() if t < old]:
                del self.away[agent]
            while self.away and loop.time() < end:  # the rest of the round's agents, a moment behind
                try:
                    await asyncio.wait_for(self.kick.wait(), end - loop.time())
                except TimeoutError:
                    break
                self.kick.clear()
            if self.posts:
                posts, self.posts = self.posts, {}
                task = self.server.loop.create_task(self._carry_posts(posts))
                self.server.tasks.add(task)
                task.add_done_callback(self.server.tasks.discard)
            ready = [h for h in self.held.values() if not h.in_batch]
            chunk: list[Held] = []
            size = 0
            for h in ready:
                n = len(json.dumps(h.results)) if h.results else 0
                if chunk and (len(chunk) >= MAX_BATCH or size + n > MAX_BATCH_BYTES):
                    self._send(chunk)
                    chunk, size = [], 0
                chunk.append(h)
                size += n
            if chunk:
                self._send(chunk)

    def _send(self, chunk: list[Held]) -> None:
        slot: list[Http] = []
        for h in chunk:  # now, not when the task runs: a poll is in one batch at a time
            h.in_batch, h.slot = True, slot
        task = self.server.loop.create_task(self._carry(chunk, slot))
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    def _merge(self, results: list[tuple[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
        """The results to carry as merged ones and, per agent, the rest (coordinator/group.py): merged only for
        a coordinator that said it takes them."""
        if not self.grouping:
            rest: dict[str, list[Any]] = {}
            for agent, r in results:
                rest.setdefault(agent, []).append(r)
            return [], rest
        return merge(results, self.comms)

    async def _batch(self, wait: float, entries: list[dict[str, Any]], slot: list[Http] | None = None,
                     merged: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], bytes | None]:
        """One ``POST /v1/relays/poll``: the coordinator's answers per agent (a command sent once for several of
        them handed out to each: ``rounds``), or what to answer every agent of the batch when it failed (502
        ``unreachable``: the agent tries the coordinator directly)."""
        self.batches += 1
        body: dict[str, Any] = {"wait_s": wait, "relay": self.url, "can": [GROUP], "agents": entries}
        if merged:
            body["merged"] = merged
            self.merged += sum(len(m["agents"]) for m in merged)
        data = json.dumps(body).encode()
        try:
            status, raw = await self.server.run_blocking(self._upstream, "POST", "/v1/relays/poll", data,
                                                         f"Bearer {self.token}", wait + 30, slot)
            doc = json.loads(raw) if raw else {}
            if status != 200:
                raise CryosleepError(str(doc.get("what", f"HTTP {status}")), str(doc.get("why", "")), "")
            self.grouping = GROUP in (doc.get("can") or ())
            answers = dict(doc.get("answers") or {})
            for r in doc.get("rounds") or ():
                self.rounds += 1
                for agent in r["agents"]:
                    answers[agent] = {"status": 200, "body": {"commands": [expand(r["command"], agent, self.comms)]}}
            return answers, None
        except (CryosleepError, ValueError, RuntimeError) as e:  # RuntimeError: the relay is stopping
            what = e.what if isinstance(e, CryosleepError) else f"{type(e).__name__}: {e}"
            why = e.why if isinstance(e, CryosleepError) else ""
            self.log(f"a batched poll of {len(entries)} agent(s) failed: {what} ({why})")
            return {}, json.dumps(Unreachable(f"the relay at {self.url} cannot reach the coordinator",
                                              f"{what} ({why})" if why else what,
                                              "the agent tries the next URL of its list (the coordinator's)"
                                              ).to_json()).encode()

    async def _carry_posts(self, posts: dict[str, Posted]) -> None:
        """The results posted since the last batch, in one batch answered at once (entries with ``poll: false``);
        each post answered as the coordinator answered its agent's results."""
        merged, rest = self._merge([(a, r) for a, p in posts.items() for r in p.results])
        entries = [{"agent": a, "credential": p.credential, "incarnation": p.incarnation,
                    "results": rest.get(a, []), "poll": False} for a, p in posts.items()]
        answers, failed = await self._batch(0.0, entries, merged=merged)
        for agent, p in posts.items():
            a = answers.get(agent)
            for fut in p.futs:
                if failed is not None or a is None:
                    _answer(fut, 502, failed or b'{"error": "error", "what": "the coordinator did not answer"}')
                else:
                    _answer(fut, int(a.get("status", 500)), json.dumps(a.get("body") or {}).encode())

    async def _carry(self, chunk: list[Held], slot: list[Http]) -> None:
        """One batched poll for ``chunk``'s agents; each answered with what the coordinator said for it."""
        now = time.monotonic()
        wait = max(0.0, min(h.deadline for h in chunk) - now - MARGIN_S)
        entries = []
        merged, rest = self._merge([(h.agent, r) for h in chunk for r in h.results])
        for h in chunk:
            entries.append({"agent": h.agent, "credential": h.credential, "incarnation": h.incarnation,
                            "results": rest.get(h.agent, [])})
            h.results = []  # an agent whose poll fails sends them again with its next one
        answers, failed = await self._batch(wait, entries, slot, merged)
        now = time.monotonic()
        for h in chunk:
            h.in_batch, h.slot = False, None
            a = answers.get(h.agent)
            if failed is None and a is None and h.deadline - now > MARGIN_S and h.fut is not None:
                continue  # still waiting: in the next batch
            if failed is not None:
                _answer(h.fut, 502, failed)
            elif a is not None:
                _answer(h.fut, int(a.get("status", 500)), json.dumps(a.get("body") or {}).encode())
            else:
                _answer(h.fut, 200, EMPTY)
            if self.held.get(h.agent) is h:
                del self.held[h.agent]
            self.away[h.agent] = now
        self.kick.set()

    # ---- the agents' side ----------------------------------------------------------------------------------------

    async def poll(self, req: httpserver.Request, agent: str) -> httpserver.Response:
        try:
            body = json.loads(req.body) if req.body else {}
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
            results = list(body.get("results") or ())
            wait = float(body.get("wait_s", 20.0))
        except (ValueError, TypeError) as e:
            err = UsageError("the relay could not read the poll", f"{type(e).__name__}: {e}", "")
            return httpserver.Response(400, json.dumps(err.to_json()).encode())
        auth = req.get("Authorization") or ""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[httpserver.Response] = loop.create_future()
        deadline = time.monotonic() + max(0.0, min(wait, 300.0))
        h = self.held.get(agent)
        if h is None:
            h = self.held[agent] = Held(agent, auth.partition(" ")[2].strip(), str(body.get("incarnation", "")),
                                        deadline, fut)
        else:  # a newer poll of the same agent: the older one is answered, this one takes its place
            _answer(h.fut, 200, EMPTY)
            h.fut, h.deadline, h.credential = fut, deadline, auth.partition(" ")[2].strip()
            h.incarnation = str(body.get("incarnation", ""))
        h.results.extend(results)
        self.away.pop(agent, None)
        self.kick.set()
        wake = self.server.wakeup()
        fut.add_done_callback(lambda _f: wake.now())
        conn = req.conn
        conn.waiting = wake  # its client closing wakes it
        try:
            while not fut.done() and not conn.gone:
                await wake.wait(max(0.05, h.deadline + 30 - time.monotonic()))
        finally:
            conn.waiting = None
        if fut.done():
            return fut.result()
        if h.fut is fut:  # the agent went: what a batch brings for it is delivered again later
            h.fut = None
            for http in h.slot or ():  # its batch ends now (the others go in the next): no longer polling there
                http.abort()
            if not h.in_batch and self.held.get(agent) is h:
                del self.held[agent]
        return httpserver.Response(200, EMPTY)

    async def post(self, req: httpserver.Request, agent: str) -> httpserver.Response:
        """Results posted on their own: carried with the others posted meanwhile, answered once delivered."""
        try:
            body = json.loads(req.body) if req.body else {}
            results = list(body.get("results") or ())
            inc = str(body.get("incarnation", ""))
        except (ValueError, TypeError, AttributeError):
            return await self.forward(req)  # the coordinator says what is wrong with it
        p = self.posts.get(agent)
        if p is not None and p.incarnation != inc:
            return await self.forward(req)  # two incarnations at once: one at a time
        if p is None:
            p = self.posts[agent] = Posted((req.get("Authorization") or "").partition(" ")[2].strip(), inc)
        fut: asyncio.Future[httpserver.Response] = asyncio.get_running_loop().create_future()
        p.results.extend(results)
        p.futs.append(fut)
        self.kick.set()
        return await fut

    async def forward(self, req: httpserver.Request) -> httpserver.Response:
        try:
            status, raw = await self.server.run_blocking(self._upstream, req.method, req.target, req.body or None,
                                                         req.get("Authorization") or "", FORWARD_TIMEOUT_S)
        except CryosleepError as e:
            err = Unreachable(f"the relay at {self.url} cannot reach the coordinator", f"{e.what} ({e.why})",
                              "the agent tries the next URL of its list (the coordinator's)")
            return httpserver.Response(502, json.dumps(err.to_json()).encode())
        return httpserver.Response(status, raw)


class _App:
    """The relay's routes for coordinator/httpserver.py: agents' polls held here, everything else forwarded."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay

    def head(self, req: httpserver.Request) -> httpserver.Response | None:
        return None  # the coordinator's gate decides, on the forwarded request or each carried poll

    def handle(self, req: httpserver.Request) -> httpserver.Response | Awaitable[httpserver.Response]:
        m = _AGENT.match(urlsplit(req.target).path) if req.method == "POST" else None
        if m is not None and m.group("what") == "poll":
            return self.relay.poll(req, unquote(m.group("agent")))
        if m is not None:
            return self.relay.post(req, unquote(m.group("agent")))
        return self.relay.forward(req)

    def failed(self, req: httpserver.Request, e: BaseException) -> httpserver.Response:
        err = CryosleepError("the relay failed", f"{type(e).__name__}: {e}", "see the relay's log")
        self.relay.log(f"{req.method} {req.target[:200]}: {type(e).__name__}: {e}")
        return httpserver.Response(500, json.dumps(err.to_json()).encode())


def start(listen: tuple[str, int], upstream: str, token: str, **kw: Any) -> Relay:
    """A relay serving on a thread of its own (tests, the benchmark; ``coordinator relay`` in the foreground)."""
    try:
        relay = Relay(listen, upstream, token, **kw)
    except OSError as e:
        raise UsageError(f"the relay cannot listen on {listen[0]}:{listen[1]}", str(e),
                         "choose another --listen address or port") from e
    return relay.start()
