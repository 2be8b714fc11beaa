"""The same launch line resumes: what `cryosleep run` does when its job has been here before.

A requeued Slurm batch script, a restarted pod or a rerun by hand runs the same ``cryosleep run ...`` line again.
Before it starts anything, the launcher asks :func:`choose` whether this job has a snapshot to continue from:

- **suspended**: the job's last run ended in a stop snapshot (its record here says so, or, on a machine that never
  ran it, the job's record in the store does): that snapshot is restored, if its command is this one (same name,
  program and arguments, same shape); a different command is refused, naming the snapshot, since a silent fresh
  start would leave it behind and a restore would run what the line did not say;
- **crashed** (``--resume latest``): the last run died without a stop snapshot (its agent gone, or failed): the
  newest verified snapshot of the job with this command is restored;
- otherwise, and always with ``--fresh``, the job starts anew.

The choice is a pure function of what was found (:class:`Found`), so that every rule is tested without jobs; the
launcher makes it while it holds the job's lock, so two launches of one job on a machine never both run it (the
second meets the first's lock). What it chose, and why, goes to the job's decision log and to stderr.

The job's record in a store (``jobs/<name>.json`` beside the snapshots: in a directory store's root, and as an
object of a remote chunk store) is written by the agent as the job starts, is restored, and ends, so that a new
machine with only the store knows whether the newest stop snapshot is still waiting to be resumed.

In a remote store the record is also the job's **claim** (:class:`Claim`), so that two launches on two machines (a
pod and its replacement) never both run it: every write of it is conditional on the version last read (S3's
``If-Match``/``If-None-Match``, a lock for a directory), a running job's agent refreshes it every
``HEARTBEAT_S``, and a launch that finds it running elsewhere with a fresh lease (``LEASE_S``) waits for that run
to end (its stop snapshot then resumes here) before it chooses; a lease not refreshed for ``LEASE_S`` is a run
that died with its machine.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from cryosleep.errors import Conflict, CryosleepError

Policy = Literal["auto", "latest", "fresh"]

# What makes two launches the same job: the name is the record's key; these fields of the spec must match.
SAME_JOB_FIELDS = ("program", "nproc_per_node", "nnodes", "node_rank")


def command_of(spec: dict[str, Any]) -> dict[str, Any]:
    """The part of a job spec that a resumed launch must repeat. The interpreter's path is left out of the program
    (a new machine's virtualenv may live elsewhere); the script and every argument count."""
    out = {k: spec.get(k) for k in SAME_JOB_FIELDS}
    program = list(spec.get("program") or [])
    if program and Path(str(program[0])).name.startswith("python"):
        program = ["python", *program[1:]]
    out["program"] = program
    return out


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """How the command of spec ``b`` differs from spec ``a``'s, one line each (empty: the same job)."""
    ca, cb = command_of(a), command_of(b)
    return [f"{k}: {ca[k]!r} then, {cb[k]!r} now" for k in SAME_JOB_FIELDS if ca[k] != cb[k]]


@dataclass(frozen=True)
class Candidate:
    """A snapshot of the job, as found in a store."""

    id: str
    mode: str  # "stop" | "keep-running"
    created_at: float
    job: dict[str, Any]  # its job spec
    verified: bool  # complete and intact where it is (a stop snapshot was verified before it was reported safe)
    where: str  # "local" or the remote store's URL


@dataclass(frozen=True)
class Found:
    """What the launcher found about the job before choosing."""

    spec: dict[str, Any]  # the job as this launch line describes it
    last_state: str | None = None  # the job's record on this machine: running | suspended | exited | failed | lost
    last_snapshot: str | None = None  # ... and its last snapshot
    last_at: float = 0.0  # ... and when it was written (the run's end, else its start)
    store_state: str | None = None  # the job's record in the store (jobs/<name>.json): running | suspended | ended
    store_snapshot: str | None = None
    store_at: float = 0.0
    candidates: tuple[Candidate, ...] = ()


@dataclass(frozen=True)
class Choice:
    action: Literal["fresh", "restore", "refuse"]
    reasons: tuple[str, ...]
    snapshot: Candidate | None = None

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "reasons": list(self.reasons),
                "snapshot": self.snapshot.id if self.snapshot else None,
                "where": self.snapshot.where if self.snapshot else None}


