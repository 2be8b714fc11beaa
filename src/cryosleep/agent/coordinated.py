"""The node agent's part in a snapshot (``coordinator.client.NodeBackend``): the operations the snapshot sequence
(``coordinator/machine.py``) calls on this node, for a job of many nodes through the coordinator, and for a
one-node job in-process (``coordinator/embedded.py``, the agent's embedded coordinator).

A job started with ``cryosleep run --nnodes N --node-rank I --coordinator URL`` registers its agent with the
coordinator, which then runs every snapshot of the job on all its nodes at once (docs/coordinator.md). Each
operation is one step of ``capture.snapshot.NodeCapture``, except the drain's decisions, which the sequence
takes over every rank of every node, and the rebuild's id relay, which crosses nodes through it::

    prepare      preflight (refuse with reasons, nothing touched), outbound drain, fast-path staging, pre-copy
    hold         HOLD(gen) on the local ranks                             -> their counters, summed up
    report       (the ranks move on their own)                            -> their counters, summed up
    targets      the targets the coordinator decided, written; answers awaited -> their counters, summed up
    quiesce      QUIESCE(gen); the fast path's device memory out
    net_hold     (keep-running) the sandbox's port on the job network disabled
    capture      ([hold_net] the port disabled first) CUDA checkpoint + CRIU dump (keep-running: CUDA back)
    net_release  (keep-running) the port enabled again
    resume       ([release_net] the port enabled first; ranks rebuilt by a failed REBUILD quiesced again)
                 REBUILD(gen); the ids published here by rank-0 members -> the coordinator
    relay        the ids from other nodes written; every local rank RUNNING(gen)
    run          RUN: the gates open
    persist      the image committed to the local store and verified (stop: and to the remote store)
    stop         the held workers ended: the job lives on in the snapshot
    abort        the node's one undo (NodeCapture.undo_capture, then capture.snapshot.undo_nccl): NCCL ranks
                 running again (or, past the cut, every local rank quiesced at the cut, for the sequence's resume)
    end          (a rollback that could not bring every node back) the workers ended, none left half-dead

One operation runs at a time. ``abort`` may arrive while an earlier command still runs (the coordinator gave
up on it): it waits that command out (a CRIU dump ends by the snapshot's deadline), bounded by its own budget.
Commands of a snapshot that was aborted or finished here change nothing.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from cryosleep import paths
from cryosleep.agent.node import NodeAgent
from cryosleep.capture import snapshot as capture_snapshot
from cryosleep.coordinator import protocol as msg
from cryosleep.coordinator.client import AgentRunner, CoordinatorClient, Registration, host_name
from cryosleep.coordinator.protocol import (
    Command,
    ImageRef,
    ident_hex,
    local_deadline,
    net_board,
    targets_from_json,
)
from cryosleep.core.interceptor import Cmd
from cryosleep.cut.driver import HOLD_GRACE_S, Driver
from cryosleep.errors import Busy, CaptureFailed, CryosleepError, InterceptorError, NotEligible, NotFound, Unreachable
from cryosleep.net import sandbox as net_sandbox
from cryosleep.store import persist as store_persist
from cryosleep.store.local import LocalStore
from cryosleep.timing import Progress

STALL_FILE = "fault-stall"
TARGETS_WAIT_S = 1.0  # how long a targets round waits for the ranks to answer before reporting what it sees
READY_FRESH_S = 30.0  # a node's entry at a restore's barrier counts this long (a waiting node re-posts it)
READY_REPOST_S = 10.0
BOARD_RETRY_S = 0.5  # while no coordinator answers the board (a restart, a standby taking over)
BOARD_RETRY_FOR_S = 30.0  # how long a post that waits on nothing else is tried
FENCE_GRACE_S = 180.0  # past a snapshot's deadline by this much, a node still at its cut ends its workers
FENCE_QUIET_S = 30.0  # ... provided its coordinator has sent it nothing for this long
FENCE_ENV = "CRYOSLEEP_FENCE_GRACE_S"
NET_REPOST_S = 10.0  # a node of a multi-node run posts its underlay address this often (NetPeers)
NET_FRESH_S = 35.0  # ... and the other nodes count it as a peer while it is younger than this


def job_name(spec_name: str, nnodes: int, node_rank: int) -> str:
    """The job's name at the coordinator: the node's local name without its ``.node<I>`` suffix."""
    suffix = f".node{node_rank}"
    return spec_name[: -len(suffix)] if nnodes > 1 and spec_name.endswith(suffix) else spec_name


class CoordinatedNode:
    """One node agent's backend: the coordinator's operations on this node's part of the job."""

    def __init__(self, agent: NodeAgent, store: LocalStore | None = None,
                 log: Callable[[str], None] | None = None, *, progress: Progress | None = None,
                 send: Callable[[dict[str, Any]], None] | None = None, fault: str | None = None) -> None:
        self.agent = agent
        self.store = store or LocalStore(paths.default_store())
        self.log = log or (lambda _m: None)
        self.progress = progress  # the node's phases as they go (a one-node snapshot's CLI shows them)
        self.send = send or (lambda _m: None)  # the requester's events (a stop snapshot's upload progress)
        self.fault = fault  # fault injection in CRIU's dump hook (tests)
        self.last: capture_snapshot.NodeCapture | None = None  # the snapshot that ended here last
        self.upload: dict[str, Any] | None = None  # its upload's record (store.persist.after_snapshot)
        self.op_lock = threading.Lock()
        self.sid: str | None = None  # the snapshot this node is in
        self.cap: capture_snapshot.NodeCapture | None = None
        self.nccl: Driver | None = None
        self.net_held = False
        self.done: dict[str, str] = {}  # snapshot -> how it ended here ("verified", "aborted", "stopped")
        self.images: dict[str, str] = {}  # snapshot -> this node's image in the local store
        self.after_abort_at_cut = False
        self.holds_lock = False  # the agent's snapshot lock is this backend's (from prepare to the end here)
        self.at_cut = False  # this node's ranks were quiesced (or captured) in the snapshot in progress
        self.fence_grace = float(os.environ.get(FENCE_ENV) or FENCE_GRACE_S)
        self.last_command = time.monotonic()

    # ---- plumbing ----------------------------------------------------------------------------------------

    def _serial(self, fn: Callable[[Command, msg.ArgsT], msg.DataT], cmd: Command) -> msg.DataT:
        lock = self.op_lock
        if cmd.op == "abort":
            budget = max(1.0, cmd.budget_s)
            if not lock.acquire(timeout=budget):
                raise CaptureFailed(f"node {self.agent.spec.node_rank} could not abort snapshot {cmd.snapshot}",
                                    f"an earlier step was still running after {budget:.0f} s",
                                    "see the node agent's log; end the job and restore its last verified snapshot")
        else:
            lock.acquire()
        try:
            self.last_command = time.monotonic()
            self._stall(cmd)
            return fn(cmd, cast(msg.ArgsT, cmd.args))  # the op's args as its handler reads them (types only)
        except Exception as e:
            cap = self.cap
            err = cap.explain(e) if cap is not None else e
            if err is e:
                raise
            raise err from e
        finally:
            self.last_command = time.monotonic()
            lock.release()

    def watch(self) -> None:
        """After each of the runner's polls, answered or not: a node whose ranks are at the cut of a snapshot that
        nobody finished or rolled back by the snapshot's deadline plus the fence grace (its coordinator gone for
        good, cut off from this node, or restarted without its catalog), and that has been sent nothing for a
        while, ends its workers. Its ranks cannot run again on their own (the others are rebuilt together or
        not at all), and the coordinator ends the other nodes once it loses one past the cut: a node left
        quiesced would hold its GPUs forever. The job's last verified snapshot is untouched."""
        cap, now = self.cap, time.monotonic()
        if cap is None or not self.at_cut or now < cap.deadline + self.fence_grace \
                or now - self.last_command < min(FENCE_QUIET_S, self.fence_grace):
            return
        if not self.op_lock.acquire(blocking=False):
            return  # a command is running: the coordinator is there
        try:
            if self.cap is not cap:
                return
            self.agent.end_job(f"ended on its own: its ranks were at the cut of snapshot {self.sid}, which nobody "
                               f"finished or rolled back within {self.fence_grace:g} s of its deadline (the "
                               "coordinator unreachable, or restarted without its catalog); restore the job's last "
                               "verified snapshot on every node")
            self._end("fenced")
        finally:
            self.op_lock.release()

    def _stall(self, cmd: Command) -> None:
        """Fault injection (tests/jobs/test_reliability.py, docs/reliability.md): a file ``fault-stall`` in the job's
        directory reading "OP SECONDS" makes the agent wait that long before its next OP (once: the file is
        removed), after leaving ``stalled-OP`` there, so that a test can kill the coordinator, this agent or a
        rank at a known step of a snapshot. One stat per operation when there is none."""
        path = self.agent.job.path / STALL_FILE
        try:
            op, seconds = path.read_text().split()
        except (OSError, ValueError):
            return
        if op != str(cmd.op):
            return
        path.unlink(missing_ok=True)
        (self.agent.job.path / f"stalled-{op}").write_text(cmd.snapshot)
        time.sleep(float(seconds))

    def _current(self, cmd: Command) -> capture_snapshot.NodeCapture:
        if cmd.snapshot in self.done:
            raise CaptureFailed(f"snapshot {cmd.snapshot} already ended on this node ({self.done[cmd.snapshot]})",
                                f"{cmd.op} arrived after it ended", "a coordinator bug: see its log")
        if self.cap is None or self.sid != cmd.snapshot:
            raise NotFound(f"node {self.agent.spec.node_rank} is not in snapshot {cmd.snapshot}",
                           f"{cmd.op} arrived before prepare (or after the agent restarted)",
                           "the coordinator rolls the snapshot back")
        return self.cap

    def _driver(self, cmd: Command) -> Driver | None:
        """For resume, relay and run: the NCCL ranks here. They come in a snapshot's own resume, or in a
        rollback's after ``abort`` (which may have ended the snapshot here: then there is nothing to rebuild
        unless the ranks are quiesced, and a fresh driver over the published blocks finds out)."""
        if cmd.snapshot == self.sid:
            return self.nccl
        if self.done.get(cmd.snapshot) != "aborted" or self.sid is not None:
            self._current(cmd)  # raises, with why
        target = self.agent.capture_target(False, lambda _m: None, persist=False)
        nccl = capture_snapshot.nccl_driver(target)
        if nccl is not None and all(b.comms_live for b in nccl.blocks.values()):
            nccl.close()
            return None  # running: nothing to rebuild here
        self.sid, self.nccl, self.after_abort_at_cut = cmd.snapshot, nccl, True
        return nccl

    def _gen(self, nccl: Driver, cmd: Command) -> None:
        nccl.gen = int(cmd.args["gen"]) - 1  # the next command written is exactly ``gen``

    def _views(self, nccl: Driver | None, summary: bool) -> msg.DrainData:
        return msg.drain_answer(nccl.views() if nccl is not None else [], summary)

    def _end(self, how: str) -> None:
        """The snapshot is over on this node: its state dropped, local snapshots allowed again."""
        if self.sid is not None:
            self.done[self.sid] = how
            while len(self.done) > 64:
                del self.done[next(iter(self.done))]
        if self.cap is not None:
            self.cap.phases.end_all()
            self.cap.close()
            self.last = self.cap
        elif self.nccl is not None:
            self.nccl.close()
        self.cap = None
        self.nccl = None
        self.sid = None
        self.agent.arm(None)
        self.after_abort_at_cut = False
        self.at_cut = False
        self.agent.state.snapshot_in_progress = None
        self.agent.save_state()
        if self.holds_lock:
            self.holds_lock = False
            self.agent.snap_lock.release()

    def _abandon_stale(self) -> None:
        """A snapshot this node is still in, whose coordinator never came back to finish it (its catalog lost):
        once its deadline and the interceptors' HOLD grace have passed, nothing of it holds the job unless the
        cut was reached; it is rolled back here so that the job can be snapshotted again."""
        cap = self.cap
        if cap is None or self.at_cut or time.monotonic() < cap.deadline + HOLD_GRACE_S:
            raise Busy(f"node {self.agent.spec.node_rank} is still in snapshot {self.sid}",
                       "it was neither finished nor aborted" + (" and its ranks are at the cut" if self.at_cut else ""),
                       "the coordinator aborts it; try again" if not self.at_cut else
                       "end the job and restore its last verified snapshot")
        self.log(f"snapshot {self.sid} was abandoned by its coordinator: rolled back here")
        self._net(False)
        cap.undo_capture()
        capture_snapshot.undo_nccl(cap.nccl, False, time.monotonic() + HOLD_GRACE_S)
        self._end("abandoned")

    # ---- the operations ----------------------------------------------------------------------------------

    def prepare(self, cmd: Command) -> msg.PrepareData:
        return self._serial(self._prepare, cmd)

    def _prepare(self, cmd: Command, args: msg.PrepareArgs) -> msg.PrepareData:
        if self.sid is not None and self.sid != cmd.snapshot:
            self._abandon_stale()
        if self.sid == cmd.snapshot:
            raise CaptureFailed(f"prepare of {cmd.snapshot} arrived twice", "", "a coordinator bug: see its log")
        agent = self.agent
        if not agent.snap_lock.acquire(blocking=False):
            raise Busy(f"a snapshot of job {agent.spec.name!r} is already in progress on node "
                       f"{agent.spec.node_rank}", f"started as {agent.state.snapshot_in_progress or 'another'}",
                       "wait for it to finish, then try again")
        self.holds_lock = True
        stop, rehearsal = args["mode"] == "stop", bool(args.get("rehearsal"))
        self.sid = cmd.snapshot
        try:
            if agent.stopping or not agent.job_alive():
                raise NotFound(f"job {agent.spec.name!r} has already exited on node {agent.spec.node_rank}",
                               "there is nothing to capture", "restore one of its snapshots to run it again")
            agent.state.snapshot_in_progress = f"{'rehearsal' if rehearsal else args['mode']} ({cmd.snapshot})"
            agent.save_state()
            target = agent.capture_target(stop, self.send, persist=not rehearsal, store=self.store)
            self.cap = capture_snapshot.NodeCapture(target, self.store, stop=stop, deadline=local_deadline(cmd),
                                                    progress=self.progress, fault=self.fault, rehearsal=rehearsal,
                                                    precopy=args.get("precopy", True))
            self.cap.preflight()
            self.nccl = self.cap.nccl
            self.cap.before_pause()
        except BaseException as e:
            cap = self.cap
            err = cap.explain(e) if cap is not None else e
            if cap is not None:  # refused: nothing of it stays (the node's one undo, as abort runs it)
                cap.undo_capture()
                capture_snapshot.undo_nccl(cap.nccl, False, local_deadline(cmd))
            self._end("refused")
            if err is e:
                raise
            raise err from e
        return {"ranks": agent.spec.ranks, "gen": self.nccl.gen if self.nccl is not None else 0,
                "facts": capture_snapshot.host_facts(self.cap.criu, agent.runtime),
                "net": bool(agent.spec.net),  # a job network to hold while the nodes are dumped
                "learns": agent.learns_peers(), "can": list(msg.CAN)}  # learns: for a migration

    def hold(self, cmd: Command) -> msg.DrainData:
        return self._serial(self._hold, cmd)

    def _hold(self, cmd: Command, args: msg.HoldArgs) -> msg.DrainData:
        cap = self._current(cmd)
        if self.nccl is not None:
            self._gen(self.nccl, cmd)
            cap.phases.begin("drain")  # until the quiesce: the rounds, and the coordinator's time between them
            self.nccl.hold(cap.deadline)
        return self._views(self.nccl, args.get("summary", False))

    def report(self, cmd: Command) -> msg.DrainData:
        return self._serial(self._report, cmd)

    def _report(self, cmd: Command, args: msg.ReportArgs) -> msg.DrainData:
        cap = self._current(cmd)
        if self.nccl is not None:
            time.sleep(min(float(args.get("wait_s", 0.0)), max(0.0, cap.deadline - time.monotonic())))
            self.nccl.join_late_ranks(cap.deadline)
            self.nccl.check_alive("a consistent cut")
        return self._views(self.nccl, args.get("summary", False))

    def targets(self, cmd: Command) -> msg.DrainData:
        return self._serial(self._targets, cmd)

    def _targets(self, cmd: Command, args: msg.TargetsArgs) -> msg.DrainData:
        cap = self._current(cmd)
        if self.nccl is None:
            return self._views(None, args.get("summary", False))
        self.nccl.join_late_ranks(cap.deadline)
        self.nccl.check_alive("a consistent cut")
        views = self.nccl.apply_targets(targets_from_json(args["targets"]),
                                        min(cap.deadline, time.monotonic() + TARGETS_WAIT_S))
        return msg.drain_answer(views, args.get("summary", False))

    def quiesce(self, cmd: Command) -> msg.QuiesceData:
        return self._serial(self._quiesce, cmd)

    def _quiesce(self, cmd: Command, args: msg.GenArgs) -> msg.QuiesceData:
        cap = self._current(cmd)
        cap.phases.end("drain")
        if self.nccl is not None:
            self._gen(self.nccl, cmd)
        self.at_cut = True
        cap.quiesce()
        return {"records": cap.nccl_info.to_json().get("ranks", [])}

    def net_hold(self, cmd: Command) -> msg.NoData:
        return self._serial(self._net_hold, cmd)

    def _net_hold(self, cmd: Command, args: msg.NoArgs) -> msg.NoData:
        self._current(cmd)
        self._net(True)
        return {}

    def net_release(self, cmd: Command) -> msg.NoData:
        return self._serial(self._net_release, cmd)

    def _net_release(self, cmd: Command, args: msg.NoArgs) -> msg.NoData:
        self._current(cmd)
        self._net(False)
        return {}

    def _net(self, held: bool) -> None:
        """Held (net_hold, capture's hold_net) or released (net_release, resume's release_net, abort); idempotent."""
        if self.agent.spec.net and self.net_held != held:
            net_sandbox.hold(self.agent.state.init_pid, held)
            self.net_held = held

    def net_peers(self, cmd: Command) -> msg.NetPeersData:
        return self._serial(self._net_peers, cmd)

    def _net_peers(self, cmd: Command, args: msg.NetPeersArgs) -> msg.NetPeersData:
        """(a migration's staying node, held) the overlay sends to the moved node's new host, not its old one."""
        self._current(cmd)
        if not self.agent.spec.net:
            return {"peers": []}
        old, new = args["old"], args["new"]
        peers = net_sandbox.move_peer(self.agent.spec.net, old, new)
        self.log(f"job network: overlay peers {', '.join(peers) or 'none'} (node(s) {args['nodes']} moved "
                 f"from {old or 'this host'} to {new or 'this host'})")
        return {"peers": peers}

    def finish(self, cmd: Command) -> msg.FinishData:
        return self._serial(self._finish, cmd)

    def _finish(self, cmd: Command, args: msg.NoArgs) -> msg.FinishData:
        """(a migration's staying node, running again) the snapshot is over here: the staging begun at prepare goes."""
        if self.done.get(cmd.snapshot) == "migrated":
            return {}
        cap = self._current(cmd)
        problems = cap.undo_capture()
        self._end("migrated")
        return {"problems": problems}

    def capture(self, cmd: Command) -> msg.PhasesData:
        return self._serial(self._capture, cmd)

    def _capture(self, cmd: Command, args: msg.CaptureArgs) -> msg.PhasesData:
        cap = self._current(cmd)
        if args.get("hold_net"):  # keep-running, msg.NET_IN_CAPTURE: until the resume command
            self._net(True)
        cap.dump()
        return {"phases": cap.phases.rounded()}

    def resume(self, cmd: Command) -> msg.ResumeData:
        return self._serial(self._resume, cmd)

    def _resume(self, cmd: Command, args: msg.ResumeArgs) -> msg.ResumeData:
        if args.get("release_net"):  # held since this node's capture; every node has dumped by now
            self._net(False)
        nccl = self._driver(cmd)
        if nccl is None:
            return {"uids": {}, "need": []}
        if self.cap is not None:
            self.cap.phases.begin("rebuild")  # until the gates open (run): the ids' relay across nodes included
        nccl.settle(local_deadline(cmd))  # a retry: every rank has answered its last REBUILD, either way
        live = [r for r, b in nccl.blocks.items() if b.comms_live]
        if live:  # ranks that rebuilt while another failed: quiesced again, so that every member re-creates
            nccl.requiesce(live, local_deadline(cmd))  # (below the generation: REBUILD is exactly gen)
        self._gen(nccl, cmd)
        gen = nccl.command(Cmd.REBUILD)
        uids, need = nccl.published(gen, local_deadline(cmd))
        return {"uids": {ident_hex(i): u.hex() for i, u in uids.items()}, "need": [ident_hex(i) for i in need]}

    def relay(self, cmd: Command) -> msg.NoData:
        return self._serial(self._relay, cmd)

    def _relay(self, cmd: Command, args: msg.RelayArgs) -> msg.NoData:
        nccl = self._driver(cmd)
        if nccl is None:
            return {}
        uids = {int(k, 16): bytes.fromhex(str(v)) for k, v in args["uids"].items()}
        nccl.rebuild_wait(int(args["gen"]), local_deadline(cmd), uids)
        return {}

    def run(self, cmd: Command) -> msg.NoData:
        return self._serial(self._run, cmd)

    def _run(self, cmd: Command, args: msg.GenArgs) -> msg.NoData:
        nccl = self._driver(cmd)
        if nccl is not None:
            self._gen(nccl, cmd)
            nccl.run()
        cap = self.cap
        if cap is not None:
            cap.phases.end("rebuild")
        if cap is not None and cmd.snapshot == self.sid and not cap.stop:
            self.agent.arm(None)  # the job runs again: it survives its agent
            self.at_cut = False
        if self.after_abort_at_cut:  # the rollback's rebuild: the snapshot is over here
            self._end("aborted")
        elif cap is not None and cap.rehearsal:  # nothing captured: the rehearsal is over here
            self._end("rehearsed")
        return {}

    def persist(self, cmd: Command) -> msg.PersistData:
        return self._serial(self._persist, cmd)

    def _persist(self, cmd: Command, args: msg.PersistArgs) -> msg.PersistData:
        cap = self._current(cmd)
        manifest = cap.commit()
        self.images[cmd.snapshot] = manifest.id
        if args.get("verify", True):
            cap.verify(float(args.get("timeout_s") or cmd.budget_s))
        cap.persist()
        remote = (self.agent.spec.persist or {}).get("url")
        data = (self.store.path_of(manifest.id) / "manifest.json").read_bytes()
        image = ImageRef(ref=manifest.id, bytes=manifest.bytes, sha256=hashlib.sha256(data).hexdigest(),
                         store=str(self.store.root), host=socket.gethostname(), remote=remote,
                         pause_s=manifest.pause_s,
                         gpus=tuple(g.name for g in manifest.nodes[0].gpu.gpus))
        if not cap.stop:  # the job runs already: this node's part is done
            cap.finish()
            self.agent.state.last_snapshot = manifest.id
            self.upload = store_persist.after_snapshot(self.agent.persister, self.store, manifest)
            self._end("verified")
        return {"image": image.to_json(), "phases": cap.phases.rounded()}

    def stop(self, cmd: Command) -> msg.StopData:
        return self._serial(self._stop, cmd)

    def _stop(self, cmd: Command, args: msg.NoArgs) -> msg.StopData:
        if self.done.get(cmd.snapshot) == "stopped":
            return {}
        cap = self._current(cmd)
        cap.end()
        manifest = cap.finish()
        self.agent.state.last_snapshot = manifest.id
        self.upload = store_persist.after_snapshot(self.agent.persister, self.store, manifest)
        self._end("stopped")
        return {"image": manifest.id}

    def abort(self, cmd: Command) -> msg.AbortData:
        return self._serial(self._abort, cmd)

    def _abort(self, cmd: Command, args: msg.AbortArgs) -> msg.AbortData:
        at_cut = bool(args["at_cut"])
        if cmd.snapshot != self.sid:
            # never seen here, or already over: a verified keep-running image of a snapshot that failed
            # elsewhere is removed (the snapshot is never listed valid, and nothing refers to the image)
            how = self.done.get(cmd.snapshot)
            ref = self.images.pop(cmd.snapshot, None)
            if how == "verified" and ref is not None:
                self.store.remove(ref)
                self.done[cmd.snapshot] = "aborted"
            if at_cut and how is None and self.sid is None:
                return {"state": "unknown"}
            return {"state": "running"}
        problems: list[str] = []
        try:
            self._net(False)
        except CryosleepError as e:
            problems.append(f"{e.what}: {e.why}")
        if self.cap is not None:
            self.cap.phases.end_all()
            problems += self.cap.undo_capture()
        self.images.pop(cmd.snapshot, None)
        if not self.agent.job_alive():  # its workers are gone: the job cannot go on as a whole (the coordinator
            self._end("aborted")  # ends the other nodes rather than leave them waiting on these ranks)
            return {"state": "exited"}
        if self.nccl is not None:
            self._gen(self.nccl, cmd)
        try:
            capture_snapshot.undo_nccl(self.nccl, at_cut, local_deadline(cmd))
        except CryosleepError as e:
            problems.append(f"{e.what}: {e.why}")
        if self.nccl is not None and at_cut:
            self.after_abort_at_cut = True
            if problems:
                raise CaptureFailed(f"node {self.agent.spec.node_rank} could not undo snapshot {cmd.snapshot}",
                                    "; ".join(problems), "end the job and restore its last verified snapshot")
            return {"state": "quiesced"}
        self._end("aborted")
        if problems:
            raise CaptureFailed(f"node {self.agent.spec.node_rank} could not undo snapshot {cmd.snapshot}",
                                "; ".join(problems), "end the job and restore its last verified snapshot")
        return {"state": "running"}

    def end(self, cmd: Command) -> msg.NoData:
        return self._serial(self._endop, cmd)

    def _endop(self, cmd: Command, args: msg.EndArgs) -> msg.NoData:
        reason = str(args["reason"] or f"snapshot {cmd.snapshot} failed past its cut")
        self.agent.end_job(f"ended by the coordinator: {reason}; restore the job's last verified snapshot")
        self._end("ended")
        return {}


