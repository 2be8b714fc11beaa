"""The content-addressed image store: files cut into chunks, each chunk stored once, compressed, and
encrypted when the job has a key.

Objects in a backend (:mod:`cryosleep.store.backend`)::

    chunks/<aa>/<address>      one chunk: MAGIC, a flags byte, then the zstd frame (or the raw bytes when
                               they do not compress), AES-256-GCM sealed when encrypted
    snapshots/<id>.json        a snapshot: per file its size, SHA-256, mode and chunk list, the chunking,
                               the key's fingerprint, and the directory store's manifest (job, versions...)
    pending/<id>.<tok>.json    an upload in progress (heartbeat); see cryosleep.store.gc for why
    gc/<tok>.json              a GC in progress

A chunk's address is the SHA-256 of its plaintext, or, with a key, the HMAC of that hash under a key
derived secret (:mod:`cryosleep.store.crypto`). Every read re-derives the address from the bytes it got,
so a flipped bit anywhere is caught and named.

Uploads are parallel (a thread pool hashes, compresses, encrypts and PUTs chunks; zstd, hashlib, the AEAD
and the sockets release the GIL) and resumable: a chunk already in the store is not sent again, so running
an interrupted upload again sends only what is missing. A snapshot becomes visible only when its
``snapshots/<id>.json`` is written, after every chunk it names is stored.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard

from cryosleep.errors import (
    BackendError,
    ChunkCorrupt,
    CryosleepError,
    IntegrityError,
    NotFound,
    ObjectNotFound,
    StoreCorrupt,
    UsageError,
    WrongKey,
)
from cryosleep.store import gc as gcmod
from cryosleep.store.backend import Backend
from cryosleep.store.chunking import DEFAULT, ChunkSpec, iter_chunks
from cryosleep.store.crypto import ALGORITHM, DecryptError, JobKey
from cryosleep.store.manifest import FileEntry, Manifest

__all__ = [
    "CAS_FORMAT",
    "ChunkRef",
    "ChunkStore",
    "ChunkedFile",
    "Problem",
    "Snapshot",
    "UploadResult",
    "chunk_name",
    "decode_chunk",
    "encode_chunk",
]

CAS_FORMAT = 1
MAGIC = b"CSC1"
F_ZSTD = 1
F_SEALED = 2
ZSTD_LEVEL = 3
CHUNKS = gcmod.CHUNKS
SNAPSHOTS = "snapshots/"
# No chunk is larger (chunking's largest is a few MiB): a stored frame that claims more is refused before
# anything is allocated for it, so a forged chunk cannot exhaust memory.
MAX_CHUNK = 256 << 20


def chunk_name(address: str) -> str:
    return f"{CHUNKS}{address[:2]}/{address}"


def _address(plain: bytes, key: JobKey | None) -> str:
    digest = hashlib.sha256(plain).digest()
    return key.address(digest) if key is not None else digest.hex()


def encode_chunk(plain: bytes, key: JobKey | None, cctx: zstandard.ZstdCompressor) -> tuple[str, bytes]:
    """(address, stored bytes) of a chunk."""
    address = _address(plain, key)
    packed = cctx.compress(plain)
    flags = F_ZSTD
    if len(packed) >= len(plain):
        packed, flags = plain, 0
    if key is not None:
        flags |= F_SEALED
        header = MAGIC + bytes([flags])
        return address, header + key.seal(packed, header + address.encode())
    return address, MAGIC + bytes([flags]) + packed


def decode_chunk(address: str, blob: bytes, key: JobKey | None, *, expected_key_id: str | None = None,
                 where: str = "", limit: int = MAX_CHUNK) -> bytes:
    """The plaintext of a stored chunk, checked against its address; ChunkCorrupt or WrongKey naming it, for any
    bytes at all. ``limit``: the most plaintext bytes it may hold."""
    at = f" ({where})" if where else ""
    if len(blob) < 5 or blob[:4] != MAGIC:
        raise ChunkCorrupt(f"chunk {address}{at} is damaged", "it does not start with a chunk header",
                           "the store lost or altered it; restore another snapshot")
    flags = blob[4]
    payload = blob[5:]
    if flags & F_SEALED:
        if key is None:
            raise WrongKey(f"chunk {address}{at} is encrypted and no key was given", "",
                           "give the job's key (--key-file, $CRYOSLEEP_KEY)")
        try:
            payload = key.open(payload, blob[:5] + address.encode())
        except DecryptError:
            if expected_key_id is not None and key.key_id != expected_key_id:
                raise WrongKey(
                    f"chunk {address}{at} cannot be decrypted: wrong key",
                    f"the key from {key.origin} has fingerprint {key.key_id}; the snapshot was written with "
                    f"{expected_key_id}",
                    "give the key this job's snapshots were written with",
                ) from None
            raise ChunkCorrupt(f"chunk {address}{at} failed authentication", "AES-GCM tag mismatch: the stored "
                               "bytes were altered (the key's fingerprint matches the snapshot's)",
                               "the store lost or altered it; restore another snapshot") from None
    elif key is not None and expected_key_id is not None:
        raise ChunkCorrupt(f"chunk {address}{at} is not encrypted but the snapshot is", "", "")
    if flags & ~(F_ZSTD | F_SEALED):
        raise ChunkCorrupt(f"chunk {address}{at} is damaged", f"unknown flags {flags:#x} in its header",
                           "the store lost or altered it; restore another snapshot")
    if flags & F_ZSTD:
        try:
            size = zstandard.frame_content_size(payload)
            if not 0 <= size <= limit:  # -1: not recorded (the writer always records it)
                raise zstandard.ZstdError(f"its frame claims {size} bytes, at most {limit} expected")
            plain = zstandard.ZstdDecompressor().decompress(payload)
        except zstandard.ZstdError as e:
            raise ChunkCorrupt(f"chunk {address}{at} does not decompress", str(e),
                               "the store lost or altered it; restore another snapshot") from e
    else:
        plain = payload
    got = _address(plain, key if flags & F_SEALED else None)
    if got != address:
        raise ChunkCorrupt(f"chunk {address}{at} is damaged", f"its content hashes to {got}",
                           "the store lost or altered it; restore another snapshot")
    return plain


# ------------------------------------------------------------------------------------------ the manifest


@dataclass
class ChunkRef:
    """One chunk of a file: ``size`` plaintext bytes at ``offset``, ``stored`` bytes in the store."""

    address: str
    offset: int
    size: int
    stored: int


@dataclass
class ChunkedFile(FileEntry):
    """A file of the image (``path``, ``size``, ``sha256`` as in the directory store), as chunks."""

    mode: int = 0o644
    chunks: list[ChunkRef] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256, "mode": self.mode,
                "chunks": [[c.address, c.offset, c.size, c.stored] for c in self.chunks]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ChunkedFile:
        """ValueError (or KeyError, TypeError) for anything that is not a file of a snapshot: a path that is not
        a normal relative one (a restore writes it under its directory), a size or offset out of range."""
        path = d["path"]
        if not isinstance(path, str) or not _relative(path):
            raise ValueError(f"file path {path!r:.80} is not a normal relative path")
        chunks = [ChunkRef(_text(a), _count(o), _count(s), _count(t)) for a, o, s, t in d["chunks"]]
        if any(c.size > MAX_CHUNK or len(c.address) != 64 for c in chunks):
            raise ValueError(f"{path}: a chunk larger than {MAX_CHUNK} bytes, or an address not 64 hex digits")
        return cls(path=path, size=_count(d["size"]), sha256=_text(d["sha256"]), mode=_count(d.get("mode", 0o644))
                   & 0o777, chunks=chunks)


def _relative(path: str) -> bool:
    parts = path.split("/")
    return bool(path) and "\0" not in path and not path.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _count(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{v!r:.40} is not a count")
    return v


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{v!r:.40} is not text")
    return v


@dataclass
class Snapshot:
    """A snapshot in the content-addressed store: what ``snapshots/<id>.json`` holds."""

    id: str
    job: str
    created_at: float
    files: list[ChunkedFile]
    chunking: dict[str, Any]
    encryption: dict[str, Any] | None = None  # {"algorithm", "key_id", "address"} when encrypted
    compression: str = f"zstd-{ZSTD_LEVEL}"
    seq: int = 0  # per job, 1, 2, 3... in the order the snapshots were stored (retention's "every Kth")
    mode: str = "keep-running"
    manifest: dict[str, Any] | None = None  # the directory store's Manifest.to_json(), when there is one
    format: int = CAS_FORMAT

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def stored_bytes(self) -> int:
        seen: dict[str, int] = {}
        for f in self.files:
            for c in f.chunks:
                seen[c.address] = c.stored
        return sum(seen.values())

    def addresses(self) -> set[str]:
        return {c.address for f in self.files for c in f.chunks}

    @property
    def key_id(self) -> str | None:
        return None if self.encryption is None else str(self.encryption["key_id"])

    def image_manifest(self) -> Manifest | None:
        return Manifest.from_json(self.manifest) if self.manifest is not None else None

    def to_json(self) -> dict[str, Any]:
        return {"kind": "cryosleep-cas-snapshot", "format": self.format, "id": self.id, "job": self.job,
                "created_at": self.created_at, "seq": self.seq, "mode": self.mode, "chunking": self.chunking,
                "compression": self.compression, "encryption": self.encryption, "bytes": self.bytes,
                "files": [f.to_json() for f in self.files], "manifest": self.manifest}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Snapshot:
        """ValueError (or KeyError, TypeError) for anything that is not a snapshot's index."""
        if not isinstance(d, dict) or d.get("format") != CAS_FORMAT:
            fmt = d.get("format") if isinstance(d, dict) else d
            raise ValueError(f"snapshot format {fmt!r:.40}, this Cryosleep reads {CAS_FORMAT}")
        enc, manifest = d.get("encryption"), d.get("manifest")
        if enc is not None and not (isinstance(enc, dict) and isinstance(enc.get("key_id"), str)):
            raise ValueError(f"encryption {enc!r:.80} has no key id")
        if manifest is not None and not isinstance(manifest, dict):
            raise ValueError("its image manifest is not an object")
        created = d["created_at"]
        if not isinstance(created, int | float) or isinstance(created, bool):
            raise ValueError(f"created_at {created!r:.40} is not a time")
        return cls(id=_text(d["id"]), job=_text(d["job"]), created_at=float(created),
                   files=[ChunkedFile.from_json(f) for f in d["files"]], chunking=dict(d["chunking"]),
                   encryption=enc, compression=_text(d.get("compression", "zstd")),
                   seq=_count(d.get("seq", 0)), mode=_text(d.get("mode", "keep-running")), manifest=manifest)


