"""The content-addressed store through each backend (a local directory, and a real S3 server)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from cryosleep.errors import ChunkCorrupt, WrongKey
from cryosleep.store.backend import Backend
from cryosleep.store.cas import ChunkStore, chunk_name
from cryosleep.store.chunking import ChunkSpec
from cryosleep.store.crypto import JobKey

from .helpers import image_bytes, write

SPEC = ChunkSpec("fixed", 1 << 20)


def test_round_trip_of_a_multi_mb_file(backend: Backend, tmp_path: Path) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    data = image_bytes(1, 12 << 20)
    write(src, "nodes/0/criu/pages-1.img", data)
    write(src, "nodes/0/criu/core-1.img", b"small file")
    write(src, "nodes/0/criu/empty.img", b"")
    store = ChunkStore(backend, spec=SPEC)
    res = store.put_snapshot("job-1", "job", src, ["nodes/0/criu/pages-1.img", "nodes/0/criu/core-1.img",
                                                   "nodes/0/criu/empty.img"], manifest=None)
    assert res.uploaded == res.unique == 13 and res.present == 0
    assert res.bytes_sent < len(data)  # zstd found the zeros and the text
    store.restore("job-1", dest)
    assert (dest / "nodes/0/criu/pages-1.img").read_bytes() == data
    assert (dest / "nodes/0/criu/core-1.img").read_bytes() == b"small file"
    assert (dest / "nodes/0/criu/empty.img").read_bytes() == b""
    snap = store.load("job-1")
    f = next(f for f in snap.files if f.path.endswith("pages-1.img"))
    assert f.sha256 == hashlib.sha256(data).hexdigest() and f.size == len(data)
    assert [c.offset for c in f.chunks] == [i << 20 for i in range(12)]
    _, problems, checked = store.verify("job-1")
    assert problems == [] and checked == 13
    # The chunks really are in the backend, named by the SHA-256 of their plaintext.
    first = f.chunks[0]
    assert first.address == hashlib.sha256(data[: 1 << 20]).hexdigest()
    assert backend.exists(chunk_name(first.address))


def test_dedup_across_two_files_sharing_content(backend: Backend, tmp_path: Path) -> None:
    shared = image_bytes(2, 6 << 20)
    a = shared + image_bytes(3, 2 << 20)
    b = image_bytes(4, 2 << 20) + shared  # shared content, at another (aligned) offset
    write(tmp_path, "rank0/pages.img", a)
    write(tmp_path, "rank1/pages.img", b)
    store = ChunkStore(backend, spec=SPEC)
    res = store.put_snapshot("s1", "job", tmp_path, ["rank0/pages.img", "rank1/pages.img"])
    assert res.chunks == 16 and res.unique == 10 and res.uploaded == 10
    # A second snapshot of the same content sends nothing.
    res2 = store.put_snapshot("s2", "job", tmp_path, ["rank0/pages.img", "rank1/pages.img"])
    assert res2.uploaded == 0 and res2.present == 10
    assert len(list(backend.list("chunks/"))) == 10
    assert store.load("s2").seq == 2


def test_cdc_finds_shifted_content(backend: Backend, tmp_path: Path) -> None:
    shared = image_bytes(5, 8 << 20)
    write(tmp_path, "a.img", shared)
    write(tmp_path, "b.img", b"x" * 12345 + shared)  # the same bytes, shifted by an unaligned amount
    store = ChunkStore(backend, spec=ChunkSpec("cdc", 512 << 10))
    res = store.put_snapshot("s", "job", tmp_path, ["a.img", "b.img"])
    assert res.uploaded < 0.6 * res.chunks  # most of b's chunks were a's
    store.restore("s", tmp_path / "out")
    assert (tmp_path / "out/b.img").read_bytes() == b"x" * 12345 + shared


def _flip_a_bit(backend: Backend, name: str, at: int) -> None:
    blob = bytearray(backend.get(name))
    blob[at] ^= 0x10
    backend.put(name, bytes(blob))


@pytest.mark.parametrize("encrypted", [False, True])
def test_a_flipped_bit_is_caught_and_the_chunk_named(backend: Backend, tmp_path: Path, encrypted: bool) -> None:
    write(tmp_path, "pages.img", image_bytes(6, 4 << 20))
    key = JobKey.from_secret(bytes(range(32))) if encrypted else None
    store = ChunkStore(backend, spec=SPEC)
    store.put_snapshot("s", "job", tmp_path, ["pages.img"], key=key)
    victim = store.load("s").files[0].chunks[2]
    _flip_a_bit(backend, chunk_name(victim.address), at=100)
    _, problems, checked = store.verify("s", key=key)
    assert checked == 4
    assert [p.chunk for p in problems] == [victim.address]
    assert problems[0].file == "pages.img" and problems[0].offset == 2 << 20
    assert victim.address in problems[0].what
    with pytest.raises(ChunkCorrupt, match=victim.address):
        store.restore("s", tmp_path / "out", key=key)
    assert not (tmp_path / "out/pages.img").exists()  # nothing half-written under the final name


def test_wrong_key_fails_clearly_naming_the_chunk(backend: Backend, tmp_path: Path) -> None:
    write(tmp_path, "pages.img", image_bytes(7, 2 << 20))
    right, wrong = JobKey.from_secret(os.urandom(32), "right.key"), JobKey.from_secret(os.urandom(32), "wrong.key")
    store = ChunkStore(backend, spec=SPEC)
    store.put_snapshot("s", "job", tmp_path, ["pages.img"], key=right)
    first = store.load("s").files[0].chunks[0].address
    with pytest.raises(WrongKey) as err:
        store.restore("s", tmp_path / "out", key=wrong)
    text = str(err.value)
    assert first in text and "wrong key" in text and wrong.key_id in text and right.key_id in text
    with pytest.raises(WrongKey, match="no key was given"):
        store.restore("s", tmp_path / "out")
    _, problems, _ = store.verify("s", key=wrong)
    assert len(problems) == 1 and problems[0].chunk == first and "wrong key" in problems[0].what
    store.restore("s", tmp_path / "out", key=right)
    assert (tmp_path / "out/pages.img").read_bytes() == (tmp_path / "pages.img").read_bytes()


def test_encrypted_addresses_leak_no_plaintext_hash(backend: Backend, tmp_path: Path) -> None:
    data = image_bytes(8, 3 << 20)
    write(tmp_path, "pages.img", data)
    store = ChunkStore(backend, spec=SPEC)
    k1, k2 = JobKey.from_secret(b"1" * 32), JobKey.from_secret(b"2" * 32)
    store.put_snapshot("a", "job-a", tmp_path, ["pages.img"], key=k1)
    store.put_snapshot("b", "job-b", tmp_path, ["pages.img"], key=k2)
    store.put_snapshot("c", "job-c", tmp_path, ["pages.img"])
    a, b, c = (store.load(x).addresses() for x in "abc")
    plain = {hashlib.sha256(data[i : i + (1 << 20)]).hexdigest() for i in range(0, len(data), 1 << 20)}
    assert c == plain
    assert not (a & plain) and not (b & plain) and not (a & b)  # one address space per key
    stored = {o.name.rsplit("/", 1)[-1] for o in backend.list("chunks/")}
    assert stored == a | b | c
    # The sealed bytes do not contain the plaintext either (these chunks compress: check a raw window).
    blob = backend.get(chunk_name(sorted(a)[0]))
    assert blob[:4] == b"CSC1" and blob[4] & 2
    assert store.load("a").encryption == {"algorithm": "AES-256-GCM", "key_id": k1.key_id, "address": "hmac-sha256"}


def test_backend_contract(backend: Backend) -> None:
    import io

    big = os.urandom(40 << 20)  # over the S3 part size: a multipart upload with parts in parallel
    info = backend.put_stream("blobs/big", io.BytesIO(big), len(big))
    assert info.size == len(big)
    with backend.open("blobs/big") as f:
        assert hashlib.sha256(f.read()).digest() == hashlib.sha256(big).digest()
    backend.put("snapshots/a.json", b"{}")
    backend.put("snapshots/ab.json", b"{}")
    backend.put("snapshotsX", b"")
    assert sorted(o.name for o in backend.list("snapshots/a")) == ["snapshots/a.json", "snapshots/ab.json"]
    assert sorted(o.name for o in backend.list("")) == ["blobs/big", "snapshots/a.json", "snapshots/ab.json",
                                                        "snapshotsX"]
    assert backend.get("snapshots/a.json") == b"{}" and backend.exists("snapshots/a.json")
    backend.delete("snapshots/a.json")
    backend.delete("snapshots/a.json")  # twice: not an error
    assert backend.stat("snapshots/a.json") is None and not backend.exists("snapshots/a.json")
    from cryosleep.errors import ObjectNotFound

    with pytest.raises(ObjectNotFound):
        backend.get("snapshots/a.json")
