"""Where the nodes restoring one snapshot meet: a small board of keys per snapshot, in the coordinator's memory.

A multi-node restore (``cryosleep restore SNAPSHOT --node-rank I`` on each host, agent/coordinated.py's
``RestoreRendezvous``) uses it twice:

* the **barrier** before anything starts: each node posts ``ready/<I>`` (coming, its own checks passed, or
  failed with the problems) and waits until every node has; one failure and every node stops before CRIU runs;
* the **id relay** after CRIU: the communicators' fresh unique ids, posted by the node of each one's rank-0
  member (``attempt/<attempt>/uid/<gen>/<ident>``) and read by the nodes of the other members; a node that fails
  there posts ``attempt/<attempt>/failed/<I>`` and the others stop waiting.

One request both posts and reads (``POST /v1/snapshots/{sid}/restore`` with ``put`` and ``get``); a read may wait
(long poll) until at least ``min`` keys with the prefix exist. The board is lost with the coordinator: a restore
in progress survives a coordinator's restart or a standby's takeover: every post is written through to the
catalog's engine (coordinator/shared.py) and loaded back by the next coordinator. Entries older than ``KEEP_S``
are dropped.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from cryosleep.coordinator.shared import SharedStore
from cryosleep.errors import UsageError

KEEP_S = 3600.0
MAX_WAIT_S = 30.0
MAX_KEYS = 4096  # per snapshot: a node's ready entry and one id per communicator


class Board:
    def __init__(self, store: SharedStore | None = None) -> None:
        self.cond = threading.Condition()
        self.store = store
        self.entries: dict[str, dict[str, tuple[Any, float]]] = store.boards() if store is not None else {}

    def _expire(self, now: float) -> None:
        for sid in list(self.entries):
            keys = self.entries[sid]
            old = [k for k, (_, t) in keys.items() if now - t > KEEP_S]
            for k in old:
                del keys[k]
            if old and self.store is not None:
                self.store.board_drop(sid, old)
            if not keys:
                del self.entries[sid]

    def exchange(self, sid: str, put: dict[str, Any] | None = None, prefix: str | None = None, min_keys: int = 0,
                 wait_s: float = 0.0) -> dict[str, Any]:
        """Posts ``put`` (key -> JSON value), then returns the keys under ``prefix`` (value and age), waiting up to
        ``wait_s`` for at least ``min_keys`` of them."""
        end = time.monotonic() + min(max(wait_s, 0.0), MAX_WAIT_S)
        with self.cond:
            now = time.monotonic()
            self._expire(now)
            if put:
                keys = self.entries.setdefault(sid, {})
                if len(keys) + len(put) > MAX_KEYS:
                    raise UsageError(f"too many keys for the restore of {sid}", f"at most {MAX_KEYS}", "")
                if self.store is not None:  # first: what was answered as posted is there for a successor
                    self.store.board_put(sid, put)
                for k, v in put.items():
                    keys[str(k)] = (v, now)
                self.cond.notify_all()
            if prefix is None:
                return {"items": {}}
            while True:
                now = time.monotonic()
                items = {k: {"value": v, "age_s": round(now - t, 3)}
                         for k, (v, t) in self.entries.get(sid, {}).items() if k.startswith(prefix)}
                left = end - now
                if len(items) >= min_keys or left <= 0:
                    return {"items": items}
                self.cond.wait(left)
