"""Issue 7's full-node run: two simulated nodes x 4 GPUs of one 8-GPU machine, a transformer with tensor
parallelism 4 inside each node and data parallelism 2 across the nodes (tests/jobs/workloads/tp_dp.py: plain
PyTorch process groups from ``new_group``, NCCL), tens of GiB of GPU memory per rank.

Keep-running snapshots of the whole job through the coordinator every ``EVERY_S`` for ``MINUTES``, then a stop
snapshot; each node's image restored on the other simulated host and the other four GPUs; every rank's losses
must equal an uninterrupted 8-rank run of the same length, bit for bit. What the run measured (pause per phase,
per GiB and as a share of wall time at the interval, restore to the first step, image bytes) is printed as one
JSON line ``full-node-summary`` and written to $CRYOSLEEP_FULLNODE_OUT when set, for docs/benchmarks.md and
docs/gpu-acceptance.md. Its CPU rehearsal at 2 x 2 ranks is tests/jobs/test_tp_dp.py.

Run on nvidia-h200-x8 as root: NCCL_NVLS_ENABLE=0 PYTHONPATH=src:. python3 -m pytest -s tests/gpu/test_gpu_full_node.py
Knobs (environment): CRYOSLEEP_FULLNODE_MINUTES (20), CRYOSLEEP_FULLNODE_EVERY_S (240), CRYOSLEEP_FULLNODE_MEM_GIB
(60: extra device memory per rank), CRYOSLEEP_FULLNODE_SOCKETS=1 (NCCL over sockets only, as between real hosts).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from cryosleep.core import proctree
from tests.gpu.test_gpu_cycle import gpu_count
from tests.jobs.coordinated import Coordinator
from tests.jobs.harness import reference, workload
from tests.jobs.test_multinode import UNDERLAY, HostHarness, hosts, restore_pair  # noqa: F401 - the fixture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() < 8, reason="needs 8 GPUs (nvidia-h200-x8)")]

MINUTES = float(os.environ.get("CRYOSLEEP_FULLNODE_MINUTES", "20"))
EVERY_S = float(os.environ.get("CRYOSLEEP_FULLNODE_EVERY_S", "240"))
MEM_GIB = float(os.environ.get("CRYOSLEEP_FULLNODE_MEM_GIB", "60"))
STEP_SLEEP = 0.05
MODEL = ["--tp", "4", "--device", "cuda", "--device-from-rank", "--d-model", "2048", "--heads", "16", "--layers",
         "8", "--seq", "1024", "--batch", "8", "--vocab", "32000"]
SOCKETS_ONLY = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
NODES = ("fn.node0", "fn.node1")


def step_time(h: HostHarness) -> float:
    """Seconds per step of the running job, from its log (two samples 20 s apart)."""
    a, t0 = last_step(h), time.monotonic()
    time.sleep(20)
    b = last_step(h)
    return (time.monotonic() - t0) / max(b - a, 1)


def last_step(h: HostHarness) -> int:
    got = h.losses(NODES[0], 0)
    return int(got[-1].split()[0]) if got else -1


def test_two_nodes_of_four_gpus_tp_inside_dp_across(hosts: tuple[HostHarness, HostHarness],  # noqa: F811
                                                    tmp_path: Path) -> None:
    ha, hb = hosts
    coord = Coordinator(tmp_path, "0.0.0.0:0", prefix=tuple(proctree.nsenter_net(ha.ns_pid)))
    url = f"http://{UNDERLAY[0]}:{coord.url.rsplit(':', 1)[1]}"
    extra = SOCKETS_ONLY if os.environ.get("CRYOSLEEP_FULLNODE_SOCKETS") == "1" else {}
    for h in hosts:
        h.env = coord.env({**h.env, **extra, "NCCL_NVLS_ENABLE": "0", "CRYOSLEEP_COORDINATOR": url})
    port = 29000 + os.getpid() % 1000
    until = tmp_path / "until"
    summary: dict[str, Any] = {"mem_gib_per_rank_extra": MEM_GIB, "minutes": MINUTES, "every_s": EVERY_S}
    try:
        # open-ended: the job trains until told (--until), after the restore; the reference runs as many steps
        started = time.monotonic()
        steps = 1000000
        args = [*MODEL, "--mem-gib", str(MEM_GIB), "--step-sleep", str(STEP_SLEEP), "--until", str(until)]
        for n, h in enumerate(hosts):
            h.cli_json("run", "--detach", "--name", "fn", "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node",
                       "4", "--master-port", str(port), "--run-id", "fn-run", "--net", "job", "--net-peers", h.peer,
                       "--coordinator", url, str(workload("tp_dp")), "--steps", str(steps), *args)
        ha.wait_step(NODES[0], 5, timeout=600)
        summary["seconds_per_step"] = round(step_time(ha), 4)
        pauses: list[dict[str, Any]] = []
        while time.monotonic() - started < MINUTES * 60:
            t0 = time.monotonic()
            s = ha.coordinator("snapshot", "fn")
            assert s["state"] == "verified", s.get("error")
            pauses.append({"id": s["id"], "phases": s["phases"], "wall_s": round(time.monotonic() - t0, 3)})
            time.sleep(max(0.0, EVERY_S - (time.monotonic() - t0)))
        at = last_step(ha)
        stop = ha.coordinator("snapshot", "fn", "--stop")
        assert stop["state"] == "verified", stop.get("error")
        assert ha.wait_end(NODES[0], 600) == 75 and ha.wait_end(NODES[1], 600) == 75
        images = [ha.cli_json("show", n["image"]["ref"]) for n in stop["nodes"]]
        summary.update(keep_running=pauses, stop={"phases": stop["phases"], "at_step": at},
                       image_bytes=[i.get("bytes") for i in images],
                       node_phases=[i.get("phases") for i in images])
        # node 0's image on host B and GPUs 4-7, node 1's on host A and GPUs 0-3
        t0 = time.monotonic()
        restore_pair(stop["id"], hb, ha, "--gpu-map", "4,5,6,7,0,1,2,3")
        done = len(ha.losses(NODES[0], 0))
        while len(ha.losses(NODES[0], 0)) <= done:
            assert time.monotonic() - t0 < 900, "no step after the restore"
            time.sleep(0.05)
        summary["restore_to_first_step_s"] = round(time.monotonic() - t0, 3)
        ha.wait_step(NODES[0], last_step(ha) + 20, timeout=600)
        until.touch()  # every rank ends at one step (rank 0 decides it and tells the others)
        assert ha.wait_end(NODES[0], 900) == 0 and ha.wait_end(NODES[1], 900) == 0
        # the uninterrupted run of the same length: as many steps as the restored job ran
        ran = min(len(ha.losses(NODES[r // 4], r)) for r in range(8))
        assert ran > at + 20
        ref = reference(workload("tp_dp"), ["--steps", str(ran), *MODEL, "--mem-gib", str(MEM_GIB)], nproc=8)
        for r in range(8):
            got = ha.losses(NODES[r // 4], r)[:ran]
            assert got == ref[r][:ran], f"rank {r}: first difference at step " + str(
                next((i for i, (x, y) in enumerate(zip(got, ref[r], strict=False)) if x != y), ran))
        line = json.dumps({"full-node-summary": summary})
        print(line)
        if os.environ.get("CRYOSLEEP_FULLNODE_OUT"):
            Path(os.environ["CRYOSLEEP_FULLNODE_OUT"]).write_text(line + "\n")
    finally:
        coord.stop()
        for name in NODES:
            if ha.job(name).exists() and ha.state(name) in ("running", "starting"):
                ha.kill_all(name)

