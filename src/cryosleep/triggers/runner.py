"""The agent's triggers: signals, preemption notices and the periodic policy, turned into snapshots.

    SIGTERM (with --grace)  a stop snapshot that aims to finish within the grace period (without --grace the
                            agent forwards SIGTERM to the workers, as before)
    SIGUSR1                 a stop snapshot (Slurm: ``#SBATCH --signal=B:USR1@120``), within --grace if given
    a preemption notice     a stop snapshot before the notice's deadline
    --snapshot-every        keep-running snapshots

Every snapshot goes through ``Agent.snapshot`` (which holds the agent's snapshot lock); what is decided and
what came of it goes to the agent's log, to ``<job dir>/decisions.jsonl`` and to the metrics. A stop that
cannot have its snapshot ends the job on its last complete snapshot when this run has one; otherwise a
SIGTERM is forwarded to the workers (the platform asked the job to end), and a notice or SIGUSR1 leaves the
job running (it may finish before the machine goes).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cryosleep import metrics, paths
from cryosleep.core import proctree
from cryosleep.core.job import JobDir, JobSpec, JobState
from cryosleep.errors import Busy, CryosleepError, NotFound
from cryosleep.store.local import LocalStore
from cryosleep.triggers import decisions, early, notices, schedule, slurm

TICK_S = 0.2


class JobHost(Protocol):
    """What the triggers need of the node agent that runs them (``cryosleep.agent.agent.Agent`` is one)."""

    @property
    def spec(self) -> JobSpec: ...
    @property
    def job(self) -> JobDir: ...
    @property
    def state(self) -> JobState: ...

    suspended_in: str | None
    """Set when the job is ended on an earlier snapshot: the job's record says it is suspended in it."""

    def snapshot(self, req: dict[str, Any], send: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Take a snapshot as the control socket's ``snapshot`` request does (raises Busy while one runs)."""

    def snapshot_busy(self) -> bool:
        """Whether a snapshot holds the job now."""

    def track(self, thread: threading.Thread) -> None:
        """A thread the agent waits for before it exits (a stop snapshot's bookkeeping and answer)."""

    def forward_signal(self, signum: int) -> None:
        """Deliver ``signum`` the agent's usual way: to the workers (a second one kills them)."""

    def log_line(self, msg: str) -> None: ...


@dataclass
class TriggerConfig:
    """What `cryosleep run` (or `restore`) was told about triggers and metrics."""

    every: float | None = None
    """--snapshot-every: keep-running snapshots this many seconds apart (None: no periodic snapshots)."""
    grace: float | None = None
    """--grace: SIGTERM leads to a stop snapshot due this many seconds later (None: SIGTERM is forwarded)."""
    notices: list[str] = field(default_factory=list)
    """--notices: the clouds whose preemption notices are watched; ["auto"] probes them."""
    notice_urls: dict[str, str] = field(default_factory=dict)
    """--notice-url SOURCE=URL: a notice endpoint's base URL instead of the documented one."""
    notice_interval: float = 5.0
    """--notice-interval: seconds between two polls of a notice endpoint."""
    metrics_port: int | None = None
    """--metrics-port: serve Prometheus metrics on this port (None: no metrics server)."""
    metrics_addr: str = "127.0.0.1"
    """--metrics-addr: the address the metrics server binds."""
    store: Path | None = None
    """Where triggered snapshots go (default: the default store)."""


class TriggerRunner:
    def __init__(self, agent: JobHost, config: TriggerConfig) -> None:
        self.agent = agent
        self.config = config
        self.log_path = decisions.path_for(agent.job.path)
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._stopping = False  # a stop (snapshot or fallback) is under way or done
        self._forwarded = False  # SIGTERM went to the workers: later signals take the agent's usual path
        self._seq = 0
        self._threads: list[threading.Thread] = []
        # Bound now, so that a port in use fails the start, not a detached agent later.
        self.metrics_server = (metrics.MetricsServer(config.metrics_addr, config.metrics_port)
                               if config.metrics_port is not None else None)

    # -- life ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Called by Agent.serve once the job runs."""
        if self.metrics_server is not None:
            self.metrics_server.start()
            host, port = self.metrics_server.address
            self._log(f"metrics on http://{host}:{port}/metrics")
        self._seed_metrics()
        if self.config.every:
            self._thread("periodic", self._periodic)
        if self.config.notices:
            self._thread("notices", self._notices)
        for signum in early.take():  # it came while the job was starting or being restored
            self._log(f"{signal.Signals(signum).name} came while the job was starting; acting on it now")
            self.on_signal(signum)

    @property
    def grace_s(self) -> float | None:
        return self.config.grace

    def close(self) -> None:
        self._halt.set()
        if self.metrics_server is not None:
            self.metrics_server.close()

    def _thread(self, name: str, target: Callable[[], None]) -> threading.Thread:
        t = threading.Thread(target=self._guarded(target), name=f"trigger-{name}", daemon=True)
        self._threads.append(t)
        t.start()
        return t

    def _guarded(self, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except Exception as e:  # a trigger that breaks must never take the agent down
                self._log(f"trigger thread failed: {type(e).__name__}: {e}")
        return run

    def _log(self, msg: str) -> None:
        self.agent.log_line(msg)

    def _store(self) -> LocalStore:
        return LocalStore(self.config.store or paths.default_store())

    def _history(self) -> list[schedule.PastSnapshot]:
        try:
            manifests = self._store().manifests(self.agent.spec.name)
        except (OSError, CryosleepError) as e:
            self._log(f"cannot read the job's previous snapshots: {e}")
            return []
        return [schedule.PastSnapshot(id=m.id, mode=m.mode, created_at=m.created_at, phases=m.phases,
                                      pause_s=m.pause_s, bytes=m.bytes, complete=m.complete) for m in manifests]

    def _seed_metrics(self) -> None:
        past = self._history()
        if past:
            last = max(past, key=lambda s: s.created_at)
            metrics.REGISTRY.since("cryosleep_last_snapshot_age_seconds", "Seconds since the last committed snapshot",
                                   last.created_at, job=self.agent.spec.name)

    # -- signals -------------------------------------------------------------------------------

    def on_signal(self, signum: int) -> bool:
        """From the agent's signal handler (main thread: must not block). True when handled here."""
        if self._forwarded:
            return False
        if signum == signal.SIGUSR1:
            deadline = time.time() + self.config.grace if self.config.grace else None
            self.begin_stop("sigusr1", deadline, "SIGUSR1 received (Slurm --signal=B:USR1@...)")
            return True
        if signum == signal.SIGTERM and self.config.grace is not None:
            self.begin_stop("sigterm", time.time() + self.config.grace,
                            f"SIGTERM received; --grace {self.config.grace:g} s")
            return True
        return False

    # -- stop ----------------------------------------------------------------------------------

    def begin_stop(self, trigger: str, deadline: float | None, detail: str,
                   done: Callable[[], None] | None = None) -> bool:
        """Start a stop in its own thread (which the agent waits for before it exits); False when one is
        already under way."""
        with self._lock:
            if self._stopping:
                self._log(f"{trigger}: {detail}; a stop is already under way, nothing more to do")
                return False
            self._stopping = True
        t = threading.Thread(target=self._guarded(lambda: self._stop(trigger, deadline, detail, done)),
                             name=f"stop-{trigger}", daemon=True)
        self.agent.track(t)
        t.start()
        return True

    def _stop(self, trigger: str, deadline: float | None, detail: str, done: Callable[[], None] | None) -> None:
        self._log(f"{trigger}: {detail}" + (f"; deadline in {deadline - time.time():.1f} s" if deadline else ""))
        while self.agent.snapshot_busy() and (deadline is None or time.time() < deadline):
            time.sleep(0.05)  # a keep-running snapshot is finishing; the stop comes right after it
        history = self._history()
        est = schedule.estimate_stop(history)
        st = self.agent.state
        fallback = schedule.pick_fallback(history, since=st.started_at, restored_from=st.restored_from)
        d = schedule.plan_stop(time.time(), deadline, est, fallback, trigger, detail)
        rid = self._decided(d)
        began = time.monotonic()
        outcome: dict[str, Any]
        if d.action == schedule.USE_LAST and fallback is not None:
            ended = self._end_on(fallback.id)
            outcome = {"outcome": "suspended-in-last", "snapshot": fallback.id} if ended else {"outcome": "job-ended"}
        else:
            try:
                result = self._snapshot({"stop": True, "timeout": d.timeout_s,
                                         "wait_upload": d.action != schedule.SNAPSHOT_NO_UPLOAD_WAIT}, trigger,
                                        deadline)
                outcome = {"outcome": "suspended", "snapshot": result["snapshot"], "pause_s": result.get("pause_s"),
                           "phases": result.get("phases")}
            except CryosleepError as e:
                outcome = {"error": e.to_json(), **self._after_failure(trigger, e)}
        took = time.monotonic() - began
        outcome["duration_s"] = round(took, 3)
        if deadline is not None:
            outcome["within_deadline"] = time.time() <= deadline
        self._outcome(rid, d, outcome)
        if outcome["outcome"] in ("suspended", "suspended-in-last"):
            if done is not None:
                done()
            self._slurm_requeue(trigger)

    def _slurm_requeue(self, trigger: str) -> None:
        """The job is suspended: in a Slurm batch job, ask Slurm to requeue it or not (triggers/slurm.py), one more
        decision in the log (trigger ``slurm``)."""
        jid = slurm.job_id()
        if jid is None:
            return
        job = slurm.describe(jid) if trigger != "sigterm" else slurm.SlurmJob(jid)
        choice = slurm.decide(trigger, job)
        rid = self._next_id()
        self._log(f"decision {rid}: slurm -> {choice.action} of job {jid}: {'; '.join(choice.reasons)}")
        decisions.append(self.log_path, {"event": "decided", "id": rid, "job": self.agent.spec.name, "trigger": "slurm",
                                         "mode": "stop", "action": choice.action, "reasons": choice.reasons,
                                         "at": time.time(), "detail": f"after the {trigger} stop",
                                         "slurm": slurm.to_json(job)})
        began = time.monotonic()
        outcome: dict[str, Any] = {"outcome": "not-requeued"}
        if choice.action == slurm.REQUEUE:
            ok, said = slurm.requeue(jid)
            outcome = {"outcome": "requeued" if ok else "requeue-failed", "detail": said}
            self._log(f"decision {rid}: slurm -> {outcome['outcome']} ({said})")
        decisions.append(self.log_path, {"event": "outcome", "id": rid, "at": time.time(),
                                         "duration_s": round(time.monotonic() - began, 3), **outcome})

    def _after_failure(self, trigger: str, e: CryosleepError) -> dict[str, Any]:
        """The stop snapshot failed (the job was resumed): what now."""
        st = self.agent.state
        if isinstance(e, NotFound) or not proctree.alive(st.init_pid):
            self._log(f"{trigger}: the job ended by itself while it was being stopped ({e.what})")
            return {"outcome": "job-ended"}
        fallback = schedule.pick_fallback(self._history(), since=st.started_at, restored_from=st.restored_from)
        if fallback is not None:
            self._log(f"{trigger}: the stop snapshot failed ({e.what}); ending the job on its last complete "
                      f"snapshot {fallback.id}")
            if self._end_on(fallback.id):
                return {"outcome": "suspended-in-last", "snapshot": fallback.id}
            return {"outcome": "job-ended"}
        if trigger == "sigterm":
            self._log(f"{trigger}: the stop snapshot failed ({e.what}) and there is no earlier snapshot; "
                      "forwarding SIGTERM to the workers")
            self._forwarded = True
            self.agent.forward_signal(signal.SIGTERM)
            return {"outcome": "failed-forwarded-sigterm"}
        self._log(f"{trigger}: the stop snapshot failed ({e.what}) and there is no earlier snapshot; the job goes "
                  "on running (it may end before the machine goes); another trigger may try again")
        with self._lock:
            self._stopping = False
        return {"outcome": "failed-job-running"}

    def _end_on(self, sid: str) -> bool:
        """End the job without a new snapshot: it is suspended in ``sid``. False when it had already ended."""
        init = self.agent.state.init_pid
        if not proctree.alive(init):
            return False
        self.agent.suspended_in = sid
        try:
            os.kill(init, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return True

    def _snapshot(self, req: dict[str, Any], trigger: str, deadline: float | None) -> dict[str, Any]:
        """Agent.snapshot, retried while another snapshot holds the job (up to the deadline for a stop)."""
        req = {**req, "store": str(self.config.store or paths.default_store())}
        stop = bool(req.get("stop"))

        def send(msg: dict[str, Any]) -> None:
            if stop and msg.get("event") == "phase" and msg.get("status") != "start":
                self._log(f"{trigger}: phase {msg.get('phase')} {msg.get('status')} in {msg.get('seconds') or 0:.2f} s")

        while True:
            try:
                result = self.agent.snapshot(req, send)
                break
            except Busy:
                if not stop or (deadline is not None and time.time() >= deadline):
                    raise
                time.sleep(0.05)
                if deadline is not None:
                    req["timeout"] = max(1.0, deadline - time.time() - schedule.MARGIN_S)
            except CryosleepError as e:
                metrics.record_failure(self.agent.spec.name, e.kind)
                raise
        metrics.record_snapshot_result(self.agent.spec.name, result, trigger)
        return result

    # -- the decision log ----------------------------------------------------------------------

    def _next_id(self) -> str:
        with self._lock:
            self._seq += 1
            return f"{os.getpid()}-{self._seq}"

    def _decided(self, d: schedule.TriggerDecision) -> str:
        rid = self._next_id()
        job = self.agent.spec.name
        left = f", {d.remaining_s:.1f} s left" if d.remaining_s is not None else ""
        est = f", estimate {d.estimate_s:.1f} s" if d.estimate_s is not None else ""
        self._log(f"decision {rid}: {d.trigger} -> {d.mode} {d.action}{left}{est}: {'; '.join(d.reasons)}")
        decisions.append(self.log_path, {"event": "decided", "id": rid, "job": job, **d.to_json()})
        metrics.record_decision(job, d.trigger, d.action)
        return rid

    def _outcome(self, rid: str, d: schedule.TriggerDecision, outcome: dict[str, Any]) -> None:
        what = outcome["outcome"] + (f" {outcome['snapshot']}" if outcome.get("snapshot") else "")
        if outcome.get("error"):
            what += f" ({outcome['error'].get('what')})"
        late = "" if outcome.get("within_deadline", True) else " AFTER the deadline"
        self._log(f"decision {rid}: {d.trigger} -> {what} in {outcome['duration_s']:.2f} s{late}")
        decisions.append(self.log_path, {"event": "outcome", "id": rid, "at": time.time(), **outcome})

    # -- the periodic policy -------------------------------------------------------------------

    def _periodic(self) -> None:
        every = float(self.config.every or 0)
        policy = schedule.Periodic.starting(every, time.time())
        seen = self.agent.state.last_snapshot
        while not self._halt.wait(TICK_S):
            if self._stopping:
                return
            now = time.time()
            if self.agent.state.last_snapshot != seen:  # a snapshot from elsewhere: a fresh image
                seen = self.agent.state.last_snapshot
                policy.snapshot_ended(now)
            action, reason = policy.decide(now, busy=self.agent.snapshot_busy())
            if action == "wait":
                continue
            d = schedule.TriggerDecision(trigger="periodic", mode="keep-running",
                                         action=schedule.SNAPSHOT if action == "take" else "skip", reasons=[reason],
                                         at=now, timeout_s=schedule.DEFAULT_TIMEOUT)
            rid = self._decided(d)
            if action == "skip":
                policy.skipped(now)
                self._outcome(rid, d, {"outcome": "skipped", "duration_s": 0.0})
                continue
            began = time.monotonic()
            outcome: dict[str, Any]
            try:
                result = self._snapshot({"stop": False, "timeout": d.timeout_s}, "periodic", None)
                outcome = {"outcome": "taken", "snapshot": result["snapshot"], "pause_s": result.get("pause_s")}
                seen = result["snapshot"]
            except Busy:
                outcome = {"outcome": "skipped", "detail": "another snapshot started first"}
            except CryosleepError as e:
                outcome = {"outcome": "failed", "error": e.to_json()}
            outcome["duration_s"] = round(time.monotonic() - began, 3)
            self._outcome(rid, d, outcome)
            policy.snapshot_ended(time.time())

    # -- preemption notices --------------------------------------------------------------------

    def _notices(self) -> None:
        sources = list(self.config.notices)
        if sources == ["auto"]:
            sources = notices.probe(self.config.notice_urls)
            self._log("notices: " + (f"watching {', '.join(sources)}" if sources else
                                     "no cloud metadata endpoint answers here; not watching for notices"))
        for source in sources:
            w = notices.make_watcher(source, self.config.notice_urls.get(source), interval=self.config.notice_interval)
            self._thread(f"notice-{source}", functools.partial(self._watch, w))

    def _watch(self, w: notices.Watcher) -> None:
        self._log(f"watching {w.source} preemption notices at {w.base} every {w.interval:g} s")
        n = w.watch(self._halt, self._log)
        if n is None:
            return
        self._log(f"{n.source} preemption notice: {n.detail}")
        self.begin_stop(f"notice:{n.source}", n.deadline, n.detail, done=lambda: w.done(n, self._log))