@dataclass
class UploadResult:
    snapshot: Snapshot
    chunks: int = 0  # chunk references in the snapshot
    unique: int = 0  # distinct chunks in the snapshot
    uploaded: int = 0  # chunks sent
    present: int = 0  # chunks already in the store, skipped
    repaired: int = 0  # chunks sent again after a concurrent GC (see cryosleep.store.gc)
    bytes_in: int = 0
    bytes_sent: int = 0
    bytes_skipped: int = 0  # plaintext bytes not sent: the store had the chunk, or this upload sent it already
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"snapshot": self.snapshot.id, "chunks": self.chunks, "unique": self.unique,
                "uploaded": self.uploaded, "present": self.present, "repaired": self.repaired,
                "bytes_in": self.bytes_in, "bytes_sent": self.bytes_sent, "bytes_skipped": self.bytes_skipped,
                "seconds": round(self.seconds, 3)}


@dataclass
class Problem:
    """One thing wrong with a stored snapshot; ``chunk`` and ``file`` say where."""

    what: str
    chunk: str | None = None
    file: str | None = None
    offset: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"what": self.what, "chunk": self.chunk, "file": self.file, "offset": self.offset}


# ------------------------------------------------------------------------------------------- the store


class _Local(threading.local):
    cctx: zstandard.ZstdCompressor | None = None


