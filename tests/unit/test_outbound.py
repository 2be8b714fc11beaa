"""Connections to peers outside the job: the policy and its parsing (pure), reading /proc/net/tcp, and, on
real processes (no CRIU), the drain wait and the reset through the holder's file descriptor."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryosleep.capture import outbound
from cryosleep.capture.outbound import Conn, Dest, Endpoint, Policy, classify
from cryosleep.errors import UsageError
from cryosleep.store.manifest import OutboundConn

TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0 100 0 0 10 0
   1: 0100007F:AD9C 0100007F:1F90 01 0000002A:00000000 00:00000000 00000000     0        0 222 1 0 20 4 30 10 -1
   2: 0100007F:AD9D 0100007F:1F90 06 00000000:00000000 03:00000F9F 00000000     0        0 0 3 0
"""
MAPPED = "0000000000000000FFFF00000100007F"  # ::ffff:127.0.0.1, as four host-order words
TABLE6 = "\n".join([
    "sl local_address remote_address st tx_queue rx_queue tr tm->when retrnsmt uid timeout inode",
    f"0: {MAPPED}:9C40 {MAPPED}:1F90 01 00000000:00000000 00:00000000 00000000 0 0 333 1 0",
    "1: 000080FE000000000000000001000000:01BB 00000000000000000000000001000000:C350 08 00000010:00000000 "
    "00:00000000 00000000 0 0 444 1 0",  # fe80::1 and ::1
])


def ep(text: str) -> Endpoint:
    host, port = text.rsplit(":", 1)
    return Endpoint(ipaddress.ip_address(host.strip("[]")), int(port))


def conn(local: str, remote: str, inode: int = 1) -> Conn:
    return Conn(ep(local), ep(remote), "ESTABLISHED", 0, inode)


def test_parse_table_ipv4_ipv6_and_mapped() -> None:
    conns = outbound.parse_table(TABLE) + outbound.parse_table(TABLE6)
    assert [(str(c.local), str(c.remote), c.state, c.queued, c.inode) for c in conns] == [
        ("127.0.0.1:44444", "127.0.0.1:8080", "ESTABLISHED", 42, 222),  # listener and TIME_WAIT left out
        ("127.0.0.1:40000", "127.0.0.1:8080", "ESTABLISHED", 0, 333),  # IPv4-mapped: back to IPv4
        ("[fe80::1]:443", "[::1]:50000", "CLOSE_WAIT", 16, 444),
    ]


@pytest.mark.parametrize(("text", "net", "port"), [
    ("10.0.0.5", "10.0.0.5/32", None),
    ("10.0.0.0/8", "10.0.0.0/8", None),
    ("10.1.2.3/8:443", "10.0.0.0/8", 443),
    ("127.0.0.1:8080", "127.0.0.1/32", 8080),
    ("fd00::1", "fd00::1/128", None),
    ("fd00::/8", "fd00::/8", None),
    ("[fd00::1]:443", "fd00::1/128", 443),
    ("[fd00::/16]:443", "fd00::/16", 443),
    (":9090", None, 9090),
])
def test_dest_parse(text: str, net: str | None, port: int | None) -> None:
    d = Dest.parse(text)
    assert (str(d.net) if d.net else None, d.port) == (net, port)
    assert Dest.parse(str(d)) == d  # what the manifest records reads back the same


@pytest.mark.parametrize("text", ["", "metrics.local", "10.0.0.5:http", "10.0.0.5:0", "10.0.0.5:70000",
                                  "[fd00::1", "[fd00::1]x", "10.0.0.0/33"])
def test_dest_parse_errors_say_what_to_do(text: str) -> None:
    with pytest.raises(UsageError) as e:
        Dest.parse(text, "--outbound-keep")
    assert "--outbound-keep" in e.value.what and e.value.why and "10.0.0.5:8080" in e.value.hint


def test_dest_matches() -> None:
    assert Dest.parse("10.0.0.0/8").matches(ep("10.9.9.9:1"))
    assert not Dest.parse("10.0.0.0/8:443").matches(ep("10.9.9.9:80"))
    assert Dest.parse(":443").matches(ep("[fd00::1]:443"))
    assert not Dest.parse("::/0").matches(ep("1.2.3.4:5"))  # families never mix


