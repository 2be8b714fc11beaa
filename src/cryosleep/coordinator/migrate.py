"""A live migration (``coordinator drain HOST`` with a free compatible host, coordinator/drain.py): the job's
nodes on HOST move to spare hosts; the other nodes hold at the cut and run on afterwards with the same processes.

One phase list, one rollback, as the snapshot's (machine.py, whose phases and transport it reuses)::

    prepare   every node as a snapshot's: the moving nodes for a stop snapshot, the staying ones keep-running
    drain     HOLD, then the cut's rounds over every rank of every node
    quiesce   every rank destroys its real NCCL communicators
    capture   the staying nodes' job network held (their frames to the moving nodes dropped: TCP retransmits
              them later); the moving nodes only: CUDA checkpoint + CRIU dump, left stopped
    persist   the moving nodes' images committed and verified
    place     one order per moving node to its spare's host daemon: that node alone restored there
              (``restore SID --node-rank I``) with its job address; its restore meets this run on the
              snapshot's board, where this run speaks for the staying nodes
    checked   each spare's restore passed its checks (image fetched and verified, machine compatible)
              == point of no return: the moving nodes' old incarnations end (STOP) ==
    switch    the staying nodes' overlay floods to the spare's underlay address instead of the old host's, and
              the run's peer board says so (for the nodes that follow it, agent/coordinated.py's NetPeers);
              their network released
    barrier   the staying nodes' readiness posted for the spares' barrier; each spare's awaited
    resume    REBUILD(g) on the staying nodes, the fresh ids crossing to and from the spares through the board
              (each spare's restore relays its own), every staying rank RUNNING(g) -> RUN
    restored  each spare's order done (the restored node runs); the staying nodes' snapshot finished (FINISH)

Rollback, before the point of no return: the snapshot's own (``SnapshotSequence.rollback``): every node aborts
(the moving nodes thawed where they ran, the staying nodes' network released), then all rebuild and run; a
spare's restore already ordered is told at its barrier that nothing starts. Past it, the moving nodes are gone
from their old host: a failure leaves the staying nodes without their peers, so they are ended (END), and the
job's last verified snapshot brings it back.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cryosleep.coordinator.catalog import Catalog
from cryosleep.coordinator.hub import Hub
from cryosleep.coordinator.machine import MachineConfig, Outcome, SnapshotRun
from cryosleep.coordinator.metrics import CoordinatorMetrics
from cryosleep.coordinator.placement import Placements
from cryosleep.coordinator.protocol import (
    RESTORE_GEN_MARGIN,
    CaptureArgs,
    EndArgs,
    GenArgs,
    ImageRef,
    Mode,
    NetPeersArgs,
    NoArgs,
    Op,
    PersistArgs,
    PersistData,
    PrepareArgs,
    PrepareData,
    RelayArgs,
    ResumeArgs,
    ResumeData,
)
from cryosleep.coordinator.rendezvous import Board
from cryosleep.errors import CaptureFailed, CryosleepError, ProtocolError

REPOST_S = 5.0  # the staying nodes' entry at the barrier is posted again this often (the spare counts it 30 s)


def attempt_of(tokens: list[str]) -> str:
    """The attempt id the nodes that passed one barrier share (agent/coordinated.py's RestoreRendezvous)."""
    return hashlib.sha256(" ".join(sorted(tokens)).encode()).hexdigest()[:16]


class MigrateRun(SnapshotRun):
    """The migration of the ``moving`` nodes of a job, node ``moving[i]`` onto host ``spare[i]``; ``hosts``: the
    host each node runs on now; ``net_board``: the board where the job's run posts its overlay peers ("" when it
    has none)."""

    def __init__(self, catalog: Catalog, hub: Hub, board: Board, placements: Placements, *, sid: str, job: str,
                 timeout_s: float, nodes: Mapping[int, str], incarnations: Mapping[str, str], moving: list[int],
                 spare: list[str], hosts: Mapping[int, str], net_board: str, cfg: MachineConfig | None = None,
                 log: Callable[[str], None] | None = None, metrics: CoordinatorMetrics | None = None) -> None:
        super().__init__(catalog, hub, sid=sid, job=job, mode=Mode.MIGRATE, timeout_s=timeout_s, nodes=nodes,
                         incarnations=incarnations, cfg=cfg, log=log, metrics=metrics)
        self.board = board
        self.placements = placements
        self.moving = sorted(moving)
        self.staying = [n for n in self.nodes if n not in self.moving]
        self.spare = dict(zip(self.moving, spare, strict=True))
        self.hosts = dict(hosts)
        self.net_board = net_board
        self.learns = True  # the staying nodes follow the run's peer board (their prepare answers say)
        self.under: dict[int, str] = {}  # each node's underlay address before the move
        self.orders: dict[int, str] = {}  # moving node -> its placement
        self.tokens = {n: secrets.token_hex(8) for n in self.staying}  # the staying nodes' entries at the barrier
        self.attempt = ""
        self.rebuild_gen = 0
        self.ponr = False

    @property
    def cancelled(self) -> bool:
        """A coordinator winding down cancels a migration only before its point of no return: past it, rolling
        back means ending the job, and going on takes seconds."""
        return self._cancelled and not self.ponr

    @cancelled.setter
    def cancelled(self, value: bool) -> None:
        self._cancelled = value

    def _decision(self, message: str) -> None:
        """A step of the migration, with its reason: an event of the snapshot (and of the drain's log)."""
        self.catalog.event("migrate", message, job=self.job, snapshot=self.sid)
        self.log(f"migration {self.sid}: {message}")

    def _underlays(self) -> dict[int, str]:
        """Each node's underlay address: what it posted on its run's peer board, else its host daemon's."""
        items = self.board.exchange(self.net_board, prefix="underlay/")["items"] if self.net_board else {}
        return {n: str(((items.get(f"underlay/{n}") or {}).get("value") or {}).get("ip") or "")
                or self.placements.underlay(self.hosts[n]) for n in self.nodes}

    # ---- the phases ------------------------------------------------------------------------------------------

    def prepare(self) -> None:
        def args(n: int) -> PrepareArgs:  # a staying node dumps nothing: no pre-copy there
            return PrepareArgs(mode=str(Mode.STOP), precopy=self.precopy) if n in self.moving else \
                PrepareArgs(mode=str(Mode.KEEP_RUNNING), precopy=False)

        out: Outcome[PrepareData] = self.gather(Op.PREPARE, args, self.deadline)
        self.gen = max([int(d["gen"]) for d in out.ok.values()] + [0])
        self.holds_net = any(bool(d.get("net", True)) for d in out.ok.values())
        self.learns = all(bool(d.get("learns")) for n, d in out.ok.items() if n in self.staying)
        self.under = self._underlays()
        missing = [f"host {self.spare[n]}" for n in self.moving if not self.placements.underlay(self.spare[n])]
        if self.holds_net and missing:  # known before anything is held: the overlay could not follow the move
            raise CaptureFailed(f"job {self.job!r} cannot be migrated", f"{', '.join(missing)} reported no underlay "
                                "address, which the job network's overlay needs",
                                "give `cryosleep host serve` --underlay IP there")

    def capture(self) -> None:
        if self.holds_net:  # from before the moving nodes' dump until the overlay follows them to the spare
            self.gather(Op.NET_HOLD, NoArgs(), self.deadline, nodes=self.staying)
        self.gather(Op.CAPTURE, CaptureArgs(mode=str(Mode.STOP), gen=self.next_gen()), self.deadline,
                    nodes=self.moving)

    def persist(self) -> None:
        out: Outcome[PersistData] = self.gather(
            Op.PERSIST, PersistArgs(mode=str(Mode.STOP), timeout_s=self.timeout_s, verify=True), self.deadline,
            nodes=self.moving)
        for n, d in out.ok.items():
            try:
                self.images[n] = ImageRef.from_json(d.get("image"))
            except ProtocolError as e:
                raise CaptureFailed(f"node {n} persisted no image", f"its answer's image: {e.why}",
                                    "the node agent is out of date?", node=n) from e
        self._save_nodes()
        self._decision(f"node(s) {', '.join(map(str, self.moving))}: image persisted and verified")

    def place(self) -> None:
        """One order per moving node; static overlay peers only when the staying nodes do not learn theirs."""
        for n in self.moving:
            peers: list[str] = []
            if not self.learns:
                peers = sorted({self.under[s] for s in self.staying if self.under.get(s)}
                               | {self.placements.underlay(self.spare[m]) for m in self.moving if m != n}
                               - {"", self.placements.underlay(self.spare[n])})
            self.orders[n] = self.placements.place_node(self.sid, n, self.spare[n], peers, self.timeout_s)
            self._decision(f"node {n}: ordered restored alone on host {self.spare[n]} (placement {self.orders[n]}), "
                           + (f"overlay peers {', '.join(peers)}" if peers else
                              "its overlay peers learned at its barrier"))

    def _spare_failed(self, n: int) -> str:
        """Why node ``n``'s restore on its spare failed ("" while it has not)."""
        st = self.placements.status(self.orders[n])
        if st["state"] == "failed":
            err = st["nodes"][0].get("error") or {}
            return f"{err.get('what')}: {err.get('why')}"
        items = self.board.exchange(self.sid, prefix=f"ready/{n}")["items"]
        v = (items.get(f"ready/{n}") or {}).get("value") or {}
        return "; ".join(v.get("problems") or ["failed"]) if v.get("ok") is False else ""

    def wait_checked(self) -> None:
        """Until every spare's restore passed its checks; a failure there, or the snapshot's deadline, raises."""
        todo = set(self.moving)
        while todo:
            got = self.board.exchange(self.sid, prefix="checked/", min_keys=len(self.moving), wait_s=1.0)["items"]
            for n in sorted(todo):
                why = self._spare_failed(n)
                if why:
                    raise CaptureFailed(f"node {n} of job {self.job!r} cannot be restored on host {self.spare[n]}",
                                        why, "the job runs on where it was; see the host daemon's log there")
                if f"checked/{n}" in got:
                    todo.discard(n)
                    self._decision(f"node {n}: its restore on host {self.spare[n]} passed its checks")
            if todo and time.monotonic() > self.deadline:
                raise CaptureFailed(f"the restore of node(s) {sorted(todo)} of job {self.job!r} on the spare did "
                                    "not pass its checks in time", f"nothing heard within {self.timeout_s:g} s",
                                    "is `cryosleep host serve` running there? the job runs on where it was")

    def stop_old(self) -> None:
        self.gather(Op.STOP, NoArgs(), self.deadline, nodes=self.moving)
        self.ponr = True
        self._decision(f"point of no return: node(s) {', '.join(map(str, self.moving))} ended on host(s) "
                       + ", ".join(sorted({self.hosts[n] for n in self.moving})))

    def switch(self, deadline: float) -> None:
        for n in self.moving:
            new = self.placements.underlay(self.spare[n])
            if self.net_board:  # the nodes following the board (NetPeers) must not bring the old address back
                self.board.exchange(self.net_board, {f"underlay/{n}": {"ip": new, "host": self.spare[n]}})
            if self.holds_net and self.staying:
                old = self.under.get(n, "")
                # a staying node on the spare's own network address (one machine) needs no overlay peer for it
                args = {s: NetPeersArgs(old=old, new="" if new == self.under.get(s) else new, nodes=[n])
                        for s in self.staying}
                self.gather(Op.NET_PEERS, args.__getitem__, deadline, nodes=self.staying)
                self._decision(f"node {n}: the staying nodes' overlay now sends to {new} (host {self.spare[n]})"
                               + (f" instead of {old}" if old and old != new else
                                  ", the address its old host had too" if old else ""))
        if self.holds_net and self.staying:
            self.gather(Op.NET_RELEASE, NoArgs(), deadline, nodes=self.staying)

    def _post_staying(self, ok: bool, problems: Sequence[str] = ()) -> None:
        gen = max(0, self.rebuild_gen - RESTORE_GEN_MARGIN)
        self.board.exchange(self.sid, {f"ready/{n}": {
            "ok": ok, "problems": list(problems), "gen": gen, "token": self.tokens[n], "host": self.hosts[n],
            "underlay": self.under.get(n, "")} for n in self.staying})

    def meet(self, deadline: float) -> None:
        """The staying nodes' word at the spares' barrier, posted until every spare passed it."""
        self.rebuild_gen = self.next_gen() + RESTORE_GEN_MARGIN
        self.gen = self.rebuild_gen  # every later command above it
        passed: dict[int, list[str]] = {}
        posted = 0.0
        while len(passed) < len(self.moving):
            if time.monotonic() - posted >= REPOST_S:
                self._post_staying(True)
                posted = time.monotonic()
            items = self.board.exchange(self.sid, prefix="ready/", wait_s=1.0)["items"]
            for n in self.moving:
                v = (items.get(f"ready/{n}") or {}).get("value") or {}
                if v.get("ok") is False:
                    raise CaptureFailed(f"node {n}'s restore on host {self.spare[n]} failed at its barrier",
                                        "; ".join(v.get("problems") or []), "see the host daemon's log there")
                if v.get("ok") is True and "passed" in v:
                    passed[n] = [str(t) for t in v["passed"]]
            if time.monotonic() > deadline:
                raise CaptureFailed("the spares' restores did not reach their barrier",
                                    f"node(s) {sorted(set(self.moving) - set(passed))} not ready in time",
                                    "see the host daemons' logs")
        self.attempt = attempt_of(next(iter(passed.values())))
        self._decision(f"every spare passed the barrier (attempt {self.attempt}); rebuilding at generation "
                       f"{self.rebuild_gen}")

    def rebuild(self, deadline: float) -> None:
        gen = self.rebuild_gen
        out: Outcome[ResumeData] = self.gather(Op.RESUME, ResumeArgs(gen=gen), deadline, nodes=self.staying)
        uids: dict[str, str] = {}
        for d in out.ok.values():
            uids.update({str(k): str(v) for k, v in d["uids"].items()})
        need = {n: [str(i) for i in d["need"]] for n, d in out.ok.items()}
        base = f"attempt/{self.attempt}/"
        prefix = f"{base}uid/{gen}/"
        if uids:
            self.board.exchange(self.sid, {prefix + i: u for i, u in uids.items()})
        wanted = sorted({i for ids in need.values() for i in ids if i not in uids})
        while wanted:
            items = self.board.exchange(self.sid, prefix=base, wait_s=1.0)["items"]
            failed = [v["value"] for k, v in items.items() if k.startswith(base + "failed/")]
            if failed:
                raise CaptureFailed("the NCCL communicators could not be rebuilt across nodes", "; ".join(
                    "; ".join(f.get("problems") or []) for f in failed), "see the host daemon's log on the spare")
            for i in [i for i in wanted if prefix + i in items]:
                uids[i] = str(items[prefix + i]["value"])
                wanted.remove(i)
            if wanted and time.monotonic() > deadline:
                raise CaptureFailed("the NCCL communicators could not be rebuilt across nodes",
                                    "no fresh id from the spare for communicator(s) " + ", ".join(wanted),
                                    "see the host daemon's log on the spare")
        self.gather(Op.RELAY, lambda n: RelayArgs(gen=gen, uids={i: uids[i] for i in need.get(n, [])}), deadline,
                    nodes=self.staying)
        self.gather(Op.RUN, GenArgs(gen=self.next_gen()), deadline, nodes=self.staying)
        self.resumed = True
        self.at_cut = False

    def wait_restored(self, deadline: float) -> None:
        for n in self.moving:
            st = self.placements.status(self.orders[n])
            while st["state"] not in ("done", "failed") and time.monotonic() < deadline:
                st = self.placements.status(self.orders[n], wait_s=min(20.0, max(0.0, deadline - time.monotonic())),
                                            seen=st["version"])
            if st["state"] != "done":
                raise CaptureFailed(f"node {n}'s restore on host {self.spare[n]} did not finish",
                                    self._spare_failed(n) or f"its order is {st['state']}",
                                    "see the host daemon's log there")
            r = st["nodes"][0].get("result") or {}
            phases = r.get("phases") or {}
            self._decision(f"node {n} restored on host {self.spare[n]} (init pid {r.get('init_pid')}; its restore's "
                           "phases: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()
                                                  if isinstance(v, (int, float))) + ")")

    # ---- the sequence ----------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        try:
            for state, phase, step in (("preparing", "prepare", self.prepare), ("draining", "drain", self.drain),
                                       ("quiescing", "quiesce", self.quiesce), ("capturing", "capture", self.capture),
                                       ("persisting", "persist", self.persist), ("migrating", "place", self.place)):
                self._state(state)
                with self.phases.phase(phase):
                    step()
            with self.phases.phase("checked"):
                self.wait_checked()
            with self.phases.phase("stop"):
                self.stop_old()
            deadline = time.monotonic() + self.cfg.rollback_s + self.timeout_s  # its own: the snapshot's is spent
            with self.phases.phase("switch"):
                self.switch(deadline)
            with self.phases.phase("barrier"):
                self.meet(deadline)
            with self.phases.phase("resume"):
                self.rebuild(deadline)
            with self.phases.phase("restored"):
                self.wait_restored(deadline)
            out = self.gather(Op.FINISH, NoArgs(), time.monotonic() + self.cfg.rollback_s, tolerant=True,
                              nodes=self.staying)
            for f in out.failed:
                self.catalog.event("migrate", f"node {f.node}: {f.why}", job=self.job, snapshot=self.sid)
            self._save_nodes()
            self._state("migrated")
            self.catalog.update_snapshot(self.sid, phases=self.phases.rounded(), finished=True)
        except Exception as e:
            err = e if isinstance(e, CryosleepError) else CaptureFailed(
                f"the migration of job {self.job!r} failed", f"{type(e).__name__}: {e}", "see the coordinator's log")
            self.error = err
            self._tell_spares(err)
            if self.ponr:
                self._abandon(err)
            else:
                self.rollback(err)
        finally:
            self.forget()
        return self.catalog.snapshot(self.sid)

    def _tell_spares(self, err: CryosleepError) -> None:
        """A spare's restore that was ordered stops at its barrier (or, past it, at the id relay)."""
        if not self.orders or not self.staying:
            return
        why = f"the migration failed: {err.what}" + (f" ({err.why})" if err.why else "")
        try:
            self._post_staying(False, [why])
            if self.attempt:
                self.board.exchange(self.sid, {f"attempt/{self.attempt}/failed/{self.staying[0]}": {
                    "host": self.hosts[self.staying[0]], "problems": [why]}})
        except CryosleepError as e:
            self.log(f"migration {self.sid}: the spares could not be told ({e.what})")

    def _abandon(self, err: CryosleepError) -> None:
        """Past the point of no return: the moved nodes are gone from their old host and did not come back on the
        spare; the staying nodes cannot go on without them."""
        self.rolling_back = True
        self.catalog.event("error", f"{err.what}: {err.why}" if err.why else err.what, job=self.job,
                           snapshot=self.sid)
        out = self.gather(Op.END, EndArgs(reason=f"migration {self.sid} failed past its point of no return"),
                          time.monotonic() + self.cfg.rollback_s, tolerant=True, nodes=self.staying)
        problems = [f"node {f.node}: {f.why}" for f in out.failed]
        err.details["rollback_problems"] = problems
        err.hint = ("the job was ended on every node: restore its last verified snapshot (`cryosleep coordinator "
                    "snapshots JOB --valid`)")
        self.catalog.event("ended", "the job was ended on every node still answering", job=self.job,
                           snapshot=self.sid)
        self._save_nodes()
        self.catalog.update_snapshot(self.sid, state="failed", reason=err.what, error=err.to_json(),
                                     phases=self.phases.rounded(), finished=True)
        self.catalog.set_job_state(self.job, "damaged")
        self.log(f"migration {self.sid}: failed past its point of no return ({err.what})")
