"""A job never outlives its agent in the middle of a snapshot.

From the cut until the job runs again (communicators destroyed, the sandbox cut off the job network, CRIU
holding the tree stopped), only the agent can bring a node's part of the job back. If the agent dies there
(SIGKILL, OOM, a crash), the sandbox would stay frozen or deaf, the job half-dead: the other nodes wait on it
forever. The watchdog is a small process of its own session that the agent arms for that window; if the agent
goes while it is armed, the watchdog kills the sandbox's init (its PID namespace ends with it), so the job
fails as a whole and its last verified snapshot is what to restore (docs/reliability.md). If a CRIU dump was
under way or held the job (``dump JSON``: capture/netlock.py), the watchdog also ends that CRIU and removes
its network lock, which would otherwise stay on the host and hang the restore.

Whatever the moment, a dead agent's snapshot under way leaves its staging directory (``staging PATH``), and its
job's network its bridge and overlay on the host (``net JSON``): the watchdog removes the staging at once, and
releases the job network once the sandbox has ended (killed here, or later, by itself, when it ran on unsupervised
because the agent died outside the armed window), as the agent would have on its way out.

A restoring agent starts its watchdog before CRIU does, armed, with no sandbox yet: it is told the restore's marks
(``restore JSON``: capture/orphans.py) before CRIU starts, the job network's veth once made, and the restored init
(``init PID``) once CRIU is done; it is disarmed once the restored job runs. If the agent dies in that window, the
watchdog ends CRIU, what it forked and what it restored, so that nothing of a restore nobody supervises is left
holding the job's addresses, and the job stays suspended in its snapshot.

The agent writes one line per change to the watchdog's stdin (a pipe): ``arm REASON``, ``disarm``, ``dump
JSON``, ``staging [PATH]``, ``net JSON``, ``restore JSON``, ``init PID``; on its own way out, after its job ended,
``end`` (nothing to undo); then it closes the pipe. A pipe that closes without ``end`` is the agent's death. The
sandbox's init is named by PID once (at start, or by ``init``, while it is the agent's child) and held by a
pidfd, so a recycled PID is never signalled.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryosleep.capture import netlock, orphans
from cryosleep.net import sandbox as net_sandbox


class Watchdog:
    """The agent's side: spawns the watchdog for one sandbox, arms and disarms it."""

    def __init__(self, init_pid: int | None, log: str, net: dict[str, Any] | None = None,
                 net_end: str | None = None) -> None:
        """``init_pid``: the sandbox's init (None: a restore's, not made yet: :meth:`restored` names it);
        ``net``: the job network's JSON (JobSpec.net) and ``net_end`` the sandbox's veth host end, released here
        if the agent dies."""
        self.lock = threading.Lock()
        self.armed = False
        self.proc = subprocess.Popen([sys.executable, "-m", "cryosleep.agent.watchdog",
                                      "-" if init_pid is None else str(init_pid), log],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        if net:
            self.network(net, net_end)

    def _say(self, line: str) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(line.encode() + b"\n")
            stdin.flush()
        except OSError:
            pass  # it is gone: nothing to arm

    def arm(self, reason: str) -> None:
        with self.lock:
            if not self.armed:
                self.armed = True
                self._say("arm " + reason.replace("\n", " "))

    def disarm(self) -> None:
        with self.lock:
            if self.armed:
                self.armed = False
                self._say("disarm")

    def dump(self, rec: dict[str, Any] | None, nft: Sequence[str] | None) -> None:
        """The CRIU dump under way or holding the job (capture/netlock.py), or None: what to undo if the agent
        dies."""
        with self.lock:
            self._say("dump " + json.dumps({"rec": rec, "nft": list(nft) if nft else None} if rec else None))

    def staging(self, path: str | None) -> None:
        """The staging directory of the snapshot under way, or None once it was published or removed."""
        with self.lock:
            self._say("staging " + (path or ""))

    # -- a restore (capture/restore.py's Guard) ----------------------------------------------------------

    def restoring(self, marks: orphans.Marks) -> None:
        """The restore's marks, before CRIU starts: what to end if the agent dies while armed."""
        with self.lock:
            self._say("restore " + json.dumps(marks.to_json()))

    def restored(self, init_pid: int) -> None:
        """The restored sandbox's init (the agent's child, so its PID is not recycled before the watchdog holds
        it)."""
        with self.lock:
            self._say(f"init {init_pid}")

    def network(self, net: dict[str, Any], end: str | None) -> None:
        """The job network and the sandbox's veth host end: released once the sandbox ended, if the agent died."""
        with self.lock:
            self._say("net " + json.dumps({"net": net, "end": end}))

    def close(self) -> None:
        """The agent's own end, its job ended: nothing for the watchdog to undo."""
        with self.lock:
            self.armed = False
            self._say("end")
            if self.proc.stdin is not None:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass  # it is gone already (its "end" could not be flushed)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main(argv: list[str]) -> int:
    init_pid, log = (None if argv[0] == "-" else int(argv[0])), argv[1]
    # A scheduler ending the job signals every process of it (Slurm: SIGTERM to the whole step): the watchdog ends
    # with its agent (its pipe closes), never before, or a stop snapshot would lose its guard.
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    pidfd = _hold(init_pid) if init_pid is not None else None
    if init_pid is not None and pidfd is None:
        return 0  # the sandbox is gone already
    armed: str | None = None
    dump: dict[str, Any] | None = None
    restore: orphans.Marks | None = None
    staging = ""
    net: dict[str, Any] | None = None
    for raw in sys.stdin.buffer:
        line = raw.decode(errors="replace").strip()
        if line == "end":
            return 0  # the agent's own end: it released all it had
        if line.startswith("arm"):
            armed = line[4:] or "a snapshot"
        elif line == "disarm":
            armed, restore = None, None  # a restore's window closes when the restored job runs
        elif line.startswith("dump "):
            dump = json.loads(line[5:])
        elif line.startswith("staging"):
            staging = line[8:]
        elif line.startswith("net "):
            net = json.loads(line[4:])
        elif line.startswith("restore "):
            restore = orphans.Marks.from_json(json.loads(line[8:]))
        elif line.startswith("init "):
            init_pid = int(line[5:])
            pidfd = _hold(init_pid)
    undone: list[str] = []
    if armed is not None or dump is not None:
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                what = "killed"
            except OSError as e:
                what = f"could not be killed ({e})"
            undone.append(f"the sandbox (init {init_pid}) {what}, so that no part of the job is left half-captured")
        if restore is not None:
            undone += orphans.end(restore) or ["no process of the restore was left"]
        if dump:
            undone += netlock.undo(netlock.DumpRecord.from_json(dump["rec"]), dump["nft"])
    if staging:
        undone += netlock.undo_staging(Path(staging))
    if undone:
        killed = armed is not None or dump is not None
        during = armed or ("a dump" if dump else "a snapshot")
        after = ("; nothing of the restore is left running: restore the snapshot again" if restore is not None
                 else "; restore the job's last verified snapshot")
        _say(log, f"the agent died during {during}: " + "; ".join(undone) + (after if killed else ""))
    if net is not None:  # the sandbox's end (now, or when the job ends by itself, unsupervised), then the release
        if pidfd is not None:
            select.select([pidfd], [], [])
        net_sandbox.release(net["net"], own_end=net["end"])
        _say(log, "the agent had died: its job's sandbox ended, the job network released on this host (its bridge "
             "and overlay, if no other node of the job uses them here)")
    return 0


def _hold(pid: int) -> int | None:
    """A pidfd of the sandbox's init (None: it is gone)."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def _say(log: str, text: str) -> None:
    try:
        with open(log, "a") as f:
            f.write(f"cryosleep watchdog: {time.strftime('%H:%M:%S')} {text}\n")
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
