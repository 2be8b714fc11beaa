"""Property-based tests (Hypothesis) over every parser here that reads what another party wrote: a snapshot's
manifest, the chunk store's index and its chunks' headers, the NCCL interceptors' control blocks, the clouds'
notice payloads, durations and destinations given on the command line, and the coordinator's request bodies,
credentials and credentials file. Each input ends in a clear
CryosleepError (or the parser's documented error, or a result), never another exception, a hang, or a write
outside the job's files. Deterministic and bounded (``derandomize``, no example database): the whole set runs
in well under a minute."""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cryosleep.capture import files
from cryosleep.capture.outbound import Dest
from cryosleep.coordinator import security, service
from cryosleep.coordinator.client import Http
from cryosleep.core import interceptor as icp
from cryosleep.cut.rules import RankView, max_targets
from cryosleep.errors import CryosleepError, UsageError
from cryosleep.store import auth
from cryosleep.store.backend import LocalBackend
from cryosleep.store.cas import MAGIC, ChunkCorrupt, ChunkStore, WrongKey, chunk_name, decode_chunk
from cryosleep.store.chunking import ChunkSpec
from cryosleep.store.crypto import JobKey
from cryosleep.store.local import LocalStore, hash_tree
from cryosleep.store.manifest import Manifest, NodeImage, StagedFile
from cryosleep.store.retention import parse_age
from cryosleep.triggers import notices
from cryosleep.triggers.schedule import parse_duration

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=100,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=24)
json_values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c,
                                                                                          max_size=4), max_leaves=12)


@pytest.fixture(scope="module")
def home() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="cryosleep-fuzz-") as d:
        old = os.environ.get("CRYOSLEEP_HOME")
        os.environ["CRYOSLEEP_HOME"] = d
        try:
            yield Path(d)
        finally:
            if old is None:
                os.environ.pop("CRYOSLEEP_HOME", None)
            else:
                os.environ["CRYOSLEEP_HOME"] = old


def _paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path (keys and indexes) into a JSON value."""
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*at, i))


def _replace(value: Any, at: tuple[Any, ...], new: Any) -> Any:
    if not at:
        return new
    out = dict(value) if isinstance(value, dict) else list(value)
    out[at[0]] = _replace(value[at[0]], at[1:], new)  # type: ignore[index]
    return out


# ------------------------------------------------------------------------------------------- the manifest


@pytest.fixture(scope="module")
def signed(home: Path) -> tuple[LocalStore, str, dict[str, Any]]:
    """A committed, signed snapshot of a job whose one file to put back is under ``home/job-files``."""
    store = LocalStore(home / "store")
    st_ = store.begin("fuzz")
    node = st_.node_dir(0)
    (node / "criu").mkdir(parents=True)
    (node / "files").mkdir()
    (node / "criu" / "pages-1.img").write_bytes(b"p" * 1000)
    (node / "files" / "0000").write_bytes(b"log")
    m = Manifest(id=st_.id, job={"name": "fuzz", "program": ["p"], "env": {"API_TOKEN": "t", "LR": "1"}},
                 mode="stop", created_at=time.time(),
                 nodes=[NodeImage(0, [0], 1, files=hash_tree(st_.path, ["nodes/0"]),
                                  staged=[StagedFile(str(home / "job-files" / "log"), 3, 0o644, "0000", "x")])],
                 host={}, phases={"dump": 0.1}, pause_s=0.1)
    store.commit(st_, m)
    return store, m.id, json.loads((store.path_of(m.id) / "manifest.json").read_text())


@FUZZ
@given(data=st.data())
def test_an_altered_manifest_is_refused_or_unchanged(signed: tuple[LocalStore, str, dict[str, Any]],
                                                     data: st.DataObject) -> None:
    """Any field of a signed manifest replaced by any JSON value: loading gives StoreCorrupt or a manifest, and
    a manifest that then authenticates is the one signed (so a restore writes only the files it signed)."""
    store, sid, original = signed
    at = data.draw(st.sampled_from(sorted(_paths(original), key=repr)))
    new = data.draw(json_values)
    path = store.path_of(sid) / "manifest.json"
    path.write_text(json.dumps(_replace(original, at, new)))
    try:
        try:
            m = store.load(sid)
        except CryosleepError:
            return
        try:
            auth.authenticate(m, sid)
        except CryosleepError:
            pass
        else:
            assert m.signed_json() == Manifest.from_json(original).signed_json(), at
        store.verify(sid)  # a list of problems, never another error
    finally:
        path.write_text(json.dumps(original))


@FUZZ
@given(raw=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode())
       | st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n))
def test_any_manifest_bytes_load_or_are_refused(home: Path, raw: bytes) -> None:
    store = LocalStore(home / "raw-store")
    d = store.snapshots / "x-1"
    d.mkdir(parents=True, exist_ok=True)
    (d / "manifest.json").write_bytes(raw)
    try:
        m = store.load("x-1")
    except CryosleepError:
        return
    with pytest.raises(CryosleepError):
        auth.authenticate(m, "x-1")  # nothing unsigned passes
    store.verify("x-1")


def _build(root: Path, tree: list[tuple[str, str]]) -> None:
    """The job's files: directories, files, and links out of them, never made through a link or a file."""
    for rel, kind in tree:
        p = root / rel
        if any(a.is_symlink() or (a.exists() and not a.is_dir()) for a in p.parents if root in a.parents):
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists() or p.is_symlink():
            continue
        if kind == "dir":
            p.mkdir()
        elif kind == "file":
            p.write_bytes(b"old")
        else:  # a link out of the job's files
            p.symlink_to(root.parent / "outside")


