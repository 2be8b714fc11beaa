"""The write-tracked pre-copy of a node's memory (docs/precopy.md): the pre-dump before the pause, and what the
final dump needs to take only the pages written since.

A snapshot's node, before the drain (``NodeCapture.before_pause``): the job's processes asked to track their
writes (``track.Tracker``: each process's tracker registers its memory, the agent holds the fds), then
``criu-uffd pre-dump --track-mem --pre-dump-mode read`` of the tree into ``nodes/N/criu-pre`` (``PRECOPY_PARENT``):
CRIU freezes the tree only to read its page maps, then copies the pages while the job runs. The final dump is
``criu-uffd dump --track-mem --prev-images-dir ../criu-pre``: the pages not written since come from the pre-dump
(CRIU links ``criu/parent`` to it), the freeze copies only the others. The pre-dump leaves the job running and
changes nothing it sees: a failure after it drops the staging, pre-dump included, and the job runs on.

Where the pre-copy cannot run (criu-uffd not built, a kernel that cannot track, no process answered the tracker,
the pre-dump failed, turned off), the snapshot takes the plain dump, and its manifest says why
(``NodeImage.precopy``).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import time
from pathlib import Path

from cryosleep.capture import criu as criu_calls
from cryosleep.capture import criu_stats, criu_uffd
from cryosleep.capture.criu_install import Criu
from cryosleep.capture.track import Tracker, holds_userfaultfd
from cryosleep.core import proctree
from cryosleep.errors import CaptureFailed
from cryosleep.store.manifest import PRECOPY_PARENT, Precopy

__all__ = ["FAULT", "available", "predump", "tracked_criu"]

FAULT = "precopy-fail"  # CRYOSLEEP_FAULT: the snapshot fails right after its pre-dump (tests/jobs)
LOG = "pre-dump.log"
# A pre-copy whose dump took less than this share of its pages from the pre-dump saved the job little (it rewrote
# most of its memory in between: measured at 16% and 43% (docs/benchmarks.md), its pause was no shorter than a plain
# dump's, the pre-dump's own writes slowing the dump's): the job's next snapshots dump plain, and every
# RETRY_EVERY-th tries again (the job may have changed)
MIN_SHARE = 0.5
RETRY_EVERY = 4
TRACK_TIMEOUT_S = 2.0  # every process's tracker answers within 50 ms when it runs; one that does not is not tracked
LET_GO_S = 1.0  # how long a late tracker is given to close its fd (told at once; it closes within a poll, 50 ms)
_available: dict[tuple[str, ...], tuple[tuple[str, ...] | None, str]] = {}


def available() -> tuple[tuple[str, ...] | None, str]:
    """criu-uffd's command prefix when it is built and this kernel lets it track (asked once per process), else
    None and why not."""
    key = ("criu-uffd",)
    if key not in _available:
        argv = criu_uffd.built()
        if argv is None:
            _available[key] = None, f"criu-uffd is not built ({criu_uffd.BUILD_HINT})"
        else:
            ok, out = criu_uffd.tracks(argv)
            why = "" if ok else "this kernel cannot track memory writes for criu-uffd: " + (
                out.splitlines()[-1] if out else "criu check failed")
            _available[key] = (argv if ok else None), why
    return _available[key]


def tracked_criu(criu: Criu) -> Criu | None:
    """The CRIU to dump with after a pre-dump: criu-uffd through the same prefix (None when there is none)."""
    argv, _ = available()
    return dataclasses.replace(criu, argv=argv) if argv is not None else None


def worth_it(tracker: Tracker) -> str:
    """Why this snapshot dumps plain because the job's last pre-copy saved too little ("" : pre-copy it)."""
    last = tracker.last_share
    if last is None or last >= MIN_SHARE:
        return ""
    tracker.plain_since += 1
    if tracker.plain_since >= RETRY_EVERY:
        tracker.plain_since = 0
        return ""
    return (f"the job's last pre-copy gave its dump only {last:.0%} of the pages (it rewrote its memory in between), "
            f"under {MIN_SHARE:.0%}: a plain dump pauses it less (tried again every {RETRY_EVERY}th snapshot)")


