"""`cryosleep gc` and `cryosleep verify --deep`, on a store directory and on S3 (settings from AWS_*)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from cryosleep.cli.main import main
from cryosleep.store.cas import ChunkStore, chunk_name
from cryosleep.store.chunking import ChunkSpec
from cryosleep.store.crypto import JobKey
from cryosleep.store.urls import open_backend
from tools.s3serve import S3Server

from .conftest import new_bucket
from .helpers import image_bytes, write


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, json.loads(out)


def _fill(url: str, src: Path, key: JobKey | None = None) -> ChunkStore:
    store = ChunkStore(open_backend(url), spec=ChunkSpec("fixed", 256 << 10))
    write(src, "a.img", image_bytes(1, 1 << 20))
    for i in range(1, 4):
        store.put_snapshot(f"exp-{i}", "exp", src, ["a.img"], key=key, created_at=time.time() - (4 - i) * 86400)
        write(src, "a.img", image_bytes(1 + i, 1 << 20))
    return store


def test_verify_deep_and_gc_on_a_store_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path / "store")
    monkeypatch.setenv("CRYOSLEEP_STORE", url)
    store = _fill(url, tmp_path / "src")
    code, out = run(capsys, "verify", "--deep", "--allow-unsigned", "exp-2", "--json")
    assert code == 0 and out["ok"] and out["chunks_checked"] == 4
    victim = store.load("exp-2").files[0].chunks[1].address
    path = tmp_path / "store" / "cas" / chunk_name(victim)
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1
    path.write_bytes(bytes(blob))
    code, out = run(capsys, "verify", "--deep", "--allow-unsigned", "exp-2", "--json")
    assert code == 1 and not out["ok"] and [p["chunk"] for p in out["problems"]] == [victim]
    assert main(["verify", "--deep", "--allow-unsigned", "exp-2"]) == 1
    assert victim in capsys.readouterr().err
    # Retention through gc: keep the newest, drop what is older than 2.5 days; a dry run first.
    code, out = run(capsys, "gc", "--keep-last", "1", "--max-age", "2.5d", "--grace", "0", "--dry-run", "--json")
    assert code == 0 and out["dry_run"]
    assert [(r["snapshot"], r["keep"]) for r in out["retention"]] == [("exp-1", False), ("exp-2", True),
                                                                      ("exp-3", True)]
    assert store.snapshot_ids() == ["exp-1", "exp-2", "exp-3"]
    time.sleep(1.05)
    code, out = run(capsys, "gc", "--keep-last", "1", "--max-age", "2.5d", "--grace", "0", "--json")
    assert code == 0 and out["deleted"] == 4 and store.snapshot_ids() == ["exp-2", "exp-3"]
    assert main(["gc", "--grace", "0"]) == 0
    assert "removed 0 chunks" in capsys.readouterr().out


def test_verify_deep_on_s3_with_a_key(s3server: S3Server, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3server.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://{new_bucket(s3server)}/team/cryo"
    secret = os.urandom(32)
    _fill(url, tmp_path / "src", key=JobKey.from_secret(secret))
    code, out = run(capsys, "verify", "--deep", "--allow-unsigned", "exp-3", "--store", url, "--json")
    assert code == 1 and out["error"] == "error" and "no key" in out["what"]
    monkeypatch.setenv("CRYOSLEEP_KEY", secret.hex())
    code, out = run(capsys, "verify", "--deep", "--allow-unsigned", "exp-3", "--store", url, "--json")
    assert code == 0 and out["ok"] and out["store"] == url
    monkeypatch.setenv("CRYOSLEEP_KEY", os.urandom(32).hex())
    code, out = run(capsys, "verify", "--deep", "--allow-unsigned", "exp-3", "--store", url, "--json")
    assert code == 1 and "wrong key" in out["problems"][0]["what"] and out["problems"][0]["chunk"]
    code, out = run(capsys, "gc", "--store", url, "--json")
    assert code == 0 and out["snapshots"] == 3 and out["deleted"] == 0
