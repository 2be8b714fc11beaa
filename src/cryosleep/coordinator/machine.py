"""The snapshot state machine of a job: one list of phases, one deadline, one rollback, for one node and many.

``SnapshotSequence`` is the sequence; how its commands reach the nodes is its subclass's: ``SnapshotRun`` (the
coordinator's, through the hub to node agents polling over HTTP) or ``embedded.EmbeddedRun`` (a one-node job's
agent, calling its node's operations in-process). Each node's side is ``agent/coordinated.py``, whose
operations are the capture steps of ``capture/snapshot.py``.

::

    prepare    every agent checks eligibility (nothing touched) ............................. refused: failed
               then, the job running, pre-copies its memory where it can (capture/precopy.py: a short freeze;
               ``precopy: false`` in the command, ``snapshot --no-precopy``, dumps plain)
    drain      HOLD on every rank of every node, then rounds: each node's summary of its ranks' counters
               (cut.summary) -> combined, cut.summary.decide_nodes over the whole job -> per-communicator
               targets to every node -> fresh summaries, until every member of every communicator issued the
               same calls (DONE) or the deadline (GIVE_UP)
    quiesce    (at_cut recorded first) every rank destroys its real NCCL communicators
    capture    every node: CUDA checkpoint + CRIU dump, staged locally (stop: leave stopped; keep-running: leave
               running, each node's job network held from before its own dump until every node's dump is
               done: its capture command holds it first, and the resume command releases it)
    keep-running:
      resume   (the job network released first) REBUILD(g) on every node -> ids published by each
               communicator's rank-0 member relayed to the other members wherever they run -> every rank
               RUNNING(g) -> RUN: the pause ends (a failed rebuild is retried ``rebuild_retries`` times: every
               node quiesces its rebuilt ranks again, then all rebuild; 0 for the coordinator, 1 for the
               embedded run)
      persist  every node commits and verifies its image -> the snapshot is verified (valid)
    stop:
      persist  every node commits and verifies its image
               == point of no return: verified + ponr written in one transaction ==
      stop     every node ends its workers; the job is suspended in this snapshot

Rollback (any failure, timeout, lost or restarted agent before the point of no return): every node gets
``abort`` (release CRIU's hold and the network hold, CUDA restore and unlock, drop the staged image; NCCL
ranks RUN if the cut was not reached, otherwise every local rank quiesced), then, if the cut was reached,
the resume sequence on every node. It has its own time (``rollback_s``), since the snapshot's may be spent.
After the point of no return nothing is rolled back: a node that fails to stop is recorded, and the snapshot
stays valid.

A rehearsal (``rehearsal``, one node only) is the sequence without capture and persist: drain, quiesce, resume.

Rounds, and why there are no fewer. Each phase's rounds are barriers (every node answers before any gets the
next command); a step is folded into the next round's command only where that barrier guards nothing:

* The network hold rides on the capture command, its release on the resume command (agents whose prepare
  answer says ``protocol.NET_IN_CAPTURE``, all of them; else separate net_hold and net_release rounds around
  the dumps, as agents of before need). What the hold must give: no frame crosses between a node already
  dumped and any other node until every node is dumped (else one image acknowledges bytes the other never
  sent). Each node holds before its own dump and stays held until the resume command, which no node gets
  before every node's capture answered: so it is. Two nodes not yet dumped may still exchange frames, as both
  images then hold them; a frame to a held node is dropped and stays unacknowledged in its sender's image.
* The hold is not folded into quiesce: QUIESCE flushes the collectives already issued (ncclCommFinalize), and
  their bytes between nodes may still be under way when one node's quiesce is over; a node holding its network
  then would stall another's flush until the deadline. Only the quiesce barrier (every node flushed) makes the
  hold safe.
* Prepare is alone: it touches nothing, so that a refusal leaves the job as it was. Its last step, once the node
  is found eligible, is the pre-copy (the pre-dump leaves the job running as it was; a refusal elsewhere drops it
  with the staging): it needs no round of its own, and the nodes pre-dump at once.
* Relay and run stay two rounds: RUN opens the gates, after which a rank runs past the cut; it must wait until
  every rank of every node is RUNNING(g) (relay's answer), or a rebuild failing on one node could no longer
  be undone on the others by quiescing again. Resume and relay cannot merge either: the ids a node needs are
  published by rank-0 members on other nodes, known only from every node's resume answer. The relay could be
  skipped where no communicator spans nodes, but a job of many nodes has one that does (its world's) unless it
  has no NCCL at all, or only communicators within nodes; not done.
* Run is not folded into persist (keep-running): the rollback must know whether every node's gates opened (an
  abort at the cut, or after it). Only a failed run round leaves that open now, a step of milliseconds; folded,
  so would any failure of the persist, which takes seconds (commit, verify), and a node lost while verifying.
  Stop is not folded into persist: the point of no return (every node's image verified, written to the
  catalog) comes between them.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from cryosleep.coordinator.catalog import Catalog
from cryosleep.coordinator.group import summaries
from cryosleep.coordinator.hub import Hub
from cryosleep.coordinator.metrics import CoordinatorMetrics
from cryosleep.coordinator.protocol import (
    GEN_STRIDE,
    NET_IN_CAPTURE,
    AbortArgs,
    AbortData,
    CaptureArgs,
    DrainData,
    EndArgs,
    GenArgs,
    HoldArgs,
    ImageRef,
    Mode,
    NoArgs,
    Op,
    PersistArgs,
    PersistData,
    PrepareArgs,
    PrepareData,
    RelayArgs,
    ReportArgs,
    ResumeArgs,
    ResumeData,
    TargetsArgs,
    targets_for,
    targets_to_json,
)
from cryosleep.cut.summary import NodeSummary, combine
from cryosleep.cut.summary import drain as drain_cut
from cryosleep.cut.views import Action, Decision, Targets
from cryosleep.errors import CaptureFailed, CryosleepError, ProtocolError
from cryosleep.timing import Phases

HOLD_GRACE_S = 5.0  # the interceptors release a HOLD this long after the snapshot's deadline

# The phase each operation's time is counted in, per node.
PHASE_OF = {Op.PREPARE: "prepare", Op.HOLD: "drain", Op.REPORT: "drain", Op.TARGETS: "drain",
            Op.QUIESCE: "quiesce", Op.NET_HOLD: "capture", Op.CAPTURE: "capture", Op.NET_RELEASE: "capture",
            Op.RESUME: "resume", Op.RELAY: "resume", Op.RUN: "resume", Op.PERSIST: "persist", Op.STOP: "stop",
            Op.ABORT: "rollback", Op.END: "rollback", Op.NET_PEERS: "move", Op.FINISH: "resume"}


@dataclass
class MachineConfig:
    lost_after_s: float = 15.0
    """An agent with no poll open and none for this long is lost (its node fails the snapshot)."""
    rollback_s: float = 120.0
    """The rollback's own bound (and the stop phase's), counted from when it starts."""
    report_wait_s: float = 0.02
    """How long an agent waits for its ranks to move before reporting counters in a round with no new targets."""
    rebuild_retries: int = 0
    """How often a failed rebuild is retried (every node quiesces its rebuilt ranks again, then all rebuild)
    before the snapshot fails and is rolled back. The coordinator's 0: its rollback rebuilds at once, and the
    snapshot is reported failed; the embedded run's 1: a one-node snapshot goes through a transient failure."""


