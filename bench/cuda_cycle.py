"""Repeated CUDA checkpoint cycles of one running GPU job, with every thread change logged (docs/gpu-acceptance.md).

    sudo python3 bench/cuda_cycle.py --cycles 30 [--sandbox] [--gap 0.2] [--mem-gib 1] [--steps N]

It starts tests/gpu/workloads/cuda_train.py (plainly, or under `cryosleep run` with --sandbox), then runs
lock, checkpoint, restore, unlock on the worker through capture/cuda.py, ``--cycles`` times, ``--gap``
seconds apart, without CRIU. Before and after every call it lists the worker's threads (TID, name, state);
it prints one JSON line per call that failed or changed the threads, and a summary: calls, failures by
call and error, threads seen to come and go. What it answers: does the driver API alone fail under load,
and which threads move around each call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _cli import cli, wait_lines

from cryosleep.capture import cuda
from cryosleep.errors import CryosleepError

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "tests" / "gpu" / "workloads" / "cuda_train.py"


def kernel_log_tail(n: int = 20) -> list[str]:
    res = subprocess.run(["dmesg"], capture_output=True, text=True, check=False)
    return res.stdout.splitlines()[-n:]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cycles", type=int, default=30)
    p.add_argument("--mem-gib", type=float, default=1.0)
    p.add_argument("--steps", default="10000000", help="the job's --steps (it must outlast the cycles)")
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--gap", type=float, default=0.2, help="seconds of training between cycles")
    p.add_argument("--sandbox", action="store_true", help="run the job under `cryosleep run` (PID + mount ns)")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cryosleep-cycle-"))
    job = [str(WORKLOAD), "--steps", a.steps, "--step-sleep", str(a.step_sleep), "--mem-gib", str(a.mem_gib)]
    proc = None
    init_pid = 0
    env = dict(os.environ, CRYOSLEEP_HOME=str(tmp / "home"), CRYOSLEEP_STORE=str(tmp / "store"))
    if a.sandbox:
        cli(env, "run", "--detach", "--name", "cycle", "--nproc-per-node", "1", *job)
        log = tmp / "home" / "jobs" / "cycle" / "logs" / "rank-0.log"
        wait_lines(log, 5, timeout=300, poll=0.05)
        st = json.loads((tmp / "home" / "jobs" / "cycle" / "job.json").read_text())["state"]
        init_pid = st["init_pid"]
        pid = cuda.cuda_processes(init_pid)[0]
    else:
        log = tmp / "rank-0.log"
        proc = subprocess.Popen([sys.executable, *job], stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_lines(log, 5, timeout=300, poll=0.05)
        pid = proc.pid
    drv = cuda.driver()
    calls: list[tuple[str, Any]] = [("lock", lambda: drv.lock(pid, 10.0)), ("checkpoint", lambda: drv.checkpoint(pid)),
                                    ("restore", lambda: drv.restore(pid)), ("unlock", lambda: drv.unlock(pid))]
    failures: dict[str, int] = {}
    came: dict[str, int] = {}
    went: dict[str, int] = {}
    done = 0
    try:
        for cycle in range(a.cycles):
            for name, call in calls:
                before = cuda.thread_table(pid)
                t0 = time.perf_counter()
                err = None
                try:
                    call()
                except CryosleepError as e:
                    err = f"{e.what}: {e.why}"
                dt = time.perf_counter() - t0
                after = cuda.thread_table(pid)
                time.sleep(0.05)
                later = cuda.thread_table(pid)
                new = {t: v for t, v in {**after, **later}.items() if t not in before}
                gone = {t: v for t, v in before.items() if t not in later}
                for v in new.values():
                    came[f"{name}:{v.split(':')[0]}"] = came.get(f"{name}:{v.split(':')[0]}", 0) + 1
                for v in gone.values():
                    went[f"{name}:{v.split(':')[0]}"] = went.get(f"{name}:{v.split(':')[0]}", 0) + 1
                rec: dict[str, Any] = {"cycle": cycle, "call": name, "s": round(dt, 4), "threads": len(before)}
                if new or gone:
                    rec.update(new=new, gone=gone)
                if err:
                    failures[f"{name}: {err}"] = failures.get(f"{name}: {err}", 0) + 1
                    try:
                        rec["state_after"] = drv.state(pid).name
                    except CryosleepError as e:
                        rec["state_after"] = e.why
                    rec.update(error=err, before=before, after=after, kernel_log=kernel_log_tail())
                if new or gone or err:
                    print(json.dumps(rec), flush=True)
                if err:
                    problems = cuda.GpuSet([pid]).rollback()
                    print(json.dumps({"cycle": cycle, "rollback_problems": problems,
                                      "state": drv.state(pid).name}), flush=True)
                    break
            done += 1
            time.sleep(a.gap)
        lines_before = log.read_text().count("\n")
        time.sleep(1.0)
        still_training = log.read_text().count("\n") > lines_before
    finally:
        if proc is not None:
            proc.kill()
        else:
            subprocess.run(["pkill", "-9", "-f", "--", "--name cycle"], check=False)
            os.kill(init_pid, 9)
    print(json.dumps({"summary": {"cycles": done, "sandbox": a.sandbox, "failures": failures,
                                  "threads_came": came, "threads_went": went, "still_training": still_training}}))


if __name__ == "__main__":
    main()
