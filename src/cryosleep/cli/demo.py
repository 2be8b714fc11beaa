"""`cryosleep demo`: the whole cycle on this machine, checked bit for bit.

It runs a small 2-rank DDP training on CPU (gloo) under Cryosleep, takes a keep-running snapshot, then a
stop snapshot, restores the job and lets it finish; then it runs the same training uninterrupted under
plain torchrun, and shows the two loss curves side by side (and as a plot file). It exits non-zero if
any loss differs in any bit. Every step goes through the real `cryosleep` commands.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cryosleep import paths
from cryosleep.cli.output import human_bytes, table
from cryosleep.core.job import JobDir
from cryosleep.errors import CryosleepError
from cryosleep.store.local import LocalStore

STEP_RE = re.compile(r"^step (\d+) loss (\S+)")
WORKLOAD = Path(__file__).resolve().parent.parent / "workloads" / "demo_train.py"


def add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser("demo", help="snapshot, stop, restore a small DDP job and compare it bit for bit")
    d.add_argument("--steps", type=int, default=80)
    d.add_argument("--out", type=Path, default=Path("cryosleep-demo"), help="where the plot and logs go")
    d.add_argument("--keep", action="store_true", help="keep the demo's snapshots in the store")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_demo)


def losses(text: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in text.splitlines():
        line = line.split("]: ", 1)[-1]
        m = STEP_RE.match(line)
        if m:
            out[int(m.group(1))] = m.group(2)
    return out


def _cli(*args: str) -> dict[str, Any]:
    res = subprocess.run([sys.executable, "-m", "cryosleep.cli.main", args[0], "--json", *args[1:]],
                         capture_output=True, text=True, check=False)
    try:
        data: dict[str, Any] = json.loads(res.stdout)
    except ValueError:
        raise CryosleepError(f"`cryosleep {' '.join(args)}` failed", res.stderr.strip()[-2000:], "") from None
    if res.returncode != 0:
        raise CryosleepError(f"`cryosleep {' '.join(args)}` failed", data.get("what", "") + " " +
                             data.get("why", ""), data.get("hint", ""))
    return data


def _wait_step(job: JobDir, step: int, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        log = job.rank_log(0)
        if log.exists() and max(losses(log.read_text()), default=-1) >= step:
            return
        _, st = job.read()
        if st.state not in ("starting", "running"):
            raise CryosleepError(f"the demo job stopped early ({st.state})", st.detail, f"see {job.logs}")
        time.sleep(0.05)
    raise CryosleepError(f"the demo job did not reach step {step} in {timeout:g} s", "", f"see {job.logs}")


def _wait_end(job: JobDir, timeout: float = 600) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        _, st = job.read()
        if st.state not in ("starting", "running"):
            return st.exit_code if st.exit_code is not None else 1
        time.sleep(0.1)
    raise CryosleepError(f"the demo job did not finish in {timeout:g} s", "", f"see {job.logs}")


def _snapshot_step(store: LocalStore, sid: str) -> int:
    """The last step the job had logged when the snapshot was taken (from the staged rank-0 log)."""
    m = store.load(sid)
    for n in m.nodes:
        for s in n.staged:
            if s.path.endswith("rank-0.log") and s.staged:
                text = (store.path_of(sid) / "nodes" / str(n.node_rank) / "files" / s.staged).read_text()
                return max(losses(text), default=-1)
    return -1


def _plot(out: Path, ref: dict[int, str], got: dict[int, str], marks: list[tuple[int, str]]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = sorted(ref)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, [float.fromhex(ref[s]) for s in steps], lw=3, alpha=0.5, label="uninterrupted (torchrun)")
    gsteps = sorted(got)
    ax.plot(gsteps, [float.fromhex(got[s]) for s in gsteps], lw=1, color="k", label="under Cryosleep")
    for step, label in marks:
        ax.axvline(step + 0.5, ls="--", color="tab:red")
        ax.annotate(label, (step + 0.5, ax.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (rank 0)")
    ax.set_title("Cryosleep demo: keep-running snapshot, stop snapshot, restore")
    ax.legend()
    path = out / "losses.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def cmd_demo(a: argparse.Namespace) -> int:
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    name = f"demo-{secrets.token_hex(3)}"
    job = JobDir(name)
    store = LocalStore(paths.default_store())

    def say(msg: str) -> None:
        if not a.json:
            print(f"[demo] {msg}", flush=True)

    linger = (out / f".{name}.linger").resolve()  # the job waits at its end until the demo is done with it
    linger.unlink(missing_ok=True)
    wargs = [str(WORKLOAD), "--steps", str(a.steps)]

    say(f"1/6 starting job {name}: 2-rank DDP (gloo, AdamW, dropout, cosine LR, DataLoader workers)")
    _cli("run", "--detach", "--name", name, "--nproc-per-node", "2", *wargs, "--linger", str(linger))
    try:
        _wait_step(job, a.steps // 4)
        say("2/6 keep-running snapshot")
        s1 = _cli("snapshot", name)
        say(f"    {s1['snapshot']}: pause {s1['pause_s']:.3f} s, image {human_bytes(s1['bytes'])}; the job goes on")
        _wait_step(job, a.steps // 2)
        say("3/6 stop snapshot")
        s2 = _cli("snapshot", name, "--stop")
        say(f"    {s2['snapshot']}: pause {s2['pause_s']:.3f} s; the job is suspended")
        _wait_end(job)
        say(f"4/6 restoring {s2['snapshot']}")
        _cli("restore", s2["snapshot"], "--detach")
        _wait_step(job, a.steps - 1)
    finally:
        linger.touch()  # the (restored) job may end now; also when the demo failed before
    code = _wait_end(job)
    linger.unlink(missing_ok=True)
    got = losses(job.rank_log(0).read_text())
    (out / "cryosleep-rank0.log").write_text(job.rank_log(0).read_text())
    if code != 0:
        raise CryosleepError(f"the restored demo job failed with exit code {code}", "", f"see {job.logs}")

    say("5/6 the same training uninterrupted, under plain torchrun")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, USE_LIBUV="0", OMP_NUM_THREADS="1")
    ref_run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
         *wargs], capture_output=True, text=True, env=env, check=False)
    (out / "reference.log").write_text(ref_run.stdout + ref_run.stderr)
    if ref_run.returncode != 0:
        raise CryosleepError("the uninterrupted reference run failed", ref_run.stderr[-2000:], "")
    ref = losses(ref_run.stdout)

    marks = [(_snapshot_step(store, s1["snapshot"]), "keep-running snapshot"),
             (_snapshot_step(store, s2["snapshot"]), "stop snapshot + restore")]
    steps = sorted(set(ref) | set(got))
    diff = [s for s in steps if ref.get(s) != got.get(s)]
    rows = []
    for s in steps:
        note = next((lbl for st, lbl in marks if st == s), "")
        r, g = ref.get(s), got.get(s)
        rows.append([s, f"{float.fromhex(r):.10f}" if r else "-", f"{float.fromhex(g):.10f}" if g else "-",
                     "same bits" if r == g else "DIFFERENT", note])
    plot = _plot(out, ref, got, marks)
    if not a.keep:
        for sid in (s1["snapshot"], s2["snapshot"]):
            store.remove(sid)
    result = {"job": name, "steps": len(steps), "identical": not diff, "different_steps": diff,
              "snapshots": [s1, s2], "plot": str(plot) if plot else None, "out": str(out)}
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        say("6/6 losses, step by step (rank 0)")
        print(table(["step", "uninterrupted", "cryosleep", "", "event"], rows))
        if plot:
            say(f"plot: {plot}")
        say("IDENTICAL: every loss matches the uninterrupted run bit for bit" if not diff else
             f"MISMATCH at steps {diff[:10]}")
    return 0 if not diff else 1
