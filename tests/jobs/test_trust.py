"""Authenticated snapshots of a real job (real CRIU, real PyTorch, through the CLI): a manifest edited to write
elsewhere, a swapped image file, an older manifest replayed under a newer id, and a manifest signed with another
job's key are each refused by `verify` and by `restore`, with nothing written and nothing started; an unsigned
snapshot is refused unless the operator allows it; the signed snapshot, and the unsigned one with the flag,
restore and continue bit for bit."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from cryosleep.core import proctree
from cryosleep.store.auth import SignKey, sign
from cryosleep.store.manifest import Manifest
from tests.jobs.harness import Harness, reference, workload

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # minutes: the extended tier (CI runs it)

ARGS = ["--steps", "20", "--step-sleep", "0.05"]


def _key(home: Path, job: str) -> Path:
    path = home / "keys" / f"{job}.sign"
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return path


def _refused(h: Harness, sid: str, why: str, *extra: str) -> None:
    """`verify` and `restore` both refuse ``sid`` with an error saying ``why``."""
    got = h.cli("verify", "--json", sid, *extra, check=False)
    out = json.loads(got.stdout)
    assert got.returncode == 1 and not out["ok"], got.stdout
    assert why in json.dumps(out), out
    got = h.cli("restore", "--detach", "--json", sid, *extra, check=False)
    assert got.returncode != 0, got.stdout
    err = json.loads(got.stdout)
    assert err["error"] in ("unauthenticated", "store_corrupt") and why in json.dumps(err), err
    assert "nothing was restored" in err["what"] or "failed verification" in err["what"], err


def test_tampered_snapshots_are_refused_and_unsigned_ones_need_the_flag(h: Harness, cryo_home: Path,
                                                                        tmp_path: Path) -> None:
    linger = tmp_path / "go"  # the job stays up after its last step until this exists: no race with a slow machine
    args = [*ARGS, "--linger", str(linger)]
    script = workload("ddp_basic")
    _key(cryo_home, "trusty")
    other = SignKey.from_secret(bytes.fromhex(_key(cryo_home, "other").read_text()), "other job's key")
    h.run("trusty", script, args)
    h.wait_step("trusty", 5, timeout=600)  # the first step waits for PyTorch to load, slow under load
    older = h.snapshot("trusty")["snapshot"]
    h.wait_step("trusty", 10, timeout=600)
    sid = h.snapshot("trusty", "--stop")["snapshot"]
    assert h.wait_end("trusty") == 75
    linger.touch()  # the restored job ends after its last step
    out = h.cli_json("verify", sid)
    assert out["ok"] and "signed with key" in out["auth"] and "trusty.sign" in out["auth"]

    snap = Path(os.environ["CRYOSLEEP_STORE"]) / "snapshots" / sid
    mpath = snap / "manifest.json"
    original = mpath.read_text()
    before = h.job("trusty").read()[1]
    assert before.state == "suspended"

    def untouched() -> None:
        """Nothing was started, and the job's state is as it was (``before``)."""
        st = h.job("trusty").read()[1]
        assert (st.state, st.agent_pid, st.init_pid) == (before.state, before.agent_pid, before.init_pid)
        assert not proctree.alive(st.init_pid)

    def edited(change: Callable[[dict], None]) -> None:  # type: ignore[type-arg]
        data = json.loads(original)
        change(data)
        mpath.write_text(json.dumps(data))

    # 1. One staged file's path (rank 0's log) edited to another location: the MAC no longer matches; nothing is
    # written there.
    evil = tmp_path / "elsewhere" / "written-by-restore"
    staged = json.loads(original)["nodes"][0]["staged"]
    mine = [i for i, s in enumerate(staged) if s["path"].endswith("/rank-0.log") and s["staged"]]
    assert mine, [s["path"] for s in staged]
    victim = mine[0]

    def move(data: dict) -> None:  # type: ignore[type-arg]
        data["nodes"][0]["staged"][victim]["path"] = str(evil)

    edited(move)
    _refused(h, sid, "altered after it was signed")
    assert not evil.exists() and not evil.parent.exists()
    untouched()
    mpath.write_text(original)

    # 2. A swapped image file (a worker's memory pages from the older snapshot in place of this one's): its
    # checksum fails.
    old_dir = Path(os.environ["CRYOSLEEP_STORE"]) / "snapshots" / older
    old_files = json.loads((old_dir / "manifest.json").read_text())["nodes"][0]["files"]
    old_sums = {f["path"]: f["sha256"] for f in old_files}
    rel = next(f["path"] for f in json.loads(original)["nodes"][0]["files"]
               if "/criu/pages-" in f["path"] and old_sums.get(f["path"], f["sha256"]) != f["sha256"])
    kept = tmp_path / "kept.img"
    shutil.copyfile(snap / rel, kept)
    shutil.copyfile(old_dir / rel, snap / rel)
    _refused(h, sid, rel)
    shutil.copyfile(kept, snap / rel)
    untouched()

    # 3. The older snapshot's manifest (validly signed) replayed under the newer snapshot's id.
    shutil.copyfile(Path(os.environ["CRYOSLEEP_STORE"]) / "snapshots" / older / "manifest.json", mpath)
    _refused(h, sid, f"its manifest names snapshot '{older}'")
    untouched()
    mpath.write_text(original)

    # 4. Signed with another job's key (whoever holds it signed a manifest naming this job).
    m = Manifest.from_json(json.loads(original))
    sign(m, other)
    mpath.write_text(m.dumps())
    _refused(h, sid, f"signed with key {other.key_id}")
    untouched()

    # 5. The snapshot as signed restores, and the job continues bit for bit.
    mpath.write_text(original)
    h.cli_json("restore", "--detach", sid)
    assert h.wait_end("trusty") == 0
    assert h.losses("trusty", 0) == reference(script, args)[0]

    # 6. Unsigned: refused without the flag, accepted with it, and the job then continues bit for bit again.
    before = h.job("trusty").read()[1]
    edited(lambda data: data.pop("auth"))
    _refused(h, sid, "not signed")
    untouched()
    out = h.cli_json("verify", sid, "--allow-unsigned")
    assert out["ok"] and out["auth"].startswith("unsigned")
    h.cli_json("restore", "--detach", "--allow-unsigned", sid)
    assert h.wait_end("trusty") == 0
    assert h.losses("trusty", 0) == reference(script, args)[0]
