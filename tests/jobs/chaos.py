"""Faults at random moments, in the shape of CRIU's zdtm runs with fault injection: the victims and the judge.

One round: a real 2-rank gloo DDP job under `cryosleep run` (tests/jobs/harness.py), a keep-running snapshot
taken first (the fallback); then either a snapshot of a random mode, or (the restore as a target) a stop
snapshot and its restore, requested and, after a random delay, one random victim killed:

- in a snapshot: the agent, the dump's CRIU, a rank, a DataLoader worker (the demo's job, two workers per
  rank), the S3 server of the job's remote store, or the disk of the store and its staging filling up
  (tests/jobs/chaos_stage.py: a tmpfs of bounded size made for the round);
- in a restore: the restoring agent, the restore's CRIU, or the S3 server while the restore fetches.

A killed server is started again, a filled disk freed, once the snapshot or restore answered. The round is
judged against the contract:

- the job continues and its losses are bit-identical to an uninterrupted run's; or it ends (suspended in its
  stop snapshot, or lost/failed) and its newest snapshot restores and finishes bit-identically (after a failed
  restore: the same snapshot, restorable again);
- every snapshot listed for the job verifies;
- nothing is left behind on the host: no CRIU lock table naming the job's port, no CRIU of the round (dump or
  restore), no staging files, no process of the job (its recorded sandbox, or any process whose environment
  names the job), no mount under the round's home or store, the round's own filesystem unmountable.

A round is planned from its seed alone (what it aims at, mode, victim, delay after the request or after CRIU's
start); the moment the kill lands is observed (what the snapshot or restore was doing then), so a replay
repeats the plan, not the exact timing. ``bench/chaos.py`` runs many rounds and prints the table;
tests/jobs/test_chaos.py a bounded number in CI.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryosleep.capture import criu, criu_install, netlock
from cryosleep.core import proctree
from tests.jobs import chaos_stage
from tests.jobs.harness import Harness, criu_dumps, criu_restores, reference, workload

SCRIPT = workload("ddp_basic")
ARGS = ["--steps", "200", "--step-sleep", "0.05"]
# a DataLoader worker's rounds: the demo's job (two persistent workers per rank, a shuffling sampler)
LOADER_SCRIPT = workload("demo_train")
LOADER_ARGS = ["--steps", "300", "--step-sleep", "0.05", "--workers", "2"]
PHASES = ("snapshot", "restore")
SNAPSHOT_VICTIMS = ("agent", "criu", "rank", "worker", "s3", "disk")
RESTORE_VICTIMS = ("agent", "criu", "s3")  # the restoring agent, the restore's CRIU, the store mid-fetch
MODES = ("keep-running", "stop")
MAX_DELAY_S = 3.0  # a snapshot of this job takes 1-3 s on an idle machine: the kill lands anywhere in it
ANCHORS = ("request", "criu")  # the delay counts from the request, or from CRIU's start (however late)
RESTORE_SHARE = 0.3  # of the rounds, those whose target is a restore
STOP_SHARE = 0.2  # of the rounds whose victim is a process, those that stop it for a while rather than kill it
STOP_S = 5.0


@dataclass
class Plan:
    seed: int
    mode: str
    victim: str
    anchor: str
    delay: float
    phase: str = "snapshot"  # what the victim dies in: a snapshot, or a restore (of a stop snapshot)
    how: str = "kill"  # kill: SIGKILL; stop: SIGSTOP, then SIGCONT STOP_S later (a process, not a store)

    @classmethod
    def of(cls, seed: int) -> Plan:
        rng = random.Random(seed)
        phase = "restore" if rng.random() < RESTORE_SHARE else "snapshot"
        victim = rng.choice(RESTORE_VICTIMS if phase == "restore" else SNAPSHOT_VICTIMS)
        mode = rng.choice(MODES) if phase == "snapshot" else "stop"
        anchor = rng.choice(ANCHORS)
        if phase == "restore" and victim == "s3":
            anchor = "request"  # the fetch comes before CRIU
        top = MAX_DELAY_S if anchor == "request" else MAX_DELAY_S / 3
        delay = round(rng.uniform(0.0, top), 3)
        how = "stop" if victim not in ("s3", "disk") and rng.random() < STOP_SHARE else "kill"
        return cls(seed, mode, victim, anchor, delay, phase, how)

    def replay(self) -> str:
        return f"python bench/chaos.py --seed {self.seed} --rounds 1"

    def describe(self) -> str:
        what = f"{self.mode} snapshot" if self.phase == "snapshot" else "restore of a stop snapshot"
        verb = f"stopped for {STOP_S:g} s" if self.how == "stop" else "filled" if self.victim == "disk" else "killed"
        return f"{what}, {self.victim} {verb} at {self.anchor} + {self.delay} s"


def seed_for(base: int, victim: str, phase: str = "snapshot", anchor: str | None = None) -> int:
    """The first seed from ``base`` whose plan kills ``victim`` in ``phase`` (timed from ``anchor``, if given):
    the CI rounds, repeatable and each replayable by its seed alone."""
    seed = base
    while (p := Plan.of(seed)).victim != victim or p.phase != phase or anchor not in (None, p.anchor):
        seed += 1
    return seed


def job_of(plan: Plan) -> tuple[Path, list[str]]:
    return (LOADER_SCRIPT, LOADER_ARGS) if plan.victim == "worker" else (SCRIPT, ARGS)


@dataclass
class Result:
    plan: Plan
    moment: str = ""  # what the snapshot (or restore) was doing when the victim died
    killed: bool = False  # False: the victim was not there at that moment (no CRIU running)
    answer: str = ""  # the snapshot's (or restore's) answer: ok, or its error's "what"
    outcome: str = ""  # continued | suspended-restored | ended-restored
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def restoring_agents(sid: str, cli_pid: int) -> list[int]:
    """The daemon(s) forked by ``cryosleep restore --detach SID`` (the agent of the restored job), not the CLI."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != cli_pid:
            try:
                argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"cryosleep.cli.main" in argv and b"restore" in argv and sid.encode() in argv:
                out.append(int(d))
    return out


