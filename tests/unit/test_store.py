"""The local store: atomic publish, listing, verification, removal, id resolution."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cryosleep.errors import NotFound, StoreCorrupt, UsageError
from cryosleep.store import LocalStore, Manifest, NodeImage, StagedFile
from cryosleep.store.local import hash_tree


def make(store: LocalStore, job: str = "j", payload: bytes = b"x" * 5000) -> Manifest:
    st = store.begin(job)
    d = st.node_dir(0) / "criu"
    d.mkdir(parents=True)
    (d / "pages-1.img").write_bytes(payload)
    (d / "core-1.img").write_bytes(b"core")
    files = hash_tree(st.path, ["nodes/0"])
    m = Manifest(id=st.id, job={"name": job, "program": ["p"]}, mode="stop", created_at=time.time(),
                 nodes=[NodeImage(0, [0, 1], 123, files=files,
                                  staged=[StagedFile("/x/log", 3, 0o644, "0000", "ab")])],
                 host={"kernel": "k"}, phases={"dump": 0.5}, pause_s=0.5)
    store.commit(st, m)
    return m


def test_commit_publishes_atomically_and_round_trips(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    m = make(store)
    assert list((tmp_path / ".staging").iterdir()) == []
    loaded = store.load(m.id)
    assert loaded.to_json() == m.to_json()
    assert loaded.complete and loaded.bytes == 5004
    assert store.verify(m.id) == []


def test_uncommitted_snapshots_are_never_listed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    st = store.begin("j")
    (st.path / "junk").write_text("half")
    assert store.manifests() == []
    with pytest.raises(NotFound):
        store.load(st.id)
    store.abort(st)
    assert not st.path.exists()


def test_verify_names_truncated_altered_and_missing_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    m = make(store)
    base = store.path_of(m.id) / "nodes/0/criu"
    (base / "pages-1.img").write_bytes(b"x" * 100)
    problems = store.verify(m.id)
    assert len(problems) == 1 and "pages-1.img" in problems[0] and "size 100" in problems[0]
    (base / "pages-1.img").write_bytes(b"y" * 5000)
    assert "sha256" in store.verify(m.id)[0]
    (base / "core-1.img").unlink()
    assert any("core-1.img: missing" in p for p in store.verify(m.id))


def test_resolve_by_prefix_and_ambiguity(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    a = make(store, "alpha")
    b = make(store, "beta")
    assert store.resolve("alpha") == a.id
    assert store.resolve(b.id[:6]) == b.id
    make(store, "alpha")
    with pytest.raises(UsageError, match="ambiguous"):
        store.resolve("alpha")
    with pytest.raises(NotFound):
        store.resolve("gamma")
    with pytest.raises(UsageError):
        store.resolve("../etc")
    assert [m.job_name for m in store.manifests("beta")] == ["beta"]


def test_remove_and_damaged_manifest(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    m = make(store)
    (store.path_of(m.id) / "manifest.json").write_text("{not json")
    with pytest.raises(StoreCorrupt):
        store.load(m.id)
    assert store.manifests() == []  # a damaged snapshot is not offered
    assert store.remove(m.id) == m.id
    assert not store.path_of(m.id).exists()