def new_snapshot_id(job: str) -> str:
    return f"{job}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(2)}"


@dataclass
class NodeFailure:
    node: int
    why: str
    error: CryosleepError | None = None  # the node's own error, where it ran in this process (embedded.py)


D = TypeVar("D")
# a command's args: one for every node, or each node's own (node rank -> its args)
Args = Mapping[str, Any] | Callable[[int], Mapping[str, Any]]


@dataclass
class Outcome(Generic[D]):
    """The answers of one round: each node's data (its op's ``protocol.PAYLOADS`` type, which the caller names:
    ``out: Outcome[PrepareData] = self.gather(Op.PREPARE, ...)``), and the nodes that failed."""

    ok: dict[int, D] = field(default_factory=dict)
    failed: list[NodeFailure] = field(default_factory=list)


def _error_text(err: Mapping[str, Any] | None) -> str:
    if not err:
        return "failed (no reason given)"
    what = str(err.get("what", "failed"))
    why = str(err.get("why", ""))
    return f"{what}: {why}" if why else what


class Journal(Protocol):
    """Where a run records its progress: the catalog (``catalog.Catalog``) for a coordinator's runs, a memory
    for the embedded one (``embedded.py``)."""

    def update_snapshot(self, sid: str, *, state: str | None = None, reason: str | None = None,
                        phases: dict[str, float] | None = None, error: dict[str, Any] | None = None,
                        at_cut: bool | None = None, finished: bool = False) -> None: ...
    def update_node(self, sid: str, node_rank: int, *, state: str | None = None,
                    phases: dict[str, float] | None = None, image: dict[str, Any] | None = None) -> None: ...
    def mark_verified(self, sid: str, job: str, *, ponr: bool, phases: dict[str, float]) -> None: ...
    def set_job_state(self, name: str, state: str, last_snapshot: str | None = None) -> None: ...
    def event(self, kind: str, message: str, *, job: str | None = None, snapshot: str | None = None,
              node_rank: int | None = None) -> None: ...
    def snapshot(self, sid: str) -> dict[str, Any]: ...


