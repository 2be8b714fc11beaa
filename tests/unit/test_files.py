"""Staging the files a job writes, and bringing them back to their state at the snapshot."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from cryosleep.capture import files
from cryosleep.errors import RestoreFailed


@pytest.fixture
def writer(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A real process holding two files open for writing (and one for reading, outside /tmp: one read under
    /tmp would be staged too, files.VOLATILE)."""
    log = tmp_path / "out.log"
    big = tmp_path / "big.bin"
    lasting = Path(tempfile.mkdtemp(prefix="cryosleep-test-", dir="/var/tmp"))
    ro = lasting / "ro.txt"
    ro.write_text("read only")
    code = (f"import time\nf = open({str(log)!r}, 'a'); g = open({str(big)!r}, 'wb'); r = open({str(ro)!r})\n"
            "f.write('hello\\n'); f.flush(); g.write(b'B' * 100000); g.flush()\ntime.sleep(60)\n")
    p = subprocess.Popen(["python3", "-c", code])
    for _ in range(100):
        if log.exists() and big.exists() and big.stat().st_size == 100000:
            break
        time.sleep(0.05)
    yield p, log, big, ro
    p.kill()
    p.wait()
    shutil.rmtree(lasting, ignore_errors=True)


def test_stage_and_restore_round_trip(writer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    p, log, big, _ro = writer
    assert set(files.writable_files(p.pid)) == {str(log), str(big)}
    dest = tmp_path / "stage"
    staged = files.stage(p.pid, dest, copy_limit=1000)
    by_path = {s.path: s for s in staged}
    assert by_path[str(log)].staged is not None and by_path[str(log)].size == 6
    assert by_path[str(big)].staged is None and by_path[str(big)].size == 100000  # too big: fingerprint
    assert files.read_index(dest) == staged

    with open(log, "a") as f:
        f.write("after the snapshot\n")
    with open(big, "ab") as f:
        f.write(b"more")
    assert files.plan_restore(staged, dest) == []
    files.restore(staged, dest)
    assert log.read_text() == "hello\n"
    assert big.stat().st_size == 100000


def test_restore_refuses_what_it_cannot_bring_back(writer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    p, log, big, _ = writer
    dest = tmp_path / "stage"
    staged = files.stage(p.pid, dest, copy_limit=1000)
    with open(big, "r+b") as f:  # the bytes before the cut changed: truncation would not bring it back
        f.seek(99990)
        f.write(b"X")
    problems = files.plan_restore(staged, dest)
    assert len(problems) == 1 and "changed since the snapshot" in problems[0]
    os.truncate(big, 10)
    assert "shorter than at the snapshot" in files.plan_restore(staged, dest)[0]
    log.write_text("something else entirely\n")
    with pytest.raises(RestoreFailed) as e:
        files.restore(staged, dest)
    assert str(big) in e.value.why
    assert log.read_text() == "something else entirely\n"  # nothing was changed


def test_stage_across_filesystems(writer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The store may sit on another filesystem than the job's files (tmpfs vs disk)."""
    p, log, _big, _ro = writer
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp dir")
    dest = Path(tempfile.mkdtemp(dir=shm))
    try:
        staged = files.stage(p.pid, dest, copy_limit=10**6)
        assert {s.path for s in staged} == {str(log), str(_big)}
        log.write_text("changed\n")
        files.restore(staged, dest)
        assert log.read_text() == "hello\n"
    finally:
        shutil.rmtree(dest)


def test_a_file_of_another_user_comes_back_theirs_in_a_directory_made_theirs(tmp_path: Path) -> None:
    """A staged file keeps its owner through the snapshot (workers of their own user, `run --user`): put back
    as that uid and gid, in directories the restore makes for it belonging to them, 0700."""
    top = Path(tempfile.mkdtemp(prefix="cryosleep-test-", dir="/var/tmp"))
    try:
        out = top / "run" / "out.log"
        out.parent.mkdir()
        out.write_text("theirs\n")
        os.chown(out, 60001, 60002)
        staged = files.stage(os.getpid(), tmp_path / "stage", extra=[str(out)], skip=[])
        (entry,) = [s for s in staged if s.path == str(out)]
        assert (entry.uid, entry.gid) == (60001, 60002)
        shutil.rmtree(out.parent)
        files.restore([entry], tmp_path / "stage")
        st, dst = out.stat(), out.parent.stat()
        assert out.read_text() == "theirs\n" and (st.st_uid, st.st_gid) == (60001, 60002)
        assert (dst.st_uid, dst.st_gid, dst.st_mode & 0o777) == (60001, 60002, 0o700)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_staging_reads_no_link_put_in_a_files_place(tmp_path: Path) -> None:
    """A link swapped in where the job's file was (its user owns the directory) is not followed: the snapshot
    fails rather than copy, as root, what the link points to."""
    secret = tmp_path / "root-only"
    secret.write_text("secret")
    link = tmp_path / "block.ctl"
    link.symlink_to(secret)
    with pytest.raises(OSError):
        files.stage(os.getpid(), tmp_path / "stage", extra=[str(link)], skip=[])
