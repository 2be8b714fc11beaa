"""Tensor parallelism inside each node, data parallelism across nodes (tests/jobs/workloads/tp_dp.py: a
transformer with Megatron-style parallel linears over process groups from ``new_group``; gloo on CPU), through a
real coordinator, real agents and real CRIU: two nodes x two ranks on this host, on the job network. The CPU
rehearsal, at a small scale, of the 8-GPU run (tests/gpu/test_gpu_full_node.py): keep-running and stop
snapshots of the whole job, the nodes restored, every rank's losses equal to an uninterrupted 4-rank run's bit
for bit. Every rank talks over three process groups (the world, its node's tensor-parallel group, its
data-parallel group across the nodes), each with connections of its own that the restore must bring back.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.jobs.coordinated import Coordinator
from tests.jobs.harness import Harness, free_port, reference, workload
from tests.jobs.test_coordinated_nccl import coord, restore_both  # noqa: F401 - the fixture
from tests.jobs.test_nccl_cut import h  # noqa: F401 - the fixture

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # minutes: the extended tier (CI runs it)


def test_tensor_parallel_in_nodes_data_parallel_across_snapshot_and_restore(h: Harness,  # noqa: F811
                                                                            coord: Coordinator,  # noqa: F811
                                                                            tmp_path: Path) -> None:
    script = workload("tp_dp")
    linger = tmp_path / "linger"
    args = ["--steps", "50", "--step-sleep", "0.05", "--tp", "2", "--linger", str(linger)]
    port = str(free_port())
    for n in (0, 1):
        h.cli_json("run", "--detach", "--name", "tp", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "2",
                   "--master-port", port, "--run-id", f"tp-{port}", "--net", "job", "--coordinator", coord.url,
                   str(script), *args)
    nodes = ("tp.node0", "tp.node1")
    h.wait_step(nodes[0], 5)
    keep = coord.snapshot("tp")
    assert keep["state"] == "verified", keep.get("error")
    h.wait_step(nodes[0], 15)
    stop = coord.snapshot("tp", stop=True)
    assert stop["state"] == "verified", stop.get("error")
    assert h.wait_end(nodes[0]) == 75 and h.wait_end(nodes[1]) == 75
    restore_both(h, coord, stop["id"], order=(1, 0))
    linger.touch()
    assert h.wait_end(nodes[0]) == 0 and h.wait_end(nodes[1]) == 0
    ref = reference(script, args, 4)
    for r in range(4):
        got = h.losses(nodes[r // 2], r)
        assert got == ref[r], f"rank {r}: {len(got)} steps vs {len(ref[r])}; first difference at " + str(
            next((i for i, (a, b) in enumerate(zip(got, ref[r], strict=False)) if a != b), min(len(got), len(ref[r]))))
