"""The coordinator's side of one drain round, in-process: decode every node's answer and decide (docs/benchmarks.md).

    .venv/bin/python bench/cut_rounds.py [--nodes 2048] [--nproc 8] [--reps 5]

The simulated job of ``tests/coordinator/sim.py`` (every rank in its node's communicator and the job-wide one,
ranks up to 5 calls apart, held), each node's answer encoded as its agent sends it: protocol 2's views
(``view_to_json`` of every rank) or protocol 3's summary (``drain_answer``). Measured, in CPU seconds of this
process (``time.process_time``, so a loaded machine slows it less than wall time would): decoding every node's
answer and deciding the round, over views (``views_from_json``, then the rules over every view: the code before
the summaries, ``tests/unit/cut_reference.py``) and over summaries (``drain_summary`` per node, ``combine``,
``decide_nodes``); the bytes of every node's answer; and the agent's side (summarizing a node's 8 views).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.*: test-only code

from cryosleep.coordinator.protocol import drain_answer, drain_summary, views_from_json
from cryosleep.cut.summary import combine, decide_nodes
from cryosleep.cut.views import Decision
from tests.coordinator.sim import SimWorld
from tests.unit import cut_reference


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    world = SimWorld(a.nodes, a.nproc, seed=1)
    for rk in world.ranks:
        rk.mode = "hold"
    views = [[world.view(rk) for rk in world.ranks[n * a.nproc:(n + 1) * a.nproc]] for n in range(a.nodes)]
    old = [json.dumps(drain_answer(v, False)) for v in views]
    new = [json.dumps(drain_answer(v, True)) for v in views]

    def timed(fn: Callable[[], object]) -> float:
        out = []
        for _ in range(a.reps):
            t = time.process_time()
            fn()
            out.append(time.process_time() - t)
        return statistics.median(out)

    def over_views() -> Decision:
        every = [v for d in old for v in views_from_json(json.loads(d))]
        return cut_reference.decide(0.0, 1e9, every, {})

    def over_summaries() -> Decision:
        return decide_nodes(0.0, 1e9, [combine(drain_summary(json.loads(d)) for d in new)], {})

    d_old, d_new = over_views(), over_summaries()
    assert (d_old.action, d_old.targets) == (d_new.action, d_new.targets), (d_old.reason, d_new.reason)
    agent = timed(lambda: [drain_answer(v, True) for v in views[:64]]) / 64
    out = {"nodes": a.nodes, "ranks": a.nodes * a.nproc, "action": d_new.action.value,
           "views_round_cpu_s": round(timed(over_views), 4), "summaries_round_cpu_s": round(timed(over_summaries), 4),
           "views_bytes_per_node": round(sum(map(len, old)) / a.nodes),
           "summary_bytes_per_node": round(sum(map(len, new)) / a.nodes),
           "agent_summary_cpu_ms_per_node": round(agent * 1e3, 3)}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
