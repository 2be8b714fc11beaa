"""Restoring a job on this node from a snapshot: one linear list of phases, one rollback.

    verify    the manifest's MAC and paths checked (store/auth.py), then every image file re-read and checked
              against the manifest (nothing has started yet)
    compat    this machine can take the image: kernel, CRIU, the job name free, paths present
    files     the job's files brought back to their state at the snapshot
    network   (job network) the job's bridge and overlay here, a fresh host end for the sandbox's veth
    restore   CRIU recreates the sandbox (fresh PID namespace, so PIDs in use do not clash); its pre-resume
              action resets the connections to peers outside the job before any task runs (capture/outbound.py)
    outbound  what that action could not reset is reset now, or told
    cuda-restore, cuda-unlock
              (GPU jobs) device memory back, onto other GPUs through a UUID map when they differ
    rebuild   (NCCL jobs) the workers' interceptors, restored QUIESCED with their control blocks (put back
              by the files phase), re-create every communicator from fresh unique ids; then the gates open

Rollback: if CRIU fails after the files were put back, nothing of the job is running; the files stay at the
snapshot's state, which is what a retry needs. If anything fails after CRIU restored the job (CUDA restore,
NCCL rebuild), the restored job is killed: a half-restored job must not linger.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cryosleep.capture import criu as criu_calls
from cryosleep.capture import criu_install, cuda, files, netlock, outbound
from cryosleep.core import proctree
from cryosleep.core.interceptor import Cmd, ControlBlock, State
from cryosleep.core.job import JobSpec
from cryosleep.cut.driver import STATE_NAMES, Driver
from cryosleep.errors import InterceptorError, NotEligible, RestoreFailed, StoreCorrupt
from cryosleep.net import sandbox as net_sandbox
from cryosleep.store import auth
from cryosleep.store.local import LocalStore
from cryosleep.store.manifest import FileEntry, Manifest
from cryosleep.timing import Phases, Progress


@dataclass
class Restored:
    manifest: Manifest
    spec: JobSpec
    init_pid: int
    phases: Phases
    net_end: str | None = None  # the restored sandbox's veth host end (job network), for its release


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def compat_problems(manifest: Manifest, criu: criu_install.Criu) -> list[str]:
    problems: list[str] = []
    host = manifest.host
    if host.get("machine") and host["machine"] != platform.machine():
        problems.append(f"captured on {host['machine']}, this machine is {platform.machine()}")
    if host.get("criu") and _version_tuple(criu.version) < _version_tuple(str(host["criu"]))[:2]:
        problems.append(f"captured with CRIU {host['criu']}, this machine has the older {criu.version}")
    cwd = manifest.job.get("cwd")
    if cwd and not Path(cwd).is_dir():
        problems.append(f"the job's working directory {cwd} does not exist here")
    prog = manifest.job.get("program") or []
    if prog and prog[0].startswith("/") and not Path(prog[0]).exists():
        problems.append(f"the job's program {prog[0]} does not exist here")
    if len(manifest.nodes) != 1:
        problems.append(f"the snapshot has {len(manifest.nodes)} nodes; a one-node restore takes one")
    here = set(criu_calls.external_mounts(os.getpid()))
    missing = [m for n in manifest.nodes for m in n.mounts if m not in here]
    if missing:
        problems.append("mountpoints the job's sandbox binds are not mounted here: " + ", ".join(missing))
    return problems


def gpu_pairs(captured: list[dict[str, Any]], here: list[cuda.Gpu], gpu_map: list[int] | None) -> list[
        tuple[bytes, bytes]]:
    """The CUDA restore map: captured GPU i goes to GPU ``gpu_map[i]`` here (default: by position).

    An empty list means "the same GPUs", which the driver takes without a map."""
    if len(captured) != len(here):
        raise NotEligible("this machine has a different number of GPUs",
                          f"captured with {len(captured)}, {len(here)} here", "restore onto matching GPUs")
    names = {g["name"] for g in captured} | {g.name for g in here}
    if len(names) > 1:
        raise NotEligible("the GPU model differs", f"captured on {captured[0]['name']}, here {here[0].name}",
                          "restore onto GPUs of the same model")
    order = gpu_map if gpu_map is not None else list(range(len(here)))
    if sorted(order) != list(range(len(here))):
        raise NotEligible(f"--gpu-map {','.join(map(str, order))} is not a permutation of the {len(here)} GPUs",
                          "every GPU must appear once", "e.g. --gpu-map 1,0 swaps two GPUs")
    new = [here[i].uuid_str for i in order]
    old = [g["uuid"] for g in captured]
    if old == new:
        return []
    return cuda.uuid_pairs(old, new)


def refuse_under_lock(spec: JobSpec, criu: criu_install.Criu) -> None:
    """A job on the host's network is not restored under a CRIU network lock it did not take: the lock would drop
    the very connections CRIU brings back, and the restored ranks would hang (capture/netlock.py)."""
    if spec.net:
        return  # its own network namespace: no lock of the host's applies to it
    locks = netlock.blocking(criu.nft_argv, spec.master_port)
    if locks:
        raise NotEligible(
            f"job {spec.name!r} cannot be restored under the CRIU network lock {locks[0]}",
            f"that nftables table drops connections to port {spec.master_port}, the job's rendezvous port, and "
            "was not taken by this restore: a dump is under way (or its agent died without removing it)",
            f"wait for the dump of any job on port {spec.master_port} to end; if none runs, `cryosleep check` "
            f"removes what a dead agent left, or remove it: nft delete table {locks[0]}; then restore again",
            locks=locks)


def restore(store: LocalStore, ref: str, work_dir: Path, *, timeout: float = 600.0,
            progress: Progress | None = None, before_criu: Callable[[Manifest], Sequence[str] | None] | None = None,
            gpu_map: list[int] | None = None, net_peers: Sequence[str] = (), relay: Relay | None = None,
            trust: auth.Trust = auth.STRICT) -> Restored:
    """Restore snapshot ``ref`` (one node's image) here. ``before_criu``: called once the checks
    passed, before anything is changed; it may return the job network's overlay peers it learned (a multi-node
    restore's barrier), used when ``net_peers`` is empty. ``trust``: how the snapshot is authenticated (its MAC
    and paths are checked first, before any file is read for the job, written or started)."""
    phases = Phases(progress)
    criu = criu_install.locate()
    with phases.phase("verify"):
        sid = store.resolve(ref)
        manifest = store.load(sid)
        auth.authenticate(manifest, sid, trust)
        devmem = devmem_files(manifest)  # checked as the devmem phase copies them: read once, not twice
        bad = store.verify(manifest.id, skip=devmem)
        if bad:
            raise corrupt(manifest.id, bad)
    spec = JobSpec.from_json(manifest.job)
    base = store.path_of(manifest.id)
    node = manifest.nodes[0]
    node_dir = base / "nodes" / str(node.node_rank)
    pairs: list[tuple[bytes, bytes]] = []
    with phases.phase("compat"):
        if node.gpu.get("gpus"):
            pairs = gpu_pairs(node.gpu["gpus"], cuda.driver().gpus(), gpu_map)
        problems = compat_problems(manifest, criu)
        problems += files.plan_restore(node.staged, node_dir / "files")
        problems += files.check_expected(node.expected)
        if problems:
            raise NotEligible(
                f"snapshot {manifest.id} cannot be restored on this machine",
                "; ".join(problems),
                "restore it on a compatible machine, or fix what is listed",
                problems=problems,
            )
        if before_criu:
            learned = before_criu(manifest)
            net_peers = net_peers or learned or ()
        refuse_under_lock(spec, criu)
    with phases.phase("files"):
        files.restore(node.staged, node_dir / "files")
    fast = node.gpu.get("fast_path") or {}
    if fast.get("ranks"):
        with phases.phase("devmem"):
            bad = put_devmem(fast["ranks"], node_dir, devmem)
            if bad:
                raise corrupt(manifest.id, bad)
    veths: list[tuple[str, str, str]] = []
    if spec.net:  # the job network: its bridge (and overlay) here; CRIU recreates the veth (docs/network.md)
        with phases.phase("network"):
            veths = net_sandbox.prepare_restore(spec.net, net_peers)
    resets = outbound.RestoreReset.plan(spec, node.outbound, work_dir)
    with phases.phase("restore"):
        try:
            init_pid = criu_calls.restore(criu, node_dir / "criu", work_dir, timeout=timeout, mounts=node.mounts,
                                          veths=veths, action=resets.hook() if resets else None)
        except RestoreFailed:
            net_sandbox.undo_restore(spec.net, veths)
            raise
        except OSError as e:
            net_sandbox.undo_restore(spec.net, veths)
            raise RestoreFailed("CRIU could not be started", str(e), "run `cryosleep check`") from e
    try:
        net_sandbox.after_restore(veths)
    except BaseException:
        _kill_tree(init_pid)
        raise
    if resets is not None:
        with phases.phase("outbound"):
            resets.finish(init_pid)  # never raises: what it could not reset is told, the job runs on
    try:
        if node.gpu.get("cuda_pids"):
            gpus = cuda.GpuSet(host_pids(init_pid, node.gpu["cuda_pids"]))
            with phases.phase("cuda-restore"):
                gpus.restore(pairs)
            with phases.phase("cuda-unlock"):
                gpus.unlock()
        if node.nccl.get("ranks"):
            # across nodes, the others may still be in their CRIU restore: wait for them within the restore's time
            rebuild_nccl(init_pid, node.nccl, phases, timeout=30.0 if relay is None else min(timeout, 300.0),
                         relay=relay)
    except BaseException:
        _kill_tree(init_pid)  # a half-restored job must not linger
        raise
    return Restored(manifest, spec, init_pid, phases, veths[0][1] if veths else None)


def corrupt(sid: str, bad: list[str]) -> StoreCorrupt:
    """The refusal of a snapshot whose files do not match its manifest."""
    return StoreCorrupt(f"snapshot {sid} failed verification; nothing was restored",
                        "; ".join(bad[:8]) + (f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""),
                        "restore another snapshot (`cryosleep ls`) and remove this one (`cryosleep rm`)", problems=bad)


def devmem_pieces(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank's device-memory image: its pieces (image path relative to the node, offset, bytes); a
    snapshot taken before images were cut into pieces has one file."""
    if not entry.get("image"):
        return []
    return list(entry.get("pieces") or [{"image": entry["image"], "offset": 0, "bytes": int(entry["bytes"])}])


