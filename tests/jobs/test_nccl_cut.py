"""NCCL jobs on CPU, with real processes, real CRIU and the stand-in NCCL behind the interceptor: snapshots
drain every rank to a consistent cut, quiesce, capture, rebuild, and the job's per-step digests are those of
an uninterrupted run (plain torchrun, no interceptor) bit for bit. Failures (a rank that never reaches the
cut, a capture that fails after quiesce) leave the job running, and it still finishes identically.

The workloads (tests/jobs/workloads/nccl_*.py) call NCCL through ctypes, so they start in a fraction of a
second; their communicators are real stand-in communicators over TCP, destroyed at quiesce and re-created
from fresh unique ids relayed by the agent.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cryosleep import paths
from cryosleep.agent.control import ControlClient
from cryosleep.core.interceptor import ControlBlock
from tests.conftest import require_criu
from tests.jobs.harness import Harness, reference, workload

pytestmark = pytest.mark.slow

STANDIN = paths.native_dir() / "standin" / "libnccl.so.2"


@pytest.fixture
def h(cryo_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    require_criu()
    assert STANDIN.is_file(), "build the native helpers: make -C native"
    monkeypatch.setenv("STANDIN_NCCL_LIB", str(STANDIN))
    monkeypatch.setenv("LD_LIBRARY_PATH", str(STANDIN.parent))
    monkeypatch.setenv("STANDIN_NCCL_TIMEOUT_S", "120")
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    harness = Harness(cryo_home)  # its environment (the jobs' too) is taken now
    yield harness
    for d in (cryo_home / "jobs").glob("*"):  # a failed test leaves no job behind (they may linger)
        if harness.job(d.name).agent_alive():
            harness.kill_all(d.name)


def args_for(tmp_path: Path, steps: int, sleep: float = 0.05, *more: str) -> list[str]:
    return ["--steps", str(steps), "--step-sleep", str(sleep), "--dir", str(tmp_path / "rdv"), *more]


def lingering(tmp_path: Path, steps: int, sleep: float = 0.05) -> list[str]:
    """The job waits after its last step until ``tmp_path/linger`` exists: it is still there for a stop
    snapshot however slow the machine is."""
    return args_for(tmp_path, steps, sleep, "--linger", str(tmp_path / "linger"))


def last_step(h: Harness, name: str) -> int:
    got = h.losses(name)
    return int(got[-1].split()[0]) if got else -1


def assert_identical(h: Harness, name: str, script: Path, ref_args: list[str], nproc: int) -> None:
    ref = reference(script, ref_args, nproc)
    for r in range(nproc):
        got = h.losses(name, r)
        assert len(ref[r]) > 0
        assert got == ref[r], f"rank {r}: {len(got)} steps vs {len(ref[r])}; first difference at " + str(
            next((i for i, (a, b) in enumerate(zip(got, ref[r], strict=False)) if a != b), min(len(got), len(ref[r]))))


def ctl_files(h: Harness, name: str, nproc: int) -> list[str]:
    return [str(h.job(name).ctl_path(r)) for r in range(nproc)]


def tcp_streams(sid: str) -> list[Path]:
    """The established TCP connections CRIU captured (one image each): a quiesced job has none."""
    images = Path(os.environ["CRYOSLEEP_STORE"]) / "snapshots" / sid / "nodes" / "0" / "criu"
    assert images.is_dir()
    return list(images.glob("tcp-stream-*.img"))


def test_data_parallel_keep_running_twice_then_stop_and_restore(h: Harness, tmp_path: Path) -> None:
    script = workload("nccl_dp")
    args = lingering(tmp_path, 50)
    h.run("dp", script, args)
    h.wait_step("dp", 3)
    check = h.cli_json("check", "--job", "dp")
    assert check["ok"] and any(c["name"] == "nccl interceptor" and c["ok"] and "ranks [0, 1]" in c["detail"]
                               for c in check["checks"]), check
    rehearsal = h.cli_json("snapshot", "dp", "--rehearse")
    assert list(rehearsal["phases"]) == ["preflight", "drain", "quiesce", "rebuild"] and h.ls() == []
    assert "every rank settled at the cut" in rehearsal["cut"] and rehearsal["pause_s"] > 0
    for step in (6, 12):
        h.wait_step("dp", step)
        s = h.snapshot("dp")
        # the pre-copy before the drain (capture/precopy.py): the pre-dump while the ranks run, NCCL untouched
        assert list(s["phases"])[:6] == ["preflight", "precopy", "precopy-freeze", "drain", "quiesce", "dump"], \
            s["phases"]
        assert "rebuild" in s["phases"] and s["pause_s"] >= s["phases"]["drain"] + s["phases"]["rebuild"]
        assert h.state("dp") == "running"
    h.wait_step("dp", 20)
    stop = h.snapshot("dp", "--stop")
    assert "rebuild" not in stop["phases"] and {"drain", "quiesce", "verify", "end"} <= set(stop["phases"])
    assert h.wait_end("dp") == 75
    shown = h.cli_json("show", stop["snapshot"])
    node = shown["nodes"][0]
    assert [r["rank"] for r in node["nccl"]["ranks"]] == [0, 1]
    world = [c for r in node["nccl"]["ranks"] for c in r["comms"]]
    assert len({c["ident"] for c in world}) == 1 and len({c["seq"] for c in world}) == 1 and world[0]["seq"] > 0
    assert set(ctl_files(h, "dp", 2)) <= {f["path"] for f in node["staged"]}  # the control blocks go along
    assert tcp_streams(stop["snapshot"]) == [], "a communicator's connection was captured: not quiesced"
    shutil.rmtree(h.job("dp").ctl)  # the restore brings the control files back from the snapshot
    restored = h.restore(stop["snapshot"])
    assert "rebuild" in restored["phases"]
    (tmp_path / "linger").touch()
    assert h.wait_end("dp") == 0
    assert_identical(h, "dp", script, args_for(tmp_path, 50, 0), 2)


@pytest.mark.parametrize(("name", "nproc"), [("nccl_overlap", 4), ("nccl_pipeline", 4), ("nccl_grouped", 4),
                                             ("nccl_ahead", 2)])
def test_patterns_keep_running_then_stop_and_restore(h: Harness, tmp_path: Path, name: str, nproc: int) -> None:
    """Overlapping communicators issued in different orders; pipeline send/recv between stages; grouped
    operations; host threads enqueuing many operations ahead."""
    script = workload(name)
    args = lingering(tmp_path, 40)
    job = name.replace("_", "-")
    h.run(job, script, args, nproc=nproc)
    h.wait_step(job, 6)
    s = h.snapshot(job)
    assert {"drain", "quiesce", "rebuild"} <= set(s["phases"])
    h.wait_step(job, 12)
    stop = h.snapshot(job, "--stop")
    assert h.wait_end(job) == 75
    assert tcp_streams(s["snapshot"]) == tcp_streams(stop["snapshot"]) == []
    h.restore(stop["snapshot"])
    (tmp_path / "linger").touch()
    assert h.wait_end(job) == 0
    assert_identical(h, job, script, args_for(tmp_path, 40, 0), nproc)


def test_restore_an_older_keep_running_snapshot_after_a_crash(h: Harness, tmp_path: Path) -> None:
    """Everything is killed long after a keep-running snapshot (the control files have moved on with the
    job): the restore puts them back as they were at the dump and rebuilds the communicators."""
    script = workload("nccl_pipeline")
    steps = 200  # 10 s of steps: the cut lands well before the last one even when the CLI starts slowly under load
    args = lingering(tmp_path, steps)
    h.run("crash", script, args, nproc=4)
    h.wait_step("crash", 6)
    s = h.snapshot("crash")
    # rank 0's counters at the cut, as the manifest keeps them (under load the job may have run on to its last
    # step, where it lingers, while the snapshot persisted: the block is compared with the cut, not with now)
    (at_cut,) = [r for r in h.cli_json("show", s["snapshot"])["nodes"][0]["nccl"]["ranks"] if r["rank"] == 0]
    with ControlBlock(h.job("crash").ctl_path(0)) as b:
        h.wait_step("crash", min(last_step(h, "crash") + 3, steps - 1))
        h.kill_all("crash")
        assert h.state("crash") == "lost"
        assert [c.seq for c in b.comms()] != [c["seq"] for c in at_cut["comms"]], at_cut
    h.restore(s["snapshot"])
    (tmp_path / "linger").touch()
    assert h.wait_end("crash") == 0
    assert_identical(h, "crash", script, args_for(tmp_path, steps, 0), 4)


def test_a_rank_that_never_reaches_the_cut_fails_the_snapshot_and_the_job_goes_on(h: Harness,
                                                                                  tmp_path: Path) -> None:
    """Rank 1 computes for 6 s at step 10 while rank 0 has issued that step's allreduces: the snapshot
    (timeout 2 s) cannot reach a cut, says which rank and communicator, opens the gates, and the job
    finishes identically."""
    script = workload("nccl_dp")
    args = args_for(tmp_path, 25, 0.02, "--stall", "1:10:6")
    h.run("stall", script, args)
    log = h.job("stall").rank_log(1)
    end = time.monotonic() + 60
    while "stalling at step 10" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < end, "rank 1 never stalled"
        time.sleep(0.05)
    time.sleep(0.3)  # rank 0 has issued step 10's calls and waits for rank 1
    start = time.monotonic()
    res = h.cli("snapshot", "--json", "stall", "--timeout", "2", check=False)
    took = time.monotonic() - start
    assert res.returncode == 1, res.stdout
    err = json.loads(res.stdout)
    assert err["error"] == "capture_failed" and "consistent NCCL cut" in err["what"], err
    assert "rank 1: communicator" in err["why"] and "collectives issued" in err["why"], err["why"]
    assert "no thread held" in err["why"] and "rank 0" not in err["why"], err["why"]
    assert err["details"]["ranks"] == [1] and "resumed" in err["hint"]
    assert "nccl_rollback_problems" not in err["details"]
    assert took < 2 + 3, f"the failed snapshot took {took:.1f} s"
    assert h.state("stall") == "running" and h.ls() == []
    assert not any((Path(os.environ["CRYOSLEEP_STORE"]) / ".staging").iterdir())
    assert h.wait_end("stall") == 0
    assert_identical(h, "stall", script, args_for(tmp_path, 25, 0), 2)


@pytest.mark.parametrize("fault", ["capture-fail", "capture-hang-kill"])
def test_a_capture_failing_after_quiesce_rebuilds_and_the_job_goes_on(h: Harness, tmp_path: Path,
                                                                       fault: str) -> None:
    """The dump fails (or hangs and CRIU is killed) while every rank is quiesced: the rollback rebuilds
    the communicators and opens the gates, for keep-running and stop snapshots alike."""
    script = workload("nccl_overlap")
    args = lingering(tmp_path, 80)
    h.run("fault", script, args, nproc=4)
    h.wait_step("fault", 5)
    env = dict(h.env, CRYOSLEEP_FAULT=fault)
    for stop in ([], ["--stop"]):
        before = len(h.losses("fault"))
        res = h.cli("snapshot", "--json", "fault", "--timeout", "4", *stop, check=False, env=env)
        assert res.returncode == 1 and '"capture_failed"' in res.stdout, res.stdout
        err = json.loads(res.stdout)
        assert {"drain", "quiesce"} <= set(err["details"]["phases"]) and "nccl_rollback_problems" not in err["details"]
        assert h.state("fault") == "running"
        end = time.monotonic() + 20
        while len(h.losses("fault")) <= before:
            assert time.monotonic() < end, "the job did not go on after the failed snapshot"
            time.sleep(0.05)
    assert h.ls() == []
    (tmp_path / "linger").touch()
    assert h.wait_end("fault") == 0
    assert_identical(h, "fault", script, args_for(tmp_path, 80, 0), 4)


def test_a_rank_failing_its_rebuild_is_quiesced_again_and_retried(h: Harness, tmp_path: Path) -> None:
    """Rank 1's first REBUILD fails after it re-created every communicator (CRYOSLEEP_NCCL_FAULT, read by the
    interceptor) while the other ranks' succeed: the agent quiesces those again, rebuilds every rank, and
    only then lets the threads go on."""
    script = workload("nccl_grouped")
    args = lingering(tmp_path, 40)
    h.env = dict(h.env, CRYOSLEEP_NCCL_FAULT="rebuild-once@1")
    h.run("retry", script, args, nproc=4)
    h.wait_step("retry", 4)
    r = h.cli_json("snapshot", "retry", "--rehearse")
    assert "rebuild" in r["phases"]
    assert "injected failure" in h.job("retry").rank_log(1).read_text()
    log = h.job("retry").agent_log.read_text()
    assert "rebuild failed" in log and "rank 1: REBUILD: injected failure" in log, log[-2000:]
    s = h.snapshot("retry")  # the fault fires once: this rebuild goes through at once
    assert "rebuild" in s["phases"]
    (tmp_path / "linger").touch()
    assert h.wait_end("retry") == 0
    assert_identical(h, "retry", script, args_for(tmp_path, 40, 0), 4)


def test_refused_features_and_check(h: Harness, tmp_path: Path) -> None:
    """More than 64 live communicators: the interceptor flags it, `check --job` and the snapshot refuse with
    the reason before touching the job; a user's NCCL_NVLS_ENABLE is kept and warned about."""
    script = workload("nccl_dp")
    args = [*lingering(tmp_path, 30), "--extra-comms", "64"]  # still there for check and snapshot under load
    h.env = dict(h.env, NCCL_NVLS_ENABLE="1")
    h.run("many", script, args)
    h.wait_step("many", 3)
    check = h.cli_json("check", "--job", "many", check=False)
    details = [c["detail"] for c in check["checks"] if not c["ok"]]
    assert not check["ok"] and any("more than 64 live communicators" in d for d in details), details
    assert any("NCCL_NVLS_ENABLE=1" in d for d in details), details
    res = h.cli("snapshot", "--json", "many", check=False)
    assert res.returncode == 1 and '"not_eligible"' in res.stdout and "more than 64 live communicators" in res.stdout
    err = json.loads(res.stdout)
    assert "drain" not in err["details"]["phases"]
    (tmp_path / "linger").touch()
    assert h.wait_end("many") == 0
    assert_identical(h, "many", script, args_for(tmp_path, 30, 0, "--extra-comms", "64"), 2)


