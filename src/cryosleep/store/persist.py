"""Persisting snapshots off the machine: the local directory store stages, the chunk store keeps.

A job started with ``cryosleep run --store URL`` (a directory or ``s3://bucket/prefix``) persists every
snapshot into the chunk store at URL (:mod:`cryosleep.store.cas`) after CRIU wrote it into the local
directory store:

- **keep-running**: the agent queues the upload once the snapshot is committed locally and the workers are
  running again; one thread per agent works through the queue (one upload at a time per job), sending only
  the chunks the store lacks, then re-reads every chunk from the store (deep verify). A failure the backend
  marks retryable (a dead server, a network error) is retried with backoff for ``retry_for`` seconds; the
  retry sends only what is missing.
- **stop**: the snapshot's ``persist`` phase (:mod:`cryosleep.capture.snapshot`) runs the upload and the deep
  verify in the snapshot's own thread, inside its deadline, while the job is held frozen; an upload of an
  older snapshot in progress is interrupted first (it resumes afterwards, without resending what it sent).
  Any failure fails the snapshot, and its rollback resumes the job.
- **bounded staging**: after a snapshot is persisted, local copies of the job's persisted snapshots beyond
  the ``local_keep`` newest are removed; a snapshot not yet persisted is never removed.

What happened to each snapshot is recorded in ``<local store>/persist/<id>.json`` (a :class:`Record`: state,
bytes, rates, dedup savings and timestamped events), which ``cryosleep ls`` and ``show`` read. States::

    queued -> uploading -> verifying -> persisted
                  |            |
                  +-> retrying +-> failed (reason)

(``interrupted`` is shown for a queued or running upload whose agent is gone.)

:func:`fetch` goes the other way: a snapshot from the chunk store into the local directory store, checked
chunk by chunk, so that the normal restore runs from it on a machine that never had it.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryosleep.errors import BackendError, CaptureFailed, CryosleepError, NotFound, UsageError
from cryosleep.store.local import LocalStore, Staging
from cryosleep.store.manifest import Manifest
from cryosleep.store.retention import Policy, SnapshotInfo, decide
from cryosleep.store.urls import is_remote, normalize_url, open_backend

if TYPE_CHECKING:
    from cryosleep.store.auth import Trust
    from cryosleep.store.cas import ChunkStore, Snapshot
    from cryosleep.store.crypto import JobKey

__all__ = [
    "Persister",
    "Record",
    "RemoteConfig",
    "authentic",
    "fetch",
    "is_remote",
    "load_records",
    "normalize_url",
    "open_chunk_store",
    "read_record",
    "resign_remote",
]

RECORDS = "persist"
LOCAL_KEEP = 2
RETRY_FOR_S = 600.0  # a background upload retries retryable failures this long
UPDATE_EVERY_S = 0.25  # the record's progress is rewritten at most this often
ACTIVE = ("queued", "uploading", "verifying", "retrying")

EventSink = Callable[[dict[str, Any]], None]  # where the transfer events go (progress=, the CLI's bars)


@dataclass
class RemoteConfig:
    """Where a job's snapshots persist (``cryosleep run --store URL --key-file F --local-keep N``)."""

    url: str
    key_file: str | None = None
    local_keep: int = LOCAL_KEEP
    # retention of the job's snapshots in the store, applied after each upload (store/retention.py's Policy:
    # keep_last, keep_every, max_age); None: keep them all (``cryosleep gc`` can still thin them)
    retain: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> RemoteConfig | None:
        if not d or not d.get("url"):
            return None
        return cls(url=str(d["url"]), key_file=d.get("key_file") or None,
                   local_keep=int(d.get("local_keep", LOCAL_KEEP)), retain=d.get("retain") or None)

    def policy(self) -> Policy | None:
        """The retention policy, or None when everything is kept."""
        if not self.retain:
            return None
        pol = Policy(**{k: self.retain.get(k) for k in ("keep_last", "keep_every", "max_age")})
        return None if pol.empty else pol


