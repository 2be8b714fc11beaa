"""What an agent does with the job network around one sandbox: attach a fresh one, prepare a host for a
restored one (CRIU then recreates the veth itself), and release the host's part when the sandbox is gone."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from cryosleep.errors import NetError
from cryosleep.net.host import Host
from cryosleep.net.plan import JobNet, host_end_name

__all__ = ["after_restore", "attach", "hold", "move_peer", "prepare", "prepare_restore", "release", "set_peers",
           "undo_restore"]


def prepare(net: JobNet, peers: Sequence[str] = (), host: Host | None = None) -> None:
    """The job's bridge on this host, and the overlay to ``peers`` (other hosts of the job) when given."""
    host = host or Host()
    host.ensure_bridge(net)
    if peers:
        host.ensure_overlay(net, peers)


def set_peers(net_json: dict[str, Any], peers: Sequence[str], host: Host | None = None) -> None:
    """The overlay here now floods to exactly ``peers`` (peers learned later: coordinated.NetPeers). None
    while every other node is on this host: the bridge links them."""
    host = host or Host()
    net = JobNet.from_json(net_json)
    if peers or host.link(net.vxlan) is not None:
        host.ensure_overlay(net, peers)


def move_peer(net_json: dict[str, Any], old: str, new: str, host: Host | None = None) -> list[str]:
    """A node of the job moved from the host at ``old`` to the one at ``new`` (a live migration): the overlay here
    floods to ``new`` instead of ``old`` (either "": none, as when it is this host), and what it learned to send
    ``old`` directly is forgotten (``Host.set_peers``). Returns the peers now."""
    host = host or Host()
    net = JobNet.from_json(net_json)
    for attempt in range(3):
        try:
            have = set(host.overlay_peers(net)) if host.link(net.vxlan) is not None else set()
            peers = sorted(((have - {old}) | {new}) - {""})
            if peers or have:
                host.ensure_overlay(net, peers)
            return peers
        except NetError:
            # the node's agent may be making the same change from the run's peer board (coordinated.NetPeers: the
            # coordinator wrote the new address there first): an entry appended or deleted meanwhile fails one
            # step of ours; a second look finds it done
            if attempt == 2:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


def attach(net_json: dict[str, Any], sandbox_pid: int, peers: Sequence[str] = (), host: Host | None = None) -> str:
    """Put a freshly started sandbox on the job network; returns the host end of its veth."""
    host = host or Host()
    net = JobNet.from_json(net_json)
    prepare(net, peers, host)
    end = host_end_name()
    host.attach(net, sandbox_pid, end)
    return end


def release(net_json: dict[str, Any], host: Host | None = None, own_end: str | None = None) -> None:
    """Best effort, after the sandbox ended: remove the job's bridge and overlay here if nothing uses them.

    ``own_end``: the ended sandbox's veth host end. The kernel tears a dead namespace's veth down in the
    background, so right after the sandbox's end it can still be a port of the bridge (seen under load); it
    is deleted here first, so that the bridge is not kept for a sandbox that is gone."""
    host = host or Host()
    try:
        if own_end:
            host.detach(own_end)
        host.remove_bridge_if_unused(JobNet.from_json(net_json))
    except (NetError, TypeError, ValueError):
        pass


def prepare_restore(net_json: dict[str, Any], peers: Sequence[str] = (),
                    host: Host | None = None) -> list[tuple[str, str, str]]:
    """Before CRIU restores a sandbox of the job network here: the bridge (and overlay) ready, and a fresh
    host end name for its veth. Returns CRIU's (name inside, host end, bridge) list."""
    net = JobNet.from_json(net_json)
    prepare(net, peers, host)
    return [(net.ifname, host_end_name(), net.bridge)]


def undo_restore(net_json: dict[str, Any], veths: Sequence[tuple[str, str, str]], host: Host | None = None) -> None:
    """After a failed restore: CRIU leaves the veth it created behind; remove it, and the job's bridge and
    overlay here if nothing else uses them."""
    for _, end, _ in veths:
        try:
            (host or Host()).detach(end)
        except NetError:
            pass
    if veths:
        release(net_json, host)


def after_restore(veths: Sequence[tuple[str, str, str]], host: Host | None = None) -> None:
    """After CRIU restored a sandbox: its veth's host end up (it may have been dumped while held)."""
    for _, end, _ in veths:
        (host or Host()).ip("link", "set", end, "up", what=f"cannot bring up {end}")


def hold(sandbox_pid: int, held: bool, host: Host | None = None) -> list[str]:
    """Cut the sandbox off the job network (``held``) or connect it again; returns the host ends changed.

    Why: the nodes of a job are dumped one after the other. A node that goes on running after its
    keep-running dump would exchange data with nodes not yet dumped, and their images would disagree
    (bytes acknowledged in one image, never sent in the other). Held from before the first node's dump to
    after the last one's, no frame crosses between nodes, so every pair of images agrees; TCP retransmits
    what was dropped meanwhile (its backoff can add a few seconds after a long hold)."""
    host = host or Host()
    ends = [end for _, end in host.sandbox_veths(sandbox_pid) if end is not None]
    if not ends:
        raise NetError(f"the sandbox {sandbox_pid} has no job network interface here",
                       "it shares the host's network, or its veth's host end is in another network namespace",
                       "run this on the job's node, in the agent's network namespace; jobs started without "
                       "--net job have nothing to hold")
    for end in ends:
        # The bridge port, not the link: a link taken down would mark the sandbox's routes "linkdown", and
        # `ip route restore` (run by CRIU) refuses such routes. A disabled port drops frames, carrier stays.
        host.run("bridge", "link", "set", "dev", end, "state", "0" if held else "3",
                 what=f"cannot {'disable' if held else 'enable'} the bridge port {end}")
    return ends