class SnapshotSequence:
    """One snapshot of one job across its nodes (node rank -> agent id): the phase list and its one rollback.
    ``run()`` executes it to the end. How a command reaches the nodes is the subclass's: ``SnapshotRun``
    through the hub (agents polling over HTTP), ``embedded.EmbeddedRun`` by calling the local node's
    operations in-process."""

    holds_network = True  # keep-running: the job network held across the dumps (only nodes of many need it)
    rehearsal = False  # drain, quiesce and rebuild only: nothing captured (the embedded run's rehearse)
    verify_kept = True  # keep-running: every node re-reads its image (a coordinator lists it valid only then)
    precopy = True  # each node pre-copies its memory at prepare where it can (False: ``--no-precopy``)

    def __init__(self, catalog: Journal, *, sid: str, job: str, mode: Mode, timeout_s: float,
                 nodes: Mapping[int, str], cfg: MachineConfig | None = None,
                 log: Callable[[str], None] | None = None, metrics: CoordinatorMetrics | None = None) -> None:
        self.catalog = catalog
        self.metrics = metrics
        self.sid = sid
        self.job = job
        self.mode = mode
        self.timeout_s = timeout_s
        self.nodes = dict(sorted(nodes.items()))
        self.cfg = cfg or MachineConfig()
        self.log = log or (lambda _m: None)
        self.deadline = time.monotonic() + timeout_s
        self.phases = Phases(metrics.phase_progress() if metrics else None)
        self.node_phases: dict[int, dict[str, float]] = {n: {} for n in self.nodes}
        self.step = 0
        self.gen = 0
        self.at_cut = False
        self.resumed = False
        self.rounds = 0
        self.cut: Decision | None = None
        self.images: dict[int, ImageRef] = {}
        self.cancelled = False
        self.rolling_back = False
        self.error: CryosleepError | None = None  # why the run failed (it was rolled back)
        self.holds_net = True  # some node has a job network to hold while dumping (its prepare answer says)
        self.net_in_capture = False  # every node holds it in capture, releases it in resume (NET_IN_CAPTURE)
        self.release_net = False  # the capture held the network: the resume releases it
        self.node_ranks: dict[int, list[int]] = {}  # the job ranks of each node (its prepare answer)
        self.finished = threading.Event()  # set once the run is over and no longer the job's active one

    # ---- talking to every node ------------------------------------------------------------------------------

    def next_gen(self) -> int:
        self.gen += GEN_STRIDE
        return self.gen

    def gather(self, op: Op, args: Args, deadline: float, *,
               tolerant: bool = False, nodes: list[int] | None = None) -> Outcome[Any]:
        """Sends ``op`` to every node and waits for every answer. Not tolerant: the first failure, a lost or
        restarted agent, or the deadline raises (the rest is cancelled). Tolerant: waits for every node that
        can still answer and returns the failures."""
        raise NotImplementedError

    def lost(self, node: int) -> bool:
        """The node's agent is gone (rather than failing the command)."""
        raise NotImplementedError

    def still_the_job(self) -> bool:
        """Some node still runs the incarnation of the job this snapshot was taken of (none restored since)."""
        raise NotImplementedError

    def forget(self) -> None:
        """The run is over: what its transport kept for it goes."""

    def _state(self, state: str, **kw: Any) -> None:
        self.catalog.update_snapshot(self.sid, state=state, phases=self.phases.rounded(), **kw)
        self.catalog.event("phase", state, job=self.job, snapshot=self.sid)
        self.log(f"snapshot {self.sid}: {state}")

    def _save_nodes(self) -> None:
        for n, ph in self.node_phases.items():
            image = self.images.get(n)
            self.catalog.update_node(self.sid, n, phases=ph, image=image.to_json() if image is not None else None)

    def _save_states(self, states: dict[int, str]) -> None:
        for n, st in states.items():
            self.catalog.update_node(self.sid, n, state=st)

    # ---- the phases ----------------------------------------------------------------------------------------

    def prepare(self) -> None:
        args = PrepareArgs(mode=str(self.mode))
        if self.rehearsal:
            args["rehearsal"] = True
        if not self.precopy:
            args["precopy"] = False
        out: Outcome[PrepareData] = self.gather(Op.PREPARE, args, self.deadline)
        self.gen = max([int(d["gen"]) for d in out.ok.values()] + [0])
        self.node_ranks = {n: [int(r) for r in d.get("ranks") or ()] for n, d in out.ok.items()}
        self.holds_net = any(bool(d.get("net", True)) for d in out.ok.values())  # an older agent: assume it has
        # only if every node can: an agent of before would ignore hold_net, and dump with its network up
        self.net_in_capture = all(NET_IN_CAPTURE in (d.get("can") or ()) for d in out.ok.values())

    def drain(self) -> Decision:
        gen = self.next_gen()
        hold_s = max(0.0, self.deadline - time.monotonic()) + HOLD_GRACE_S
        out: Outcome[DrainData] = self.gather(Op.HOLD, HoldArgs(gen=gen, hold_s=hold_s, summary=True),
                                              self.deadline)
        sums = summaries(out.ok, self.node_ranks)

        def ask(round_: int, targets: Targets | None) -> NodeSummary:
            """One round on every node: its share of the targets written, or a short wait; their summaries (a
            relay's group's merged in one: its nodes get one targets argument, sent once to the relay)."""
            self.rounds = round_
            if targets is not None:
                share: dict[int, TargetsArgs] = {}
                for n in self.nodes:
                    if id(sums[n]) not in share:
                        share[id(sums[n])] = TargetsArgs(round=round_, summary=True, targets=targets_to_json(
                            targets_for(targets, set(sums[n].comms))))
                per_node = {n: share[id(sums[n])] for n in self.nodes}
                got: Outcome[DrainData] = self.gather(Op.TARGETS, per_node.__getitem__, self.deadline)
            else:
                got = self.gather(Op.REPORT, ReportArgs(round=round_, wait_s=self.cfg.report_wait_s, summary=True),
                                  self.deadline)
            sums.update(summaries(got.ok, self.node_ranks))
            return combine({id(s): s for s in (sums[n] for n in self.nodes)}.values())

        d, _ = drain_cut(combine({id(s): s for s in (sums[n] for n in self.nodes)}.values()), ask, self.deadline,
                         time.monotonic)
        self.cut = d
        if d.action is Action.GIVE_UP:
            raise CaptureFailed(f"the ranks of job {self.job!r} did not reach a consistent NCCL cut", d.reason,
                                "every node was resumed; snapshot again later, or with a longer --timeout",
                                ranks=list(d.unsettled))
        self.catalog.event("cut", f"{d.reason}, after {self.rounds} round(s)", job=self.job, snapshot=self.sid)
        return d

    def quiesce(self) -> None:
        self.at_cut = True
        self.catalog.update_snapshot(self.sid, at_cut=True)  # durable before any rank destroys a communicator
        self.gather(Op.QUIESCE, GenArgs(gen=self.next_gen()), self.deadline)

    def capture(self) -> None:
        """Keep-running: each node's job network is held from before its dump until every node's dump is done,
        so that no byte crosses between a node already dumped (and running on) and another (docs/network.md):
        by the capture command itself, released by the resume command (``NET_IN_CAPTURE``), else by rounds of
        their own before and after. A stop snapshot needs no hold: each node stays frozen after its dump."""
        keep = self.mode is Mode.KEEP_RUNNING and self.holds_network and self.holds_net
        args = CaptureArgs(mode=str(self.mode), gen=self.next_gen())
        if keep and self.net_in_capture:
            args["hold_net"] = self.release_net = True
        elif keep:
            self.log(f"snapshot {self.sid}: net_hold and net_release rounds (an agent without {NET_IN_CAPTURE})")
            self.gather(Op.NET_HOLD, NoArgs(), self.deadline)
        self.gather(Op.CAPTURE, args, self.deadline)
        if keep and not self.release_net:
            self.gather(Op.NET_RELEASE, NoArgs(), self.deadline)

    def rebuild_all(self, deadline: float, release_net: bool = False) -> None:
        """(the job network released first) REBUILD(g) everywhere, ids relayed across nodes, every rank
        RUNNING(g), then RUN."""
        gen = self.next_gen()
        args = ResumeArgs(gen=gen)
        if release_net:
            args["release_net"] = True
        out: Outcome[ResumeData] = self.gather(Op.RESUME, args, deadline)
        uids: dict[str, str] = {}
        for d in out.ok.values():
            uids.update({str(k): str(v) for k, v in d["uids"].items()})
        need = {n: [str(i) for i in d["need"]] for n, d in out.ok.items()}
        missing = sorted({i for n in need for i in need[n] if i not in uids})
        if missing:
            raise CaptureFailed("the NCCL communicators could not be rebuilt across nodes",
                                "no node published a fresh id for communicator(s) " + ", ".join(missing),
                                "the member of rank 0 of each communicator must be on a node of this job")
        share: dict[int, RelayArgs] = {}  # a relay's group answered with one need list: one argument for it
        for n in need:
            if id(out.ok[n]["need"]) not in share:
                share[id(out.ok[n]["need"])] = RelayArgs(gen=gen, uids={i: uids[i] for i in need[n]})
        args_of = {n: share[id(out.ok[n]["need"])] for n in need}
        self.gather(Op.RELAY, args_of.__getitem__, deadline)
        self.gather(Op.RUN, GenArgs(gen=self.next_gen()), deadline)

    def resume(self) -> None:
        deadline = max(self.deadline, time.monotonic() + self.cfg.rollback_s)
        for attempt in range(self.cfg.rebuild_retries + 1):
            try:
                self.rebuild_all(deadline, self.release_net)  # on a retry too: a release is idempotent
                break
            except CaptureFailed as e:  # every node quiesces its rebuilt ranks again at the next resume
                if attempt == self.cfg.rebuild_retries:
                    raise
                self.log(f"rebuild failed ({e.why}); quiescing the rebuilt ranks and retrying")
        self.resumed = True
        self.at_cut = False
        self.catalog.update_snapshot(self.sid, at_cut=False)  # nothing quiesced left to rebuild after a restart

    def persist(self) -> None:
        verify = self.mode is Mode.STOP or self.verify_kept
        out: Outcome[PersistData] = self.gather(
            Op.PERSIST, PersistArgs(mode=str(self.mode), timeout_s=self.timeout_s, verify=verify), self.deadline)
        for n, d in out.ok.items():
            try:
                self.images[n] = ImageRef.from_json(d.get("image"))
            except ProtocolError as e:
                raise CaptureFailed(f"node {n} persisted no image", f"its answer's image: {e.why}",
                                    "the node agent is out of date?", node=n) from e

    def stop(self) -> list[str]:
        out = self.gather(Op.STOP, NoArgs(), time.monotonic() + self.cfg.rollback_s, tolerant=True)
        return [f"node {f.node}: {f.why}" for f in out.failed]

    # ---- the sequence --------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        stop = self.mode is Mode.STOP
        ponr = False
        try:
            self._state("preparing")
            with self.phases.phase("prepare"):
                self.prepare()
            self._state("draining")
            with self.phases.phase("drain"):
                self.drain()
            self._state("quiescing")
            with self.phases.phase("quiesce"):
                self.quiesce()
            if not self.rehearsal:
                self._state("capturing")
                with self.phases.phase("capture"):
                    self.capture()
            if not stop:
                self._state("resuming")
                with self.phases.phase("resume"):
                    self.resume()
            if self.rehearsal:
                self._state("rehearsed")
                return self.catalog.snapshot(self.sid)
            self._state("persisting")
            with self.phases.phase("persist"):
                self.persist()
            self._save_nodes()
            self.catalog.mark_verified(self.sid, self.job, ponr=stop, phases=self.phases.rounded())
            ponr = stop
            self.catalog.event("verified", f"every node's image persisted and verified ({len(self.nodes)} nodes)",
                               job=self.job, snapshot=self.sid)
            if stop:
                self.log(f"snapshot {self.sid}: point of no return")
                with self.phases.phase("stop"):
                    problems = self.stop()
                for p in problems:
                    self.catalog.event("stop-failed", p, job=self.job, snapshot=self.sid)
                self.catalog.set_job_state(self.job, "suspended", self.sid)
                self.catalog.update_snapshot(self.sid, phases=self.phases.rounded(), finished=True,
                                             reason="; ".join(problems))
            self._save_nodes()
            self.catalog.update_snapshot(self.sid, phases=self.phases.rounded())
            return self.catalog.snapshot(self.sid)
        except Exception as e:
            if ponr:  # nothing to undo: the snapshot is verified and the nodes were told to stop
                self.catalog.event("error", f"after the point of no return: {e}", job=self.job, snapshot=self.sid)
                return self.catalog.snapshot(self.sid)
            err = e if isinstance(e, CryosleepError) else CaptureFailed(
                f"the snapshot of job {self.job!r} failed", f"{type(e).__name__}: {e}", "see the coordinator's log")
            self.error = err
            self.rollback(err)
            return self.catalog.snapshot(self.sid)
        finally:
            self.forget()

    def rollback(self, err: CryosleepError) -> None:
        """The one way back: every node aborts; if the cut was reached, every node rebuilds and runs again."""
        self.rolling_back = True
        self.catalog.event("error", str(err.what) + (f": {err.why}" if err.why else ""), job=self.job,
                           snapshot=self.sid)
        self._state("rolling-back", reason=err.what)
        deadline = time.monotonic() + self.cfg.rollback_s
        problems: list[str] = []
        states = dict.fromkeys(self.nodes, "resumed")
        with self.phases.phase("rollback"):
            at_cut = self.at_cut and not self.resumed
            out: Outcome[AbortData] = self.gather(Op.ABORT, AbortArgs(at_cut=at_cut, gen=self.next_gen()), deadline,
                                                  tolerant=True)
            exited = sorted(n for n, d in out.ok.items() if d["state"] == "exited")
            for n in exited:
                states[n] = "exited"
                problems.append(f"node {n}: its workers exited during the snapshot")
            for f in out.failed:
                lost = self.lost(f.node)
                states[f.node] = "lost" if lost else "not-resumed"
                if lost and not at_cut:  # its ranks were only held: their interceptors release the HOLD by themselves
                    self.catalog.event("rollback", f"node {f.node}: {f.why}; its ranks are released by the HOLD "
                                       "deadline", job=self.job, snapshot=self.sid, node_rank=f.node)
                else:
                    problems.append(f"node {f.node}: {f.why}")
            if at_cut:
                for attempt in range(2):
                    try:
                        self.rebuild_all(deadline)
                        break
                    except CaptureFailed as e:
                        if attempt == 1:
                            problems.append(f"{e.what}: {e.why}")
                            states = {n: "lost" if st == "lost" else "not-resumed" for n, st in states.items()}
                            break
                        again = self.gather(Op.ABORT, AbortArgs(at_cut=True, gen=self.next_gen()), deadline,
                                            tolerant=True)
                        problems += [f"node {f.node}: {f.why}" for f in again.failed]
        ended = False
        if problems and (at_cut or exited):
            # past the cut, a node that cannot be brought back leaves the others unable to go on (their peers
            # are gone, or quiesced for good), and so does a node whose workers exited, at any phase (the others
            # would wait on them until their own timeouts): every node still answering ends its workers, so that
            # no part of the job is left half-dead; a lost agent's own watchdog has ended its node
            # (agent/watchdog.py)
            reason = (f"the workers of node(s) {', '.join(map(str, exited))} exited during snapshot {self.sid}"
                      if exited else f"snapshot {self.sid} could not be rolled back on every node")
            out = self.gather(Op.END, EndArgs(reason=reason), time.monotonic() + self.cfg.rollback_s, tolerant=True)
            ended = True
            for n in out.ok:
                states[n] = "ended"
            problems += [f"node {f.node}: {f.why}" for f in out.failed]
        if problems:
            err.details["rollback_problems"] = problems
            err.hint = ("some nodes could not be resumed" + (", so the job was ended on every node" if ended else "")
                        + ": restore its last verified snapshot (`cryosleep coordinator snapshots JOB --valid`)")
            for p in problems:
                self.catalog.event("rollback-failed", p, job=self.job, snapshot=self.sid)
            if ended:
                self.catalog.event("ended", "the job was ended on every node still answering", job=self.job,
                                   snapshot=self.sid)
        self._save_nodes()
        self._save_states(states)
        self.catalog.update_snapshot(self.sid, state="failed", reason=err.what, error=err.to_json(),
                                     phases=self.phases.rounded(), finished=True)
        if self.still_the_job():
            self.catalog.set_job_state(self.job, "damaged" if problems else "running")
        # else every node runs another incarnation now (restored since): the job's state is theirs, not this one's
        self.log(f"snapshot {self.sid}: failed ({err.what})")


