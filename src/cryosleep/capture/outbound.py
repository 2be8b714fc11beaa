"""Connections to peers outside the job (metrics, logging, HTTP APIs): drained before a dump, reset in the
restored copy.

CRIU restores every TCP connection of the job established, with its queues and sequence numbers
(``--tcp-established``). Between the job's own processes that is what makes a restore continue exactly: both
ends come back together. A peer outside the job was not captured: by the time the copy runs (minutes later,
or on another machine) it has closed its end, timed out, restarted, or is unreachable from here; whatever
the copy's send queue still held would be retransmitted into a stream the peer has left, or for many minutes
into a peer that no longer answers. So, for the connections this module picks (``classify``):

    snapshot  (phase ``outbound``, before the job is held or frozen) wait up to ``drain_s`` (default 2 s,
              never past the snapshot's deadline) for their send queues to empty, i.e. for every byte the
              job wrote to be acknowledged by the peer; record them, and what was left, in the manifest
              (``nodes[].outbound``). The running job is only observed (/proc/PID/net/tcp), never touched.
    restore   CRIU runs our action script at ``pre-resume``: the restored tasks exist, their sockets are out
              of repair mode and the network is unlocked, but no task has run yet. The script sorts the
              restored connections by the same rules and disconnects each one to reset through a copy of
              its file descriptor (pidfd_getfd, then ``connect(AF_UNSPEC)``): the kernel sends the peer a
              RST, drops the socket's queues, and the application's next call on it fails with ECONNRESET
              (then EPIPE or ENOTCONN), as after any network reset; a client that reconnects on error goes
              on. Then (restore phase ``outbound``) the agent reads the script's report and disconnects,
              late, whatever the script did not get to (it could not run, or was cut off by its alarm).

Only the restored copy is reset: a keep-running snapshot leaves the running job's connections alone.

Why not CRIU's ``--tcp-close``: it closes every connection at restore, the ones between ranks too. Why not
``ss -K`` (SOCK_DESTROY): it needs CONFIG_INET_DIAG_DESTROY, iproute2 on the machine (the GPU machines lack
it) and a 4-tuple lookup inside the sandbox's network namespace; a disconnect through the process's own
file descriptor needs none of these, and names the socket exactly (its inode).

Which connections (``classify``, pure): a connection of the job is left as CRIU restores it when

    1. its peer is a socket of the job itself (both ends held by processes of the sandbox),
    2. the sandbox has its own network namespace (``--net job``) and the peer is a loopback address,
    3. the peer is on the job network (another node of the job: the job's subnet, but for its gateway at
       subnet + 1, which is the host the sandbox runs on: a peer outside the job),
    4. the peer matches ``--outbound-keep``,
    5. ``--outbound-reset`` lists destinations and the peer matches none of them (``none``: nothing is reset);

every other connection (the default: every peer outside the job) is drained and reset.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import shlex
import signal
import stat
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from cryosleep.capture.criu import action_script
from cryosleep.core import proctree
from cryosleep.core.job import JobSpec, OutboundPolicy
from cryosleep.errors import UsageError
from cryosleep.store.manifest import NodeOutbound, OutboundConn
from cryosleep.timing import Phases

__all__ = [
    "Conn",
    "Dest",
    "Endpoint",
    "Policy",
    "RestoreReset",
    "Verdict",
    "before_dump",
    "classify",
    "job_connections",
    "parse_table",
    "reset",
]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_DRAIN_S = 2.0
POLL_S = 0.01
# The pre-resume script ends itself after this long (CRIU waits for it with the restored tasks stopped);
# what it did not reset by then the agent resets right after the restore.
HOOK_ALARM_S = 20
# /proc/net/tcp states (include/net/tcp_states.h) of sockets that are not connections to restore
NOT_CONNECTED = {"06": "TIME_WAIT", "07": "CLOSE", "0A": "LISTEN"}
STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
          "08": "CLOSE_WAIT", "09": "LAST_ACK", "0B": "CLOSING", **NOT_CONNECTED}
PLAN_ENV = "CRYOSLEEP_OUTBOUND_PLAN"

DEST_HINT = ("give addresses, networks and ports separated by commas: 10.0.0.5, 10.0.0.0/8, 10.0.0.5:8080, "
             "[fd00::1]:443, :9090 (any address, that port); or all / none for --outbound-reset")


# -- what a connection is -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    addr: Address
    port: int

    def __str__(self) -> str:
        return f"[{self.addr}]:{self.port}" if self.addr.version == 6 else f"{self.addr}:{self.port}"


@dataclass(frozen=True)
class Conn:
    """One TCP socket of the job that is (or was being) connected."""

    local: Endpoint
    remote: Endpoint
    state: str
    queued: int  # bytes written but not yet acknowledged by the peer (write_seq - snd_una)
    inode: int

    def to_json(self) -> dict[str, Any]:
        return {"local": str(self.local), "remote": str(self.remote), "state": self.state, "queued": self.queued}


def _addr(hex_addr: str) -> Address:
    """An address as /proc/net/tcp{,6} prints it: 32-bit words in host byte order. IPv4-mapped IPv6
    addresses (a dual-stack socket talking IPv4) come back as IPv4."""
    raw = b"".join(int(hex_addr[i:i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hex_addr), 8))
    a = ipaddress.ip_address(raw)
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def _endpoint(text: str) -> Endpoint:
    host, port = text.split(":")
    return Endpoint(_addr(host), int(port, 16))


def parse_table(text: str) -> list[Conn]:
    """The connections in the text of /proc/PID/net/tcp or tcp6 (listening and closed sockets left out)."""
    out: list[Conn] = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10 or f[3] in NOT_CONNECTED:
            continue
        tx, _rx = f[4].split(":")
        out.append(Conn(_endpoint(f[1]), _endpoint(f[2]), STATES.get(f[3], f[3]), int(tx, 16), int(f[9])))
    return out


def read_table(ns_pid: int) -> list[Conn]:
    """Every TCP connection of the network namespace that process ``ns_pid`` is in."""
    out: list[Conn] = []
    for name in ("tcp", "tcp6"):
        try:
            out += parse_table(Path(f"/proc/{ns_pid}/net/{name}").read_text())
        except FileNotFoundError:  # no IPv6 in this kernel
            continue
    return out


def socket_holders(tree: Iterable[int]) -> dict[int, list[tuple[int, int]]]:
    """Socket inode -> the (pid, fd) that hold it, over the processes of ``tree``."""
    held: dict[int, list[tuple[int, int]]] = {}
    for pid in tree:
        for f in proctree.open_files(pid):
            if f.target.startswith("socket:["):
                held.setdefault(int(f.target[len("socket:["):-1]), []).append((pid, f.fd))
    return held


def job_connections(init_pid: int, tree: Sequence[int] | None = None) -> tuple[
        list[Conn], dict[int, list[tuple[int, int]]]]:
    """The TCP connections held by the sandbox's processes, and who holds each socket."""
    held = socket_holders(proctree.tree(init_pid) if tree is None else tree)
    return [c for c in read_table(init_pid) if c.inode in held], held