def connect(agent: NodeAgent, url: str, token: str, *, wait_s: float = 20.0) -> AgentRunner:
    """Registers this node's agent with the coordinator and serves its commands (on a thread)."""
    spec = agent.spec
    address = str(spec.net.get("address", "")) if spec.net else ""
    reg = Registration(job=job_name(spec.name, spec.nnodes, spec.node_rank), nnodes=spec.nnodes,
                       node_rank=spec.node_rank, ranks=spec.ranks, hostname=socket.gethostname(), address=address,
                       facts={"local_job": spec.name, "restored_from": agent.state.restored_from,
                              "host": host_name()},
                       spec={"nproc_per_node": spec.nproc_per_node, "run_id": spec.run_id,
                             "program": spec.program[-3:], "fast_path": spec.fast_path})
    log = agent.log_line
    backend = CoordinatedNode(agent, log=log)
    return AgentRunner(url, token, backend, reg, wait_s=wait_s, log=log).start()


class RestoreRendezvous:
    """One node of a multi-node restore (``cryosleep restore SNAPSHOT --node-rank I``), meeting the others at the
    coordinator (coordinator/rendezvous.py):

    * ``announce`` as soon as the restore begins (before fetching the image): this node is coming, and whatever an
      earlier attempt of it left on the board no longer speaks for it;
    * ``barrier``, once this node's checks passed (``failed`` when anything before failed): waits until every node
      is ready, so that nothing starts anywhere unless every node can restore; one node's problems stop them all,
      each told which node failed and why;
    * ``generation`` and ``exchange`` (with the above: ``capture.restore.Meeting``), after CRIU: the REBUILD
      generation all nodes use (above any the images hold), and the communicators' fresh ids across nodes; a
      node that fails past the barrier (``failed`` again) tells the others, which stop waiting for its ids and
      end their part.

    The nodes that passed one barrier together share an attempt id (from the tokens they posted), so that what an
    earlier, failed attempt left on the board is never taken. The board outlives its coordinator (it is in the
    catalog's engine): while none answers (a restart, a standby taking over), each call is tried again until the
    wait's own deadline."""

    def __init__(self, client: CoordinatorClient, sid: str, node_rank: int, nnodes: int, timeout: float,
                 log: Callable[[str], None] | None = None, underlay: str = "", migrating: bool = False) -> None:
        self.client = client
        self.migrating = migrating  # a live migration's node: the coordinator speaks for the other nodes
        self.sid = sid
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.timeout = timeout
        self.log = log or (lambda _m: None)
        self.underlay = underlay  # this host's address for the job network's overlay, told to the other nodes
        self.token = secrets.token_hex(8)
        self.started = time.monotonic()
        self.stage = "checks"  # then "barrier" (a failure there withdraws this node itself), then "passed"
        self.attempt = ""
        self.gen = 0
        self.peers: list[str] = []  # the other nodes' underlay addresses, once the barrier passed

    def _entry(self, ok: bool | None, problems: list[str], gen: int, **extra: Any) -> dict[str, Any]:
        return {f"ready/{self.node_rank}": {"ok": ok, "problems": problems, "gen": gen, "token": self.token,
                                            "host": socket.gethostname(), "underlay": self.underlay, **extra}}

    def _board(self, until: float, put: dict[str, Any] | None = None, prefix: str | None = None,
               min_keys: int = 0, wait_s: float = 0.0) -> dict[str, Any]:
        """One exchange with the board, tried again while no coordinator answers, until ``until`` (monotonic)."""
        while True:
            try:
                return self.client.rendezvous(self.sid, put, prefix=prefix, min_keys=min_keys,
                                              wait_s=min(wait_s, max(0.0, until - time.monotonic())))
            except Unreachable as e:
                if time.monotonic() >= until:
                    raise
                self.log(f"the coordinator does not answer ({e.why}); trying again")
                time.sleep(BOARD_RETRY_S)

    def _post(self, put: dict[str, Any], what: str) -> None:
        try:
            self._board(time.monotonic() + BOARD_RETRY_FOR_S, put)
        except CryosleepError as e:
            self.log(f"could not tell the other nodes that {what}: {e.what}")

    def announce(self) -> None:
        """This node's restore has begun: it replaces whatever an earlier attempt of this node left (a failure
        there would otherwise stop the others once it stayed unanswered for READY_FRESH_S)."""
        self._post(self._entry(None, [], 0), "this node is restoring")

    def checked(self) -> None:
        """This node's checks passed: a live migration's coordinator then ends the node's old self (plain: no word)."""
        if self.migrating:
            self._board(time.monotonic() + BOARD_RETRY_FOR_S,
                        {f"checked/{self.node_rank}": {"token": self.token, "host": socket.gethostname()}})

    def failed(self, problems: list[str]) -> None:
        """This node's restore failed. Before the barrier, every other node is told before it starts anything;
        past it, the others stop waiting for this node's ids (and end their part)."""
        if self.stage == "checks":
            self._post(self._entry(False, problems, 0), "this one cannot restore")
        elif self.stage == "passed":
            self._post({f"attempt/{self.attempt}/failed/{self.node_rank}":
                        {"host": socket.gethostname(), "problems": problems}}, "this one failed")

    def barrier(self, gen: int) -> None:
        """This node is ready (its captured NCCL generation ``gen``); returns once every node is, or raises.

        What counts: a node's readiness posted within READY_FRESH_S (a waiting node re-posts its own every
        READY_REPOST_S, so a node that went away drops out), or, once it passed, only for the nodes it passed
        with (its entry then lists their tokens: a node that passed an earlier attempt's barrier does not let a
        retry pass alone); a node's failure posted since this restore began, or one left before it that its node
        has not replaced (``announce``) within READY_FRESH_S: that node is not being restored again, and its
        last word is the reason rather than a timeout."""
        self.stage = "barrier"
        end = time.monotonic() + self.timeout
        while True:
            items = self._board(end, self._entry(True, [], gen), prefix="ready/", min_keys=self.nnodes,
                                wait_s=READY_REPOST_S)
            since = time.monotonic() - self.started  # after the read: an entry posted since we began is younger
            ready = {k: v["value"] for k, v in items.items() if v["value"].get("ok") is True and (
                self.token in v["value"]["passed"] if "passed" in v["value"] else v["age_s"] < READY_FRESH_S)}
            bad = {k: {**v["value"], "before": v["age_s"] >= since} for k, v in items.items()
                   if v["value"].get("ok") is False and (v["age_s"] < since or since >= READY_FRESH_S)}
            if bad:
                self._withdraw()
                raise NotEligible(f"snapshot {self.sid} cannot be restored: another node cannot take its image",
                                  "; ".join(f"node {k.split('/')[1]} on {v.get('host')}: " + "; ".join(v["problems"])
                                            + (" (reported before this restore began, and that node has not been "
                                               "restored again since)" if v["before"] else "")
                                            for k, v in sorted(bad.items())),
                                  "fix what is listed on that node and run the restore of every node again; nothing "
                                  "was started here")
            if len(ready) >= self.nnodes:
                tokens = sorted(v["token"] for v in ready.values())
                self.attempt = hashlib.sha256(" ".join(tokens).encode()).hexdigest()[:16]
                self.gen = max(int(v.get("gen") or 0) for v in ready.values()) + msg.RESTORE_GEN_MARGIN
                self.peers = sorted({str(v["underlay"]) for k, v in ready.items()
                                     if k != f"ready/{self.node_rank}" and v.get("underlay")} - {self.underlay})
                self.stage = "passed"
                # from now on this entry counts only for the nodes this one passed with
                self._post(self._entry(True, [], gen, passed=tokens), "this one passed the barrier")
                self.log(f"every node of {self.sid} is ready (attempt {self.attempt})")
                return
            time.sleep(0.2)  # the keys are there but not every node is ready: do not spin on the board
            if time.monotonic() > end:
                self._withdraw()
                missing = sorted(set(range(self.nnodes)) - {int(k.split("/")[1]) for k in ready})
                raise NotEligible(f"snapshot {self.sid} cannot be restored: not every node came",
                                  f"no restore of node(s) {missing} ready within {self.timeout:g} s",
                                  "run `cryosleep restore SNAPSHOT --node-rank I` for every node of the job; "
                                  "nothing was started here")

    def _withdraw(self) -> None:
        try:
            self.client.rendezvous(self.sid, {f"ready/{self.node_rank}": {"ok": None, "token": self.token}})
        except CryosleepError:
            pass

    def generation(self) -> int:
        return self.gen

    def exchange(self, gen: int, uids: dict[int, bytes], need: list[int], deadline: float) -> dict[int, bytes]:
        base = f"attempt/{self.attempt}/"
        prefix = f"{base}uid/{gen}/"
        self._board(deadline, {prefix + ident_hex(i): u.hex() for i, u in uids.items()})
        missing = {prefix + ident_hex(i): i for i in need}  # key on the board -> communicator
        got: dict[int, bytes] = {}
        while missing:
            left = deadline - time.monotonic()
            if left <= 0:
                raise InterceptorError("the NCCL communicators could not be rebuilt across nodes",
                                       "no fresh id from another node for communicator(s) "
                                       + ", ".join(sorted(k.rsplit("/", 1)[1] for k in missing)),
                                       "is every node of the job restoring? see their logs")
            # the attempt's keys: this generation's ids, and any node's failure (which wakes the wait too)
            items = self._board(deadline, prefix=base, min_keys=len(uids) + len(need), wait_s=min(5.0, left))
            failed = {k.rsplit("/", 1)[1]: v["value"] for k, v in items.items() if k.startswith(base + "failed/")}
            if failed:
                raise InterceptorError("the NCCL communicators could not be rebuilt across nodes",
                                       "; ".join(f"node {n} on {v.get('host')} failed its restore: "
                                                 + "; ".join(v.get("problems") or [])
                                                 for n, v in sorted(failed.items())),
                                       "fix what is listed on that node and run the restore of every node again")
            for k in [k for k in missing if k in items]:
                got[missing.pop(k)] = bytes.fromhex(str(items[k]["value"]))
            if missing and len(items) >= len(uids) + len(need):
                time.sleep(0.2)  # other nodes' ids filled the count, not ours: do not spin on the board
        return got


