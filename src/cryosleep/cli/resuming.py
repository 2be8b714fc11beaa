"""`cryosleep run` resuming its job: what it finds about the job, the choice (agent/resume.py), and saying it.

The launcher calls :func:`decide` while it holds the job's lock, before it starts anything."""

from __future__ import annotations

import sys
import time
from typing import Any

from cryosleep import paths
from cryosleep.agent import resume
from cryosleep.core.job import JobDir, JobSpec
from cryosleep.errors import NotEligible
from cryosleep.store import persist
from cryosleep.store.local import LocalStore
from cryosleep.triggers import decisions

__all__ = ["decide", "gather"]


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


def gather(spec: JobSpec, policy: resume.Policy) -> resume.Found:
    """Everything the choice reads: the job's record here, its record in the store(s), its snapshots there."""
    job = JobDir(spec.name)
    last_state = last_snapshot = None
    last_at = 0.0
    if job.exists():
        _, st = job.read()
        last_state, last_snapshot, last_at = st.state, st.last_snapshot, st.ended_at or st.started_at
    store = LocalStore(paths.default_store())
    remote = resume.remote_of(spec.persist)
    rec = resume.read_local_record(store.root, spec.name)
    if rec is None and remote is not None:
        rec = resume.read_remote_record(remote, spec.name)
    candidates: list[resume.Candidate] = []
    suspended = last_state == "suspended" or (rec is not None and rec.state == "suspended")
    if policy == "latest" or (policy == "auto" and suspended):  # else the choice reads no snapshot: none listed
        candidates = _local_candidates(store, spec.name, verify=policy == "latest")
        if remote is not None:
            candidates += _remote_candidates(remote, spec.name, {c.id for c in candidates})
    return resume.Found(spec=spec.to_json(), last_state=last_state, last_snapshot=last_snapshot, last_at=last_at,
                        store_state=rec.state if rec else None, store_snapshot=rec.snapshot if rec else None,
                        store_at=rec.at if rec else 0.0, candidates=tuple(candidates))


def decide(spec: JobSpec, policy: resume.Policy, *, quiet: bool) -> resume.Choice:
    """The choice for this launch, logged in the job's decision log and said on stderr; a refusal raised."""
    choice = resume.choose(gather(spec, policy), policy)
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
    return choice

