"""What an active coordinator shares with its standby, in the catalog's engine (schemas 3 and 4): the lease that
says which coordinator serves, the restores' boards (rendezvous.py), the hosts and the placements' orders
(placement.py), the drained hosts and the restores queued for capacity (queue.py).

The serving coordinator keeps these in memory, where its long polls wait on them, and writes every change
through to the engine; a coordinator that takes over (or restarts) loads them back before it serves. Times are
stored on the wall clock and turned back into the process's monotonic clock on load.

The lease: one row, ``coordinator``, naming its holder and when it runs out on the engine's clock. A coordinator
serves only while it holds it: it takes it when free or run out, renews it every third of its time to live, and
stops serving (``on_lost``) once its own, earlier, idea of the expiry passes without a renewal (the engine
unreachable, the process paused): by then a standby may have taken it. A holder is named by its host, process id
and that process's start time: a coordinator restarted on the same host (or a standby there) sees that the holder's
process is gone and takes the lease at once, without waiting for it to run out.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from cryosleep.coordinator.catalog import Catalog
from cryosleep.core import proctree

LEASE = "coordinator"


def _j(x: Any) -> str:
    return json.dumps(x, sort_keys=True)


def _mono(wall: float, now_wall: float, now_mono: float) -> float:
    return now_mono - max(0.0, now_wall - wall)


class SharedStore:
    """The boards, hosts and orders in the catalog's engine (each call one short transaction)."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog

    # ---- boards ------------------------------------------------------------------------------------------------

    def board_put(self, board: str, items: dict[str, Any]) -> None:
        now = time.time()
        with self.catalog.tx() as c:
            c.executemany("INSERT INTO board (board, key, value, ts) VALUES (?, ?, ?, ?) ON CONFLICT (board, key) "
                          "DO UPDATE SET value = excluded.value, ts = excluded.ts",
                          [(board, str(k), _j(v), now) for k, v in items.items()])

    def board_drop(self, board: str, keys: list[str]) -> None:
        with self.catalog.tx() as c:
            c.executemany("DELETE FROM board WHERE board = ? AND key = ?", [(board, k) for k in keys])

    def boards(self) -> dict[str, dict[str, tuple[Any, float]]]:
        """board -> key -> (value, monotonic time posted)."""
        with self.catalog.lock:
            rows = self.catalog.db.execute("SELECT * FROM board").fetchall()
        now_wall, now_mono = time.time(), time.monotonic()
        out: dict[str, dict[str, tuple[Any, float]]] = {}
        for r in rows:
            out.setdefault(str(r["board"]), {})[str(r["key"])] = (json.loads(r["value"]),
                                                                  _mono(float(r["ts"]), now_wall, now_mono))
        return out

    # ---- hosts and orders --------------------------------------------------------------------------------------

    def host_put(self, name: str, facts: dict[str, Any]) -> None:
        with self.catalog.tx() as c:
            c.execute("INSERT INTO hosts (name, facts, seen_at) VALUES (?, ?, ?) ON CONFLICT (name) "
                      "DO UPDATE SET facts = excluded.facts, seen_at = excluded.seen_at",
                      (name, _j(facts), time.time()))

    def hosts(self) -> list[tuple[str, dict[str, Any], float]]:
        """(name, facts, monotonic time last seen)."""
        with self.catalog.lock:
            rows = self.catalog.db.execute("SELECT * FROM hosts ORDER BY name").fetchall()
        now_wall, now_mono = time.time(), time.monotonic()
        return [(str(r["name"]), json.loads(r["facts"]), _mono(float(r["seen_at"]), now_wall, now_mono))
                for r in rows]

    def order_put(self, o: dict[str, Any]) -> None:
        """One order (placement.Order's JSON form)."""
        with self.catalog.tx() as c:
            c.execute("INSERT INTO orders (id, placement, host, snapshot, node_rank, peers, timeout_s, state, result, "
                      "error, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                      "state = excluded.state, result = excluded.result, error = excluded.error, "
                      "updated_at = excluded.updated_at",
                      (o["id"], o["placement"], o["host"], o["snapshot"], o["node_rank"], _j(o["peers"]),
                       o["timeout_s"], o["state"], None if o.get("result") is None else _j(o["result"]),
                       None if o.get("error") is None else _j(o["error"]), time.time()))

    def orders_drop(self, ids: list[str]) -> None:
        with self.catalog.tx() as c:
            c.executemany("DELETE FROM orders WHERE id = ?", [(i,) for i in ids])

    def orders(self) -> list[dict[str, Any]]:
        """Every order (its JSON form, and ``updated``: the monotonic time of its last change), by placement and
        node rank."""
        with self.catalog.lock:
            rows = self.catalog.db.execute("SELECT * FROM orders ORDER BY placement, node_rank").fetchall()
        now_wall, now_mono = time.time(), time.monotonic()
        return [{"id": str(r["id"]), "placement": str(r["placement"]), "host": str(r["host"]),
                 "snapshot": str(r["snapshot"]), "node_rank": int(r["node_rank"]), "peers": json.loads(r["peers"]),
                 "timeout_s": float(r["timeout_s"]), "state": str(r["state"]),
                 "result": json.loads(r["result"]) if r["result"] else None,
                 "error": json.loads(r["error"]) if r["error"] else None,
                 "updated": _mono(float(r["updated_at"]), now_wall, now_mono)} for r in rows]


    # ---- drained hosts and the restore queue ----------------------------------------------------------------

    def drain_put(self, host: str, reason: str) -> None:
        with self.catalog.tx() as c:
            c.execute("INSERT INTO drains (host, reason, since) VALUES (?, ?, ?) ON CONFLICT (host) "
                      "DO UPDATE SET reason = excluded.reason", (host, reason, time.time()))

    def drain_drop(self, host: str) -> None:
        with self.catalog.tx() as c:
            c.execute("DELETE FROM drains WHERE host = ?", (host,))

    def drained(self) -> dict[str, str]:
        with self.catalog.lock:
            rows = self.catalog.db.execute("SELECT host, reason FROM drains").fetchall()
        return {str(r["host"]): str(r["reason"]) for r in rows}

    def queue_put(self, e: dict[str, Any]) -> None:
        """One queue entry (queue.Entry's JSON form: times on the wall clock, kept as they are)."""
        with self.catalog.tx() as c:
            c.execute("INSERT INTO queue (id, snapshot, job, priority, created_at, timeout_s, state, reason, "
                      "placement, attempts, source, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                      "ON CONFLICT (id) DO UPDATE SET priority = excluded.priority, state = excluded.state, "
                      "reason = excluded.reason, placement = excluded.placement, attempts = excluded.attempts, "
                      "updated_at = excluded.updated_at",
                      (e["id"], e["snapshot"], e["job"], e["priority"], e["created_at"], e["timeout_s"], e["state"],
                       e["reason"], e["placement"], e["attempts"], e["source"], e["updated_at"]))

    def queue_drop(self, ids: list[str]) -> None:
        with self.catalog.tx() as c:
            c.executemany("DELETE FROM queue WHERE id = ?", [(i,) for i in ids])

    def queue(self) -> list[dict[str, Any]]:
        with self.catalog.lock:
            rows = self.catalog.db.execute("SELECT * FROM queue ORDER BY created_at, id").fetchall()
        return [{"id": str(r["id"]), "snapshot": str(r["snapshot"]), "job": str(r["job"]),
                 "priority": int(r["priority"]), "created_at": float(r["created_at"]),
                 "timeout_s": float(r["timeout_s"]), "state": str(r["state"]), "reason": str(r["reason"]),
                 "placement": str(r["placement"]), "attempts": int(r["attempts"]), "source": str(r["source"]),
                 "updated_at": float(r["updated_at"])} for r in rows]


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{proctree.start_time(os.getpid())}:{secrets.token_hex(4)}"


