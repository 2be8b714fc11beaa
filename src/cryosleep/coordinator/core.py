"""The coordinator's logic without HTTP: agents registering and polling, clients triggering and reading snapshots,
one ``SnapshotRun`` per job at a time, and the recovery of what a previous coordinator left unfinished.
``service`` puts it behind the HTTP API; tests and the benchmark may also drive it directly.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryosleep.coordinator import drain as drain_rules
from cryosleep.coordinator.catalog import FINAL, Catalog
from cryosleep.coordinator.hub import Hub
from cryosleep.coordinator.machine import MachineConfig, RecoveryRun, SnapshotRun, new_snapshot_id
from cryosleep.coordinator.metrics import CoordinatorMetrics
from cryosleep.coordinator.migrate import MigrateRun
from cryosleep.coordinator.placement import Order, Placements
from cryosleep.coordinator.protocol import PROTOCOL_VERSION, Mode, Result, net_board
from cryosleep.coordinator.queue import Entry, RestoreQueue
from cryosleep.coordinator.rendezvous import Board
from cryosleep.coordinator.shared import SharedStore
from cryosleep.errors import Busy, CryosleepError, NotEligible, NotFound, ProtocolError, UsageError


@dataclass
class ServiceConfig:
    poll_wait_s: float = 20.0
    """The longest an agent's poll is held open (it polls again at once)."""
    lost_after_s: float = 15.0
    """An agent without a poll open, and without one for this long, is lost."""
    rollback_s: float = 120.0
    redeliver_s: float = 5.0
    """A command delivered but not answered is delivered again after this long (agents drop repeats)."""
    default_timeout_s: float = 600.0


def _stderr_log(msg: str) -> None:
    sys.stderr.write(f"cryosleep coordinator: {time.strftime('%H:%M:%S')} {msg}\n")


