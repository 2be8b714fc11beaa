"""Simulated node agents: the real protocol over real HTTP, with simulated ranks and NCCL counters.

Test-only code (not in the package): for the coordinator's tests and its scale benchmark (no workers, no
CRIU). ``SimWorld`` is one job: every rank runs the same program, step after step: an all-reduce on its
node's communicator (the node's ranks), then one on the job-wide communicator. Ranks start at different
points of the program (``spread``), so at a snapshot some are behind and must run on to the cut, and some are
held short of it on their node's communicator (the case ``cut.rules.raise_for_stuck`` exists for). The
interceptor's gate is modelled as docs/interceptor.md describes it: in HOLD a collective is admitted while
``seq < coll_target``.

``SimNode`` implements ``client.NodeBackend`` for one node's ranks; with ``call_s > 0`` a rank takes that long
per call, so the cut takes several rounds. ``SimFaults`` injects, per node: an error, a hang (never answers),
a lost agent (stops polling) or a delay, at any operation or phase. A node speaks this package's protocol (it
holds its job network in a keep-running capture told ``hold_net``, and releases it in a resume told
``release_net``; it checks that no node releases before every node has dumped), or with ``legacy`` the one of
before (no capabilities at prepare, and those arguments ignored, as an older agent would). ``SimCluster``
starts a job's nodes, each with its own ``AgentRunner`` (threads in this process, each with its own HTTP
connections); ``only`` limits it to some of the job's nodes, so that one job's agents can be spread over several
processes (the benchmark does): every process builds the same world from the same seed, and the ids published
for a rebuild are derived from (communicator, generation), so they agree across processes.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryosleep.coordinator.client import AgentRunner, Registration
from cryosleep.coordinator.machine import PHASE_OF
from cryosleep.coordinator.protocol import CAN, Command, Op, drain_answer, ident_hex, targets_from_json
from cryosleep.core.interceptor import MAX_PEERS, CommSlot, Rebuild, SlotState, WaitKind
from cryosleep.cut.rules import RankView
from cryosleep.errors import CaptureFailed, NotEligible

GLOBAL = 0x6A0B_0000_0000_0001
ABORT_WAIT_S = 2.0


def node_ident(node: int) -> int:
    return 0x0DE0_0000_0000_0000 | (node + 1)


@dataclass
class SimFaults:
    fail: dict[str, str] = field(default_factory=dict)
    """op or phase name -> the error that operation answers (or ``held``: a keep-running capture's, after its
    network hold and before its dump)."""
    hang: set[str] = field(default_factory=set)
    """ops or phases that never answer (the agent keeps polling)."""
    die: str | None = None
    """At this op or phase the agent stops polling and never answers: a lost agent."""
    delay: dict[str, float] = field(default_factory=dict)
    """op or phase -> seconds to wait before doing it."""
    once: bool = False
    """Each ``fail`` entry fires once, then is forgotten (a transient fault: the rollback then succeeds)."""

    def matches(self, keys: set[str], names: set[str]) -> bool:
        return bool(names & keys)


@dataclass
class SimRank:
    rank: int
    node: int
    local: int
    pos: int = 0  # calls issued so far
    seq: dict[int, int] = field(default_factory=dict)
    target: dict[int, int] = field(default_factory=dict)
    mode: str = "run"  # run, hold, quiesced, rebuilt
    live: bool = True
    uid_gen: dict[int, int] = field(default_factory=dict)
    targets_gen: int = 0
    settled_gen: int = 0
    ready_at: float = 0.0  # (call_s > 0) when the next call can be issued
    ended: bool = False


class SimWorld:
    """One simulated job: ``nnodes`` x ``nproc`` ranks, its communicators and the ids published for rebuilds."""

    def __init__(self, nnodes: int, nproc: int, *, seed: int = 0, spread: int = 5, call_s: float = 0.0) -> None:
        self.nnodes = nnodes
        self.nproc = nproc
        self.world = nnodes * nproc
        self.call_s = call_s
        self.seed = seed
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.ranks = [SimRank(r, r // nproc, r % nproc) for r in range(self.world)]
        for rk in self.ranks:
            rk.seq = {node_ident(rk.node): 0, GLOBAL: 0}
            rk.target = {i: 0 for i in rk.seq}
        self.uids: dict[tuple[int, int], str] = {}
        self.dumped: dict[str, set[int]] = {}  # snapshot -> the nodes whose keep-running dump is done
        self.here: set[int] = set()  # the nodes simulated in this process (a SimNode each)
        base = 1000
        for rk in self.ranks:
            self._issue_n(rk, base + self.rng.randint(0, spread))

    def comm_of(self, rk: SimRank, pos: int) -> int:
        return node_ident(rk.node) if pos % 2 == 0 else GLOBAL

    def _issue_n(self, rk: SimRank, n: int) -> None:
        for _ in range(n):
            rk.seq[self.comm_of(rk, rk.pos)] += 1
            rk.pos += 1

    def members(self, ident: int) -> int:
        return self.world if ident == GLOBAL else self.nproc

    def comm_rank(self, rk: SimRank, ident: int) -> int:
        return rk.rank if ident == GLOBAL else rk.local

    def run_free(self, ranks: list[SimRank], steps: int) -> None:
        """Time passes with the gates open: each rank issues up to ``steps`` calls."""
        for rk in ranks:
            if rk.mode == "run" and rk.live and not rk.ended:
                self._issue_n(rk, self.rng.randint(0, steps))

    def advance(self, rk: SimRank, now: float) -> None:
        """In HOLD: issue the calls the gate admits (all at once, or one per ``call_s``)."""
        if rk.mode != "hold" or rk.ended:
            return
        while True:
            c = self.comm_of(rk, rk.pos)
            if rk.seq[c] >= rk.target.get(c, 0):
                return  # held at this call
            if self.call_s > 0:
                if rk.ready_at == 0.0:
                    rk.ready_at = now + self.call_s
                if now < rk.ready_at:
                    return
                rk.ready_at += self.call_s
            rk.seq[c] += 1
            rk.pos += 1

    def short(self, rk: SimRank) -> bool:
        return any(rk.seq[c] < rk.target.get(c, 0) for c in rk.seq)

    def view(self, rk: SimRank) -> RankView:
        nxt = self.comm_of(rk, rk.pos)
        at_gate = rk.mode == "hold" and not rk.ended and rk.seq[nxt] >= rk.target.get(nxt, 0)
        comms = []
        for i, ident in enumerate(sorted(rk.seq)):
            n = self.members(ident)
            peers = (0,) * min(n, MAX_PEERS)
            waiting = int(at_gate and ident == nxt)
            comms.append(CommSlot(index=i, state=SlotState.LIVE, vid=i + 1, ident=ident,
                                  rank=self.comm_rank(rk, ident), nranks=n, parent_vid=0, color=0, key=0,
                                  rebuild=Rebuild.FROM_ID, flags=0, device=-1, seq=rk.seq[ident],
                                  coll_target=rk.target.get(ident, 0), uid_gen=rk.uid_gen.get(ident, 0),
                                  waiting=waiting, waiting_kind=WaitKind.COLL if waiting else WaitKind.NONE,
                                  waiting_peer=-1, send=peers, recv=peers, send_target=peers, recv_target=peers))
        settled = rk.mode == "hold" and not self.short(rk)
        return RankView(rank=rk.rank, comms=tuple(comms), held=int(at_gate), targets_gen=rk.targets_gen,
                        settled_gen=rk.settled_gen, settled=settled)

    def not_dumped(self, sid: str) -> list[int]:
        """The nodes simulated here whose keep-running dump of ``sid`` is not done."""
        with self.lock:
            return sorted(self.here - self.dumped.get(sid, set()))

    def publish(self, ident: int, gen: int) -> str:
        """The id communicator ``ident``'s rank 0 publishes at generation ``gen`` (the same in every process)."""
        with self.lock:
            return self.uids.setdefault((ident, gen), hashlib.sha256(f"{self.seed}:{ident}:{gen}".encode())
                                        .hexdigest()[:32])


