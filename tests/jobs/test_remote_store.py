"""Snapshots persisted into a real S3 server (Ceph radosgw on loopback, started here), with real CRIU and
real PyTorch: restore from the remote store alone, background uploads that survive a killed server, a
flipped bit caught with its chunk named, and a stop snapshot that cannot be persisted leaving the job running."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cryosleep.store.cas import ChunkStore
from cryosleep.store.s3 import S3Backend
from tests.conftest import require_criu
from tests.jobs.harness import Harness, assert_identical, free_port, workload
from tests.jobs.test_triggers import scrape
from tests.store.conftest import new_bucket, require_radosgw, settings_of
from tools.s3serve import S3Server

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # minutes: the extended tier (CI runs it)


@pytest.fixture
def srv(tmp_path: Path) -> Iterator[S3Server]:
    """A server of the test's own, to kill and restart."""
    s = S3Server(tmp_path / "radosgw", prefix=require_radosgw()).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def h(cryo_home: Path, srv: S3Server, monkeypatch: pytest.MonkeyPatch) -> Harness:
    require_criu()
    for var in list(os.environ):
        if var.startswith(("CRYOSLEEP_KEY", "AWS_")) or var == "CRYOSLEEP_S3_ENDPOINT":
            monkeypatch.delenv(var, raising=False)
    for k, v in srv.env().items():  # as an operator would set them; the agent inherits them
        monkeypatch.setenv(k, v)
    return Harness(cryo_home)


def key_file(path: Path) -> Path:
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


def record(sid: str) -> dict[str, Any]:
    """The snapshot's persistence record in the local store ($CRYOSLEEP_STORE of the test)."""
    p = Path(os.environ["CRYOSLEEP_STORE"]) / "persist" / f"{sid}.json"
    return json.loads(p.read_text()) if p.exists() else {}


def wait_record(sid: str, until: Any, timeout: float = 180) -> dict[str, Any]:
    end = time.monotonic() + timeout
    rec: dict[str, Any] = {}
    while time.monotonic() < end:
        rec = record(sid)
        if rec and until(rec):
            return rec
        time.sleep(0.02)
    raise AssertionError(f"the record of {sid} never got there: {rec}")


def events(rec: dict[str, Any]) -> list[str]:
    return [e["event"] for e in rec["events"]]


def at(rec: dict[str, Any], name: str, nth: int = 0) -> float:
    return float([e["t"] for e in rec["events"] if e["event"] == name][nth])


def last_step(h: Harness, name: str) -> int:
    got = h.losses(name)
    return int(got[-1].split()[0]) if got else -1


def flip_bit(srv: S3Server, bucket: str, address: str) -> Path:
    """Alter one bit of a stored chunk, in the server's own files."""
    path = next(p for p in (srv.root / "objects" / bucket).iterdir() if p.name.endswith(address))
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x10
    path.write_bytes(bytes(blob))
    return path


