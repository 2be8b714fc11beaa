"""A node's capture steps: the operations the snapshot sequence (``coordinator/machine.py``) calls on each node,
in this order, for a one-node job (in-process, ``coordinator/embedded.py``) as for a node of many
(``agent/coordinated.py`` is the node's side of both). Phases, as each node times them::

    settle     (a process of the job killed or failing in the last SETTLE_S, as the agent's watch between
               snapshots saw it: core/procwatch.py) wait until the job has outlived it, or refuse
    preflight  what the processes hold that cannot be captured, and what their NCCL interceptors refuse
               -> refuse with reasons (nothing touched)
    outbound   (job running, when it has connections to peers outside the job) a bounded wait for their send
               queues to drain; recorded, for a restore to reset them (capture/outbound.py)
    prepare    (fast path, job still running) each rank's pinned staging file grown to its device memory
    precopy    (job still running; keep-running and stop, where criu-uffd is built and the kernel tracks) the
               job's processes asked to track their writes (the agent's Tracker), then criu-uffd's pre-dump of
               the tree into the staging's ``criu-pre``: the job frozen only while CRIU reads its page maps
               (``precopy-freeze``, CRIU's own time, in the pause), its pages copied while it runs
               (capture/precopy.py). Where it cannot run, the dump is plain and the manifest's
               ``NodeImage.precopy`` says why
    drain      (ranks that called NCCL) from HOLD to the consistent cut, the sequence's rounds included: every
               member of every communicator has issued exactly the same calls
    quiesce    every rank flushes and destroys its real NCCL communicators (no NCCL socket, IPC or
               InfiniBand state left for the CUDA checkpoint and CRIU)
    offload    (fast path) each rank copies its device memory into its staging file at DMA speed and
               releases it, so the driver's checkpoint has little left; a rank that cannot (docs/interceptor.md,
               "The fast path") keeps its memory and takes the plain path
    cuda-lock, cuda-checkpoint
               (GPU jobs) every CUDA process locked, then its device memory moved to host memory
    dump       CRIU freezes the tree, writes its image, stages the job's files and the NCCL control
               blocks, then resumes it (keep-running) or holds it stopped (stop); after a pre-dump, only the pages
               written since (``--track-mem --prev-images-dir ../criu-pre``: the image is both directories)
    dump-record
               (CPU jobs without NCCL) the dump's records for a survivor of the agent, saved while the job runs:
               before CRIU stops it, and after a keep-running dump (a GPU or NCCL job, paused then, counts them
               in ``dump``)
    cuda-restore, cuda-unlock
               (GPU jobs, keep-running) device memory back, CUDA calls released
    reload     (fast path, keep-running) the offloaded device memory back at its addresses
    rebuild    (NCCL, keep-running) from REBUILD to RUN, the ids' relay included: every communicator
               re-created from fresh ids, then the gates open: the pause ends here
    probation  (keep-running, after a settle that waited) the job runs on SETTLE_S past the dump, its init and
               workers alive, or the image is dropped
    devmem     (fast path) the staging files copied into the image (keep-running: after the job resumed)
    checksum   size and SHA-256 of every image file, and of the files the job only reads (libraries,
               datasets: checked at restore) unless cached (the job is already running again)
    commit     manifest written, snapshot published atomically in the store
    verify     (stop) every file flushed to its disk (fsync), re-read and checked against the manifest
    persist    (stop, when the job has a remote store) every chunk stored and re-read from it, inside the
               deadline (keep-running snapshots persist in the background, after the snapshot)
    end        (stop) the held job is killed; it lives on only in the snapshot

The pause (``pause_s``) is the sum of the phases in ``PAUSE`` (a stop snapshot adds those after the dump):
counted in one place, ``NodeCapture.pause_s``.

A failure after the pre-dump fails the snapshot like any other: the staging goes with the pre-dump in it, and
the job, which the pre-dump left running, is not touched by it. The node's undo, whatever failed, is
``NodeCapture.undo_capture`` then ``undo_nccl``, called by the
sequence's one rollback (its ``abort``): a held job is released (network lock removed, tasks continued), CUDA
processes are restored and unlocked, a committed but unverified snapshot is removed, the staging directory is
deleted; NCCL ranks that were only held run again, and past the cut every rank is quiesced at the cut for the
sequence's rebuild. The job is never killed unless its snapshot is complete and verified.

A rehearsal (``rehearsal=True``) runs preflight, drain, quiesce and rebuild only, capturing nothing: it shows
that a job reaches a consistent cut, and what that costs, without writing an image.
"""

from __future__ import annotations