def test_policy_parse_and_json() -> None:
    assert Policy.parse() == Policy() == Policy.from_json({}) == Policy.from_json(None)
    assert Policy().active and not Policy.parse("none").active
    p = Policy.parse("10.0.0.0/8, :9090", "10.0.0.7", 0.5)
    assert p.to_json() == {"reset": ["10.0.0.0/8", ":9090"], "keep": ["10.0.0.7"], "drain_s": 0.5}
    assert Policy.from_json(p.to_json()) == p
    assert Policy.from_json(Policy.parse("none").to_json()) == Policy(reset=())
    assert Policy.from_json(Policy().to_json()) == Policy()
    with pytest.raises(UsageError):
        Policy.parse("", "")
    with pytest.raises(UsageError):
        Policy.parse("all", "", -1)
    with pytest.raises(UsageError):
        Policy.parse("all", "", float("nan"))


def test_classify_the_rules_in_order() -> None:
    conns = [
        conn("127.0.0.1:29500", "127.0.0.1:40000", 1),  # TCPStore server side ...
        conn("127.0.0.1:40000", "127.0.0.1:29500", 2),  # ... and its client: both in the job
        conn("127.0.0.1:40001", "127.0.0.1:8080", 3),  # metrics on the host's loopback
        conn("10.235.1.2:40002", "10.235.1.3:33333", 4),  # another node of the job
        conn("10.235.1.2:40003", "10.0.0.7:443", 5),  # kept by the user
        conn("10.235.1.2:40004", "192.0.2.1:443", 6),  # an HTTP API
    ]
    nets = [ipaddress.ip_network("10.235.1.0/24")]

    def verdicts(policy: Policy, own_ns: bool = False) -> list[tuple[bool, bool]]:
        return [(v.reset, v.outside) for v in classify(conns, policy, own_ns=own_ns, job_nets=nets)]

    keep = Dest.parse("10.0.0.7")
    internal = [(False, False)] * 2
    assert verdicts(Policy(keep=(keep,))) == [*internal, (True, True), (False, False), (False, True), (True, True)]
    # in its own network namespace, loopback is the job's own
    assert verdicts(Policy(keep=(keep,)), own_ns=True)[2] == (False, False)
    # --outbound-reset lists what is reset; --outbound-keep wins over it
    only = Policy(reset=(Dest.parse(":443"),), keep=(keep,))
    assert verdicts(only) == [*internal, (False, True), (False, False), (False, True), (True, True)]
    assert not any(r for r, _ in verdicts(Policy(reset=())))
    reasons = [v.reason for v in classify(conns, only, own_ns=False, job_nets=nets)]
    assert reasons[5] == "the peer is outside the job and matches --outbound-reset :443"
    assert reasons[4] == "kept by --outbound-keep 10.0.0.7"
    assert reasons[2] == "the peer is outside the job but not listed in --outbound-reset"
    # the job network's gateway (subnet + 1) is the host the sandbox runs on: outside the job
    via_gateway = conn("10.235.1.2:40005", "10.235.1.1:9090", 7)
    assert [(v.reset, v.outside) for v in classify([via_gateway], Policy(), own_ns=True, job_nets=nets)] == [
        (True, True)]


# -- real sockets, real processes --------------------------------------------------------------------

CHILD = r"""
import socket, sys, time
out = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
lst = socket.create_server(("127.0.0.1", 0))
a = socket.create_connection(lst.getsockname())
b, _ = lst.accept()
out.setblocking(False)
sent = 0
try:
    while sys.argv[2] == "fill":
        sent += out.send(b"x" * 65536)
except BlockingIOError:
    pass
out.setblocking(True)
print("ready", out.getsockname()[1], sent, flush=True)
sys.stdin.readline()
for name, s in (("outside", out), ("inside", a)):
    try:
        s.sendall(b"y")
        print(name, "ok", flush=True)
    except OSError as e:
        print(name, type(e).__name__, flush=True)
"""


@pytest.fixture
def server() -> Iterator[socket.socket]:
    srv = socket.create_server(("127.0.0.1", 0))
    yield srv
    srv.close()


def child(port: int, mode: str) -> tuple[subprocess.Popen[str], int, int]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(port), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    _, local_port, sent = proc.stdout.readline().split()
    return proc, int(local_port), int(sent)


