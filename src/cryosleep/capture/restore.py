"""Restoring a job on this node from a snapshot: one linear list of phases, one record of what to undo.

    fetch     the snapshot found in the local store, or fetched into it from a remote one (every chunk and file
              checked as it lands); its manifest authenticated (MAC, paths: store/auth.py) before anything uses
              what it says. A node of a multi-node restore first tells the others it is coming
    verify    every image file checked against the manifest: the small ones (what CRIU parses as root, the
              job's files) read and hashed now; the pages files (the workers' memory) checked for size now and
              hashed while the next phases and CRIU run (capture/imagecheck.py): one read, not two
    compat    this machine can take the image: GPUs, kernel, CRIU, paths present, the job's files as expected
    lock      the job's lock (unless the launcher holds it); what a dead agent's dump left undone; no CRIU network
              lock of another dump in the way
    barrier   (multi-node) every node passed its checks, or none starts; the overlay peers learned
    files     the job's files brought back to their state at the snapshot
    devmem    (fast path) the staging files of device memory back, each piece checked as it is copied
    network   (job network) the job's bridge and overlay here, a fresh host end for the sandbox's veth
    criu      CRIU recreates the sandbox (fresh PID namespace, so PIDs in use do not clash), every process it forks
              marked for the caller's guard (capture/orphans.py: what a dead agent's watchdog ends). At post-restore
              (every task restored, none run) it waits for the pages' verdict: a file that does not match stops
              the restore there. Its pre-resume action resets the connections to peers outside the job
              (capture/outbound.py)
    outbound  what that action could not reset is reset now, or told
    cuda-restore, cuda-unlock
              (GPU jobs) device memory back, onto other GPUs through a UUID map when they differ
    reload, rebuild
              (NCCL jobs) the workers' interceptors, restored QUIESCED (or OFFLOADED) with their control blocks
              (put back by the files phase), bring device memory back and re-create every communicator from fresh
              unique ids (across nodes through the coordinator); then the gates open

Undo: each phase that changes something records how to take it back (core/undo.py); a failure at any phase
undoes exactly what ran, newest first: the restored job killed (a half-restored job must not linger), the veth
and the job network's bridge removed, the fast path's staging files removed, the job's lock let go (when this
restore took it), the other nodes told why. The job's files put back stay at the snapshot's state: nothing of
the job runs, and that is what a retry needs.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cryosleep import paths
from cryosleep.capture import criu as criu_calls
from cryosleep.capture import criu_install, cuda, files, imagecheck, netlock, orphans, outbound
from cryosleep.core import privileges, proctree
from cryosleep.core.interceptor import Cmd, ControlBlock, State
from cryosleep.core.job import ENDING_WAIT_S, JobDir, JobSpec
from cryosleep.core.undo import UndoLog
from cryosleep.cut.driver import STATE_NAMES, Driver
from cryosleep.errors import CryosleepError, InterceptorError, NotEligible, NotFound, RestoreFailed, StoreCorrupt
from cryosleep.net import sandbox as net_sandbox
from cryosleep.store import auth, persist
from cryosleep.store.local import LocalStore
from cryosleep.store.manifest import DevmemPiece, DevmemRank, FastPath, FileEntry, GpuDevice, Manifest, NcclCut
from cryosleep.timing import Phases, Progress


class Meeting(Protocol):
    """One node of a multi-node restore meeting the others (agent/coordinated.py's RestoreRendezvous): told at
    the start, at the barrier and at a failure; after CRIU, the REBUILD generation every node uses and the fresh
    ids of communicators whose rank-0 member was restored on another node."""

    peers: list[str]  # the other nodes' underlay addresses, once the barrier passed

    def announce(self) -> None: ...
    def checked(self) -> None: ...
    def barrier(self, gen: int) -> None: ...
    def failed(self, problems: list[str]) -> None: ...
    def generation(self) -> int: ...
    def exchange(self, gen: int, uids: dict[int, bytes], need: list[int], deadline: float) -> dict[int, bytes]: ...


class Guard(Protocol):
    """Whoever ends what this restore leaves on the host if the process running it dies before the restored job
    runs (the agent's watchdog, agent/watchdog.py; capture/orphans.py says why it is needed)."""

    def restoring(self, marks: orphans.Marks) -> None: ...
    def restored(self, init_pid: int) -> None: ...
    def network(self, net: dict[str, Any], end: str | None) -> None: ...


@dataclass
class Request:
    """What to restore, from where, and how; the CLI builds one from its arguments."""

    ref: str
    """The snapshot: an id or a unique prefix."""
    where: str | Path | None = None
    """A store directory (its chunk store ``DIR/cas`` tried when the directory store lacks it), or s3://... (fetched
    into $CRYOSLEEP_STORE unless already there); None: $CRYOSLEEP_STORE."""
    key_file: Path | None = None
    """The job's encryption key, for a remote store's chunks (and the signing key derived from it)."""
    trust: auth.Trust | None = None
    """How the manifest is authenticated (default: strict, with ``key_file``)."""
    timeout: float = 600.0
    """CRIU's restore and a multi-node rebuild give up after this."""
    gpu_map: list[int] | None = None
    """GPU i of the snapshot goes to GPU gpu_map[i] here (default: by position)."""
    net_peers: Sequence[str] = ()
    """The job network's overlay peers (other hosts' addresses); default: those the barrier learned."""
    meeting: Meeting | None = None
    """One node of a multi-node restore: the others, met at the coordinator."""
    lock_wait_s: float = 0.0
    """A live migration's node: the job's lock, held here by the node's previous incarnation where the job's
    directory is shared, is waited for this long (its coordinator ends that one once the checks passed)."""
    lock_fd: int = -1
    """The job's lock, when the caller holds it already (a launch that chose to resume); else the lock phase
    takes it, and a failure lets it go."""
    work_dir: Path | None = None
    """CRIU's work directory (default: the job's ``restore/``)."""
    progress: Progress | None = None
    """Told each phase as it starts and ends."""
    transfer: persist.EventSink | None = None
    """Told a remote fetch's progress."""
    log: Callable[[str], None] | None = None
    """A line for the agent's log (default: the agent's own, when it runs the restore)."""
    guard: Guard | None = None
    """Told what to end if the caller dies mid-restore (the agent's watchdog, when an agent runs the restore)."""


@dataclass
class Restored:
    manifest: Manifest
    spec: JobSpec
    init_pid: int
    phases: Phases
    net_end: str | None = None  # the restored sandbox's veth host end (job network), for its release
    job: JobDir | None = None
    lock_fd: int = -1  # the job's lock, held from here on by whoever supervises the restored job
    peers: tuple[str, ...] = ()  # the overlay peers a multi-node restore learned at its barrier
    fetched: dict[str, Any] | None = None  # what was fetched from where (None: it was local)
    streamed: dict[str, float] = field(default_factory=dict)  # the pages checked as CRIU read them: bytes, seconds


def problems_of(e: BaseException) -> list[str]:
    """What to tell the other nodes of a multi-node restore about this node's failure."""
    if isinstance(e, CryosleepError):
        return list(e.details.get("problems") or []) or [f"{e.what}: {e.why}" if e.why else e.what]
    return [f"the restore was interrupted ({type(e).__name__}{': ' + str(e) if str(e) else ''})"]


class RestoreRun:
    """One restore: :meth:`run` goes through the phases in order. :meth:`fetch` may be called first on its own,
    for the caller to learn the job before the rest runs (a detached agent's log is named after it)."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.phases = Phases(req.progress)
        self.undo = UndoLog(self.log)
        self.store: LocalStore | None = None
        self.manifest: Manifest | None = None
        self.fetched: dict[str, Any] | None = None
        self.lock_fd = req.lock_fd
        self.peers: tuple[str, ...] = ()
        self.pairs: list[tuple[bytes, bytes]] = []
        self.veths: list[tuple[str, str, str]] = []
        self.init_pid = 0
        self.pages: imagecheck.PageCheck | None = None
        self.criu: criu_install.Criu | None = None

    def log(self, msg: str) -> None:
        if self.req.log is not None:
            self.req.log(msg)

    # -- the sequence ------------------------------------------------------------------------------------

    def run(self) -> Restored:
        """Every phase, in order; on a failure, what ran is undone and the error raised."""
        steps: list[tuple[str, Callable[[], bool], Callable[[], None]]] = [
            ("verify", lambda: True, self._verify),
            ("compat", lambda: True, self._compat),
            ("lock", lambda: True, self._lock),
            ("barrier", lambda: self.req.meeting is not None, self._barrier),
            ("files", lambda: True, self._files),
            ("devmem", lambda: bool(self._fast().ranks), self._devmem),
            ("network", lambda: bool(self.spec.net), self._network),
            ("criu", lambda: True, self._criu),
            ("outbound", lambda: self.resets is not None, self._outbound),
            ("cuda-restore", lambda: bool(self.node.gpu.cuda_pids), self._cuda_restore),
            ("cuda-unlock", lambda: bool(self.node.gpu.cuda_pids), self._cuda_unlock),
        ]
        self.fetch()
        try:
            try:
                for name, applies, step in steps:
                    if applies():
                        with self.phases.phase(name):
                            step()
                if self.node.nccl.ranks:  # its own phases: reload (offloaded memory), rebuild
                    self._rebuild()
            except BaseException as e:
                self.undo.undo(e)
                raise
        finally:
            if self.pages is not None:
                self.pages.close()
        self.undo.forget()
        assert self.manifest is not None
        return Restored(self.manifest, self.spec, self.init_pid, self.phases,
                        self.veths[0][1] if self.veths else None, self.job, self.lock_fd, self.peers, self.fetched,
                        {"bytes": self.pages.bytes, "seconds": round(self.pages.seconds, 4)} if self.pages else {})

    def fetch(self) -> Manifest:
        """The fetch phase (once): the snapshot in a local store, its manifest authenticated."""
        if self.manifest is not None:
            return self.manifest
        meeting = self.req.meeting
        if meeting is not None:  # before the fetch: this node is coming; whatever it fails at, the others are told
            meeting.announce()
            self.undo.push("tell the other nodes", lambda e: meeting.failed(problems_of(e)))
        try:
            with self.phases.phase("fetch"):
                self.store, self.manifest, self.fetched = locate(self.req)
        except BaseException as e:
            self.undo.undo(e)
            raise
        self.spec = JobSpec.from_json(self.manifest.job)
        self.job = JobDir(self.manifest.job_name)
        self.node = self.manifest.nodes[0]
        self.resets = outbound.RestoreReset.plan(self.spec, self.node.outbound, self.work_dir)
        return self.manifest

    def abandon(self, cause: BaseException) -> None:
        """The caller gives up on this restore (between :meth:`fetch` and :meth:`run`, or after a failure of
        either: then nothing is left to undo): what ran is undone."""
        self.undo.undo(cause)
        if self.pages is not None:
            self.pages.close()

    @property
    def base(self) -> Path:
        assert self.store is not None and self.manifest is not None
        return self.store.path_of(self.manifest.id)

    @property
    def node_dir(self) -> Path:
        return self.base / "nodes" / str(self.node.node_rank)

    @property
    def work_dir(self) -> Path:
        return self.req.work_dir or self.job.path / "restore"

    def _fast(self) -> FastPath:
        return self.node.gpu.fast_path or FastPath({}, {})

    # -- the phases --------------------------------------------------------------------------------------

    def _verify(self) -> None:
        assert self.store is not None and self.manifest is not None
        pages = imagecheck.streamed_files(self.manifest)
        self.pages = imagecheck.PageCheck(self.base, pages)
        self.pages.start()  # from now on, beside the rest; its verdict is awaited at CRIU's post-restore
        bad = self.store.verify(self.manifest.id, skip=devmem_files(self.manifest), sizes_only=pages)
        if bad:
            raise corrupt(self.manifest.id, bad)

    def _compat(self) -> None:
        assert self.manifest is not None
        self.criu = criu_install.locate()
        if self.node.gpu.gpus:
            self.pairs = gpu_pairs(self.node.gpu.gpus, cuda.driver().gpus(), self.req.gpu_map)
        problems = compat_problems(self.manifest, self.criu)
        lacking = privileges.missing(privileges.for_job(frozenset(), self.spec.user))
        if lacking:  # CRIU could restore it, but no snapshot of it could be taken here
            problems.append(f"its workers run as a user of their own, which needs {', '.join(lacking)} "
                            "(docs/security.md)")
        problems += files.plan_restore(self.node.staged, self.node_dir / "files")
        problems += files.check_expected(self.node.expected)
        if problems:
            raise NotEligible(f"snapshot {self.manifest.id} cannot be restored on this machine", "; ".join(problems),
                              "restore it on a compatible machine, or fix what is listed", problems=problems)
        if self.req.meeting is not None:  # a live migration waits for this word before it ends the node's old self
            self.req.meeting.checked()

    def _lock(self) -> None:
        assert self.criu is not None
        if self.lock_fd < 0:
            def say() -> None:
                if self.req.lock_wait_s:
                    self.log(f"job {self.job.name}'s previous incarnation holds its lock here (a live migration: "
                             f"its coordinator ends it now): waiting up to {self.req.lock_wait_s:g} s")
                else:
                    self.log(f"job {self.job.name}'s previous agent is still ending: waiting up to "
                             f"{ENDING_WAIT_S:g} s")

            fd = self.lock_fd = self.job.take_lock(wait_ending=ENDING_WAIT_S, on_wait=say,
                                                   wait_held=self.req.lock_wait_s)
            self.undo.push("let go of the job's lock", lambda _e: os.close(fd))
        netlock.undo_dead_dump(self.job, self.log)
        for r in self.spec.ranks:  # a later run's error reports: never read as the restored job's
            self.job.error_file(r, own_user=bool(self.spec.user)).unlink(missing_ok=True)
        refuse_under_lock(self.spec, self.criu)

    def _barrier(self) -> None:
        assert self.req.meeting is not None
        self.req.meeting.barrier(self.node.nccl.generation)
        self.peers = tuple(self.req.meeting.peers)  # the other nodes' underlay addresses: the overlay's peers

    def _files(self) -> None:
        files.restore(self.node.staged, self.node_dir / "files")

    def _devmem(self) -> None:
        assert self.manifest is not None
        ranks = self._fast().ranks
        bad = put_devmem(ranks, self.node_dir, devmem_files(self.manifest))
        if bad:
            raise corrupt(self.manifest.id, bad)
        self.undo.push("remove the fast path's staging files", lambda _e: remove_devmem(ranks))

    def _network(self) -> None:
        veths = self.veths = net_sandbox.prepare_restore(self.spec.net, self.req.net_peers or self.peers)
        self.undo.push("remove the veth and the job network here", lambda _e: net_sandbox.undo_restore(
            self.spec.net, veths))
        if self.req.guard is not None:
            self.req.guard.network(self.spec.net, veths[0][1] if veths else None)

    def _criu(self) -> None:
        assert self.criu is not None and self.pages is not None and self.manifest is not None
        marks = orphans.Marks.new(self.work_dir)
        if self.req.guard is not None:  # before CRIU starts: whatever it forks is marked from its first moment
            self.req.guard.restoring(marks)
        actions = [marks.action()]
        if self.pages.entries:
            actions.append(self.pages.gate(self.work_dir))
        if self.resets is not None:
            actions.append(self.resets.hook())
        try:
            pid = criu_calls.restore(self.criu, self.node_dir / "criu", self.work_dir, timeout=self.req.timeout,
                                     mounts=self.node.mounts, veths=self.veths, actions=actions)
        except RestoreFailed:
            bad = self.pages.problems()  # an altered pages file stops CRIU at its gate: say so, not "CRIU failed"
            if bad:
                raise corrupt(self.manifest.id, bad) from None
            raise
        except OSError as e:
            raise RestoreFailed("CRIU could not be started", str(e), "run `cryosleep check`") from e
        self.init_pid = pid
        self.undo.push("end the restored job", lambda _e: _kill_tree(pid))
        if self.req.guard is not None:
            self.req.guard.restored(pid)
        bad = self.pages.problems()  # settled at the gate; asked again so that no path runs an unchecked image
        if bad:
            raise corrupt(self.manifest.id, bad)
        net_sandbox.after_restore(self.veths)

    def _outbound(self) -> None:
        assert self.resets is not None
        self.resets.finish(self.init_pid)  # never raises: what it could not reset is told, the job runs on

    def _cuda_restore(self) -> None:
        self.gpus = cuda.GpuSet(host_pids(self.init_pid, self.node.gpu.cuda_pids))
        self.gpus.restore(self.pairs)

    def _cuda_unlock(self) -> None:
        self.gpus.unlock()

    def _rebuild(self) -> None:
        # across nodes, the others may still be in their CRIU restore: wait for them within the restore's time
        meeting = self.req.meeting
        rebuild_nccl(self.init_pid, self.node.nccl, self.phases,
                     timeout=30.0 if meeting is None else min(self.req.timeout, 300.0), relay=meeting)


def locate(req: Request) -> tuple[LocalStore, Manifest, dict[str, Any] | None]:
    """The local store holding the snapshot, its manifest (authenticated), and what was fetched from where
    (None: it was local): {"store", "bytes", "seconds", "rate"}."""
    trust = req.trust or auth.Trust(key_file=req.key_file)
    remote = persist.is_remote(req.where)
    local = LocalStore(paths.default_store() if remote or req.where is None else Path(req.where))
    try:
        sid = local.resolve(req.ref)
        manifest = local.load(sid)
        auth.authenticate(manifest, sid, trust)  # before anything uses what the manifest says
        return local, manifest, None
    except NotFound:
        url = persist.normalize_url(req.where) if remote and req.where is not None else str(local.root)
        if not remote and not (local.root / "cas" / "snapshots").is_dir():
            raise
    manifest, rec = persist.fetch(url, req.ref, local, key_file=req.key_file, progress=req.transfer, trust=trust)
    auth.authenticate(manifest, manifest.id, trust)
    rate = rec.bytes_total / rec.verify_s if rec.verify_s else 0.0
    return local, manifest, {"store": url, "bytes": rec.bytes_total, "seconds": rec.verify_s, "rate": round(rate, 1)}


def restore(store: LocalStore, ref: str, work_dir: Path, **kw: Any) -> Restored:
    """Restore snapshot ``ref`` of ``store`` here (a :class:`Request`'s other fields as keywords)."""
    return RestoreRun(Request(ref=ref, where=store.root, work_dir=work_dir, **kw)).run()


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


def gpu_pairs(captured: list[GpuDevice], here: list[cuda.Gpu], gpu_map: list[int] | None) -> list[
        tuple[bytes, bytes]]:
    """The CUDA restore map: captured GPU i goes to GPU ``gpu_map[i]`` here (default: by position).

    An empty list means "the same GPUs", which the driver takes without a map."""
    if len(captured) != len(here):
        raise NotEligible("this machine has a different number of GPUs",
                          f"captured with {len(captured)}, {len(here)} here", "restore onto matching GPUs")
    names = {g.name for g in captured} | {g.name for g in here}
    if len(names) > 1:
        raise NotEligible("the GPU model differs", f"captured on {captured[0].name}, here {here[0].name}",
                          "restore onto GPUs of the same model")
    order = gpu_map if gpu_map is not None else list(range(len(here)))
    if sorted(order) != list(range(len(here))):
        raise NotEligible(f"--gpu-map {','.join(map(str, order))} is not a permutation of the {len(here)} GPUs",
                          "every GPU must appear once", "e.g. --gpu-map 1,0 swaps two GPUs")
    new = [here[i].uuid_str for i in order]
    old = [g.uuid for g in captured]
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


def corrupt(sid: str, bad: list[str]) -> StoreCorrupt:
    """The refusal of a snapshot whose files do not match its manifest."""
    return StoreCorrupt(f"snapshot {sid} failed verification; nothing was restored",
                        "; ".join(bad[:8]) + (f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""),
                        "restore another snapshot (`cryosleep ls`) and remove this one (`cryosleep rm`)", problems=bad)


def devmem_files(manifest: Manifest) -> dict[str, FileEntry]:
    """The fast path's device-memory files of the manifest's node, by path relative to the snapshot."""
    node = manifest.nodes[0]
    ranks = node.gpu.fast_path.ranks.values() if node.gpu.fast_path else ()
    names = {f"nodes/{node.node_rank}/{x.image}" for e in ranks for x in e.image_pieces()}
    return {f.path: f for f in node.files if f.path in names}


def put_devmem(ranks: dict[str, DevmemRank], node_dir: Path, checks: dict[str, FileEntry]) -> list[str]:
    """Every rank's fast-path staging file back at its path, at its size, before CRIU maps it again; for the
    ranks whose device memory it held at the snapshot, with that content (RELOAD copies it to the GPU), each
    piece checked against the manifest's SHA-256 as it is copied (``checks``: by path relative to the
    snapshot), all pieces of all ranks in parallel. Returns the problems found; with any, no staging file is
    left changed."""
    base = node_dir.parent.parent
    tmps: list[tuple[Path, str, int]] = []  # (path, temporary name, its directory's fd: files.open_dir)
    todo: list[tuple[tuple[str, int], DevmemPiece, str, FileEntry]] = []
    problems: list[str] = []
    for entry in ranks.values():
        path = Path(entry.stage_path)
        dfd = files.open_dir(str(path.parent), create=True, mode=0o700)  # no link on the way is followed
        tmp = path.name + ".cryosleep-restore"
        tmps.append((path, tmp, dfd))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            os.fchmod(fd, 0o600)  # a leftover of an interrupted restore may have had other bits
            os.ftruncate(fd, entry.stage_bytes)
        finally:
            os.close(fd)
        for piece in entry.image_pieces():
            rel = str((node_dir / piece.image).relative_to(base))
            want = checks.get(rel)
            if want is None:
                problems.append(f"{rel}: not in the manifest's file list")
            else:
                todo.append(((tmp, dfd), piece, rel, want))

    def put(job: tuple[tuple[str, int], DevmemPiece, str, FileEntry]) -> str | None:
        (tmp, dfd), piece, rel, want = job
        src = base / rel
        size = src.stat().st_size if src.exists() else -1
        if size != want.size or size != piece.bytes:
            return f"{rel}: size {size}, expected {want.size} (missing, truncated or altered)"
        got = files.copy_hashed(src, tmp, size, dst_off=piece.offset, dst_dir_fd=dfd)
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


def remove_devmem(ranks: dict[str, DevmemRank]) -> None:
    """Undo of :func:`put_devmem`: the staging files it put back removed (they hold device memory, on tmpfs)."""
    for entry in ranks.values():
        path = Path(entry.stage_path)
        path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only when empty


def rebuild_nccl(init_pid: int, facts: NcclCut, phases: Phases | None = None, timeout: float = 30.0,
                 relay: Meeting | None = None) -> None:
    """The restored workers' interceptors are QUIESCED (or OFFLOADED: the fast path), holding every NCCL call:
    bring offloaded device memory back, re-create their communicators from fresh unique ids and open the
    gates. Their control blocks came back (the files phase) at the paths they map. ``relay``: the job spans
    nodes, and ids cross them through the coordinator."""
    phases = phases or Phases(None)
    deadline = time.monotonic() + timeout
    blocks: dict[int, ControlBlock] = {}
    try:
        for r in facts.ranks:
            left = max(0.1, deadline - time.monotonic())
            blocks[r.rank] = ControlBlock.wait(r.ctl, pid=r.pid, timeout=left)
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
                gen = driver.command_at(Cmd.REBUILD, relay.generation())  # the generation all nodes agreed on
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
