"""Workers of their own user (core/users.py): the user resolved once, by number; what the agent reads from a
directory the workers own is only their own regular files; what they cannot reach is named before the launch;
cryosleep-init starts each worker as that user with no capability."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cryosleep import paths
from cryosleep.core import users
from cryosleep.errors import UsageError

INIT = paths.native_dir() / "cryosleep-init"


def test_users_by_name_and_by_number() -> None:
    root = users.WorkerUser.resolve("root")
    assert (root.uid, root.gid, root.name) == (0, 0, "root") and root.env()["HOME"] == "/root"
    anon = users.WorkerUser.resolve("60001")
    assert (anon.uid, anon.gid, anon.groups, anon.name, anon.env()) == (60001, 60001, (), "", {})
    assert users.WorkerUser.resolve("60001:60002").gid == 60002
    assert users.WorkerUser.from_json(anon.to_json()) == anon and users.WorkerUser.from_json({}) is None
    assert anon.init_args() == ["-u", "60001", "-g", "60001", "-G", "-"]
    for bad in ("", ":0", "no-such-user-here", "60001:no-such-group-here"):
        with pytest.raises(UsageError):
            users.WorkerUser.resolve(bad)


def test_only_the_directory_owners_own_regular_files_are_opened(tmp_path: Path) -> None:
    d = tmp_path / "ctl"
    d.mkdir()
    users.WorkerUser(60001, 60001).give(d)
    mine = d / "rank-0.ctl"
    mine.write_bytes(b"x")
    os.chown(mine, 60001, 60001)
    os.close(users.open_owned(mine))
    secret = tmp_path / "secret"
    secret.write_text("root's")
    (d / "link.ctl").symlink_to(secret)
    os.link(mine, d / "hard.ctl")  # a second name for it: refused too (nlink 2)
    (d / "roots.ctl").write_bytes(b"y")  # a file the directory's owner did not make
    for name in ("link.ctl", "hard.ctl", "roots.ctl"):
        with pytest.raises(OSError):
            users.open_owned(d / name)


def test_what_the_user_cannot_reach_is_named() -> None:
    top = Path(tempfile.mkdtemp(prefix="cryosleep-test-", dir="/var/tmp"))  # pytest's tmp is root's alone
    try:
        _reach(top)
    finally:
        shutil.rmtree(top)


def _reach(top: Path) -> None:
    os.chmod(top, 0o711)
    user = users.WorkerUser(60001, 60001)
    closed = top / "closed"
    (closed / "inner").mkdir(parents=True)
    os.chmod(closed, 0o700)
    assert f"{closed} (mode 700, owner uid 0) is not searchable by uid 60001" in users.unreachable(closed / "inner",
                                                                                                  user)
    os.chmod(closed, 0o711)
    assert "is not open to uid 60001" in users.unreachable(closed / "inner", user)
    user.give(closed / "inner")
    assert users.unreachable(closed / "inner", user) == ""
    script = closed / "inner" / "train"
    script.write_text("#!/bin/sh\n")
    os.chmod(script, 0o700)  # root's, not executable by the user
    assert "not executable by uid 60001" in users.cannot_run(str(script), "", user)
    assert users.cannot_run("sh", "/usr/bin:/bin", user) == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_init_starts_each_worker_as_the_user_without_capabilities(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    probe = "import os; s = open('/proc/self/status').read(); print(os.getuid(), os.getgid(), os.getgroups(), " \
            "[l.split()[1] for l in s.splitlines() if l.startswith(('CapEff', 'CapPrm'))])"
    py = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    res = subprocess.run([str(INIT), "-n", "1", "-l", str(tmp_path), "-u", "60001", "-g", "60002", "-G", "60003,60004",
                          "--", py, "-c", probe], capture_output=True, text=True, check=False, timeout=60)
    log = (tmp_path / "rank-0.log").read_text()
    assert res.returncode == 0, log
    assert log.split(None, 2)[:2] == ["60001", "60002"] and "[60003, 60004]" in log, log
    assert "'0000000000000000', '0000000000000000'" in log, log
    bad = subprocess.run([str(INIT), "-n", "1", "-l", str(tmp_path), "-u", "1", "-g", "1", "-G", "1,x", "--", "true"],
                         capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "usage" in bad.stderr
