"""Faults at random moments, in the shape of CRIU's zdtm runs with fault injection: the victims and the judge.

One round: a real 2-rank gloo DDP job under `cryosleep run` (tests/jobs/harness.py), a keep-running snapshot
taken first (the fallback), then a snapshot of a random mode requested and, after a random delay, one random
victim SIGKILLed: the agent, the dump's CRIU, or a rank. The round is judged against the contract:

- the job continues and its losses are bit-identical to an uninterrupted run's; or it ends (suspended in its
  stop snapshot, or lost/failed) and its newest snapshot restores and finishes bit-identically;
- every snapshot listed for the job verifies;
- nothing is left behind on the host: no CRIU lock table naming the job's port, no CRIU of the round, no
  staging files, no process of the job.

A round is planned from its seed alone (mode, victim, delay after the request or after CRIU's start); the
moment the kill lands is observed (what the snapshot was doing then: before its dump, in CRIU, after it, or
already answered), so a replay repeats the plan, not the exact timing. ``bench/chaos.py`` runs many rounds
and prints the table; tests/jobs/test_chaos.py a bounded number in CI.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryosleep.capture import criu_install, netlock
from cryosleep.core import proctree
from tests.jobs.harness import Harness, criu_dumps, reference, workload

SCRIPT = workload("ddp_basic")
ARGS = ["--steps", "200", "--step-sleep", "0.05"]
VICTIMS = ("agent", "criu", "rank")
MODES = ("keep-running", "stop")
MAX_DELAY_S = 3.0  # a snapshot of this job takes 1-3 s on an idle machine: the kill lands anywhere in it
ANCHORS = ("request", "criu")  # the delay counts from the snapshot's request, or from CRIU's start (however late)


@dataclass
class Plan:
    seed: int
    mode: str
    victim: str
    anchor: str
    delay: float

    @classmethod
    def of(cls, seed: int) -> Plan:
        rng = random.Random(seed)
        anchor = rng.choice(ANCHORS)
        top = MAX_DELAY_S if anchor == "request" else MAX_DELAY_S / 3
        return cls(seed, rng.choice(MODES), rng.choice(VICTIMS), anchor, round(rng.uniform(0.0, top), 3))

    def replay(self) -> str:
        return f"python bench/chaos.py --seed {self.seed} --rounds 1"


@dataclass
class Result:
    plan: Plan
    moment: str = ""  # what the snapshot was doing when the victim died
    killed: bool = False  # False: the victim was not there at that moment (no CRIU running)
    answer: str = ""  # the snapshot's answer: ok, or its error's "what"
    outcome: str = ""  # continued | suspended-restored | ended-restored
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _moment(snap: subprocess.Popen[str], store: Path) -> str:
    if snap.poll() is not None:
        return "after-answer"
    if criu_dumps(store):
        return "criu-dump"
    return "after-dump" if any(store.glob(".staging/*/nodes/0/dump.log")) else "before-dump"


def _kill(h: Harness, name: str, victim: str, store: Path, rng: random.Random) -> bool:
    _, st = h.job(name).read()
    if victim == "agent":
        pids = [st.agent_pid]
    elif victim == "criu":
        found = criu_dumps(store)
        pids = [p for p in found if _ppid(p) not in found][:1]  # CRIU itself, not what it forked
    else:
        pids = [rng.choice(proctree.tree(st.init_pid)[1:] or [0])]
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return False
    return bool(pids) and pids[0] > 0


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
        left.append(f"CRIU processes {criu_dumps(store)}")
    staging = store / ".staging"
    if staging.is_dir() and any(staging.iterdir()):
        left.append(f"staging files {sorted(p.name for p in staging.iterdir())}")
    _, st = h.job(name).read()
    if st.init_pid and proctree.tree(st.init_pid):
        left.append(f"processes of the job {proctree.tree(st.init_pid)}")
    return left


def _identical(h: Harness, name: str) -> list[str]:
    ref = reference(SCRIPT, ARGS)
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


def run_round(h: Harness, plan: Plan) -> Result:
    """One round, judged. The job is ended whatever happens (nothing of a round outlives it)."""
    res = Result(plan)
    t0 = time.monotonic()
    rng = random.Random(plan.seed + 1)
    name = f"chaos-{plan.seed}"
    store = Path(h.env["CRYOSLEEP_STORE"])
    try:
        h.run(name, SCRIPT, ARGS)
        spec, _ = h.job(name).read()
        h.wait_step(name, 5, timeout=300)
        h.snapshot(name)  # the fallback
        env = dict(h.env)
        snap = subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "snapshot", "--json", name,
                                 *(["--stop"] if plan.mode == "stop" else [])], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        if plan.anchor == "criu":
            end = time.monotonic() + 300
            while time.monotonic() < end and snap.poll() is None and not criu_dumps(store):
                time.sleep(0.005)
        time.sleep(plan.delay)
        res.moment = _moment(snap, store)
        res.killed = _kill(h, name, plan.victim, store, rng)
        try:
            out, _ = snap.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            snap.kill()
            out = ""
            res.problems.append("the snapshot did not answer in 300 s")
        res.answer = "ok" if snap.returncode == 0 else (out.split('"what": ', 1)[-1].split("\n", 1)[0][:160]
                                                        if out else "(no answer: its agent died)")
        state = _settle(h, name)
        if state in ("running", "exited", "unsupervised"):
            res.outcome = "continued"
            if not _wait_gone(h, name, 600):
                res.problems.append("the job did not end")
            res.problems += _identical(h, name)
        elif state in ("suspended", "lost", "failed"):
            res.outcome = "suspended-restored" if state == "suspended" else "ended-restored"
            snaps = _snapshots(h, name)
            if not snaps:
                res.problems.append(f"the job is {state} with no snapshot listed")
            else:
                newest = max(snaps, key=lambda s: s.get("created_at") or 0)
                try:
                    h.restore(newest["snapshot"])
                    if h.wait_end(name, timeout=600) != 0:
                        res.problems.append(f"the restored job failed: {h.job(name).read()[1].detail}")
                    res.problems += _identical(h, name)
                except AssertionError as e:
                    res.problems.append(f"the restore of {newest['snapshot']} failed: {str(e)[-400:]}")
        else:
            res.outcome = state
            res.problems.append(f"the job is {state} after the fault (frozen or cut off)")
        for s in _snapshots(h, name):
            sid = s["snapshot"]
            if not h.cli_json("verify", sid, check=False).get("ok"):
                res.problems.append(f"snapshot {sid} is listed but does not verify")
        res.problems += _leftovers(h, name, store, spec.master_port)
    except AssertionError as e:
        res.problems.append(str(e)[-600:])
    finally:
        try:
            h.kill_all(name)
        except Exception:
            pass
        for s in _snapshots(h, name):
            h.cli("rm", s["snapshot"], check=False)
        res.seconds = round(time.monotonic() - t0, 1)
    return res


def report(results: list[Result]) -> str:
    """The chaos table: victims x snapshot modes x moments x outcomes, with round counts."""
    rows: dict[tuple[str, str, str, str, str], int] = {}
    for r in results:
        key = (r.plan.victim if r.killed else f"{r.plan.victim} (absent)", r.plan.mode, r.moment, r.outcome,
               "pass" if r.ok else "FAIL")
        rows[key] = rows.get(key, 0) + 1
    lines = ["| victim | snapshot | moment | outcome | judged | rounds |", "|---|---|---|---|---|---|"]
    lines += [f"| {v} | {mode} | {m} | {o} | {j} | {n} |" for (v, mode, m, o, j), n in sorted(rows.items())]
    return "\n".join(lines)
