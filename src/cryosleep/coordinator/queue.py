"""Restores that wait for capacity: a suspended job's snapshot queued at the coordinator is restored on its own as
soon as host daemons with its nodes' GPUs are free.

``cryosleep restore SNAPSHOT --nodes auto --wait`` (and ``coordinator drain``, for the jobs it stop-snapshots)
queues an entry; the coordinator's queue thread goes over the waiting entries in order (``ordered``: higher
priority first, then older first) about once a second and asks the placement (placement.py, ``Placements.place``
with ``["auto"]``) for free compatible hosts: a host that polls, is not drained, runs no node of a live job and has
no order in progress. An entry that fits gets its placement (one order per node, each run by its host's daemon, as
``restore --nodes`` does); one that does not keeps the placement's refusal as the reason it waits (``coordinator
queue`` shows it). Entries are tried in order and each takes what fits: an entry that cannot be placed does not
hold hosts back from the ones after it (so a large job may wait while smaller ones pass it).

A placement that fails (a node's restore refused or failed on its host) puts the entry back to waiting, with the
failure as its reason; after ``MAX_ATTEMPTS`` failed placements the entry fails. Every change of an entry's state
or reason is an event in the catalog (kind ``queue``) and a line in the coordinator's log.

Entries live in memory and are written through to the catalog's engine (coordinator/shared.py, table ``queue``):
a restarted coordinator or a standby that takes over loads them, so the queue and its order survive it; times
are on the wall clock (an entry's age is its age, whoever serves).
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from cryosleep.coordinator.placement import Placements
from cryosleep.coordinator.shared import SharedStore
from cryosleep.errors import Busy, CryosleepError, NotEligible, NotFound

MAX_ATTEMPTS = 3
OPEN = ("waiting", "placing")
FINAL = ("done", "failed", "cancelled")
KEEP_S = 24 * 3600.0  # final entries are forgotten after this long
MAX_WAIT_S = 30.0


@dataclass
class Entry:
    id: str
    snapshot: str
    job: str
    priority: int
    created_at: float  # wall clock
    timeout_s: float  # each node's restore's own bound, as `restore --timeout`
    state: str = "waiting"  # then placing (a placement in progress), and done, failed or cancelled
    reason: str = ""  # why it waits, or how it ended
    placement: str = ""
    attempts: int = 0  # placements that failed
    source: str = ""  # who queued it: "restore", "drain HOST", "run"
    updated_at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def version(self) -> str:
        return f"{self.state}|{self.placement}|{self.attempts}|{gist(self.reason)}"


def gist(reason: str) -> str:
    """A reason without its counts of seconds ("has not polled for 75 s"): what tells a change from time passing."""
    return re.sub(r"\d+(\.\d+)? s\b", "N s", reason)


def ordered(entries: Iterable[Entry]) -> list[Entry]:
    """The order entries are served in: higher priority first, then older first (then by id, for a total
    order)."""
    return sorted(entries, key=lambda e: (-e.priority, e.created_at, e.id))


def after_placement(e: Entry, state: str, nodes: list[dict[str, Any]], max_attempts: int = MAX_ATTEMPTS
                    ) -> tuple[str, str, int]:
    """An entry's (state, reason, attempts) once its placement ended in ``state`` (done or failed) with ``nodes``
    (the placement's orders)."""
    hosts = ", ".join(f"node {n['node_rank']} on {n['host']}" for n in nodes)
    if state == "done":
        return "done", f"restored: {hosts}", e.attempts
    bad = [n for n in nodes if n.get("state") == "failed"]
    why = "; ".join(f"node {n['node_rank']} on {n['host']}: {(n.get('error') or {}).get('what', 'failed')}"
                    + (f" ({(n.get('error') or {}).get('why')})" if (n.get("error") or {}).get("why") else "")
                    for n in bad) or "its placement failed"
    attempts = e.attempts + 1
    if attempts >= max_attempts:
        return "failed", f"{attempts} placements failed, the last: {why}", attempts
    return "waiting", f"placement {attempts} of {max_attempts} failed ({why}); waiting for hosts again", attempts


class RestoreQueue:
    """The entries, served by one thread (``serve``); thread-safe."""

    def __init__(self, placements: Placements, snapshot: Callable[[str], dict[str, Any]],
                 blockers: Callable[[str, float], tuple[str, bool] | None], busy: Callable[[], Mapping[str, str]],
                 event: Callable[[Entry, str], None], store: SharedStore | None = None) -> None:
        """``snapshot(sid)``: its catalog row; ``blockers(job, since)``: why the job must not be restored now (it
        runs) and whether it runs in an incarnation registered after ``since`` (restored by other means: the entry
        then ends), or None; ``busy()``: host -> why it takes no node (it runs one); ``event(entry, message)``:
        logs a decision."""
        self.placements = placements
        self.snapshot = snapshot
        self.blockers = blockers
        self.busy = busy
        self.event = event
        self.store = store
        self.cond = threading.Condition()
        self.entries: dict[str, Entry] = {}
        if store is not None:
            for d in store.queue():
                self.entries[d["id"]] = Entry(**d)
        self._stop = threading.Event()

    def _write(self, e: Entry) -> None:
        e.updated_at = time.time()
        if self.store is not None:
            self.store.queue_put(e.to_json())
        self.cond.notify_all()

    def _set(self, e: Entry, state: str, reason: str, **kw: Any) -> None:
        """Under the lock: the entry's new state and reason, written through and logged when they changed."""
        changed = (state, gist(reason)) != (e.state, gist(e.reason))
        e.state, e.reason = state, reason
        for k, v in kw.items():
            setattr(e, k, v)
        if changed or kw:
            self._write(e)
            self.event(e, f"{state}: {reason}")

    # ---- the clients' side -----------------------------------------------------------------------------------

    def enqueue(self, sid: str, priority: int, timeout_s: float, source: str) -> dict[str, Any]:
        """Snapshot ``sid`` queued (refused unless it is verified); an entry already open for it is returned
        instead (its priority raised to ``priority`` if that is higher), so that two launches queue it once."""
        row = self.snapshot(sid)
        if row.get("state") != "verified":
            raise NotEligible(f"snapshot {sid} cannot be queued for a restore", f"it is {row.get('state')}, not "
                              "verified", "list the valid snapshots with `cryosleep coordinator snapshots JOB --valid`")
        job = str(row["job"])
        with self.cond:
            same = next((e for e in self.entries.values() if e.job == job and e.state in OPEN), None)
            if same is not None and same.snapshot != sid:
                raise Busy(f"job {job!r} is queued for a restore already", f"entry {same.id} restores snapshot "
                           f"{same.snapshot}", f"wait for it (`cryosleep coordinator queue`), or cancel it: "
                           f"`cryosleep coordinator unqueue {same.snapshot}`")
            if same is not None:
                if priority > same.priority:
                    same.priority = priority
                    self._write(same)
                return self._status(same)
            e = Entry("q-" + secrets.token_hex(6), sid, job, priority, time.time(), timeout_s, source=source,
                      reason="queued: waiting for its first placement")
            self.entries[e.id] = e
            self._write(e)
            self.event(e, f"queued by {source} (priority {priority})")
            return self._status(e)

    def cancel(self, sid: str) -> dict[str, Any]:
        with self.cond:
            e = self._newest(sid)
            if e.state == "placing":
                raise Busy(f"the restore of {sid} cannot be cancelled", f"placement {e.placement} is under way",
                           f"wait for it: `cryosleep coordinator placement {e.placement}`")
            if e.state == "waiting":
                self._set(e, "cancelled", "cancelled by a client")
            return self._status(e)

    def _newest(self, sid: str) -> Entry:
        mine = [e for e in self.entries.values() if e.snapshot == sid]
        if not mine:
            raise NotFound(f"snapshot {sid} is not queued", "no restore of it waits at this coordinator",
                           f"queue it: `cryosleep restore {sid} --nodes auto --wait`")
        return max(mine, key=lambda e: (e.state in OPEN, e.created_at))

    def status(self, sid: str, wait_s: float = 0.0, seen: str = "") -> dict[str, Any]:
        """Snapshot ``sid``'s newest entry; with ``wait_s``, once its ``version`` differs from ``seen``."""
        end = time.monotonic() + min(max(wait_s, 0.0), MAX_WAIT_S)
        with self.cond:
            while True:
                e = self._newest(sid)
                left = end - time.monotonic()
                if e.version != seen or e.state in FINAL or left <= 0:
                    return self._status(e)
                self.cond.wait(min(left, 1.0))

    def _status(self, e: Entry) -> dict[str, Any]:
        waiting = [x.id for x in ordered(self.entries.values()) if x.state in OPEN]
        return {**e.to_json(), "version": e.version,
                "position": waiting.index(e.id) + 1 if e.id in waiting else None,
                "age_s": round(time.time() - e.created_at, 1)}

    def list(self) -> list[dict[str, Any]]:
        """Every entry, open ones first in the order they are served, then the ended ones, newest first."""
        with self.cond:
            live = ordered(e for e in self.entries.values() if e.state in OPEN)
            ended = sorted((e for e in self.entries.values() if e.state in FINAL), key=lambda e: -e.updated_at)
            return [self._status(e) for e in live + ended]

    # ---- the queue's thread ----------------------------------------------------------------------------------

    def step(self) -> None:
        """One pass over the open entries, in order: a placement's end taken, waiting ones placed if they fit. The
        pass holds the placements' lock, so that the hosts do not change under it (a host that polls for the first
        time, an order reported done): a host that frees up mid-pass would go to a later entry that the earlier
        ones never saw it for."""
        with self.placements.cond:  # (an RLock: place and status take it again)
            with self.cond:
                entries = ordered(e for e in self.entries.values() if e.state in OPEN)
                self._expire()
            busy = self.busy() if any(e.state == "waiting" for e in entries) else {}
            for e in entries:
                try:
                    self._serve(e, busy)
                except CryosleepError as x:  # the catalog unreachable, a snapshot gone: said, tried again
                    with self.cond:
                        if e.state == "waiting":
                            self._set(e, "waiting", f"{x.what} ({x.why})")

    def _serve(self, e: Entry, busy: Mapping[str, str]) -> None:
        if e.state == "placing":
            try:
                st = self.placements.status(e.placement)
            except NotFound:
                with self.cond:
                    self._set(e, "waiting", f"placement {e.placement} was forgotten; waiting for hosts again",
                              placement="")
                return
            if st["state"] in ("done", "failed"):
                state, reason, attempts = after_placement(e, str(st["state"]), list(st["nodes"]))
                with self.cond:
                    self._set(e, state, reason, attempts=attempts)
            return
        row = self.snapshot(e.snapshot)
        if row.get("state") != "verified":
            with self.cond:
                self._set(e, "failed", f"snapshot {e.snapshot} is {row.get('state')}, not verified")
            return
        blocked = self.blockers(e.job, e.created_at)
        if blocked is not None:
            why, again = blocked
            with self.cond:
                if again:
                    self._set(e, "cancelled", f"{why}: it was restored since it was queued")
                else:
                    self._set(e, "waiting", why)
            return
        try:
            st = self.placements.place(row, ["auto"], e.timeout_s, busy=busy)
        except NotEligible as x:
            with self.cond:
                self._set(e, "waiting", x.why)
            return
        except Busy as x:  # placed by hand meanwhile (`restore --nodes`): its end is this entry's too
            with self.cond:
                self._set(e, "waiting", f"{x.why}; waiting for it")
            return
        hosts = ", ".join(f"node {n['node_rank']} on {n['host']}" for n in st["nodes"])
        with self.cond:
            self._set(e, "placing", f"placement {st['id']}: {hosts}", placement=str(st["id"]))

    def _expire(self) -> None:
        now = time.time()
        old = [e.id for e in self.entries.values() if e.state in FINAL and now - e.updated_at > KEEP_S]
        for i in old:
            del self.entries[i]
        if old and self.store is not None:
            self.store.queue_drop(old)

    def serve(self, every_s: float = 1.0, log: Callable[[str], None] = lambda _m: None) -> None:
        """The queue's thread: ``step`` every ``every_s`` until ``close``."""
        while not self._stop.wait(every_s):
            try:
                self.step()
            except Exception as x:  # never let the thread die: the next pass tries again
                log(f"restore queue: {type(x).__name__}: {x}")

    def close(self) -> None:
        self._stop.set()
