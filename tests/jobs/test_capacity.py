"""Capacity at the coordinator with a real job: a host drained under a two-node job, the job suspended and queued,
restored on its own when a host appears; then a restore queued by `restore --nodes auto --wait`, placed once a
host is offered again; and a host drained while a spare is free: its node alone moves there (a live migration),
the other node's processes untouched. Real CRIU, real PyTorch (gloo DDP, 2 nodes x 2 ranks on the job network), a real
coordinator and real host daemons, on two simulated hosts (tests/jobs/hosts.py); the losses of all four ranks equal
an uninterrupted 4-rank torchrun bit for bit after each restore. The rules themselves, on both catalog engines:
tests/coordinator/test_queue.py."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cryosleep.capture import criu_install
from cryosleep.core import proctree
from cryosleep.net import Host
from cryosleep.net.plan import job_net
from tests.conftest import require_criu
from tests.jobs.coordinated import Coordinator, wait_for
from tests.jobs.harness import reference, workload
from tests.jobs.hosts import SPARE_LINK, UNDERLAY, HostHarness, start_host_daemon, three_hosts, two_hosts
from tests.jobs.test_multinode import ARGS, assert_identical

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # minutes: the extended tier (CI runs it)


@pytest.fixture
def hosts(cryo_home: Path) -> Iterator[tuple[HostHarness, HostHarness]]:
    require_criu()
    with two_hosts(cryo_home, ("mn.node0", "mn.node1")) as pair:
        yield pair


def test_a_drained_two_node_job_without_a_spare_is_queued_and_comes_back_when_a_host_appears(
        hosts: tuple[HostHarness, HostHarness], tmp_path: Path) -> None:
    ha, hb = hosts
    coord = Coordinator(tmp_path, "0.0.0.0:0", prefix=tuple(proctree.nsenter_net(ha.ns_pid)))
    url = f"http://{UNDERLAY[0]}:{coord.url.rsplit(':', 1)[1]}"
    for h, name in ((ha, "hostA"), (hb, "hostB")):  # each node's agent says which host it runs on
        h.env = coord.env({**h.env, "CRYOSLEEP_COORDINATOR": url, "CRYOSLEEP_HOST": name})
    daemons = [start_host_daemon(ha, "hostA", url), start_host_daemon(hb, "hostB", url)]
    try:
        port = 29000 + os.getpid() % 1000
        ha.run_node("mn", 0, port, url, ARGS)
        hb.run_node("mn", 1, port, url, ARGS)
        ha.wait_step("mn.node0", 8)
        assert sorted((n["node_rank"], n["alive"]) for n in ha.coordinator("job", "mn")["nodes"]) == [(0, True),
                                                                                                    (1, True)]

        # hostB drained: hostA runs node 0, hostB takes no node: no spare, so the whole job is stop-snapshotted
        # and queued
        out = ha.coordinator("drain", "hostB", "--deadline", "120")
        (d,) = out["jobs"]
        assert d["job"] == "mn" and d["nodes"] == [1] and d["spare"] == [] and d["outcome"] == "queued", out
        assert "host hostA runs node 0 of job mn" in d["reasons"][1] and "host hostB is drained" in d["reasons"][1]
        assert ha.wait_end("mn.node0", 120) == 75 and ha.wait_end("mn.node1", 120) == 75
        assert ha.coordinator("job", "mn")["state"] == "suspended"

        # queued: hostA is free again, hostB is drained, and no other host polls: it waits, saying why
        def waiting_on_a_host() -> bool:
            (e,) = ha.coordinator("queue")["entries"]
            return e["state"] == "waiting" and "node 1 needs a host" in e["reason"]

        wait_for(waiting_on_a_host, 60, "the entry waiting for a second host")
        (e,) = ha.coordinator("queue")["entries"]
        assert e["snapshot"] == d["snapshot"] and "host hostB is drained" in e["reason"], e
        assert ha.state("mn.node0") == ha.state("mn.node1") == "suspended"

        # a host appears (host B's machine, back under a new name): the job is restored on its own, node 0 on
        # hostA and node 1 on hostC, and trains on to its end
        daemons.append(start_host_daemon(hb, "hostC", url))
        wait_for(lambda: ha.coordinator("queue")["entries"][0]["state"] in ("done", "failed"), 240,
                 "the queued restore to end")
        (e,) = ha.coordinator("queue")["entries"]
        assert e["state"] == "done" and e["reason"] == "restored: node 0 on hostA, node 1 on hostC", e
        assert ha.wait_end("mn.node0", 180) == 0 and ha.wait_end("mn.node1", 180) == 0
        ref = reference(workload("ddp_basic"), ARGS, nproc=4)
        assert_identical(ha, ref)

        # `restore --nodes auto --wait`: with hostC drained too there is one free host for two nodes, so the
        # restore waits in the queue; hostC offered again, it is placed and the job runs to the same losses
        ha.coordinator("drain", "hostC")
        cmd = [*proctree.nsenter_net(ha.ns_pid), sys.executable, "-m", "cryosleep.cli.main", "restore",
               d["snapshot"], "--nodes", "auto", "--wait", "--priority", "3", "--timeout", "120", "--json"]
        waiter = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ha.env)

        def queued_again() -> bool:
            es = [x for x in ha.coordinator("queue")["entries"] if x["state"] == "waiting"]
            return bool(es) and es[0]["priority"] == 3 and "host hostC is drained" in es[0]["reason"]

        wait_for(queued_again, 60, "the restore waiting in the queue")
        assert waiter.poll() is None
        ha.cli("coordinator", "undrain", "hostC")
        stdout, stderr = waiter.communicate(timeout=300)
        assert waiter.returncode == 0, stderr[-3000:]
        placed = json.loads(stdout)
        assert placed["state"] == "done" and sorted(n["host"] for n in placed["nodes"]) == ["hostA", "hostC"], placed
        wait_for(lambda: [x["state"] for x in ha.coordinator("queue")["entries"] if x["priority"] == 3] == ["done"],
                 30, "the second entry done")
        assert ha.wait_end("mn.node0", 180) == 0 and ha.wait_end("mn.node1", 180) == 0
        assert_identical(ha, ref)
    finally:
        for p in daemons:
            p.send_signal(signal.SIGTERM)
        for p in daemons:
            p.wait(60)
        coord.stop()


def test_a_drained_node_with_a_spare_moves_alone_while_the_other_keeps_its_processes(
        cryo_home: Path, tmp_path: Path) -> None:
    require_criu()
    with three_hosts(cryo_home, ("mn.node0", "mn.node1")) as (ha, hb, hc):
        coord = Coordinator(tmp_path, "0.0.0.0:0", prefix=tuple(proctree.nsenter_net(ha.ns_pid)))
        url = f"http://{UNDERLAY[0]}:{coord.url.rsplit(':', 1)[1]}"
        for h, name in ((ha, "hostA"), (hb, "hostB"), (hc, "hostC")):
            h.env = coord.env({**h.env, "CRYOSLEEP_COORDINATOR": url, "CRYOSLEEP_HOST": name})
        daemons = [start_host_daemon(h, name, url) for h, name in ((ha, "hostA"), (hb, "hostB"), (hc, "hostC"))]
        try:
            port = 29000 + os.getpid() % 1000
            ha.run_node("mn", 0, port, url, ARGS)
            hb.run_node("mn", 1, port, url, ARGS)
            ha.wait_step("mn.node0", 8)
            before = ha.pids("mn.node0")
            old_agent = ha.job("mn.node1").read()[1].agent_pid

            # hostB drained, hostC free: node 1 alone moves there; node 0 holds at the cut, then runs on
            out = ha.coordinator("drain", "hostB", "--deadline", "120")
            (d,) = out["jobs"]
            assert d["action"] == "migrate" and d["nodes"] == [1] and d["spare"] == ["hostC"], out
            assert d["outcome"] == "migrated", out
            assert "only those nodes move (node 1 to hostC)" in d["reasons"][2], d
            assert ha.pids("mn.node0") == before  # the same processes: node 0 was never captured nor restarted
            assert ha.state("mn.node0") == "running"
            _, st1 = ha.job("mn.node1").read()
            assert st1.agent_pid != old_agent and not proctree.alive(old_agent)
            assert os.readlink(f"/proc/{st1.agent_pid}/ns/net") == os.readlink(f"/proc/{hc.ns_pid}/ns/net")
            net = job_net("mn-run", 0, 2)
            assert Host(ha.ns_pid).overlay_peers(net) == [SPARE_LINK[1]]  # node 0's overlay followed node 1
            events = [e["message"] for e in ha.coordinator("show", d["migration"])["events"]]
            assert any("point of no return" in m for m in events) and any("passed its checks" in m for m in events)
            assert ha.coordinator("job", "mn")["state"] == "running"

            assert ha.wait_end("mn.node0", 180) == 0 and ha.wait_end("mn.node1", 180) == 0
            assert_identical(ha, reference(workload("ddp_basic"), ARGS, nproc=4))
        finally:
            for p in daemons:
                p.send_signal(signal.SIGTERM)
            for p in daemons:
                p.wait(60)
            coord.stop()


def test_a_migration_whose_spare_fails_past_the_point_of_no_return_ends_the_job_rather_than_hang(
        cryo_home: Path, tmp_path: Path) -> None:
    """The spare's CRIU restore fails (a wrapper refuses `restore` there) after its checks passed and node 1's old
    incarnation ended: node 0 cannot go on without it, and is ended at once, the job marked damaged."""
    require_criu()
    real = " ".join(shlex.quote(a) for a in criu_install.locate().argv)
    wrapper = tmp_path / "criu-no-restore"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" restore "*) echo "restore refused (test)" >&2; exit 1;; esac\n'
                       f'exec {real} "$@"\n')
    wrapper.chmod(0o755)
    with three_hosts(cryo_home, ("mn.node0", "mn.node1")) as (ha, hb, hc):
        coord = Coordinator(tmp_path, "0.0.0.0:0", prefix=tuple(proctree.nsenter_net(ha.ns_pid)))
        url = f"http://{UNDERLAY[0]}:{coord.url.rsplit(':', 1)[1]}"
        for h, name in ((ha, "hostA"), (hb, "hostB"), (hc, "hostC")):
            h.env = coord.env({**h.env, "CRYOSLEEP_COORDINATOR": url, "CRYOSLEEP_HOST": name})
        hc.env["CRYOSLEEP_CRIU"] = str(wrapper)
        daemons = [start_host_daemon(h, name, url) for h, name in ((ha, "hostA"), (hb, "hostB"), (hc, "hostC"))]
        try:
            port = 29000 + os.getpid() % 1000
            ha.run_node("mn", 0, port, url, ARGS)
            hb.run_node("mn", 1, port, url, ARGS)
            ha.wait_step("mn.node0", 8)
            res = ha.cli("coordinator", "drain", "hostB", "--deadline", "120", "--json", check=False)
            (d,) = json.loads(res.stdout)["jobs"]
            assert res.returncode == 1 and d["action"] == "migrate" and d["outcome"] == "failed", d
            assert "node 1's restore on host hostC did not finish" in d["error"]["what"], d
            assert "the job was ended on every node" in d["error"]["hint"], d
            assert ha.wait_end("mn.node0", 60) not in (0, 75)  # ended by the coordinator, not left waiting
            assert ha.coordinator("job", "mn")["state"] == "damaged"
            events = [e["message"] for e in ha.coordinator("show", d["migration"])["events"]]
            assert any("point of no return" in m for m in events), events
        finally:
            for p in daemons:
                p.send_signal(signal.SIGTERM)
            for p in daemons:
                p.wait(60)
            coord.stop()
