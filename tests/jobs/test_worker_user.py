"""Workers of their own user (``cryosleep run --user``; core/users.py, docs/security.md): two NCCL jobs (the CPU
stand-in NCCL, through the interceptor's control blocks) run at once on this host as two users; each one's
workers have that uid and no capability; neither user reads the other job's record, logs or control blocks,
signals its workers or commands its agent; one job is stopped by a snapshot and restored (its control directory
removed first: the restore puts the blocks back as that user's), its workers that user's again, bit for bit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryosleep import paths
from cryosleep.core import privileges, proctree
from tests.conftest import require_criu
from tests.jobs.harness import Harness, workload
from tests.jobs.test_nccl_cut import assert_identical

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # two jobs, a stop, a restore: the extended tier (CI)

ALICE, BOB = 60001, 60002
STANDIN = paths.native_dir() / "standin" / "libnccl.so.2"
# The workers' interpreter: one any user may run (the project's virtualenv may live under root's home, which
# `run --user` refuses, naming it). The NCCL workload needs nothing but the standard library.
SYSTEM_PYTHON = Path("/usr/bin/python3")


def as_user(uid: int) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory both users reach (pytest's own tmp is root's alone): $CRYOSLEEP_HOME and each job's files."""
    d = Path(tempfile.mkdtemp(prefix="cryosleep-users-"))
    os.chmod(d, 0o711)
    for uid in (ALICE, BOB):
        (d / str(uid)).mkdir(mode=0o700)
        os.chown(d / str(uid), uid, uid)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def h(cryo_home: Path, shared: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    require_criu()
    home = shared / "home"
    home.mkdir(mode=0o711)
    monkeypatch.setenv("CRYOSLEEP_HOME", str(home))
    monkeypatch.setenv("STANDIN_NCCL_LIB", str(STANDIN))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(STANDIN.parent))
    monkeypatch.setenv("STANDIN_NCCL_TIMEOUT_S", "120")
    harness = Harness(home)
    yield harness
    for d in (home / "jobs").glob("*"):
        if harness.job(d.name).agent_alive():
            harness.kill_all(d.name)


def _status(pid: int, key: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {key} for {pid}")


def workers(h: Harness, name: str) -> list[int]:
    _, st = h.job(name).read()
    return proctree.children(st.init_pid)


def assert_runs_as(h: Harness, name: str, uid: int) -> None:
    for pid in workers(h, name):
        assert _status(pid, "Uid").split() == [str(uid)] * 4, (pid, _status(pid, "Uid"))
        assert int(_status(pid, "CapEff"), 16) == 0 and int(_status(pid, "CapPrm"), 16) == 0
    ctl = h.job(name).ctl
    assert (ctl.stat().st_uid, ctl.stat().st_mode & 0o777) == (uid, 0o700)
    blocks = sorted(ctl.glob("rank-*.ctl"))
    assert len(blocks) == 2 and all(b.stat().st_uid == uid for b in blocks), blocks


def denied(uid: int, *cmd: str) -> subprocess.CompletedProcess[str]:
    got = subprocess.run([*as_user(uid), *cmd], capture_output=True, text=True, check=False)
    assert got.returncode != 0, got
    return got


def test_two_users_jobs_are_kept_apart_and_a_stop_restore_keeps_the_user(h: Harness, shared: Path) -> None:
    if privileges.missing(privileges.OWN_USER):
        pytest.skip("this host's root lacks CAP_SYS_RESOURCE (its bounding set), which a snapshot of another user's "
                    "workers needs: `run --user` refuses it (the next test)")
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"no {SYSTEM_PYTHON} for the workers of another user")
    script = workload("nccl_dp")
    base = {uid: ["--steps", "40", "--step-sleep", "0.05", "--dir", str(shared / str(uid) / "rdv")]
            for uid in (ALICE, BOB)}
    args = {uid: [*base[uid], "--linger", str(shared / str(uid) / "linger")] for uid in (ALICE, BOB)}
    py = SYSTEM_PYTHON
    h.run("alice", py, [str(script), *args[ALICE]], flags=("--user", str(ALICE), "--no-python"))
    h.run("bob", py, [str(script), *args[BOB]], flags=("--user", f"{BOB}:{BOB}", "--no-python"))
    h.wait_step("alice", 3)
    h.wait_step("bob", 3)
    assert_runs_as(h, "alice", ALICE)
    assert_runs_as(h, "bob", BOB)
    _, st = h.job("alice").read()
    assert privileges.effective(st.agent_pid) >= privileges.SNAPSHOT  # the agent keeps what it needs

    job = h.job("alice")
    assert (job.path.stat().st_mode & 0o777, job.path.stat().st_gid) == (0o710, ALICE)
    for target in (job.spec_file, job.rank_log(0), job.ctl_path(0)):  # bob reads none of alice's files
        assert "Permission denied" in denied(BOB, "cat", str(target)).stderr
    assert "Permission denied" in denied(BOB, "ls", str(job.ctl)).stderr
    victim = workers(h, "alice")[0]
    assert "Operation not permitted" in denied(BOB, "kill", "-0", str(victim)).stderr
    probe = f"import socket; s=socket.socket(socket.AF_UNIX); s.connect({str(job.socket)!r})"
    assert "PermissionError" in denied(BOB, sys.executable, "-c", probe).stderr

    stop = h.snapshot("alice", "--stop")
    assert h.wait_end("alice") == 75, h.job("alice").read()[1].detail
    shown = h.cli_json("show", stop["snapshot"])
    blocks = [f for f in shown["nodes"][0]["staged"] if f["path"].endswith(".ctl")]
    assert len(blocks) == 2 and {(f["uid"], f["gid"]) for f in blocks} == {(ALICE, ALICE)}, blocks
    shutil.rmtree(job.ctl)  # the restore makes it again, alice's, with her blocks in it
    h.restore(stop["snapshot"])
    h.wait_step("alice", len(h.losses("alice")))
    assert_runs_as(h, "alice", ALICE)
    (shared / str(ALICE) / "linger").touch()
    (shared / str(BOB) / "linger").touch()
    assert h.wait_end("alice") == 0, h.job("alice").read()[1].detail
    assert h.wait_end("bob") == 0, h.job("bob").read()[1].detail
    for name, uid in (("alice", ALICE), ("bob", BOB)):
        assert_identical(h, name, script, base[uid], 2)


def test_a_user_that_cannot_run_is_refused_before_anything_starts(h: Harness, shared: Path) -> None:
    script = workload("ddp_basic")
    got = h.cli("run", "--json", "--detach", "--user", "no-such-user-here", str(script), check=False)
    assert got.returncode == 2 and "no such user" in got.stdout, got.stdout
    got = h.cli("run", "--json", "--detach", "--user", str(ALICE), "--fast-path", str(script), check=False)
    assert got.returncode == 2 and "fast path" in got.stdout, got.stdout
    if privileges.missing(privileges.OWN_USER):  # this host's root cannot snapshot another user's workers
        got = h.cli("run", "--json", "--detach", "--name", "unable", "--user", str(ALICE), str(script), check=False)
        assert got.returncode != 0 and "CAP_SYS_RESOURCE" in got.stdout, got.stdout
        assert not h.job("unable").path.exists()
        return
    os.chmod(shared, 0o700)  # the workers' user can no longer reach $CRYOSLEEP_HOME
    got = h.cli("run", "--json", "--detach", "--name", "unreached", "--user", str(ALICE), str(script),
                "--steps", "3", check=False)
    assert got.returncode != 0 and "not searchable by uid 60001" in got.stdout, got.stdout
    assert not h.job("unreached").agent_alive()
