"""`cryosleep run` resuming its job: what it finds about the job, the choice (agent/resume.py), and saying it.

The launcher calls :func:`decide` while it holds the job's lock, before it starts anything. With a remote store it
also claims the job there (agent/resume.py's :class:`~cryosleep.agent.resume.Claim`): a run of the job that still
holds the claim on another machine is waited for, up to ``--wait-previous``, before anything is chosen."""

from __future__ import annotations

import sys
import time
from typing import Any

from cryosleep import paths
from cryosleep.agent import resume
from cryosleep.agent.coordinated import job_name
from cryosleep.coordinator.client import CoordinatorClient
from cryosleep.core.job import JobDir, JobSpec
from cryosleep.errors import Busy, Conflict, Forbidden, NotEligible, NotFound, Unreachable
from cryosleep.store import persist
from cryosleep.store.local import LocalStore
from cryosleep.triggers import decisions

__all__ = ["at_coordinator", "decide", "gather"]

CONFIRM_S = 0.5  # between a claim's write and its read-back


def _local_candidates(store: LocalStore, job: str, verify: bool) -> list[resume.Candidate]:
    out = []
    for m in store.manifests(job):
        ok = m.complete
        if verify and ok and m.mode != "stop":  # --resume latest: re-checked (a stop snapshot was verified at the stop)
            ok = not store.verify(m.id)
        out.append(resume.Candidate(m.id, m.mode, m.created_at, m.job, ok, "local"))
    return out


def _remote_candidates(url: str, job: str, known: set[str]) -> list[resume.Candidate]:
    out = []
    for s in persist.open_chunk_store(url).snapshots(job):
        m = s.image_manifest()
        if m is None or s.id in known:
            continue
        # A snapshot listed in the chunk store was stored and read back whole before it was published there.
        out.append(resume.Candidate(s.id, s.mode, s.created_at, m.job, m.complete, url))
    return out


def gather(spec: JobSpec, policy: resume.Policy, claim: resume.Claim | None = None) -> resume.Found:
    """Everything the choice reads: the job's record here, its record in the store(s), its snapshots there. With a
    claim, the remote store's record is read through it (its version is what the claim writes over)."""
    job = JobDir(spec.name)
    last_state = last_snapshot = None
    last_at = 0.0
    if job.exists():
        _, st = job.read()
        last_state, last_snapshot, last_at = st.state, st.last_snapshot, st.ended_at or st.started_at
    store = LocalStore(paths.default_store())
    remote = resume.remote_of(spec.persist)
    rec = resume.read_local_record(store.root, spec.name)
    if claim is not None:  # the remote record counts when it is the newer (the job ran elsewhere since)
        there = claim.read()
        if there is not None and (rec is None or there.at >= rec.at):
            rec = there
    candidates: list[resume.Candidate] = []
    suspended = last_state == "suspended" or (rec is not None and rec.state == "suspended")
    if policy == "latest" or (policy == "auto" and suspended):  # else the choice reads no snapshot: none listed
        candidates = _local_candidates(store, spec.name, verify=policy == "latest")
        if remote is not None:
            candidates += _remote_candidates(remote, spec.name, {c.id for c in candidates})
    return resume.Found(spec=spec.to_json(), last_state=last_state, last_snapshot=last_snapshot, last_at=last_at,
                        store_state=rec.state if rec else None, store_snapshot=rec.snapshot if rec else None,
                        store_at=rec.at if rec else 0.0, candidates=tuple(candidates))


def _wait_previous(spec: JobSpec, policy: resume.Policy, claim: resume.Claim, wait_s: float,
                   say: Any) -> resume.Found:
    """What the store says once no other run holds the job's claim (a run elsewhere still refreshing its lease is
    waited for: a pod's replacement starts while the old pod's stop snapshot is being taken)."""
    start = time.monotonic()
    next_say = 0.0  # said at once, then every 10 s
    while True:
        found = gather(spec, policy, claim)
        rec = claim.last  # the version the claim writes over, the one the choice reads
        now = time.time()
        if not resume.live_elsewhere(rec, claim.run, now):
            return found
        assert rec is not None
        waited = time.monotonic() - start
        if waited >= wait_s:
            raise Busy(f"job {spec.name} is not started: it is running on {rec.host}",
                       f"its record in {claim.url} was refreshed {now - rec.at:.0f} s ago (a run holds the job while "
                       f"it refreshes the record within {resume.LEASE_S:.0f} s); waited {waited:.0f} s for it to end",
                       "stop that run (its stop snapshot then resumes here), or give --wait-previous more seconds")
        if waited >= next_say:
            say(f"job {spec.name} is running on {rec.host} (its record in the store, refreshed {now - rec.at:.0f} s "
                f"ago): waiting up to {wait_s - waited:.0f} s more for that run to end")
            next_say = waited + 10.0
        time.sleep(min(1.0, max(0.05, wait_s - waited)))