def devmem_files(manifest: Manifest) -> dict[str, FileEntry]:
    """The fast path's device-memory files of the manifest's node, by path relative to the snapshot."""
    node = manifest.nodes[0]
    ranks = ((node.gpu.get("fast_path") or {}).get("ranks") or {}).values()
    names = {f"nodes/{node.node_rank}/{x['image']}" for e in ranks for x in devmem_pieces(e)}
    return {f.path: f for f in node.files if f.path in names}


def put_devmem(ranks: dict[str, Any], node_dir: Path, checks: dict[str, FileEntry]) -> list[str]:
    """Every rank's fast-path staging file back at its path, at its size, before CRIU maps it again; for the
    ranks whose device memory it held at the snapshot, with that content (RELOAD copies it to the GPU), each
    piece checked against the manifest's SHA-256 as it is copied (``checks``: by path relative to the
    snapshot), all pieces of all ranks in parallel. Returns the problems found; with any, no staging file is
    left changed."""
    base = node_dir.parent.parent
    tmps: list[tuple[Path, str, int]] = []  # (path, temporary name, its directory's fd: files.open_dir)
    todo: list[tuple[tuple[str, int], dict[str, Any], str, FileEntry]] = []
    problems: list[str] = []
    for entry in ranks.values():
        path = Path(entry["stage_path"])
        dfd = files.open_dir(str(path.parent), create=True, mode=0o700)  # no link on the way is followed
        tmp = path.name + ".cryosleep-restore"
        tmps.append((path, tmp, dfd))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            os.fchmod(fd, 0o600)  # a leftover of an interrupted restore may have had other bits
            os.ftruncate(fd, int(entry["stage_bytes"]))
        finally:
            os.close(fd)
        for piece in devmem_pieces(entry):
            rel = str((node_dir / piece["image"]).relative_to(base))
            want = checks.get(rel)
            if want is None:
                problems.append(f"{rel}: not in the manifest's file list")
            else:
                todo.append(((tmp, dfd), piece, rel, want))

    def put(job: tuple[tuple[str, int], dict[str, Any], str, FileEntry]) -> str | None:
        (tmp, dfd), piece, rel, want = job
        src = base / rel
        size = src.stat().st_size if src.exists() else -1
        if size != want.size or size != int(piece["bytes"]):
            return f"{rel}: size {size}, expected {want.size} (missing, truncated or altered)"
        got = files.copy_hashed(src, tmp, size, dst_off=int(piece["offset"]), dst_dir_fd=dfd)
        if got != want.sha256:
            return f"{rel}: sha256 {got[:16]}..., expected {want.sha256[:16]}... (altered)"
        return None

    try:
        if not problems:
            with ThreadPoolExecutor(max_workers=files.copy_workers(len(todo))) as pool:
                problems = [p for p in pool.map(put, todo) if p]
    except BaseException:
        for _, tmp, dfd in tmps:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            os.close(dfd)
        raise
    for path, tmp, dfd in tmps:
        try:
            if problems:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dfd)
                with contextlib.suppress(OSError):
                    path.parent.rmdir()  # only when empty: the directory this restore made
            else:
                os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
    return problems


