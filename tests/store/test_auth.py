"""Authenticated snapshots without CRIU (tests/jobs/test_trust.py does it with a real job): where signing keys
come from, what the MAC refuses in the directory store and in the chunk store (a directory and a real S3
server), and key rotation by re-signing, which sends no chunk again."""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from cryosleep import paths
from cryosleep.cli.main import main
from cryosleep.errors import StoreCorrupt, UsageError
from cryosleep.store import auth, persist
from cryosleep.store.auth import Trust, Unauthenticated
from cryosleep.store.cas import SNAPSHOTS, ChunkStore
from cryosleep.store.local import LocalStore, hash_tree
from cryosleep.store.manifest import Manifest, NodeImage, StagedFile
from tools.s3serve import S3Server

from .conftest import new_bucket
from .helpers import image_bytes

CRIU_ROOT = str(paths.criu_root())  # resolved at import, before a test moves $CRYOSLEEP_HOME


def key(path: Path) -> Path:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return path


def snapshot(store: LocalStore, job: str = "job", victim: str = "/tmp/cryosleep-test-job/log") -> Manifest:
    st = store.begin(job)
    node = st.node_dir(0)
    (node / "criu").mkdir(parents=True)
    (node / "files").mkdir()
    (node / "criu" / "pages-1.img").write_bytes(image_bytes(1, 300_000))
    (node / "files" / "0000").write_bytes(b"log\n")
    m = Manifest(id=st.id, job={"name": job, "program": ["/nonexistent/train.py"], "cwd": "/", "nproc_per_node": 1,
                                      "env": {"API_TOKEN": "t", "LR": "1"}},
                 mode="stop", created_at=time.time(),
                 nodes=[NodeImage(0, [0], 1, files=hash_tree(st.path, ["nodes/0"]),
                                  staged=[StagedFile(victim, 4, 0o644, "0000", "x")])],
                 host={}, phases={}, pause_s=0.1)
    store.commit(st, m)
    return m


