"""The chaos suite's multi-node rounds: two simulated hosts (tests/jobs/hosts.py), a 2 nodes x 2 ranks gloo DDP
job on the job network, snapshotted through a real coordinator on host A.

One round: a keep-running snapshot through the coordinator first (the fallback); then a snapshot of a random
mode asked of the coordinator and, after a random delay, one victim SIGKILLed: the coordinator (started again
on the same address and catalog a second later), one node's agent, a CRIU of either node's dump, or one node's
rank. Or (the host daemon as a victim) a stop snapshot, then its restore placed through both hosts' daemons
(`host serve`, `restore ID --nodes`), one daemon SIGKILLed during it. Judged as the one-node rounds are
(tests/jobs/chaos.py), for the job as a whole: both nodes go on and all four ranks' losses are bit-identical to
an uninterrupted run's, or both end (never one half running) and the newest valid snapshot restores on both
hosts and trains on bit-identically; every valid snapshot's node images verify; nothing is left on either host
(a CRIU lock table naming the job's port, the job network's bridge or VXLAN once the job ended, a CRIU or a
process of the job, staging files).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryosleep.capture import criu_install, netlock
from cryosleep.core import proctree
from cryosleep.net import Host, job_net
from tests.jobs import chaos
from tests.jobs.coordinated import Coordinator
from tests.jobs.harness import criu_dumps, criu_restores, reference, workload
from tests.jobs.hosts import UNDERLAY, HostHarness, restore_pair, start_host_daemon, two_hosts

ARGS = ["--steps", "300", "--step-sleep", "0.05"]
VICTIMS = ("coordinator", "agent", "criu", "rank", "host-daemon")


@dataclass
class MnPlan(chaos.Plan):
    node: int = 0  # the node whose agent, rank or host daemon dies

    @classmethod
    def of(cls, seed: int) -> MnPlan:
        rng = random.Random(seed)
        victim = rng.choice(VICTIMS)
        mode = "stop" if victim == "host-daemon" else rng.choice(chaos.MODES)
        phase = "restore" if victim == "host-daemon" else "snapshot"
        return cls(seed, mode, victim, "request", round(rng.uniform(0.0, chaos.MAX_DELAY_S), 3), phase,
                   rng.choice((0, 1)))

    def replay(self) -> str:
        return f"python bench/chaos.py --multinode --seed {self.seed} --rounds 1"

    def describe(self) -> str:
        who = self.victim if self.victim in ("coordinator", "criu") else f"node {self.node}'s {self.victim}"
        what = f"{self.mode} snapshot" if self.phase == "snapshot" else "restore through the host daemons"
        return f"two nodes, {what}, {who} at request + {self.delay} s"


def seed_for(base: int, victim: str) -> int:
    seed = base
    while MnPlan.of(seed).victim != victim:
        seed += 1
    return seed


class _Round:
    def __init__(self, ha: HostHarness, hb: HostHarness, coord: Coordinator, plan: MnPlan, store: Path) -> None:
        self.hosts = (ha, hb)
        self.coord = coord
        self.plan = plan
        self.store = store
        self.name = f"mnc{plan.seed}"
        self.nodes = (f"{self.name}.node0", f"{self.name}.node1")

    def states(self) -> list[str]:
        return [self.hosts[0].state(n) for n in self.nodes]

    def live(self) -> list[bool]:
        """Per node: its workers run (supervised, or on after their agent died: ``lost`` with a live init)."""
        out = []
        for n in self.nodes:
            st = self.hosts[0].job(n).read()[1]
            out.append(st.state in ("starting", "running") or (st.state == "lost" and proctree.alive(st.init_pid)))
        return out

    def valid(self) -> list[str]:
        """The job's valid snapshots, oldest first, asked as an operator would: host A's CLI, from inside host A's
        network namespace, where the coordinator listens."""
        return [str(s["id"]) for s in self.hosts[0].coordinator("snapshots", self.name, "--valid")]

    def detail(self, sid: str) -> dict[str, Any]:
        out: dict[str, Any] = self.hosts[0].coordinator("show", sid)
        return out

    def steps(self) -> int:
        return min(len(self.hosts[0].losses(self.nodes[0], 0)), len(self.hosts[0].losses(self.nodes[1], 2)))

    def cli(self, *args: str) -> subprocess.Popen[str]:
        ha = self.hosts[0]
        return subprocess.Popen([*ha.prefix, sys.executable, "-m", "cryosleep.cli.main", *args], env=ha.env,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def kill(self, daemons: list[subprocess.Popen[str]]) -> bool:
        h, p = self.hosts[0], self.plan
        st = h.job(self.nodes[p.node]).read()[1]
        if p.victim == "coordinator":
            self.coord.kill()
            time.sleep(1.0)
            self.coord.start()
            return True
        if p.victim == "host-daemon":
            pids = [daemons[p.node].pid]
        elif p.victim == "agent":
            pids = [st.agent_pid]
        elif p.victim == "criu":
            found = criu_dumps(self.store)
            pids = [x for x in found if chaos.ppid(x) not in found][:1]
        else:
            tree = proctree.tree(st.init_pid)
            pids = [random.Random(p.seed + 1).choice(tree[1:])] if tree[1:] else []
        try:
            for pid in pids:
                assert pid > 0  # (0 would be this process's own group)
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return False
        return bool(pids)

    def settle(self, timeout: float = 240) -> str:
        """``running`` (both nodes stepping), ``ended`` (both ended), or ``half`` (one running, one not)."""
        end = time.monotonic() + timeout
        at = self.steps()
        while time.monotonic() < end:
            live = self.live()
            if not any(live):
                return "ended"
            if all(live) and self.steps() >= at + 3:
                return "running"
            time.sleep(0.2)
        return "half" if any(self.live()) else "ended"

    def identical(self) -> list[str]:
        ref = reference(workload("ddp_basic"), ARGS, nproc=4)
        bad = []
        for r in range(4):
            got = self.hosts[0].losses(self.nodes[r // 2], r)
            if got != ref[r]:
                first = next((i for i, (a, b) in enumerate(zip(got, ref[r], strict=False)) if a != b),
                             min(len(got), len(ref[r])))
                bad.append(f"rank {r}'s losses differ from the uninterrupted run's at step {first}")
        return bad

    def wait_ended(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not any(self.live()):
                return True
            time.sleep(0.2)
        return False

    def leftovers(self, port: int) -> list[str]:
        left: list[str] = []
        nft = criu_install.locate().nft_argv
        ended = not any(self.live())
        for i, h in enumerate(self.hosts):
            if nft:
                for t in netlock.blocking([*h.prefix, *nft], port):
                    left.append(f"CRIU lock table {t} on host {'AB'[i]}")
            if ended:
                host = Host(h.ns_pid)
                names = {x["ifname"] for x in host.links()}
                for n in (0, 1):
                    net = job_net(f"{self.name}-run", n, 2)
                    if {net.bridge, net.vxlan} & names:
                        left.append(f"the job network ({net.bridge}, {net.vxlan}) on host {'AB'[i]}, its bridge's "
                                    f"ports {host.bridge_ports(net.bridge)}")
                        break
        if criu_dumps(self.store) or criu_restores(self.store):
            left.append(f"CRIU processes {criu_dumps(self.store) + criu_restores(self.store)}")
        staging = self.store / ".staging"
        if staging.is_dir() and any(staging.iterdir()):
            left.append(f"staging files {sorted(p.name for p in staging.iterdir())}")
        for n in self.nodes:
            if stray := chaos.of_job(n):
                left.append(f"processes of {n} {stray}")
        return left


def run_round(home: Path, plan: MnPlan, tmp: Path) -> chaos.Result:
    """One multi-node round, judged; both hosts and the coordinator are gone afterwards."""
    res = chaos.Result(plan)
    t0 = time.monotonic()
    store = Path(os.environ["CRYOSLEEP_STORE"])
    work = tmp / f"mn-{plan.seed}"
    work.mkdir(parents=True, exist_ok=True)
    name = f"mnc{plan.seed}"
    try:
        with two_hosts(home, (f"{name}.node0", f"{name}.node1")) as (ha, hb):
            coord = Coordinator(work, "0.0.0.0:0", prefix=tuple(ha.prefix))
            try:
                url = f"http://{UNDERLAY[0]}:{coord.url.rsplit(':', 1)[1]}"
                for h in (ha, hb):
                    h.env = coord.env({**h.env, "CRYOSLEEP_COORDINATOR": url})
                _play(_Round(ha, hb, coord, plan, store), url, res)
            finally:
                for n in (f"{name}.node0", f"{name}.node1"):
                    try:
                        if ha.job(n).exists():
                            ha.kill_all(n)
                    except Exception:
                        pass
                coord.stop()
    except AssertionError as e:
        res.problems.append(str(e)[-600:])
    res.seconds = round(time.monotonic() - t0, 1)
    return res


def _play(r: _Round, url: str, res: chaos.Result) -> None:
    ha, hb = r.hosts
    plan = r.plan
    port = 29000 + plan.seed % 1000
    ha.run_node(r.name, 0, port, url, ARGS)
    hb.run_node(r.name, 1, port, url, ARGS)
    ha.wait_step(r.nodes[0], 8, timeout=300)
    keep = ha.coordinator("snapshot", r.name)
    if keep["state"] != "verified":
        raise AssertionError(f"the fallback snapshot failed: {keep.get('error')}")
    daemons: list[subprocess.Popen[str]] = []
    try:
        if plan.victim == "host-daemon":
            stop = ha.coordinator("snapshot", r.name, "--stop")
            if stop["state"] != "verified" or not r.wait_ended(120):
                raise AssertionError(f"the stop snapshot did not suspend the job: {stop.get('error')}")
            daemons = [start_host_daemon(h, n, url) for h, n in ((ha, "hostA"), (hb, "hostB"))]
            proc = r.cli("restore", stop["id"], "--nodes", "hostA,hostB", "--json")
        else:
            proc = r.cli("coordinator", "snapshot", r.name, "--json", *(["--stop"] if plan.mode == "stop" else []))
        time.sleep(plan.delay)
        res.moment = ("after-answer" if proc.poll() is not None else "criu-dump" if criu_dumps(r.store)
                      else "criu-restore" if criu_restores(r.store) else "before-criu")
        res.killed = r.kill(daemons)
        try:
            out, _ = proc.communicate(timeout=400)
            res.answer = "ok" if proc.returncode == 0 else out[-160:]
        except subprocess.TimeoutExpired:
            proc.kill()
            res.problems.append("the request did not answer in 400 s")
    finally:
        for d in daemons:
            d.send_signal(signal.SIGKILL)
            d.wait()
    state = r.settle()
    if state == "running":
        res.outcome = "continued"
        if not r.wait_ended(600):
            res.problems.append("the job did not end")
        res.problems += r.identical()
    elif state == "ended":
        res.outcome = "ended-restored"
        valid = r.valid()
        if not valid:
            res.problems.append("the job ended with no valid snapshot")
        else:
            newest = valid[-1]  # the catalog lists them oldest first
            try:
                restore_pair(newest, ha, hb)
                if not r.wait_ended(600):
                    res.problems.append("the restored job did not end")
                res.problems += r.identical()
            except AssertionError as e:
                res.problems.append(f"the restore of {newest} failed: {str(e)[-400:]}")
    else:
        res.outcome = "half"
        res.problems.append(f"one node of the job is running, the other not: {r.states()} {r.live()}")
    for sid in r.valid():
        for i, n in enumerate(r.detail(sid)["nodes"]):
            if not ha.cli_json("verify", n["image"]["ref"], check=False).get("ok"):
                res.problems.append(f"snapshot {sid} is valid but node {i}'s image does not verify")
    res.problems += r.leftovers(port)

