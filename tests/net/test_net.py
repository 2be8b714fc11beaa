"""The job network: the address plan (pure), and bridge, veth and VXLAN overlay set up and torn down in real
network namespaces (as root), with TCP between sandboxes as the proof."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from cryosleep.core import proctree
from cryosleep.errors import UsageError
from cryosleep.net import Host, JobNet, NetError, host_end_name, job_net, node_address
from cryosleep.net import sandbox as net_sandbox
from cryosleep.net.plan import DEFAULT_POOL

# --------------------------------------------------------------------------------------- the plan (pure)


def test_every_node_derives_the_same_plan_and_distinct_addresses() -> None:
    nets = [job_net("run-42", r, 4) for r in range(4)]
    assert len({n.subnet for n in nets}) == 1 and len({n.bridge for n in nets}) == 1
    assert len({n.vni for n in nets}) == 1 and 1 <= nets[0].vni < 1 << 24
    addrs = [n.address for n in nets]
    assert len(set(addrs)) == 4
    subnet = ipaddress.IPv4Network(nets[0].subnet)
    assert subnet.subnet_of(ipaddress.IPv4Network(DEFAULT_POOL)) and subnet.prefixlen == 24
    assert all(ipaddress.IPv4Address(a) in subnet for a in addrs)
    assert addrs[0] == node_address(subnet, 0) == str(subnet.network_address + 2)
    for n in nets:
        assert len(n.bridge) <= 15 and len(n.vxlan) <= 15  # IFNAMSIZ
        assert JobNet.from_json(n.to_json()) == n
    assert len(host_end_name()) <= 15 and host_end_name() != host_end_name()


def test_other_jobs_get_other_names_and_the_pool_is_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = job_net("job-a", 0, 2), job_net("job-b", 0, 2)
    assert a.bridge != b.bridge and a.vni != b.vni
    monkeypatch.setenv("CRYOSLEEP_NET_POOL", "192.168.64.0/20")
    n = job_net("job-a", 1, 2, prefixlen=28)
    assert ipaddress.IPv4Network(n.subnet).subnet_of(ipaddress.IPv4Network("192.168.64.0/20"))
    assert n.cidr.endswith("/28")
    assert job_net("job-a", 0, 2, vni=77).vni == 77


@pytest.mark.parametrize(("run_id", "rank", "nnodes", "kw"), [
    ("", 0, 1, {}),
    ("r", 2, 2, {}),
    ("r", 0, 300, {}),
    ("r", 0, 1, {"pool_text": "8.8.0.0/16"}),
    ("r", 0, 1, {"pool_text": "10.0.0.1/8"}),
    ("r", 0, 1, {"pool_text": "10.0.0.0/16", "prefixlen": 12}),
])
def test_bad_plans_are_refused_with_a_reason(run_id: str, rank: int, nnodes: int, kw: dict[str, object]) -> None:
    with pytest.raises(UsageError) as e:
        job_net(run_id, rank, nnodes, **kw)  # type: ignore[arg-type]
    assert e.value.what and e.value.hint is not None


# ------------------------------------------------------------------------- real namespaces (root only)

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7001)); s.listen(1); print("ready", flush=True)
c, peer = s.accept(); c.sendall(c.recv(64).upper()); print(peer[0], flush=True)
"""
CLIENT = """
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], 7001), timeout=2); break
    except OSError:
        time.sleep(0.05)
c.sendall(b"hello"); print(c.recv(64).decode())
"""