# -- which connections: the policy --------------------------------------------------------------------


@dataclass(frozen=True)
class Dest:
    """A destination of ``--outbound-reset`` / ``--outbound-keep``: an address or network (None: any), and a
    port (None: any)."""

    net: Network | None
    port: int | None = None

    def matches(self, ep: Endpoint) -> bool:
        return (self.net is None or ep.addr in self.net) and (self.port is None or self.port == ep.port)

    def __str__(self) -> str:
        if self.net is None:
            return f":{self.port}"
        net = str(self.net.network_address) if self.net.prefixlen == self.net.max_prefixlen else str(self.net)
        if self.port is None:
            return net
        return f"[{net}]:{self.port}" if self.net.version == 6 else f"{net}:{self.port}"

    @classmethod
    def parse(cls, text: str, option: str = "--outbound-keep") -> Dest:
        t = text.strip()

        def bad(why: str) -> UsageError:
            return UsageError(f"bad destination {text!r} in {option}", why, DEST_HINT)

        port_text: str | None = None
        if t.startswith("["):
            end = t.find("]")
            if end < 0 or (t[end + 1:] and not t[end + 1:].startswith(":")):
                raise bad("an IPv6 destination with a port is written [ADDRESS]:PORT")
            host, port_text = t[1:end], (t[end + 2:] if t[end + 1:] else None)
        elif t.count(":") == 1:  # IPv4 (or nothing) and a port
            host, port_text = t.split(":")
        else:  # IPv4 without a port, or a bare IPv6 address or network
            host = t
        port: int | None = None
        if port_text is not None:
            if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:  # not "²"
                raise bad(f"{port_text!r} is not a port (1-65535)")
            port = int(port_text)
        if not host:
            if port is None:
                raise bad("neither an address nor a port")
            return cls(None, port)
        try:
            net = ipaddress.ip_network(host, strict=False)
        except ValueError as e:
            raise bad(f"{e} (host names are not resolved: give addresses)") from None
        return cls(net, port)


