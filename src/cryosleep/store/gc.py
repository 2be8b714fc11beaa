"""Garbage collection of chunks no snapshot needs, safe against uploads running at the same time.

The danger: an upload finds chunk X already in the store and skips it (that is what makes uploads
resumable and deduplicated), while a GC that saw no snapshot naming X deletes it; the upload then commits
a snapshot that names a chunk that is gone. Object stores have no locks and no conditional delete, so the
rule is built from two kinds of marker objects, written and read in a fixed order (S3 and a local
directory both give read-after-write consistency, which is all it needs):

- an upload writes ``pending/<id>.<tok>.json`` *before* it checks for any chunk, keeps it fresh with a
  heartbeat (every ``ttl/5``) and deletes it after its snapshot's manifest is written;
- a GC writes ``gc/<tok>.json`` *before* it lists the markers (and keeps it fresh the same way).

The rule: **a GC deletes nothing while any upload marker is live** (written or refreshed within its TTL,
judged by the backend's own clock: the object times, compared with the time of the GC's lock). It
reports "deferred" and may be run again. **An upload that saw a live GC lock when it started** (or whose
own heartbeat lapsed for longer than its TTL, so a GC may have judged it dead) **waits, before it commits,
until no GC lock is live, then checks that every chunk it names is in the store and sends again any that
is not** (from its source files, which it still has).

Why that is enough: take any GC G and upload U that overlap. G writes its lock, then lists the markers;
U writes its marker, then lists the locks. Whichever wrote second sees the other's object. If G sees U's
marker, G deletes nothing. If not, U's marker came after G's listing, so U's listing of the locks (after
its marker) sees G's lock, and U re-checks every chunk after G has finished: what G deleted is sent again
before the manifest is written. A GC that starts after that re-check sees U's (fresh) marker. So a chunk
named by a committed manifest, or by an upload about to commit one, is never lost. The grace period
(a chunk is deleted only if it is older than ``grace`` at the GC's start) is a second, independent
margin, for writers that do not follow this protocol; the TTLs only decide when a crashed upload's or
GC's marker stops counting (a crashed upload never commits, so its chunks are garbage; a crashed GC's
lock only makes uploads re-check until it expires).

``retention`` decides which snapshots to remove (pure functions); this module removes unreferenced chunks.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

from cryosleep.errors import CryosleepError
from cryosleep.store.backend import Backend, ObjectInfo

__all__ = ["GcReport", "UploadMarker", "collect", "live_gc_locks", "wait_for_gc"]

CHUNKS = "chunks/"  # where the chunk store (cas.py) keeps its chunks, the objects a collection may delete
PENDING = "pending/"
GC_LOCKS = "gc/"
MARKER_TTL_S = 600.0  # an upload marker not refreshed for this long belongs to a dead upload
GC_TTL_S = 600.0  # likewise for a GC's lock
GRACE_S = 3600.0  # chunks younger than this are never deleted
WAIT_POLL_S = 0.5


class _Addressed(Protocol):
    def addresses(self) -> set[str]:
        """The chunk addresses a snapshot names."""


class ChunkCatalog(Protocol):
    """What a collection reads of the chunk store (``cas.ChunkStore``): its backend and its snapshots."""

    @property
    def backend(self) -> Backend: ...

    def snapshots(self) -> Sequence[_Addressed]: ...


class _Heartbeat:
    """An object kept fresh by a thread: written now, rewritten every ``ttl/5`` until closed."""

    def __init__(self, backend: Backend, name: str, ttl: float, body: dict[str, Any]) -> None:
        self.backend = backend
        self.name = name
        self.ttl = ttl
        self.body = body
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._last_ok = 0.0  # monotonic time of the last successful write
        self._lapsed = False
        self.info: ObjectInfo = self._write()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {name}", daemon=True)
        self._thread.start()

    def _write(self) -> ObjectInfo:
        with self._lock:
            now = time.monotonic()
            if self._last_ok and now - self._last_ok > self.ttl:
                self._lapsed = True
            info = self.backend.put(self.name, json.dumps({**self.body, "at": time.time()}).encode())
            self._last_ok = time.monotonic()
            self.info = info
            return info

    def _run(self) -> None:
        while not self._stop.wait(self.ttl / 5):
            try:
                self._write()
            except CryosleepError:
                continue  # the next beat retries; lapsed() tells the owner if it was too long

    def refresh(self) -> ObjectInfo:
        return self._write()

    def lapsed(self) -> bool:
        """Whether the object may have looked dead to someone (not refreshed within its TTL)."""
        with self._lock:
            return self._lapsed or time.monotonic() - self._last_ok > self.ttl

    def server_now(self) -> float:
        """The backend's clock now: our last write's time plus the local time elapsed since."""
        with self._lock:
            return self.info.mtime + (time.monotonic() - self._last_ok)

    def close(self, delete: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if delete:
            try:
                self.backend.delete(self.name)
            except CryosleepError:
                pass  # it expires by itself


class UploadMarker(_Heartbeat):
    def __init__(self, backend: Backend, snapshot: str, ttl: float = MARKER_TTL_S) -> None:
        super().__init__(backend, f"{PENDING}{snapshot}.{secrets.token_hex(4)}.json", ttl,
                         {"snapshot": snapshot, "ttl": ttl})

    def __enter__(self) -> UploadMarker:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        # On failure the marker is removed too: a failed upload commits nothing, so nothing needs its chunks.
        self.close()


def _live(info: ObjectInfo, now: float, ttl: float) -> bool:
    return info.mtime >= now - ttl


def _fresh(backend: Backend, prefix: str) -> list[ObjectInfo]:
    """The objects under ``prefix`` with their size and time read by HEAD, not from the listing: some
    S3-compatible stores serve listings that lag behind (or, for the test server, misreport sizes and
    times), and every decision here rests on those times."""
    names = sorted({o.name for o in backend.list(prefix)})
    return [info for n in names if (info := backend.stat(n)) is not None]


def live_gc_locks(backend: Backend, now: float, ttl: float = GC_TTL_S) -> list[str]:
    return [o.name for o in _fresh(backend, GC_LOCKS) if _live(o, now, ttl)]


def wait_for_gc(backend: Backend, now: Callable[[], float], ttl: float = GC_TTL_S,
                timeout: float | None = None) -> None:
    """Return once no GC lock is live (a running GC finished, or a crashed one's lock expired)."""
    end = None if timeout is None else time.monotonic() + timeout
    while live_gc_locks(backend, now(), ttl):
        if end is not None and time.monotonic() > end:
            raise CryosleepError("a garbage collection is still running", f"waited {timeout:.0f} s",
                                 "try again later")
        time.sleep(WAIT_POLL_S)


@dataclass
class GcReport:
    dry_run: bool
    deferred: bool = False  # uploads were in progress: nothing was deleted
    uploads_in_progress: list[str] = field(default_factory=list)
    snapshots: int = 0
    chunks: int = 0
    referenced: int = 0
    unreferenced: int = 0
    too_young: int = 0  # unreferenced but within the grace period
    deleted: int = 0  # (would be, with dry_run)
    bytes_freed: int = 0
    stale_markers: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def collect(store: ChunkCatalog, *, dry_run: bool = False, grace: float = GRACE_S, marker_ttl: float = MARKER_TTL_S,
            gc_ttl: float = GC_TTL_S) -> GcReport:
    """Delete every chunk that no snapshot names and that is older than ``grace`` (see the module's rule)."""
    t0 = time.monotonic()
    backend = store.backend
    report = GcReport(dry_run=dry_run)
    lock = _Heartbeat(backend, f"{GC_LOCKS}{secrets.token_hex(6)}.json", gc_ttl, {"gc": True})
    try:
        start = lock.info.mtime  # the backend's clock at our lock
        markers = _fresh(backend, PENDING)
        live = [m.name for m in markers if _live(m, start, marker_ttl)]
        report.stale_markers = [m.name for m in markers if not _live(m, start, marker_ttl)]
        if live:
            report.deferred = True
            report.uploads_in_progress = live
            return report
        snaps = store.snapshots()  # raises (and so deletes nothing) if any manifest cannot be read
        report.snapshots = len(snaps)
        needed: set[str] = set()
        for s in snaps:
            needed |= s.addresses()
        report.referenced = len(needed)
        doomed: list[ObjectInfo] = []
        for name in sorted({o.name for o in backend.list(CHUNKS)}):
            report.chunks += 1
            if name.rsplit("/", 1)[-1] in needed:
                continue
            o = backend.stat(name)  # its time by HEAD, just before deciding (see _fresh)
            if o is None:
                continue
            report.unreferenced += 1
            if o.mtime >= start - grace:
                report.too_young += 1
                continue
            doomed.append(o)
        report.deleted = len(doomed)
        report.bytes_freed = sum(o.size for o in doomed)
        if not dry_run:
            for o in doomed:
                backend.delete(o.name)
            for name in report.stale_markers:
                backend.delete(name)
        return report
    finally:
        lock.close()
        report.seconds = time.monotonic() - t0
