"""The job network on one host: the job's bridge, each sandbox's veth, the VXLAN overlay to other hosts.

Everything is done with iproute2 (``ip``, ``bridge``), which CRIU itself needs on the machine too (it saves
and restores a namespace's addresses and routes with ``ip``): the system's when it is on PATH, else the copy
in Cryosleep's private CRIU prefix (``net/tools.py``; the GPU machines have no iproute2); and
the gateway's rules with the ``nft`` that comes with CRIU.

A :class:`Host` acts on the network namespace it is given (``ns_pid``: any process in it) or on the
caller's own: tests use network namespaces as simulated hosts, and a real agent simply runs in its host's
namespace.

    bridge    one per job per host (``JobNet.bridge``): switches the job's frames, and is the sandboxes'
              gateway out of the job network (subnet + 1, nftables masquerade; nft from the CRIU prefix)
    veth      one per sandbox: the host end (``csv...``) is a port of the bridge, the other end is moved into
              the sandbox's namespace by its init's PID and named ``eth0`` there, with the node's job address
    vxlan     one per job per host when the job spans hosts (``JobNet.vxlan``, the job's VNI, UDP 4789), a
              port of the bridge; frames for unknown or broadcast destinations are sent to every peer VTEP
              (head-end replication through all-zero FDB entries), so no multicast is needed underneath

Nothing here is left half done: a step that fails undoes what the same call created, and raises a
:class:`NetError` that says what failed, why (iproute2's own words) and what to do.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cryosleep.core import proctree
from cryosleep.errors import IprouteUnavailable, NetError
from cryosleep.net.plan import VXLAN_PORT, JobNet
from cryosleep.net.tools import iproute_argv, nft_argv

__all__ = ["Host"]

HINT = "run as root on Linux with the veth, bridge and vxlan kernel modules; `cryosleep check`"
ZERO_MAC = "00:00:00:00:00:00"


@dataclass(frozen=True)
class Host:
    """A host's network namespace (``ns_pid`` None: the caller's own)."""

    ns_pid: int | None = None

    # -- running iproute2 -----------------------------------------------------------------------------

    def _prefix(self, ns_pid: int | None) -> list[str]:
        return proctree.nsenter_net(ns_pid) if ns_pid is not None else []

    def run(self, tool: str, *args: str, what: str, ns_pid: int | None = None, ok_if: Sequence[str] = (),
            hint: str = HINT) -> str:
        """Run iproute2's ``tool`` (``ip``, ``bridge``) with ``ARGS`` in this host's namespace (or in
        ``ns_pid``'s); a failure whose message contains one of ``ok_if`` is not one."""
        try:
            program = iproute_argv(tool)
        except IprouteUnavailable as e:
            raise NetError(what, f"{e.what}: {e.why}", e.hint) from None
        return self._exec([*program, *args], what=what, ns_pid=ns_pid, ok_if=ok_if, hint=hint)

    def _exec(self, argv: Sequence[str], *, what: str, ns_pid: int | None = None, ok_if: Sequence[str] = (),
              hint: str = HINT, stdin: str | None = None) -> str:
        cmd = [*self._prefix(ns_pid if ns_pid is not None else self.ns_pid), *argv]
        try:
            res = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NetError(what, f"{' '.join(cmd)}: {e}", hint) from None
        if res.returncode != 0:
            err = (res.stderr or res.stdout).strip()
            if any(s in err for s in ok_if):
                return res.stdout
            raise NetError(what, f"{' '.join(cmd)}: {err or f'exit code {res.returncode}'}", hint)
        return res.stdout

    def ip(self, *args: str, what: str, ok_if: Sequence[str] = (), hint: str = HINT) -> str:
        return self.run("ip", *args, what=what, ok_if=ok_if, hint=hint)

    def links(self, *, ns_pid: int | None = None) -> list[dict[str, Any]]:
        out = self.run("ip", "-j", "-d", "link", "show", what="cannot list network interfaces", ns_pid=ns_pid)
        links: list[dict[str, Any]] = json.loads(out or "[]")
        return links

    def link(self, name: str) -> dict[str, Any] | None:
        return next((x for x in self.links() if x.get("ifname") == name), None)

    # -- the bridge -----------------------------------------------------------------------------------

    def ensure_bridge(self, net: JobNet) -> bool:
        """Create the job's bridge unless it exists (another node of the job may share this host); bring
        it up, as the job's gateway (``ensure_gateway``). Returns whether it was created here."""
        created = self.link(net.bridge) is None
        if created:
            self.ip("link", "add", net.bridge, "address", net.gateway_mac, "type", "bridge",
                    what=f"cannot create the job bridge {net.bridge}", ok_if=("File exists",))
        self.ip("link", "set", net.bridge, "mtu", str(net.mtu), "up", what=f"cannot bring up the bridge {net.bridge}")
        self.ensure_gateway(net)
        return created

    # -- the gateway ----------------------------------------------------------------------------------

    def nft(self, *args: str, what: str, ok_if: Sequence[str] = (), stdin: str | None = None) -> str:
        """``nft`` (the one that comes with CRIU) in this host's network namespace."""
        program = nft_argv()
        if program is None:
            raise NetError(what, "no nft binary: nft is not on PATH and no private CRIU prefix (which carries one) "
                           "is installed", "run `cryosleep criu install` (as root), or install the system's nftables")
        return self._exec([*program, *args], what=what, ok_if=ok_if, stdin=stdin)

    def ensure_gateway(self, net: JobNet) -> None:
        """The bridge is the sandboxes' gateway out of the job network: the address subnet + 1 (the same on
        every host, with the same MAC), IPv4 forwarding on, and the job's traffic to anywhere else masqueraded
        behind this host's address (nftables tables ``cryosleep_<bridge>``). Nothing about the gateway crosses
        the overlay (each host answers for it alone), so a sandbox, restored anywhere, always leaves through its
        own host. Idempotent."""
        self.ip("addr", "add", f"{net.gateway}/{net.prefixlen}", "dev", net.bridge,
                what=f"cannot give the bridge {net.bridge} the job's gateway address {net.gateway}",
                ok_if=("File exists", "already assigned"))
        self._exec(["sh", "-c", 'test "$(cat /proc/sys/net/ipv4/ip_forward)" = 1 || '
                    "echo 1 > /proc/sys/net/ipv4/ip_forward"], what="cannot turn on IPv4 forwarding")
        table = gateway_table(net)
        have = self.nft("list", "tables", what="cannot list the nftables tables")
        if f"table ip {table}\n" in have and f"table bridge {table}\n" in have:
            return  # another sandbox of the job on this host set it up: never a moment without it
        self.remove_gateway(net)
        self.nft("-f", "-", what=f"cannot set up the job's gateway {net.gateway} (nftables table {table})", stdin=(
            f"table ip {table} {{\n"
            f"  chain postrouting {{ type nat hook postrouting priority srcnat; policy accept;\n"
            f"    ip saddr {net.subnet} ip daddr != {net.subnet} masquerade; }}\n"
            f"  chain forward {{ type filter hook forward priority filter; policy accept;\n"
            f"    iifname \"{net.bridge}\" accept;\n"
            f"    oifname \"{net.bridge}\" ct state established,related accept; }}\n"
            f"}}\n"
            f"table bridge {table} {{\n"
            f"  chain forward {{ type filter hook forward priority filter; policy accept;\n"
            f"    oifname \"{net.vxlan}\" arp daddr ip {net.gateway} drop; }}\n"
            f"  chain output {{ type filter hook output priority filter; policy accept;\n"
            f"    oifname \"{net.vxlan}\" ether saddr {net.gateway_mac} drop; }}\n"
            f"}}\n"))

    def remove_gateway(self, net: JobNet) -> None:
        table = gateway_table(net)
        for family in ("ip", "bridge"):
            self.nft("delete", "table", family, table, what=f"cannot delete the nftables table {table}",
                     ok_if=("No such file", "does not exist"))

    def bridge_ports(self, bridge: str) -> list[str]:
        return [str(x["ifname"]) for x in self.links() if x.get("master") == bridge]

    def remove_bridge_if_unused(self, net: JobNet) -> bool:
        """Delete the job's bridge (and its VXLAN device) once no sandbox of the job is attached here."""
        ports = [p for p in self.bridge_ports(net.bridge) if p != net.vxlan]
        if ports or self.link(net.bridge) is None:
            return False
        self.ip("link", "del", net.vxlan, what=f"cannot delete {net.vxlan}", ok_if=("Cannot find device",))
        self.ip("link", "del", net.bridge, what=f"cannot delete the bridge {net.bridge}",
                ok_if=("Cannot find device",))
        self.remove_gateway(net)
        return True

    # -- a sandbox ------------------------------------------------------------------------------------

    def attach(self, net: JobNet, sandbox_pid: int, host_end: str) -> None:
        """Give the sandbox whose init is ``sandbox_pid`` its ``eth0`` with the node's job address: a veth
        pair whose host end ``host_end`` is a port of the job's bridge. The bridge must exist."""
        try:
            self.ip("link", "add", host_end, "mtu", str(net.mtu), "type", "veth", "peer", "name", net.ifname,
                    "mtu", str(net.mtu), "netns", str(sandbox_pid),
                    what=f"cannot create the veth pair {host_end}/{net.ifname} for the sandbox {sandbox_pid}")
            self.ip("link", "set", host_end, "master", net.bridge, "up",
                    what=f"cannot attach {host_end} to the bridge {net.bridge}")
            for args in (["addr", "add", net.cidr, "dev", net.ifname],
                         ["link", "set", net.ifname, "up"],
                         ["link", "set", "lo", "up"],
                         ["route", "add", "default", "via", net.gateway, "dev", net.ifname]):
                self.run("ip", *args, what=f"cannot configure {net.ifname} in the sandbox {sandbox_pid}",
                         ns_pid=sandbox_pid)
        except NetError:
            self.detach(host_end)
            raise

    def detach(self, host_end: str) -> None:
        """Delete a sandbox's veth (the pair goes with it; it also goes by itself when the sandbox ends)."""
        self.ip("link", "del", host_end, what=f"cannot delete {host_end}", ok_if=("Cannot find device",))

    def host_end_of(self, sandbox_pid: int, ifname: str) -> str | None:
        """The name, here, of the host end of the sandbox's veth ``ifname`` (None: none, or not a veth)."""
        inside = next((x for x in self.links(ns_pid=sandbox_pid) if x.get("ifname") == ifname), None)
        if inside is None or (inside.get("linkinfo") or {}).get("info_kind") != "veth":
            return None
        peer = inside.get("link_index")
        for x in self.links():
            if x.get("ifindex") == peer and (x.get("linkinfo") or {}).get("info_kind") == "veth":
                return str(x["ifname"])
        return None

    def sandbox_veths(self, sandbox_pid: int) -> list[tuple[str, str | None]]:
        """Each veth inside the sandbox's network namespace with the name of its host end here (None when
        the peer is not in this namespace); [] when the sandbox shares this namespace."""
        if self.ns_pid is None and _same_netns(sandbox_pid):
            return []
        mine = self.links()
        by_index = {x.get("ifindex"): str(x["ifname"]) for x in mine
                    if (x.get("linkinfo") or {}).get("info_kind") == "veth"}
        return [(str(x["ifname"]), by_index.get(x.get("link_index")) if "link_netnsid" in x else None)
                for x in self.links(ns_pid=sandbox_pid) if (x.get("linkinfo") or {}).get("info_kind") == "veth"]

    # -- the overlay ----------------------------------------------------------------------------------

    def ensure_overlay(self, net: JobNet, peers: Sequence[str], *, local: str | None = None,
                       underlay: str | None = None) -> None:
        """Link this host's bridge of the job to the other hosts of the job: a VXLAN device with the job's
        VNI, a port of the bridge, that floods to every peer VTEP in ``peers`` (their underlay addresses;
        the coordinator hands them out). Idempotent: a second call only updates the peer list."""
        bad = [p for p in peers if not _is_ipv4(p)]
        if bad or (local is not None and not _is_ipv4(local)):
            raise NetError("bad overlay peer address", ", ".join(bad or [str(local)]),
                           "peers are the other hosts' IPv4 addresses on the network between the hosts")
        if self.link(net.vxlan) is None:
            args = ["link", "add", net.vxlan, "type", "vxlan", "id", str(net.vni), "dstport", str(VXLAN_PORT)]
            if local:
                args += ["local", local]
            if underlay:
                args += ["dev", underlay]
            self.ip(*args, what=f"cannot create the VXLAN device {net.vxlan} (VNI {net.vni})",
                    hint=HINT + "; another job may use the same VNI on this host",
                    ok_if=("File exists",))  # another node of the job on this host made it just now
            try:
                self.ip("link", "set", net.vxlan, "master", net.bridge, "up",
                        what=f"cannot attach {net.vxlan} to the bridge {net.bridge}")
            except NetError:
                self.ip("link", "del", net.vxlan, what=f"cannot delete {net.vxlan}", ok_if=("Cannot find device",))
                raise
        self.set_peers(net, peers)

    def overlay_peers(self, net: JobNet) -> list[str]:
        out = self.run("bridge", "-j", "fdb", "show", "dev", net.vxlan, what=f"cannot read the FDB of {net.vxlan}")
        return sorted({str(e["dst"]) for e in json.loads(out or "[]") if e.get("mac") == ZERO_MAC and e.get("dst")})

    def set_peers(self, net: JobNet, peers: Sequence[str]) -> None:
        """Make the overlay flood to exactly ``peers`` (a restore on other hosts changes them)."""
        have = set(self.overlay_peers(net))
        want = set(peers)
        for p in sorted(want - have):
            self.run("bridge", "fdb", "append", ZERO_MAC, "dev", net.vxlan, "dst", p,
                     what=f"cannot add the overlay peer {p} to {net.vxlan}")
        for p in sorted(have - want):
            self.run("bridge", "fdb", "del", ZERO_MAC, "dev", net.vxlan, "dst", p,
                     what=f"cannot remove the overlay peer {p} from {net.vxlan}", ok_if=("No such file",))
        if have - want:
            # what the VXLAN learned to send straight to a dropped peer (a node's MAC, behind its old host) would
            # still go there, for minutes, after that node moved (a migration): forgotten, it floods to the peers
            out = self.run("bridge", "-j", "fdb", "show", "dev", net.vxlan, what=f"cannot read the FDB of {net.vxlan}")
            for e in json.loads(out or "[]"):
                if e.get("dst") in have - want and e.get("mac") and e.get("mac") != ZERO_MAC:
                    self.run("bridge", "fdb", "del", str(e["mac"]), "dev", net.vxlan, "dst", str(e["dst"]),
                             what=f"cannot forget {e['mac']} behind {e['dst']} on {net.vxlan}",
                             ok_if=("No such file",))


def gateway_table(net: JobNet) -> str:
    """The job's nftables tables on a host (families ip and bridge)."""
    return f"cryosleep_{net.bridge}"


def _same_netns(pid: int) -> bool:
    return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True
