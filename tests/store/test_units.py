"""Chunking, keys and S3 settings: the pure parts."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from cryosleep.errors import CryosleepError, UsageError
from cryosleep.store.chunking import ChunkSpec, candidates, iter_chunks
from cryosleep.store.crypto import JobKey, load_key
from cryosleep.store.s3 import aws_settings

from .helpers import image_bytes


@pytest.mark.parametrize("spec", [ChunkSpec("fixed", 100_000), ChunkSpec("cdc", 64 << 10),
                                  ChunkSpec("cdc", 64 << 10, align=4096)])
def test_chunks_cover_the_stream_and_do_not_depend_on_reads(spec: ChunkSpec) -> None:
    data = image_bytes(1, 3 << 20)
    cuts = [(o, len(b)) for o, b in iter_chunks(io.BytesIO(data), spec)]
    assert sum(n for _, n in cuts) == len(data) and cuts[0][0] == 0
    assert all(o + n == cuts[i + 1][0] for i, (o, n) in enumerate(cuts[:-1]))
    if spec.method == "cdc":
        assert all(spec.lo <= n <= spec.hi for _, n in cuts[:-1])
        assert all(o % spec.align == 0 for o, _ in cuts)
        for read in (4096, 77_777, 1 << 20):
            assert [(o, len(b)) for o, b in iter_chunks(io.BytesIO(data), spec, read_size=read)] == cuts
    back = ChunkSpec.from_json(spec.to_json())
    assert (back.method, back.avg, back.lo, back.hi, back.align) == (spec.method, spec.avg, spec.lo, spec.hi,
                                                                     spec.align)


def test_page_aligned_candidates_are_the_aligned_subset() -> None:
    data = os.urandom(1 << 20)
    every = candidates(data, 4)
    for phase in (0, 100, 4095):
        assert list(candidates(data, 4, 4096, phase)) == [p for p in every if (p + phase) % 4096 == 0]


def test_page_aligned_cdc_finds_content_moved_by_whole_pages() -> None:
    shared = os.urandom(4 << 20)
    spec = ChunkSpec("cdc", 256 << 10, align=4096)
    a = {b for _, b in iter_chunks(io.BytesIO(os.urandom(3 * 4096) + shared), spec)}
    b = {b for _, b in iter_chunks(io.BytesIO(os.urandom(7 * 4096) + shared), spec)}
    assert sum(len(x) for x in a & b) > 0.8 * len(shared)


def test_cdc_resynchronises_after_an_insertion() -> None:
    data = os.urandom(4 << 20)
    spec = ChunkSpec("cdc", 64 << 10)
    a = {b for _, b in iter_chunks(io.BytesIO(data), spec)}
    b = {b for _, b in iter_chunks(io.BytesIO(data[:1000] + b"inserted" + data[1000:]), spec)}
    assert len(a & b) >= len(a) - 3
    fixed = ChunkSpec("fixed", 64 << 10)
    fa = {b for _, b in iter_chunks(io.BytesIO(data), fixed)}
    fb = {b for _, b in iter_chunks(io.BytesIO(data[:1000] + b"inserted" + data[1000:]), fixed)}
    assert len(fa & fb) == 0  # the shift defeats fixed-size chunks


def test_invalid_specs() -> None:
    with pytest.raises(ValueError):
        ChunkSpec("cdc", 64, 10, 1000)
    with pytest.raises(ValueError):
        ChunkSpec("cdc", 1 << 20, 1000, 4 << 20, align=4096)
    with pytest.raises(ValueError):
        ChunkSpec("fixed", 0)


def test_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = os.urandom(32)
    assert load_key("job") is None
    with pytest.raises(CryosleepError, match="no key for job"):
        load_key("job", required=True)
    monkeypatch.setenv("CRYOSLEEP_KEY", secret.hex())
    k_env = load_key("job")
    assert k_env is not None and k_env.key_id == JobKey.from_secret(secret).key_id
    monkeypatch.delenv("CRYOSLEEP_KEY")
    f = tmp_path / "k"
    f.write_bytes(secret)
    f.chmod(0o644)
    with pytest.raises(UsageError, match="readable by others"):
        load_key("job", f)
    f.chmod(0o600)
    assert load_key("job", f) == JobKey.from_secret(secret, str(f))
    f.write_text("not a key")
    with pytest.raises(UsageError, match="not 32 bytes"):
        load_key("job", f)
    home_key = tmp_path / "home" / "keys" / "job.key"  # $CRYOSLEEP_HOME is tmp_path/home (conftest)
    home_key.parent.mkdir(parents=True)
    import base64

    home_key.write_text(base64.b64encode(secret).decode() + "\n")
    home_key.chmod(0o600)
    k_home = load_key("job")
    assert k_home is not None and k_home.key_id == k_env.key_id and load_key("other") is None


def test_keys_give_distinct_address_spaces() -> None:
    k1, k2 = JobKey.from_secret(b"a" * 32), JobKey.from_secret(b"b" * 32)
    h = bytes(32)
    assert k1.address(h) != k2.address(h) and k1.address(h) != h.hex()
    blob = k1.seal(b"payload", b"aad")
    assert k1.open(blob, b"aad") == b"payload"
    from cryosleep.store.crypto import DecryptError

    with pytest.raises(DecryptError):
        k2.open(blob, b"aad")
    with pytest.raises(DecryptError):
        k1.open(blob, b"other aad")


def test_aws_settings_from_env_and_files(tmp_path: Path) -> None:
    aws = tmp_path / ".aws"
    aws.mkdir()
    (aws / "credentials").write_text("[default]\naws_access_key_id = AK1\naws_secret_access_key = S1\n"
                                     "[work]\naws_access_key_id = AK2\naws_secret_access_key = S2\n")
    (aws / "config").write_text("[default]\nregion = eu-west-1\n[profile work]\nregion = us-west-2\n"
                                "endpoint_url = http://127.0.0.1:9000\n")
    home = {"HOME": str(tmp_path)}
    assert aws_settings(home) == {"access_key_id": "AK1", "secret_access_key": "S1", "region": "eu-west-1"}
    assert aws_settings({**home, "AWS_PROFILE": "work"}) == {
        "access_key_id": "AK2", "secret_access_key": "S2", "region": "us-west-2", "endpoint": "http://127.0.0.1:9000"}
    env = {**home, "AWS_ACCESS_KEY_ID": "AK3", "AWS_SECRET_ACCESS_KEY": "S3", "AWS_SESSION_TOKEN": "T",
           "AWS_REGION": "ap-south-1", "CRYOSLEEP_S3_ENDPOINT": "http://127.0.0.1:1/"}
    assert aws_settings(env) == {"access_key_id": "AK3", "secret_access_key": "S3", "session_token": "T",
                                 "region": "ap-south-1", "endpoint": "http://127.0.0.1:1"}


def test_a_store_url_names_its_backend_by_scheme() -> None:
    """store.urls.SCHEMES is where a backend is named: its scheme is remote, folded slashes mended, the module
    imported only for its URLs; other schemes are refused with the list."""
    from cryosleep.store import urls
    from cryosleep.store.backend import LocalBackend
    from cryosleep.store.s3 import S3Backend

    assert urls.normalize_url("s3:/bucket/p") == "s3://bucket/p" and urls.is_remote("s3:/bucket")
    assert not urls.is_remote("/srv/store") and not urls.is_remote(None)
    b = urls.open_backend("s3:/bucket/a/b")
    assert isinstance(b, S3Backend) and (b.bucket, b.prefix) == ("bucket", "a/b")
    assert isinstance(urls.open_backend("/srv/store"), LocalBackend)
    with pytest.raises(UsageError, match="unsupported store URL") as e:
        urls.open_backend("gs://bucket")
    assert "s3" in e.value.why
    with pytest.raises(UsageError, match="invalid store URL"):
        urls.open_backend("s3://")


def test_the_nccl_section_is_typed_and_its_json_unchanged() -> None:
    """NodeImage.nccl is a NcclCut: read into typed ranks and communicators, written back as the same JSON (what the
    MAC of a manifest signed before covers), ``{}`` when no worker called NCCL; anything else is refused."""
    import json

    from cryosleep.store.manifest import Manifest, ManifestError, NcclCut

    comm = {"ident": "fedcba9876543210", "vid": 1, "rank": 0, "nranks": 2, "seq": 12, "sent": 3, "received": 3,
            "rebuild": 1, "state": 1, "device": 0}
    nccl = {"generation": 40, "ranks": [{"rank": 0, "ctl": "/run/j/rank-0.ctl", "pid": 7, "nccl_version": 22809,
                                         "comms": [comm]}]}
    doc = {"format": 1, "id": "s", "job": {"name": "j"}, "mode": "stop", "created_at": 0.0, "host": {}, "phases": {},
           "pause_s": 0.0, "nodes": [{"node_rank": 0, "ranks": [0, 1], "init_pid": 1, "nccl": nccl},
                                     {"node_rank": 1, "ranks": [2, 3], "init_pid": 1, "nccl": {}}]}
    m = Manifest.from_json(json.loads(json.dumps(doc)))
    cut = m.nodes[0].nccl
    assert isinstance(cut, NcclCut) and cut.generation == 40 and cut.ranks[0].comms[0].seq == 12
    assert m.nodes[1].nccl == NcclCut() and not m.nodes[1].nccl.ranks
    out = m.to_json()
    assert out["nodes"][0]["nccl"] == nccl and out["nodes"][1]["nccl"] == {}
    assert Manifest.from_json(json.loads(m.dumps())).signed_json() == m.signed_json()
    for bad in ([], {"ranks": 5}, {"ranks": [{"rank": 0}]}, {"ranks": [{**nccl["ranks"][0], "comms": [{"seq": 1}]}]},
                {"ranks": [{**nccl["ranks"][0], "comms": [{**comm, "seq": "12"}]}]}):
        with pytest.raises(ManifestError):
            Manifest.from_json({**doc, "nodes": [{**doc["nodes"][0], "nccl": bad}]})


def test_the_gpu_and_outbound_sections_are_typed_and_old_manifests_still_verify(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """NodeImage.gpu is a NodeGpu and NodeImage.outbound a NodeOutbound. The manifests of data/ were written and
    signed by the code before (every shape those sections took: CPU and GPU nodes, the stand-in fast path of a
    real run, fast-path ranks from before pieces and plans, each outbound policy): each reads into typed fields,
    writes back byte for byte the JSON it was read from, and its MAC verifies. A section half-written is refused."""
    import json

    from cryosleep.store import auth
    from cryosleep.store.manifest import DevmemPiece, Manifest, ManifestError, NodeGpu, NodeOutbound

    data = json.loads((Path(__file__).parent / "data" / "manifests-before-typed-sections.json").read_text())
    monkeypatch.setenv("CRYOSLEEP_SIGN_KEY", data["key"])
    shapes = {}
    for case in data["manifests"]:
        raw = json.dumps(case["manifest"], indent=2, sort_keys=True)
        m = Manifest.from_json(json.loads(raw))
        assert m.dumps() == raw, case["shape"]
        assert auth.authenticate(m, m.id).startswith("signed with key"), case["shape"]
        assert isinstance(m.nodes[0].gpu, NodeGpu) and isinstance(m.nodes[0].outbound, NodeOutbound)
        shapes[case["shape"]] = m.nodes[0]
    assert len(shapes) == 8
    assert shapes["cpu, before outbound"].gpu == NodeGpu()
    assert shapes["cpu, before outbound"].outbound == NodeOutbound()
    gpu = shapes["GPU, no fast path"].gpu
    assert gpu.driver == 12080 and [g.name for g in gpu.gpus] == ["NVIDIA H200"] * 2 and gpu.cuda_pids == [41, 57]
    assert gpu.fast_path is None
    out = shapes["outbound reset and kept"].outbound
    assert [c.drained for c in out.reset] == [True, False] and out.undrained == out.reset[1:]
    assert out.kept[0].queued_before is None and out.internal == 4 and out.waited_s == 1.5021
    assert shapes["outbound policy only"].outbound.waited_s is None
    real = shapes["stand-in fast path (real)"].gpu.fast_path
    assert real is not None and real.ranks["0"].image_pieces()[1] == DevmemPiece("devmem/rank-0.devmem.001",
                                                                                 1 << 20, 1 << 20)
    old = shapes["GPU, fast path before pieces and plans"].gpu.fast_path
    assert old is not None and old.ranks["0"].image_pieces() == [DevmemPiece("devmem/rank-0.devmem", 0, 1 << 20)]
    assert old.ranks["1"].image_pieces() == [] and old.plain == {"1": "it did not offload in time"}

    doc = data["manifests"][3]["manifest"]
    node = doc["nodes"][0]
    half_gpu = {"driver": 12080}
    half_outbound = {k: v for k, v in node["outbound"].items() if k != "kept"}
    bad_conn = {**node["outbound"], "reset": [{**node["outbound"]["reset"][0], "queued": "0"}]}
    bad_policy = {**node["outbound"], "policy": {**node["outbound"]["policy"], "drain_s": "2"}}
    fast = data["manifests"][4]["manifest"]["nodes"][0]["gpu"]["fast_path"]
    bad_plan = {**fast, "ranks": {"0": {**fast["ranks"]["0"], "plan": {"moved_bytes": "6 MiB"}}}}
    for bad in ({"gpu": half_gpu}, {"gpu": {"gpus": [{"index": 0}]}}, {"gpu": {"fast_path": {"ranks": {}}}},
                {"gpu": {"fast_path": {"ranks": {"0": {"stage_path": 1}}, "plain": {}}}},
                {"gpu": {"fast_path": bad_plan}}, {"outbound": half_outbound}, {"outbound": bad_conn},
                {"outbound": bad_policy}, {"outbound": []}):
        with pytest.raises(ManifestError):
            Manifest.from_json({**doc, "nodes": [{**node, **bad}]})
