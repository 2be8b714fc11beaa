"""A job never outlives its agent in the middle of a snapshot.

From the cut until the job runs again (communicators destroyed, the sandbox cut off the job network, CRIU
holding the tree stopped), only the agent can bring a node's part of the job back. If the agent dies there
(SIGKILL, OOM, a crash), the sandbox would stay frozen or deaf, the job half-dead: the other nodes wait on it
forever. The watchdog is a small process of its own session that the agent arms for that window; if the agent
goes while it is armed, the watchdog kills the sandbox's init (its PID namespace ends with it), so the job
fails as a whole and its last verified snapshot is what to restore (docs/reliability.md). If a CRIU dump was
under way or held the job (``dump JSON``: capture/netlock.py), the watchdog also ends that CRIU and removes
its network lock, which would otherwise stay on the host and hang the restore.

The agent writes one line per change to the watchdog's stdin (a pipe): ``arm REASON`` or ``disarm``; it closes
the pipe (or dies) to end it. The sandbox's init is named by PID once, at start, and held by a pidfd, so a
recycled PID is never signalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from cryosleep.capture import netlock


class Watchdog:
    """The agent's side: spawns the watchdog for one sandbox, arms and disarms it."""

    def __init__(self, init_pid: int, log: str) -> None:
        self.lock = threading.Lock()
        self.armed = False
        self.proc = subprocess.Popen([sys.executable, "-m", "cryosleep.agent.watchdog", str(init_pid), log],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

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

    def close(self) -> None:
        with self.lock:
            self.armed = False
            self._say("disarm")
            if self.proc.stdin is not None:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass  # it is gone already (its "disarm" could not be flushed)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main(argv: list[str]) -> int:
    init_pid, log = int(argv[0]), argv[1]
    # A scheduler ending the job signals every process of it (Slurm: SIGTERM to the whole step): the watchdog ends
    # with its agent (its pipe closes), never before, or a stop snapshot would lose its guard.
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    try:
        pidfd = os.pidfd_open(init_pid)
    except OSError:
        return 0  # the sandbox is gone already
    armed: str | None = None
    dump: dict[str, Any] | None = None
    for raw in sys.stdin.buffer:
        line = raw.decode(errors="replace").strip()
        if line.startswith("arm"):
            armed = line[4:] or "a snapshot"
        elif line == "disarm":
            armed = None
        elif line.startswith("dump "):
            dump = json.loads(line[5:])
    if armed is None and dump is None:
        return 0  # the agent ended (or died) with the job in a state it survives
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        what = "killed"
    except OSError as e:
        what = f"could not be killed ({e})"
    undone = netlock.undo(netlock.DumpRecord.from_json(dump["rec"]), dump["nft"]) if dump else []
    try:
        with open(log, "a") as f:
            f.write(f"cryosleep watchdog: {time.strftime('%H:%M:%S')} the agent died during {armed or 'a dump'}: "
                    f"the sandbox (init {init_pid}) {what}, so that no part of the job is left half-captured"
                    f"{'; ' + ', '.join(undone) if undone else ''}; restore the job's last verified snapshot\n")
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