def _dests(items: Iterable[Any], option: str) -> tuple[Dest, ...]:
    return tuple(Dest.parse(str(x), option) for x in items)


@dataclass(frozen=True)
class Policy:
    """Which of the job's connections to peers outside it are drained and reset (the job spec's ``outbound``;
    ``cryosleep run --outbound-reset/--outbound-keep/--outbound-drain``)."""

    reset: tuple[Dest, ...] | None = None  # None: every peer outside the job; (): none
    keep: tuple[Dest, ...] = ()  # peers outside the job whose connections are restored as they are
    drain_s: float = DEFAULT_DRAIN_S  # how long a snapshot waits at most for their send queues to empty

    @property
    def active(self) -> bool:
        return self.reset is None or bool(self.reset)

    def to_json(self) -> OutboundPolicy:
        reset: str | list[str] = "all" if self.reset is None else [str(d) for d in self.reset] or "none"
        return {"reset": reset, "keep": [str(d) for d in self.keep], "drain_s": self.drain_s}

    @classmethod
    def from_json(cls, data: OutboundPolicy | None) -> Policy:
        """From the job spec (empty or absent, as in snapshots older than this option: the default)."""
        data = data or {}
        reset = data.get("reset", "all")
        return cls(reset=None if reset == "all" else () if reset == "none" else _dests(reset, "--outbound-reset"),
                   keep=_dests(data.get("keep") or [], "--outbound-keep"),
                   drain_s=float(data.get("drain_s", DEFAULT_DRAIN_S)))

    @classmethod
    def parse(cls, reset: str = "all", keep: str = "", drain_s: float = DEFAULT_DRAIN_S) -> Policy:
        """From the command line's comma-separated lists."""
        words = [w.strip() for w in reset.split(",") if w.strip()]
        if not words:
            raise UsageError("--outbound-reset is empty", "it takes all, none or destinations", DEST_HINT)
        if len(words) == 1 and words[0] in ("all", "none"):
            resets: tuple[Dest, ...] | None = None if words[0] == "all" else ()
        else:
            resets = _dests(words, "--outbound-reset")
        if not drain_s >= 0:
            raise UsageError(f"bad --outbound-drain {drain_s!r}", "it is a time in seconds, 0 or more",
                             "e.g. --outbound-drain 2 (0: do not wait for send queues to drain)")
        return cls(reset=resets, keep=_dests((w for w in keep.split(",") if w.strip()), "--outbound-keep"),
                   drain_s=drain_s)


@dataclass(frozen=True)
class Verdict:
    conn: Conn
    reset: bool
    reason: str
    outside: bool = True  # the peer is outside the job (rules 4 and 5 keep such connections too)

    def to_json(self) -> dict[str, Any]:
        return {**self.conn.to_json(), "reason": self.reason}

    def record(self, queued: int | None = None) -> OutboundConn:
        """As the manifest records it; ``queued``: (one to reset) its bytes unacknowledged after the wait."""
        c = self.conn
        if queued is None:
            return OutboundConn(str(c.local), str(c.remote), c.state, c.queued, self.reason)
        return OutboundConn(str(c.local), str(c.remote), c.state, queued, self.reason, queued_before=c.queued,
                            drained=not queued)