names = st.sampled_from(["a", "b", "c"])
rel_paths = st.lists(names, min_size=1, max_size=3).map("/".join)


@FUZZ
@given(tree=st.lists(st.tuples(rel_paths, st.sampled_from(["dir", "file", "link"])), max_size=5), target=rel_paths)
def test_a_restore_never_writes_through_a_link(tree: list[tuple[str, str]], target: str) -> None:
    """Files put back at paths whose directories may be links out of the job's files (swapped in after the
    capture): the file lands at its own path, or the restore refuses; nothing is ever written outside."""
    with tempfile.TemporaryDirectory(prefix="cryosleep-fuzz-") as d:
        jobs, outside = Path(d) / "job", Path(d) / "outside"
        jobs.mkdir()
        outside.mkdir()
        _build(jobs, tree)
        copies = Path(d) / "copies"
        copies.mkdir()
        (copies / "0000").write_bytes(b"new!")
        staged = [StagedFile(str(jobs / target), 4, 0o644, "0000", None)]
        try:
            files.restore(staged, copies)
        except CryosleepError:
            pass
        else:
            assert (jobs / target).read_bytes() == b"new!" and not (jobs / target).is_symlink()
        assert list(outside.iterdir()) == []


# ------------------------------------------------------------------------------------ the chunk store


@FUZZ
@given(data=st.data())
def test_any_chunk_index_loads_or_is_refused_and_writes_only_under_dest(home: Path, data: st.DataObject) -> None:
    root = home / "cas"
    store = ChunkStore(LocalBackend(str(root)), spec=ChunkSpec("fixed", 4096))
    src = home / "cas-src"
    src.mkdir(exist_ok=True)
    (src / "a.img").write_bytes(b"x" * 5000)
    if "good" not in store.snapshot_ids():
        store.put_snapshot("good", "j", src, ["a.img"])
    original = json.loads(store.backend.get("snapshots/good.json"))
    doc = data.draw(json_values | st.builds(lambda at, v: _replace(original, at, v),
                                            st.sampled_from(sorted(_paths(original), key=repr)), json_values))
    store.backend.put("snapshots/fz.json", json.dumps(doc).encode())
    dest = home / "dest" / "fz"
    try:
        store.restore("fz", dest)
    except CryosleepError:
        pass
    for p in (home / "dest").rglob("*"):  # nothing outside dest: every path stays below it
        assert p == dest or dest in p.parents, p
    assert not (home / "escaped").exists()


zstd_forged = st.builds(lambda size, tail: b"\x28\xb5\x2f\xfd\xe0" + struct.pack("<Q", size) + tail,
                        st.integers(0, 2**64 - 1), st.binary(max_size=16))


@FUZZ
@given(body=st.binary(max_size=200) | zstd_forged, flags=st.integers(0, 255), sealed_key=st.booleans())
def test_any_chunk_bytes_decode_or_are_refused(body: bytes, flags: int, sealed_key: bool) -> None:
    """Random chunk bodies behind a valid header, and zstd frames claiming any size (a 2**40-byte claim used to
    end in MemoryError): ChunkCorrupt or WrongKey, nothing else, and nothing large allocated."""
    key = JobKey.from_secret(b"k" * 32) if sealed_key else None
    for blob in (body, MAGIC + bytes([flags]) + body, MAGIC + b"\x01" + body):
        try:
            decode_chunk("0" * 64, blob, key, expected_key_id=key.key_id if key else None, limit=1 << 20)
        except (ChunkCorrupt, WrongKey):
            pass