def finish(proc: subprocess.Popen[str]) -> list[str]:
    out, _ = proc.communicate("go\n", timeout=20)
    return out.split("\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="pidfd_getfd on another process needs ptrace rights (root)")
def test_reset_only_the_outside_connection(server: socket.socket) -> None:
    proc, local_port, _ = child(server.getsockname()[1], "idle")
    peer, _ = server.accept()
    try:
        conns, held = outbound.job_connections(proc.pid)
        assert len(conns) == 3 and all(c.inode in held for c in conns)
        report = outbound.reset(proc.pid, Policy(), [])
        assert [(r["local"], r["remote"]) for r in report["reset"]] == [
            (f"127.0.0.1:{local_port}", f"127.0.0.1:{server.getsockname()[1]}")]
        assert report["kept"] == 2 and report["failed"] == []
        peer.settimeout(5)
        with pytest.raises(ConnectionResetError):  # the peer got a RST
            peer.recv(1)
        assert finish(proc)[:2] == ["outside ConnectionResetError", "inside ok"]
    finally:
        peer.close()
        proc.kill()
        proc.wait()


def test_drain_waits_for_unacknowledged_bytes(server: socket.socket) -> None:
    proc, _, sent = child(server.getsockname()[1], "fill")
    peer, _ = server.accept()
    try:
        conns, _ = outbound.job_connections(proc.pid)
        out = [c for c in conns if c.remote.port == server.getsockname()[1]]
        assert len(out) == 1 and out[0].queued > 0  # the peer does not read: its window is closed
        start = time.monotonic()
        left = outbound.drain(proc.pid, out, 0.3)
        assert left[out[0].inode] > 0 and 0.3 <= time.monotonic() - start < 2
        got = 0
        peer.settimeout(5)
        while got < sent:
            got += len(peer.recv(1 << 20))
        assert outbound.drain(proc.pid, out, 5.0) == {out[0].inode: 0}
    finally:
        peer.close()
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="pidfd_getfd on another process needs ptrace rights (root)")
def test_pre_resume_script_resets_and_reports(server: socket.socket, cryo_home: object, tmp_path: Path) -> None:
    """The script CRIU runs (the shell filter, then ``python -m cryosleep.capture.outbound``), without CRIU."""
    proc, local_port, _ = child(server.getsockname()[1], "idle")
    peer, _ = server.accept()
    try:
        rr = outbound.RestoreReset(Policy(), [], tmp_path, [  # what the snapshot recorded
            OutboundConn(f"127.0.0.1:{local_port}", f"127.0.0.1:{server.getsockname()[1]}", "ESTABLISHED", 0, "-"),
            OutboundConn("127.0.0.1:1", "127.0.0.1:2", "ESTABLISHED", 0, "-")])
        script, env = rr.hook()
        base = dict(os.environ, **env, CRTOOLS_INIT_PID=str(proc.pid))
        for action in ("pre-restore", "post-restore", "post-resume"):  # not its stage: nothing done
            subprocess.run([script], env=dict(base, CRTOOLS_SCRIPT_ACTION=action), check=True, timeout=30)
            assert not rr.report_path.exists()
        subprocess.run([script], env=dict(base, CRTOOLS_SCRIPT_ACTION="pre-resume"), check=True, timeout=30)
        report = rr.finish(proc.pid)
        assert [r["local"] for r in report["reset"]] == [f"127.0.0.1:{local_port}"]
        assert report["gone"] == [{"local": "127.0.0.1:1", "remote": "127.0.0.1:2"}]
        assert report["kept"] == 2 and report["failed"] == [] and "hook_problem" not in report
        assert finish(proc)[:2] == ["outside ConnectionResetError", "inside ok"]
    finally:
        peer.close()
        proc.kill()
        proc.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="pidfd_getfd on another process needs ptrace rights (root)")
def test_without_the_scripts_report_the_agent_resets_late(server: socket.socket, tmp_path: Path) -> None:
    proc, _, _ = child(server.getsockname()[1], "idle")
    peer, _ = server.accept()
    try:
        rr = outbound.RestoreReset(Policy(), [], tmp_path)
        report = rr.finish(proc.pid)  # as if CRIU never ran the script (or its alarm cut it off)
        assert len(report["reset"]) == 1 and report["reset"][0]["late"] is True
        assert "left no report" in report["hook_problem"]
        assert finish(proc)[:2] == ["outside ConnectionResetError", "inside ok"]
    finally:
        peer.close()
        proc.kill()
        proc.wait()


def test_run_options_go_into_the_job_spec(tmp_path: Path) -> None:
    from cryosleep.cli.jobs import build_spec
    from cryosleep.cli.main import parse

    script = tmp_path / "t.py"
    script.write_text("")

    def spec(*argv: str) -> dict[str, object]:
        return build_spec(parse(["run", *argv, str(script)])).outbound

    assert spec() == {"reset": "all", "keep": [], "drain_s": 2.0}
    assert spec("--outbound-reset", "10.0.0.0/8,[fd00::1]:443", "--outbound-keep", "10.0.0.9:9090",
                "--outbound-drain", "0") == {"reset": ["10.0.0.0/8", "[fd00::1]:443"], "keep": ["10.0.0.9:9090"],
                                             "drain_s": 0.0}
    with pytest.raises(UsageError, match="--outbound-keep"):
        spec("--outbound-keep", "metrics.internal:9090")
