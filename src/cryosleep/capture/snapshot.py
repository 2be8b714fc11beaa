"""Taking a snapshot of a job on this node: one linear list of phases, one rollback.

    preflight  what the processes hold that cannot be captured -> refuse with reasons (nothing touched)
    dump       CRIU freezes the tree, writes its image, stages the job's files, then resumes it
               (keep-running) or holds it stopped (stop); the job's pause is this phase
    checksum   size and SHA-256 of every image file (the job is already running again)
    commit     manifest written, snapshot published atomically in the store
    verify     (stop) every file re-read and checked against the manifest
    end        (stop) the held job is killed; it lives on only in the snapshot

Rollback, whatever failed: a held job is released (network lock removed, tasks continued), a committed
but unverified snapshot is removed, the staging directory is deleted. The job is never killed unless its
snapshot is complete and verified.
"""

from __future__ import annotations

import os
import platform
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cryosleep import __version__, eligibility
from cryosleep.agent import proctree
from cryosleep.agent.job import JobSpec
from cryosleep.capture import criu as criu_calls
from cryosleep.capture import criu_install, files
from cryosleep.errors import CaptureFailed, CryosleepError, NotEligible
from cryosleep.store.local import LocalStore, Staging, hash_tree
from cryosleep.store.manifest import Manifest, NodeImage
from cryosleep.timing import Phases

Progress = Callable[[str, str, float | None], None]


@dataclass
class Target:
    """The running sandbox to capture, as the agent knows it."""

    spec: JobSpec
    init_pid: int
    runtime: dict[str, Any] = field(default_factory=dict)
    restored_from: str | None = None
    end: Callable[[str], None] | None = None  # kills the held job once the stop snapshot is safe


def host_facts(criu: criu_install.Criu, runtime: dict[str, Any]) -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "criu": criu.version,
        "cryosleep": __version__,
        "agent_python": platform.python_version(),
        **runtime,
    }


def take(target: Target, store: LocalStore, *, stop: bool, timeout: float = 600.0,
         progress: Progress | None = None, fault: str | None = None) -> Manifest:
    phases = Phases(progress)
    criu = criu_install.locate()
    staging: Staging | None = None
    held = False
    committed = False
    dump_rid: str | None = None
    node_rank = target.spec.node_rank
    try:
        with phases.phase("preflight"):
            problems = [c for c in eligibility.process_checks(target.init_pid) if not c.ok]
            if problems:
                raise NotEligible(
                    f"job {target.spec.name!r} cannot be captured now",
                    "; ".join(c.detail for c in problems),
                    "fix what is listed, then snapshot again; the job was not touched",
                    checks=[c.to_json() for c in problems],
                )
            tree = proctree.tree(target.init_pid)
            rss = sum(proctree.rss_bytes(p) for p in tree)
            staging = store.begin(target.spec.name)
        node_dir = staging.node_dir(node_rank)
        deadline = time.monotonic() + timeout
        with phases.phase("dump"):
            extra = {"CRYOSLEEP_FAULT": fault} if fault else None
            res = criu_calls.dump(criu, target.init_pid, node_dir, leave="stopped" if stop else "running",
                                  timeout=timeout, extra_env=extra)
            dump_rid = res.run_id
            held = stop
        with phases.phase("checksum"):
            image_files = hash_tree(staging.path, [f"nodes/{node_rank}"])
            staged = files.read_index(node_dir / "files")
        node = NodeImage(node_rank=node_rank, ranks=target.spec.ranks, init_pid=target.init_pid,
                         files=image_files, staged=staged, processes=len(tree), rss_bytes=rss)
        manifest = Manifest(
            id=staging.id, job=target.spec.to_json(), mode="stop" if stop else "keep-running",
            created_at=time.time(), nodes=[node], host=host_facts(criu, target.runtime),
            phases={}, pause_s=0.0, restored_from=target.restored_from,
        )
        manifest.phases = phases.rounded()
        manifest.pause_s = round(phases.durations["dump"], 4)
        with phases.phase("commit"):
            store.commit(staging, manifest)
            committed = True
        if stop:
            with phases.phase("verify"):
                if time.monotonic() > deadline:
                    raise CaptureFailed(f"the stop snapshot ran past its {timeout:g} s timeout", "",
                                        "retry with a longer --timeout")
                bad = store.verify(manifest.id)
                if bad:
                    raise CaptureFailed("the stored image failed verification", "; ".join(bad[:5]),
                                        "check the store's disk; the job was resumed")
            with phases.phase("end"):
                if target.end:
                    target.end(manifest.id)
                held = False
                criu_calls.unlock_network(criu, dump_rid)
        manifest.phases = phases.rounded()
        keep = ["dump"] if not stop else ["dump", "checksum", "commit", "verify", "end"]
        manifest.pause_s = round(phases.total(keep), 4)
        _rewrite_manifest(store, manifest)
        return manifest
    except BaseException as e:
        # The one rollback path.
        if held:
            criu_calls.release(criu, target.init_pid, dump_rid)
        if committed and staging is not None:
            try:
                store.remove(staging.id)
            except CryosleepError:
                pass
        if staging is not None:
            store.abort(staging)
        if isinstance(e, CryosleepError):
            e.details.setdefault("phases", phases.rounded())
            raise
        raise CaptureFailed(f"the snapshot failed: {type(e).__name__}: {e}",
                            "the job was resumed and goes on running", "see the agent's log",
                            phases=phases.rounded()) from e


def _rewrite_manifest(store: LocalStore, manifest: Manifest) -> None:
    """Record the final phase times (the manifest's checksummed files are unchanged)."""
    path = store.path_of(manifest.id) / "manifest.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(manifest.dumps())
    os.replace(tmp, path)