class ChunkStore:
    """Snapshots as chunks in a backend. Thread-safe; one per process is enough.

    ``workers``: threads hashing, compressing, encrypting and transferring chunks. ``marker_ttl``: how long
    an upload's in-progress marker counts as live without a heartbeat (see cryosleep.store.gc).
    """

    def __init__(self, backend: Backend, *, workers: int = 8, spec: ChunkSpec = DEFAULT,
                 level: int = ZSTD_LEVEL, marker_ttl: float = gcmod.MARKER_TTL_S) -> None:
        self.backend = backend
        self.workers = max(1, workers)
        self.spec = spec
        self.level = level
        self.marker_ttl = marker_ttl
        self._local = _Local()

    def _cctx(self) -> zstandard.ZstdCompressor:
        if self._local.cctx is None:
            self._local.cctx = zstandard.ZstdCompressor(level=self.level)
        return self._local.cctx

    # --------------------------------------------------------------------------------------- writing

    def put_snapshot(
        self,
        sid: str,
        job: str,
        base: Path,
        files: Iterable[str],
        *,
        key: JobKey | None = None,
        mode: str = "keep-running",
        manifest: dict[str, Any] | None = None,
        created_at: float | None = None,
        seq: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> UploadResult:
        """Store the files ``base/<rel>`` for each rel in ``files`` as snapshot ``sid`` of ``job``.

        Chunks already in the store are skipped, so calling this again after an interruption (a crash, a
        killed server) sends only what is missing. Raises BackendError when the backend fails.
        """
        if not sid or "/" in sid or sid.startswith("."):
            raise UsageError(f"invalid snapshot id {sid!r}")
        t0 = time.monotonic()
        rels = sorted(set(files))
        if seq is None:
            seq = 1 + max((s.seq for s in self.snapshots(job)), default=0)
        snap = Snapshot(id=sid, job=job, created_at=created_at if created_at is not None else time.time(),
                        files=[], chunking=self.spec.to_json(), seq=seq, mode=mode, manifest=manifest,
                        encryption=None if key is None else
                        {"algorithm": ALGORITHM, "key_id": key.key_id, "address": "hmac-sha256"})
        res = UploadResult(snap)
        with gcmod.UploadMarker(self.backend, sid, self.marker_ttl) as marker:
            gc_seen = gcmod.live_gc_locks(self.backend, marker.server_now())
            self._upload(base, rels, key, snap, res, progress)
            if gc_seen or marker.lapsed():
                # A GC may have run without seeing our marker: wait for it, then make sure every chunk we
                # name is there, sending again what it took.
                marker.refresh()
                gcmod.wait_for_gc(self.backend, marker.server_now)
                res.repaired = self._repair(base, snap, key)
            self.backend.put(f"{SNAPSHOTS}{sid}.json", json.dumps(snap.to_json(), indent=1).encode())
        res.chunks = sum(len(f.chunks) for f in snap.files)
        res.unique = len(snap.addresses())
        res.seconds = time.monotonic() - t0
        return res

    def _upload(self, base: Path, rels: list[str], key: JobKey | None, snap: Snapshot, res: UploadResult,
                progress: Callable[[int], None] | None) -> None:
        lock = threading.Lock()
        claimed: dict[str, Future[int]] = {}  # address -> its one store operation in this upload
        room = threading.BoundedSemaphore(self.workers * 2)  # chunks held in memory, queued or in flight
        failed = threading.Event()

        def store(address: str, plain: bytes) -> int:
            """Stored size of the chunk, sending it unless the store has it already."""
            name = chunk_name(address)
            info = self.backend.stat(name)
            if info is not None:
                with lock:
                    res.present += 1
                    res.bytes_skipped += len(plain)
                return info.size
            _, blob = encode_chunk(plain, key, self._cctx())
            self.backend.put(name, blob)
            with lock:
                res.uploaded += 1
                res.bytes_sent += len(blob)
            return len(blob)

        def task(plain: bytes) -> tuple[str, int]:
            try:
                address = _address(plain, key)
                mine: Future[int] = Future()
                with lock:
                    prior = claimed.get(address)
                    if prior is None:
                        claimed[address] = mine
                if prior is not None:  # the same content earlier in this upload: its operation is running
                    stored = prior.result()
                    with lock:
                        res.bytes_skipped += len(plain)
                    return address, stored
                try:
                    mine.set_result(store(address, plain))
                except BaseException as e:
                    mine.set_exception(e)
                    failed.set()
                    raise
                return address, mine.result()
            finally:
                room.release()

        with ThreadPoolExecutor(self.workers, thread_name_prefix="cas-put") as pool:
            for rel in rels:
                path = base / rel
                st = path.stat()
                refs: list[tuple[int, int, Future[tuple[str, int]]]] = []
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for off, plain in iter_chunks(f, self.spec):
                        if failed.is_set():
                            break
                        h.update(plain)
                        room.acquire()
                        refs.append((off, len(plain), pool.submit(task, plain)))
                        res.bytes_in += len(plain)
                        if progress is not None:
                            progress(len(plain))
                chunks = []
                for off, size, fut in refs:
                    address, stored = fut.result()  # raises the first failure
                    chunks.append(ChunkRef(address, off, size, stored))
                snap.files.append(ChunkedFile(path=rel, size=st.st_size, sha256=h.hexdigest(),
                                              mode=st.st_mode & 0o7777, chunks=chunks))

    def _repair(self, base: Path, snap: Snapshot, key: JobKey | None) -> int:
        """Send again every chunk of ``snap`` that the store no longer has (read back from the source)."""
        where: dict[str, tuple[str, int, int]] = {}
        for f in snap.files:
            for c in f.chunks:
                where.setdefault(c.address, (f.path, c.offset, c.size))

        def fix(address: str) -> int:
            if self.backend.exists(chunk_name(address)):
                return 0
            rel, off, size = where[address]
            with open(base / rel, "rb") as fh:
                fh.seek(off)
                plain = fh.read(size)
            got, blob = encode_chunk(plain, key, self._cctx())
            if got != address:
                raise CryosleepError(f"{rel} changed while it was being stored",
                                     f"the chunk at offset {off} no longer hashes to {address}",
                                     "store it again from a stable copy")
            self.backend.put(chunk_name(address), blob)
            return 1

        with ThreadPoolExecutor(self.workers, thread_name_prefix="cas-fix") as pool:
            return sum(pool.map(fix, sorted(where)))

    # --------------------------------------------------------------------------------------- reading

    def snapshot_ids(self) -> list[str]:
        return sorted(o.name[len(SNAPSHOTS):-5] for o in self.backend.list(SNAPSHOTS) if o.name.endswith(".json"))

    def resolve(self, ref: str) -> str:
        if not ref or "/" in ref:
            raise UsageError(f"invalid snapshot id {ref!r}")
        ids = self.snapshot_ids()
        if ref in ids:
            return ref
        matches = [i for i in ids if i.startswith(ref)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise NotFound(f"no snapshot {ref!r} in the store {self.backend.url}", "no snapshot id starts with it",
                           "list the store's snapshots, and check --store")
        raise UsageError(f"snapshot id {ref!r} is ambiguous", f"it matches {', '.join(matches)}", "give more of it")

    def load(self, ref: str) -> Snapshot:
        sid = self.resolve(ref)
        try:
            return Snapshot.from_json(json.loads(self.backend.get(f"{SNAPSHOTS}{sid}.json")))
        except ObjectNotFound:
            raise NotFound(f"snapshot {sid} vanished from {self.backend.url}", "it was removed meanwhile") from None
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise StoreCorrupt(f"the manifest of snapshot {sid} cannot be read", str(e),
                               "the snapshot is damaged; restore another one and remove this one") from e

    def snapshots(self, job: str | None = None) -> list[Snapshot]:
        out = []
        for sid in self.snapshot_ids():
            try:
                s = self.load(sid)
            except NotFound:
                continue
            if job is None or s.job == job:
                out.append(s)
        out.sort(key=lambda s: (s.created_at, s.seq))
        return out

    def _chunks(self, snap: Snapshot, f: ChunkedFile, key: JobKey | None,
                pool: ThreadPoolExecutor) -> Iterator[tuple[ChunkRef, bytes | BaseException]]:
        """Each chunk of ``f`` in order, fetched ``workers`` ahead; a failure is yielded, not raised."""

        def fetch(c: ChunkRef) -> bytes:
            where = f"{f.path} at offset {c.offset}"
            try:
                blob = self.backend.get(chunk_name(c.address))
            except ObjectNotFound:
                raise ChunkCorrupt(f"chunk {c.address} ({where}) is missing from the store", "",
                                   "the store lost it; restore another snapshot") from None
            except IntegrityError as e:  # the backend's own checksum (S3 ETag) caught it first
                raise ChunkCorrupt(f"chunk {c.address} ({where}) is damaged", f"{e.what}: {e.why}",
                                   "the store lost or altered it; restore another snapshot") from e
            return decode_chunk(c.address, blob, key, expected_key_id=snap.key_id, where=where, limit=c.size)

        window: list[tuple[ChunkRef, Future[bytes]]] = []
        it = iter(f.chunks)
        for c in it:
            window.append((c, pool.submit(fetch, c)))
            if len(window) >= self.workers * 2:
                break
        while window:
            c, fut = window.pop(0)
            try:
                yield c, fut.result()
            except (CryosleepError, BackendError) as e:
                yield c, e
            nxt = next(it, None)
            if nxt is not None:
                window.append((nxt, pool.submit(fetch, nxt)))

    def _key_for(self, snap: Snapshot, key: JobKey | None) -> None:
        if snap.encryption is not None and key is None:
            raise WrongKey(f"snapshot {snap.id} is encrypted and no key was given", "",
                           "give the job's key (--key-file FILE, $CRYOSLEEP_KEY or $CRYOSLEEP_KEY_FILE)")

    def restore(self, ref: str, dest: Path, *, key: JobKey | None = None,
                progress: Callable[[int], None] | None = None) -> Snapshot:
        """Write every file of the snapshot under ``dest``, each checked chunk by chunk and whole.
        ``progress`` is called with the plaintext bytes of each chunk written."""
        snap = self.load(ref)
        self._key_for(snap, key)
        with ThreadPoolExecutor(self.workers, thread_name_prefix="cas-get") as pool:
            for f in snap.files:
                out = dest / f.path
                out.parent.mkdir(parents=True, exist_ok=True)
                h = hashlib.sha256()
                tmp = out.with_name(f".{out.name}.{secrets.token_hex(4)}")
                try:
                    with open(tmp, "wb") as fh:
                        for _c, data in self._chunks(snap, f, key, pool):
                            if isinstance(data, BaseException):
                                raise data
                            h.update(data)
                            fh.write(data)
                            if progress is not None:
                                progress(len(data))
                    if h.hexdigest() != f.sha256:
                        raise StoreCorrupt(f"{f.path} of snapshot {snap.id} does not match its checksum",
                                           "every chunk verified but the file's SHA-256 differs: the manifest "
                                           "is inconsistent", "restore another snapshot")
                    os.chmod(tmp, f.mode)
                    os.replace(tmp, out)
                finally:
                    tmp.unlink(missing_ok=True)
        return snap

    def verify(self, ref: str, *, key: JobKey | None = None,
               progress: Callable[[int], None] | None = None) -> tuple[Snapshot, list[Problem], int]:
        """Re-read and re-hash every chunk of the snapshot (and every file whole): (snapshot, problems,
        chunks checked). No problem: every byte is there and intact. ``progress``: bytes of each chunk read."""
        snap = self.load(ref)
        self._key_for(snap, key)
        problems: list[Problem] = []
        checked = 0
        with ThreadPoolExecutor(self.workers, thread_name_prefix="cas-verify") as pool:
            for f in snap.files:
                h = hashlib.sha256()
                whole = True
                expect = 0
                for c, data in self._chunks(snap, f, key, pool):
                    checked += 1
                    if progress is not None:
                        progress(c.size)
                    if c.offset != expect:
                        problems.append(Problem(f"{f.path}: chunk at offset {c.offset}, expected {expect}",
                                                c.address, f.path, c.offset))
                    expect = c.offset + c.size
                    if isinstance(data, BaseException):
                        problems.append(Problem(str(data).split("\n")[0], c.address, f.path, c.offset))
                        whole = False
                        if isinstance(data, WrongKey):
                            return snap, problems, checked  # every other chunk would say the same
                        continue
                    if len(data) != c.size:
                        problems.append(Problem(f"chunk {c.address} is {len(data)} bytes, expected {c.size}",
                                                c.address, f.path, c.offset))
                    h.update(data)
                if expect != f.size:
                    problems.append(Problem(f"{f.path}: chunks cover {expect} bytes, the file has {f.size}",
                                            None, f.path))
                elif whole and h.hexdigest() != f.sha256:
                    problems.append(Problem(f"{f.path}: SHA-256 of the whole file differs", None, f.path))
        return snap, problems, checked

    def remove(self, ref: str) -> str:
        """Remove a snapshot (its manifest); its chunks go at the next GC when nothing else needs them."""
        sid = self.resolve(ref)
        self.backend.delete(f"{SNAPSHOTS}{sid}.json")
        return sid