class NetPeers:
    """The job network's overlay peers, learned from the coordinator (``run --nnodes N --coordinator URL --net
    job`` without ``--net-peers``). While the job runs, this node posts its underlay address (where its
    route to the coordinator leaves from) on its run's board every NET_REPOST_S, reads the other nodes', and
    makes the overlay flood to those posted within NET_FRESH_S: a node that starts late is added when it comes,
    one restored on another host is followed there, one that ended is dropped. The workers meanwhile start
    and retry their first connection (TCPStore) until the overlay reaches the master's node."""

    def __init__(self, client: CoordinatorClient, run_id: str, node_rank: int, nnodes: int, underlay: str,
                 apply: Callable[[list[str]], None], log: Callable[[str], None],
                 known: Sequence[str] = ()) -> None:
        self.client = client
        self.board = net_board(run_id)
        self.key = f"underlay/{node_rank}"
        self.nnodes = nnodes
        self.underlay = underlay
        self.apply = apply
        self.log = log
        # A restored node's peers, learned at the restore's barrier: already applied, and kept until they had the
        # time to post (NET_FRESH_S): a peer restored a moment later, whose entry on the board is still its old run's
        # (stale), is not dropped from the overlay by this node's first round.
        self.applied: list[str] | None = sorted(known) if known else None
        self.known = frozenset(known)
        self.since = time.monotonic()
        self.stopped = threading.Event()
        self.wait_s = 5.0  # a round waits this long for every node's entry
        self._apply_lock = threading.Lock()  # stop() waits for an update under way; none starts after it

    def round(self) -> tuple[list[str], int]:
        """Post this node's address; return the other nodes' addresses (those posted within NET_FRESH_S; one on
        this host, with this host's address, needs no overlay) and how many other nodes posted, waiting a few
        seconds for every node's entry."""
        items = self.client.rendezvous(self.board, {self.key: {"ip": self.underlay, "host": socket.gethostname()}},
                                       prefix="underlay/", min_keys=self.nnodes, wait_s=self.wait_s)
        fresh = {k: str(v["value"].get("ip")) for k, v in items.items()
                 if k != self.key and v["age_s"] <= NET_FRESH_S and v["value"].get("ip")}
        return sorted(set(fresh.values()) - {self.underlay}), len(fresh)

    def step(self) -> bool:
        """One round, the overlay updated if the peers changed; True once every other node posted. After stop()
        nothing is applied: the job's network may be released already."""
        peers, heard = self.round()
        if self.known and time.monotonic() - self.since < NET_FRESH_S:
            peers = sorted(set(peers) | self.known)
        with self._apply_lock:
            if self.stopped.is_set():
                return False
            if peers != self.applied:
                self.apply(peers)
                self.log(f"job network: overlay peers {', '.join(peers) or 'none'} ({heard} of {self.nnodes - 1} "
                         "other node(s) told their address to the coordinator; those on this host need none)")
                self.applied = peers
        return heard >= self.nnodes - 1

    def _loop(self) -> None:
        said = ""
        while not self.stopped.is_set():
            try:
                complete = self.step()
                said = ""
            except CryosleepError as e:  # coordinator away, ip failing: say it once, keep trying
                if e.what != said:
                    self.log(f"job network: cannot update the overlay peers: {e.what}: {e.why}")
                    said = e.what
                complete = False
            self.stopped.wait(NET_REPOST_S if complete else 1.0)

    def start(self) -> NetPeers:
        threading.Thread(target=self._loop, name="net-peers", daemon=True).start()
        return self

    def stop(self) -> None:
        """No new round (posting this node's address) and no overlay change from here on; an update under way is
        waited for. Called when the job ended, before its network is released."""
        with self._apply_lock:
            self.stopped.set()