class Namespaces:
    """Processes each holding a fresh network namespace; all killed at the end, which removes every
    interface inside them."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def new(self) -> int:
        p = subprocess.Popen(["unshare", "--net", "--", "sleep", "300"])
        self.procs.append(p)
        end = time.monotonic() + 5
        while os.readlink(f"/proc/{p.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
            assert time.monotonic() < end, "unshare did not make a network namespace"
            time.sleep(0.01)
        return p.pid

    def close(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
            p.wait()


@pytest.fixture
def ns() -> Iterator[Namespaces]:
    if os.geteuid() != 0:
        pytest.fail("network namespace tests need root")
    n = Namespaces()
    try:
        yield n
    finally:
        n.close()


def in_ns(pid: int, code: str, *args: str, wait: bool = True) -> subprocess.Popen[str]:
    p = subprocess.Popen([*proctree.nsenter_net(pid), sys.executable, "-c", code, *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        p.wait(timeout=30)
    return p


def talk(server_ns: int, server_addr: str, client_ns: int) -> tuple[str, str]:
    """A TCP exchange from the client's namespace to the server's address; (reply, peer seen by server)."""
    srv = in_ns(server_ns, SERVER, server_addr, wait=False)
    assert srv.stdout is not None
    assert srv.stdout.readline().strip() == "ready", srv.stderr.read() if srv.stderr else ""
    cli = in_ns(client_ns, CLIENT, server_addr)
    out, err = cli.communicate()
    peer, _ = srv.communicate(timeout=30)
    assert cli.returncode == 0, err
    return out.strip(), peer.strip()


def links(pid: int | None = None) -> set[str]:
    return {str(x["ifname"]) for x in Host().links(ns_pid=pid)}


def test_bridge_and_veths_link_two_sandboxes_and_tear_down(ns: Namespaces) -> None:
    host_pid = ns.new()  # a simulated host, so that nothing here touches this machine's own interfaces
    host = Host(host_pid)
    a, b = (job_net("t-bridge", r, 2) for r in range(2))
    sa, sb = ns.new(), ns.new()
    assert host.ensure_bridge(a) is True and host.ensure_bridge(b) is False  # the second node shares it
    ea, eb = host_end_name(), host_end_name()
    host.attach(a, sa, ea)
    host.attach(b, sb, eb)
    assert sorted(host.bridge_ports(a.bridge)) == sorted([ea, eb])
    assert {"eth0", "lo"} <= links(sa)
    assert host.sandbox_veths(sa) == [("eth0", ea)]
    assert host.host_end_of(sb, "eth0") == eb
    assert talk(sa, a.address, sb) == ("HELLO", b.address)
    # held (around multi-node snapshots): no frame crosses, the link itself stays up; then released
    assert net_sandbox.hold(sb, True, host=host) == [eb]
    probe = in_ns(sb, "import socket, sys\ntry:\n socket.create_connection((sys.argv[1], 9), timeout=1)\n"
                  "except ConnectionRefusedError:\n print('reached')\nexcept OSError:\n print('cut off')", a.address)
    assert probe.stdout is not None and probe.stdout.read().strip() == "cut off"
    assert "LOWER_UP" in (host.link(eb) or {}).get("flags", [])
    net_sandbox.hold(sb, False, host=host)
    assert talk(sa, a.address, sb) == ("HELLO", b.address)
    with pytest.raises(NetError):
        net_sandbox.hold(host_pid, True, host=Host())  # a namespace with no job veth
    assert host.remove_bridge_if_unused(a) is False  # still in use
    host.detach(ea)
    host.detach(eb)
    host.detach(eb)  # twice is fine
    assert "eth0" not in links(sa)
    assert host.remove_bridge_if_unused(a) is True
    assert a.bridge not in links(host_pid)


def test_a_failed_attach_leaves_nothing_behind(ns: Namespaces) -> None:
    host = Host(ns.new())
    net = job_net("t-fail", 0, 1)
    sandbox = ns.new()
    end = host_end_name()
    with pytest.raises(NetError) as e:
        host.attach(net, sandbox, end)  # no bridge yet
    assert net.bridge in e.value.what + e.value.why and e.value.hint
    assert end not in links(host.ns_pid) and "eth0" not in links(sandbox)
    with pytest.raises(NetError):
        host.ensure_overlay(net, ["not-an-address"])


def test_vxlan_overlay_links_sandboxes_on_two_hosts(ns: Namespaces) -> None:
    host_a, host_b = ns.new(), ns.new()
    A, B = Host(host_a), Host(host_b)
    # the network between the hosts: a veth pair, 10.250.0.1 <-> 10.250.0.2
    A.ip("link", "add", "under0", "type", "veth", "peer", "name", "under1", "netns", str(host_b), what="underlay")
    A.ip("addr", "add", "10.250.0.1/30", "dev", "under0", what="underlay")
    A.ip("link", "set", "under0", "up", what="underlay")
    B.run("ip", "addr", "add", "10.250.0.2/30", "dev", "under1", what="underlay")
    B.run("ip", "link", "set", "under1", "up", what="underlay")
    n0, n1 = job_net("t-vxlan", 0, 2), job_net("t-vxlan", 1, 2)
    s0, s1 = ns.new(), ns.new()
    net_sandbox.attach(n0.to_json(), s0, ["10.250.0.2"], host=A)
    net_sandbox.attach(n1.to_json(), s1, ["10.250.0.1"], host=B)
    assert A.overlay_peers(n0) == ["10.250.0.2"] and B.overlay_peers(n1) == ["10.250.0.1"]
    assert n0.vxlan in A.bridge_ports(n0.bridge)
    assert talk(s1, n1.address, s0) == ("HELLO", n0.address)
    # the peer list follows the job: a restore elsewhere replaces it
    A.ensure_overlay(n0, ["10.250.0.2", "10.250.0.9"])
    assert A.overlay_peers(n0) == ["10.250.0.2", "10.250.0.9"]
    A.set_peers(n0, ["10.250.0.2"])
    assert A.overlay_peers(n0) == ["10.250.0.2"]
    assert talk(s0, n0.address, s1) == ("HELLO", n1.address)
    # a live migration moves node 1 elsewhere: the overlay follows, and forgets the MAC it learned behind its old
    # host (else frames to that MAC went on to the old address for minutes); back again, they talk at once
    def learned_behind(dst: str) -> list[str]:
        out = A.run("bridge", "-j", "fdb", "show", "dev", n0.vxlan, what="fdb")
        return [e["mac"] for e in json.loads(out or "[]") if e.get("dst") == dst and e["mac"] != "00:00:00:00:00:00"]

    assert learned_behind("10.250.0.2")
    assert net_sandbox.move_peer(n0.to_json(), "10.250.0.2", "10.250.0.9", host=A) == ["10.250.0.9"]
    assert A.overlay_peers(n0) == ["10.250.0.9"] and not learned_behind("10.250.0.2")
    assert net_sandbox.move_peer(n0.to_json(), "10.250.0.9", "10.250.0.2", host=A) == ["10.250.0.2"]
    assert talk(s0, n0.address, s1) == ("HELLO", n1.address)
    # teardown: the sandbox's end goes with it, then the bridge and the overlay
    A.detach(A.sandbox_veths(s0)[0][1] or "")
    net_sandbox.release(n0.to_json(), host=A)
    assert not {n0.bridge, n0.vxlan} & links(host_a)
    assert n1.bridge in links(host_b)  # the other host's part is the other agent's


def test_the_gateway_takes_each_sandbox_out_through_its_own_host(ns: Namespaces) -> None:
    """Each host's job bridge is the gateway (subnet + 1, the same MAC everywhere): a sandbox reaches a server
    outside the job network, masqueraded behind its own host's address (the outside has no route back to the
    job subnet), and nothing about the gateway crosses the overlay."""
    host_a, host_b, outside = ns.new(), ns.new(), ns.new()
    A, B, W = Host(host_a), Host(host_b), Host(outside)
    A.ip("link", "add", "under0", "type", "veth", "peer", "name", "under1", "netns", str(host_b), what="underlay")
    A.ip("addr", "add", "10.250.0.1/30", "dev", "under0", what="underlay")
    A.ip("link", "set", "under0", "up", what="underlay")
    B.ip("addr", "add", "10.250.0.2/30", "dev", "under1", what="underlay")
    B.ip("link", "set", "under1", "up", what="underlay")
    for h, i in ((A, 0), (B, 1)):  # each host's own link to the outside world
        h.ip("link", "add", f"wan{i}", "type", "veth", "peer", "name", f"lan{i}", "netns", str(outside), what="wan")
        h.ip("addr", "add", f"10.251.{i}.1/30", "dev", f"wan{i}", what="wan")
        h.ip("link", "set", f"wan{i}", "up", what="wan")
        W.ip("addr", "add", f"10.251.{i}.2/30", "dev", f"lan{i}", what="wan")
        W.ip("link", "set", f"lan{i}", "up", what="wan")
        h.ip("route", "add", "default", "via", f"10.251.{i}.2", what="wan")
    n0, n1 = job_net("t-gw", 0, 2), job_net("t-gw", 1, 2)
    s0, s1 = ns.new(), ns.new()
    net_sandbox.attach(n0.to_json(), s0, ["10.250.0.2"], host=A)
    net_sandbox.attach(n1.to_json(), s1, ["10.250.0.1"], host=B)
    assert n0.gateway == n1.gateway and n0.gateway.endswith(".1") and n0.gateway_mac == n1.gateway_mac
    assert A.link(n0.bridge)["address"] == B.link(n1.bridge)["address"] == n0.gateway_mac  # type: ignore[index]
    assert talk(outside, "10.251.0.2", s0) == ("HELLO", "10.251.0.1")  # out through host A
    assert talk(outside, "10.251.0.2", s1) == ("HELLO", "10.251.1.1")  # out through host B, not A
    assert talk(s1, n1.address, s0) == ("HELLO", n0.address)  # the job's own traffic is not masqueraded
    # host A's sandbox asked only host A for the gateway: host B's stack never heard from it (an ARP request
    # for the gateway crossing the overlay would have made host B learn the asker's address)
    neigh = json.loads(B.ip("-j", "neigh", "show", "dev", n1.bridge, what="neighbours") or "[]")
    assert n0.address not in {e.get("dst") for e in neigh}, neigh
    net_sandbox.release(n0.to_json(), host=A, own_end=A.sandbox_veths(s0)[0][1])
    assert "cryosleep_" not in A.nft("list", "tables", what="tables")


def test_a_failed_restore_is_undone(ns: Namespaces) -> None:
    host_pid = ns.new()
    host = Host(host_pid)
    net = job_net("t-undo", 1, 2)
    veths = net_sandbox.prepare_restore(net.to_json(), (), host=host)
    (inside, end, bridge), = veths
    assert (inside, bridge) == ("eth0", net.bridge) and net.bridge in links(host_pid)
    # what CRIU leaves behind when it fails after creating the pair
    host.ip("link", "add", end, "type", "veth", "peer", "name", "leftover", what="a leftover veth")
    host.ip("link", "set", end, "master", bridge, what="a leftover veth")
    net_sandbox.undo_restore(net.to_json(), veths, host=host)
    assert not {end, "leftover", net.bridge} & links(host_pid)
