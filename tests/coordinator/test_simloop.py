"""The benchmark's event-loop agents (tests/coordinator/simloop.py) speak the protocol as the real runner does:
one job's nodes split over two loops (as the benchmark spreads them over processes) reach a consistent cut, keep
running, then stop, with every result delivered once."""

from __future__ import annotations

import json
from pathlib import Path

from tests.coordinator.helpers import serving
from tests.coordinator.simloop import LoopAgents


def test_loop_agents_take_keep_running_and_stop_snapshots(tmp_path: Path) -> None:
    with serving(tmp_path) as env:
        parts = [LoopAgents(env.url, env.token, tmp_path / "store", job="loop", nnodes=3, nproc=4, seed=3,
                            only=only, wait_s=2.0) for only in (range(0, 2), range(2, 3))]
        try:
            for p in parts:
                p.start(timeout=30)
            client = env.client()
            for stop in (False, True):
                s = client.snapshot("loop", stop=stop, timeout_s=30)
                assert s["state"] == "verified", s
                counts: dict[str, set[int]] = {}
                for f in (tmp_path / "store" / s["id"]).glob("node-*.json"):
                    for r, seq in json.loads(f.read_text())["ranks"].items():
                        for ident, n in seq.items():
                            key = ident if not ident.startswith("0de") else f"{ident}@{int(r) // 4}"
                            counts.setdefault(key, set()).add(n)
                assert len(counts) == 3 + 1 and all(len(v) == 1 for v in counts.values()), counts
            assert client.job("loop")["state"] == "suspended"
            for p in parts:  # every command ran once on each node
                for a in p.agents:
                    ops = [op for _, op in a.node.ops]
                    assert ops.count("capture") == 2 and ops.count("stop") == 1, ops
        finally:
            for p in parts:
                p.close()