class Relay(Protocol):
    """A multi-node restore's rebuild (agent/coordinated.py's RestoreRendezvous): the REBUILD generation every
    node uses, and the fresh ids of communicators whose rank-0 member was restored on another node."""

    def generation(self) -> int: ...
    def exchange(self, gen: int, uids: dict[int, bytes], need: list[int], deadline: float) -> dict[int, bytes]: ...


def rebuild_nccl(init_pid: int, facts: dict[str, Any], phases: Phases | None = None, timeout: float = 30.0,
                 relay: Relay | None = None) -> None:
    """The restored workers' interceptors are QUIESCED (or OFFLOADED: the fast path), holding every NCCL call:
    bring offloaded device memory back, re-create their communicators from fresh unique ids and open the
    gates. Their control blocks came back (the files phase) at the paths they map. ``relay``: the job spans
    nodes, and ids cross them through the coordinator."""
    phases = phases or Phases(None)
    deadline = time.monotonic() + timeout
    blocks: dict[int, ControlBlock] = {}
    try:
        for r in facts["ranks"]:
            left = max(0.1, deadline - time.monotonic())
            blocks[int(r["rank"])] = ControlBlock.wait(r["ctl"], pid=int(r["pid"]), timeout=left)
        not_quiesced = [f"rank {r} is {STATE_NAMES.get(b.state()[0], f'in state {b.state()[0]}')}"
                        for r, b in blocks.items()
                        if b.state()[0] not in (State.QUIESCED, State.OFFLOADED)]
        if not_quiesced:
            raise RestoreFailed("the restored workers' NCCL interceptors are not where the snapshot left them",
                                "; ".join(not_quiesced), "the restored job was ended; restore another snapshot")
        driver = Driver(blocks)
        offloaded = [r for r, b in blocks.items() if b.devmem.offloaded]
        if offloaded:
            with phases.phase("reload"):
                driver.reload(offloaded, deadline + 60)
        with phases.phase("rebuild"):
            if relay is None:
                driver.resume()
            else:
                driver.gen = relay.generation() - 1
                gen = driver.command(Cmd.REBUILD)
                uids, need = driver.published(gen, deadline)
                driver.rebuild_wait(gen, deadline, relay.exchange(gen, uids, need, deadline))
                driver.run()
    except InterceptorError as e:
        raise RestoreFailed("the job's NCCL communicators could not be rebuilt after the restore",
                            f"{e.what}: {e.why}",
                            "the restored job was ended; see the workers' logs (lines 'cryosleep-nccl[PID]') "
                            "and `cryosleep check`") from e
    finally:
        for b in blocks.values():
            b.close()


def host_pids(init_pid: int, ns_pids: list[int]) -> list[int]:
    """Host PIDs of the restored processes that had these PIDs inside their namespace."""
    by_ns = {proctree.ns_pid(p): p for p in proctree.tree(init_pid)}
    missing = [n for n in ns_pids if n not in by_ns]
    if missing:
        raise RestoreFailed("restored CUDA processes are missing", f"namespace PIDs {missing} not found",
                            "see the CRIU restore log")
    return [by_ns[n] for n in ns_pids]


def _kill_tree(init_pid: int) -> None:
    try:
        os.kill(init_pid, signal.SIGKILL)  # PID 1 of the namespace: the kernel ends the rest
    except ProcessLookupError:
        pass