def choose(found: Found, policy: Policy) -> Choice:
    """Resume, start fresh, or refuse: the rules in the module's docstring."""
    name = str(found.spec.get("name"))
    if policy == "fresh":
        return Choice("fresh", ("--fresh: the job starts anew, whatever snapshots it has",))
    by_id = {c.id: c for c in found.candidates}
    if found.store_state is not None and (found.last_state is None or found.store_at > found.last_at):
        # the store's record is newer: the job ran on (or was resumed by) another machine since it last ran here
        found = replace(found, last_state=None, last_snapshot=None)
    suspended_in, said = None, ""
    if found.last_state == "suspended" and found.last_snapshot:
        suspended_in, said = found.last_snapshot, "its record on this machine"
    elif found.last_state is None and found.store_state == "suspended" and found.store_snapshot:
        suspended_in, said = found.store_snapshot, "its record in the store"
    if suspended_in is not None:
        snap = by_id.get(suspended_in)
        if snap is None:
            return Choice("refuse", (f"job {name} is suspended in snapshot {suspended_in} ({said}), but that snapshot "
                                     "is in no store this launch reads",))
        diff = differences(snap.job, found.spec)
        if diff:
            return Choice("refuse", (f"job {name} is suspended in snapshot {snap.id}, taken of another command: "
                                     + "; ".join(diff),), snap)
        return Choice("restore", (f"job {name} is suspended in snapshot {snap.id} ({said}); its command is this one",),
                      snap)
    crashed = found.last_state in ("failed", "lost") or (found.last_state is None and found.store_state == "running")
    if policy == "latest" and crashed:
        usable = [c for c in found.candidates if c.verified and not differences(c.job, found.spec)]
        if usable:
            snap = max(usable, key=lambda c: c.created_at)
            return Choice("restore", (f"--resume latest: job {name}'s last run ended without a stop snapshot "
                                      f"({found.last_state or 'running, says the store'}); {snap.id} is its newest "
                                      f"verified {snap.mode} snapshot with this command",), snap)
        return Choice("fresh", (f"--resume latest: job {name}'s last run ended without a stop snapshot, and no "
                                "verified snapshot of it has this command: the job starts anew",))
    if found.last_state is None and found.store_state is None:
        return Choice("fresh", (f"job {name} has no record here or in the store: a new job",))
    if crashed:
        return Choice("fresh", (f"job {name}'s last run ended without a stop snapshot "
                                f"({found.last_state or 'running'}); it starts anew (`--resume latest` would restore "
                                "its newest verified snapshot)",))
    last = found.last_state or found.store_state
    return Choice("fresh", (f"job {name}'s last run {'ended' if last in ('exited', 'ended') else 'is ' + str(last)}, "
                            "not suspended: the job starts anew",))


# -- the job's record in a store --------------------------------------------------------------------------------

RECORD_DIR = "jobs"


@dataclass
class StoreRecord:
    """``jobs/<name>.json`` in a store: where the job's life stands, for a machine that never ran it."""

    job: str
    state: str  # running | suspended | ended | failed
    snapshot: str | None = None  # suspended: the stop snapshot; running: the snapshot it was restored from
    host: str = field(default_factory=socket.gethostname)
    at: float = field(default_factory=time.time)  # written, and refreshed every HEARTBEAT_S while running
    run: str = ""  # the launch that holds the claim (a remote store's record)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def parse(cls, data: bytes) -> StoreRecord | None:
        """None for anything that is not a record (a damaged or foreign file reads as no record)."""
        try:
            d = json.loads(data)
            rec = cls(job=str(d["job"]), state=str(d["state"]), snapshot=d.get("snapshot"),
                      host=str(d.get("host", "")), at=float(d.get("at", 0.0)), run=str(d.get("run", "")))
        except (ValueError, KeyError, TypeError):
            return None
        if rec.snapshot is not None and not isinstance(rec.snapshot, str):
            return None
        return rec


def record_name(job: str) -> str:
    return f"{RECORD_DIR}/{job}.json"


def write_local_record(store_root: Path, rec: StoreRecord) -> None:
    path = store_root / record_name(rec.job)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(rec.to_json(), sort_keys=True))
    os.replace(tmp, path)


def read_local_record(store_root: Path, job: str) -> StoreRecord | None:
    try:
        rec = StoreRecord.parse((store_root / record_name(job)).read_bytes())
    except OSError:
        return None
    return rec if rec is not None and rec.job == job else None


def remote_of(persist: dict[str, Any] | None) -> str | None:
    """The remote store a job persists to (its spec's ``persist``), if any."""
    return str((persist or {}).get("url") or "") or None


