"""2-rank (or N-rank) DDP on CPU with gloo and AdamW; prints each step's loss as exact float hex.

Usage (under torchrun or cryosleep run): ddp_basic.py --steps N [--step-sleep S] [--hidden H] [--mem-mb M]
[--write-frac F] [--own-log DIR] [--linger FILE] [--hold-at N --hold FILE] [--churn] [--helper-timeout-at N].
--mem-mb keeps that much extra state per rank (to measure snapshot cost against memory), of which every step
rewrites the first --write-frac (default 1: all of it; 1/64 is what docs/precopy.md measures); --own-log makes each
rank append its losses to a file it keeps open (a job's own log); --linger: after the last step, wait for FILE
before ending (the job stays up for a test however slow the machine is); --hold-at N --hold FILE: after step N, wait
for FILE (every rank between two steps, no collective under way: a test acts on the job at a known quiet moment);
--churn: every step starts a short-lived child process (it exits 0 some 30 ms later, reaped the next step), as a
DataLoader's workers come and go; --helper-timeout-at N: after step N, rank 0 runs a helper with a timeout it
overruns (subprocess kills it with SIGKILL), then says so ("helper timed out"): a job that kills its own helper on
purpose and goes on.
"""

import argparse
import os
import subprocess
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--mem-mb", type=int, default=0)
    p.add_argument("--write-frac", type=float, default=1.0, help="the part of --mem-mb every step rewrites")
    p.add_argument("--own-log", default="", help="directory: each rank also appends its losses to a file there")
    p.add_argument("--linger", default="", help="after the last step, wait for this file before ending")
    p.add_argument("--hold-at", type=int, default=-1, help="after this step, wait for --hold FILE")
    p.add_argument("--hold", default="", help="the file --hold-at waits for")
    p.add_argument("--churn", action="store_true", help="a short-lived child process each step")
    p.add_argument("--helper-timeout-at", type=int, default=-1, help="after this step, rank 0's helper times out")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, args.hidden), torch.nn.ReLU(), torch.nn.Linear(args.hidden, 1)
    )
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ballast = torch.randn(args.mem_mb * 1024 * 1024 // 4) if args.mem_mb else None
    gen = torch.Generator().manual_seed(100 + rank)
    own = open(os.path.join(args.own_log, f"train-rank{rank}.log"), "a") if args.own_log else None
    child = None
    for step in range(args.steps):
        if args.churn:
            if child is not None:
                child.wait()
            child = subprocess.Popen(["sleep", "0.03"])
        x = torch.randn(32, 16, generator=gen)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ballast is not None:
            ballast[: max(1, int(ballast.numel() * min(1.0, args.write_frac)))].mul_(1.0)
        print(f"step {step} loss {loss.item().hex()}", flush=True)
        if own is not None:
            own.write(f"step {step} loss {loss.item().hex()}\n")
            own.flush()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if step == args.helper_timeout_at and rank == 0:
            try:
                subprocess.run(["sleep", "30"], timeout=0.2)
            except subprocess.TimeoutExpired:
                print("helper timed out", flush=True)
        while step == args.hold_at and not os.path.exists(args.hold):
            time.sleep(0.05)
    while args.linger and not os.path.exists(args.linger):
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    print(f"done rank {rank} pid {os.getpid()}", flush=True)


if __name__ == "__main__":
    main()
