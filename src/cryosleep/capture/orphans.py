"""What a restore leaves running when its agent dies before the restored job is supervised, found and ended.

CRIU restores a sandbox in steps: it forks the sandbox's init into a fresh PID namespace, the init forks the rest,
each task maps its own memory back; only at the end does CRIU write the init's PID (its ``--pidfile``) and exit,
and only then does the agent hold the tree as its child. An agent killed in between (SIGKILL, the OOM killer)
leaves CRIU (ended by its parent-death signal), CRIU's helpers (stopped, in CRIU's process group), tasks
half-restored and, once CRIU has finished, the whole restored tree: none of it supervised, the half-restored part
never to run, the finished part holding the job's addresses, so that the next restore of the job fails
("Cannot assign requested address"). docs/reliability.md has the rounds that found it.

So each restore is marked before CRIU starts (:class:`Marks`): a token in CRIU's environment, which every process
CRIU forks (helpers, the tasks it restores, its action scripts) carries until its own memory, and with it its
environment, is put back; and a file where CRIU's setup-namespaces action records the init's PID and start time:
PID 1 of the sandbox's namespace, whose end ends every task in it. The agent's watchdog is told the marks before
CRIU starts and the init once CRIU is done; if the agent dies before the restored job runs, it ends both
(:func:`end`).
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryosleep.capture import criu as criu_calls
from cryosleep.core import proctree

MARK_ENV = "CRYOSLEEP_RESTORE_MARK"
ROOT_ENV = "CRYOSLEEP_RESTORE_ROOT"
END_WAIT_S = 10.0  # a SIGKILLed task ends at once; this bounds a task stuck in the kernel (D state)

# CRIU runs every action script at every stage; this one acts at setup-namespaces, where CRIU has forked the
# sandbox's init and nothing else yet (CRTOOLS_INIT_PID: its PID here). Field 22 of /proc/PID/stat, its start
# time, comes after the command name, which may hold spaces: cut up to the last ") ". Every path exits 0: a
# failing action script fails the restore, and this record only serves a dead agent.
ROOT_SCRIPT = (
    "#!/bin/sh\n"
    "# CRIU's setup-namespaces action of a Cryosleep restore (capture/orphans.py): the restored sandbox's init\n"
    "# recorded (PID, start time) for the agent's watchdog.\n"
    f"[ \"$CRTOOLS_SCRIPT_ACTION\" = setup-namespaces ] && [ -n \"${ROOT_ENV}\" ] || exit 0\n"
    "set -f\n"
    "read -r stat < /proc/\"$CRTOOLS_INIT_PID\"/stat || exit 0\n"
    "set -- ${stat##*) }\n"
    "shift 19\n"
    f"echo \"$CRTOOLS_INIT_PID $1\" > \"${ROOT_ENV}.tmp\" && mv \"${ROOT_ENV}.tmp\" \"${ROOT_ENV}\"\n"
    "exit 0\n"
)


@dataclass(frozen=True)
class Marks:
    """One restore's marks: what its watchdog finds it by."""

    token: str  # in CRIU's environment as MARK_ENV=token, inherited by all it forks
    root_file: str  # "PID STARTTIME" of the restored init, written at CRIU's setup-namespaces

    @classmethod
    def new(cls, work_dir: Path) -> Marks:
        root = work_dir / "restore.root"
        root.unlink(missing_ok=True)
        return cls(secrets.token_hex(12), str(root))

    def action(self) -> tuple[str, dict[str, str]]:
        """CRIU's ``--action-script`` that records the init, and the environment that marks this restore."""
        return criu_calls.action_script("criu-restore-root", ROOT_SCRIPT), {MARK_ENV: self.token,
                                                                            ROOT_ENV: self.root_file}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Marks:
        return cls(str(data["token"]), str(data["root_file"]))


def recorded_root(marks: Marks) -> tuple[int, str] | None:
    """The restored init (PID, start time), if CRIU got as far as recording it and it is still that process."""
    try:
        pid_s, started = Path(marks.root_file).read_text().split()
        pid = int(pid_s)
    except (OSError, ValueError):
        return None
    return (pid, started) if pid > 1 and proctree.start_time(pid) == started else None


def marked(marks: Marks) -> list[tuple[int, str]]:
    """Processes whose environment carries this restore's token (CRIU and what it forked, not yet restored):
    (PID, start time), the start time read first so that a PID recycled meanwhile is told apart."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid() or not (started := proctree.start_time(int(d))):
            continue
        if proctree.environ(int(d)).get(MARK_ENV) == marks.token:
            found.append((int(d), started))
    return found


def _open(pid: int, started: str) -> int | None:
    """A pidfd of ``pid``, if it is still the process first seen (its start time unchanged)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    if proctree.start_time(pid) != started:
        os.close(fd)
        return None
    return fd


def end(marks: Marks) -> list[str]:
    """Everything of a restore whose agent died, ended: the restored init CRIU recorded (PID 1 of the sandbox's
    namespace: the kernel ends the rest) and every marked process, SIGKILLed by pidfd (no recycled PID is
    signalled) and waited for. Returns what was done (empty: nothing was left)."""
    root = recorded_root(marks)
    targets = dict.fromkeys([*([root] if root else []), *marked(marks)])
    held = [(pid, fd) for pid, started in targets if (fd := _open(pid, started)) is not None]
    for _, fd in held:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.monotonic() + END_WAIT_S
    for _, fd in held:
        select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        os.close(fd)
    done = []
    ended = [pid for pid, _ in held]
    if root is not None and root[0] in ended:
        done.append(f"the restored sandbox (init {root[0]}) killed")
    if rest := sorted(p for p in ended if root is None or p != root[0]):
        done.append(f"its CRIU restore and what it forked (PIDs {', '.join(map(str, rest))}) ended")
    return done