def test_without_the_interceptor_nothing_is_drained(h: Harness, tmp_path: Path) -> None:
    """`--no-interceptor`: no control block, no drain (the stand-in's TCP connections are captured as they are
    by CRIU), and `check` says what that means."""
    script = workload("nccl_dp")
    args = lingering(tmp_path, 30)
    out = h.cli_json("run", "--detach", "--no-interceptor", "--name", "plain", "--nproc-per-node", "2",
                     str(script), *args)
    assert out["job"] == "plain"
    h.wait_step("plain", 5)
    assert not h.job("plain").ctl_path(0).exists()
    check = h.cli_json("check", "--job", "plain", check=False)
    assert any("--no-interceptor" in c["detail"] for c in check["checks"])
    s = h.snapshot("plain")
    assert "drain" not in s["phases"]
    assert tcp_streams(s["snapshot"]), "the stand-in's connections should have been captured as they were"
    (tmp_path / "linger").touch()
    assert h.wait_end("plain") == 0
    assert_identical(h, "plain", script, args_for(tmp_path, 30, 0), 2)


def test_one_hundred_random_cuts_then_snapshots_and_restore(h: Harness, tmp_path: Path) -> None:
    """Covers: 100 drain+quiesce+rebuild cycles (`snapshot --rehearse` requests on the agent's control
    socket: the agent's own drain, quiesce and rebuild, capturing nothing) at seeded random moments of a
    live 4-rank job mixing every pattern (collectives in rank-dependent orders on two overlapping
    communicators, a grouped ring, a chain of ungrouped sends and receives, a second thread per rank running
    ahead), two keep-running CRIU snapshots among them, then a stop snapshot and a restore. Every cycle must
    converge, and the digests must equal an uninterrupted run's."""
    script = workload("nccl_mixed")
    linger = tmp_path / "linger"
    steps = 500
    args = args_for(tmp_path, steps, 0.02, "--linger", str(linger))
    h.run("mixed", script, args, nproc=4)
    h.wait_step("mixed", 3)
    client = ControlClient(h.job("mixed").socket, "mixed")
    rng = random.Random(20261129)
    results: list[dict[str, Any]] = []
    for i in range(100):
        time.sleep(rng.uniform(0.0, 0.04))
        results.append(client.call({"op": "snapshot", "rehearse": True, "timeout": 30}))
        if i in (33, 66):
            s = h.snapshot("mixed")
            assert {"drain", "quiesce", "rebuild"} <= set(s["phases"])
    assert len(results) == 100 and all("every rank settled at the cut" in r["cut"] for r in results)
    seqs = [sum(c["seq"] for r in res["nccl"]["ranks"] for c in r["comms"]) for res in results]
    assert len(set(seqs)) > 50, "the cuts did not land at different moments"
    reached = int(h.losses("mixed")[-1].split()[0])
    assert reached < steps - 1, f"the job finished its steps ({reached}) before the cycles did: not a live job"
    stop = h.snapshot("mixed", "--stop")
    assert h.wait_end("mixed") == 75
    h.restore(stop["snapshot"])
    linger.touch()
    assert h.wait_end("mixed", timeout=300) == 0
    assert_identical(h, "mixed", script, args_for(tmp_path, steps, 0), 4)


