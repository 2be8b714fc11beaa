"""Two simulated nodes x 2 ranks of gloo DDP on the job network, with real CRIU and real PyTorch.

Each "host" is a network namespace of its own (held by a sleeping process), joined to the other by a veth
pair as the network between the hosts (10.250.1.1 <-> 10.250.1.2). Each node's agent runs in its host's
namespace (`nsenter --net`), so each host has its own bridge for the job and the two are linked by the
job's VXLAN overlay. Both nodes are snapshot keep-running, then stop; each node's image is restored on the
OTHER host, into fresh namespaces; the losses of all four ranks must equal an uninterrupted 4-rank torchrun
bit for bit. Then the keep-running pair (taken with both nodes held off the job network, `cryosleep net
hold`) is restored too, an older snapshot after the job ended, and must match again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cryosleep.net import Host, job_net
from tests.conftest import require_criu
from tests.jobs.harness import Harness, reference, workload

pytestmark = pytest.mark.slow

ARGS = ["--steps", "50", "--step-sleep", "0.05"]
UNDERLAY = ("10.250.1.1", "10.250.1.2")


class HostHarness(Harness):
    """The harness, with every CLI call made from inside one simulated host's network namespace."""

    def __init__(self, home: Path, ns_pid: int, peer: str) -> None:
        super().__init__(home)
        self.ns_pid = ns_pid
        self.peer = peer

    def cli(self, *args: str, check: bool = True, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        cmd = ["nsenter", f"--net=/proc/{self.ns_pid}/ns/net", "--", sys.executable, "-m", "cryosleep.cli.main",
               *args]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env or self.env, timeout=timeout, check=False)
        if check and res.returncode != 0:
            raise AssertionError(f"cryosleep {' '.join(args)} failed ({res.returncode}):\n"
                                 f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        return res

    def run_node(self, name: str, rank: int, port: int) -> dict[str, Any]:
        out: dict[str, Any] = self.cli_json(
            "run", "--detach", "--name", name, "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "2",
            "--master-port", str(port), "--run-id", f"{name}-run", "--net", "job", "--net-peers", self.peer,
            str(workload("ddp_basic")), *ARGS)
        return out

    def restore_here(self, sid: str) -> dict[str, Any]:
        out: dict[str, Any] = self.cli_json("restore", "--detach", "--net-peers", self.peer, sid)
        return out


@pytest.fixture
def hosts(cryo_home: Path) -> Iterator[tuple[HostHarness, HostHarness]]:
    require_criu()
    holders: list[subprocess.Popen[bytes]] = []
    harnesses: list[HostHarness] = []
    try:
        for _ in range(2):
            p = subprocess.Popen(["unshare", "--net", "--", "sleep", "600"])
            holders.append(p)
            end = time.monotonic() + 5
            while os.readlink(f"/proc/{p.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
                assert time.monotonic() < end
                time.sleep(0.01)
        a, b = Host(holders[0].pid), Host(holders[1].pid)
        a.ip("link", "add", "under0", "type", "veth", "peer", "name", "under1", "netns", str(holders[1].pid),
             what="the network between the simulated hosts")
        for host, dev, addr in ((a, "under0", UNDERLAY[0]), (b, "under1", UNDERLAY[1])):
            host.run("ip", "addr", "add", f"{addr}/30", "dev", dev, what="underlay")
            host.run("ip", "link", "set", dev, "up", what="underlay")
            host.run("ip", "link", "set", "lo", "up", what="loopback")  # CRIU probes TCP repair on it
        harnesses = [HostHarness(cryo_home, holders[0].pid, UNDERLAY[1]),
                     HostHarness(cryo_home, holders[1].pid, UNDERLAY[0])]
        yield harnesses[0], harnesses[1]
    finally:
        for name in ("mn.node0", "mn.node1"):
            if harnesses and harnesses[0].job(name).exists() and harnesses[0].state(name) in ("running", "starting"):
                harnesses[0].kill_all(name)
        for p in holders:  # the hosts' namespaces, and every bridge, VXLAN and veth in them, go with these
            p.send_signal(signal.SIGKILL)
            p.wait()


def assert_identical(h: Harness, ref: dict[int, list[str]]) -> None:
    for r in range(4):
        got = h.losses(f"mn.node{r // 2}", r)
        assert got == ref[r], f"rank {r}: {len(got)} steps vs {len(ref[r])}; first difference at " + str(
            next((i for i, (x, y) in enumerate(zip(got, ref[r], strict=False)) if x != y), min(len(got), len(ref[r]))))


def test_two_nodes_snapshot_and_restore_swapped_across_hosts(hosts: tuple[HostHarness, HostHarness]) -> None:
    ha, hb = hosts
    port = 29000 + os.getpid() % 1000
    ha.run_node("mn", 0, port)
    hb.run_node("mn", 1, port)
    spec, _ = ha.job("mn.node0").read()
    net = job_net("mn-run", 0, 2)
    assert spec.net["address"] == net.address and spec.master_addr == net.address
    ha.wait_step("mn.node0", 8)

    # keep-running: the nodes are dumped one after the other, so they are held off the job network from
    # before the first dump to after the last (docs/network.md); TCP retransmits what was dropped meanwhile
    for i, h in enumerate(hosts):
        held = h.cli_json("net", "hold", f"mn.node{i}")
        assert held["held"] and held["interfaces"]
    keep = [h.snapshot(f"mn.node{i}") for i, h in enumerate(hosts)]
    for i, h in enumerate(hosts):
        h.cli_json("net", "release", f"mn.node{i}")
    assert all(s["mode"] == "keep-running" for s in keep)
    assert ha.state("mn.node0") == ha.state("mn.node1") == "running"
    ha.wait_step("mn.node0", 20)
    stop = [h.snapshot(f"mn.node{i}", "--stop") for i, h in enumerate(hosts)]
    assert ha.wait_end("mn.node0", 120) == 75 and ha.wait_end("mn.node1", 120) == 75
    manifest = ha.cli_json("show", stop[0]["snapshot"])
    assert manifest["job"]["net"]["address"] == net.address and manifest["job"]["net"]["bridge"] == net.bridge
    # both hosts' parts of the job network went with their sandboxes
    assert not {net.bridge, net.vxlan} & {x["ifname"] for x in Host(ha.ns_pid).links()}

    # node 0's image on host B, node 1's on host A
    hb.restore_here(stop[0]["snapshot"])
    ha.restore_here(stop[1]["snapshot"])
    assert ha.wait_end("mn.node0", 120) == 0 and ha.wait_end("mn.node1", 120) == 0
    ref = reference(workload("ddp_basic"), ARGS, nproc=4)
    assert_identical(ha, ref)

    # the older, keep-running pair, restored after the job ended (back on their own hosts this time)
    ha.restore_here(keep[0]["snapshot"])
    hb.restore_here(keep[1]["snapshot"])
    assert ha.wait_end("mn.node0", 120) == 0 and ha.wait_end("mn.node1", 120) == 0
    assert_identical(ha, ref)
