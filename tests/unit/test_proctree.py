"""proctree.Watch: which processes of a tree ended since it was opened, and how, even once their parent reaped
them (the snapshot tells a DataLoader's workers ending at an epoch's end from a worker killed: capture/snapshot.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cryosleep.capture.snapshot import failed_processes
from cryosleep.core import proctree


def _grandchild(script: str) -> tuple[subprocess.Popen[str], int]:
    """A process started by a shell (so not ours to wait for) and the shell, which reaps it. ``script`` lasts long
    enough for the watch to open on it."""
    sh = subprocess.Popen(["sh", "-c", f"{script} & echo $!; wait $!"], stdout=subprocess.PIPE, text=True)
    assert sh.stdout is not None
    return sh, int(sh.stdout.readline())


def _gate(tmp_path: Path, name: str = "gate") -> tuple[Path, Callable[[], None]]:
    """A FIFO one shell waits on with a builtin (``read _ < FIFO``: no process of its own) and its opening: a process
    that must outlive the opening of a watch ends when the test says, not after a sleep a loaded machine outlasts."""
    fifo = tmp_path / name
    os.mkfifo(fifo)

    def open_gate() -> None:
        fd = os.open(fifo, os.O_WRONLY)  # waits for its one reader to open it too; it reads the line and goes on
        os.write(fd, b"go\n")
        os.close(fd)

    return fifo, open_gate


def _kernel_keeps_exit_status() -> bool:
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 15)


def test_a_running_process_has_not_ended() -> None:
    sh, pid = _grandchild("sleep 30")
    watch = proctree.Watch([pid])
    try:
        assert watch.ended() == {}
    finally:
        os.kill(pid, signal.SIGKILL)
        sh.wait()
        watch.close()


@pytest.mark.skipif(not _kernel_keeps_exit_status(), reason="a reaped process's status needs Linux 6.15")
def test_how_reaped_processes_ended_is_known(tmp_path: Path) -> None:
    (clean_fifo, open_clean), (failed_fifo, open_failed) = _gate(tmp_path, "clean"), _gate(tmp_path, "failed")
    clean_sh, clean = _grandchild(f"(read _ < {clean_fifo}; exit 0)")
    failed_sh, failed = _grandchild(f"(read _ < {failed_fifo}; exit 3)")
    killed_sh, killed = _grandchild("sleep 30")
    watch = proctree.Watch([clean, failed, killed])
    open_clean()
    open_failed()
    os.kill(killed, signal.SIGKILL)
    for sh in (clean_sh, failed_sh, killed_sh):
        sh.wait()  # each shell has reaped its child: /proc no longer has them
    deadline = time.monotonic() + 5
    while len(ended := watch.ended()) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.close()
    assert {p: proctree.describe_status(s) for p, s in ended.items()} == {
        clean: "exited 0", failed: "exited 3", killed: "killed by signal 9"}
    assert not any(os.path.exists(f"/proc/{p}") for p in (clean, failed, killed))


def test_a_zombies_status_is_read_before_it_is_reaped() -> None:
    child = subprocess.Popen(["sh", "-c", "exit 7"])
    watch = proctree.Watch([child.pid])
    deadline = time.monotonic() + 5
    while not watch.ended() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proctree.state(child.pid) == "Z"
    assert watch.ended() == {child.pid: 7 << 8}
    child.wait()
    watch.close()


def test_a_process_gone_before_the_watch_is_left_to_the_tree() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    watch = proctree.Watch([child.pid])
    assert watch.fds == {} and watch.ended() == {}


def test_only_a_descendants_clean_exit_is_the_jobs_own_churn() -> None:
    """A real tree: init (a shell) and its worker (a shell) whose children come and go. A worker's child that
    exits 0 is churn the image can do without; one killed or failing, or the worker itself ending, is not."""
    init = subprocess.Popen(["sh", "-c", "sh -c 'sleep 30 & sleep 30 & sleep 30 & wait' & wait"])
    deadline = time.monotonic() + 5
    while len(tree := proctree.tree(init.pid)) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker = proctree.children(init.pid)[0]
    a, b, c = proctree.children(worker)
    watch = proctree.Watch(tree)
    own = {init.pid, worker}
    try:
        assert failed_processes(watch, own, init.pid) == ""
        os.kill(a, signal.SIGTERM)  # sleep's default: ends by the signal
        _until(lambda: a in watch.ended())
        assert failed_processes(watch, own, init.pid) == f"process {a} killed by signal 15"
        os.kill(worker, signal.SIGKILL)
        _until(lambda: worker in watch.ended())
        assert f"process {worker} (a worker) killed by signal 9" in failed_processes(watch, own, init.pid)
    finally:
        for p in (b, c, init.pid):
            os.kill(p, signal.SIGKILL)
        init.wait()
        watch.close()


def test_a_descendant_exiting_0_is_not_a_failure(tmp_path: Path) -> None:
    fifo, open_gate = _gate(tmp_path)
    init = subprocess.Popen(["sh", "-c", f"sh -c '(read _ < {fifo}; exit 0) & wait; sleep 30' & wait"])
    deadline = time.monotonic() + 5
    while len(tree := proctree.tree(init.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker = proctree.children(init.pid)[0]
    (churn,) = proctree.children(worker)
    watch = proctree.Watch(tree)
    open_gate()
    try:
        _until(lambda: churn in watch.ended())
        assert failed_processes(watch, {init.pid, worker}, init.pid) == ""
    finally:
        for p in proctree.tree(init.pid)[::-1]:
            os.kill(p, signal.SIGKILL)
        init.wait()
        watch.close()


def _until(cond: Callable[[], bool], timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