def test_stop_to_s3_restore_from_s3_alone(h: Harness, srv: S3Server, tmp_path: Path) -> None:
    """(a) stop snapshot to S3, local copies deleted, restore from S3 alone, identical continuation;
    (c) a flipped bit is caught on restore with its chunk named, and the wrong key fails clearly;
    (f) a stop snapshot whose upload fails leaves the job running and says what failed."""
    script = workload("ddp_basic")
    linger = tmp_path / "linger"
    args = ["--steps", "400", "--step-sleep", "0.12", "--linger", str(linger)]  # trains past the failed stop
    bucket = new_bucket(srv)
    url = f"s3://{bucket}/team/cryo"
    key = key_file(tmp_path / "job.key")
    h.cli_json("run", "--detach", "--name", "s3job", "--nproc-per-node", "2", "--store", url, "--key-file", str(key),
               "--local-keep", "0", str(script), *args)
    h.wait_step("s3job", 8)
    s1 = h.snapshot("s3job")
    assert s1["persist"]["state"] in ("queued", "uploading") and s1["persist"]["remote"] == url
    rec1 = wait_record(s1["snapshot"], lambda r: r["state"] == "failed" or r["local"] == "removed")
    assert rec1["state"] == "persisted" and rec1["encrypted"] and rec1["local"] == "removed", rec1
    assert not (Path(os.environ["CRYOSLEEP_STORE"]) / "snapshots" / s1["snapshot"]).exists()

    # (f) the server dies: the stop snapshot cannot be persisted, so the job must go on running.
    srv.stop()
    res = h.cli("snapshot", "s3job", "--stop", "--json", check=False)
    err = json.loads(res.stdout)
    assert res.returncode == 1 and err["error"] == "capture_failed", err
    assert "could not be persisted to " + url in err["what"] and "resumed" in err["hint"], err
    assert err["details"]["phases"].get("persist") is not None and "end" not in err["details"]["phases"]
    step = last_step(h, "s3job")
    h.wait_step("s3job", step + 3)  # it trains on
    assert h.state("s3job") == "running"
    assert [s["snapshot"] for s in h.ls() if s["local"]] == []  # the failed snapshot is not listed
    srv.start()

    h.wait_step("s3job", last_step(h, "s3job") + 3)
    s2 = h.snapshot("s3job", "--stop")
    assert "persist" in s2["phases"] and s2["persist"]["state"] == "persisted", s2
    assert s2["persist"]["bytes_total"] == s2["bytes"] and s2["persist"]["bytes_skipped"] > 0  # shared with s1
    # pre-copied (capture/precopy.py): the image is the dump and its pre-dump, and the chunk store holds both
    assert "precopy" in s2["phases"] and "precopy-freeze" in s2["phases"], s2["phases"]
    assert h.wait_end("s3job") == 75
    # Both snapshots are in S3, none is left on this machine.
    store_dir = Path(os.environ["CRYOSLEEP_STORE"])
    assert not any((store_dir / "snapshots").iterdir())
    listed = h.cli_json("ls", "--store", url)
    assert {s["snapshot"] for s in listed} == {s1["snapshot"], s2["snapshot"]}
    assert all(s["encryption"] for s in listed)
    shown = h.cli_json("ls")
    assert {(s["snapshot"], s["local"], s["persist"]["state"]) for s in shown} == {
        (s1["snapshot"], False, "persisted"), (s2["snapshot"], False, "persisted")}

    # (c) one flipped bit in one stored chunk: the restore names it and restores nothing.
    backend = S3Backend(bucket, "team/cryo", settings=settings_of(srv))
    snap = ChunkStore(backend).load(s2["snapshot"])
    pages = max(snap.files, key=lambda f: f.size)
    victim = pages.chunks[len(pages.chunks) // 2]
    path = flip_bit(srv, bucket, victim.address)
    res = h.cli("restore", "--json", "--detach", s2["snapshot"], "--store", url, "--key-file", str(key), check=False)
    err = json.loads(res.stdout)
    assert res.returncode == 1 and err["error"] == "chunk_corrupt", err
    assert victim.address in err["what"] and pages.path in err["what"], err
    assert not any((store_dir / "snapshots").iterdir()) and not any((store_dir / ".staging").iterdir())
    assert h.state("s3job") == "suspended"
    flip_bit(srv, bucket, victim.address)  # flipped back
    assert path.exists()

    # The wrong key fails clearly, before anything is fetched.
    res = h.cli("restore", "--json", "--detach", s2["snapshot"], "--store", url, "--key-file",
                str(key_file(tmp_path / "other.key")), check=False)
    err = json.loads(res.stdout)
    assert res.returncode == 1 and err["error"] == "wrong_key" and "wrong key" in err["what"], err

    # From S3 alone: fetched, verified, restored; the training continues bit for bit.
    linger.touch()
    out = h.cli_json("restore", "--detach", s2["snapshot"], "--store", url, "--key-file", str(key))
    assert out["snapshot"] == s2["snapshot"]
    assert out["fetched"]["bytes"] == s2["bytes"] and out["fetched"]["store"] == url
    assert h.wait_end("s3job") == 0
    assert_identical(h, "s3job", script, args, [0, 1])
    assert record(s2["snapshot"])["local"] == "fetched"


def test_background_upload_resumes_after_a_killed_server_while_training_runs(h: Harness, srv: S3Server) -> None:
    """(b) an upload interrupted midway by a killed server resumes and completes when the server is back;
    (e) a keep-running snapshot returns the job to training before its upload finishes, and the upload
    completes while training runs; (d) a GC while an upload runs loses nothing."""
    script = workload("ddp_basic")
    args = ["--steps", "100000", "--step-sleep", "0.05", "--mem-mb", "48"]
    bucket = new_bucket(srv)
    url = f"s3://{bucket}/cryo"
    port = free_port()
    h.cli_json("run", "--detach", "--name", "bg", "--nproc-per-node", "2", "--store", url, "--metrics-port", str(port),
               str(script), *args)
    seen: dict[int, float] = {}  # training step -> when the watcher first saw it in the log
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            t = time.time()
            for line in h.losses("bg"):
                seen.setdefault(int(line.split()[0]), t)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        h.wait_step("bg", 5)
        s1 = h.snapshot("bg")
        returned = time.time()
        sid = s1["snapshot"]
        # (b) kill the server once part of the image is stored.
        rec = wait_record(sid, lambda r: r["state"] == "uploading" and r["bytes_done"] > r["bytes_total"] // 4)
        srv.stop()
        rec = wait_record(sid, lambda r: r["state"] in ("retrying", "failed"))
        assert rec["state"] == "retrying" and "s3://" in rec["reason"], rec
        srv.start()
        rec = wait_record(sid, lambda r: r["state"] in ("persisted", "failed"))
        assert rec["state"] == "persisted", rec
        assert rec["attempts"] >= 2 and rec["present"] > 0, rec  # the retry skipped what was stored
        order = events(rec)
        assert order[:3] == ["queued", "upload-start", "retrying"] and order[-2:] == ["uploaded", "persisted"]
        assert h.cli_json("verify", "--deep", sid, "--store", url)["ok"]

        # (e) and (d): a second snapshot, uploaded while the job trains, with a GC running meanwhile.
        s2 = h.snapshot("bg")
        returned2 = time.time()
        step2 = max(seen)  # the step the job had reached when the snapshot returned (or later)
        gc_reports = []
        while (rec2 := record(s2["snapshot"]))["state"] not in ("persisted", "failed"):
            if rec2["state"] == "uploading" and len(gc_reports) < 2:
                gc_reports.append(h.cli_json("gc", "--store", url, "--grace", "0"))
            time.sleep(0.02)
        assert rec2["state"] == "persisted", rec2
        persisted = at(rec2, "persisted")
        # The snapshot returned before its upload started and ended; steps after the snapshot were trained
        # before the upload was done; and the job was still training after it.
        assert returned2 < at(rec2, "uploaded") <= persisted and returned < at(rec, "persisted")
        assert any(step > step2 and t < persisted for step, t in seen.items()), (step2, persisted, seen)
        h.wait_step("bg", max(seen) + 3)
        assert h.state("bg") == "running"
        assert rec2["bytes_skipped"] > 0 and rec2["bytes_sent"] < rec2["bytes_total"]  # dedup against s1
        assert gc_reports and all(g["deferred"] or g["deleted"] == 0 for g in gc_reports), gc_reports
        time.sleep(1.05)
        gc = h.cli_json("gc", "--store", url, "--grace", "0")
        assert not gc["deferred"] and gc["snapshots"] == 2
        for s in (sid, s2["snapshot"]):
            assert h.cli_json("verify", "--deep", s, "--store", url)["ok"]
        # Two snapshots kept locally (the default), both persisted; ls and show say so.
        shown = {s["snapshot"]: s for s in h.ls()}
        assert {s: shown[s]["persist"]["state"] for s in (sid, s2["snapshot"])} == {sid: "persisted",
                                                                                     s2["snapshot"]: "persisted"}
        text = h.cli("show", s2["snapshot"]).stdout
        assert "persisted+verified" in text and "dedup" in text
        # and the agent's metrics carry the uploads: bytes, rate, dedup, the verified snapshot's age
        got = scrape(port)
        assert got['cryosleep_upload_bytes_total{job="bg"}'] >= rec["bytes_sent"] + rec2["bytes_sent"]
        assert got['cryosleep_upload_rate_bytes_per_second{job="bg"}'] > 0
        assert got['cryosleep_dedup_ratio{job="bg"}'] > 1.0  # s2 reused s1's chunks
        assert 0 <= got['cryosleep_last_verified_snapshot_age_seconds{job="bg"}'] < 120
    finally:
        done.set()
        h.kill_all("bg")
