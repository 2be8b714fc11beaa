"""GC of unreferenced chunks: what it deletes, what it never deletes, and uploads running at the same time."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from cryosleep.store.backend import Backend
from cryosleep.store.cas import ChunkStore, UploadResult, chunk_name
from cryosleep.store.chunking import ChunkSpec
from cryosleep.store.gc import GC_LOCKS, UploadMarker, collect

from .helpers import image_bytes, write

SPEC = ChunkSpec("fixed", 256 << 10)


def _tick() -> None:
    """Let a second pass: S3 object times have one-second resolution, and a chunk written in the same
    second as the GC's lock counts as young even with no grace period (the rule errs towards keeping)."""
    time.sleep(1.05)


def _store(backend: Backend) -> ChunkStore:
    return ChunkStore(backend, spec=SPEC, workers=4)


def test_gc_deletes_only_what_no_snapshot_needs(backend: Backend, tmp_path: Path) -> None:
    shared = image_bytes(1, 1 << 20)
    write(tmp_path, "a.img", shared + image_bytes(2, 1 << 20))
    write(tmp_path, "b.img", shared + image_bytes(3, 1 << 20))
    store = _store(backend)
    store.put_snapshot("a", "job", tmp_path, ["a.img"])
    store.put_snapshot("b", "job", tmp_path, ["b.img"])
    only_a = store.load("a").addresses() - store.load("b").addresses()
    assert len(only_a) == 4
    store.remove("a")
    _tick()
    dry = collect(store, dry_run=True, grace=0)
    assert dry.deleted == 4 and dry.unreferenced == 4 and not dry.deferred
    assert all(backend.exists(chunk_name(x)) for x in only_a)  # a dry run deletes nothing
    young = collect(store, grace=3600)
    assert young.deleted == 0 and young.too_young == 4  # the grace period protects fresh chunks
    report = collect(store, grace=0)
    assert report.deleted == 4 and report.referenced == 8 and report.bytes_freed > 0
    assert not any(backend.exists(chunk_name(x)) for x in only_a)
    assert store.verify("b")[1] == []
    assert list(backend.list(GC_LOCKS)) == []  # its lock is gone


def test_gc_defers_while_an_upload_is_in_progress(backend: Backend, tmp_path: Path) -> None:
    write(tmp_path, "a.img", image_bytes(4, 1 << 20))
    store = _store(backend)
    store.put_snapshot("a", "job", tmp_path, ["a.img"])
    store.remove("a")
    with UploadMarker(backend, "someone-else"):
        report = collect(store, grace=0)
        assert report.deferred and report.deleted == 0 and len(report.uploads_in_progress) == 1
        assert len(list(backend.list("chunks/"))) == 4
    _tick()
    assert collect(store, grace=0).deleted == 4


def test_upload_that_saw_a_gc_repairs_what_it_deleted(backend: Backend, tmp_path: Path) -> None:
    """The other half of the rule, made deterministic: an upload starts while a GC holds its lock (so the GC
    cannot have seen the upload's marker), skips a chunk the store has, and that GC deletes it. The upload
    waits for the GC to finish, finds the chunk gone and sends it again before it commits."""
    data = image_bytes(5, 1 << 20)
    write(tmp_path, "a.img", data)
    store = _store(backend)
    store.put_snapshot("old", "job", tmp_path, ["a.img"])
    store.remove("old")  # its 4 chunks are garbage now, still in the store
    backend.put(f"{GC_LOCKS}fake.json", b"{}")  # a GC is running
    result: list[UploadResult] = []
    t = threading.Thread(target=lambda: result.append(store.put_snapshot("new", "job", tmp_path, ["a.img"])))
    t.start()
    deadline = time.monotonic() + 20
    while not list(backend.list("pending/")) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # the upload has found the 4 chunks present and skipped them; it now waits for the GC
    for o in list(backend.list("chunks/")):  # ...which deletes them, as it saw no marker
        backend.delete(o.name)
    backend.delete(f"{GC_LOCKS}fake.json")  # and finishes
    t.join(timeout=30)
    res = result[0]
    assert res.present == 4 and res.repaired == 4
    assert store.verify("new")[1] == []


@pytest.mark.slow
def test_gc_under_concurrent_uploads_loses_nothing(backend: Backend, tmp_path: Path) -> None:
    """Uploads that reuse garbage chunks race a GC running in a loop with no grace period; afterwards every
    committed snapshot verifies."""
    base = [image_bytes(10 + i, 1 << 20) for i in range(4)]
    for i, b in enumerate(base):
        write(tmp_path, f"seed{i}.img", b)
    store = _store(backend)
    for i in range(4):
        store.put_snapshot(f"seed{i}", "job", tmp_path, [f"seed{i}.img"])
        store.remove(f"seed{i}")  # garbage that the uploads below will find and skip
    stop = threading.Event()
    reports: list[object] = []
    errors: list[BaseException] = []

    def gc_loop() -> None:
        while not stop.is_set():
            try:
                reports.append(collect(store, grace=0))
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)
                return

    def uploader(n: int) -> None:
        try:
            for j in range(4):
                rel = f"u{n}-{j}.img"
                write(tmp_path, rel, base[(n + j) % 4] + image_bytes(100 * n + j, 256 << 10))
                store.put_snapshot(f"u{n}-{j}", "job", tmp_path, [rel])
                time.sleep(0.02)  # room for GCs between uploads
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    gc = threading.Thread(target=gc_loop)
    ups = [threading.Thread(target=uploader, args=(n,)) for n in range(3)]
    gc.start()
    for u in ups:
        u.start()
    for u in ups:
        u.join(timeout=120)
    stop.set()
    gc.join(timeout=60)
    assert not errors, errors
    assert len(reports) >= 2
    ids = store.snapshot_ids()
    assert len(ids) == 12
    for sid in ids:
        assert store.verify(sid)[1] == [], sid
    final = collect(store, grace=0)
    assert not final.deferred and final.unreferenced == 0
