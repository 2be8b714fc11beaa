"""Job-level acceptance on CPU, with real CRIU and real PyTorch: snapshots and restores must continue the
training bit for bit, survive a crash of everything, and never harm the job when they fail."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs.coordinated import wait_for
from tests.jobs.harness import Harness, assert_identical, in_post_dump, reference, workload

pytestmark = pytest.mark.slow

BASIC = ["--steps", "40", "--step-sleep", "0.05"]


def test_ddp_adamw_keep_running_then_stop_and_restore(h: Harness, tmp_path: Path) -> None:
    script = workload("ddp_basic")
    hold = tmp_path / "hold"  # the job waits after step 18 until the stop snapshot is taken, however slow the machine
    args = [*BASIC, "--hold", str(hold), "--hold-at", "18"]
    h.run("adamw", script, args)
    h.wait_step("adamw", 8)
    s1 = h.snapshot("adamw")
    assert s1["mode"] == "keep-running" and s1["bytes"] > 0 and s1["pause_s"] > 0
    assert set(s1["phases"]) >= {"preflight", "dump", "checksum", "commit"}
    # CRIU's own breakdown of the dump, from the stats-dump image it wrote (capture/criu_stats.py)
    prof = h.cli_json("show", s1["snapshot"])["nodes"][0]["criu"]
    assert 0 < prof["memwrite_s"] <= prof["memdump_s"] <= prof["frozen_s"] <= prof["held_s"] <= s1["phases"]["dump"]
    assert prof["pages_written"] * 4096 <= s1["bytes"] and "post-dump" in prof["scripts_s"], prof
    # by default, the write-tracked pre-copy (capture/precopy.py): the pre-dump's freeze is in the pause, and the
    # dump took most pages from it (the job writes little between the two)
    pre = h.cli_json("show", s1["snapshot"])["nodes"][0]["precopy"]
    assert pre["parent"] == "criu-pre" and pre["why"] == "" and pre["tracked"] >= 2, pre
    assert 0 < s1["phases"]["precopy-freeze"] == round(pre["freeze_s"], 4) < s1["phases"]["precopy"], s1["phases"]
    assert pre["pages_parent"] > prof["pages_written"], (pre, prof)
    assert h.state("adamw") == "running"
    h.wait_step("adamw", 16)
    s2 = h.snapshot("adamw", "--stop")
    assert s2["mode"] == "stop" and {"verify", "end"} <= set(s2["phases"])
    assert h.wait_end("adamw") == 75  # suspended
    assert h.state("adamw") == "suspended"
    assert h.cli_json("verify", s2["snapshot"])["ok"]
    hold.touch()
    h.restore(s2["snapshot"])
    assert h.wait_end("adamw") == 0
    assert_identical(h, "adamw", script, args, [0, 1])


@pytest.mark.parametrize("workers", [0, 2], ids=["dropout-lr-schedule", "dataloader-2-workers-sampler"])
def test_dropout_lr_schedule_and_dataloader_workers(h: Harness, workers: int, tmp_path: Path) -> None:
    script = workload("demo_train")
    # the job waits after its last step (--linger): under load its 50 steps were once done before the stop
    # snapshot reached it (nothing left to stop)
    linger = tmp_path / "linger"
    args = ["--steps", "50", "--step-sleep", "0.05", "--workers", str(workers), "--linger", str(linger)]
    name = f"dl{workers}"
    h.run(name, script, args)
    h.wait_step(name, 12)
    h.snapshot(name)
    h.wait_step(name, 25)
    s = h.snapshot(name, "--stop")
    assert h.wait_end(name) == 75
    h.restore(s["snapshot"])
    linger.touch()
    assert h.wait_end(name) == 0
    assert_identical(h, name, script, args, [0])


def test_many_snapshots_stop_restore_twice(h: Harness, tmp_path: Path) -> None:
    script = workload("ddp_basic")
    # The job waits after its last step until the test lets it end: on a loaded machine a keep-running snapshot
    # takes seconds (CRIU's dump, then the checksum while the job runs on), and 60 steps of 0.05 s were all done
    # before the third snapshot, which then found no job. Each rank starts a child process every step that ends
    # 30 ms later (--churn): a process that comes and goes, exiting 0, during a snapshot is the job's own (a
    # DataLoader's workers at an epoch's end), not a failure (before: Lightning's snapshots failed in CI).
    linger = tmp_path / "linger"
    args = ["--steps", "60", "--step-sleep", "0.05", "--linger", str(linger), "--churn"]
    h.run("many", script, args)
    for step in (5, 10, 15):
        h.wait_step("many", step)
        plain = step == 10  # one dumped plain: --no-precopy, and the manifest says why
        snap = h.snapshot("many", *(["--no-precopy"] if plain else []))
        pre = h.cli_json("show", snap["snapshot"])["nodes"][0]["precopy"]
        assert (pre["parent"] is None and "--no-precopy" in pre["why"]) if plain else pre["parent"] == "criu-pre", pre
    h.wait_step("many", 20)
    s = h.snapshot("many", "--stop")
    assert h.wait_end("many") == 75
    h.restore(s["snapshot"])
    h.wait_step("many", 35)
    s2 = h.snapshot("many", "--stop")
    # after a restore, the restored workers' trackers answer the new agent: pre-copied again
    assert h.cli_json("show", s2["snapshot"])["nodes"][0]["precopy"]["parent"] == "criu-pre"
    assert h.wait_end("many") == 75
    restored = h.restore(s2["snapshot"])
    assert restored["restored_from"] == s2["snapshot"]
    linger.touch()
    assert h.wait_end("many") == 0
    assert_identical(h, "many", script, args, [0, 1])
    snaps = h.ls()
    assert len(snaps) == 5
    assert [x["restored_from"] for x in snaps][-1] == s["snapshot"]


def test_restore_older_snapshot_after_everything_was_killed(h: Harness, tmp_path: Path) -> None:
    script = workload("ddp_basic")
    own = tmp_path / "own-logs"
    own.mkdir()
    # long enough that it still trains after the snapshot, however long that took under load (80 steps were once
    # all done before the test looked for five more), and then waits after its last step (--linger)
    linger = tmp_path / "linger"
    args = ["--steps", "400", "--step-sleep", "0.03", "--own-log", str(own), "--linger", str(linger)]
    h.run("crash", script, args)
    h.wait_step("crash", 8)
    s = h.snapshot("crash")
    size_at_snapshot = (own / "train-rank0.log").stat().st_size
    last = int(h.losses("crash")[-1].split()[0])
    h.wait_step("crash", min(last + 5, 399))  # the job runs on; its logs grow past the snapshot
    assert (own / "train-rank0.log").stat().st_size > size_at_snapshot
    h.kill_all("crash")
    assert h.state("crash") == "lost"
    h.restore(s["snapshot"])
    linger.touch()
    assert h.wait_end("crash") == 0
    # The job's own log was brought back to its state at the snapshot, then continued: no step twice.
    own_lines = [" ".join(ln.split()[1::2]) for ln in (own / "train-rank1.log").read_text().splitlines()]
    assert own_lines == h.losses("crash", 1)
    assert_identical(h, "crash", script, args, [0, 1])  # (the reference run appends to own/ too: last)


def _take_pid(pid: int) -> int | None:
    """Start a process that gets exactly ``pid`` (through ns_last_pid); return its PID. None: another process
    (of a test running beside this one) took it first, so it is in use all the same."""
    for _ in range(50):
        if _in_use(pid):
            return None
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        child = os.fork()
        if child == 0:  # pragma: no cover - child
            signal.pause()
            os._exit(0)
        if child == pid:
            return child
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    raise AssertionError(f"could not take PID {pid}")


def _in_use(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_restore_while_the_original_pids_are_in_use(h: Harness) -> None:
    script = workload("ddp_basic")
    h.run("pids", script, BASIC)
    h.wait_step("pids", 8)
    original = h.pids("pids")
    s = h.snapshot("pids", "--stop")
    assert h.wait_end("pids") == 75
    taken = [_take_pid(p) for p in original]
    squatters = [p for p in taken if p is not None]
    try:
        assert all(_in_use(p) for p in original)
        h.restore(s["snapshot"])
        assert h.wait_end("pids") == 0
        assert_identical(h, "pids", script, BASIC, [0, 1])
    finally:
        for p in squatters:
            os.kill(p, signal.SIGKILL)
            os.waitpid(p, 0)


@pytest.mark.parametrize("fault", ["capture-fail", "capture-hang", "capture-hang-kill"])
def test_failed_or_timed_out_capture_leaves_the_job_running(h: Harness, fault: str) -> None:
    script = workload("ddp_basic")
    args = ["--steps", "60", "--step-sleep", "0.05"]
    h.run("atomic", script, args)
    h.wait_step("atomic", 8)
    before = len(h.losses("atomic"))
    env = dict(h.env, CRYOSLEEP_FAULT=fault)
    for stop in ([], ["--stop"]):
        res = h.cli("snapshot", "--json", "atomic", "--timeout", "4", *stop, check=False, env=env)
        assert res.returncode != 0, res.stdout
        assert "capture_failed" in res.stdout
        assert h.state("atomic") == "running"
    time.sleep(1.0)
    assert len(h.losses("atomic")) > before, "the job did not go on after the failed snapshots"
    assert h.ls() == []
    store = Path(os.environ["CRYOSLEEP_STORE"])
    assert not any((store / ".staging").iterdir()), "a failed snapshot left staging files"
    assert h.wait_end("atomic") == 0
    assert_identical(h, "atomic", script, args, [0, 1])


def test_a_failure_after_the_pre_dump_drops_it_and_the_job_runs_on(h: Harness, tmp_path: Path) -> None:
    """A fault between the pre-dump and the dump (CRYOSLEEP_FAULT=precopy-fail, capture/precopy.py): each
    snapshot fails cleanly, the job runs on unharmed, nothing stays in the store or its staging, and the next
    snapshot pre-copies and is restored bit for bit."""
    script = workload("ddp_basic")
    # it waits after its last step (--linger) until restored: under load its 60 steps were once all done before
    # the last snapshot came, which then found no job to take
    linger = tmp_path / "linger"
    args = ["--steps", "60", "--step-sleep", "0.05", "--linger", str(linger)]
    h.run("prefail", script, args)
    h.wait_step("prefail", 8)
    env = dict(h.env, CRYOSLEEP_FAULT="precopy-fail")
    for stop in ([], ["--stop"]):
        res = h.cli("snapshot", "--json", "prefail", *stop, check=False, env=env)
        assert res.returncode != 0 and "after the pre-dump" in res.stdout, res.stdout
        assert h.state("prefail") == "running"
    store = Path(os.environ["CRYOSLEEP_STORE"])
    assert h.ls() == [] and not any((store / ".staging").iterdir()), "a failed snapshot left files"
    before = len(h.losses("prefail"))
    s = h.snapshot("prefail", "--stop")
    assert before > 8 and h.cli_json("show", s["snapshot"])["nodes"][0]["precopy"]["parent"] == "criu-pre"
    assert h.wait_end("prefail") == 75
    h.restore(s["snapshot"])
    linger.touch()
    assert h.wait_end("prefail") == 0
    assert_identical(h, "prefail", script, args, [0, 1])


def test_two_snapshots_at_once_and_snapshot_of_exited_job(h: Harness) -> None:
    script = workload("ddp_basic")
    args = ["--steps", "30", "--step-sleep", "0.05"]
    h.run("busy", script, args)
    h.wait_step("busy", 5)
    env = dict(h.env, CRYOSLEEP_FAULT="capture-hang")
    import subprocess
    import sys

    slow = subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "snapshot", "--json", "busy",
                             "--timeout", "5"], env=env, stdout=subprocess.PIPE, text=True)
    time.sleep(1.5)
    res = h.cli("snapshot", "--json", "busy", check=False)
    assert res.returncode == 1 and '"busy"' in res.stdout, res.stdout
    slow.communicate(timeout=60)
    assert h.wait_end("busy") == 0
    assert_identical(h, "busy", script, args, [0, 1])
    res = h.cli("snapshot", "--json", "busy", check=False)
    assert res.returncode == 1 and "not running" in res.stdout, res.stdout


def test_a_worker_that_exits_during_the_snapshot_is_named(h: Harness) -> None:
    """A job ending (or a rank dying) mid-snapshot makes the snapshot fail with that as the reason, not with
    whatever CRIU or CUDA reported about the vanished process."""
    script = workload("ddp_basic")
    h.run("ending", script, ["--steps", "100000", "--step-sleep", "0.05"])
    h.wait_step("ending", 5)
    env = dict(h.env, CRYOSLEEP_FAULT="capture-hang")
    import subprocess
    import sys

    snap = subprocess.Popen([sys.executable, "-m", "cryosleep.cli.main", "snapshot", "--json", "ending",
                             "--timeout", "6"], env=env, stdout=subprocess.PIPE, text=True)
    # the dump's hook hangs with the tree frozen (a fixed wait was once too short at load 8: CRIU was still
    # dumping, and the kill made it fail first)
    wait_for(lambda: in_post_dump(os.environ["CRYOSLEEP_STORE"]), 120, "the dump's post-dump hook")
    victim = h.pids("ending")[-1]
    os.kill(victim, signal.SIGKILL)
    out, _ = snap.communicate(timeout=60)
    err = json.loads(out)
    assert err["error"] == "capture_failed", err
    assert "ended while the snapshot ran" in err["what"] and str(victim) in err["why"], err
    assert h.wait_end("ending") != 0
    assert h.ls() == []


@pytest.fixture
def lasting_dir() -> Iterator[Path]:
    """A directory outside /tmp (files there are staged into the snapshot, not expected at restore)."""
    d = Path(tempfile.mkdtemp(prefix="cryosleep-test-", dir="/var/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_files_the_job_reads_are_checked_at_restore(h: Harness, lasting_dir: Path) -> None:
    """A file the job holds open or maps read-only must be unchanged where it is restored: size and mtime,
    or else its SHA-256; a changed one stops the restore before anything starts, named."""
    data = lasting_dir / "dataset.bin"
    data.write_bytes(bytes(range(256)) * 4096)
    script = workload("reads_dataset")
    # (with 40 steps the job once ended, at load 7, before the stop snapshot reached it)
    args = ["--data", str(data), "--steps", "200", "--step-sleep", "0.05"]
    h.run("reader", script, args, nproc=1)
    h.wait_step("reader", 5)
    s = h.snapshot("reader", "--stop")
    assert h.wait_end("reader") == 75
    manifest = json.loads((Path(os.environ["CRYOSLEEP_STORE"]) / "snapshots" / s["snapshot"] / "manifest.json")
                          .read_text())
    expected = {e["path"]: e for e in manifest["nodes"][0]["expected"]}
    assert expected[str(data)]["sha256"] and expected[str(data)]["size"] == 256 * 4096
    assert any("libpython" in p or "torch" in p for p in expected), "the job's libraries are recorded too"
    st = data.stat()

    data.write_bytes(bytes(range(256)) * 4096 + b"x")  # grown: refused, nothing started
    res = h.cli("restore", "--json", "--detach", s["snapshot"], check=False)
    err = json.loads(res.stdout)
    assert res.returncode != 0 and err["error"] == "not_eligible", err
    assert f"{data}: {256 * 4096 + 1} bytes, {256 * 4096} at the snapshot" in err["why"], err["why"]
    assert h.state("reader") == "suspended"

    data.write_bytes(bytes(255 - b for b in range(256)) * 4096)  # same size, other content
    res = h.cli("restore", "--json", "--detach", s["snapshot"], check=False)
    assert "content differs from the snapshot's" in json.loads(res.stdout)["why"]

    data.write_bytes(bytes(range(256)) * 4096)  # the same bytes again, a new mtime: the checksum admits it
    assert data.stat().st_mtime_ns != st.st_mtime_ns
    h.restore(s["snapshot"])
    assert h.wait_end("reader") == 0
    assert h.losses("reader") == reference(script, args, 1)[0]


def test_a_file_the_job_reads_under_tmp_travels_in_the_snapshot(h: Harness, tmp_path: Path) -> None:
    """/tmp and /dev/shm do not outlive the machine: a file the job reads there is staged at the dump and
    put back at restore, so a restore elsewhere (here: after it was deleted) finds it."""
    data = tmp_path / "scratch.bin"
    data.write_bytes(bytes(range(256)) * 1024)
    script = workload("reads_dataset")
    # (with 30 steps the job once ended, at load 8, before the stop snapshot reached it)
    args = ["--data", str(data), "--steps", "200", "--step-sleep", "0.05"]
    ref = reference(script, args, 1)[0]
    h.run("scratch", script, args, nproc=1)
    h.wait_step("scratch", 5)
    s = h.snapshot("scratch", "--stop")
    assert h.wait_end("scratch") == 75
    data.unlink()
    h.restore(s["snapshot"])
    assert h.wait_end("scratch") == 0
    assert data.read_bytes() == bytes(range(256)) * 1024
    assert h.losses("scratch") == ref


def test_corrupt_images_are_refused_before_anything_starts(h: Harness) -> None:
    script = workload("ddp_basic")
    h.run("corrupt", script, BASIC)
    h.wait_step("corrupt", 5)
    s = h.snapshot("corrupt", "--stop")
    assert h.wait_end("corrupt") == 75
    store = Path(os.environ["CRYOSLEEP_STORE"]) / "snapshots" / s["snapshot"]
    pages = max((store / "nodes/0/criu").glob("pages-*.img"), key=lambda p: p.stat().st_size)
    original = pages.read_bytes()
    log = h.job("corrupt").rank_log(0)
    log_before = log.read_bytes()

    for damage in ("truncate", "flip"):
        if damage == "truncate":
            pages.write_bytes(original[: len(original) // 2])
        else:
            flipped = bytearray(original)
            flipped[len(flipped) // 3] ^= 0x01
            pages.write_bytes(bytes(flipped))
        v = h.cli_json("verify", s["snapshot"], check=False)
        assert not v["ok"] and any(pages.name in p for p in v["problems"])
        res = h.cli("restore", "--json", s["snapshot"], check=False)
        assert res.returncode != 0 and "store_corrupt" in res.stdout and pages.name in res.stdout
        assert h.state("corrupt") == "suspended"  # nothing started
        assert log.read_bytes() == log_before  # nothing touched
    pages.write_bytes(original)
    h.restore(s["snapshot"])
    assert h.wait_end("corrupt") == 0
    assert_identical(h, "corrupt", script, BASIC, [0, 1])


def test_unknown_job_and_snapshot(h: Harness) -> None:
    res = h.cli("snapshot", "--json", "nosuchjob", check=False)
    assert res.returncode == 1 and '"not_found"' in res.stdout and "no job named" in res.stdout
    res = h.cli("restore", "--json", "nosuchsnap", check=False)
    assert res.returncode == 1 and '"not_found"' in res.stdout
    res = h.cli("show", "--json", "nosuchsnap", check=False)
    assert res.returncode == 1 and "cryosleep ls" in res.stdout


def test_without_criu_a_snapshot_is_refused_and_the_job_goes_on(h: Harness, tmp_path: Path) -> None:
    script = workload("ddp_basic")
    args = ["--steps", "30", "--step-sleep", "0.05"]
    empty = tmp_path / "empty"
    empty.mkdir()
    # The agent looks for CRIU when it snapshots: this job's agent finds none.
    h.env = dict(h.env, CRYOSLEEP_CRIU_ROOT=str(empty), PATH=f"{empty}:/usr/bin:/bin")
    h.env.pop("CRYOSLEEP_CRIU", None)
    assert not Path("/usr/bin/criu").exists() and not Path("/usr/sbin/criu").exists()
    h.run("nocriu", script, args)
    h.wait_step("nocriu", 5)
    res = h.cli("snapshot", "--json", "nocriu", check=False)
    assert res.returncode == 1 and '"criu_unavailable"' in res.stdout and "cryosleep criu install" in res.stdout
    assert h.state("nocriu") == "running"
    res = h.cli("check", "--json", check=False)
    assert res.returncode == 1 and "cryosleep criu install" in res.stdout
    assert h.wait_end("nocriu") == 0
    assert_identical(h, "nocriu", script, args, [0, 1])
    assert h.ls() == []


def test_non_root_gets_a_clear_refusal(h: Harness, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from cryosleep.cli.main import main

    # The interpreter here lives under root's home, which another user cannot enter: pretend instead.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    for cmd in (["snapshot", "--json", "anyjob"], ["restore", "--json", "anysnap"],
                ["run", "--json", "--detach", str(workload("ddp_basic"))]):
        assert main(cmd) == 1
        out = capsys.readouterr().out
        assert '"not_eligible"' in out and "needs root" in out and "sudo" in out, out
    assert main(["check", "--json"]) == 1
    assert "not root" in capsys.readouterr().out