class SnapshotRun(SnapshotSequence):
    """The coordinator's run of a snapshot: commands go to the node agents through the hub (their polls), each
    agent's incarnation checked at every step."""

    def __init__(self, catalog: Catalog, hub: Hub, *, sid: str, job: str, mode: Mode, timeout_s: float,
                 nodes: Mapping[int, str], incarnations: Mapping[str, str], cfg: MachineConfig | None = None,
                 log: Callable[[str], None] | None = None, metrics: CoordinatorMetrics | None = None) -> None:
        super().__init__(catalog, sid=sid, job=job, mode=mode, timeout_s=timeout_s, nodes=nodes, cfg=cfg, log=log,
                         metrics=metrics)
        self.catalog: Catalog = catalog
        self.hub = hub
        self.incarnations = dict(incarnations)

    def _save_nodes(self) -> None:  # one transaction for every node
        self.catalog.update_nodes(self.sid, {n: (ph, i.to_json() if (i := self.images.get(n)) is not None else None)
                                             for n, ph in self.node_phases.items()})

    def _save_states(self, states: dict[int, str]) -> None:
        self.catalog.update_node_states(self.sid, states)

    def gather(self, op: Op, args: Args, deadline: float, *,
               tolerant: bool = False, nodes: list[int] | None = None) -> Outcome[Any]:
        """Sends ``op`` to every node and waits for every answer. Not tolerant: the first failure, a lost or
        restarted agent, or the deadline raises CaptureFailed (the rest is cancelled). Tolerant: waits for
        every node that can still answer and returns the failures."""
        self.step += 1
        started = time.monotonic()
        cid = f"{self.sid}.{self.step}.{op}"
        todo = list(self.nodes) if nodes is None else list(nodes)
        out: Outcome[Any] = Outcome()
        registered = self.hub.health([self.nodes[n] for n in todo], self.cfg.lost_after_s)  # one lock for all
        for n in list(todo):
            inc = registered[self.nodes[n]][0]
            if inc is None:  # not registered with this coordinator (a restarted one): nothing to send it to
                todo.remove(n)
                out.failed.append(NodeFailure(n, f"{op}: its agent has not registered with this coordinator"))
                continue
            if inc != self.incarnations[self.nodes[n]]:
                # another incarnation registered since (the agent restarted, or the node was restored): it was
                # never in this snapshot, and nothing of it may be aborted or ended on that one's behalf
                todo.remove(n)
                out.failed.append(NodeFailure(n, f"{op}: its agent restarted (registered again), losing the "
                                              "snapshot's state"))
                continue
        # one lock acquisition for the round's commands, one wake-up when its answers are in (hub.send_round)
        self.hub.send_round(cid, self.sid, self.job, op,
                            {self.nodes[n]: args(n) if callable(args) else args for n in todo}, deadline)
        pending = set(todo)
        node_of = {self.nodes[n]: n for n in todo}
        phase = PHASE_OF[op]
        checked = 0.0
        seen = 0
        while pending:
            # only the results that arrived since the last wake-up, and liveness at most every 50 ms: with 2,048
            # nodes, checking every node at every result would be quadratic and starve the HTTP threads
            got = self.hub.arrived(cid, seen)
            seen += len(got)
            for n, r in sorted((node_of[a], r) for a, r in got if a in node_of):
                if n not in pending:
                    continue
                pending.discard(n)
                np = self.node_phases[n]
                np[phase] = round(np.get(phase, 0.0) + r.seconds, 6)
                if r.ok:
                    out.ok[n] = r.data
                else:
                    out.failed.append(NodeFailure(n, f"{op}: {_error_text(r.error)}"))
            now = time.monotonic()
            if pending and now - checked >= 0.05:
                checked = now
                health = self.hub.health([self.nodes[n] for n in pending], self.cfg.lost_after_s)
                for n in sorted(pending):
                    agent = self.nodes[n]
                    inc, alive, age = health[agent]
                    why: str | None = None
                    if inc != self.incarnations[agent]:
                        why = "its agent restarted (registered again), losing the snapshot's state"
                    elif not alive:
                        went = self.hub.left(agent)  # it said so as it went (its job ended on its node)
                        why = f"its agent left: {went}" if went else \
                            f"its agent was lost (no poll for {age or 0:.1f} s)"
                    elif self.cancelled and not self.rolling_back:  # the rollback itself still runs
                        why = "the coordinator is shutting down"
                    if why is not None:
                        pending.discard(n)
                        out.failed.append(NodeFailure(n, f"{op}: {why}"))
            if out.failed and not tolerant:
                break
            if pending and time.monotonic() > deadline:
                out.failed.extend(NodeFailure(n, f"{op}: no answer before the deadline") for n in sorted(pending))
                break
            if pending:
                self.hub.wait_arrivals(cid, seen, deadline)
        self.hub.end_round(cid, [self.nodes[n] for n in pending])
        if self.metrics is not None:
            self.metrics.round_seconds.labels(str(op)).observe(time.monotonic() - started)
        if out.failed and not tolerant:
            first = out.failed[0]
            raise CaptureFailed(f"node {first.node} of job {self.job!r} failed the snapshot at {op}",
                                "; ".join(f"node {f.node}: {f.why}" for f in out.failed),
                                f"every node was told to abort and resume; see `cryosleep coordinator show {self.sid}` "
                                "for the events, and the node agents' logs",
                                node=first.node, op=str(op), snapshot=self.sid)
        return out

    def lost(self, node: int) -> bool:
        return not self.hub.alive(self.nodes[node], self.cfg.lost_after_s)

    def still_the_job(self) -> bool:
        return any(self.hub.incarnation(a) in (None, self.incarnations[a]) for a in self.nodes.values())

    def forget(self) -> None:
        self.hub.forget(self.sid)


