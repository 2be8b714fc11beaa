"""A failed job's report, as torchrun prints it: which rank failed first, its exit code and its error file.

Each worker's ``TORCHELASTIC_ERROR_FILE`` is ``logs/rank-<R>.error.json`` in the job's directory (torchrun's is
``<log dir>/attempt_0/<local rank>/error.json``): the ``@record`` decorator of
``torch.distributed.elastic.multiprocessing.errors`` writes the worker's exception there. The directory is the job's,
so a snapshot carries the path (the logs are open files of the workers) and a restored worker writes it where the
agent reads it. The summary is torchrun's ``ChildFailedError`` message, made from the same fields.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from cryosleep.core import users
from cryosleep.core.job import JobDir, JobSpec

NOT_AVAILABLE = "<N/A>"
# workers ended by the sandbox's init after another failed: not failures of their own
_ENDED = {f"signal {int(signal.SIGTERM)}", f"signal {int(signal.SIGKILL)}"}


def error_file(job: JobDir, spec: JobSpec, rank: int | str) -> Path:
    """Rank ``rank``'s error file (``"{rank}"``: the pattern cryosleep-init fills in for each worker)."""
    return job.error_file(rank, own_user=bool(spec.user))


ERROR_FILE_LIMIT = 1 << 20  # an error report larger than this is not read (a worker wrote it: its size is theirs)


def _read_report(path: Path) -> str:
    """The error file's text, read without following a link and only when the worker's user (its directory's
    owner) wrote it: a root agent never reads another file on a worker's behalf (core/users.py)."""
    fd = users.open_owned(path)
    with os.fdopen(fd, "rb") as f:
        return f.read(ERROR_FILE_LIMIT).decode(errors="replace")


@dataclass(frozen=True)
class Failure:
    rank: int
    local_rank: int
    exitcode: int  # negative: killed by that signal (as torchrun reports it)
    error_file: str  # NOT_AVAILABLE when the worker wrote none
    message: str | dict[str, Any]
    timestamp: int

    def signal_name(self) -> str:
        try:
            return signal.Signals(-self.exitcode).name if self.exitcode < 0 else NOT_AVAILABLE
        except ValueError:
            return NOT_AVAILABLE


def _exitcode(text: str) -> int | None:
    kind, _, value = text.strip().partition(" ")
    try:
        return int(value) if kind == "exit" else -int(value) if kind == "signal" else None
    except ValueError:
        return None


def failures(job: JobDir, spec: JobSpec) -> list[Failure]:
    """The failed workers, those that failed on their own first (the others were ended because of them)."""
    found: list[tuple[bool, Failure]] = []
    for local, rank in enumerate(spec.ranks):
        try:
            status = (job.logs / f"rank-{rank}.exit").read_text()
        except FileNotFoundError:
            continue
        code = _exitcode(status)
        if not code:
            continue
        path = error_file(job, spec, rank)
        message: str | dict[str, Any] = ""
        stamp = int(path.stat().st_mtime) if path.exists() else int(time.time())
        where = NOT_AVAILABLE
        try:
            data = json.loads(_read_report(path))
            message = data["message"]
            stamp = int(data.get("timestamp", 0) if isinstance(message, str) else message["extraInfo"]["timestamp"])
            where = str(path)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if not message:
            message = (f"Signal {-code} ({signal.Signals(-code).name}) received by the worker" if code < 0 else
                       "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html")
        found.append((status.strip() in _ENDED and where == NOT_AVAILABLE,
                      Failure(rank, local, code, where, message, stamp)))
    found.sort(key=lambda f: (f[0], f[1].timestamp, f[1].rank))
    return [f for _, f in found]


def _format(idx: int, f: Failure) -> str:
    msg = f.message
    if isinstance(msg, dict):
        msg = str(msg.get("extraInfo", {}).get("py_callstack", msg.get("message", NOT_AVAILABLE))).replace("\n", "\n  ")
    sig = f.signal_name()
    return (f"[{idx}]:\n"
            f"  time      : {datetime.fromtimestamp(f.timestamp).isoformat(sep='_')}\n"
            f"  host      : {socket.getfqdn()}\n"
            f"  rank      : {f.rank} (local_rank: {f.local_rank})\n"
            f"  exitcode  : {f.exitcode} (pid: {NOT_AVAILABLE}){f' ({sig})' if sig != NOT_AVAILABLE else ''}\n"
            f"  error_file: {f.error_file}\n"
            f"  traceback : {msg}")


def entrypoint(program: list[str]) -> str:
    """What torchrun names the job in its report: the script (or module), else the program."""
    if program and "python" in Path(program[0]).name:
        return next((a for a in program[1:] if not a.startswith("-")), program[0])
    return program[0] if program else NOT_AVAILABLE


def summary(name: str, found: list[Failure]) -> str:
    """torchrun's failure report (``ChildFailedError.format_msg``): the first failure is the root cause."""
    if not found:
        return ""
    root, others = found[0], found[1:]
    blocks = [_format(i + 1, f) for i, f in enumerate(others)]
    root_fmt = _format(0, root)
    title = f"{name} FAILED"
    width = min(max(len(line) for text in [title, root_fmt, *blocks] for line in text.split("\n")), 60)
    return "\n".join([
        "=" * width, title, "-" * width, "Failures:", "\n".join(blocks or ["  <NO_OTHER_FAILURES>"]), "-" * width,
        "Root Cause (first observed failure):", root_fmt, "=" * width])
