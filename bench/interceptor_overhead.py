"""Time per training step with and without the NCCL interceptor (issue 3: within 1%), on a GPU machine.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=src:. python3 bench/interceptor_overhead.py [--steps 300] [--repeats 3]

Runs tests/gpu/workloads/cuda_train.py on 2 ranks (DDP over NCCL, no sleep between steps) under
`cryosleep run` with the interceptor preloaded and with `--no-interceptor`, in pairs (the order alternating
from pair to pair), and prints the median time per step of each, the per-pair ratios (median and middle
80%: what says whether "within 1%" is resolved), and whether the losses were identical. For a 1% question,
use thousands of steps and ten or more pairs (e.g. --steps 3000 --repeats 12).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "tests" / "gpu" / "workloads" / "cuda_train.py"


def run(home: Path, name: str, steps: int, intercept: bool, extra: list[str]) -> tuple[float, list[str]]:
    env = dict(os.environ, CRYOSLEEP_HOME=str(home))
    flags = [] if intercept else ["--no-interceptor"]
    res = subprocess.run([sys.executable, "-m", "cryosleep.cli.main", "run", "--nproc-per-node", "2", "--name", name,
                          *flags, str(WORKLOAD), "--steps", str(steps), "--step-sleep", "0", *extra],
                         capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        raise SystemExit(f"run failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    per_step = [float(ln.split()[-1]) for ln in res.stdout.splitlines() if "time_per_step" in ln]
    # The ranks' lines interleave differently from run to run: compare each rank's own sequence.
    losses = sorted((ln for ln in res.stdout.splitlines() if " loss " in ln), key=lambda ln: ln.split("]")[0])
    return max(per_step), losses


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--async-groups", action="store_true", help="the two-process-group job of issue 3's point 2")
    a = p.parse_args()
    extra = ["--hidden", str(a.hidden), *(["--async-groups"] if a.async_groups else [])]
    home = Path(tempfile.mkdtemp(prefix="cryosleep-overhead-"))
    os.environ.setdefault("CRYOSLEEP_CRIU_ROOT", "/var/lib/cryosleep/criu")
    times: dict[bool, list[float]] = {True: [], False: []}
    losses: dict[bool, list[str]] = {}
    ratios = []
    for i in range(a.repeats):
        order = (True, False) if i % 2 == 0 else (False, True)  # alternate who goes first: drift cancels
        got = {}
        for intercept in order:
            t, ls = run(home, f"oh{i}{int(intercept)}", a.steps, intercept, extra)
            times[intercept].append(t)
            losses[intercept] = ls
            got[intercept] = t
        ratios.append(got[True] / got[False])
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print("| variant | median s/step | runs |")
    print("|---|---|---|")
    print(f"| interceptor preloaded | {on:.6f} | {', '.join(f'{t:.6f}' for t in times[True])} |")
    print(f"| --no-interceptor | {off:.6f} | {', '.join(f'{t:.6f}' for t in times[False])} |")
    ratios.sort()
    lo, hi = ratios[len(ratios) // 10], ratios[-1 - len(ratios) // 10]
    print(f"paired ratio (with/without, per pair): median {statistics.median(ratios):.4f}, "
          f"middle 80% {lo:.4f}..{hi:.4f}, all {', '.join(f'{r:.4f}' for r in ratios)}")
    print(f"ratio of medians {on / off:.4f}; losses identical: {losses[True] == losses[False]} "
          f"({len(losses[True])} lines)")


if __name__ == "__main__":
    main()