def test_fast_path_moves_device_memory_and_the_job_continues_identically(
        h: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path with real CRIU: the workers' "device memory" (tests/native/fakecuda over host memory:
    CI has no GPU; the workload reaches it only through launches and copies, as on a GPU) is offloaded into
    the staging files, released, reloaded after the dump (keep-running) or restored from the image (stop +
    restore), and the job's digests equal an uninterrupted run's. Its memory is of every kind a job has:
    cudaMalloc served by the interceptor, a small one (from a slab chunk) and a segment the workload maps itself
    (all moved), and cudaMallocAsync (left to the driver, with why in `check --job` and the manifest)."""
    from tests.native.fakecuda.build import build

    _, cudart = build(tmp_path / "fake")
    libs = os.pathsep.join([str(tmp_path / "fake"), str(STANDIN.parent)])
    for k, v in (("FAKE_CUDART", str(cudart)), ("LD_LIBRARY_PATH", libs)):
        monkeypatch.setitem(h.env, k, v)  # the job's
        monkeypatch.setenv(k, v)  # the reference run's
    monkeypatch.setitem(h.env, "CRYOSLEEP_DEVMEM_PIECE", str(1 << 20))  # images in pieces of 1 MiB, not 1 GiB
    monkeypatch.setitem(h.env, "CRYOSLEEP_PREPARE_EVERY_S", "0.5")  # the agent prepares the staging files early
    script = workload("nccl_devmem")
    args = lingering(tmp_path, 40)
    h.run("fast", script, args, flags=("--fast-path",))
    h.wait_step("fast", 3)
    check = h.cli_json("check", "--job", "fast")
    moved = ("moves 6 MiB itself (4 MiB it serves for cudaMalloc in 2 VMM allocation(s), 1 cudaMalloc under 1 MiB "
             "held in shared 2 MiB chunks; 2 MiB in 2 handle(s) the application mapped")
    assert sum(c["name"] == "fast path" and c["ok"] and moved in c["detail"]
               for c in check["checks"]) == 2, check  # both ranks: what each snapshot would take
    left = [c["detail"] for c in check["checks"] if c["name"] == "fast path: left to the driver"]
    assert len(left) == 2 and all("in 1 cudaMallocAsync allocation(s)" in d for d in left), check
    assert {r: (p["moved_bytes"], [x["kind"] for x in p["left"]]) for r, p in check["fast_path"].items()} == {
        r: (6 << 20, ["cudaMallocAsync"]) for r in ("0", "1")}, check["fast_path"]
    # the staging files are made while the job runs, before any snapshot asks for them
    end = time.monotonic() + 30

    def prepared() -> set[int]:  # both at once, or each rank as its memory appeared
        log = h.job("fast").agent_log.read_text()
        lines = re.findall(r"staging files prepared ahead for rank\(s\) \[([\d, ]+)\]", log)
        return {int(r) for line in lines for r in line.split(",")}

    while prepared() != {0, 1}:
        assert time.monotonic() < end, h.job("fast").agent_log.read_text()[-2000:]
        time.sleep(0.1)
    assert len(list(h.job("fast").devmem.glob("*.devmem"))) == 2
    h.wait_step("fast", min(39, int(h.losses("fast")[-1].split()[0]) + 2))  # a PREPARE ahead holds no NCCL call
    keep = h.snapshot("fast")
    order = [p for p in keep["phases"] if p in ("prepare", "drain", "quiesce", "offload")]
    assert order == ["prepare", "drain", "quiesce", "offload"], keep["phases"]
    assert {"reload", "devmem"} <= set(keep["phases"]), keep["phases"]
    shown = h.cli_json("show", keep["snapshot"])
    fast = shown["nodes"][0]["gpu"]["fast_path"]
    assert sorted(fast["ranks"]) == ["0", "1"] and fast["plain"] == {}
    node = Path(os.environ["CRYOSLEEP_STORE"]) / "snapshots" / keep["snapshot"] / "nodes" / "0"
    for entry in fast["ranks"].values():
        pieces = entry["pieces"]
        assert len(pieces) >= 2 and [x["offset"] for x in pieces] == [i << 20 for i in range(len(pieces))], pieces
        assert sum((node / x["image"]).stat().st_size for x in pieces) == entry["bytes"] >= 6 << 20
        plan = entry["plan"]  # what the manifest records: moved, left to the driver and why, the arena
        assert plan["mapped"] == {"bytes": 2 << 20, "count": 2} and plan["arena"]["prefaulted"], plan
        assert plan["served"] == {"bytes": 4 << 20, "count": 2, "small": 1}, plan
        assert [(x["kind"], x["count"]) for x in plan["left"]] == [("cudaMallocAsync", 1)] and plan["left"][0]["why"]
        assert entry["stage_path"].startswith("/dev/shm/")
        assert entry["stage_path"] not in {f["path"] for f in shown["nodes"][0]["staged"]}  # not copied in the freeze
    h.wait_step("fast", 10)
    stop = h.snapshot("fast", "--stop")
    assert {"offload", "devmem", "verify", "end"} <= set(stop["phases"]) and "reload" not in stop["phases"]
    # the job held all along (devmem too), but for the pre-copy (its freeze counted apart, as precopy-freeze)
    held = [p for p in stop["phases"] if p not in ("preflight", "prepare", "precopy")]
    assert stop["phases"]["devmem"] >= 0.002, stop
    assert abs(stop["pause_s"] - sum(stop["phases"][p] for p in held)) < 5e-4, stop
    assert h.wait_end("fast") == 75
    assert not h.job("fast").devmem.exists()  # the agent removed the staging files with the job
    # a device-memory file altered in the store: the restore's devmem phase checks it as it copies it (the
    # verify phase leaves it to that copy) and refuses before CRIU runs, naming it; nothing is left behind
    entry = h.cli_json("show", stop["snapshot"])["nodes"][0]["gpu"]["fast_path"]["ranks"]["1"]
    piece = entry["pieces"][1]
    image = Path(os.environ["CRYOSLEEP_STORE"]) / "snapshots" / stop["snapshot"] / "nodes" / "0" / piece["image"]
    with open(image, "r+b") as f:
        f.seek(piece["bytes"] // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x20]))
    bad = h.cli_json("restore", "--detach", stop["snapshot"], check=False)
    assert bad["error"] == "store_corrupt" and f"{piece['image']}: sha256" in bad["why"], bad
    assert not Path(entry["stage_path"]).exists() and not h.job("fast").devmem.exists(), "staging left behind"
    with open(image, "r+b") as f:
        f.seek(piece["bytes"] // 2)
        f.write(byte)
    restored = h.restore(stop["snapshot"])
    assert {"devmem", "reload", "rebuild"} <= set(restored["phases"]), restored["phases"]
    (tmp_path / "linger").touch()
    assert h.wait_end("fast") == 0
    assert_identical(h, "fast", script, args_for(tmp_path, 40, 0), 2)