class SimNode:
    """One node's simulated agent (``client.NodeBackend``)."""

    def __init__(self, world: SimWorld, node: int, store: Path, faults: SimFaults | None = None,
                 net: bool = True, legacy: bool = False) -> None:
        self.world = world
        self.node = node
        self.net = net  # a job network (net_hold holds it); without one on any node, the coordinator skips the hold
        self.legacy = legacy  # the protocol of before: no capabilities, capture's hold_net and resume's release_net
        self.store = store
        self.faults = faults or SimFaults()
        self.ranks = world.ranks[node * world.nproc:(node + 1) * world.nproc]
        world.here.add(node)
        self.lock = threading.Lock()
        self.ops: list[tuple[str, str]] = []  # (snapshot, op) executed, in order
        self.staged: dict[str, dict[str, Any]] = {}
        self.frozen = False
        self.net_held = False
        self.gen = 0
        self.runner: AgentRunner | None = None
        self.release = threading.Event()
        self.op_lock = threading.Lock()

    # -- helpers --

    def _fault(self, op: Op, point: str | None = None) -> None:
        f = self.faults
        keys = {point} if point else {str(op), PHASE_OF[op]}
        for k in sorted(keys):
            if k in f.delay:
                time.sleep(f.delay[k])
        if f.die is not None and f.matches({f.die}, keys):
            if self.runner is not None:
                self.runner.halt()
            self.release.wait()
            raise CaptureFailed("the simulated agent died", "", "")
        if f.matches(f.hang, keys):
            self.release.wait()
            raise CaptureFailed(f"simulated hang at {op}", "", "")
        for k in sorted(keys):
            if k in f.fail:
                why = f.fail.pop(k) if f.once else f.fail[k]
                raise CaptureFailed(f"simulated failure at {point or op} on node {self.node}", why, "")

    def _enter(self, cmd: Command) -> None:
        with self.lock:
            self.ops.append((cmd.snapshot, str(cmd.op)))
        self._fault(cmd.op)

    def _serial(self, fn: Callable[[Command], dict[str, Any]], cmd: Command) -> dict[str, Any]:
        """One operation at a time, as a real agent must: an ``abort`` that arrives while an earlier command still
        runs (the coordinator gave up on it) waits for it, up to ABORT_WAIT_S, then goes ahead anyway (a real agent
        would kill its CRIU dump there); a hung operation that wakes up later changes nothing."""
        lock = self.op_lock
        if cmd.op is not Op.ABORT:
            lock.acquire()
        elif not lock.acquire(timeout=min(max(cmd.budget_s, 0.0), ABORT_WAIT_S)):
            lock = self.op_lock = threading.Lock()  # the stuck operation keeps the old one
            lock.acquire()
        try:
            return fn(cmd)
        finally:
            lock.release()

    def _views(self, cmd: Command) -> dict[str, Any]:
        now = time.monotonic()
        for rk in self.ranks:
            self.world.advance(rk, now)
        # the real agent's answer: its summary, or the views to a coordinator that does not ask for one
        return dict(drain_answer([self.world.view(rk) for rk in self.ranks], bool(cmd.args.get("summary"))))

    def ops_of(self, sid: str) -> list[str]:
        with self.lock:
            return [op for s, op in self.ops if s == sid]

    def running(self) -> bool:
        return not self.frozen and not self.net_held and all(rk.mode == "run" and rk.live for rk in self.ranks)

    # -- the operations --

    def prepare(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._prepare, cmd)

    def _prepare(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        if any(rk.ended for rk in self.ranks):
            raise NotEligible(f"node {self.node}'s workers have ended", "", "")
        self.world.run_free(self.ranks, 3)
        out = {"ranks": [rk.rank for rk in self.ranks], "gen": self.gen, "facts": {"simulated": True}, "net": self.net}
        return out if self.legacy else {**out, "can": list(CAN)}

    def hold(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._hold, cmd)

    def _hold(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        for rk in self.ranks:
            rk.target = {i: 0 for i in rk.seq}
            rk.mode = "hold"
            rk.ready_at = 0.0
            rk.targets_gen += 1
            rk.settled_gen = rk.targets_gen
        return self._views(cmd)

    def report(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._report, cmd)

    def _report(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        time.sleep(float(cmd.args.get("wait_s", 0.0)) if self.world.call_s else 0.0)
        return self._views(cmd)

    def targets(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._targets, cmd)

    def _targets(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        t = targets_from_json(cmd.args.get("targets") or {})
        for rk in self.ranks:
            for ident in rk.seq:
                rk.target[ident] = t[ident].coll if ident in t else 0
            rk.targets_gen += 1
            rk.settled_gen = rk.targets_gen
        return self._views(cmd)

    def quiesce(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._quiesce, cmd)

    def _quiesce(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        for rk in self.ranks:
            if rk.mode != "hold" or any(rk.seq[c] != rk.target.get(c, 0) for c in rk.seq):
                raise CaptureFailed(f"rank {rk.rank} is not at the cut", f"counters {rk.seq}, targets {rk.target}",
                                    "")
        for rk in self.ranks:
            rk.mode, rk.live = "quiesced", False
        return {"records": [{"rank": rk.rank, "seq": {ident_hex(i): n for i, n in rk.seq.items()}}
                            for rk in self.ranks]}

    def net_hold(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._net_hold, cmd)

    def _net_hold(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        self.net_held = True
        return {}

    def net_release(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._net_release, cmd)

    def _net_release(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        self._release(cmd)
        return {}

    def _release(self, cmd: Command) -> None:
        """The job network released once every node has dumped (else a frame could cross between a node dumped
        and one not yet: the images would disagree)."""
        if self.net_held and (late := self.world.not_dumped(cmd.snapshot)):
            raise CaptureFailed(f"node {self.node}: the job network released before node(s) {late} dumped", "", "")
        self.net_held = False

    def capture(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._capture, cmd)

    def _capture(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        if any(rk.live for rk in self.ranks):
            raise CaptureFailed(f"node {self.node}: ranks are not quiesced", "", "")
        keep = cmd.args.get("mode") == "keep-running"
        if keep and cmd.args.get("hold_net") and self.net and not self.legacy:
            self.net_held = True
            self._fault(cmd.op, "held")
        if keep and self.net and not self.net_held:
            raise CaptureFailed(f"node {self.node}: a keep-running dump without the job network held", "", "")
        self.staged[cmd.snapshot] = {"node": self.node, "ranks": {
            str(rk.rank): {ident_hex(i): n for i, n in sorted(rk.seq.items())} for rk in self.ranks}}
        self.frozen = cmd.args.get("mode") == "stop"
        if keep:
            with self.world.lock:
                self.world.dumped.setdefault(cmd.snapshot, set()).add(self.node)
        return {"phases": {"dump": 0.0}}

    def resume(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._resume, cmd)

    def _resume(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        if cmd.args.get("release_net") and not self.legacy:
            self._release(cmd)
        self.frozen = False
        gen = int(cmd.args["gen"])
        uids: dict[str, str] = {}
        need: set[str] = set()
        for rk in self.ranks:
            if rk.live:
                continue  # REBUILD with live communicators: nothing to re-create
            rk.mode = "rebuilt"
            for ident in rk.seq:
                if self.world.comm_rank(rk, ident) == 0:
                    uids[ident_hex(ident)] = self.world.publish(ident, gen)
                    rk.uid_gen[ident] = gen
                else:
                    need.add(ident_hex(ident))
        return {"uids": uids, "need": sorted(need)}

    def relay(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._relay, cmd)

    def _relay(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        gen = int(cmd.args["gen"])
        got = dict(cmd.args.get("uids") or {})
        for rk in self.ranks:
            if rk.live:
                continue
            for ident in rk.seq:
                if self.world.comm_rank(rk, ident) == 0:
                    continue
                h = ident_hex(ident)
                if got.get(h) != self.world.publish(ident, gen):
                    raise CaptureFailed(f"rank {rk.rank}: wrong or missing id for {h}", f"got {got.get(h)}", "")
                rk.uid_gen[ident] = gen
        for rk in self.ranks:
            rk.live = True
        return {}

    def run(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._run, cmd)

    def _run(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        for rk in self.ranks:
            if not rk.live:
                raise CaptureFailed(f"rank {rk.rank} has no communicators", "send REBUILD first", "")
            rk.mode = "run"
        return {}

    def persist(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._persist, cmd)

    def _persist(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        img = self.staged.get(cmd.snapshot)
        if img is None:
            raise CaptureFailed(f"node {self.node} has no image of {cmd.snapshot}", "", "")
        path = self.store / cmd.snapshot / f"node-{self.node}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps(img, sort_keys=True).encode()
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()  # verify: read back what is stored
        if digest != hashlib.sha256(data).hexdigest():
            raise CaptureFailed(f"node {self.node}: image failed verification", str(path), "")
        return {"image": {"ref": str(path), "sha256": digest, "bytes": len(data)}}

    def stop(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._stop, cmd)

    def _stop(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        for rk in self.ranks:
            rk.ended = True
        return {}

    def abort(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._abort, cmd)

    def _abort(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        self.frozen = False
        self.net_held = False
        img = self.staged.pop(cmd.snapshot, None)
        if img is not None:
            (self.store / cmd.snapshot / f"node-{self.node}.json").unlink(missing_ok=True)
        if cmd.args.get("at_cut"):
            for rk in self.ranks:
                rk.mode, rk.live = "quiesced", False  # live ones re-quiesced at their own counters (the cut)
            return {"state": "quiesced"}
        for rk in self.ranks:
            if rk.live:
                rk.mode = "run"
        return {"state": "running"}


    def end(self, cmd: Command) -> dict[str, Any]:
        return self._serial(self._endop, cmd)

    def watch(self) -> None:
        pass  # a simulated node never acts on its own

    def _endop(self, cmd: Command) -> dict[str, Any]:
        self._enter(cmd)
        self.frozen = False
        self.net_held = False
        for rk in self.ranks:
            rk.ended = True
        return {}


class SimCluster:
    """A job's simulated nodes, each with its own agent runner against the coordinator at ``url``."""

    def __init__(self, url: str, token: str, store: Path, *, job: str = "sim", nnodes: int = 2, nproc: int = 4,
                 seed: int = 0, spread: int = 5, call_s: float = 0.0, faults: dict[int, SimFaults] | None = None,
                 wait_s: float = 20.0, log: Callable[[str], None] | None = None,
                 only: range | None = None, net: bool = True, legacy: frozenset[int] = frozenset()) -> None:
        self.world = SimWorld(nnodes, nproc, seed=seed, spread=spread, call_s=call_s)
        self.job = job
        self.nodes = [SimNode(self.world, n, store, (faults or {}).get(n), net, n in legacy)
                      for n in (only or range(nnodes))]
        self.runners: list[AgentRunner] = []
        for node in self.nodes:
            reg = Registration(job=job, nnodes=nnodes, node_rank=node.node, ranks=[rk.rank for rk in node.ranks],
                               hostname=f"sim-{node.node}", address=f"sim://{node.node}",
                               spec={"nproc_per_node": nproc, "simulated": True})
            r = AgentRunner(url, token, node, reg, wait_s=wait_s, log=log)
            node.runner = r
            self.runners.append(r)

    def start(self, timeout: float = 30.0) -> SimCluster:
        for r in self.runners:
            r.start()
        end = time.monotonic() + timeout
        while not all(r.agent_id for r in self.runners):
            if time.monotonic() > end:
                raise TimeoutError("simulated agents did not register")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        for n in self.nodes:
            n.release.set()
        for r in self.runners:
            r.halt()
        for r in self.runners:
            r.join(5)

    def all_running(self) -> bool:
        return all(n.running() for n in self.nodes)

    def cut_counters(self, sid: str) -> dict[int, dict[str, int]]:
        """From the persisted images: job rank -> {communicator: seq} at the cut."""
        out: dict[int, dict[str, int]] = {}
        for n in self.nodes:
            p = n.store / sid / f"node-{n.node}.json"
            for r, seq in json.loads(p.read_text())["ranks"].items():
                out[int(r)] = seq
        return out
