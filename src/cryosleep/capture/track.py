"""Having a job's processes track their own writes, for criu-uffd's pre-copy (docs/precopy.md).

Each process with the interceptor preloaded and ``CRYOSLEEP_TRACK_DIR`` set runs a tracker thread
(native/nccl/interceptor/track.c). ``Tracker.register`` asks the given processes to register their private
writable memory with a userfaultfd in the asynchronous write-protect mode, takes each fd (``pidfd_getfd``) and
tells the process, which then closes its own: the process holds no userfaultfd (CRIU could not dump it), and the
fd held here keeps the tracking alive until ``forget``/``close``. A process that does not answer in time (no
tracker: a program without the preload, a static binary) is not tracked: criu-uffd dumps it whole.

The exchange is files named by PID in the directory (``PID.req``, ``PID.ack``, ``PID.taken``), each written to a
temporary name and renamed; track.c's header has the format.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ENV = "CRYOSLEEP_TRACK_DIR"
SYS_PIDFD_GETFD = 438  # the same number on every architecture (the generic syscall table)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def pidfd_getfd(pid: int, fd: int) -> int:
    """A duplicate, in this process, of process ``pid``'s fd ``fd`` (needs ptrace access to it)."""
    pidfd = os.pidfd_open(pid)
    try:
        got = int(_libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0))
    finally:
        os.close(pidfd)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pidfd_getfd of fd {fd} of process {pid}: {os.strerror(err)}")
    return got


@dataclass(frozen=True)
class Registered:
    """One process's answer to a round: ``vmas`` mappings (``bytes`` bytes) newly registered; ``error`` the errno
    of a mapping that could not be (0: none)."""

    pid: int
    vmas: int
    bytes: int
    error: int = 0


def _running(pid: int) -> bool:
    """The process exists and has not exited (a zombie never answers)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:][:1] not in ("Z", "X")


TRACKER_THREAD = "cryosleep-trk"  # track.c's thread's name
NO_TRACKER_S = 0.25  # a process still without that thread this long after a round began is not waited for


def has_tracker(pid: int) -> bool:
    """The process runs track.c's thread (a program without the preload, or one that has not loaded it yet, does
    not: no answer would come, so none is waited for)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            if Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() == TRACKER_THREAD:
                return True
        except OSError:
            continue  # a thread gone meanwhile
    return False


def holds_userfaultfd(pid: int) -> bool:
    """The process has a userfaultfd open (CRIU cannot dump it)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[userfaultfd]":
                return True
        except OSError:
            continue  # closed meanwhile
    return False


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


class Tracker:
    """The fds that keep a job's processes' memory tracked, and the rounds that register it."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.gen = 0
        self.fds: dict[int, list[int]] = {}
        # the job's last pre-copy: the share of its dump's pages taken from the pre-dump (None: none yet), and the
        # snapshots dumped plain since because it was too small (capture/precopy.py's ``worth_it``)
        self.last_share: float | None = None
        self.plain_since = 0

    def next_gen(self) -> int:
        """A round's generation: above any an earlier agent of the job used (a process's tracker answers only a
        generation above the last it served, and a restored process remembers its own): milliseconds of the
        clock, and above this tracker's last."""
        self.gen = max(self.gen + 1, int(time.time() * 1000))
        return self.gen

    def register(self, pids: Iterable[int], timeout_s: float = 2.0,
                 names: Mapping[int, int] | None = None) -> dict[int, Registered]:
        """Asks every process in ``pids`` to register what it has not registered yet; returns the answers of those
        that answered within ``timeout_s`` (the others are not tracked, and are told their fd is taken, so that a
        late one closes it at once rather than holding it, undumpable, for its 10 s wait). A process that has had
        no tracker thread for ``NO_TRACKER_S`` is not waited for (it cannot answer: a program without the preload,
        a static binary; one forked or started just now gets its thread within that). ``names``: each process's PID
        as it sees itself (in the sandbox's PID namespace), which names its files; by default the same."""
        gen = self.next_gen()
        waiting = set(pids)
        asked = set(waiting)
        seen: set[int] = set()  # those with a tracker thread
        name = dict(names or {})
        for pid in waiting:
            _write(self.dir / f"{name.get(pid, pid)}.req", f"{gen}\n")
        out: dict[int, Registered] = {}
        start = time.monotonic()
        end = start + timeout_s
        while waiting and time.monotonic() < end:
            for pid in sorted(waiting):
                try:
                    fields = (self.dir / f"{name.get(pid, pid)}.ack").read_text().split()
                except OSError:
                    if not _running(pid):  # gone (a short-lived child): no answer to wait for
                        waiting.discard(pid)
                    elif pid not in seen:
                        if has_tracker(pid):
                            seen.add(pid)
                        elif time.monotonic() - start > NO_TRACKER_S:
                            waiting.discard(pid)
                    continue
                if len(fields) != 5 or int(fields[0]) != gen:
                    continue
                waiting.discard(pid)
                fd, vmas, size, err = (int(x) for x in fields[1:])
                if fd >= 0:
                    try:
                        self.fds.setdefault(pid, []).append(pidfd_getfd(pid, fd))
                    except OSError:
                        continue  # gone meanwhile, or the fd closed after its wait ran out: not tracked
                    _write(self.dir / f"{name.get(pid, pid)}.taken", f"{gen}\n")
                out[pid] = Registered(pid, vmas, size, err)
            if waiting:
                time.sleep(0.01)
        for pid in asked - set(out):  # late, or its fd not taken: it closes its own as soon as it has one
            if _running(pid):
                _write(self.dir / f"{name.get(pid, pid)}.taken", f"{gen}\n")
        return out

    def tracked(self) -> list[int]:
        return sorted(self.fds)

    def forget(self, pid: int, name: int | None = None) -> None:
        """Stops tracking ``pid`` (it exited, or is restored anew); ``name``: its files' (its PID in the sandbox)."""
        for fd in self.fds.pop(pid, []):
            os.close(fd)
        for what in ("req", "ack", "taken"):
            (self.dir / f"{pid if name is None else name}.{what}").unlink(missing_ok=True)

    def keep(self, pids: Iterable[int]) -> None:
        """Only ``pids`` stay tracked: the fds of processes gone since are closed."""
        alive = set(pids)
        for pid in [p for p in self.fds if p not in alive]:
            for fd in self.fds.pop(pid):
                os.close(fd)

    def close(self) -> None:
        for pid in list(self.fds):
            self.forget(pid)