def learn(tracker: Tracker, rec: Precopy, pages_written: int) -> None:
    """The pre-copy's share of the dump's pages, for the job's next snapshots (``worth_it``)."""
    total = rec.pages_parent + pages_written
    if total:
        tracker.last_share = rec.pages_parent / total


def register(tracker: Tracker, root_pid: int) -> tuple[int, int]:
    """Every process of the tree asked to track its writes; (processes tracked, processes in the tree). The fds
    of processes gone since the last round are closed. It returns once no process of the tree holds a userfaultfd
    (one whose tracker answered late closes its own: the dump could not take it), or after ``LET_GO_S``."""
    tree = [p for p in proctree.tree(root_pid) if proctree.state(p) not in ("Z", "X", "gone")]
    tracker.keep(tree)
    names = {p: n for p in tree if (n := proctree.ns_pid(p)) is not None}
    tracker.register(tree, TRACK_TIMEOUT_S, names=names)
    end = time.monotonic() + LET_GO_S
    while any(holds_userfaultfd(p) for p in tree) and time.monotonic() < end:
        time.sleep(0.01)
    return len([p for p in tree if p in tracker.fds]), len(tree)


def predump(criu: Criu, root_pid: int, node_dir: Path, timeout: float) -> Precopy:
    """``criu-uffd pre-dump`` of the tree of ``root_pid`` into ``node_dir/criu-pre``, the job left running; its
    record (``Precopy``) with CRIU's own freeze time. CaptureFailed with CRIU's words when it fails (the job goes
    on: a pre-dump leaves it running, and a CRIU killed midway releases the tasks it held)."""
    images = node_dir / PRECOPY_PARENT
    images.mkdir(parents=True, exist_ok=True)
    log = images / LOG
    cmd = criu.command("pre-dump", "-t", str(root_pid), "-D", str(images), "-o", LOG, criu_calls.DUMP_VERBOSITY,
                       "--track-mem", "--pre-dump-mode", "read")
    tree = proctree.tree(root_pid)
    started = time.monotonic()
    with open(images / "criu.out", "wb") as out:
        proc = subprocess.Popen(criu_calls.protected(cmd), env=criu.env(), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if not criu_calls.wait_exit(proc, timeout):
            raise CaptureFailed(f"CRIU's pre-dump did not finish within {timeout:g} s", "it was killed",
                                "retry with a longer --timeout; the job goes on running")
        if proc.returncode != 0:
            kept = criu_calls.keep_log(log)
            raise CaptureFailed(f"CRIU's pre-dump failed (exit code {proc.returncode})", criu_calls.log_tail(log),
                                f"the job goes on running; CRIU's log: {kept}", log=str(kept))
    except BaseException:
        criu_calls.end_group(proc.pid)
        proc.wait()
        criu_calls.continue_tasks(proctree.tree(root_pid) or tree)  # a CRIU killed midway let them go already
        raise
    finally:
        criu_calls.end_group(proc.pid)
    run_s = time.monotonic() - started
    try:
        st = criu_stats.decode_dump_stats((images / criu_stats.STATS_FILE).read_bytes())
    except (OSError, ValueError):
        st = {}
    freeze_s = (st.get("freezing_time", 0) + st.get("frozen_time", 0)) / 1e6 if st else run_s
    return Precopy(parent=PRECOPY_PARENT, freeze_s=round(freeze_s, 6), run_s=round(run_s, 6),
                   pages_copied=st.get("pages_written", 0))


def parent_arg(rec: Precopy | None) -> str | None:
    """The final dump's ``--prev-images-dir`` (relative to its images' directory), None for a plain dump."""
    return f"../{rec.parent}" if rec is not None and rec.parent is not None else None


def drop(node_dir: Path) -> None:
    """The pre-dump removed (the snapshot dumps plain, or failed)."""
    shutil.rmtree(node_dir / PRECOPY_PARENT, ignore_errors=True)


def parent_pages(node_dir: Path) -> int:
    """Of the final dump's pages, those it took from the pre-dump (CRIU's stats; 0 when unreadable)."""
    try:
        return criu_stats.decode_dump_stats((node_dir / criu_stats.STATS_FILE).read_bytes())["pages_skipped_parent"]
    except (OSError, ValueError, KeyError):
        return 0