def classify(conns: Sequence[Conn], policy: Policy, *, own_ns: bool, job_nets: Sequence[Network] = ()) -> list[
        Verdict]:
    """For each of the job's connections: reset it in a restored copy, or leave it as CRIU restores it, and
    why (the rules in the module's docstring, in that order)."""
    pairs = {(c.local, c.remote) for c in conns}
    out: list[Verdict] = []
    for c in conns:
        peer = c.remote
        if (peer, c.local) in pairs:
            out.append(Verdict(c, False, "the peer is a process of the job", outside=False))
        elif own_ns and peer.addr.is_loopback:
            out.append(Verdict(c, False, "loopback inside the job's own network namespace", outside=False))
        elif net := next((n for n in job_nets if peer.addr in n and peer.addr != n.network_address + 1), None):
            out.append(Verdict(c, False, f"the peer is on the job network {net}", outside=False))
        elif d := next((d for d in policy.keep if d.matches(peer)), None):
            out.append(Verdict(c, False, f"kept by --outbound-keep {d}"))
        elif policy.reset is None:
            out.append(Verdict(c, True, "the peer is outside the job"))
        elif d := next((d for d in policy.reset if d.matches(peer)), None):
            out.append(Verdict(c, True, f"the peer is outside the job and matches --outbound-reset {d}"))
        else:
            out.append(Verdict(c, False, "the peer is outside the job but not listed in --outbound-reset"))
    return out


def job_nets(spec_net: dict[str, Any] | None) -> list[Network]:
    """The job network's subnet (``JobSpec.net``), whose addresses but the gateway's are the job's other nodes."""
    subnet = (spec_net or {}).get("subnet")
    return [ipaddress.ip_network(subnet, strict=False)] if subnet else []


# -- snapshot: wait for the send queues to drain --------------------------------------------------------


