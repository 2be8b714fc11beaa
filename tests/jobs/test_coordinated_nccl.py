"""An NCCL job across two nodes, snapshotted and restored through a real coordinator (CPU: the stand-in NCCL
behind the interceptor, real CRIU, real agents; two nodes on this host, on the job network).

Its communicators span both nodes, so neither node can reach a cut on its own: the coordinator decides the cut
over the four ranks, every node quiesces, captures, and the rebuilt communicators' fresh ids cross the nodes
through it (resume/relay); at the restore the nodes meet at its board (the barrier, then the id relay). The
per-step digests of all four ranks must equal an uninterrupted 4-rank run's bit for bit.

Then a live migration of such a job (`coordinator drain`, three host daemons named on this one machine): node 1
alone moves to the spare, node 0's ranks hold at the cut, their communicators rebuilt with the restored node's
through the coordinator, and node 0's processes stay the same.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.jobs.coordinated import Coordinator
from tests.jobs.harness import Harness, free_port, reference, workload
from tests.jobs.test_nccl_cut import args_for, h, lingering  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow

NODES = ("nd.node0", "nd.node1")


@pytest.fixture
def coord(h: Harness, tmp_path: Path) -> Iterator[Coordinator]:  # noqa: F811
    c = Coordinator(tmp_path)
    h.env = c.env(h.env)
    yield c
    c.stop()


def test_nccl_across_nodes_keep_running_stop_and_restore(h: Harness, coord: Coordinator,  # noqa: F811
                                                         tmp_path: Path) -> None:
    script = workload("nccl_dp")
    args = lingering(tmp_path, 60)
    port = str(free_port())
    for n in (0, 1):
        h.cli_json("run", "--detach", "--name", "nd", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "2",
                   "--master-port", port, "--run-id", f"nd-{port}", "--net", "job", "--coordinator", coord.url,
                   str(script), *args)
    h.wait_step(NODES[0], 5)
    keep = coord.snapshot("nd")
    assert keep["state"] == "verified", keep.get("error")
    assert h.state(NODES[0]) == h.state(NODES[1]) == "running"
    h.wait_step(NODES[0], 15)
    stop = coord.snapshot("nd", stop=True)
    assert stop["state"] == "verified", stop.get("error")
    assert h.wait_end(NODES[0]) == 75 and h.wait_end(NODES[1]) == 75
    # one cut over both nodes: every member of the world communicator, on either node, at the same count
    comms = [c for n in stop["nodes"] for r in h.cli_json("show", n["image"]["ref"])["nodes"][0]["nccl"]["ranks"]
             for c in r["comms"]]
    assert len(comms) == 4 and len({c["ident"] for c in comms}) == 1 and len({c["seq"] for c in comms}) == 1
    # a node that cannot restore stops every node before anything starts: node 1's image of the keep-running
    # snapshot damaged, both restores of it fail, node 0's naming node 1 and why; nothing runs
    damaged = Path(coord.detail(keep["id"])["nodes"][1]["image"]["store"]) / "snapshots"
    victim = next(p for p in sorted((damaged / keep["nodes"][1]["image"]["ref"]).rglob("*.img")) if p.stat().st_size)
    good = victim.read_bytes()
    victim.write_bytes(bytes([good[0] ^ 1]) + good[1:])
    refused = restore_both(h, coord, keep["id"], check=False)
    errors = [json.loads(r.stdout) for r in refused]
    assert [r.returncode for r in refused] == [1, 1] and errors[1]["error"] == "store_corrupt", errors
    assert errors[0]["error"] == "not_eligible" and "node 1" in errors[0]["why"], errors[0]
    assert h.state(NODES[0]) == h.state(NODES[1]) == "suspended"
    # repaired, the same snapshot restores at once (node 0's failure at the barrier did not stand in the way)
    victim.write_bytes(good)
    restored = [json.loads(r.stdout) for r in restore_both(h, coord, keep["id"])]
    assert all("rebuild" in r["phases"] for r in restored), [r["phases"] for r in restored]
    (tmp_path / "linger").touch()
    assert h.wait_end(NODES[0]) == 0 and h.wait_end(NODES[1]) == 0
    ref = reference(script, args_for(tmp_path, 60, 0), 4)
    assert_identical(h, ref)
    # and the stop snapshot, the nodes' restores started in the other order
    restore_both(h, coord, stop["id"], order=(1, 0))
    assert h.wait_end(NODES[0]) == 0 and h.wait_end(NODES[1]) == 0
    assert_identical(h, ref)


def restore_both(h: Harness, coord: Coordinator, sid: str, order: tuple[int, int] = (0, 1),  # noqa: F811
                 check: bool = True) -> list[subprocess.CompletedProcess[str]]:
    """Both nodes' restores at once: each waits at the coordinator's barrier for the other (results by node)."""
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(order, pool.map(lambda n: h.cli("restore", "--detach", "--json", "--node-rank", str(n),
                                                         "--coordinator", coord.url, sid, check=check), order),
                        strict=True))
    return [done[0], done[1]]


def assert_identical(h: Harness, ref: dict[int, list[str]]) -> None:  # noqa: F811
    for r in range(4):
        got = h.losses(NODES[r // 2], r)
        assert got == ref[r], f"rank {r}: {len(got)} steps vs {len(ref[r])}; first difference at " + str(
            next((i for i, (a, b) in enumerate(zip(got, ref[r], strict=False)) if a != b), min(len(got), len(ref[r]))))


@pytest.mark.extended
def test_nccl_node_migrated_to_a_spare_while_the_other_node_holds(h: Harness, coord: Coordinator,  # noqa: F811
                                                                  tmp_path: Path) -> None:
    script = workload("nccl_dp")
    args = lingering(tmp_path, 60)
    port = str(free_port())
    daemons = []
    for name in ("hostA", "hostB", "hostC"):  # one machine, three host daemons: what `drain` sees as hosts
        p = subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "host", "serve", "--name", name,
                              "--coordinator", coord.url, "--poll-wait", "2", "--json"], stdout=subprocess.PIPE,
                             text=True, env=h.env)
        daemons.append(p)
        assert p.stdout is not None and json.loads(p.stdout.readline())["event"] == "serving"
    try:
        for n, host in ((0, "hostA"), (1, "hostB")):
            h.cli_json("run", "--detach", "--name", "nd", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node",
                       "2", "--master-port", port, "--run-id", f"nd-{port}", "--net", "job", "--coordinator",
                       coord.url, str(script), *args, env={**h.env, "CRYOSLEEP_HOST": host})
        h.wait_step(NODES[0], 5)
        before = h.pids(NODES[0])
        old_agent = h.job(NODES[1]).read()[1].agent_pid
        out = json.loads(h.cli("coordinator", "drain", "hostB", "--deadline", "120", "--json", "--coordinator",
                               coord.url).stdout)
        (d,) = out["jobs"]
        assert d["action"] == "migrate" and d["spare"] == ["hostC"] and d["outcome"] == "migrated", out
        assert h.pids(NODES[0]) == before and h.state(NODES[0]) == "running"
        new_agent = h.job(NODES[1]).read()[1].agent_pid
        assert new_agent != old_agent and h.state(NODES[1]) == "running"
        # the communicators spanning both nodes were rebuilt across the move: node 0's ids relayed to the spare
        events = [e["message"] for e in json.loads(h.cli("coordinator", "show", d["migration"], "--json",
                                                         "--coordinator", coord.url).stdout)["events"]]
        assert any(" rebuild " in m and "node 1 restored on host hostC" in m for m in events), events
        (tmp_path / "linger").touch()
        assert h.wait_end(NODES[0]) == 0 and h.wait_end(NODES[1]) == 0
        assert_identical(h, reference(script, args_for(tmp_path, 60, 0), 4))
    finally:
        for p in daemons:
            p.send_signal(signal.SIGTERM)
        for p in daemons:
            p.wait(60)
