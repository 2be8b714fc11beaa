"""The restore sequence's own pieces, without a job: the undo record (core/undo.py) and the streamed check of the
pages (capture/imagecheck.py) with its post-restore gate, run as CRIU runs it (the real script, through /bin/sh)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from cryosleep.capture import imagecheck
from cryosleep.core.undo import UndoLog
from cryosleep.store.manifest import FileEntry


def test_undo_runs_what_was_done_newest_first_and_goes_on_past_a_failing_step() -> None:
    done: list[str] = []
    logged: list[str] = []
    log = UndoLog(logged.append)
    log.push("a", lambda _e: done.append("a"))

    def broken(_e: BaseException) -> None:
        raise OSError("stuck")

    log.push("b", broken)
    log.push("c", lambda e: done.append(f"c:{e}"))
    assert log.pending == ["c", "b", "a"]
    problems = log.undo(RuntimeError("why"))
    assert done == ["c:why", "a"] and len(problems) == 1 and "b: OSError: stuck" in problems[0], problems
    assert logged and log.pending == [] and log.undo(RuntimeError()) == []  # nothing twice
    log.push("d", lambda _e: done.append("d"))
    log.forget()
    assert log.undo(RuntimeError()) == [] and "d" not in done


def _pages(tmp_path: Path, n: int = 2, size: int = 3 << 20) -> dict[str, FileEntry]:
    out: dict[str, FileEntry] = {}
    for i in range(n):
        rel = f"nodes/0/criu/pages-{i + 1}.img"
        data = os.urandom(size + i)
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
        out[rel] = FileEntry(path=rel, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    return out


def _criu_runs(script: str, env: dict[str, str], action: str) -> int:
    return subprocess.run([script], env={**os.environ, **env, "CRTOOLS_SCRIPT_ACTION": action},
                          timeout=60).returncode


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CRYOSLEEP_HOME", str(tmp_path / "home"))
    return tmp_path


def test_intact_pages_open_the_gate(home: Path) -> None:
    entries = _pages(home / "snap")
    check = imagecheck.PageCheck(home / "snap", entries)
    check.start()
    script, env = check.gate(home / "work")
    try:
        assert _criu_runs(script, env, "pre-restore") == 0  # other stages pass at once
        assert _criu_runs(script, env, "post-restore") == 0
        assert check.problems() == [] and check.bytes == sum(f.size for f in entries.values())
    finally:
        check.close()
    assert not (home / "work" / "page-check.fifo").exists()


def test_an_altered_pages_file_shuts_the_gate_and_is_named(home: Path) -> None:
    entries = _pages(home / "snap")
    victim = home / "snap" / "nodes/0/criu/pages-2.img"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 1  # one bit, same size: only the hash can tell
    victim.write_bytes(bytes(data))
    check = imagecheck.PageCheck(home / "snap", entries)
    check.start()
    script, env = check.gate(home / "work")
    try:
        assert _criu_runs(script, env, "post-restore") != 0  # CRIU aborts the restore before any task runs
        bad = check.problems()
        assert len(bad) == 1 and "nodes/0/criu/pages-2.img" in bad[0] and "altered" in bad[0], bad
    finally:
        check.close()


def test_only_pages_files_are_streamed() -> None:
    from cryosleep.store.manifest import Manifest

    files = [{"path": p, "size": 1, "sha256": "0" * 64} for p in
             ("nodes/0/criu/pages-1.img", "nodes/0/criu/pagemap-1.img", "nodes/0/criu/core-1.img",
              "nodes/0/files/0", "nodes/0/devmem/rank-0.bin")]
    m = Manifest.from_json({"format": 1, "id": "s", "job": {"name": "j"}, "mode": "stop", "created_at": 0.0, "host": {},
                            "phases": {}, "pause_s": 0.0,
                            "nodes": [{"node_rank": 0, "ranks": [0], "init_pid": 1, "files": files}]})
    assert list(imagecheck.streamed_files(m)) == ["nodes/0/criu/pages-1.img"]


def test_a_multi_node_rebuild_writes_the_agreed_generation(tmp_path: Path) -> None:
    """The nodes of a restore agree on REBUILD's generation (above every one their images hold): the driver writes
    exactly that one, and refuses one some rank here has already seen."""
    from cryosleep.core.interceptor import Cmd
    from cryosleep.cut.driver import Driver
    from cryosleep.errors import InterceptorError
    from tests.unit.test_interceptor_block import publish

    blocks = {0: publish(tmp_path / "rank-0.ctl", pid=10)}  # state RUNNING(9)
    d = Driver(blocks)
    assert d.command_at(Cmd.REBUILD, 17) == 17 and blocks[0].cmd() == (Cmd.REBUILD, 17) and d.gen == 17
    with pytest.raises(InterceptorError, match="not above"):
        d.command_at(Cmd.REBUILD, 9)
    d.close()
