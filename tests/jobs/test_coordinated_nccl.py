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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.jobs.coordinated import Coordinator, wait_for
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


@contextmanager
def three_host_daemons(h: Harness, coord: Coordinator) -> Iterator[None]:  # noqa: F811
    """One machine, three host daemons (hostA, hostB, hostC): what `coordinator drain` sees as hosts."""
    daemons = []
    try:
        for name in ("hostA", "hostB", "hostC"):
            p = subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "host", "serve", "--name", name,
                                  "--coordinator", coord.url, "--poll-wait", "2", "--json"], stdout=subprocess.PIPE,
                                 text=True, env=h.env)
            daemons.append(p)
            assert p.stdout is not None and json.loads(p.stdout.readline())["event"] == "serving"
        yield
    finally:
        for p in daemons:
            p.send_signal(signal.SIGTERM)
        for p in daemons:
            p.wait(60)


def start_on_two_hosts(h: Harness, coord: Coordinator, script: Path, args: list[str]) -> None:  # noqa: F811
    port = str(free_port())
    for n, host in ((0, "hostA"), (1, "hostB")):
        h.cli_json("run", "--detach", "--name", "nd", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node",
                   "2", "--master-port", port, "--run-id", f"nd-{port}", "--net", "job", "--coordinator",
                   coord.url, str(script), *args, env={**h.env, "CRYOSLEEP_HOST": host})
    h.wait_step(NODES[0], 5)


def drain(h: Harness, coord: Coordinator, host: str, deadline: int) -> dict[str, Any]:  # noqa: F811
    out: dict[str, Any] = json.loads(h.cli("coordinator", "drain", host, "--deadline", str(deadline), "--json",
                                           "--coordinator", coord.url).stdout)
    return out


def events(h: Harness, coord: Coordinator, sid: str) -> list[str]:  # noqa: F811
    row = json.loads(h.cli("coordinator", "show", sid, "--json", "--coordinator", coord.url).stdout)
    return [str(e["message"]) for e in row["events"]]


@pytest.mark.extended
def test_nccl_node_migrated_to_a_spare_while_the_other_node_holds(h: Harness, coord: Coordinator,  # noqa: F811
                                                                  tmp_path: Path) -> None:
    script = workload("nccl_dp")
    args = lingering(tmp_path, 60)
    with three_host_daemons(h, coord):
        start_on_two_hosts(h, coord, script, args)
        before = h.pids(NODES[0])
        old_agent = h.job(NODES[1]).read()[1].agent_pid
        (d,) = drain(h, coord, "hostB", 120)["jobs"]
        assert d["action"] == "migrate" and d["spare"] == ["hostC"] and d["outcome"] == "migrated", d
        assert h.pids(NODES[0]) == before and h.state(NODES[0]) == "running"
        new_agent = h.job(NODES[1]).read()[1].agent_pid
        assert new_agent != old_agent and h.state(NODES[1]) == "running"
        # the communicators spanning both nodes were rebuilt across the move: node 0's ids relayed to the spare
        said = events(h, coord, d["migration"])
        assert any(" rebuild " in m and "node 1 restored on host hostC" in m for m in said), said
        (tmp_path / "linger").touch()
        assert h.wait_end(NODES[0]) == 0 and h.wait_end(NODES[1]) == 0
        assert_identical(h, reference(script, args_for(tmp_path, 60, 0), 4))


@pytest.mark.extended
def test_a_migration_that_fails_before_its_point_of_no_return_resumes_in_place_and_falls_back_to_the_queue(
        h: Harness, coord: Coordinator, tmp_path: Path) -> None:  # noqa: F811
    script = workload("nccl_dp")
    args = lingering(tmp_path, 60)
    with three_host_daemons(h, coord):
        start_on_two_hosts(h, coord, script, args)
        # node 1's agent stalls its image's persist past the drain's deadline: the migration fails before the
        # spare is ordered; its rollback thaws node 1 where it ran and rebuilds both nodes' communicators
        (h.job(NODES[1]).path / "fault-stall").write_text("persist 20")
        (d,) = drain(h, coord, "hostB", 12)["jobs"]
        assert d["migration"] and d["action"] == "suspend-and-queue" and d["outcome"] == "queued", d
        assert f"the migration {d['migration']} failed" in d["reasons"][-1], d
        mig = coord.detail(d["migration"])
        assert mig["state"] == "failed" and [n["state"] for n in mig["nodes"]] == ["resumed", "resumed"], mig
        assert not any("point of no return" in m for m in events(h, coord, d["migration"]))
        # then stop-snapshotted (both nodes) and queued: the queue restores it on the free hosts
        assert h.wait_end(NODES[0], 120) in (0, 75)
        wait_for(lambda: h.state(NODES[0]) == h.state(NODES[1]) == "running", 120, "the queued restore")
        (tmp_path / "linger").touch()
        assert h.wait_end(NODES[0]) == 0 and h.wait_end(NODES[1]) == 0
        assert_identical(h, reference(script, args_for(tmp_path, 60, 0), 4))