def test_a_chunk_claiming_a_huge_size_is_refused_before_allocating() -> None:
    frame = b"\x28\xb5\x2f\xfd\xe0" + struct.pack("<Q", 1 << 40) + b"\x01\x00\x00"
    assert zstandard.frame_content_size(frame) == 1 << 40
    with pytest.raises(ChunkCorrupt, match="claims 1099511627776 bytes"):
        decode_chunk("0" * 64, MAGIC + b"\x01" + frame, None)


# ------------------------------------------------------------------------------- NCCL control blocks


@FUZZ
@given(words=st.dictionaries(st.integers(0, (icp.BLOCK_SIZE - 8) // 8), st.integers(0, 2**64 - 1), max_size=40),
       header=st.dictionaries(st.sampled_from([icp.H_STATE, icp.H_CMD, icp.H_SLOTS_USED, icp.H_FLAGS, icp.H_PID,
                                               icp.H_DEVMEM_BYTES, icp.H_STAGE_BYTES]),
                              st.integers(0, 2**64 - 1)))
def test_any_control_block_reads_as_values(home: Path, words: dict[int, int], header: dict[int, int]) -> None:
    """A worker's control block holding anything (the agent reads what a job's process wrote): every reader
    the agent uses returns values, and the cut computed from them is a dict, never an exception."""
    raw = bytearray(icp.BLOCK_SIZE)
    for i, v in words.items():
        struct.pack_into("<Q", raw, 8 * i, v)
    for off, v in header.items():
        struct.pack_into("<Q" if off in (icp.H_STATE, icp.H_CMD, icp.H_DEVMEM_BYTES, icp.H_STAGE_BYTES) else "<I",
                         raw, off, v & (2**64 - 1 if off in (icp.H_STATE, icp.H_CMD) else 0xFFFFFFFF))
    struct.pack_into("<QII", raw, icp.H_MAGIC, icp.MAGIC, icp.VERSION, icp.BLOCK_SIZE)
    path = home / "ctl.block"
    path.write_bytes(bytes(raw))
    with icp.ControlBlock(path) as b:
        assert b.published()
        b.state(), b.cmd(), b.flag_names(), b.settled(), b.devmem, b.error
        comms = b.comms()
        for s in comms:
            b.uid(s.index)
        view = RankView(0, tuple(comms), b.held, b.busy, b.in_group, b.targets_gen, *b.settled(), b.premul_live)
        assert isinstance(max_targets([view]), dict)


# ----------------------------------------------------------------------------------- cloud notices


@FUZZ
@given(body=st.binary(max_size=120) | json_values.map(lambda v: json.dumps(v).encode())
       | st.builds(lambda ev: json.dumps({"Events": ev}).encode(), json_values)
       | st.builds(lambda a, t: json.dumps({"action": a, "time": t}).encode(), json_values, json_values),
       status=st.sampled_from([200, 200, 200, 404, 500]))
def test_any_notice_payload_is_a_notice_none_or_an_endpoint_error(body: bytes, status: int) -> None:
    def answer(method: str, url: str, headers: Any, timeout: float, data: bytes | None = None) -> tuple[
            int, dict[str, str], bytes]:
        return (200, {}, b"token") if url.endswith("/api/token") else (status, {}, body)

    saved = notices._request
    notices._request = answer  # the HTTP layer is not what is under test: what the watcher makes of the answer
    try:
        for w in (notices.AwsWatcher("http://aws"), notices.GceWatcher("http://gce"),
                  notices.AzureWatcher("http://azure", vm_name="vm-1")):
            try:
                got = w.check()
            except notices.NoticeEndpointError:
                continue
            assert got is None or (isinstance(got, notices.Notice) and math.isfinite(got.deadline))
    finally:
        notices._request = saved


# ------------------------------------------------------------------- durations and destinations (CLI)


@FUZZ
@given(text=st.text(max_size=24) | st.from_regex(r"\A-?[0-9.e]{1,8}(ms|s|m|h|d|w)?\Z")
       | st.sampled_from(["nan", "inf", "-inf", "1e309", "1e308w", "-1d", "0", "²", "1h30m"]))
def test_durations_are_finite_positive_or_refused(text: str) -> None:
    try:
        seconds = parse_duration(text)
    except UsageError:
        pass
    else:
        assert math.isfinite(seconds) and seconds > 0
    try:
        age = parse_age(text)
    except ValueError:
        pass
    else:
        assert math.isfinite(age) and age >= 0, text


@FUZZ
@given(text=st.text(max_size=30) | st.from_regex(r"\A\[?[0-9a-f:.]{0,20}\]?(:[0-9²³]{0,6})?(/[0-9]{1,3})?\Z"))
def test_destinations_parse_or_are_refused(text: str) -> None:
    try:
        d = Dest.parse(text)
    except UsageError:
        return
    assert d.port is None or 0 < d.port < 65536
    assert Dest.parse(str(d)) == d


# ------------------------------------------------------------------- the coordinator's requests


@pytest.fixture(scope="module")
def coordinator(home: Path) -> Iterator[tuple[service.Server, str]]:
    token = "fuzz-admin-" + os.urandom(8).hex()
    cfg = service.ServiceConfig(poll_wait_s=0.01, lost_after_s=1.0, rollback_s=2.0, redeliver_s=0.5,
                                default_timeout_s=2.0)
    srv, _ = service.start("127.0.0.1:0", home / "fuzz-catalog.db", token, cfg, log=lambda _m: None)
    h = Http(srv.url, token)
    h.call("POST", "/v1/agents/register", {"job": "fz", "nnodes": 1, "node_rank": 0, "incarnation": "i"})
    yield srv, token
    h.close()
    service.shutdown(srv)
    srv.coordinator.catalog.close()


ROUTE_PATHS = [(m, pat.pattern.strip("^$"), name) for m, pat, name in service.ROUTES]
FIELDS = sorted({k for f in security.BODY_FIELDS.values() for k in f} | {"prefix", "min", "put", "value"})


def _clamp_waits(v: Any) -> Any:
    """The service bounds every wait itself (30 s at most); the fuzzer's examples must not each take that long."""
    if isinstance(v, dict):
        return {k: (0 if k == "wait_s" and isinstance(v[k], int | float) and not isinstance(v[k], bool)
                    else _clamp_waits(v[k])) for k in v}
    return [_clamp_waits(x) for x in v] if isinstance(v, list) else v


@FUZZ
@given(route=st.sampled_from(ROUTE_PATHS), param=st.sampled_from(["fz", "fz@0", "sim", "..", "%00"]) | st.text(
       "abc@-_%./", max_size=8),
       body=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), json_values, max_size=6)
       | json_values, query=st.sampled_from(["", "?valid=1", "?job=fz", "?wait_s=x", "?wait_s=0&seen=1"]))