import os
import platform
import socket
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryosleep import __version__, paths
from cryosleep.capture import criu as criu_calls
from cryosleep.capture import criu_install, criu_stats, cuda, eligibility, files, netlock, outbound, precopy
from cryosleep.capture.track import Tracker
from cryosleep.core import proctree, procwatch
from cryosleep.core.interceptor import ControlBlock, attach_published
from cryosleep.core.job import JobSpec
from cryosleep.cut.driver import Driver
from cryosleep.errors import CaptureFailed, CryosleepError, InterceptorError, NotEligible
from cryosleep.store.local import LocalStore, Staging, hash_tree
from cryosleep.store.manifest import (
    DevmemPiece,
    DevmemRank,
    FastPath,
    GpuDevice,
    Manifest,
    NcclComm,
    NcclCut,
    NcclRank,
    NodeGpu,
    NodeImage,
    NodeOutbound,
    Precopy,
)
from cryosleep.timing import Phases, Progress

# A process of the job killed (or failing) this long before a snapshot makes it wait until this long has passed
# since, the job alive; and a keep-running snapshot taken after such a wait is listed valid only once the job has
# run on this long after its dump. A job whose process was just killed is often about to fail, and its parent has
# not said so yet (chaos seed 1002: a DataLoader worker killed, reaped at once by its rank). Measured here: the rank
# raises at its next SIGCHLD (the kill's, or only the one the dump's own stop of its workers sends), then joins its
# other workers (up to 5 s each, PyTorch's MP_STATUS_CHECK_INTERVAL) and exits 5.5-8 s after the kill.
SETTLE_S = 10.0
# ... and a snapshot waits at most this long for a quiet window: a job whose processes keep being killed is
# refused rather than captured in the middle of it
SETTLE_MAX_S = 3 * SETTLE_S

# The phases during which the job does not run (a stop snapshot adds checksum, commit, verify and end); the
# pre-dump's freeze (``precopy-freeze``, CRIU's own time) inside its ``precopy`` phase, the job running otherwise.
PAUSE = ["precopy-freeze", "drain", "quiesce", "offload", "cuda-lock", "cuda-checkpoint", "dump", "cuda-restore",
         "cuda-unlock", "reload", "rebuild"]


@dataclass
class Target:
    """The running sandbox to capture, as the agent knows it."""

    spec: JobSpec
    init_pid: int
    runtime: dict[str, Any] = field(default_factory=dict)
    restored_from: str | None = None
    end: Callable[[str], None] | None = None  # kills the held job once the stop snapshot is safe
    # Stores a committed, verified stop snapshot remotely and verifies it there, by the deadline (monotonic);
    # raises when it cannot (the rollback then resumes the job). None: the local store is where it lives.
    persist: Callable[[Manifest, float], None] | None = None
    cuda_lock_timeout: float = 10.0
    ctl: dict[int, Path] = field(default_factory=dict)  # job rank -> its NCCL control file (JobDir.ctl_path)
    log: Callable[[str], None] | None = None  # the agent's log, for what the drain does round by round
    # Arms (a reason) or disarms (None) the agent's watchdog: from the cut until the job runs again, a job
    # whose agent dies is killed rather than left half-captured (agent/watchdog.py)
    arm: Callable[[str | None], None] | None = None
    # Records (a DumpRecord) or forgets (None) the CRIU dump under way or holding the job, in the job's state and
    # with its watchdog: what a survivor of a dead agent undoes (capture/netlock.py)
    on_dump: Callable[[netlock.DumpRecord | None], None] | None = None
    # Records (its path) or forgets (None) the staging directory of the snapshot under way, likewise: a dead
    # agent's survivor removes it, whatever the moment
    on_staging: Callable[[str | None], None] | None = None
    # The agent's watch on the job's processes between snapshots (core/procwatch.py ``JobExits.since``): the
    # exits at or after a monotonic time. None: no watch, the snapshot sees only what ends from its preflight on
    exits: Callable[[float], list[procwatch.Exit]] | None = None
    # The agent's tracker of the job's writes (capture/track.py), for the pre-copy; None: the job's workers were
    # started without theirs (capture/precopy.py: the dump is plain)
    tracker: Tracker | None = None


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


def nccl_driver(target: Target) -> Driver | None:
    """The control blocks of the ranks that have called NCCL (None when none has: nothing to drain)."""
    if not target.ctl:
        return None

    def job_pids(running: bool = False) -> set[int]:
        """The sandbox's PIDs as seen inside its namespace (``running``: not those that exited)."""
        tree = proctree.tree(target.init_pid)
        return {p for p in (proctree.ns_pid(x) for x in tree
                            if not running or proctree.state(x) not in ("Z", "X", "gone")) if p is not None}

    def published(known: Collection[int] = ()) -> dict[int, ControlBlock]:
        todo = {r: p for r, p in target.ctl.items() if r not in known and p.exists()}
        return attach_published(todo, job_pids()) if todo else {}

    blocks = published()
    return Driver(blocks, discover=published, log=target.log, live=lambda: job_pids(running=True)) if blocks else None


