"""The interceptor (LD_PRELOAD) in real multi-process jobs on the stand-in NCCL, with the test
acting as the agent through the control block (ctl.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ctl import BLOCK_SIZE, CMD_QUIESCE, REBUILD_ID, REBUILD_SPLIT, ST_HOLDING, ST_QUIESCED, Agent, CommTarget, Ctl
from nccl_jobs import INTERCEPTOR, ROOT, STANDIN, WORKLOADS, Job, run, tcp_sockets

STEPS = 24
SPLITS = 4  # train.py splits world 4 times before its first step (sub, solo, temp, gone)


def digests(out: list[list[dict[str, Any]]]) -> list[list[str]]:
    return [[row["digest"] for row in rows if "digest" in row] for rows in out]


def reference(tmp_path: Path, nranks: int) -> list[list[str]]:
    """The uninterrupted run, without the interceptor."""
    ref = digests(run("train.py", nranks, tmp_path / "ref", ["{rank}", "{nranks}", "{dir}", str(STEPS), "0"]))
    assert all(len(d) == STEPS for d in ref)
    return ref


def start_train(tmp_path: Path, nranks: int, pause: float = 0.03, **kw: Any) -> tuple[Job, list[Ctl]]:
    job = Job("train.py", nranks, tmp_path / "job", ["{rank}", "{nranks}", "{dir}", str(STEPS), str(pause)],
              interceptor=True, ctl=True, **kw).start()
    for rank in range(nranks):
        assert job.read_line(rank) == {"ready": True}
    ctls = [Ctl.wait(job.ctl_path(r), pid=job.procs[r].pid) for r in range(nranks)]
    return job, ctls


def read_steps(job: Job, rank: int, upto: int) -> list[str]:
    out: list[str] = []
    while len(out) <= upto:
        row = job.read_line(rank)
        out.append(row["digest"])
    return out


def test_exports_only_the_nccl_api_and_the_cuda_runtime_calls_it_wraps() -> None:
    syms = subprocess.run(["nm", "-D", "--defined-only", str(INTERCEPTOR)], capture_output=True, text=True,
                          check=True).stdout.split()
    names = [s for s in syms if s.startswith("nccl")]
    assert "ncclAllReduce" in names and "ncclCommInitRank" in names and "ncclGroupStart" in names
    others = sorted(s for s in syms[2::3] if not s.startswith("nccl"))
    # cudaipc.c counts the IPC calls; devmem.c serves device memory and gates the work-issuing runtime calls;
    # drvgate.c gates the driver's submission calls (dlsym, cuGetProcAddress and the calls themselves); vmm.c
    # tracks the memory the application maps itself and counts cudaMallocAsync
    spec = importlib.util.spec_from_file_location("gen_wrappers", ROOT / "native/nccl/interceptor/gen_wrappers.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # its dataclasses look their module up
    spec.loader.exec_module(gen)
    assert others == sorted(["cudaIpcCloseMemHandle", "cudaIpcOpenMemHandle", "cudaMalloc", "cudaFree",
                             "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpy", "cudaMemcpyAsync",
                             "cudaMemcpy2DAsync", "cudaMemset", "cudaMemsetAsync", "cudaGraphLaunch", "dlsym",
                             "cuGetProcAddress", "cuGetProcAddress_v2", "cudaMallocAsync",
                             "cudaMallocFromPoolAsync", "cudaFreeAsync", *gen.DRIVER_EXPORTS, *gen.VMM_EXPORTS])


@pytest.mark.parametrize("case", ["others", "split", "allreduce"])
def test_passthrough_results_identical(tmp_path: Path, case: str) -> None:
    args = [case, "{rank}", "{nranks}", "{dir}"]
    plain = run("collectives.py", 4, tmp_path / "plain", args)
    wrapped = run("collectives.py", 4, tmp_path / "wrapped", args, interceptor=True)
    counted = run("collectives.py", 4, tmp_path / "counted", args, interceptor=True, ctl=True)
    assert plain == wrapped == counted


def test_forked_child_does_not_touch_the_block(tmp_path: Path) -> None:
    out = run("collectives.py", 2, tmp_path, ["fork", "{rank}", "{nranks}", "{dir}"], interceptor=True, ctl=True)
    assert [rows[-1]["seq"] for rows in out] == [2, 2]  # the child's call counted only in its own copy
    assert [rows[-1]["value"] for rows in out] == [4.0, 4.0]


def test_counters_visible_and_hold_at_target(tmp_path: Path) -> None:
    """HOLD with targets at 5 steps: every rank stops exactly there, then RUN lets it finish."""
    ref = reference(tmp_path, 2)
    job, ctls = start_train(tmp_path, 2, pause=0.05)
    try:
        assert all(c.control_thread and c.nccl_version == 22809 and c.flags == 0 for c in ctls)
        k = 5
        targets = {}
        for comm in ctls[0].comms() + ctls[1].comms():
            # world: 4 splits at set-up (counted as its collectives) + 2 collectives and a ring send/recv per step
            pairs = {(0, 1): k, (1, 0): k} if comm.vid == 1 else {}
            targets[comm.ident] = CommTarget(SPLITS + 2 * k if comm.vid == 1 else k, pairs)
        agent = Agent(ctls)
        agent.hold(targets)
        got = [read_steps(job, r, k - 1) for r in range(2)]
        deadline = time.monotonic() + 5
        while not all(c.held == 1 for c in ctls):
            assert time.monotonic() < deadline, [c.held for c in ctls]
            time.sleep(0.01)
        for rank, c in enumerate(ctls):
            comms = {m.vid: m for m in c.comms()}
            world = comms[1]
            assert (world.seq, world.rank, world.nranks, world.rebuild) == (SPLITS + 2 * k, rank, 2, REBUILD_ID)
            assert world.send == world.recv == ((0, k) if rank == 0 else (k, 0))
            assert comms[2].seq == k and comms[2].rebuild == REBUILD_SPLIT and comms[2].parent_vid == 1
            assert c.state() == (ST_HOLDING, agent.gen) and c.busy == 0 and c.in_group == 0
            beat = c.heartbeat
        time.sleep(0.2)
        assert ctls[0].heartbeat > beat
        assert all(job.lines[r].empty() for r in range(2)), "a rank went past its targets"
        agent.run()
        out = job.wait()
    finally:
        job.kill()
    assert [g + d for g, d in zip(got, digests(out), strict=True)] == ref


@pytest.mark.parametrize(("nranks", "cycles"), [(2, 2), (4, 1)])
def test_quiesce_and_rebuild_continue_identically(tmp_path: Path, nranks: int, cycles: int) -> None:
    """Drain to a consistent cut, destroy every communicator (no TCP socket left), rebuild with ids
    relayed by the agent: the job's results are those of an uninterrupted run."""
    ref = reference(tmp_path, nranks)
    job, ctls = start_train(tmp_path, nranks)
    got: list[list[str]] = [[] for _ in range(nranks)]
    try:
        agent = Agent(ctls)
        for cycle in range(cycles):
            for r in range(nranks):
                got[r] += read_steps(job, r, 2)
            assert all(tcp_sockets(p.pid) for p in job.procs)
            agent.hold()
            cut = agent.drain()
            agent.quiesce()
            for c, p in zip(ctls, job.procs, strict=True):
                assert not c.comms_live
                assert tcp_sockets(p.pid) == set(), "a TCP socket survived quiesce"
                kinds = sorted((m.vid, m.rebuild) for m in c.comms())
                assert (1, REBUILD_ID) in kinds and (2, REBUILD_SPLIT) in kinds
                world = next(m for m in c.comms() if m.vid == 1)
                assert world.seq == cut.targets[world.ident].coll
                assert world.flags & 2  # a registered buffer, re-registered at rebuild
            time.sleep(0.2)
            for r in range(nranks):  # nothing moves while quiesced; steps already printed are fine
                while not job.lines[r].empty():
                    got[r].append(job.read_line(r)["digest"])
            seqs = [[m.seq for m in c.comms()] for c in ctls]
            time.sleep(0.1)
            assert seqs == [[m.seq for m in c.comms()] for c in ctls]
            if cycle == 1:  # a restore that brings back a blank file: the interceptor publishes it again
                for c in ctls:  # the magic last: the control thread acts as soon as it is gone
                    c.mm[8:] = bytes(BLOCK_SIZE - 8)
                    c.w64(0, 0)
                for c in ctls:
                    Ctl.wait(c.path, timeout=5).close()
                assert seqs == [[m.seq for m in c.comms()] for c in ctls]
                assert [c.state() for c in ctls] == [(ST_QUIESCED, agent.gen)] * nranks
            agent.rebuild()
            assert all(c.comms_live for c in ctls)
            agent.run()
        out = job.wait()
    finally:
        job.kill()
    assert [g + d for g, d in zip(got, digests(out), strict=True)] == ref