def of_job(name: str) -> list[int]:
    """Every process started for job ``name`` (its workers' environment names it), wherever it lives: a tree
    cut loose from its agent is found too."""
    key = f"CRYOSLEEP_JOB={name}".encode()
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if key in env:
                out.append(int(d))
    return out


def _moment(proc: subprocess.Popen[str], store: Path, phase: str) -> str:
    if proc.poll() is not None:
        return "after-answer"
    if phase == "restore":
        return "criu-restore" if criu_restores(store) else "before-criu"
    if criu_dumps(store):
        return "criu-dump"
    return "after-dump" if any(store.glob(".staging/*/nodes/0/dump.log")) else "before-dump"


def _kill(h: Harness, name: str, plan: Plan, stage: chaos_stage.Stage, proc: subprocess.Popen[str], sid: str,
          rng: random.Random) -> bool:
    if plan.victim in ("s3", "disk"):
        return stage.fault()
    _, st = h.job(name).read()
    if plan.victim == "agent":
        pids = restoring_agents(sid, proc.pid) if plan.phase == "restore" else [st.agent_pid]
    elif plan.victim == "criu":
        found = criu_restores(stage.store) if plan.phase == "restore" else criu_dumps(stage.store)
        pids = [p for p in found if ppid(p) not in found][:1]  # CRIU itself, not what it forked
    else:
        tree = proctree.tree(st.init_pid)
        ranks = [p for p in tree if ppid(p) == st.init_pid]
        pool = [p for p in tree if ppid(p) in ranks] if plan.victim == "worker" else tree[1:]
        pids = [rng.choice(pool)] if pool else []
    killed = False
    for p in pids:
        assert p > 0  # (0 would be this process's own group)
        try:
            os.kill(p, signal.SIGSTOP if plan.how == "stop" else signal.SIGKILL)
            killed = True
        except (ProcessLookupError, PermissionError):
            pass
    if killed and plan.how == "stop":
        threading.Timer(STOP_S, criu.continue_tasks, (pids,)).start()
    return killed


def _snapshots(h: Harness, name: str) -> list[dict[str, Any]]:
    return [s for s in h.ls() if s.get("job") == name]


