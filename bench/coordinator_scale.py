"""The coordinator at scale: simulated node agents and ranks, real HTTP, real SQLite (docs/benchmarks.md).

    .venv/bin/python bench/coordinator_scale.py [--nodes 128] [--nproc 8] [--reps 5] [--agent-procs 4]

Starts the coordinator as `cryosleep coordinator serve` in its own process, then ``--nodes`` simulated node agents
(``tests/coordinator/sim.py``'s nodes, run by ``tests/coordinator/simloop.py``: one event loop per process, the
same protocol; ``--agent-runner threads`` runs each with the real agent's ``client.AgentRunner``, a poll thread
and a thread per command, several times the CPU) spread over ``--agent-procs`` processes, with ``--nproc`` ranks
each. ``--coordinator-cpus 0 --agents-cpus 1`` gives each side cores of its own. Every rank is in two
communicators (its node's and the job-wide one) and the ranks start up to ``--spread`` calls apart, so the drain
needs rounds: ranks behind run on, ranks held short of the cut get their held call added. Capture and persist are
simulated (~0 s), so what is measured is the protocol: commands fanned out to every agent by long poll, results
back, the cut computed over every rank's counters, the catalog written.

Per keep-running snapshot it reports the snapshot's phase times as the coordinator recorded them (prepare, drain =
one cut, quiesce, capture, resume, persist), the drain's rounds, the rounds of commands in all
(``requests_rounds``: one command to every node and its answers each, from the coordinator's ``round_seconds``
counts), the total, and the coordinator process's own CPU time: per phase (its /metrics:
``cryosleep_coordinator_phase_cpu_seconds_total``) and in all (/proc/PID/stat, the whole snapshot); the simulated
agents' processes' CPU over the same snapshot (on a machine of few cores, what the wall time waits for when it is
more than the coordinator's); the fan-out is one ``run`` round (a command with nothing to do for a simulated
agent, to every agent, and every answer back; rounds before 2026-12-03 measured ``net_hold``, which agents that
hold their network in the capture command no longer get). Then one stop snapshot. Every cut is checked: every
member of every communicator at the same count in the persisted images. The agents' processes run at
``--agents-nice`` (10): they stand in for other machines, and on the same cores their thousands of threads would
starve the coordinator's event loop, one thread, of its share; and the coordinator counts an agent lost only after
``--lost-after`` (120 s): 2,048 simulated agents on two shared cores can go longer than the default 15 s between
polls.

``--relays R`` starts R relays (``cryosleep coordinator relay``, each its own process, at ``--relays-nice``, on
the agents' CPUs: they stand in for machines next to the nodes) and spreads the nodes over them in contiguous
groups, each agent given ``RELAY_URL,COORDINATOR_URL``; the relays' CPU is reported on its own, and the
coordinator's requests per snapshot by route (``requests``: its /metrics' requests_total).

``--coordinator-src DIR`` runs the coordinator from another source tree (the baseline: an older commit's
``src``, e.g. ``git archive main src | tar -x -C /tmp/old``), the agents from this one. A coordinator of protocol 2
asks for no summary in the drain's commands: this tree's agents answer it with every rank's views, as its own
agents did. A coordinator older than protocol 2 cannot read this tree's agents' counters: run the whole
benchmark with ``PYTHONPATH=OLD/src`` then (the agents' client and wire format from the old tree, the simulated
agents still this tree's tests/coordinator/sim.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.coordinator.sim: test-only code

from cryosleep.coordinator.client import CoordinatorClient
from tests.coordinator.sim import SimCluster
from tests.coordinator.simloop import LoopAgents

PHASES = ["prepare", "drain", "quiesce", "capture", "resume", "persist"]
TICK = os.sysconf("SC_CLK_TCK")


def check_cut(store: Path, sid: str, nproc: int) -> None:
    seen: dict[tuple[str, int], set[int]] = {}
    for p in (store / sid).glob("node-*.json"):
        for r, seq in json.loads(p.read_text())["ranks"].items():
            node = int(r) // nproc
            for ident, n in seq.items():
                key = (ident, node) if ident.startswith("0de") else (ident, -1)
                seen.setdefault(key, set()).add(n)
    bad = {k: v for k, v in seen.items() if len(v) != 1}
    if bad or not seen:
        raise SystemExit(f"snapshot {sid}: inconsistent cut {bad}" if bad else f"snapshot {sid}: no images")


def rounds(client: CoordinatorClient, sid: str) -> int:
    for e in client.snapshot_detail(sid)["events"]:
        m = re.search(r"after (\d+) round", e["message"]) if e["kind"] == "cut" else None
        if m:
            return int(m.group(1))
    return -1


def proc_cpu(pid: int) -> tuple[float, float]:
    """A process's user and system CPU seconds, every thread."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def scrape(url: str, token: str) -> dict[str, float] | None:
    """The coordinator's per-phase CPU counters and per-op round sums/counts (None: an older coordinator)."""
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {token}"})
    try:
        text = urllib.request.urlopen(req, timeout=60).read().decode()
    except Exception:
        return None
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "cryosleep_coordinator_phase_cpu_seconds_total":
                out[f"cpu:{s.labels['phase']}"] = s.value
            elif s.name in ("cryosleep_coordinator_polls_open", "cryosleep_coordinator_agents_alive"):
                out[s.name.rsplit("_", 2)[1]] = s.value
            elif s.name in ("cryosleep_coordinator_relay_results_total", "cryosleep_coordinator_relay_commands_total"):
                out[f"{s.name.split('_')[3]}:{s.labels['how']}"] = s.value
            elif s.name == "cryosleep_coordinator_requests_total":
                k = f"req:{s.labels['route']}"
                out[k] = out.get(k, 0.0) + s.value
            elif s.name in ("cryosleep_coordinator_round_seconds_sum", "cryosleep_coordinator_round_seconds_count"):
                out[f"{s.name.rsplit('_', 1)[1]}:{s.labels['op']}"] = s.value
    return out


