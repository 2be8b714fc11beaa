"""The persistence queue without CRIU: snapshots written into a local directory store the way a capture
commits them, uploaded into a chunk store, pruned locally, fetched back. (tests/jobs/test_remote_store.py
runs the same path with real jobs and a real S3 server.)"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cryosleep.errors import CaptureFailed, ChunkCorrupt, UsageError, WrongKey
from cryosleep.store import persist
from cryosleep.store.backend import Backend, ObjectInfo
from cryosleep.store.cas import chunk_name
from cryosleep.store.local import LocalStore, hash_tree
from cryosleep.store.manifest import Manifest, NodeImage

from .helpers import image_bytes


def snapshot(store: LocalStore, seed: int, size: int = 4 << 20, *, shared: bytes = b"",
             mode: str = "keep-running") -> Manifest:
    """A committed snapshot of job "job" whose memory image shares ``shared`` with others."""
    st = store.begin("job")
    d = st.node_dir(0) / "criu"
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes(shared + image_bytes(seed, size))
    m = Manifest(id=st.id, job={"name": "job", "program": ["train.py"],
                                "env": {"AWS_SECRET_ACCESS_KEY": "s3cr3t", "CRYOSLEEP_KEY": "k", "LR": "3e-4"}},
                 mode=mode, created_at=time.time(), nodes=[NodeImage(0, [0, 1], 1,
                                                                             files=hash_tree(st.path, ["nodes/0"]))],
                 host={}, phases={}, pause_s=0.1)
    store.commit(st, m)
    time.sleep(0.01)  # distinct creation times order the snapshots
    return m


def key_file(path: Path, secret: bytes) -> Path:
    path.write_bytes(secret)
    path.chmod(0o600)
    return path


def at(rec: persist.Record, event: str, nth: int = 0) -> float:
    return float([e["t"] for e in rec.events if e["event"] == event][nth])


class Slow:
    """A backend whose PUTs take a while, so that an upload can be caught in the middle."""

    def __init__(self, inner: Backend, delay: float) -> None:
        self.inner = inner
        self.delay = delay
        self.url = inner.url

    def put(self, name: str, data: bytes) -> ObjectInfo:
        if name.startswith("chunks/"):
            time.sleep(self.delay)
        return self.inner.put(name, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_queue_uploads_one_at_a_time_dedups_and_bounds_local_staging(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    shared = image_bytes(7, 4 << 20)
    snaps = [snapshot(store, i, shared=shared) for i in range(3)]
    log: list[str] = []
    p = persist.Persister("job", persist.RemoteConfig(str(tmp_path / "remote"), local_keep=1), log=log.append)
    broken = snapshot(store, 9)  # its image vanishes before its upload: it fails, and is never pruned
    (store.path_of(broken.id) / "nodes/0/criu/pages-1.img").unlink()
    for m in [*snaps, broken]:
        assert p.enqueue(store, m).state == "queued"
    assert p.close(timeout=120)
    recs = persist.load_records(store)
    for a, b in itertools.pairwise(snaps):  # one upload at a time, in order
        assert at(recs[a.id], "persisted") <= at(recs[b.id], "upload-start")
    assert all(recs[m.id].state == "persisted" for m in snaps)
    assert recs[snaps[0].id].bytes_skipped == 0 and recs[snaps[1].id].bytes_skipped >= 3 << 20  # the shared part
    assert 0 < recs[snaps[1].id].dedup < 1 and recs[snaps[1].id].bytes_sent < recs[snaps[0].id].bytes_sent
    assert recs[broken.id].state == "failed" and "pages-1.img" in recs[broken.id].reason
    # local_keep=1: the newest local snapshot (the failed one) stays, and so does nothing persisted beyond it.
    local = {m.id for m in store.manifests()}
    assert local == {broken.id}
    assert [recs[m.id].local for m in snaps] == ["removed", "removed", "removed"]
    chunks = persist.open_chunk_store(tmp_path / "remote")
    assert [s.id for s in chunks.snapshots()] == [m.id for m in snaps]
    # What leaves the machine in clear has no secrets: the embedded manifest's environment is redacted.
    env = chunks.load(snaps[0].id).manifest["job"]["env"]  # type: ignore[index]
    assert env == {"AWS_SECRET_ACCESS_KEY": "<redacted>", "CRYOSLEEP_KEY": "<redacted>", "LR": "3e-4"}


def test_a_stop_snapshot_interrupts_a_background_upload_which_then_resumes(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    p = persist.Persister("job", persist.RemoteConfig(str(tmp_path / "remote"), local_keep=5))
    p.cas.backend = Slow(p.cas.backend, 0.05)
    p.cas.workers = 2
    big = snapshot(store, 1, 24 << 20)
    p.enqueue(store, big)
    end = time.monotonic() + 60
    while (r := persist.read_record(store, big.id)) is None or r.bytes_done < 2 << 20:
        assert time.monotonic() < end
        time.sleep(0.01)
    stop = snapshot(store, 2, 2 << 20)
    events: list[dict[str, Any]] = []
    rec = p.persist_now(store, stop, time.monotonic() + 60, events.append)
    assert rec.state == "persisted" and rec.attempts == 1
    assert {e["step"] for e in events} == {"upload", "verify"} and events[-1]["done"]
    assert p.close(timeout=120)
    bg = persist.read_record(store, big.id)
    assert bg is not None and bg.state == "persisted" and bg.attempts == 2
    names = [e["event"] for e in bg.events]
    assert names[:3] == ["queued", "upload-start", "interrupted"] and names[-1] == "persisted"
    assert bg.present > 0  # the second attempt did not send again what the first one stored
    assert at(bg, "upload-start", 1) >= at(rec, "persisted")  # resumed after the stop snapshot


def test_a_stop_snapshot_past_its_deadline_fails_and_leaves_no_record(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    p = persist.Persister("job", persist.RemoteConfig(str(tmp_path / "remote")))
    p.cas.backend = Slow(p.cas.backend, 0.2)
    p.cas.workers = 1  # two chunks in flight at most: the upload takes ~8 x 0.2 s
    m = snapshot(store, 3, 8 << 20)
    with pytest.raises(CaptureFailed) as err:
        p.persist_now(store, m, time.monotonic() + 0.5)
    assert "before its deadline" in err.value.what and err.value.details["persist"]["state"] == "failed"
    assert persist.read_record(store, m.id) is None
    assert persist.open_chunk_store(tmp_path / "remote").snapshot_ids() == []


def test_fetch_checks_every_chunk_and_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = os.urandom(32)
    monkeypatch.setenv("CRYOSLEEP_KEY", secret.hex())
    store = LocalStore(tmp_path / "store")
    m = snapshot(store, 4)
    remote = tmp_path / "remote"
    p = persist.Persister("job", persist.RemoteConfig(str(remote)))
    assert p.persist_now(store, m, time.monotonic() + 60).encrypted
    monkeypatch.delenv("CRYOSLEEP_KEY")
    elsewhere = LocalStore(tmp_path / "other-machine")
    with pytest.raises(WrongKey, match="wrong key"):
        persist.fetch(remote, m.id, elsewhere, key_file=key_file(tmp_path / "bad.key", os.urandom(32)))
    good = key_file(tmp_path / "good.key", secret)
    snap = p.cas.load(m.id)
    victim = snap.files[0].chunks[2]
    path = remote / "cas" / chunk_name(victim.address)
    blob = bytearray(path.read_bytes())
    blob[40] ^= 1
    path.write_bytes(bytes(blob))
    with pytest.raises(ChunkCorrupt) as err:
        persist.fetch(remote, m.id[:12], elsewhere, key_file=good)
    assert victim.address in err.value.what and "pages-1.img" in err.value.what
    assert elsewhere.manifests() == [] and not any(elsewhere.staging.iterdir())
    blob[40] ^= 1
    path.write_bytes(bytes(blob))
    progress: list[dict[str, Any]] = []
    got, rec = persist.fetch(remote, m.id, elsewhere, key_file=good, progress=progress.append)
    assert got.id == m.id and elsewhere.verify(m.id) == [] and rec.local == "fetched"
    assert progress[-1]["done"] and progress[-1]["bytes"] == m.bytes
    assert (elsewhere.path_of(m.id) / "nodes/0/criu/pages-1.img").read_bytes() == (
        store.path_of(m.id) / "nodes/0/criu/pages-1.img").read_bytes()


def test_close_waits_for_the_queue(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    p = persist.Persister("job", persist.RemoteConfig(str(tmp_path / "remote")))
    p.cas.backend = Slow(p.cas.backend, 0.02)
    for i in range(2):
        p.enqueue(store, snapshot(store, 10 + i))
    assert p.pending() >= 1
    done = threading.Event()
    threading.Thread(target=lambda: (p.close(), done.set()), daemon=True).start()
    assert done.wait(120) and p.pending() == 0
    assert all(r.state == "persisted" for r in persist.load_records(store).values())


def test_transfer_progress_plain_lines_json_and_a_bar() -> None:
    import io
    import json

    from cryosleep.cli.transfer import TransferPrinter, summary

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    evs = [{"event": "transfer", "step": "upload", "bytes": n << 20, "total": 8 << 20} for n in (1, 4)]
    evs.append({"event": "transfer", "step": "upload", "bytes": 8 << 20, "total": 8 << 20, "done": True})
    plain, js, tty = io.StringIO(), io.StringIO(), Tty()
    for out, kw in ((plain, {}), (js, {"as_json": True}), (tty, {})):
        printer = TransferPrinter(out=out, **kw)  # type: ignore[arg-type]
        for ev in [{"event": "phase", "phase": "persist"}, *evs]:
            printer(ev)
        printer.close()
    lines = plain.getvalue().splitlines()
    assert lines[0].split()[:2] == ["upload", "12.5%"] and lines[-1].split()[:2] == ["upload", "100.0%"]
    assert [json.loads(x)["bytes"] for x in js.getvalue().splitlines()] == [1 << 20, 4 << 20, 8 << 20]
    assert "\r" in tty.getvalue() and "[########################]" in tty.getvalue() and tty.getvalue().endswith("\n")
    rec = {"state": "persisted", "bytes_sent": 3 << 20, "dedup": 0.5, "upload_rate": 100 << 20, "upload_s": 1,
           "local": "removed"}
    assert summary(rec) == "persisted+verified: 3.0 MiB sent, 50% dedup, 100.0 MiB/s, local copy removed"
    assert summary({"state": "failed", "reason": "server down"}) == "failed: server down"
    assert summary(None) == "local only"


def test_retention_after_each_upload_keeps_the_newest_and_the_last_stop(tmp_path: Path) -> None:
    """`run --store URL --keep-last N`: once a snapshot is persisted, the job's older snapshots in the store that
    the policy does not keep are removed (manifests; chunks go at the next gc), the one just persisted and the
    latest stop snapshot never."""
    store = LocalStore(tmp_path / "store")
    log: list[str] = []
    p = persist.Persister("job", persist.RemoteConfig(str(tmp_path / "remote"), local_keep=10,
                                                      retain={"keep_last": 2}), log=log.append)
    snaps = [snapshot(store, 0, mode="stop"), *(snapshot(store, i) for i in range(1, 5))]
    for m in snaps:
        p.enqueue(store, m)
    assert p.close(timeout=120)
    chunks = persist.open_chunk_store(tmp_path / "remote")
    end = time.monotonic() + 10  # retention runs beside the uploads
    while len(chunks.snapshots("job")) > 3 and time.monotonic() < end:
        time.sleep(0.05)
    left = [s.id for s in chunks.snapshots("job")]
    assert left == [snaps[0].id, snaps[3].id, snaps[4].id], (left, log)  # the stop, then the 2 newest
    assert any(f"removed snapshot {snaps[1].id}" in line for line in log), log
    assert p.retain(snaps[4].id) == []  # applied again: nothing more to remove
    with pytest.raises(UsageError, match="bad retention policy"):
        persist.check_config("job", persist.RemoteConfig(str(tmp_path / "remote"), retain={"keep_every": 0}))
    from cryosleep.cli.transfer import remote_config

    with pytest.raises(UsageError, match="apply to the store"):  # `run --keep-last 2` without --store
        remote_config("job", None, None, 2, {"keep_last": 2})
    assert remote_config("job", tmp_path / "remote", None, 2, {"keep_last": 2})["retain"] == {"keep_last": 2}