def _refuse(target: Target, checks: list[eligibility.Check]) -> NotEligible:
    return NotEligible(
        f"job {target.spec.name!r} cannot be captured now",
        "; ".join(c.detail for c in checks),
        "fix what is listed, then snapshot again; the job was not touched",
        checks=[c.to_json() for c in checks],
    )


def nccl_facts(nccl: Driver) -> NcclCut:
    """The interceptors at the cut, for the manifest."""
    ranks = [NcclRank(rank=r, ctl=str(b.path), pid=b.pid, nccl_version=b.nccl_version, comms=[
        NcclComm(ident=f"{s.ident:016x}", vid=s.vid, rank=s.rank, nranks=s.nranks, seq=s.seq, sent=sum(s.send),
                 received=sum(s.recv), rebuild=int(s.rebuild), state=int(s.state), device=s.device)
        for s in b.comms()]) for r, b in nccl.blocks.items()]
    return NcclCut(generation=nccl.gen, ranks=ranks)


class NodeCapture:
    """One node's snapshot in progress: what its undo must undo, and one method per step.

    The snapshot sequence (``coordinator/machine.py``) runs the steps one operation at a time
    (``agent/coordinated.py``), and its rollback calls ``undo_capture`` and ``undo_nccl``: the one way back from
    wherever a failure left the node."""

    def __init__(self, target: Target, store: LocalStore, *, stop: bool, deadline: float,
                 progress: Progress | None = None, fault: str | None = None, rehearsal: bool = False,
                 precopy: bool = True) -> None:
        self.target = target
        self.store = store
        self.stop = stop
        self.rehearsal = rehearsal  # drain, quiesce and rebuild only: nothing captured
        self.deadline = deadline
        self.fault = fault
        self.phases = Phases(progress)
        self.criu = criu_install.locate()
        self.staging: Staging | None = None
        self.gpus = cuda.GpuSet([])
        self.gpu_facts = NodeGpu()
        self.nccl: Driver | None = None
        self.nccl_info = NcclCut()
        self.held = False  # CRIU left the tree stopped (a stop snapshot's dump): released by rollback or end
        self.committed = False
        self.dump_rid: str | None = None
        self.dump_times = (0.0, 0.0, 0.0)  # the dump's CRIU run, the job held, its stopping (criu.DumpResult)
        self.dumped = False
        self.tree: list[int] = []
        self.watch: proctree.Watch | None = None  # the tree's processes at the preflight: which end, and how
        self.own: set[int] = set()  # the sandbox's init and the workers it started (its children)
        self.suspect = False  # a process of the job failed just before: the job must outlive the dump (probation)
        self.dumped_at = 0.0
        self.rss = 0
        self.mounts: list[str] = []
        self.outbound_facts = NodeOutbound()
        self.fast: list[int] = []
        self.fast_skipped: dict[int, str] = {}
        self.manifest: Manifest | None = None
        self.precopy_on = precopy  # False: this snapshot dumps plain (``--no-precopy``)
        self.precopy: Precopy | None = None  # the pre-copy's record, or why the dump is plain (the manifest's)
        self.tracked: criu_install.Criu | None = None  # criu-uffd, for the final dump after a pre-dump

    @property
    def node_rank(self) -> int:
        return self.target.spec.node_rank

    def time_left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())

    def preflight(self) -> None:
        """What cannot be captured is refused with reasons, before anything is touched; the staging begins."""
        target = self.target
        with self.phases.phase("preflight"):
            if self.rehearsal:
                self.nccl = nccl_driver(target)
                if self.nccl is None:
                    raise NotEligible(f"job {target.spec.name!r} has no NCCL communicators to drain",
                                      "none of its workers has called NCCL through the interceptor yet",
                                      "rehearse once the job has started training (or it runs with "
                                      "--no-interceptor)")
                refused = [c for c in eligibility.interceptor_checks(self.nccl.blocks) if not c.ok and c.fatal]
                if refused:
                    raise _refuse(target, refused)
                return
            settled = self.settle()
            problems = [c for c in eligibility.process_checks(target.init_pid) if not c.ok and c.fatal]
            self.nccl = nccl_driver(target)
            if self.nccl is not None:
                problems += [c for c in eligibility.interceptor_checks(self.nccl.blocks) if not c.ok and c.fatal]
            if problems:
                raise _refuse(target, problems)
            self.tree = proctree.tree(target.init_pid)
            self.watch = proctree.Watch(self.tree)
            self.own = {target.init_pid, *proctree.children(target.init_pid)}
            if target.exits is not None and (late := [e for e in target.exits(settled) if e.failed]):
                raise JobEnding(f"processes of job {target.spec.name!r} ended as the snapshot began",
                                _exits_words(late, time.monotonic()),
                                "snapshot again in a few seconds; the job was not touched and its last snapshot is "
                                "still valid")
            self.rss = sum(proctree.rss_bytes(p) for p in self.tree)
            if cuda.gpu_processes(target.init_pid):
                self.gpus = cuda.GpuSet(cuda.cuda_processes(target.init_pid))
                drv = cuda.driver()
                self.gpu_facts = NodeGpu(drv.version(), [GpuDevice(g.index, g.uuid_str, g.name) for g in drv.gpus()],
                                         [n for n in map(proctree.ns_pid, self.gpus.pids) if n is not None])
                # (a process gone already is not listed: it fails the CUDA lock, and the snapshot with it)
            own_mnt = proctree.other_ns(target.init_pid, "mnt")
            self.mounts = criu_calls.external_mounts(target.init_pid) if own_mnt else []
            self.staging = self.store.begin(target.spec.name)
            self.record_staging(str(self.staging.path))

    def settle(self) -> float:
        """The rule of ``SETTLE_S``: the snapshot waits until no process of the job has been killed or failed for
        that long, the sandbox's init and workers alive; it refuses when the job ends meanwhile (its init, or a
        worker failing), when its deadline comes first, or after ``SETTLE_MAX_S``. Returns when it looked last."""
        target, exits = self.target, self.target.exits
        start = now = time.monotonic()
        if exits is None:
            return now
        waited = False
        while True:
            recent = [e for e in exits(now - SETTLE_S) if e.failed]
            verdict, until = settle_verdict(now, recent, proctree.alive(target.init_pid))
            if verdict == "go":
                if waited:
                    self.phases.end("settle")
                return now
            words = _exits_words(recent, now)
            if verdict == "ended":
                raise JobEnding(f"job {target.spec.name!r} is failing: it ended just before the snapshot",
                                f"{words}; a snapshot waits {SETTLE_S:g} s after a process of the job is killed "
                                "or fails, to see the job survive it, and the job did not",
                                "a failing job cannot be captured; its last snapshot is still valid: restore it")
            why = (f"{words}; a job whose process was just killed is often about to fail (its parent has not "
                   f"noticed yet), so a snapshot waits until {SETTLE_S:g} s have passed since such an exit with the "
                   "job's init and workers alive")
            if until > self.deadline:
                raise NotEligible(f"job {target.spec.name!r} cannot be captured now: a process of it was just "
                                  "killed or failed", f"{why}, and this snapshot's deadline comes first",
                                  f"snapshot again in {until - now:.0f} s or with a longer --timeout; the job was "
                                  "not touched and its last snapshot is still valid")
            if now - start > SETTLE_MAX_S:
                raise NotEligible(f"job {target.spec.name!r} cannot be captured now: its processes keep being "
                                  "killed or failing", f"{why}, and none of the last {SETTLE_MAX_S:g} s was quiet",
                                  "snapshot again once they stop; the job was not touched and its last snapshot is "
                                  "still valid")
            self.suspect = True
            if not waited:
                waited = True
                self.phases.begin("settle")
                if target.log is not None:
                    target.log(f"snapshot waits {until - now:.1f} s to see the job survive: {words}")
            time.sleep(max(0.0, min(0.1, until - now)))
            now = time.monotonic()

    def probation(self) -> None:
        """(keep-running, after ``settle`` waited) The job runs on; the image is committed only once it has run
        ``SETTLE_S`` past the dump with its init and workers alive: a rank that had not noticed its dead worker
        before notices at the dump (the stop of its workers sends it a SIGCHLD) and fails within that time, and an
        image of it would restore a job that fails at once."""
        with self.phases.phase("probation"):
            until = min(self.dumped_at + SETTLE_S, self.deadline)
            while True:
                ended = {p: st for p, st in (self.watch.ended() if self.watch else {}).items() if p in self.own}
                if ended or not proctree.alive(self.target.init_pid):
                    words = ", ".join(f"process {p} {proctree.describe_status(st)}" for p, st in sorted(ended.items()))
                    raise JobEnding(f"job {self.target.spec.name!r} failed right after the snapshot",
                                    f"{words or 'its sandbox init ended'} within {SETTLE_S:g} s of the dump; a "
                                    "process of the job had been killed or failed just before the snapshot, so its "
                                    "image was kept only if the job outlived the dump by that long",
                                    "a failing job cannot be captured; its last snapshot is still valid: restore it")
                if time.monotonic() >= until:
                    return
                time.sleep(0.1)

    def before_pause(self) -> None:
        """Job still running: outside peers' send queues drained (bounded); the fast path's staging grown."""
        if self.rehearsal:
            return
        self.outbound_facts = outbound.before_dump(self.target.spec, self.target.init_pid, self.phases, self.deadline)
        nccl = self.nccl
        if nccl is not None and nccl.fast_ranks():
            with self.phases.phase("prepare"):
                self.fast_skipped = nccl.prepare(nccl.fast_ranks(), self.deadline)
                self.fast = [r for r in nccl.fast_ranks() if r not in self.fast_skipped]
        self.pre_copy()

    def pre_copy(self) -> None:
        """(job running, before the drain) The write-tracked pre-copy (capture/precopy.py): the job's processes
        track their writes, and criu-uffd's pre-dump copies their memory into the staging, freezing the job only
        to read its page maps (``precopy-freeze``, in the pause); the dump then copies only what was written
        since. Where it cannot, the dump is plain and the manifest says why. A failure after the pre-dump fails
        the snapshot: the rollback drops the staging, pre-dump included; the job, left running, is unharmed."""
        assert self.staging is not None
        _, why = precopy.available()
        if not self.precopy_on:
            why = "turned off for this snapshot (--no-precopy)"
        elif self.target.tracker is None:
            why = "the job's workers do not track their writes (started with --no-precopy or --no-interceptor, " \
                  "or before criu-uffd was built)"
        elif not why:
            why = precopy.worth_it(self.target.tracker)
        uffd = precopy.tracked_criu(self.criu) if not why else None
        if uffd is None:
            self.precopy = Precopy(why=why or "criu-uffd is not available")
            return
        assert self.target.tracker is not None
        node_dir = self.staging.node_dir(self.node_rank)
        with self.phases.phase("precopy"):
            tracked, total = precopy.register(self.target.tracker, self.target.init_pid)
            if not tracked:
                self.precopy = Precopy(why="no process of the job answered the write tracker", processes=total)
                return
            try:
                rec = precopy.predump(uffd, self.target.init_pid, node_dir, self.time_left())
            except CaptureFailed as e:
                precopy.drop(node_dir)
                self.precopy = Precopy(why=f"the pre-dump failed: {e.what}: {e.why}"[:400], tracked=tracked,
                                       processes=total)
                if self.target.log is not None:
                    self.target.log(f"pre-copy skipped, the dump is plain: {self.precopy.why}")
                return
            rec.tracked, rec.processes = tracked, total
            self.precopy, self.tracked = rec, uffd
            if self.fault == precopy.FAULT:
                raise CaptureFailed(f"a fault injected after the pre-dump (CRYOSLEEP_FAULT={precopy.FAULT})",
                                    "the test's fault point between the pre-dump and the dump",
                                    "the job goes on running")
        self.phases.part("precopy-freeze", rec.freeze_s)  # of the precopy phase, the job frozen

    def quiesce(self) -> None:
        """(at the cut) every rank destroys its real communicators; the fast path moves device memory out.
        From here until the job runs again, only this agent can bring it back: its watchdog is armed."""
        if self.target.arm is not None:
            mode = "rehearsal" if self.rehearsal else "stop snapshot" if self.stop else "keep-running snapshot"
            self.target.arm(f"a {mode}")
        nccl = self.nccl
        if nccl is None:
            return
        with self.phases.phase("quiesce"):
            nccl.quiesce(self.deadline)
            self.nccl_info = nccl_facts(nccl)
        if self.fast:
            with self.phases.phase("offload"):
                refused = nccl.offload(self.fast, self.deadline)
                self.fast_skipped.update(refused)
                self.fast = [r for r in self.fast if r not in refused]

    def dump(self) -> None:
        """CUDA checkpoint and CRIU dump; keep-running: CUDA and the fast path's memory back at once."""
        if self.gpus.pids:
            with self.phases.phase("cuda-lock"):
                self.gpus.lock(self.target.cuda_lock_timeout)
            with self.phases.phase("cuda-checkpoint"):
                self.gpus.checkpoint()
        assert self.staging is not None
        # The dump's records for a survivor of this agent (saved with an fsync: on the disk CRIU fills, one took up to
        # 2 s here) are counted in the pause only where the job is paused then: a CPU job's runs until CRIU stops
        # it and again as soon as CRIU is done with a keep-running dump; a GPU or NCCL job's is paused throughout.
        paused = bool(self.gpus.pids) or self.nccl is not None
        node_dir = self.staging.node_dir(self.node_rank)
        rec = netlock.DumpRecord(str(node_dir))
        extra = {"CRYOSLEEP_FAULT": self.fault} if self.fault else {}
        nccl = self.nccl
        if nccl is not None:  # the control blocks, copied while CRIU holds the tree frozen
            extra["CRYOSLEEP_HOOK_EXTRA_FILES"] = os.pathsep.join(str(b.path) for b in nccl.blocks.values())
            stages = [b.devmem.stage_path for b in nccl.blocks.values() if b.devmem.stage_path]
            if stages:  # the fast path's staging files: copied in ``commit``, outside the freeze
                extra["CRYOSLEEP_HOOK_SKIP"] = os.pathsep.join(stages)
        with self.phases.phase("dump" if paused else "dump-record"):
            if failed := self.failed_processes():  # an image now would hold a job that fails at once (chaos
                raise JobEnding(  # seed 301: a DataLoader worker killed before the dump)
                    f"processes of job {self.target.spec.name!r} ended before the dump",
                    f"since the snapshot began, {failed}",
                    "a failing or ending job cannot be captured; its last snapshot is still valid")
            self.record(rec)
        with self.phases.phase("dump"):
            try:
                res = criu_calls.dump(self.tracked or self.criu, self.target.init_pid, node_dir,
                                      leave="stopped" if self.stop else "running", timeout=self.time_left(),
                                      extra_env=extra, mounts=self.mounts, parent=precopy.parent_arg(self.precopy),
                                      on_start=lambda pid: self.record(netlock.DumpRecord(rec.dir, pid)))
            except BaseException:
                self.record(None)  # CRIU is gone, and what it left undone
                raise
            self.dump_rid = res.run_id
            self.dump_times = (res.criu_s, res.held_s, res.stopping_s)
            self.held = self.stop
            self.dumped = True
            self.dumped_at = time.monotonic()
        with self.phases.phase("dump" if paused or self.stop else "dump-record"):
            # a stop dump holds the job under its lock until end() or the rollback removes it
            self.record(netlock.DumpRecord(rec.dir, 0, res.run_id) if self.stop else None)
        if self.gpus.pids and not self.stop:
            with self.phases.phase("cuda-restore"):
                self.gpus.restore()
            with self.phases.phase("cuda-unlock"):
                self.gpus.unlock()
        if self.nccl is not None and self.fast and not self.stop:
            with self.phases.phase("reload"):
                self.nccl.reload(self.fast, self.deadline)

    def record(self, rec: netlock.DumpRecord | None) -> None:
        if self.target.on_dump is not None:
            self.target.on_dump(rec)

    def record_staging(self, path: str | None) -> None:
        if self.target.on_staging is not None:
            self.target.on_staging(path)

    def commit(self) -> Manifest:
        """The fast path's device memory copied into the image, every file hashed, the snapshot published."""
        staging, target = self.staging, self.target
        assert staging is not None
        if self.suspect and not self.stop:
            self.probation()
        node_dir = staging.node_dir(self.node_rank)
        devmem_sums: dict[str, str] = {}
        nccl = self.nccl
        if nccl is not None and any(b.devmem.stage_path for b in nccl.blocks.values()):  # mapped: CRIU needs them
            with self.phases.phase("devmem"):
                self.gpu_facts.fast_path = save_devmem(nccl, self.fast, self.fast_skipped, node_dir, devmem_sums)
        criu_profile = criu_stats.read(node_dir, *self.dump_times)  # CRIU's own breakdown of the dump's freeze
        if self.precopy is not None and self.precopy.parent is not None:
            self.precopy.pages_parent = precopy.parent_pages(node_dir)
            if self.target.tracker is not None and criu_profile is not None:
                precopy.learn(self.target.tracker, self.precopy, criu_profile.pages_written)
        with self.phases.phase("checksum"):
            image_files = hash_tree(staging.path, [f"nodes/{self.node_rank}"], known=devmem_sums)
            staged = files.read_index(node_dir / "files")
            expected = files.read_expected(node_dir / "files")
            files.hash_expected(expected, paths.home() / "cache" / "file-hashes.json")
        node = NodeImage(node_rank=self.node_rank, ranks=target.spec.ranks, init_pid=target.init_pid,
                         files=image_files, staged=staged, processes=len(self.tree), rss_bytes=self.rss,
                         gpu=self.gpu_facts, mounts=self.mounts, nccl=self.nccl_info, expected=expected,
                         outbound=self.outbound_facts, criu=criu_profile, precopy=self.precopy)
        manifest = Manifest(
            id=staging.id, job=target.spec.to_json(), mode="stop" if self.stop else "keep-running",
            created_at=time.time(), nodes=[node], host=host_facts(self.criu, target.runtime),
            phases={}, pause_s=0.0, restored_from=target.restored_from,
        )
        manifest.phases = self.phases.rounded()
        manifest.pause_s = self.pause_s()
        with self.phases.phase("commit"):
            self.store.commit(staging, manifest)
            self.committed = True
            self.record_staging(None)  # published: a snapshot of the store now, no staging left
        self.manifest = manifest
        return manifest

    def verify(self, timeout: float) -> None:
        """(stop) Every stored file made durable (CRIU and the staging write into the page cache, and the stop
        snapshot ends the job: its image must outlive a crash of the machine), then every stored file re-read
        and checked against the manifest, inside the deadline."""
        assert self.manifest is not None
        with self.phases.phase("verify"):
            if time.monotonic() > self.deadline:
                raise CaptureFailed(f"the stop snapshot ran past its {timeout:g} s timeout", "",
                                    "retry with a longer --timeout")
            if self.stop:
                durable(self.store.snapshots / self.manifest.id, [f.path for n in self.manifest.nodes for f in n.files])
            bad = self.store.verify(self.manifest.id)
            if bad:
                raise CaptureFailed("the stored image failed verification", "; ".join(bad[:5]),
                                    "check the store's disk; the job was resumed")

    def persist(self) -> None:
        """(stop, with a remote store) stored and verified there, inside the deadline."""
        if self.target.persist is not None:
            assert self.manifest is not None
            with self.phases.phase("persist"):
                self.target.persist(self.manifest, self.deadline)

    def end(self) -> None:
        """(stop, the snapshot safe) the held job is killed: it lives on only in the snapshot."""
        assert self.manifest is not None
        with self.phases.phase("end"):
            if self.target.end:
                self.target.end(self.manifest.id)
            self.held = False
            self.gpus.pids = []  # they are gone with the job
            if self.nccl is not None:
                self.nccl.close()  # and so are their interceptors: nothing to roll back
            criu_calls.unlock_network(self.criu, self.dump_rid)
            self.record(None)

    def pause_s(self) -> float:
        """How long the job did not run: the one place the pause is counted. A stop snapshot holds the job
        until it is safe: the device memory's copy into the image, the checksum, commit, verify, persist and
        end count too."""
        keep = PAUSE if not self.stop else [*PAUSE, "devmem", "checksum", "commit", "verify", "persist", "end"]
        return round(self.phases.total(keep), 4)

    def finish(self) -> Manifest:
        """The final phase times (and pause) written into the published manifest."""
        manifest = self.manifest
        assert manifest is not None
        manifest.phases = self.phases.rounded()
        manifest.pause_s = self.pause_s()
        _rewrite_manifest(self.store, manifest)
        return manifest

    def undo_capture(self) -> list[str]:
        """Everything but NCCL undone: CRIU's hold released, CUDA restored and unlocked, the image (committed or
        staged) removed. Returns what could not be undone."""
        problems: list[str] = []
        if self.held:
            criu_calls.release(self.criu, self.target.init_pid, self.dump_rid, repair=True)  # TCP repair is on
            self.held = False
            self.record(None)
        if self.gpus.locked or self.gpus.checkpointed:
            problems += self.gpus.rollback()
        if self.committed and self.manifest is not None:
            try:
                self.store.remove(self.manifest.id)
            except CryosleepError as e:
                problems.append(f"{e.what}: {e.why}")
            self.committed = False
        if self.staging is not None:
            self.store.abort(self.staging)
            self.staging = None
            self.record_staging(None)
        return problems

    def explain(self, e: BaseException) -> CryosleepError:
        """The error to report for a step that failed (the sequence's rollback then resumes the job)."""
        err = _as_failure(e, "the snapshot failed")
        failed = self.failed_processes()
        if failed and not isinstance(e, JobEnding):
            # the job was failing or ending: what failed is a symptom of that, not the thing to report
            err = CaptureFailed(
                f"processes of job {self.target.spec.name!r} ended while the snapshot ran",
                f"{failed}, and then the snapshot failed ({err.what}: {err.why})",
                "a failing or ending job cannot be captured; its last snapshot is still valid", **err.details)
        return err

    def failed_processes(self) -> str:
        """Which of the job's processes ended since the preflight in a way an image cannot hold, as words ("" when
        none did): ``failed_processes`` below."""
        return failed_processes(self.watch, self.own, self.target.init_pid) if self.watch is not None else ""

    def close(self) -> None:
        """The snapshot is over here (the job runs, or was ended): the watchdog disarmed, the blocks closed."""
        if self.target.arm is not None:
            self.target.arm(None)
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.nccl is not None:
            self.nccl.close()


