"""Taking a snapshot of a job on this node: one linear list of phases, one rollback.

    preflight  what the processes hold that cannot be captured -> refuse with reasons (nothing touched)
    cuda-lock, cuda-checkpoint
               (GPU jobs) every CUDA process locked, then its device memory moved to host memory
    dump       CRIU freezes the tree, writes its image, stages the job's files, then resumes it
               (keep-running) or holds it stopped (stop)
    cuda-restore, cuda-unlock
               (GPU jobs, keep-running) device memory back, CUDA calls released: the pause ends here
    checksum   size and SHA-256 of every image file (the job is already running again)
    commit     manifest written, snapshot published atomically in the store
    verify     (stop) every file re-read and checked against the manifest
    end        (stop) the held job is killed; it lives on only in the snapshot

Rollback, whatever failed: a held job is released (network lock removed, tasks continued), CUDA processes
are restored and unlocked, a committed but unverified snapshot is removed, the staging directory is
deleted. The job is never killed unless its snapshot is complete and verified.
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
from cryosleep.capture import criu_install, cuda, files
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
    cuda_lock_timeout: float = 10.0


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
    gpus = cuda.GpuSet([])
    gpu_facts: dict[str, Any] = {}
    held = False
    committed = False
    dump_rid: str | None = None
    node_rank = target.spec.node_rank
    try:
        with phases.phase("preflight"):
            problems = [c for c in eligibility.process_checks(target.init_pid) if not c.ok and c.fatal]
            if problems:
                raise NotEligible(
                    f"job {target.spec.name!r} cannot be captured now",
                    "; ".join(c.detail for c in problems),
                    "fix what is listed, then snapshot again; the job was not touched",
                    checks=[c.to_json() for c in problems],
                )
            tree = proctree.tree(target.init_pid)
            rss = sum(proctree.rss_bytes(p) for p in tree)
            if cuda.gpu_processes(target.init_pid):
                gpus = cuda.GpuSet(cuda.cuda_processes(target.init_pid))
                drv = cuda.driver()
                gpu_facts = {"driver": drv.version(), "gpus": [
                    {"index": g.index, "uuid": g.uuid_str, "name": g.name} for g in drv.gpus()],
                    "cuda_pids": [proctree.ns_pid(p) for p in gpus.pids]}
            mounts = criu_calls.external_mounts(target.init_pid) if _own_mount_ns(target.init_pid) else []
            staging = store.begin(target.spec.name)
        node_dir = staging.node_dir(node_rank)
        deadline = time.monotonic() + timeout
        pause = ["cuda-lock", "cuda-checkpoint", "dump", "cuda-restore", "cuda-unlock"]
        if gpus.pids:
            with phases.phase("cuda-lock"):
                gpus.lock(target.cuda_lock_timeout)
            with phases.phase("cuda-checkpoint"):
                gpus.checkpoint()
        with phases.phase("dump"):
            extra = {"CRYOSLEEP_FAULT": fault} if fault else None
            res = criu_calls.dump(criu, target.init_pid, node_dir, leave="stopped" if stop else "running",
                                  timeout=timeout, extra_env=extra, mounts=mounts)
            dump_rid = res.run_id
            held = stop
        if gpus.pids and not stop:
            with phases.phase("cuda-restore"):
                gpus.restore()
            with phases.phase("cuda-unlock"):
                gpus.unlock()
        with phases.phase("checksum"):
            image_files = hash_tree(staging.path, [f"nodes/{node_rank}"])
            staged = files.read_index(node_dir / "files")
        node = NodeImage(node_rank=node_rank, ranks=target.spec.ranks, init_pid=target.init_pid,
                         files=image_files, staged=staged, processes=len(tree), rss_bytes=rss, gpu=gpu_facts,
                         mounts=mounts)
        manifest = Manifest(
            id=staging.id, job=target.spec.to_json(), mode="stop" if stop else "keep-running",
            created_at=time.time(), nodes=[node], host=host_facts(criu, target.runtime),
            phases={}, pause_s=0.0, restored_from=target.restored_from,
        )
        manifest.phases = phases.rounded()
        manifest.pause_s = round(phases.total(pause), 4)
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
                gpus.pids = []  # they are gone with the job
                criu_calls.unlock_network(criu, dump_rid)
        manifest.phases = phases.rounded()
        keep = pause if not stop else [*pause, "checksum", "commit", "verify", "end"]
        manifest.pause_s = round(phases.total(keep), 4)
        _rewrite_manifest(store, manifest)
        return manifest
    except BaseException as e:
        # The one rollback path.
        if held:
            criu_calls.release(criu, target.init_pid, dump_rid)
        if gpus.locked or gpus.checkpointed:
            undone = gpus.rollback()
            if undone and isinstance(e, CryosleepError):
                e.details["cuda_rollback_problems"] = undone
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


def _own_mount_ns(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    except OSError:
        return False


def _rewrite_manifest(store: LocalStore, manifest: Manifest) -> None:
    """Record the final phase times (the manifest's checksummed files are unchanged)."""
    path = store.path_of(manifest.id) / "manifest.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(manifest.dumps())
    os.replace(tmp, path)