def gone(holder: str) -> bool:
    """The holder is a process of this host that no longer runs."""
    parts = holder.split(":")
    if len(parts) != 4 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    return proctree.start_time(int(parts[1])) != parts[2]


class Lease:
    """The right to serve, held in the catalog's engine (see the module's docstring)."""

    def __init__(self, catalog: Catalog, ttl_s: float, address: str = "", holder: str | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.catalog = catalog
        self.ttl_s = ttl_s
        self.address = address
        self.holder = holder or holder_id()
        self.log = log or (lambda _m: None)
        self.valid_until = 0.0  # monotonic: this process's own (early) idea of when the lease runs out
        self._stop = threading.Event()

    def try_take(self) -> bool:
        """Takes or renews the lease; True if this process holds it now."""
        sent = time.monotonic()  # the engine's expiry is set after this: ours is earlier, on the safe side
        now = self.catalog.db.now
        with self.catalog.tx() as c:
            c.execute("INSERT INTO leases (name, holder, address, expires_at) VALUES (?, '', '', 0) "
                      "ON CONFLICT (name) DO NOTHING", (LEASE,))
            row = c.execute("SELECT holder FROM leases WHERE name = ?", (LEASE,)).fetchone()
            dead = str(row["holder"]) if row is not None and gone(str(row["holder"])) else self.holder
            n = c.execute(f"UPDATE leases SET holder = ?, address = ?, expires_at = {now} + ? "
                          f"WHERE name = ? AND (holder = ? OR holder = ? OR expires_at < {now})",
                          (self.holder, self.address, self.ttl_s, LEASE, self.holder, dead)).rowcount
        if n == 1:
            self.valid_until = sent + self.ttl_s
        return n == 1

    def current(self) -> dict[str, Any] | None:
        """The lease's row: holder, address, and ``left_s`` (seconds to its expiry on the engine's clock)."""
        with self.catalog.lock:
            r = self.catalog.db.execute(f"SELECT holder, address, expires_at - {self.catalog.db.now} AS left_s "
                                        "FROM leases WHERE name = ?", (LEASE,)).fetchone()
        return None if r is None else {"holder": r["holder"], "address": r["address"], "left_s": float(r["left_s"])}

    def acquire(self, on_wait: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Waits (a standby) until this process holds the lease."""
        told = False
        while not self._stop.is_set():
            if self.try_take():
                return
            if not told and on_wait is not None:
                cur = self.current()
                if cur is not None:
                    on_wait(cur)
                told = True
            self._stop.wait(min(1.0, self.ttl_s / 3))
        raise InterruptedError("stopped while waiting for the lease")

    def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renews the lease every third of its time to live; ``on_lost`` once it ran out here without a renewal
        (checked apart from the renewal, which may hang on an unreachable engine)."""

        def renew() -> None:
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    if not self.try_take():
                        self.valid_until = 0.0
                        return
                except Exception as e:  # the engine unreachable: retried until the lease runs out here
                    self.log(f"the lease could not be renewed: {type(e).__name__}: {e}")

        def watch() -> None:
            while not self._stop.wait(min(0.2, self.ttl_s / 10)):
                if time.monotonic() >= self.valid_until:
                    if not self._stop.is_set():
                        on_lost(f"the lease {LEASE!r} ran out without a renewal (its time to live {self.ttl_s:g} s)")
                    return

        for fn in (renew, watch):
            threading.Thread(target=fn, name=f"lease-{fn.__name__}", daemon=True).start()

    def release(self) -> None:
        """A graceful stop: the lease ends now, so that a standby takes over at once."""
        self._stop.set()
        try:
            with self.catalog.tx() as c:
                c.execute("UPDATE leases SET expires_at = 0 WHERE name = ? AND holder = ?", (LEASE, self.holder))
        except Exception as e:  # the engine unreachable: the lease runs out by itself
            self.log(f"the lease could not be released: {type(e).__name__}: {e}")
