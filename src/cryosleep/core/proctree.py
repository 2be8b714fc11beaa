"""Reading a process tree and what its processes hold, from /proc."""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except OSError:
            continue
        out.extend(int(x) for x in text.split())
    return out


def tree(root: int) -> list[int]:
    """Every process of the tree rooted at ``root``, root first (parents before children)."""
    order: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop(0)
        if not Path(f"/proc/{pid}").exists():
            continue
        order.append(pid)
        todo.extend(children(pid))
    return order


def alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def other_ns(pid: int, kind: str = "net") -> bool | None:
    """Whether ``pid`` lives in another namespace of ``kind`` (``net``, ``mnt``) than the caller; None when it is
    gone (a sandbox with its own network namespace is in another ``net`` namespace)."""
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino != os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return None


def nsenter_net(pid: int) -> list[str]:
    """The command prefix that runs a program in ``pid``'s network namespace (joined by PID, never through
    ``ip netns exec``, which would add a mount namespace)."""
    return ["nsenter", f"--net=/proc/{pid}/ns/net", "--"]


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (field 3 on), [] if there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def state(pid: int) -> str:
    fields = _stat(pid)
    return fields[0] if fields else "gone"


def start_time(pid: int) -> str:
    """When ``pid`` started (clock ticks since boot), "" if there is none: with the pid, it names one process."""
    fields = _stat(pid)
    return fields[19] if fields else ""


def killed_by(pid: int) -> int:
    """For a zombie: the signal that ended it (its wait status, /proc's field 52), else 0."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    if fields[0] not in ("Z", "X") or len(fields) < 50:
        return 0
    return int(fields[49]) & 0x7F


# linux/pidfd.h (6.15): PIDFD_GET_INFO = _IOWR(0xFF, 11, struct pidfd_info), the struct's first 64 bytes
_PIDFD_GET_INFO = (3 << 30) | (64 << 16) | (0xFF << 8) | 11
_PIDFD_INFO_EXIT = 8
_EXIT_CODE_AT = 60  # struct pidfd_info: mask, cgroupid (u64 each), pid .. fsgid (11 x u32), then exit_code (s32)


def describe_status(status: int | None) -> str:
    """A wait status as words: "exited 0", "killed by signal 9", "ended, how unknown" (None)."""
    if status is None:
        return "ended, how unknown"
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exited {os.WEXITSTATUS(status)}"


class Watch:
    """Pidfds on processes, opened while they ran: which of them have ended since, and how. A pidfd names one
    process even once its PID is reused; from Linux 6.15 it keeps the wait status after the parent has reaped
    it (PIDFD_INFO_EXIT), before that only a zombie's status is known (/proc's field 52)."""

    def __init__(self, pids: list[int]) -> None:
        self.fds: dict[int, int] = {}
        self.add(pids)

    def add(self, pids: Iterable[int]) -> None:
        """Watch these too (a PID watched already keeps its pidfd)."""
        for pid in pids:
            if pid in self.fds:
                continue
            try:
                self.fds[pid] = os.pidfd_open(pid)
            except OSError:  # gone already: the caller's next look at the tree sees that
                continue

    def forget(self, pid: int) -> None:
        """No longer watched (its end was read)."""
        fd = self.fds.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def ended(self) -> dict[int, int | None]:
        """pid -> wait status (None: unknown) of each watched process that has exited."""
        if not self.fds:
            return {}
        poller = select.poll()
        by_fd = {fd: pid for pid, fd in self.fds.items()}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        return {by_fd[fd]: self._status(fd, by_fd[fd]) for fd, _ev in poller.poll(0)}

    @staticmethod
    def _status(fd: int, pid: int) -> int | None:
        buf = bytearray(64)
        struct.pack_into("Q", buf, 0, _PIDFD_INFO_EXIT)
        try:
            fcntl.ioctl(fd, _PIDFD_GET_INFO, buf)
            if struct.unpack_from("Q", buf, 0)[0] & _PIDFD_INFO_EXIT:
                return int(struct.unpack_from("i", buf, _EXIT_CODE_AT)[0])
        except OSError:  # before 6.15, or not reaped yet
            pass
        fields = _stat(pid)  # a zombie (not reaped, so its PID is still its own)
        if len(fields) >= 50 and fields[0] in ("Z", "X"):
            return int(fields[49])
        return None

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def ns_pid(pid: int) -> int | None:
    """The PID of ``pid`` inside its own (innermost) PID namespace."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except OSError:
        return None
    return None


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


@dataclass(frozen=True)
class OpenFile:
    pid: int
    fd: int
    target: str  # readlink of /proc/PID/fd/FD: a path, or "socket:[ino]", "anon_inode:[io_uring]", ...
    flags: int

    @property
    def writable(self) -> bool:
        return (self.flags & os.O_ACCMODE) in (os.O_WRONLY, os.O_RDWR)

    @property
    def is_path(self) -> bool:
        return self.target.startswith("/")


def open_files(pid: int) -> list[OpenFile]:
    out: list[OpenFile] = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for name in fds:
        fd = int(name)
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            flags = 0
            for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
                if line.startswith("flags:"):
                    flags = int(line.split()[1], 8)
        except OSError:
            continue
        out.append(OpenFile(pid, fd, target, flags))
    return out


def maps_paths(pid: int) -> set[str]:
    """Paths of files mapped into ``pid``."""
    paths: set[str] = set()
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return paths
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/"):
            paths.add(parts[5])
    return paths


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


SYS_PIDFD_GETFD = 438  # x86_64 and aarch64


def pidfd_getfd(pid: int, fd: int) -> int:
    """A duplicate, in this process, of descriptor ``fd`` of process ``pid`` (pidfd_getfd(2); root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        got = int(libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0))
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd(pid {pid}, fd {fd}): {os.strerror(err)}")
        return got
    finally:
        os.close(pidfd)


# The mark of a signal the agent means for the job (also in cryosleep-init and the interceptor's shield.c): a
# sandbox's init forwards such a SIGTERM to the workers, and their SIGTERM shield lets it through.
SIGNAL_MARK = 0x43525953


class _Sigval(ctypes.Union):
    _fields_ = [("sival_int", ctypes.c_int), ("sival_ptr", ctypes.c_void_p)]


def send_marked(pid: int, sig: int) -> None:
    """``sig`` to ``pid``, queued with :data:`SIGNAL_MARK` (sigqueue); raises ProcessLookupError when it is gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sigqueue.argtypes = [ctypes.c_int, ctypes.c_int, _Sigval]
    if libc.sigqueue(pid, sig, _Sigval(sival_int=SIGNAL_MARK)) != 0:
        err = ctypes.get_errno()
        raise ProcessLookupError(err, os.strerror(err)) if err == 3 else OSError(err, os.strerror(err))
