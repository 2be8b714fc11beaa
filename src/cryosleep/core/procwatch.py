"""The agent's watch on its job's processes between snapshots: which of them ended, when, and how.

A snapshot's own watch (``proctree.Watch``) starts at its preflight; a process of the job killed a moment before
(chaos seed 1002: a DataLoader worker SIGKILLed 0.4 s after the request, reaped at once by its rank, which had
not raised yet) is not in the tree it sees, and the image holds a job about to fail. This watch runs from the
job's start (or restore) to its end, so that a snapshot can ask what ended in the last seconds
(``JobExits.since``; the rule is ``capture/snapshot.py``'s ``settle``).

How: the kernel's process events connector (netlink, ``NETLINK_CONNECTOR``/``CN_IDX_PROC``; root has
CAP_NET_ADMIN): every fork and exit on the host, with the exit's wait status, delivered as it happens, filtered
here to the job's tree (its processes' thread-group ids, grown by their forks). It sees every process, however
short-lived, costs nothing while nothing forks, and needs no parent to leave a zombie; pidfds polled on the
tree miss what is born and killed between two looks, and cost a /proc walk of every thread each time. Where the
connector is silent (an agent outside the host's initial PID or user namespace is not sent its events) or cannot
be opened, the watch falls back to pidfds on the tree, refreshed every ``POLL_S``. Lost events (the socket's
buffer overflowed) count as an exit whose status is unknown: the conservative reading.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryosleep.core import proctree

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
PROC_CN_MCAST_LISTEN = 1
PROC_EVENT_FORK = 0x00000001
PROC_EVENT_EXIT = 0x80000000
_NLMSG_DONE = 3
_EVENT_AT = 16 + 20  # nlmsghdr, then cn_msg: the proc_event (what, cpu, timestamp_ns, then its union)
_DATA_AT = _EVENT_AT + 16
RCVBUF = 4 << 20  # a host forking fast overflows the default (~200 KiB) while the agent is busy elsewhere
SELF_TEST_S = 2.0  # the connector must show the watch's own thread being created within this, or is silent here
POLL_S = 0.2  # the fallback's refresh: a process that lives less than this between two looks goes unseen
KEEP_S = 120.0  # how long an exit is remembered (a snapshot asks about the last few seconds)


@dataclass(frozen=True)
class Exit:
    """A process of the job that ended: ``status`` its wait status (None: unknown, or events were lost)."""

    pid: int  # 0: events were lost (the socket's buffer overflowed), which process unknown
    status: int | None
    at: float  # monotonic
    role: str  # "init" (the sandbox's), "worker" (one of init's children), "" (another descendant)

    @property
    def failed(self) -> bool:
        """Killed by a signal, exited non-zero, or not known: what a platform reads as the job going wrong. A
        descendant exiting 0 is the job's own churn (a DataLoader's workers at an epoch's end)."""
        return self.status != 0

    @property
    def own(self) -> bool:
        """The sandbox's init or a worker: the job itself ends with it."""
        return bool(self.role)

    def describe(self, now: float) -> str:
        ago = f"{max(0.0, now - self.at):.1f} s ago"
        if self.pid == 0:
            return f"the process events were lost {ago} (an exit may have gone unseen)"
        who = {"init": " (the sandbox's init)", "worker": " (a worker)"}.get(self.role, "")
        return f"process {self.pid}{who} {proctree.describe_status(self.status)} {ago}"


