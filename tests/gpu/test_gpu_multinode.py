"""Two simulated nodes with one GPU each, NCCL between them over the job network (issue 4's GPU point).

Each simulated host is a network namespace of its own (tests/jobs/test_multinode.py's fixture); node 0's
rank uses GPU 0 and node 1's GPU 1 (--device-from-rank). NCCL's peer-to-peer and shared-memory transports
are off, so the ranks talk through NCCL's socket transport over the job network (eth0 of each sandbox,
the VXLAN overlay between the hosts). The coordinator (on host A) drains both ranks to one NCCL cut and takes
a stop snapshot of both nodes, relaying the rebuilt communicators' ids between the nodes; then each node's image
is restored on the other host and the other GPU (`restore --node-rank I --gpu-map 1,0`): the losses must equal
an uninterrupted 2-rank torchrun.

Run on a 2-GPU machine as root: NCCL_NVLS_ENABLE=0 PYTHONPATH=src:. python3 -m pytest tests/gpu/test_gpu_multinode.py
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cryosleep.core import proctree
from tests.gpu.test_gpu_cycle import WORKLOAD, gpu_count
from tests.jobs.coordinated import Coordinator
from tests.jobs.harness import reference
from tests.jobs.test_multinode import UNDERLAY, HostHarness, hosts, restore_pair  # noqa: F401 - the fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 2, reason="needs 2 GPUs")]

ARGS = ["--steps", "200", "--step-sleep", "0.05", "--device-from-rank"]
SOCKETS_ONLY = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}


def run_node(h: HostHarness, rank: int, port: int, url: str) -> dict[str, Any]:
    out: dict[str, Any] = h.cli_json(
        "run", "--detach", "--name", "gmn", "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
        "--master-port", str(port), "--run-id", "gmn-run", "--net", "job", "--net-peers", h.peer,
        "--coordinator", url, str(WORKLOAD), *ARGS)
    return out


def test_two_gpu_nodes_nccl_over_job_network_restored_swapped(
        hosts: tuple[HostHarness, HostHarness], tmp_path: Path) -> None:  # noqa: F811
    ha, hb = hosts
    coord = Coordinator(tmp_path, "0.0.0.0:0", prefix=tuple(proctree.nsenter_net(ha.ns_pid)))
    url = f"http://{UNDERLAY[0]}:{coord.url.rsplit(':', 1)[1]}"
    for h in hosts:
        h.env = coord.env({**h.env, **SOCKETS_ONLY, "CRYOSLEEP_COORDINATOR": url})
    port = 29000 + os.getpid() % 1000
    try:
        run_node(ha, 0, port, url)
        run_node(hb, 1, port, url)
        ha.wait_step("gmn.node0", 15)
        stop = ha.coordinator("snapshot", "gmn", "--stop")
        assert stop["state"] == "verified", stop.get("error")
        assert {"drain", "quiesce", "capture", "persist"} <= set(stop["phases"]), stop["phases"]
        assert ha.wait_end("gmn.node0", 120) == 75 and ha.wait_end("gmn.node1", 120) == 75
        for n in stop["nodes"]:
            phases = ha.cli_json("show", n["image"]["ref"])["phases"]
            assert {"quiesce", "cuda-checkpoint", "dump"} <= set(phases), phases
        # node 0's image on host B and GPU 1, node 1's on host A and GPU 0
        restore_pair(stop["id"], hb, ha, "--gpu-map", "1,0")
        assert ha.wait_end("gmn.node0", 300) == 0 and ha.wait_end("gmn.node1", 300) == 0
        ref = reference(WORKLOAD, ARGS, nproc=2)
        for r in range(2):
            got = ha.losses(f"gmn.node{r}", r)
            assert got == ref[r], f"rank {r}: {len(got)} steps vs {len(ref[r])}"
    finally:
        coord.stop()
        for name in ("gmn.node0", "gmn.node1"):
            if ha.job(name).exists() and ha.state(name) in ("running", "starting"):
                ha.kill_all(name)