def _settle(h: Harness, name: str, timeout: float = 60) -> str:
    """The job's state once the fault played out: ended (its state), or running and stepping (``running``), or
    its agent gone with its processes still running (``unsupervised``)."""
    end = time.monotonic() + timeout
    at = len(h.losses(name))
    while time.monotonic() < end:
        _, st = h.job(name).read()
        if st.state not in ("starting", "running", "lost"):
            return st.state
        if st.state == "lost":
            time.sleep(3.0)  # an armed watchdog kills the sandbox at once: give it the time
            return "unsupervised" if proctree.alive(st.init_pid) else "lost"
        if len(h.losses(name)) >= at + 3:  # (a job at its last step is waited for: it exits, or is suspended)
            return "running"
        time.sleep(0.1)
    return "stuck"


def _leftovers(h: Harness, name: str, store: Path, port: int) -> list[str]:
    left: list[str] = []
    nft = criu_install.locate().nft_argv
    for t in netlock.blocking(nft, port):
        left.append(f"CRIU lock table {t} on the host")
    if criu_dumps(store):
        left.append(f"CRIU dump processes {criu_dumps(store)}")
    if criu_restores(store):
        left.append(f"CRIU restore processes {criu_restores(store)}")
    staging = store / ".staging"
    if staging.is_dir() and any(staging.iterdir()):
        left.append(f"staging files {sorted(p.name for p in staging.iterdir())}")
    _, st = h.job(name).read()
    # live ones: the init of a job whose agent died is reaped by whoever adopts it, in its own time (seed 1001: the
    # init, a zombie a moment after the job ended unsupervised, gone soon after)
    if st.init_pid and (live := [p for p in proctree.tree(st.init_pid) if proctree.alive(p)]):
        left.append(f"processes of the job {live}")
    elif stray := of_job(name):
        left.append(f"processes of the job outside its recorded sandbox {stray}")
    return left


def _identical(h: Harness, name: str, plan: Plan) -> list[str]:
    ref = reference(*job_of(plan))
    bad = []
    for r in (0, 1):
        got = h.losses(name, r)
        if got != ref[r]:
            first = next((i for i, (a, b) in enumerate(zip(got, ref[r], strict=False)) if a != b),
                         min(len(got), len(ref[r])))
            bad.append(f"rank {r}'s losses differ from the uninterrupted run's at step {first} "
                       f"({len(got)} steps vs {len(ref[r])})")
    return bad


