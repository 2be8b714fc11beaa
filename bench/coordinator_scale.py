"""The coordinator at scale: simulated node agents and ranks, real HTTP, real SQLite (docs/benchmarks.md).

    .venv/bin/python bench/coordinator_scale.py [--nodes 128] [--nproc 8] [--reps 5] [--separate]

Starts the coordinator (in this process, or with --separate as `cryosleep coordinator serve` in its own
process), then ``--nodes`` simulated node agents (``cryosleep.coordinator.sim``: one thread and two keep-alive
HTTP connections each, in this process) with ``--nproc`` ranks each. Every rank is in two communicators (its
node's and the job-wide one) and the ranks start up to ``--spread`` calls apart, so the drain needs rounds:
ranks behind run on, ranks held short of the cut get their held call added. Capture and persist are simulated
(~0 s), so what is measured is the protocol: commands fanned out to every agent by long poll, results back,
the cut computed over every rank's counters, the catalog written.

Per keep-running snapshot it reports the snapshot's phase times as the coordinator recorded them (prepare,
drain = one cut, quiesce, capture, resume, persist), the drain's rounds, and the total; then one stop snapshot.
Every cut is checked: every member of every communicator at the same count in the persisted images.
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
from pathlib import Path
from typing import Any

from cryosleep.coordinator import service
from cryosleep.coordinator.client import CoordinatorClient
from cryosleep.coordinator.sim import SimCluster

PHASES = ["prepare", "drain", "quiesce", "capture", "resume", "persist"]


def check_cut(cluster: SimCluster, sid: str) -> None:
    seen: dict[tuple[str, int], set[int]] = {}
    for r, seq in cluster.cut_counters(sid).items():
        node = r // cluster.world.nproc
        for ident, n in seq.items():
            key = (ident, node) if ident.startswith("0de") else (ident, -1)
            seen.setdefault(key, set()).add(n)
    bad = {k: v for k, v in seen.items() if len(v) != 1}
    if bad:
        raise SystemExit(f"snapshot {sid}: inconsistent cut {bad}")


def rounds(client: CoordinatorClient, sid: str) -> int:
    for e in client.snapshot_detail(sid)["events"]:
        m = re.search(r"after (\d+) round", e["message"]) if e["kind"] == "cut" else None
        if m:
            return int(m.group(1))
    return -1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--spread", type=int, default=5, help="ranks start up to this many calls apart")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--separate", action="store_true", help="run the coordinator in its own process")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="cryo-coord-bench-"))
    token = secrets.token_hex(16)
    (tmp / "token").write_text(token)
    proc: subprocess.Popen[str] | None = None
    srv: service.Server | None = None
    if a.separate:
        proc = subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "coordinator", "serve", "--listen",
                                 "127.0.0.1:0", "--db", str(tmp / "catalog.db"), "--token-file", str(tmp / "token"),
                                 "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env={**os.environ, "CRYOSLEEP_HOME": str(tmp)})
        assert proc.stdout is not None
        head = proc.stdout.readline() + proc.stdout.readline() + proc.stdout.readline() + proc.stdout.readline()
        url = json.loads(head)["listening"]
    else:
        srv, _ = service.start("127.0.0.1:0", tmp / "catalog.db", token, log=lambda _m: None)
        url = srv.url
    client = CoordinatorClient(url, token, timeout=600)
    t0 = time.monotonic()
    cluster = SimCluster(url, token, tmp / "store", job="scale", nnodes=a.nodes, nproc=a.nproc, spread=a.spread,
                         seed=1).start(timeout=300)
    reg_s = time.monotonic() - t0
    results: list[dict[str, Any]] = []
    try:
        for i in range(a.reps + 1):
            stop = i == a.reps
            t = time.monotonic()
            s = client.snapshot("scale", stop=stop, timeout_s=300)
            wall = time.monotonic() - t
            if s["state"] != "verified":
                raise SystemExit(f"snapshot failed: {json.dumps(s.get('error'), indent=2)}")
            check_cut(cluster, s["id"])
            results.append({"mode": s["mode"], "phases": s["phases"], "rounds": rounds(client, s["id"]),
                            "wall_s": round(wall, 4)})
    finally:
        cluster.close()
        if srv is not None:
            service.shutdown(srv)
        if proc is not None:
            proc.terminate()
            proc.wait(10)

    ranks = a.nodes * a.nproc
    keep = [r for r in results if r["mode"] == "keep-running"]
    summary: dict[str, Any] = {"nodes": a.nodes, "ranks": ranks, "coordinator": "own process" if a.separate else
                               "same process as the agents", "register_all_s": round(reg_s, 3), "runs": results,
                               "median": {p: round(statistics.median(r["phases"].get(p, 0.0) for r in keep), 4)
                                          for p in PHASES},
                               "median_rounds": statistics.median(r["rounds"] for r in keep),
                               "median_wall_s": round(statistics.median(r["wall_s"] for r in keep), 4),
                               "python": platform.python_version(), "cpus": os.cpu_count()}
    if a.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{ranks} ranks in {a.nodes} simulated nodes; coordinator in {summary['coordinator']}; "
          f"all agents registered in {reg_s:.2f} s")
    print("run  mode          rounds  " + "  ".join(f"{p:>8}" for p in PHASES) + "     stop     total")
    for i, r in enumerate(results):
        ph = r["phases"]
        print(f"{i:>3}  {r['mode']:<12}  {r['rounds']:>6}  " + "  ".join(f"{ph.get(p, 0.0):8.3f}" for p in PHASES)
              + f"  {ph.get('stop', 0.0):7.3f}  {r['wall_s']:8.3f}")
    med = summary["median"]
    print(f"median keep-running: cut (drain) {med['drain']:.3f} s in {summary['median_rounds']} rounds, capture "
          f"round (quiesce+capture) {med['quiesce'] + med['capture']:.3f} s, total {summary['median_wall_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
