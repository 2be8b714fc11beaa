"""criu-uffd (capture/criu_uffd.py): the pinned CRIU built with memory tracked by userfaultfd write-protect. On a
kernel without soft-dirty bits the stock CRIU refuses ``pre-dump --track-mem``; criu-uffd pre-dumps a running
process, then dumps only the pages it wrote since (the rest from the pre-dump, its parent image), and the process
restored from the two is exactly as it was: every page checked against its step counter. The memory registered by
the process itself (its fd taken by the test), or by the preloaded interceptor's tracker when asked
(capture/track.py, native/nccl/interceptor/track.c), which also tracks a forked child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from cryosleep import paths
from cryosleep.capture import criu_install, criu_stats, criu_uffd
from cryosleep.capture.track import ENV, Tracker, holds_userfaultfd, pidfd_getfd
from tests.native.uffd_target import wait_for

TARGET = Path(__file__).with_name("uffd_target.py")
MIB = 256


def _preload_env(track: Path) -> dict[str, str]:
    return {**os.environ, "LD_PRELOAD": str(paths.native_dir() / "libcryosleep_nccl.so"), ENV: str(track)}


def _holding(mib: int) -> str:
    """The start of a program that holds ``mib`` MiB of private memory, every page written."""
    return ("import mmap, os, sys, time\n"
            f"m = mmap.mmap(-1, {mib} << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
            f"m.write(b'x' * ({mib} << 20))\n")


@contextmanager
def _program(prog: str, env: dict[str, str], *args: str) -> Iterator[subprocess.Popen[str]]:
    """``python -c PROG ARGS`` in a session of its own, its output piped; it and its children killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", prog, *args], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        yield proc
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.parametrize("how", ["self", "preload"])
def test_a_tracked_dump_writes_only_what_changed_since_the_pre_dump_and_restores_exactly(tmp_path: Path,
                                                                                          how: str) -> None:
    argv = criu_uffd.built()
    assert argv is not None, f"criu-uffd is not built: {criu_uffd.BUILD_HINT}"
    ok, why = criu_uffd.tracks(argv)
    if not ok:
        pytest.skip(f"this kernel cannot track memory by userfaultfd write-protect: {why}")
    stock = criu_install.locate()
    log = tmp_path / "target.log"
    tracker = Tracker(tmp_path / "track")
    proc = subprocess.Popen([sys.executable, str(TARGET), str(MIB), str(log), how], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd="/",
                            env=_preload_env(tracker.dir) if how == "preload" else None)
    held = -1
    restored = None
    try:
        fd = int(wait_for(log, r"ready fd (-?\d+)").group(1))
        if how == "self":
            held = pidfd_getfd(proc.pid, fd)
            os.kill(proc.pid, signal.SIGUSR2)  # its own fd closed: ours keeps the tracking
            wait_for(log, "closed")
        else:
            got = tracker.register([proc.pid])
            assert got[proc.pid].vmas >= 1 and got[proc.pid].bytes >= MIB << 20, got
            assert tracker.tracked() == [proc.pid]
            again = tracker.register([proc.pid])  # nothing new to register: no second fd
            assert again[proc.pid].vmas == 0 and len(tracker.fds[proc.pid]) == 1, again
            end = time.monotonic() + 5
            while holds_userfaultfd(proc.pid) and time.monotonic() < end:
                time.sleep(0.02)
        assert not holds_userfaultfd(proc.pid)  # what CRIU could not dump
        pre, final = tmp_path / "pre", tmp_path / "final"
        pre.mkdir()
        final.mkdir()
        env = stock.env()
        refused = stock.run(["pre-dump", "-t", str(proc.pid), "-D", str(tmp_path), "--track-mem"])
        if "soft_dirty" not in Path("/proc/self/smaps").read_text():  # a kernel without soft-dirty bits
            assert refused.returncode != 0 and "Tracking memory is not available" in refused.stdout + refused.stderr

        def criu(*args: str) -> None:
            r = subprocess.run([*argv, *args, "-t", str(proc.pid), "-v4", "-o", "criu.log"], env=env,
                               capture_output=True, text=True, timeout=120, check=False)
            assert r.returncode == 0, (r.stderr, (Path(args[args.index("-D") + 1]) / "criu.log").read_text()[-3000:])

        criu("pre-dump", "-D", str(pre), "--track-mem", "--pre-dump-mode", "read")
        time.sleep(0.2)  # the process runs on: about 20 steps, each writing the same 1/64 of its pages
        criu("dump", "-D", str(final), "--track-mem", "--prev-images-dir", "../pre", "--leave-running")
        st = criu_stats.decode_dump_stats((final / criu_stats.STATS_FILE).read_bytes())
        pages = MIB * 256
        assert st["pages_skipped_parent"] > 0.95 * pages, st  # taken from the pre-dump
        assert st["pages_written"] < 0.05 * pages, st  # the 1/64 written since, and the process's own heap

        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        r = subprocess.run([*argv, "restore", "-D", str(final), "-d", "--pidfile", str(tmp_path / "pid"), "-v4",
                            "-o", "restore.log"], env=env, capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode == 0, (final / "restore.log").read_text()[-3000:]
        restored = int((tmp_path / "pid").read_text())
        time.sleep(0.1)
        os.kill(restored, signal.SIGUSR1)
        assert wait_for(log, r"verify step \d+: .*").group(0).endswith("OK")
    finally:
        for pid in (proc.pid, restored):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait(10)
        if held >= 0:
            os.close(held)
        tracker.close()


def test_the_tracker_answers_in_a_forked_child_and_only_for_its_own_pid(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path / "track")
    prog = _holding(64) + "child = os.fork()\nprint(child if child else '', flush=True)\ntime.sleep(60)\n"
    try:
        with _program(prog, _preload_env(tracker.dir)) as proc:
            assert proc.stdout is not None
            child = int(next(line for line in proc.stdout if line.strip()))  # the child's empty line may come first
            got = tracker.register([proc.pid, child, 1])  # 1: no tracker there (not preloaded): no answer
            assert set(got) == {proc.pid, child}, got
            assert all(r.bytes >= 64 << 20 for r in got.values()), got
            assert not (tracker.dir / "1.ack").exists()
    finally:
        tracker.close()


def test_a_child_forked_while_the_tracker_holds_its_fd_does_not_keep_it(tmp_path: Path) -> None:
    """A worker that forks (a DataLoader's workers, each epoch) while its tracker holds the userfaultfd it made, not
    yet taken by the agent: the child closes its copy (CRIU cannot dump a process holding one: the failure of a
    Lightning job's snapshot). The test takes the fd 0.4 s late, with a fork every few milliseconds meanwhile."""
    track = tmp_path / "track"
    track.mkdir()
    log = tmp_path / "children.log"
    prog = _holding(16) + (
        "from cryosleep.capture.track import holds_userfaultfd\n"
        "print(flush=True)\n"
        "while True:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        with open(sys.argv[1], 'a') as f:\n"
        "            f.write(('held' if holds_userfaultfd(os.getpid()) else 'free') + '\\n')\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "    time.sleep(0.003)\n")
    held = -1
    try:
        with _program(prog, _preload_env(track), str(log)) as proc:
            assert proc.stdout is not None
            proc.stdout.readline()
            (track / f"{proc.pid}.req").write_text("1\n")
            ack = wait_for(track / f"{proc.pid}.ack", r"^1 (\d+) ")
            forked_before = len(log.read_text().split())
            time.sleep(0.4)  # the tracker holds the fd all this while; the process forks on
            held = pidfd_getfd(proc.pid, int(ack.group(1)))
            (track / f"{proc.pid}.taken").write_text("1\n")
            children = log.read_text().split()
            assert len(children) - forked_before >= 10, "too few forks while the fd was held to show anything"
            kept = children.count("held")
            assert kept == 0, f"{kept} of {len(children)} children kept the userfaultfd"
    finally:
        if held >= 0:
            os.close(held)


def test_a_process_without_the_tracker_is_not_waited_for(tmp_path: Path) -> None:
    """A process of the tree without the preload (no tracker thread) is not waited for: the round does not wait its
    timeout out for it (docs/precopy.md: a round took its whole 2 s for such a process)."""
    tracker = Tracker(tmp_path / "track")
    prog = "import time; print(flush=True); time.sleep(60)\n"
    try:
        with _program(prog, _preload_env(tracker.dir)) as with_it, \
                _program(prog, {**os.environ, ENV: str(tracker.dir)}) as without:
            for p in (with_it, without):
                assert p.stdout is not None
                p.stdout.readline()
            t0 = time.monotonic()
            got = tracker.register([with_it.pid, without.pid], timeout_s=60)
            took = time.monotonic() - t0
            assert set(got) == {with_it.pid}, got
            assert took < 30, f"the round waited {took:.1f} s: for the process that has no tracker"
    finally:
        tracker.close()


def test_a_tracker_that_answers_late_lets_go_of_its_fd_at_once(tmp_path: Path) -> None:
    """A process whose tracker answers after the round's wait ran out (a loaded machine) is not tracked, and does
    not hold its userfaultfd for the 10 s it would wait for the agent to take it: the dump that follows the
    pre-dump would fail on it ("Can't dump file ... anon_inode:[userfaultfd]")."""
    tracker = Tracker(tmp_path / "track")
    try:
        with _program(_holding(16) + "print(flush=True); time.sleep(60)\n", _preload_env(tracker.dir)) as proc:
            assert proc.stdout is not None
            proc.stdout.readline()
            assert tracker.register([proc.pid], timeout_s=0.001) == {}  # over before its tracker looks (every 50 ms)
            wait_for(tracker.dir / f"{proc.pid}.ack", r"^\d+ \d+ ")  # it answered, late, with an fd
            end = time.monotonic() + 2
            while holds_userfaultfd(proc.pid) and time.monotonic() < end:
                time.sleep(0.01)
            assert not holds_userfaultfd(proc.pid), "the late tracker still holds its userfaultfd"
            assert tracker.tracked() == []
    finally:
        tracker.close()
