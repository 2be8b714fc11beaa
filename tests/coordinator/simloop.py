"""Simulated node agents on one event loop: the real protocol over real HTTP, at a fraction of the CPU.

Test-only code, for the coordinator's scale benchmark (``bench/coordinator_scale.py``). ``SimCluster``'s agents
are ``client.AgentRunner``s, the real agent's loop: a poll thread, two keep-alive connections and a thread per
command each. That is right for one agent on its own machine, but 2,048 of them on the benchmark's cores (4,000
threads) cost several times the coordinator's own CPU per snapshot and so became what the benchmark measured.
``LoopAgents`` runs the same ``SimNode`` backends with the same protocol on one asyncio loop (aiohttp): register,
long-poll, run each delivered command, answer it on the next poll when it is done within ``PIGGYBACK_S`` (as the
runner does) or post it, answer a repeated delivery from the results kept, register again when the coordinator
says so. The backends' operations run on a small thread pool, since they may wait (a fault's delay, a report's
wait for simulated calls). Faults that stop an agent's polls (``SimFaults.die``) are not modelled here: the
coordinator's fault tests use ``SimCluster``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from cryosleep.coordinator.client import KEEP_RESULTS, PIGGYBACK_S, Failover, Registration, execute, split_urls
from cryosleep.coordinator.protocol import Command, Result
from cryosleep.errors import CryosleepError, Unreachable, from_json
from tests.coordinator.sim import SimFaults, SimNode, SimWorld


class _Agent:
    def __init__(self, node: SimNode, reg: Registration, urls: list[str]) -> None:
        self.failover = Failover(urls)  # a relay's URL first, the coordinator's next (client.Http's rule)
        self.node = node
        self.reg = reg
        self.agent_id: str | None = None
        self.credential = ""
        self.done: dict[str, Result] = {}
        self.running: set[str] = set()


class LoopAgents:
    """``only``'s nodes of one simulated job (``SimWorld``), each an agent of the coordinator at ``url`` (several,
    comma-separated: a relay first, the coordinator next, as ``client.Http`` takes them; ``via``: node -> its own
    list, the benchmark's nodes spread over relays)."""

    def __init__(self, url: str, token: str, store: Path, *, job: str, nnodes: int, nproc: int, seed: int = 0,
                 spread: int = 5, only: range | None = None, wait_s: float = 20.0, workers: int = 8,
                 log: Callable[[str], None] | None = None, faults: Mapping[int, SimFaults] | None = None,
                 back_after_s: float | None = None, via: Mapping[int, str] | None = None) -> None:
        self.urls = [u.rstrip("/") for u in split_urls(url)]
        self.token = token
        self.wait_s = wait_s
        self.log = log or (lambda _m: None)
        self.world = SimWorld(nnodes, nproc, seed=seed, spread=spread)
        self.agents = []
        for n in only or range(nnodes):
            node = SimNode(self.world, n, store, (faults or {}).get(n))
            self.agents.append(_Agent(node, Registration(
                job=job, nnodes=nnodes, node_rank=n, ranks=[rk.rank for rk in node.ranks], hostname=f"sim-{n}",
                address=f"sim://{n}", spec={"nproc_per_node": nproc, "simulated": True}),
                [u.rstrip("/") for u in split_urls(via[n])] if via and n in via else self.urls))
            if back_after_s is not None:
                self.agents[-1].failover.back_after_s = back_after_s
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="simloop-op")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="simloop", daemon=True)
        self.session: aiohttp.ClientSession | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.posting: set[asyncio.Task[None]] = set()
        self.registered = 0

    # -- HTTP --

    async def _call(self, agent: _Agent | None, path: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any]:
        assert self.session is not None
        cred = agent.credential if agent is not None and agent.credential else self.token
        fo = agent.failover if agent is not None else Failover(self.urls)
        order = fo.order()
        for k, i in enumerate(order):
            try:
                try:
                    async with self.session.post(fo.urls[i] + path, json=body,
                                                 headers={"Authorization": f"Bearer {cred}"},
                                                 timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                        doc: dict[str, Any] = await resp.json(content_type=None) or {}
                except (aiohttp.ClientConnectionError, ConnectionError) as e:
                    raise Unreachable(f"{fo.urls[i]} did not answer", f"{type(e).__name__}: {e}", "") from e
                if resp.status >= 400:
                    raise from_json(doc) if "error" in doc else \
                        CryosleepError(f"HTTP {resp.status}", str(doc)[:200], "")
            except Unreachable:
                if k == len(order) - 1:
                    raise
                continue
            fo.worked(i)
            return doc
        raise AssertionError("unreachable")

    async def _register(self, a: _Agent) -> None:
        a.credential = ""
        res = await self._call(a, "/v1/agents/register", a.reg.to_json(), 60)  # its bootstrap token: no credential yet
        a.credential = str(res.get("credential") or "")
        a.agent_id = str(res["agent_id"])
        self.wait_s = min(self.wait_s, float(res.get("poll_wait_s", self.wait_s)))

    # -- commands --

    def _keep(self, a: _Agent, res: Result) -> None:
        a.running.discard(res.id)
        a.done[res.id] = res
        while len(a.done) > KEEP_RESULTS:
            del a.done[next(iter(a.done))]

    async def _post_later(self, a: _Agent, fut: asyncio.Future[Result]) -> None:
        res = await fut
        self._keep(a, res)
        if a.agent_id is None:
            return  # the next delivery of the command is answered from ``done``
        try:
            await self._call(a, f"/v1/agents/{quote(a.agent_id, safe='')}/results",
                             {"incarnation": a.reg.incarnation, "results": [res.to_json()]}, 60)
        except (TimeoutError, CryosleepError, aiohttp.ClientError) as e:
            self.log(f"node {a.reg.node_rank}: result of {res.id} not delivered ({e}); answered at its next delivery")

    async def _dispatch(self, a: _Agent, cmds: list[Command]) -> list[Result]:
        """Starts the delivered commands; returns the results to carry on the next poll."""
        carry: list[Result] = []
        started: list[tuple[Command, asyncio.Future[Result]]] = []
        for cmd in cmds:
            if cmd.id in a.running:
                continue
            if cmd.id in a.done:
                carry.append(a.done[cmd.id])  # a repeat: the same answer, never a second execution
                continue
            a.running.add(cmd.id)
            started.append((cmd, asyncio.ensure_future(self.loop.run_in_executor(self.pool, execute, a.node, cmd))))
        if started:
            await asyncio.wait([f for _, f in started], timeout=PIGGYBACK_S)
        for _cmd, fut in started:
            if fut.done():
                res = fut.result()
                self._keep(a, res)
                carry.append(res)
            else:
                task = asyncio.ensure_future(self._post_later(a, fut))
                self.posting.add(task)  # kept until done (the loop holds only weak references to tasks)
                task.add_done_callback(self.posting.discard)
        return carry

    async def _run(self, a: _Agent) -> None:
        carry: list[Result] = []
        backoff = 0.05
        while True:
            try:
                if a.agent_id is None:
                    await self._register(a)
                    self.registered += 1
                assert a.agent_id is not None
                body: dict[str, Any] = {"incarnation": a.reg.incarnation, "wait_s": self.wait_s}
                if carry:
                    body["results"] = [r.to_json() for r in carry]
                res = await self._call(a, f"/v1/agents/{quote(a.agent_id, safe='')}/poll", body, self.wait_s + 30)
                carry = await self._dispatch(a, [Command.from_json(c) for c in res.get("commands") or ()])
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except CryosleepError as e:
                if e.details.get("reregister"):
                    a.agent_id, carry = None, []  # its commands are delivered again, and answered from ``done``
                    continue
                self.log(f"node {a.reg.node_rank}: {e.what} ({e.why}); retrying in {backoff:.2f} s")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                self.log(f"node {a.reg.node_rank}: {type(e).__name__}: {e}; retrying in {backoff:.2f} s")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    # -- lifetime --

    async def _start(self) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
        self.tasks = [asyncio.ensure_future(self._run(a)) for a in self.agents]

    def start(self, timeout: float = 60.0) -> LoopAgents:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        end = time.monotonic() + timeout
        while not all(a.agent_id for a in self.agents):
            if time.monotonic() > end:
                raise TimeoutError(f"{sum(1 for a in self.agents if a.agent_id)} of {len(self.agents)} simulated "
                                   f"agents registered in {timeout:.0f} s")
            time.sleep(0.05)
        return self

    async def _stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def close(self) -> None:
        for a in self.agents:
            a.node.release.set()
        if self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        self.pool.shutdown(wait=False, cancel_futures=True)