def cpus(text: str) -> set[int]:
    """A CPU list as taskset takes it: 0,2-3."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def agents_main(a: argparse.Namespace) -> int:
    """One process of simulated agents (--agents-of LO:HI): registers, serves, ends when stdin closes."""
    lo, hi = (int(x) for x in a.agents_of.split(":"))
    token = Path(a.token_file).read_text().strip()
    relays = a.relay_urls.split("|") if a.relay_urls else []
    via = {n: f"{relays[n * len(relays) // a.nodes]},{a.url}" for n in range(lo, hi)} if relays else None
    cluster: SimCluster | LoopAgents
    if a.agent_runner == "threads":
        if relays:
            raise SystemExit("--relays takes the event-loop agents (--agent-runner loop)")
        cluster = SimCluster(a.url, token, Path(a.store), job="scale", nnodes=a.nodes, nproc=a.nproc, spread=a.spread,
                             seed=1, only=range(lo, hi)).start(timeout=600)
    else:
        cluster = LoopAgents(a.url, token, Path(a.store), job="scale", nnodes=a.nodes, nproc=a.nproc, spread=a.spread,
                             seed=1, only=range(lo, hi), via=via).start(timeout=600)
    print("ready", flush=True)
    sys.stdin.read()
    cluster.close()
    return 0


def agents_setup(a: argparse.Namespace) -> None:
    """In a process of simulated agents before it starts: its priority and its CPUs."""
    os.setpriority(os.PRIO_PROCESS, 0, max(a.agents_nice, os.getpriority(os.PRIO_PROCESS, 0)))
    if a.agents_cpus:
        os.sched_setaffinity(0, a.agents_cpus)


def start_relay(a: argparse.Namespace, url: str, token: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """One ``coordinator relay`` process (this tree's), with the admin token as its credential; its URL."""
    gather = ["--gather-ms", str(a.gather_ms)] if a.gather_ms is not None else []

    def setup() -> None:
        os.setpriority(os.PRIO_PROCESS, 0, a.relays_nice)
        if a.agents_cpus:
            os.sched_setaffinity(0, a.agents_cpus)

    p = subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "coordinator", "relay", "--upstream", url,
                          "--listen", "127.0.0.1:0", "--token-file", str(token), "--json", *gather],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env={**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}, preexec_fn=setup)
    assert p.stdout is not None
    head = ""
    while not head.endswith("}\n"):
        line = p.stdout.readline()
        if not line:
            raise SystemExit("a relay exited before it listened")
        head += line
    return p, str(json.loads(head)["listening"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--spread", type=int, default=5, help="ranks start up to this many calls apart")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--agent-procs", type=int, default=4, help="processes the simulated agents are spread over")
    ap.add_argument("--lost-after", type=float, default=120.0,
                    help="the coordinator's --lost-after: simulated agents starved of the shared cores poll late")
    ap.add_argument("--agents-nice", type=int, default=10,
                    help="the simulated agents' processes' nice value (stand-ins for other machines: thousands of "
                    "agent threads at the coordinator's priority starve its one event loop thread of the cores)")
    ap.add_argument("--agent-runner", choices=["loop", "threads"], default="loop",
                    help="the simulated agents on one event loop per process (tests/coordinator/simloop.py), or each "
                    "with the real agent's threads (client.AgentRunner)")
    ap.add_argument("--coordinator-cpus", type=cpus, help="CPUs the coordinator runs on (e.g. 0), so that it has "
                    "cores of its own")
    ap.add_argument("--agents-cpus", type=cpus, help="CPUs the simulated agents run on (e.g. 1)")
    ap.add_argument("--relays", type=int, default=0, help="relay processes the agents' polls go through (0: none)")
    ap.add_argument("--relays-nice", type=int, default=0, help="the relays' processes' nice value")
    ap.add_argument("--gather-ms", type=float, default=None, help="the relays' --gather-ms")
    ap.add_argument("--coordinator-src", help="run the coordinator from this source tree (a baseline)")
    ap.add_argument("--profile", help="sample the coordinator's threads into this file (bench/profile_sampler.py)")
    ap.add_argument("--separate", action="store_true", help=argparse.SUPPRESS)  # always so now
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--agents-of", help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    ap.add_argument("--token-file", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--relay-urls", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.agents_of:
        return agents_main(a)

    tmp = Path(tempfile.mkdtemp(prefix="cryo-coord-bench-"))
    token = secrets.token_hex(16)
    (tmp / "token").write_text(token)
    env = {**os.environ, "CRYOSLEEP_HOME": str(tmp)}
    if a.coordinator_src:
        env["PYTHONPATH"] = str(Path(a.coordinator_src).resolve())
    run = [sys.executable, str(Path(__file__).with_name("profile_sampler.py")), a.profile] if a.profile else \
        [sys.executable, "-m"]
    coord = subprocess.Popen([*run, "cryosleep.cli.main", "coordinator", "serve", "--listen",
                              "127.0.0.1:0", "--db", str(tmp / "catalog.db"), "--token-file", str(tmp / "token"),
                              "--lost-after", str(a.lost_after), "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                             preexec_fn=(lambda: os.sched_setaffinity(0, a.coordinator_cpus)) if a.coordinator_cpus
                             else None)
    assert coord.stdout is not None
    head = ""
    while not head.endswith("}\n"):  # its first JSON object: where it listens
        line = coord.stdout.readline()
        if not line:
            raise SystemExit("the coordinator exited before it listened")
        head += line
    url = json.loads(head)["listening"]
    client = CoordinatorClient(url, token, timeout=600)
    relays = [start_relay(a, url, tmp / "token", env) for _ in range(a.relays)]
    relay_urls = "|".join(u for _, u in relays)
    t0 = time.monotonic()
    procs: list[subprocess.Popen[str]] = []
    per = -(-a.nodes // max(1, a.agent_procs))
    for lo in range(0, a.nodes, per):
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--agents-of", f"{lo}:{min(a.nodes, lo + per)}", "--url", url, "--token-file",
             str(tmp / "token"), "--store", str(tmp / "store"), "--nodes", str(a.nodes), "--nproc", str(a.nproc),
             "--spread", str(a.spread), "--agent-runner", a.agent_runner, "--relay-urls", relay_urls],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, preexec_fn=lambda: agents_setup(a)))
    results: list[dict[str, Any]] = []
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise SystemExit("a process of simulated agents failed to start")
        reg_s = time.monotonic() - t0
        time.sleep(1.0)  # let the registrations' first polls settle
        settle = time.monotonic() + 120
        while (m := scrape(url, token)) is not None and m.get("polls", a.nodes) < a.nodes:
            if time.monotonic() > settle:
                print(f"only {m.get('polls')} of {a.nodes} agents poll after 120 s; snapshotting anyway",
                      file=sys.stderr)
                break
            time.sleep(1.0)
        print(f"all agents registered in {reg_s:.1f} s, {m and m.get('polls')} polls open after "
              f"{time.monotonic() - t0 - reg_s:.1f} s more", file=sys.stderr)
        for i in range(a.reps + 1):
            stop = i == a.reps
            m0, c0, t = scrape(url, token), proc_cpu(coord.pid), time.monotonic()
            a0 = sum(sum(proc_cpu(p.pid)) for p in procs)
            r0 = sum(sum(proc_cpu(p.pid)) for p, _ in relays)
            s = client.snapshot("scale", stop=stop, timeout_s=300)
            wall, c1 = time.monotonic() - t, proc_cpu(coord.pid)
            a1 = sum(sum(proc_cpu(p.pid)) for p in procs)
            r1 = sum(sum(proc_cpu(p.pid)) for p, _ in relays)
            m1 = scrape(url, token)
            if s["state"] != "verified":
                raise SystemExit(f"snapshot failed: {json.dumps(s.get('error'), indent=2)}")
            check_cut(tmp / "store", s["id"], a.nproc)
            run: dict[str, Any] = {"mode": s["mode"], "phases": s["phases"], "rounds": rounds(client, s["id"]),
                                   "wall_s": round(wall, 4), "cpu_s": round(c1[0] + c1[1] - c0[0] - c0[1], 3),
                                   "sys_s": round(c1[1] - c0[1], 3), "agents_cpu_s": round(a1 - a0, 3),
                                   "relays_cpu_s": round(r1 - r0, 3)}
            if m0 is not None and m1 is not None:
                run["phase_cpu"] = {k[4:]: round(v - m0.get(k, 0.0), 4) for k, v in m1.items() if k.startswith("cpu:")}
                run["requests"] = {k[4:]: int(v - m0.get(k, 0.0)) for k, v in m1.items()
                                   if k.startswith("req:") and v - m0.get(k, 0.0) >= 1 and k != "req:metrics"}
                run["carried"] = {k: int(v - m0.get(k, 0.0)) for k, v in m1.items()
                                  if k.split(":")[0] in ("results", "commands") and v - m0.get(k, 0.0) >= 1}
                run["requests_rounds"] = int(sum(v - m0.get(k, 0.0) for k, v in m1.items() if k.startswith("count:")))
                dn = m1.get("count:run", 0.0) - m0.get("count:run", 0.0)
                if dn:
                    run["fanout_s"] = round((m1["sum:run"] - m0.get("sum:run", 0.0)) / dn, 4)
            results.append(run)
    finally:
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for p, _ in relays:
            p.terminate()
            p.wait(30)
        coord.terminate()
        coord.wait(30)

    ranks = a.nodes * a.nproc
    keep = [r for r in results if r["mode"] == "keep-running"]

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 4) if xs else 0.0

    summary: dict[str, Any] = {
        "nodes": a.nodes, "ranks": ranks, "agent_procs": len(procs), "register_all_s": round(reg_s, 3),
        "runs": results, "median": {p: med([r["phases"].get(p, 0.0) for r in keep]) for p in PHASES},
        "median_cpu": {p: med([r["phase_cpu"].get(p, 0.0) for r in keep if "phase_cpu" in r]) for p in PHASES},
        "median_rounds": statistics.median(r["rounds"] for r in keep),
        "median_wall_s": med([r["wall_s"] for r in keep]), "median_cpu_s": med([r["cpu_s"] for r in keep]),
        "median_agents_cpu_s": med([r["agents_cpu_s"] for r in keep]),
        "relays": a.relays, "median_relays_cpu_s": med([r["relays_cpu_s"] for r in keep]),
        "median_requests": med([sum(r.get("requests", {}).values()) for r in keep]),
        "median_fanout_s": med([r["fanout_s"] for r in keep if "fanout_s" in r]),
        "median_requests_rounds": med([r["requests_rounds"] for r in keep if "requests_rounds" in r]),
        "agents_nice": a.agents_nice, "agent_runner": a.agent_runner,
        "coordinator_cpus": sorted(a.coordinator_cpus or []), "agents_cpus": sorted(a.agents_cpus or []),
        "python": platform.python_version(), "cpus": os.cpu_count()}
    if a.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{ranks} ranks in {a.nodes} simulated nodes over {len(procs)} agent processes; coordinator in its own "
          f"process; all agents registered in {reg_s:.2f} s")
    print("run  mode          rounds  " + "  ".join(f"{p:>8}" for p in PHASES) + "     stop     total   coord-cpu")
    for i, r in enumerate(results):
        ph = r["phases"]
        print(f"{i:>3}  {r['mode']:<12}  {r['rounds']:>6}  " + "  ".join(f"{ph.get(p, 0.0):8.3f}" for p in PHASES)
              + f"  {ph.get('stop', 0.0):7.3f}  {r['wall_s']:8.3f}  {r['cpu_s']:10.3f} (system {r['sys_s']:.3f}; "
              f"agents {r['agents_cpu_s']:.3f}; relays {r['relays_cpu_s']:.3f})")
        if r.get("requests"):
            print("     coordinator requests  " + ", ".join(f"{k} {v}" for k, v in sorted(r["requests"].items())))
        if r.get("carried"):
            print("     through relays        " + ", ".join(f"{k} {v}" for k, v in sorted(r["carried"].items())))
        if "phase_cpu" in r:
            pc = r["phase_cpu"]
            print("     coordinator CPU       " + "  ".join(f"{pc.get(p, 0.0):8.3f}" for p in PHASES))
    md, mc = summary["median"], summary["median_cpu"]
    print(f"median keep-running: cut (drain) {md['drain']:.3f} s in {summary['median_rounds']} rounds, capture round "
          f"(quiesce+capture) {md['quiesce'] + md['capture']:.3f} s, total {summary['median_wall_s']:.3f} s; "
          f"coordinator CPU: cut {mc['drain']:.3f} s, capture round {mc['quiesce'] + mc['capture']:.3f} s, whole "
          f"snapshot {summary['median_cpu_s']:.3f} s (the simulated agents' processes: "
          f"{summary['median_agents_cpu_s']:.3f} s, {a.relays} relays' {summary['median_relays_cpu_s']:.3f} s); "
          f"fan-out to {a.nodes} agents {summary['median_fanout_s']:.3f} s; "
          f"{summary['median_requests']:.0f} coordinator requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
