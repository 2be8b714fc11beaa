"""A pre-copied node's image (docs/precopy.md): the final dump in ``criu/``, its pre-dump in ``criu-pre/`` and the
``criu/parent`` link CRIU reads it through. The manifest's ``precopy`` record, the checksum, the local store's
commit and verify, and a chunk store's upload and fetch all take both directories and the link."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from cryosleep.errors import StoreCorrupt
from cryosleep.store import persist
from cryosleep.store.local import LocalStore, hash_tree
from cryosleep.store.manifest import PRECOPY_PARENT, Manifest, ManifestError, NodeImage, Precopy

from .helpers import image_bytes


def precopied(store: LocalStore, seed: int = 1) -> Manifest:
    """A committed snapshot as a pre-copied capture leaves it: pages in both directories, CRIU's link."""
    st = store.begin("job")
    node = st.node_dir(0)
    (node / "criu").mkdir(parents=True)
    (node / PRECOPY_PARENT).mkdir()
    (node / PRECOPY_PARENT / "pages-1.img").write_bytes(image_bytes(seed, 3 << 20))
    (node / PRECOPY_PARENT / "pagemap-1.img").write_bytes(b"pre")
    (node / "criu" / "pages-1.img").write_bytes(image_bytes(seed + 1, 64 << 10))
    os.symlink(f"../{PRECOPY_PARENT}", node / "criu" / "parent")  # as CRIU makes it: relative
    files = hash_tree(st.path, ["nodes/0"])
    m = Manifest(id=st.id, job={"name": "job", "program": ["train.py"], "env": {}}, mode="keep-running",
                 created_at=time.time(), host={}, phases={}, pause_s=0.1,
                 nodes=[NodeImage(0, [0], 1, files=files, precopy=Precopy(parent=PRECOPY_PARENT, freeze_s=0.05,
                                                                          tracked=2, processes=3))])
    store.commit(st, m)
    return m


def test_the_record_is_absent_when_none_and_round_trips_when_there() -> None:
    plain = Manifest(id="x", job={"name": "job"}, mode="stop", created_at=1.0, host={}, phases={}, pause_s=0.0,
                     nodes=[NodeImage(0, [0], 1)])
    assert "precopy" not in plain.to_json()["nodes"][0]  # a manifest of before re-serializes as it was signed
    assert plain.links() == {}
    why = Manifest.from_json(json.loads(plain.dumps()))
    why.nodes[0].precopy = Precopy(why="criu-uffd is not built")
    again = Manifest.from_json(json.loads(why.dumps()))
    assert again.nodes[0].precopy == Precopy(why="criu-uffd is not built") and again.links() == {}
    again.nodes[0].precopy = Precopy(parent=PRECOPY_PARENT, pages_parent=7)
    assert again.links() == {"nodes/0/criu/parent": f"../{PRECOPY_PARENT}"}
    assert Manifest.from_json(json.loads(again.dumps())).nodes[0].precopy == Precopy(parent=PRECOPY_PARENT,
                                                                                    pages_parent=7)
    for bad in ("/etc", "../../x", "criu"):  # the link's target is never the manifest's to choose
        again.nodes[0].precopy = Precopy(parent=bad)
        with pytest.raises(ManifestError):
            again.links()
    with pytest.raises(ManifestError):
        Manifest.from_json({**again.to_json(), "nodes": [{**again.to_json()["nodes"][0], "precopy": {"parent": 3}}]})


def test_both_directories_are_hashed_and_the_link_verified(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    m = precopied(store)
    paths = {f.path for f in m.nodes[0].files}
    assert {"nodes/0/criu/pages-1.img", f"nodes/0/{PRECOPY_PARENT}/pages-1.img"} <= paths
    assert "nodes/0/criu/parent" not in paths and not any(p.startswith("nodes/0/criu/parent/") for p in paths)
    assert store.verify(m.id) == []
    link = store.path_of(m.id) / "nodes/0/criu/parent"
    link.unlink()
    os.symlink("/", link)  # another target: what CRIU would read is not the image
    assert any("not the link" in p for p in store.verify(m.id))
    link.unlink()
    assert any("missing (the link" in p for p in store.verify(m.id))
    os.symlink(f"../{PRECOPY_PARENT}", link)
    os.symlink(f"../{PRECOPY_PARENT}", store.path_of(m.id) / "nodes/0/criu/other")  # a link nobody described
    assert any("other: not in the manifest" in p for p in store.verify(m.id))


def test_a_chunk_store_round_trip_brings_the_link_back(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    m = precopied(store, 5)
    p = persist.Persister("job", persist.RemoteConfig(str(tmp_path / "remote"), local_keep=5))
    assert p.persist_now(store, m, time.monotonic() + 60).state == "persisted"
    assert p.close(timeout=60)
    elsewhere = LocalStore(tmp_path / "elsewhere")
    got, _ = persist.fetch(tmp_path / "remote", m.id, elsewhere)
    base = elsewhere.path_of(got.id)
    assert os.readlink(base / "nodes/0/criu/parent") == f"../{PRECOPY_PARENT}"
    assert (base / "nodes/0/criu/parent/pages-1.img").read_bytes() == image_bytes(5, 3 << 20)
    assert elsewhere.verify(got.id) == []


def test_a_commit_refuses_a_file_where_the_link_belongs(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    st = store.begin("job")
    (st.node_dir(0) / "criu").mkdir(parents=True)
    (st.node_dir(0) / "criu" / "parent").write_bytes(b"not a link")
    m = Manifest(id=st.id, job={"name": "job", "env": {}}, mode="stop", created_at=1.0, host={}, phases={},
                 pause_s=0.0, nodes=[NodeImage(0, [0], 1, precopy=Precopy(parent=PRECOPY_PARENT))])
    with pytest.raises(StoreCorrupt):
        store.commit(st, m)