class RecoveryRun(SnapshotRun):
    """After a coordinator restart: a snapshot the previous coordinator left unfinished. Before the point of no
    return it is marked aborted and every node is told to abort (and rebuild, if the cut had been reached) once
    its agent polls again; past it, the nodes are told to stop again."""

    def __init__(self, *args: Any, snapshot: Mapping[str, Any], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.row = dict(snapshot)
        self.at_cut = bool(self.row.get("at_cut"))
        self.gen = 1 << 20  # above anything the previous coordinator handed out for this snapshot

    def recover(self) -> None:
        # the agents come back by polling (retrying at least every 5 s): wait for them, bounded; one that does not
        # come is gone (a stop snapshot's nodes may have ended already) and counts as lost
        deadline = time.monotonic() + min(self.cfg.rollback_s, self.cfg.lost_after_s + 10.0)
        while time.monotonic() < deadline and not all(self.hub.line(a) for a in self.nodes.values()):
            time.sleep(0.1)
        # the incarnations that took part (a catalog of schema 1 did not record them: whichever registered)
        self.incarnations = {a: self.incarnations.get(a) or self.hub.incarnation(a) or "" for a in self.nodes.values()}
        try:
            if self.row.get("ponr_at"):
                problems = self.stop()
                for p in problems:
                    self.catalog.event("stop-failed", p, job=self.job, snapshot=self.sid)
                self.catalog.set_job_state(self.job, "suspended", self.sid)
                self.catalog.update_snapshot(self.sid, finished=True, reason="; ".join(problems))
                return
            err = CaptureFailed("the coordinator restarted during the snapshot",
                                f"it was {self.row.get('state')} when the previous coordinator stopped",
                                "the job was resumed; snapshot again")
            self.rollback(err)  # ends with finished_at set: the recovery is done
            self.catalog.update_snapshot(self.sid, state="aborted")
        finally:
            self.hub.forget(self.sid)
