"""A small data-parallel training job: DDP over gloo on CPU, AdamW, dropout, a cosine LR schedule and a
DataLoader with worker processes, a shuffling DistributedSampler and several epochs.

It prints one line per step, ``step N loss HEX``, the loss as an exact float (float.hex), so that two runs
can be compared bit for bit. It knows nothing of Cryosleep.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-sleep", type=float, default=0.05, help="seconds to idle after each step")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--mem-mb", type=int, default=0, help="extra state per rank, in MiB (for benchmarks)")
    p.add_argument("--linger", default=None, metavar="FILE",
                   help="after the last step, wait until FILE exists before ending (so that a snapshot asked near "
                   "the end never meets a job that is exiting)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = torch.randn(512, 32)
    labels = (data[:, :4].sum(dim=1) > 0).long()
    dataset = TensorDataset(data, labels)
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler,
                        num_workers=args.workers, persistent_workers=args.workers > 0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(128, 2))
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    ballast = torch.ones(args.mem_mb * 262144) if args.mem_mb else None

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            sched.step()
            if ballast is not None:
                ballast.add_(1.0)
            if rank == 0:
                lr = float(sched.get_last_lr()[0])
                print(f"step {step} loss {float(loss.item()).hex()} lr {lr.hex()}", flush=True)
            step += 1
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if step >= args.steps:
                break
        epoch += 1
    while args.linger and not os.path.exists(args.linger):
        time.sleep(0.05)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("done", flush=True)


if __name__ == "__main__":
    main()