def test_hold_deadline_reopens_the_gate(tmp_path: Path) -> None:
    """An agent that vanishes during HOLD does not stop the job: the deadline opens the gate."""
    job, ctls = start_train(tmp_path, 2, pause=0.01)
    try:
        agent = Agent(ctls)
        gen = agent.hold(release_after=0.3)
        assert all("deadline" in e for e in agent.wait_error(gen))
        out = job.wait()
    finally:
        job.kill()
    assert all(len(d) == STEPS for d in digests(out))


def test_quiesce_without_hold_is_refused(tmp_path: Path) -> None:
    job, ctls = start_train(tmp_path, 2, pause=0.01)
    try:
        agent = Agent(ctls)
        errors = agent.wait_error(agent.command_all(CMD_QUIESCE))
        assert all("must follow a HOLD" in e for e in errors)
        assert all(c.comms_live for c in ctls)
        agent.run()
        out = job.wait()
    finally:
        job.kill()
    assert all(len(d) == STEPS for d in digests(out))


def test_a_second_process_with_the_same_control_file_counts_privately(tmp_path: Path) -> None:
    """A subprocess of a worker that calls NCCL with the worker's environment must not take over the
    worker's block: it finds it published by a live process and counts in its own memory."""
    job, ctls = start_train(tmp_path, 2, pause=0.02)
    try:
        env = dict(os.environ, LD_PRELOAD=str(INTERCEPTOR), CRYOSLEEP_NCCL_CTL=str(job.ctl_path(0)),
                   STANDIN_NCCL_LIB=str(STANDIN))
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from ncclbind import Nccl; "
                "n = Nccl(); n.unique_id(); print('ok')")
        child = subprocess.run([sys.executable, "-c", code, str(WORKLOADS)], env=env, capture_output=True,
                               text=True, timeout=30, check=False)
        assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr
        assert f"belongs to live process {job.procs[0].pid}" in child.stderr
        assert ctls[0].pid == job.procs[0].pid and ctls[0].control_thread and ctls[0].comms()
        out = job.wait()
    finally:
        job.kill()
    assert all(len(d) == STEPS for d in digests(out))