def drain(init_pid: int, conns: Sequence[Conn], limit_s: float, *, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> dict[int, int]:
    """Wait up to ``limit_s`` until none of ``conns`` has unacknowledged bytes; returns inode -> bytes still
    queued when the wait ended (0: drained; a socket that is gone counts as drained)."""
    left = {c.inode: c.queued for c in conns}
    end = clock() + limit_s
    while True:
        now = {c.inode: c.queued for c in read_table(init_pid) if c.inode in left}
        left = {ino: now.get(ino, 0) for ino in left}
        if not any(left.values()) or clock() >= end:
            return left
        sleep(POLL_S)


def before_dump(spec: JobSpec, init_pid: int, phases: Phases, deadline: float) -> NodeOutbound:
    """Before the dump (the job running): sort the job's connections and, when some are to be reset, wait in
    the phase ``outbound`` (bounded) for their send queues to drain. Returns what the manifest records
    (``NodeImage.outbound``). A policy that resets nothing reads nothing; a job without connections to
    reset gets no phase (listing them reads /proc only: milliseconds)."""
    policy = Policy.from_json(spec.outbound)
    if not policy.active:
        return NodeOutbound(policy=policy.to_json())
    conns, _ = job_connections(init_pid)
    verdicts = classify(conns, policy, own_ns=bool(proctree.other_ns(init_pid)), job_nets=job_nets(spec.net))
    todo = [v.conn for v in verdicts if v.reset]
    left: dict[int, int] = {}
    waited = 0.0
    if todo:
        with phases.phase("outbound"):
            start = time.monotonic()
            left = drain(init_pid, todo, max(0.0, min(policy.drain_s, deadline - time.monotonic() - 1.0)))
            waited = time.monotonic() - start
    return NodeOutbound(
        policy=policy.to_json(), waited_s=round(waited, 4),
        reset=[v.record(queued=left.get(v.conn.inode, 0)) for v in verdicts if v.reset],
        kept=[v.record() for v in verdicts if not v.reset and v.outside],  # rules 4 and 5
        internal=sum(1 for v in verdicts if not v.outside))


# -- restore: reset them in the restored copy ------------------------------------------------------------


def disconnect(pid: int, fd: int, inode: int) -> None:
    """Reset the connection of socket ``inode``, which ``pid`` holds as ``fd``: ``connect(AF_UNSPEC)`` on a
    copy of the descriptor (tcp_disconnect: a RST to the peer, the queues dropped, ECONNRESET to the owner)."""
    libc = ctypes.CDLL(None, use_errno=True)
    dup = proctree.pidfd_getfd(pid, fd)
    try:
        st = os.fstat(dup)
        if not stat.S_ISSOCK(st.st_mode) or st.st_ino != inode:
            raise OSError(0, f"fd {fd} of pid {pid} is no longer socket {inode}")
        unspec = bytes(16)  # struct sockaddr with sa_family AF_UNSPEC
        if libc.connect(dup, ctypes.c_char_p(unspec), len(unspec)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"connect(AF_UNSPEC) on fd {fd} of pid {pid}: {os.strerror(err)}")
    finally:
        os.close(dup)


class ResetReport(TypedDict, total=False):
    """What a restore did about the connections outside the job (``outbound.json`` in its work directory)."""

    reset: list[dict[str, Any]]
    """Connections reset (``Verdict.to_json`` and the inode; ``late``: by the agent, after CRIU)."""
    failed: list[dict[str, Any]]
    """Connections that could not be reset, each with ``why``."""
    kept: int
    """Connections left as CRIU restored them."""
    gone: list[dict[str, str]]
    """Connections the snapshot recorded that were no longer there (their peer had reset them)."""
    hook_problem: str | None
    """Why the pre-resume script did not do it all (then the agent reset the rest late)."""
    error: str
    """(the script's report) why it failed."""


def reset(init_pid: int, policy: Policy, nets: Sequence[Network], *, skip: Iterable[int] = ()) -> ResetReport:
    """Sort the restored tree's connections and reset those to reset (not those in ``skip``: inodes already
    reset). Returns the reset, the failed and the number kept; never raises for one connection."""
    conns, held = job_connections(init_pid)
    done = set(skip)
    report: ResetReport = {"reset": [], "failed": [], "kept": 0}
    for v in classify(conns, policy, own_ns=bool(proctree.other_ns(init_pid)), job_nets=nets):
        if not v.reset:
            report["kept"] += 1
            continue
        if v.conn.inode in done:
            continue
        errors = []
        for pid, fd in held.get(v.conn.inode, []):
            try:
                disconnect(pid, fd, v.conn.inode)
                break
            except OSError as e:
                errors.append(str(e))
        else:
            report["failed"].append({**v.to_json(), "inode": v.conn.inode, "why": "; ".join(errors) or "no holder"})
            continue
        done.add(v.conn.inode)
        report["reset"].append({**v.to_json(), "inode": v.conn.inode})
    return report


def _hook_script() -> str:
    """CRIU's --action-script for a restore: runs ``python -m cryosleep.capture.outbound`` at pre-resume only
    (CRIU calls it at every stage; the other stages cost a shell, not a Python)."""
    return action_script("criu-outbound", f"#!/bin/sh\n[ \"$CRTOOLS_SCRIPT_ACTION\" = pre-resume ] || exit 0\n"
                                          f"exec {shlex.quote(sys.executable)} -m cryosleep.capture.outbound\n")


@dataclass
class RestoreReset:
    """What a restore does about the connections to peers outside the job: the CRIU action script (``hook``)
    and, after CRIU, ``finish``."""

    policy: Policy
    nets: list[Network]
    work_dir: Path
    recorded: list[OutboundConn] = field(default_factory=list)  # what the snapshot drained (manifest)

    @property
    def plan_path(self) -> Path:
        return self.work_dir / "outbound-plan.json"

    @property
    def report_path(self) -> Path:
        return self.work_dir / "outbound.json"

    @classmethod
    def plan(cls, spec: JobSpec, node_outbound: NodeOutbound, work_dir: Path) -> RestoreReset | None:
        """None when the job's policy resets nothing."""
        policy = Policy.from_json(spec.outbound)
        if not policy.active:
            return None
        return cls(policy, job_nets(spec.net), work_dir, list(node_outbound.reset))

    def hook(self) -> tuple[str, dict[str, str]]:
        """CRIU's ``--action-script`` and the environment it reads."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.report_path.unlink(missing_ok=True)
        self.plan_path.write_text(json.dumps({"policy": self.policy.to_json(), "nets": [str(n) for n in self.nets],
                                              "report": str(self.report_path)}))
        env = {PLAN_ENV: str(self.plan_path), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        return _hook_script(), env

    def finish(self, init_pid: int) -> ResetReport:
        """After CRIU: the script's report, and a late reset of what it did not do (the job runs already).
        Never raises: a problem is told on stderr (what, why, what to do) and the restored job runs on."""
        try:
            report: ResetReport = json.loads(self.report_path.read_text())
            problem = report.get("error")
        except (OSError, ValueError) as e:
            report, problem = {"reset": [], "failed": []}, f"its pre-resume script left no report ({e})"
        if problem or report.get("failed"):
            done = [int(r["inode"]) for r in report.get("reset", [])]
            try:
                late = reset(init_pid, self.policy, self.nets, skip=done)
            except Exception as e:  # /proc unreadable, ...: the job runs on, and is told
                late = {"reset": [], "kept": 0, "failed": [{"local": "?", "remote": "?",
                                                            "why": f"{type(e).__name__}: {e}"}]}
            report = {"reset": [*report.get("reset", []), *[{**r, "late": True} for r in late["reset"]]],
                      "failed": late["failed"], "kept": late["kept"], "hook_problem": problem}
        # Recorded at the snapshot, but no longer connected when the restored tasks were about to run: CRIU's
        # window probe (sent as it takes a socket out of repair mode) met a peer without that connection,
        # which answered with a reset. The application sees ECONNRESET all the same.
        seen = {(r.get("local"), r.get("remote")) for r in [*report.get("reset", []), *report.get("failed", [])]}
        report["gone"] = [{"local": r.local, "remote": r.remote} for r in self.recorded
                          if (r.local, r.remote) not in seen]
        try:
            self.report_path.write_text(json.dumps(report, indent=1))
        except OSError:
            pass
        if report.get("failed"):
            names = "; ".join(f"{f['local']} -> {f['remote']}: {f['why']}" for f in report["failed"][:5])
            sys.stderr.write(
                "cryosleep: warning: connections of the restored job to peers outside it could not all be reset\n"
                f"  why: {names}\n  what to do: nothing if the job reconnects on errors (the peer answers a "
                "stale connection with a reset, or the job's own timeout ends it); otherwise restart the "
                f"job's client, or list the peer in --outbound-keep; details in {self.report_path}\n")
        return report


def _hook_main() -> int:
    """``python -m cryosleep.capture.outbound``: CRIU's pre-resume action during a restore. Its report goes to
    the file the plan names; a non-zero exit only makes CRIU log it (pre-resume does not fail a restore)."""
    signal.alarm(HOOK_ALARM_S)  # never hold the restore: the agent resets what is left after CRIU
    if os.environ.get("CRTOOLS_SCRIPT_ACTION") != "pre-resume":
        return 0
    plan = json.loads(Path(os.environ[PLAN_ENV]).read_text())
    try:
        report = reset(int(os.environ["CRTOOLS_INIT_PID"]), Policy.from_json(plan["policy"]),
                       [ipaddress.ip_network(n) for n in plan["nets"]])
    except Exception as e:  # reported to the agent, which tries again after CRIU
        report = {"reset": [], "failed": [], "error": f"{type(e).__name__}: {e}"}
    out = Path(plan["report"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, out)
    return 1 if report.get("failed") or report.get("error") else 0


if __name__ == "__main__":
    sys.exit(_hook_main())