def _wait_gone(h: Harness, name: str, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        _, st = h.job(name).read()
        if not (st.init_pid and proctree.alive(st.init_pid)) and st.state != "running":
            return True
        time.sleep(0.1)
    return False


def _request(h: Harness, plan: Plan, name: str, stage: chaos_stage.Stage, sid: str) -> subprocess.Popen[str]:
    """The snapshot (or restore) the victim dies in, under way."""
    if plan.phase == "restore":
        args = ["restore", "--json", "--detach", *stage.store_flags, sid]
    else:
        args = ["snapshot", "--json", name, *(["--stop"] if plan.mode == "stop" else [])]
    return subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", *args], env=dict(h.env),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def _where(snap: dict[str, Any], stage: chaos_stage.Stage) -> tuple[str, ...]:
    """Where a listed snapshot is read from: its local copy, else the round's remote store."""
    return () if snap.get("local") else stage.store_flags


def _judge(h: Harness, plan: Plan, name: str, stage: chaos_stage.Stage, res: Result) -> None:
    """The contract, once the fault played out: the job goes on bit-identically, or its newest snapshot restores
    and trains on bit-identically; every snapshot listed verifies."""
    state = _settle(h, name)
    if state in ("running", "exited", "unsupervised"):
        res.outcome = "continued"
        if not _wait_gone(h, name, 600):
            res.problems.append("the job did not end")
        res.problems += _identical(h, name, plan)
    elif state in ("suspended", "lost", "failed"):
        res.outcome = "suspended-restored" if state == "suspended" else "ended-restored"
        snaps = _snapshots(h, name)
        if not snaps:
            res.problems.append(f"the job is {state} with no snapshot listed")
        else:
            newest = max(snaps, key=lambda s: s.get("created_at") or 0)
            try:
                h.cli_json("restore", "--detach", *_where(newest, stage), newest["snapshot"])
                if h.wait_end(name, timeout=600) != 0:
                    res.problems.append(f"the restored job failed: {h.job(name).read()[1].detail}")
                res.problems += _identical(h, name, plan)
            except AssertionError as e:
                res.problems.append(f"the restore of {newest['snapshot']} failed: {str(e)[-400:]}")
    else:
        res.outcome = state
        res.problems.append(f"the job is {state} after the fault (frozen or cut off)")
    for s in _snapshots(h, name):
        sid = s["snapshot"]
        if not h.cli_json("verify", *_where(s, stage), sid, check=False).get("ok"):
            res.problems.append(f"snapshot {sid} is listed but does not verify")


def run_round(h: Harness, plan: Plan) -> Result:
    """One round, judged. The job is ended whatever happens (nothing of a round outlives it)."""
    res = Result(plan)
    t0 = time.monotonic()
    rng = random.Random(plan.seed + 1)
    name = f"chaos-{plan.seed}"
    script, args = job_of(plan)
    stage = chaos_stage.make(h, plan.victim, plan.seed, plan.phase == "restore")
    try:
        h.run(name, script, args, flags=stage.run_flags)
        spec, _ = h.job(name).read()
        h.wait_step(name, 5, timeout=300)
        h.snapshot(name)  # the fallback
        sid = ""
        if plan.phase == "restore":  # the snapshot the restore is of: taken, verified, the job suspended in it
            sid = h.snapshot(name, "--stop")["snapshot"]
            if h.wait_end(name, timeout=300) != 75:
                raise AssertionError(f"the stop snapshot did not suspend the job: {h.job(name).read()[1].detail}")
            local = stage.store / "snapshots" / sid
            end = time.monotonic() + 120
            while stage.server is not None and local.exists():  # its restore fetches it from the server
                if time.monotonic() > end:
                    raise AssertionError(f"the local copy of {sid} was not removed after its upload")
                time.sleep(0.1)
        proc = _request(h, plan, name, stage, sid)
        if plan.anchor == "criu":
            end = time.monotonic() + 300
            find = criu_restores if plan.phase == "restore" else criu_dumps
            while time.monotonic() < end and proc.poll() is None and not find(stage.store):
                time.sleep(0.005)
        time.sleep(plan.delay)
        res.moment = _moment(proc, stage.store, plan.phase)
        res.killed = _kill(h, name, plan, stage, proc, sid, rng)
        try:
            out, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out = ""
            res.problems.append(f"the {plan.phase} did not answer in 300 s")
        res.answer = "ok" if proc.returncode == 0 else (out.split('"what": ', 1)[-1].split("\n", 1)[0][:160]
                                                        if out else "(no answer: its agent died)")
        stage.recover()  # the server back, the disk freed: the judge restores from there
        _judge(h, plan, name, stage, res)
        res.problems += _leftovers(h, name, stage.store, spec.master_port)
    except AssertionError as e:
        res.problems.append(str(e)[-600:])
    finally:
        try:
            h.kill_all(name)
        except Exception:
            pass
        for p in of_job(name):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            for s in _snapshots(h, name):
                h.cli("rm", s["snapshot"], check=False)
        except Exception:
            pass
        res.problems += chaos_stage.undo(h, stage)
        if left := chaos_stage.mounts_under(h.home, Path(h.env["CRYOSLEEP_STORE"])):
            res.problems.append(f"mounts left behind {left}")
        res.seconds = round(time.monotonic() - t0, 1)
    return res


def report(results: list[Result]) -> str:
    """The chaos table: victims x what they died in x moments x outcomes, with round counts."""
    rows: dict[tuple[str, str, str, str, str], int] = {}
    for r in results:
        what = r.plan.mode if r.plan.phase == "snapshot" else "restore"
        key = (r.plan.victim if r.killed else f"{r.plan.victim} (absent)", what, r.moment, r.outcome,
               "pass" if r.ok else "FAIL")
        rows[key] = rows.get(key, 0) + 1
    lines = ["| victim | in | moment | outcome | judged | rounds |", "|---|---|---|---|---|---|"]
    lines += [f"| {v} | {w} | {m} | {o} | {j} | {n} |" for (v, w, m, o, j), n in sorted(rows.items())]
    return "\n".join(lines)