def open_chunk_store(url: str | Path) -> ChunkStore:
    # Imported here: the chunk store needs numpy, zstandard and cryptography; the capture path does not.
    from cryosleep.store.cas import ChunkStore

    return ChunkStore(open_backend(url))


def check_config(job: str, cfg: RemoteConfig) -> JobKey | None:
    """Fail early, before a job starts, on a store or key that cannot work; returns the job's key."""
    from cryosleep.store.crypto import load_key

    if cfg.local_keep < 0:
        raise UsageError(f"--local-keep {cfg.local_keep} is negative", "", "give 0 or more")
    try:
        cfg.policy()
    except (TypeError, ValueError) as e:
        raise UsageError("bad retention policy for the store", str(e),
                         "--keep-last and --max-age take 0 or more, --keep-every 1 or more") from None
    key = load_key(job, Path(cfg.key_file) if cfg.key_file else None)
    store = open_chunk_store(cfg.url)
    try:
        store.snapshot_ids()
    except BackendError as e:
        raise BackendError(f"the store {cfg.url} cannot be read", f"{e.what}: {e.why}", e.hint) from e
    return key


# ------------------------------------------------------------------------------------------- the record


@dataclass
class Record:
    """What happened to one snapshot on its way to the chunk store (``<local store>/persist/<id>.json``)."""

    snapshot: str
    job: str
    remote: str
    mode: str
    state: str = "queued"
    reason: str = ""
    attempts: int = 0
    bytes_total: int = 0  # the image
    bytes_done: int = 0  # of the current step (upload, verify or download)
    bytes_sent: int = 0  # compressed (and encrypted) bytes sent
    bytes_skipped: int = 0  # image bytes whose chunks the store had, or this upload sent already
    chunks: int = 0
    uploaded: int = 0
    present: int = 0
    stored_bytes: int = 0  # what the snapshot's distinct chunks take in the store
    upload_s: float = 0.0
    verify_s: float = 0.0
    encrypted: bool = False
    local: str = "present"  # present | removed (bounded staging) | fetched (restored from the store)
    agent_pid: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)  # {"t": unix time, "event": ..., ...}

    @property
    def upload_rate(self) -> float:
        """Image bytes per second through the upload (hash, compress, encrypt, send)."""
        return self.bytes_total / self.upload_s if self.upload_s > 0 else 0.0

    @property
    def dedup(self) -> float:
        """The share of the image the store did not need sent."""
        return self.bytes_skipped / self.bytes_total if self.bytes_total else 0.0

    def event(self, name: str, **extra: Any) -> None:
        self.events.append({"t": round(time.time(), 4), "event": name, **extra})

    def shown_state(self) -> str:
        if self.state in ACTIVE and self.agent_pid and not _alive(self.agent_pid):
            return "interrupted"
        return self.state

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["state"] = self.shown_state()
        out["upload_rate"] = round(self.upload_rate, 1)
        out["dedup"] = round(self.dedup, 4)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Record:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _records_dir(store: LocalStore) -> Path:
    return store.root / RECORDS


def write_record(store: LocalStore, rec: Record) -> None:
    d = _records_dir(store)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{rec.snapshot}.{threading.get_ident()}.tmp"
    tmp.write_text(json.dumps(rec.to_json() | {"state": rec.state}, indent=1))
    os.replace(tmp, d / f"{rec.snapshot}.json")


