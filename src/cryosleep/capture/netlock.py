"""CRIU's network lock as a dead agent can leave it behind, and what whoever outlives that agent does.

A dump with ``--tcp-established`` adds an nftables table ``CRIU-<run id>`` (cut to fit a table name) to the
network namespace of the tree: its sets name every TCP connection of the job, and its rules drop their
packets until CRIU (or the agent, after a stop dump) removes it. For a sandbox on the host's network that is
the host's namespace, so the table outlives the job: an agent SIGKILLed while CRIU dumps, or while a stop dump
holds the job, leaves it there, and a later restore of the job brings back the very connections it drops
(the restored ranks hang at their first collective).

So the agent records each dump in the job's state (``JobState.dump``: a :class:`DumpRecord`) from before CRIU
starts until its lock is gone, and tells its watchdog the same. Whoever outlives a dead agent undoes what that
record names, and only that (never another dump's table): the watchdog as it kills the sandbox, the next run
or restore of the job on the host, ``cryosleep check``. A restore of a job on the host's network also refuses
to start under any CRIU table that names the job's rendezvous port and that it did not take
(:func:`blocking`): it would hang, and the table may belong to a dump still under way.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryosleep.capture import criu_install
from cryosleep.capture.criu import run_id
from cryosleep.core import proctree
from cryosleep.core.job import JobDir
from cryosleep.errors import CryosleepError

TABLE_RE = re.compile(r"^table (\S+) (CRIU-\S+)$")
# one element of a CRIU lock set: "127.0.0.1 . 52410 . 127.0.0.1 . 29500"
ELEMENT_RE = re.compile(r"(\S+) \. (\d+) \. (\S+) \. (\d+)")


@dataclass
class DumpRecord:
    """A CRIU dump under way (or holding its job stopped), as the job's state records it."""

    dir: str  # the dump's work directory (-W): its dump.log names the run id, hence the lock table
    criu_pid: int = 0  # CRIU, once started (it leads its own process group)
    run_id: str | None = None  # once CRIU has exited (a stop dump holds the job under its lock)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DumpRecord:
        return cls(**data)


def tables(nft: Sequence[str]) -> list[tuple[str, str]]:
    """Every CRIU lock table in this network namespace: (family, name)."""
    out = subprocess.run([*nft, "list", "tables"], capture_output=True, text=True, check=False)
    return [(m.group(1), m.group(2)) for m in (TABLE_RE.match(ln.strip()) for ln in out.stdout.splitlines()) if m]


def of_run(name: str, rid: str) -> bool:
    """Whether table ``name`` is the lock of CRIU run ``rid`` (CRIU cuts the run id to fit a table name)."""
    return name.startswith("CRIU-") and len(name) > len("CRIU-") and rid.startswith(name[len("CRIU-"):])


def _is_criu_of(pid: int, work_dir: str) -> bool:
    """``pid`` is still the CRIU of that dump (not a recycled PID)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"dump" in argv and work_dir.encode() in argv


def undo_dead_dump(job: JobDir, log: Callable[[str], None]) -> None:
    """(the job's lock just taken) What a previous agent of this job left on this host when it died during a
    dump (its CRIU, its network lock, its staging) is undone; nothing when it left nothing."""
    try:
        old = job.read()[1]
    except (CryosleepError, OSError, ValueError, KeyError, TypeError):
        return
    done = undo_state(old.dump, old.staging)
    if done:
        log(f"job {job.name}'s previous agent died during a {'dump' if old.dump else 'snapshot'}: " + ", ".join(done))


def undo_state(dump: dict[str, Any] | None, staging: str | None) -> list[str]:
    """What a dead agent's job state names (JobState.dump, JobState.staging), undone; returns what was done."""
    done: list[str] = []
    if dump:
        try:
            nft = criu_install.locate().nft_argv
        except CryosleepError:
            nft = None
        done += undo(DumpRecord.from_json(dump), nft)
    if staging:
        done += undo_staging(Path(staging))
    return done


def undo_staging(staging: Path) -> list[str]:
    """A dead agent's snapshot under way: its staging directory (``<store>/.staging/<snapshot id>``) removed."""
    if staging.parent.name == ".staging" and staging.is_dir():
        shutil.rmtree(staging, ignore_errors=True)
        return [f"its staging directory {staging} removed"]
    return []


def undo(rec: DumpRecord, nft: Sequence[str] | None) -> list[str]:
    """Undo what a dead agent's dump left on this host: its CRIU and everything CRIU forked ended, its lock
    table removed, its staging directory deleted. Returns what was done (empty: nothing was left)."""
    done: list[str] = []
    if rec.criu_pid and _is_criu_of(rec.criu_pid, rec.dir):
        try:
            os.killpg(rec.criu_pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        end = time.monotonic() + 10.0
        while time.monotonic() < end and proctree.alive(rec.criu_pid):
            time.sleep(0.02)
        done.append(f"its CRIU (PID {rec.criu_pid}) ended")
    rid = rec.run_id or run_id(Path(rec.dir) / "dump.log")
    if rid and nft:
        for family, name in tables(nft):
            if of_run(name, rid):
                subprocess.run([*nft, "delete", "table", family, name], capture_output=True, check=False)
                done.append(f"its network lock (nftables table {family} {name}) removed")
    done += undo_staging(Path(rec.dir).parent.parent)  # <store>/.staging/<snapshot id>/nodes/<rank>
    return done


def blocking(nft: Sequence[str] | None, port: int) -> list[str]:
    """The CRIU lock tables of this namespace that drop connections to or from ``port`` (a job's rendezvous
    port: every rank's store connection uses it), as ``family name``."""
    if not nft:
        return []
    found: list[str] = []
    for family, name in tables(nft):
        out = subprocess.run([*nft, "list", "table", family, name], capture_output=True, text=True, check=False)
        for m in ELEMENT_RE.finditer(out.stdout):
            if port in (int(m.group(2)), int(m.group(4))):
                found.append(f"{family} {name}")
                break
    return found
