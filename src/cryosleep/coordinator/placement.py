"""Hosts that offer capacity, and the placement of a snapshot's node images on them.

``cryosleep host serve --coordinator URL --name H`` runs on each machine that may take a node of a job (the host
daemon, cli/host_cmd.py): it long-polls here for orders, reporting its facts (host name, GPUs, the underlay
address its job networks' overlays use) with each poll. ``cryosleep restore SNAPSHOT --nodes H0,H1,...`` asks
for a placement: node I's image on host HI (``--nodes auto``: the coordinator picks live, free hosts with each
node's GPUs, ``Placements.pick``). The coordinator checks the snapshot (verified, that many nodes) and
the hosts (known, polled recently), and queues one order per node, each with the overlay peers of its node (the
other hosts' underlay addresses: ``--net-peers`` is not given by hand). Each host daemon runs its order as
``cryosleep restore SNAPSHOT --node-rank I`` there; the nodes then meet at the restore's barrier
(rendezvous.py), so that nothing starts unless every node can restore. The placement's state is read back
(long poll) until every order is done or failed.

Hosts, orders and placements live in the coordinator's memory, written through to the catalog's engine
(coordinator/shared.py: each order at every change of state, each host when it first polls, when its facts change
and every ``HOST_WRITE_S``): a restarted coordinator, or a standby taking over, loads them back, so that a
placement in progress goes on (its orders are delivered again if they were not reported running, and their
reports are taken).

A host daemon that stops polling (killed, its machine gone) for ``lost_s`` is lost: each order it had not yet
started fails, saying so, and the other nodes' restores are told at their barrier (``on_lost``), so that they
stop at once rather than wait out their timeout, nothing started anywhere; the placement then ends, failed, and
the snapshot can be placed again. An order it had started goes on there by itself (the restore is not the
daemon's to end): once its restored agent registered with the coordinator (``agent_restored``), the order is
done by that word; until then it stays running.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryosleep.coordinator.shared import SharedStore
from cryosleep.errors import Busy, NotEligible, NotFound, UsageError

HOST_FRESH_S = 60.0  # a host that has not polled for this long is not offered for a placement
MAX_WAIT_S = 30.0
REDELIVER_S = 10.0  # an order delivered but not reported running is delivered again (the daemon drops repeats)
FINAL = ("done", "failed")
KEEP_S = 24 * 3600.0  # finished placements are forgotten after this long
HOST_WRITE_S = 10.0  # a polling host's last-seen time is written through this often
HOST_LOST_S = 30.0  # a host daemon with no poll open and none for this long is lost (its unstarted orders fail)


@dataclass
class Order:
    id: str
    placement: str
    host: str
    snapshot: str
    node_rank: int
    peers: list[str]
    timeout_s: float
    state: str = "queued"  # then delivered, running, done or failed
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    updated: float = field(default_factory=time.monotonic)
    # the restored agent's registration (its job here, the image it came from): the order's result if its host is
    # lost before it reports (kept in memory only)
    registered: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "placement": self.placement, "host": self.host,
                               "snapshot": self.snapshot, "node_rank": self.node_rank, "peers": self.peers,
                               "timeout_s": self.timeout_s, "state": self.state}
        if self.result is not None:
            out["result"] = self.result
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass
class HostEntry:
    name: str
    facts: dict[str, Any]
    seen: float
    polling: int = 0  # polls open now
    written: float = 0.0  # when it was last written through (monotonic)


class Placements:
    """The hosts, their orders and the placements (thread-safe; one condition wakes every waiter)."""

    def __init__(self, fresh_s: float = HOST_FRESH_S, store: SharedStore | None = None, lost_s: float = HOST_LOST_S,
                 on_lost: Callable[[Order], None] | None = None) -> None:
        """``on_lost``: told of each order failed because its host was lost before it started it (with this
        object's lock held: it must not call back here)."""
        self.cond = threading.Condition()
        self.fresh_s = fresh_s
        self.lost_s = lost_s
        self.on_lost = on_lost
        self.started = time.monotonic()  # a host is not lost for the time this coordinator did not serve
        self.store = store
        self.hosts: dict[str, HostEntry] = {}
        self.orders: dict[str, Order] = {}
        self.placements: dict[str, list[str]] = {}  # placement id -> its orders, by node rank
        self.drained: dict[str, str] = {}  # host -> why it takes no node (`coordinator drain`)
        if store is not None:  # what a previous coordinator left (a restart, a standby's takeover)
            self.drained = store.drained()
            for name, facts, seen in store.hosts():
                self.hosts[name] = HostEntry(name, facts, seen, written=seen)
            for d in store.orders():
                o = self.orders[d["id"]] = Order(**d)
                self.placements.setdefault(o.placement, []).append(o.id)

    def _write(self, *orders: Order) -> None:
        if self.store is not None:
            for o in orders:
                self.store.order_put(o.to_json())

    def drain(self, host: str, reason: str) -> None:
        """``host`` takes no node from now on (until ``undrain``); written through."""
        with self.cond:
            self.drained[host] = reason
            if self.store is not None:
                self.store.drain_put(host, reason)

    def undrain(self, host: str) -> bool:
        with self.cond:
            was = self.drained.pop(host, None) is not None
            if self.store is not None:
                self.store.drain_drop(host)
            self.cond.notify_all()
            return was

    # ---- the host daemons' side --------------------------------------------------------------------------------

    def poll(self, name: str, facts: dict[str, Any], wait_s: float,
             gone: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """A host daemon's poll: records the host (and its facts), then returns its queued orders, waiting up to
        ``wait_s`` for one."""
        if not name or "/" in name:
            raise UsageError(f"invalid host name {name!r}", "a host's name is one path segment", "")
        end = time.monotonic() + min(max(wait_s, 0.0), MAX_WAIT_S)
        with self.cond:
            host = self.hosts.get(name)
            new = host is None
            if host is None:
                host = self.hosts[name] = HostEntry(name, facts, time.monotonic())
            host.seen = time.monotonic()
            changed = bool(facts) and facts != host.facts
            if facts:
                host.facts = facts
            if self.store is not None and (new or changed or host.seen - host.written > HOST_WRITE_S):
                self.store.host_put(name, host.facts)
                host.written = host.seen
            host.polling += 1
            try:
                while True:
                    now = time.monotonic()
                    mine = [o for o in self.orders.values() if o.host == name and (
                        o.state == "queued" or (o.state == "delivered" and now - o.updated > REDELIVER_S))]
                    left = end - now
                    if gone():  # the daemon went away with its poll: what it did not get stays queued
                        return {"orders": []}
                    self._fail_lost(now)  # another host's, while this one waits
                    if mine or left <= 0:
                        for o in mine:
                            o.state, o.updated = "delivered", time.monotonic()
                        self._write(*mine)
                        self.cond.notify_all()
                        return {"orders": [o.to_json() for o in mine]}
                    self.cond.wait(min(left, 1.0))
            finally:
                host.polling -= 1
                host.seen = time.monotonic()

    def report(self, oid: str, body: dict[str, Any]) -> dict[str, Any]:
        """A host daemon's word on one of its orders: running, done (with the restore's result) or failed (with
        the error)."""
        state = str(body.get("state", ""))
        if state not in ("running", *FINAL):
            raise UsageError(f"invalid order state {state!r}", "expected running, done or failed", "")
        with self.cond:
            o = self.orders.get(oid)
            if o is None:
                raise NotFound(f"no order {oid}", "the coordinator does not know it (restarted?)", "")
            if o.state not in FINAL:  # a repeated report changes nothing
                o.state, o.updated = state, time.monotonic()
                if isinstance(body.get("result"), dict):
                    o.result = body["result"]
                if isinstance(body.get("error"), dict):
                    o.error = body["error"]
                self._write(o)
            self.cond.notify_all()
            return o.to_json()

    # ---- the clients' side ---------------------------------------------------------------------------------------

    def list_hosts(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        with self.cond:
            return [{"name": h.name, "facts": h.facts, "seen_s": round(now - h.seen, 3),
                     "available": (h.polling > 0 or now - h.seen < self.fresh_s) and h.name not in self.drained,
                     "drained": self.drained.get(h.name),
                     "orders": sum(1 for o in self.orders.values() if o.host == h.name and o.state not in FINAL)}
                    for h in sorted(self.hosts.values(), key=lambda h: h.name)]

    def pick(self, snapshot: dict[str, Any], busy: Mapping[str, str] | None = None) -> list[str]:
        """Hosts for every node of ``snapshot`` (``--nodes auto``), node by node in rank order: a host that polled
        recently, is not drained, has no order in progress, is not ``busy`` (host -> why: it runs a node of a live
        job), is not taken by another node, and has the GPUs (count and model) the node's image was taken on; by
        name among equals. Refused with each node's unmet need and why each host was passed over."""
        sid = str(snapshot["id"])
        images = {int(n["node_rank"]): n.get("image") or {} for n in snapshot.get("nodes") or ()}
        now = time.monotonic()
        chosen: list[str] = []
        with self.cond:
            self._expire(now)
            why: dict[str, str] = {}
            free = []
            for h in sorted(self.hosts.values(), key=lambda h: h.name):
                if h.polling == 0 and now - h.seen >= self.fresh_s:
                    why[h.name] = f"has not polled for {now - h.seen:.0f} s"
                elif h.name in self.drained:
                    why[h.name] = f"is drained ({self.drained[h.name]})"
                elif busy and h.name in busy:
                    why[h.name] = busy[h.name]
                elif any(o.host == h.name and o.state not in FINAL for o in self.orders.values()):
                    why[h.name] = "is restoring another node now"
                else:
                    free.append(h)
            unmet = []
            for rank in sorted(images):
                need = sorted(images[rank].get("gpus") or [])
                fit = next((h for h in free if h.name not in chosen and (
                    not need or sorted(h.facts.get("gpus") or []) == need)), None)
                if fit is None:
                    unmet.append(f"node {rank} needs a host with " + (
                        f"{len(need)} GPU(s) ({', '.join(sorted(set(need)))})" if need else "no GPU in particular"))
                    continue
                chosen.append(fit.name)
            if unmet:
                passed = [f"host {n} {w}" for n, w in sorted(why.items())] + [
                    f"host {h.name} has {len(h.facts.get('gpus') or [])} GPU(s)" for h in free if h.name not in chosen]
                raise NotEligible(f"snapshot {sid} cannot be placed: not enough compatible hosts",
                                  "; ".join(unmet + passed + ([f"taken by the nodes before: {', '.join(chosen)}"]
                                                              if chosen else [])),
                                  "start `cryosleep host serve` on more machines with those GPUs, or name the hosts "
                                  "with --nodes; nothing was started")
        return chosen

    def place(self, snapshot: dict[str, Any], hosts: list[str], timeout_s: float,
              busy: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Node I of ``snapshot`` (a catalog row) on ``hosts[I]`` (``["auto"]``: hosts chosen by ``pick``, ``busy``
        passed on): one order per node, or refused with every reason (nothing is queued then)."""
        sid = str(snapshot["id"])
        if hosts == ["auto"]:
            if snapshot.get("state") != "verified":
                raise NotEligible(f"snapshot {sid} cannot be placed", f"it is {snapshot.get('state')}, not verified",
                                  "list the valid snapshots with `cryosleep coordinator snapshots JOB --valid`")
            hosts = self.pick(snapshot, busy)
        nodes = sorted(int(n["node_rank"]) for n in snapshot.get("nodes") or ())
        problems = []
        if snapshot.get("state") != "verified":
            problems.append(f"snapshot {sid} is {snapshot.get('state')}, not verified")
        if len(hosts) != len(nodes):
            problems.append(f"snapshot {sid} has {len(nodes)} node(s), {len(hosts)} host(s) were given")
        now = time.monotonic()
        with self.cond:
            self._expire(now)
            for name in dict.fromkeys(hosts):
                h = self.hosts.get(name)
                if h is None:
                    problems.append(f"no host {name!r} has registered (is `cryosleep host serve` running there?)")
                elif h.polling == 0 and now - h.seen >= self.fresh_s:
                    problems.append(f"host {name!r} has not polled for {now - h.seen:.0f} s")
                if name in self.drained:
                    problems.append(f"host {name!r} is drained ({self.drained[name]}): `cryosleep coordinator "
                                    f"undrain {name}` offers it again")
            images = {int(n["node_rank"]): n.get("image") or {} for n in snapshot.get("nodes") or ()}
            for rank, name in zip(nodes, hosts, strict=False):
                need, h = images.get(rank, {}).get("gpus") or [], self.hosts.get(name)
                have = list(h.facts.get("gpus") or []) if h is not None else None
                if need and have is not None and sorted(have) != sorted(need):
                    models = ", ".join(sorted(set(need)))
                    problems.append(f"node {rank}'s image was taken on {len(need)} GPU(s) ({models}), host {name!r} "
                                    f"has {len(have)}" + (f" ({', '.join(sorted(set(have)))})" if have else ""))
            if problems:
                raise NotEligible(f"snapshot {sid} cannot be placed", "; ".join(problems),
                                  "list the hosts with `cryosleep coordinator hosts` and the valid snapshots with "
                                  "`cryosleep coordinator snapshots JOB --valid`; nothing was started")
            placing = [p for p, oids in self.placements.items()
                       if self.orders[oids[0]].snapshot == sid and any(self.orders[o].state not in FINAL for o in oids)]
            if placing:
                raise Busy(f"snapshot {sid} is being placed already", f"placement {placing[0]} is in progress",
                           f"wait for it: `cryosleep coordinator placement {placing[0]}`")
            pid = "pl-" + secrets.token_hex(6)
            underlay = {n: str(self.hosts[n].facts.get("underlay") or "") for n in hosts}
            oids = []
            for rank, name in zip(nodes, hosts, strict=True):
                peers = sorted({underlay[o] for o in hosts if o != name and underlay[o]} - {underlay[name]})
                o = Order("or-" + secrets.token_hex(6), pid, name, sid, rank, peers, timeout_s)
                self.orders[o.id] = o
                oids.append(o.id)
            self.placements[pid] = oids
            self._write(*(self.orders[o] for o in oids))
            self.cond.notify_all()
            return self._status(pid)

    def place_node(self, sid: str, node_rank: int, host: str, peers: list[str], timeout_s: float) -> str:
        """One node of a live migration (coordinator/migrate.py) on ``host``, which ``pick`` found free: one order,
        in a placement of its own, whose id is returned. ``peers``: the overlay peers its restore is given (none:
        it learns them at its barrier, as the job's other nodes learn theirs)."""
        with self.cond:
            if host in self.drained:
                raise NotEligible(f"host {host!r} cannot take node {node_rank} of {sid}",
                                  f"it is drained ({self.drained[host]})", f"`cryosleep coordinator undrain {host}`")
            pid = "pl-" + secrets.token_hex(6)
            o = Order("or-" + secrets.token_hex(6), pid, host, sid, node_rank, list(peers), timeout_s)
            self.orders[o.id] = o
            self.placements[pid] = [o.id]
            self._write(o)
            self.cond.notify_all()
            return pid

    def underlay(self, host: str) -> str:
        """The underlay address a host daemon reported ("" when it never polled, or reported none)."""
        with self.cond:
            h = self.hosts.get(host)
            return str(h.facts.get("underlay") or "") if h is not None else ""

    def status(self, pid: str, wait_s: float = 0.0, seen: str = "") -> dict[str, Any]:
        """A placement's orders; with ``wait_s``, waits until they change from ``seen`` (a status's ``version``)
        or are all final."""
        end = time.monotonic() + min(max(wait_s, 0.0), MAX_WAIT_S)
        with self.cond:
            while True:
                if pid not in self.placements:
                    raise NotFound(f"no placement {pid}", "the coordinator does not know it (restarted?)",
                                   "list the job's snapshots and place one again")
                self._fail_lost(time.monotonic())
                out = self._status(pid)
                left = end - time.monotonic()
                if out["version"] != seen or out["state"] in FINAL or left <= 0:
                    return out
                self.cond.wait(min(left, 1.0))

    def running(self, node_rank: int) -> list[tuple[str, str]]:
        """(order id, snapshot) of the orders of node ``node_rank`` under way."""
        with self.cond:
            return [(o.id, o.snapshot) for o in self.orders.values()
                    if o.node_rank == node_rank and o.state in ("delivered", "running")]

    def agent_restored(self, oid: str, registration: dict[str, Any]) -> None:
        """The agent restored by order ``oid`` registered with the coordinator: what the order's result is if its
        host daemon is lost before it reports."""
        with self.cond:
            o = self.orders.get(oid)
            if o is not None and o.state not in FINAL:
                o.registered = registration
                self.cond.notify_all()

    def _fail_lost(self, now: float) -> None:
        """(lock held) The orders not yet started by a host that is lost fail, and the others' barriers are told;
        those it started are done once their restored agent registered."""
        for o in self.orders.values():
            if o.state in FINAL:
                continue
            h = self.hosts.get(o.host)
            quiet = now - max(h.seen if h is not None else 0.0, self.started)
            if (h is not None and h.polling > 0) or quiet < self.lost_s:
                continue
            if o.state == "running" or (o.state == "delivered" and o.registered is not None):
                if o.registered is not None:
                    o.state, o.updated = "done", now
                    o.result = {**o.registered, "reported_by": f"the restored agent (host {o.host!r}'s daemon "
                                                               f"has not polled for {quiet:.0f} s)"}
                    self._write(o)
                    self.cond.notify_all()
                continue
            o.state, o.updated = "failed", now
            o.error = NotEligible(
                f"host {o.host!r} was lost before it started the restore of node {o.node_rank} of {o.snapshot}",
                f"its host daemon has not polled for {quiet:.0f} s (stopped, killed, or its machine gone); the "
                "other nodes' restores were told at their barrier, so nothing was started anywhere",
                "start `cryosleep host serve` there again, or place the snapshot on other hosts: the snapshot "
                "is untouched").to_json()
            self._write(o)
            if self.on_lost is not None:
                self.on_lost(o)
            self.cond.notify_all()

    def _status(self, pid: str) -> dict[str, Any]:
        orders = [self.orders[o] for o in self.placements[pid]]
        states = [o.state for o in orders]
        state = ("failed" if "failed" in states and all(s in FINAL for s in states) else
                 "done" if all(s == "done" for s in states) else "running")
        version = ",".join(states)
        return {"id": pid, "snapshot": orders[0].snapshot, "state": state, "version": version,
                "nodes": [o.to_json() for o in orders]}

    def _expire(self, now: float) -> None:
        for pid, oids in list(self.placements.items()):
            if all(self.orders[o].state in FINAL and now - self.orders[o].updated > KEEP_S for o in oids):
                for o in oids:
                    del self.orders[o]
                del self.placements[pid]
                if self.store is not None:
                    self.store.orders_drop(oids)