def test_signing_keys_come_from_the_documented_sources_in_order(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    assert auth.signing_key("job") is None  # nothing configured, and verifying makes no key
    host = auth.signing_key("job", create=True)  # signing makes the host's key, owner-only
    assert host is not None and host.origin.endswith("keys/host.sign")
    assert stat.S_IMODE((home / "keys" / "host.sign").stat().st_mode) == 0o600
    assert stat.S_IMODE((home / "keys").stat().st_mode) == 0o700
    assert auth.signing_key("job", create=True) == host  # made once
    monkeypatch.setenv("CRYOSLEEP_KEY", os.urandom(32).hex())  # the job's encryption key is a root
    enc = auth.signing_key("job")
    assert enc is not None and enc.key_id != host.key_id and "encryption key" in enc.origin
    own = key(home / "keys" / "job.sign")
    assert auth.signing_key("job").origin == str(own)  # type: ignore[union-attr]
    hook = tmp_path / "kms"
    secret = os.urandom(32).hex()
    asked = str(tmp_path / "asked")
    hook.write_text(f"#!{sys.executable}\nimport sys\nopen({asked!r}, 'w').write(repr(sys.argv[1:]))\n"
                    f"print({secret!r})\n")
    hook.chmod(0o700)
    monkeypatch.setenv("CRYOSLEEP_SIGN_KEY_COMMAND", str(hook))
    got = auth.signing_key("job", key_id="abc")
    assert got is not None and got.secret == bytes.fromhex(secret) and got.origin == "$CRYOSLEEP_SIGN_KEY_COMMAND"
    assert (tmp_path / "asked").read_text() == "['job', 'abc']"
    env_file = key(tmp_path / "env.sign")
    monkeypatch.setenv("CRYOSLEEP_SIGN_KEY_FILE", str(env_file))
    assert auth.signing_key("job").origin == str(env_file)  # type: ignore[union-attr]
    explicit = key(tmp_path / "explicit.sign")
    assert auth.signing_key("job", Trust(sign_key_file=explicit)).origin == str(explicit)  # type: ignore[union-attr]
    explicit.chmod(0o644)
    with pytest.raises(UsageError, match="readable by others"):
        auth.signing_key("job", Trust(sign_key_file=explicit))
    monkeypatch.delenv("CRYOSLEEP_SIGN_KEY_FILE")
    hook.write_text("#!/bin/sh\necho no key for $1 >&2\nexit 3\n")
    with pytest.raises(UsageError, match="failed for job 'job'"):
        auth.signing_key("job")


def test_the_mac_covers_paths_ids_and_keys_and_paths_are_checked(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    m = snapshot(store)
    assert "signed with key" in auth.authenticate(store.load(m.id), m.id)
    # What the chunk store leaves out (secret-named variables' values) is all the MAC leaves out.
    changed = store.load(m.id)
    changed.job["env"]["API_TOKEN"] = "other"
    auth.authenticate(changed, m.id)
    for edit in (lambda x: x.nodes[0].staged[0].__setattr__("path", "/etc/cron.d/x"),
                 lambda x: x.job["env"].__setitem__("LR", "2"), lambda x: x.__setattr__("job", {**x.job, "name": "j2"}),
                 lambda x: x.nodes[0].files[0].__setattr__("sha256", "0" * 64)):
        bad = store.load(m.id)
        edit(bad)
        with pytest.raises(Unauthenticated):
            auth.authenticate(bad, m.id)
    with pytest.raises(Unauthenticated, match="a replay"):
        auth.authenticate(store.load(m.id), m.id + "x")
    # Paths a restore must not use are refused even when signed (and whatever --allow-unsigned says).
    for path in ("relative/log", "/tmp/../etc/passwd", "/proc/1/mem", "//etc/x", "/tmp/a/"):
        odd = store.load(m.id)
        odd.nodes[0].staged[0].path = path
        auth.sign(odd, auth.signing_key("job"))  # type: ignore[arg-type]
        assert auth.path_problems(odd), path
        with pytest.raises(Unauthenticated, match="paths a restore must not use"):
            auth.authenticate(odd, m.id, Trust(allow_unsigned=True))
    odd = store.load(m.id)
    odd.nodes[0].staged[0].staged = "../../criu/pages-1.img"
    odd.nodes[0].files[0].path = "nodes/1/criu/pages-1.img"
    assert len(auth.path_problems(odd)) == 2


def test_resign_rotates_a_local_key_and_never_vouches_for_a_swapped_file(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    store = LocalStore(tmp_path / "store")
    old = key(tmp_path / "home" / "keys" / "job.sign")
    m = snapshot(store)
    saved = tmp_path / "old.sign"
    os.replace(old, saved)
    key(old)  # rotated: the job's key is new, the snapshot still signed with the old one
    argv = ["--store", str(store.root), "--json"]
    assert main(["verify", m.id, *argv]) == 1
    assert "another job's or tenant's key, or an old one" in capsys.readouterr().out
    assert main(["resign", m.id, *argv]) == 1  # the old key is needed to vouch for it
    capsys.readouterr()
    assert main(["resign", m.id, "--from-key-file", str(saved), *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["before"].startswith("signed with key") and out["key_id"] == auth.signing_key("job").key_id  # type: ignore[union-attr]
    assert main(["verify", m.id, *argv]) == 0 and json.loads(capsys.readouterr().out)["ok"]
    (store.path_of(m.id) / "nodes/0/criu/pages-1.img").write_bytes(b"swapped")
    assert main(["resign", m.id, *argv]) == 1
    assert "was not re-signed" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["dir", "s3"])
def test_the_chunk_store_is_authenticated_before_a_fetch_and_resigned_without_chunks(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    if where == "s3":
        srv: S3Server = request.getfixturevalue("s3server")
        for k, v in srv.env().items():
            monkeypatch.setenv(k, v)
        url = f"s3://{new_bucket(srv)}/tenant-a"
    else:
        url = str(tmp_path / "remote")
    store = LocalStore(tmp_path / "store")
    key(tmp_path / "home" / "keys" / "job.sign")
    m = snapshot(store)
    persist.Persister("job", persist.RemoteConfig(url)).persist_now(store, m, time.monotonic() + 120)
    cas = ChunkStore(persist.open_chunk_store(url).backend)
    name = f"{SNAPSHOTS}{m.id}.json"
    original = cas.backend.get(name)
    elsewhere = LocalStore(tmp_path / "elsewhere")

    def tampered(change: object) -> None:
        doc = json.loads(original)
        change(doc)  # type: ignore[operator]
        cas.backend.put(name, json.dumps(doc).encode())
        with pytest.raises(StoreCorrupt):  # Unauthenticated is one
            persist.fetch(url, m.id, elsewhere)
        assert elsewhere.manifests() == [] and not (elsewhere.staging.exists() and any(elsewhere.staging.iterdir()))

    tampered(lambda d: d["manifest"]["nodes"][0]["staged"][0].__setitem__("path", str(tmp_path / "evil")))
    tampered(lambda d: d["files"][0].__setitem__("sha256", "0" * 64))  # the index no longer what was signed
    tampered(lambda d: d["manifest"].pop("auth"))
    assert not (tmp_path / "evil").exists()
    cas.backend.put(name, original)
    chunks = sorted((o.name, o.size) for o in cas.backend.list("chunks/"))
    saved = tmp_path / "old.sign"
    os.replace(tmp_path / "home" / "keys" / "job.sign", saved)
    key(tmp_path / "home" / "keys" / "job.sign")
    with pytest.raises(Unauthenticated, match="an old one"):
        persist.fetch(url, m.id, elsewhere)
    _, before, key_id = persist.resign_remote(url, m.id, Trust(sign_key_file=saved), Trust())
    assert before.startswith("signed with key") and key_id == auth.signing_key("job").key_id  # type: ignore[union-attr]
    assert sorted((o.name, o.size) for o in cas.backend.list("chunks/")) == chunks  # nothing sent again
    got, _ = persist.fetch(url, m.id, elsewhere)
    assert got.auth is not None and got.auth["key_id"] == key_id
    assert auth.authenticate(elsewhere.load(m.id), m.id).startswith(f"signed with key {key_id}")
    assert elsewhere.verify(m.id) == []


def test_a_jobs_recorded_key_file_is_a_root_but_a_manifests_never(tmp_path: Path) -> None:
    """A local restore of a job run with --key-file finds its key through this host's record of the job; a key
    path written into a manifest (by whoever wrote the store) is never used to check that manifest."""
    enc = key(tmp_path / "job.key")
    record = tmp_path / "home" / "jobs" / "job" / "job.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"spec": {"name": "job", "persist": {"url": "x", "key_file": str(enc)}}, "state": {}}))
    found = auth.signing_key("job")
    assert found is not None and found.origin.startswith(str(enc)) and "encryption key" in found.origin
    store = LocalStore(tmp_path / "store")
    m = snapshot(store)  # signed by the committing side with the same root
    assert auth.authenticate(store.load(m.id), m.id).startswith(f"signed with key {found.key_id}")
    record.unlink()
    forged = store.load(m.id)
    forged.job["persist"] = {"key_file": str(key(tmp_path / "attacker.key"))}
    from cryosleep.store.crypto import JobKey

    attacker = JobKey.from_secret(bytes.fromhex((tmp_path / "attacker.key").read_text()))
    auth.sign(forged, auth.SignKey.from_secret(attacker.sign, "attacker"))
    with pytest.raises(Unauthenticated, match="signed with key"):
        auth.authenticate(forged, m.id)


def test_the_restore_checks_the_mac_first_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """capture.restore's first phase: a signed snapshot passes it (and stops at the next check here, its program
    being absent); an edited one is refused there, its file not written."""
    from cryosleep.capture import criu_install
    from cryosleep.capture import restore as capture_restore
    from cryosleep.errors import NotEligible
    from tests.conftest import require_criu

    monkeypatch.setenv("CRYOSLEEP_CRIU_ROOT", CRIU_ROOT)
    criu_install.reset_cache()
    require_criu()
    store = LocalStore(tmp_path / "store")
    victim = tmp_path / "job-files" / "log"
    m = snapshot(store, victim=str(victim))
    store.load(m.id)
    with pytest.raises(NotEligible, match="program"):  # past the MAC, the paths and every checksum
        capture_restore.restore(store, m.id, tmp_path / "work")
    path = store.path_of(m.id) / "manifest.json"
    doc = json.loads(path.read_text())
    doc["job"]["program"] = ["/bin/true"]
    path.write_text(json.dumps(doc))
    with pytest.raises(Unauthenticated, match="altered after it was signed"):
        capture_restore.restore(store, m.id, tmp_path / "work")
    assert not victim.exists() and not (tmp_path / "work").exists()
    criu_install.reset_cache()
