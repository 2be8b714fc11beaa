"""Two simulated hosts on this machine, for the multi-node job tests (tests/jobs/test_multinode.py) and the
chaos suite's multi-node rounds (tests/jobs/chaos_multinode.py).

Each "host" is a network namespace of its own (held by a sleeping process), joined to the other by a veth
pair as the network between the hosts (10.250.1.1 <-> 10.250.1.2). Each node's agent runs in its host's
namespace (`nsenter --net`), so each host has its own bridge for the job and the two are linked by the
job's VXLAN overlay. Ending the holders ends the namespaces, and every bridge, VXLAN and veth in them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cryosleep.core import proctree
from cryosleep.net import Host
from tests.jobs.harness import Harness, workload

UNDERLAY = ("10.250.1.1", "10.250.1.2")


class HostHarness(Harness):
    """The harness, with every CLI call made from inside one simulated host's network namespace."""

    def __init__(self, home: Path, ns_pid: int, peer: str) -> None:
        super().__init__(home, prefix=proctree.nsenter_net(ns_pid))
        self.ns_pid = ns_pid
        self.peer = peer

    def run_node(self, name: str, rank: int, port: int, coordinator: str, args: list[str]) -> dict[str, Any]:
        out: dict[str, Any] = self.cli_json(
            "run", "--detach", "--name", name, "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "2",
            "--master-port", str(port), "--run-id", f"{name}-run", "--net", "job",  # no --net-peers: learned
            "--coordinator", coordinator, str(workload("ddp_basic")), *args)
        return out

    def coordinator(self, *args: str) -> Any:
        return json.loads(self.cli("coordinator", *args, "--json").stdout)

    def restore_here(self, sid: str, node: int, *extra: str, peers: bool = True) -> dict[str, Any]:
        """``peers``: --net-peers given; else the overlay's peers are learned at the restore's barrier."""
        given = ["--net-peers", self.peer] if peers else []
        out: dict[str, Any] = self.cli_json("restore", "--detach", *given, "--node-rank", str(node), *extra, sid)
        return out


SPARE_LINK = ("10.250.2.1", "10.250.2.2")  # host A <-> host C, the spare of three_hosts


@contextmanager
def two_hosts(home: Path, jobs: tuple[str, ...]) -> Iterator[tuple[HostHarness, HostHarness]]:
    """The two hosts; on the way out every job of ``jobs`` still running is killed, then the hosts go."""
    with _hosts(home, jobs, spare=False) as hs:
        yield hs[0], hs[1]


@contextmanager
def three_hosts(home: Path, jobs: tuple[str, ...]) -> Iterator[tuple[HostHarness, HostHarness, HostHarness]]:
    """The two hosts and a third, C (a spare), linked to host A (SPARE_LINK, routed: C reaches host A's
    UNDERLAY address, where the tests' coordinator listens, through it)."""
    with _hosts(home, jobs, spare=True) as hs:
        yield hs[0], hs[1], hs[2]


@contextmanager
def _hosts(home: Path, jobs: tuple[str, ...], spare: bool) -> Iterator[list[HostHarness]]:
    holders: list[subprocess.Popen[bytes]] = []
    harnesses: list[HostHarness] = []
    try:
        for _ in range(3 if spare else 2):
            p = subprocess.Popen(["unshare", "--net", "--", "sleep", "3600"])
            holders.append(p)
            end = time.monotonic() + 5
            while os.readlink(f"/proc/{p.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
                assert time.monotonic() < end
                time.sleep(0.01)
        a, b = Host(holders[0].pid), Host(holders[1].pid)
        a.ip("link", "add", "under0", "type", "veth", "peer", "name", "under1", "netns", str(holders[1].pid),
             what="the network between the simulated hosts")
        links = [(a, "under0", UNDERLAY[0]), (b, "under1", UNDERLAY[1])]
        if spare:
            c = Host(holders[2].pid)
            a.ip("link", "add", "under2", "type", "veth", "peer", "name", "under3", "netns", str(holders[2].pid),
                 what="the network between host A and the spare")
            links += [(a, "under2", SPARE_LINK[0]), (c, "under3", SPARE_LINK[1])]
        for host, dev, addr in links:
            host.run("ip", "addr", "add", f"{addr}/30", "dev", dev, what="underlay")
            host.run("ip", "link", "set", dev, "up", what="underlay")
            host.run("ip", "link", "set", "lo", "up", what="loopback")  # CRIU probes TCP repair on it
        if spare:
            c.run("ip", "route", "add", f"{UNDERLAY[0]}/32", "via", SPARE_LINK[0], what="the spare's route to A")
        harnesses = [HostHarness(home, holders[0].pid, UNDERLAY[1]), HostHarness(home, holders[1].pid, UNDERLAY[0])]
        if spare:
            harnesses.append(HostHarness(home, holders[2].pid, SPARE_LINK[0]))
        yield harnesses
    finally:
        for name in jobs:
            if harnesses and harnesses[0].job(name).exists() and harnesses[0].state(name) in ("running", "starting"):
                harnesses[0].kill_all(name)
        for p in holders:  # the hosts' namespaces, and every bridge, VXLAN and veth in them, go with these
            p.send_signal(signal.SIGKILL)
            p.wait()


def start_host_daemon(h: HostHarness, name: str, url: str) -> subprocess.Popen[str]:
    """`cryosleep host serve` in the simulated host's namespace; returns once it serves."""
    p = subprocess.Popen([*proctree.nsenter_net(h.ns_pid), sys.executable, "-m", "cryosleep.cli.main",
                          "host", "serve", "--name", name, "--coordinator", url, "--poll-wait", "2", "--json"],
                         stdout=subprocess.PIPE, text=True, env=h.env)
    assert p.stdout is not None
    first = json.loads(p.stdout.readline())
    assert first["event"] == "serving" and first["host"] == name, first
    return p


def restore_pair(sid: str, node0_on: HostHarness, node1_on: HostHarness, *extra: str, peers: bool = True) -> None:
    """Both nodes' restores at once: each waits at the coordinator's barrier for the other."""
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda a: a[0].restore_here(sid, a[1], *extra, peers=peers), ((node0_on, 0), (node1_on, 1))))