def read_record(store: LocalStore, sid: str) -> Record | None:
    try:
        return Record.from_json(json.loads((_records_dir(store) / f"{sid}.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def load_records(store: LocalStore) -> dict[str, Record]:
    out: dict[str, Record] = {}
    d = _records_dir(store)
    if d.is_dir():
        for p in d.glob("*.json"):
            rec = read_record(store, p.stem)
            if rec is not None:
                out[rec.snapshot] = rec
    return out


def remove_record(store: LocalStore, sid: str) -> None:
    (_records_dir(store) / f"{sid}.json").unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ uploading


class _Interrupted(Exception):
    """Raised from an upload's progress callback to stop it (a stop snapshot needs the store, a deadline)."""


@dataclass
class _Item:
    store: LocalStore
    manifest: Manifest
    record: Record


class Persister:
    """Uploads one job's snapshots into its chunk store, one at a time, and keeps the records.

    ``log``: the agent's log. ``retry_for``: how long a background upload retries retryable failures.
    ``on_done``: called with each record that reaches ``persisted`` or ``failed`` (metrics: upload rate,
    dedup, the age of the last verified snapshot); it must not raise.
    """

    def __init__(self, job: str, cfg: RemoteConfig, *, log: Callable[[str], None] | None = None,
                 retry_for: float = RETRY_FOR_S) -> None:
        from cryosleep.store.crypto import load_key

        self.job = job
        self.cfg = cfg
        self.url = normalize_url(cfg.url)
        self.key = load_key(job, Path(cfg.key_file) if cfg.key_file else None)
        self.cas = open_chunk_store(self.url)
        self.retry_for = retry_for
        self._log = log or (lambda _m: None)
        self._queue: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._busy = threading.Lock()  # held by the one upload running
        self._interrupt = threading.Event()
        self._closing = False
        self._active: _Item | None = None
        self._thread: threading.Thread | None = None
        self.on_done: Callable[[Record], None] | None = None
        self._retaining = threading.Lock()  # one retention pass at a time

    # -- the queue (keep-running snapshots) ------------------------------------------------------

    def enqueue(self, store: LocalStore, manifest: Manifest) -> Record:
        """Queue a committed snapshot's upload; returns at once."""
        rec = self._record(manifest)
        rec.event("queued")
        write_record(store, rec)
        with self._cond:
            self._queue.append(_Item(store, manifest, rec))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name=f"persist {self.job}", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return rec

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + (self._active is not None)

    def close(self, timeout: float | None = None) -> bool:
        """Wait for the queued uploads to end (persisted or failed); True when none is left."""
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            while self._queue or self._active is not None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
        return True

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closing:
                        return
                    self._cond.wait(1.0)
                item = self._queue.popleft()
                self._active = item
            try:
                self._background(item)
            finally:
                with self._cond:
                    self._active = None
                    self._cond.notify_all()

    def _background(self, item: _Item) -> None:
        rec = item.record
        started = time.monotonic()
        delay = 1.0
        while True:
            while self._interrupt.is_set():  # a stop snapshot is using the store
                time.sleep(0.05)
            with self._busy:
                try:
                    self._persist(item, None, None)
                    self.prune(item.store)
                    return
                except _Interrupted:
                    # A stop snapshot needs the store now: start again once it is done (what this attempt
                    # sent stays stored and is not sent again).
                    rec.state, rec.reason = "queued", "interrupted by a stop snapshot; resumes after it"
                    rec.event("interrupted")
                    write_record(item.store, rec)
                    delay = 0.0
                except CryosleepError as e:
                    retry = (isinstance(e, BackendError) and e.retryable
                             and time.monotonic() - started + delay < self.retry_for)
                    rec.reason = f"{e.what}: {e.why}" if e.why else e.what
                    rec.state = "retrying" if retry else "failed"
                    rec.event(rec.state, reason=rec.reason)
                    write_record(item.store, rec)
                    self._log(f"snapshot {rec.snapshot}: upload to {self.url} {rec.state}: {rec.reason}")
                    if not retry:
                        self._done(rec)
                        return
                except Exception as e:  # a bug must not kill the queue; it is recorded
                    rec.state, rec.reason = "failed", f"{type(e).__name__}: {e}"
                    rec.event("failed", reason=rec.reason)
                    write_record(item.store, rec)
                    self._log(f"snapshot {rec.snapshot}: upload failed: {rec.reason}")
                    self._done(rec)
                    return
            time.sleep(delay)
            delay = min(30.0, max(1.0, delay * 2))

    # -- a stop snapshot's persist phase -------------------------------------------------------------

    def persist_now(self, store: LocalStore, manifest: Manifest, deadline: float,
                    progress: EventSink | None = None) -> Record:
        """Upload and verify remotely, in this thread, before ``deadline`` (monotonic); CaptureFailed if not."""
        rec = self._record(manifest)
        rec.event("queued")
        self._interrupt.set()  # a background upload gives way; it resumes after this one
        got = self._busy.acquire(timeout=max(0.0, deadline - time.monotonic()))
        try:
            if not got:
                raise CaptureFailed(f"the snapshot could not be persisted to {self.url} in time",
                                    "an earlier snapshot's upload did not give way before the deadline",
                                    "retry with a longer --timeout; the job was resumed and goes on running")
            try:
                self._persist(_Item(store, manifest, rec), deadline, progress)
            except _Interrupted:
                raise CaptureFailed(f"the snapshot could not be persisted to {self.url} before its deadline",
                                    f"{rec.state} had reached {rec.bytes_done} of {rec.bytes_total} bytes",
                                    "retry with a longer --timeout; the job was resumed and goes on running",
                                    persist=self._failed(rec, "deadline")) from None
            except CryosleepError as e:
                why = f"{e.what}: {e.why}" if e.why else e.what
                raise CaptureFailed(f"the snapshot could not be persisted to {self.url}", why,
                                    "the job was resumed and goes on running; " + (e.hint or "check the store"),
                                    persist=self._failed(rec, why)) from e
        except BaseException:
            remove_record(store, rec.snapshot)  # the rollback removes the local snapshot too
            raise
        finally:
            if got:
                self._busy.release()
            self._interrupt.clear()
        return rec

    def _failed(self, rec: Record, reason: str) -> dict[str, Any]:
        rec.state, rec.reason = "failed", reason
        rec.event("failed", reason=reason)
        self._done(rec)
        return rec.to_json()

    def _done(self, rec: Record) -> None:
        if self.on_done is not None:
            try:
                self.on_done(rec)
            except Exception as e:  # a listener's bug must not fail an upload
                self._log(f"persistence listener failed: {type(e).__name__}: {e}")
        if rec.state == "persisted" and self.cfg.policy() is not None:  # on the side: never delays an upload
            threading.Thread(target=self.retain, args=(rec.snapshot,), name=f"retain {self.job}", daemon=True).start()

    def retain(self, newest: str) -> list[str]:
        """The job's retention policy applied to its snapshots in the store, ``newest`` (just persisted) always
        kept, and so is the latest stop snapshot (a suspended job lives in it). Removes manifests only: their
        chunks go at the next ``cryosleep gc``. Returns what was removed; a failure is logged, never raised."""
        policy = self.cfg.policy()
        if policy is None:
            return []
        removed: list[str] = []
        with self._retaining:
            try:
                snaps = self.cas.snapshots(self.job)
                last_stop = next((x.id for x in reversed(snaps) if x.mode == "stop"), None)
                infos = [SnapshotInfo(x.id, x.job, x.created_at, x.seq, protected=x.id in (newest, last_stop))
                         for x in snaps]
                for d in decide(infos, policy, time.time()):
                    if not d.keep:
                        self.cas.remove(d.snapshot.id)
                        removed.append(d.snapshot.id)
                        self._log(f"retention: removed snapshot {d.snapshot.id} from {self.url} ({d.reason})")
            except Exception as e:  # the upload succeeded; thinning the store can wait for the next one
                self._log(f"retention in {self.url} failed: {type(e).__name__}: {e}")
        return removed

    # -- one upload ------------------------------------------------------------------------------

    def _record(self, manifest: Manifest) -> Record:
        return Record(snapshot=manifest.id, job=manifest.job_name, remote=self.url, mode=manifest.mode,
                      bytes_total=manifest.bytes, encrypted=self.key is not None, agent_pid=os.getpid())

    def _persist(self, item: _Item, deadline: float | None, progress: EventSink | None) -> None:
        """Upload the snapshot's files, then re-read every chunk from the store; the record follows along."""
        store, manifest, rec = item.store, item.manifest, item.record
        base = store.path_of(manifest.id)
        files = [f.path for n in manifest.nodes for f in n.files]
        last = [0.0]

        def tick(step: str) -> Callable[[int], None]:
            def on(n: int) -> None:
                if self._interrupt.is_set() and deadline is None:
                    raise _Interrupted()
                if deadline is not None and time.monotonic() > deadline:
                    raise _Interrupted()
                rec.bytes_done += n
                now = time.monotonic()
                if now - last[0] >= UPDATE_EVERY_S:
                    last[0] = now
                    write_record(store, rec)
                    if progress is not None:
                        progress({"event": "transfer", "step": step, "bytes": rec.bytes_done,
                                  "total": rec.bytes_total, "snapshot": rec.snapshot})
            return on

        rec.attempts += 1
        rec.state, rec.reason, rec.bytes_done = "uploading", "", 0
        rec.event("upload-start", attempt=rec.attempts)
        write_record(store, rec)
        self._log(f"snapshot {rec.snapshot}: uploading to {self.url} (attempt {rec.attempts})")
        t0 = time.monotonic()
        res = self.cas.put_snapshot(manifest.id, manifest.job_name, base, files, key=self.key,
                                       mode=manifest.mode, manifest=manifest.redacted(),
                                       created_at=manifest.created_at, progress=tick("upload"))
        rec.upload_s = round(time.monotonic() - t0, 3)
        if rec.attempts > 1:
            self._drop_stale_markers(manifest.id)
        rec.bytes_sent, rec.bytes_skipped = res.bytes_sent, res.bytes_skipped
        rec.chunks, rec.uploaded, rec.present = res.chunks, res.uploaded, res.present
        rec.stored_bytes = res.snapshot.stored_bytes
        rec.state, rec.bytes_done = "verifying", 0
        rec.event("uploaded", seconds=rec.upload_s, bytes_sent=rec.bytes_sent, skipped=rec.bytes_skipped)
        write_record(store, rec)
        if progress is not None:
            progress({"event": "transfer", "step": "upload", "bytes": rec.bytes_total, "total": rec.bytes_total,
                      "snapshot": rec.snapshot, "done": True})
        t1 = time.monotonic()
        try:
            _, problems, _ = self.cas.verify(manifest.id, key=self.key, progress=tick("verify"))
        except BaseException:
            self._unpublish(manifest.id)
            raise
        rec.verify_s = round(time.monotonic() - t1, 3)
        if problems:
            self._unpublish(manifest.id)
            from cryosleep.errors import StoreCorrupt

            raise StoreCorrupt(f"snapshot {manifest.id} failed verification in {self.url} after its upload",
                               "; ".join(p.what for p in problems[:3]), "check the store",
                               chunks=[p.chunk for p in problems if p.chunk])
        rec.state, rec.bytes_done = "persisted", rec.bytes_total
        rec.event("persisted", verify_seconds=rec.verify_s)
        write_record(store, rec)
        self._done(rec)
        if progress is not None:
            progress({"event": "transfer", "step": "verify", "bytes": rec.bytes_total, "total": rec.bytes_total,
                      "snapshot": rec.snapshot, "done": True})
        self._log(f"snapshot {rec.snapshot}: persisted to {self.url} and verified ({rec.bytes_sent} bytes sent, "
                  f"{100 * rec.dedup:.0f}% already stored, {rec.upload_s:.2f} s upload, {rec.verify_s:.2f} s verify)")

    def _drop_stale_markers(self, sid: str) -> None:
        """Remove the in-progress markers that failed attempts at this snapshot could not remove (the server
        was down): its manifest is written now, naming every chunk they were sending, so they protect nothing,
        and left alone they would hold every GC off until their TTL passed."""
        from cryosleep.store.gc import PENDING

        try:
            for o in list(self.cas.backend.list(f"{PENDING}{sid}.")):
                self.cas.backend.delete(o.name)
        except CryosleepError:
            pass

    def _unpublish(self, sid: str) -> None:
        """A snapshot that did not verify is not left listed in the store."""
        try:
            self.cas.remove(sid)
        except CryosleepError:
            pass

    # -- bounded local staging -------------------------------------------------------------------

    def prune(self, store: LocalStore) -> list[str]:
        """Remove local copies of this job's persisted snapshots beyond the ``local_keep`` newest."""
        removed: list[str] = []
        local = sorted(store.manifests(self.job), key=lambda m: m.created_at, reverse=True)
        for m in local[self.cfg.local_keep:]:
            rec = read_record(store, m.id)
            if rec is None or rec.state != "persisted" or rec.remote != self.url:
                continue
            try:
                store.remove(m.id)
            except (CryosleepError, OSError):
                continue
            rec.local = "removed"
            rec.event("local-removed", keep=self.cfg.local_keep)
            write_record(store, rec)
            removed.append(m.id)
        if removed:
            self._log(f"removed local copies of persisted snapshot(s) {', '.join(removed)} "
                      f"(keeping {self.cfg.local_keep} locally)")
        return removed


# ------------------------------------------------------------------------------------------- fetching


def authentic(snap: Snapshot, trust: Trust) -> tuple[Manifest | None, str]:
    """The image manifest of a chunk store's snapshot, authenticated (:func:`cryosleep.store.auth.authenticate`),
    and its chunk index checked against it: the same job, and exactly the files the manifest signs, each of the
    size and SHA-256 it signs (the chunks then give back those bytes or fail their checksum). Returns the
    manifest and how it was authenticated; Unauthenticated or StoreCorrupt if not. A snapshot without an image
    manifest (files stored by other means than a snapshot: nothing to restore) counts as unsigned."""
    from cryosleep.errors import StoreCorrupt
    from cryosleep.store.auth import UNSIGNED_HINT, Unauthenticated, authenticate

    try:
        manifest = snap.image_manifest()
    except ValueError as e:
        raise StoreCorrupt(f"the image manifest of snapshot {snap.id} cannot be read", str(e),
                           "the snapshot is damaged; restore another one and remove this one") from e
    if manifest is None:
        if trust.allow_unsigned:
            return None, "unsigned, no image manifest (accepted: --allow-unsigned)"
        raise Unauthenticated(f"snapshot {snap.id} is not signed", "it has no image manifest to carry a MAC",
                              UNSIGNED_HINT)
    how = authenticate(manifest, snap.id, trust)
    signed = {(f.path, f.size, f.sha256) for n in manifest.nodes for f in n.files}
    indexed = {(f.path, f.size, f.sha256) for f in snap.files}
    if snap.job != manifest.job_name or signed != indexed:
        odd = sorted(p for p, _, _ in signed ^ indexed)[:5]
        raise Unauthenticated(f"snapshot {snap.id}'s chunk index does not match its manifest; nothing was restored",
                              f"job {snap.job!r} vs {manifest.job_name!r}; files that differ: {odd}",
                              "do not restore it; restore another snapshot and remove this one")
    return manifest, how


def fetch(url: str | Path, ref: str, store: LocalStore, *, key_file: Path | None = None,
          progress: EventSink | None = None, trust: Trust | None = None) -> tuple[Manifest, Record]:
    """Bring snapshot ``ref`` from the chunk store at ``url`` into the local directory store, authenticated first
    (``trust``; nothing is downloaded otherwise), every chunk checked against its address and every file against
    its SHA-256. A snapshot already there is reused. The local copy keeps the MAC the store's manifest had."""
    from cryosleep.errors import StoreCorrupt, WrongKey
    from cryosleep.store.auth import Trust
    from cryosleep.store.crypto import load_key

    url = normalize_url(url)
    chunks = open_chunk_store(url)
    snap = chunks.load(ref)
    key = load_key(snap.job, key_file, required=snap.encryption is not None)
    if snap.key_id is not None and key is not None and key.key_id != snap.key_id:
        raise WrongKey(f"snapshot {snap.id} cannot be decrypted with the key from {key.origin}: wrong key",
                       f"the key's fingerprint is {key.key_id}; the snapshot was written with {snap.key_id}",
                       "give the key this job's snapshots were written with (--key-file, $CRYOSLEEP_KEY)")
    manifest, _ = authentic(snap, trust or Trust(key_file=key_file))
    if manifest is None:
        from cryosleep.errors import StoreCorrupt

        raise StoreCorrupt(f"snapshot {snap.id} in {url} has no image manifest",
                           "it was not written by a Cryosleep snapshot", "restore another snapshot")
    rec = Record(snapshot=snap.id, job=snap.job, remote=url, mode=snap.mode, state="persisted",
                 bytes_total=snap.bytes, stored_bytes=snap.stored_bytes, encrypted=snap.encryption is not None,
                 local="fetched")
    try:
        store.resolve(snap.id)
        return store.load(snap.id), read_record(store, snap.id) or rec
    except NotFound:
        pass
    staging = Staging(snap.id, store.staging / f"{snap.id}")
    shutil.rmtree(staging.path, ignore_errors=True)
    staging.path.mkdir(parents=True)
    done = [0, 0.0]

    def on(n: int) -> None:
        done[0] += n
        now = time.monotonic()
        if progress is not None and now - done[1] >= UPDATE_EVERY_S:
            done[1] = now
            progress({"event": "transfer", "step": "download", "bytes": done[0], "total": snap.bytes,
                      "snapshot": snap.id})

    t0 = time.monotonic()
    try:
        chunks.restore(snap.id, staging.path, key=key, progress=on)
        store.commit(staging, manifest, sign=False)
    except BaseException:
        shutil.rmtree(staging.path, ignore_errors=True)
        raise
    seconds = time.monotonic() - t0
    if progress is not None:
        progress({"event": "transfer", "step": "download", "bytes": snap.bytes, "total": snap.bytes,
                  "snapshot": snap.id, "done": True, "seconds": round(seconds, 3)})
    rec.event("fetched", seconds=round(seconds, 3))
    rec.verify_s = round(seconds, 3)
    write_record(store, rec)
    return manifest, rec


def resign_remote(url: str | Path, ref: str, old: Trust, new: Trust) -> tuple[Snapshot, str, str]:
    """Re-sign snapshot ``ref`` of the chunk store at ``url``: authenticated under ``old``, its manifest signed
    under ``new``'s key and written again; no chunk is read or sent. Returns (snapshot, how it was authenticated
    before, the new key id)."""
    from cryosleep.store.auth import resign
    from cryosleep.store.cas import SNAPSHOTS

    chunks = open_chunk_store(url)
    snap = chunks.load(ref)
    manifest, _ = authentic(snap, old)
    if manifest is None:
        raise UsageError(f"snapshot {snap.id} has no image manifest to sign", "it is not a job's snapshot", "")
    before, key = resign(manifest, snap.id, old, new)
    snap.manifest = manifest.redacted()
    chunks.backend.put(f"{SNAPSHOTS}{snap.id}.json", json.dumps(snap.to_json(), indent=1).encode())
    return snap, before, key.key_id


# ------------------------------------------------------------------------------------- the agent's side


def for_job(job: str, persist: dict[str, Any] | None, log: Callable[[str], None] | None = None) -> Persister | None:
    """The persister of a job whose spec names a remote store, else None."""
    cfg = RemoteConfig.from_json(persist)
    return None if cfg is None else Persister(job, cfg, log=log)


def stop_hook(persister: Persister | None, store: LocalStore,
              send: EventSink) -> Callable[[Manifest, float], None] | None:
    """The ``persist`` phase of a stop snapshot (:class:`cryosleep.capture.snapshot.Target`)."""
    if persister is None:
        return None
    p = persister

    def hook(manifest: Manifest, deadline: float) -> None:
        p.persist_now(store, manifest, deadline, send)

    return hook


def after_snapshot(persister: Persister | None, store: LocalStore, manifest: Manifest) -> dict[str, Any] | None:
    """Once take() returned: queue a keep-running snapshot's upload; apply bounded staging after a stop
    snapshot (persisted by then). The record, for the snapshot's result."""
    if persister is None:
        return None
    if manifest.mode == "stop":
        rec = read_record(store, manifest.id)
        persister.prune(store)
        return None if rec is None else rec.to_json()
    return persister.enqueue(store, manifest).to_json()