class Coordinator:
    """The service's logic, without HTTP (tests and the bench may drive it directly)."""

    def __init__(self, catalog: Catalog, cfg: ServiceConfig | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.catalog = catalog
        self.cfg = cfg or ServiceConfig()
        self.log: Callable[[str], None] = log or _stderr_log
        self.hub = Hub(self.cfg.redeliver_s)
        shared = SharedStore(catalog)  # written through, loaded back by a successor (coordinator/shared.py)
        self.board = Board(shared)  # multi-node restores meet here (coordinator/rendezvous.py)
        # host daemons, and snapshots placed on them (placement.py)
        self.placements = Placements(store=shared, on_lost=self._host_lost)
        self.queue = RestoreQueue(self.placements, catalog.snapshot, self._runs, self._busy_hosts, self._queue_event,
                                  shared)  # restores waiting for capacity (queue.py)
        self.lock = threading.Lock()
        self.active: dict[str, SnapshotRun] = {}  # job -> its snapshot in progress
        self.threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.machine_cfg = MachineConfig(lost_after_s=self.cfg.lost_after_s, rollback_s=self.cfg.rollback_s)
        self.metrics = CoordinatorMetrics()
        self.metrics.in_flight.set_function(lambda: float(len(self.active)))
        self.metrics.watch_hub(lambda: self.hub.stats(self.cfg.lost_after_s))
        self._recover()
        t = threading.Thread(target=self._flush_heartbeats, name="heartbeats", daemon=True)
        t.start()
        threading.Thread(target=self.queue.serve, kwargs={"log": self.log}, name="queue", daemon=True).start()

    def _host_lost(self, order: Order) -> None:
        """A node's order failed, its host lost before it started: the node's word at the restore's barrier
        (rendezvous.py), so that the other nodes' restores stop there at once, each saying why."""
        err = order.error or {}
        self.board.exchange(order.snapshot, {f"ready/{order.node_rank}": {
            "ok": False, "problems": [f"{err.get('what')} ({err.get('why')})"], "gen": 0,
            "token": f"lost-{order.id}", "host": order.host, "underlay": ""}})
        self.log(f"placement {order.placement}: {err.get('what')}")

    # ---- recovery after a restart ----------------------------------------------------------------------------

    def _recover(self) -> None:
        for row in self.catalog.unfinished():
            sid, job = str(row["id"]), str(row["job"])
            if not row.get("ponr_at") and row["state"] != "aborted":
                self.catalog.update_snapshot(sid, state="aborted", reason="the coordinator restarted during the "
                                             f"snapshot (it was {row['state']})")
            self.catalog.event("recover", f"found unfinished at start (state {row['state']})", job=job, snapshot=sid)
            nodes = {int(n["node_rank"]): str(n["agent"]) for n in row["nodes"]}
            incs = {str(n["agent"]): str(n.get("incarnation") or "") for n in row["nodes"]}
            run = RecoveryRun(self.catalog, self.hub, sid=sid, job=job, mode=Mode(row["mode"]), timeout_s=0.0,
                              nodes=nodes, incarnations=incs, cfg=self.machine_cfg, log=self.log, snapshot=row,
                              metrics=self.metrics)
            with self.lock:
                self.active[job] = run
            self._spawn(f"recover-{sid}", functools.partial(self._finish, job, run, run.recover))

    def _spawn(self, name: str, fn: Callable[[], None]) -> threading.Thread:
        t = threading.Thread(target=fn, name=name, daemon=True)
        self.threads.append(t)
        t.start()
        return t

    def _finish(self, job: str, run: SnapshotRun, fn: Callable[[], Any]) -> None:
        outcome = "error"
        try:
            fn()
            outcome = str(self.catalog.snapshot(run.sid)["state"])
        except Exception as e:  # never leave a job marked busy because of a bug
            self.log(f"snapshot {run.sid}: {type(e).__name__}: {e}")
        finally:
            self.metrics.snapshots.labels(str(run.mode), outcome).inc()
            with self.lock:
                if self.active.get(job) is run:
                    del self.active[job]
            run.finished.set()

    def _flush_heartbeats(self) -> None:
        while not self._stop.wait(2.0):
            try:
                self.catalog.touch(self.hub.drain_heartbeats())
            except Exception as e:  # the catalog may be closing
                self.log(f"heartbeats not recorded: {e}")

    def wind_down(self, timeout: float) -> list[str]:
        """Before a graceful stop: every snapshot in progress is cancelled and rolled back (its nodes resumed)
        while the HTTP server still serves the agents' polls; returns the ones that did not finish in time."""
        with self.lock:
            runs = list(self.active.values())
        for r in runs:
            r.cancelled = True
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if not self.active:
                    return []
            time.sleep(0.05)
        with self.lock:
            return [r.sid for r in self.active.values()]

    def close(self) -> None:
        self._stop.set()
        self.queue.close()
        self.hub.close()
        for r in list(self.active.values()):
            r.cancelled = True

    # ---- agents ----------------------------------------------------------------------------------------------

    def register(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            job = str(body["job"])
            nnodes = int(body["nnodes"])
            node_rank = int(body["node_rank"])
            incarnation = str(body["incarnation"])
        except (KeyError, ValueError, TypeError) as e:
            raise ProtocolError("a malformed registration", f"{type(e).__name__}: {e}",
                                "the agent and the coordinator speak different protocol versions?") from e
        if not 0 <= node_rank < nnodes:
            raise UsageError(f"node rank {node_rank} is outside 0..{nnodes - 1}", "", "check --node-rank and --nnodes")
        agent_id = f"{job}@{node_rank}"
        self.catalog.register(agent_id=agent_id, job=job, nnodes=nnodes, node_rank=node_rank,
                              incarnation=incarnation, hostname=str(body.get("hostname", "")),
                              address=str(body.get("address", "")), ranks=[int(r) for r in body.get("ranks") or ()],
                              facts=dict(body.get("facts") or {}), spec=dict(body.get("spec") or {}))
        self.hub.attach(agent_id, job, node_rank, incarnation)
        facts = body.get("facts") or {}
        if facts.get("restored_from"):  # a node restored by a placement's order, maybe: its word, should its host's
            self._restored(node_rank, str(facts["restored_from"]), {  # daemon not report it
                "job": facts.get("local_job"), "restored_from": facts["restored_from"], "agent": agent_id})
        return {"agent_id": agent_id, "poll_wait_s": self.cfg.poll_wait_s, "protocol": PROTOCOL_VERSION}

    def _restored(self, node_rank: int, image: str, registration: dict[str, Any]) -> None:
        for oid, sid in self.placements.running(node_rank):
            try:
                nodes = self.catalog.snapshot(sid).get("nodes") or ()
            except NotFound:
                continue
            if any(int(n["node_rank"]) == node_rank and (n.get("image") or {}).get("ref") == image for n in nodes):
                self.placements.agent_restored(oid, registration)

    def _unknown_agent(self, agent_id: str) -> NotFound:
        return NotFound(f"agent {agent_id!r} is not registered (or registered again since)",
                        "the coordinator restarted, or a newer incarnation of this agent registered",
                        "register again (POST /v1/agents/register)", reregister=True)

    def poll_args(self, body: dict[str, Any]) -> tuple[str, list[Result], float]:
        """A poll's incarnation, the results it carries and how long it may be held."""
        inc = str(body.get("incarnation", ""))
        results = [Result.from_json(r) for r in body.get("results") or ()]
        wait = min(max(0.0, float(body.get("wait_s", self.cfg.poll_wait_s))), self.cfg.poll_wait_s)
        return inc, results, wait

    def unknown_agent(self, agent_id: str) -> NotFound:
        return self._unknown_agent(agent_id)

    def leave(self, agent_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """The agent goes (its job ended on its node): counted out at once, with its reason."""
        reason = str(body.get("reason") or "its agent left")[:500]
        line = self.hub.line(agent_id)
        if line is None or not self.hub.leave(agent_id, str(body.get("incarnation", "")), reason):
            raise self._unknown_agent(agent_id)
        self.catalog.event("agent", f"node {line.node_rank} left: {reason}", job=line.job, node_rank=line.node_rank)
        return {"left": True}

    def results(self, agent_id: str, body: dict[str, Any]) -> dict[str, Any]:
        inc = str(body.get("incarnation", ""))
        n = 0
        for r in body.get("results") or ():
            if not self.hub.put_result(agent_id, inc, Result.from_json(r)):
                raise self._unknown_agent(agent_id)
            n += 1
        return {"accepted": n}

    # ---- clients ---------------------------------------------------------------------------------------------

    def _nodes(self, job: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for a in self.catalog.agents(job["name"]):
            age = self.hub.last_seen_age(a["id"])
            out.append({"node_rank": a["node_rank"], "agent": a["id"], "hostname": a["hostname"],
                        "address": a["address"], "ranks": a["ranks"], "registered_at": a["registered_at"],
                        "connected": age is not None, "alive": self.hub.alive(a["id"], self.cfg.lost_after_s),
                        "left": self.hub.left(a["id"]),
                        "last_seen_s": None if age is None else round(age, 3)})
        return out

    def job_status(self, name: str) -> dict[str, Any]:
        job = self.catalog.job(name)
        nodes = self._nodes(job)
        with self.lock:
            run = self.active.get(name)
        state = job["state"]
        if state == "running" and (len(nodes) < job["nnodes"] or not all(n["alive"] for n in nodes)):
            state = "incomplete" if len(nodes) < job["nnodes"] else "lost"
        return {"job": name, "nnodes": job["nnodes"], "state": state, "last_snapshot": job["last_snapshot"],
                "snapshot_in_progress": run.sid if run else None, "nodes": nodes,
                "ranks": sum(len(n["ranks"]) for n in nodes), "created_at": job["created_at"], "spec": job["spec"]}

    def jobs(self) -> list[dict[str, Any]]:
        return [self.job_status(j["name"]) for j in self.catalog.jobs()]

    def trigger(self, job: str, mode: str, timeout_s: float | None = None, request_id: str | None = None,
                wait: bool = False, precopy: bool = True) -> dict[str, Any]:
        try:
            m = Mode(mode)
        except ValueError:
            m = None
        if m is None or m is Mode.MIGRATE:  # a migration is a drain's (coordinator drain HOST), not a trigger's
            raise UsageError(f"unknown snapshot mode {mode!r}", "modes: keep-running, stop", "")
        timeout = float(timeout_s or self.cfg.default_timeout_s)
        if request_id:  # a retried request: the same snapshot, not a second one
            seen = self.catalog.by_request(job, request_id)
            if seen is not None:
                return self.wait_snapshot(seen["id"], timeout + self.cfg.rollback_s) if wait else seen
        status = self.job_status(job)
        with self.lock:
            self._idle(job, "wait for it to finish (`cryosleep coordinator snapshots JOB`), then try again")
            nodes = {int(n["node_rank"]): str(n["agent"]) for n in status["nodes"]}
            missing = sorted(set(range(status["nnodes"])) - set(nodes))
            lost = [n["node_rank"] for n in status["nodes"] if not n["alive"] and not n["left"]]
            left = [f"node {n['node_rank']}: {n['left']}" for n in status["nodes"] if n["left"]]
            if missing or lost or left:
                why = []
                if missing:
                    why.append(f"node(s) {missing} never registered")
                if lost:
                    why.append(f"the agents of node(s) {lost} are lost (no poll for {self.cfg.lost_after_s:g} s)")
                if left:
                    why.append("the agents left (" + "; ".join(left) + ")")
                hint = "start the missing node agents (or wait for them to reconnect), then try again"
                if left and not (missing or lost):
                    hint = "the job ended on those nodes: restore one of its snapshots to run it again"
                raise NotEligible(f"job {job!r} cannot be snapshotted now", "; ".join(why), hint)
            if status["state"] == "suspended":
                raise NotEligible(f"job {job!r} is suspended", f"in snapshot {status['last_snapshot']}",
                                  "restore it first")
            sid = new_snapshot_id(job)
            incs = {a: self.hub.incarnation(a) or "" for a in nodes.values()}
            self.catalog.create_snapshot(sid, job, str(m), timeout, request_id, nodes, incs)
            run = SnapshotRun(self.catalog, self.hub, sid=sid, job=job, mode=m, timeout_s=timeout, nodes=nodes,
                              incarnations=incs, cfg=self.machine_cfg, log=self.log, metrics=self.metrics)
            run.precopy = precopy
            self.active[job] = run
        plain = "" if precopy else ", no pre-copy"
        self.catalog.event("trigger", f"{m} snapshot requested (timeout {timeout:g} s{plain})", job=job, snapshot=sid)
        self._spawn(f"snapshot-{sid}", lambda: self._finish(job, run, run.run))
        if wait:
            return self.wait_snapshot(sid, timeout + self.cfg.rollback_s * 2)
        return self.catalog.snapshot(sid)

    def wait_snapshot(self, sid: str, timeout: float) -> dict[str, Any]:
        """Waits on the run's end (not by re-reading the catalog: a snapshot of 2,048 nodes has 2,048 rows)."""
        end = time.monotonic() + timeout
        while True:
            with self.lock:
                run = next((r for r in self.active.values() if r.sid == sid), None)
            if run is not None:
                run.finished.wait(max(0.0, end - time.monotonic()))
            row = self.catalog.snapshot(sid)
            done = row["state"] in FINAL and (row["ponr_at"] is None or row["finished_at"] is not None)
            with self.lock:
                running = any(r.sid == sid for r in self.active.values())
            if (done and not running) or time.monotonic() > end:
                return row
            time.sleep(0.02)

    def snapshots(self, job: str | None = None, valid_only: bool = False) -> list[dict[str, Any]]:
        if job:
            self.catalog.job(job)
        return self.catalog.snapshots(job, valid_only)

    def snapshot(self, sid: str) -> dict[str, Any]:
        row = self.catalog.snapshot(sid)
        row["events"] = self.catalog.events(snapshot=sid)
        return row

    def place(self, sid: str, hosts: list[str], timeout_s: float | None) -> dict[str, Any]:
        """Node I of snapshot ``sid`` restored on ``hosts[I]`` by its host daemon (coordinator/placement.py)."""
        if not hosts or not all(isinstance(h, str) and h for h in hosts):
            raise UsageError("no hosts given for the placement", "expected a list of host names, one per node, or "
                             "[\"auto\"]", "e.g. `cryosleep restore SNAPSHOT --nodes hostA,hostB` or `--nodes auto`")
        return self.placements.place(self.catalog.snapshot(sid), hosts,
                                     float(timeout_s or self.cfg.default_timeout_s),
                                     busy=self._busy_hosts() if hosts == ["auto"] else None)

    # ---- capacity: busy hosts, the restore queue, drains -------------------------------------------------------

    def _live_agents(self, job: str | None = None) -> list[dict[str, Any]]:
        return [a for a in self.catalog.agents(job) if self.hub.alive(a["id"], self.cfg.lost_after_s)]

    @staticmethod
    def host_of(agent: dict[str, Any]) -> str:
        """The host an agent runs on, by its host daemon's name (``$CRYOSLEEP_HOST``), else its host name."""
        return str((agent.get("facts") or {}).get("host") or agent["hostname"])

    def _busy_hosts(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for a in self._live_agents():
            out.setdefault(self.host_of(a), f"runs node {a['node_rank']} of job {a['job']}")
        return out

    def _runs(self, job: str, since: float) -> tuple[str, bool] | None:
        live = self._live_agents(job)
        if not live:
            return None
        where = ", ".join(f"node {a['node_rank']} on {self.host_of(a)}" for a in live)
        return f"job {job} runs ({where})", any(float(a["registered_at"]) > since for a in live)

    def _queue_event(self, e: Entry, message: str) -> None:
        self.catalog.event("queue", f"restore {e.id} of {e.snapshot}: {message}", job=e.job, snapshot=e.snapshot)
        self.log(f"queue: {e.id} ({e.snapshot}, job {e.job}, priority {e.priority}): {message}")

    def enqueue(self, sid: str, priority: int = 0, timeout_s: float | None = None,
                source: str = "restore") -> dict[str, Any]:
        """Snapshot ``sid`` restored on its own once free compatible hosts are there (coordinator/queue.py)."""
        return self.queue.enqueue(sid, int(priority), float(timeout_s or self.cfg.default_timeout_s), source)

    def drain(self, host: str, deadline_s: float | None = None) -> dict[str, Any]:
        """Every job with a node on ``host`` moved off it (coordinator/drain.py); the host takes no node from now
        on. Returns once every job's migration or stop snapshot ended (migrated, queued) or failed (the job still
        runs there)."""
        if not host or "/" in host:
            raise UsageError(f"invalid host name {host!r}", "a host's name is one path segment", "")
        deadline = float(deadline_s or self.cfg.default_timeout_s)
        self.placements.drain(host, f"drained at {time.strftime('%Y-%m-%d %H:%M:%S')}")
        self.catalog.event("drain", f"host {host} drained (deadline {deadline:g} s): it takes no node from now on")
        self.log(f"drain: host {host}: it takes no node from now on")
        on: dict[str, list[int]] = {}
        for a in self._live_agents():
            if self.host_of(a) == host:
                on.setdefault(str(a["job"]), []).append(int(a["node_rank"]))
        busy = self._busy_hosts()
        decisions: list[drain_rules.Decision] = []
        for job, nodes in sorted(on.items()):
            row = self.catalog.job(job)
            last = self.catalog.snapshot(row["last_snapshot"]) if row.get("last_snapshot") else {}
            images = {int(n["node_rank"]): n.get("image") or {} for n in last.get("nodes") or ()}
            try:
                spare = self.placements.pick({"id": f"{job} (its nodes on {host})",
                                              "nodes": [{"node_rank": r, "image": images.get(r, {})} for r in nodes]},
                                             busy)
                no_spare = ""
            except NotEligible as e:
                spare, no_spare = [], e.why
            d = drain_rules.decide(job, host, nodes, int(row["nnodes"]), spare, no_spare)
            decisions.append(d)
            busy.update(dict.fromkeys(d.spare, f"taken by the migration of job {job}"))
            self._drain_step(d, deadline)
        for d in decisions:
            if d.action == drain_rules.MIGRATE:
                # its own phases past the point of no return have a bound of their own (migrate.py)
                row = self.wait_snapshot(d.migration, 2 * deadline + self.cfg.rollback_s * 3)
                if row["state"] == "migrated":
                    d.outcome = "migrated"
                    self._drain_said(d, f"host {host}: job {d.job}: migrated (snapshot {d.migration}: "
                                     + ", ".join(f"node {n} now on {h}" for n, h in zip(d.nodes, d.spare, strict=True))
                                     + ")")
                    continue
                err = row.get("error") or {"what": f"the migration {d.migration} is {row['state']}"}
                if self.catalog.job(d.job)["state"] != "running":  # past its point of no return: nothing to save
                    d.outcome, d.error = "failed", err
                    self._drain_said(d, f"host {host}: job {d.job}: failed: {err.get('what')}")
                    continue
                drain_rules.fall_back(d, str(err.get("what")) + (f": {err['why']}" if err.get("why") else ""))
                self._drain_step(d, deadline)
        for d in decisions:
            if not d.snapshot or d.outcome != "pending":
                continue
            row = self.wait_snapshot(d.snapshot, deadline + self.cfg.rollback_s * 2)
            if row["state"] == "verified":
                entry = self.enqueue(d.snapshot, 0, None, f"drain {host}")
                d.entry, d.outcome = str(entry["id"]), "queued"
            else:
                d.outcome = "failed"
                d.error = row.get("error") or {"what": f"the stop snapshot {d.snapshot} is {row['state']}"}
                d.error = {**d.error, "hint": f"the job still runs on {host} (a failed snapshot leaves it running): "
                           f"drain again, or end it"}
            self._drain_said(d, f"host {host}: job {d.job}: {d.outcome}" + (
                f" (snapshot {d.snapshot}, queue entry {d.entry})" if d.entry else f": {(d.error or {}).get('what')}"))
        return {"host": host, "drained": True, "deadline_s": deadline, "jobs": [d.to_json() for d in decisions]}

    def _drain_said(self, d: drain_rules.Decision, msg: str) -> None:
        self.catalog.event("drain", msg, job=d.job, snapshot=(d.snapshot or d.migration) or None)
        self.log(f"drain: {msg}")

    def _drain_step(self, d: drain_rules.Decision, deadline: float) -> None:
        """The decision carried out (its migration, or its stop snapshot, started) and logged with its reasons."""
        try:
            if d.action == drain_rules.MIGRATE:
                d.migration = self.migrate(d.job, d.nodes, d.spare, deadline)
            else:
                d.snapshot = str(self.trigger(d.job, "stop", deadline,
                                              request_id=f"drain-{d.host}-{time.time():.0f}")["id"])
        except CryosleepError as e:
            if d.action == drain_rules.MIGRATE:  # not started: the job runs where it was
                drain_rules.fall_back(d, f"{e.what}: {e.why}" if e.why else e.what)
                self._drain_said(d, f"host {d.host}: job {d.job}: migrate: " + "; ".join(d.reasons))
                self._drain_step(d, deadline)
                return
            d.outcome, d.error = "failed", e.to_json()
        # shown with the snapshot's events too (`coordinator show SNAPSHOT`)
        self._drain_said(d, f"host {d.host}: job {d.job}: {d.action}: " + "; ".join(d.reasons))

    def _idle(self, job: str, hint: str) -> None:
        """Refuses (Busy) while a snapshot of ``job`` is in progress. Called under ``self.lock``."""
        busy = self.active.get(job)
        if busy is not None:
            raise Busy(f"a snapshot of job {job!r} is already in progress", f"snapshot {busy.sid}", hint)

    def migrate(self, job: str, moving: list[int], spare: list[str], timeout_s: float) -> str:
        """Nodes ``moving`` of ``job`` moved onto hosts ``spare`` while the others hold (coordinator/migrate.py);
        returns the migration's snapshot id (it runs on, in the background)."""
        status = self.job_status(job)
        with self.lock:
            self._idle(job, "wait for it to finish, then drain again")
            nodes = {int(n["node_rank"]): str(n["agent"]) for n in status["nodes"]}
            down = [n["node_rank"] for n in status["nodes"] if not n["alive"]]
            if len(nodes) < status["nnodes"] or down or status["state"] != "running":
                raise NotEligible(f"job {job!r} cannot be migrated now", f"it is {status['state']}" + (
                    f" (node(s) {down} not answering)" if down else ""), "start its missing node agents")
            hosts = {int(n["node_rank"]): str(a) for n in status["nodes"]
                     for a in [self.host_of(self.catalog.agent(str(n["agent"])) or {"hostname": n["hostname"]})]}
            run_id = str((status["spec"] or {}).get("run_id") or "")
            sid = new_snapshot_id(job)
            incs = {a: self.hub.incarnation(a) or "" for a in nodes.values()}
            self.catalog.create_snapshot(sid, job, str(Mode.MIGRATE), timeout_s, None, nodes, incs)
            run = MigrateRun(self.catalog, self.hub, self.board, self.placements, sid=sid, job=job,
                             timeout_s=timeout_s, nodes=nodes, incarnations=incs, moving=moving, spare=spare,
                             hosts=hosts, net_board=net_board(run_id) if run_id else "", cfg=self.machine_cfg,
                             log=self.log, metrics=self.metrics)
            self.active[job] = run
        self.catalog.event("trigger", f"migration of node(s) {moving} to {spare} (timeout {timeout_s:g} s)", job=job,
                           snapshot=sid)
        self._spawn(f"migrate-{sid}", lambda: self._finish(job, run, run.run))
        return sid

    def undrain(self, host: str) -> dict[str, Any]:
        was = self.placements.undrain(host)
        if was:
            self.catalog.event("drain", f"host {host} undrained: it takes nodes again")
        return {"host": host, "drained": False, "was_drained": was}