def decide(spec: JobSpec, policy: resume.Policy, *, quiet: bool,
           wait_s: float = 600.0) -> tuple[resume.Choice, resume.Claim | None]:
    """The choice for this launch, logged in the job's decision log and said on stderr; a refusal raised. With a
    remote store the job is claimed there before the choice is returned (the claim goes to the agent)."""
    remote = resume.remote_of(spec.persist)
    claim = resume.Claim(remote, spec.name) if remote is not None else None

    def say(msg: str) -> None:
        if not quiet:
            sys.stderr.write(f"cryosleep: {msg}\n")

    while True:
        found = _wait_previous(spec, policy, claim, wait_s, say) if claim is not None else gather(spec, policy)
        choice = resume.choose(found, policy)
        if claim is None or choice.action == "refuse":
            break
        try:
            claim.write("running", choice.snapshot.id if choice.snapshot else None)
            time.sleep(CONFIRM_S)  # read back once settled: a store that does not serialize conditional writes
            if claim.read() is not None and claim.last is not None and claim.last.run == claim.run:
                break
        except Conflict:
            pass
        say(f"job {spec.name}: its record in the store changed while this launch read it; reading it again")
    log = decisions.path_for(JobDir(spec.name).path)
    now = time.time()
    entry: dict[str, Any] = {"id": f"launch-{int(now * 1000)}", "job": spec.name, "trigger": "launch",
                             "mode": policy, **choice.to_json(), "at": now}
    decisions.append(log, {"event": "decided", **entry})
    decisions.append(log, {"event": "outcome", "id": entry["id"], "at": now,
                           "outcome": {"fresh": "started", "restore": "resuming", "refuse": "refused"}[choice.action]})
    if choice.action == "refuse":
        snap = choice.snapshot.id if choice.snapshot else "?"
        raise NotEligible(f"job {spec.name} is not started: it has a suspended snapshot, {snap}",
                          "; ".join(choice.reasons),
                          f"bring that snapshot back as it was with `cryosleep restore {snap}`, or start the job "
                          "anew with `cryosleep run --fresh ...` (the snapshot stays in the store)")
    if not quiet:
        what = (f"resuming from snapshot {choice.snapshot.id}" if choice.action == "restore" and choice.snapshot
                else "starting anew")
        sys.stderr.write(f"cryosleep: job {spec.name}: {what} ({'; '.join(choice.reasons)})\n")
    return choice, claim



def _log(spec: JobSpec, action: str, reasons: list[str], outcome: str, snapshot: str | None = None) -> None:
    log = decisions.path_for(JobDir(spec.name).path)
    now = time.time()
    entry: dict[str, Any] = {"id": f"launch-{int(now * 1000)}", "job": spec.name, "trigger": "launch",
                             "mode": "coordinator", "action": action, "snapshot": snapshot, "reasons": reasons,
                             "at": now}
    decisions.append(log, {"event": "decided", **entry})
    decisions.append(log, {"event": "outcome", "id": entry["id"], "at": now, "outcome": outcome})


def at_coordinator(spec: JobSpec, link: CoordinatorClient, *, fresh: bool, quiet: bool) -> str | None:
    """A multi-node job's launch line (``run --nnodes N --coordinator URL``): the snapshot to queue for a restore on
    free hosts when the coordinator has the job suspended in one, with this command (same program and arguments,
    ``--nproc-per-node`` and ``--run-id``); None to start anew (a new job, one not suspended, ``--fresh``). Another
    command of a suspended job is refused, naming the snapshot. Said on stderr and in the decision log."""
    job = job_name(spec.name, spec.nnodes, spec.node_rank)
    try:
        row = link.job(job)
    except NotFound:
        return None
    except Forbidden as e:  # a bootstrap credential registers agents and reads no job: nothing to resume by
        if not quiet:
            sys.stderr.write(f"cryosleep: job {spec.name}: starting anew: the coordinator's credential cannot read "
                             f"job {job} ({e.why}), so a suspended snapshot of it is not looked for\n")
        return None
    except Unreachable as e:
        if fresh:
            return None
        raise Unreachable(f"job {spec.name} is not started: the coordinator cannot say whether it is suspended",
                          f"{e.what} ({e.why})", "start the coordinator (or check --coordinator), then launch again; "
                          "`--fresh` starts the job anew without asking") from e
    if row.get("state") != "suspended" or not row.get("last_snapshot"):
        return None
    sid = str(row["last_snapshot"])
    if fresh:
        _log(spec, "fresh", [f"--fresh: job {job} is suspended in snapshot {sid} at the coordinator; it stays there"],
             "started")
        return None
    had = row.get("spec") or {}
    mine = {"program": spec.program[-3:], "nproc_per_node": spec.nproc_per_node, "run_id": spec.run_id}
    differs = [f"{k}: {had.get(k)!r} there, {v!r} here" for k, v in mine.items() if k in had and had.get(k) != v]
    if differs:
        _log(spec, "refuse", differs, "refused", sid)
        raise NotEligible(f"job {spec.name} is not started: the coordinator has it suspended in snapshot {sid}",
                          "this launch's command differs from the suspended one's: " + "; ".join(differs),
                          f"bring that snapshot back with `cryosleep restore {sid} --nodes auto --wait`, or start the "
                          "job anew with `cryosleep run --fresh ...` (the snapshot stays in the catalog)")
    why = [f"job {job} is suspended in snapshot {sid} (the coordinator's catalog)", "its command is this one"]
    _log(spec, "restore", why, "queued", sid)
    if not quiet:
        sys.stderr.write(f"cryosleep: job {spec.name}: resuming from snapshot {sid} through the coordinator's queue "
                         f"({'; '.join(why)})\n")
    return sid

