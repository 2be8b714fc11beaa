"""Pause per phase and image size against the workers' memory (docs/benchmarks.md).

    sudo .venv/bin/python bench/pause.py [--mem-mb 0 2048] [--nproc 2] [--store-parent /dev/shm]
    sudo python3 bench/pause.py --gpu --mem-mb 2048 8192 24576 --nproc 1     (on a GPU machine)
    sudo python3 bench/pause.py --gpu --mem-mb 8192 --paths fast plain         (the fast path and the plain one)

For each size it starts ddp_basic (gloo DDP, AdamW; with --gpu: tests/gpu/workloads/cuda_train.py, its
extra state in device memory) with that much extra state per rank under
`cryosleep run`, takes ``--keep`` keep-running snapshots (2) and a stop snapshot, restores, and prints one
markdown row per snapshot: pause (and per GiB of extra state per rank, and of the whole image), each phase,
CRIU's own breakdown of the dump (capture/criu_stats.py: freezing, drain, write, the rest, the post-dump hook,
the job held outside CRIU's freeze), image bytes and the workers' resident memory; for a stop snapshot, the
baseline measured in the same run: its image's bytes written and fsynced to the store's filesystem; for the restore,
the time from `cryosleep restore` to the job's next step line (its s/GiB: per GiB of the whole image restored).
The job's step times (when rank 0 logged each
step) give two more numbers: before the first snapshot, the median and longest gap between steps (with
``--prepare-ahead S`` the agent prepares the fast path's staging files then, and the bench waits until they
are); and for each keep-running snapshot, "job's step gap", the longest wait between two steps across it: what
the snapshot cost the job, whatever held it (the pause, or a first snapshot's pinning of the staging file,
which stalls the job's CUDA calls outside the reported pause). ``--paths``: the fast path (`run --fast-path`: the
interceptor moves device memory itself) and/or the plain path (the CUDA driver's own checkpoint copies it),
one after the other for each size. ``--precopy on off``: the keep-running snapshots with the write-tracked
pre-copy and without it (`snapshot --no-precopy`), ``--keep`` of each on the same job, each row saying which the
manifest recorded (docs/precopy.md); ``--write-frac F``: the CPU job rewrites that part of its extra state every
step (1: all of it; the rest is written once). It uses its own
CRYOSLEEP_HOME and store under /tmp, and removes them afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _cli import cli, wait_lines  # bench/ is on sys.path when a script here is run

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "tests" / "jobs" / "workloads" / "ddp_basic.py"
GPU_WORKLOAD = ROOT / "tests" / "gpu" / "workloads" / "cuda_train.py"


def measure(a: argparse.Namespace, env: dict[str, str], tmp: Path, name: str, mem: int, path: str,
            rows: list[tuple[int, str, dict[str, object]]]) -> None:
    """One size on one path: the job started, ``--keep`` keep-running snapshots, a stop, the restore."""
    flags = ["--fast-path"] if path == "fast" else []
    if a.gpu:
        job = [str(GPU_WORKLOAD), "--steps", "100000", "--step-sleep", "0.1", "--mem-gib", str(mem / 1024)]
    else:
        job = [str(WORKLOAD), "--steps", "100000", "--step-sleep", "0.1", "--mem-mb", str(mem),
               "--write-frac", str(a.write_frac)]
    cli(env, "run", "--detach", "--name", name, "--nproc-per-node", str(a.nproc), *flags, *job)
    log = tmp / "home" / "jobs" / name / "logs" / "rank-0.log"
    steps = StepClock(log)
    wait_lines(log, 5)
    if path == "fast" and a.gpu and a.prepare_ahead:  # the agent prepared the staging files: a snapshot needs none
        wait_prepared(tmp / "home" / "jobs" / name / "ctl", a.nproc, timeout=300)
        wait_lines(log, log.read_text().count("\n") + 3)
    res_steps = steps.summary(time.monotonic())
    rows.append((mem, f"steps ({path})", res_steps))
    print(f"# {mem} MiB {path} steps before the first snapshot: {res_steps}", file=sys.stderr, flush=True)
    takes = [("keep-running", pc) for pc in a.precopy for _ in range(a.keep)]
    for kind, pc in takes + ([] if a.no_stop else [("stop", a.precopy[0])]):
        t0 = time.monotonic()
        res = cli(env, "snapshot", name, *(["--stop"] if kind == "stop" else []),
                  *(["--no-precopy"] if pc == "off" else []))
        if kind != "stop":  # the job's own view: its longest wait between two steps across the snapshot
            wait_lines(log, log.read_text().count("\n") + 3)
            res["step_gap_s"] = steps.longest_gap(t0, time.monotonic())
        shown = cli(env, "show", str(res["snapshot"]))
        res["criu"] = shown["nodes"][0].get("criu")  # type: ignore[index]
        res["precopy"] = shown["nodes"][0].get("precopy")  # type: ignore[index]
        kind = f"{kind}, pre-copy {'on' if (res['precopy'] or {}).get('parent') else 'off'}"  # type: ignore[attr-defined]
        res["plain"] = {r: why for n in shown["nodes"] for r, why in  # type: ignore[attr-defined]
                        ((n.get("gpu") or {}).get("fast_path") or {}).get("plain", {}).items()}
        rows.append((mem, f"{kind} ({path})", res))
        say(mem, kind, path, res)
        if not kind.startswith("stop"):
            cli(env, "rm", str(res["snapshot"]))  # keep the store small (it may be on tmpfs)
        else:  # the stop snapshot's baseline: the image's bytes written to the same filesystem, and fsynced
            res["disk_write_s"] = disk_write_s(Path(env["CRYOSLEEP_STORE"]), int(res["bytes"]))  # type: ignore[call-overload]
            print(f"# {mem} MiB {path}: {int(res['bytes']) >> 20} MiB written to the store's disk and fsynced in "  # type: ignore[call-overload]
                  f"{res['disk_write_s']} s", file=sys.stderr, flush=True)
        time.sleep(1)
    steps.stop()
    if a.no_restore or a.no_stop:
        return
    time.sleep(2)
    gmap = ["--gpu-map", a.restore_gpu_map] if a.restore_gpu_map else []
    lines = log.read_text().count("\n")
    steps = StepClock(log, skip_existing=True)  # the job's own clock: when its next step line appears
    t0 = time.monotonic()
    restored = cli(env, "restore", "--detach", *gmap, str(rows[-1][2]["snapshot"]))
    first = steps.first_after(t0, timeout=600)
    steps.stop()
    restored["first_step_s"] = round(first - t0, 3)
    restored["bytes"] = rows[-1][2]["bytes"]  # the image restored: the stop snapshot's
    rows.append((mem, f"restore ({path})", restored))
    say(mem, "restore", path, restored)
    wait_lines(log, lines + 3)


class StepClock:
    """When each new step line of a rank's log appeared (polled every 2 ms), until stopped: how regularly the job
    stepped before the first snapshot, and its longest wait across each snapshot."""

    def __init__(self, log: Path, skip_existing: bool = False) -> None:
        self.log, self.times, self.done = log, list[float](), threading.Event()
        # skip_existing: only lines added from now on count (the restored job goes on writing the same log)
        self.start = log.stat().st_size if skip_existing and log.exists() else 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pos, part = self.start, b""  # how far the log was read; the start of a line not yet ended
        while not self.done.is_set():
            with contextlib.suppress(OSError), open(self.log, "rb") as f:  # only what was added since
                f.seek(pos)
                new = f.read()
                pos += len(new)
                *lines, part = (part + new).split(b"\n")
                self.times += [time.monotonic()] * sum(line.startswith(b"step ") for line in lines)
            time.sleep(0.002)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def first_after(self, t0: float, timeout: float) -> float:
        """When the first step line after ``t0`` appeared; exit saying so after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            after = [t for t in self.times if t >= t0]
            if after:
                return after[0]
            time.sleep(0.002)
        raise SystemExit(f"{self.log}: no step line within {timeout:g} s")

    def summary(self, until: float) -> dict[str, object]:
        """The steps logged before ``until``: how many, the median and longest gap between two."""
        times = [t for t in self.times if t < until]
        gaps = sorted(b - a for a, b in itertools.pairwise(times))
        if not gaps:
            return {"steps": len(times)}
        return {"steps": len(times), "median_gap_s": round(gaps[len(gaps) // 2], 3),
                "longest_gap_s": round(gaps[-1], 3), "over_2x_median": sum(g > 2 * gaps[len(gaps) // 2] for g in gaps)}

    def longest_gap(self, t0: float, t1: float) -> float:
        """The longest time between two consecutive steps with the wait overlapping [t0, t1]: what a snapshot
        taken then cost the job, whatever held it (the pause, or the driver stalling its CUDA calls)."""
        return round(max((b - a for a, b in itertools.pairwise(self.times) if b > t0 and a < t1), default=0.0), 3)


def wait_prepared(ctl: Path, nproc: int, timeout: float) -> None:
    """Wait until every rank's staging file is as large as its device memory (the agent prepares them while the
    job runs); exit saying so after ``timeout`` seconds."""
    from cryosleep.core.interceptor import attach_published

    end, seen = time.monotonic() + timeout, ""
    while time.monotonic() < end:
        blocks = attach_published({r: ctl / f"rank-{r}.ctl" for r in range(nproc)})
        try:
            mem = {r: b.devmem for r, b in blocks.items()}
            seen = ", ".join(f"rank {r}: {m.stage_bytes >> 20}/{m.bytes >> 20} MiB" for r, m in mem.items())
            if len(mem) == nproc and all(0 < m.bytes <= m.stage_bytes for m in mem.values()):
                return
        finally:
            for b in blocks.values():
                b.close()
        time.sleep(0.2)
    raise SystemExit(f"the staging files were not prepared within {timeout:g} s ({seen or 'no control blocks'})")


def disk_write_s(store: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` (incompressible) to a file in ``store`` and fsync it: what writing the image's
    bytes to that disk costs at the least, the stop snapshot's baseline."""
    block = os.urandom(8 << 20)
    probe = store / "disk-write-probe"
    t0 = time.monotonic()
    with open(probe, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[:min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())
    took = time.monotonic() - t0
    probe.unlink()
    return round(took, 3)


def criu_words(res: dict[str, object]) -> str:
    """CRIU's own breakdown of the dump (the node's manifest record: capture/criu_stats.py), in seconds."""
    c = dict(res.get("criu") or {})  # type: ignore[call-overload]
    if not c:
        return "-"
    frozen, memdump, memwrite = float(c["frozen_s"]), float(c["memdump_s"]), float(c["memwrite_s"])
    rate = int(c["pages_written"]) * 4096 / memwrite / 1e9 if memwrite else 0.0
    scripts = dict(c.get("scripts_s") or {})
    held = float(c.get("held_s", 0.0))
    outside = held - float(c["freezing_s"]) - frozen  # the job held, not by CRIU's freeze
    return (f"freezing {float(c['freezing_s']):.3f}, frozen {frozen:.2f} = drain {memdump - memwrite:.2f} + "
            f"write {memwrite:.2f} ({rate:.2f} GB/s) + rest {frozen - memdump:.2f} (post-dump hook "
            f"{float(scripts.get('post-dump', 0.0)):.3f}); job held {held:.2f}, of which outside CRIU's freeze "
            f"{outside:.2f} (its stop {float(c.get('stopping_s', 0.0)):.3f}; "
            f"CRIU ran {float(c.get('run_s', 0.0)):.2f})")


def precopy_words(res: dict[str, object]) -> str:
    """The node's pre-copy (its manifest record: capture/precopy.py), or why the dump was plain."""
    pc = dict(res.get("precopy") or {})  # type: ignore[call-overload]
    if not pc.get("parent"):
        return f"off ({pc.get('why') or 'no record'})"
    c = dict(res.get("criu") or {})  # type: ignore[call-overload]
    mib = 4096 / 2**20
    return (f"pre-dump froze {float(pc['freeze_s']):.3f} s (ran {float(pc['run_s']):.2f} s, "
            f"{int(pc['pages_copied']) * mib:.0f} MiB); the dump took {int(pc['pages_parent']) * mib:.0f} MiB from "
            f"it and wrote {int(c.get('pages_written', 0)) * mib:.0f} MiB")


def say(mem: int, kind: str, path: str, res: dict[str, object]) -> None:
    """One line per snapshot as it happens (the table comes at the end)."""
    print(f"# {mem} MiB {path} {kind}: pause {res.get('pause_s')} first step {res.get('first_step_s')} "
          f"phases {res.get('phases')} step gap {res.get('step_gap_s')} CRIU: {criu_words(res)}"
          + (f" plain path: {res['plain']}" if res.get("plain") else "") + f" pre-copy: {precopy_words(res)}",
          file=sys.stderr, flush=True)


def end_job(tmp: Path, name: str) -> None:
    """The job's processes and its agent killed, and the fast path's staging files (as large as the GPU
    memory) removed, so that the next size starts clean."""
    subprocess.run(["pkill", "-9", "-f", "--", f"--name {name}"], check=False)
    job = tmp / "home" / "jobs" / name / "job.json"
    if job.exists():
        pid = json.loads(job.read_text()).get("state", {}).get("init_pid")
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    from cryosleep.core.job import JobDir
    shutil.rmtree(JobDir(name, tmp / "home" / "jobs").devmem, ignore_errors=True)
    time.sleep(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mem-mb", type=int, nargs="+", default=[0, 2048])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--store-parent", default="/tmp", help="where the store goes (a disk, or /dev/shm)")
    p.add_argument("--gpu", action="store_true", help="a CUDA job, its extra state on the GPU")
    p.add_argument("--keep", type=int, default=2, help="keep-running snapshots before the stop snapshot")
    p.add_argument("--restore-gpu-map", default="", help="restore the stop snapshot with this --gpu-map")
    p.add_argument("--no-restore", action="store_true", help="end after the stop snapshot (saves device time)")
    p.add_argument("--no-stop", action="store_true",
                   help="only the keep-running snapshots: no stop snapshot, no restore (a plain-path baseline)")
    p.add_argument("--prepare-ahead", type=float, default=0.0, metavar="S",
                   help="the agent prepares the fast path's staging files every S s while the job runs (experimental; "
                   "the bench waits for it before the first snapshot)")
    p.add_argument("--precopy", nargs="+", choices=["on", "off"], default=["on"],
                   help="keep-running snapshots with the pre-copy (on: where criu-uffd can; the manifest says) and/or "
                   "without it (`snapshot --no-precopy`), --keep of each, on the same job (docs/precopy.md)")
    p.add_argument("--write-frac", type=float, default=1.0,
                   help="the part of its extra state the CPU job rewrites every step (1: all of it, as ddp_basic "
                   "did before; 1/64 = 0.015625: docs/precopy.md's workload)")
    p.add_argument("--paths", nargs="+", choices=["fast", "plain"], default=["fast"],
                   help="capture paths to measure, each in its own run (docs/interceptor.md, 'The fast path')")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cryosleep-bench-"))
    store = Path(tempfile.mkdtemp(prefix="cryosleep-bench-store-", dir=a.store_parent))
    env = dict(os.environ, CRYOSLEEP_HOME=str(tmp / "home"), CRYOSLEEP_STORE=str(store))
    env.pop("CRYOSLEEP_PREPARE_EVERY_S", None)  # the first snapshot prepares the staging files, unless:
    if a.prepare_ahead:
        env["CRYOSLEEP_PREPARE_EVERY_S"] = str(a.prepare_ahead)
    from cryosleep import paths

    env.setdefault("CRYOSLEEP_CRIU_ROOT", str(paths.criu_root()))
    rows: list[tuple[int, str, dict[str, object]]] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` still gets the table printed
    try:
        for mem, path in [(m, x) for m in a.mem_mb for x in a.paths]:
            name = f"bench{mem}{path}-{os.getpid()}"  # its own: other runs of the bench may share the machine
            try:
                measure(a, env, tmp, name, mem, path, rows)
            except SystemExit as e:  # a failed command: its row says why, the next size still runs
                if e.code == 143:
                    raise
                rows.append((mem, f"failed ({path})", {"error": str(e.code)[-600:]}))
                print(f"# {mem} MiB {path}: {str(e.code)[-600:]}", file=sys.stderr, flush=True)
            finally:
                end_job(tmp, name)
    finally:
        print(f"| extra MiB/rank ({'GPU' if a.gpu else 'host'}) | snapshot | pause s | s/GiB of extra | "
              "s/GiB of image | job's step gap s | gap s/GiB of image | phases (s) | CRIU's breakdown of the dump (s) "
              "| image | workers' RSS |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for mem, kind, res in rows:
            phases = ", ".join(f"{k} {v:.2f}" for k, v in dict(res.get("phases") or {}).items())  # type: ignore[call-overload]
            if kind.startswith("steps"):
                print(f"| {mem} | {kind}: the job before the first snapshot | - | - | - | "
                      f"{res.get('longest_gap_s', '-')} | - | {res.get('steps')} steps, median gap "
                      f"{res.get('median_gap_s')} s, {res.get('over_2x_median')} over twice the median | - | - | - |")
                continue
            if kind.startswith("failed"):
                print(f"| {mem} | {kind} | - | - | - | - | {res['error']} | - | - | - | - |".replace("\n", " "))
                continue
            if kind.startswith("restore"):  # s/GiB: of the whole image (every rank's memory and the rest)
                per = f"{float(res['first_step_s']) / (int(res['bytes']) / 2**30):.3f}"  # type: ignore[call-overload]
                streamed = dict(res.get("streamed") or {})  # type: ignore[call-overload]
                if streamed.get("bytes"):
                    phases += f" (pages hashed meanwhile: {int(streamed['bytes']) / 2**20:.0f} MiB in " \
                              f"{float(streamed['seconds']):.2f} s)"
                print(f"| {mem} | {kind}, first step after {res['first_step_s']} s | - | - | {per} | - | - | {phases} "
                      f"| - | {int(res['bytes']) / 2**20:.0f} MiB | - |")  # type: ignore[call-overload]
                continue
            per = f"{float(res['pause_s']) / (mem / 1024):.3f}" if mem else "-"  # type: ignore[arg-type]
            if res.get("plain"):
                kind += " (plain: " + "; ".join(f"rank {r}: {w}" for r, w in res["plain"].items()) + ")"  # type: ignore[attr-defined]
            gap = res.get("step_gap_s", "-")
            gib = int(res["bytes"]) / 2**30  # type: ignore[call-overload]
            gap_per = f"{float(gap) / gib:.3f}" if gap != "-" else "-"  # type: ignore[arg-type]
            if res.get("disk_write_s") is not None:  # the stop snapshot: against writing its bytes to that disk
                phases += f" (the image's bytes written and fsynced to the store's disk: {res['disk_write_s']} s)"
            sizes = f"{int(res['bytes']) / 2**20:.0f} MiB | {int(res['rss_bytes']) / 2**20:.0f} MiB"  # type: ignore[call-overload]
            image_per = f"{float(res['pause_s']) / gib:.3f}"  # type: ignore[arg-type]
            print(f"| {mem} | {kind} | {res['pause_s']:.2f} | {per} | {image_per} | {gap} | {gap_per} | {phases} | "
                  f"{criu_words(res)}; pre-copy: {precopy_words(res)} | {sizes} |")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