def record(store_root: Path, claim: Claim | None, rec: StoreRecord, log: Any = None) -> None:
    """The job's record, in the local store and (through the job's claim, when it persists to a remote store) the
    remote one. A record that cannot be written is said in the agent's log and costs the job nothing: without it a
    new machine starts the job anew."""
    try:
        write_local_record(store_root, rec)
        if claim is not None and not claim.keep(rec.state, rec.snapshot) and claim.lost is not None:
            lost = claim.lost
            if log is not None:
                log(f"the job's record in {claim.url} was taken by another run ({lost.run} on {lost.host}, "
                    f"{lost.state}): not written over; if that run is live, this job now runs twice")
    except (OSError, CryosleepError) as e:
        if log is not None:
            log(f"the job's record ({rec.state}) could not be written to its store: {e}")


# -- the claim: one run of a job at a time across machines -------------------------------------------------------

HEARTBEAT_S = 10.0
LEASE_S = float(os.environ.get("CRYOSLEEP_LEASE_S", "") or 3 * HEARTBEAT_S)  # the env: tests of a lapsed lease


def live_elsewhere(rec: StoreRecord | None, run: str, now: float, host: str | None = None) -> bool:
    """The record is of another run of the job that still holds it: running, refreshed within ``LEASE_S``, and not
    of this machine (the launcher holds the job's lock here, so a run of this host is dead)."""
    return (rec is not None and rec.state == "running" and rec.run != run and now - rec.at < LEASE_S
            and rec.host != (host or socket.gethostname()))


class Claim:
    """The job's record in its remote store, written only over the version this launch last read.

    The backend is opened in the process that uses it (a detached agent forks after the launcher claimed)."""

    def __init__(self, url: str, job: str, run: str | None = None) -> None:
        self.url, self.job = url, job
        self.run = run or uuid.uuid4().hex[:16]
        self.version: str | None = None
        self.last: StoreRecord | None = None  # the record as last read
        self.lost: StoreRecord | None = None  # the record that another run wrote over ours, once seen
        self._backend: Any = None
        self._pid = 0
        self._read = False
        self._lock = threading.Lock()

    def backend(self) -> Any:
        if self._backend is None or self._pid != os.getpid():
            from cryosleep.store.urls import open_backend  # the S3 client, only for a remote store

            self._backend, self._pid = open_backend(self.url), os.getpid()
        return self._backend

    def read(self) -> StoreRecord | None:
        got = self.backend().get_versioned(record_name(self.job))
        rec = StoreRecord.parse(got[0]) if got is not None else None
        self.version = got[1] if got is not None else None
        self.last = rec if rec is not None and rec.job == self.job else None
        self._read = True
        return self.last

    def write(self, state: str, snapshot: str | None) -> None:
        """Our record over the version last read: :class:`~cryosleep.errors.Conflict` if anyone wrote since."""
        rec = StoreRecord(self.job, state, snapshot, run=self.run)
        data = json.dumps(rec.to_json(), sort_keys=True).encode()
        self.version = self.backend().put_if(record_name(self.job), data, self.version)

    def keep(self, state: str, snapshot: str | None) -> bool:
        """The agent's write (a heartbeat, a restore, the end): over our own record only. False when another run
        took the record (our lease lapsed, or an operator's restore elsewhere): it is not written over, and
        :attr:`lost` says who holds it."""
        with self._lock:
            if self.lost is not None:
                return False
            if not self._read:  # an agent that was not launched through a claim (a restore): it takes the record
                self.read()
            for _ in range(3):
                try:
                    self.write(state, snapshot)
                    return True
                except Conflict:
                    rec = self.read()
                    if rec is not None and rec.run != self.run:
                        self.lost = rec
                        return False
            return False


def heartbeat(claim: Claim, recorded: Callable[[], tuple[str, str | None]], log: Callable[[str], None],
              on_lost: Callable[[str], None]) -> None:
    """Refreshes the claim every HEARTBEAT_S while the job's record says running (a thread of the agent); ends
    when the job's record moves on. When another run took the record (this run's lease lapsed while the store was
    out of reach, or two launches raced on a store whose conditional writes do not serialize), ``on_lost`` ends
    this run: the other one already chose what to run, and a job must not run twice."""

    def loop() -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            state, snapshot = recorded()
            if state != "running" or claim.lost is not None:
                return
            try:
                if not claim.keep(state, snapshot):
                    lost = claim.lost
                    on_lost(f"the job's record in {claim.url} was taken by another run"
                            + (f" ({lost.run} on {lost.host}, {lost.state})" if lost else "")
                            + ": this run ends, so that the job runs once")
                    return
            except (OSError, CryosleepError) as e:  # the store unreachable for a while: the lease may lapse
                log(f"the job's record in {claim.url} could not be refreshed: {e}")

    threading.Thread(target=loop, name="claim", daemon=True).start()