class JobExits:
    """Exits of the processes of the tree rooted at ``root`` (the sandbox's init), from :meth:`start` to
    :meth:`close`. Thread-safe; :meth:`since` reads everything the kernel has queued up to the call."""

    def __init__(self, root: int, log: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.log = log or (lambda _m: None)
        self.clock = clock
        self.mode = "off"  # "connector", "pidfd" (the fallback), or "off" (closed, or nothing worked)
        self.exits: list[Exit] = []
        self.members: set[int] = set()
        self.workers: set[int] = set()  # the sandbox init's children
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._pidfds: proctree.Watch | None = None
        self._closed = False
        self._tested = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- starting ------------------------------------------------------------------------------------------

    def start(self) -> JobExits:
        try:
            self._sock = _subscribe()
        except OSError as e:
            self.log(f"process watch: the kernel's process events are not available ({e}): polling pidfds")
        self._rescan()
        if self._sock is not None:
            self._thread = threading.Thread(target=self._read_loop, name="procwatch", daemon=True)
            self._thread.start()  # its own creation is the connector's self-test (a fork event of this process)
            if self._tested.wait(SELF_TEST_S):
                self.mode = "connector"
                return self
            self.log("process watch: the kernel sends this agent no process events (another PID or user "
                     "namespace?): polling pidfds")
            self._sock.close()
            self._sock = None
        self.mode = "pidfd"
        self._thread = threading.Thread(target=self._poll_loop, name="procwatch", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.mode = "off"
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._pidfds is not None:
                self._pidfds.close()
                self._pidfds = None

    # ---- reading ---------------------------------------------------------------------------------------------

    def since(self, t: float) -> list[Exit]:
        """The exits at or after monotonic time ``t``, oldest first (every event queued so far read first)."""
        with self._lock:
            if self._sock is not None:
                self._drain(self._sock, block=False)
            elif self._pidfds is not None:
                self._refresh()
            return [e for e in self.exits if e.at >= t]

    def _record(self, pid: int, status: int | None, at: float | None = None) -> None:
        now = self.clock()
        role = "init" if pid == self.root else "worker" if pid in self.workers else ""
        self.exits.append(Exit(pid, status, now if at is None else min(at, now), role))
        self.members.discard(pid)
        if len(self.exits) > 256 or (self.exits and self.exits[0].at < now - KEEP_S):
            self.exits = [e for e in self.exits[-256:] if e.at >= now - KEEP_S]

    def _rescan(self, replace: bool = False) -> None:
        """The tree as /proc shows it now joins the members (at the start, after each poll) or, after lost events,
        replaces them (an exit missed would leave its PID a member, to be taken by whatever reuses it)."""
        pids = proctree.tree(self.root)
        if replace:
            self.members = set(pids)
        self.members.update(pids)
        self.workers.update(proctree.children(self.root))
        if self._pidfds is not None:
            self._pidfds.add(p for p in pids if p not in self._pidfds.fds)

    # ---- the connector -------------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        me = (os.getpid(), threading.get_native_id())
        while True:
            with self._lock:
                sock = self._sock
                if sock is None or self._closed:
                    return
            try:
                ready, _, _ = select.select([sock], [], [], 0.5)
            except (OSError, ValueError):  # closed under us
                return
            if ready:
                with self._lock:
                    if self._sock is sock:
                        self._drain(sock, block=False, me=me)

    def _drain(self, sock: socket.socket, *, block: bool, me: tuple[int, int] | None = None) -> None:
        while True:
            try:
                data = sock.recv(65536, 0 if block else socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == 105:  # ENOBUFS: events were dropped; the tree is read again, an exit assumed
                    self._record(0, None)
                    self._rescan(replace=True)
                    continue
                return
            self._event(data, me)

    def _event(self, data: bytes, me: tuple[int, int] | None) -> None:
        if len(data) < _DATA_AT + 16:
            return
        what, _cpu, ts_ns = struct.unpack_from("IIQ", data, _EVENT_AT)
        if what == PROC_EVENT_FORK:
            _parent_pid, parent_tgid, child_pid, child_tgid = struct.unpack_from("4I", data, _DATA_AT)
            if me is not None and (child_tgid, child_pid) == me:  # (a thread's "parent" is its process's parent)
                self._tested.set()
            if child_pid == child_tgid and parent_tgid in self.members:  # a process, not a thread
                self.members.add(child_tgid)
                if parent_tgid == self.root:
                    self.workers.add(child_tgid)
        elif what == PROC_EVENT_EXIT and len(data) >= _DATA_AT + 16:
            pid, tgid, code, _sig = struct.unpack_from("4I", data, _DATA_AT)
            if pid == tgid and pid in self.members:  # the thread-group leader: the process itself
                # the event's time is the kernel's CLOCK_MONOTONIC, which time.monotonic reads
                self._record(pid, code, ts_ns / 1e9 if self.clock is time.monotonic else None)

    # ---- the fallback ----------------------------------------------------------------------------------------

    def _poll_loop(self) -> None:
        with self._lock:
            self._pidfds = proctree.Watch([])
            self._rescan()
        while True:
            with self._lock:
                if self._closed or self._pidfds is None:
                    return
                self._refresh()
            time.sleep(POLL_S)

    def _refresh(self) -> None:
        assert self._pidfds is not None
        for pid, status in self._pidfds.ended().items():
            self._pidfds.forget(pid)
            self._record(pid, status)
        if proctree.alive(self.root):
            self._rescan()


def _subscribe() -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
    try:
        try:
            sock.setsockopt(socket.SOL_SOCKET, 33, RCVBUF)  # SO_RCVBUFFORCE (root): past net.core.rmem_max
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        sock.bind((0, CN_IDX_PROC))
        op = struct.pack("I", PROC_CN_MCAST_LISTEN)
        msg = struct.pack("IIIIHH", CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(op), 0) + op
        sock.send(struct.pack("IHHII", 16 + len(msg), _NLMSG_DONE, 0, 0, 0) + msg)
    except OSError:
        sock.close()
        raise
    return sock
