"""Two simulated nodes x 2 ranks of gloo DDP on the job network, with real CRIU, real PyTorch and a real
coordinator.

Each "host" is a network namespace of its own (tests/jobs/hosts.py), joined to the other by a veth pair as the
network between the hosts. The coordinator runs on host A; both agents register with it (`run --coordinator`), and
it snapshots the job on both nodes at once: keep-running (the job network held on both nodes from before the
first dump to after the last), then stop. Each node's image of the stop snapshot is restored on the OTHER
host, into fresh namespaces (`restore --node-rank`); the losses of all four ranks must equal an uninterrupted
4-rank torchrun bit for bit. Then the keep-running snapshot is restored too, after the job ended, and must
match again.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryosleep.core import proctree
from cryosleep.net import Host, job_net
from tests.conftest import require_criu
from tests.jobs.coordinated import Coordinator
from tests.jobs.harness import Harness, reference, workload
from tests.jobs.hosts import UNDERLAY, HostHarness, restore_pair, start_host_daemon, two_hosts

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # minutes: the extended tier (CI runs it)

# long enough to outlive a keep-running snapshot and reach step 20 after it
ARGS = ["--steps", "150", "--step-sleep", "0.05"]


@pytest.fixture
def hosts(cryo_home: Path) -> Iterator[tuple[HostHarness, HostHarness]]:
    require_criu()
    with two_hosts(cryo_home, ("mn.node0", "mn.node1")) as pair:
        yield pair


def assert_identical(h: Harness, ref: dict[int, list[str]]) -> None:
    for r in range(4):
        got = h.losses(f"mn.node{r // 2}", r)
        assert got == ref[r], f"rank {r}: {len(got)} steps vs {len(ref[r])}; first difference at " + str(
            next((i for i, (x, y) in enumerate(zip(got, ref[r], strict=False)) if x != y), min(len(got), len(ref[r]))))


def test_two_nodes_snapshot_and_restore_swapped_across_hosts(hosts: tuple[HostHarness, HostHarness],
                                                           tmp_path: Path) -> None:
    ha, hb = hosts
    coord = Coordinator(tmp_path, "0.0.0.0:0", prefix=tuple(proctree.nsenter_net(ha.ns_pid)))
    url = f"http://{UNDERLAY[0]}:{coord.url.rsplit(':', 1)[1]}"  # host A's address, reached from both hosts
    for h in hosts:
        h.env = coord.env({**h.env, "CRYOSLEEP_COORDINATOR": url})
    try:
        port = 29000 + os.getpid() % 1000
        ha.run_node("mn", 0, port, url, ARGS)
        hb.run_node("mn", 1, port, url, ARGS)
        spec, _ = ha.job("mn.node0").read()
        net = job_net("mn-run", 0, 2)
        assert spec.net["address"] == net.address and spec.master_addr == net.address
        assert spec.coordinator == url and "CRYOSLEEP_COORDINATOR_TOKEN" not in spec.env
        ha.wait_step("mn.node0", 8)  # the ranks of both hosts met over the overlay: its peers were learned
        assert Host(ha.ns_pid).overlay_peers(net) == [UNDERLAY[1]] and Host(hb.ns_pid).overlay_peers(net) == [
            UNDERLAY[0]]
        assert "overlay peers 10." in ha.job("mn.node0").agent_log.read_text()
        nodes = ha.coordinator("job", "mn")["nodes"]
        assert sorted((n["node_rank"], n["address"]) for n in nodes) == [(0, net.address),
                                                                         (1, job_net("mn-run", 1, 2).address)]

        # keep-running, asked of node 1 as a one-node job would be: the coordinator snapshots both nodes
        keep = hb.snapshot("mn.node1")
        assert keep["coordinated"] and keep["mode"] == "keep-running"
        row = ha.coordinator("show", keep["snapshot"])
        assert row["state"] == "verified" and [n["state"] for n in row["nodes"]] == ["verified", "verified"]
        assert "net_hold" not in row["phases"] and row["phases"]["capture"] > 0
        assert ha.state("mn.node0") == ha.state("mn.node1") == "running"
        ha.wait_step("mn.node0", 20)
        stop = ha.coordinator("snapshot", "mn", "--stop")
        assert stop["state"] == "verified", stop.get("error")
        assert ha.wait_end("mn.node0", 120) == 75 and ha.wait_end("mn.node1", 120) == 75
        suspended = ha.coordinator("job", "mn")
        assert suspended["state"] == "suspended"
        # each agent said why it went (as it exited): not an agent lost after --lost-after without a poll
        assert all(str(n["left"]).startswith("suspended in snapshot ") for n in suspended["nodes"]), suspended
        image0 = stop["nodes"][0]["image"]["ref"]
        manifest = ha.cli_json("show", image0)
        assert manifest["job"]["net"]["address"] == net.address and manifest["job"]["net"]["bridge"] == net.bridge
        # both hosts' parts of the job network went with their sandboxes
        assert not {net.bridge, net.vxlan} & {x["ifname"] for x in Host(ha.ns_pid).links()}

        # node 0's image on host B, node 1's on host A, from one command: each host's daemon (`host serve`) takes
        # its order from the coordinator, with the other host as its overlay peer; the restored agents register
        # with the coordinator again
        daemons = [start_host_daemon(h, name, url) for h, name in ((ha, "hostA"), (hb, "hostB"))]
        try:
            placed = json.loads(ha.cli("restore", stop["id"], "--nodes", "hostB,hostA", "--json").stdout)
        finally:
            for d in daemons:
                d.send_signal(signal.SIGTERM)
            for d in daemons:
                assert d.wait(30) == 0
        assert placed["state"] == "done" and [(n["host"], n["peers"], n["result"]["job"]) for n in placed["nodes"]] == [
            ("hostB", [UNDERLAY[0]], "mn.node0"), ("hostA", [UNDERLAY[1]], "mn.node1")], placed
        assert ha.coordinator("job", "mn")["state"] in ("running", "lost", "incomplete")
        assert ha.wait_end("mn.node0", 120) == 0 and ha.wait_end("mn.node1", 120) == 0
        # a snapshot of the job that ended is refused at once, saying so (an earlier, 50-step version of this test
        # ended its job just before the stop snapshot, which then failed: "its agent was lost (no poll for 3.0 s)")
        refused = ha.cli("coordinator", "snapshot", "mn", "--json", check=False)
        assert refused.returncode != 0 and refused.stdout.count("its job ended on this node (exit code 0)") == 2, (
            refused.stdout + refused.stderr)
        ref = reference(workload("ddp_basic"), ARGS, nproc=4)
        assert_identical(ha, ref)

        # the older, keep-running snapshot, restored after the job ended (back on their own hosts this time, by
        # hand, each node learning the other's address at the restore's barrier)
        restore_pair(keep["snapshot"], ha, hb, peers=False)
        assert Host(ha.ns_pid).overlay_peers(net) == [UNDERLAY[1]]
        assert ha.wait_end("mn.node0", 120) == 0 and ha.wait_end("mn.node1", 120) == 0
        assert_identical(ha, ref)
    finally:
        coord.stop()