def test_any_request_body_is_answered_or_refused_never_a_crash(coordinator: tuple[service.Server, str],
                                                               route: tuple[str, str, str], param: str, body: Any,
                                                               query: str) -> None:
    """Any JSON (or not) to any endpoint, as an admin (the widest access): an answer, or a 4xx error with what,
    why and what to do; never a 500 (an exception the service did not expect)."""
    srv, token = coordinator
    method, pattern, _name = route
    path = re.sub(r"\(\?P<[a-z]+>\[\^/\]\+\)", param.replace("/", "%2F") or "x", pattern) + query
    h = Http(srv.url, token)
    try:
        h.call(method, path, _clamp_waits(body) if method == "POST" else None)
    except CryosleepError as e:
        assert type(e) is not CryosleepError and e.what, (path, body, e)
    finally:
        h.close()


@settings(FUZZ, max_examples=50)
@given(header=st.text(max_size=80) | st.builds(lambda t: f"Bearer {security.AGENT_PREFIX}{t}", st.text(max_size=80)),
       doc=json_values)
def test_any_credential_or_credentials_file_is_a_principal_none_or_refused(header: str, doc: Any) -> None:
    creds = security.Credentials.parse({"admin": ["a" * 16], "tenants": {"t": {"tokens": ["b" * 16],
                                                                              "jobs": ["t-*"]}}})
    got = creds.authenticate(header)
    assert got is None or got.role in security.ROLES
    try:
        security.Credentials.parse(doc)
    except UsageError as e:
        assert e.why


def test_regressions_found_by_the_fuzzer() -> None:
    """Each fixed: an age of nan or -1d, a port written in superscript digits, an Events that is no list."""
    for bad in ("nan", "inf", "-1d", "1e308w"):
        with pytest.raises(ValueError):
            parse_age(bad)
    with pytest.raises(UsageError):
        Dest.parse("10.0.0.1:²")
    saved = notices._request
    notices._request = lambda *a, **k: (200, {}, b'{"Events": 5}')
    try:
        with pytest.raises(notices.NoticeEndpointError):
            notices.AzureWatcher("http://azure", vm_name="vm").check()
    finally:
        notices._request = saved
    assert chunk_name("ab" * 32).startswith("chunks/ab/")
