"""The job network's address plan: pure functions of the job's run id, the node's rank and a pool.

Every job gets a private subnet (default a /24 out of ``10.224.0.0/12``, ``$CRYOSLEEP_NET_POOL`` changes the
pool), chosen by hashing its run id, so that every node's agent computes the same plan without talking to
the others. Node I of the job has address ``subnet + 2 + I`` on the interface ``eth0`` of its sandbox (``+1``
is kept free for a gateway). The address is configured inside the sandbox's network namespace, so a CRIU
image carries it: a restored node has the same address wherever it lands, and the TCP connections between
ranks go on.

Names on a host are derived from the same hash: the job's bridge ``csb<8 hex>``, its VXLAN device
``csx<8 hex>`` with VNI ``1 + hash mod (2^24 - 2)``. Subnets of different jobs may coincide: each job's
sandboxes see only their own bridge, so that is harmless. VNIs must not coincide between jobs sharing hosts;
24 bits make that unlikely, and a coordinator can hand out VNIs instead (``vni=``).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import secrets
from dataclasses import asdict, dataclass
from typing import Any

from cryosleep.errors import UsageError

__all__ = ["DEFAULT_POOL", "IFNAME", "JobNet", "host_end_name", "job_net", "node_address", "pool"]

DEFAULT_POOL = "10.224.0.0/12"
DEFAULT_PREFIXLEN = 24
IFNAME = "eth0"
# VXLAN adds 50 bytes; the sandbox's interface leaves room for them whether the job spans hosts or not, so
# that an image taken on one host restores into an overlay unchanged (its MTU is part of the image).
MTU = 1450
VXLAN_PORT = 4789
FIRST_HOST = 2  # .1 is left for a gateway


@dataclass(frozen=True)
class JobNet:
    """One node's place in its job's network (recorded in the job spec, hence in every snapshot manifest)."""

    subnet: str  # the job's subnet, e.g. "10.231.17.0/24"
    address: str  # this node's address in it, e.g. "10.231.17.2"
    prefixlen: int
    bridge: str  # the job's bridge on every host, e.g. "csb1a2b3c4d"
    vxlan: str  # the job's VXLAN device on every host
    vni: int
    ifname: str = IFNAME
    mtu: int = MTU

    @property
    def cidr(self) -> str:
        return f"{self.address}/{self.prefixlen}"

    @property
    def gateway(self) -> str:
        """Every host's job bridge has this address (subnet + 1): the sandboxes' way out of the job network."""
        return str(ipaddress.IPv4Network(self.subnet).network_address + 1)

    @property
    def gateway_mac(self) -> str:
        """The bridge's MAC, the same on every host of the job, so that a sandbox restored on another host finds
        its gateway at the address and MAC its image remembers."""
        tag = self.bridge[3:11]
        return "02:c5:" + ":".join(tag[i:i + 2] for i in range(0, 8, 2))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobNet:
        return cls(**data)


def _digest(run_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"cryosleep-net:{run_id}".encode()).digest()[:8], "big")


def pool(text: str | None = None) -> ipaddress.IPv4Network:
    """The pool job subnets come from: ``text``, else ``$CRYOSLEEP_NET_POOL``, else DEFAULT_POOL."""
    text = text or os.environ.get("CRYOSLEEP_NET_POOL") or DEFAULT_POOL
    try:
        net = ipaddress.IPv4Network(text, strict=True)
    except ValueError as e:
        raise UsageError(f"bad job network pool {text!r}", str(e),
                         "give an IPv4 network such as 10.224.0.0/12 ($CRYOSLEEP_NET_POOL)") from None
    if not net.is_private:
        raise UsageError(f"the job network pool {text} is not a private range",
                         "job addresses must never be routable outside the job",
                         "use a range inside 10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16")
    return net


def job_net(run_id: str, node_rank: int, nnodes: int, *, pool_text: str | None = None,
         prefixlen: int = DEFAULT_PREFIXLEN, vni: int | None = None) -> JobNet:
    """Node ``node_rank``'s place in the network of the job ``run_id`` (the same on every node)."""
    if not run_id:
        raise UsageError("a job network needs the job's run id", "every node derives the plan from it",
                         "give the same --run-id to every node of the job")
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"node rank {node_rank} is outside 0..{nnodes - 1}", "", "check --node-rank and --nnodes")
    base = pool(pool_text)
    if not base.prefixlen <= prefixlen <= 29:
        raise UsageError(f"a /{prefixlen} job subnet does not fit the pool {base}", "",
                         f"use a prefix length between /{base.prefixlen} and /29")
    subnets = 1 << (prefixlen - base.prefixlen)
    hosts = (1 << (32 - prefixlen)) - FIRST_HOST - 1  # minus network, gateway, broadcast
    if nnodes > hosts:
        raise UsageError(f"{nnodes} nodes do not fit a /{prefixlen} job subnet (at most {hosts})", "",
                         "use a larger subnet (a smaller prefix length)")
    h = _digest(run_id)
    subnet = ipaddress.IPv4Network((int(base.network_address) + (h % subnets) * (1 << (32 - prefixlen)),
                                    prefixlen))
    tag = f"{h >> 32:08x}"
    return JobNet(
        subnet=str(subnet),
        address=node_address(subnet, node_rank),
        prefixlen=prefixlen,
        bridge=f"csb{tag}",
        vxlan=f"csx{tag}",
        vni=vni if vni is not None else 1 + h % ((1 << 24) - 2),
    )


def node_address(subnet: ipaddress.IPv4Network | str, node_rank: int) -> str:
    net = ipaddress.IPv4Network(subnet)
    return str(net.network_address + FIRST_HOST + node_rank)


def host_end_name() -> str:
    """A fresh name for the host end of a sandbox's veth (unique per attach: a restore gets a new one)."""
    return f"csv{secrets.token_hex(5)}"