DEVMEM_DIR = "devmem"
DEVMEM_PIECE = 1 << 30  # each rank's device memory is imaged in pieces of this size, copied and hashed in parallel


def durable(base: Path, rels: list[str]) -> None:
    """Each file (relative to ``base``) flushed to its disk; CaptureFailed naming the first that cannot be."""
    for rel in rels:
        try:
            fd = os.open(base / rel, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise CaptureFailed(f"the image file {rel} could not be written to its disk", e.strerror or str(e),
                                "check the store's disk; the job was resumed") from None


def devmem_piece_size() -> int:
    """The piece size (``$CRYOSLEEP_DEVMEM_PIECE`` bytes, for tests; else 1 GiB)."""
    try:
        return max(4096, int(os.environ.get("CRYOSLEEP_DEVMEM_PIECE") or DEVMEM_PIECE))
    except ValueError:
        return DEVMEM_PIECE


def save_devmem(nccl: Driver, fast: list[int], skipped: dict[int, str], node_dir: Path,
                digests: dict[str, str]) -> FastPath:
    """Each offloaded rank's staging file (its device memory) copied into the image in pieces
    (``devmem/rank-R.devmem.NNN``, 1 GiB each), every piece hashed as it is copied (into ``digests``,
    image-relative path -> SHA-256, so the checksum does not read it again), all pieces in parallel; and what
    a restore needs to put every rank's staging file back before CRIU maps it again (docs/interceptor.md,
    "The fast path")."""
    ranks: dict[str, DevmemRank] = {}
    todo: list[tuple[str, Path, int, int]] = []
    piece = devmem_piece_size()
    for r, b in nccl.blocks.items():
        dm = b.devmem
        if not dm.stage_path:
            continue
        entry = DevmemRank(dm.stage_path, dm.stage_bytes, image=None, plan=dm.plan())
        if r in fast:
            total = dm.offload_bytes
            name = f"{DEVMEM_DIR}/rank-{r}.devmem"
            pieces = [DevmemPiece(f"{name}.{i:03d}", o, min(piece, total - o))
                      for i, o in enumerate(range(0, total, piece))] or [DevmemPiece(f"{name}.000", 0, 0)]
            todo += [(dm.stage_path, node_dir / x.image, x.offset, x.bytes) for x in pieces]
            entry.image, entry.pieces, entry.bytes = pieces[0].image, pieces, total
            entry.offload_s = round(dm.offload_s, 4)
        ranks[str(r)] = entry
    if todo:
        (node_dir / DEVMEM_DIR).mkdir(exist_ok=True)
        with ThreadPoolExecutor(max_workers=files.copy_workers(len(todo))) as pool:
            sums = list(pool.map(lambda t: files.copy_hashed(t[0], t[1], t[3], src_off=t[2]), todo))
        base = node_dir.parent.parent  # the snapshot's directory: the manifest's paths are relative to it
        digests.update({str(dst.relative_to(base)): h for (_, dst, _, _), h in zip(todo, sums, strict=True)})
    return FastPath(ranks, {str(r): why for r, why in skipped.items()})


def undo_nccl(nccl: Driver | None, at_cut: bool, deadline: float) -> None:
    """A node's NCCL ranks back to where the sequence's rollback goes on from (after ``NodeCapture.undo_capture``:
    the tasks must run and their CUDA work be back before the interceptors can rebuild communicators). Before
    the cut, held ranks run again; at it, every rank still live is quiesced at the cut, so that the rollback's
    rebuild re-creates every communicator with all its members."""
    if nccl is None:
        return
    if at_cut:
        live = [r for r, b in nccl.blocks.items() if b.comms_live]
        if live:
            nccl.requiesce(live, deadline)
    elif nccl.touched:
        nccl.run()


def failed_processes(watch: proctree.Watch, own: set[int], init_pid: int) -> str:
    """Which of the watched processes ended in a way an image cannot hold, as words ("" when none did): the
    sandbox's init or a worker it started (``own``), however they ended; any other process killed, failed or
    whose status is unknown. A descendant that exited 0 is the job's own churn (a DataLoader's workers at an
    epoch's end, a compiler's): the image holds the tree as it is at the dump."""
    bad = {p: st for p, st in watch.ended().items() if p in own or st != 0}
    return ", ".join(f"process {p} {'(a worker) ' if p in own and p != init_pid else ''}"
                     f"{proctree.describe_status(st)}" for p, st in sorted(bad.items()))


def settle_verdict(now: float, recent: list[procwatch.Exit], init_alive: bool) -> tuple[str, float]:
    """The rule of ``SETTLE_S`` as a decision, from the job's failed exits of the last ``SETTLE_S`` seconds (killed
    by a signal, exited non-zero, or unknown): ("ended", now) when the job is ending (its init gone, or its init
    or a worker among them), ("wait", until) while the newest is younger than ``SETTLE_S``, else ("go", now)."""
    if not init_alive or any(e.own for e in recent):
        return "ended", now
    newest = max((e.at for e in recent), default=None)
    if newest is not None and now < newest + SETTLE_S:
        return "wait", newest + SETTLE_S
    return "go", now


def _exits_words(exits: list[procwatch.Exit], now: float) -> str:
    """The exits as words, the newest few ("process 19 killed by signal 9 0.4 s ago, ...")."""
    shown = [e.describe(now) for e in exits[-4:]]
    more = len(exits) - len(shown)
    return ", ".join(shown) + (f" (and {more} more)" if more > 0 else "") if exits else "the sandbox's init ended"


class JobEnding(CaptureFailed):
    """The job's processes ended in a way no image can hold (``NodeCapture.failed_processes``)."""


def _as_failure(e: BaseException, what: str) -> CryosleepError:
    """The error to report once the rollback has run (it resumes the job)."""
    if isinstance(e, InterceptorError):
        return CaptureFailed(e.what, e.why, "the job was resumed and goes on running; " + e.hint, **e.details)
    if isinstance(e, CryosleepError):
        return e
    return CaptureFailed(f"{what}: {type(e).__name__}: {e}", "the job was resumed and goes on running",
                         "see the agent's log")


def _rewrite_manifest(store: LocalStore, manifest: Manifest) -> None:
    """Record the final phase times (the manifest's checksummed files are unchanged; it is signed anew)."""
    store.rewrite(manifest)
